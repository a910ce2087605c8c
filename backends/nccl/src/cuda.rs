//! The CUDA side: primary contexts, streams, events and device memory through cudarc's
//! driver `result` layer, plus the `Platform` implementation.

use crate::result::cuda as cuda_err;
use anyccl_core::{Ctx, DType, Device, DeviceKind, Error, MemInfo, Recovery, Result};
use anyccl_device::{DeviceBuffer, Free};
use cudarc::driver::{result as cu, sys};
use std::sync::{Arc, OnceLock};

/// Whether libcuda loads and the driver initialises; the number of devices.
///
/// # Errors
/// A description of what is missing.
pub fn probe() -> std::result::Result<usize, String> {
    static PROBE: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            // Whether the driver loads at all, before any CUDA call (cudarc's own check exists
            // only in its dynamic-loading mode; an engine may link CUDA instead).
            let names = ["libcuda.so.1", "libcuda.so"];
            // SAFETY: loading the NVIDIA driver library runs its initialisers only, as the
            // first CUDA call would; the handle is dropped at once (cudarc keeps its own).
            if !names.iter().any(|n| unsafe { libloading::Library::new(n) }.is_ok()) {
                return Err(format!("libcuda.so (the NVIDIA driver) not found; tried {}", names.join(", ")));
            }
            cu::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
            let n = cu::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e:?}"))?;
            if n <= 0 {
                return Err("no CUDA device".into());
            }
            Ok(n as usize)
        })
        .clone()
}

/// A device's primary context, retained for our lifetime.
#[derive(Debug)]
pub struct Cuda {
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    /// Ordinal.
    pub ordinal: i32,
    /// Set at the first sticky error (an aborted NCCL kernel touching freed memory, say):
    /// the context is then unusable for the rest of the process, and says so.
    lost: std::sync::OnceLock<String>,
}

/// Errors after which a CUDA context cannot be used again by the process.
fn sticky(e: &cudarc::driver::DriverError) -> bool {
    use cudarc::driver::sys::CUresult::*;
    matches!(
        e.0,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_ECC_UNCORRECTABLE
    )
}

// SAFETY: a CUcontext handle may be made current on any thread; we never share mutable state
// through it.
unsafe impl Send for Cuda {}
// SAFETY: as above.
unsafe impl Sync for Cuda {}

impl Cuda {
    /// Retain device `ordinal`'s primary context.
    ///
    /// # Errors
    /// `Unavailable` without a driver; `Backend` on a driver error.
    pub fn new(ordinal: i32) -> Result<Arc<Cuda>> {
        probe().map_err(|reason| Error::unavailable("nccl", reason))?;
        let dev = cu::device::get(ordinal).map_err(|e| cuda_err("cuDeviceGet", e))?;
        // SAFETY: `dev` is a valid device handle; the context is released in Drop.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))?;
        let c = Cuda { dev, ctx, ordinal, lost: std::sync::OnceLock::new() };
        c.bind()?;
        Ok(Arc::new(c))
    }

    /// Make this device current on the calling thread (cheap; call before any CUDA or NCCL call).
    /// Every launch and every look at a `Work` binds, and the thread's context is usually
    /// ours already: asking (`cuCtxGetCurrent`, a read of the driver's thread state) costs
    /// less than setting it again (the benchmark's `--vs-raw` header prints both).
    ///
    /// # Errors
    /// `Backend` on a driver error.
    pub fn bind(&self) -> Result<()> {
        if self.current()? {
            return Ok(());
        }
        self.set_current()
    }

    /// Make this device current on the calling thread, asking nothing first.
    ///
    /// # Errors
    /// `Backend` on a driver error.
    pub(crate) fn set_current(&self) -> Result<()> {
        // SAFETY: `ctx` is retained for our lifetime.
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(|e| cuda_err("cuCtxSetCurrent", e))
    }

    /// The device handle.
    #[cfg(feature = "bench")]
    pub(crate) fn dev(&self) -> sys::CUdevice {
        self.dev
    }

    /// The device's nominal clock, kHz.
    ///
    /// # Errors
    /// `Backend` on a driver error.
    pub fn clock_khz(&self) -> Result<u32> {
        // SAFETY: `dev` is a valid device handle.
        let v = unsafe { cu::device::get_attribute(self.dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE) }
            .map_err(|e| cuda_err("cuDeviceGetAttribute", e))?;
        Ok(u32::try_from(v).unwrap_or(1_000_000).max(1))
    }

    /// Whether this device's context is the calling thread's current one.
    ///
    /// # Errors
    /// `Backend` on a driver error.
    pub fn current(&self) -> Result<bool> {
        let c = cu::ctx::get_current().map_err(|e| cuda_err("cuCtxGetCurrent", e))?;
        Ok(c == Some(self.ctx))
    }

    /// `r`'s error as anyccl's; a sticky one marks the context lost, and the error says
    /// plainly what that means.
    pub(crate) fn check<T>(&self, op: &str, r: std::result::Result<T, cudarc::driver::DriverError>) -> Result<T> {
        r.map_err(|e| {
            let err = cuda_err(op, e);
            if !sticky(&e) {
                return err;
            }
            let why = format!("{err}");
            if self.lost.set(why.clone()).is_ok() {
                tracing::error!("{}", self.lost_text(&why));
            }
            self.lost_error(op)
        })
    }

    fn lost_text(&self, why: &str) -> String {
        format!(
            "the CUDA context of {} is lost ({why}), typically after an NCCL abort while kernels ran: its device \
             memory is released only when the process exits, and the process must exit to use the device again",
            self.device()
        )
    }

    /// The error every call gets once the context is lost.
    pub(crate) fn lost_error(&self, op: &str) -> Error {
        let why = self.lost.get().cloned().unwrap_or_default();
        // No code: the driver's own error is in the text.
        Ctx::process("nccl").backend_error(op, -1, self.lost_text(&why), Recovery::Fatal)
    }

    /// `Err` once the context is lost.
    pub(crate) fn usable(&self, op: &str) -> Result<()> {
        match self.lost.get() {
            Some(_) => Err(self.lost_error(op)),
            None => Ok(()),
        }
    }

    /// The anyccl device.
    pub fn device(&self) -> Device {
        Device { kind: DeviceKind::Cuda, ordinal: self.ordinal }
    }
}

impl Drop for Cuda {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `new`.
        if let Err(e) = unsafe { cu::primary_ctx::release(self.dev) } {
            tracing::warn!("cuDevicePrimaryCtxRelease: {e:?}");
        }
    }
}

/// Events kept for reuse, so a launch does not pay for creating one.
#[derive(Debug, Default)]
struct EventPool(std::sync::Mutex<Vec<RawEvent>>);

#[derive(Debug)]
struct RawEvent(sys::CUevent);
// SAFETY: an event handle is usable from any thread with the context current.
unsafe impl Send for RawEvent {}

/// A non-blocking stream.
#[derive(Debug)]
pub struct Stream {
    pub(crate) raw: sys::CUstream,
    cuda: Arc<Cuda>,
    events: Arc<EventPool>,
}

// SAFETY: stream handles are usable from any thread with the context current.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new non-blocking stream on `cuda`.
    ///
    /// # Errors
    /// `Backend` on a driver error.
    pub fn new(cuda: &Arc<Cuda>) -> Result<Stream> {
        cuda.bind()?;
        let raw = cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| cuda_err("cuStreamCreate", e))?;
        Ok(Stream { raw, cuda: cuda.clone(), events: Arc::default() })
    }

    /// Whether everything enqueued on the stream so far has finished (`cuStreamQuery`). The
    /// stream's device must be current.
    ///
    /// # Errors
    /// `Backend` when the device reports an error.
    pub fn done(&self) -> Result<bool> {
        // SAFETY: `raw` is a live stream (destroyed only when this value is dropped).
        match unsafe { sys::cuStreamQuery(self.raw) }.result() {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => self.cuda.check("cuStreamQuery", Err(e)),
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.cuda.bind();
        let pooled: Vec<RawEvent> = self.events.0.lock().map(|mut v| v.drain(..).collect()).unwrap_or_default();
        for e in pooled {
            // SAFETY: pooled events are ours and no longer recorded anywhere.
            let _ = unsafe { cu::event::destroy(e.0) };
        }
        // SAFETY: `raw` was created by us and is destroyed once.
        if let Err(e) = unsafe { cu::stream::destroy(self.raw) } {
            tracing::warn!("cuStreamDestroy: {e:?}");
        }
    }
}

/// An event recorded on a stream, to poll completion. Returned to its stream's pool on drop.
#[derive(Debug)]
pub struct Event {
    raw: sys::CUevent,
    cuda: Arc<Cuda>,
    pool: std::sync::Weak<EventPool>,
}

// SAFETY: event handles are usable from any thread with the context current.
unsafe impl Send for Event {}
// SAFETY: `&Event` only allows querying, which CUDA permits concurrently.
unsafe impl Sync for Event {}

impl Event {
    /// Record a new event at the current end of `stream`. The stream's device must be
    /// current on the calling thread ([`Cuda::bind`]): launches bind once for all their calls.
    ///
    /// # Errors
    /// `Backend` on a driver error.
    pub fn record(stream: &Stream) -> Result<Event> {
        let pooled = stream.events.0.lock().ok().and_then(|mut v| v.pop());
        let raw = match pooled {
            Some(e) => e.0,
            None => cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| cuda_err("cuEventCreate", e))?,
        };
        let ev = Event { raw, cuda: stream.cuda.clone(), pool: Arc::downgrade(&stream.events) };
        // SAFETY: both handles are live.
        unsafe { cu::event::record(ev.raw, stream.raw) }.map_err(|e| cuda_err("cuEventRecord", e))?;
        Ok(ev)
    }

    /// An event at the current end of a stream that is not one of ours (`raw`, a live
    /// stream of `cuda`'s device, which must be current); destroyed on drop.
    #[cfg(feature = "bench")]
    pub(crate) fn record_raw(cuda: &Arc<Cuda>, raw: sys::CUstream) -> Result<Event> {
        let ev =
            cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| cuda_err("cuEventCreate", e))?;
        let ev = Event { raw: ev, cuda: cuda.clone(), pool: std::sync::Weak::new() };
        // SAFETY: both handles are live (the stream per the caller).
        unsafe { cu::event::record(ev.raw, raw) }.map_err(|e| cuda_err("cuEventRecord", e))?;
        Ok(ev)
    }

    /// Wait until the work before the event has finished, within `timeout`, calling `check`
    /// (a library's asynchronous error) between looks. The device must be current.
    ///
    /// # Errors
    /// `Timeout` in `ctx` naming `op` and `why` when it has not finished in time; `check`'s
    /// error; `Backend` when the device reports an error.
    #[cfg(feature = "bench")]
    pub(crate) fn wait(
        &self,
        timeout: std::time::Duration,
        ctx: &anyccl_core::Ctx,
        op: &str,
        why: &str,
        mut check: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        let deadline = anyccl_core::deadline_in(timeout);
        while !self.done()? {
            check()?;
            if std::time::Instant::now() >= deadline {
                return Err(ctx.timeout(op, timeout, why));
            }
            std::hint::spin_loop();
        }
        Ok(())
    }

    /// Whether the work before the event has finished. The device must be current on the
    /// calling thread ([`Cuda::bind`]), once before a polling loop rather than every spin.
    ///
    /// # Errors
    /// `Backend` when the device reports an error.
    pub fn done(&self) -> Result<bool> {
        // SAFETY: `raw` is a live event.
        match unsafe { cu::event::query(self.raw) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => self.cuda.check("cuEventQuery", Err(e)),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // Re-recording an event that is still pending is allowed; its next query reflects
        // the new record only. So a pending event may go back to the pool.
        if let Some(pool) = self.pool.upgrade() {
            if let Ok(mut v) = pool.0.lock() {
                if v.len() < 64 {
                    v.push(RawEvent(self.raw));
                    return;
                }
            }
        }
        let _ = self.cuda.bind();
        // SAFETY: created by us, destroyed once (not pooled).
        let _ = unsafe { cu::event::destroy(self.raw) };
    }
}

/// Why the `bytes` bytes at `ptr` cannot be an NCCL window: they are not one cuMem (VMM)
/// allocation, such as `ncclMemAlloc` gives, or run past its end. The context is current.
pub(crate) fn window_refusal(ptr: *mut std::ffi::c_void, bytes: usize) -> Option<String> {
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: a valid out-parameter; the driver only looks the address up.
    let r = unsafe { sys::cuMemRetainAllocationHandle(&mut h, ptr) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Some(format!(
            "{bytes} bytes at {ptr:p} are not cuMem memory ({r:?}): a window needs memory from \
             Platform::alloc_registrable (ncclMemAlloc)"
        ));
    }
    // SAFETY: releasing the reference just retained, once.
    unsafe { sys::cuMemRelease(h) };
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-parameters.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr as sys::CUdeviceptr) };
    let end = ptr as u64 + bytes as u64;
    (r != sys::CUresult::CUDA_SUCCESS || end > base + size as u64)
        .then(|| format!("{bytes} bytes at {ptr:p} run past their allocation ({size} bytes at {base:#x}; {r:?})"))
}

/// Zero `bytes` bytes at `p` and wait until they are: `cuMemsetD8` runs on the legacy
/// default stream, asynchronously to the host, so without the wait an operation on a
/// non-blocking stream (every communicator's) could run before it, and an `ncclMemFree`
/// (which unmaps without synchronizing, unlike `cuMemFree`) of memory dropped at once faulted
/// the context ("unspecified launch failure", seen on an H200 when a refused window's
/// memory was freed right after its allocation).
///
/// # Safety
/// `p` addresses `bytes` bytes of the current context's device.
unsafe fn zero(p: sys::CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: per the caller.
    unsafe { cu::memset_d8_sync(p, 0, bytes) }.map_err(|e| cuda_err("cuMemsetD8", e))?;
    // SAFETY: the legacy default stream of the current context.
    unsafe { cu::stream::synchronize(std::ptr::null_mut()) }.map_err(|e| cuda_err("cuStreamSynchronize", e))
}

/// Device memory on a CUDA device, freed on drop (by `ncclMemFree` where `ncclMemAlloc`
/// made it).
pub type CudaMemory = DeviceBuffer<CudaFree>;

/// How a [`CudaMemory`] is freed: `cuMemFree`, or `ncclMemFree` for memory from
/// `ncclMemAlloc`; nothing once the context is lost (its memory goes with the process).
#[derive(Debug)]
pub struct CudaFree {
    cuda: Arc<Cuda>,
    /// Allocated by `ncclMemAlloc` (freed by `ncclMemFree`), not `cuMemAlloc`.
    nccl: Option<&'static crate::sys::NcclLib>,
}

impl Free for CudaFree {
    fn free(&mut self, ptr: *mut std::ffi::c_void, _bytes: usize) {
        // A lost context's memory goes with the process (said once, when it was lost).
        if self.cuda.usable("cuMemFree").is_err() {
            return;
        }
        let _ = self.cuda.bind();
        if let Some(lib) = self.nccl {
            // SAFETY: allocated by ncclMemAlloc in `nccl_zeroed`, freed once.
            if let Err(e) = unsafe { crate::result::mem_free(lib, ptr) } {
                tracing::warn!("{e}");
            }
            return;
        }
        // SAFETY: allocated by cuMemAlloc in `zeroed`, freed once.
        let r = unsafe { cu::free_sync(ptr as sys::CUdeviceptr) };
        if let Err(e) = self.cuda.check("cuMemFree", r) {
            if self.cuda.usable("cuMemFree").is_ok() {
                tracing::warn!("{e}");
            }
        }
    }
}

/// `count` zeroed elements of `dtype` on `cuda`.
///
/// # Errors
/// `Backend` (e.g. out of memory).
pub fn zeroed(cuda: &Arc<Cuda>, dtype: DType, count: usize) -> Result<CudaMemory> {
    cuda.bind()?;
    let bytes = count * dtype.size();
    let ptr = if bytes == 0 {
        0
    } else {
        // SAFETY: a plain allocation of `bytes` bytes, freed by CudaFree.
        let p = unsafe { cu::malloc_sync(bytes) }.map_err(|e| cuda_err("cuMemAlloc", e))?;
        // SAFETY: `p` points to `bytes` bytes just allocated.
        if let Err(e) = unsafe { zero(p, bytes) } {
            // SAFETY: allocated above, freed once.
            let _ = unsafe { cu::free_sync(p) };
            return Err(e);
        }
        p
    };
    let free = CudaFree { cuda: cuda.clone(), nccl: None };
    // SAFETY: `ptr` holds `count` elements on this device (or is null), freed by cuMemFree.
    Ok(unsafe { CudaMemory::from_raw(ptr as *mut std::ffi::c_void, dtype, count, cuda.device(), free) })
}

/// `count` zeroed elements of `dtype` on `cuda` from `ncclMemAlloc` (memory NCCL's
/// zero-copy paths can map once registered); `None` where the loaded NCCL lacks it.
///
/// # Errors
/// `Backend` (e.g. out of memory), the library's error as its source.
pub fn nccl_zeroed(cuda: &Arc<Cuda>, dtype: DType, count: usize) -> Result<Option<CudaMemory>> {
    let Ok(lib) = crate::sys::lib() else { return Ok(None) };
    let bytes = count * dtype.size();
    if bytes == 0 || lib.MemAlloc.is_none() || lib.MemFree.is_none() {
        return Ok(None);
    }
    cuda.bind()?;
    let p = match crate::result::mem_alloc(lib, bytes) {
        Ok(Some(p)) => p,
        Ok(None) => return Ok(None),
        Err(e) => {
            let recovery = match e.kind {
                anyccl_device::ErrorKind::OutOfMemory => Recovery::Retry,
                _ => Recovery::Fatal,
            };
            let op = format!("ncclMemAlloc of {bytes} bytes on {}", cuda.device());
            return Err(Ctx::process("nccl").backend_error(&op, e.code, e.to_string(), recovery).with_source(e));
        }
    };
    // Owned from here: an error below frees it on drop.
    let free = CudaFree { cuda: cuda.clone(), nccl: Some(lib) };
    // SAFETY: `p` holds `count` elements on this device, from ncclMemAlloc, freed by ncclMemFree.
    let mem = unsafe { CudaMemory::from_raw(p, dtype, count, cuda.device(), free) };
    // SAFETY: `p` points to `bytes` bytes just allocated on the current device.
    unsafe { zero(p as sys::CUdeviceptr, bytes) }?;
    Ok(Some(mem))
}

/// Make `waiter` wait on the device for the work enqueued on `first` so far: an event
/// recorded on `first`, waited for on `waiter`, then destroyed (CUDA frees it once the
/// wait is done). The device is current.
///
/// # Safety
/// Both streams are live streams of this device.
unsafe fn order(cuda: &Cuda, first: sys::CUstream, waiter: sys::CUstream) -> Result<()> {
    let ev = cuda.check("cuEventCreate", cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
    // SAFETY: `ev` was just created; the streams are live per the caller.
    let r = unsafe { cu::event::record(ev, first) }
        .and_then(|()| unsafe { cu::stream::wait_event(waiter, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) });
    // SAFETY: created above, destroyed once; a pending wait keeps what it needs.
    let _ = unsafe { cu::event::destroy(ev) };
    cuda.check("cuStreamWaitEvent", r)
}

/// The CUDA device layer of one rank.
pub type CudaPlatform = anyccl_device::DevicePlatform<Cuda>;

impl anyccl_device::Runtime for Cuda {
    type Stream = Stream;
    type Event = Event;
    type Memory = CudaMemory;

    fn device(&self) -> Device {
        Cuda::device(self)
    }
    fn bind(&self) -> Result<()> {
        Cuda::bind(self)
    }
    fn usable(&self, op: &str) -> Result<()> {
        Cuda::usable(self, op)
    }
    fn stream(self: &Arc<Self>) -> Result<Stream> {
        Stream::new(self)
    }
    fn record(&self, stream: &Stream) -> Result<Event> {
        Event::record(stream)
    }
    fn record_again(&self, event: &Event, stream: &Stream) -> Result<()> {
        // SAFETY: both handles are live (the event owns its handle until it is dropped).
        unsafe { cu::event::record(event.raw, stream.raw) }.map_err(|e| cuda_err("cuEventRecord", e))
    }
    fn done(&self, event: &Event) -> Result<bool> {
        event.done()
    }
    fn stream_done(&self, stream: &Stream) -> Result<Option<bool>> {
        stream.done().map(Some)
    }
    fn alloc(self: &Arc<Self>, dtype: DType, count: usize) -> Result<CudaMemory> {
        zeroed(self, dtype, count)
    }
    fn alloc_registrable(self: &Arc<Self>, dtype: DType, count: usize) -> Result<CudaMemory> {
        match nccl_zeroed(self, dtype, count)? {
            Some(m) => Ok(m),
            None => zeroed(self, dtype, count),
        }
    }
    unsafe fn copy_to_device(&self, dst: *mut u8, src: &[u8]) -> Result<()> {
        // SAFETY: per the caller, `dst` addresses `src.len()` bytes of this device.
        self.check("cuMemcpyHtoD", unsafe { cu::memcpy_htod_sync(dst as sys::CUdeviceptr, src) })
    }
    unsafe fn copy_to_host(&self, dst: &mut [u8], src: *const u8) -> Result<()> {
        // SAFETY: per the caller, `src` addresses `dst.len()` bytes of this device.
        self.check("cuMemcpyDtoH", unsafe { cu::memcpy_dtoh_sync(dst, src as sys::CUdeviceptr) })
    }
    fn synchronize(&self) -> Result<()> {
        self.check("cuCtxSynchronize", cu::ctx::synchronize())
    }
    unsafe fn wait_raw(&self, stream: &Stream, raw: *mut std::ffi::c_void) -> Result<()> {
        // SAFETY: per the caller, `raw` is a live stream of this device; ours is live.
        unsafe { order(self, raw as sys::CUstream, stream.raw) }
    }
    unsafe fn capturing(&self, raw: *mut std::ffi::c_void) -> Result<bool> {
        // SAFETY: per the caller, `raw` is a live stream of this device.
        let st = self.check("cuStreamIsCapturing", unsafe { cu::stream::is_capturing(raw as sys::CUstream) })?;
        Ok(st == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE)
    }
    unsafe fn signal_raw(&self, stream: &Stream, raw: *mut std::ffi::c_void) -> Result<()> {
        // SAFETY: as above.
        unsafe { order(self, stream.raw, raw as sys::CUstream) }
    }
    fn mem_info(&self) -> Result<MemInfo> {
        let (free, total) = self.check("cuMemGetInfo", cu::mem_get_info())?;
        Ok(MemInfo { free: free as u64, total: total as u64 })
    }
}
