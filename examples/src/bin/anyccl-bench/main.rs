//! `anyccl-bench <op> [--backend B] [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP]
//! [-d DTYPE] [-o OP] [-c 0|1] [--json] [--vs-raw PAIRS]`: nccl-tests-style rows (size, count, type, redop,
//! root, then time, algbw, busbw and #wrong out of place and in place) plus two columns no
//! peer prints: the first (cold) call's time and the device memory it took. Runs under
//! `anyccl-run` (one rank per process) or alone.
//!
//! The largest row must fit before the first is run: host memory (`MemAvailable`, or
//! `ANYCCL_MEM_LIMIT` where lower) for this host's ranks, and the device's free memory.
#![forbid(unsafe_code)]
mod args;
mod bufs;
mod check;
mod fit;
mod modes;
mod op;
mod probe;
mod timing;

use anyccl_examples::{errln, outln};
use args::{bad_arg, parse_size, Args};
use bufs::{alloc_mem, budget, depth, Bufs, Registration, WINDOW_DEPTH};
use check::wrong;
use op::{counts, in_place_layout, issue, Op};
use timing::{timed, StoreBarrier, Warmup};

use anyccl::raw::pattern;
use anyccl::{CommConfig, DType, DeviceKind, ReduceOp, Result};
use clap::Parser;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// This rank's input pattern for `count` elements, encoded once per row.
fn input(rank: usize, count: usize, dtype: DType, rop: ReduceOp) -> Vec<u8> {
    pattern::encode(&pattern::values(rank, count, Some(rop), 0), dtype)
}

struct Row {
    bytes: usize,
    count: usize,
    oop: (f64, usize),
}

fn main() -> ExitCode {
    // Output that could not be written fails the run, and says so.
    anyccl_examples::out::finish("anyccl-bench", program())
}

#[tokio::main(flavor = "current_thread")]
async fn program() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            errln!("anyccl-bench: {e}");
            ExitCode::from(1)
        }
    }
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
    if let Some(mode) = modes::Mode::of(&args).filter(|_| op != Op::AllReduce) {
        return Err(bad_arg(mode.flag(), format!("this mode times all_reduce only, not {}", args.op)));
    }
    let anyccl_examples::Rank { env, store, backend, platform, world: comm, server: _server, .. } =
        anyccl_examples::start_world("anyccl-bench", args.backend.as_deref(), CommConfig::from_env()?).await?;
    let (n, me) = (comm.size(), comm.rank());
    let root = args.root;
    if op.rooted() && root >= n {
        return Err(bad_arg("-r", format!("root {root} is out of range for {n} ranks")));
    }
    // Before any buffer: the largest row must fit this machine.
    let first = min.max(dtype.size() * op.unit(n));
    let run = fit::Run {
        flags: format!("-b {} -e {}", args.min, args.max),
        op: (op, &args.op),
        dtype: (dtype, &args.dtype),
        ranks: n,
        rows: (first, max, args.factor),
    };
    if let Some(why) = fit::shortfall(&run, platform.as_ref(), env.local_world_size)? {
        return Err(bad_arg("-e", why));
    }
    let timeout = comm.config().op_timeout;
    let print = me == 0;
    if let Some(mode) = modes::Mode::of(&args) {
        if platform.device().kind != DeviceKind::Cuda {
            let on = format!("the {} backend on {}", comm.info().backend, platform.device());
            return Err(bad_arg(
                mode.flag(),
                format!("this mode times NCCL on a CUDA device (--backend nccl), not {on}"),
            ));
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
    if first > max {
        return Err(bad_arg(
            "-e",
            format!(
                "the smallest {} of {} on a world of {n} is {first} B, above -e ({max} B): no rows",
                args.op, args.dtype
            ),
        ));
    }
    let mut sync = StoreBarrier { store: store.as_ref(), n, me, calls: 0, timeout };
    // Only for the header (every rank takes part, or none: the flags are the same on all).
    let cpus = if args.json { None } else { timing::cpus_line(&mut sync).await? };
    if print && !args.json {
        let info = backend.probe()?;
        outln!(
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
            outln!("# tuning: {}", t.join(" "));
        }
        if let Some(c) = &cpus {
            outln!("# cpus: {c}");
        }
        if platform.kind() == DeviceKind::Cpu {
            outln!("# host: {}", probe::host_line());
        }
        // The algorithm and transport each size takes on this communicator, as chosen at
        // connect (thresholds from the host's cache and CPUs), so a slow run can be told
        // from a fast one.
        let mut b = first;
        while b <= max {
            let rc = counts(op, b, dtype.size(), n).1 * dtype.size();
            match comm.path(op.name(), rc) {
                Some(p) => outln!("# path {b:>11} B: {p}"),
                None => break,
            }
            b = b.saturating_mul(args.factor);
        }
        if let Some(said) = how.header(comm.capabilities()) {
            outln!("# buffers: {said}");
        }
        outln!("#  nThread 1 nGpus 1 minBytes {min} maxBytes {max} step: {}(factor) warmup iters: {} iters: {} validation: {} in flight: {}", args.factor, args.warmup, args.iters, args.check, match (args.depth, args.window) {
            (Some(d), true) => d.to_string(),
            (Some(d), false) => bufs::depth_said(d as usize, platform.kind() != DeviceKind::Cpu),
            (None, true) => WINDOW_DEPTH.to_string(),
            (None, false) if platform.kind() == DeviceKind::Cpu => bufs::host_depth_said(),
            (None, false) => bufs::device_depth_said(),
        });
        outln!("# time per call: {}", timing::average_said(args.average));
        outln!("#");
        outln!("#                                                              out-of-place                       in-place                    cold first call");
        outln!("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong     time   devmem");
        outln!("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)            (us)    (MiB)");
    }
    let mut rows = Vec::new();
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
        // Each receive buffer written once before any call: a buffer the warm-up calls do
        // not reach would otherwise take its first-touch page faults inside the timed calls
        // (32 MiB pipelined 50 deep with 20 warm-up calls took 22-46 ms a call instead of
        // 6.5-7.4), and the cold call's memory would count the bench's pages.
        let zeros = vec![0u8; rc * dtype.size()];
        for _ in 0..depth(rc) {
            let mut r = alloc(rc).await?;
            platform.copy_from_host(&mut *r, &zeros)?;
            b.recvs.push(r);
        }
        drop(zeros);
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
        let (oop, oop_ranks) = timing::over_ranks(&mut sync, oop, args.average).await?;
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
                let (t, ranks) = timing::over_ranks(&mut sync, t, args.average).await?;
                let w = if args.check != 0 {
                    wrong(platform.as_ref(), op, dtype, rop, &comm, root, &*b.recvs[0], true, env.local_world_size)?
                } else {
                    0
                };
                Some((t, w, ranks))
            }
        };
        wrong_total += oop_wrong + ip.as_ref().map(|x| x.1).unwrap_or(0);
        let ip_issue_us = ip.as_ref().map(|x| x.0.issue_us);
        let (ip, ip_ranks) = match ip {
            Some((t, w, ranks)) => (Some((t.us, w)), ranks),
            None => (None, Vec::new()),
        };
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
                outln!(
                    "{}",
                    serde_json::json!({"op": args.op, "ranks": n, "size": row.bytes, "count": row.count, "type": dtype.name(), "redop": redop, "root": rt,
                        "oop_us": oop, "oop_issue_us": oop_issue_us, "oop_algbw": algbw(oop), "oop_busbw": algbw(oop) * op.bus_factor(n), "oop_wrong": oop_wrong,
                        "ip_us": ip.map(|x| x.0), "ip_issue_us": ip_issue_us, "ip_busbw": ip.map(|x| algbw(x.0) * op.bus_factor(n)), "ip_wrong": ip.map(|x| x.1),
                        "cold_us": cold_us, "cold_devmem_mib": cold_mib, "average": args.average,
                        "oop_us_ranks": oop_ranks, "ip_us_ranks": ip_ranks})
                );
            } else {
                let ipc =
                    ip.map(cols).unwrap_or_else(|| format!("{:>8} {:>7} {:>7} {:>6}", "N/A", "N/A", "N/A", "N/A"));
                outln!(
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
        outln!("# Out of bounds values : {wrong_total} {}", if wrong_total == 0 { "OK" } else { "FAILED" });
        outln!("# Avg bus bandwidth    : {:.4}", sum_bus / rows.len().max(1) as f64);
        outln!("#");
    }
    comm.shutdown().await?;
    if wrong_total > 0 {
        return Err(bad_arg("-c", format!("{wrong_total} wrong elements")));
    }
    Ok(())
}
