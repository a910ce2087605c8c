//! Sub-groups: splits, non-members, and two communicators in use at once.

use crate::ensure;
use crate::harness::{CaseResult, RankCtx};
use crate::pattern::{check, value, values};
use anyccl_core::{DType, GroupSpec, ReduceOp, Role};

fn sum_over(ranks: &[usize], count: usize, salt: usize) -> Vec<f64> {
    (0..count).map(|i| ranks.iter().map(|&r| value(r, i, None, salt)).sum()).collect()
}

/// Split the world into a lower and an upper half; each half all-reduces on its own.
fn halves(cx: &RankCtx) -> CaseResult {
    let (n, me) = (cx.size, cx.rank);
    let h = n / 2;
    let (name, ranks): (&str, Vec<usize>) =
        if me < h { ("lower", (0..h).collect()) } else { ("upper", (h..n).collect()) };
    let sub = cx
        .block_on(cx.comm.split(Some(GroupSpec::new(name, ranks.clone(), "conformance", Role::Data))))?
        .ok_or("member got no communicator")?;
    ensure!(sub.size() == ranks.len(), "group '{name}' has {} ranks, expected {}", sub.size(), ranks.len());
    ensure!(sub.rank() == ranks.iter().position(|&r| r == me).unwrap_or(usize::MAX), "wrong group rank {}", sub.rank());
    let count = 1000;
    let mut buf = cx.upload(DType::F32, &values(me, count, None, 3))?;
    cx.wait(sub.all_reduce(None, buf.view_mut(), ReduceOp::Sum)?)?;
    check("half all_reduce", &cx.download(buf.as_ref())?, &sum_over(&ranks, count, 3), DType::F32, None)?;
    Ok(())
}

/// Even and odd ranks form groups; a world collective and a group collective are issued
/// back to back and waited on together.
fn two_at_once(cx: &RankCtx) -> CaseResult {
    let (n, me) = (cx.size, cx.rank);
    let ranks: Vec<usize> = (0..n).filter(|r| r % 2 == me % 2).collect();
    let name = if me % 2 == 0 { "even" } else { "odd" };
    let sub = cx
        .block_on(cx.comm.split(Some(GroupSpec::new(name, ranks.clone(), "conformance", Role::Tensor))))?
        .ok_or("no communicator")?;
    let count = 2053;
    for round in 0..3 {
        let mut a = cx.upload(DType::F64, &values(me, count, None, round))?;
        let mut b = cx.upload(DType::F64, &values(me, count, None, round + 10))?;
        let wa = cx.comm.all_reduce(None, a.view_mut(), ReduceOp::Sum)?;
        let wb = sub.all_reduce(None, b.view_mut(), ReduceOp::Sum)?;
        cx.wait(wb)?;
        cx.wait(wa)?;
        check(
            "world",
            &cx.download(a.as_ref())?,
            &sum_over(&(0..n).collect::<Vec<_>>(), count, round),
            DType::F64,
            None,
        )?;
        check("group", &cx.download(b.as_ref())?, &sum_over(&ranks, count, round + 10), DType::F64, None)?;
    }
    Ok(())
}

/// Only ranks 0 and 1 form a group; the others pass no spec and get none; the world still
/// works afterwards.
fn non_members(cx: &RankCtx) -> CaseResult {
    let me = cx.rank;
    let spec = (me < 2).then(|| GroupSpec::new("pair", vec![0, 1], "conformance", Role::Pipeline));
    let sub = cx.block_on(cx.comm.split(spec))?;
    ensure!(sub.is_some() == (me < 2), "rank {me}: membership {}", sub.is_some());
    if let Some(sub) = sub {
        let mut b = cx.upload(DType::I32, &values(me, 5, None, 0))?;
        cx.wait(sub.all_reduce(None, b.view_mut(), ReduceOp::Max)?)?;
    }
    let mut w = cx.upload(DType::I32, &values(me, 9, None, 1))?;
    cx.wait(cx.comm.all_reduce(None, w.view_mut(), ReduceOp::Sum)?)?;
    check(
        "world after split",
        &cx.download(w.as_ref())?,
        &sum_over(&(0..cx.size).collect::<Vec<_>>(), 9, 1),
        DType::I32,
        None,
    )?;
    Ok(())
}

/// Split a split: data groups, then pairs inside each data group.
fn nested(cx: &RankCtx) -> CaseResult {
    let (n, me) = (cx.size, cx.rank);
    let dp: Vec<usize> = if me < n / 2 { (0..n / 2).collect() } else { (n / 2..n).collect() };
    let dpc = cx
        .block_on(cx.comm.split(Some(GroupSpec::new(format!("dp{}", dp[0]), dp.clone(), "conformance", Role::Data))))?
        .ok_or("no dp communicator")?;
    let r = dpc.rank();
    let pair: Vec<usize> = vec![r & !1, (r & !1) + 1].into_iter().filter(|&x| x < dpc.size()).collect();
    let inner = cx
        .block_on(dpc.split(Some(GroupSpec::new(
            format!("pair{}-{}", dp[0], pair[0]),
            pair.clone(),
            "conformance",
            Role::Tensor,
        ))))?
        .ok_or("no inner communicator")?;
    let mut b = cx.upload(DType::F32, &[me as f64])?;
    cx.wait(inner.all_reduce(None, b.view_mut(), ReduceOp::Sum)?)?;
    let want: f64 = pair.iter().map(|&x| dp[x] as f64).sum();
    check("nested pair sum", &cx.download(b.as_ref())?, &[want], DType::F32, None)?;
    Ok(())
}

/// Register the group cases.
pub fn register(v: &mut Vec<crate::registry::Case>) {
    use crate::registry::Case;
    let split = |c: &anyccl_core::Capabilities, _| (!c.split).then(|| "backend cannot split".to_string());
    v.push(Case::new("groups", "split_halves", &[2, 3, 4, 5, 8], halves).needs(split));
    v.push(Case::new("groups", "two_groups_at_once", &[2, 3, 4, 5, 8], two_at_once).needs(split));
    v.push(Case::new("groups", "split_non_members", &[2, 3, 4, 8], non_members).needs(split));
    v.push(Case::new("groups", "split_nested", &[4, 8], nested).needs(split));
}
