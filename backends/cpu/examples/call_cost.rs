//! What a small operation costs the host on the CPU backend when nothing is sent: a world of
//! one rank, so each call is the per-call path alone (the `Communicator`'s validation,
//! sequence number and flight recorder; the backend's queue, `Work` and wait) and a copy of
//! its bytes. Rows through the `Communicator`, as a program calls it, and of the backend's
//! `Collective` called directly (no validation, no flight recorder): the difference is the
//! `Communicator`'s share. A wait at least as long as the operation timeout runs the
//! operation on the caller's thread; a shorter one hands it to the communicator's worker
//! thread (the last two rows: the hand-over's cost).
//!
//! `cargo run --release -p anyccl-cpu --example call_cost [CALLS] [BYTES] [long]` prints nanoseconds
//! per call (issue, then wait), the median of 9 runs of CALLS calls (default 200000; a
//! hundredth of them for the shorter waits) of an all_reduce of BYTES bytes (default 8);
//! `long` leaves out the shorter waits (for a profile of the caller's own path).

use anyccl_core::{Backend, CommConfig, Communicator, Ctx, DType, GroupSpec, ReduceOp, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let ctx = Ctx::process("call_cost");
    // Each argument given is a whole number of 1 up to its bound, or the program says which
    // one is not (`args_os`: one that is not UTF-8 is an error too, not a panic).
    let arg = |i: usize, name: &'static str, default: usize, most: usize| -> Result<usize> {
        let Some(a) = std::env::args_os().nth(i) else { return Ok(default) };
        match a.to_str().and_then(|t| t.parse::<usize>().ok()) {
            Some(v) if (1..=most).contains(&v) => Ok(v),
            _ => Err(ctx.invalid(
                "main",
                name,
                format!("'{}' is not a whole number from 1 to {most}", a.to_string_lossy()),
            )),
        }
    };
    let (calls, bytes) = (arg(1, "CALLS", 200_000, 100_000_000)?, arg(2, "BYTES", 8, 64 << 20)?);
    // `long`: the first two rows only (a profile of the caller's own path, no worker).
    let long_only = match std::env::args_os().nth(3) {
        None => false,
        Some(a) if a == "long" => true,
        Some(a) => {
            return Err(ctx.invalid("main", "PATTERN", format!("'{}': only `long` is known", a.to_string_lossy())))
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ctx.io("start a tokio runtime", "", e))?;
    let cpu = anyccl_cpu::Cpu;
    let platform = cpu.platform(0)?;
    let store = Arc::new(anyccl_core::MemoryStore::new());
    let comm = rt.block_on(Communicator::connect(
        &cpu,
        GroupSpec::world(1, "call-cost"),
        0,
        store,
        platform.device(),
        CommConfig::default(),
    ))?;
    let count = bytes.div_ceil(4);
    let send = platform.alloc(DType::F32, count)?;
    let mut recv = platform.alloc(DType::F32, count)?;
    // A wait at least as long as the operation timeout runs the operation on the caller's
    // thread; a shorter one hands it to the communicator's worker thread.
    let long = comm.config().op_timeout;
    let short = long.checked_div(10).unwrap_or(Duration::from_secs(1)).max(Duration::from_millis(1));
    println!("# CPU backend, world size 1: ns per all_reduce of {} B, issue then wait", count * 4);
    println!("# {calls} calls a run ({} for the short waits), median of 9 runs", (calls / 100).max(1));
    println!("#{:>60} {:>12}", "pattern", "ns/call");
    let backend = comm.collective().clone();
    let rows: [(&str, Duration, usize, bool); 4] = [
        ("wait >= operation timeout, through the Communicator", long, calls, true),
        ("wait >= operation timeout, the backend alone", long, calls, false),
        ("shorter wait (the worker runs it), Communicator", short, (calls / 100).max(1), true),
        ("shorter wait (the worker runs it), the backend alone", short, (calls / 100).max(1), false),
    ];
    let rows = &rows[..if long_only { 2 } else { 4 }];
    let mut times = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..9 {
        for (i, &(_, timeout, n, through)) in rows.iter().enumerate() {
            let t = Instant::now();
            for _ in 0..n {
                let w = if through {
                    comm.all_reduce(Some(send.view()), recv.view_mut(), ReduceOp::Sum)?
                } else {
                    backend.all_reduce(Some(send.view()), recv.view_mut(), ReduceOp::Sum)?
                };
                let mut w = w;
                w.wait(timeout)?;
            }
            times[i].push(t.elapsed().as_secs_f64() * 1e9 / n as f64);
        }
    }
    for ((what, ..), t) in rows.iter().zip(times) {
        println!("{what:>61} {:>12.1}", median(t));
    }
    rt.block_on(comm.shutdown())?;
    Ok(())
}
