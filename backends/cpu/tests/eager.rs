//! A small all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, barrier or sendrecv
//! of two ranks of one host, issued
//! while nothing else is queued, runs as it is issued (`comm/eager.rs`): in step it returns
//! finished; a peer that comes late, or that sent a point-to-point message first, leaves the
//! receive queued and the issue returns at once; a mismatch fails both ranks. Results
//! checked in every case. Among more than two ranks: `eager_ring.rs`.

mod common;

use anyccl_core::{Buf, BufMut, Communicator, P2POp, ReduceOp, Result as AResult, Work};
use common::{input, meet, wait, T};
use libtest_mimic::{Arguments, Failed, Trial};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Issued in step (the ranks meet first), out of place and in place, sum and average, 4 B
/// to 8 KiB: every result right, and at least some calls finished as they were issued (a
/// finished `Work` says so before any wait).
fn in_step_all_reduce_finishes_at_issue() -> Result<(), Failed> {
    let arrived = Arc::new(AtomicUsize::new(0));
    common::two_ranks("eager-in-step", move |me, c| {
        let mut at_issue = 0;
        let mut calls = 0;
        for round in 0..100 {
            for n in [1usize, 16, 512, 2048] {
                let (mine, theirs) = (input(me, n, round), input(1 - me, n, round));
                for (op, in_place) in [(ReduceOp::Sum, false), (ReduceOp::Sum, true), (ReduceOp::Avg, false)] {
                    let mut out = if in_place { mine.clone() } else { vec![0f32; n] };
                    meet(&arrived, &mut calls, 2);
                    let send = (!in_place).then(|| Buf::host(&mine));
                    let mut w = c.all_reduce(send, BufMut::host(&mut out), op).map_err(|e| e.to_string())?;
                    if w.is_completed().map_err(|e| e.to_string())? {
                        at_issue += 1;
                    }
                    wait(Ok(w))?;
                    let want = |i: usize| match op {
                        ReduceOp::Avg => (mine[i] + theirs[i]) / 2.0,
                        _ => mine[i] + theirs[i],
                    };
                    if let Some(i) = (0..n).find(|&i| out[i] != want(i)) {
                        return Err(format!("{n} x f32 {op:?} (in place: {in_place}): [{i}] = {}", out[i]));
                    }
                }
            }
        }
        if at_issue == 0 {
            return Err(format!("none of {calls} calls in step finished as it was issued"));
        }
        Ok(())
    })
}

/// all_gather, broadcast (from either rank) and barrier issued in step, in place and out
/// of place, 4 B to 8 KiB a part: every result right, and at least some calls of each
/// finished as they were issued.
fn in_step_others_finish_at_issue() -> Result<(), Failed> {
    let arrived = Arc::new(AtomicUsize::new(0));
    common::two_ranks("eager-others", move |me, c| {
        let mut calls = 0;
        // Calls finished at issue: all_gather, broadcast, barrier.
        let mut at_issue = [0usize; 3];
        let mut issued = |w: anyccl_core::Result<Work<'_>>, kind: usize| -> Result<(), String> {
            let mut w = w.map_err(|e| e.to_string())?;
            if w.is_completed().map_err(|e| e.to_string())? {
                at_issue[kind] += 1;
            }
            wait(Ok(w))
        };
        for round in 0..60 {
            for n in [1usize, 16, 2048] {
                let (mine, theirs) = (input(me, n, round), input(1 - me, n, round));
                let want: Vec<f32> =
                    if me == 0 { [&mine[..], &theirs[..]].concat() } else { [&theirs[..], &mine[..]].concat() };
                for in_place in [false, true] {
                    let mut all = vec![0f32; 2 * n];
                    if in_place {
                        all[me * n..(me + 1) * n].copy_from_slice(&mine);
                    }
                    meet(&arrived, &mut calls, 2);
                    let send = (!in_place).then(|| Buf::host(&mine));
                    issued(c.all_gather(send, BufMut::host(&mut all)), 0)?;
                    if all != want {
                        return Err(format!(
                            "all_gather of {n} x f32 (in place: {in_place}): {:?}",
                            &all[..4.min(2 * n)]
                        ));
                    }
                    for root in 0..2 {
                        let mut b = if in_place { mine.clone() } else { vec![0f32; n] };
                        meet(&arrived, &mut calls, 2);
                        let send = (!in_place).then(|| Buf::host(&mine));
                        issued(c.broadcast(send, BufMut::host(&mut b), root), 1)?;
                        if b != input(root, n, round) {
                            return Err(format!("broadcast of {n} x f32 from {root} (in place: {in_place}): wrong"));
                        }
                    }
                }
            }
            meet(&arrived, &mut calls, 2);
            issued(c.barrier(), 2)?;
        }
        if let Some(k) = (0..3).find(|&k| at_issue[k] == 0) {
            let what = ["all_gather", "broadcast", "barrier"][k];
            return Err(format!("no {what} in step finished as it was issued ({calls} calls)"));
        }
        Ok(())
    })
}

/// Rank 1 comes 200 ms late to a broadcast from rank 0 and to a barrier: rank 0's broadcast
/// finishes as it is issued (the root only sends), its barrier's issue returns at once,
/// unfinished; rank 1 gets the root's bytes.
fn late_peer_others() -> Result<(), Failed> {
    common::two_ranks("eager-late-others", |me, c| {
        let mine = input(me, 8, 0);
        let mut b = if me == 0 { mine.clone() } else { vec![0f32; 8] };
        if me == 1 {
            std::thread::sleep(Duration::from_millis(200));
        }
        let mut w = c.broadcast(None, BufMut::host(&mut b), 0).map_err(|e| e.to_string())?;
        if me == 0 && !w.is_completed().map_err(|e| e.to_string())? {
            return Err("the root's broadcast did not finish as it was issued".into());
        }
        wait(Ok(w))?;
        if b != input(0, 8, 0) {
            return Err(format!("broadcast: {b:?}"));
        }
        if me == 1 {
            std::thread::sleep(Duration::from_millis(200));
        }
        let t = Instant::now();
        let mut w = c.barrier().map_err(|e| e.to_string())?;
        if me == 0 {
            if t.elapsed() > Duration::from_millis(100) {
                return Err(format!("the barrier's issue waited {:?} for a peer 200 ms late", t.elapsed()));
            }
            if w.is_completed().map_err(|e| e.to_string())? {
                return Err("a barrier finished at issue with the peer 200 ms late".into());
            }
        }
        wait(Ok(w))
    })
}

/// Rank 1 issues 200 ms after rank 0: rank 0's issue returns within the eager look (not
/// after the peer's), unfinished; both waits then give the right sums, and the calls after
/// it (in step again) are right too.
fn late_peer_leaves_the_receive_queued() -> Result<(), Failed> {
    common::two_ranks("eager-late", |me, c| {
        for round in 0..3 {
            let (mine, theirs) = (input(me, 8, round), input(1 - me, 8, round));
            let mut out = vec![0f32; 8];
            if me == 1 && round == 0 {
                std::thread::sleep(Duration::from_millis(200));
            }
            let t = Instant::now();
            let mut w = c
                .all_reduce(Some(Buf::host(&mine)), BufMut::host(&mut out), ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            let took = t.elapsed();
            if me == 0 && round == 0 {
                if took > Duration::from_millis(100) {
                    return Err(format!("the issue waited {took:?} for a peer 200 ms late"));
                }
                if w.is_completed().map_err(|e| e.to_string())? {
                    return Err("finished at issue with the peer 200 ms late".into());
                }
            }
            wait(Ok(w))?;
            if (0..8).any(|i| out[i] != mine[i] + theirs[i]) {
                return Err(format!("round {round}: wrong sum {out:?}"));
            }
        }
        Ok(())
    })
}

/// A pipeline of 300 operations (all_reduce, all_gather and barrier in turn, issued back to
/// back, then waited): rank 0 issues all of its own first, and waits for them only once
/// rank 1 has issued all of its. Each of rank 0's issues sends its message and leaves its
/// receive queued, in order (the worker, with a hand-over of a second, runs nothing
/// meanwhile), so every one of rank 1's finds rank 0's message there and finishes as it is
/// issued; every result right on both.
fn pipeline_sends_at_issue() -> Result<(), Failed> {
    let step = Arc::new(AtomicUsize::new(0));
    common::two_ranks("eager-pipeline", move |me, c| {
        const CALLS: usize = 300;
        let until = |n: usize| -> Result<(), String> {
            let t = Instant::now();
            while step.load(Ordering::SeqCst) < n {
                if t.elapsed() > T {
                    return Err("the other rank never got there".into());
                }
                std::thread::yield_now();
            }
            Ok(())
        };
        let ins: Vec<Vec<f32>> = (0..CALLS).map(|k| input(me, 4, k)).collect();
        let mut outs: Vec<Vec<f32>> = (0..CALLS).map(|k| vec![0f32; if k % 3 == 1 { 8 } else { 4 }]).collect();
        if me == 1 {
            until(1)?;
        }
        let mut works = Vec::with_capacity(CALLS);
        let mut at_issue = 0;
        for (k, out) in outs.iter_mut().enumerate() {
            let send = Some(Buf::host(&ins[k]));
            let w = match k % 3 {
                0 => c.all_reduce(send, BufMut::host(out), ReduceOp::Sum),
                1 => c.all_gather(send, BufMut::host(out)),
                _ => c.barrier(),
            };
            let mut w = w.map_err(|e| e.to_string())?;
            // (Only rank 1 looks: a look at an unfinished operation has the worker run it.)
            if me == 1 && w.is_completed().map_err(|e| e.to_string())? {
                at_issue += 1;
            }
            works.push(w);
        }
        step.fetch_add(1, Ordering::SeqCst);
        if me == 0 {
            until(2)?;
        }
        for w in works {
            wait(Ok(w))?;
        }
        for (k, out) in outs.iter().enumerate() {
            let (mine, theirs) = (input(me, 4, k), input(1 - me, 4, k));
            let want: Vec<f32> = match k % 3 {
                0 => (0..4).map(|i| mine[i] + theirs[i]).collect(),
                1 if me == 0 => [&mine[..], &theirs[..]].concat(),
                1 => [&theirs[..], &mine[..]].concat(),
                _ => vec![0f32; 4],
            };
            if *out != want {
                return Err(format!("operation {k}: {out:?}, not {want:?}"));
            }
        }
        if me == 1 && at_issue < CALLS {
            return Err(format!("{at_issue} of rank 1's {CALLS} operations finished as they were issued"));
        }
        Ok(())
    })
}

/// Rank 1 sends rank 0 a message and then issues the all_reduce; rank 0 issues the
/// all_reduce, then the receive: the message that comes first is not the collective's, so
/// the collective's receive is queued, and both operations get their own bytes.
fn message_before_the_collective() -> Result<(), Failed> {
    common::two_ranks("eager-p2p-first", |me, c| {
        let (mine, theirs) = (input(me, 4, 0), input(1 - me, 4, 0));
        let mut out = vec![0f32; 4];
        let note = [7f32; 3];
        if me == 1 {
            wait(c.send(Buf::host(&note), 0))?;
            wait(c.all_reduce(Some(Buf::host(&mine)), BufMut::host(&mut out), ReduceOp::Sum))?;
        } else {
            // Issued after the peer's message has arrived (the peer waited for its send).
            std::thread::sleep(Duration::from_millis(50));
            let w = c.all_reduce(Some(Buf::host(&mine)), BufMut::host(&mut out), ReduceOp::Sum);
            let mut got = [0f32; 3];
            let r = c.recv(BufMut::host(&mut got), 1);
            wait(w)?;
            wait(r)?;
            if got != note {
                return Err(format!("the message arrived as {got:?}"));
            }
        }
        if (0..4).any(|i| out[i] != mine[i] + theirs[i]) {
            return Err(format!("wrong sum {out:?}"));
        }
        Ok(())
    })
}

/// reduce_scatter (sum and average) and all_to_all of 4 B to 8 KiB a share, issued in step
/// and then with rank 1 200 ms late: every result right; in step some finish as they are
/// issued, late rank 0's issue returns at once, unfinished.
fn reduce_scatter_and_all_to_all() -> Result<(), Failed> {
    let arrived = Arc::new(AtomicUsize::new(0));
    common::two_ranks("eager-rs-a2a", move |me, c| {
        let mut calls = 0;
        let mut at_issue = [0usize; 2];
        // Waits for `w`, issued at `t`: 1 if it finished as it was issued. `late`: rank 1 is
        // 200 ms late, so rank 0's issue must return at once, unfinished (late calls count 0).
        let issued = |what: &str, w: anyccl_core::Result<Work<'_>>, t: Instant, late: bool| {
            let mut w = w.map_err(|e| e.to_string())?;
            let done = w.is_completed().map_err(|e| e.to_string())?;
            if late && me == 0 && (done || t.elapsed() > Duration::from_millis(100)) {
                return Err(format!("{what} with the peer 200 ms late: finished {done} after {:?}", t.elapsed()));
            }
            wait(Ok(w))?;
            Ok::<usize, String>(usize::from(done && !late))
        };
        for round in 0..40 {
            let late = round == 39;
            for n in [1usize, 16, 2048] {
                // Two shares of n: rank r's input is `input(r, 2n, round)`.
                let (mine, theirs) = (input(me, 2 * n, round), input(1 - me, 2 * n, round));
                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                    let mut out = vec![0f32; n];
                    meet(&arrived, &mut calls, 2);
                    if late && me == 1 {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    let t = Instant::now();
                    let w = c.reduce_scatter(Some(Buf::host(&mine)), BufMut::host(&mut out), op);
                    at_issue[0] += issued("reduce_scatter", w, t, late)?;
                    let share = me * n..(me + 1) * n;
                    let want = |i: usize| {
                        let s = mine[share.start + i] + theirs[share.start + i];
                        if op == ReduceOp::Avg {
                            s / 2.0
                        } else {
                            s
                        }
                    };
                    if let Some(i) = (0..n).find(|&i| out[i] != want(i)) {
                        return Err(format!("reduce_scatter {n} x f32 {op:?}, round {round}: [{i}] = {}", out[i]));
                    }
                }
                let mut all = vec![0f32; 2 * n];
                meet(&arrived, &mut calls, 2);
                if late && me == 1 {
                    std::thread::sleep(Duration::from_millis(200));
                }
                let t = Instant::now();
                let w = c.all_to_all(Buf::host(&mine), BufMut::host(&mut all), None);
                at_issue[1] += issued("all_to_all", w, t, late)?;
                // Segment r of the output is rank r's segment `me` of its input.
                let want: Vec<f32> = (0..2)
                    .flat_map(|r| {
                        let src = if r == me { &mine } else { &theirs };
                        src[me * n..(me + 1) * n].to_vec()
                    })
                    .collect();
                if all != want {
                    return Err(format!(
                        "all_to_all of {n} x f32 a segment, round {round}: {:?}",
                        &all[..4.min(2 * n)]
                    ));
                }
            }
        }
        if let Some(k) = (0..2).find(|&k| at_issue[k] == 0) {
            let what = ["reduce_scatter", "all_to_all"][k];
            return Err(format!("no {what} in step finished as it was issued ({calls} calls)"));
        }
        Ok(())
    })
}

/// A batch of one send to the peer and one receive from it (either order), 4 B to 8 KiB,
/// issued in step: every result right, some finished as they were issued. Then rank 1 comes
/// 200 ms late to a sendrecv followed by an all_reduce: rank 0's two issues return at once,
/// unfinished (the all_reduce's receive queued behind the sendrecv's), and both operations
/// get their own bytes. Then sizes that do not match (8 B against 16 B): both ranks fail
/// naming the sizes, within the operation timeout.
fn sendrecv() -> Result<(), Failed> {
    let arrived = Arc::new(AtomicUsize::new(0));
    common::two_ranks("eager-sendrecv", move |me, c| {
        let (peer, mut calls, mut at_issue) = (1 - me, 0, 0);
        fn batch<'a>(c: &'a Communicator, send: &'a [f32], out: &'a mut [f32], first: bool) -> AResult<Work<'a>> {
            let peer = 1 - c.rank();
            let (s, r) = (P2POp::Send(Buf::host(send), peer), P2POp::Recv(BufMut::host(out), peer));
            c.p2p_group(if first { vec![s, r] } else { vec![r, s] })
        }
        for round in 0..60 {
            for n in [1usize, 16, 2048] {
                for send_first in [true, false] {
                    let (mine, theirs) = (input(me, n, round), input(peer, n, round));
                    let mut out = vec![0f32; n];
                    meet(&arrived, &mut calls, 2);
                    let mut w = batch(c, &mine, &mut out, send_first).map_err(|e| e.to_string())?;
                    at_issue += usize::from(w.is_completed().map_err(|e| e.to_string())?);
                    wait(Ok(w))?;
                    if out != theirs {
                        return Err(format!("sendrecv of {n} x f32, round {round}: {:?}", &out[..n.min(4)]));
                    }
                }
            }
        }
        if at_issue == 0 {
            return Err(format!("no sendrecv in step finished as it was issued ({calls} calls)"));
        }
        // The peer late: both receives queued, in order, of two kinds.
        let (mine, theirs) = (input(me, 8, 7), input(peer, 8, 7));
        let (mut got, mut sum) = (vec![0f32; 8], vec![0f32; 8]);
        meet(&arrived, &mut calls, 2);
        if me == 1 {
            std::thread::sleep(Duration::from_millis(200));
        }
        let t = Instant::now();
        let mut w = batch(c, &mine, &mut got, true).map_err(|e| e.to_string())?;
        let mut a =
            c.all_reduce(Some(Buf::host(&mine)), BufMut::host(&mut sum), ReduceOp::Sum).map_err(|e| e.to_string())?;
        if me == 0 {
            let done = (w.is_completed(), a.is_completed());
            if !matches!(done, (Ok(false), Ok(false))) || t.elapsed() > Duration::from_millis(100) {
                return Err(format!("with the peer 200 ms late: {done:?} after {:?}", t.elapsed()));
            }
        }
        wait(Ok(w))?;
        wait(Ok(a))?;
        if got != theirs || (0..8).any(|i| sum[i] != mine[i] + theirs[i]) {
            return Err(format!("late peer: got {got:?}, sum {sum:?}"));
        }
        // Sizes that do not match.
        let n = if me == 0 { 2 } else { 4 };
        let (mine, mut out) = (input(me, n, 0), vec![0f32; n]);
        meet(&arrived, &mut calls, 2);
        let t = Instant::now();
        match wait(batch(c, &mine, &mut out, true)) {
            Ok(()) => Err("a sendrecv of 8 B against one of 16 B succeeded".into()),
            Err(e) if e.contains("bytes") && t.elapsed() < T => Ok(()),
            Err(e) => Err(format!("after {:?}: {e}", t.elapsed())),
        }
    })
}

/// A seeded mix of 2,000 operations, the same on both ranks: sendrecv (either order),
/// all_reduce, broadcast (from either rank) and all_to_all, 1 float to 4,096 (so some go
/// as they are issued and some the usual way), issued in batches of 1 to 12 back to back and
/// then waited, each rank sleeping up to 300 us before some issues and looking at some
/// operations as it issues them (which has its queue run), so receives of both kinds are
/// left for later behind one another in every order, and a call goes as it is issued on one
/// rank and the usual way on the other: every result right.
fn mixed_pipeline() -> Result<(), Failed> {
    common::two_ranks("eager-mixed", move |me, c| {
        // One stream of choices both ranks share, one for this rank's sleeps.
        let mut shared = 0x9e37_79b9_7f4a_7c15u64;
        let mut own = 0x2545_f491_4f6c_dd1du64 ^ (me as u64 + 1);
        let next = |s: &mut u64| {
            *s ^= *s << 13;
            *s ^= *s >> 7;
            *s ^= *s << 17;
            *s
        };
        let mut done = 0;
        while done < 2000 {
            let k = 1 + (next(&mut shared) % 12) as usize;
            // (kind, floats, root or order) for each operation of the batch.
            let ops: Vec<(u64, usize, usize)> = (0..k)
                .map(|_| {
                    let kind = next(&mut shared) % 4;
                    let n = [1usize, 2, 16, 64, 512, 2048, 4096][(next(&mut shared) % 7) as usize];
                    (kind, n, (next(&mut shared) % 2) as usize)
                })
                .collect();
            let ins: Vec<Vec<f32>> = ops.iter().enumerate().map(|(i, &(_, n, _))| input(me, 2 * n, done + i)).collect();
            let mut outs: Vec<Vec<f32>> = ops.iter().map(|&(_, n, _)| vec![0f32; 2 * n]).collect();
            let mut works = Vec::with_capacity(k);
            for ((&(kind, n, x), src), out) in ops.iter().zip(&ins).zip(outs.iter_mut()) {
                if next(&mut own) % 4 == 0 {
                    std::thread::sleep(Duration::from_micros(next(&mut own) % 300));
                }
                let w = match kind {
                    0 => {
                        let (s, r) = (
                            P2POp::Send(Buf::host(&src[..n]), 1 - me),
                            P2POp::Recv(BufMut::host(&mut out[..n]), 1 - me),
                        );
                        c.p2p_group(if x == 0 { vec![s, r] } else { vec![r, s] })
                    }
                    1 => c.all_reduce(Some(Buf::host(&src[..n])), BufMut::host(&mut out[..n]), ReduceOp::Sum),
                    2 => c.broadcast(Some(Buf::host(&src[..n])), BufMut::host(&mut out[..n]), x),
                    _ => c.all_to_all(Buf::host(src), BufMut::host(out), None),
                };
                let mut w = w.map_err(|e| format!("operation {done}+: {e}"))?;
                // A look now and then, on this rank alone: it has the queued operations run,
                // so the ranks' queues differ and one rank's call goes as it is issued where
                // the other's goes the usual way.
                if next(&mut own) % 3 == 0 {
                    w.is_completed().map_err(|e| e.to_string())?;
                }
                works.push(w);
            }
            for w in works {
                wait(Ok(w))?;
            }
            for (i, (&(kind, n, x), out)) in ops.iter().zip(&outs).enumerate() {
                let (mine, theirs) = (input(me, 2 * n, done + i), input(1 - me, 2 * n, done + i));
                let want: Vec<f32> = match kind {
                    0 => theirs[..n].to_vec(),
                    1 => (0..n).map(|j| mine[j] + theirs[j]).collect(),
                    2 => input(x, 2 * n, done + i)[..n].to_vec(),
                    _ => (0..2)
                        .flat_map(|r| if r == me { &mine } else { &theirs }[me * n..(me + 1) * n].to_vec())
                        .collect(),
                };
                let got = if kind == 3 { &out[..] } else { &out[..n] };
                if got != &want[..] {
                    return Err(format!(
                        "operation {} (kind {kind}, {n} floats): {:?}",
                        done + i,
                        &got[..got.len().min(4)]
                    ));
                }
            }
            done += k;
        }
        Ok(())
    })
}

/// Rank 0 reduces 8 B, rank 1 16 B: each fails naming the collective, within the operation
/// timeout, whether its issue or its wait finds out.
fn mismatch_fails_both_ranks() -> Result<(), Failed> {
    common::two_ranks("eager-mismatch", |me, c: &Communicator| {
        let n = if me == 0 { 2 } else { 4 };
        let mine = input(me, n, 0);
        let mut out = vec![0f32; n];
        let t = Instant::now();
        match wait(c.all_reduce(Some(Buf::host(&mine)), BufMut::host(&mut out), ReduceOp::Sum)) {
            Ok(()) => Err("an all_reduce of 8 B against one of 16 B succeeded".into()),
            Err(e) if e.contains("all_reduce") && t.elapsed() < T => Ok(()),
            Err(e) => Err(format!("after {:?}: {e}", t.elapsed())),
        }
    })
}

fn main() -> std::process::ExitCode {
    // Set before any thread starts (read at every connect): a millisecond's look, not the
    // default 5 us, since a test build's path to the send can take longer than 5 us, and a
    // peer that missed goes the usual, slower, way for its next calls.
    std::env::set_var("ANYCCL_CPU_EAGER_US", "1000");
    // And the worker leaves queued operations to their callers for a second: what goes to
    // the peer at the issue is what the eager path sends (see the pipeline case).
    std::env::set_var("ANYCCL_CPU_HANDOFF_US", "1000000");
    let args = Arguments::from_args();
    let trials = vec![
        Trial::test("cpu::eager::in_step_all_reduce_finishes_at_issue[w=2]", in_step_all_reduce_finishes_at_issue),
        Trial::test("cpu::eager::late_peer_leaves_the_receive_queued[w=2]", late_peer_leaves_the_receive_queued),
        Trial::test("cpu::eager::in_step_others_finish_at_issue[w=2]", in_step_others_finish_at_issue),
        Trial::test("cpu::eager::late_peer_others[w=2]", late_peer_others),
        Trial::test("cpu::eager::pipeline_sends_at_issue[w=2]", pipeline_sends_at_issue),
        Trial::test("cpu::eager::message_before_the_collective[w=2]", message_before_the_collective),
        Trial::test("cpu::eager::mismatch_fails_both_ranks[w=2]", mismatch_fails_both_ranks),
        Trial::test("cpu::eager::reduce_scatter_and_all_to_all[w=2]", reduce_scatter_and_all_to_all),
        Trial::test("cpu::eager::sendrecv[w=2]", sendrecv),
        Trial::test("cpu::eager::mixed_pipeline[w=2]", mixed_pipeline),
    ];
    libtest_mimic::run(&args, trials).exit_code()
}
