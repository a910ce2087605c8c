//! `anyccl-sim --ranks N [--layout DPxTPxPP[xEP]] [--procs P] [--fault fail:R|hang:R|die:R]
//! [--json]`: the real warmup (agreement, execution, outcome) of N simulated ranks against
//! the real TCP store, over a backend that moves no data but connects lazily (simulated
//! connect time and memory). The ranks are tasks in P child processes of this one, each
//! rank with its own store client; this process hosts the store. It prints the store
//! requests per phase (in all and per rank; failure polling apart) and each phase's wall
//! time, and with `--fault` checks that every other rank returned the error in time.
#![forbid(unsafe_code)]

mod backend;
mod counting;

use anyccl::warmup::{plan_for, warmup, warmup_saved, PlanFile, PlanIdentity, Session, Sizes, Target, WarmupConfig};
use anyccl::{CommConfig, Communicator, EtcdStore, GroupSpec, Role, Store, TcpStore, TcpStoreOptions, TcpStoreServer};
use backend::{Arrivals, Costs, Fault, SimComm, SimPlatform};
use clap::Parser;
use counting::{Counters, Counting, PhaseFigures, PHASES};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::process::{ExitCode, Stdio};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser, Debug, Clone)]
#[command(about = "Simulate the warmup protocol of N ranks against the real store")]
struct Args {
    /// Simulated ranks.
    #[arg(long)]
    ranks: usize,
    /// Parallel layout, outermost first: data × tensor × pipeline [× expert] (e.g. 64x8x8);
    /// the product is the rank count. Default: data × 8 × 8 where it divides, else data × 8,
    /// else data only.
    #[arg(long)]
    layout: Option<String>,
    /// Processes the ranks are spread over (each rank keeps its own store client).
    #[arg(long, default_value_t = 4)]
    procs: usize,
    /// `fail:R` (rank R's first operation fails), `hang:R` (never completes), `die:R` (kills
    /// its process, with every rank in it).
    #[arg(long, default_value = "none")]
    fault: String,
    /// The warmup's deadline, seconds.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Simulated time of each new connection, milliseconds.
    #[arg(long, default_value_t = 20)]
    connect_ms: u64,
    /// Simulated device memory of each new connection, MiB.
    #[arg(long, default_value_t = 64)]
    connect_mib: u64,
    /// The store: `tcp` (a TCP store server in this process) or `etcd://host:port[,...]`
    /// (keys under a prefix of this run's own).
    #[arg(long, default_value = "tcp")]
    store: String,
    /// Warm from a saved plan per rank (`warmup_saved`), so the members first agree on
    /// each group's plan source.
    #[arg(long)]
    saved: bool,
    /// Call the same generation again afterwards: it must replay the outcome.
    #[arg(long)]
    repeat: bool,
    /// Instead of a warmup, measure the store: every rank's client sets and reads its own
    /// key for this many seconds; prints requests per second.
    #[arg(long, default_value_t = 0)]
    store_bench: u64,
    /// Print the figures as one JSON object.
    #[arg(long)]
    json: bool,
    /// Internal: run the ranks of child K against the store at --store-addr.
    #[arg(long, hide = true)]
    child: Option<usize>,
    /// Internal: the store's address.
    #[arg(long, hide = true)]
    store_addr: Option<String>,
    /// Internal: the etcd key prefix.
    #[arg(long, hide = true)]
    store_prefix: Option<String>,
}

/// The dimensions of a layout, outermost first, with their roles.
#[derive(Debug, Clone)]
struct Layout {
    dims: Vec<(&'static str, Role, usize)>,
}

impl Layout {
    fn parse(spec: Option<&str>, ranks: usize) -> Result<Layout, String> {
        let sizes: Vec<usize> = match spec {
            Some(s) => s
                .split('x')
                .map(|d| d.trim().parse::<usize>().ok().filter(|&d| d > 0))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    format!("--layout {s:?}: expected sizes like 64x8x8 (data x tensor x pipeline [x expert])")
                })?,
            None if ranks.is_multiple_of(64) && ranks >= 128 => vec![ranks / 64, 8, 8],
            None if ranks.is_multiple_of(8) && ranks >= 16 => vec![ranks / 8, 8],
            None => vec![ranks],
        };
        if sizes.len() > 4 {
            return Err(format!(
                "--layout: at most 4 dimensions (data x tensor x pipeline x expert), got {}",
                sizes.len()
            ));
        }
        let product: usize = sizes.iter().product();
        if product != ranks {
            return Err(format!("--layout {}: its product is {product}, --ranks is {ranks}", join(&sizes)));
        }
        let names = [("dp", Role::Data), ("tp", Role::Tensor), ("pp", Role::Pipeline), ("ep", Role::Expert)];
        Ok(Layout { dims: sizes.iter().zip(names).map(|(&n, (name, role))| (name, role, n)).collect() })
    }

    /// Every group `rank` is a member of: its name, role and members.
    fn groups_of(&self, rank: usize) -> Vec<(String, Role, Vec<usize>)> {
        // Coordinates with the tensor dimension innermost: rank = ((dp·pp + p)·ep + e)·tp + t.
        let order: Vec<usize> = [0, 2, 3, 1].into_iter().filter(|&d| d < self.dims.len()).collect();
        let mut stride = vec![0usize; self.dims.len()];
        let mut s = 1;
        for &d in order.iter().rev() {
            stride[d] = s;
            s *= self.dims[d].2;
        }
        let coord = |r: usize, d: usize| (r / stride[d]) % self.dims[d].2;
        self.dims
            .iter()
            .enumerate()
            .filter(|(_, (_, _, n))| *n > 1)
            .map(|(d, (name, role, n))| {
                let base = rank - coord(rank, d) * stride[d];
                (name.to_string(), role.clone(), (0..*n).map(|i| base + i * stride[d]).collect())
            })
            .collect()
    }

    fn describe(&self) -> String {
        self.dims.iter().map(|(n, _, s)| format!("{n}{s}")).collect::<Vec<_>>().join("x")
    }
}

fn join(v: &[usize]) -> String {
    v.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")
}

fn parse_fault(s: &str, ranks: usize) -> Result<(Fault, usize), String> {
    if s == "none" {
        return Ok((Fault::None, usize::MAX));
    }
    let (kind, rank) =
        s.split_once(':').ok_or_else(|| format!("--fault {s:?}: expected none, fail:R, hang:R or die:R"))?;
    let rank: usize = rank.parse().map_err(|_| format!("--fault {s:?}: {rank:?} is not a rank"))?;
    if rank >= ranks {
        return Err(format!("--fault {s:?}: rank {rank} is outside the {ranks} ranks"));
    }
    let f = match kind {
        "fail" => Fault::Fail,
        "hang" => Fault::Hang,
        "die" => Fault::Die,
        _ => return Err(format!("--fault {s:?}: {kind:?} is not fail, hang or die")),
    };
    Ok((f, rank))
}

/// One rank's end.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RankEnd {
    rank: usize,
    ok: bool,
    kind: String,
    /// The error (first 300 characters).
    msg: String,
    /// From the start signal to the warmup's return.
    ms: f64,
    /// Store requests answered (`--store-bench`).
    #[serde(default)]
    ops: u64,
    /// `--repeat`: what the second call of the generation did (`replayed`, or why not).
    #[serde(default)]
    repeat: String,
}

/// What a child reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ChildReport {
    child: usize,
    connect_ms: f64,
    ranks: Vec<RankEnd>,
    phases: Vec<(String, PhaseFigures)>,
    /// The longest time any rank spent between its agreement and its outcome.
    execute_ms: f64,
}

fn main() -> ExitCode {
    if let Err(e) = anyccl::init_logging(anyccl::LogLevel::ERROR) {
        eprintln!("anyccl-sim: {e}");
        return ExitCode::from(2);
    }
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("anyccl-sim: cannot start a runtime: {e}");
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
            eprintln!("anyccl-sim: {e}");
            ExitCode::from(2)
        }
    }
}

fn check_args(a: &Args) -> Result<(Layout, Fault, usize), String> {
    if a.ranks == 0 || a.ranks > 65536 {
        return Err(format!("--ranks {}: expected 1 to 65536", a.ranks));
    }
    if a.procs == 0 || a.procs > a.ranks || a.procs > 64 {
        return Err(format!("--procs {}: expected 1 to min(64, --ranks)", a.procs));
    }
    if a.timeout == 0 || a.timeout > 3600 {
        return Err(format!("--timeout {}: expected 1 to 3600 seconds", a.timeout));
    }
    if a.store != "tcp" && !a.store.starts_with("etcd://") {
        return Err(format!("--store {:?}: expected tcp or etcd://host:port[,host:port...]", a.store));
    }
    let layout = Layout::parse(a.layout.as_deref(), a.ranks)?;
    let (fault, at) = parse_fault(&a.fault, a.ranks)?;
    Ok((layout, fault, at))
}

fn block(k: usize, procs: usize, ranks: usize) -> std::ops::Range<usize> {
    k * ranks / procs..(k + 1) * ranks / procs
}

async fn child(a: &Args, k: usize) -> Result<ExitCode, String> {
    // The simulation's processes never outlive it: killed with it, even by kill -9.
    let parent = std::env::var("ANYCCL_SIM_PARENT").ok().and_then(|p| p.parse::<i32>().ok());
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).map_err(|e| format!("prctl: {e}"))?;
    if parent.is_some_and(|p| nix::unistd::getppid().as_raw() != p) {
        return Err("the simulation that started this process is gone".into());
    }
    let (layout, fault, fault_rank) = check_args(a)?;
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
    println!("ready");
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
            let session =
                Session { store: &*store, job: "sim", generation: 1, rank: r, world_size: world, platform: &platform };
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
    println!("{}", serde_json::to_string(&report).map_err(|e| e.to_string())?);
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
    println!("{}", serde_json::to_string(&report).map_err(|e| e.to_string())?);
    Ok(ExitCode::SUCCESS)
}

fn parent(a: &Args) -> Result<ExitCode, String> {
    let (layout, fault, fault_rank) = check_args(a)?;
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
    // Every rank returns by the deadline + 5 s; a process still running well after that
    // (stopped, or hung outside the warmup) is killed, and its ranks count as unreported.
    let limit = Duration::from_secs(a.timeout + 30);
    let mut reports = Vec::new();
    let mut ended = vec![false; a.procs];
    let mut died = Vec::new();
    while ended.iter().any(|e| !e) {
        match rx.recv_timeout(limit.saturating_sub(go.elapsed())) {
            Ok((_, Some(l))) => match serde_json::from_str::<ChildReport>(&l) {
                Ok(r) => reports.push(r),
                Err(_) => eprintln!("anyccl-sim: unexpected line from a child: {l}"),
            },
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
            println!("{j}");
        } else {
            println!(
                "# store {}: {} clients (connected in {} ms), {} requests (set, get) in {} s: {} requests/s",
                j["store"], clients, j["clients_connect_ms"], ops, j["seconds"], j["requests_per_s"]
            );
        }
        let all = clients == a.ranks && died.is_empty();
        return Ok(if all { ExitCode::SUCCESS } else { ExitCode::from(1) });
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
        println!("{j}");
    } else {
        print_table(&summary);
        match &verdict {
            Ok(s) => println!("# check: {s}"),
            Err(s) => println!("# check FAILED: {s}"),
        }
    }
    drop(server);
    Ok(if verdict.is_ok() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

fn layout_arg(l: &Layout) -> String {
    join(&l.dims.iter().map(|d| d.2).collect::<Vec<_>>())
}

fn kill_all(children: &mut [std::process::Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn summarize(a: &Args, layout: &Layout, reports: &[ChildReport], clients_ms: f64, wall: Duration) -> serde_json::Value {
    let n = a.ranks as f64;
    let mut phases = serde_json::Map::new();
    let mut total = 0u64;
    let mut keys_total = 0u64;
    let mut polls = 0u64;
    for (i, name) in PHASES.iter().enumerate() {
        let figs: Vec<&PhaseFigures> = reports.iter().map(|r| &r.phases[i].1).collect();
        let ops: u64 = figs.iter().map(|f| f.ops).sum();
        let keys: u64 = figs.iter().map(|f| f.keys).sum();
        let first = figs.iter().map(|f| f.first_ns).min().unwrap_or(u64::MAX);
        let last = figs.iter().map(|f| f.last_ns).max().unwrap_or(0);
        let wall_ms = if ops == 0 || last < first { 0.0 } else { (last - first) as f64 / 1e6 };
        if *name == "poll" {
            polls = ops;
        } else {
            total += ops;
            keys_total += keys;
        }
        phases.insert(
            name.to_string(),
            serde_json::json!({ "ops": ops, "per_rank": ops as f64 / n, "keys": keys, "wall_ms": round(wall_ms) }),
        );
    }
    let mut ms: Vec<f64> = reports.iter().flat_map(|r| r.ranks.iter().map(|e| e.ms)).collect();
    ms.sort_by(f64::total_cmp);
    let pick = |q: f64| ms.get(((ms.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0);
    let ok = reports.iter().flat_map(|r| &r.ranks).filter(|e| e.ok).count();
    let reported = reports.iter().map(|r| r.ranks.len()).sum::<usize>();
    serde_json::json!({
        "ranks": a.ranks,
        "layout": layout.describe(),
        "procs": a.procs,
        "store": if a.store == "tcp" { "tcp" } else { "etcd" },
        "store_ops_total": total,
        "store_ops_per_rank": round(total as f64 / n),
        "store_keys_total": keys_total,
        "polls": polls,
        "phases": phases,
        "execute_ms_max": round(reports.iter().map(|r| r.execute_ms).fold(0.0, f64::max)),
        "warmup_ms": { "min": round(pick(0.0)), "median": round(pick(0.5)), "max": round(pick(1.0)) },
        "wall_ms": round(wall.as_secs_f64() * 1e3),
        "clients_connect_ms": round(clients_ms),
        "ranks_ok": ok,
        "ranks_failed": reported - ok,
        "ranks_unreported": a.ranks - reported,
    })
}

fn round(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn print_table(s: &serde_json::Value) {
    println!(
        "# anyccl-sim: {} ranks, layout {}, {} processes, store {}",
        s["ranks"], s["layout"], s["procs"], s["store"]
    );
    println!(
        "# clients connected in {} ms; warmup call min/median/max {}/{}/{} ms",
        s["clients_connect_ms"], s["warmup_ms"]["min"], s["warmup_ms"]["median"], s["warmup_ms"]["max"]
    );
    println!("# {:>8} {:>12} {:>10} {:>12} {:>10}", "phase", "store ops", "per rank", "keys", "wall ms");
    for name in PHASES {
        let p = &s["phases"][name];
        println!("  {:>8} {:>12} {:>10} {:>12} {:>10}", name, p["ops"], p["per_rank"], p["keys"], p["wall_ms"]);
    }
    println!("  {:>8} {:>12} {:>10}", "total", s["store_ops_total"], s["store_ops_per_rank"]);
    println!(
        "# execution (slowest rank, agreement to outcome): {} ms; ranks ok {}, failed {}, unreported {}",
        s["execute_ms_max"], s["ranks_ok"], s["ranks_failed"], s["ranks_unreported"]
    );
}

/// Whether the run ended as it must: every rank ok without a fault; with one, every rank
/// that did not die returned an error within the deadline + 5 s.
fn judge(
    a: &Args,
    fault: Fault,
    at: usize,
    reports: &[ChildReport],
    died: &[(usize, String)],
) -> Result<String, String> {
    let ends: Vec<&RankEnd> = reports.iter().flat_map(|r| &r.ranks).collect();
    let bound = (a.timeout + 5) as f64 * 1e3;
    let dead_child =
        (fault == Fault::Die).then(|| (0..a.procs).find(|&k| block(k, a.procs, a.ranks).contains(&at))).flatten();
    let expect_reported = match dead_child {
        Some(k) => a.ranks - block(k, a.procs, a.ranks).len(),
        None => a.ranks,
    };
    if ends.len() != expect_reported {
        return Err(format!(
            "{} ranks reported, {expect_reported} expected (processes that ended badly: {died:?})",
            ends.len()
        ));
    }
    if let Some(k) = dead_child {
        if !died.iter().any(|(d, _)| *d == k) {
            return Err(format!("child {k} (rank {at}) was to die but exited normally"));
        }
    } else if !died.is_empty() {
        return Err(format!("processes ended badly: {died:?}"));
    }
    if a.repeat {
        let bad: Vec<_> = ends
            .iter()
            .filter(|e| e.repeat != "replayed")
            .take(3)
            .map(|e| format!("rank {}: {}", e.rank, e.repeat))
            .collect();
        if !bad.is_empty() {
            return Err(format!("the repeated generation did not replay: {}", bad.join(" | ")));
        }
    }
    let slowest = ends.iter().map(|e| e.ms).fold(0.0, f64::max);
    if fault == Fault::None {
        let bad: Vec<_> =
            ends.iter().filter(|e| !e.ok).take(3).map(|e| format!("rank {}: {}", e.rank, e.msg)).collect();
        return if bad.is_empty() {
            Ok(format!("all {} ranks warmed; slowest returned after {slowest:.0} ms", ends.len()))
        } else {
            Err(format!("ranks failed without a fault: {}", bad.join(" | ")))
        };
    }
    let ok: Vec<usize> = ends.iter().filter(|e| e.ok).map(|e| e.rank).take(5).collect();
    if !ok.is_empty() {
        return Err(format!("ranks {ok:?}... returned Ok although rank {at} had a fault"));
    }
    let late: Vec<_> =
        ends.iter().filter(|e| e.ms > bound).take(3).map(|e| format!("rank {} after {:.0} ms", e.rank, e.ms)).collect();
    if !late.is_empty() {
        return Err(format!("ranks returned later than the deadline + 5 s: {}", late.join(", ")));
    }
    let mut kinds: Vec<String> = ends.iter().map(|e| e.kind.clone()).collect();
    kinds.sort();
    kinds.dedup();
    let sample = ends.iter().find(|e| e.rank != at).map(|e| format!("rank {}: {}", e.rank, e.msg)).unwrap_or_default();
    Ok(format!(
        "every one of the {} ranks returned an error ({}) within {slowest:.0} ms (bound {bound:.0} ms); e.g. {sample}",
        ends.len(),
        kinds.join(", ")
    ))
}
