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
#![forbid(unsafe_code)]

use anyccl_core::{
    CommConfig, Communicator, DType, DeviceKind, DeviceMemory, Error, GroupRegistry, GroupSpec, Platform, ReduceOp,
    Result, Role,
};
use anyccl_warmup::{warmup, Session, Target, WarmupConfig};
use clap::{Args as ClapArgs, Parser, Subcommand};
use std::io::Write;
use std::path::{Path, PathBuf};
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
    /// Training steps.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Checkpoint every this many steps.
    #[arg(long, default_value_t = 5)]
    ckpt_every: usize,
    /// The last rank exits (code 17) when it reaches this step.
    #[arg(long)]
    crash_at: Option<usize>,
    /// Recover from the latest complete checkpoint under this run directory.
    #[arg(long)]
    resume_from: Option<PathBuf>,
    /// Output directory.
    #[arg(long, default_value = "target/anyccl-recover")]
    out: PathBuf,
    /// Name of this run (a folder under --out).
    #[arg(long, default_value = "run")]
    run: String,
    /// Do not warm the communicators before the first step after recovery.
    #[arg(long)]
    no_warmup: bool,
    /// Before the first step after recovery, fill device memory until only this many MiB
    /// are free (GPU backends).
    #[arg(long)]
    squeeze: Option<u64>,
    /// Memory a colocated component (e.g. an inference engine) holds, MiB; released first
    /// when recovering.
    #[arg(long, default_value_t = 64)]
    colocated_mib: usize,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// Layers per pipeline stage.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Batch rows per replica.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 4.0)]
    lr: f32,
    /// Seed.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// Backend (default: ANYCCL_BACKEND, else the best available).
    #[arg(long)]
    backend: Option<String>,
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
        recovery: anyccl_core::Recovery::Fatal,
    }
}

// ---------------------------------------------------------------- the driver

fn layout(job: &Job) -> Result<(usize, usize)> {
    // On an accelerator backend: how many ranks this host can run (one per device unless
    // the backend says otherwise) and the backend's name for messages.
    let accel = anyccl_examples::pick_backend(job.backend.as_deref()).ok().and_then(|b| {
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
    let crash_at = job.crash_at.unwrap_or(job.steps * 3 / 5);
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
        for (k, v) in [("--dp", dp), ("--pp", pp), ("--steps", job.steps), ("--ckpt-every", job.ckpt_every)] {
            args.push(k.into());
            args.push(v.to_string());
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
    if let Some(s) = job.squeeze {
        extra.extend(["--squeeze".into(), s.to_string()]);
    }
    if !launch("3/3 recovered run", &extra)? {
        return Err(bad("the recovered run failed".into()));
    }
    let mut same = 0;
    for r in 0..n {
        let a = std::fs::read(job.out.join("ref/final").join(format!("rank{r}.bin")))
            .map_err(|e| bad(format!("reference shard of rank {r}: {e}")))?;
        let b = std::fs::read(job.out.join("recovered/final").join(format!("rank{r}.bin")))
            .map_err(|e| bad(format!("recovered shard of rank {r}: {e}")))?;
        if a == b {
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

fn batch(seed: u64, step: usize, replica: usize, rows: usize, h: usize) -> Vec<f32> {
    let mut r = Rng::new(&[seed, 7, step as u64, replica as u64]);
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
        c.all_reduce(None, m.view_mut(), ReduceOp::Avg)?.wait(self.timeout)?;
        self.download(m.as_ref(), data)
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

// ---------------------------------------------------------------- checkpoints

fn shard_path(dir: &Path, step: usize, rank: usize) -> PathBuf {
    dir.join(format!("ckpt/step{step:06}/rank{rank}.bin"))
}

/// Write atomically: temporary file, fsync, rename, fsync the folder. A checksum guards it.
fn write_shard(path: &Path, step: usize, rank: usize, params: &[f32]) -> Result<()> {
    let io = |e: std::io::Error| bad(format!("checkpoint {}: {e}", path.display()));
    let dir = path.parent().ok_or_else(|| bad("no folder".into()))?;
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut body = Vec::with_capacity(params.len() * 4 + 32);
    body.extend_from_slice(b"ACKP");
    body.extend_from_slice(&(step as u64).to_le_bytes());
    body.extend_from_slice(&(rank as u32).to_le_bytes());
    body.extend_from_slice(&(params.len() as u64).to_le_bytes());
    for p in params {
        body.extend_from_slice(&p.to_le_bytes());
    }
    let crc = crc32fast::hash(&body);
    body.extend_from_slice(&crc.to_le_bytes());
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&body).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
    Ok(())
}

fn read_shard(path: &Path, rank: usize, n_params: usize) -> Result<(usize, Vec<f32>)> {
    let body = std::fs::read(path)
        .map_err(|e| bad(format!("checkpoint shard {} is missing or unreadable: {e}", path.display())))?;
    let corrupt = |why: &str| bad(format!("checkpoint shard {} is corrupt: {why}", path.display()));
    if body.len() < 28 || &body[..4] != b"ACKP" {
        return Err(corrupt("bad header"));
    }
    let (data, crc) = body.split_at(body.len() - 4);
    if crc32fast::hash(data) != u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]) {
        return Err(corrupt("checksum mismatch"));
    }
    let step = u64::from_le_bytes(data[4..12].try_into().unwrap_or_default()) as usize;
    let r = u32::from_le_bytes(data[12..16].try_into().unwrap_or_default()) as usize;
    let n = u64::from_le_bytes(data[16..24].try_into().unwrap_or_default()) as usize;
    if r != rank || n != n_params || data.len() != 24 + n * 4 {
        return Err(corrupt(&format!("written by rank {r} with {n} parameters; this is rank {rank} with {n_params}")));
    }
    Ok((step, data[24..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
}

/// The latest step whose checkpoint every rank finished (marked COMPLETE by rank 0).
fn latest_complete(dir: &Path) -> Result<usize> {
    let rd =
        std::fs::read_dir(dir.join("ckpt")).map_err(|e| bad(format!("no checkpoints under {}: {e}", dir.display())))?;
    rd.flatten()
        .filter(|e| e.path().join("COMPLETE").exists())
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_prefix("step")).and_then(|s| s.parse().ok()))
        .max()
        .ok_or_else(|| bad(format!("no complete checkpoint under {}", dir.display())))
}

// ---------------------------------------------------------------- one rank

async fn train(job: &Job) -> Result<ExitCode> {
    let (env, store, _server) = anyccl_examples::start_rank().await?;
    let backend = anyccl_examples::pick_backend(job.backend.as_deref())?;
    let platform = backend.platform(env.local_rank)?;
    let (dp, pp) = (job.dp.unwrap_or(2), job.pp.unwrap_or(2));
    if dp * pp != env.world_size {
        return Err(bad(format!("dp {dp} x pp {pp} needs {} ranks, the launcher started {}", dp * pp, env.world_size)));
    }
    let (me, replica, stage) = (env.rank, env.rank / pp, env.rank % pp);
    let run_dir = job.out.join(&job.run);
    let say = |msg: String| {
        if me == 0 {
            println!("{msg}");
        }
    };

    // A colocated component (an inference engine, say) holds device memory.
    let mut colocated = Some(platform.alloc(DType::U8, job.colocated_mib << 20)?);

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

    let mut model = Stage::new(job.width, job.layers, job.seed, stage);
    let mut start = 0;
    let dev = Dev { p: platform.as_ref(), timeout: cfg.op_timeout };

    if let Some(from) = &job.resume_from {
        say(format!("recovering from {}", from.display()));
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
            let session = Session {
                store: store.as_ref(),
                job: OWNER,
                generation: 1,
                rank: me,
                world_size: env.world_size,
                platform: platform.as_ref(),
            };
            let wcfg = WarmupConfig {
                enabled: true,
                force: true,
                timeout: Duration::from_secs(120),
                ..WarmupConfig::from_env(WarmupConfig::default())?
            };
            let report = warmup(&session, &targets, &wcfg).await?;
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
        let step = latest_complete(from)?;
        let (s, params) = read_shard(&shard_path(from, step, me), me, model.params.len())?;
        model.params = params;
        start = s;
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

    let rows = job.batch;
    let h = job.width;
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
        if !squeezed.is_empty() {
            squeezed.clear();
            println!("rank {me}: first step after recovery succeeded with the squeezed memory");
        }
        if stage + 1 == pp && replica == 0 {
            println!("step {:3}  loss {loss:.6}  {:.2?}", step + 1, t.elapsed());
        }
        let done = step + 1;
        if done % job.ckpt_every == 0 {
            write_shard(&shard_path(&run_dir, done, me), done, me, &model.params)?;
            anyccl_examples::meet(store.as_ref(), &format!("ckpt/{}/{done}", job.run), env.world_size).await?;
            if me == 0 {
                std::fs::write(run_dir.join(format!("ckpt/step{done:06}/COMPLETE")), b"")
                    .map_err(|e| bad(format!("marker: {e}")))?;
            }
        }
    }
    let fin = run_dir.join("final").join(format!("rank{me}.bin"));
    write_shard(&fin, job.steps, me, &model.params)?;
    anyccl_examples::meet(store.as_ref(), &format!("end/{}", job.run), env.world_size).await?;
    drop(colocated);
    for c in [&ppc, &dpc, &world] {
        c.shutdown().await?;
    }
    say(format!("finished {} steps; parameters written to {}", job.steps, run_dir.join("final").display()));
    Ok(ExitCode::SUCCESS)
}
