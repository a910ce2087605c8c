//! Small operations among more than two ranks of one host, issued while nothing else is
//! queued, run as they are issued (`comm/eager.rs`): a seeded mix of every kind, and a ring
//! of sendrecvs whose messages go through the rings. Results checked in every case; the
//! two-rank cases are in `eager.rs`.

mod common;

use anyccl_core::{Buf, BufMut, P2POp, ReduceOp};
use common::{input, meet, wait};
use libtest_mimic::{Arguments, Failed, Trial};
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

/// Among `n` ranks, a seeded mix of 1,500 operations, the same on every rank: a ring's step
/// either way (send to the next rank, receive from the one before, or the reverse), a
/// pairwise exchange (ranks 0-1, 2-3, ...; a ring step in an odd world), all_reduce (sum,
/// max and average), broadcast and all_gather (these three in and out of place),
/// reduce_scatter, all_to_all and barrier, 1 float to 4,096 (a
/// rank's part: so some go as they are issued and some the usual way), in batches of 1 to
/// 12 issued
/// back to back and then waited, each rank sleeping up to 300 us before some issues and
/// looking at some operations as it issues them (on its own choice, so the ranks' queues
/// differ): every result right, and some of each kind tried as issued finished at the issue
/// (a look right after it found them done: the usual path's job would not have run yet).
fn ring_mix(n: usize) -> Result<(), Failed> {
    common::ranks(n, &format!("eager-ring-{n}"), move |me, c| {
        let mut shared = 0x9e37_79b9_7f4a_7c15u64 ^ n as u64;
        let mut own = 0x2545_f491_4f6c_dd1du64 ^ (me as u64 + 1);
        let next = |s: &mut u64| {
            *s ^= *s << 13;
            *s ^= *s >> 7;
            *s ^= *s << 17;
            *s
        };
        // (to, from) of a step of this kind on `rank`.
        let peers = |kind: u64, rank: usize| match kind {
            0 => ((rank + 1) % n, (rank + n - 1) % n),
            1 => ((rank + n - 1) % n, (rank + 1) % n),
            _ if n % 2 == 1 => ((rank + 1) % n, (rank + n - 1) % n),
            _ => (rank ^ 1, rank ^ 1),
        };
        let (mut done, mut at_issue, mut p2p, mut gathers, mut reduces, mut others) = (0, 0, 0, 0, 0, 0);
        let mut barriers = 0;
        while done < 1500 {
            let k = 1 + (next(&mut shared) % 12) as usize;
            // (kind, floats, root, variant) for each operation of the batch: the variant
            // picks in place (3 and up) and all_reduce's reduction (sum, max, average).
            let ops: Vec<(u64, usize, usize, u64)> = (0..k)
                .map(|_| {
                    let kind = next(&mut shared) % 9;
                    let len = [1usize, 2, 16, 64, 512, 2048, 4096][(next(&mut shared) % 7) as usize];
                    (kind, len, (next(&mut shared) % n as u64) as usize, next(&mut shared) % 6)
                })
                .collect();
            let reduction = |x: u64| [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg][(x % 3) as usize];
            // all_gather's and all_to_all's outputs, and reduce_scatter's and all_to_all's
            // inputs, hold a part for every rank.
            let each = |kind: u64, len: usize| if kind >= 6 { n * len } else { len };
            let ins: Vec<Vec<f32>> =
                ops.iter().enumerate().map(|(i, &(kind, len, _, _))| input(me, each(kind, len), done + i)).collect();
            let mut outs: Vec<Vec<f32>> = ops
                .iter()
                .map(|&(kind, len, _, _)| vec![0f32; if kind == 5 || kind == 7 { n * len } else { len }])
                .collect();
            let mut works = Vec::with_capacity(k);
            for ((&(kind, len, root, x), src), out) in ops.iter().zip(&ins).zip(outs.iter_mut()) {
                if next(&mut own) % 4 == 0 {
                    std::thread::sleep(Duration::from_micros(next(&mut own) % 300));
                }
                // In place: the input where the output goes (this rank's part of it).
                let in_place = (3..=5).contains(&kind) && x >= 3;
                if in_place {
                    let at = if kind == 5 { me * len } else { 0 };
                    out[at..at + len].copy_from_slice(src);
                }
                let send = (!in_place).then(|| Buf::host(src));
                let w = match kind {
                    0..=2 => {
                        let (to, from) = peers(kind, me);
                        let (s, r) = (P2POp::Send(Buf::host(src), to), P2POp::Recv(BufMut::host(out), from));
                        p2p += 1;
                        c.p2p_group(if root % 2 == 0 { vec![s, r] } else { vec![r, s] })
                    }
                    3 => c.all_reduce(send, BufMut::host(out), reduction(x)),
                    4 => c.broadcast(send, BufMut::host(out), root),
                    5 => c.all_gather(send, BufMut::host(out)),
                    6 => c.reduce_scatter(Some(Buf::host(src)), BufMut::host(out), ReduceOp::Sum),
                    7 => c.all_to_all(Buf::host(src), BufMut::host(out), None),
                    _ => c.barrier(),
                };
                let mut w = w.map_err(|e| format!("operation {done}+: {e}"))?;
                // A look on this rank alone now and then: it has the queue run, and a
                // sendrecv it finds done finished as it was issued.
                if next(&mut own) % 2 == 0 {
                    let finished = w.is_completed().map_err(|e| e.to_string())?;
                    at_issue += usize::from(finished && kind <= 2);
                    gathers += usize::from(finished && kind == 5);
                    reduces += usize::from(finished && (kind == 3 || kind == 6));
                    others += usize::from(finished && (kind == 4 || kind == 7));
                    barriers += usize::from(finished && kind == 8);
                }
                works.push(w);
            }
            for w in works {
                wait(Ok(w))?;
            }
            for (i, (&(kind, len, root, x), out)) in ops.iter().zip(&outs).enumerate() {
                let at = done + i;
                let want: Vec<f32> = match kind {
                    0..=2 => input(peers(kind, me).1, len, at),
                    3 => {
                        let all = |j: usize| (0..n).map(move |r| input(r, len, at)[j]);
                        match reduction(x) {
                            ReduceOp::Max => (0..len).map(|j| all(j).fold(f32::MIN, f32::max)).collect(),
                            ReduceOp::Avg => (0..len).map(|j| all(j).sum::<f32>() / n as f32).collect(),
                            _ => (0..len).map(|j| all(j).sum()).collect(),
                        }
                    }
                    4 => input(root, len, at),
                    5 => (0..n).flat_map(|r| input(r, len, at)).collect(),
                    6 => (0..len).map(|j| (0..n).map(|r| input(r, n * len, at)[me * len + j]).sum()).collect(),
                    7 => (0..n).flat_map(|r| input(r, n * len, at)[me * len..(me + 1) * len].to_vec()).collect(),
                    // A barrier has no buffers: its output stays as it was made.
                    _ => vec![0f32; len],
                };
                if *out != want {
                    let bad = (0..out.len()).find(|&j| out[j] != want[j]).unwrap_or(0);
                    return Err(format!(
                        "operation {at} (kind {kind}, {len} floats): at {bad} {} not {}",
                        out[bad], want[bad]
                    ));
                }
            }
            done += k;
        }
        if at_issue == 0 || gathers == 0 || reduces == 0 || others == 0 || barriers == 0 {
            return Err(format!(
                "{at_issue} of {p2p} sendrecvs, {gathers} all_gathers, {reduces} all_reduces and reduce_scatters, \
                 {others} broadcasts and all_to_alls and {barriers} barriers finished as they were issued"
            ));
        }
        Ok(())
    })
}

/// A ring of sendrecvs among `n` ranks in step, 8-32 KiB each way: every result right, and
/// where the ranks outnumber this process's CPUs (their messages go through the rings up to
/// 32 KiB there, by reference from 64 KiB) some of those above 8 KiB finished as they were
/// issued.
fn ring_sendrecv_through_the_rings(n: usize) -> Result<(), Failed> {
    let arrived = Arc::new(AtomicUsize::new(0));
    let crowded = std::thread::available_parallelism().is_ok_and(|c| n > c.get());
    common::ranks(n, &format!("eager-ring-sendrecv-{n}"), move |me, c| {
        let (to, from) = ((me + 1) % n, (me + n - 1) % n);
        let (mut calls, mut above_8k) = (0usize, 0usize);
        for round in 0..50 {
            for len in [2048usize, 4096, 6144, 8192] {
                let mine = input(me, len, round);
                let mut out = vec![0f32; len];
                meet(&arrived, &mut calls, n);
                let ops = vec![P2POp::Send(Buf::host(&mine), to), P2POp::Recv(BufMut::host(&mut out), from)];
                let mut w = c.p2p_group(ops).map_err(|e| e.to_string())?;
                let finished = w.is_completed().map_err(|e| e.to_string())?;
                above_8k += usize::from(finished && len > 2048);
                wait(Ok(w))?;
                if out != input(from, len, round) {
                    return Err(format!("sendrecv of {len} x f32 from rank {from}, round {round}: {:?}", &out[..4]));
                }
            }
        }
        if crowded && above_8k == 0 {
            return Err(format!("no sendrecv of 16-32 KiB finished as it was issued ({calls} calls)"));
        }
        Ok(())
    })
}

fn main() -> std::process::ExitCode {
    // As in `eager.rs`: a millisecond's look (a test build's path to the send can take longer
    // than the default 5 us), and the worker leaves queued operations to their callers.
    std::env::set_var("ANYCCL_CPU_EAGER_US", "1000");
    std::env::set_var("ANYCCL_CPU_HANDOFF_US", "1000000");
    let args = Arguments::from_args();
    let trials = vec![
        Trial::test("cpu::eager::ring_mix[w=3]", || ring_mix(3)),
        Trial::test("cpu::eager::ring_mix[w=4]", || ring_mix(4)),
        Trial::test("cpu::eager::ring_sendrecv_through_the_rings[w=3]", || ring_sendrecv_through_the_rings(3)),
        Trial::test("cpu::eager::ring_sendrecv_through_the_rings[w=4]", || ring_sendrecv_through_the_rings(4)),
    ];
    libtest_mimic::run(&args, trials).exit_code()
}
