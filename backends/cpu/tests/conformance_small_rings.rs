//! The conformance suite on the CPU backend with 4 KiB shared-memory rings, messages from
//! 4 KiB on sent by reference, outputs from 1 KiB on written with streaming stores and
//! two-rank all_reduce from 1 KiB on in pieces of 4 KiB: every message larger than a ring,
//! so the paths a large job takes only now and then (a full ring, a drain that stops
//! mid-message, copies out of the sender's memory, streamed outputs at every alignment,
//! pieces that end anywhere) run in every case; and a small all_reduce of two ranks is
//! never run as it is issued (see `comm/eager.rs`), so its queued path runs in every case.
fn main() -> std::process::ExitCode {
    // Set before any thread starts: the variables are read at every connect.
    std::env::set_var("ANYCCL_CPU_SHM_RING_BYTES", "4096");
    std::env::set_var("ANYCCL_CPU_BY_REF_MIN", "4096");
    std::env::set_var("ANYCCL_CPU_STREAM_MIN", "1K");
    std::env::set_var("ANYCCL_CPU_PAIR_MIN", "1K");
    std::env::set_var("ANYCCL_CPU_PAIR_PIECE", "4K");
    // And the queued path of small all_reduce between two ranks, which in step usually
    // finishes as it is issued (the other programs run that way).
    std::env::set_var("ANYCCL_CPU_EAGER_US", "0");
    anyccl_conformance::run_libtest_as(std::sync::Arc::new(anyccl_cpu::Cpu), "cpu-small-rings")
}
