//! Timing a row: the ranks meet through the store (no collective before the cold call),
//! warm up, then time calls issued back to back.

use crate::args::bad_arg;
use crate::bufs::Bufs;
use crate::op::{issue, Op};
use anyccl::{Communicator, Platform, ReduceOp, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A barrier through the store, so that meeting costs no collective (which would connect
/// transports before the cold call is measured). One for the whole run: its count makes
/// every barrier's key new.
pub(crate) struct StoreBarrier<'a> {
    pub(crate) store: &'a dyn anyccl::Store,
    pub(crate) n: usize,
    pub(crate) me: usize,
    pub(crate) calls: usize,
    pub(crate) timeout: Duration,
}

impl StoreBarrier<'_> {
    pub(crate) async fn wait(&mut self, what: &str) -> Result<()> {
        self.calls += 1;
        let key = format!("bench/barrier/{what}/{}", self.calls);
        anyccl_examples::meet(self.store, &key, self.me, self.n, self.timeout).await
    }

    /// Rank 0's `value`, on every rank.
    pub(crate) async fn agree(&mut self, what: &str, value: u64) -> Result<u64> {
        self.calls += 1;
        let key = format!("bench/agree/{what}/{}", self.calls);
        if self.me == 0 {
            self.store.set(&key, &value.to_le_bytes()).await?;
        }
        let v = self.store.wait(&key, anyccl::raw::deadline_in(self.timeout)).await?;
        let bytes: [u8; 8] = v.as_slice().try_into().map_err(|_| bad_arg("store", format!("bad value under {key}")))?;
        Ok(u64::from_le_bytes(bytes))
    }

    /// Every rank's `value`, on rank 0, of the first `ranks` ranks (`None` on the others).
    pub(crate) async fn gather(&mut self, what: &str, value: &[u8], ranks: usize) -> Result<Option<Vec<Vec<u8>>>> {
        self.calls += 1;
        let key = |r: usize| format!("bench/{what}/{}/{r}", self.calls);
        self.store.set(&key(self.me), value).await?;
        if self.me != 0 {
            return Ok(None);
        }
        let mut all = Vec::with_capacity(ranks);
        for r in 0..self.n.min(ranks) {
            all.push(self.store.wait(&key(r), anyccl::raw::deadline_in(self.timeout)).await?);
        }
        Ok(Some(all))
    }
}

/// `t` on rank 0, as `-a` asks (see [`crate::args::Args::average`]): its own (0, with no
/// exchange), or the average, the least or the most of every rank's, each rank's time
/// through the store (outside the timed calls; the other ranks get their own back); with
/// every rank's time per call on rank 0 (empty for `-a 0`).
pub(crate) async fn over_ranks(sync: &mut StoreBarrier<'_>, t: Timing, average: u8) -> Result<(Timing, Vec<f64>)> {
    if average == 0 || sync.n == 1 {
        return Ok((t, Vec::new()));
    }
    let mine = [t.us.to_le_bytes(), t.issue_us.to_le_bytes()].concat();
    let Some(got) = sync.gather("time", &mine, sync.n).await? else { return Ok((t, Vec::new())) };
    let mut all = Vec::with_capacity(got.len());
    for (r, v) in got.iter().enumerate() {
        let word = |at: usize| v.get(at..at + 8).and_then(|b| b.try_into().ok()).map(f64::from_le_bytes);
        let (Some(us), Some(issue_us)) = (word(0), word(8)) else {
            return Err(bad_arg("store", format!("rank {r}'s time under bench/time is not two numbers")));
        };
        all.push(Timing { us, issue_us });
    }
    let n = all.len() as f64;
    let each = all.iter().map(|t| t.us).collect();
    let shown = match average {
        1 => Timing {
            us: all.iter().map(|t| t.us).sum::<f64>() / n,
            issue_us: all.iter().map(|t| t.issue_us).sum::<f64>() / n,
        },
        // The issue time of the rank whose time is shown.
        2 => all.into_iter().min_by(|a, b| a.us.total_cmp(&b.us)).unwrap_or(t),
        _ => all.into_iter().max_by(|a, b| a.us.total_cmp(&b.us)).unwrap_or(t),
    };
    Ok((shown, each))
}

/// What `-a` shows, for the header.
pub(crate) fn average_said(average: u8) -> &'static str {
    match average {
        0 => "rank 0's (-a 0)",
        1 => "the average over the ranks (-a 1)",
        2 => "the fastest rank's (-a 2)",
        _ => "the slowest rank's (-a 3)",
    }
}

/// The CPUs this process may run on, as the kernel lists them (`0-3,8`); `?` where unknown.
fn own_cpus() -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let line = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"));
    line.map_or_else(|| "?".to_string(), |l| l.trim().to_string())
}

/// Where each rank may run, for rank 0's header (`None` on the others): every rank puts its
/// CPUs in the store, rank 0 reads the first [`CPUS_SHOWN`]. Two ranks that may share a CPU
/// can land on one (each exchange then waits for the other's turn): the line tells such a run
/// from one whose ranks were bound apart.
pub(crate) async fn cpus_line(sync: &mut StoreBarrier<'_>) -> Result<Option<String>> {
    let Some(got) = sync.gather("cpus", own_cpus().as_bytes(), CPUS_SHOWN).await? else { return Ok(None) };
    let mut said: Vec<String> =
        got.iter().enumerate().map(|(r, v)| format!("rank {r} {}", String::from_utf8_lossy(v))).collect();
    if sync.n > CPUS_SHOWN {
        said.push(format!("... ({} ranks)", sync.n));
    }
    Ok(Some(said.join(", ")))
}

/// Ranks whose CPUs the header lists.
const CPUS_SHOWN: usize = 16;

/// Rounds of warm-up calls at most after the first `calls` (each from the pace of the one
/// before: a run whose pace keeps changing still ends).
const WARMUP_ROUNDS: usize = 8;

/// Untimed calls before a timed run: `calls`, then more until `min_time` has passed.
#[derive(Clone, Copy)]
pub(crate) struct Warmup {
    pub(crate) calls: usize,
    pub(crate) min_time: Duration,
}

/// Average time per operation (us) over `iters` calls issued back to back, `depth` at a
/// time on distinct receive buffers, after the `warmup` untimed calls.
///
/// The ranks meet through the store before the warm-up calls, not right before the timer:
/// a store barrier releases ranks tens of microseconds apart, while the last warm-up
/// collective lines them up as closely as the operation itself can (as nccl-tests does).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn timed(
    comm: &Communicator,
    platform: &Arc<dyn Platform>,
    op: Op,
    b: &mut Bufs<'_>,
    rop: ReduceOp,
    root: usize,
    warmup: Warmup,
    iters: usize,
    timeout: Duration,
    in_place: bool,
    sync: &mut StoreBarrier<'_>,
) -> Result<Timing> {
    // `count` calls in chunks of at most one per receive buffer; the time of the calls only,
    // and the part of it the host spent enqueuing them.
    let run = |count: usize, b: &mut Bufs<'_>| -> Result<(Duration, Duration)> {
        let mut total = Duration::ZERO;
        let mut issuing = Duration::ZERO;
        let mut left = count;
        // The clock is read where a timed stretch starts and ends, not around every call (a
        // read costs tens of nanoseconds, a fair share of a small operation): out of place
        // the loop is one stretch, as an MPI benchmark times its blocking loop; in place each
        // refill ends one (a broadcast's or all_gather's only the run's first). At depth 1
        // the issue's share is timed on every 256th call from the first, and scaled: every
        // 16th cost the timed loop 0.01-0.02 us a call (2 ranks on the CPU backend, waited,
        // medians of 7 quiet rounds: all_reduce 8 B 0.25 -> 0.24 us, 1 KiB 0.44 -> 0.43,
        // broadcast 8 B 0.14 -> 0.12), which an MPI benchmark's loop does not pay.
        const SAMPLE: usize = 256;
        let (mut ones, mut sampled) = (0u32, (0u32, Duration::ZERO));
        let mut stretch = Instant::now();
        // In place, the inputs put back before each chunk, or once for the run where the
        // calls leave them as they were (see `Op::in_place_repeatable`): refilling and the
        // barrier after it made each call of a broadcast start from ranks in step, a
        // latency, where MPI's loop (and out of place here) times calls back to back.
        let mut filled = false;
        while left > 0 {
            let k = left.min(b.recvs.len());
            if in_place && !(filled && op.in_place_repeatable()) {
                filled = true;
                total += stretch.elapsed();
                for r in b.recvs.iter_mut().take(k) {
                    platform.copy_from_host(&mut **r, &b.in_place_input)?;
                }
                // Refilling the inputs is not part of the operation, and the copies take
                // different times on different ranks: line the ranks up again.
                comm.barrier()?.wait(timeout)?;
                stretch = Instant::now();
            }
            let send = (!in_place).then_some(&*b.send);
            if k == 1 {
                // One call at a time (depth 1): no list to allocate.
                let sample = (count - left).is_multiple_of(SAMPLE).then(Instant::now);
                let mut w = issue(comm, op, send, &mut *b.recvs[0], rop, root)?;
                ones += 1;
                if let Some(s) = sample {
                    sampled.0 += 1;
                    sampled.1 += s.elapsed();
                }
                w.wait(timeout)?;
            } else {
                let start = Instant::now();
                let mut works = Vec::with_capacity(k);
                for r in b.recvs.iter_mut().take(k) {
                    works.push(issue(comm, op, send, &mut **r, rop, root)?);
                }
                issuing += start.elapsed();
                for mut w in works {
                    w.wait(timeout)?;
                }
            }
            left -= k;
        }
        total += stretch.elapsed();
        if sampled.0 > 0 {
            // The sampled calls' mean issue time, for every call of the chunks of one.
            issuing += sampled.1 / sampled.0 * ones;
        }
        Ok((total, issuing))
    };
    sync.wait(if in_place { "in-place" } else { "timed" }).await?;
    // At least one untimed call, so the timed ones start from ranks in step.
    let first = warmup.calls.max(1);
    let (mut took, _) = run(first, b)?;
    if !warmup.min_time.is_zero() {
        // Every rank must issue the same calls: rank 0 says how many, in rounds, until the
        // time has passed on its clock, each round's count from the pace of the one before.
        // One count from the first calls' pace fell short: those calls include the ranks'
        // start apart, so 2 ranks' 8 B all_reduce on the CPU backend warmed up for well under
        // a millisecond instead of 100, and the first row ran at 0.65-0.99 us a call where
        // the next ran at 0.24 (0.24-0.28 after 300,000 warm-up calls).
        let (mut spent, mut calls) = (took, first);
        for _ in 0..WARMUP_ROUNDS {
            let left = warmup.min_time.saturating_sub(spent);
            let per_call = took.as_secs_f64() / calls as f64;
            let want = match left.is_zero() {
                true => 0,
                false => (left.as_secs_f64() / per_call.max(1e-7)).ceil().min(1e6) as u64,
            };
            calls = sync.agree("warmup", want).await? as usize;
            if calls == 0 {
                break;
            }
            (took, _) = run(calls, b)?;
            spent += took;
        }
    }
    let (total, issuing) = run(iters, b)?;
    // Every rank out of the run before any goes on to its next work (checking its output):
    // a rank still in the run's last call (a root waiting for a copy by reference, which a
    // rank passes on down a tree) would otherwise share the CPUs with ranks that are done.
    // 4 ranks on 2 cores, broadcast 1 MiB, 5 calls: the root's last took 1-2 ms, the others
    // 95-240 us.
    comm.barrier()?.wait(timeout)?;
    let per_call = |d: Duration| d.as_secs_f64() * 1e6 / iters.max(1) as f64;
    Ok(Timing { us: per_call(total), issue_us: per_call(issuing) })
}

/// Average microseconds per call: in all, and on the host enqueuing it (when that is close
/// to the whole, the host, not the device or the link, sets the pace).
#[derive(Clone, Copy)]
pub(crate) struct Timing {
    pub(crate) us: f64,
    pub(crate) issue_us: f64,
}
