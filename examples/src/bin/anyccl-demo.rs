//! `anyccl-demo`: a small all_reduce job. Run under the launcher:
//! `anyccl-run -n 4 -- anyccl-demo`. `--exit-rank R --exit-code C --exit-at STEP` makes
//! one rank exit mid-run, to show the launcher stopping the others.
#![forbid(unsafe_code)]

use anyccl::{CommConfig, DType, ReduceOp};
use anyccl_examples::{errln, outln};
use clap::Parser;
use std::process::ExitCode;
use std::time::Instant;

#[derive(Parser, Debug)]
struct Args {
    /// Steps to run.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Elements per all_reduce.
    #[arg(long, default_value_t = 1 << 20)]
    count: usize,
    /// Backend (default: ANYCCL_BACKEND, else the best available).
    #[arg(long)]
    backend: Option<String>,
    /// Rank that exits early (with --exit-code, at --exit-at).
    #[arg(long)]
    exit_rank: Option<usize>,
    /// Exit code of that rank.
    #[arg(long, default_value_t = 3)]
    exit_code: u8,
    /// Step at which it exits.
    #[arg(long, default_value_t = 2)]
    exit_at: usize,
    /// Rank that calls all_gather instead of all_reduce at --exit-at (what
    /// `ANYCCL_DEBUG=detail` catches on every backend).
    #[arg(long)]
    mismatch_rank: Option<usize>,
}

fn main() -> ExitCode {
    // Output that could not be written fails the run, and says so.
    anyccl_examples::out::finish("anyccl-demo", program())
}

#[tokio::main(flavor = "current_thread")]
async fn program() -> ExitCode {
    let args = Args::parse();
    match run(&args).await {
        Ok(code) => code,
        Err(e) => {
            errln!("anyccl-demo: {e}");
            ExitCode::from(1)
        }
    }
}

async fn run(args: &Args) -> anyccl::Result<ExitCode> {
    let anyccl_examples::Rank { env, platform, world: comm, server: _server, .. } =
        anyccl_examples::start_world("anyccl-demo", args.backend.as_deref(), CommConfig::from_env()?).await?;
    let n = env.world_size as f32;
    let timeout = comm.config().op_timeout;
    // The data lives on the backend's device (host memory on the CPU backend), as an
    // engine's tensors do.
    let mut dev = platform.alloc(DType::F32, args.count)?;
    let mut bytes = vec![0u8; args.count * 4];
    for step in 0..args.steps {
        if args.exit_rank == Some(env.rank) && step == args.exit_at {
            outln!("exiting with code {} at step {step} (as asked)", args.exit_code);
            return Ok(ExitCode::from(args.exit_code));
        }
        let data: Vec<u8> = (0..args.count).flat_map(|i| ((env.rank + i + step) as f32).to_le_bytes()).collect();
        platform.copy_from_host(dev.as_mut(), &data)?;
        let t = Instant::now();
        if args.mismatch_rank == Some(env.rank) && step == args.exit_at {
            outln!("calling all_gather at step {step} while the others call all_reduce (as asked)");
            let mut all = platform.alloc(DType::F32, args.count * env.world_size)?;
            let r = comm.all_gather(Some(dev.view()), all.view_mut())?.wait(timeout);
            r?;
        }
        let mut w = comm.all_reduce(None, dev.view_mut(), ReduceOp::Sum)?;
        if let Err(e) = w.wait(timeout) {
            // Said at once; then a timed-out operation, which may still run, is aborted
            // before its buffer goes (an abort can take seconds).
            errln!("anyccl-demo: {e}");
            if matches!(e, anyccl::Error::Timeout { .. }) {
                let _ = comm.abort().await;
            }
            drop(w);
            return Ok(ExitCode::from(1));
        }
        drop(w);
        platform.synchronize()?;
        platform.copy_to_host(dev.as_ref(), &mut bytes)?;
        let took = t.elapsed();
        // Sum over ranks r of (r + i + step) = n(n-1)/2 + n(i + step).
        let want = |i: usize| n * (n - 1.0) / 2.0 + n * (i + step) as f32;
        let got = |i: usize| f32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]);
        if let Some(i) = (0..args.count).find(|&i| got(i) != want(i)) {
            // A wrong result: the communicator cannot be trusted after it.
            let msg = format!("all_reduce of step {step}: element {i} is {}, expected {}", got(i), want(i));
            return Err(comm.ctx().aborted(msg));
        }
        if env.rank == 0 {
            outln!(
                "step {step}: all_reduce of {} x f32 over {} ranks ({}) ok in {took:.2?}",
                args.count,
                env.world_size,
                comm.info().backend
            );
        }
    }
    comm.barrier_wait()?;
    comm.shutdown().await?;
    if env.rank == 0 {
        outln!("all {} steps matched the expected sums", args.steps);
    }
    Ok(ExitCode::SUCCESS)
}
