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

mod acl;
mod library;
mod result;
mod sys;

pub use acl::{Acl, AclMemory, AclPlatform};
pub use library::{hccl_capabilities, HcclHandle, HcclLibrary};
pub use result::HcclError;

use anyccl_core::Result;
use anyccl_device::{Adapter, Loaded};
use std::sync::Arc;

anyccl_device::device_backend!(
    /// What HCCL adds to the device layer: loading libhccl and libascendcl, and Ascend NPUs.
    HcclAdapter => Hccl, HcclComm over HcclLibrary
);

impl Adapter for HcclAdapter {
    type Lib = HcclLibrary;
    const NAME: &'static str = "hccl";

    fn load(&self) -> Result<Loaded<HcclLibrary>> {
        let unavailable = |why: String| anyccl_core::Error::unavailable("hccl", why);
        let (lib, (acl, devices)) = match (sys::hccl(), acl::probe()) {
            (Ok(l), Ok(a)) => (l, a),
            (Err(h), Ok(_)) => return Err(unavailable(h)),
            (Ok(_), Err(a)) => return Err(unavailable(a)),
            (Err(h), Err(a)) => return Err(unavailable(format!("{h}; {a}"))),
        };
        static L: std::sync::OnceLock<HcclLibrary> = std::sync::OnceLock::new();
        let lib = L.get_or_init(|| HcclLibrary { lib, devices });
        let version = format!("{} with {}", lib.lib.path, acl.path);
        Ok(Loaded { lib, devices, version, capabilities: hccl_capabilities(lib.lib, devices) })
    }

    fn runtime(&self, ordinal: i32) -> Result<Arc<Acl>> {
        Acl::new(ordinal)
    }
}
