//! anyccl-examples: the programs around the library: the `anyccl-run` launcher, the
//! demos, the conformance runner and the benchmark tool. They use the library as an engine
//! does, through the `anyccl` crate; this file holds what they share on top of it (their
//! start-up, meeting through the store), the demos' checkpoints, and what the machine can
//! give a run (memory, open files, ports, a folder's lock), checked before a run starts.
#![forbid(unsafe_code)]

pub mod checkpoint;
pub mod machine;
pub mod out;

use anyccl::{CommConfig, LaunchEnv, Result, Store, TcpStoreServer};
use std::sync::Arc;
use std::time::Duration;

pub use anyccl::{backend_by_name, pick_backend, Rank};

/// What every program here turns on first: logging filtered by `ANYCCL_LOG` (warnings by
/// default) and flight-recorder dumps on SIGTERM and SIGUSR1 (the launcher stops ranks with
/// SIGTERM), written where `ANYCCL_TRACE_DIR` says.
///
/// # Errors
/// `InvalidArgument` for a malformed `ANYCCL_LOG`; `Unavailable` when the signal handlers
/// cannot be installed.
pub fn init_program() -> Result<()> {
    anyccl::init_logging(anyccl::LogLevel::WARN)?;
    anyccl::trace::dump_on_signals()
}

/// A rank's start ([`init_program`], then [`anyccl::connect_store`]): launcher variables
/// and the job store (hosted here on rank 0 unless the launcher hosts it).
///
/// # Errors
/// As [`anyccl::connect_store`].
pub async fn start_rank() -> Result<(LaunchEnv, Arc<dyn Store>, Option<TcpStoreServer>)> {
    init_program()?;
    anyccl::connect_store().await
}

/// A rank's start ([`init_program`], then [`anyccl::start_rank`]) with the world
/// communicator owned by `owner`.
///
/// # Errors
/// As [`anyccl::start_rank`].
pub async fn start_world(owner: &str, backend: Option<&str>, config: CommConfig) -> Result<Rank> {
    init_program()?;
    anyccl::start_rank(owner, backend, config).await
}

/// Wait until all `n` ranks reach `key` (through the store: no collective), for at most
/// `timeout` (a program passes its communicators' `op_timeout`, so `ANYCCL_TIMEOUT_S`
/// bounds this wait as it bounds the collectives).
///
/// # Errors
/// `Timeout` naming the ranks that never arrived; store errors.
pub async fn meet(store: &dyn Store, key: &str, rank: usize, n: usize, timeout: Duration) -> Result<()> {
    anyccl::store_barrier(store, key, rank, n, anyccl::raw::deadline_in(timeout)).await
}
