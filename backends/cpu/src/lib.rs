//! anyccl-cpu: a Gloo-like CPU backend: ranks are processes (or threads, in tests) joined
//! by shared memory on one host and TCP between hosts, running every anyccl operation on
//! every dtype.
//!
//! # Design choices
//! - **Eager transport.** Each TCP connection has a reader thread that drains messages into
//!   per-peer queues, so sends never wait for receives and no send order can deadlock.
//! - **Shared memory on one host** (`shm`): a ring per pair of ranks in an anonymous segment
//!   (nothing to leak); a sender whose ring is full moves what it was sent to the queues
//!   meanwhile, so the eager rule holds there too for a message that fits in the ring (one
//!   sent by reference, below, waits for its receiver's copy), and the ring algorithms'
//!   steps stream both directions at once with nothing buffered. The TCP connection to each such peer
//!   stays: it carries failure notices and closes when the peer's process dies.
//! - **Large messages by reference.** On one host a collective's message from 256 KiB sent
//!   while one is received (a ring step; below 16 MiB where the host's ranks outnumber the
//!   CPUs a rank may run on), a sendrecv's message from 64 KiB, and
//!   any other point-to-point message of 16 MiB or more, is copied once, by the receiver,
//!   out of the sender's memory (`process_vm_readv`), and the sender waits for that copy
//!   (a rank waiting on another peer for a millisecond makes that copy to its inbox, as it
//!   drains a ring whose point-to-point writer waits for room, so no cycle of sends and
//!   receives waits for good; a send that fails first withdraws its message, and the
//!   receiver then fails rather than deliver what it read); where a security module
//!   forbids it, the receiver says so at connect and the ring carries it. Other messages
//!   stream through the rings (faster where measured; `ANYCCL_CPU_BY_REF_MIN` sets one size
//!   from which every message goes by reference), written from 64 KiB with streaming
//!   stores, which held their rate where plain stores swung between about 4 and 25 GB/s.
//! - **Thresholds from the host's cache** (`cache`): where one large L3 serves all the ranks
//!   of a host (each names the same one at connect), whole buffers stay in it to an eighth of
//!   its size and the rings take plain stores.
//! - **No slow string moves.** Copies whose destination sits 1-63 bytes past the source
//!   modulo a page, which the string-move instruction runs 15-20x slower on several AMD
//!   cores (in the C library's `memcpy` and in the kernel's copies between processes), go
//!   through a vector loop (and a bounce buffer for the kernel's).
//! - **The caller's thread runs its operation.** A `wait` at least as long as the operation
//!   timeout runs the queued operations up to its own on the calling thread (no hand-over
//!   between threads, which cost tens of microseconds); the worker thread takes an operation
//!   nobody waits for after half a millisecond.
//! - **Ordered execution.** A communicator's operations run in issue order on one worker
//!   thread, as NCCL runs them in stream order; collectives carry an op code and sequence
//!   number, so mismatched collectives across ranks are reported, not mixed.
//! - **No copy in or out for a caller that waits.** A job run in its own caller's wait
//!   reads and writes the caller's buffers. The worker never dereferences them: small
//!   inputs are copied at enqueue, large ones (64 KiB up), and those of a collective issued
//!   while nothing else is queued, are lent and read through the kernel (a leaked `Work`
//!   then yields an error or stale bytes, never a stray access), and
//!   results are copied in when the caller observes completion. Dropping an unfinished
//!   `Work` with lent inputs waits for its job.
//! - **Deterministic results.** all_reduce gives bit-identical results on every rank:
//!   small buffers are folded in rank order on each rank, large ones reduced once per chunk
//!   on a ring and then shared.
//! - **Failure spreads.** A failed operation or a closed connection kills the
//!   communicator and shuts its sockets, so every other rank's wait ends with an error.
//!
//! # Layout
//! The modules form a ladder, each importing only from those below it: `reduce` (the
//! arithmetic) and `settings` (every `ANYCCL_CPU_*` variable, its default and its reading) at
//! the foot, then `cache` (the host's L3), `shm` (shared memory, copies and waiting), `bufs`
//! (buffers kept for reuse), `platform`, `transport` (the links between ranks), `algo` (the
//! collective algorithms over them) and `comm` (the communicator) at the top.
//!
// `unsafe` only in the shared-memory module (mappings, futexes, the rings' bytes, copies).
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod algo;
mod bufs;
mod cache;
mod comm;
mod platform;
mod reduce;
mod settings;
mod shm;
mod transport;

pub use comm::{cpu_capabilities, CpuComm};
pub use platform::CpuPlatform;
pub use settings::Links;

use anyccl_core::{async_trait, Backend, BackendInfo, Capabilities, Collective, ConnectOptions, Platform, Result};
use std::sync::Arc;

/// The CPU backend: shared memory between ranks of one host, TCP between hosts
/// (`ANYCCL_CPU_LINKS` chooses otherwise; see [`Links`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct Cpu;

/// The CPU backend with its links chosen here rather than by `ANYCCL_CPU_LINKS` (tests and
/// benchmarks: `CpuLinks(Links::Hosts(2))` runs the mixed shared-memory and TCP path on one
/// machine).
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuLinks(pub Links);

async fn connect(opts: ConnectOptions, links: Option<Links>) -> Result<Arc<dyn Collective>> {
    let deadline = anyccl_core::deadline_in(opts.timeout);
    let c: Arc<dyn Collective> =
        CpuComm::connect(opts.store, &opts.namespace, opts.rank, opts.size, deadline, opts.op_timeout, links).await?;
    Ok(c)
}

/// What [`Backend::tuning`] reports: each setting as a communicator connected now gets it
/// (a malformed variable shows as such; the connect names it in its error).
fn tuning(links: Option<Links>) -> Vec<(String, String)> {
    use settings as s;
    let env = |name: &str, default: String| s::shown(name).unwrap_or(default);
    // What the host's cache makes of the defaults (a group takes the smallest host's step, and
    // none from a host whose ranks run under different L3s).
    let l3 = cache::L3::this_host();
    let step = cache::L3::step(l3);
    let from_l3 = |v: String| match l3 {
        Some(l) => format!("{v} (this host: {l})"),
        None => format!("{v} (this host's L3 unknown)"),
    };
    let waiting = |own: usize, shared: usize| {
        format!("{own} ({shared} on a host whose ranks outnumber the CPUs they may run on together)")
    };
    let links = match links {
        Some(l) => format!("{l:?} (set by the program)"),
        None => env("ANYCCL_CPU_LINKS", "auto".into()),
    };
    vec![
        ("ANYCCL_CPU_LINKS".into(), links),
        ("ANYCCL_CPU_HUGE_PAGES".into(), env("ANYCCL_CPU_HUGE_PAGES", "1".into())),
        ("ANYCCL_CPU_HUGE_PAGES_MIN".into(), env("ANYCCL_CPU_HUGE_PAGES_MIN", s::HUGE_PAGES_MIN.to_string())),
        (
            "ANYCCL_CPU_ALLREDUCE_DIRECT_MAX".into(),
            env(
                "ANYCCL_CPU_ALLREDUCE_DIRECT_MAX",
                format!(
                    "{} ({} on two ranks, {} among more where a host's ranks outnumber the CPUs they may run on \
                     together)",
                    s::DIRECT_MAX,
                    s::DIRECT_MAX_PAIR,
                    s::DIRECT_MAX_CROWDED
                ),
            ),
        ),
        (
            "ANYCCL_CPU_ALLTOALL_DIRECT_MAX".into(),
            env(
                "ANYCCL_CPU_ALLTOALL_DIRECT_MAX",
                format!(
                    "{} ({} where a host's ranks outnumber the CPUs they may run on together)",
                    s::ALL_TO_ALL_DIRECT_MAX,
                    s::ALL_TO_ALL_DIRECT_MAX_CROWDED
                ),
            ),
        ),
        (
            "ANYCCL_CPU_ALLGATHER_DIRECT_MAX".into(),
            env("ANYCCL_CPU_ALLGATHER_DIRECT_MAX", s::ALL_GATHER_DIRECT_MAX.to_string()),
        ),
        ("ANYCCL_CPU_STREAM_MIN".into(), env("ANYCCL_CPU_STREAM_MIN", from_l3(s::STREAM_MIN.max(step).to_string()))),
        ("ANYCCL_CPU_PAIR_MIN".into(), env("ANYCCL_CPU_PAIR_MIN", from_l3(s::PAIR_MIN.max(step).to_string()))),
        ("ANYCCL_CPU_PAIR_PIECE".into(), env("ANYCCL_CPU_PAIR_PIECE", s::PAIR_PIECE.to_string())),
        (
            "ANYCCL_CPU_BY_REF_MIN".into(),
            env(
                "ANYCCL_CPU_BY_REF_MIN",
                format!(
                    "{} (point-to-point; a sendrecv's: {} ({} on a host whose ranks outnumber the CPUs they may run on \
                     together); a collective's in a ring step: from {} (all_reduce's from {}), from {} and below {} on \
                     such a host (all_to_all's from a sendrecv's size, with no end); a collective's sent alone: from {} \
                     ({} on such a host))",
                    s::BY_REF_MIN,
                    s::BY_REF_P2P_EXCHANGE_OWN_CPU,
                    s::BY_REF_P2P_EXCHANGE,
                    s::BY_REF_EXCHANGE_OWN_CPU,
                    s::BY_REF_EXCHANGE.start,
                    s::BY_REF_EXCHANGE.start,
                    s::BY_REF_EXCHANGE.end,
                    s::BY_REF_ALONE_OWN_CPU,
                    s::BY_REF_ALONE_CROWDED
                ),
            ),
        ),
        (
            "ANYCCL_CPU_SHM_RING_BYTES".into(),
            env("ANYCCL_CPU_SHM_RING_BYTES", "4 MiB up to 8 ranks a host, then 32 MiB / (ranks - 1)".into()),
        ),
        (
            "ANYCCL_CPU_RING_STREAM_MIN".into(),
            env(
                "ANYCCL_CPU_RING_STREAM_MIN",
                if cache::L3::ring_streaming(l3) {
                    format!("{} (messages written to a ring with streaming stores; off: none)", s::RING_STREAM_MIN)
                } else {
                    from_l3("off (messages written to the rings with plain stores)".into())
                },
            ),
        ),
        ("ANYCCL_CPU_HANDOFF_US".into(), env("ANYCCL_CPU_HANDOFF_US", s::HANDOFF.as_micros().to_string())),
        ("ANYCCL_CPU_EAGER_US".into(), env("ANYCCL_CPU_EAGER_US", s::EAGER.as_micros().to_string())),
        ("ANYCCL_CPU_MAX_QUEUED_BYTES".into(), env("ANYCCL_CPU_MAX_QUEUED_BYTES", s::MAX_HELD.to_string())),
        ("ANYCCL_CPU_MAX_INBOX_BYTES".into(), env("ANYCCL_CPU_MAX_INBOX_BYTES", s::MAX_HELD.to_string())),
        ("ANYCCL_CPU_HOST".into(), env("ANYCCL_CPU_HOST", s::HOST.into())),
        ("ANYCCL_CPU_SPIN_US".into(), env("ANYCCL_CPU_SPIN_US", waiting(s::OWN_CPU.0, s::SHARED_CPUS.0))),
        ("ANYCCL_CPU_YIELD_US".into(), env("ANYCCL_CPU_YIELD_US", waiting(s::OWN_CPU.1, s::SHARED_CPUS.1))),
        ("ANYCCL_CPU_ROUND".into(), env("ANYCCL_CPU_ROUND", waiting(s::OWN_CPU.2, s::SHARED_CPUS.2))),
    ]
}

macro_rules! cpu_backend {
    ($t:ty, $links:expr) => {
        #[async_trait]
        impl Backend for $t {
            fn name(&self) -> &'static str {
                "cpu"
            }
            fn probe(&self) -> Result<BackendInfo> {
                Ok(BackendInfo { name: "cpu", version: env!("CARGO_PKG_VERSION").into(), devices: 1 })
            }
            fn capabilities(&self) -> Result<Capabilities> {
                Ok(cpu_capabilities())
            }
            fn platform(&self, _local_rank: usize) -> Result<Arc<dyn Platform>> {
                Ok(Arc::new(CpuPlatform::from_env(anyccl_core::env_rank())?))
            }
            fn tuning(&self) -> Vec<(String, String)> {
                #[allow(clippy::redundant_closure_call)]
                tuning(($links)(self))
            }
            async fn connect(&self, opts: ConnectOptions) -> Result<Arc<dyn Collective>> {
                #[allow(clippy::redundant_closure_call)]
                connect(opts, ($links)(self)).await
            }
        }
    };
}

cpu_backend!(Cpu, |_: &Cpu| None);
cpu_backend!(CpuLinks, |c: &CpuLinks| Some(c.0));
