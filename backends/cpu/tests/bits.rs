//! reduce_scatter's result is, bit for bit, this rank's chunk of an all_reduce of the same
//! buffer, on either side of the size where both switch from the direct algorithm (folded in
//! rank order) to the ring: floats whose sums depend on the order of the fold, in place and
//! out of place. And a small all_reduce among more than two ranks is the fold in rank order,
//! bit for bit, whether it ran as it was issued or behind a queued operation.

mod common;

use anyccl_core::{Buf, BufMut, ReduceOp};
use libtest_mimic::{Arguments, Failed, Trial};
use std::time::Duration;

const T: Duration = Duration::from_secs(20);

/// Rank `rank`'s input of `n` floats: magnitudes from 1e-3 to 1e5, so that a sum's bits
/// depend on the order of its operands.
fn input(rank: usize, n: usize, round: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = ((rank * 7919 + i * 104_729 + round * 1_299_709) % 1_000_003) as f32;
            let scale = [1e-3f32, 1.0, 1e5][(i + rank) % 3];
            (x - 500_000.0) * scale
        })
        .collect()
}

fn chunk_of_all_reduce(ranks: usize) -> Result<(), Failed> {
    common::ranks(ranks, "bits-rs", move |me, c| {
        // Chunks of 4 B to 4 KiB: whole buffers from below the direct all_reduce's 2 KiB to
        // above it.
        for (round, chunk) in [1usize, 16, 64, 128, 129, 512, 1024].into_iter().enumerate() {
            let whole = input(me, ranks * chunk, round);
            let mut all = vec![0f32; ranks * chunk];
            let w = c.all_reduce(Some(Buf::host(&whole)), BufMut::host(&mut all), ReduceOp::Sum);
            w.and_then(|mut w| w.wait(T)).map_err(|e| e.to_string())?;
            let want = &all[me * chunk..(me + 1) * chunk];
            let mut out = vec![0f32; chunk];
            let w = c.reduce_scatter(Some(Buf::host(&whole)), BufMut::host(&mut out), ReduceOp::Sum);
            w.and_then(|mut w| w.wait(T)).map_err(|e| e.to_string())?;
            let mut inplace = whole.clone();
            let w = c.reduce_scatter(None, BufMut::host(&mut inplace), ReduceOp::Sum);
            w.and_then(|mut w| w.wait(T)).map_err(|e| e.to_string())?;
            for (how, got) in [("out of place", &out[..]), ("in place", &inplace[me * chunk..(me + 1) * chunk])] {
                if let Some(i) = (0..chunk).find(|&i| got[i].to_bits() != want[i].to_bits()) {
                    return Err(format!(
                        "{chunk} floats a chunk ({how}): [{i}] = {:e}, the all_reduce's {:e}",
                        got[i], want[i]
                    ));
                }
            }
        }
        Ok(())
    })
}

/// A small (direct) all_reduce among `ranks` ranks, sum and average, in and out of place,
/// issued alone (so it may run as it is issued) and behind a large one (queued, so it goes the
/// usual way): every result is the fold of the inputs in rank order computed here, bit for bit.
fn small_all_reduce_folds_in_rank_order(ranks: usize) -> Result<(), Failed> {
    common::ranks(ranks, "bits-fold", move |me, c| {
        let big_in = input(me, 1 << 16, 0);
        let mut big_out = vec![0f32; 1 << 16];
        for (round, n) in [1usize, 16, 128, 512].into_iter().enumerate() {
            let mut want = input(0, n, round);
            for r in 1..ranks {
                for (w, x) in want.iter_mut().zip(input(r, n, round)) {
                    *w += x;
                }
            }
            for (op, behind, in_place) in
                (0..8).map(|k| ([ReduceOp::Sum, ReduceOp::Avg][k % 2], k / 2 % 2 == 1, k / 4 == 1))
            {
                let mine = input(me, n, round);
                let mut out = if in_place { mine.clone() } else { vec![0f32; n] };
                let big =
                    behind.then(|| c.all_reduce(Some(Buf::host(&big_in)), BufMut::host(&mut big_out), ReduceOp::Sum));
                let send = (!in_place).then(|| Buf::host(&mine));
                let w = c.all_reduce(send, BufMut::host(&mut out), op);
                w.and_then(|mut w| w.wait(T)).map_err(|e| e.to_string())?;
                if let Some(b) = big {
                    b.and_then(|mut w| w.wait(T)).map_err(|e| e.to_string())?;
                }
                let expect = |i: usize| if op == ReduceOp::Avg { want[i] / ranks as f32 } else { want[i] };
                if let Some(i) = (0..n).find(|&i| out[i].to_bits() != expect(i).to_bits()) {
                    return Err(format!(
                        "{n} floats, {op:?}, {}, {}: [{i}] = {:e}, the fold in rank order {:e}",
                        if behind { "behind a queued all_reduce" } else { "alone" },
                        if in_place { "in place" } else { "out of place" },
                        out[i],
                        expect(i)
                    ));
                }
            }
        }
        Ok(())
    })
}

fn main() -> std::process::ExitCode {
    let args = Arguments::from_args();
    let trials = [2, 3, 4]
        .into_iter()
        .map(|n| {
            Trial::test(format!("cpu::bits::reduce_scatter_is_a_chunk_of_all_reduce[w={n}]"), move || {
                chunk_of_all_reduce(n)
            })
        })
        .chain([3, 4].into_iter().map(|n| {
            Trial::test(format!("cpu::bits::small_all_reduce_folds_in_rank_order[w={n}]"), move || {
                small_all_reduce_folds_in_rank_order(n)
            })
        }))
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}
