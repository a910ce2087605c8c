//! anyccl-examples: the programs around the library: the `anyccl-run` launcher, the
//! demos, the conformance runner and the benchmark tool. This file holds what they share:
//! picking a backend, starting a rank from the launcher's variables, meeting through the store.
#![forbid(unsafe_code)]

pub mod checkpoint;

use anyccl_core::{
    Backend, CommConfig, Communicator, Error, GroupSpec, LaunchEnv, Platform, Result, Store, TcpStoreServer,
};
use std::sync::Arc;
use std::time::Duration;

/// The backends this build knows, by name.
pub fn backend_by_name(name: &str) -> Result<Arc<dyn Backend>> {
    match name {
        "cpu" => Ok(Arc::new(anyccl_cpu::Cpu)),
        "nccl" => Ok(Arc::new(anyccl_nccl::Nccl)),
        other => Err(Error::InvalidArgument {
            op: "backend_by_name",
            arg: "--backend",
            rank: 0,
            group: String::new(),
            msg: format!("unknown backend '{other}' (known: cpu, nccl)"),
        }),
    }
}

/// Accelerator backends tried, in order, before falling back to the CPU.
const ACCELERATORS: &[&str] = &["nccl"];

/// `ANYCCL_BACKEND` or `requested`, or else the first backend whose probe succeeds,
/// preferring accelerators.
pub fn pick_backend(requested: Option<&str>) -> Result<Arc<dyn Backend>> {
    if let Some(name) = requested.map(str::to_string).or_else(|| std::env::var("ANYCCL_BACKEND").ok()) {
        let b = backend_by_name(&name)?;
        b.probe()?;
        return Ok(b);
    }
    for name in ACCELERATORS {
        let b = backend_by_name(name)?;
        match b.probe() {
            Ok(info) => {
                tracing::info!("using the {name} backend: {} device(s), {}", info.devices, info.version);
                return Ok(b);
            }
            Err(e) => tracing::info!("not using {name}: {e}"),
        }
    }
    backend_by_name("cpu")
}

/// A rank's start: launcher variables, the job store (hosted here on rank 0 unless the
/// launcher hosts it), a tracing subscriber filtered by `ANYCCL_LOG`, and flight-recorder
/// dumps on SIGTERM and SIGUSR1.
pub async fn start_rank() -> Result<(LaunchEnv, Arc<dyn Store>, Option<TcpStoreServer>)> {
    anyccl_conformance::init_tracing(tracing::Level::WARN);
    // These programs opt in to flight-recorder dumps on SIGTERM and SIGUSR1 (the launcher
    // stops ranks with SIGTERM), written where ANYCCL_TRACE_DIR says.
    anyccl_core::trace::dump_on_signals()?;
    let env = LaunchEnv::from_env()?;
    let (store, server) = env.connect_store().await?;
    Ok((env, store, server))
}

/// A started rank of a program: its launcher variables, the job store, the backend, its
/// device and the world communicator.
#[allow(missing_debug_implementations)] // The store server and backend are not Debug.
pub struct Rank {
    /// Launcher variables.
    pub env: LaunchEnv,
    /// The job store.
    pub store: Arc<dyn Store>,
    /// The store server, when this rank hosts it (kept alive with the rank).
    pub server: Option<TcpStoreServer>,
    /// The backend in use.
    pub backend: Arc<dyn Backend>,
    /// This rank's device.
    pub platform: Arc<dyn Platform>,
    /// Every rank of the job, owned by `owner`.
    pub world: Communicator,
}

/// Start a rank ([`start_rank`]), pick its backend ([`pick_backend`]) and connect the world
/// communicator, owned by `owner`, with `config`.
///
/// # Errors
/// Launcher variables, store, backend or connect errors.
pub async fn start_world(owner: &str, backend: Option<&str>, config: CommConfig) -> Result<Rank> {
    let (env, store, server) = start_rank().await?;
    let backend = pick_backend(backend)?;
    let platform = backend.platform(env.local_rank)?;
    let world = Communicator::connect(
        backend.as_ref(),
        GroupSpec::world(env.world_size, owner),
        env.rank,
        store.clone(),
        platform.device(),
        config,
    )
    .await?;
    Ok(Rank { env, store, server, backend, platform, world })
}

/// Wait until all `n` ranks reach `key` (through the store: no collective), for at most
/// `timeout` (a program passes its communicators' `op_timeout`, so `ANYCCL_TIMEOUT_S`
/// bounds this wait as it bounds the collectives).
///
/// # Errors
/// `Timeout` naming the ranks that never arrived; store errors.
pub async fn meet(store: &dyn Store, key: &str, rank: usize, n: usize, timeout: Duration) -> Result<()> {
    anyccl_core::store_barrier(store, key, rank, n, anyccl_core::deadline_in(timeout)).await
}
