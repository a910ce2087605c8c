//! The device runtime a collective library runs on ([`Runtime`]), and the `Platform` that
//! every device backend offers over it ([`DevicePlatform`]).

use anyccl_core::{Buf, Ctx, DType, Device, DeviceKind, DeviceMemory, Error, MemInfo, Platform, Result};
use std::fmt;
use std::sync::Arc;

/// A device runtime (CUDA's driver, Ascend's ACL) for one device.
///
/// Errors are anyccl's already: a runtime call has no rank or group, and each runtime
/// keeps its own error value as the `Backend` error's source.
///
/// A new backend starts here: with a runtime, [`DevicePlatform`] is its `Platform`
/// (allocation, copies, free memory) with no more code.
///
/// # Examples
/// The testing runtime (`testing` feature), whose streams run nothing, as a platform:
/// ```
/// # #[cfg(feature = "testing")] {
/// use anyccl_core::{DType, Platform};
/// use anyccl_device::{testing::NullRuntime, DevicePlatform};
/// use std::sync::Arc;
///
/// let platform = DevicePlatform::new(Arc::new(NullRuntime::new()));
/// let mut buf = platform.alloc(DType::F32, 4)?;
/// platform.copy_from_host(buf.as_mut(), &[0u8; 16])?;
/// assert_eq!(buf.count(), 4);
/// assert!(platform.mem_info()?.free > 0);
/// # }
/// # Ok::<(), anyccl_core::Error>(())
/// ```
pub trait Runtime: Send + Sync + fmt::Debug + 'static {
    /// A stream that executes in order.
    type Stream: Send + Sync + fmt::Debug;
    /// A marker recorded on a stream.
    type Event: Send + Sync;
    /// Device memory, freed on drop.
    type Memory: DeviceMemory + 'static;

    /// The device.
    fn device(&self) -> Device;
    /// Make the device current on the calling thread (cheap; before any library call).
    ///
    /// # Errors
    /// A runtime error.
    fn bind(&self) -> Result<()>;
    /// `Err` once the device can no longer be used by this process (a lost context).
    ///
    /// # Errors
    /// Why not.
    fn usable(&self, _op: &str) -> Result<()> {
        Ok(())
    }
    /// A new stream.
    ///
    /// # Errors
    /// A runtime error.
    fn stream(self: &Arc<Self>) -> Result<Self::Stream>;
    /// An event at the current end of `stream`; the device is current.
    ///
    /// # Errors
    /// A runtime error.
    fn record(&self, stream: &Self::Stream) -> Result<Self::Event>;
    /// Record `event` again at the current end of `stream` (its earlier record no longer
    /// counts); the device is current. Marks reuse their events this way once nothing
    /// holds them.
    ///
    /// # Errors
    /// A runtime error.
    fn record_again(&self, event: &Self::Event, stream: &Self::Stream) -> Result<()>;
    /// Whether the work before `event` has finished; the device is current.
    ///
    /// # Errors
    /// A runtime error (the device failed).
    fn done(&self, event: &Self::Event) -> Result<bool>;
    /// Whether everything enqueued on `stream` so far has finished (the device is current);
    /// `None` where the runtime cannot say without an event, and a mark is recorded instead.
    /// A `Work` waited before anything more is put on its communicator's stream asks this, not
    /// an event recorded after its operation.
    ///
    /// # Errors
    /// A runtime error (the device failed).
    fn stream_done(&self, stream: &Self::Stream) -> Result<Option<bool>> {
        let _ = stream;
        Ok(None)
    }
    /// `count` zeroed elements of `dtype`.
    ///
    /// # Errors
    /// Out of memory, or another runtime error.
    fn alloc(self: &Arc<Self>, dtype: DType, count: usize) -> Result<Self::Memory>;
    /// `count` zeroed elements of `dtype` allocated the way the collective library registers
    /// best (`Platform::alloc_registrable`); [`Runtime::alloc`] where there is no such way.
    ///
    /// # Errors
    /// As [`Runtime::alloc`].
    fn alloc_registrable(self: &Arc<Self>, dtype: DType, count: usize) -> Result<Self::Memory> {
        self.alloc(dtype, count)
    }
    /// Copy `src` to device address `dst`.
    ///
    /// # Safety
    /// `dst` must address at least `src.len()` bytes of this device's memory.
    ///
    /// # Errors
    /// A runtime error.
    unsafe fn copy_to_device(&self, dst: *mut u8, src: &[u8]) -> Result<()>;
    /// Copy device address `src` to `dst`.
    ///
    /// # Safety
    /// `src` must address at least `dst.len()` bytes of this device's memory.
    ///
    /// # Errors
    /// A runtime error.
    unsafe fn copy_to_host(&self, dst: &mut [u8], src: *const u8) -> Result<()>;
    /// Wait for all work on the device.
    ///
    /// # Errors
    /// A runtime error.
    fn synchronize(&self) -> Result<()>;
    /// Free and total memory of the device.
    ///
    /// # Errors
    /// A runtime error.
    fn mem_info(&self) -> Result<MemInfo>;
    /// Make `stream` wait, on the device, for the work enqueued on the engine's stream
    /// `raw` so far (an event recorded there, waited for here). The device is current.
    ///
    /// # Safety
    /// `raw` is a live stream of this device.
    ///
    /// # Errors
    /// `Unsupported` where the runtime has no such ordering; a runtime error.
    unsafe fn wait_raw(&self, stream: &Self::Stream, raw: *mut std::ffi::c_void) -> Result<()> {
        let _ = (stream, raw);
        Err(Ctx::new("device", 0, "").unsupported("wait_stream", "events between streams"))
    }
    /// Whether the engine's stream `raw` is recording a graph (a stream capture).
    ///
    /// # Safety
    /// `raw` is a live stream of this device.
    ///
    /// # Errors
    /// A runtime error.
    unsafe fn capturing(&self, raw: *mut std::ffi::c_void) -> Result<bool> {
        let _ = raw;
        Ok(false)
    }
    /// The engine's stream `raw` as a stream the library can launch on, not owned (never
    /// destroyed by the returned value); `None` where the runtime cannot lend one, and a
    /// capture then forks this communicator's stream into the engine's through events.
    ///
    /// # Safety
    /// `raw` is a live stream of this device that outlives the returned value.
    unsafe fn borrow_raw(self: &Arc<Self>, raw: *mut std::ffi::c_void) -> Option<Self::Stream> {
        let _ = raw;
        None
    }
    /// Make the engine's stream `raw` wait, on the device, for the work enqueued on
    /// `stream` so far. The device is current.
    ///
    /// # Safety
    /// `raw` is a live stream of this device.
    ///
    /// # Errors
    /// `Unsupported` where the runtime has no such ordering; a runtime error.
    unsafe fn signal_raw(&self, stream: &Self::Stream, raw: *mut std::ffi::c_void) -> Result<()> {
        let _ = (stream, raw);
        Err(Ctx::new("device", 0, "").unsupported("signal_stream", "events between streams"))
    }
}

/// The `Platform` of one device over its runtime.
#[derive(Debug)]
pub struct DevicePlatform<R: Runtime> {
    rt: Arc<R>,
}

impl<R: Runtime> DevicePlatform<R> {
    /// The platform of `rt`'s device.
    pub fn new(rt: Arc<R>) -> Self {
        DevicePlatform { rt }
    }
    /// The runtime.
    pub fn runtime(&self) -> &Arc<R> {
        &self.rt
    }
    fn check_device(&self, op: &'static str, b: &Buf<'_>) -> Result<()> {
        if b.device() != self.rt.device() {
            let msg = format!("buffer on {}, platform is {}", b.device(), self.rt.device());
            return Err(Ctx::new("platform", 0, "").invalid(op, "buffer", msg));
        }
        Ok(())
    }
}

impl<R: Runtime> Platform for DevicePlatform<R> {
    fn kind(&self) -> DeviceKind {
        self.rt.device().kind
    }
    fn device(&self) -> Device {
        self.rt.device()
    }
    fn alloc(&self, dtype: DType, count: usize) -> Result<Box<dyn DeviceMemory>> {
        self.rt.usable("alloc")?;
        Ok(Box::new(self.rt.alloc(dtype, count)?))
    }
    fn alloc_registrable(&self, dtype: DType, count: usize) -> Result<Box<dyn DeviceMemory>> {
        self.rt.usable("alloc_registrable")?;
        Ok(Box::new(self.rt.alloc_registrable(dtype, count)?))
    }
    fn copy_from_host(&self, dst: &mut dyn DeviceMemory, src: &[u8]) -> Result<()> {
        let v = dst.view();
        if v.bytes() != src.len() {
            return Err(Error::length_mismatch("copy_from_host", "src", v.bytes(), src.len()));
        }
        if src.is_empty() {
            return Ok(());
        }
        self.check_device("copy_from_host", &v)?;
        self.rt.usable("copy_from_host")?;
        self.rt.bind()?;
        // SAFETY: `v` addresses `src.len()` bytes of this device's memory, owned by `dst`.
        unsafe { self.rt.copy_to_device(v.ptr() as *mut u8, src) }
    }
    fn copy_to_host(&self, src: &dyn DeviceMemory, dst: &mut [u8]) -> Result<()> {
        let v = src.view();
        if v.bytes() != dst.len() {
            return Err(Error::length_mismatch("copy_to_host", "dst", v.bytes(), dst.len()));
        }
        if dst.is_empty() {
            return Ok(());
        }
        self.check_device("copy_to_host", &v)?;
        self.rt.usable("copy_to_host")?;
        self.rt.bind()?;
        // SAFETY: `v` addresses `dst.len()` bytes of this device's memory, owned by `src`.
        unsafe { self.rt.copy_to_host(dst, v.ptr()) }
    }
    fn synchronize(&self) -> Result<()> {
        self.rt.usable("synchronize")?;
        self.rt.bind()?;
        self.rt.synchronize()
    }
    fn mem_info(&self) -> Result<MemInfo> {
        self.rt.usable("mem_info")?;
        self.rt.bind()?;
        self.rt.mem_info()
    }
}
