//! The command line: the flags as nccl-tests names them, their parsers, and how a flag is
//! refused.

use anyccl::raw::Ctx;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(name = "anyccl-bench")]
pub(crate) struct Args {
    /// all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, sendrecv,
    /// barrier (its rows' buffers go unused: the size column names them only).
    pub(crate) op: String,
    /// Backend (default: ANYCCL_BACKEND, else nccl when it loads, else cpu).
    #[arg(long)]
    pub(crate) backend: Option<String>,
    /// Smallest size (bytes; K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8")]
    pub(crate) min: String,
    /// Largest size.
    #[arg(short = 'e', long = "maxbytes", default_value = "128M")]
    pub(crate) max: String,
    /// Size factor between rows.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub(crate) factor: usize,
    /// Timed iterations per row.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    pub(crate) iters: usize,
    /// Warmup iterations per row.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    pub(crate) warmup: usize,
    /// Before the first timed row, keep issuing warm-up calls for this long (milliseconds).
    /// Without it the first row ran slower than the rest on H200s (most likely a device
    /// that sat idle through the connect, still at low clocks).
    #[arg(long = "warmup-ms", default_value_t = 100)]
    pub(crate) warmup_ms: u64,
    /// Element type.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    pub(crate) dtype: String,
    /// Reduce op.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub(crate) redop: String,
    /// Calls in flight at most: 1 issues each call and waits for it (latency, as an MPI
    /// benchmark's blocking loop measures); the default issues as many as the memory budget
    /// allows back to back (on the host, as many as 1 MiB of receive buffers holds, 64 at
    /// most), then waits (pipelined, as nccl-tests does).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) depth: Option<u32>,
    /// Root for broadcast and reduce.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    pub(crate) root: usize,
    /// Which rank's time a row shows, as nccl-tests' flag: 0 rank 0's, 1 the average over
    /// the ranks, 2 the fastest rank's, 3 the slowest's (what Open MPI's and Gloo's harnesses
    /// in `bench/peers` print). Rank 0's alone says little of a rooted operation: a
    /// broadcast's root (rank 0 by default) may finish its calls well before the others have
    /// received them.
    #[arg(short = 'a', long = "average", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub(crate) average: u8,
    /// Check results (count wrong elements).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    pub(crate) check: u8,
    /// Print rows as JSON lines instead.
    #[arg(long)]
    pub(crate) json: bool,
    /// all_reduce with NCCL only: time this many interleaved pairs per size, raw NCCL (its
    /// own communicator, one stream, calls back to back, one wait), raw with an event per call
    /// (events made before the timing, waited in chunks as anyccl's `Work`s are) and the same
    /// calls through anyccl, in an order reversed every other pair, and print the medians and
    /// the ratios (at least 1).
    #[arg(long, value_name = "PAIRS", value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub(crate) vs_raw: Option<u32>,
    /// all_reduce only: a step that computes for this many microseconds on the engine's
    /// own stream beside an all_reduce of an earlier buffer, ordered by events between the
    /// streams (no host wait), against the two back to back.
    #[arg(long, value_name = "US", conflicts_with = "vs_raw", value_parser = parse_us)]
    pub(crate) overlap_us: Option<f64>,
    /// Allocate every buffer the way the library registers best
    /// (`Platform::alloc_registrable`; NCCL: `ncclMemAlloc`) and register it with the
    /// communicator (NCCL: `ncclCommRegister`), as an engine does that keeps its
    /// buffers for the job's life; the header says whether the backend registered them.
    /// With `--vs-raw`, anyccl's buffers only (raw NCCL keeps its defaults).
    #[arg(long, conflicts_with_all = ["overlap_us", "graph"])]
    pub(crate) register: bool,
    /// As `--register`, but each buffer registered as a window of the communicator
    /// (`Communicator::register_window`; NCCL: a symmetric window, whose kernels serve small
    /// collectives): a collective registration, so every rank keeps the same buffers,
    /// `--depth` of them (default 8) per size.
    #[arg(long, conflicts_with_all = ["vs_raw", "overlap_us", "graph", "register"])]
    pub(crate) window: bool,
    /// all_reduce only: capture this many in-place all_reduces into a CUDA graph on the
    /// engine's stream and time its replays (per all_reduce), beside the same calls issued.
    #[arg(long, value_name = "OPS", conflicts_with_all = ["vs_raw", "overlap_us"],
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub(crate) graph: Option<u32>,
}

fn parse_us(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (1.0..=10_000_000.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a number of microseconds from 1 to 10000000")),
    }
}

pub(crate) fn parse_size(s: &str) -> std::result::Result<usize, String> {
    match anyccl::raw::parse_bytes(s) {
        Some(b) if b <= MAX_BYTES => Ok(b),
        Some(_) => Err(format!("'{s}' is larger than the 64 GiB this tool measures")),
        None => Err(format!("'{s}' is not a size (bytes, with K, M or G)")),
    }
}

/// The largest size a row may have.
const MAX_BYTES: usize = 64 << 30;

/// `arg` refused because of `msg`.
pub(crate) fn bad_arg(arg: &'static str, msg: String) -> anyccl::Error {
    Ctx::process("anyccl-bench").invalid("anyccl-bench", arg, msg)
}
