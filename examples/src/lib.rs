//! anyccl-examples: the programs around the library: the `anyccl-run` launcher, the
//! demos, the conformance runner and the benchmark tool. This file holds what they share:
//! picking a backend and starting a rank from the launcher's variables.
#![forbid(unsafe_code)]

use anyccl_core::{Backend, Error, LaunchEnv, Result, Store, TcpStoreServer};
use std::sync::Arc;

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
/// launcher hosts it), and a tracing subscriber filtered by `ANYCCL_LOG`.
pub async fn start_rank() -> Result<(LaunchEnv, Arc<dyn Store>, Option<TcpStoreServer>)> {
    anyccl_conformance::init_tracing(tracing::Level::WARN);
    let env = LaunchEnv::from_env()?;
    let (store, server) = env.connect_store().await?;
    Ok((env, store, server))
}
