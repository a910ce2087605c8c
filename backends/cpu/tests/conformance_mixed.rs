//! The conformance suite on the CPU backend with the ranks of each communicator spread over
//! two pretend hosts (`Links::Hosts(2)`): shared memory inside each, TCP between them, so
//! every case runs the mixed path on one machine.
fn main() -> std::process::ExitCode {
    anyccl_conformance::run_libtest_as(
        std::sync::Arc::new(anyccl_cpu::CpuLinks(anyccl_cpu::Links::Hosts(2))),
        "cpu-mixed",
    )
}
