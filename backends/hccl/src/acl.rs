//! The Ascend device runtime (ACL) as an [`anyccl_device::Runtime`]: the device of the
//! calling thread, streams, events, device memory and `aclrtGetMemInfo`, so the warmup's
//! memory report works on Ascend.

use crate::result::{acl_check, event_done, record_event};
use crate::sys::{self, aclrtEvent, aclrtStream, AclLib};
use anyccl_core::{DType, Device, DeviceKind, Error, MemInfo, Result};
use anyccl_device::{DeviceBuffer, Free};
use std::cell::Cell;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

/// Whether ACL loads and initialises, and how many devices it sees.
///
/// # Errors
/// What is missing, and where it was looked for.
pub fn probe() -> std::result::Result<(&'static AclLib, usize), String> {
    static PROBE: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    let acl = sys::acl()?;
    let n = PROBE
        .get_or_init(|| {
            // SAFETY: a null config path is allowed; aclInit runs once per process.
            let code = unsafe { (acl.Init)(std::ptr::null()) };
            if code != sys::SUCCESS && code != sys::ACL_ERROR_REPEAT_INITIALIZE {
                return Err(format!("aclInit failed with {code} ({})", acl.path));
            }
            let mut n = 0u32;
            // SAFETY: valid out-parameter.
            let code = unsafe { (acl.GetDeviceCount)(&mut n) };
            match (code, n) {
                (sys::SUCCESS, 0) => Err("no Ascend device".into()),
                (sys::SUCCESS, n) => Ok(n as usize),
                (c, _) => Err(format!("aclrtGetDeviceCount failed with {c}")),
            }
        })
        .clone()?;
    Ok((acl, n))
}

thread_local! {
    /// The device this thread last set (ACL's current device is per thread).
    static BOUND: Cell<i32> = const { Cell::new(-1) };
}

/// One Ascend device.
#[derive(Debug)]
pub struct Acl {
    lib: &'static AclLib,
    ordinal: i32,
    /// Events a stream was made to wait for, each with a marker recorded on the waiting
    /// stream after the wait: ACL before CANN 8 lets an event go only once the wait on it
    /// has run, so they are destroyed when their marker is done.
    waits: Mutex<Vec<(AclEvent, AclEvent)>>,
    /// Events of `wait_stream`/`signal_stream` orderings recorded into a graph capture by
    /// the program (a captured operation itself uses none): a replay of the graph may use
    /// them, so they live as long as this runtime.
    captured: Mutex<Vec<AclEvent>>,
}

impl Acl {
    /// Device `ordinal`, made current on the calling thread.
    ///
    /// # Errors
    /// `Unavailable` without ACL; `Backend` on an ACL error.
    pub fn new(ordinal: i32) -> Result<Arc<Acl>> {
        let (lib, _) = probe().map_err(|reason| Error::unavailable("hccl", reason))?;
        let a = Arc::new(Acl { lib, ordinal, waits: Mutex::new(Vec::new()), captured: Mutex::new(Vec::new()) });
        anyccl_device::Runtime::bind(&*a)?;
        Ok(a)
    }
    /// The loaded ACL.
    pub fn lib(&self) -> &'static AclLib {
        self.lib
    }
}

/// A stream, destroyed on drop when it is ours (an engine's stream lent for a capture is
/// not).
#[derive(Debug)]
pub struct AclStream {
    pub(crate) raw: aclrtStream,
    acl: Arc<Acl>,
    owned: bool,
}
// SAFETY: ACL streams may be used from any thread with their device set.
unsafe impl Send for AclStream {}
// SAFETY: as above; calls on one stream are serialised by the device layer.
unsafe impl Sync for AclStream {}

impl Drop for AclStream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let _ = anyccl_device::Runtime::bind(&*self.acl);
        // SAFETY: created by us, destroyed once; ACL waits for its queued work.
        let code = unsafe { (self.acl.lib.DestroyStream)(self.raw) };
        if code != sys::SUCCESS {
            tracing::warn!("aclrtDestroyStream: {code}");
        }
    }
}

/// An event, destroyed on drop.
#[derive(Debug)]
pub struct AclEvent {
    raw: aclrtEvent,
    lib: &'static AclLib,
}
// SAFETY: ACL events may be queried from any thread.
unsafe impl Send for AclEvent {}
// SAFETY: `&AclEvent` only queries.
unsafe impl Sync for AclEvent {}

impl Drop for AclEvent {
    fn drop(&mut self) {
        // SAFETY: created by us, destroyed once.
        unsafe { (self.lib.DestroyEvent)(self.raw) };
    }
}

/// Device memory on an Ascend NPU, freed by `aclrtFree` on drop.
pub type AclMemory = DeviceBuffer<AclFree>;

/// How an [`AclMemory`] is freed: `aclrtFree` on its device.
#[derive(Debug)]
pub struct AclFree {
    acl: Arc<Acl>,
}

impl Free for AclFree {
    fn free(&mut self, ptr: *mut c_void, _bytes: usize) {
        let _ = anyccl_device::Runtime::bind(&*self.acl);
        // SAFETY: allocated by aclrtMalloc in `alloc`, freed once.
        let code = unsafe { (self.acl.lib.Free)(ptr) };
        if code != sys::SUCCESS {
            tracing::warn!("aclrtFree: {code}");
        }
    }
}

impl Acl {
    /// `waiter` runs its later work after the work on `first` so far, neither host thread
    /// waiting: an event recorded on `first`, waited for on `waiter`.
    ///
    /// # Safety
    /// Both are live streams of this device.
    unsafe fn order(&self, first: aclrtStream, waiter: aclrtStream) -> Result<()> {
        let Some(wait) = self.lib.StreamWaitEvent else {
            let what = "events between streams (this ACL has no aclrtStreamWaitEvent)";
            return Err(anyccl_core::Ctx::process("hccl").unsupported("wait_stream", what));
        };
        anyccl_device::Runtime::bind(self)?;
        // SAFETY: per the caller.
        let ev = AclEvent { raw: unsafe { record_event(self.lib, first) }?, lib: self.lib };
        // SAFETY: both handles live.
        acl_check(self.lib, "aclrtStreamWaitEvent", unsafe { wait(waiter, ev.raw) })?;
        // SAFETY: per the caller.
        match unsafe { self.capture_status(waiter) } {
            Ok(0) => {}
            status => {
                // Recorded into a graph (or not known not to be): no run to mark, and a
                // replay may use the event, which therefore lives as long as this runtime.
                self.captured.lock().unwrap_or_else(|p| p.into_inner()).push(ev);
                return status.map(|_| ());
            }
        }
        // SAFETY: per the caller.
        let marker = match unsafe { record_event(self.lib, waiter) } {
            Ok(raw) => AclEvent { raw, lib: self.lib },
            Err(e) => {
                // No marker to tell when the wait has run: the event is kept for the life of
                // the process rather than destroyed under a pending wait.
                std::mem::forget(ev);
                return Err(e);
            }
        };
        let mut waits = self.waits.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: markers are live events of ours.
        waits.retain(|(_, m)| !unsafe { event_done(self.lib, m.raw) }.unwrap_or(false));
        waits.push((ev, marker));
        Ok(())
    }
}

impl Acl {
    /// `aclmdlRICaptureGetInfo`'s status of `stream`: 0 none, 1 capturing, 2 invalidated
    /// (0 where ACL has no graph capture).
    ///
    /// # Safety
    /// `stream` is a live stream of this device.
    unsafe fn capture_status(&self, stream: aclrtStream) -> Result<i32> {
        let Some(info) = self.lib.CaptureGetInfo else { return Ok(0) };
        let (mut status, mut model) = (0, std::ptr::null_mut());
        // SAFETY: per the caller; valid out-parameters.
        acl_check(self.lib, "aclmdlRICaptureGetInfo", unsafe { info(stream, &mut status, &mut model) })?;
        Ok(status)
    }
}

impl anyccl_device::Runtime for Acl {
    type Stream = AclStream;
    type Event = AclEvent;
    type Memory = AclMemory;

    fn device(&self) -> Device {
        Device { kind: DeviceKind::Npu, ordinal: self.ordinal }
    }
    fn bind(&self) -> Result<()> {
        if BOUND.with(|b| b.get()) == self.ordinal {
            return Ok(());
        }
        // SAFETY: plain call; the ordinal was checked against the device count.
        acl_check(self.lib, "aclrtSetDevice", unsafe { (self.lib.SetDevice)(self.ordinal) })?;
        BOUND.with(|b| b.set(self.ordinal));
        Ok(())
    }
    fn stream(self: &Arc<Self>) -> Result<AclStream> {
        self.bind()?;
        let mut raw: aclrtStream = std::ptr::null_mut();
        // SAFETY: valid out-parameter; the device is set.
        acl_check(self.lib, "aclrtCreateStream", unsafe { (self.lib.CreateStream)(&mut raw) })?;
        Ok(AclStream { raw, acl: self.clone(), owned: true })
    }
    fn record(&self, stream: &AclStream) -> Result<AclEvent> {
        // SAFETY: the stream is live.
        let raw = unsafe { record_event(self.lib, stream.raw) }?;
        Ok(AclEvent { raw, lib: self.lib })
    }
    fn record_again(&self, event: &AclEvent, stream: &AclStream) -> Result<()> {
        // SAFETY: both handles are live.
        acl_check(self.lib, "aclrtRecordEvent", unsafe { (self.lib.RecordEvent)(event.raw, stream.raw) })
    }
    fn done(&self, event: &AclEvent) -> Result<bool> {
        // SAFETY: the event is live.
        unsafe { event_done(self.lib, event.raw) }
    }
    fn stream_done(&self, stream: &AclStream) -> Result<Option<bool>> {
        // SAFETY: the stream is live.
        unsafe { crate::result::stream_done(self.lib, stream.raw) }
    }
    fn alloc(self: &Arc<Self>, dtype: DType, count: usize) -> Result<AclMemory> {
        self.bind()?;
        let bytes = count * dtype.size();
        let mut ptr: *mut c_void = std::ptr::null_mut();
        if bytes > 0 {
            // SAFETY: valid out-parameter; the device is set.
            let code = unsafe { (self.lib.Malloc)(&mut ptr, bytes, sys::ACL_MEM_MALLOC_HUGE_FIRST) };
            acl_check(self.lib, "aclrtMalloc", code)?;
            // SAFETY: `ptr` holds `bytes` bytes just allocated.
            let code = unsafe { (self.lib.Memset)(ptr, bytes, 0, bytes) };
            if let Err(e) = acl_check(self.lib, "aclrtMemset", code) {
                // SAFETY: allocated above, freed once.
                unsafe { (self.lib.Free)(ptr) };
                return Err(e);
            }
        }
        let free = AclFree { acl: self.clone() };
        // SAFETY: `ptr` holds `count` elements of this device (or is null), from aclrtMalloc.
        Ok(unsafe { AclMemory::from_raw(ptr, dtype, count, anyccl_device::Runtime::device(&**self), free) })
    }
    unsafe fn copy_to_device(&self, dst: *mut u8, src: &[u8]) -> Result<()> {
        let n = src.len();
        // SAFETY: per the caller, `dst` addresses `n` bytes of this device.
        let code = unsafe {
            (self.lib.Memcpy)(dst as *mut c_void, n, src.as_ptr() as *const c_void, n, sys::ACL_MEMCPY_HOST_TO_DEVICE)
        };
        acl_check(self.lib, "aclrtMemcpy", code)
    }
    unsafe fn copy_to_host(&self, dst: &mut [u8], src: *const u8) -> Result<()> {
        let n = dst.len();
        // SAFETY: per the caller, `src` addresses `n` bytes of this device.
        let code = unsafe {
            (self.lib.Memcpy)(
                dst.as_mut_ptr() as *mut c_void,
                n,
                src as *const c_void,
                n,
                sys::ACL_MEMCPY_DEVICE_TO_HOST,
            )
        };
        acl_check(self.lib, "aclrtMemcpy", code)
    }
    unsafe fn wait_raw(&self, stream: &AclStream, raw: *mut c_void) -> Result<()> {
        // SAFETY: per the caller, `raw` is a live stream of this device; ours is live.
        unsafe { self.order(raw, stream.raw) }
    }
    unsafe fn signal_raw(&self, stream: &AclStream, raw: *mut c_void) -> Result<()> {
        // SAFETY: as in `wait_raw`.
        unsafe { self.order(stream.raw, raw) }
    }
    unsafe fn capturing(&self, raw: *mut c_void) -> Result<bool> {
        self.bind()?;
        // SAFETY: per the caller.
        // An invalidated capture (2) records nothing more: as good as none.
        Ok(unsafe { self.capture_status(raw) }? == 1)
    }
    unsafe fn borrow_raw(self: &Arc<Self>, raw: *mut c_void) -> Option<AclStream> {
        // HCCL puts a collective issued on a capturing stream into that capture (its
        // internal streams included), as its capture sample does: no events between
        // streams, which the graph would need alive for as long as it may replay.
        Some(AclStream { raw, acl: self.clone(), owned: false })
    }
    fn synchronize(&self) -> Result<()> {
        match self.lib.SynchronizeDevice {
            // SAFETY: no arguments; the device is set.
            Some(f) => acl_check(self.lib, "aclrtSynchronizeDevice", unsafe { f() }),
            // Every copy of the platform is synchronous and every operation is waited on
            // through its event: nothing else can be pending.
            None => Ok(()),
        }
    }
    fn mem_info(&self) -> Result<MemInfo> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-parameters; the device is set.
        let code = unsafe { (self.lib.GetMemInfo)(sys::ACL_HBM_MEM, &mut free, &mut total) };
        acl_check(self.lib, "aclrtGetMemInfo", code)?;
        Ok(MemInfo { free: free as u64, total: total as u64 })
    }
}

/// The Ascend device layer of one rank.
pub type AclPlatform = anyccl_device::DevicePlatform<Acl>;
