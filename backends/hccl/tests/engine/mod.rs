//! The conformance suite's engine stream on ACL: a stream of the engine's own
//! (`aclrtCreateStream`) in the library the backend loaded, written by device-to-device
//! copies from staged buffers (an engine's kernel writing a buffer), held by the stand-in's
//! `anyccl_standin_stream_sleep` (an engine's long kernel), and captured into ACL graphs
//! (`aclmdlRICaptureBegin` to `aclmdlRIExecuteAsync`).

use anyccl_conformance::cases::streams::Engine;
use anyccl_conformance::CaseError;
use anyccl_core::{DType, DeviceMemory, Platform, StreamRef};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

type Code = i32;
const ACL_MEMCPY_DEVICE_TO_DEVICE: i32 = 3;
/// `aclmdlRICaptureBegin`'s thread-local mode.
const CAPTURE_THREAD_LOCAL: i32 = 1;

/// The ACL calls an engine makes on its own stream.
struct Acl {
    set_device: unsafe extern "C" fn(i32) -> Code,
    create: unsafe extern "C" fn(*mut *mut c_void) -> Code,
    destroy: unsafe extern "C" fn(*mut c_void) -> Code,
    sync: unsafe extern "C" fn(*mut c_void, i32) -> Code,
    copy: unsafe extern "C" fn(*mut c_void, usize, *const c_void, usize, i32, *mut c_void) -> Code,
    sleep: Option<unsafe extern "C" fn(*mut c_void, u32) -> Code>,
    begin: unsafe extern "C" fn(*mut c_void, i32) -> Code,
    end: unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> Code,
    execute: unsafe extern "C" fn(*mut c_void, *mut c_void) -> Code,
    destroy_model: unsafe extern "C" fn(*mut c_void) -> Code,
    /// Keeps the entry points above loaded.
    _lib: libloading::Library,
}

impl Acl {
    /// `libascendcl.so` from `ANYCCL_HCCL_LIBRARY_DIR` (where the backend loads it), else
    /// by its name from the loader's path.
    fn load() -> Result<Acl, CaseError> {
        let path = match std::env::var_os("ANYCCL_HCCL_LIBRARY_DIR") {
            Some(dir) => std::path::PathBuf::from(dir).join("libascendcl.so"),
            None => "libascendcl.so".into(),
        };
        let fail = |what: &str, e: libloading::Error| CaseError(format!("{what} in {}: {e}", path.display()));
        // SAFETY: the ACL library the backend loaded (the same object): its initialisers ran.
        let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| fail("loading", e))?;
        // SAFETY: each symbol is ACL's entry point with the C signature it is given here.
        unsafe {
            let sym = |name: &str| fail(name, libloading::Error::DlSymUnknown);
            Ok(Acl {
                set_device: *lib.get(b"aclrtSetDevice").map_err(|_| sym("aclrtSetDevice"))?,
                create: *lib.get(b"aclrtCreateStream").map_err(|_| sym("aclrtCreateStream"))?,
                destroy: *lib.get(b"aclrtDestroyStream").map_err(|_| sym("aclrtDestroyStream"))?,
                sync: *lib
                    .get(b"aclrtSynchronizeStreamWithTimeout")
                    .map_err(|_| sym("aclrtSynchronizeStreamWithTimeout"))?,
                copy: *lib.get(b"aclrtMemcpyAsync").map_err(|_| sym("aclrtMemcpyAsync"))?,
                sleep: lib.get(b"anyccl_standin_stream_sleep").ok().map(|s| *s),
                begin: *lib.get(b"aclmdlRICaptureBegin").map_err(|_| sym("aclmdlRICaptureBegin"))?,
                end: *lib.get(b"aclmdlRICaptureEnd").map_err(|_| sym("aclmdlRICaptureEnd"))?,
                execute: *lib.get(b"aclmdlRIExecuteAsync").map_err(|_| sym("aclmdlRIExecuteAsync"))?,
                destroy_model: *lib.get(b"aclmdlRIDestroy").map_err(|_| sym("aclmdlRIDestroy"))?,
                _lib: lib,
            })
        }
    }
}

fn ok(what: &str, code: Code) -> Result<(), CaseError> {
    if code == 0 {
        Ok(())
    } else {
        Err(CaseError(format!("{what}: ACL error {code}")))
    }
}

/// An engine stream on `platform`'s device.
pub fn open(platform: &Arc<dyn Platform>) -> Result<Box<dyn Engine>, CaseError> {
    let acl = Acl::load()?;
    let mut raw: *mut c_void = std::ptr::null_mut();
    // SAFETY: plain calls with a valid out-parameter.
    unsafe {
        ok("aclrtSetDevice", (acl.set_device)(platform.device().ordinal))?;
        ok("aclrtCreateStream", (acl.create)(&mut raw))?;
    }
    Ok(Box::new(AclEngine { acl, raw, platform: platform.clone(), models: Vec::new(), held: Vec::new() }))
}

struct AclEngine {
    acl: Acl,
    raw: *mut c_void,
    platform: Arc<dyn Platform>,
    models: Vec<*mut c_void>,
    /// Every buffer the stream's copies read or write (the destinations and the staged
    /// sources), kept until the stream is done with them (Drop).
    held: Vec<Arc<dyn DeviceMemory>>,
}

impl AclEngine {
    fn wait(&self, timeout: Duration) -> Result<(), CaseError> {
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: our live stream.
        ok("aclrtSynchronizeStreamWithTimeout", unsafe { (self.acl.sync)(self.raw, ms) })
    }
}

impl Engine for AclEngine {
    fn stream(&self) -> StreamRef<'_> {
        // SAFETY: the stream lives as long as `self`, which the reference borrows.
        unsafe { StreamRef::from_raw(self.platform.device(), self.raw) }
    }
    fn delay(&mut self, d: Duration) -> Result<(), CaseError> {
        let sleep = self.acl.sleep.ok_or("this ACL has no anyccl_standin_stream_sleep to hold a stream with")?;
        let ms = u32::try_from(d.as_millis()).unwrap_or(u32::MAX);
        // SAFETY: our live stream.
        ok("anyccl_standin_stream_sleep", unsafe { sleep(self.raw, ms) })
    }
    fn fill_f32(&mut self, dst: &Arc<dyn DeviceMemory>, value: f32) -> Result<(), CaseError> {
        if dst.dtype() != DType::F32 {
            return Err(CaseError(format!("fill_f32 on a buffer of {}", dst.dtype())));
        }
        // Staged on the device first: a capture may not copy from pageable host memory.
        let mut staged = self.platform.alloc(DType::F32, dst.count())?;
        self.platform.copy_from_host(staged.as_mut(), &value.to_le_bytes().repeat(dst.count()))?;
        let staged: Arc<dyn DeviceMemory> = Arc::from(staged);
        let bytes = dst.count() * 4;
        let (to, from) = (dst.view().ptr() as *mut c_void, staged.view().ptr() as *const c_void);
        // SAFETY: both address `bytes` bytes of this device, kept in `held` until the stream
        // is done (Drop waits for it).
        let code = unsafe { (self.acl.copy)(to, bytes, from, bytes, ACL_MEMCPY_DEVICE_TO_DEVICE, self.raw) };
        self.held.extend([dst.clone(), staged]);
        ok("aclrtMemcpyAsync", code)
    }
    fn begin_capture(&mut self) -> Result<(), CaseError> {
        // SAFETY: our live stream.
        ok("aclmdlRICaptureBegin", unsafe { (self.acl.begin)(self.raw, CAPTURE_THREAD_LOCAL) })
    }
    fn end_capture(&mut self) -> Result<usize, CaseError> {
        let mut model: *mut c_void = std::ptr::null_mut();
        // SAFETY: our live stream; a valid out-parameter.
        ok("aclmdlRICaptureEnd", unsafe { (self.acl.end)(self.raw, &mut model) })?;
        self.models.push(model);
        Ok(self.models.len() - 1)
    }
    fn replay(&mut self, graph: usize) -> Result<(), CaseError> {
        let model = *self.models.get(graph).ok_or_else(|| CaseError(format!("no graph {graph}")))?;
        // SAFETY: a live model (destroyed in Drop only) and our live stream.
        ok("aclmdlRIExecuteAsync", unsafe { (self.acl.execute)(model, self.raw) })
    }
    fn synchronize(&mut self, timeout: Duration) -> Result<(), CaseError> {
        self.wait(timeout)
    }
}

impl Drop for AclEngine {
    fn drop(&mut self) {
        if let Err(e) = self.wait(Duration::from_secs(30)) {
            // The copies may still write the buffers: leave them allocated.
            eprintln!("engine stream: {}; its buffers are leaked", e.0);
            std::mem::forget(std::mem::take(&mut self.held));
        }
        // SAFETY: each created here and destroyed once, after the stream's work (replays
        // already issued keep what they run); the stream last, waiting for what is queued.
        unsafe {
            for m in self.models.drain(..) {
                let _ = (self.acl.destroy_model)(m);
            }
            let _ = (self.acl.destroy)(self.raw);
        }
    }
}
