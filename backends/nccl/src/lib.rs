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

mod cuda;
#[cfg(feature = "bench")]
mod engine;
mod library;
#[cfg(feature = "bench")]
mod raw;
mod result;
mod sys;

pub use cuda::{Cuda, CudaMemory, CudaPlatform};
#[cfg(feature = "bench")]
pub use engine::{EngineStream, Graph};
pub use library::{nccl_capabilities, NcclHandles, NcclLibrary};
#[cfg(feature = "bench")]
pub use raw::{RawNccl, RawTiming};
pub use result::NcclError;

use anyccl_core::Result;
use anyccl_device::{Adapter, Loaded};
use std::sync::Arc;

anyccl_device::device_backend!(
    /// What NCCL adds to the device layer: loading libcuda and libnccl, and CUDA devices.
    NcclAdapter => Nccl, NcclComm over NcclLibrary
);

impl NcclAdapter {
    /// NCCL loaded and the CUDA devices counted, or every place looked.
    fn ready() -> Result<(&'static NcclLibrary, usize)> {
        library::blocking_setting()?;
        let unavailable = |why: String| anyccl_core::Error::unavailable("nccl", why);
        let (lib, devices) = match (cuda::probe(), sys::lib()) {
            (Ok(devices), Ok(lib)) => (lib, devices),
            (Err(c), Ok(_)) => return Err(unavailable(c)),
            (Ok(_), Err(n)) => return Err(unavailable(n)),
            (Err(c), Err(n)) => return Err(unavailable(format!("{c}; {n}"))),
        };
        static L: std::sync::OnceLock<NcclLibrary> = std::sync::OnceLock::new();
        Ok((L.get_or_init(|| NcclLibrary { lib }), devices))
    }
}

/// `22803` as `2.28.3`.
fn version_text(v: i32) -> String {
    format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
}

impl Adapter for NcclAdapter {
    type Lib = NcclLibrary;
    const NAME: &'static str = "nccl";

    fn load(&self) -> Result<Loaded<NcclLibrary>> {
        let (lib, devices) = Self::ready()?;
        let version = format!("{} ({})", version_text(lib.lib.version), lib.lib.path);
        Ok(Loaded { lib, devices, version, capabilities: nccl_capabilities(lib.lib, devices) })
    }

    fn runtime(&self, ordinal: i32) -> Result<Arc<Cuda>> {
        Cuda::new(ordinal)
    }
}
