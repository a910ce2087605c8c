//! The communicator's worker thread stays asleep while callers run their own operations: a
//! program with a few operations in flight, each waited for in turn, runs them in its waits,
//! and the worker, which would only take a rank's CPU, is not woken for each enqueue.

mod common;

use anyccl_core::{Buf, BufMut, Communicator, ReduceOp, Work};
use common::T;
use libtest_mimic::{Arguments, Failed, Trial};
use std::sync::Arc;
use std::time::Instant;

/// Voluntary context switches of this process's worker threads (`anyccl-cpu-<rank>`), in all.
fn worker_sleeps() -> Result<u64, String> {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task").map_err(|e| e.to_string())? {
        let dir = task.map_err(|e| e.to_string())?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let name = comm.trim();
        if !name.strip_prefix("anyccl-cpu-").is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit())) {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
        let n = status.lines().find_map(|l| l.strip_prefix("voluntary_ctxt_switches:")).unwrap_or("0");
        total += n.trim().parse::<u64>().unwrap_or(0);
    }
    Ok(total)
}

/// `calls` all_reduces of 16,384 floats (64 KiB), `depth` issued, then waited in turn.
fn run(c: &Communicator, calls: usize, depth: usize) -> Result<(), String> {
    let input = vec![1f32; 16384];
    let mut outs = vec![vec![0f32; 16384]; depth];
    for _ in 0..calls / depth {
        let works: Vec<Work<'_>> = outs
            .iter_mut()
            .map(|o| c.all_reduce(Some(Buf::host(&input)), BufMut::host(o), ReduceOp::Sum))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        for mut w in works {
            w.wait(T).map_err(|e| e.to_string())?;
        }
        if outs.iter().any(|o| o.iter().any(|&x| x != 2.0)) {
            return Err("a sum of two ones is not two".into());
        }
    }
    Ok(())
}

/// 2 ranks, 64 KiB all_reduce four in flight: the workers slept fewer times than one in ten
/// calls and two a quarter of the hand-off grace (500 us) of the run, the looks a worker
/// takes on its own while jobs are queued. When an enqueue behind a job left to its caller
/// woke the worker, it slept about once a call (36,000 times a second).
fn pipelined_calls_leave_the_worker_asleep() -> Result<(), Failed> {
    let got = Arc::new(std::sync::Mutex::new(None));
    let seen = got.clone();
    let calls = 4000;
    common::two_ranks("worker-asleep", move |me, c| {
        run(c, 200, 4)?;
        c.barrier().and_then(|mut b| b.wait(T)).map_err(|e| e.to_string())?;
        let before = if me == 0 { worker_sleeps()? } else { 0 };
        let t = Instant::now();
        run(c, calls, 4)?;
        c.barrier().and_then(|mut b| b.wait(T)).map_err(|e| e.to_string())?;
        if me == 0 {
            *seen.lock().map_err(|_| "poisoned")? = Some((worker_sleeps()? - before, t.elapsed()));
        }
        Ok(())
    })?;
    let Some((n, took)) = *got.lock().map_err(|_| "poisoned")? else { return Err("rank 0 measured nothing".into()) };
    let allowed = calls as u64 / 10 + 2 * (took.as_micros() as u64 / 250);
    if n >= allowed {
        return Err(
            format!("the two workers slept {n} times in {calls} calls each ({took:?}; {allowed} allowed)").into()
        );
    }
    Ok(())
}

/// 2 ranks: after a pipeline (callers running the queue in their waits, so that an enqueue
/// no longer wakes the worker), rank 0 issues an all_reduce and does not wait for it for 2 s;
/// rank 1's wait for the same all_reduce needs rank 0's part, which only rank 0's worker can
/// run: it must end long before rank 0 comes back (the worker still looks on its own).
fn a_job_nobody_waits_for_runs_after_a_pipeline() -> Result<(), Failed> {
    common::two_ranks("worker-unwaited", move |me, c| {
        run(c, 400, 4)?;
        c.barrier().and_then(|mut b| b.wait(T)).map_err(|e| e.to_string())?;
        let input = vec![1f32; 16384];
        let mut out = vec![0f32; 16384];
        let t = Instant::now();
        let mut w =
            c.all_reduce(Some(Buf::host(&input)), BufMut::host(&mut out), ReduceOp::Sum).map_err(|e| e.to_string())?;
        if me == 0 {
            std::thread::sleep(std::time::Duration::from_secs(2));
        }
        w.wait(T).map_err(|e| e.to_string())?;
        let took = t.elapsed();
        drop(w);
        if out.iter().any(|&x| x != 2.0) {
            return Err("a sum of two ones is not two".into());
        }
        if me == 1 && took >= std::time::Duration::from_secs(1) {
            return Err(format!("rank 1 waited {took:?}: rank 0's worker did not run the all_reduce that rank 0 left"));
        }
        Ok(())
    })
}

fn main() -> std::process::ExitCode {
    let args = Arguments::from_args();
    let trials = vec![
        Trial::test(
            "cpu::worker::pipelined_calls_leave_the_worker_asleep[w=2]",
            pipelined_calls_leave_the_worker_asleep,
        ),
        Trial::test(
            "cpu::worker::a_job_nobody_waits_for_runs_after_a_pipeline[w=2]",
            a_job_nobody_waits_for_runs_after_a_pipeline,
        ),
    ];
    libtest_mimic::run(&args, trials).exit_code()
}
