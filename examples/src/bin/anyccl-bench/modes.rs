//! The benchmark's all_reduce modes beside an engine's stream (NCCL): `--vs-raw` (raw NCCL
//! and anyccl in interleaved pairs), `--graph` (replayed CUDA graphs) and `--overlap-us`
//! (compute beside an all_reduce, ordered by events).

use crate::args::{bad_arg, Args};
use crate::bufs::{alloc_mem, budget, depth, Bufs, Registration};
use crate::op::Op;
use crate::timing::{timed, StoreBarrier, Warmup};
use anyccl::{CommConfig, Communicator, DType, DeviceMemory, LaunchEnv, Platform, ReduceOp, Result};
use anyccl_examples::outln;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which mode the flags ask for.
#[derive(Clone, Copy, Debug)]
pub(super) enum Mode {
    VsRaw(usize),
    Graph(usize),
    Overlap(f64),
}

impl Mode {
    pub(super) fn of(args: &Args) -> Option<Mode> {
        args.vs_raw
            .map(|p| Mode::VsRaw(p as usize))
            .or(args.graph.map(|k| Mode::Graph(k as usize)))
            .or(args.overlap_us.map(Mode::Overlap))
    }
    pub(super) fn flag(self) -> &'static str {
        match self {
            Mode::VsRaw(_) => "--vs-raw",
            Mode::Graph(_) => "--graph",
            Mode::Overlap(_) => "--overlap-us",
        }
    }
}

/// What every mode works with.
struct Ctx<'a> {
    args: &'a Args,
    comm: &'a Communicator,
    platform: &'a Arc<dyn Platform>,
    engine: anyccl::bench::EngineStream,
    sync: StoreBarrier<'a>,
    dtype: DType,
    rop: ReduceOp,
    timeout: Duration,
}

impl<'a> Ctx<'a> {
    fn print_header(&self, lines: &[String]) {
        if self.comm.rank() == 0 && !self.args.json {
            lines.iter().for_each(|l| outln!("{l}"));
        }
    }

    /// One row on rank 0: JSON (with the row's shape added) or text.
    fn emit(&self, mode: &str, count: usize, json: serde_json::Value, text: impl FnOnce() -> String) {
        if self.comm.rank() != 0 {
            return;
        }
        if self.args.json {
            let mut row = serde_json::json!({"op": "all_reduce", "mode": mode, "ranks": self.comm.size(),
                "size": count * self.dtype.size(), "count": count, "type": self.dtype.name()});
            if let (Some(r), serde_json::Value::Object(extra)) = (row.as_object_mut(), json) {
                r.extend(extra);
            }
            outln!("{row}");
        } else {
            outln!("{:12} {:13} {:>9} {}", count * self.dtype.size(), count, self.dtype.name(), text());
        }
    }

    /// Receive buffers for `iters` issued calls of `count` elements; with `--register`,
    /// allocated for registration and registered with the communicator.
    async fn bufs(&self, count: usize) -> Result<Bufs<'a>> {
        let (p, how) =
            (self.platform.as_ref(), if self.args.register { Registration::Local } else { Registration::Plain });
        let mut b = Bufs {
            send: alloc_mem(p, self.comm, how, self.dtype, count).await?,
            recvs: Vec::new(),
            in_place_input: Vec::new(),
        };
        for _ in 0..depth(budget(p, 1), count * self.dtype.size(), self.args.iters) {
            b.recvs.push(alloc_mem(p, self.comm, how, self.dtype, count).await?);
        }
        Ok(b)
    }

    /// The normal rows' loop on `b`: microseconds per call, and per call on the host.
    async fn issued(&mut self, b: &mut Bufs<'_>) -> Result<(f64, f64)> {
        let w = Warmup { calls: self.args.warmup, min_time: Duration::ZERO };
        let (a, comm, p) = (self.args, self.comm, self.platform);
        let t = timed(comm, p, Op::AllReduce, b, self.rop, 0, w, a.iters, self.timeout, false, &mut self.sync).await?;
        Ok((t.us, t.issue_us))
    }
}

/// Run `mode` over the sizes `min..=max` (factor `-f`).
#[allow(clippy::too_many_arguments)]
pub(super) async fn run(
    mode: Mode,
    args: &Args,
    env: &LaunchEnv,
    comm: &Communicator,
    platform: &Arc<dyn Platform>,
    store: &dyn anyccl::Store,
    (min, max): (usize, usize),
    dtype: DType,
    rop: ReduceOp,
) -> Result<()> {
    let timeout = comm.config().op_timeout;
    let sync = StoreBarrier { store, n: comm.size(), me: comm.rank(), calls: 0, timeout };
    let engine = anyccl::bench::EngineStream::new(platform.device())?;
    let mut cx = Ctx { args, comm, platform, engine, sync, dtype, rop, timeout };
    let raw = match mode {
        // The raw side keeps NCCL's defaults: anyccl's thread-block settings are compared to them.
        Mode::VsRaw(_) => {
            let defaults =
                CommConfig { min_ctas: None, max_ctas: None, cga_cluster_size: None, ..comm.config().clone() };
            Some(
                anyccl::bench::RawNccl::connect(
                    store,
                    "bench/raw-id",
                    comm.rank(),
                    comm.size(),
                    env.local_rank,
                    &defaults,
                )
                .await?,
            )
        }
        _ => None,
    };
    match (mode, &raw) {
        (Mode::VsRaw(pairs), Some(raw)) => vs_raw_header(&cx, raw, pairs)?,
        (Mode::Graph(k), _) => graph_header(&cx, k),
        (Mode::Overlap(us), _) => overlap_header(&cx, us),
        _ => {}
    }
    let mut bytes = min.max(dtype.size());
    while bytes <= max {
        let count = (bytes / dtype.size()).max(1);
        match (mode, &raw) {
            (Mode::VsRaw(pairs), Some(raw)) => vs_raw(&mut cx, raw, count, pairs).await?,
            (Mode::Graph(k), _) => graph(&mut cx, count, k).await?,
            (Mode::Overlap(us), _) => overlap(&mut cx, count, us).await?,
            _ => {}
        }
        bytes = bytes.saturating_mul(args.factor);
    }
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn worst(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NAN, f64::max)
}

fn vs_raw_header(cx: &Ctx<'_>, raw: &anyccl::bench::RawNccl, pairs: usize) -> Result<()> {
    if cx.comm.rank() != 0 || cx.args.json {
        return Ok(());
    }
    let c = cx.comm.config();
    let costs: Vec<String> = raw.host_costs(20_000)?.into_iter().map(|(what, ns)| format!("{what} {ns:.0}")).collect();
    cx.print_header(&[
        format!("# anyccl-bench all_reduce --vs-raw {pairs}: {} ranks, {pairs} pairs per size (each pair runs the five patterns, in reverse order every other pair), {} iters after {} warm-up calls", cx.comm.size(), cx.args.iters, cx.args.warmup),
        format!("# raw: NCCL's defaults; anyccl: min_ctas {:?} max_ctas {:?} cga_cluster_size {:?}, shared_completion {}", c.min_ctas, c.max_ctas, c.cga_cluster_size, c.shared_completion),
        format!("# anyccl's buffers: {}", match cx.args.register {
            true => Registration::Local.header(cx.comm.capabilities()).unwrap_or_default(),
            false => "plain (raw's are plain too)",
        }),
        format!("# host cost per call, ns: {}", costs.join(", ")),
        format!("# completion: {}", if c.shared_completion {
            "shared (ANYCCL_SHARED_COMPLETION=1): an event after the newest operation when a Work is first asked about, so a wait may also wait for later operations"
        } else {
            "an event after each operation, recorded as the next is issued; a wait on the newest asks the stream (the default: a wait waits for its own operation only)"
        }),
        "# enqueued: the same calls through enqueue_all_reduce (stream order only: no Work), one signal_stream and one wait".into(),
        "# raw, N outputs: raw writing as many outputs in turn as anyccl's run keeps (N, one per Work in flight); raw and enqueued write one".into(),
        "# raw+events: raw with an event recorded after each call on events made before the timing, waited in chunks of N calls as the Work run waits its Works".into(),
        "# vs raw+events: anyccl over raw NCCL with an event per call, per pair: median/worst".into(),
        "#       size         count      type    raw (us)  anyccl (us)  median ratio  worst ratio  raw busbw  anyccl busbw  issue raw/anyccl (us)  raw+events (us)  raw, N outputs (us)  enqueued (us)  median/worst ratio  vs raw+events   pairs (raw/anyccl us)".into(),
    ]);
    Ok(())
}

/// `--vs-raw`: `pairs` interleaved timings of raw NCCL and of anyccl, the same calls (out of
/// place, `iters` back to back after `warmup`), then the medians, the median of the
/// per-pair ratios and the worst pair; also raw with an event per call, and the same calls
/// in stream order only (no Work, one signal of the engine's stream, one wait).
async fn vs_raw(cx: &mut Ctx<'_>, raw: &anyccl::bench::RawNccl, count: usize, pairs: usize) -> Result<()> {
    let (a, dtype) = (cx.args, cx.dtype);
    let mut b = cx.bufs(count).await?;
    let (shared_send, shared_recv): (Arc<dyn DeviceMemory>, Arc<dyn DeviceMemory>) =
        (Arc::from(cx.platform.alloc(dtype, count)?), Arc::from(cx.platform.alloc(dtype, count)?));
    let enqueued = |cx: &Ctx<'_>, k: usize| -> Result<f64> {
        let mut held = Vec::with_capacity(k);
        let t = Instant::now();
        for _ in 0..k {
            held.push(cx.comm.enqueue_all_reduce(Some(&shared_send), &shared_recv, cx.rop)?);
        }
        cx.comm.signal_stream(cx.engine.stream_ref())?;
        cx.engine.synchronize(cx.timeout)?;
        let us = t.elapsed().as_secs_f64() * 1e6 / k.max(1) as f64;
        drop(held);
        Ok(us)
    };
    let [mut raws, mut ours, mut ratios, mut raw_issue, mut our_issue, mut with_events, mut enq, mut enq_ratios, mut raw_outputs, mut ev_ratios]: [Vec<f64>; 10] =
        Default::default();
    let mut shown = Vec::new();
    for pair in 0..pairs {
        // The patterns in one order, then in the reverse order in the next pair, so that no
        // pattern always runs first or right after another (the host drifts within a pair).
        // Each filled once below.
        let none = anyccl::bench::RawTiming { us: 0.0, issue_us: 0.0 };
        let (mut r, mut mine, mut e, mut ro, mut q) = (none, (0.0, 0.0), none, none, 0.0);
        for step in 0..5 {
            match if pair % 2 == 0 { step } else { 4 - step } {
                0 => {
                    cx.sync.wait("raw").await?;
                    r = raw.all_reduce_us(count, dtype, (a.iters, a.warmup), None, 1)?;
                }
                1 => mine = cx.issued(&mut b).await?,
                2 => {
                    // An event per call, waited in chunks of as many calls as the `Work` run
                    // keeps in flight.
                    cx.sync.wait("raw-events").await?;
                    e = raw.all_reduce_us(count, dtype, (a.iters, a.warmup), Some(b.recvs.len()), 1)?;
                }
                3 => {
                    // Raw again, writing as many outputs in turn as anyccl's run keeps (its
                    // `Work`s borrow one output each until waited), so the two differ only
                    // in what anyccl adds.
                    cx.sync.wait("raw-outputs").await?;
                    ro = raw.all_reduce_us(count, dtype, (a.iters, a.warmup), None, b.recvs.len())?;
                }
                _ => {
                    cx.sync.wait("enqueued").await?;
                    enqueued(cx, a.warmup.max(1))?;
                    q = enqueued(cx, a.iters.max(1))?;
                }
            }
        }
        let (us, issue_us) = mine;
        raw_outputs.push(ro.us);
        enq.push(q);
        enq_ratios.push(q / r.us);
        raws.push(r.us);
        ours.push(us);
        ratios.push(us / r.us);
        raw_issue.push(r.issue_us);
        our_issue.push(issue_us);
        with_events.push(e.us);
        ev_ratios.push(us / e.us);
        shown.push(format!("{:.1}/{us:.1}", r.us));
    }
    let (w, enq_w, ev_w) = (worst(&ratios), worst(&enq_ratios), worst(&ev_ratios));
    let ev_q = median(&mut ev_ratios);
    let (ri, ai, ev, ro) =
        (median(&mut raw_issue), median(&mut our_issue), median(&mut with_events), median(&mut raw_outputs));
    let (mr, ma, mq) = (median(&mut raws), median(&mut ours), median(&mut ratios));
    let (m_enq, mq_enq) = (median(&mut enq), median(&mut enq_ratios));
    let busbw = |us: f64| (count * dtype.size()) as f64 / us / 1e3 * Op::AllReduce.bus_factor(cx.comm.size());
    let json = serde_json::json!({"raw_us": mr, "anyccl_us": ma, "median_ratio": mq, "worst_ratio": w, "pairs": shown,
        "raw_issue_us": ri, "anyccl_issue_us": ai, "raw_with_events_us": ev, "raw_outputs_us": ro, "raw_outputs": b.recvs.len(),
        "enqueued_us": m_enq, "enqueued_median_ratio": mq_enq, "enqueued_worst_ratio": enq_w,
        "vs_events_median_ratio": ev_q, "vs_events_worst_ratio": ev_w});
    cx.emit("vs_raw", count, json, || {
        format!(
            "{mr:11.2} {ma:12.2} {mq:13.3} {w:12.3} {:10.2} {:13.2} {:>22} {ev:16.2} {:>20} {m_enq:14.2} {:>19} {:>14}   {}",
            busbw(mr),
            busbw(ma),
            format!("{ri:.2}/{ai:.2}"),
            format!("{ro:.2} (N={})", b.recvs.len()),
            format!("{mq_enq:.3}/{enq_w:.3}"),
            format!("{ev_q:.3}/{ev_w:.3}"),
            shown.join(" ")
        )
    });
    Ok(())
}

fn graph_header(cx: &Ctx<'_>, k: usize) {
    cx.print_header(&[
        format!("# anyccl-bench all_reduce --graph {k}: {} ranks, {k} in-place all_reduces per graph, {} replays after {} warm-up replays", cx.comm.size(), cx.args.iters, cx.args.warmup),
        "#       size         count      type  issued (us)  replayed (us)   ratio".into(),
    ]);
}

/// `--graph K`: K in-place all_reduces captured into a graph on the engine's stream,
/// replayed `iters` times after `warmup` replays (one synchronize at the end): the time per
/// all_reduce, beside the same all_reduces issued (the normal rows' loop).
async fn graph(cx: &mut Ctx<'_>, count: usize, k: usize) -> Result<()> {
    let mut b = cx.bufs(count).await?;
    let (issued, _) = cx.issued(&mut b).await?;
    drop(b);
    let g: Arc<dyn DeviceMemory> = Arc::from(cx.platform.alloc(cx.dtype, count)?);
    let es = cx.engine.stream_ref();
    cx.engine.begin_capture()?;
    let captured: Result<Vec<_>> = (0..k).map(|_| cx.comm.capture_all_reduce(es, None, &g, cx.rop)).collect();
    // The capture ends whatever happened, so the stream is usable again.
    let graph = cx.engine.end_capture();
    let (captured, graph) = (captured?, graph?);
    cx.sync.wait("graph").await?;
    for _ in 0..cx.args.warmup.max(1) {
        cx.engine.replay(&graph)?;
    }
    cx.engine.synchronize(cx.timeout)?;
    cx.sync.wait("graph-timed").await?;
    let t = Instant::now();
    for _ in 0..cx.args.iters.max(1) {
        cx.engine.replay(&graph)?;
    }
    cx.engine.synchronize(cx.timeout)?;
    let replayed = t.elapsed().as_secs_f64() * 1e6 / (cx.args.iters.max(1) * k) as f64;
    drop(graph);
    drop(captured);
    let json = serde_json::json!({"ops_per_graph": k, "issued_us": issued, "replayed_us": replayed});
    cx.emit("graph", count, json, || format!("{issued:12.2} {replayed:14.2} {:7.3}", replayed / issued));
    Ok(())
}

fn overlap_header(cx: &Ctx<'_>, us: f64) {
    cx.print_header(&[
        format!("# anyccl-bench all_reduce --overlap-us {us}: {} ranks, {} steps per row after {} warm-up steps; compute = a kernel spinning {us} us on the engine's stream", cx.comm.size(), cx.args.iters, cx.args.warmup),
        "#       size         count      type  compute (us)  all_reduce (us)  back to back (us)  overlapped (us)  saved (us)".into(),
    ]);
}

/// `--overlap-us`: the mean over `iters` steps of: the compute alone, the all_reduce alone,
/// the two back to back (the host waits for the compute, then issues and waits for the
/// all_reduce), and the two overlapped (the all_reduce ordered after the engine's stream and
/// the engine's stream after it by events; one wait at the end).
async fn overlap(cx: &mut Ctx<'_>, count: usize, compute_us: f64) -> Result<()> {
    let mut g = cx.platform.alloc(cx.dtype, count)?;
    let step = |cx: &Ctx<'_>, kind: usize, g: &mut Box<dyn DeviceMemory>| -> Result<Duration> {
        let (comm, engine, es, rop, timeout) = (cx.comm, &cx.engine, cx.engine.stream_ref(), cx.rop, cx.timeout);
        let t = Instant::now();
        if kind == 0 || kind == 2 {
            engine.spin_us(compute_us)?;
            engine.synchronize(timeout)?;
        }
        if kind == 1 || kind == 2 {
            comm.all_reduce(None, g.view_mut(), rop)?.wait(timeout)?;
        }
        if kind == 3 {
            comm.wait_stream(es)?;
            let mut w = comm.all_reduce(None, g.view_mut(), rop)?;
            engine.spin_us(compute_us)?;
            comm.signal_stream(es)?;
            engine.synchronize(timeout)?;
            if !w.is_completed()? {
                return Err(bad_arg(
                    "--overlap-us",
                    "the engine's stream finished before the all_reduce it was ordered after".into(),
                ));
            }
        }
        Ok(t.elapsed())
    };
    let mut means = [0f64; 4];
    for (kind, mean) in means.iter_mut().enumerate() {
        cx.sync.wait(&format!("overlap{kind}")).await?;
        for _ in 0..cx.args.warmup {
            step(cx, kind, &mut g)?;
        }
        let mut total = Duration::ZERO;
        for _ in 0..cx.args.iters {
            total += step(cx, kind, &mut g)?;
        }
        *mean = total.as_secs_f64() * 1e6 / cx.args.iters.max(1) as f64;
    }
    let [c, a, b, o] = means;
    let json = serde_json::json!({"compute_us": c, "all_reduce_us": a, "back_to_back_us": b, "overlapped_us": o});
    cx.emit("overlap", count, json, || format!("{c:13.2} {a:16.2} {b:18.2} {o:16.2} {:11.2}", b - o));
    Ok(())
}
