//! The command line: the demo's and a training rank's flags, and what they need of this host.

use anyccl::raw::Ctx;
use anyccl::{Error, Result};
use anyccl_examples::machine;
use clap::{Args as ClapArgs, Parser, Subcommand};
use std::path::PathBuf;

pub(crate) const OWNER: &str = "anyccl-recover";

#[derive(Parser, Debug)]
#[command(name = "anyccl-recover")]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) cmd: Option<Cmd>,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Cmd {
    /// Reference run, crashing run, recovered run, bit-for-bit comparison.
    Demo(Job),
    /// One rank of one launch (started by anyccl-run).
    Train(Job),
}

#[derive(ClapArgs, Debug, Clone)]
pub(crate) struct Job {
    /// Data-parallel replicas (default: 2 on CPU; 1 with GPUs).
    #[arg(long)]
    pub(crate) dp: Option<usize>,
    /// Pipeline stages (default: 2).
    #[arg(long)]
    pub(crate) pp: Option<usize>,
    /// Training steps (at least 1).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) steps: u64,
    /// Checkpoint every this many steps (at least 1).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) ckpt_every: u64,
    /// The last rank exits (code 17) when it reaches this step.
    #[arg(long)]
    pub(crate) crash_at: Option<u64>,
    /// The last rank kills itself with SIGKILL in the middle of this step (its first
    /// process only: a replacement does not). The demo's default: the step after 3/5 of
    /// `--steps`.
    #[arg(long)]
    pub(crate) kill_at: Option<u64>,
    /// Each step takes at least this long, in milliseconds (a stand-in for a real model's
    /// compute; 0 to 60000). The in-place demo's default is 150, so that the replacement
    /// rejoins before the run ends.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub(crate) step_ms: Option<u64>,
    /// Recover in place: survivors agree on who is in (anyccl's membership), rebuild and warm
    /// their groups, and go on; a replacement (`anyccl-run --elastic`) rejoins and is fed
    /// the parameters by a healthy replica. No checkpoint is read.
    #[arg(long, conflicts_with_all = ["resume_from", "crash_at"])]
    pub(crate) in_place: bool,
    /// Alternate training with this many rollout phases (1 to 1000): in each, a colocated
    /// inference engine takes the device's free memory but `--squeeze` MiB (512 by default;
    /// on the CPU backend, `--colocated-mib` of host memory) and gives it back; the training
    /// groups sleep through it (`anyccl::warmup::sleep_groups`) and wake warmed from the
    /// first step's plan, unless `--no-sleep`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1000))]
    #[arg(conflicts_with_all = ["in_place", "resume_from", "crash_at", "kill_at"])]
    pub(crate) colocated_phases: Option<u64>,
    /// With `--colocated-phases`: the training groups stay awake through the rollouts.
    #[arg(long, requires = "colocated_phases")]
    pub(crate) no_sleep: bool,
    /// With `--in-place`: replay the participation record of an in-place run (which
    /// replicas trained which steps) with no fault, as the reference it must equal.
    #[arg(long, requires = "in_place")]
    pub(crate) replay: Option<PathBuf>,
    /// Recover from the latest complete checkpoint under this run directory.
    #[arg(long)]
    pub(crate) resume_from: Option<PathBuf>,
    /// Output directory.
    #[arg(long, default_value = "target/anyccl-recover")]
    pub(crate) out: PathBuf,
    /// Name of this run (a folder under --out; `train` only, the demo names its three runs).
    #[arg(long)]
    pub(crate) run: Option<String>,
    /// Do not warm the communicators before the first step after recovery.
    #[arg(long)]
    pub(crate) no_warmup: bool,
    /// Warm from the groups' roles, not from the plan saved with the checkpoint.
    #[arg(long, conflicts_with = "no_warmup")]
    pub(crate) role_plan: bool,
    /// Before the first step after recovery, fill device memory until only this many MiB
    /// are free (GPU backends).
    #[arg(long)]
    pub(crate) squeeze: Option<u64>,
    /// Memory a colocated component (e.g. an inference engine) holds, MiB; released first
    /// when recovering.
    #[arg(long, default_value_t = 64)]
    #[arg(value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    pub(crate) colocated_mib: u64,
    /// Model width (1 to 4096).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub(crate) width: u64,
    /// Layers per pipeline stage (1 to 1024).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub(crate) layers: u64,
    /// Batch rows per replica (1 to 65536).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub(crate) batch: u64,
    /// Learning rate (a finite number above 0).
    #[arg(long, default_value_t = 4.0, value_parser = positive_f32)]
    pub(crate) lr: f32,
    /// Seed.
    #[arg(long, default_value_t = 1234)]
    pub(crate) seed: u64,
    /// Backend (default: ANYCCL_BACKEND, else the best available).
    #[arg(long)]
    pub(crate) backend: Option<String>,
}

fn positive_f32(s: &str) -> std::result::Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("must be a finite number above 0, not {s:?}")),
    }
}

impl Job {
    /// The model and parallel layout every shard records.
    pub(crate) fn layout(&self, dp: usize, pp: usize) -> String {
        format!("dp{dp} pp{pp} width{} layers{} seed{}", self.width, self.layers, self.seed)
    }
    pub(crate) fn run_name(&self) -> &str {
        self.run.as_deref().unwrap_or("run")
    }

    /// Host memory one rank needs, about: its stage's parameters five times over (gradients,
    /// their trip through a device buffer, a checkpoint's bytes) and the activations of a
    /// batch; the colocated component's memory too where it is host memory. `None`: more
    /// than a u64 counts.
    pub(crate) fn host_need(&self, colocated_on_host: bool) -> Option<u64> {
        let (h, layers, rows) = (self.width, self.layers, self.batch);
        let params = h.checked_mul(h)?.checked_add(h)?.checked_mul(layers)?;
        let acts = layers.checked_add(4)?.checked_mul(rows)?.checked_mul(h)?;
        let colocated = if colocated_on_host { self.colocated_mib << 20 } else { 0 };
        params.checked_mul(5)?.checked_add(acts)?.checked_mul(4)?.checked_add(colocated)
    }

    /// Refuse a run whose `ranks` ranks on this host need more host memory than it has
    /// (`MemAvailable`, or `ANYCCL_MEM_LIMIT` where lower), before anything is allocated.
    ///
    /// # Errors
    /// `InvalidArgument` naming the model's flags and both figures.
    pub(crate) fn check_memory(&self, ranks: usize, colocated_on_host: bool) -> Result<()> {
        let Some(have) = machine::host_available()? else { return Ok(()) };
        let each = self.host_need(colocated_on_host);
        let all = each.and_then(|e| e.checked_mul(ranks as u64));
        if all.is_some_and(|a| a <= have.bytes) {
            return Ok(());
        }
        let figure = |b: Option<u64>| b.map_or_else(|| "more than 16 EiB".to_string(), machine::size);
        let colocated =
            if colocated_on_host { format!(" --colocated-mib {}", self.colocated_mib) } else { String::new() };
        Err(usage(
            "--width",
            format!(
                "--width {} --layers {} --batch {}{colocated}: each rank needs about {} of host memory (its stage's \
                 parameters with their gradients and copies, and the activations), {ranks} rank(s) on this host need \
                 {}, and this host has {have}: choose a smaller --width or --layers",
                self.width,
                self.layers,
                self.batch,
                figure(each),
                figure(all),
            ),
        ))
    }
}

/// What a training rank starts with: the launcher's variables, the job's store (and its
/// server where this rank hosts it), the backend and this rank's device, and the layout
/// `(dp, pp)`, checked against this host's memory and the launcher's rank count.
pub(crate) struct Started {
    pub(crate) env: anyccl::LaunchEnv,
    pub(crate) store: std::sync::Arc<dyn anyccl::Store>,
    pub(crate) server: Option<anyccl::TcpStoreServer>,
    pub(crate) backend: std::sync::Arc<dyn anyccl::Backend>,
    pub(crate) platform: std::sync::Arc<dyn anyccl::Platform>,
    pub(crate) dp: usize,
    pub(crate) pp: usize,
}

impl Job {
    /// Start a training rank (see [`Started`]).
    ///
    /// # Errors
    /// The store's, the backend's, or `InvalidArgument` naming `--dp` or the model's flags.
    pub(crate) async fn start(&self) -> Result<Started> {
        let (env, store, server) = anyccl_examples::start_rank().await?;
        let backend = anyccl_examples::pick_backend(self.backend.as_deref())?;
        let platform = backend.platform(env.local_rank)?;
        // Before the first allocation: this host's ranks together, against its memory.
        self.check_memory(env.local_world_size, platform.kind() == anyccl::DeviceKind::Cpu)?;
        let (dp, pp) = (self.dp.unwrap_or(2), self.pp.unwrap_or(2));
        let n = ranks(dp, pp)?;
        if n != env.world_size {
            let msg = format!("dp {dp} x pp {pp} needs {n} ranks, the launcher started {}", env.world_size);
            return Err(usage("--dp", msg));
        }
        Ok(Started { env, store, server, backend, platform, dp, pp })
    }
}

/// `dp × pp` ranks, checked.
///
/// # Errors
/// `InvalidArgument` naming `--dp` and `--pp` when the product overflows.
pub(crate) fn ranks(dp: usize, pp: usize) -> Result<usize> {
    dp.checked_mul(pp).ok_or_else(|| {
        usage("--dp", format!("--dp {dp} x --pp {pp}: the rank count overflows (more than {})", usize::MAX))
    })
}

/// A flag or setting this program refuses.
pub(crate) fn usage(arg: &'static str, msg: String) -> Error {
    Ctx::process("anyccl-recover").invalid("anyccl-recover", arg, msg)
}
