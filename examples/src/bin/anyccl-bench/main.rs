//! `anyccl-bench <op> [--backend B] [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP]
//! [-d DTYPE] [-o OP] [-c 0|1] [--json] [--vs-raw PAIRS]`: nccl-tests-style rows (size, count, type, redop,
//! root, then time, algbw, busbw and #wrong out of place and in place) plus two columns no
//! peer prints: the first (cold) call's time and the device memory it took. Runs under
//! `anyccl-run` (one rank per process) or alone.
#![forbid(unsafe_code)]

mod modes;
mod op;

use op::{counts, in_place_layout, issue, Op};

use anyccl::raw::pattern;
use anyccl::{CommConfig, Communicator, DType, DeviceKind, DeviceMemory, Platform, ReduceOp, Result};
use clap::Parser;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(name = "anyccl-bench")]
struct Args {
    /// all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, sendrecv.
    op: String,
    /// Backend (default: ANYCCL_BACKEND, else nccl when it loads, else cpu).
    #[arg(long)]
    backend: Option<String>,
    /// Smallest size (bytes; K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8")]
    min: String,
    /// Largest size.
    #[arg(short = 'e', long = "maxbytes", default_value = "128M")]
    max: String,
    /// Size factor between rows.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    factor: usize,
    /// Timed iterations per row.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: usize,
    /// Warmup iterations per row.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: usize,
    /// Before the first timed row, keep issuing warm-up calls for this long (milliseconds).
    /// Without it the first row ran slower than the rest on H200s (most likely a device
    /// that sat idle through the connect, still at low clocks).
    #[arg(long = "warmup-ms", default_value_t = 100)]
    warmup_ms: u64,
    /// Element type.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    dtype: String,
    /// Reduce op.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    redop: String,
    /// Calls in flight at most: 1 issues each call and waits for it (latency, as an MPI
    /// benchmark's blocking loop measures); the default issues as many as the memory budget
    /// allows back to back, then waits (pipelined, as nccl-tests does).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    depth: Option<u32>,
    /// Root for broadcast and reduce.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    root: usize,
    /// Check results (count wrong elements).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    check: u8,
    /// Print rows as JSON lines instead.
    #[arg(long)]
    json: bool,
    /// all_reduce only: time this many interleaved pairs per size, raw NCCL (its own
    /// communicator, one stream, calls back to back, one wait) then the same calls through
    /// anyccl, and print both medians and the ratios (at least 1).
    #[arg(long, value_name = "PAIRS", value_parser = clap::value_parser!(u32).range(1..=1000))]
    vs_raw: Option<u32>,
    /// all_reduce only: a step that computes for this many microseconds on the engine's
    /// own stream beside an all_reduce of an earlier buffer, ordered by events between the
    /// streams (no host wait), against the two back to back.
    #[arg(long, value_name = "US", conflicts_with = "vs_raw", value_parser = parse_us)]
    overlap_us: Option<f64>,
    /// Allocate every buffer the way the library registers best
    /// (`Platform::alloc_registrable`; NCCL: `ncclMemAlloc`) and register it with the
    /// communicator (NCCL: `ncclCommRegister`), as an engine does that keeps its
    /// buffers for the job's life; the header says whether the backend registered them.
    /// With `--vs-raw`, anyccl's buffers only (raw NCCL keeps its defaults).
    #[arg(long, conflicts_with_all = ["overlap_us", "graph"])]
    register: bool,
    /// As `--register`, but each buffer registered as a window of the communicator
    /// (`Communicator::register_window`; NCCL: a symmetric window, whose kernels serve small
    /// collectives): a collective registration, so every rank keeps the same buffers,
    /// `--depth` of them (default 8) per size.
    #[arg(long, conflicts_with_all = ["vs_raw", "overlap_us", "graph", "register"])]
    window: bool,
    /// all_reduce only: capture this many in-place all_reduces into a CUDA graph on the
    /// engine's stream and time its replays (per all_reduce), beside the same calls issued.
    #[arg(long, value_name = "OPS", conflicts_with_all = ["vs_raw", "overlap_us"],
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    graph: Option<u32>,
}

fn parse_us(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (1.0..=10_000_000.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a number of microseconds from 1 to 10000000")),
    }
}

fn parse_size(s: &str) -> std::result::Result<usize, String> {
    match anyccl::raw::parse_bytes(s) {
        Some(b) if b <= MAX_BYTES => Ok(b),
        Some(_) => Err(format!("'{s}' is larger than the 64 GiB this tool measures")),
        None => Err(format!("'{s}' is not a size (bytes, with K, M or G)")),
    }
}

/// The largest size a row may have.
const MAX_BYTES: usize = 64 << 30;

/// A buffer of the benchmark: plain, or registered with the communicator (`--register`).
enum Mem<'c> {
    Plain(Box<dyn DeviceMemory>),
    Registered(anyccl::Registered<'c, Box<dyn DeviceMemory>>),
}

impl std::ops::Deref for Mem<'_> {
    type Target = dyn DeviceMemory;
    fn deref(&self) -> &Self::Target {
        match self {
            Mem::Plain(m) => m.as_ref(),
            Mem::Registered(r) => &**r,
        }
    }
}

impl std::ops::DerefMut for Mem<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        match self {
            Mem::Plain(m) => m.as_mut(),
            Mem::Registered(r) => &mut **r,
        }
    }
}

/// How the rows' buffers are allocated and registered.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Registration {
    Plain,
    /// `--register`.
    Local,
    /// `--window`.
    Window,
}

impl Registration {
    /// What the header says of the buffers, where they are registered.
    fn header(self, caps: &anyccl::Capabilities) -> Option<&'static str> {
        match self {
            Registration::Plain => None,
            Registration::Local if caps.buffer_registration => {
                Some("allocated for registration and registered with the communicator (--register)")
            }
            Registration::Local => Some("--register: this backend has no buffer registration; plain buffers"),
            Registration::Window if caps.windows => {
                Some("allocated for registration and registered as windows of the communicator (--window)")
            }
            Registration::Window => Some("--window: this backend has no windows; plain buffers"),
        }
    }
}

/// Receive buffers per size with `--window` when `--depth` does not say: each is a
/// collective registration, and every rank must make the same ones.
const WINDOW_DEPTH: usize = 8;

/// `count` elements for the rows: allocated the way the library registers best and
/// registered with `comm` (`--register`), or registered as a window of it (`--window`:
/// collective), or plain.
async fn alloc_mem<'c>(
    platform: &dyn Platform,
    comm: &'c Communicator,
    how: Registration,
    dtype: DType,
    count: usize,
) -> Result<Mem<'c>> {
    Ok(match how {
        _ if count == 0 => Mem::Plain(platform.alloc(dtype, count)?),
        Registration::Plain => Mem::Plain(platform.alloc(dtype, count)?),
        Registration::Local => Mem::Registered(comm.register(platform.alloc_registrable(dtype, count)?)?),
        Registration::Window => Mem::Registered(comm.register_window(platform.alloc_registrable(dtype, count)?).await?),
    })
}

struct Bufs<'c> {
    send: Mem<'c>,
    /// Receive buffers of out-of-place calls, then the buffers of in-place calls
    /// (re-allocated where the shape differs: reduce_scatter's hold the whole input).
    recvs: Vec<Mem<'c>>,
    /// The encoded input of an in-place call (that buffer's size).
    in_place_input: Vec<u8>,
}

/// Every expected output of a row, tabulated once: inputs repeat every `pattern::PERIOD`
/// elements, so an output element is a lookup by its source rank and index modulo the
/// period (the check of a 1 GiB buffer allocates nothing per element).
struct Expected {
    op: Op,
    n: usize,
    me: usize,
    root: usize,
    /// Output elements this rank checks.
    count: usize,
    /// The reduction over all ranks, by index modulo the period.
    reduced: [f64; pattern::PERIOD],
    /// Each rank's input as stored, by index modulo the period.
    inputs: Vec<[f64; pattern::PERIOD]>,
}

impl Expected {
    fn new(op: Op, dtype: DType, rop: ReduceOp, n: usize, me: usize, root: usize, count: usize) -> Self {
        let reduced = std::array::from_fn(|k| pattern::reduced(n, k, dtype, rop, 0));
        let inputs = (0..n)
            .map(|r| std::array::from_fn(|k| pattern::round_trip(pattern::value(r, k, Some(rop), 0), dtype)))
            .collect();
        Expected { op, n, me, root, count, reduced, inputs }
    }

    /// Output element `i` on this rank (`None`: not defined here, e.g. reduce off the root).
    fn at(&self, i: usize) -> Option<f64> {
        const P: usize = pattern::PERIOD;
        let (n, me) = (self.n, self.me);
        let per = (self.count / n).max(1);
        Some(match self.op {
            Op::AllReduce => self.reduced[i % P],
            Op::Reduce => {
                if me != self.root {
                    return None;
                }
                self.reduced[i % P]
            }
            Op::Broadcast => self.inputs[self.root][i % P],
            Op::AllGather => self.inputs[i / per][(i % per) % P],
            Op::ReduceScatter => self.reduced[(me * self.count + i) % P],
            Op::AllToAll => self.inputs[i / per][(me * per + i % per) % P],
            Op::SendRecv => self.inputs[(me + n - 1) % n][i % P],
        })
    }
}

/// Wrong elements in `recv` after one operation of the row, counted on this host's share of
/// the cores.
#[allow(clippy::too_many_arguments)] // the row's shape and the buffer
fn wrong(
    platform: &dyn Platform,
    op: Op,
    dtype: DType,
    rop: ReduceOp,
    comm: &Communicator,
    root: usize,
    recv: &dyn DeviceMemory,
    in_place: bool,
    local_ranks: usize,
) -> Result<usize> {
    let es = dtype.size();
    let mut bytes = vec![0u8; recv.count() * es];
    platform.copy_to_host(recv, &mut bytes)?;
    let (n, me) = (comm.size(), comm.rank());
    let (mut data, mut count) = (&bytes[..], recv.count());
    if in_place && op == Op::ReduceScatter {
        // The result is this rank's chunk of the whole buffer.
        count = recv.count() / n;
        data = &bytes[me * count * es..(me + 1) * count * es];
    }
    let want = Expected::new(op, dtype, rop, n, me, root, count);
    let tol = pattern::tolerance(dtype, Some(rop));
    let check = |first: usize, chunk: &[u8]| {
        chunk
            .chunks_exact(es)
            .enumerate()
            .filter(|(j, b)| want.at(first + j).is_some_and(|w| !pattern::close(pattern::decode_one(b, dtype), w, tol)))
            .count()
    };
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = (cores / local_ranks.max(1)).clamp(1, 16).min(count.div_ceil(1 << 20)).max(1);
    let per = count.div_ceil(threads);
    let bad = std::thread::scope(|s| {
        let parts: Vec<_> = data
            .chunks(per * es)
            .enumerate()
            .map(|(t, chunk)| {
                let check = &check;
                s.spawn(move || check(t * per, chunk))
            })
            .collect();
        parts.into_iter().map(|h| h.join().unwrap_or(usize::MAX)).fold(0usize, usize::saturating_add)
    });
    Ok(bad)
}

/// A barrier through the store, so that meeting costs no collective (which would connect
/// transports before the cold call is measured). One for the whole run: its count makes
/// every barrier's key new.
struct StoreBarrier<'a> {
    store: &'a dyn anyccl::Store,
    n: usize,
    me: usize,
    calls: usize,
    timeout: Duration,
}

impl StoreBarrier<'_> {
    async fn wait(&mut self, what: &str) -> Result<()> {
        self.calls += 1;
        let key = format!("bench/barrier/{what}/{}", self.calls);
        anyccl_examples::meet(self.store, &key, self.me, self.n, self.timeout).await
    }

    /// Rank 0's `value`, on every rank.
    async fn agree(&mut self, what: &str, value: u64) -> Result<u64> {
        self.calls += 1;
        let key = format!("bench/agree/{what}/{}", self.calls);
        if self.me == 0 {
            self.store.set(&key, &value.to_le_bytes()).await?;
        }
        let v = self.store.wait(&key, anyccl::raw::deadline_in(self.timeout)).await?;
        let bytes: [u8; 8] = v.as_slice().try_into().map_err(|_| bad_arg("store", format!("bad value under {key}")))?;
        Ok(u64::from_le_bytes(bytes))
    }
}

/// Untimed calls before a timed run: `calls`, then more until `min_time` has passed.
#[derive(Clone, Copy)]
struct Warmup {
    calls: usize,
    min_time: Duration,
}

/// This rank's input pattern for `count` elements, encoded once per row.
fn input(rank: usize, count: usize, dtype: DType, rop: ReduceOp) -> Vec<u8> {
    pattern::encode(&pattern::values(rank, count, Some(rop), 0), dtype)
}

struct Row {
    bytes: usize,
    count: usize,
    oop: (f64, usize),
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("anyccl-bench: {e}");
            ExitCode::from(1)
        }
    }
}

fn bad_arg(arg: &'static str, msg: String) -> anyccl::Error {
    anyccl::Error::InvalidArgument { op: "anyccl-bench", arg, rank: anyccl::raw::env_rank(), group: String::new(), msg }
}

async fn run(args: Args) -> Result<()> {
    let op = Op::parse(&args.op).ok_or_else(|| bad_arg("op", format!("unknown op '{}'", args.op)))?;
    let dtype = DType::parse(&args.dtype).ok_or_else(|| bad_arg("-d", format!("unknown type '{}'", args.dtype)))?;
    let rop = ReduceOp::parse(&args.redop).ok_or_else(|| bad_arg("-o", format!("unknown op '{}'", args.redop)))?;
    let min = parse_size(&args.min).map_err(|m| bad_arg("-b", m))?;
    let max = parse_size(&args.max).map_err(|m| bad_arg("-e", m))?;
    if args.factor < 2 {
        return Err(bad_arg("-f", "the step factor must be at least 2".into()));
    }
    if min > max {
        return Err(bad_arg(
            "-b",
            format!("the smallest size ({min} B) is larger than the largest (-e, {max} B): no rows"),
        ));
    }
    if args.iters == 0 {
        return Err(bad_arg("-n", "at least one timed iteration is needed".into()));
    }
    if args.check > 1 {
        return Err(bad_arg("-c", format!("{} is not 0 or 1", args.check)));
    }
    let anyccl_examples::Rank { env, store, backend, platform, world: comm, server: _server, .. } =
        anyccl_examples::start_world("anyccl-bench", args.backend.as_deref(), CommConfig::from_env()?).await?;
    let (n, me) = (comm.size(), comm.rank());
    let root = args.root;
    if op.rooted() && root >= n {
        return Err(bad_arg("-r", format!("root {root} is out of range for {n} ranks")));
    }
    let timeout = comm.config().op_timeout;
    let print = me == 0;
    if let Some(mode) = modes::Mode::of(&args) {
        if op != Op::AllReduce {
            return Err(bad_arg(mode.flag(), format!("this mode times all_reduce only, not {}", args.op)));
        }
        let r = modes::run(mode, &args, &env, &comm, &platform, store.as_ref(), (min, max), dtype, rop).await;
        comm.shutdown().await?;
        return r;
    }
    let how = match (args.register, args.window) {
        (true, _) => Registration::Local,
        (_, true) => Registration::Window,
        _ => Registration::Plain,
    };
    let first = min.max(dtype.size() * op.unit(n));
    if first > max {
        return Err(bad_arg(
            "-e",
            format!(
                "the smallest {} of {} on a world of {n} is {first} B, above -e ({max} B): no rows",
                args.op, args.dtype
            ),
        ));
    }
    if print && !args.json {
        let info = backend.probe()?;
        println!(
            "# anyccl-bench {} on {} ranks, backend {} {}, device {}",
            args.op,
            n,
            info.name,
            info.version,
            platform.device()
        );
        let tuning = backend.tuning();
        if !tuning.is_empty() {
            let t: Vec<String> = tuning.iter().map(|(k, v)| format!("{k}={v}")).collect();
            println!("# tuning: {}", t.join(" "));
        }
        if let Some(said) = how.header(comm.capabilities()) {
            println!("# buffers: {said}");
        }
        println!("#  nThread 1 nGpus 1 minBytes {min} maxBytes {max} step: {}(factor) warmup iters: {} iters: {} validation: {} in flight: {}", args.factor, args.warmup, args.iters, args.check, match (args.depth, args.window) {
            (Some(d), _) => d.to_string(),
            (None, true) => WINDOW_DEPTH.to_string(),
            (None, false) => "as many as fit".to_string(),
        });
        println!("#");
        println!("#                                                              out-of-place                       in-place                    cold first call");
        println!("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong     time   devmem");
        println!("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)            (us)    (MiB)");
    }
    let mut rows = Vec::new();
    let mut sync = StoreBarrier { store: store.as_ref(), n, me, calls: 0, timeout };
    let warmup = |first: bool| Warmup {
        calls: args.warmup,
        min_time: if first { Duration::from_millis(args.warmup_ms) } else { Duration::ZERO },
    };
    let budget = budget(platform.as_ref(), env.local_world_size);

    let mut bytes = first;
    let mut sum_bus = 0.0;
    let mut wrong_total = 0;
    while bytes <= max {
        let (sc, rc) = counts(op, bytes, dtype.size(), n);
        let size_b = rc.max(sc) * dtype.size();
        // Enough receive buffers to enqueue a run back to back without waiting, within the
        // budget above.
        let depth = |count: usize| match how {
            Registration::Window => args.depth.map_or(WINDOW_DEPTH, |d| d as usize),
            _ => depth(budget, count * dtype.size(), args.iters).min(args.depth.map_or(usize::MAX, |d| d as usize)),
        };
        let send_input = input(me, sc, dtype, rop);
        let alloc = |count: usize| alloc_mem(platform.as_ref(), &comm, how, dtype, count);
        let mut b = Bufs { send: alloc(sc).await?, recvs: Vec::new(), in_place_input: Vec::new() };
        platform.copy_from_host(&mut *b.send, &send_input)?;
        for _ in 0..depth(rc) {
            b.recvs.push(alloc(rc).await?);
        }
        // Cold: the first call of this size on this communicator, with its memory. The
        // ranks meet through the store, so no collective runs before it.
        sync.wait(&format!("cold{bytes}")).await?;
        platform.synchronize()?;
        let before = platform.mem_info()?.free;
        let t = Instant::now();
        issue(&comm, op, Some(&*b.send), &mut *b.recvs[0], rop, root)?.wait(timeout)?;
        let cold_us = t.elapsed().as_secs_f64() * 1e6;
        let after = platform.mem_info()?.free;
        let cold_mib = before.saturating_sub(after) as f64 / (1 << 20) as f64;
        let oop = timed(
            &comm,
            &platform,
            op,
            &mut b,
            rop,
            root,
            warmup(rows.is_empty()),
            args.iters,
            timeout,
            false,
            &mut sync,
        )
        .await?;
        let oop_wrong = if args.check != 0 {
            wrong(platform.as_ref(), op, dtype, rop, &comm, root, &*b.recvs[0], false, env.local_world_size)?
        } else {
            0
        };
        let ip = match in_place_layout(op, me, sc, rc, dtype, send_input) {
            None => None,
            Some((count, input)) => {
                // Buffers of the in-place shape, as many as fit the same 4 GiB (those of the
                // out-of-place run when the shape is the same).
                if count != rc {
                    b.recvs.clear();
                    for _ in 0..depth(count) {
                        b.recvs.push(alloc(count).await?);
                    }
                }
                b.in_place_input = input;
                let t =
                    timed(&comm, &platform, op, &mut b, rop, root, warmup(false), args.iters, timeout, true, &mut sync)
                        .await?;
                let w = if args.check != 0 {
                    wrong(platform.as_ref(), op, dtype, rop, &comm, root, &*b.recvs[0], true, env.local_world_size)?
                } else {
                    0
                };
                Some((t, w))
            }
        };
        wrong_total += oop_wrong + ip.map(|x| x.1).unwrap_or(0);
        let ip_issue_us = ip.map(|x| x.0.issue_us);
        let ip = ip.map(|(t, w)| (t.us, w));
        let (oop_issue_us, oop) = (oop.issue_us, oop.us);
        let row = Row { bytes: size_b, count: size_b / dtype.size(), oop: (oop, oop_wrong) };
        let algbw = |us: f64| row.bytes as f64 / us / 1e3;
        sum_bus += algbw(oop) * op.bus_factor(n);
        if print {
            let cols = |(us, w): (f64, usize)| {
                format!("{us:8.2} {:7.2} {:7.2} {w:6}", algbw(us), algbw(us) * op.bus_factor(n))
            };
            let redop = if op.reduces() { rop.name() } else { "none" };
            let rt = if op.rooted() { root.to_string() } else { "-1".into() };
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"op": args.op, "ranks": n, "size": row.bytes, "count": row.count, "type": dtype.name(), "redop": redop, "root": rt,
                        "oop_us": oop, "oop_issue_us": oop_issue_us, "oop_algbw": algbw(oop), "oop_busbw": algbw(oop) * op.bus_factor(n), "oop_wrong": oop_wrong,
                        "ip_us": ip.map(|x| x.0), "ip_issue_us": ip_issue_us, "ip_busbw": ip.map(|x| algbw(x.0) * op.bus_factor(n)), "ip_wrong": ip.map(|x| x.1),
                        "cold_us": cold_us, "cold_devmem_mib": cold_mib})
                );
            } else {
                let ipc =
                    ip.map(cols).unwrap_or_else(|| format!("{:>8} {:>7} {:>7} {:>6}", "N/A", "N/A", "N/A", "N/A"));
                println!(
                    "{:12} {:13} {:>9} {:>7} {:>7} {} {} {:8.1} {:8.1}",
                    row.bytes,
                    row.count,
                    dtype.name(),
                    redop,
                    rt,
                    cols(row.oop),
                    ipc,
                    cold_us,
                    cold_mib
                );
            }
        }
        rows.push(row);
        drop(b);
        bytes = bytes.saturating_mul(args.factor);
    }
    if print && !args.json {
        println!("# Out of bounds values : {wrong_total} {}", if wrong_total == 0 { "OK" } else { "FAILED" });
        println!("# Avg bus bandwidth    : {:.4}", sum_bus / rows.len().max(1) as f64);
        println!("#");
    }
    comm.shutdown().await?;
    if wrong_total > 0 {
        return Err(bad_arg("-c", format!("{wrong_total} wrong elements")));
    }
    Ok(())
}

/// Bytes of receive buffers a rank may hold for a run back to back: host memory is shared
/// by this host's ranks, a device's is its rank's own. The bench holds up to three copies of
/// the depth (results, in-place inputs, and a backend's copy of results not yet waited for),
/// so each rank takes an eighth of its share, 4 GiB at most.
fn budget(platform: &dyn Platform, local_world_size: usize) -> usize {
    let free = platform.mem_info().map(|m| m.free).unwrap_or(u64::MAX);
    let sharing = if platform.kind() == DeviceKind::Cpu { local_world_size.max(1) as u64 } else { 1 };
    (free / sharing / 8).min(4 << 30) as usize
}

/// Receive buffers of `bytes` each for `iters` calls back to back within `budget`.
fn depth(budget: usize, bytes: usize, iters: usize) -> usize {
    budget.checked_div(bytes.max(1)).unwrap_or(1).clamp(1, iters.max(1))
}

/// Average time per operation (us) over `iters` calls issued back to back, `depth` at a
/// time on distinct receive buffers, after the `warmup` untimed calls.
///
/// The ranks meet through the store before the warm-up calls, not right before the timer:
/// a store barrier releases ranks tens of microseconds apart, while the last warm-up
/// collective lines them up as closely as the operation itself can (as nccl-tests does).
#[allow(clippy::too_many_arguments)]
async fn timed(
    comm: &Communicator,
    platform: &Arc<dyn Platform>,
    op: Op,
    b: &mut Bufs<'_>,
    rop: ReduceOp,
    root: usize,
    warmup: Warmup,
    iters: usize,
    timeout: Duration,
    in_place: bool,
    sync: &mut StoreBarrier<'_>,
) -> Result<Timing> {
    // `count` calls in chunks of at most one per receive buffer; the time of the calls only,
    // and the part of it the host spent enqueuing them.
    let run = |count: usize, b: &mut Bufs<'_>| -> Result<(Duration, Duration)> {
        let mut total = Duration::ZERO;
        let mut issuing = Duration::ZERO;
        let mut left = count;
        // The clock is read where a timed stretch starts and ends, not around every call (a
        // read costs tens of nanoseconds, a fair share of a small operation): out of place
        // the loop is one stretch, as an MPI benchmark times its blocking loop; in place each
        // refill ends one. At depth 1 the issue's share is timed on every 16th call from the
        // first, and scaled.
        const SAMPLE: usize = 16;
        let (mut ones, mut sampled) = (0u32, (0u32, Duration::ZERO));
        let mut stretch = Instant::now();
        while left > 0 {
            let k = left.min(b.recvs.len());
            if in_place {
                total += stretch.elapsed();
                for r in b.recvs.iter_mut().take(k) {
                    platform.copy_from_host(&mut **r, &b.in_place_input)?;
                }
                // Refilling the inputs is not part of the operation, and the copies take
                // different times on different ranks: line the ranks up again.
                comm.barrier()?.wait(timeout)?;
                stretch = Instant::now();
            }
            let send = (!in_place).then_some(&*b.send);
            if k == 1 {
                // One call at a time (depth 1): no list to allocate.
                let sample = (count - left).is_multiple_of(SAMPLE).then(Instant::now);
                let mut w = issue(comm, op, send, &mut *b.recvs[0], rop, root)?;
                ones += 1;
                if let Some(s) = sample {
                    sampled.0 += 1;
                    sampled.1 += s.elapsed();
                }
                w.wait(timeout)?;
            } else {
                let start = Instant::now();
                let mut works = Vec::with_capacity(k);
                for r in b.recvs.iter_mut().take(k) {
                    works.push(issue(comm, op, send, &mut **r, rop, root)?);
                }
                issuing += start.elapsed();
                for mut w in works {
                    w.wait(timeout)?;
                }
            }
            left -= k;
        }
        total += stretch.elapsed();
        if sampled.0 > 0 {
            // The sampled calls' mean issue time, for every call of the chunks of one.
            issuing += sampled.1 / sampled.0 * ones;
        }
        Ok((total, issuing))
    };
    sync.wait(if in_place { "in-place" } else { "timed" }).await?;
    // At least one untimed call, so the timed ones start from ranks in step.
    let first = warmup.calls.max(1);
    let (took, _) = run(first, b)?;
    if !warmup.min_time.is_zero() {
        // Every rank must issue the same calls: rank 0's estimate of how many fill the time.
        let per_call = took.as_secs_f64() / first as f64;
        let want = (warmup.min_time.as_secs_f64() / per_call.max(1e-7)).ceil().min(1e6) as u64;
        let more = sync.agree("warmup", want).await?;
        run(more as usize, b)?;
    }
    let (total, issuing) = run(iters, b)?;
    let per_call = |d: Duration| d.as_secs_f64() * 1e6 / iters.max(1) as f64;
    Ok(Timing { us: per_call(total), issue_us: per_call(issuing) })
}

/// Average microseconds per call: in all, and on the host enqueuing it (when that is close
/// to the whole, the host, not the device or the link, sets the pace).
#[derive(Clone, Copy)]
struct Timing {
    us: f64,
    issue_us: f64,
}
