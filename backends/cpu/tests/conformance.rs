//! The conformance suite on the CPU backend: every case, every world size.
fn main() -> std::process::ExitCode {
    anyccl_conformance::run_libtest(std::sync::Arc::new(anyccl_cpu::Cpu))
}
