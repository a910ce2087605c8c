//! Point-to-point: rings, per-pair ordering, a wait that waits for its own operation only,
//! batched exchanges, pipelines in both directions.

use crate::harness::{CaseResult, RankCtx};
use crate::pattern::{check, round_trip};
use crate::registry::Case;
use anyccl_core::{DType, P2POp};

fn msg(from: usize, to: usize, k: usize, count: usize) -> Vec<f64> {
    (0..count).map(|i| ((from * 11 + to * 5 + k * 3 + i) % 13) as f64).collect()
}

/// Send to the next rank, receive from the previous one, without a batch: even ranks send
/// first, odd ranks receive first, so the chain completes on any backend.
fn ring(cx: &RankCtx) -> CaseResult {
    let (n, me) = (cx.size, cx.rank);
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    for (k, &count) in [1usize, 1000, 70_000].iter().enumerate() {
        let send = cx.upload(DType::F32, &msg(me, next, k, count))?;
        let mut recv = cx.zeros(DType::F32, count)?;
        if me % 2 == 0 {
            cx.wait(cx.comm.send(send.view(), next)?)?;
            cx.wait(cx.comm.recv(recv.view_mut(), prev)?)?;
        } else {
            cx.wait(cx.comm.recv(recv.view_mut(), prev)?)?;
            cx.wait(cx.comm.send(send.view(), next)?)?;
        }
        check(
            &format!("message {k} from rank {prev}"),
            &cx.download(recv.as_ref())?,
            &msg(prev, me, k, count),
            DType::F32,
            None,
        )?;
    }
    Ok(())
}

/// Several messages between each pair (2k, 2k+1) arrive in the order they were sent.
fn ordering(cx: &RankCtx) -> CaseResult {
    let me = cx.rank;
    let peer = me ^ 1;
    if peer >= cx.size {
        return Ok(());
    }
    let sizes = [3usize, 0, 1, 513, 2];
    for (k, &c) in sizes.iter().enumerate() {
        if me.is_multiple_of(2) {
            let send = cx.upload(DType::I32, &msg(me, peer, k, c))?;
            cx.wait(cx.comm.send(send.view(), peer)?)?;
        } else {
            let mut recv = cx.zeros(DType::I32, c)?;
            cx.wait(cx.comm.recv(recv.view_mut(), peer)?)?;
            check(&format!("message {k}"), &cx.download(recv.as_ref())?, &msg(peer, me, k, c), DType::I32, None)?;
        }
    }
    Ok(())
}

/// Every rank sends to and receives from every rank (itself included) in one batch.
fn batched_all_pairs(cx: &RankCtx, dtype: DType) -> CaseResult {
    let (n, me) = (cx.size, cx.rank);
    let count = 257;
    let sends: Vec<_> = (0..n).map(|j| cx.upload(dtype, &msg(me, j, 0, count))).collect::<Result<_, _>>()?;
    let mut recvs: Vec<_> = (0..n).map(|_| cx.zeros(dtype, count)).collect::<Result<_, _>>()?;
    let mut ops = Vec::new();
    for (j, s) in sends.iter().enumerate() {
        ops.push(P2POp::Send(s.view(), j));
    }
    for (i, r) in recvs.iter_mut().enumerate() {
        ops.push(P2POp::Recv(r.view_mut(), i));
    }
    cx.wait(cx.comm.p2p_group(ops)?)?;
    for (i, r) in recvs.iter().enumerate() {
        let want: Vec<f64> = msg(i, me, 0, count).iter().map(|v| round_trip(*v, dtype)).collect();
        check(&format!("from rank {i}"), &cx.download(r.as_ref())?, &want, dtype, None)?;
    }
    Ok(())
}

/// A pipeline: activations forward and gradients backward between neighbouring stages,
/// each step one batch, as a 1F1B schedule issues them.
fn pipeline_both_directions(cx: &RankCtx) -> CaseResult {
    let (n, me) = (cx.size, cx.rank);
    let count = 4099;
    for step in 0..3 {
        let fwd = cx.upload(DType::BF16, &msg(me, me + 1, step, count))?;
        let bwd = cx.upload(DType::BF16, &msg(me, me.saturating_sub(1), step, count))?;
        let mut from_prev = cx.zeros(DType::BF16, count)?;
        let mut from_next = cx.zeros(DType::BF16, count)?;
        let mut ops = Vec::new();
        if me + 1 < n {
            ops.push(P2POp::Send(fwd.view(), me + 1));
            ops.push(P2POp::Recv(from_next.view_mut(), me + 1));
        }
        if me > 0 {
            ops.push(P2POp::Send(bwd.view(), me - 1));
            ops.push(P2POp::Recv(from_prev.view_mut(), me - 1));
        }
        if ops.is_empty() {
            continue;
        }
        cx.wait(cx.comm.p2p_group(ops)?)?;
        let rt = |v: Vec<f64>| v.into_iter().map(|x| round_trip(x, DType::BF16)).collect::<Vec<_>>();
        if me > 0 {
            check(
                &format!("step {step} activations from {}", me - 1),
                &cx.download(from_prev.as_ref())?,
                &rt(msg(me - 1, me, step, count)),
                DType::BF16,
                None,
            )?;
        }
        if me + 1 < n {
            check(
                &format!("step {step} gradients from {}", me + 1),
                &cx.download(from_next.as_ref())?,
                &rt(msg(me + 1, me, step, count)),
                DType::BF16,
                None,
            )?;
        }
    }
    Ok(())
}

/// A wait waits for its own operation, not for one issued after it: rank 0 sends, then
/// posts a receive, then waits for the send and only then lets rank 1 go on; rank 1 receives,
/// waits for rank 0's word, and only then sends what rank 0's receive takes. A wait on the
/// send that also waited for the receive behind it (one completion for both) would block both
/// ranks until the timeout.
fn wait_is_for_its_own_operation(cx: &RankCtx) -> CaseResult {
    let (me, count) = (cx.rank, 1000);
    match me {
        0 => {
            let send = cx.upload(DType::F32, &msg(0, 1, 0, count))?;
            let mut recv = cx.zeros(DType::F32, count)?;
            let sent = cx.comm.send(send.view(), 1)?;
            let received = cx.comm.recv(recv.view_mut(), 1)?;
            cx.wait(sent)?;
            cx.signal("own-operation/sent")?;
            cx.wait(received)?;
            check("the reply from rank 1", &cx.download(recv.as_ref())?, &msg(1, 0, 1, count), DType::F32, None)?;
        }
        1 => {
            let mut recv = cx.zeros(DType::F32, count)?;
            cx.wait(cx.comm.recv(recv.view_mut(), 0)?)?;
            check("the message from rank 0", &cx.download(recv.as_ref())?, &msg(0, 1, 0, count), DType::F32, None)?;
            cx.await_signal("own-operation/sent")?;
            let reply = cx.upload(DType::F32, &msg(1, 0, 1, count))?;
            cx.wait(cx.comm.send(reply.view(), 0)?)?;
        }
        _ => {}
    }
    Ok(())
}

/// Register the point-to-point cases.
pub fn register(v: &mut Vec<Case>) {
    let no_batch = |c: &anyccl_core::Capabilities, _| (!c.p2p_group).then(|| "no batched point-to-point".to_string());
    v.push(Case::new("p2p", "ring_unbatched", &[2, 3, 4, 5, 8], ring));
    v.push(Case::new("p2p", "pair_ordering", &[2, 3, 4, 8], ordering));
    v.push(Case::new("p2p", "wait_is_for_its_own_operation", &[2, 3], wait_is_for_its_own_operation));
    for d in [DType::F32, DType::BF16, DType::U8, DType::F64] {
        v.push(
            Case::new("p2p", format!("batched_all_pairs_{d}"), &[1, 2, 3, 4, 5, 8], move |cx| batched_all_pairs(cx, d))
                .needs(no_batch),
        );
    }
    v.push(Case::new("p2p", "pipeline_both_directions", &[2, 3, 4, 5, 8], pipeline_both_directions).needs(no_batch));
}
