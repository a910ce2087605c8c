//! NCCL called directly, for measuring what anyccl adds on top of it: a communicator of its
//! own (made as the backend makes one, with the same deadline), one stream, `ncclAllReduce`
//! issued back to back and one wait at the end: the loop of nccl-tests and of an engine that
//! calls NCCL by hand. `anyccl-bench --vs-raw` times it beside the same calls through a
//! `Communicator`, interleaved.

use crate::cuda::{Cuda, CudaMemory, Event, Stream};
use crate::library::{NcclHandles, NcclLibrary};
use crate::NcclAdapter;
use anyccl_core::{CommConfig, Ctx, DType, ReduceOp, Result, Store};
use anyccl_device::{fresh_comm, Library, Plane, Settings};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Microseconds per call: in all, and on the host issuing it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RawTiming {
    /// Time per call, issue to completion of the last.
    pub us: f64,
    /// Host time per call spent issuing.
    pub issue_us: f64,
}

/// A raw NCCL communicator with its stream.
#[derive(Debug)]
pub struct RawNccl {
    lib: &'static NcclLibrary,
    cuda: Arc<Cuda>,
    handles: Option<NcclHandles>,
    stream: Stream,
    rank: usize,
    timeout: Duration,
}

/// The raw communicator's place in errors.
fn ctx(rank: usize) -> Ctx {
    Ctx::new("nccl", rank, "raw")
}

impl RawNccl {
    /// Make one on device `LOCAL_RANK` modulo the devices: rank 0 draws the id and
    /// publishes it under `key`; every rank waits for it, then inits, within
    /// `config.init_timeout`.
    ///
    /// # Errors
    /// `Unavailable` without NCCL or CUDA, `Timeout` when the ranks do not all arrive,
    /// `Backend` on a library error.
    pub async fn connect(
        store: &dyn Store,
        key: &str,
        rank: usize,
        size: usize,
        local_rank: usize,
        config: &CommConfig,
    ) -> Result<RawNccl> {
        let (lib, devices) = NcclAdapter::ready()?;
        let cuda = Cuda::new((local_rank % devices) as i32)?;
        let deadline = anyccl_core::deadline_in(config.init_timeout);
        let settings = Settings::from_config("raw", config, config.op_timeout);
        let handles =
            fresh_comm(lib, &cuda, store, key, rank, size, &settings, deadline, &ctx(rank), "raw init").await?;
        let stream = Stream::new(&cuda)?;
        Ok(RawNccl { lib, cuda, handles: Some(handles), stream, rank, timeout: config.op_timeout })
    }

    /// Microseconds per call of `iters` in-place-free `ncclAllReduce` (sum) of `count`
    /// elements of `dtype`, issued back to back on one stream after `warmup` untimed calls,
    /// with one wait at the end. Buffers are allocated before and freed after the timing.
    ///
    /// # Errors
    /// `Backend` on a library or driver error, `Timeout` when the calls do not finish
    /// within the operation timeout.
    ///
    /// With `events: Some(depth)`, an event is also recorded after each call (what a
    /// completion handle per operation costs by itself), and the calls are waited for in
    /// chunks of `depth`, as a caller of `Work`s keeps `depth` in flight and waits for them:
    /// each chunk's end waits for its last event. The events are made before the timing and
    /// recorded again (as anyccl keeps its own), so no event is made or freed while timed.
    /// The calls write `recvs` output buffers in turn (1: one buffer for every call; more:
    /// what a caller that keeps each output until its call is waited for does). Returns the
    /// time per call and the part of it the host spent issuing.
    pub fn all_reduce_us(
        &self,
        count: usize,
        dtype: DType,
        (iters, warmup): (usize, usize),
        events: Option<usize>,
        recvs: usize,
    ) -> Result<RawTiming> {
        self.all_reduce_us_with(count, dtype, (iters, warmup), events, recvs, &|| ())
    }

    /// [`RawNccl::all_reduce_us`] running `between` after each call (and its event), timed
    /// with it: what a caller's own code costs once a launch has run in between
    /// (`launch_cost`'s cold-code rows).
    pub fn all_reduce_us_with(
        &self,
        count: usize,
        dtype: DType,
        (iters, warmup): (usize, usize),
        events: Option<usize>,
        recvs: usize,
        between: &dyn Fn(),
    ) -> Result<RawTiming> {
        let send = crate::cuda::zeroed(&self.cuda, dtype, count)?;
        // `recvs` outputs of `count` elements: the caller bounds it (the benchmark passes the
        // outputs its own run holds, within its memory budget, at the sizes it compares).
        let recv: Vec<CudaMemory> =
            (0..recvs.max(1)).map(|_| crate::cuda::zeroed(&self.cuda, dtype, count)).collect::<Result<_>>()?;
        self.cuda.bind()?;
        // One event per call in flight, made (recorded once) before anything is timed.
        let depth = events.map(|d| d.clamp(1, iters.max(warmup).max(1)));
        let kept: Vec<Event> = (0..depth.unwrap_or(0)).map(|_| Event::record(&self.stream)).collect::<Result<_>>()?;
        self.wait()?;
        let run = |k: usize| -> Result<(Duration, Duration)> {
            let (mut issued, t) = (Duration::ZERO, Instant::now());
            let mut left = k;
            let mut i = 0;
            while left > 0 {
                let chunk = depth.map_or(left, |d| d.min(left));
                let start = Instant::now();
                for e in 0..chunk {
                    self.all_reduce(&send, &recv[i % recv.len()], count, dtype)?;
                    i += 1;
                    if let Some(ev) = kept.get(e) {
                        <Cuda as anyccl_device::Runtime>::record_again(&self.cuda, ev, &self.stream)?;
                    }
                    between();
                }
                issued += start.elapsed();
                match kept.get(chunk - 1) {
                    Some(last) => self.wait_for(last)?,
                    None => self.wait()?,
                }
                left -= chunk;
            }
            Ok((t.elapsed(), issued))
        };
        run(warmup.max(1))?;
        let (took, issued) = run(iters.max(1))?;
        let per = |d: Duration| d.as_secs_f64() * 1e6 / iters.max(1) as f64;
        Ok(RawTiming { us: per(took), issue_us: per(issued) })
    }

    /// Make the device current where it is not (`cuCtxGetCurrent`, then `cuCtxSetCurrent`
    /// only if another context is current): what each anyccl launch asks first, for
    /// `launch_cost`'s rows that add one piece of anyccl's path at a time to raw NCCL.
    ///
    /// # Errors
    /// `Backend` on a driver error.
    pub fn bind(&self) -> Result<()> {
        self.cuda.bind()
    }

    /// What the host pays for the pieces of a launch that are not NCCL's, in nanoseconds
    /// per call over `reps` calls: making the device current (`cuCtxSetCurrent`), asking
    /// which context is current (`cuCtxGetCurrent`), recording an event, querying a
    /// finished one, reading the clock, taking an uncontended lock.
    ///
    /// # Errors
    /// `Backend` on a driver error.
    pub fn host_costs(&self, reps: u32) -> Result<Vec<(&'static str, f64)>> {
        let reps = reps.max(1);
        let per = |t: Instant| t.elapsed().as_secs_f64() * 1e9 / f64::from(reps);
        self.cuda.bind()?;
        let mut out = Vec::new();
        let t = Instant::now();
        for _ in 0..reps {
            self.cuda.set_current()?;
        }
        out.push(("cuCtxSetCurrent", per(t)));
        let t = Instant::now();
        for _ in 0..reps {
            std::hint::black_box(self.cuda.current()?);
        }
        out.push(("cuCtxGetCurrent", per(t)));
        // A new event each (the runtime's pool holds a few; past them, each is made) ...
        let mut events = Vec::with_capacity(reps as usize);
        let t = Instant::now();
        for _ in 0..reps {
            events.push(Event::record(&self.stream)?);
        }
        out.push(("cuEventCreate+cuEventRecord", per(t)));
        self.wait()?;
        // ... and the same events recorded again, as a completion handle that keeps its
        // events does.
        let t = Instant::now();
        for e in &events {
            <Cuda as anyccl_device::Runtime>::record_again(&self.cuda, e, &self.stream)?;
        }
        out.push(("cuEventRecord", per(t)));
        self.wait()?;
        let t = Instant::now();
        for e in &events {
            std::hint::black_box(e.done()?);
        }
        out.push(("cuEventQuery (done)", per(t)));
        drop(events);
        // A counter the stream writes to pinned host memory (stream memory operations),
        // read by the host: an alternative to an event per operation.
        if let Some(ns) = self.write_value_ns(reps)? {
            out.push(("cuStreamWriteValue64", ns));
        }
        let t = Instant::now();
        for _ in 0..reps {
            std::hint::black_box(Instant::now());
        }
        out.push(("Instant::now", per(t)));
        let m = std::sync::Mutex::new(0u64);
        let t = Instant::now();
        for _ in 0..reps {
            if let Ok(mut g) = m.lock() {
                *g += 1;
            }
        }
        out.push(("Mutex lock", per(t)));
        Ok(out)
    }

    /// Nanoseconds per `cuStreamWriteValue64` of a counter in mapped pinned host memory,
    /// or `None` where the device has no 64-bit stream memory operations.
    fn write_value_ns(&self, reps: u32) -> Result<Option<f64>> {
        use cudarc::driver::{result as cu, sys};
        let io = |op: &'static str| move |e| crate::result::cuda(op, e);
        // SAFETY: plain attribute query of a valid device.
        let can = unsafe {
            cu::device::get_attribute(
                self.cuda.dev(),
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
            )
        }
        .map_err(io("cuDeviceGetAttribute"))?;
        if can == 0 {
            return Ok(None);
        }
        // CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP.
        // SAFETY: an 8-byte pinned allocation, freed below.
        let host = unsafe { cu::malloc_host(8, 0x01 | 0x02) }.map_err(io("cuMemHostAlloc"))?;
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: `host` is mapped pinned memory; `dptr` is a valid out-parameter.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, host, 0) };
        let result = if r != sys::CUresult::CUDA_SUCCESS {
            Err(crate::result::cuda("cuMemHostGetDevicePointer", cudarc::driver::DriverError(r)))
        } else {
            let t = Instant::now();
            let mut failed = None;
            for i in 0..u64::from(reps) {
                // SAFETY: `dptr` maps 8 bytes of live pinned memory; our live stream.
                let r = unsafe { sys::cuStreamWriteValue64_v2(self.stream.raw, dptr, i + 1, 0) };
                if r != sys::CUresult::CUDA_SUCCESS {
                    failed = Some(r);
                    break;
                }
            }
            let ns = t.elapsed().as_secs_f64() * 1e9 / f64::from(reps);
            match failed {
                Some(r) => Err(crate::result::cuda("cuStreamWriteValue64", cudarc::driver::DriverError(r))),
                None => self.wait().map(|()| Some(ns)),
            }
        };
        // SAFETY: allocated above; the stream was waited for (or failed before using it).
        let _ = unsafe { cu::free_host(host) };
        result
    }

    fn all_reduce(&self, send: &CudaMemory, recv: &CudaMemory, count: usize, dtype: DType) -> Result<()> {
        let h = self.handles.as_ref().ok_or_else(|| ctx(self.rank).aborted("the raw communicator is gone"))?;
        let op = anyccl_device::Op::AllReduce {
            send: send.ptr() as *const std::ffi::c_void,
            recv: recv.ptr(),
            count,
            dtype,
            op: ReduceOp::Sum,
        };
        // SAFETY: the buffers hold `count` elements and outlive the timing (the caller waits
        // for the stream before they drop); the communicator is ours alone; the device is
        // current.
        unsafe { self.lib.launch(h, &self.stream, &op) }
            .map_err(|e| e.into_error(&ctx(self.rank), "ncclAllReduce", Duration::ZERO))?;
        Ok(())
    }

    /// Wait for the stream, checking NCCL's async error, within the operation timeout.
    fn wait(&self) -> Result<()> {
        self.wait_for(&Event::record(&self.stream)?)
    }

    /// Wait for `ev`, checking NCCL's async error, within the operation timeout.
    fn wait_for(&self, ev: &Event) -> Result<()> {
        let check = || match &self.handles {
            Some(h) => self
                .lib
                .async_error(h, Plane::Data)
                .map(|_| ())
                .map_err(|e| e.into_error(&ctx(self.rank), "ncclCommGetAsyncError", Duration::ZERO)),
            None => Ok(()),
        };
        ev.wait(self.timeout, &ctx(self.rank), "raw all_reduce", "the raw NCCL calls did not finish", check)
    }
}

impl Drop for RawNccl {
    fn drop(&mut self) {
        if let Some(h) = self.handles.take() {
            let _ = self.cuda.bind();
            // ncclCommAbort frees without waiting on peers.
            self.lib.destroy(&h);
        }
    }
}
