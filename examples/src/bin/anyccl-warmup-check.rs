//! `anyccl-warmup-check [--no-warmup | --record DIR | --plan DIR]`: build a data group, a
//! pipeline group and an expert (token-dispatch) group over all ranks, warm them, then run
//! one step with the same collectives and print the device memory that step took. With the
//! warmup it should be (close to) nothing; without, it is what NCCL's lazy connects allocate.
//!
//! - default: warm from the groups' roles;
//! - `--no-warmup`: the step cold;
//! - `--record DIR`: the step cold, recorded; each rank writes its merged plan (with what the
//!   cold step took) to `DIR/warmup-plan-rank<r>.json`;
//! - `--plan DIR`: a fresh run warms from those files (the report gives warmed/cold);
//! - `--sleep-cycles N`: after the step, N times: the groups sleep (`sleep_groups`: the
//!   device memory that gave back), wake and are warmed again from their role plans
//!   (`wake_groups`), and the step runs again (the device memory it took); one row per cycle
//!   with the times, and the first cycle's reports.
#![forbid(unsafe_code)]

use anyccl::warmup::{
    sleep_groups, wake_groups, warmup, warmup_saved, PlanFile, PlanIdentity, Session, StepRecorder, Target,
    WarmupConfig,
};
use anyccl::{CommConfig, Communicator, DType, DeviceMemory, GroupSpec, P2POp, Platform, ReduceOp, Result, Role, Work};
use anyccl_examples::{errln, out, outln};
use clap::Parser;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    /// Skip the warmup (to see what the step costs cold).
    #[arg(long)]
    no_warmup: bool,
    /// Run the step cold and record it: each rank writes its plan to DIR.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["no_warmup", "plan"])]
    record: Option<std::path::PathBuf>,
    /// Warm from the plans a `--record` run wrote to DIR.
    #[arg(long, value_name = "DIR", conflicts_with = "no_warmup")]
    plan: Option<std::path::PathBuf>,
    /// Backend (default: the best available).
    #[arg(long)]
    backend: Option<String>,
    /// Print the warmup report as JSON too.
    #[arg(long)]
    json: bool,
    /// After the step: this many cycles of sleep, wake, warmup and the step again.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=10_000))]
    sleep_cycles: u64,
}

fn main() -> ExitCode {
    // Output that could not be written fails the run, and says so.
    anyccl_examples::out::finish("anyccl-warmup-check", program())
}

#[tokio::main(flavor = "current_thread")]
async fn program() -> ExitCode {
    let args = Args::parse();
    match run(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            errln!("anyccl-warmup-check: {e}");
            ExitCode::from(1)
        }
    }
}

fn done(mut w: Work<'_>) -> Result<()> {
    w.wait(Duration::from_secs(120))
}

async fn run(args: &Args) -> Result<()> {
    let owner = "warmup-check";
    let anyccl_examples::Rank { env, store, platform, world, backend, server: _server } =
        anyccl_examples::start_world(owner, args.backend.as_deref(), CommConfig::from_env()?).await?;
    let (n, me) = (env.world_size, env.rank);
    let all: Vec<usize> = (0..n).collect();
    let mut dp = world.split(Some(GroupSpec::new("dp", all.clone(), owner, Role::Data))).await?.ok_or_else(no_group)?;
    let mut pp =
        world.split(Some(GroupSpec::new("pp", all.clone(), owner, Role::Pipeline))).await?.ok_or_else(no_group)?;
    let mut ep = world.split(Some(GroupSpec::new("ep", all, owner, Role::Expert))).await?.ok_or_else(no_group)?;
    let caps = dp.capabilities().clone();
    let es = DType::BF16.size();
    let (small, large) = (caps.warmup_small_bytes / es, caps.warmup_large_bytes / es);

    let session = Session {
        store: store.as_ref(),
        job: owner,
        generation: 1,
        rank: me,
        world_size: n,
        members: None,
        platform: platform.as_ref(),
    };
    // Whose plan a file is: this program's groups at this size, on this backend.
    let identity = PlanIdentity {
        job: owner.into(),
        step: 0,
        rank: me,
        world_size: n,
        layout: format!("dp pp ep over {n} ranks, {}, probes {small}/{large} bf16", world.info().backend),
    };
    let plan_file = |dir: &std::path::Path| dir.join(format!("warmup-plan-rank{me}.json"));
    let cold = args.no_warmup || args.record.is_some();
    if !cold {
        let cfg = WarmupConfig { enabled: true, force: true, ..WarmupConfig::from_env(WarmupConfig::default())? };
        let targets = [Target::new(&dp), Target::new(&pp), Target::new(&ep)];
        let report = match &args.plan {
            Some(dir) => {
                let saved = PlanFile::load(&plan_file(dir), &identity);
                warmup_saved(&session, &targets, &saved, &cfg).await?
            }
            None => warmup(&session, &targets, &cfg).await?,
        };
        if me == 0 {
            out!("{}", report.table());
            if args.json {
                outln!("{}", report.to_json());
            }
        }
    }

    // The step: the same collectives a train step issues on these groups. Buffers first,
    // so the measurement sees only what the communication itself allocates.
    let p: &dyn Platform = platform.as_ref();
    let mut bufs = Vec::new();
    for c in [small, large] {
        let rounded = c.div_ceil(n) * n;
        bufs.push((
            p.alloc(DType::BF16, c)?,
            p.alloc(DType::BF16, c * n)?,
            p.alloc(DType::BF16, c)?,
            p.alloc(DType::BF16, rounded)?,
            p.alloc(DType::BF16, rounded)?,
        ));
    }
    p.synchronize()?;
    let timeout = world.config().op_timeout;
    anyccl_examples::meet(store.as_ref(), "warmup-check/step", me, n, timeout).await?;
    let before = p.mem_info()?.free;
    let recorder = args.record.as_ref().map(|_| StepRecorder::start(&[&dp, &pp, &ep], p));
    let t = Instant::now();
    step(&dp, &pp, &ep, &mut bufs, me, n)?;
    p.synchronize()?;
    let took = t.elapsed();
    let after = p.mem_info()?.free;
    let mib = (before as f64 - after as f64) / (1 << 20) as f64;
    let how = match (&args.record, &args.plan) {
        (Some(_), _) => "cold, recorded",
        _ if args.no_warmup => "cold, no warmup",
        (_, Some(_)) => "after warmup with --plan",
        _ => "after warmup from the role plans",
    };
    outln!(
        "rank {me}: step ({how}, {n} ranks, {}) took {mib:.1} MiB of device memory in {took:.2?}",
        world.info().backend
    );
    if let (Some(r), Some(dir)) = (recorder, &args.record) {
        let recorded = r.finish(&session, timeout).await?;
        if let Some(c) = &recorded.cost {
            let per: Vec<String> =
                c.groups.iter().map(|(g, b)| format!("{g} {:.1}", *b as f64 / (1 << 20) as f64)).collect();
            outln!(
                "rank {me}: recorded step took {:.1} MiB, counted from {}{}",
                c.total as f64 / (1 << 20) as f64,
                c.source.describe(),
                if per.is_empty() { String::new() } else { format!(" ({})", per.join(", ")) }
            );
        }
        let file = PlanFile { identity: identity.clone(), plans: recorded.plans, cold_step: recorded.cost, path: None };
        file.write(&plan_file(dir))?;
        outln!("rank {me}: plan written to {}", plan_file(dir).display());
    }
    if args.sleep_cycles > 0 {
        let cycles = Cycles { session, store: store.as_ref(), backend: backend.as_ref(), p, timeout };
        cycles.run(args.sleep_cycles, [&mut dp, &mut pp, &mut ep], &mut bufs).await?;
    }
    anyccl_examples::meet(store.as_ref(), "warmup-check/end", me, n, timeout).await?;
    for c in [&ep, &pp, &dp, &world] {
        c.shutdown().await?;
    }
    Ok(())
}

/// One step's buffers of one size: all_reduce and reduce_scatter output, all_gather
/// output, receive, all_to_all in and out.
type Bufs =
    (Box<dyn DeviceMemory>, Box<dyn DeviceMemory>, Box<dyn DeviceMemory>, Box<dyn DeviceMemory>, Box<dyn DeviceMemory>);

/// The step: the collectives a train step issues on the data, pipeline and expert groups.
fn step(dp: &Communicator, pp: &Communicator, ep: &Communicator, bufs: &mut [Bufs], me: usize, n: usize) -> Result<()> {
    for (a, big, b, x, y) in bufs.iter_mut() {
        done(dp.all_reduce(None, a.view_mut(), ReduceOp::Sum)?)?;
        done(dp.reduce_scatter(Some(big.view()), b.view_mut(), ReduceOp::Sum)?)?;
        done(dp.all_gather(Some(b.view()), big.view_mut())?)?;
        for (lo, hi) in (0..n.saturating_sub(1)).map(|i| (i, i + 1)) {
            if me == lo {
                done(pp.send(a.view(), hi)?)?;
                done(pp.recv(b.view_mut(), hi)?)?;
                done(pp.p2p_group(vec![P2POp::Send(a.view(), hi), P2POp::Recv(b.view_mut(), hi)])?)?;
            } else if me == hi {
                done(pp.recv(b.view_mut(), lo)?)?;
                done(pp.send(a.view(), lo)?)?;
                done(pp.p2p_group(vec![P2POp::Send(a.view(), lo), P2POp::Recv(b.view_mut(), lo)])?)?;
            }
        }
        done(ep.all_to_all(x.view(), y.view_mut(), None)?)?;
    }
    Ok(())
}

/// `--sleep-cycles`: what sleeping gives back, and what waking and warming again cost.
struct Cycles<'a> {
    session: Session<'a>,
    store: &'a dyn anyccl::Store,
    backend: &'a dyn anyccl::Backend,
    p: &'a dyn Platform,
    timeout: Duration,
}

impl Cycles<'_> {
    /// Device memory in use, MiB, once every rank got here (so no peer is mid-call).
    async fn in_use(&self, at: &str) -> Result<f64> {
        let (me, n) = (self.session.rank, self.session.world_size);
        anyccl_examples::meet(self.store, at, me, n, self.timeout).await?;
        self.p.synchronize()?;
        let m = self.p.mem_info()?;
        Ok((m.total - m.free) as f64 / (1 << 20) as f64)
    }

    async fn run(&self, cycles: u64, mut groups: [&mut Communicator; 3], bufs: &mut [Bufs]) -> Result<()> {
        let (me, n) = (self.session.rank, self.session.world_size);
        let cfg = WarmupConfig { enabled: true, force: true, ..WarmupConfig::from_env(WarmupConfig::default())? };
        if me == 0 {
            outln!("# sleep cycles: every group sleeps, wakes, is warmed from its role plan, and the step runs");
            outln!(
                "{:>6} {:>14} {:>12} {:>10} {:>10} {:>14} {:>14}",
                "cycle",
                "given back MiB",
                "sleep ms",
                "wake ms",
                "warm ms",
                "awake MiB",
                "step MiB"
            );
        }
        for k in 1..=cycles {
            let held = self.in_use(&format!("warmup-check/sleep{k}/before")).await?;
            let session = Session { generation: 1 + k, ..self.session };
            let t = Instant::now();
            let slept_report = sleep_groups(&session, &mut groups[..]).await?;
            let slept = t.elapsed();
            let asleep = self.in_use(&format!("warmup-check/sleep{k}/asleep")).await?;
            let t = Instant::now();
            let woke_report = wake_groups(&session, &mut groups[..], self.backend, None, &cfg).await?;
            let woke = t.elapsed().saturating_sub(Duration::from_secs_f64(woke_report.warm_ms / 1e3));
            let warmed = Duration::from_secs_f64(woke_report.warm_ms / 1e3);
            if me == 0 && k == 1 {
                out!("{}", slept_report.table("given back"));
                out!("{}", woke_report.table("taken by the wake"));
            }
            let awake = self.in_use(&format!("warmup-check/sleep{k}/awake")).await?;
            let [dp, pp, ep] = &groups;
            step(dp, pp, ep, bufs, me, n)?;
            let stepped = self.in_use(&format!("warmup-check/sleep{k}/stepped")).await?;
            outln!(
                "{k:>6} {:>14.1} {:>12.1} {:>10.1} {:>10.1} {:>14.1} {:>14.1}   (rank {me})",
                // `+ 0.0`: no "-0.0" for a difference that rounds to nothing.
                held - asleep + 0.0,
                slept.as_secs_f64() * 1e3,
                woke.as_secs_f64() * 1e3,
                warmed.as_secs_f64() * 1e3,
                awake - asleep + 0.0,
                stepped - awake + 0.0,
            );
        }
        Ok(())
    }
}

fn no_group() -> anyccl::Error {
    anyccl::raw::Ctx::process("anyccl-warmup-check").aborted("split: a member got no group")
}
