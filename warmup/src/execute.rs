//! Running an agreed plan: each group's steps in order, each wait cut into slices that
//! watch for another rank's failure and the deadline, with time and device memory per step.

use crate::outcome::{failure_on_record, publish_failure, warmup_timeout};
use crate::plan::{GroupPlan, Kind, Step};
use crate::report::{MemSource, Report, StepReport};
use crate::session::Session;
use anyccl_core::{Communicator, Error, P2POp, ReduceOp, Result, Work};
use std::time::{Duration, Instant};

/// Wait for `w` in short slices, giving up when another rank reports failure or the
/// deadline passes. Giving up aborts `comm` before the unfinished operation is dropped: its
/// kernels may wait forever on the failed peer, and the warmup fails as a whole anyway.
async fn settle(
    s: &Session<'_>,
    comm: &Communicator,
    w: Work<'_>,
    what: &str,
    group: &str,
    rank: usize,
    deadline: Instant,
) -> Result<()> {
    let mut w = w;
    let r = wait_slices(s, &mut w, what, group, rank, deadline).await;
    if let Err(e) = &r {
        if !matches!(w.is_completed(), Ok(true)) {
            // The failure is on record before the abort closes this rank's connections, so a
            // peer that sees them close reads why (a timeout here stays a timeout there).
            publish_failure(s, e).await;
            let _ = comm.abort().await;
        }
    }
    drop(w);
    r
}

async fn wait_slices(
    s: &Session<'_>,
    w: &mut Work<'_>,
    what: &str,
    group: &str,
    rank: usize,
    deadline: Instant,
) -> Result<()> {
    // Short slices first (most steps finish in microseconds once connected), longer ones
    // while a first connect takes seconds, so the store is not asked 50 times a second.
    let mut slice = Duration::from_millis(20);
    loop {
        let wait = slice.min(deadline.saturating_duration_since(Instant::now())).max(Duration::from_millis(1));
        // Any other error, also one after the deadline, goes to `execute`, which reports an
        // error past the deadline as the Timeout it is.
        match w.wait_async(wait).await {
            Ok(()) => return Ok(()),
            Err(Error::Timeout { .. }) => {}
            // A peer that gave up (its deadline came first, or it failed) published why before
            // its abort closed the connections this wait saw fail: report that cause.
            Err(e) => return Err(failure_on_record(s, what, group, rank).await.ok().flatten().unwrap_or(e)),
        }
        slice = (slice * 2).min(Duration::from_millis(250));
        if Instant::now() >= deadline {
            return Err(warmup_timeout(what, rank, group, "the warmup deadline passed; communicators aborted".into()));
        }
        if let Some(e) = failure_on_record(s, what, group, rank).await? {
            return Err(e);
        }
    }
}

fn op_name(k: Kind) -> &'static str {
    match k {
        Kind::AllReduce => "all_reduce",
        Kind::ReduceScatter => "reduce_scatter",
        Kind::AllGather => "all_gather",
        Kind::Broadcast => "broadcast",
        Kind::AllToAll => "all_to_all",
        Kind::SendRecv => "send/recv",
        Kind::SendRecvBatched => "send/recv batched",
    }
}

pub(crate) async fn execute(
    s: &Session<'_>,
    plans: &[(&Communicator, GroupPlan)],
    report: &mut Report,
    deadline: Instant,
) -> Result<()> {
    for (comm, plan) in plans {
        for step in &plan.steps {
            let held_before = comm.memory_held();
            let before = s.platform.mem_info()?.free as i64;
            let t = Instant::now();
            match run_step(s, comm, plan, step, deadline).await {
                Ok(()) => {}
                // Past the deadline an error is the deadline's doing (a wait cut short, or a
                // call blocked inside the backend that the watchdog's abort ended), not a
                // failure of its own.
                Err(e) if Instant::now() >= deadline && !matches!(e, Error::Timeout { .. }) => {
                    let detail = format!("the warmup deadline passed; communicators aborted ({e})");
                    return Err(warmup_timeout(op_name(step.kind), comm.rank(), &plan.group, detail));
                }
                Err(e) => return Err(e),
            }
            let time_us = t.elapsed().as_secs_f64() * 1e6;
            let after = s.platform.mem_info()?.free as i64;
            // The communicator's own count when it keeps one: free memory also moves with
            // whatever else the process (or another on the device) allocates meanwhile.
            let (mem_delta, mem_source) = match (held_before, comm.memory_held()) {
                (Some(b), Some(a)) => (a as i64 - b as i64, MemSource::Communicator),
                _ => (before - after, MemSource::FreeMemory),
            };
            report.steps.push(StepReport {
                group: plan.group.clone(),
                role: plan.role.to_string(),
                op: op_name(step.kind).into(),
                bytes: step.count * step.dtype.size(),
                time_us,
                mem_delta,
                mem_source,
            });
        }
    }
    Ok(())
}

async fn run_step(
    s: &Session<'_>,
    comm: &Communicator,
    plan: &GroupPlan,
    step: &Step,
    deadline: Instant,
) -> Result<()> {
    let (n, me, p) = (comm.size(), comm.rank(), s.platform);
    let (g, c, d) = (plan.group.as_str(), step.count, step.dtype);
    let what = op_name(step.kind);
    match step.kind {
        Kind::AllReduce => {
            let mut b = p.alloc(d, c)?;
            settle(s, comm, comm.all_reduce(None, b.view_mut(), ReduceOp::Sum)?, what, g, me, deadline).await?;
        }
        Kind::Broadcast => {
            let mut b = p.alloc(d, c)?;
            settle(s, comm, comm.broadcast(None, b.view_mut(), 0)?, what, g, me, deadline).await?;
        }
        Kind::ReduceScatter => {
            let src = p.alloc(d, c * n)?;
            let mut dst = p.alloc(d, c)?;
            settle(
                s,
                comm,
                comm.reduce_scatter(Some(src.view()), dst.view_mut(), ReduceOp::Sum)?,
                what,
                g,
                me,
                deadline,
            )
            .await?;
        }
        Kind::AllGather => {
            let src = p.alloc(d, c)?;
            let mut dst = p.alloc(d, c * n)?;
            settle(s, comm, comm.all_gather(Some(src.view()), dst.view_mut())?, what, g, me, deadline).await?;
        }
        Kind::AllToAll => {
            let src = p.alloc(d, c)?;
            let mut dst = p.alloc(d, c)?;
            settle(s, comm, comm.all_to_all(src.view(), dst.view_mut(), None)?, what, g, me, deadline).await?;
        }
        Kind::SendRecv | Kind::SendRecvBatched => {
            let src = p.alloc(d, c)?;
            let mut dst = p.alloc(d, c)?;
            // Pairs run in the plan's (sorted) order on every member: a global order on
            // pairs, so no cycle of waits can form. In a pair the lower rank sends first.
            for &(a, b) in step.pairs.iter().filter(|(a, b)| *a == me || *b == me) {
                let other = if a == me { b } else { a };
                if step.kind == Kind::SendRecvBatched {
                    let ops = vec![P2POp::Send(src.view(), other), P2POp::Recv(dst.view_mut(), other)];
                    settle(s, comm, comm.p2p_group(ops)?, what, g, me, deadline).await?;
                } else if me == a {
                    settle(s, comm, comm.send(src.view(), other)?, what, g, me, deadline).await?;
                    settle(s, comm, comm.recv(dst.view_mut(), other)?, what, g, me, deadline).await?;
                } else {
                    settle(s, comm, comm.recv(dst.view_mut(), other)?, what, g, me, deadline).await?;
                    settle(s, comm, comm.send(src.view(), other)?, what, g, me, deadline).await?;
                }
            }
        }
    }
    p.synchronize()?;
    Ok(())
}
