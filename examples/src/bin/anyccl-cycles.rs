//! `anyccl-cycles [--backend cpu|hccl] [--ranks N] [--cycles N] [--count N] [--rss-slack-mib M]
//! [--check]`: what rebuild cycles leave behind. The ranks run as threads of this one process
//! (as an engine's do, and with an in-process store), so every resource they hold is this
//! process's; each cycle `K` they connect `world@eK` among all ranks, run a checked
//! all_reduce, end the communicator and drop it. Cycles end in turn by shutdown, by abort, by
//! a peer's death (the last rank aborts; the others' next all_reduce fails and they abort), by
//! the drop alone, and by a rank that never arrives (the others' connect fails at its 1 s
//! deadline): the ways recovery leaves a communicator.
//!
//! Each row shows, as `held->after`, what the process holds with every rank's communicator
//! live, and once every rank dropped it and the counts stopped moving (a library's helper
//! threads and their sockets go a moment after the call that ended them; at most 2 s):
//! resident memory (`VmRSS`), `memfd:` mappings (the CPU backend's shared-memory segments),
//! open descriptors, threads, and on a device backend the device memory in use (on the HCCL
//! stand-in: its counted pool, summed over the ranks' devices). Then the first cycle's
//! figures against the last's: mappings, descriptors, threads and device memory must be back
//! exactly; resident memory within `--rss-slack-mib`, since the allocator keeps what it freed
//! (glibc: an arena per thread that allocated, up to 8 per core; with
//! `GLIBC_TUNABLES=glibc.malloc.arena_max=2` far less of that shows) and the store keeps each
//! epoch's keys. `--check` exits with status 1 when a count did not come back (resident
//! memory is reported, not checked).
//!
//! `--sleep`: sleep and wake cycles instead. The ranks connect `world` once; each cycle wakes
//! it (from the second on), runs the checked all_reduce and puts it to sleep
//! (`Communicator::sleep`): a row shows what the process holds awake -> asleep, and asleep
//! nothing of the communicator may be held (`--check`: in every cycle no `memfd:` mapping more
//! than before the connect and no device memory in use; descriptors and threads back to the
//! first cycle's; the store's keys after the last cycle at most twice those after the first,
//! since each sleep removes the keys of the cycle before).
//!
//! The HCCL backend finds its library as everywhere (`ANYCCL_HCCL_LIBRARY_DIR`, ...); the
//! workspace's stand-in is in `anyccl_hccl_standin::library_dir()`.
#![forbid(unsafe_code)]

use anyccl::raw::pattern;
use anyccl::{Backend, CommConfig, Communicator, DType, Error, GroupSpec, MemoryStore, ReduceOp, Result, Role, Store};
use anyccl_examples::{errln, outln};
use clap::Parser;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    /// Backend: cpu or hccl.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Ranks, as threads of this process (default: 4 on cpu, 8 on hccl).
    #[arg(long)]
    ranks: Option<usize>,
    /// Rebuild cycles.
    #[arg(long, default_value_t = 50)]
    cycles: usize,
    /// f32 elements each all_reduce sums.
    #[arg(long, default_value_t = 1 << 14)]
    count: usize,
    /// How far above the first cycle's the last cycle's resident memory may be, in MiB.
    #[arg(long, default_value_t = 8)]
    rss_slack_mib: u64,
    /// Exit with status 1 when a count (mappings, descriptors, threads, device memory) did
    /// not come back to the first cycle's.
    #[arg(long)]
    check: bool,
    /// Sleep and wake one communicator instead of rebuilding.
    #[arg(long)]
    sleep: bool,
}

/// How a cycle ends its communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Shutdown,
    Abort,
    /// The last rank aborts; the others' next all_reduce fails, and they abort.
    PeerDies,
    /// Dropped without a shutdown or an abort.
    Drop,
    /// The last rank never arrives: the others' connect fails at its deadline (1 s, and
    /// an operation timeout of 1 s).
    Absent,
}

impl End {
    fn of(cycle: usize) -> End {
        [End::Shutdown, End::Abort, End::PeerDies, End::Drop, End::Absent][cycle % 5]
    }
    fn name(self) -> &'static str {
        match self {
            End::Shutdown => "shutdown",
            End::Abort => "abort",
            End::PeerDies => "peer-dies",
            End::Drop => "drop",
            End::Absent => "absent",
        }
    }
}

/// The counts that must come back: `memfd:` mappings, open descriptors, threads.
type Counts = (usize, usize, usize);

/// What the process holds at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sample {
    rss_kib: u64,
    memfd: usize,
    fds: usize,
    threads: usize,
}

fn proc_status(field: &str) -> std::io::Result<u64> {
    let text = std::fs::read_to_string("/proc/self/status")?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no {field} in /proc/self/status")))
}

fn sample() -> std::io::Result<Sample> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    Ok(Sample {
        rss_kib: proc_status("VmRSS:")?,
        memfd: maps.lines().filter(|l| l.contains("memfd:")).count(),
        // Less the descriptor that reads the folder.
        fds: std::fs::read_dir("/proc/self/fd")?.count().saturating_sub(1),
        threads: proc_status("Threads:")? as usize,
    })
}

impl Sample {
    fn counts(&self) -> Counts {
        (self.memfd, self.fds, self.threads)
    }
}

/// A sample once the counts stay the same over three reads 20 ms apart (at most 2 s): a
/// library's helper threads and their sockets go a moment after the call that ended them.
fn settled() -> std::io::Result<Sample> {
    let until = Instant::now() + Duration::from_secs(2);
    let mut s = sample()?;
    let mut same = 0;
    while same < 2 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
        let next = sample()?;
        same = if next.counts() == s.counts() { same + 1 } else { 0 };
        s = next;
    }
    Ok(s)
}

/// One rank's report of a cycle.
#[derive(Debug, Clone, Default)]
struct Report {
    error: Option<String>,
    /// Device memory in use with the communicator live, and after it was dropped.
    device: Option<(u64, u64)>,
}

/// What the rank threads and the measuring thread share.
struct Shared {
    backend: Arc<dyn Backend>,
    store: Arc<dyn Store>,
    ranks: usize,
    count: usize,
    /// Sleep and wake cycles.
    sleep: bool,
    /// Four times a cycle: every communicator live, its sample taken; every communicator
    /// dropped, the row written.
    barrier: Barrier,
    reports: Mutex<Vec<Report>>,
    stop: AtomicBool,
}

fn io_err(what: &str, e: impl std::fmt::Display) -> Error {
    anyccl::raw::Ctx::process("anyccl-cycles").unsupported("measure", format!("{what}: {e}"))
}

fn main() -> ExitCode {
    // Output that could not be written fails the run, and says so.
    anyccl_examples::out::finish("anyccl-cycles", program())
}

fn program() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            errln!("anyccl-cycles: {e}");
            ExitCode::from(2)
        }
    }
}

/// Whether the check passed (always, without `--check`).
fn run(args: &Args) -> Result<bool> {
    // Every cycle aborts communicators on purpose: their warnings would be noise.
    anyccl::init_logging(anyccl::LogLevel::ERROR)?;
    let bad = |arg: &'static str, msg: String| anyccl::raw::Ctx::process("anyccl-cycles").invalid("args", arg, msg);
    if !["cpu", "hccl"].contains(&args.backend.as_str()) {
        return Err(bad("--backend", format!("'{}': cpu or hccl", args.backend)));
    }
    let ranks = args.ranks.unwrap_or(if args.backend == "cpu" { 4 } else { 8 });
    if ranks < 2 {
        return Err(bad("--ranks", format!("{ranks}: a rank must be able to die and leave survivors")));
    }
    if args.cycles == 0 || args.count == 0 {
        return Err(bad("--cycles", "at least one cycle of at least one element".into()));
    }
    let backend = anyccl::pick_backend(Some(&args.backend))?;
    let memory = MemoryStore::new();
    let shared = Arc::new(Shared {
        backend,
        store: Arc::new(memory.clone()),
        ranks,
        count: args.count,
        sleep: args.sleep,
        barrier: Barrier::new(ranks + 1),
        reports: Mutex::new(vec![Report::default(); ranks]),
        stop: AtomicBool::new(false),
    });
    let what = if args.sleep {
        "wake world (from the second), all_reduce of {} f32 (checked), sleep"
    } else {
        "connect world@eK, all_reduce of {} f32 (checked), end by shutdown / abort / peer-dies / drop / absent in turn"
    };
    outln!(
        "# anyccl-cycles: {} backend, {ranks} ranks as threads of process {}; {} cycles of: {}",
        shared.backend.name(),
        std::process::id(),
        args.cycles,
        what.replace("{}", &args.count.to_string())
    );
    if args.sleep {
        outln!("# each figure is with every rank's communicator awake -> asleep");
    } else {
        outln!("# each figure is with every rank's communicator live -> after every rank dropped it");
    }
    outln!(
        "{:>7}  {:<9}  {:>17}  {:>7}  {:>9}  {:>7}  {:>15}",
        "cycle",
        "end",
        "rss_kib",
        "memfd",
        "fds",
        "threads",
        "device_bytes"
    );
    let start = sample().map_err(|e| io_err("/proc/self", e))?;
    print_row("start", "-", &start, &start, None);
    let mut threads = Vec::new();
    for rank in 0..ranks {
        let s = shared.clone();
        let cycles = args.cycles;
        let h = std::thread::Builder::new()
            .name(format!("cycles-rank{rank}"))
            .spawn(move || rank_main(&s, rank, cycles))
            .map_err(|e| io_err("start a rank thread", e))?;
        threads.push(h);
    }
    let mut rows = Vec::new();
    // The store's keys and bytes after each cycle.
    let mut stored = Vec::new();
    // Sleep cycles in which the process held mappings or device memory asleep.
    let mut asleep_holds = Vec::new();
    let mut failed = None;
    for k in 0..args.cycles {
        // Every rank's communicator is live and checked (or its cycle failed).
        shared.barrier.wait();
        let held = sample();
        shared.barrier.wait();
        // Every rank dropped its communicator.
        shared.barrier.wait();
        let reports = shared.reports.lock().map(|r| r.clone()).unwrap_or_default();
        let errors: Vec<String> =
            reports.iter().enumerate().filter_map(|(r, p)| Some(format!("rank {r}: {}", p.error.as_ref()?))).collect();
        let device = reports.iter().map(|p| p.device).try_fold((0, 0), |(h, a), d| d.map(|(dh, da)| (h + dh, a + da)));
        let after = settled();
        match (&held, &after) {
            (Ok(h), Ok(a)) => {
                print_row(&(k + 1).to_string(), if args.sleep { "sleep" } else { End::of(k).name() }, h, a, device);
                rows.push((*a, device.map(|d| d.1)));
                stored.push(memory.size());
                // Asleep: no mapping more than before the connect, no device memory in use
                // (threads and descriptors: the ranks' runtimes and the library's own are
                // there from the first cycle on, and compared across cycles).
                if args.sleep && (a.memfd != start.memfd || device.is_some_and(|d| d.1 != 0)) {
                    asleep_holds.push(k + 1);
                }
            }
            (Err(e), _) | (_, Err(e)) => failed = Some(io_err("/proc/self", e)),
        }
        if !errors.is_empty() {
            let why = format!("cycle {} failed: {}", k + 1, errors.join("; "));
            failed = Some(anyccl::raw::Ctx::process("anyccl-cycles").aborted(why));
        }
        shared.stop.store(failed.is_some(), Ordering::Release);
        shared.barrier.wait();
        if failed.is_some() {
            break;
        }
    }
    for h in threads {
        let _ = h.join();
    }
    if let Some(e) = failed {
        return Err(e);
    }
    let mut passed = verdict(&rows, args.rss_slack_mib << 10);
    if let (Some(first), Some(last)) = (stored.first(), stored.last()) {
        // Sleep and wake trim the keys of the cycle before the last: at most two cycles'.
        let bounded = last.0 <= 2 * first.0;
        let verdict = match (args.sleep, bounded) {
            (false, _) => "not checked: each cycle connects a new group",
            (true, true) => "bounded",
            (true, false) => "GROWS",
        };
        outln!(
            "#   store    {} keys, {} bytes after the first cycle -> {} keys, {} bytes after the last: {verdict}",
            first.0,
            first.1,
            last.0,
            last.1
        );
        passed &= !args.sleep || bounded;
    }
    if args.sleep {
        if asleep_holds.is_empty() {
            outln!("# asleep, every cycle: no mapping more than before the connect, no device memory in use");
        } else {
            outln!("# asleep, mappings or device memory held in cycles {asleep_holds:?}");
            passed = false;
        }
    }
    Ok(passed || !args.check)
}

fn print_row(cycle: &str, end: &str, held: &Sample, after: &Sample, device: Option<(u64, u64)>) {
    let pair = |h: u64, a: u64| format!("{h}->{a}");
    let device = device.map_or("-".to_string(), |(h, a)| pair(h, a));
    outln!(
        "{cycle:>7}  {end:<9}  {:>17}  {:>7}  {:>9}  {:>7}  {device:>15}",
        pair(held.rss_kib, after.rss_kib),
        pair(held.memfd as u64, after.memfd as u64),
        pair(held.fds as u64, after.fds as u64),
        pair(held.threads as u64, after.threads as u64),
    );
}

/// Print the first cycle's figures against the last's; whether every count came back.
fn verdict(rows: &[(Sample, Option<u64>)], slack_kib: u64) -> bool {
    let (Some((first, dev_first)), Some((last, dev_last))) = (rows.first(), rows.last()) else { return true };
    outln!("# the first cycle against the last ({} cycles):", rows.len());
    let mut left = Vec::new();
    let mut line = |what: &str, a: u64, b: u64, slack: u64, unit: &str| {
        let back = b <= a + slack;
        let d = b as i64 - a as i64;
        let tol = if slack > 0 { format!("; tolerance +{slack} {unit}, not checked") } else { String::new() };
        outln!("#   {what:<8} {a} -> {b} {unit} ({d:+}{tol}): {}", if back { "back" } else { "LEFT BEHIND" });
        if !back && slack == 0 {
            left.push(format!("{what} {d:+}"));
        }
        back
    };
    let rss_back = line("rss", first.rss_kib, last.rss_kib, slack_kib, "KiB");
    line("memfd", first.memfd as u64, last.memfd as u64, 0, "mappings");
    line("fds", first.fds as u64, last.fds as u64, 0, "descriptors");
    line("threads", first.threads as u64, last.threads as u64, 0, "threads");
    if let (Some(a), Some(b)) = (dev_first, dev_last) {
        line("device", *a, *b, 0, "bytes");
    }
    let peak = rows.iter().map(|(r, _)| r.rss_kib).max().unwrap_or(0);
    outln!("#   rss peak {peak} KiB");
    if !rss_back {
        outln!(
            "# resident memory above the tolerance: the allocator's caches grow with the threads that freed memory \
             (glibc: GLIBC_TUNABLES=glibc.malloc.arena_max=2 shows what is held); compare a longer run"
        );
    }
    if left.is_empty() {
        outln!("# every count came back: nothing left behind");
        true
    } else {
        outln!("# left behind: {}", left.join(", "));
        false
    }
}

/// One rank: every cycle, then its report and the two meetings with the measuring thread.
fn rank_main(s: &Shared, rank: usize, cycles: usize) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
    let platform = s.backend.platform(rank);
    // Device memory in use on a device backend, asked on this thread (where the device is bound).
    let in_use = || -> Option<u64> {
        let p = platform.as_ref().ok().filter(|p| p.kind() != anyccl::DeviceKind::Cpu)?;
        p.mem_info().ok().map(|m| m.total - m.free)
    };
    // The sleep cycles' communicator, connected in the first.
    let mut sleeper: Option<Communicator> = None;
    for k in 0..cycles {
        let mut held = None;
        let mut met = false;
        // With the communicator live: its device memory, then the measuring thread's sample.
        let mut measure = || {
            held = in_use();
            met = true;
            s.barrier.wait();
            s.barrier.wait();
        };
        let r = match (&rt, &platform) {
            (Ok(rt), Ok(p)) if s.sleep => {
                sleep_cycle(s, rt, p.as_ref(), rank, k, &mut sleeper, &mut measure).map_err(|e| e.to_string())
            }
            (Ok(rt), Ok(p)) => cycle(s, rt, p.as_ref(), rank, k, &mut measure).map_err(|e| e.to_string()),
            (Err(e), _) => Err(format!("runtime: {e}")),
            (_, Err(e)) => Err(e.to_string()),
        };
        if !met {
            // A cycle that failed before its communicator was checked still meets.
            s.barrier.wait();
            s.barrier.wait();
        }
        let report = Report { error: r.err(), device: held.zip(in_use()) };
        if let Ok(mut v) = s.reports.lock() {
            v[rank] = report;
        }
        s.barrier.wait();
        s.barrier.wait();
        if s.stop.load(Ordering::Acquire) {
            return;
        }
    }
}

/// Cycle `k` on one rank: connect `world@eK`, a checked all_reduce, `measure` with the
/// communicator live, the cycle's end, drop.
fn cycle(
    s: &Shared,
    rt: &tokio::runtime::Runtime,
    platform: &dyn anyccl::Platform,
    rank: usize,
    k: usize,
    measure: &mut dyn FnMut(),
) -> Result<()> {
    let n = s.ranks;
    let spec = GroupSpec::new(format!("world@e{k}"), (0..n).collect(), "cycles", Role::World);
    let op = Duration::from_secs(10);
    let config = CommConfig { op_timeout: op, init_timeout: Duration::from_secs(30), ..CommConfig::default() };
    let store = s.store.clone();
    if End::of(k) == End::Absent {
        if rank + 1 < n {
            // The operation timeout too: HCCL's init waits for the absent rank as long as that
            // (the communicator's hcclExecTimeOut) on a helper thread the connect cannot stop.
            let second = Duration::from_secs(1);
            let config = CommConfig { init_timeout: second, op_timeout: second, ..config };
            let r =
                rt.block_on(Communicator::connect(s.backend.as_ref(), spec, rank, store, platform.device(), config));
            if r.is_ok() {
                return Err(anyccl::raw::Ctx::process("anyccl-cycles")
                    .aborted(format!("cycle {}: connected without the last rank", k + 1)));
            }
        }
        measure();
        return Ok(());
    }
    let comm = rt.block_on(Communicator::connect(s.backend.as_ref(), spec, rank, store, platform.device(), config))?;
    let mut buf = checked_all_reduce(s, platform, &comm, rank, k)?;
    measure();
    match End::of(k) {
        End::Shutdown => rt.block_on(comm.shutdown())?,
        End::Abort => rt.block_on(comm.abort())?,
        End::Drop | End::Absent => {}
        End::PeerDies if rank == n - 1 => {
            rt.block_on(comm.abort())?;
            rt.block_on(s.store.set(&format!("cycles/{k}/dead"), b"1"))?;
        }
        End::PeerDies => {
            rt.block_on(s.store.wait(&format!("cycles/{k}/dead"), Instant::now() + op))?;
            let failed = match comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum) {
                Ok(mut w) => {
                    let r = w.wait(Duration::from_secs(2));
                    // Aborted before the pending operation is dropped (a drop waits for it).
                    rt.block_on(comm.abort())?;
                    r.is_err()
                }
                Err(_) => {
                    rt.block_on(comm.abort())?;
                    true
                }
            };
            if !failed {
                let msg = format!("cycle {}: an all_reduce without the dead rank succeeded", k + 1);
                return Err(comm.ctx().aborted(msg));
            }
        }
    }
    drop(comm);
    drop(buf);
    Ok(())
}

/// A checked all_reduce of cycle `k` on `comm`; its buffer.
fn checked_all_reduce(
    s: &Shared,
    platform: &dyn anyccl::Platform,
    comm: &Communicator,
    rank: usize,
    k: usize,
) -> Result<Box<dyn anyccl::DeviceMemory>> {
    let n = s.ranks;
    let mut buf = platform.alloc(DType::F32, s.count)?;
    platform.copy_from_host(buf.as_mut(), &pattern::encode(&pattern::values(rank, s.count, None, k), DType::F32))?;
    comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum)?.wait(Duration::from_secs(10))?;
    platform.synchronize()?;
    let mut bytes = vec![0u8; s.count * DType::F32.size()];
    platform.copy_to_host(buf.as_ref(), &mut bytes)?;
    let got = pattern::decode(&bytes, DType::F32);
    let want = |i: usize| (0..n).map(|r| pattern::value(r, i, None, k)).sum::<f64>();
    if let Some(i) = (0..s.count).find(|&i| got[i] != want(i)) {
        let msg = format!("all_reduce of cycle {}: element {i} is {}, expected {}", k + 1, got[i], want(i));
        return Err(comm.ctx().aborted(msg));
    }
    Ok(buf)
}

/// Sleep cycle `k` on one rank: connect `world` (the first) or wake it, a checked
/// all_reduce, `measure` awake, sleep.
fn sleep_cycle(
    s: &Shared,
    rt: &tokio::runtime::Runtime,
    platform: &dyn anyccl::Platform,
    rank: usize,
    k: usize,
    comm: &mut Option<Communicator>,
    measure: &mut dyn FnMut(),
) -> Result<()> {
    let c = match comm {
        Some(c) => {
            rt.block_on(c.wake(s.backend.as_ref()))?;
            c
        }
        None => {
            let spec = GroupSpec::new("world", (0..s.ranks).collect(), "cycles", Role::World);
            let config = CommConfig { init_timeout: Duration::from_secs(30), ..CommConfig::default() };
            let store = s.store.clone();
            let c =
                rt.block_on(Communicator::connect(s.backend.as_ref(), spec, rank, store, platform.device(), config))?;
            comm.insert(c)
        }
    };
    checked_all_reduce(s, platform, c, rank, k)?;
    measure();
    rt.block_on(c.sleep())
}
