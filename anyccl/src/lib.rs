//! anyccl: one collective-communication API over NCCL (CUDA), HCCL (Ascend) and a Gloo-like
//! CPU backend, plus a communicator warmup written once against it. This is the crate an
//! engine adds; the `anyccl-*` crates behind it are its parts.
//!
//! # Design choices
//! 1. **Features decide what is compiled, probes decide what is used.** `cpu` (default),
//!    `nccl` and `hccl` compile a backend in; every backend builds without its vendor SDK and loads its
//!    libraries at run time, so a build with `nccl` runs on a machine without GPUs and picks
//!    the CPU backend there ([`pick_backend`]).
//! 2. **The registry branches on capabilities, never on names.** [`pick_backend`] prefers a
//!    backend whose devices are accelerators (`Capabilities::device_kind`) and whose probe
//!    succeeds; names only select a backend a user asked for.
//! 3. **Rank start-up is one call.** [`start_rank`] reads the launcher's variables (torchrun's,
//!    Slurm's, Open MPI's), joins the job's store (checking the job identity) and connects the
//!    world communicator; [`connect_store`] stops before the communicator.
//! 4. **Nothing global happens behind the program's back.** Logging ([`init_logging`]) and
//!    flight-recorder dumps on signals ([`trace::dump_on_signals`]) are the program's to
//!    turn on.
//!
//! # Two faces
//! The root holds what a program that *uses* collectives needs, by name: the
//! [`Communicator`] and its [`Work`], buffers and dtypes, errors, groups, configuration, the
//! store, platforms, logging, rank start-up and backend picking, with the warmup as
//! [`warmup`], the membership of recovery in place as [`membership`], flight-recorder
//! dumps as [`trace`] and the backends as [`backends`](mod@backends). What a program that
//! *implements* a backend, a store or a tool needs (the [`raw::Collective`] contract,
//! [`raw::WorkImpl`], error context, the checked environment parser, clocks,
//! store generations, test patterns) is under [`raw`]. Benchmark tools (raw NCCL, an
//! engine's stream) are under `bench`, with the feature of that name.
//!
//! # Examples
//! A rank of a job started by `anyccl-run`, `torchrun` or Slurm:
//! ```no_run
//! # async fn rank() -> anyccl::Result<()> {
//! use anyccl::{CommConfig, GroupSpec, ReduceOp, Role};
//! let rank = anyccl::start_rank("my-engine", None, CommConfig::from_env()?).await?;
//! let mut grads = rank.platform.alloc(anyccl::DType::F32, 1 << 20)?;
//! rank.world.all_reduce(None, grads.view_mut(), ReduceOp::Sum)?.wait(rank.world.config().op_timeout)?;
//! let all: Vec<usize> = (0..rank.env.world_size).collect();
//! let dp = rank.world.split(Some(GroupSpec::new("dp", all, "my-engine", Role::Data))).await?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use anyccl_core::{
    abort_all, bf16, f16, init_logging, store_barrier, AllToAllSplits, Backend, BackendInfo, Buf, BufMut, Capabilities,
    Captured, CasOutcome, CommConfig, Communicator, DType, Device, DeviceKind, DeviceMemory, Element, Error, EtcdStore,
    GraphOp, GroupRegistry, GroupSpec, HostMemory, HostPlatform, LaunchEnv, MemInfo, MemoryStore, OpSignature, P2POp,
    Platform, PrefixStore, Recovery, ReduceOp, RegHandle, Registered, Result, Role, Store, StoreStats, StreamRef,
    TcpStore, TcpStoreOptions, TcpStoreServer, Work, WorkInfo,
};

/// The communicator warmup: plans, agreement and strategies (`anyccl-warmup`).
pub mod warmup {
    pub use anyccl_warmup::*;
}

/// Who is in the job at which epoch, agreed through the store on evidence, for recovery in
/// place (`anyccl-membership`).
pub mod membership {
    pub use anyccl_membership::*;
}

/// Flight-recorder dumps, and the recorder's records.
pub mod trace {
    pub use anyccl_core::trace::*;
    pub use anyccl_core::{FlightRecorder, OpRecord, OpState};
}

/// The backends compiled into this build (by feature); [`crate::pick_backend`] chooses
/// among them at run time.
pub mod backends {
    #[cfg(feature = "cpu")]
    pub use anyccl_cpu::Cpu;
    #[cfg(feature = "hccl")]
    pub use anyccl_hccl::Hccl;
    #[cfg(feature = "nccl")]
    pub use anyccl_nccl::Nccl;
}

/// What implementers of a backend, a store or a tool need beyond the user API: the
/// [`Collective`](raw::Collective) contract and its `Work`, error context, the checked
/// environment parser, clocks, store generations and the conformance suite's data pattern.
pub mod raw {
    pub use anyccl_core::{abandon_generation, connect_generation, in_new_generation, joined_generation};
    pub use anyccl_core::{
        agree_window, async_trait, bad_env, coarse_now_ns, deadline_in, env_bytes, env_choice, env_flag, env_parse,
        env_parse_at, env_rank, env_secs, env_string, env_world_size, overlaps, parse_bytes, parse_flag, parse_secs,
        read_regular_file, stable_hash, write_file_atomically, Collective, CommInfo, ConnectOptions, Ctx, Source,
        Ticket, WorkImpl, MAX_RECORDS, MAX_TIMEOUT,
    };
    pub use anyccl_core::{pattern, store};
}

/// Tools for benchmarks (`bench` feature): NCCL called directly, for measuring what anyccl
/// adds (`anyccl-bench --vs-raw`), and an engine's own CUDA stream with a spin kernel and
/// graph capture (`anyccl-bench --overlap-us`, `--graph`).
#[cfg(feature = "bench")]
pub mod bench {
    pub use anyccl_nccl::{EngineStream, Graph, RawNccl, RawTiming};
}

/// The level below which [`init_logging`] drops messages when `ANYCCL_LOG` is unset.
pub use tracing::Level as LogLevel;

use std::sync::Arc;

/// Every backend compiled into this build (by feature), whether or not it can run here.
#[allow(clippy::vec_init_then_push)] // Each push exists only with its feature.
pub fn backends() -> Vec<Arc<dyn Backend>> {
    // Accelerators first; each push is there only with its feature.
    #[allow(unused_mut)]
    let mut v: Vec<Arc<dyn Backend>> = Vec::new();
    #[cfg(feature = "nccl")]
    v.push(Arc::new(anyccl_nccl::Nccl));
    #[cfg(feature = "hccl")]
    v.push(Arc::new(anyccl_hccl::Hccl));
    #[cfg(feature = "cpu")]
    v.push(Arc::new(anyccl_cpu::Cpu));
    v
}

/// The backend named `name`, among those compiled in.
///
/// # Errors
/// `InvalidArgument` naming the backends this build has (and the feature that adds one).
pub fn backend_by_name(name: &str) -> Result<Arc<dyn Backend>> {
    let all = backends();
    if let Some(b) = all.iter().find(|b| b.name() == name) {
        return Ok(b.clone());
    }
    let known: Vec<&str> = all.iter().map(|b| b.name()).collect();
    Err(raw::Ctx::process("anyccl").invalid(
        "backend_by_name",
        "backend",
        format!(
            "no backend '{name}' in this build (it has: {}); backends are added by the anyccl crate's features \
             (cpu, nccl, hccl)",
            known.join(", ")
        ),
    ))
}

/// The backend to use: `requested`, else `ANYCCL_BACKEND`, else the first compiled-in
/// backend whose devices are accelerators and whose probe succeeds, else the first whose
/// probe succeeds.
///
/// # Errors
/// A requested backend that is not compiled in or cannot run here (its probe's
/// `Unavailable`, listing what it looked for); `Unavailable` when no backend can run.
pub fn pick_backend(requested: Option<&str>) -> Result<Arc<dyn Backend>> {
    let from_env = || raw::env_string("ANYCCL_BACKEND");
    if let Some(name) = requested.map(str::to_string).map_or_else(from_env, |n| Ok(Some(n)))? {
        let b = backend_by_name(&name)?;
        b.probe()?;
        return Ok(b);
    }
    let mut usable = Vec::new();
    let mut why = Vec::new();
    for b in backends() {
        match b.probe() {
            Ok(info) => usable.push((b, info)),
            // Installed but set up wrong (a malformed setting): an error, never a silent
            // move to another backend.
            Err(e) if !matches!(e, Error::Unavailable { .. }) => return Err(e),
            Err(e) => {
                tracing::info!("not using {}: {e}", b.name());
                why.push(e.to_string());
            }
        }
    }
    let accelerated = |b: &Arc<dyn Backend>| b.capabilities().is_ok_and(|c| c.device_kind != DeviceKind::Cpu);
    let pick = usable.iter().position(|(b, _)| accelerated(b)).or(if usable.is_empty() { None } else { Some(0) });
    match pick {
        Some(i) => {
            let (b, info) = usable.swap_remove(i);
            tracing::info!("using the {} backend: {} device(s), {}", b.name(), info.devices, info.version);
            Ok(b)
        }
        None => Err(Error::unavailable(
            "any",
            if why.is_empty() {
                "this build has no backend (enable the cpu, nccl or hccl feature)".into()
            } else {
                why.join("; ")
            },
        )),
    }
}

/// A started rank of a job.
#[allow(missing_debug_implementations)] // The store server and backend are not Debug.
pub struct Rank {
    /// The launcher's variables.
    pub env: LaunchEnv,
    /// The job's store.
    pub store: Arc<dyn Store>,
    /// The store server, when this rank hosts it (keep it alive as long as the job runs).
    pub server: Option<TcpStoreServer>,
    /// The backend in use.
    pub backend: Arc<dyn Backend>,
    /// This rank's device layer (`LOCAL_RANK` picks the device).
    pub platform: Arc<dyn Platform>,
    /// Every rank of the job, owned by the `owner` given to [`start_rank`].
    pub world: Communicator,
}

/// Read the launcher's variables and join the job's store: rank 0 hosts it unless the
/// launcher does (`ANYCCL_STORE_EXTERNAL=1`); the job identity is checked on joining (see
/// [`LaunchEnv::connect_store`]).
///
/// # Errors
/// `InvalidArgument` naming a malformed variable or a refused join; store errors.
pub async fn connect_store() -> Result<(LaunchEnv, Arc<dyn Store>, Option<TcpStoreServer>)> {
    let env = LaunchEnv::from_env()?;
    let (store, server) = env.connect_store().await?;
    Ok((env, store, server))
}

/// Start a rank: [`connect_store`], [`pick_backend`] (`backend` by name, or the best
/// available), this rank's device, and the world communicator owned by `owner`.
///
/// # Errors
/// As [`connect_store`] and [`pick_backend`]; the world's connect errors.
///
/// # Cancel safety
/// Not cancel safe: a dropped start may leave the other ranks waiting for this one until
/// their connect deadline.
pub async fn start_rank(owner: &str, backend: Option<&str>, config: CommConfig) -> Result<Rank> {
    let (env, store, server) = connect_store().await?;
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

/// The README's "Using it" snippet, compiled as a doc test of this crate.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_backend_names_the_compiled_ones() {
        let e = backend_by_name("gloo").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("no backend 'gloo'"), "{e}");
        for b in backends() {
            assert!(e.contains(b.name()), "{e} does not list {}", b.name());
        }
    }

    #[test]
    fn the_pick_is_a_backend_that_runs_here_preferring_accelerators() {
        if std::env::var_os("ANYCCL_BACKEND").is_some() {
            return;
        }
        let b = pick_backend(None).expect("the cpu backend runs anywhere");
        assert!(b.probe().is_ok());
        let accelerator_runs = backends()
            .iter()
            .any(|x| x.probe().is_ok() && x.capabilities().is_ok_and(|c| c.device_kind != DeviceKind::Cpu));
        assert_eq!(b.capabilities().map(|c| c.device_kind != DeviceKind::Cpu).unwrap_or(false), accelerator_runs);
    }

    /// A one-rank job with no launcher: the store on a free port, the world communicator of
    /// one rank, a collective on it.
    #[test]
    fn a_single_rank_starts_without_a_launcher() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port());
        // This crate's only test that reads the launcher's variables.
        std::env::set_var("MASTER_PORT", port.expect("a free port").to_string());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let rank = rt.block_on(start_rank("facade-test", Some("cpu"), CommConfig::default())).expect("start");
        assert_eq!((rank.env.rank, rank.env.world_size, rank.world.size()), (0, 1, 1));
        let mut x = rank.platform.alloc(DType::F32, 4).expect("alloc");
        rank.world
            .all_reduce(None, x.view_mut(), ReduceOp::Sum)
            .expect("enqueue")
            .wait(rank.world.config().op_timeout)
            .expect("wait");
        rt.block_on(rank.world.shutdown()).expect("shutdown");
    }
}
