//! `anyccl-recover`: a small data-parallel x pipeline-parallel training job that crashes,
//! recovers from its checkpoint and proves the result is bit-for-bit the uninterrupted one.
//!
//! `anyccl-recover demo` (the default) drives three launches of `anyccl-run`: a reference
//! run, a run that crashes (a rank exits mid-run), and the recovered run, then compares the
//! final parameters byte for byte. `anyccl-recover train ...` is one rank of one launch.
//!
//! The recovery order is the one that keeps the first step from running out of memory:
//! release what a colocated component holds, warm the train step's groups (never the
//! cross-engine weight-sync group), load the checkpoint, run the first step.
//!
//! What to warm is what the step uses: every launch records its first step, the members of
//! each group merge their recordings, and the plan is saved beside every checkpoint
//! (`warmup-plan-rank<r>.json`). Recovery warms from the plan of the checkpoint it loads, and
//! from the groups' roles where that file is missing or corrupt (saying so).
#![forbid(unsafe_code)]

use anyccl::warmup::{warmup, warmup_saved, PlanFile, PlanIdentity, Session, StepRecorder, Target, WarmupConfig};
use anyccl::{
    CommConfig, Communicator, DType, DeviceKind, DeviceMemory, Error, GroupRegistry, GroupSpec, Platform, ReduceOp,
    Result, Role,
};
use anyccl_examples::checkpoint as ckpt;
use clap::{Args as ClapArgs, Parser, Subcommand};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

const OWNER: &str = "anyccl-recover";

#[derive(Parser, Debug)]
#[command(name = "anyccl-recover")]
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
    /// Data-parallel replicas (default: 2 on CPU; 1 with GPUs).
    #[arg(long)]
    dp: Option<usize>,
    /// Pipeline stages (default: 2).
    #[arg(long)]
    pp: Option<usize>,
    /// Training steps (at least 1).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    /// Checkpoint every this many steps (at least 1).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    ckpt_every: u64,
    /// The last rank exits (code 17) when it reaches this step.
    #[arg(long)]
    crash_at: Option<u64>,
    /// Recover from the latest complete checkpoint under this run directory.
    #[arg(long)]
    resume_from: Option<PathBuf>,
    /// Output directory.
    #[arg(long, default_value = "target/anyccl-recover")]
    out: PathBuf,
    /// Name of this run (a folder under --out; `train` only, the demo names its three runs).
    #[arg(long)]
    run: Option<String>,
    /// Do not warm the communicators before the first step after recovery.
    #[arg(long)]
    no_warmup: bool,
    /// Warm from the groups' roles, not from the plan saved with the checkpoint.
    #[arg(long, conflicts_with = "no_warmup")]
    role_plan: bool,
    /// Before the first step after recovery, fill device memory until only this many MiB
    /// are free (GPU backends).
    #[arg(long)]
    squeeze: Option<u64>,
    /// Memory a colocated component (e.g. an inference engine) holds, MiB; released first
    /// when recovering.
    #[arg(long, default_value_t = 64)]
    #[arg(value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    colocated_mib: u64,
    /// Model width (1 to 4096).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    width: u64,
    /// Layers per pipeline stage (1 to 1024).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=1024))]
    layers: u64,
    /// Batch rows per replica (1 to 65536).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=65536))]
    batch: u64,
    /// Learning rate (a finite number above 0).
    #[arg(long, default_value_t = 4.0, value_parser = positive_f32)]
    lr: f32,
    /// Seed.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// Backend (default: ANYCCL_BACKEND, else the best available).
    #[arg(long)]
    backend: Option<String>,
}

fn positive_f32(s: &str) -> std::result::Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("must be a finite number above 0, not {s:?}")),
    }
}

impl Job {
    /// The model and parallel layout every shard records.
    fn layout(&self, dp: usize, pp: usize) -> String {
        format!("dp{dp} pp{pp} width{} layers{} seed{}", self.width, self.layers, self.seed)
    }
    fn run_name(&self) -> &str {
        self.run.as_deref().unwrap_or("run")
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let cmd = match cli.cmd {
        Some(c) => c,
        None => match Cli::parse_from(["anyccl-recover", "demo"]).cmd {
            Some(c) => c,
            None => return ExitCode::from(2),
        },
    };
    let r = match cmd {
        Cmd::Demo(job) => demo(&job),
        Cmd::Train(job) => match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt.block_on(train(&job)),
            Err(e) => Err(bad(format!("cannot start a runtime: {e}"))),
        },
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("anyccl-recover: {e}");
            ExitCode::from(1)
        }
    }
}

fn bad(msg: String) -> Error {
    Error::Backend {
        backend: "anyccl-recover",
        op: "job".into(),
        code: -1,
        text: msg,
        recovery: anyccl::Recovery::Fatal,
        source: None,
    }
}

// ---------------------------------------------------------------- the driver

fn layout(job: &Job) -> Result<(usize, usize)> {
    // On an accelerator backend: how many ranks this host can run (one per device unless
    // the backend says otherwise) and the backend's name for messages.
    // A backend asked for by name must be usable here: say why not before launching ranks.
    let picked = match anyccl_examples::pick_backend(job.backend.as_deref()) {
        Err(e) if job.backend.is_some() => return Err(e),
        r => r.ok(),
    };
    let accel = picked.and_then(|b| {
        let caps = b.capabilities().ok().filter(|c| c.device_kind != DeviceKind::Cpu)?;
        let devices = b.probe().ok()?.devices;
        Some((b.name(), devices.min(caps.max_local_ranks), caps.max_local_ranks))
    });
    let pp = job.pp.unwrap_or(match accel {
        Some((_, n, _)) if n < 2 => 1,
        _ => 2,
    });
    let dp = job.dp.unwrap_or(match accel {
        Some((_, n, _)) => (n / pp.max(1)).max(1),
        None => 2,
    });
    if dp == 0 || pp == 0 {
        return Err(bad("--dp and --pp must be at least 1".into()));
    }
    if let Some((name, _, max)) = accel {
        if dp * pp > max {
            return Err(bad(format!(
                "--dp {dp} x --pp {pp} = {} ranks, but the {name} backend runs at most {max} rank(s) on this host \
                 (one per device)",
                dp * pp
            )));
        }
    }
    Ok((dp, pp))
}

fn demo(job: &Job) -> Result<ExitCode> {
    let (dp, pp) = layout(job)?;
    let n = dp * pp;
    let here = std::env::current_exe().map_err(|e| bad(format!("own path: {e}")))?;
    let dir = here.parent().ok_or_else(|| bad("no directory".into()))?;
    let runner = dir.join("anyccl-run");
    if job.resume_from.is_some() || job.run.is_some() {
        return Err(bad(
            "--resume-from and --run belong to `anyccl-recover train`; the demo names its three runs and recovers \
             from its own crashing run"
                .into(),
        ));
    }
    let crash_at = job.crash_at.unwrap_or(job.steps * 3 / 5);
    if crash_at == 0 || crash_at >= job.steps || crash_at < job.ckpt_every {
        return Err(bad(format!(
            "--crash-at {crash_at} must be after the first checkpoint (--ckpt-every {}) and before --steps {}",
            job.ckpt_every, job.steps
        )));
    }
    // Only this demo's own runs are cleared, never anything else under --out.
    for run in ["ref", "crash", "recovered"] {
        let _ = std::fs::remove_dir_all(job.out.join(run));
    }
    let launch = |title: &str, extra: &[String]| -> Result<bool> {
        println!("\n=== {title} ===");
        let _ = std::io::stdout().flush();
        let mut args: Vec<String> = vec!["-n".into(), n.to_string(), "--timeout".into(), "600".into(), "--".into()];
        args.push(here.display().to_string());
        args.push("train".into());
        let same: [(&str, String); 10] = [
            ("--dp", dp.to_string()),
            ("--pp", pp.to_string()),
            ("--steps", job.steps.to_string()),
            ("--ckpt-every", job.ckpt_every.to_string()),
            ("--width", job.width.to_string()),
            ("--layers", job.layers.to_string()),
            ("--batch", job.batch.to_string()),
            ("--lr", job.lr.to_string()),
            ("--seed", job.seed.to_string()),
            ("--colocated-mib", job.colocated_mib.to_string()),
        ];
        for (k, v) in same {
            args.push(k.into());
            args.push(v);
        }
        args.extend(["--out".into(), job.out.display().to_string()]);
        if let Some(b) = &job.backend {
            args.extend(["--backend".into(), b.clone()]);
        }
        args.extend(extra.iter().cloned());
        let st = Command::new(&runner)
            .args(&args)
            .status()
            .map_err(|e| bad(format!("cannot run {}: {e}", runner.display())))?;
        Ok(st.success())
    };
    let t = Instant::now();
    println!(
        "anyccl-recover: dp {dp} x pp {pp} = {n} ranks, {} steps, checkpoint every {}, crash at step {crash_at}",
        job.steps, job.ckpt_every
    );
    if !launch("1/3 reference run, uninterrupted", &["--run".into(), "ref".into()])? {
        return Err(bad("the reference run failed".into()));
    }
    if launch(
        &format!("2/3 run that crashes at step {crash_at}"),
        &["--run".into(), "crash".into(), "--crash-at".into(), crash_at.to_string()],
    )? {
        return Err(bad("the crashing run did not crash".into()));
    }
    println!("(the crash was planned: the launcher stopped every rank)");
    let resume = job.out.join("crash").display().to_string();
    let mut extra = vec!["--run".into(), "recovered".into(), "--resume-from".into(), resume];
    if job.no_warmup {
        extra.push("--no-warmup".into());
    }
    if job.role_plan {
        extra.push("--role-plan".into());
    }
    if let Some(s) = job.squeeze {
        extra.extend(["--squeeze".into(), s.to_string()]);
    }
    if !launch("3/3 recovered run", &extra)? {
        return Err(bad("the recovered run failed".into()));
    }
    let mut same = 0;
    for r in 0..n {
        // The parameters, bit for bit (the shards' headers name different jobs).
        let bits = |run: &str| -> Result<Vec<u32>> {
            let (_, p) = ckpt::read_shard(&job.out.join(run).join("final").join(format!("rank{r}.bin")))?;
            Ok(p.iter().map(|x| x.to_bits()).collect())
        };
        if bits("ref")? == bits("recovered")? {
            same += 1;
        } else {
            println!("rank {r}: recovered parameters DIFFER from the uninterrupted run");
        }
    }
    println!("\n=== verdict ===");
    if same == n {
        println!("bit-for-bit match: the recovered run's parameters equal the uninterrupted run's on all {n} ranks ({:.1?} in all)", t.elapsed());
        Ok(ExitCode::SUCCESS)
    } else {
        println!("MISMATCH on {} of {n} ranks", n - same);
        Ok(ExitCode::from(1))
    }
}

// ---------------------------------------------------------------- the model

/// splitmix64: a seeded stream of uniform floats in [-1, 1).
struct Rng(u64);
impl Rng {
    fn new(parts: &[u64]) -> Self {
        let mut r = Rng(0x9E37_79B9_7F4A_7C15);
        for p in parts {
            r.0 ^= p.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            r.next();
        }
        r
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// One stage: `layers` dense tanh layers of width `h`; parameters flat (W row-major, then b).
struct Stage {
    h: usize,
    layers: usize,
    params: Vec<f32>,
}

impl Stage {
    fn new(h: usize, layers: usize, seed: u64, stage: usize) -> Self {
        let mut params = Vec::with_capacity(layers * (h * h + h));
        for l in 0..layers {
            let mut r = Rng::new(&[seed, stage as u64, l as u64]);
            let scale = 1.0 / (h as f32).sqrt();
            params.extend((0..h * h).map(|_| r.uniform() * scale));
            params.extend((0..h).map(|_| r.uniform() * 0.1));
        }
        Stage { h, layers, params }
    }
    fn layer(&self, l: usize) -> (&[f32], &[f32]) {
        let per = self.h * self.h + self.h;
        let p = &self.params[l * per..(l + 1) * per];
        p.split_at(self.h * self.h)
    }
    /// Activations of every layer (input first).
    fn forward(&self, x: &[f32], rows: usize) -> Vec<Vec<f32>> {
        let h = self.h;
        let mut acts = vec![x.to_vec()];
        for l in 0..self.layers {
            let (w, b) = self.layer(l);
            let a = acts.last().map(|v| v.as_slice()).unwrap_or(&[]);
            let mut y = vec![0f32; rows * h];
            for r in 0..rows {
                for o in 0..h {
                    let mut s = b[o];
                    for i in 0..h {
                        s += w[o * h + i] * a[r * h + i];
                    }
                    y[r * h + o] = s.tanh();
                }
            }
            acts.push(y);
        }
        acts
    }
    /// Given d(loss)/d(output), the gradient of the parameters and of the input.
    fn backward(&self, acts: &[Vec<f32>], dout: &[f32], rows: usize) -> (Vec<f32>, Vec<f32>) {
        let h = self.h;
        let per = h * h + h;
        let mut grads = vec![0f32; self.params.len()];
        let mut da = dout.to_vec();
        for l in (0..self.layers).rev() {
            let (w, _) = self.layer(l);
            let (a_in, a_out) = (&acts[l], &acts[l + 1]);
            let dz: Vec<f32> = da.iter().zip(a_out).map(|(d, y)| d * (1.0 - y * y)).collect();
            let g = &mut grads[l * per..(l + 1) * per];
            for r in 0..rows {
                for o in 0..h {
                    let d = dz[r * h + o];
                    for i in 0..h {
                        g[o * h + i] += d * a_in[r * h + i];
                    }
                    g[h * h + o] += d;
                }
            }
            let mut dx = vec![0f32; rows * h];
            for r in 0..rows {
                for i in 0..h {
                    let mut s = 0f32;
                    for o in 0..h {
                        s += dz[r * h + o] * w[o * h + i];
                    }
                    dx[r * h + i] = s;
                }
            }
            da = dx;
        }
        (grads, da)
    }
}

fn batch(seed: u64, step: u64, replica: usize, rows: usize, h: usize) -> Vec<f32> {
    let mut r = Rng::new(&[seed, 7, step, replica as u64]);
    (0..rows * h).map(|_| r.uniform()).collect()
}

// ---------------------------------------------------------------- communication helpers

/// Host data through device buffers: how a real engine's tensors meet the communicator.
struct Dev<'a> {
    p: &'a dyn Platform,
    timeout: Duration,
}

impl Dev<'_> {
    fn upload(&self, data: &[f32]) -> Result<Box<dyn DeviceMemory>> {
        let mut m = self.p.alloc(DType::F32, data.len())?;
        self.p.copy_from_host(m.as_mut(), &le_bytes(data))?;
        Ok(m)
    }
    fn download(&self, m: &dyn DeviceMemory, out: &mut [f32]) -> Result<()> {
        self.p.synchronize()?;
        let mut bytes = vec![0u8; out.len() * 4];
        self.p.copy_to_host(m, &mut bytes)?;
        for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        Ok(())
    }
    fn all_reduce_avg(&self, c: &Communicator, data: &mut [f32]) -> Result<()> {
        if c.size() == 1 {
            return Ok(());
        }
        let mut m = self.upload(data)?;
        // A library without an average (HCCL) sums; the mean is then taken here.
        let avg = c.capabilities().supports_reduce_op(ReduceOp::Avg);
        let op = if avg { ReduceOp::Avg } else { ReduceOp::Sum };
        c.all_reduce(None, m.view_mut(), op)?.wait(self.timeout)?;
        self.download(m.as_ref(), data)?;
        if !avg {
            let n = c.size() as f32;
            data.iter_mut().for_each(|x| *x /= n);
        }
        Ok(())
    }
    fn send(&self, c: &Communicator, data: &[f32], peer: usize) -> Result<()> {
        let m = self.upload(data)?;
        let mut w = c.send(m.view(), peer)?;
        w.wait(self.timeout)?;
        drop(w);
        Ok(())
    }
    fn recv(&self, c: &Communicator, out: &mut [f32], peer: usize) -> Result<()> {
        let mut m = self.p.alloc(DType::F32, out.len())?;
        c.recv(m.view_mut(), peer)?.wait(self.timeout)?;
        self.download(m.as_ref(), out)
    }
}

fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

// ---------------------------------------------------------------- one rank

/// Where rank `rank`'s warmup plan of step `step`'s checkpoint lives: beside its shard.
fn plan_path(run_dir: &std::path::Path, step: u64, rank: usize) -> PathBuf {
    ckpt::step_dir(run_dir, step).join(format!("warmup-plan-rank{rank}.json"))
}

fn from_dir(job: &Job) -> Result<&std::path::Path> {
    job.resume_from.as_deref().ok_or_else(|| bad("not recovering".into()))
}

/// A new training job's identity, recorded in every shard: the launcher's job id
/// (`ANYCCL_JOB_ID`) or one rank 0 draws, the same on every rank.
async fn new_job_id(store: &dyn anyccl::Store, me: usize, timeout: Duration) -> Result<String> {
    let key = "anyccl-recover/job-id";
    if me == 0 {
        let id = std::env::var("ANYCCL_JOB_ID")
            .ok()
            .filter(|j| !j.is_empty())
            .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()));
        store.set(key, id.as_bytes()).await?;
    }
    let v = store.wait(key, anyccl::raw::deadline_in(timeout)).await?;
    Ok(String::from_utf8_lossy(&v).into_owned())
}

async fn train(job: &Job) -> Result<ExitCode> {
    let (env, store, _server) = anyccl_examples::start_rank().await?;
    let backend = anyccl_examples::pick_backend(job.backend.as_deref())?;
    let platform = backend.platform(env.local_rank)?;
    let (dp, pp) = (job.dp.unwrap_or(2), job.pp.unwrap_or(2));
    if dp * pp != env.world_size {
        return Err(bad(format!("dp {dp} x pp {pp} needs {} ranks, the launcher started {}", dp * pp, env.world_size)));
    }
    let (me, replica, stage) = (env.rank, env.rank / pp, env.rank % pp);
    let run_dir = job.out.join(job.run_name());
    let (width, layers, rows) = (job.width as usize, job.layers as usize, job.batch as usize);
    let layout = job.layout(dp, pp);
    let say = |msg: String| {
        if me == 0 {
            println!("{msg}");
        }
    };

    // A colocated component (an inference engine, say) holds device memory.
    let mut colocated = Some(platform.alloc(DType::U8, (job.colocated_mib as usize) << 20)?);

    let cfg = CommConfig::from_env()?;
    let world = Communicator::connect(
        backend.as_ref(),
        GroupSpec::world(env.world_size, OWNER),
        me,
        store.clone(),
        platform.device(),
        cfg.clone(),
    )
    .await?;
    let registry = GroupRegistry::new();
    // Every process is in one data group (same stage) and one pipeline group (same replica).
    let dp_ranks: Vec<usize> = (0..dp).map(|d| d * pp + stage).collect();
    let pp_ranks: Vec<usize> = (0..pp).map(|s| replica * pp + s).collect();
    let dp_spec = GroupSpec::new(format!("dp-stage{stage}"), dp_ranks, OWNER, Role::Data);
    let pp_spec = GroupSpec::new(format!("pp-replica{replica}"), pp_ranks, OWNER, Role::Pipeline);
    let dpc = world.split(Some(dp_spec.clone())).await?.ok_or_else(|| bad("no data group".into()))?;
    let ppc = world.split(Some(pp_spec.clone())).await?.ok_or_else(|| bad("no pipeline group".into()))?;
    registry.register(dp_spec);
    registry.register(pp_spec);
    // The weight-sync group with the inference engine: its other member never joins this
    // job's warmup, so nothing may ever issue a collective on it from here.
    registry.register(GroupSpec::new("weight-sync", vec![0, env.world_size], OWNER, Role::CrossEngine));

    let mut model = Stage::new(width, layers, job.seed, stage);
    let mut start = 0;
    let dev = Dev { p: platform.as_ref(), timeout: cfg.op_timeout };

    // The checkpoint to resume from, agreed by every rank before anything else happens, so
    // that the warmup belongs to the checkpoint actually loaded; a new run's job identity.
    let resumed = match &job.resume_from {
        Some(from) => {
            say(format!("recovering from {}", from.display()));
            let want = ckpt::Expect {
                rank: me,
                world_size: env.world_size,
                layout: layout.clone(),
                count: model.params.len() as u64,
            };
            Some(ckpt::agree_and_load(store.as_ref(), "resume", from, &want, cfg.op_timeout).await?)
        }
        None => None,
    };
    let job_id = match &resumed {
        Some(l) => l.job.clone(),
        None => new_job_id(store.as_ref(), me, cfg.op_timeout).await?,
    };
    let plan_id = |step: u64| PlanIdentity {
        job: job_id.clone(),
        step,
        rank: me,
        world_size: env.world_size,
        layout: layout.clone(),
    };
    let session = Session {
        store: store.as_ref(),
        job: OWNER,
        generation: 1,
        rank: me,
        world_size: env.world_size,
        platform: platform.as_ref(),
    };
    // The plan the warmup used, when it came from a checkpoint: its cold step's cost is
    // carried into the plans this run saves (this run's own first step runs warm).
    let mut warmed_from: Option<PlanFile> = None;
    let mut warmed = false;

    if let Some(loaded) = resumed {
        // 1. Release what the colocated component holds, so the warmup runs while memory
        //    is light.
        drop(colocated.take());
        say(format!("released the colocated component's {} MiB", job.colocated_mib));
        // 2. Warm the train step's groups, chosen from the registry by owner and role.
        if job.no_warmup {
            say("warmup skipped (--no-warmup)".into());
        } else {
            let roles = [Role::Data, Role::Pipeline, Role::Tensor, Role::Expert];
            let chosen = registry.filter(OWNER, &roles);
            let by_name = |n: &str| [&dpc, &ppc].into_iter().find(|c| c.spec().name == n);
            let targets: Vec<Target<'_>> = chosen.iter().filter_map(|g| by_name(&g.name)).map(Target::new).collect();
            let wcfg = WarmupConfig {
                enabled: true,
                force: true,
                timeout: Duration::from_secs(120),
                ..WarmupConfig::from_env(WarmupConfig::default())?
            };
            // The plan saved with the checkpoint being loaded; without one (missing, corrupt,
            // another job's), the role plans, which the report says.
            let plan_path = plan_path(from_dir(job)?, loaded.step, me);
            let saved = PlanFile::load(&plan_path, &plan_id(loaded.step));
            let report = if job.role_plan {
                warmup(&session, &targets, &wcfg).await?
            } else {
                warmup_saved(&session, &targets, &saved, &wcfg).await?
            };
            warmed = true;
            warmed_from = saved.ok();
            if me == 0 {
                print!("{}", report.table());
                for g in registry.all().iter().filter(|g| !roles.contains(&g.role)) {
                    println!(
                        "  not warmed: {} (role {}: the warmup takes the train step's roles from the registry)",
                        g.name, g.role
                    );
                }
            }
        }
        // 3. Load the checkpoint.
        model.params = loaded.params;
        start = loaded.step;
        say(format!("loaded the checkpoint of step {start}"));
    }

    // 4. On GPUs, optionally leave only a few MiB free for the first step.
    let mut squeezed = Vec::new();
    if let (Some(leave), Some(_)) = (job.squeeze, job.resume_from.as_ref()) {
        if platform.kind() != DeviceKind::Cpu {
            let mut chunk: u64 = 1 << 30;
            while chunk >= 1 << 20 {
                let free = platform.mem_info()?.free;
                if free <= (leave << 20) + chunk {
                    chunk /= 2;
                    continue;
                }
                match platform.alloc(DType::U8, chunk as usize) {
                    Ok(m) => squeezed.push(m),
                    Err(_) => chunk /= 2,
                }
            }
            println!("rank {me}: squeezed device memory to {} MiB free", platform.mem_info()?.free >> 20);
        }
    }

    let h = width;
    let mut recorder = Some(StepRecorder::start(&[&dpc, &ppc], platform.as_ref()));
    let mut saved_plan: Option<PlanFile> = None;
    for step in start..job.steps {
        if job.crash_at == Some(step) && me == env.world_size - 1 {
            println!("rank {me}: crashing at step {step} (as asked)");
            std::process::exit(17);
        }
        let t = Instant::now();
        // forward
        let x = if stage == 0 {
            batch(job.seed, step, replica, rows, h)
        } else {
            let mut x = vec![0f32; rows * h];
            dev.recv(&ppc, &mut x, stage - 1)?;
            x
        };
        let acts = model.forward(&x, rows);
        let out = acts.last().cloned().unwrap_or_default();
        let mut loss = 0f32;
        let dout = if stage + 1 < pp {
            dev.send(&ppc, &out, stage + 1)?;
            let mut d = vec![0f32; rows * h];
            dev.recv(&ppc, &mut d, stage + 1)?;
            d
        } else {
            let input = batch(job.seed, step, replica, rows, h);
            let scale = 2.0 / (rows * h) as f32;
            out.iter()
                .zip(&input)
                .map(|(y, x)| {
                    let e = y - (3.0 * x).sin() * 0.5;
                    loss += e * e / (rows * h) as f32;
                    e * scale
                })
                .collect()
        };
        let (mut grads, dx) = model.backward(&acts, &dout, rows);
        if stage > 0 {
            dev.send(&ppc, &dx, stage - 1)?;
        }
        dev.all_reduce_avg(&dpc, &mut grads)?;
        for (p, g) in model.params.iter_mut().zip(&grads) {
            *p -= job.lr * g;
        }
        // The first step of every launch is recorded; its plan is saved with each checkpoint.
        if let Some(r) = recorder.take() {
            let recorded = r.finish(&session, cfg.op_timeout).await?;
            let cold_step = if warmed {
                // This step ran warm: the cold figure is the one saved with the plan replayed.
                warmed_from.as_ref().filter(|f| f.plans == recorded.plans).and_then(|f| f.cold_step.clone())
            } else {
                recorded.cost
            };
            if me == 0 {
                if let Some(c) = &cold_step {
                    println!(
                        "recorded the first step's plan; it took {:.1} MiB cold",
                        c.total as f64 / (1 << 20) as f64
                    );
                }
            }
            saved_plan = Some(PlanFile { identity: plan_id(0), plans: recorded.plans, cold_step, path: None });
        }
        if !squeezed.is_empty() {
            squeezed.clear();
            println!("rank {me}: first step after recovery succeeded with the squeezed memory");
        }
        if stage + 1 == pp && replica == 0 {
            println!("step {:3}  loss {loss:.6}  {:.2?}", step + 1, t.elapsed());
        }
        let done = step + 1;
        let id = |step: u64| ckpt::ShardId {
            job: job_id.clone(),
            step,
            rank: me,
            world_size: env.world_size,
            layout: layout.clone(),
            count: model.params.len() as u64,
        };
        if done % job.ckpt_every == 0 {
            ckpt::write_shard(&ckpt::shard_path(&run_dir, done, me), &id(done), &model.params)?;
            if let Some(plan) = &saved_plan {
                let plan = PlanFile { identity: plan_id(done), ..plan.clone() };
                plan.write(&plan_path(&run_dir, done, me))?;
            }
            anyccl_examples::meet(
                store.as_ref(),
                &format!("ckpt/{}/{done}", job.run_name()),
                me,
                env.world_size,
                cfg.op_timeout,
            )
            .await?;
            if me == 0 {
                std::fs::write(run_dir.join(format!("ckpt/step{done:06}/COMPLETE")), b"")
                    .map_err(|e| bad(format!("marker: {e}")))?;
            }
        }
    }
    let fin = run_dir.join("final").join(format!("rank{me}.bin"));
    let id = ckpt::ShardId {
        job: job_id,
        step: job.steps,
        rank: me,
        world_size: env.world_size,
        layout,
        count: model.params.len() as u64,
    };
    ckpt::write_shard(&fin, &id, &model.params)?;
    anyccl_examples::meet(store.as_ref(), &format!("end/{}", job.run_name()), me, env.world_size, cfg.op_timeout)
        .await?;
    drop(colocated);
    for c in [&ppc, &dpc, &world] {
        c.shutdown().await?;
    }
    say(format!("finished {} steps; parameters written to {}", job.steps, run_dir.join("final").display()));
    Ok(ExitCode::SUCCESS)
}
