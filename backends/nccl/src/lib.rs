//! anyccl-nccl: the NCCL backend: NCCL's C API as an `anyccl-device` library (sys / result /
//! safe layers), with CUDA through cudarc's driver `result` layer, all loaded at run time.
//!
//! # Design choices
//! - **Builds anywhere, runs where NCCL is.** Nothing links against CUDA or NCCL. The
//!   probe reports every place it looked and never panics: cudarc's own NCCL loader is not
//!   used because it skips `libnccl.so.2` and panics when nothing loads (see `sys`).
//! - **Non-blocking communicators.** Init, split, connection setup and finalize are polled
//!   against deadlines; on expiry the communicator is aborted, never left hanging.
//! - **Errors carry NCCL's words.** `ncclGetErrorString` plus `ncclGetLastError` travel in
//!   every error (an out-of-memory during a lazy connect reads as NCCL wrote it).
//! - **Stream order.** Each communicator has its own stream; a `Work` records an event (at
//!   its call; with `CommConfig::shared_completion`, at its first look, shared by every
//!   operation before it) and its wait checks the event, the communicator's async error and the deadline. Buffers
//!   must be ready when an operation is enqueued (the platform's copies are synchronous).
//! - **Written once.** Lifecycle, watchdog, `Work` polling, drain and shutdown are
//!   `anyccl-device`'s; this crate is NCCL's types (`sys`), one function per symbol
//!   returning `Result` (`result`), and the adapter (`library`, `cuda`).
//! - **One rank per GPU.** A process may hold several ranks (one thread each) on
//!   different GPUs; the device is `LOCAL_RANK` modulo the devices visible.
#![warn(missing_docs)]
#![allow(missing_docs)] // sys-level field names mirror nccl.h

mod cuda;
mod engine;
mod library;
mod raw;
mod result;
mod sys;

pub use cuda::{Cuda, CudaMemory, CudaPlatform};
pub use engine::{EngineStream, Graph};
pub use library::{nccl_capabilities, NcclHandles, NcclLibrary};
pub use raw::{RawNccl, RawTiming};
pub use result::NcclError;

/// The NCCL backend's communicator: the device layer's over [`NcclLibrary`].
pub type NcclComm = anyccl_device::DeviceComm<NcclLibrary>;

use anyccl_core::{
    async_trait, Backend, BackendInfo, Capabilities, Collective, ConnectOptions, DeviceKind, Error, Platform, Result,
};
use std::sync::Arc;

/// The NCCL backend.
#[derive(Debug, Default, Clone, Copy)]
pub struct Nccl;

fn unavailable(reason: String) -> Error {
    Error::Unavailable { backend: "nccl", reason }
}

impl Nccl {
    fn ready() -> Result<(&'static sys::NcclLib, usize)> {
        match (cuda::probe(), sys::lib()) {
            (Ok(devices), Ok(lib)) => Ok((lib, devices)),
            (Err(c), Ok(_)) => Err(unavailable(c)),
            (Ok(_), Err(n)) => Err(unavailable(n)),
            (Err(c), Err(n)) => Err(unavailable(format!("{c}; {n}"))),
        }
    }
}

/// The process-wide adapter over the loaded NCCL.
fn library(lib: &'static sys::NcclLib) -> &'static NcclLibrary {
    static L: std::sync::OnceLock<NcclLibrary> = std::sync::OnceLock::new();
    L.get_or_init(|| NcclLibrary { lib })
}

/// `22803` as `2.28.3`.
fn version_text(v: i32) -> String {
    format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
}

#[async_trait]
impl Backend for Nccl {
    fn name(&self) -> &'static str {
        "nccl"
    }
    fn probe(&self) -> Result<BackendInfo> {
        let (lib, devices) = Nccl::ready()?;
        Ok(BackendInfo { name: "nccl", version: format!("{} ({})", version_text(lib.version), lib.path), devices })
    }
    fn capabilities(&self) -> Result<Capabilities> {
        let (lib, devices) = Nccl::ready()?;
        Ok(nccl_capabilities(lib, devices))
    }
    fn platform(&self, local_rank: usize) -> Result<Arc<dyn Platform>> {
        let (_, devices) = Nccl::ready()?;
        Ok(Arc::new(CudaPlatform::new(Cuda::new((local_rank % devices) as i32)?)))
    }
    async fn connect(&self, opts: ConnectOptions) -> Result<Arc<dyn Collective>> {
        let (lib, _) = Nccl::ready()?;
        if opts.device.kind != DeviceKind::Cuda {
            return Err(Error::InvalidArgument {
                op: "connect",
                arg: "device",
                rank: opts.rank,
                group: opts.namespace.clone(),
                msg: format!("the nccl backend needs a CUDA device, got {}", opts.device),
            });
        }
        let cuda = Cuda::new(opts.device.ordinal)?;
        let c: Arc<dyn Collective> = NcclComm::connect(library(lib), cuda, opts).await?;
        Ok(c)
    }
}
