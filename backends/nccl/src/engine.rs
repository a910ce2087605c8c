//! An engine's side of a CUDA device, for the examples, the benchmark and the tests: a
//! stream of its own, and two small kernels loaded from PTX through the driver (no CUDA
//! toolkit needed): one keeps one SM busy for a given time (the stand-in for an engine's
//! compute), one fills `f32` memory (an engine's kernel writing a buffer).

use crate::cuda::{Cuda, Event};
use crate::result::cuda as cuda_err;
use anyccl_core::{Ctx, Device, DeviceKind, Error, Result, StreamRef};
use cudarc::driver::{result as cu, sys};
use std::ffi::{c_void, CString};
use std::sync::Arc;
use std::time::Duration;

/// The kernels, PTX ISA 7.0 for sm_70 and newer (the driver compiles it for the device).
const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry anyccl_spin(.param .u64 cycles)
{
    .reg .pred %p;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [cycles];
    mov.u64 %rd2, %clock64;
SPIN:
    mov.u64 %rd3, %clock64;
    sub.s64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p, %rd4, %rd1;
    @%p bra SPIN;
    ret;
}

.visible .entry anyccl_fill(.param .u64 ptr, .param .u64 n, .param .f32 v)
{
    .reg .pred %p;
    .reg .b32 %r<6>;
    .reg .b64 %rd<8>;
    .reg .f32 %f1;
    ld.param.u64 %rd1, [ptr];
    ld.param.u64 %rd2, [n];
    ld.param.f32 %f1, [v];
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mad.lo.u32 %r4, %r1, %r2, %r3;
    cvt.u64.u32 %rd3, %r4;
    mov.u32 %r5, %nctaid.x;
    mul.lo.u32 %r5, %r5, %r2;
    cvt.u64.u32 %rd6, %r5;
FILL:
    setp.ge.u64 %p, %rd3, %rd2;
    @%p bra DONE;
    shl.b64 %rd4, %rd3, 2;
    add.s64 %rd5, %rd1, %rd4;
    st.global.f32 [%rd5], %f1;
    add.s64 %rd3, %rd3, %rd6;
    bra FILL;
DONE:
    ret;
}
"#;

/// A stream of the engine's own on one device, with the two kernels.
#[derive(Debug)]
pub struct EngineStream {
    cuda: Arc<Cuda>,
    raw: sys::CUstream,
    module: sys::CUmodule,
    spin: sys::CUfunction,
    fill: sys::CUfunction,
    /// Clock cycles per microsecond (the device's nominal clock).
    cycles_per_us: f64,
}

// SAFETY: the handles are usable from any thread with the context current (every method
// binds first).
unsafe impl Send for EngineStream {}
// SAFETY: as above; launches on one stream from several threads are ordered by CUDA.
unsafe impl Sync for EngineStream {}

impl EngineStream {
    /// A new non-blocking stream on CUDA device `device`, with the kernels loaded.
    ///
    /// # Errors
    /// `Unavailable` without a driver, `InvalidArgument` for a device that is not CUDA's,
    /// `Backend` on a driver error (e.g. a driver too old for the PTX).
    pub fn new(device: Device) -> Result<EngineStream> {
        if device.kind != DeviceKind::Cuda {
            let msg = format!("an engine stream needs a CUDA device, got {device}");
            return Err(Ctx::process("nccl").invalid("EngineStream::new", "device", msg));
        }
        let cuda = Cuda::new(device.ordinal)?;
        cuda.bind()?;
        let ptx = CString::new(PTX).map_err(|e| cuda_err_text("PTX", e.to_string()))?;
        // SAFETY: a NUL-terminated PTX image; the module is unloaded in Drop.
        let module = unsafe { cu::module::load_data(ptx.as_ptr() as *const c_void) }
            .map_err(|e| cuda_err("cuModuleLoadData", e))?;
        let func = |name: &str| -> Result<sys::CUfunction> {
            let n = CString::new(name).map_err(|e| cuda_err_text("kernel name", e.to_string()))?;
            // SAFETY: `module` was just loaded.
            unsafe { cu::module::get_function(module, n) }.map_err(|e| cuda_err("cuModuleGetFunction", e))
        };
        let (spin, fill) = match (func("anyccl_spin"), func("anyccl_fill")) {
            (Ok(s), Ok(f)) => (s, f),
            (Err(e), _) | (_, Err(e)) => {
                // SAFETY: loaded above and not used again.
                let _ = unsafe { cu::module::unload(module) };
                return Err(e);
            }
        };
        let khz = cuda.clock_khz()?;
        let raw = cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| cuda_err("cuStreamCreate", e))?;
        Ok(EngineStream { cuda, raw, module, spin, fill, cycles_per_us: f64::from(khz) / 1000.0 })
    }

    /// The stream, for [`anyccl_core::Communicator::wait_stream`] and `signal_stream`.
    pub fn stream_ref(&self) -> StreamRef<'_> {
        // SAFETY: the stream lives as long as `self`, which the reference borrows.
        unsafe { StreamRef::from_raw(self.cuda.device(), self.raw as *mut c_void) }
    }

    /// Keep the stream busy for about `us` microseconds (one thread spinning on the clock:
    /// the stream waits, the other SMs stay free).
    ///
    /// # Errors
    /// `Backend` on a driver error.
    pub fn spin_us(&self, us: f64) -> Result<()> {
        let mut cycles: u64 = (us.max(0.0) * self.cycles_per_us) as u64;
        let mut params = [&mut cycles as *mut u64 as *mut c_void];
        self.cuda.bind()?;
        // SAFETY: the kernel takes one u64 by value; `params` outlives the call, which
        // copies the arguments.
        unsafe { cu::launch_kernel(self.spin, (1, 1, 1), (1, 1, 1), 0, self.raw, &mut params) }
            .map_err(|e| cuda_err("cuLaunchKernel", e))
    }

    /// Fill `count` `f32`s at device address `ptr` with `value`, on this stream.
    ///
    /// # Safety
    /// `ptr` addresses `count` `f32`s of this device that stay allocated, and that nothing
    /// else writes, until the stream has passed the kernel.
    ///
    /// # Errors
    /// `Backend` on a driver error.
    pub unsafe fn fill_f32(&self, ptr: *mut c_void, count: usize, value: f32) -> Result<()> {
        let (mut p, mut n, mut v) = (ptr as u64, count as u64, value);
        let mut params =
            [&mut p as *mut u64 as *mut c_void, &mut n as *mut u64 as *mut c_void, &mut v as *mut f32 as *mut c_void];
        let blocks = count.div_ceil(256).clamp(1, 1024) as u32;
        self.cuda.bind()?;
        // SAFETY: the arguments match the kernel's (u64, u64, f32); the memory is valid per
        // the caller.
        unsafe { cu::launch_kernel(self.fill, (blocks, 1, 1), (256, 1, 1), 0, self.raw, &mut params) }
            .map_err(|e| cuda_err("cuLaunchKernel", e))
    }

    /// Start recording a graph on this stream (`cuStreamBeginCapture`, thread-local mode:
    /// other threads' CUDA calls are not affected). Work enqueued until
    /// [`EngineStream::end_capture`] is recorded, not run.
    ///
    /// # Errors
    /// `Backend` on a driver error (e.g. a capture already under way).
    pub fn begin_capture(&self) -> Result<()> {
        self.cuda.bind()?;
        // SAFETY: our live stream.
        unsafe { cu::stream::begin_capture(self.raw, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) }
            .map_err(|e| cuda_err("cuStreamBeginCapture", e))
    }

    /// Stop recording and instantiate what was recorded, to be replayed on this stream.
    ///
    /// # Errors
    /// `Backend` on a driver error (e.g. a stream that joined the capture and did not
    /// rejoin this one).
    pub fn end_capture(&self) -> Result<Graph> {
        self.cuda.bind()?;
        // SAFETY: our live stream.
        let graph = unsafe { cu::stream::end_capture(self.raw) }.map_err(|e| cuda_err("cuStreamEndCapture", e))?;
        // SAFETY: `graph` was just captured.
        match unsafe { cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
            Ok(exec) => Ok(Graph { cuda: self.cuda.clone(), graph, exec }),
            Err(e) => {
                // SAFETY: captured above, not used again.
                let _ = unsafe { cu::graph::destroy(graph) };
                Err(cuda_err("cuGraphInstantiate", e))
            }
        }
    }

    /// Replay `graph` on this stream (enqueued; [`EngineStream::synchronize`] waits).
    ///
    /// # Errors
    /// `Backend` on a driver error.
    pub fn replay(&self, graph: &Graph) -> Result<()> {
        self.cuda.bind()?;
        // SAFETY: both live; the graph's buffers are kept by the caller's `Captured`s.
        unsafe { cu::graph::launch(graph.exec, self.raw) }.map_err(|e| cuda_err("cuGraphLaunch", e))
    }

    /// Wait until the stream has done everything enqueued on it, at most `timeout`.
    ///
    /// # Errors
    /// `Timeout` when it has not; `Backend` on a device error.
    pub fn synchronize(&self, timeout: Duration) -> Result<()> {
        self.cuda.bind()?;
        let ev = Event::record_raw(&self.cuda, self.raw)?;
        let ctx = Ctx::process("nccl");
        ev.wait(timeout, &ctx, "engine stream synchronize", "the engine's stream did not finish", || Ok(()))
    }
}

impl Drop for EngineStream {
    fn drop(&mut self) {
        let _ = self.cuda.bind();
        // SAFETY: created in `new`, destroyed once; CUDA lets queued work finish first.
        if let Err(e) = unsafe { cu::stream::destroy(self.raw) } {
            tracing::warn!("cuStreamDestroy: {e:?}");
        }
        // SAFETY: loaded in `new`, unloaded once, after the stream that used it.
        let _ = unsafe { cu::module::unload(self.module) };
    }
}

/// A recorded and instantiated graph ([`EngineStream::end_capture`]).
#[derive(Debug)]
pub struct Graph {
    cuda: Arc<Cuda>,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: graph handles are usable from any thread with the context current.
unsafe impl Send for Graph {}
// SAFETY: launches of one executable graph are ordered by the streams they go on.
unsafe impl Sync for Graph {}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ = self.cuda.bind();
        // SAFETY: created by `end_capture`, destroyed once (CUDA lets launched replays end).
        let _ = unsafe { cu::graph::exec_destroy(self.exec) };
        // SAFETY: as above.
        let _ = unsafe { cu::graph::destroy(self.graph) };
    }
}

fn cuda_err_text(op: &str, text: String) -> Error {
    // No code: a driver call that failed says why in `text`.
    Ctx::process("nccl").backend_error(op, -1, text, anyccl_core::Recovery::Fatal)
}
