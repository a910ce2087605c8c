//! The conformance suite on the NCCL backend. Without CUDA or NCCL every case is reported
//! ignored with the probe's reason.
fn main() -> std::process::ExitCode {
    anyccl_conformance::run_libtest(std::sync::Arc::new(anyccl_nccl::Nccl))
}
