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

mod dev;
mod driver;
mod model;
mod rank;

use anyccl::raw::Ctx;
use anyccl::{Error, Result};
use anyccl_examples::machine;
use clap::{Args as ClapArgs, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

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

    /// Host memory one rank needs, about: its stage's parameters five times over (gradients,
    /// their trip through a device buffer, a checkpoint's bytes) and the activations of a
    /// batch; the colocated component's memory too where it is host memory. `None`: more
    /// than a u64 counts.
    fn host_need(&self, colocated_on_host: bool) -> Option<u64> {
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
    fn check_memory(&self, ranks: usize, colocated_on_host: bool) -> Result<()> {
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

/// `dp × pp` ranks, checked.
///
/// # Errors
/// `InvalidArgument` naming `--dp` and `--pp` when the product overflows.
fn ranks(dp: usize, pp: usize) -> Result<usize> {
    dp.checked_mul(pp).ok_or_else(|| {
        usage("--dp", format!("--dp {dp} x --pp {pp}: the rank count overflows (more than {})", usize::MAX))
    })
}

/// A flag or setting this program refuses.
fn usage(arg: &'static str, msg: String) -> Error {
    Ctx::process("anyccl-recover").invalid("anyccl-recover", arg, msg)
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
        Cmd::Demo(job) => driver::demo(&job),
        Cmd::Train(job) => match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt.block_on(rank::train(&job)),
            Err(e) => Err(Error::unavailable("anyccl-recover", format!("cannot start a runtime: {e}"))),
        },
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("anyccl-recover: {e}");
            // A flag this program refuses ends as clap's refusals do.
            match e {
                Error::InvalidArgument { arg, .. } if arg.starts_with("--") => ExitCode::from(2),
                _ => ExitCode::from(1),
            }
        }
    }
}
