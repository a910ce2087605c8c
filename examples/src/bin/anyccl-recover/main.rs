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
//!
//! Before anything is allocated or launched, a run is checked against this host: the model's
//! memory for every rank here against `MemAvailable` (or `ANYCCL_MEM_LIMIT`, bytes with K, M
//! or G, where lower), and the output folder against another run holding it (a lock file).
#![forbid(unsafe_code)]
mod cli;
mod dev;
mod driver;
mod inplace;
mod inplace_demo;
mod model;
mod participation;
mod rank;
mod step;
mod timeline;

use anyccl::Error;
use anyccl_examples::errln;
use clap::Parser;
use cli::{Cli, Cmd};
use std::process::ExitCode;

fn main() -> ExitCode {
    // Output that could not be written fails the run, and says so.
    anyccl_examples::out::finish("anyccl-recover", program())
}

fn program() -> ExitCode {
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
            Ok(rt) if job.in_place => rt.block_on(inplace::train(&job)),
            Ok(rt) => rt.block_on(rank::train(&job)),
            Err(e) => Err(Error::unavailable("anyccl-recover", format!("cannot start a runtime: {e}"))),
        },
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            errln!("anyccl-recover: {e}");
            // A flag this program refuses ends as clap's refusals do.
            match e {
                Error::InvalidArgument { arg, .. } if arg.starts_with("--") => ExitCode::from(2),
                _ => ExitCode::from(1),
            }
        }
    }
}
