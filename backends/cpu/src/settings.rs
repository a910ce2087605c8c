//! Every `ANYCCL_CPU_*` setting in one place: its default, with the measurements behind it,
//! and its reading, at connect (the platform's at start-up). A value that does not parse, or
//! lies outside what the backend can use, is an error naming the variable, the rank and the
//! group, never a silent default.
//!
//! This module sits at the foot of the crate's ladder: it imports nothing of the crate, and
//! the algorithms, the rings, the transport and the communicator take their settings from
//! it.

use anyccl_core::{env_parse_at, Ctx, Result};
use std::time::Duration;

// ---------------------------------------------------------------- reading

/// What a byte setting takes, for its errors.
const BYTES: &str = "a number of bytes (such as 65536, 64K, 16M or 1G)";

/// A byte count from the variable `name` (`default` when unset), read at connect.
fn bytes(name: &str, default: usize, ctx: &Ctx) -> Result<usize> {
    Ok(env_parse_at(ctx, "connect", name, BYTES, anyccl_core::parse_bytes)?.unwrap_or(default))
}

/// A byte count from `name` within `range` (`default` when unset), read at connect.
fn bytes_within(name: &str, default: usize, range: std::ops::RangeInclusive<usize>, ctx: &Ctx) -> Result<usize> {
    let expected = match range.end() {
        &usize::MAX => format!("{BYTES} of at least {}", range.start()),
        end => format!("{BYTES} from {} to {end}", range.start()),
    };
    let parse = |s: &str| anyccl_core::parse_bytes(s).filter(|v| range.contains(v));
    Ok(env_parse_at(ctx, "connect", name, &expected, parse)?.unwrap_or(default))
}

/// A whole number from `name` of at most `max` (`default` when unset), read at connect.
fn whole(name: &str, default: usize, max: usize, ctx: &Ctx) -> Result<usize> {
    let expected = format!("a whole number from 0 to {max}");
    let parse = |s: &str| s.parse::<usize>().ok().filter(|&v| v <= max);
    Ok(env_parse_at(ctx, "connect", name, &expected, parse)?.unwrap_or(default))
}

/// Read every setting a connect reads, before the ranks exchange anything: a malformed one
/// then fails every rank at once, each naming itself, instead of one rank failing while the
/// others wait for it (or meet its half-built links). `links_given`: the program chose the
/// links, so `ANYCCL_CPU_LINKS` is not read. The values are read again, where their defaults
/// are known (from the group's hosts and cache).
///
/// # Errors
/// `InvalidArgument` naming the first malformed variable, the rank and the group.
pub(crate) fn check(ctx: &Ctx, links_given: bool) -> Result<()> {
    if !links_given {
        Links::from_env(ctx)?;
    }
    host(ctx)?;
    max_inbox_bytes(ctx)?;
    max_queued_bytes(ctx)?;
    handoff(ctx)?;
    eager(ctx)?;
    by_ref_min(ctx)?;
    ring_bytes(2, ctx)?;
    ring_stream_min(true, ctx)?;
    Patience::for_host(false, ctx)?;
    Tuning::from_env(ctx, 0, (2, false))?;
    Ok(())
}

// ---------------------------------------------------------------- algorithms

/// The default of `ANYCCL_CPU_ALLREDUCE_DIRECT_MAX`: all_reduce size up to which whole buffers
/// are exchanged (MPICH's short-message threshold; measured here, ring reduce-scatter +
/// all-gather is faster from 2-8 KiB on).
pub(crate) const DIRECT_MAX: usize = 2 << 10;

/// [`DIRECT_MAX`] of a communicator of two ranks: one exchange of the whole buffer against the
/// ring's two steps (2 ranks waited, quiet host: 4 KiB 1.14-1.16 us against 1.33-1.34 by the
/// ring, 8 KiB 1.81-1.94 against 2.02-2.09; with the eager path, 4 KiB 0.92-0.93 against
/// 1.28-1.90 and Open MPI's 1.13-1.24).
pub(crate) const DIRECT_MAX_PAIR: usize = 8 << 10;

/// [`DIRECT_MAX`] of a group among more than two ranks where a host's ranks outnumber their
/// CPUs (every ring step may wait for a peer's turn on a CPU: one exchange waits once).
/// Medians of 3 alternating runs on 2 cores (ring -> direct, Open MPI beside them): 4 ranks,
/// 4/8/16/32/64 KiB 12.6/12.6/15.4/20.3/28.3 -> 5.5/7.2/12.1/21.3/39.7 us (12.2/18.2/22.7/28.1/
/// 42.1); 3 ranks, 4/8/16/32/64 KiB 6.5/7.3/10.4/15.1/23.6 -> 3.6/5.0/8.5/14.6/29.1 us.
pub(crate) const DIRECT_MAX_CROWDED: usize = 16 << 10;

/// The default of `ANYCCL_CPU_ALLTOALL_DIRECT_MAX`: all_to_all segment size up to which a
/// rank sends every segment before it receives any. Measured at 4 ranks on 2 cores: 16 B-4
/// KiB segments take 15-29 us exchanged in posted order against 19-34 us pairwise; pairwise
/// wins once segments stream (tens of KiB).
pub(crate) const ALL_TO_ALL_DIRECT_MAX: usize = 8 << 10;

/// [`ALL_TO_ALL_DIRECT_MAX`] of a group where a host's ranks outnumber their CPUs (each
/// pairwise step may wait for a peer's turn on a CPU). Time medians of 5 alternating runs on
/// 2 cores, pairwise -> direct (Open MPI beside them): 4 ranks, segments of 16 and 32 KiB
/// 17.3 and 24.4 -> 13.1 and 21.7 us (17.0 and 18.4); 3 ranks, 16 and 32 KiB 9.4 and 15.6 ->
/// 8.2 and 13.6 (9.2 and 12.5); segments of 64 KiB lost (3 ranks 20.2 -> 27.5).
pub(crate) const ALL_TO_ALL_DIRECT_MAX_CROWDED: usize = 32 << 10;

/// Ranks up to which a barrier sends an empty message to every other rank and then waits
/// for every other rank's, instead of ceil(log2 n) rounds of one message each (rounds that
/// wait in a row). A world size, not a setting: every rank must take the same way. On 2
/// cores (Open MPI beside it): 3 ranks 2.67 -> 1.45 us (2.35), 8 ranks 8.9-9.6 -> 6.9 (7.1-10.6).
/// Among more ranks, the messages a rank sends grow with the world, the rounds with its log.
pub(crate) const BARRIER_DIRECT_MAX: usize = 8;

/// The default of `ANYCCL_CPU_ALLGATHER_DIRECT_MAX`: the part size (each rank's) up to
/// which an all_gather of more than two ranks sends its part to every rank before it
/// receives any, instead of going round the ring (`size - 1` waits in a row). Time medians of
/// alternating runs on 2 cores (Intel, 2026-12-06), ring -> direct (Open MPI beside them):
/// 4 ranks, 16 B-512 B in all 7.3-8.3 -> 5.7-6.4 us (4.4-4.7), 4/8/32 KiB 8.4/10.7/14.4 ->
/// 7.0/8.0/11.8 us (6.6/11.5/20.8); 3 ranks, 12 B 3.9 -> 3.2 us, 12/24 KiB 6.3/8.5 -> 5.1/7.0
/// us. Parts of 16 and 64 KiB gained too at 4 ranks (64/256 KiB in all 20.9/59.0 ->
/// 16.7/50.2 us), but there, on a host whose ranks have CPUs of their own, a ring step goes by
/// reference and copies once (`BY_REF_EXCHANGE_OWN_CPU`), where a part sent alone is copied
/// into the ring and out again: not measured on such a host, so the default stays below it.
pub(crate) const ALL_GATHER_DIRECT_MAX: usize = 8 << 10;

/// Output size from which outputs are written with streaming stores ([`Tuning::stream_min`]).
/// From 8 MiB the input, the output and the rings no longer stay in the 32 MiB L3 that
/// the machines measured share with their neighbours; 4 MiB sits at the edge, where what
/// the neighbours hold decides. 2 ranks, busbw, medians of alternating rounds: at 8 MiB
/// streaming won on both days measured (all_reduce 3.09 and 3.60 GB/s against 2.54 and
/// 2.23, all_to_all 1.79 and 2.75 against 1.49 and 2.58); at 4 MiB it won on the first
/// (all_reduce 4.11 against 2.71) and lost every operation on the second (all_reduce 4.23
/// against 5.74, all_gather 3.17 against 5.26, reduce_scatter 5.88 against 6.65,
/// broadcast 5.50 against 6.36, all_to_all 5.06 against 5.53), when Open MPI, which keeps
/// 4 MiB in cache, ran 4.7-7.6. At 2 MiB all_to_all lost (3.46 against 6.19). Where the
/// ranks share a larger L3, the whole-buffer step it gives (`cache::L3::step`) when larger.
pub(crate) const STREAM_MIN: usize = 8 << 20;

/// all_reduce size from which two ranks go a piece at a time ([`Tuning::pair_min`]), folding
/// into a scratch that streams to the output (from [`STREAM_MIN`]). Measured
/// on 2 cores, out-of-place busbw, medians of alternating rounds against the ring, both
/// streaming from 16 MiB: 4 and 8 MiB 2.68 and 2.07 GB/s against 2.18 and 1.96, 16-256 MiB
/// 1.96-2.79 against 1.79-1.96; 1-2 MiB, which stay in cache either way, lower (2.02-2.29
/// against 2.34-3.54). Since the ring's steps go by reference, 4 MiB is as fast on the ring
/// (7.8 against 7.4 GB/s with 512 KiB pieces, 5.1-5.6 with 256 KiB ones), so it starts
/// at 8 MiB (the ring there 4.3, pieces 4.1, within the runs' spread). Where the ranks share
/// a larger L3, the whole-buffer step it gives (`cache::L3::step`) when larger.
pub(crate) const PAIR_MIN: usize = 8 << 20;

/// Bytes of a piece of a two-rank all_reduce ([`Tuning::pair_piece`]): its folded half (the
/// scratch, when streaming) stays in a core's L2, and, at 128 KiB, goes through the ring
/// (written with streaming stores) rather than by reference (from 256 KiB): 2 ranks, busbw
/// medians of 3 alternating runs, pieces of 512 -> 256 KiB: 8 MiB 3.8 -> 5.5 GB/s, 16-64
/// MiB 3.5-4.2 -> 4.0-4.8, 128 and 256 MiB 2.4 and 2.3 -> 4.3 and 4.0.
pub(crate) const PAIR_PIECE: usize = 256 << 10;

/// The smallest piece `ANYCCL_CPU_PAIR_PIECE` may set.
const PAIR_PIECE_MIN: usize = 4096;

/// Size thresholds that pick algorithms; `ANYCCL_CPU_*` overrides.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tuning {
    /// all_reduce at or below this many bytes exchanges whole buffers in one round
    /// (latency-bound); above it, ring reduce-scatter + all-gather (bandwidth-bound).
    pub all_reduce_direct_max: usize,
    /// all_to_all whose segments are all at most this many bytes sends every segment, then
    /// receives every segment (one round of waiting); above it, pairwise exchange.
    pub all_to_all_direct_max: usize,
    /// all_gather of more than two ranks whose parts are at most this many bytes sends its
    /// part to every rank, then receives every part (one round of waiting); above it, the
    /// ring.
    pub all_gather_direct_max: usize,
    /// all_reduce outputs from this many bytes on are written with streaming stores
    /// (`shm::copy_streaming`): far larger than the cache, their lines would otherwise be
    /// read from memory before being overwritten.
    pub stream_min: usize,
    /// all_reduce between two ranks from this many bytes on goes a piece at a time (the
    /// algorithms' pairwise all_reduce) instead of by the ring over the whole buffer.
    pub pair_min: usize,
    /// Bytes of each piece of that exchange.
    pub pair_piece: usize,
}

impl Tuning {
    /// The thresholds of a communicator of `size` ranks, `crowded` where a host of the group
    /// has more ranks than CPUs (the same answer on every rank); the stream and pair sizes
    /// default to at least `step` (the group's whole-buffer step, from its hosts' L3:
    /// `cache::L3::step`).
    ///
    /// # Errors
    /// `InvalidArgument` naming the variable, the rank and the group when one is malformed
    /// (or a piece is below 4 KiB).
    pub(crate) fn from_env(ctx: &Ctx, step: usize, (size, crowded): (usize, bool)) -> Result<Self> {
        let direct_max = match (size, crowded) {
            (2, _) => DIRECT_MAX_PAIR,
            (_, true) => DIRECT_MAX_CROWDED,
            _ => DIRECT_MAX,
        };
        Ok(Tuning {
            all_reduce_direct_max: bytes("ANYCCL_CPU_ALLREDUCE_DIRECT_MAX", direct_max, ctx)?,
            all_to_all_direct_max: bytes(
                "ANYCCL_CPU_ALLTOALL_DIRECT_MAX",
                if crowded { ALL_TO_ALL_DIRECT_MAX_CROWDED } else { ALL_TO_ALL_DIRECT_MAX },
                ctx,
            )?,
            all_gather_direct_max: bytes("ANYCCL_CPU_ALLGATHER_DIRECT_MAX", ALL_GATHER_DIRECT_MAX, ctx)?,
            stream_min: bytes("ANYCCL_CPU_STREAM_MIN", STREAM_MIN.max(step), ctx)?,
            pair_min: bytes("ANYCCL_CPU_PAIR_MIN", PAIR_MIN.max(step), ctx)?,
            pair_piece: bytes_within("ANYCCL_CPU_PAIR_PIECE", PAIR_PIECE, PAIR_PIECE_MIN..=usize::MAX, ctx)?,
        })
    }
}

// ---------------------------------------------------------------- the communicator

/// The default of `ANYCCL_CPU_MAX_QUEUED_BYTES` and of `ANYCCL_CPU_MAX_INBOX_BYTES`: what a
/// communicator's queued inputs, and the messages from one peer that it has not consumed,
/// may hold.
pub(crate) const MAX_HELD: usize = 256 << 20;

/// `ANYCCL_CPU_MAX_QUEUED_BYTES`: what the inputs of queued operations may hold.
pub(crate) fn max_queued_bytes(ctx: &Ctx) -> Result<usize> {
    bytes("ANYCCL_CPU_MAX_QUEUED_BYTES", MAX_HELD, ctx)
}

/// `ANYCCL_CPU_MAX_INBOX_BYTES`: what the messages from one peer that this rank has not
/// consumed may hold.
pub(crate) fn max_inbox_bytes(ctx: &Ctx) -> Result<usize> {
    bytes("ANYCCL_CPU_MAX_INBOX_BYTES", MAX_HELD, ctx)
}

/// The default of `ANYCCL_CPU_HANDOFF_US`: how long a queued job is left to a caller that
/// waits for it (it then runs on the caller's thread, with no hand-over between threads)
/// before the worker takes it; also how often a worker that ran something recently looks at
/// the queue without being woken.
pub(crate) const HANDOFF: Duration = Duration::from_micros(500);

/// The longest hand-over `ANYCCL_CPU_HANDOFF_US` may set: a job nobody waits for starts at
/// most this late.
const HANDOFF_MAX_US: usize = 1_000_000;

/// `ANYCCL_CPU_HANDOFF_US`: the hand-over ([`HANDOFF`]), whole microseconds up to a second.
///
/// # Errors
/// `InvalidArgument` naming the variable, the rank and the group when it is not a whole
/// number of microseconds from 0 to 1000000 (`garbage`, `1e30`, `-5` and `nan` are not).
pub(crate) fn handoff(ctx: &Ctx) -> Result<Duration> {
    let default = HANDOFF.as_micros() as usize;
    Ok(Duration::from_micros(whole("ANYCCL_CPU_HANDOFF_US", default, HANDOFF_MAX_US, ctx)? as u64))
}

/// The default of `ANYCCL_CPU_EAGER_US`: how long a small all_reduce between two ranks of
/// one host, issued while nothing else is queued, looks for the peer's input as it is
/// issued (it then completes there, with no job queued, no hand-over and no wait); past it,
/// the receive is queued as usual. A pair calling in step arrives within a microsecond.
pub(crate) const EAGER: Duration = Duration::from_micros(5);

/// The longest look `ANYCCL_CPU_EAGER_US` may set: the issue blocks at most this long.
const EAGER_MAX_US: usize = 1000;

/// `ANYCCL_CPU_EAGER_US` ([`EAGER`]): whole microseconds up to a millisecond; 0 turns the
/// eager path off.
///
/// # Errors
/// `InvalidArgument` naming the variable, the rank and the group when it is not a whole
/// number of microseconds from 0 to 1000.
pub(crate) fn eager(ctx: &Ctx) -> Result<Duration> {
    let default = EAGER.as_micros() as usize;
    Ok(Duration::from_micros(whole("ANYCCL_CPU_EAGER_US", default, EAGER_MAX_US, ctx)? as u64))
}

// ---------------------------------------------------------------- links

/// Which transport links ranks (`ANYCCL_CPU_LINKS`, or [`crate::CpuLinks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Links {
    /// Shared memory between ranks of one host, TCP between hosts (the default).
    #[default]
    Auto,
    /// TCP between every pair.
    Tcp,
    /// As `Auto`, with rank `r` of each communicator pretending to live on host `r % K`: the
    /// mixed shared-memory and TCP path on one machine (`hosts:K`).
    Hosts(usize),
}

impl Links {
    /// Parse `auto`, `tcp` or `hosts:K`.
    pub fn parse(s: &str) -> Option<Links> {
        match s.trim() {
            "auto" | "" => Some(Links::Auto),
            "tcp" => Some(Links::Tcp),
            x => x.strip_prefix("hosts:")?.parse().ok().filter(|&k| k >= 1).map(Links::Hosts),
        }
    }

    /// `ANYCCL_CPU_LINKS` (`Auto` when unset).
    ///
    /// # Errors
    /// `InvalidArgument` naming the variable, the rank and the group when it is malformed.
    pub(crate) fn from_env(ctx: &Ctx) -> Result<Links> {
        let expected = "auto, tcp or hosts:K (K at least 1)";
        Ok(env_parse_at(ctx, "connect", "ANYCCL_CPU_LINKS", expected, Links::parse)?.unwrap_or_default())
    }
}

/// The default of `ANYCCL_CPU_HOST`: the address a rank listens on for its peers.
pub(crate) const HOST: &str = "127.0.0.1";

/// `ANYCCL_CPU_HOST`: the address this rank listens on.
pub(crate) fn host(ctx: &Ctx) -> Result<String> {
    let expected = "a host name or address to listen on";
    Ok(env_parse_at(ctx, "connect", "ANYCCL_CPU_HOST", expected, |s| Some(s.to_string()))?
        .unwrap_or_else(|| HOST.into()))
}

// ---------------------------------------------------------------- shared memory

/// `ANYCCL_CPU_SHM_RING_BYTES`: data bytes of each ring for `locals` ranks on a host (4 MiB up
/// to 8 ranks, then less, so a rank's segment stays near 32 MiB, at least 64 KiB a ring),
/// rounded up to a power of two.
///
/// # Errors
/// `InvalidArgument` naming the variable, the rank and the group when it is malformed or
/// outside 4096 ..= 1 GiB.
pub(crate) fn ring_bytes(locals: usize, ctx: &Ctx) -> Result<usize> {
    let default = (32usize << 20).checked_div(locals.saturating_sub(1)).unwrap_or(4 << 20).clamp(64 << 10, 4 << 20);
    let v = bytes_within("ANYCCL_CPU_SHM_RING_BYTES", default, 4096..=(1 << 30), ctx)?;
    Ok(v.next_power_of_two().min(1 << 30))
}

/// The default of `ANYCCL_CPU_RING_STREAM_MIN`: a writer copies a message of at least this many
/// bytes into the ring with streaming stores (to memory, not into its own cache), from which
/// the reader then reads it. A plain store leaves each line in the writer's cache, where the
/// reader's load must fetch it from: on these 2-core machines that ran at either about 25 or
/// about 4 GB/s from one moment to the next (the two vCPUs' placement on the host), while
/// streaming stores held 9-14. 2 ranks, busbw medians of 4 alternating runs, plain ->
/// streaming: broadcast 64 KiB-2 MiB 6.0-19 -> 18-23 GB/s, 64 MiB 4.7 -> 10.9; all_reduce
/// 64-256 KiB 1.0-1.4 -> 4.4-5.0, 32 and 128 MiB 1.9 and 2.4 -> 2.3 and 2.9. Below it the
/// reader's wait for the bytes (a latency) matters more than the copy's rate. Where one large
/// L3 serves the ranks, none (`cache::L3::ring_streaming`).
pub(crate) const RING_STREAM_MIN: usize = 64 << 10;

/// `ANYCCL_CPU_RING_STREAM_MIN`: the size from which messages go into the rings with
/// streaming stores (`usize::MAX`: none, as `off` says and as is the default where
/// `streaming` is false, the host's ranks sharing one large L3).
pub(crate) fn ring_stream_min(streaming: bool, ctx: &Ctx) -> Result<usize> {
    let expected = format!("off or {BYTES}");
    let parse = |s: &str| if s == "off" { Some(usize::MAX) } else { anyccl_core::parse_bytes(s) };
    let default = if streaming { RING_STREAM_MIN } else { usize::MAX };
    Ok(env_parse_at(ctx, "connect", "ANYCCL_CPU_RING_STREAM_MIN", &expected, parse)?.unwrap_or(default))
}

/// How long a waiter on a peer of its host spins and yields before it sleeps.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Patience {
    /// `ANYCCL_CPU_SPIN_US`.
    pub spin: Duration,
    /// `ANYCCL_CPU_YIELD_US`.
    pub yield_for: Duration,
    /// `ANYCCL_CPU_ROUND`: looks at the condition between clock reads (and, past the spin,
    /// between yields).
    pub round: u32,
}

/// Microseconds of spinning, microseconds of yielding, and looks between clock reads, where
/// each of a host's ranks has a CPU of its own.
///
/// The spin is short because the scheduler may still put two ranks on one CPU for a while:
/// each then spins its whole spin before the other runs. Measured with two ranks on one CPU
/// (`taskset -c 0`, these settings otherwise), all_gather 8 B-4 KiB took 57-74 us a call with a
/// 50 us spin, 9-12 with 5 us, and 6.5-8.5 with 2 us. Rows of 39-40 us at 256 B seen in a
/// 2-rank benchmark run look like the same thing happening unasked. A peer that answers within
/// a few microseconds, as every small operation's does, is still met while spinning. The
/// yields that follow keep looking between calls to `sched_yield`, which return at once on an
/// otherwise idle CPU. With 2 ranks on 2 CPUs, all_reduce 8 B-8 MiB measured the same with a
/// 50, 5 or 2 us spin (0.84-0.88 us at 8 B and 937-1032 us at 8 MiB in all three).
pub(crate) const OWN_CPU: (usize, usize, usize) = (5, 500, 64);

/// [`OWN_CPU`] where a host's ranks outnumber its CPUs: they must not spin, or they would
/// take the CPU from the rank they wait for.
pub(crate) const SHARED_CPUS: (usize, usize, usize) = (1, 200, 4);

/// The longest spin or yield `ANYCCL_CPU_SPIN_US` and `ANYCCL_CPU_YIELD_US` may set (a
/// minute, in microseconds): past it a waiter sleeps.
const WAIT_MAX_US: usize = 60_000_000;

impl Patience {
    /// The waiting of a host whose ranks do or do not outnumber the CPUs they may run on
    /// together (`crowded`: [`SHARED_CPUS`], else [`OWN_CPU`]), with the variables' overrides.
    ///
    /// # Errors
    /// `InvalidArgument` naming the variable, the rank and the group when one is not a whole
    /// number in its range.
    pub(crate) fn for_host(crowded: bool, ctx: &Ctx) -> Result<Patience> {
        let (spin, yield_for, round) = if crowded { SHARED_CPUS } else { OWN_CPU };
        let us = |name: &str, default: usize| {
            whole(name, default, WAIT_MAX_US, ctx).map(|v| Duration::from_micros(v as u64))
        };
        Ok(Patience {
            spin: us("ANYCCL_CPU_SPIN_US", spin)?,
            yield_for: us("ANYCCL_CPU_YIELD_US", yield_for)?,
            round: whole("ANYCCL_CPU_ROUND", round, usize::MAX, ctx)?.clamp(1, 1 << 16) as u32,
        })
    }
}

// ---------------------------------------------------------------- messages by reference

/// The default for point-to-point messages sent alone: such a message goes through the ring
/// a piece at a time, copied in by the sender and out by the receiver at once, faster there
/// than the kernel's single copy between processes (9-12 GB/s on the 2-core machines
/// measured, and it pins every page) up to 16 MiB; a large send alone gained 10-25% from 16
/// MiB up.
pub(crate) const BY_REF_MIN: usize = 16 << 20;

/// The default for a collective's messages sent alone (a broadcast's, a reduce's) on a host
/// whose ranks do not outnumber its CPUs: the receiver copies each once out of the sender's
/// memory instead of both copying through the ring. 2 ranks on 2 cores (Intel, 2026-12-07),
/// broadcast in place, time medians of 3 alternating runs, ring -> by reference from 64 KiB
/// (Open MPI beside them): 64 KiB 3.09 -> 3.36 us (3.21), 128 KiB 5.67 -> 5.58 (5.24), 256 KiB
/// 10.6 -> 9.3 (9.2), 512 KiB 19.2 -> 11.7 (17.3), 1 MiB 38.9 -> 28.1 (47.2), 4/16/32 MiB
/// 298/1187/2288 -> 247/1004/2063 (295/1244/2498). A crowded host: [`BY_REF_ALONE_CROWDED`].
pub(crate) const BY_REF_ALONE_OWN_CPU: usize = 128 << 10;

/// [`BY_REF_ALONE_OWN_CPU`] on a host whose ranks outnumber its CPUs, where a sender waiting
/// for a copy may wait for the receiver's turn on a CPU: only messages large enough that the
/// copy saved outweighs that. Broadcast in place on 2 cores, ring -> by reference, time
/// medians of alternating runs (Open MPI beside them): 4 ranks, 128/256/512 KiB 14.3/28.3/57.2
/// -> 24.0/40.3/47.5 us (20.6/40.0/80.5), 1/2 MiB 142.6/378.6 -> 104.7/292.1 (259.0/521.3), 4-32
/// MiB 816-7498 -> 618-4762 (908-12418); 3 ranks, 512 KiB 57.9 -> 104.0 (40.2), 1/2 MiB
/// 140.0/378.5 -> 111.2/309.7 (116.4/312.5), 8/16/32 MiB 1582/3247/6252 -> 1173/2344/5211.
pub(crate) const BY_REF_ALONE_CROWDED: usize = 1 << 20;

/// The default for a collective's messages sent in an exchange (a ring step): both ranks
/// copy at once, and by reference each copies once instead of twice. 2 ranks, busbw medians
/// of 3 alternating runs, rings -> by reference: all_reduce 1 and 4 MiB (messages of half
/// that) 4.4 and 4.9 -> 7.7 and 9.5 GB/s, all_to_all 1 and 4 MiB 3.2 and 2.0 -> 7.1 and
/// 7.0, all_gather 512 KiB and 4 MiB 1.6 and 6.1 -> 7.9 and 7.1 (1 MiB 8.1 -> 7.8); the
/// rings' runs swing between about 1.5 and 10 GB/s from run to run here, by reference's
/// less. From 16 MiB, where memory bounds both, by reference lost 30% at 4 ranks on 2 cores
/// (all_reduce 32 MiB 2.10 -> 1.45, 256 MiB 1.43 -> 1.01; all_gather 256 MiB 1.89 -> 1.30),
/// so there larger messages go as they would alone; where the host's ranks do not outnumber
/// the CPUs a rank may run on, the range has no end ([`by_ref_defaults`]).
pub(crate) const BY_REF_EXCHANGE: std::ops::Range<usize> = (256 << 10)..BY_REF_MIN;

/// Where the by-reference range of a collective's exchange starts by default on a host whose
/// ranks do not outnumber the CPUs a rank may run on: both ranks run and copy at once there,
/// so by reference each copies once instead of twice from much smaller messages than
/// [`BY_REF_EXCHANGE`]'s start. 2 ranks on 2 cores (Intel, 2026-12-06), out-of-place time
/// medians of 5 alternating runs, from 256 KiB -> from 16 KiB (Open MPI beside them):
/// all_gather 64 / 128 / 256 KiB 7.75 / 14.0 / 28.4 -> 4.46 / 7.05 / 12.1 us (4.74 / 7.11 /
/// 12.1), reduce_scatter 32 KiB-256 KiB 1.4-1.7x, all_to_all 1.7-2.3x, all_reduce 64-256 KiB
/// 5-10%, every other size alike; from 32 KiB lost 32 KiB all_gather, reduce_scatter and
/// all_to_all (messages of 16 KiB) again. With 4 ranks on the 2 cores it lost (all_reduce 64
/// KiB-256 KiB 40-112 -> 73-153 us: a sender waits for a copy by a rank that is not running),
/// so a crowded host keeps [`BY_REF_EXCHANGE`]'s start; all_reduce keeps it everywhere (two
/// ranks' all_reduce from 32 MiB exchanges 128 KiB pieces, and by reference 32-128 MiB took
/// 14-20% longer: `ByRef::exchange_all_reduce`).
pub(crate) const BY_REF_EXCHANGE_OWN_CPU: usize = 16 << 10;

/// The by-reference defaults of a host whose ranks do or do not outnumber the CPUs they may
/// run on together or a CPU quota's (`crowded`: [`crate::cache::crowded`]): a collective's
/// exchange range (all_reduce's apart: it starts at [`BY_REF_EXCHANGE`]'s start everywhere)
/// and a sendrecv's start. Crowded: [`BY_REF_EXCHANGE`] and [`BY_REF_P2P_EXCHANGE`];
/// otherwise from [`BY_REF_EXCHANGE_OWN_CPU`] with no end, and [`BY_REF_P2P_EXCHANGE_OWN_CPU`].
/// Why no end:
/// 2 ranks on 2 cores, 32-256 MiB, busbw medians of 4 alternating runs, rings -> by
/// reference: all_to_all 3.68/2.82/3.08/3.09 -> 5.0/3.5/3.23/3.28 GB/s, all_gather
/// 3.41/2.77/2.80/2.65 -> 4.8/2.96/2.73/2.94, reduce_scatter 2.30/2.37/2.24/2.30 ->
/// 3.29/3.01/2.85/2.71 (an Intel host with a shared 260 MiB L3; on the AMD hosts the two
/// were within 10% of each other at 2 ranks).
pub(crate) fn by_ref_defaults(crowded: bool) -> (std::ops::Range<usize>, usize) {
    if crowded {
        (BY_REF_EXCHANGE, BY_REF_P2P_EXCHANGE)
    } else {
        (BY_REF_EXCHANGE_OWN_CPU..usize::MAX, BY_REF_P2P_EXCHANGE_OWN_CPU)
    }
}

/// The default for a sendrecv's message (sent while one is received): from this size it goes
/// by reference. 2 ranks, busbw medians of 4 alternating runs, rings -> by reference: 64 KiB
/// 5.1 -> 6.5 GB/s, 256 KiB 4.1 -> 8.8, 1 MiB 5.9 -> 8.2, 2 MiB 6.2 -> 21.1, 8 MiB 4.6 ->
/// 7.3. Its send then waits for the receiver's copy, as a large send does in NCCL; a
/// receiver waiting on another rank meanwhile copies it to its inbox once that wait has
/// lasted a millisecond (the transport's `DRAIN_AFTER`), so ranks that exchange in a cycle
/// never wait on each other for good. A send whose operation fails before that copy
/// withdraws the message: the receiver fails rather than deliver a buffer that the sender
/// may have reused.
pub(crate) const BY_REF_P2P_EXCHANGE: usize = 64 << 10;

/// [`BY_REF_P2P_EXCHANGE`] on a host whose ranks do not outnumber the CPUs they may run on
/// together: 2 ranks on 2 cores, time medians of 5 alternating runs, from 64 KiB -> from 16
/// KiB (Open MPI beside them): 16 KiB 5.50 -> 3.57 us (3.65), 32 KiB 8.20 -> 4.75 (4.81),
/// other sizes alike. With 4 ranks on the 2 cores the runs moved by 1.5x either way, so a
/// crowded host keeps 64 KiB. From 8 KiB (2026-12-07, 5 rounds; 8 KiB went as it was issued,
/// through the rings, before): 8 KiB 1.98 -> 1.65 us (1.83), 2-4 KiB and 16-64 KiB alike.
pub(crate) const BY_REF_P2P_EXCHANGE_OWN_CPU: usize = 8 << 10;

/// What `ANYCCL_CPU_BY_REF_MIN` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ByRefMin {
    /// Unset: the defaults above.
    Defaults,
    /// `off`: no message goes by reference.
    Off,
    /// Every message from this size goes by reference, sent alone or not.
    From(usize),
}

/// `ANYCCL_CPU_BY_REF_MIN`.
///
/// # Errors
/// `InvalidArgument` naming the variable, the rank and the group when it is malformed.
pub(crate) fn by_ref_min(ctx: &Ctx) -> Result<ByRefMin> {
    let expected = format!("off or {BYTES}");
    let parse =
        |s: &str| if s == "off" { Some(ByRefMin::Off) } else { anyccl_core::parse_bytes(s).map(ByRefMin::From) };
    Ok(env_parse_at(ctx, "connect", "ANYCCL_CPU_BY_REF_MIN", &expected, parse)?.unwrap_or(ByRefMin::Defaults))
}

// ---------------------------------------------------------------- the platform

/// The default of `ANYCCL_CPU_HUGE_PAGES_MIN`: allocations from this size on are mapped in
/// huge pages (those of an all_gather's inputs of 1 MiB outputs at 2 ranks, and up).
pub(crate) const HUGE_PAGES_MIN: usize = 512 << 10;

/// The platform's allocations from this many bytes on ask for huge pages (`usize::MAX`:
/// none do): `ANYCCL_CPU_HUGE_PAGES_MIN` ([`HUGE_PAGES_MIN`]), unless
/// `ANYCCL_CPU_HUGE_PAGES=0`. Read at start-up (`ctx` has no group yet).
///
/// # Errors
/// `InvalidArgument` naming the variable and the rank when `ANYCCL_CPU_HUGE_PAGES` is
/// neither `0` nor `1` or `ANYCCL_CPU_HUGE_PAGES_MIN` is not a number of bytes.
pub(crate) fn huge_pages_min(ctx: &Ctx) -> Result<usize> {
    let huge =
        env_parse_at(ctx, "platform", "ANYCCL_CPU_HUGE_PAGES", "0 or 1", anyccl_core::parse_flag)?.unwrap_or(true);
    let min = env_parse_at(ctx, "platform", "ANYCCL_CPU_HUGE_PAGES_MIN", BYTES, anyccl_core::parse_bytes)?
        .unwrap_or(HUGE_PAGES_MIN);
    Ok(if huge { min.max(1) } else { usize::MAX })
}

/// The raw value of the variable `name` for the backend's tuning report: `None` when unset,
/// or the error that the connect would give, as text, where it is not UTF-8.
pub(crate) fn shown(name: &str) -> Option<String> {
    match env_parse_at(&Ctx::process("cpu"), "tuning", name, "UTF-8", |s| Some(s.to_string())) {
        Ok(v) => v,
        Err(e) => Some(format!("malformed: {e}")),
    }
}
