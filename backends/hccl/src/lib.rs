//! anyccl-hccl: the HCCL backend: HCCL and ACL (Ascend CANN) loaded at run time with
//! libloading, as an `anyccl-device` library (sys / result / safe layers).
//!
//! **Not yet run on Ascend hardware.** It is tested in CI against a stand-in library the
//! workspace builds (`anyccl-hccl-standin`): HCCL's and ACL's symbols with their real
//! signatures and type sizes, data really exchanged between ranks, lazy link set-up that
//! takes device memory and fails as HCCL does. What the stand-in cannot show is listed in
//! the README.
//!
//! # Design choices
//! - **Builds anywhere, runs where CANN is.** `libhccl.so` and `libascendcl.so` are found
//!   in `ANYCCL_HCCL_LIBRARY_DIR`, `ASCEND_HOME_PATH/lib64`, `ASCEND_TOOLKIT_HOME/lib64`,
//!   `/usr/local/Ascend/ascend-toolkit/latest/lib64`, then the loader's path; the probe
//!   lists every place looked and never panics. Symbols older CANN releases lack
//!   (`HcclCreateSubCommConfig`, `HcclAlltoAllV`, `HcclBatchSendRecv`, `HcclCommSuspend`)
//!   are optional and show in the capabilities. Batched send/recv uses
//!   `HcclBatchSendRecv` (in `libhccl.so`), so `libhcomm.so`'s group calls are not needed.
//! - **Root info through the store.** The group's first rank calls `HcclGetRootInfo` and
//!   publishes its 4,108 bytes; every rank calls `HcclCommInitRootInfoConfig` with a
//!   config built like `HcclCommConfigInit` (an inline header function, reproduced in
//!   `sys`), carrying the group name, `CommConfig::buffer_mb` as `hcclBufferSize` and the
//!   operation timeout as `hcclExecTimeOut`, for the fields
//!   `HcclGetCommConfigCapability` says the library honours.
//! - **Sub-groups** through `HcclCreateSubCommConfig` where the library has it (no new
//!   link set-up), else a fresh root-info exchange among the members.
//! - **No average, no abort.** HCCL has no `avg` reduction: the capabilities leave it out
//!   and programs that average sum and scale. HCCL has no abort: a call blocked in link
//!   set-up cannot be stopped. The deadline holds through HCCL's own timeouts: init waits
//!   on a helper thread under the caller's deadline; `hcclExecTimeOut` is the
//!   communicator's operation timeout; link set-up is bounded by `HCCL_CONNECT_TIMEOUT`
//!   (120 s by default, at least 120 on Ascend); past the enqueue timeout the communicator
//!   is failed and the blocked call returns `Timeout` once HCCL releases it. Destroy calls
//!   `HcclCommSuspend` first where present.
//! - **Errors** carry `HcclGetErrorString` and ACL's most recent message; asynchronous
//!   errors come from `HcclGetCommAsyncError`.
#![warn(missing_docs)]
#![allow(missing_docs)] // sys-level field names mirror hccl_types.h and acl_rt.h

mod acl;
mod library;
mod result;
mod sys;

pub use acl::{Acl, AclMemory, AclPlatform};
pub use library::{hccl_capabilities, HcclHandle, HcclLibrary};
pub use result::HcclError;

use anyccl_core::{
    async_trait, Backend, BackendInfo, Capabilities, Collective, ConnectOptions, DeviceKind, Error, Platform, Result,
};
use std::sync::Arc;

/// The HCCL backend's communicator: the device layer's over [`HcclLibrary`].
pub type HcclComm = anyccl_device::DeviceComm<HcclLibrary>;

/// The HCCL backend.
#[derive(Debug, Default, Clone, Copy)]
pub struct Hccl;

fn unavailable(reason: String) -> Error {
    Error::Unavailable { backend: "hccl", reason }
}

impl Hccl {
    fn ready() -> Result<(&'static HcclLibrary, usize)> {
        let lib = sys::hccl();
        let acl = acl::probe();
        let (lib, devices) = match (lib, acl) {
            (Ok(l), Ok((_, n))) => (l, n),
            (Err(h), Ok(_)) => return Err(unavailable(h)),
            (Ok(_), Err(a)) => return Err(unavailable(a)),
            (Err(h), Err(a)) => return Err(unavailable(format!("{h}; {a}"))),
        };
        static L: std::sync::OnceLock<HcclLibrary> = std::sync::OnceLock::new();
        Ok((L.get_or_init(|| HcclLibrary { lib, devices }), devices))
    }
}

#[async_trait]
impl Backend for Hccl {
    fn name(&self) -> &'static str {
        "hccl"
    }
    fn probe(&self) -> Result<BackendInfo> {
        let (lib, devices) = Hccl::ready()?;
        let acl = acl::probe().map(|(a, _)| a.path.clone()).unwrap_or_default();
        Ok(BackendInfo { name: "hccl", version: format!("{} with {acl}", lib.lib.path), devices })
    }
    fn capabilities(&self) -> Result<Capabilities> {
        let (lib, devices) = Hccl::ready()?;
        Ok(hccl_capabilities(lib.lib, devices))
    }
    fn platform(&self, local_rank: usize) -> Result<Arc<dyn Platform>> {
        let (_, devices) = Hccl::ready()?;
        Ok(Arc::new(AclPlatform::new(Acl::new((local_rank % devices) as i32)?)))
    }
    async fn connect(&self, opts: ConnectOptions) -> Result<Arc<dyn Collective>> {
        let (lib, _) = Hccl::ready()?;
        if opts.device.kind != DeviceKind::Npu {
            return Err(Error::InvalidArgument {
                op: "connect",
                arg: "device",
                rank: opts.rank,
                group: opts.namespace.clone(),
                msg: format!("the hccl backend needs an Ascend NPU device, got {}", opts.device),
            });
        }
        let acl = Acl::new(opts.device.ordinal)?;
        let c: Arc<dyn Collective> = HcclComm::connect(lib, acl, opts).await?;
        Ok(c)
    }
}
