//! `anyccl-candle`: data-parallel training of a small candle model on the CPU, its
//! gradients all-reduced through anyccl straight from candle's storage (a borrowed slice is
//! the send buffer), checkpointed, crashed and recovered with the warmup, and checked bit for
//! bit against an uninterrupted run.
//!
//! `anyccl-candle demo` (the default) drives three launches of `anyccl-run`: a reference run,
//! a run whose last rank exits mid-run, and the recovered run. `anyccl-candle train ...` is
//! one rank of one launch.
#![forbid(unsafe_code)]

use anyccl::warmup::{warmup, Session, Target, WarmupConfig};
use anyccl::{Buf, BufMut, CommConfig, GroupSpec, ReduceOp, Role};
use anyccl_examples::checkpoint as ckpt;
use anyccl_examples::{errln, out, outln};
use candle_core::{Device, Storage, Tensor, Var};
use clap::{Args as ClapArgs, Parser, Subcommand};
use std::path::PathBuf;
use std::process::{Command, ExitCode};

const OWNER: &str = "anyccl-candle";

#[derive(Parser, Debug)]
#[command(name = "anyccl-candle")]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Reference run, crashing run, recovered run, bit-for-bit comparison.
    Demo(Job),
    /// One rank of one launch (started by anyccl-run).
    Train(Job),
}

#[derive(ClapArgs, Debug, Clone)]
struct Job {
    /// Data-parallel ranks.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=64))]
    ranks: u64,
    /// Training steps.
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    /// Checkpoint every this many steps.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    ckpt_every: u64,
    /// The last rank exits (code 17) at this step (`train`; the demo picks one).
    #[arg(long)]
    crash_at: Option<u64>,
    /// Recover from the newest consistent checkpoint under this run folder (`train`).
    #[arg(long)]
    resume_from: Option<PathBuf>,
    /// Output folder.
    #[arg(long, default_value = "target/anyccl-candle")]
    out: PathBuf,
    /// Name of this run, a folder under --out (`train`).
    #[arg(long, default_value = "run")]
    run: String,
    /// Hidden width of the model.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=4096))]
    width: u64,
}

fn main() -> ExitCode {
    // Output that could not be written fails the run, and says so.
    anyccl_examples::out::finish("anyccl-candle", program())
}

fn program() -> ExitCode {
    let cli = Cli::parse();
    let job = match cli.cmd {
        Some(Cmd::Train(job)) => {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => return fail(format!("cannot start a runtime: {e}")),
            };
            return match rt.block_on(train(&job)) {
                Ok(code) => code,
                Err(e) => fail(e),
            };
        }
        Some(Cmd::Demo(job)) => job,
        None => match Cli::parse_from(["anyccl-candle", "demo"]).cmd {
            Some(Cmd::Demo(job)) => job,
            _ => return ExitCode::from(2),
        },
    };
    match demo(&job) {
        Ok(code) => code,
        Err(e) => fail(e),
    }
}

fn fail(e: impl std::fmt::Display) -> ExitCode {
    errln!("anyccl-candle: {e}");
    ExitCode::from(1)
}

/// Errors of this program: anyccl's, candle's, or its own.
type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn demo(job: &Job) -> Res<ExitCode> {
    let here = std::env::current_exe()?;
    let runner = here.parent().ok_or("no folder")?.join("anyccl-run");
    let crash_at = job.steps * 3 / 5;
    if crash_at <= job.ckpt_every {
        return Err(format!("--steps {} leaves no checkpoint before the crash at step {crash_at}", job.steps).into());
    }
    for run in ["ref", "crash", "recovered"] {
        let _ = std::fs::remove_dir_all(job.out.join(run));
    }
    let launch = |run: &str, extra: &[String]| -> Res<bool> {
        outln!("\n=== {run} ===");
        let st = Command::new(&runner)
            .args(["-n", &job.ranks.to_string(), "--timeout", "600", "--"])
            .arg(&here)
            .args(["train", "--ranks", &job.ranks.to_string(), "--steps", &job.steps.to_string()])
            .args(["--ckpt-every", &job.ckpt_every.to_string(), "--width", &job.width.to_string()])
            .args(["--run", run, "--out"])
            .arg(&job.out)
            .args(extra)
            .env("ANYCCL_BACKEND", "cpu")
            .status()?;
        Ok(st.success())
    };
    if !launch("ref", &[])? {
        return Err("the reference run failed".into());
    }
    if launch("crash", &["--crash-at".into(), crash_at.to_string()])? {
        return Err("the crashing run did not crash".into());
    }
    let from = job.out.join("crash").display().to_string();
    if !launch("recovered", &["--resume-from".into(), from])? {
        return Err("the recovered run failed".into());
    }
    for r in 0..job.ranks as usize {
        let bits = |run: &str| -> Res<Vec<u32>> {
            let (_, p) = ckpt::read_shard(&job.out.join(run).join(format!("final/rank{r}.bin")))?;
            Ok(p.iter().map(|x| x.to_bits()).collect())
        };
        if bits("ref")? != bits("recovered")? {
            outln!("rank {r}: recovered parameters DIFFER from the uninterrupted run");
            return Ok(ExitCode::from(1));
        }
    }
    outln!("\nbit-for-bit match: the recovered candle model equals the uninterrupted run's on all {} ranks", job.ranks);
    Ok(ExitCode::SUCCESS)
}

/// splitmix64 in [-1, 1): the same inputs on every run and rank layout.
fn uniform(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// All-reduce (average) a candle gradient through anyccl: the send buffer is the tensor's
/// own storage, borrowed; only the result is a new buffer.
fn all_reduce_avg(comm: &anyccl::Communicator, grad: &Tensor) -> Res<Tensor> {
    let grad = grad.contiguous()?;
    let (storage, layout) = grad.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else { return Err("the example trains on the CPU".into()) };
    let (start, end) = layout.contiguous_offsets().ok_or("a contiguous gradient")?;
    let send = &cpu.as_slice::<f32>()?[start..end];
    let mut avg = vec![0f32; send.len()];
    comm.all_reduce(Some(Buf::host(send)), BufMut::host(&mut avg), ReduceOp::Avg)?.wait(comm.config().op_timeout)?;
    drop(storage);
    Ok(Tensor::from_vec(avg, grad.shape(), &Device::Cpu)?)
}

async fn train(job: &Job) -> Res<ExitCode> {
    let rank = anyccl_examples::start_world(OWNER, Some("cpu"), CommConfig::from_env()?).await?;
    let (me, n) = (rank.env.rank, rank.env.world_size);
    if n as u64 != job.ranks {
        return Err(format!("--ranks {} but the launcher started {n}", job.ranks).into());
    }
    let dp = rank
        .world
        .split(Some(GroupSpec::new("dp", (0..n).collect(), OWNER, Role::Data)))
        .await?
        .ok_or("no data-parallel group")?;
    let (h, dev) = (job.width as usize, Device::Cpu);
    let layout = format!("dp{n} width{h}");
    let shapes = [(8, h), (1, h), (h, 1), (1, 1)];
    let init: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(a, b))| Tensor::from_vec(uniform(i as u64, a * b), (a, b), &dev))
        .collect::<candle_core::Result<_>>()?;
    let params: Vec<Var> = init.iter().map(Var::from_tensor).collect::<candle_core::Result<_>>()?;
    let count: usize = shapes.iter().map(|(a, b)| a * b).sum();
    let flat = |ps: &[Var]| -> Res<Vec<f32>> {
        let mut v = Vec::with_capacity(count);
        for p in ps {
            v.extend(p.as_tensor().flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(v)
    };
    let id = |step: u64, job_id: &str| ckpt::ShardId {
        job: job_id.to_string(),
        step,
        rank: me,
        world_size: n,
        layout: layout.clone(),
        count: count as u64,
    };
    let run_dir = job.out.join(&job.run);
    let timeout = rank.world.config().op_timeout;
    let mut start = 0;
    let mut job_id = std::env::var("ANYCCL_JOB_ID").unwrap_or_else(|_| "candle".into());
    if let Some(from) = &job.resume_from {
        // The checkpoint every rank can load, agreed first; then warm the data-parallel
        // group's transports; then load.
        let want = ckpt::Expect { rank: me, world_size: n, layout: layout.clone(), count: count as u64 };
        let loaded = ckpt::agree_and_load(rank.store.as_ref(), "resume", from, &want, timeout).await?;
        let session = Session {
            store: rank.store.as_ref(),
            job: OWNER,
            generation: 1,
            rank: me,
            world_size: n,
            members: None,
            platform: rank.platform.as_ref(),
        };
        let wcfg = WarmupConfig { enabled: true, force: true, ..WarmupConfig::from_env(WarmupConfig::default())? };
        let report = warmup(&session, &[Target::new(&dp)], &wcfg).await?;
        if me == 0 {
            out!("{}", report.table());
        }
        let mut off = 0;
        for (p, &(a, b)) in params.iter().zip(&shapes) {
            p.set(&Tensor::from_vec(loaded.params[off..off + a * b].to_vec(), (a, b), &dev)?)?;
            off += a * b;
        }
        start = loaded.step;
        job_id = loaded.job;
        if me == 0 {
            outln!("loaded the checkpoint of step {start}");
        }
    }
    let lr = 0.05f64;
    for step in start..job.steps {
        if job.crash_at == Some(step) && me == n - 1 {
            outln!("rank {me}: crashing at step {step} (as asked)");
            std::process::exit(17);
        }
        // This rank's shard of the batch: 16 rows of 8 features, a smooth target.
        let x = Tensor::from_vec(uniform(1000 + step * 64 + me as u64, 16 * 8), (16, 8), &dev)?;
        let y = x.sum_keepdim(1)?.sin()?;
        let hidden = x.matmul(params[0].as_tensor())?.broadcast_add(params[1].as_tensor())?.tanh()?;
        let pred = hidden.matmul(params[2].as_tensor())?.broadcast_add(params[3].as_tensor())?;
        let loss = (pred - &y)?.sqr()?.mean_all()?;
        let grads = loss.backward()?;
        for p in &params {
            let g = grads.get(p.as_tensor()).ok_or("a parameter without a gradient")?;
            let g = all_reduce_avg(&dp, g)?;
            p.set(&(p.as_tensor() - (g * lr)?)?)?;
        }
        if me == 0 {
            outln!("step {:3}  loss {:.6}", step + 1, loss.to_scalar::<f32>()?);
        }
        let done = step + 1;
        if done % job.ckpt_every == 0 {
            ckpt::write_shard(&ckpt::shard_path(&run_dir, done, me), &id(done, &job_id), &flat(&params)?)?;
            anyccl_examples::meet(rank.store.as_ref(), &format!("ckpt/{done}"), me, n, timeout).await?;
            if me == 0 {
                std::fs::write(ckpt::step_dir(&run_dir, done).join("COMPLETE"), b"")?;
            }
        }
    }
    ckpt::write_shard(&run_dir.join(format!("final/rank{me}.bin")), &id(job.steps, &job_id), &flat(&params)?)?;
    anyccl_examples::meet(rank.store.as_ref(), "end", me, n, timeout).await?;
    dp.shutdown().await?;
    rank.world.shutdown().await?;
    Ok(ExitCode::SUCCESS)
}
