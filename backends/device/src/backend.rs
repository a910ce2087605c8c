//! The backend every device library gets from the layer ([`DeviceBackend`]): an adapter
//! supplies only how to load its library and make a device runtime ([`Adapter`]); probing,
//! capabilities, the platform and connect are written once here.

use crate::comm::DeviceComm;
use crate::library::Library;
use crate::runtime::DevicePlatform;
use anyccl_core::{async_trait, Backend, BackendInfo, Capabilities, Collective, ConnectOptions, Ctx, Platform, Result};
use std::fmt;
use std::sync::Arc;

/// A library an [`Adapter`] loaded: what its backend's probe reports.
#[derive(Debug)]
pub struct Loaded<L: 'static> {
    /// The process-wide library (loaded once, kept for the process's life).
    pub lib: &'static L,
    /// Devices it can use on this machine.
    pub devices: usize,
    /// Its version and where it was loaded from, for the probe's report.
    pub version: String,
    /// What its communicators support; `device_kind` is the kind of device connect accepts.
    pub capabilities: Capabilities,
}

/// What a device library's adapter supplies to become a backend ([`DeviceBackend`]).
///
/// # Examples
/// An adapter over the testing library (`testing` feature), loaded once:
/// ```
/// # #[cfg(feature = "testing")] {
/// use anyccl_device::testing::{NullLibrary, NullRuntime};
/// use anyccl_device::{Adapter, DeviceBackend, Library, Loaded};
/// use anyccl_core::{Backend, Result};
/// use std::sync::{Arc, OnceLock};
///
/// #[derive(Debug, Default, Clone, Copy)]
/// struct NullAdapter;
///
/// impl Adapter for NullAdapter {
///     type Lib = NullLibrary;
///     const NAME: &'static str = "null";
///     fn load(&self) -> Result<Loaded<NullLibrary>> {
///         static LIB: OnceLock<NullLibrary> = OnceLock::new();
///         let lib = LIB.get_or_init(NullLibrary::default);
///         let capabilities = lib.capabilities(&NullRuntime::new());
///         Ok(Loaded { lib, devices: 1, version: "null 1.0 (built in)".into(), capabilities })
///     }
///     fn runtime(&self, _ordinal: i32) -> Result<Arc<NullRuntime>> {
///         Ok(Arc::new(NullRuntime::new()))
///     }
/// }
///
/// let backend = DeviceBackend(NullAdapter);
/// assert_eq!(backend.probe()?.devices, 1);
/// # }
/// # Ok::<(), anyccl_core::Error>(())
/// ```
pub trait Adapter: Send + Sync + fmt::Debug + 'static {
    /// The collective library.
    type Lib: Library;
    /// The backend's name (`nccl`, `hccl`).
    const NAME: &'static str;
    /// Load the library and count the devices, once per process (never a panic).
    ///
    /// # Errors
    /// `Unavailable` listing everything looked for and where; `InvalidArgument` for a
    /// setting of the backend that does not parse (the library is there, but set up wrong:
    /// a program must not silently move to another backend).
    fn load(&self) -> Result<Loaded<Self::Lib>>;
    /// The runtime of device `ordinal` (below [`Loaded::devices`]).
    ///
    /// # Errors
    /// The runtime's, when the device cannot be opened.
    fn runtime(&self, ordinal: i32) -> Result<Arc<<Self::Lib as Library>::Runtime>>;
}

/// The names an adapter crate exports, written once: the adapter's unit struct (with the docs
/// given), the backend's type and value, and its communicator's type.
///
/// `device_backend!(/// docs  NcclAdapter => Nccl, NcclComm over NcclLibrary);` declares
/// `pub struct NcclAdapter`, `pub type Nccl = DeviceBackend<NcclAdapter>`, the value
/// `pub const Nccl` (for `Arc::new(Nccl)`) and `pub type NcclComm = DeviceComm<NcclLibrary>`.
#[macro_export]
macro_rules! device_backend {
    ($(#[$doc:meta])* $adapter:ident => $backend:ident, $comm:ident over $lib:ty) => {
        $(#[$doc])*
        #[derive(Debug, Default, Clone, Copy)]
        pub struct $adapter;
        #[doc = concat!("The ", stringify!($backend), " backend: the device layer's backend over [`", stringify!($adapter), "`].")]
        pub type $backend = $crate::DeviceBackend<$adapter>;
        #[doc = concat!("The ", stringify!($backend), " backend, as a value (`Arc::new(", stringify!($backend), ")`, `", stringify!($backend), ".probe()`).")]
        #[allow(non_upper_case_globals)] // Named as the type, as a unit struct's value is.
        pub const $backend: $backend = $crate::DeviceBackend($adapter);
        #[doc = concat!("The ", stringify!($backend), " backend's communicator: the device layer's over [`", stringify!($lib), "`].")]
        pub type $comm = $crate::DeviceComm<$lib>;
    };
}

/// The backend of a device library: `anyccl-core`'s `Backend` over an [`Adapter`].
#[derive(Debug, Default, Clone, Copy)]
pub struct DeviceBackend<A>(pub A);

impl<A: Adapter> DeviceBackend<A> {
    fn loaded(&self) -> Result<Loaded<A::Lib>> {
        self.0.load()
    }
}

#[async_trait]
impl<A: Adapter> Backend for DeviceBackend<A> {
    fn name(&self) -> &'static str {
        A::NAME
    }

    fn probe(&self) -> Result<BackendInfo> {
        let l = self.loaded()?;
        Ok(BackendInfo { name: A::NAME, version: l.version, devices: l.devices })
    }

    fn capabilities(&self) -> Result<Capabilities> {
        Ok(self.loaded()?.capabilities)
    }

    fn platform(&self, local_rank: usize) -> Result<Arc<dyn Platform>> {
        let l = self.loaded()?;
        let ordinal = (local_rank % l.devices.max(1)) as i32;
        Ok(Arc::new(DevicePlatform::new(self.0.runtime(ordinal)?)))
    }

    async fn connect(&self, opts: ConnectOptions) -> Result<Arc<dyn Collective>> {
        let l = self.loaded()?;
        let kind = l.capabilities.device_kind;
        if opts.device.kind != kind {
            let ctx = Ctx::new(A::NAME, opts.rank, opts.namespace.clone());
            let msg = format!("the {} backend needs a {kind:?} device, got {}", A::NAME, opts.device);
            return Err(ctx.invalid("connect", "device", msg));
        }
        let rt = self.0.runtime(opts.device.ordinal)?;
        let c: Arc<dyn Collective> = DeviceComm::connect(l.lib, rt, opts).await?;
        Ok(c)
    }
}
