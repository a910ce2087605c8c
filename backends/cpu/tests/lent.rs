//! Large inputs are lent to operations rather than copied at enqueue (see `comm.rs`): the
//! worker thread reads them through the kernel, a peer of the host copies them out, and
//! dropping an unfinished `Work` waits until its job no longer reads the caller's memory.
//! These cases run the paths that a caller waiting for each operation never takes, and the
//! large sizes of the path it does take that the conformance suite's sizes do not reach.

mod common;

use anyccl_core::{Buf, BufMut, MemoryStore, P2POp, ReduceOp, Store};
use libtest_mimic::{Arguments, Failed, Trial};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

/// Wait by polling only: the worker thread runs the job (a caller's wait never does).
fn poll_until_done(w: &mut anyccl_core::Work<'_>) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !w.is_completed().map_err(|e| e.to_string())? {
        if Instant::now() > deadline {
            return Err("operation did not complete in 30 s".into());
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}

fn pattern(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (rank * 1000 + i % 997) as f32).collect()
}

/// Every operation with lent inputs (1 KiB and 16 KiB, lent because each is issued while
/// nothing else is queued; 1 MiB and 24 MiB: through the rings, and by reference), run by
/// the worker.
fn worker_reads_lent_inputs() -> Result<(), Failed> {
    common::two_ranks("lent-worker", |me, c| {
        let peer = 1 - me;
        for bytes in [1 << 10, 16 << 10, MIB, 24 * MIB] {
            let n = bytes / 4;
            let mine = pattern(me, n);
            let theirs = pattern(peer, n);
            let mut out = vec![0f32; n];
            let mut w = c
                .all_reduce(Some(Buf::host(&mine)), BufMut::host(&mut out), ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            poll_until_done(&mut w)?;
            drop(w);
            if out.iter().enumerate().any(|(i, &x)| x != mine[i] + theirs[i]) {
                return Err(format!("all_reduce of {bytes} bytes: wrong result"));
            }
            let mut got = vec![0f32; n];
            let ops = vec![P2POp::Send(Buf::host(&mine), peer), P2POp::Recv(BufMut::host(&mut got), peer)];
            let mut w = c.p2p_group(ops).map_err(|e| e.to_string())?;
            poll_until_done(&mut w)?;
            drop(w);
            if got != theirs {
                return Err(format!("sendrecv of {bytes} bytes: wrong result"));
            }
            let mut all = vec![0f32; 2 * n];
            let mut w = c.all_gather(Some(Buf::host(&mine)), BufMut::host(&mut all)).map_err(|e| e.to_string())?;
            poll_until_done(&mut w)?;
            drop(w);
            let want: Vec<f32> =
                if me == 0 { [&mine[..], &theirs[..]].concat() } else { [&theirs[..], &mine[..]].concat() };
            if all != want {
                return Err(format!("all_gather of {bytes} bytes: wrong result"));
            }
            let mut b = vec![0f32; n];
            let mut w = c.broadcast(Some(Buf::host(&mine)), BufMut::host(&mut b), 1).map_err(|e| e.to_string())?;
            poll_until_done(&mut w)?;
            drop(w);
            if b != pattern(1, n) {
                return Err(format!("broadcast of {bytes} bytes: wrong result"));
            }
        }
        Ok(())
    })
}

/// Large operations run in their caller's wait, on its own buffers (24 MiB, above the
/// conformance suite's sizes: the rings read the send buffer piece by piece and fold into
/// the caller's buffer), out of place and in place, results checked.
fn large_in_callers_wait() -> Result<(), Failed> {
    common::two_ranks("lent-direct", |me, c| {
        let peer = 1 - me;
        let n = 24 * MIB / 4;
        let (mine, theirs) = (pattern(me, n), pattern(peer, n));
        let wait = |w: anyccl_core::Result<anyccl_core::Work<'_>>| {
            w.and_then(|mut w| w.wait(Duration::from_secs(60))).map_err(|e| e.to_string())
        };
        let sum: Vec<f32> = mine.iter().zip(&theirs).map(|(a, b)| a + b).collect();
        for root in 0..2 {
            let mut b = vec![0f32; n];
            wait(c.broadcast(Some(Buf::host(&mine)), BufMut::host(&mut b), root))?;
            if b != pattern(root, n) {
                return Err(format!("broadcast from {root} out of place: wrong result"));
            }
            let mut b = mine.clone();
            wait(c.broadcast(None, BufMut::host(&mut b), root))?;
            if b != pattern(root, n) {
                return Err(format!("broadcast from {root} in place: wrong result"));
            }
            let mut r = vec![-1f32; n];
            wait(c.reduce(Some(Buf::host(&mine)), BufMut::host(&mut r), ReduceOp::Sum, root))?;
            let untouched = r.iter().all(|&x| x == -1.0);
            if (me == root && r != sum) || (me != root && !untouched) {
                return Err(format!("reduce to {root}: wrong result"));
            }
        }
        let mut out = vec![0f32; n];
        wait(c.all_reduce(Some(Buf::host(&mine)), BufMut::host(&mut out), ReduceOp::Sum))?;
        let mut inplace = mine.clone();
        wait(c.all_reduce(None, BufMut::host(&mut inplace), ReduceOp::Sum))?;
        if out != sum || inplace != sum {
            return Err("all_reduce: wrong result".into());
        }
        let half = n / 2;
        let mut rs = vec![0f32; half];
        wait(c.reduce_scatter(Some(Buf::host(&mine)), BufMut::host(&mut rs), ReduceOp::Sum))?;
        let mut rs_in = mine.clone();
        wait(c.reduce_scatter(None, BufMut::host(&mut rs_in), ReduceOp::Sum))?;
        let own = me * half..(me + 1) * half;
        let others_kept = rs_in.iter().enumerate().all(|(i, &x)| own.contains(&i) || x == mine[i]);
        if rs[..] != sum[own.clone()] || rs_in[own.clone()] != sum[own] || !others_kept {
            return Err("reduce_scatter: wrong result".into());
        }
        Ok(())
    })
}

/// A `Work` dropped unfinished waits for its job: the caller may then overwrite the
/// buffer, and the peer, receiving late, still gets what was sent (1 MiB goes through the
/// ring, 24 MiB by reference, where the drop waits for the peer's copy).
fn dropped_work_waits_for_lent_job() -> Result<(), Failed> {
    common::two_ranks("lent-drop", |me, c| {
        for bytes in [MIB, 24 * MIB] {
            let n = bytes / 4;
            if me == 0 {
                let mut data = pattern(7, n);
                let w = c.send(Buf::host(&data), 1).map_err(|e| e.to_string())?;
                drop(w);
                data.iter_mut().for_each(|x| *x = -1.0);
                std::hint::black_box(&data);
            } else {
                std::thread::sleep(Duration::from_millis(300));
                let mut got = vec![0f32; n];
                c.recv(BufMut::host(&mut got), 0)
                    .and_then(|mut w| w.wait(Duration::from_secs(10)))
                    .map_err(|e| e.to_string())?;
                if got != pattern(7, n) {
                    let bad = got.iter().zip(pattern(7, n)).filter(|(a, b)| *a != b).count();
                    return Err(format!("{bad} of {n} elements received differ from what was sent ({bytes} bytes)"));
                }
            }
        }
        c.barrier().and_then(|mut w| w.wait(Duration::from_secs(10))).map_err(|e| e.to_string())
    })
}

/// A small collective issued while nothing else is queued lends its input (it is likely
/// waited for at once); dropped unfinished, its `Work` waits for the job, so overwriting
/// the buffer after the drop changes nothing the peer receives.
fn dropped_small_collective_waits_for_its_job() -> Result<(), Failed> {
    common::two_ranks("lent-drop-small", |me, c| {
        for bytes in [256, 1 << 10, 16 << 10] {
            let n = bytes / 4;
            let mut data = pattern(me, n);
            let mut out = vec![0f32; n];
            if me == 0 {
                let w = c
                    .all_reduce(Some(Buf::host(&data)), BufMut::host(&mut out), ReduceOp::Sum)
                    .map_err(|e| e.to_string())?;
                drop(w);
                data.iter_mut().for_each(|x| *x = -1.0);
                std::hint::black_box(&data);
            } else {
                std::thread::sleep(Duration::from_millis(100));
                c.all_reduce(Some(Buf::host(&data)), BufMut::host(&mut out), ReduceOp::Sum)
                    .and_then(|mut w| w.wait(Duration::from_secs(10)))
                    .map_err(|e| e.to_string())?;
                let want: Vec<f32> = pattern(0, n).iter().zip(&data).map(|(a, b)| a + b).collect();
                if out != want {
                    return Err(format!("all_reduce of {bytes} bytes: the dropped side's input changed under it"));
                }
            }
        }
        c.barrier().and_then(|mut w| w.wait(Duration::from_secs(10))).map_err(|e| e.to_string())
    })
}

/// An input from 4 KiB issued behind another operation is lent too: dropped unfinished, its
/// `Work` leaves the job a copy at once (it does not wait for the peer, which joins later),
/// so overwriting the buffer after the drop changes nothing the peer receives.
fn dropped_queued_collective_keeps_its_input() -> Result<(), Failed> {
    common::two_ranks("lent-drop-queued", |me, c| {
        let t = Duration::from_secs(10);
        for bytes in [4 << 10, 16 << 10, 48 << 10] {
            let n = bytes / 4;
            let (first, mut data) = (pattern(me + 2, 256), pattern(me, n));
            let (mut first_out, mut out) = (vec![0f32; 256], vec![0f32; n]);
            if me == 0 {
                // The first waits for rank 1, so the second is queued behind it.
                let mut a = c
                    .all_reduce(Some(Buf::host(&first)), BufMut::host(&mut first_out), ReduceOp::Sum)
                    .map_err(|e| e.to_string())?;
                let b = c
                    .all_reduce(Some(Buf::host(&data)), BufMut::host(&mut out), ReduceOp::Sum)
                    .map_err(|e| e.to_string())?;
                let start = Instant::now();
                drop(b);
                let took = start.elapsed();
                data.iter_mut().for_each(|x| *x = -1.0);
                std::hint::black_box(&data);
                if took > Duration::from_millis(250) {
                    return Err(format!("dropping a queued {bytes}-byte all_reduce took {took:?}: it waited"));
                }
                a.wait(t).map_err(|e| e.to_string())?;
            } else {
                std::thread::sleep(Duration::from_millis(300));
                c.all_reduce(Some(Buf::host(&first)), BufMut::host(&mut first_out), ReduceOp::Sum)
                    .and_then(|mut w| w.wait(t))
                    .map_err(|e| e.to_string())?;
                c.all_reduce(Some(Buf::host(&data)), BufMut::host(&mut out), ReduceOp::Sum)
                    .and_then(|mut w| w.wait(t))
                    .map_err(|e| e.to_string())?;
                let want: Vec<f32> = pattern(0, n).iter().zip(&data).map(|(a, b)| a + b).collect();
                if out != want {
                    let bad = out.iter().zip(&want).filter(|(a, b)| a != b).count();
                    return Err(format!(
                        "all_reduce of {bytes} bytes: {bad} of {n} elements took the input overwritten after the drop"
                    ));
                }
            }
            let want_first: Vec<f32> = pattern(2, 256).iter().zip(pattern(3, 256)).map(|(a, b)| a + b).collect();
            if first_out != want_first {
                return Err("the first all_reduce: wrong result".into());
            }
            c.barrier().and_then(|mut w| w.wait(t)).map_err(|e| e.to_string())?;
        }
        Ok(())
    })
}

/// Dropping an unfinished small collective returns at once, whatever the peers do next:
/// rank 0 issues an all_reduce on one communicator, drops it unwaited and sends to rank 1 on
/// another, which receives that first and only then joins the all_reduce (a drop that
/// waited for the all_reduce would wait for rank 1, which waits for the send: both until
/// the operation timeout; on a device the two communicators' streams run side by side).
fn dropped_small_collective_does_not_wait_for_peers() -> Result<(), Failed> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let run = |me: usize, store: Arc<dyn Store>| -> Result<(), String> {
        let t = Duration::from_secs(20);
        let a = common::connect(store.clone(), me, 2, "drop-a", t).map_err(|e| e.to_string())?;
        let b = common::connect(store, me, 2, "drop-b", t).map_err(|e| e.to_string())?;
        for bytes in [256, 1 << 10, 16 << 10] {
            let n = bytes / 4;
            let data = pattern(me, n);
            let mut out = vec![0f32; n];
            if me == 0 {
                // Issued while nothing else is queued on `a` (the barrier below ran all):
                // its input is lent.
                let w = a
                    .all_reduce(Some(Buf::host(&data)), BufMut::host(&mut out), ReduceOp::Sum)
                    .map_err(|e| e.to_string())?;
                let start = Instant::now();
                drop(w);
                let took = start.elapsed();
                if took > Duration::from_secs(2) {
                    return Err(format!("dropping an unfinished {bytes}-byte all_reduce took {took:?}"));
                }
                b.send(Buf::host(&[1f32]), 1).and_then(|mut w| w.wait(t)).map_err(|e| e.to_string())?;
            } else {
                let mut token = [0f32; 1];
                b.recv(BufMut::host(&mut token), 0).and_then(|mut w| w.wait(t)).map_err(|e| e.to_string())?;
                a.all_reduce(Some(Buf::host(&data)), BufMut::host(&mut out), ReduceOp::Sum)
                    .and_then(|mut w| w.wait(t))
                    .map_err(|e| e.to_string())?;
                let want: Vec<f32> = pattern(0, n).iter().zip(&data).map(|(x, y)| x + y).collect();
                if out != want {
                    return Err(format!("all_reduce of {bytes} bytes after the peer dropped its Work: wrong result"));
                }
            }
            a.barrier().and_then(|mut w| w.wait(t)).map_err(|e| e.to_string())?;
        }
        Ok(())
    };
    let handles: Vec<_> = (0..2)
        .map(|r| {
            let s = store.clone();
            std::thread::spawn(move || run(r, s).map_err(|e| format!("rank {r}: {e}")))
        })
        .collect();
    let errs: Vec<String> = handles
        .into_iter()
        .filter_map(|h| match h.join() {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some("a rank panicked".into()),
        })
        .collect();
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.join("; ").into())
    }
}

fn main() -> std::process::ExitCode {
    // Set before any thread starts (read at every connect): a small all_reduce of two ranks
    // issued in step would otherwise finish as it is issued (`comm/eager.rs`), and these
    // cases are about the queued path (`eager.rs` runs the other).
    std::env::set_var("ANYCCL_CPU_EAGER_US", "0");
    let args = Arguments::from_args();
    let trials = vec![
        Trial::test("cpu::lent::worker_reads_lent_inputs[w=2]", worker_reads_lent_inputs),
        Trial::test("cpu::lent::dropped_work_waits_for_lent_job[w=2]", dropped_work_waits_for_lent_job),
        Trial::test("cpu::lent::large_in_callers_wait[w=2]", large_in_callers_wait),
        Trial::test(
            "cpu::lent::dropped_small_collective_waits_for_its_job[w=2]",
            dropped_small_collective_waits_for_its_job,
        ),
        Trial::test(
            "cpu::lent::dropped_queued_collective_keeps_its_input[w=2]",
            dropped_queued_collective_keeps_its_input,
        ),
        Trial::test(
            "cpu::lent::dropped_small_collective_does_not_wait_for_peers[w=2]",
            dropped_small_collective_does_not_wait_for_peers,
        ),
    ];
    libtest_mimic::run(&args, trials).exit_code()
}
