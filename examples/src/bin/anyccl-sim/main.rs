//! `anyccl-sim --ranks N [--layout DPxTPxPP[xEP]] [--procs P] [--fault fail:R|hang:R|die:R]
//! [--json]`: the real warmup (agreement, execution, outcome) of N simulated ranks against
//! the real TCP store, over a backend that moves no data but connects lazily (simulated
//! connect time and memory). The ranks are tasks in P child processes of this one, each
//! rank with its own store client; this process hosts the store. It prints the store
//! requests per phase (in all and per rank; failure polling apart) and each phase's wall
//! time, and with `--fault` checks that every other rank returned the error in time.
//!
//! `--fault kill-rank:R[@start|@steady] [--rejoin[=J]]` runs the membership instead (module
//! `members`, the parent's side in `stages`): every rank a member, rank R killed, the
//! survivors' agreement and a replacement's admission timed and counted.
//! `ANYCCL_SIM_LATE_FIRST_LOOK=1` (a test's switch) holds the `@start` rank's first look at
//! epoch 0 until another rank has decided it, so the answer that kills it also ends its join.
#![forbid(unsafe_code)]

mod args;
mod backend;
mod counting;
mod limits;
mod members;
mod report;
mod stages;

use anyccl::warmup::{plan_for, warmup, warmup_saved, PlanFile, PlanIdentity, Session, Sizes, Target, WarmupConfig};
use anyccl::{CommConfig, Communicator, EtcdStore, GroupSpec, Store, TcpStore, TcpStoreOptions, TcpStoreServer};
use anyccl_examples::{errln, outln};
use args::{block, check_args, layout_arg, Args};
use backend::{Arrivals, Costs, Fault, SimComm, SimPlatform};
use clap::Parser;
use counting::{Counters, Counting};
use report::{judge, print_table, round, summarize, ChildReport, RankEnd};
use std::io::{BufRead, BufReader, Write};
use std::process::{ExitCode, Stdio};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn main() -> ExitCode {
    // Output that could not be written fails the run, and says so.
    anyccl_examples::out::finish("anyccl-sim", program())
}

fn program() -> ExitCode {
    if let Err(e) = anyccl::init_logging(anyccl::LogLevel::ERROR) {
        errln!("anyccl-sim: {e}");
        return ExitCode::from(2);
    }
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            errln!("anyccl-sim: cannot start a runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let r = match args.child {
        Some(k) => rt.block_on(child(&args, k)),
        None => parent(&args),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            errln!("anyccl-sim: {e}");
            ExitCode::from(2)
        }
    }
}

async fn child(a: &Args, k: usize) -> Result<ExitCode, String> {
    // The simulation's processes never outlive it: killed with it, even by kill -9.
    let parent = std::env::var("ANYCCL_SIM_PARENT").ok().and_then(|p| p.parse::<i32>().ok());
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).map_err(|e| format!("prctl: {e}"))?;
    if parent.is_some_and(|p| nix::unistd::getppid().as_raw() != p) {
        return Err("the simulation that started this process is gone".into());
    }
    let plan = check_args(a)?;
    let (layout, fault, fault_rank) = (plan.layout, plan.fault, plan.fault_rank);
    let addr = a.store_addr.clone().ok_or("--child needs --store-addr")?;
    let mine = block(k, a.procs, a.ranks);
    let mut opts = TcpStoreOptions::from_env().map_err(|e| e.to_string())?;
    opts.connect_timeout = Duration::from_secs(120);

    // Every rank's own client, connected at once (thousands of clients meet the server).
    let t = Instant::now();
    let mut connecting = tokio::task::JoinSet::new();
    let etcd = addr.strip_prefix("etcd://").map(str::to_string);
    let prefix = a.store_prefix.clone().unwrap_or_else(|| "anyccl-sim".into());
    for r in mine.clone() {
        let (addr, opts, etcd, prefix) = (addr.clone(), opts.clone(), etcd.clone(), prefix.clone());
        connecting.spawn(async move {
            let s: anyccl::Result<Arc<dyn Store>> = match etcd {
                Some(ep) => EtcdStore::connect(&ep, &prefix, opts.connect_timeout).await.map(|s| Arc::new(s) as _),
                None => TcpStore::connect(addr, opts).await.map(|s| Arc::new(s) as _),
            };
            (r, s)
        });
    }
    let mut stores: Vec<Option<Arc<dyn Store>>> = vec![None; mine.len()];
    while let Some(j) = connecting.join_next().await {
        let (r, s) = j.map_err(|e| e.to_string())?;
        stores[r - mine.start] = Some(s.map_err(|e| format!("rank {r}: {e}"))?);
    }
    let connect_ms = t.elapsed().as_secs_f64() * 1e3;

    // Ready; wait for the start signal, so every process's ranks start together.
    outln!("ready");
    let _ = std::io::stdout().flush();
    let go = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).map(|_| line)
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())?;
    if go.trim() != "go" {
        return Err(format!("expected 'go' from the parent, got {go:?}"));
    }
    let started = Instant::now();
    if a.store_bench > 0 {
        return store_bench(a, k, &mine, stores, connect_ms, started).await;
    }
    if let Some(kill) = plan.kill {
        let stores = stores.into_iter().collect::<Option<Vec<_>>>().ok_or("a store client is missing")?;
        return members::child(a, k, kill, mine, stores, connect_ms).await;
    }

    let caps = backend::capabilities().map_err(|e| e.to_string())?;
    let counters = Arc::new(Counters::default());
    let arrivals = Arc::new(Arrivals::default());
    let costs = Costs { connect: Duration::from_millis(a.connect_ms), memory: a.connect_mib << 20 };
    let mut tasks = tokio::task::JoinSet::new();
    for (i, r) in mine.clone().enumerate() {
        let store = stores[i].take().ok_or("a store client is missing")?;
        let store = Arc::new(Counting::new(store, counters.clone()));
        let groups = layout.groups_of(r);
        let (arrivals, mine) = (arrivals.clone(), mine.clone());
        let (saved, repeat, layout_name, caps) = (a.saved, a.repeat, layout.describe(), caps.clone());
        let fault = if r == fault_rank { fault } else { Fault::None };
        let (world, timeout) = (a.ranks, Duration::from_secs(a.timeout));
        tasks.spawn(async move {
            let used = Arc::new(AtomicU64::new(0));
            let platform = SimPlatform { used: used.clone(), total: 141 << 30 };
            let config = CommConfig { flight_recorder: 64, ..CommConfig::default() };
            let mut comms = Vec::new();
            for (name, role, members) in groups {
                let local = members.iter().filter(|m| mine.contains(m)).count();
                let me = members.iter().position(|&m| m == r).unwrap_or(0);
                let spec = GroupSpec::new(name, members, "sim", role);
                let sim = SimComm::new(
                    caps.clone(),
                    me,
                    spec.ranks.len(),
                    spec.id(),
                    local,
                    arrivals.clone(),
                    used.clone(),
                    fault,
                    costs,
                );
                match Communicator::new(Arc::new(sim), spec, config.clone()) {
                    Ok(c) => comms.push(c),
                    Err(e) => return (r, Err(e), started.elapsed(), store, String::new()),
                }
            }
            let targets: Vec<Target<'_>> = comms.iter().map(Target::new).collect();
            let session = Session {
                store: &*store,
                job: "sim",
                generation: 1,
                rank: r,
                world_size: world,
                members: None,
                platform: &platform,
            };
            let cfg = WarmupConfig { enabled: true, timeout, sizes: Sizes::default(), ..WarmupConfig::default() };
            let run = || async {
                if saved {
                    let plans = targets.iter().filter_map(|t| plan_for(t, &caps, &cfg.sizes)).collect();
                    let identity = PlanIdentity {
                        job: "sim".into(),
                        step: 1,
                        rank: r,
                        world_size: world,
                        layout: layout_name.clone(),
                    };
                    let file = Ok(PlanFile { identity, plans, cold_step: None, path: None });
                    warmup_saved(&session, &targets, &file, &cfg).await
                } else {
                    warmup(&session, &targets, &cfg).await
                }
            };
            let res = run().await.map(|_| ());
            let took = started.elapsed();
            let again = if repeat {
                match (run().await, &res) {
                    (Ok(rep), Ok(())) if rep.replayed => "replayed".to_string(),
                    (Ok(_), Ok(())) => "ran again".to_string(),
                    (Err(anyccl::Error::Aborted { .. }), Err(_)) => "replayed".to_string(),
                    (r, _) => format!("{:?}", r.map(|_| ())),
                }
            } else {
                String::new()
            };
            (r, res, took, store, again)
        });
    }
    let mut ends = Vec::new();
    let mut execute = Duration::ZERO;
    while let Some(j) = tasks.join_next().await {
        let (rank, res, took, store, repeat) = j.map_err(|e| e.to_string())?;
        execute = execute.max(store.execute());
        let (ok, kind, msg) = match res {
            Ok(()) => (true, String::new(), String::new()),
            Err(e) => (false, e.kind().to_string(), e.to_string().chars().take(300).collect()),
        };
        ends.push(RankEnd { rank, ok, kind, msg, ms: took.as_secs_f64() * 1e3, ops: 0, repeat });
    }
    let report = ChildReport {
        child: k,
        connect_ms,
        ranks: ends,
        phases: counters.figures(),
        execute_ms: execute.as_secs_f64() * 1e3,
    };
    outln!("{}", serde_json::to_string(&report).map_err(|e| e.to_string())?);
    Ok(ExitCode::SUCCESS)
}

/// `--store-bench`: every rank's client sets and reads its own key until the time is up.
async fn store_bench(
    a: &Args,
    k: usize,
    mine: &std::ops::Range<usize>,
    stores: Vec<Option<Arc<dyn Store>>>,
    connect_ms: f64,
    started: Instant,
) -> Result<ExitCode, String> {
    let until = started + Duration::from_secs(a.store_bench);
    let mut tasks = tokio::task::JoinSet::new();
    for (r, st) in mine.clone().zip(stores) {
        let st = st.ok_or("a store client is missing")?;
        tasks.spawn(async move {
            let key = format!("bench/{r}");
            let mut ops = 0u64;
            while Instant::now() < until {
                st.set(&key, &ops.to_le_bytes()).await?;
                let v = st.get(&key).await?;
                if v.as_deref() != Some(&ops.to_le_bytes()[..]) {
                    return Err(anyccl::Error::store_fatal(format!("rank {r} read back {v:?}")));
                }
                ops += 2;
            }
            Ok::<_, anyccl::Error>((r, ops))
        });
    }
    let mut ranks = Vec::new();
    while let Some(j) = tasks.join_next().await {
        let (rank, ops) = j.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
        ranks.push(RankEnd {
            rank,
            ok: true,
            kind: String::new(),
            msg: String::new(),
            ms: started.elapsed().as_secs_f64() * 1e3,
            ops,
            repeat: String::new(),
        });
    }
    let report = ChildReport { child: k, connect_ms, ranks, phases: Counters::default().figures(), execute_ms: 0.0 };
    outln!("{}", serde_json::to_string(&report).map_err(|e| e.to_string())?);
    Ok(ExitCode::SUCCESS)
}

fn parent(a: &Args) -> Result<ExitCode, String> {
    let plan = check_args(a)?;
    let (layout, fault, fault_rank) = (plan.layout.clone(), plan.fault, plan.fault_rank);
    limits::check(a)?;
    let token = format!("sim-{}-{}", std::process::id(), rand::random::<u64>());
    let opts = TcpStoreOptions { token: Some(token.clone()), ..TcpStoreOptions::default() };
    let (server, addr) = if a.store == "tcp" {
        let s = TcpStoreServer::start(([127, 0, 0, 1], 0).into(), opts).map_err(|e| e.to_string())?;
        let addr = s.local_addr().to_string();
        (Some(s), addr)
    } else {
        // Reachable at all? Said now rather than after every rank's attempt.
        let ep = a.store.trim_start_matches("etcd://").to_string();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
        rt.block_on(EtcdStore::connect(&ep, "anyccl-sim", Duration::from_secs(10)))
            .map_err(|e| format!("--store {}: {e}", a.store))?;
        (None, a.store.clone())
    };
    let prefix = format!("anyccl-sim/{:016x}", rand::random::<u64>());
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    // A line from each child, read on threads so one slow child bounds nothing else.
    let (tx, rx) = std::sync::mpsc::channel::<(usize, Option<String>)>();
    let mut children = Vec::new();
    let mut inputs = Vec::new();
    for k in 0..a.procs {
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(["--ranks", &a.ranks.to_string(), "--layout", &layout_arg(&layout)])
            .args(["--procs", &a.procs.to_string(), "--fault", &a.fault, "--timeout", &a.timeout.to_string()])
            .args(["--connect-ms", &a.connect_ms.to_string(), "--connect-mib", &a.connect_mib.to_string()])
            .args(["--store-bench", &a.store_bench.to_string()])
            .args(a.saved.then_some("--saved"))
            .args(a.repeat.then_some("--repeat"))
            .args(["--beat-ms", &a.beat_ms.to_string(), "--stale-ms", &a.stale_ms.to_string()])
            .args(["--liveness", &a.liveness])
            .args(a.rejoin.map(|j| j.map_or("--rejoin".to_string(), |j| format!("--rejoin={j}"))))
            .args(["--child", &k.to_string(), "--store-addr", &addr, "--store-prefix", &prefix])
            .env("ANYCCL_STORE_TOKEN", &token)
            .env("ANYCCL_SIM_PARENT", std::process::id().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut c = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                kill_all(&mut children);
                return Err(format!("cannot start child {k}: {e}"));
            }
        };
        inputs.push(c.stdin.take());
        if let Some(out) = c.stdout.take() {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut out = BufReader::new(out);
                loop {
                    let mut line = String::new();
                    match out.read_line(&mut line) {
                        Ok(0) | Err(_) => {
                            let _ = tx.send((k, None));
                            return;
                        }
                        Ok(_) => {
                            let _ = tx.send((k, Some(line.trim().to_string())));
                        }
                    }
                }
            });
        }
        children.push(c);
    }
    drop(tx);
    let t = Instant::now();
    let mut ready = 0;
    while ready < a.procs {
        match rx.recv_timeout(Duration::from_secs(180).saturating_sub(t.elapsed())) {
            Ok((_, Some(l))) if l == "ready" => ready += 1,
            Ok((k, l)) => {
                kill_all(&mut children);
                return Err(format!("child {k} failed before the start: {l:?}"));
            }
            Err(_) => {
                kill_all(&mut children);
                return Err("the children did not connect their store clients within 180 s".into());
            }
        }
    }
    let clients_ms = t.elapsed().as_secs_f64() * 1e3;
    for i in inputs.iter_mut().flatten() {
        let _ = writeln!(i, "go");
        let _ = i.flush();
    }
    let go = Instant::now();
    let go_ns = counting::now_ns();
    let mut lines = Vec::new();
    let mut ended = vec![false; a.procs];
    let missed = plan.kill.and_then(|kill| stages::drive(a, kill, &rx, &mut inputs, &mut ended, &mut lines));
    // Every rank returns by the deadline + 5 s; a process still running well after that
    // (stopped, or hung outside the warmup) is killed, and its ranks count as unreported.
    // The membership's stages are bounded apart; then the children only report.
    let limit = go.elapsed() + Duration::from_secs(a.timeout + 30);
    let mut died = Vec::new();
    while ended.iter().any(|e| !e) {
        match rx.recv_timeout(limit.saturating_sub(go.elapsed())) {
            Ok((_, Some(l))) => lines.push(l),
            Ok((k, None)) => ended[k] = true,
            Err(_) => {
                for (k, c) in children.iter_mut().enumerate().filter(|(k, _)| !ended[*k]) {
                    let _ = c.kill();
                    died.push((k, format!("still running {limit:?} after the start (stopped or hung): killed")));
                }
                break;
            }
        }
    }
    let wall = go.elapsed();
    let mut reports = Vec::new();
    let mut member_reports = Vec::new();
    for l in &lines {
        if let Ok(r) = serde_json::from_str::<ChildReport>(l) {
            reports.push(r);
        } else if let Ok(r) = serde_json::from_str::<members::MemberReport>(l) {
            member_reports.push(r);
        } else {
            errln!("anyccl-sim: unexpected line from a child: {l}");
        }
    }
    for (k, c) in children.iter_mut().enumerate() {
        if died.iter().any(|(d, _)| *d == k) {
            let _ = c.wait();
            continue;
        }
        match c.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => died.push((k, s.to_string())),
            Err(e) => died.push((k, e.to_string())),
        }
    }
    if a.store_bench > 0 {
        let ops: u64 = reports.iter().flat_map(|r| &r.ranks).map(|e| e.ops).sum();
        let clients = reports.iter().map(|r| r.ranks.len()).sum::<usize>();
        let j = serde_json::json!({
            "store": if a.store == "tcp" { "tcp" } else { "etcd" },
            "clients": clients,
            "clients_connect_ms": round(clients_ms),
            "seconds": round(wall.as_secs_f64()),
            "requests": ops,
            "requests_per_s": round(ops as f64 / wall.as_secs_f64()),
            "connections_peak": server.as_ref().map(|s| s.stats().connections_peak),
        });
        if a.json {
            outln!("{j}");
        } else {
            outln!(
                "# store {}: {} clients (connected in {} ms), {} requests (set, get) in {} s: {} requests/s",
                j["store"],
                clients,
                j["clients_connect_ms"],
                ops,
                j["seconds"],
                j["requests_per_s"]
            );
        }
        let all = clients == a.ranks && died.is_empty();
        return Ok(if all { ExitCode::SUCCESS } else { ExitCode::from(1) });
    }
    if let Some(kill) = plan.kill {
        let mut summary = stages::summarize(a, kill, &member_reports, go_ns);
        summary["wall_ms"] = round(wall.as_secs_f64() * 1e3).into();
        summary["clients_connect_ms"] = round(clients_ms).into();
        if let Some(s) = &server {
            let st = s.stats();
            summary["server"] = serde_json::json!({ "requests": st.requests, "connections_peak": st.connections_peak });
        }
        let verdict = stages::judge(a, kill, &member_reports, &died, missed.as_deref());
        if a.json {
            summary["fault"] = serde_json::json!({ "spec": a.fault, "check": verdict.clone().unwrap_or_else(|e| e), "passed": verdict.is_ok() });
            outln!("{summary}");
        } else {
            stages::print_table(&summary, kill);
            match &verdict {
                Ok(s) => outln!("# check: {s}"),
                Err(s) => outln!("# check FAILED: {s}"),
            }
        }
        return Ok(if verdict.is_ok() { ExitCode::SUCCESS } else { ExitCode::from(1) });
    }
    let mut summary = summarize(a, &layout, &reports, clients_ms, wall);
    if let Some(s) = &server {
        let st = s.stats();
        summary["server"] = serde_json::json!({
            "requests": st.requests,
            "requests_per_s": round(st.requests as f64 / wall.as_secs_f64()),
            "connections_peak": st.connections_peak,
            "waiting_at_end": st.waiting,
        });
    }
    let verdict = judge(a, fault, fault_rank, &reports, &died);
    if a.json {
        let mut j = summary.clone();
        j["fault"] = serde_json::json!({ "spec": a.fault, "check": verdict.clone().unwrap_or_else(|e| e), "passed": verdict.is_ok() });
        outln!("{j}");
    } else {
        print_table(&summary);
        match &verdict {
            Ok(s) => outln!("# check: {s}"),
            Err(s) => outln!("# check FAILED: {s}"),
        }
    }
    drop(server);
    Ok(if verdict.is_ok() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

fn kill_all(children: &mut [std::process::Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}
