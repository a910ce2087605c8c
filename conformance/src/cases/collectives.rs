//! all_reduce, reduce, broadcast, all_gather, reduce_scatter, all_to_all and barrier:
//! every dtype, every reduce op, in and out of place, sizes from 0 to 4 MiB.

use super::{four_mib, need_dtype, need_op, SIZES};
use crate::ensure;
use crate::harness::{CaseResult, RankCtx};
use crate::pattern::{check, reduced, values};
use crate::registry::{Case, DEFAULT_WORLDS};
use anyccl_core::{AllToAllSplits, DType, ReduceOp};
use std::time::Duration;

fn all_reduce(cx: &RankCtx, dtype: DType, op: ReduceOp, sizes: &[usize]) -> CaseResult {
    let n = cx.size;
    for (salt, &count) in sizes.iter().enumerate() {
        let input = values(cx.rank, count, Some(op), salt);
        let want: Vec<f64> = (0..count).map(|i| reduced(n, i, dtype, op, salt)).collect();
        let send = cx.upload(dtype, &input)?;
        let mut recv = cx.zeros(dtype, count)?;
        cx.wait(cx.comm.all_reduce(Some(send.view()), recv.view_mut(), op)?)?;
        check(&format!("out-of-place, {count} elements"), &cx.download(recv.as_ref())?, &want, dtype, Some(op))?;
        check(
            &format!("send buffer after the op, {count} elements"),
            &cx.download(send.as_ref())?,
            &input.iter().map(|v| crate::pattern::round_trip(*v, dtype)).collect::<Vec<_>>(),
            dtype,
            None,
        )?;
        let mut buf = cx.upload(dtype, &input)?;
        cx.wait(cx.comm.all_reduce(None, buf.view_mut(), op)?)?;
        check(&format!("in place, {count} elements"), &cx.download(buf.as_ref())?, &want, dtype, Some(op))?;
    }
    Ok(())
}

fn reduce(cx: &RankCtx, dtype: DType, op: ReduceOp) -> CaseResult {
    let n = cx.size;
    let roots: Vec<usize> = if n > 1 { vec![0, n - 1] } else { vec![0] };
    for root in roots {
        for (salt, &count) in SIZES.iter().enumerate() {
            let input = values(cx.rank, count, Some(op), salt);
            let send = cx.upload(dtype, &input)?;
            let mut recv = cx.zeros(dtype, count)?;
            cx.wait(cx.comm.reduce(Some(send.view()), recv.view_mut(), op, root)?)?;
            let got = cx.download(recv.as_ref())?;
            if cx.rank == root {
                let want: Vec<f64> = (0..count).map(|i| reduced(n, i, dtype, op, salt)).collect();
                check(&format!("root {root}, {count} elements"), &got, &want, dtype, Some(op))?;
            } else {
                check(&format!("non-root recv untouched, root {root}"), &got, &vec![0.0; count], dtype, None)?;
            }
        }
    }
    Ok(())
}

fn broadcast(cx: &RankCtx, dtype: DType, in_place: bool) -> CaseResult {
    let n = cx.size;
    let roots: Vec<usize> = if n > 1 { vec![0, n / 2, n - 1] } else { vec![0] };
    for root in roots {
        for (salt, &count) in SIZES.iter().enumerate() {
            let data = values(root, count, None, salt);
            let want: Vec<f64> = data.iter().map(|v| crate::pattern::round_trip(*v, dtype)).collect();
            let got = if in_place {
                let mut buf = if cx.rank == root { cx.upload(dtype, &data)? } else { cx.zeros(dtype, count)? };
                cx.wait(cx.comm.broadcast(None, buf.view_mut(), root)?)?;
                cx.download(buf.as_ref())?
            } else {
                let send = if cx.rank == root { cx.upload(dtype, &data)? } else { cx.zeros(dtype, count)? };
                let mut recv = cx.zeros(dtype, count)?;
                cx.wait(cx.comm.broadcast(Some(send.view()), recv.view_mut(), root)?)?;
                cx.download(recv.as_ref())?
            };
            check(&format!("root {root}, {count} elements"), &got, &want, dtype, None)?;
        }
    }
    Ok(())
}

fn all_gather(cx: &RankCtx, dtype: DType, in_place: bool, sizes: &[usize]) -> CaseResult {
    let n = cx.size;
    for (salt, &c) in sizes.iter().enumerate() {
        let want: Vec<f64> =
            (0..n).flat_map(|r| values(r, c, None, salt)).map(|v| crate::pattern::round_trip(v, dtype)).collect();
        let mine = values(cx.rank, c, None, salt);
        let got = if in_place {
            let mut init = vec![0.0; n * c];
            init[cx.rank * c..(cx.rank + 1) * c].copy_from_slice(&mine);
            let mut buf = cx.upload(dtype, &init)?;
            cx.wait(cx.comm.all_gather(None, buf.view_mut())?)?;
            cx.download(buf.as_ref())?
        } else {
            let send = cx.upload(dtype, &mine)?;
            let mut recv = cx.zeros(dtype, n * c)?;
            cx.wait(cx.comm.all_gather(Some(send.view()), recv.view_mut())?)?;
            cx.download(recv.as_ref())?
        };
        check(&format!("{c} elements per rank"), &got, &want, dtype, None)?;
    }
    Ok(())
}

fn reduce_scatter(cx: &RankCtx, dtype: DType, op: ReduceOp, in_place: bool, sizes: &[usize]) -> CaseResult {
    let (n, me) = (cx.size, cx.rank);
    for (salt, &c) in sizes.iter().enumerate() {
        let input = values(me, n * c, Some(op), salt);
        let want: Vec<f64> = (0..c).map(|i| reduced(n, me * c + i, dtype, op, salt)).collect();
        let got = if in_place {
            let mut buf = cx.upload(dtype, &input)?;
            cx.wait(cx.comm.reduce_scatter(None, buf.view_mut(), op)?)?;
            cx.download(buf.as_ref())?[me * c..(me + 1) * c].to_vec()
        } else {
            let send = cx.upload(dtype, &input)?;
            let mut recv = cx.zeros(dtype, c)?;
            cx.wait(cx.comm.reduce_scatter(Some(send.view()), recv.view_mut(), op)?)?;
            cx.download(recv.as_ref())?
        };
        check(&format!("{c} elements per rank"), &got, &want, dtype, Some(op))?;
    }
    Ok(())
}

/// Element `i` of what `from` sends to `to`.
fn a2a_value(from: usize, to: usize, i: usize) -> f64 {
    ((from * 5 + to * 3 + i) % 7 + 1) as f64
}

fn all_to_all(cx: &RankCtx, dtype: DType, explicit: bool) -> CaseResult {
    let (n, me) = (cx.size, cx.rank);
    // Counts per peer; the last, with explicit splits, gives rank 0 only small segments and
    // the other ranks large ones between them (a backend may choose per rank by size: here
    // the choices differ within one call).
    const MIXED: usize = usize::MAX;
    let counts: &[usize] = if explicit { &[0, 1, 7, 130, 4100, MIXED] } else { &[0, 1, 7, 130, 4100] };
    for &c in counts {
        let count_to = |from: usize, to: usize| match (explicit, c) {
            (true, MIXED) if from != 0 && to != 0 && from != to => 4100,
            (true, MIXED) => 3,
            (true, _) => c + (from + 2 * to) % 3,
            (false, _) => c,
        };
        let send_counts: Vec<usize> = (0..n).map(|j| count_to(me, j)).collect();
        let recv_counts: Vec<usize> = (0..n).map(|i| count_to(i, me)).collect();
        let send_vals: Vec<f64> = (0..n).flat_map(|j| (0..send_counts[j]).map(move |i| a2a_value(me, j, i))).collect();
        let want: Vec<f64> = (0..n)
            .flat_map(|i| (0..recv_counts[i]).map(move |k| a2a_value(i, me, k)))
            .map(|v| crate::pattern::round_trip(v, dtype))
            .collect();
        let send = cx.upload(dtype, &send_vals)?;
        let mut recv = cx.zeros(dtype, want.len())?;
        let splits = AllToAllSplits { send_counts, recv_counts };
        let sp = explicit.then_some(&splits);
        cx.wait(cx.comm.all_to_all(send.view(), recv.view_mut(), sp)?)?;
        let what = if c == MIXED { "mixed small and large segments".into() } else { format!("{c} elements per peer") };
        check(&what, &cx.download(recv.as_ref())?, &want, dtype, None)?;
    }
    Ok(())
}

/// Rank 0 enters each round 100 ms late and says so (through the store) just before: no
/// other rank may leave the barrier without seeing that (an order, not a time, so a loaded
/// machine cannot fail it).
fn barrier(cx: &RankCtx) -> CaseResult {
    for round in 0..3 {
        let entered = format!("barrier-entered-{round}");
        if cx.rank == 0 {
            std::thread::sleep(Duration::from_millis(100));
            cx.signal(&entered)?;
        }
        cx.wait(cx.comm.barrier()?)?;
        ensure!(
            cx.rank == 0 || cx.signalled(&entered)?,
            "round {round}: barrier returned before rank 0 (delayed 100 ms) entered it"
        );
    }
    Ok(())
}

/// Register the collective cases.
pub fn register(v: &mut Vec<Case>) {
    for &op in &ReduceOp::ALL {
        for &d in &DType::ALL {
            v.push(
                Case::new("all_reduce", format!("{}_{}", op, d), DEFAULT_WORLDS, move |cx| {
                    all_reduce(cx, d, op, SIZES)
                })
                .needs(move |c, _| need_op(c, d, op)),
            );
        }
    }
    for d in [DType::F32, DType::BF16] {
        v.push(
            Case::new("all_reduce", format!("sum_{d}_4mib"), &[2, 3, 4], move |cx| {
                all_reduce(cx, d, ReduceOp::Sum, &[four_mib(d)])
            })
            .needs(move |c, _| need_op(c, d, ReduceOp::Sum)),
        );
    }
    for &op in &ReduceOp::ALL {
        for d in [DType::F32, DType::BF16, DType::I32, DType::U8] {
            v.push(
                Case::new("reduce", format!("{op}_{d}"), DEFAULT_WORLDS, move |cx| reduce(cx, d, op))
                    .needs(move |c, _| need_op(c, d, op)),
            );
        }
    }
    for &d in &DType::ALL {
        v.push(
            Case::new("broadcast", format!("{d}"), DEFAULT_WORLDS, move |cx| broadcast(cx, d, false))
                .needs(move |c, _| need_dtype(c, d)),
        );
        v.push(
            Case::new("all_gather", format!("{d}"), DEFAULT_WORLDS, move |cx| all_gather(cx, d, false, SIZES))
                .needs(move |c, _| need_dtype(c, d)),
        );
        v.push(
            Case::new("reduce_scatter", format!("sum_{d}"), DEFAULT_WORLDS, move |cx| {
                reduce_scatter(cx, d, ReduceOp::Sum, false, SIZES)
            })
            .needs(move |c, _| need_op(c, d, ReduceOp::Sum)),
        );
        v.push(
            Case::new("all_to_all", format!("equal_{d}"), DEFAULT_WORLDS, move |cx| all_to_all(cx, d, false))
                .needs(move |c, _| need_dtype(c, d).or_else(|| (!c.all_to_all).then(|| "no all_to_all".into()))),
        );
    }
    v.push(Case::new("broadcast", "in_place_f32", DEFAULT_WORLDS, |cx| broadcast(cx, DType::F32, true)));
    v.push(Case::new("all_gather", "in_place_f32", DEFAULT_WORLDS, |cx| all_gather(cx, DType::F32, true, SIZES)));
    v.push(Case::new("all_gather", "f32_4mib", &[2, 3, 4], |cx| {
        all_gather(cx, DType::F32, false, &[four_mib(DType::F32) / cx.size])
    }));
    for &op in &[ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg] {
        for d in [DType::F32, DType::BF16, DType::I64] {
            v.push(
                Case::new("reduce_scatter", format!("{op}_{d}"), DEFAULT_WORLDS, move |cx| {
                    reduce_scatter(cx, d, op, false, SIZES)
                })
                .needs(move |c, _| need_op(c, d, op)),
            );
        }
    }
    v.push(Case::new("reduce_scatter", "in_place_f32", DEFAULT_WORLDS, |cx| {
        reduce_scatter(cx, DType::F32, ReduceOp::Sum, true, SIZES)
    }));
    v.push(Case::new("reduce_scatter", "f32_4mib", &[2, 3, 4], |cx| {
        reduce_scatter(cx, DType::F32, ReduceOp::Sum, false, &[four_mib(DType::F32) / cx.size])
    }));
    for d in [DType::F32, DType::BF16, DType::I8] {
        v.push(
            Case::new("all_to_all", format!("splits_{d}"), DEFAULT_WORLDS, move |cx| all_to_all(cx, d, true)).needs(
                move |c, _| {
                    need_dtype(c, d).or_else(|| (!c.all_to_all_v).then(|| "no all_to_all with explicit splits".into()))
                },
            ),
        );
    }
    v.push(Case::new("barrier", "orders_ranks", DEFAULT_WORLDS, barrier));
}
