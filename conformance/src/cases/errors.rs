//! Invalid arguments are rejected with `InvalidArgument` naming the argument, the rank and
//! the group, before any communication: the operation counter does not move and the
//! communicator keeps working.

use crate::ensure;
use crate::harness::{CaseError, CaseResult, RankCtx};
use crate::pattern::values;
use crate::registry::Case;
use anyccl_core::{AllToAllSplits, DType, Error, GroupSpec, ReduceOp, Role, Work};

fn expect_invalid(cx: &RankCtx, what: &str, r: Result<Work<'_>, Error>, arg: &str) -> CaseResult {
    match r {
        Ok(_) => Err(CaseError(format!("{what}: accepted, expected InvalidArgument for `{arg}`"))),
        Err(Error::InvalidArgument { arg: a, rank, group, msg, .. }) => {
            ensure!(a == arg, "{what}: error names `{a}`, expected `{arg}` ({msg})");
            ensure!(rank == cx.rank, "{what}: error names rank {rank}, this is rank {}", cx.rank);
            ensure!(group == cx.comm.spec().name, "{what}: error names group '{group}'");
            Ok(())
        }
        Err(e) => Err(CaseError(format!("{what}: {} error, expected InvalidArgument: {e}", e.kind()))),
    }
}

/// Run `bad` (which must only issue rejected calls), then check nothing was issued and the
/// communicator still works.
fn rejected(cx: &RankCtx, bad: impl FnOnce(&RankCtx) -> CaseResult) -> CaseResult {
    let before = cx.comm.issued();
    bad(cx)?;
    ensure!(cx.comm.issued() == before, "{} operations were issued by rejected calls", cx.comm.issued() - before);
    let mut b = cx.upload(DType::F32, &values(cx.rank, 3, None, 0))?;
    cx.wait(cx.comm.all_reduce(None, b.view_mut(), ReduceOp::Sum)?)?;
    Ok(())
}

fn counts(cx: &RankCtx) -> CaseResult {
    rejected(cx, |cx| {
        let s = cx.zeros(DType::F32, 4)?;
        let mut r = cx.zeros(DType::F32, 5)?;
        expect_invalid(
            cx,
            "all_reduce 4 -> 5",
            cx.comm.all_reduce(Some(s.view()), r.view_mut(), ReduceOp::Sum),
            "recv",
        )?;
        expect_invalid(cx, "broadcast 4 -> 5", cx.comm.broadcast(Some(s.view()), r.view_mut(), 0), "recv")?;
        let mut big = cx.zeros(DType::F32, 4 * cx.size + 1)?;
        expect_invalid(cx, "all_gather wrong recv", cx.comm.all_gather(Some(s.view()), big.view_mut()), "recv")?;
        Ok(())
    })
}

fn dtypes(cx: &RankCtx) -> CaseResult {
    rejected(cx, |cx| {
        let s = cx.zeros(DType::F32, 4)?;
        let mut r = cx.zeros(DType::I32, 4)?;
        expect_invalid(cx, "f32 -> i32", cx.comm.all_reduce(Some(s.view()), r.view_mut(), ReduceOp::Sum), "send")
    })
}

fn not_divisible(cx: &RankCtx) -> CaseResult {
    rejected(cx, |cx| {
        let n = cx.size;
        let s = cx.zeros(DType::BF16, 3 * n + 1)?;
        let mut r = cx.zeros(DType::BF16, 3)?;
        expect_invalid(
            cx,
            "reduce_scatter send not size x recv",
            cx.comm.reduce_scatter(Some(s.view()), r.view_mut(), ReduceOp::Sum),
            "send",
        )?;
        let mut ip = cx.zeros(DType::BF16, 3 * n + 1)?;
        expect_invalid(
            cx,
            "reduce_scatter in place not divisible",
            cx.comm.reduce_scatter(None, ip.view_mut(), ReduceOp::Sum),
            "recv",
        )?;
        expect_invalid(cx, "all_gather in place not divisible", cx.comm.all_gather(None, ip.view_mut()), "recv")?;
        let a = cx.zeros(DType::BF16, 3 * n + 1)?;
        let mut b = cx.zeros(DType::BF16, 3 * n + 1)?;
        expect_invalid(cx, "all_to_all not divisible", cx.comm.all_to_all(a.view(), b.view_mut(), None), "send")?;
        Ok(())
    })
}

fn splits(cx: &RankCtx) -> CaseResult {
    rejected(cx, |cx| {
        let n = cx.size;
        let a = cx.zeros(DType::F32, n)?;
        let mut b = cx.zeros(DType::F32, n)?;
        let short = AllToAllSplits { send_counts: vec![1; n.saturating_sub(1)], recv_counts: vec![1; n] };
        expect_invalid(cx, "splits too short", cx.comm.all_to_all(a.view(), b.view_mut(), Some(&short)), "splits")?;
        let mut wrong = AllToAllSplits { send_counts: vec![1; n], recv_counts: vec![1; n] };
        wrong.send_counts[0] += 1;
        expect_invalid(cx, "splits do not add up", cx.comm.all_to_all(a.view(), b.view_mut(), Some(&wrong)), "splits")?;
        // Sums match, but this rank would send itself 2 elements and expect 1.
        let other = (cx.rank + 1) % n;
        let mut selfish = AllToAllSplits { send_counts: vec![1; n], recv_counts: vec![1; n] };
        selfish.send_counts[cx.rank] = 2;
        selfish.send_counts[other] = 0;
        expect_invalid(
            cx,
            "self split mismatch",
            cx.comm.all_to_all(a.view(), b.view_mut(), Some(&selfish)),
            "splits",
        )?;
        Ok(())
    })
}

fn ranks(cx: &RankCtx) -> CaseResult {
    rejected(cx, |cx| {
        let n = cx.size;
        let s = cx.zeros(DType::F32, 4)?;
        let mut r = cx.zeros(DType::F32, 4)?;
        expect_invalid(cx, "broadcast root = size", cx.comm.broadcast(None, r.view_mut(), n), "root")?;
        expect_invalid(
            cx,
            "reduce root beyond size",
            cx.comm.reduce(Some(s.view()), r.view_mut(), ReduceOp::Sum, n + 3),
            "root",
        )?;
        expect_invalid(cx, "send peer = size", cx.comm.send(s.view(), n), "peer")?;
        expect_invalid(cx, "recv peer beyond size", cx.comm.recv(r.view_mut(), n + 7), "peer")?;
        expect_invalid(cx, "send to self", cx.comm.send(s.view(), cx.rank), "peer")?;
        expect_invalid(
            cx,
            "p2p_group peer = size",
            cx.comm.p2p_group(vec![anyccl_core::P2POp::Send(s.view(), n)]),
            "peer",
        )?;
        expect_invalid(cx, "empty p2p_group", cx.comm.p2p_group(vec![]), "ops")?;
        expect_invalid(
            cx,
            "unmatched receive from self",
            cx.comm.p2p_group(vec![anyccl_core::P2POp::Recv(r.view_mut(), cx.rank)]),
            "ops",
        )?;
        Ok(())
    })
}

fn unsupported(cx: &RankCtx) -> CaseResult {
    let caps = cx.comm.capabilities().clone();
    rejected(cx, |cx| {
        if let Some(&d) = DType::ALL.iter().find(|d| !caps.supports_dtype(**d)) {
            let mut r = cx.zeros(d, 4)?;
            expect_invalid(cx, "unsupported dtype", cx.comm.all_reduce(None, r.view_mut(), ReduceOp::Sum), "recv")?;
        }
        if let Some(&op) = ReduceOp::ALL.iter().find(|o| !caps.supports_reduce_op(**o)) {
            let mut r = cx.zeros(DType::F32, 4)?;
            expect_invalid(cx, "unsupported op", cx.comm.all_reduce(None, r.view_mut(), op), "op")?;
        }
        Ok(())
    })
}

fn bad_specs(cx: &RankCtx) -> CaseResult {
    let n = cx.size;
    let me = cx.rank;
    let before = cx.comm.issued();
    let others: Vec<usize> = (0..n).filter(|&r| r != me).collect();
    let cases = [
        ("not a member", GroupSpec::new("g", others, "conformance", Role::Data)),
        ("repeated rank", GroupSpec::new("g", vec![me, me], "conformance", Role::Data)),
        ("rank out of range", GroupSpec::new("g", vec![me, n], "conformance", Role::Data)),
        ("no name", GroupSpec::new("", vec![me], "conformance", Role::Data)),
    ];
    for (what, spec) in cases {
        match cx.block_on(cx.comm.split(Some(spec))) {
            Err(Error::InvalidArgument { arg, rank, .. }) => {
                ensure!(arg == "spec" && rank == me, "{what}: error names `{arg}` on rank {rank}");
            }
            Err(e) => return Err(CaseError(format!("{what}: {} error, expected InvalidArgument: {e}", e.kind()))),
            Ok(_) => return Err(CaseError(format!("{what}: split accepted"))),
        }
    }
    ensure!(cx.comm.issued() == before, "rejected splits issued operations");
    Ok(())
}

/// Members of one group pass different specs: every member gets `InvalidArgument`.
fn spec_mismatch(cx: &RankCtx) -> CaseResult {
    let name = if cx.rank == 0 { "a" } else { "b" };
    match cx.block_on(cx.comm.split(Some(GroupSpec::new(name, vec![0, 1], "conformance", Role::Data)))) {
        Err(Error::InvalidArgument { arg: "spec", msg, .. }) => {
            ensure!(msg.contains("different specs"), "message does not say the specs differ: {msg}");
            Ok(())
        }
        Err(e) => Err(CaseError(format!("{} error, expected InvalidArgument: {e}", e.kind()))),
        Ok(_) => Err("mismatched specs accepted".into()),
    }
}

/// Register the error cases.
pub fn register(v: &mut Vec<Case>) {
    let w = &[1, 2, 3, 4, 5, 8];
    v.push(Case::new("errors", "count_mismatch", w, counts));
    v.push(Case::new("errors", "dtype_mismatch", w, dtypes));
    v.push(Case::new("errors", "not_divisible", &[2, 3, 4, 5, 8], not_divisible));
    v.push(
        Case::new("errors", "all_to_all_splits", &[2, 3, 4, 5, 8], splits)
            .needs(|c, _| (!c.all_to_all_v).then(|| "no all_to_all with explicit splits".into())),
    );
    v.push(Case::new("errors", "rank_out_of_range", w, ranks));
    v.push(Case::new("errors", "unsupported_dtype_or_op", &[2], unsupported).needs(|c, _| {
        let all =
            DType::ALL.iter().all(|d| c.supports_dtype(*d)) && ReduceOp::ALL.iter().all(|o| c.supports_reduce_op(*o));
        all.then(|| "backend supports every dtype and reduce op; nothing to reject".to_string())
    }));
    v.push(Case::new("errors", "bad_group_spec", &[1, 2, 3], bad_specs));
    v.push(
        Case::new("errors", "group_spec_mismatch", &[2], spec_mismatch)
            .needs(|c, _| (!c.split).then(|| "backend cannot split".into())),
    );
}
