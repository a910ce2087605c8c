//! The conformance suite on the NCCL backend, with its engine streams (`engine`). Without
//! CUDA or NCCL every case is reported ignored with the probe's reason.
mod engine;

fn main() -> std::process::ExitCode {
    anyccl_conformance::cases::streams::set_engine(engine::open);
    anyccl_conformance::run_libtest(std::sync::Arc::new(anyccl_nccl::Nccl))
}
