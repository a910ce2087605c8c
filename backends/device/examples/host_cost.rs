//! What anyccl itself costs the host per operation on a device backend: the `Communicator`
//! (validation, sequence number, flight recorder) and the device layer (lifecycle, call
//! lock, watchdog bookkeeping, `Work`, marks) over a library and a runtime that do nothing
//! (every launch is enqueued at once, every event is done). On a GPU host, raw NCCL's own
//! call comes on top (`anyccl-bench all_reduce --vs-raw`); this isolates the rest, on any
//! machine.
//!
//! `cargo run --release -p anyccl-device --example host_cost [CALLS] [SWEEP_KIB]` prints, per
//! pattern, nanoseconds per call (median of 9 runs of CALLS calls, default 100000). With
//! SWEEP_KIB, each launch of the null library reads that many KiB (a line in every 64 B), as
//! a real library's launch pushes anyccl's state out of the caches; the first row is that
//! launch alone, and each row says what anyccl adds to it.

use anyccl_core::{CommConfig, Communicator, Ctx, DType, DeviceMemory, HostMemory, ReduceOp, Result};
use anyccl_device::testing::{Hooks, NullLibrary, NullRuntime};
use anyccl_device::{Launched, Op};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The null library's launch reads [`SWEPT`].
#[derive(Debug)]
struct Sweep;

impl Hooks for Sweep {
    fn launch(&self, _op: &Op) -> Launched {
        std::hint::black_box(sweep());
        Launched::Enqueued
    }
}

/// What each launch reads (SWEEP_KIB), one `u64` per cache line.
static SWEPT: OnceLock<Vec<AtomicU64>> = OnceLock::new();

/// Read a line in every 64 B of `SWEPT`: the null library's launch.
fn sweep() -> u64 {
    SWEPT.get().map_or(0, |v| v.iter().step_by(8).map(|x| x.load(Ordering::Relaxed)).fold(0, u64::wrapping_add))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    // Each argument given is a whole number within its bounds, or the program says which one
    // is not (`args_os`: one that is not UTF-8 is an error too, not a panic).
    let arg = |i: usize, name: &'static str, default: usize, (least, most): (usize, usize)| -> Result<usize> {
        let Some(a) = std::env::args_os().nth(i) else { return Ok(default) };
        match a.to_str().and_then(|t| t.parse::<usize>().ok()) {
            Some(v) if (least..=most).contains(&v) => Ok(v),
            _ => Err(Ctx::process("host_cost").invalid(
                "main",
                name,
                format!("'{}' is not a whole number from {least} to {most}", a.to_string_lossy()),
            )),
        }
    };
    let calls = arg(1, "CALLS", 100_000, (1, 100_000_000))?;
    // The swept memory is allocated: at most 64 MiB, past any cache.
    let sweep_kib = arg(2, "SWEEP_KIB", 0, (0, 64 << 10))?;
    SWEPT.get_or_init(|| (0..sweep_kib * 128).map(|i| AtomicU64::new(i as u64)).collect());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Ctx::process("host_cost").io("start a tokio runtime", "", e))?;
    println!("# anyccl host cost per call over a library and a runtime that do nothing (all_reduce, 8 B)");
    println!("# {calls} calls a run, median of 9 runs; events: device events recorded per call (a wait with");
    println!("# nothing issued after its operation asks the stream instead)");
    println!("# each launch reads {sweep_kib} KiB; anyccl's own cost: the row's time less the launch alone");
    let mut alone = Vec::new();
    for _ in 0..9 {
        let t = Instant::now();
        for _ in 0..calls {
            std::hint::black_box(sweep());
        }
        alone.push(t.elapsed().as_secs_f64() * 1e9 / calls as f64);
    }
    let alone = median(alone);
    println!(" {:>52} {alone:>12.1}", "the null library's launch alone");
    println!("#{:>52} {:>12} {:>10} {:>12}", "pattern", "ns/call", "events", "anyccl ns");
    for shared_completion in [false, true] {
        run(&rt, calls, shared_completion, alone)?;
    }
    Ok(())
}

/// Both patterns on a communicator with `shared_completion` as given.
/// `alone`: the null launch's own ns per call, taken off each row.
fn run(rt: &tokio::runtime::Runtime, calls: usize, shared_completion: bool, alone: f64) -> Result<()> {
    static LIB: OnceLock<&'static NullLibrary> = OnceLock::new();
    let lib = *LIB.get_or_init(|| NullLibrary::with_hooks(Arc::new(Sweep)).leak());
    let runtime = Arc::new(NullRuntime::new());
    let config = CommConfig { shared_completion, ..CommConfig::default() };
    let comm: Communicator = rt.block_on(lib.communicator(runtime.clone(), "host-cost", config))?;
    let mode = if shared_completion { "shared_completion" } else { "default" };
    let send = HostMemory::new(DType::F32, 2);
    let depth = 100usize;
    let mut recvs: Vec<HostMemory> = (0..depth).map(|_| HostMemory::new(DType::F32, 2)).collect();
    let t_wait = Duration::from_secs(10);

    type Pattern<'c> = (&'c str, Box<dyn Fn(&mut Vec<HostMemory>) -> Result<()> + 'c>);
    let patterns: Vec<Pattern<'_>> = vec![
        (
            "issue + wait, one at a time",
            Box::new(|recvs: &mut Vec<HostMemory>| {
                for i in 0..calls {
                    let r = &mut recvs[i % depth];
                    comm.all_reduce(Some(send.view()), r.view_mut(), ReduceOp::Sum)?.wait(t_wait)?;
                }
                Ok(())
            }),
        ),
        (
            "100 back to back, then waited",
            Box::new(|recvs: &mut Vec<HostMemory>| {
                let mut left = calls;
                while left > 0 {
                    let k = left.min(depth);
                    let mut works = Vec::with_capacity(k);
                    for r in recvs.iter_mut().take(k) {
                        works.push(comm.all_reduce(Some(send.view()), r.view_mut(), ReduceOp::Sum)?);
                    }
                    for mut w in works {
                        w.wait(t_wait)?;
                    }
                    left -= k;
                }
                Ok(())
            }),
        ),
    ];
    for (name, run) in &patterns {
        run(&mut recvs)?;
        let mut times = Vec::new();
        let before = runtime.records();
        for _ in 0..9 {
            let t = Instant::now();
            run(&mut recvs)?;
            times.push(t.elapsed().as_secs_f64() * 1e9 / calls as f64);
        }
        let events = (runtime.records() - before) as f64 / (9 * calls) as f64;
        let t = median(times);
        println!(" {:>52} {t:>12.1} {events:>10.3} {:>12.1}", format!("{name} ({mode})"), t - alone);
        // Waited one at a time, no event: each wait asks the stream, on which nothing follows
        // its operation. Back to back, an event a call but the newest (whose wait asks the
        // stream), or, with shared completion, one a run of 100.
        let want = match (name.starts_with("100"), shared_completion) {
            (false, _) => 0.0,
            (true, false) => 0.99,
            (true, true) => 0.01,
        };
        if (events - want).abs() > 0.001 {
            let ctx = Ctx::new("null", 0, "host-cost");
            return Err(ctx.aborted(format!("{name} ({mode}) recorded {events:.3} events a call, not {want}")));
        }
    }
    rt.block_on(comm.shutdown())?;
    Ok(())
}
