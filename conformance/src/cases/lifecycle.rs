//! Failures: a rank that never arrives, abort from another thread, a peer that closes, a
//! collective mismatch, a killed process; plus health and shutdown.

use crate::ensure;
use crate::harness::{CaseError, CaseResult, RankCtx};
use crate::pattern::values;
use crate::registry::Case;
use anyccl_core::{CommConfig, Communicator, DType, Error, GroupSpec, ReduceOp, Role};
use std::time::{Duration, Instant};

/// The last rank never issues the all_reduce: the others get `Timeout` from `wait`, naming
/// the op and the group; then everyone aborts.
fn never_arrives(cx: &RankCtx) -> CaseResult {
    let absent = cx.size - 1;
    if cx.rank == absent {
        for r in 0..absent {
            cx.await_signal(&format!("timed-out-{r}"))?;
        }
        cx.block_on(cx.comm.abort())?;
        return Ok(());
    }
    let mut b = cx.upload(DType::F32, &values(cx.rank, 64, None, 0))?;
    let blocks = cx.comm.capabilities().first_call_may_block;
    let t = Instant::now();
    let (r, took) = match cx.comm.all_reduce(None, b.view_mut(), ReduceOp::Sum) {
        Ok(mut w) => {
            let r = w.wait(Duration::from_millis(500));
            let took = t.elapsed();
            // The pending operation must not be dropped (that waits for it) before the abort.
            if r.is_err() {
                cx.block_on(cx.comm.abort())?;
            }
            (r, took)
        }
        // A backend whose first call blocks while connecting times out inside the enqueue.
        Err(e) if blocks => (Err(e), t.elapsed()),
        Err(e) => return Err(e.into()),
    };
    let limit = if blocks { cx.comm.config().op_timeout + Duration::from_secs(5) } else { Duration::from_secs(3) };
    match r {
        Err(Error::Timeout { op, group, .. }) => {
            ensure!(op.contains("all_reduce") && group == "world", "timeout names op '{op}' and group '{group}'");
        }
        other => return Err(CaseError(format!("expected Timeout, got {other:?}"))),
    }
    ensure!(took < limit, "the timeout came after {took:?}");
    cx.signal(&format!("timed-out-{}", cx.rank))?;
    cx.block_on(cx.comm.abort())?;
    Ok(())
}

/// Rank 0 waits on an all_reduce nobody else joins; another thread aborts the
/// communicator; the wait ends promptly with `Aborted`.
fn abort_unblocks(cx: &RankCtx) -> CaseResult {
    if cx.rank != 0 {
        cx.await_signal("aborted")?;
        return Ok(());
    }
    let mut b = cx.upload(DType::F32, &values(0, 1024, None, 0))?;
    let t = Instant::now();
    // The aborting thread starts first: on backends whose first call blocks while
    // connecting, the abort has to unblock the enqueue itself.
    let r = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            let _ = cx.comm.abort_blocking();
        });
        match cx.comm.all_reduce(None, b.view_mut(), ReduceOp::Sum) {
            Ok(mut w) => w.wait(Duration::from_secs(30)),
            Err(e) => Err(e),
        }
    });
    let took = t.elapsed();
    cx.signal("aborted")?;
    ensure!(matches!(r, Err(Error::Aborted { .. })), "expected Aborted, got {r:?}");
    ensure!(took < Duration::from_secs(5), "abort took {took:?} to unblock the wait");
    let h = cx.block_on(cx.comm.health());
    ensure!(matches!(h, Err(Error::Aborted { .. })), "health after abort: {h:?}");
    let again = cx.comm.barrier().map(|_| ());
    ensure!(matches!(again, Err(Error::Aborted { .. })), "enqueue after abort: {again:?}");
    Ok(())
}

/// The last rank closes its communicator while the others are in an all_reduce: every
/// other rank gets `PeerFailed` within the deadline.
fn peer_closes(cx: &RankCtx) -> CaseResult {
    let victim = cx.size - 1;
    // One round first, so every connection exists and the failure hits a warm job.
    let mut warm = cx.upload(DType::F32, &values(cx.rank, 1 << 18, None, 0))?;
    cx.wait(cx.comm.all_reduce(None, warm.view_mut(), ReduceOp::Sum)?)?;
    if cx.rank == victim {
        cx.await_signal("issued")?;
        cx.block_on(cx.comm.abort())?;
        return Ok(());
    }
    // Large enough that every rank talks to its neighbours on a ring.
    let mut b = cx.upload(DType::F32, &values(cx.rank, 1 << 18, None, 0))?;
    let mut w = cx.comm.all_reduce(None, b.view_mut(), ReduceOp::Sum)?;
    if cx.rank == 0 {
        cx.signal("issued")?;
    }
    expect_peer_failure(cx, &mut w, "the victim's abort")?;
    Ok(())
}

/// Backends that detect peer failure must report it within 10 s; the others must end the
/// wait at its deadline with `Timeout`, or earlier with `PeerFailed` where the transport
/// happens to notice (NCCL over sockets sees the connection close; over NVLink it sees
/// nothing), after which the survivor aborts.
fn expect_peer_failure(cx: &RankCtx, w: &mut anyccl_core::Work<'_>, what: &str) -> CaseResult {
    let t = Instant::now();
    if cx.comm.capabilities().detects_peer_failure {
        let r = w.wait(Duration::from_secs(20));
        ensure!(matches!(r, Err(Error::PeerFailed { .. })), "expected PeerFailed after {what}, got {r:?}");
        ensure!(t.elapsed() < Duration::from_secs(10), "{what} took {:?} to surface", t.elapsed());
    } else {
        let r = w.wait(Duration::from_secs(2));
        ensure!(
            matches!(r, Err(Error::Timeout { .. } | Error::PeerFailed { .. })),
            "expected Timeout (or PeerFailed) after {what}, got {r:?}"
        );
        ensure!(t.elapsed() < Duration::from_secs(5), "wait(2 s) returned after {:?}", t.elapsed());
        cx.block_on(cx.comm.abort())?;
    }
    Ok(())
}

/// Rank 0 issues an all_gather while the others issue an all_reduce: every rank gets an
/// error, none hangs and none returns mixed data as a success.
fn mismatch(cx: &RankCtx) -> CaseResult {
    let mut b = cx.upload(DType::F32, &values(cx.rank, 4 * cx.size, None, 0))?;
    let mut w = if cx.rank == 0 {
        cx.comm.all_gather(None, b.view_mut())?
    } else {
        cx.comm.all_reduce(None, b.view_mut(), ReduceOp::Sum)?
    };
    match w.wait(Duration::from_secs(20)) {
        Err(Error::PeerFailed { .. } | Error::Aborted { .. }) => Ok(()),
        other => Err(CaseError(format!("expected PeerFailed or Aborted, got {other:?}"))),
    }
}

/// Detail mode, on any backend: rank 0 calls all_gather while the others call all_reduce;
/// every rank fails before any data moves, within 10 s, with an error naming both calls.
fn mismatch_detail(cx: &RankCtx) -> CaseResult {
    let config = CommConfig { detail: true, op_timeout: cx.timeout, init_timeout: cx.timeout, ..CommConfig::default() };
    let comm = cx.connect_all("detail", Role::Data, config)?;
    // A matching collective first: detail mode lets it through.
    let mut ok = cx.upload(DType::F32, &[1.0; 8])?;
    cx.wait(comm.all_reduce(None, ok.view_mut(), ReduceOp::Sum)?)?;
    let mut b = cx.upload(DType::F32, &values(cx.rank, 4 * cx.size, None, 0))?;
    let t = Instant::now();
    let r = if cx.rank == 0 {
        comm.all_gather(None, b.view_mut()).map(drop)
    } else {
        comm.all_reduce(None, b.view_mut(), ReduceOp::Sum).map(drop)
    };
    let took = t.elapsed();
    match r {
        Err(Error::InvalidArgument { arg: "collective", msg, .. }) => {
            ensure!(
                msg.contains("all_gather") && msg.contains("all_reduce"),
                "the error does not name both calls: {msg}"
            );
        }
        other => return Err(CaseError(format!("expected InvalidArgument naming both calls, got {other:?}"))),
    }
    ensure!(took < Duration::from_secs(10), "the mismatch took {took:?} to report");
    cx.block_on(comm.shutdown())?;
    Ok(())
}

/// Shutdown after work is idempotent; health is fine before it.
fn shutdown_twice(cx: &RankCtx) -> CaseResult {
    cx.block_on(cx.comm.health())?;
    cx.wait(cx.comm.barrier()?)?;
    cx.block_on(cx.comm.shutdown())?;
    cx.block_on(cx.comm.shutdown())?;
    Ok(())
}

/// Process mode: rank 1 dies without any cleanup in the middle of the job; every survivor
/// gets `PeerFailed` within the deadline and exits cleanly.
fn killed_process(cx: &RankCtx) -> CaseResult {
    let mut b = cx.upload(DType::F32, &values(cx.rank, 4096, None, 0))?;
    cx.wait(cx.comm.all_reduce(None, b.view_mut(), ReduceOp::Sum)?)?;
    // Rank 1 dies only once every rank has finished the first round: a peer still inside
    // it when the process goes may rightly fail that round instead of the next.
    cx.signal(&format!("round-one-{}", cx.rank))?;
    if cx.rank == 1 {
        for r in (0..cx.size).filter(|&r| r != 1) {
            cx.await_signal(&format!("round-one-{r}"))?;
        }
        std::process::abort();
    }
    let mut w = cx.comm.all_reduce(None, b.view_mut(), ReduceOp::Sum)?;
    expect_peer_failure(cx, &mut w, "the death of rank 1")?;
    drop(w);
    Ok(())
}

/// A rank that retries a connect alone must meet the others' next attempt: first the last
/// rank, then rank 0, tries to connect a new communicator by itself and times out; then
/// every rank connects it, and it works.
fn retry_connect_alone(cx: &RankCtx) -> CaseResult {
    let spec = GroupSpec::new("retry", (0..cx.size).collect(), "conformance", Role::Data);
    let connect = |limit: Duration| {
        let config = CommConfig { init_timeout: limit, op_timeout: cx.timeout, ..CommConfig::default() };
        cx.block_on(Communicator::connect(
            cx.backend.as_ref(),
            spec.clone(),
            cx.rank,
            cx.store.clone(),
            cx.platform.device(),
            config,
        ))
    };
    for (phase, alone) in [("last", cx.size - 1), ("first", 0)] {
        if cx.rank == alone {
            let t = Instant::now();
            let r = connect(Duration::from_millis(1500));
            ensure!(matches!(r, Err(Error::Timeout { .. })), "rank {alone} alone: expected Timeout, got {:?}", r.err());
            ensure!(t.elapsed() < Duration::from_secs(10), "rank {alone} alone took {:?}", t.elapsed());
            cx.signal(&format!("alone-{phase}"))?;
        } else {
            cx.await_signal(&format!("alone-{phase}"))?;
        }
    }
    let comm = connect(cx.timeout).map_err(|e| CaseError(format!("connect after the lone attempts: {e}")))?;
    let mut b = cx.upload(DType::F32, &vec![1.0; 256])?;
    cx.wait(comm.all_reduce(None, b.view_mut(), ReduceOp::Sum)?)?;
    let got = cx.download(b.as_ref())?;
    ensure!(got.iter().all(|&v| v == cx.size as f64), "all_reduce after the retry gave {:?}", &got[..4]);
    cx.block_on(comm.shutdown())?;
    Ok(())
}

/// Register the lifecycle cases.
pub fn register(v: &mut Vec<Case>) {
    v.push(Case::new("lifecycle", "rank_never_arrives_timeout", &[2, 3, 5], never_arrives));
    v.push(
        Case::new("lifecycle", "abort_unblocks_wait", &[2, 3], abort_unblocks)
            .needs(|c, _| (!c.abort_in_flight).then(|| "backend cannot abort in-flight operations".into())),
    );
    v.push(Case::new("lifecycle", "peer_closes_peer_failed", &[2, 3, 4, 8], peer_closes));
    v.push(Case::new("lifecycle", "collective_mismatch_errors", &[2, 3], mismatch).needs(|c, _| {
        (!c.detects_mismatch).then(|| "the backend does not check that ranks issue the same collective".into())
    }));
    v.push(Case::new("lifecycle", "collective_mismatch_detail_mode", &[2, 3, 4], mismatch_detail));
    v.push(Case::new("lifecycle", "shutdown_twice", &[1, 2, 3], shutdown_twice));
    v.push(Case::new("lifecycle", "retry_connect_alone", &[2, 3], retry_connect_alone));
    v.push(Case::new("lifecycle", "killed_process_peer_failed", &[2, 3, 4], killed_process).processes(Some(1)));
}
