//! `anyccl-warmup-check [--no-warmup]`: build a data group, a pipeline group and an expert
//! (token-dispatch) group over all ranks, warm them (unless `--no-warmup`), then run one step
//! with the same collectives and print the device memory that step took. With the warmup it
//! should be (close to) nothing; without, it is what NCCL's lazy connects allocate.
#![forbid(unsafe_code)]

use anyccl::warmup::{warmup, Session, Target, WarmupConfig};
use anyccl::{CommConfig, DType, GroupSpec, P2POp, Platform, ReduceOp, Result, Role, Work};
use clap::Parser;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    /// Skip the warmup (to see what the step costs cold).
    #[arg(long)]
    no_warmup: bool,
    /// Backend (default: the best available).
    #[arg(long)]
    backend: Option<String>,
    /// Print the warmup report as JSON too.
    #[arg(long)]
    json: bool,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("anyccl-warmup-check: {e}");
            ExitCode::from(1)
        }
    }
}

fn done(mut w: Work<'_>) -> Result<()> {
    w.wait(Duration::from_secs(120))
}

async fn run(args: &Args) -> Result<()> {
    let owner = "warmup-check";
    let anyccl_examples::Rank { env, store, platform, world, server: _server, .. } =
        anyccl_examples::start_world(owner, args.backend.as_deref(), CommConfig::from_env()?).await?;
    let (n, me) = (env.world_size, env.rank);
    let all: Vec<usize> = (0..n).collect();
    let dp = world.split(Some(GroupSpec::new("dp", all.clone(), owner, Role::Data))).await?.ok_or_else(no_group)?;
    let pp = world.split(Some(GroupSpec::new("pp", all.clone(), owner, Role::Pipeline))).await?.ok_or_else(no_group)?;
    let ep = world.split(Some(GroupSpec::new("ep", all, owner, Role::Expert))).await?.ok_or_else(no_group)?;
    let caps = dp.capabilities().clone();
    let es = DType::BF16.size();
    let (small, large) = (caps.warmup_small_bytes / es, caps.warmup_large_bytes / es);

    if !args.no_warmup {
        let session = Session {
            store: store.as_ref(),
            job: owner,
            generation: 1,
            rank: me,
            world_size: n,
            platform: platform.as_ref(),
        };
        let cfg = WarmupConfig { enabled: true, force: true, ..WarmupConfig::from_env(WarmupConfig::default())? };
        let report = warmup(&session, &[Target::new(&dp), Target::new(&pp), Target::new(&ep)], &cfg).await?;
        if me == 0 {
            print!("{}", report.table());
            if args.json {
                println!("{}", report.to_json());
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
    let t = Instant::now();
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
    p.synchronize()?;
    let took = t.elapsed();
    let after = p.mem_info()?.free;
    let mib = (before as f64 - after as f64) / (1 << 20) as f64;
    println!(
        "rank {me}: step ({}, {} ranks, {}) took {mib:.1} MiB of device memory in {took:.2?}",
        if args.no_warmup { "cold, no warmup" } else { "after warmup" },
        n,
        world.info().backend
    );
    anyccl_examples::meet(store.as_ref(), "warmup-check/end", me, n, timeout).await?;
    for c in [&ep, &pp, &dp, &world] {
        c.shutdown().await?;
    }
    Ok(())
}

fn no_group() -> anyccl::Error {
    anyccl::Error::Backend {
        backend: "split",
        op: "split".into(),
        code: -1,
        text: "member got no group".into(),
        recovery: anyccl::Recovery::Fatal,
        source: None,
    }
}
