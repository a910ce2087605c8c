//! What a small all_reduce costs the host with real launches, on one GPU at world size 1:
//! raw NCCL (every call, then one wait), raw NCCL with an event recorded after each call
//! (what a completion handle per operation costs by itself: events made before the timing
//! and recorded again, waited in chunks as the `Work` rows are), and anyccl's paths over the same library: stream order only
//! (`enqueue_all_reduce`), a `Work` per call through the `Communicator`, a `Work` from the
//! backend's `Collective` called directly (no validation, no flight recorder), and a `Work`
//! with shared completion. Each pattern issues CALLS calls of 8 B, out of place, in chunks
//! of 100 in flight (each anyccl call borrows one of 100 outputs until waited), then waits
//! for them; the rows give nanoseconds per call spent issuing and in all, the median of
//! ROUNDS rounds that alternate the patterns, and each anyccl row's ratio to raw with events.
//! Rows 6 and 7 are raw with events running 17 or 34 KB of straight-line code after each
//! call: what code costs that a launch has pushed out of the instruction caches, against its
//! time in a loop (in the header), the scale for anyccl's own code per call. Rows 8-11 add
//! one piece of the device layer's path at a time to raw with events (asking which context
//! is current, the locks and atomics around a launch, a `Work`'s allocation, all three),
//! each weighed with real launches. Rows 12-13 issue and wait one call at a time: raw NCCL
//! with an event a call, waited, against anyccl's `Work`, whose wait then asks the stream
//! (nothing was issued after it) and records no event.
//!
//! `cargo build --release -p anyccl-nccl --example launch_cost`, then on the GPU host
//! `launch_cost [CALLS] [ROUNDS] [PATTERN]` (default 20000 and 5; PATTERN, a row's number,
//! runs that row alone, for a profiler). The `ANYCCL_*` settings apply to the communicators.

use anyccl_core::{Backend, CommConfig, Communicator, Ctx, DType, DeviceMemory, GroupSpec, ReduceOp, Result};
use anyccl_nccl::{EngineStream, Nccl, RawNccl};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Calls in flight before a wait, as `anyccl-bench` keeps them at these sizes.
const DEPTH: usize = 100;
const COUNT: usize = 2;

const PATTERNS: [&str; 14] = [
    "raw ncclAllReduce",
    "raw, an event after each call, waited by 100",
    "anyccl stream order (enqueue_all_reduce)",
    "anyccl Work, through the Communicator",
    "anyccl Work, the backend's Collective alone",
    "anyccl Work, shared completion",
    "raw with events, + 17 KB of code a call",
    "raw with events, + 34 KB of code a call",
    "raw with events, + cuCtxGetCurrent a call",
    "raw with events, + 2 locks, 2 atomics a call",
    "raw with events, + a 128 B allocation a call",
    "raw with events, + rows 8, 9 and 10",
    "raw, one at a time: an event a call, waited",
    "anyccl Work, one at a time: issued, waited",
];

/// One step of [`cold_code`]: a multiply, a rotate and an xor that the compiler can neither
/// fold nor loop (the value goes through `black_box` each time).
macro_rules! step {
    ($x:ident) => {
        $x = std::hint::black_box($x.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(13) ^ 0x55);
    };
}
macro_rules! steps16 {
    ($x:ident) => {
        step!($x);
        step!($x);
        step!($x);
        step!($x);
        step!($x);
        step!($x);
        step!($x);
        step!($x);
        step!($x);
        step!($x);
        step!($x);
        step!($x);
        step!($x);
        step!($x);
        step!($x);
        step!($x);
    };
}
macro_rules! steps128 {
    ($x:ident) => {
        steps16!($x);
        steps16!($x);
        steps16!($x);
        steps16!($x);
        steps16!($x);
        steps16!($x);
        steps16!($x);
        steps16!($x);
    };
}

/// About 17 KB of straight-line code (768 steps): what a call that runs this much code costs
/// once a library's launch has pushed it out of the instruction caches (rows 6 and 7),
/// against its time in a loop, where it stays in them (the header). anyccl's own code per
/// call is about as large (`bench/host_footprint.sh`).
#[inline(never)]
fn cold_code(mut x: u64) -> u64 {
    steps128!(x);
    steps128!(x);
    steps128!(x);
    steps128!(x);
    steps128!(x);
    steps128!(x);
    x
}

/// Another copy of [`cold_code`], so that a call can run twice as much code.
#[inline(never)]
fn cold_code_2(mut x: u64) -> u64 {
    steps128!(x);
    steps128!(x);
    steps128!(x);
    steps128!(x);
    steps128!(x);
    steps128!(x);
    x ^ 1
}

struct Setup {
    raw: RawNccl,
    engine: EngineStream,
    send: Arc<dyn DeviceMemory>,
    shared_recv: Arc<dyn DeviceMemory>,
    timeout: Duration,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// `$calls` calls `$issue(send, recv)` over the outputs `$recvs`, in chunks of [`DEPTH`],
/// each chunk waited for: (issue, total) nanoseconds per call.
macro_rules! chunks {
    ($s:expr, $recvs:expr, $calls:expr, |$send:ident, $recv:ident| $issue:expr) => {{
        let (mut issuing, t) = (Duration::ZERO, Instant::now());
        let mut left = $calls;
        let $send: &dyn DeviceMemory = &*$s.send;
        while left > 0 {
            let k = left.min(DEPTH);
            let start = Instant::now();
            let mut works = Vec::with_capacity(k);
            for $recv in $recvs.iter_mut().take(k) {
                works.push($issue?);
            }
            issuing += start.elapsed();
            for mut w in works {
                w.wait($s.timeout)?;
            }
            left -= k;
        }
        let per = |d: Duration| d.as_secs_f64() * 1e9 / $calls as f64;
        Ok((per(issuing), per(t.elapsed())))
    }};
}

fn run(
    s: &Setup,
    (comm, shared): (&Communicator, &Communicator),
    recvs: &mut [Box<dyn DeviceMemory>],
    pattern: usize,
    calls: usize,
) -> Result<(f64, f64)> {
    let sum = ReduceOp::Sum;
    match pattern {
        0 | 1 => {
            // With events: waited in chunks of `DEPTH`, as the `Work` rows wait.
            let events = (pattern == 1).then_some(DEPTH);
            let t = s.raw.all_reduce_us(COUNT, DType::F32, (calls, 0), events, 1)?;
            Ok((t.issue_us * 1e3, t.us * 1e3))
        }
        2 => {
            let t = Instant::now();
            let mut held = Vec::with_capacity(calls);
            for _ in 0..calls {
                held.push(comm.enqueue_all_reduce(Some(&s.send), &s.shared_recv, sum)?);
            }
            let issued = t.elapsed();
            comm.signal_stream(s.engine.stream_ref())?;
            s.engine.synchronize(s.timeout)?;
            let total = t.elapsed();
            drop(held);
            Ok((issued.as_secs_f64() * 1e9 / calls as f64, total.as_secs_f64() * 1e9 / calls as f64))
        }
        6..=11 => {
            // Raw with events, then one piece of what anyccl's path does after each call:
            // code that the launch pushed out of the caches (6, 7), or one of the things the
            // device layer asks or touches (8-11), to weigh each with real launches.
            let sync = (std::sync::Mutex::new(0u64), std::sync::Mutex::new(0u64));
            let (flag, count) = (std::sync::atomic::AtomicU64::new(0), std::sync::atomic::AtomicU64::new(0));
            let held = std::cell::RefCell::new(Vec::<Box<[u64; 16]>>::with_capacity(DEPTH));
            let failed = std::cell::Cell::new(None);
            let between = || {
                if pattern == 6 || pattern == 7 {
                    std::hint::black_box(cold_code(std::hint::black_box(7)));
                }
                if pattern == 7 {
                    std::hint::black_box(cold_code_2(std::hint::black_box(7)));
                }
                if pattern == 8 || pattern == 11 {
                    if let Err(e) = s.raw.bind() {
                        failed.set(Some(e));
                    }
                }
                if pattern == 9 || pattern == 11 {
                    // The call lock around the launch, the watchdog's sequentially
                    // consistent store, the operation's number, the marks' lock.
                    let g = sync.0.lock().unwrap_or_else(|p| p.into_inner());
                    flag.store(std::hint::black_box(1), std::sync::atomic::Ordering::SeqCst);
                    count.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                    *sync.1.lock().unwrap_or_else(|p| p.into_inner()) += 1;
                    drop(g);
                }
                if pattern == 10 || pattern == 11 {
                    // A `Work`'s holder, freed when its chunk is waited.
                    let mut h = held.borrow_mut();
                    if h.len() == DEPTH {
                        h.clear();
                    }
                    h.push(std::hint::black_box(Box::new([7u64; 16])));
                }
            };
            let t = s.raw.all_reduce_us_with(COUNT, DType::F32, (calls, 0), Some(DEPTH), 1, &between)?;
            if let Some(e) = failed.take() {
                return Err(e);
            }
            Ok((t.issue_us * 1e3, t.us * 1e3))
        }
        12 => {
            // Each call followed by an event and waited before the next: a training step's
            // issue-then-wait, the baseline of row 13.
            let t = s.raw.all_reduce_us(COUNT, DType::F32, (calls, 0), Some(1), 1)?;
            Ok((t.issue_us * 1e3, t.us * 1e3))
        }
        13 => {
            // The same through anyccl: the wait comes before anything else is issued, so it
            // asks the stream and no event is recorded.
            let (mut issuing, t) = (Duration::ZERO, Instant::now());
            let send: &dyn DeviceMemory = &*s.send;
            let r = &mut recvs[0];
            for _ in 0..calls {
                let start = Instant::now();
                let mut w = comm.all_reduce(Some(send.view()), r.view_mut(), sum)?;
                issuing += start.elapsed();
                w.wait(s.timeout)?;
            }
            let per = |d: Duration| d.as_secs_f64() * 1e9 / calls as f64;
            Ok((per(issuing), per(t.elapsed())))
        }
        3 => chunks!(s, recvs, calls, |send, r| comm.all_reduce(Some(send.view()), r.view_mut(), sum)),
        4 => chunks!(s, recvs, calls, |send, r| comm.collective().all_reduce(Some(send.view()), r.view_mut(), sum)),
        _ => chunks!(s, recvs, calls, |send, r| shared.all_reduce(Some(send.view()), r.view_mut(), sum)),
    }
}

fn main() -> std::process::ExitCode {
    match measure() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("launch_cost: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

fn measure() -> Result<()> {
    // Each argument given is a whole number, or the program says which one is not.
    let arg = |i: usize, name: &'static str| -> Result<Option<usize>> {
        // `args_os`: an argument that is not UTF-8 is an error here, not a panic.
        std::env::args_os()
            .nth(i)
            .map(|a| {
                a.to_str().and_then(|t| t.parse::<usize>().ok()).ok_or_else(|| {
                    let shown = a.to_string_lossy();
                    Ctx::process("launch_cost").invalid("main", name, format!("'{shown}' is not a whole number"))
                })
            })
            .transpose()
    };
    // Every call of a round is held until the round's end (raw's events, the stream-order
    // handles): bounded, so a large count is refused rather than aborting on memory.
    let at_most = |v: usize, most: usize, name: &'static str| -> Result<usize> {
        if v > most {
            return Err(Ctx::process("launch_cost").invalid("main", name, format!("{v} is more than {most}")));
        }
        Ok(v)
    };
    let calls = at_most(arg(1, "CALLS")?.unwrap_or(20_000).max(1), 10_000_000, "CALLS")?;
    let rounds = at_most(arg(2, "ROUNDS")?.unwrap_or(5).max(1), 1_000, "ROUNDS")?;
    let only = arg(3, "PATTERN")?;
    if only.is_some_and(|p| p >= PATTERNS.len()) {
        return Err(Ctx::process("launch_cost").invalid(
            "main",
            "PATTERN",
            format!("a row number below {}", PATTERNS.len()),
        ));
    }
    let ctx = Ctx::process("launch_cost");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ctx.io("start a tokio runtime", "", e))?;
    let nccl = Nccl::default();
    let platform = nccl.platform(0)?;
    let store = Arc::new(anyccl_core::MemoryStore::new());
    // The ANYCCL_* settings apply (ANYCCL_FLIGHT_RECORDER, ANYCCL_NCCL_BLOCKING, ...).
    let config = CommConfig::from_env()?;
    let shared_config = CommConfig { shared_completion: true, ..config.clone() };
    let connect = |name: &str, c: &CommConfig| {
        Communicator::connect(&nccl, GroupSpec::world(1, name), 0, store.clone(), platform.device(), c.clone())
    };
    let (raw, comm, shared) = rt.block_on(async {
        let raw = RawNccl::connect(&*store, "launch-cost/raw", 0, 1, 0, &config).await?;
        Ok::<_, anyccl_core::Error>((
            raw,
            connect("launch-cost", &config).await?,
            connect("launch-cost-shared", &shared_config).await?,
        ))
    })?;
    let s = Setup {
        raw,
        engine: EngineStream::new(platform.device())?,
        send: Arc::from(platform.alloc(DType::F32, COUNT)?),
        shared_recv: Arc::from(platform.alloc(DType::F32, COUNT)?),
        timeout: config.op_timeout,
    };
    let mut recvs: Vec<Box<dyn DeviceMemory>> =
        (0..DEPTH).map(|_| platform.alloc(DType::F32, COUNT)).collect::<Result<_>>()?;
    let patterns: Vec<usize> = only.map_or_else(|| (0..PATTERNS.len()).collect(), |p| vec![p]);
    for &p in &patterns {
        run(&s, (&comm, &shared), &mut recvs, p, (calls / 10).max(DEPTH))?;
    }
    let mut times: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); PATTERNS.len()];
    for _ in 0..rounds {
        for &p in &patterns {
            let (issue, total) = run(&s, (&comm, &shared), &mut recvs, p, calls)?;
            times[p].0.push(issue);
            times[p].1.push(total);
        }
    }
    println!("# host cost per 8 B all_reduce with real launches, world size 1 ({} calls a round, {rounds} rounds, {DEPTH} in flight)", calls);
    println!(
        "# host cost per call, ns: {}",
        s.raw.host_costs(20_000)?.iter().map(|(w, ns)| format!("{w} {ns:.0}")).collect::<Vec<_>>().join(", ")
    );
    let t = Instant::now();
    for _ in 0..100_000 {
        std::hint::black_box(cold_code(std::hint::black_box(7)));
    }
    println!(
        "# rows 6-7's 17 KB of code alone, in a loop (in the caches): {:.0} ns",
        t.elapsed().as_secs_f64() * 1e9 / 1e5
    );
    println!("#{:>3} {:>48} {:>12} {:>12} {:>16}", "row", "pattern", "issue (ns)", "total (ns)", "vs raw+events");
    println!("# (row 13 against row 12, one at a time; the others against row 1)");
    // Row 13 against row 12 (one at a time), every other row against row 1.
    let (with_events, one_at_a_time) = (median(times[1].1.clone()), median(times[12].1.clone()));
    for &p in &patterns {
        let (issue, total) = (median(times[p].0.clone()), median(times[p].1.clone()));
        let base = match p {
            2..=11 => with_events,
            13 => one_at_a_time,
            _ => f64::NAN,
        };
        let ratio = if base.is_finite() { format!("{:.3}", total / base) } else { "-".into() };
        println!("{p:>4} {:>48} {issue:>12.0} {total:>12.0} {ratio:>16}", PATTERNS[p]);
    }
    drop(recvs);
    drop(s);
    rt.block_on(async {
        comm.shutdown().await?;
        shared.shutdown().await
    })
}
