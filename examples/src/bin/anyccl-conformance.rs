//! `anyccl-conformance --backend B [--world-sizes 2,3,4] [--filter TEXT]`: run the
//! conformance registry against one backend, one line per case and world size, ending with
//! `N passed, N failed, N ignored`.
#![forbid(unsafe_code)]

use anyccl_examples::errln;
use clap::Parser;
use std::process::ExitCode;

#[derive(Parser, Debug)]
struct Args {
    /// Backend to test.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// World sizes to run (default: each case's own list).
    #[arg(long, value_delimiter = ',')]
    world_sizes: Option<Vec<usize>>,
    /// Only cases whose name contains this text.
    #[arg(long)]
    filter: Option<String>,
}

fn main() -> ExitCode {
    // Output that could not be written fails the run, and says so.
    anyccl_examples::out::finish("anyccl-conformance", program())
}

fn program() -> ExitCode {
    let args = Args::parse();
    let backend = match anyccl_examples::backend_by_name(&args.backend) {
        Ok(b) => b,
        Err(e) => {
            errln!("anyccl-conformance: {e}");
            return ExitCode::from(2);
        }
    };
    anyccl_conformance::run_report(backend, args.world_sizes.as_deref(), args.filter.as_deref())
}
