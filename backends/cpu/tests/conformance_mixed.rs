//! The conformance suite on the CPU backend with the ranks of each communicator spread over
//! two pretend hosts (`Links::Hosts(2)`): shared memory inside each, TCP between them, so
//! every case runs the mixed path on one machine. Two-rank all_reduce goes in pieces from
//! 4 KiB on (pieces of 64 KiB, outputs not streamed), so that path runs too, and messages
//! from 4 KiB on go by reference, copied straight into outputs that are not streamed.
fn main() -> std::process::ExitCode {
    // Set before any thread starts: the variables are read at every connect.
    std::env::set_var("ANYCCL_CPU_PAIR_MIN", "4K");
    std::env::set_var("ANYCCL_CPU_PAIR_PIECE", "64K");
    std::env::set_var("ANYCCL_CPU_BY_REF_MIN", "4K");
    anyccl_conformance::run_libtest_as(
        std::sync::Arc::new(anyccl_cpu::CpuLinks(anyccl_cpu::Links::Hosts(2))),
        "cpu-mixed",
    )
}
