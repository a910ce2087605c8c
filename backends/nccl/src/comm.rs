//! `NcclComm`: our own RAII communicator on NCCL's C API.
//!
//! Communicators are created non-blocking (`blocking = 0`) so that initialisation, splits
//! and connection setup can be bounded by a deadline and aborted. Every call on the handle
//! is serialised by a mutex (NCCL communicators are not thread-safe); polling loops release
//! it between polls so that `abort` from another thread gets through promptly. `Drop`
//! aborts a communicator that was not shut down and never panics.

use crate::cuda::{Cuda, CudaMemory, Event, Stream};
use crate::result::{check, error};
use crate::sys::{self, ncclComm_t, ncclUniqueId, NcclLib};
use anyccl_core::{
    async_trait, AllToAllSplits, Buf, BufMut, Capabilities, Collective, CommInfo, DType, DeviceMemory, Error, P2POp,
    ReduceOp, Result, Work, WorkImpl,
};
use std::ffi::{c_int, c_void, CString};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

fn dtype(d: DType) -> c_int {
    match d {
        DType::I8 => 0,
        DType::U8 => 1,
        DType::I32 => 2,
        DType::U32 => 3,
        DType::I64 => 4,
        DType::U64 => 5,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
    }
}

fn redop(o: ReduceOp) -> c_int {
    match o {
        ReduceOp::Sum => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
    }
}

/// Whether the launcher gives every rank its own `NCCL_HOSTID` (`ANYCCL_RANK_ENV`): NCCL
/// then treats each rank as a host of its own, connects them over the network transport,
/// and several ranks may share one GPU (a functional test setup, not a fast one).
fn per_rank_host_ids() -> bool {
    let id = |r| {
        anyccl_core::LaunchEnv::rank_env(r)
            .ok()
            .and_then(|v| v.into_iter().find(|(n, _)| n == "NCCL_HOSTID").map(|(_, v)| v))
    };
    matches!((id(0), id(1)), (Some(a), Some(b)) if a != b)
}

/// What the NCCL backend supports with the loaded library.
pub fn nccl_capabilities(lib: &NcclLib, devices: usize) -> Capabilities {
    Capabilities {
        device_kind: anyccl_core::DeviceKind::Cuda,
        dtypes: DType::ALL.to_vec(),
        reduce_ops: ReduceOp::ALL.to_vec(),
        all_to_all: true,
        all_to_all_v: true,
        p2p_group: true,
        abort_in_flight: true,
        split: lib.CommSplit.is_some(),
        lazy_connect: true,
        memory_stats: lib.CommMemStats.is_some(),
        warmup_small_bytes: 8 << 10,
        warmup_large_bytes: 32 << 20,
        max_world_size: usize::MAX,
        max_local_ranks: if per_rank_host_ids() { usize::MAX } else { devices },
        // NCCL reports neither: a dead peer leaves kernels waiting, a mismatched collective
        // runs with whatever arrives (NVIDIA/nccl#279).
        detects_peer_failure: false,
        first_call_may_block: blocking_data_plane(),
        detects_mismatch: false,
    }
}

/// A communicator not yet wrapped in an `NcclComm`: aborted when dropped, so every error
/// path between its creation and `wrap` frees it.
struct CommPtr {
    lib: &'static NcclLib,
    comm: ncclComm_t,
}
// SAFETY: the pointer is only dereferenced by NCCL, from one task at a time (a new
// communicator belongs to the task creating it until it is wrapped).
unsafe impl Send for CommPtr {}
// SAFETY: a shared reference only reads the pointer value; the calls made with it come
// from the owning task.
unsafe impl Sync for CommPtr {}

impl CommPtr {
    fn new(lib: &'static NcclLib, comm: ncclComm_t) -> Self {
        CommPtr { lib, comm }
    }
    fn get(&self) -> ncclComm_t {
        self.comm
    }
    /// Hand the communicator over to its owner: no abort on drop.
    fn into_raw(mut self) -> ncclComm_t {
        std::mem::replace(&mut self.comm, std::ptr::null_mut())
    }
}

impl Drop for CommPtr {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: a live communicator that nothing else holds; it is not used again.
            unsafe { (self.lib.CommAbort)(self.comm) };
        }
    }
}

/// Heap storage for a `ncclComm_t*` out-parameter that NCCL may write asynchronously.
struct OutSlot(Option<Box<ncclComm_t>>);
// SAFETY: the slot is only read by the task that owns it.
unsafe impl Send for OutSlot {}

impl OutSlot {
    fn new() -> Self {
        OutSlot(Some(Box::new(std::ptr::null_mut())))
    }
    fn ptr(&self) -> *mut ncclComm_t {
        self.0.as_ref().map(|b| &**b as *const ncclComm_t as *mut ncclComm_t).unwrap_or(std::ptr::null_mut())
    }
    fn get(&self) -> ncclComm_t {
        // SAFETY: reads our own heap cell; NCCL writes it with a plain pointer store.
        self.0.as_ref().map(|b| unsafe { std::ptr::read_volatile(&**b) }).unwrap_or(std::ptr::null_mut())
    }
    /// Give up on a job that may still write the slot: never free it.
    fn leak(mut self) {
        if let Some(b) = self.0.take() {
            Box::leak(b);
        }
    }
}

/// The handle, usable from any thread under the mutex.
struct Handle(Option<ncclComm_t>);
// SAFETY: NCCL communicator handles may be used from any thread as long as calls on one
// communicator are not concurrent; every use goes through the mutex holding this.
unsafe impl Send for Handle {}

/// The NCCL backend's communicator.
///
/// Two NCCL communicators back it: a non-blocking *control* communicator (init and splits,
/// bounded by deadlines) and a blocking *data* communicator split from it with shared
/// resources, so a warm operation launches synchronously (a non-blocking communicator hands
/// every launch to an asynchronous path, costing tens of microseconds each). A first call
/// that blocks while NCCL connects to a peer is bounded by a watchdog that aborts the
/// communicator. `ANYCCL_NCCL_BLOCKING=0` runs the data plane on the control communicator.
pub struct NcclComm {
    info: CommInfo,
    caps: Capabilities,
    lib: &'static NcclLib,
    cuda: Arc<Cuda>,
    stream: Stream,
    /// The data communicator.
    handle: Mutex<Handle>,
    /// The control communicator, when the data one is separate.
    ctrl: Mutex<Handle>,
    /// Copies of both handles for the watchdog, which aborts without taking the locks.
    raw: [std::sync::atomic::AtomicPtr<sys::ncclComm>; 2],
    /// Set by whoever frees the NCCL communicators first (abort, shutdown or watchdog).
    freed: AtomicBool,
    /// Set when the watchdog aborted a call that blocked past the enqueue timeout.
    timed_out: AtomicBool,
    /// Nanoseconds since `epoch` at which a blocking NCCL call began; 0 when none runs.
    in_call_since: AtomicU64,
    epoch: Instant,
    aborted: AtomicBool,
    failure: Mutex<Option<String>>,
    label: String,
    scratch: CudaMemory,
    op_timeout: Duration,
    /// How long one call may block while NCCL connects (read once, at creation).
    enqueue_timeout: Duration,
    /// The event slot of an operation NCCL is still launching (`ncclInProgress`, e.g. while
    /// it connects for a first call). No other NCCL call may be made until it clears.
    pending: Mutex<Option<Arc<LaunchSlot>>>,
    in_progress_returns: AtomicU64,
    /// Operations whose completion a `Work` observed: whether the communicator ever ran
    /// (its peers had joined) when a later call blocks.
    completed: AtomicU64,
}

/// Filled with the operation's event once NCCL has put it on the stream.
/// What a launch that NCCL answered with `ncclInProgress` became: nothing yet, the event
/// recorded once NCCL finished enqueuing it, or why it failed. Shared by the `Work` and the
/// communicator (which resolves it at the next launch or wait).
type LaunchSlot = Mutex<Option<std::result::Result<Event, String>>>;

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm(rank {} of {}, '{}', {})", self.info.rank, self.info.size, self.label, self.info.device)
    }
}

/// How long one NCCL call may block: `ANYCCL_NCCL_ENQUEUE_TIMEOUT_S`, else the
/// communicator's operation timeout.
///
/// # Errors
/// `InvalidArgument` when the variable is set but not a positive number of seconds.
fn enqueue_timeout(op_timeout: Duration) -> Result<Duration> {
    Ok(anyccl_core::env_secs("ANYCCL_NCCL_ENQUEUE_TIMEOUT_S")?.unwrap_or(op_timeout))
}

/// Whether the data plane runs on a blocking communicator (`ANYCCL_NCCL_BLOCKING`, default on).
fn blocking_data_plane() -> bool {
    std::env::var("ANYCCL_NCCL_BLOCKING").map(|v| v != "0").unwrap_or(true)
}

/// Poll `comm`'s async state until it leaves `ncclInProgress`.
///
/// # Safety
/// `comm` must be a live communicator not used concurrently.
unsafe fn async_state(lib: &NcclLib, comm: ncclComm_t) -> c_int {
    let mut st: c_int = sys::SUCCESS;
    // SAFETY: per the caller.
    let code = unsafe { (lib.CommGetAsyncError)(comm, &mut st) };
    if code != sys::SUCCESS {
        code
    } else {
        st
    }
}

impl NcclComm {
    /// Create the communicator of `opts.rank` among `opts.size` over the store, within
    /// `opts.timeout`; every rank calls it.
    pub(crate) async fn connect(
        lib: &'static NcclLib,
        cuda: Arc<Cuda>,
        opts: anyccl_core::ConnectOptions,
    ) -> Result<Arc<NcclComm>> {
        let deadline = anyccl_core::deadline_in(opts.timeout);
        let (store, namespace, rank, size, op_timeout) =
            (opts.store, opts.namespace.as_str(), opts.rank, opts.size, opts.op_timeout);
        // A generation per connect, started by rank 0 (a rank retrying alone joins rank 0's
        // next attempt rather than one of its own).
        let base = format!("{namespace}/nccl");
        let st = store.as_ref();
        anyccl_core::in_new_generation(st, &base, rank, namespace, deadline, |ns| async move {
            let enqueue_timeout = enqueue_timeout(op_timeout)?;
            let devices = crate::cuda::probe().unwrap_or(1);
            let caps = nccl_capabilities(lib, devices);
            let key = format!("{ns}/unique-id");
            let mut id = ncclUniqueId { internal: [0; 128] };
            if rank == 0 {
                // SAFETY: `id` is a valid out-parameter.
                let code = unsafe { (lib.GetUniqueId)(&mut id) };
                check(lib, "ncclGetUniqueId", code, None, rank, namespace)?;
                let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
                st.set(&key, &bytes).await?;
            } else {
                let bytes = match st.wait(&key, deadline).await {
                    Ok(b) => b,
                    Err(Error::Timeout { after, .. }) => {
                        return Err(Error::Timeout {
                            op: "connect".into(),
                            rank,
                            group: namespace.into(),
                            after,
                            detail: "rank 0 never published the NCCL unique id".into(),
                        })
                    }
                    Err(e) => return Err(e),
                };
                if bytes.len() != 128 {
                    return Err(Error::store_fatal(format!(
                        "NCCL unique id under '{key}' has {} bytes, not 128",
                        bytes.len()
                    )));
                }
                for (d, s) in id.internal.iter_mut().zip(bytes) {
                    *d = s as _;
                }
            }
            cuda.bind()?;
            // NCCL keeps the address of the out-parameter in its asynchronous init job and may
            // write through it until the communicator is ready: it must outlive the job.
            let slot = OutSlot::new();
            {
                let name = CString::new(namespace.replace('\0', "")).unwrap_or_default();
                let mut cfg = sys::config(Some(&name));
                // SAFETY: the slot is heap memory that outlives the job; the config (and the name)
                // are copied by NCCL before it returns; the device is current.
                let code = unsafe { (lib.CommInitRankConfig)(slot.ptr(), size as c_int, id, rank as c_int, &mut cfg) };
                if code != sys::SUCCESS && code != sys::IN_PROGRESS {
                    return Err(error(lib, "ncclCommInitRankConfig", code, None, rank, namespace));
                }
            }
            let comm = CommPtr::new(lib, slot.get());
            if let Err(e) = wait_init(lib, &comm, "ncclCommInitRankConfig", rank, namespace, deadline).await {
                slot.leak();
                return Err(e);
            }
            drop(slot);
            let (ctrl, data) = NcclComm::data_comm(lib, comm, rank, namespace, deadline).await?;
            NcclComm::wrap(lib, cuda, ctrl, data, rank, size, namespace, caps, op_timeout, enqueue_timeout)
        })
        .await
    }

    /// Split a blocking data communicator off `ctrl` (every member calls this), unless
    /// `ANYCCL_NCCL_BLOCKING=0`. Returns (control, data).
    async fn data_comm(
        lib: &'static NcclLib,
        ctrl: CommPtr,
        rank: usize,
        label: &str,
        deadline: Instant,
    ) -> Result<(Option<CommPtr>, CommPtr)> {
        let Some(split) = lib.CommSplit.filter(|_| blocking_data_plane()) else { return Ok((None, ctrl)) };
        let slot = OutSlot::new();
        {
            let mut cfg = sys::config(None);
            cfg.blocking = 1;
            cfg.splitShare = 1;
            // SAFETY: `ctrl` is live and used only by this task until wrapped; the slot
            // outlives the job; NCCL copies the config before returning.
            let code = unsafe { split(ctrl.get(), 0, rank as c_int, slot.ptr(), &mut cfg) };
            if code != sys::SUCCESS && code != sys::IN_PROGRESS {
                return Err(error(lib, "ncclCommSplit (data)", code, Some(ctrl.get()), rank, label));
            }
        }
        if let Err(e) = wait_init(lib, &ctrl, "ncclCommSplit (data)", rank, label, deadline).await {
            slot.leak();
            return Err(e);
        }
        // Declared after `ctrl`, so on an error below it is aborted before its parent.
        let data = CommPtr::new(lib, slot.get());
        if data.get().is_null() {
            return Err(Error::Backend {
                backend: "nccl",
                op: "ncclCommSplit (data)".into(),
                code: -1,
                text: "NCCL returned no communicator".into(),
                recovery: anyccl_core::Recovery::Rebuild,
                source: None,
            });
        }
        wait_init(lib, &data, "ncclCommSplit (data)", rank, label, deadline).await?;
        drop(slot);
        Ok((Some(ctrl), data))
    }

    #[allow(clippy::too_many_arguments)]
    fn wrap(
        lib: &'static NcclLib,
        cuda: Arc<Cuda>,
        ctrl: Option<CommPtr>,
        comm: CommPtr,
        rank: usize,
        size: usize,
        label: &str,
        mut caps: Capabilities,
        op_timeout: Duration,
        enqueue_timeout: Duration,
    ) -> Result<Arc<NcclComm>> {
        let stream = Stream::new(&cuda)?;
        let scratch = CudaMemory::zeroed(&cuda, DType::F32, 1)?;
        // Enqueues can block on peers exactly when the data plane is a blocking
        // communicator split off the control one.
        caps.first_call_may_block = ctrl.is_some();
        // From here nothing fails: the communicators belong to the `NcclComm`.
        let comm = comm.into_raw();
        let ctrl = ctrl.map(CommPtr::into_raw);
        let comm = Arc::new(NcclComm {
            info: CommInfo { backend: "nccl", rank, size, device: cuda.device() },
            caps,
            lib,
            cuda,
            stream,
            handle: Mutex::new(Handle(Some(comm))),
            ctrl: Mutex::new(Handle(ctrl)),
            raw: [
                std::sync::atomic::AtomicPtr::new(comm),
                std::sync::atomic::AtomicPtr::new(ctrl.unwrap_or(std::ptr::null_mut())),
            ],
            freed: AtomicBool::new(false),
            timed_out: AtomicBool::new(false),
            in_call_since: AtomicU64::new(0),
            epoch: Instant::now(),
            aborted: AtomicBool::new(false),
            failure: Mutex::new(None),
            label: label.to_string(),
            scratch,
            pending: Mutex::new(None),
            in_progress_returns: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            op_timeout,
            enqueue_timeout,
        });
        NcclComm::start_watchdog(&comm);
        Ok(comm)
    }

    /// A thread that aborts the communicator when one NCCL call blocks for longer than the
    /// enqueue timeout (a first call waiting for a peer that never connects).
    fn start_watchdog(comm: &Arc<NcclComm>) {
        let weak = Arc::downgrade(comm);
        let limit = comm.enqueue_timeout;
        let spawned = std::thread::Builder::new().name("anyccl-nccl-watchdog".into()).spawn(move || loop {
            std::thread::sleep(Duration::from_millis(100));
            let Some(c) = weak.upgrade() else { return };
            if c.freed.load(Ordering::Acquire) {
                return;
            }
            let since = c.in_call_since.load(Ordering::Acquire);
            if since != 0 && c.epoch.elapsed().saturating_sub(Duration::from_nanos(since)) > limit {
                let why =
                    format!("an NCCL call blocked for more than {limit:?}: {}; communicator aborted", c.blocked_why());
                tracing::error!("'{}' rank {}: {why}", c.label, c.info.rank);
                if let Ok(mut f) = c.failure.lock() {
                    f.get_or_insert(why);
                }
                c.timed_out.store(true, Ordering::Release);
                c.aborted.store(true, Ordering::Release);
                c.release();
                return;
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("no watchdog for '{}': {e}", comm.label);
        }
    }

    /// Abort both NCCL communicators once, without the locks (the watchdog's path, and the
    /// last step of every other path).
    fn free_raw(&self) {
        if self.freed.swap(true, Ordering::AcqRel) {
            return;
        }
        let _ = self.cuda.bind();
        for r in &self.raw {
            let c = r.swap(std::ptr::null_mut(), Ordering::AcqRel);
            if !c.is_null() {
                // SAFETY: `c` is one of our live communicators, freed exactly once (guarded
                // by `freed`); ncclCommAbort may run while another thread is blocked in a
                // call on it, which it then unblocks.
                let code = unsafe { (self.lib.CommAbort)(c) };
                if code != sys::SUCCESS {
                    tracing::warn!("ncclCommAbort on '{}' rank {}: code {code}", self.label, self.info.rank);
                }
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Handle> {
        self.handle.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn dead(&self) -> Option<Error> {
        if self.aborted.load(Ordering::Acquire) {
            let why =
                self.failure.lock().ok().and_then(|f| f.clone()).unwrap_or_else(|| "aborted by the caller".into());
            return Some(Error::Aborted { rank: self.info.rank, group: self.label.clone(), detail: why });
        }
        None
    }

    /// What a call that blocked inside NCCL means, from what is known: whether any
    /// operation of this communicator ever completed (NCCL over NVLink cannot say which
    /// peer is missing).
    fn blocked_why(&self) -> String {
        match self.completed.load(Ordering::Relaxed) {
            0 => "no operation of this communicator has completed yet: a peer never joined (or is still connecting)"
                .into(),
            n => format!(
                "{n} operations of this communicator had completed, so every peer had joined: one stopped taking \
                 part (stopped, stuck or dead) and NCCL's queue filled"
            ),
        }
    }

    /// A `Timeout` for `op` that also aborts the communicator (it cannot be trusted after).
    fn timed_out(&self, op: &str, after: Duration, why: &str) -> Error {
        let e = Error::Timeout {
            op: op.to_string(),
            rank: self.info.rank,
            group: self.label.clone(),
            after,
            detail: format!("{why}; communicator aborted"),
        };
        self.fail(&e);
        e
    }

    /// Record a failure and abort, so every later call fails fast.
    fn fail(&self, why: &Error) {
        if let Ok(mut f) = self.failure.lock() {
            f.get_or_insert_with(|| format!("failed earlier: {why}"));
        }
        self.abort_now();
    }

    fn abort_now(&self) {
        self.aborted.store(true, Ordering::Release);
        self.release();
    }

    /// Free both NCCL communicators and forget the handles. Under the handle locks, so no
    /// other thread is inside a call on them, unless a call is blocked inside NCCL (waiting
    /// for peers to connect): then the abort must run without the lock to release that call
    /// (NCCL's documented way to unblock it; best effort). `ncclCommRevoke` first, then the
    /// abort once the call returned, was tried on NCCL 2.28.9 and hung: the call never
    /// returned and the abort after it did not release it either.
    fn release(&self) {
        loop {
            match self.handle.try_lock() {
                Ok(mut h) => {
                    let mut c = self.ctrl.lock().unwrap_or_else(|p| p.into_inner());
                    self.free_raw();
                    h.0 = None;
                    c.0 = None;
                    return;
                }
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    let mut h = p.into_inner();
                    self.free_raw();
                    h.0 = None;
                    self.ctrl.lock().unwrap_or_else(|p| p.into_inner()).0 = None;
                    return;
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    if self.in_call_since.load(Ordering::Acquire) != 0 {
                        tracing::warn!(
                            "'{}' rank {}: aborting beside a call blocked inside NCCL",
                            self.label,
                            self.info.rank
                        );
                        self.free_raw();
                        self.lock().0 = None;
                        self.ctrl.lock().unwrap_or_else(|p| p.into_inner()).0 = None;
                        return;
                    }
                    std::thread::yield_now();
                }
            }
        }
    }

    /// The async error of the data communicator, if it has one (`Ok(true)`: still in progress).
    fn poll_async(&self, op: &str) -> Result<bool> {
        self.poll(&self.handle, op)
    }

    /// Like [`NcclComm::poll_async`], on the control communicator (where splits run); the
    /// data communicator when there is no separate one.
    fn poll_ctrl(&self, op: &str) -> Result<bool> {
        let has_ctrl = self.ctrl.lock().unwrap_or_else(|p| p.into_inner()).0.is_some();
        self.poll(if has_ctrl { &self.ctrl } else { &self.handle }, op)
    }

    fn poll(&self, which: &Mutex<Handle>, op: &str) -> Result<bool> {
        if let Some(e) = self.dead() {
            return Err(e);
        }
        // Another thread may hold the lock inside a call that waits for peers: report "in
        // progress" rather than wait, so every caller's own deadline still applies.
        let h = match which.try_lock() {
            Ok(h) => h,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Ok(true),
        };
        let Some(c) = h.0.filter(|_| !self.freed.load(Ordering::Acquire)) else {
            return Err(self.dead().unwrap_or_else(|| self.aborted_err()));
        };
        // SAFETY: live handle (not freed) under its lock; frees take the lock too, except the
        // unblocking abort of a call stuck inside NCCL.
        let st = unsafe { async_state(self.lib, c) };
        match st {
            sys::SUCCESS => Ok(false),
            sys::IN_PROGRESS => Ok(true),
            code => {
                let e = error(self.lib, op, code, Some(c), self.info.rank, &self.label);
                drop(h);
                self.fail(&e);
                Err(e)
            }
        }
    }

    fn aborted_err(&self) -> Error {
        Error::Aborted { rank: self.info.rank, group: self.label.clone(), detail: "communicator released".into() }
    }

    /// If an operation is still being launched, see whether NCCL is done with it and, if
    /// so, record its event. `Ok(true)` while it is still in progress.
    fn resolve_pending(&self, op: &str) -> Result<bool> {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let Some(slot) = p.as_ref() else { return Ok(false) };
        match self.poll_async(op) {
            Ok(true) => Ok(true),
            Ok(false) => {
                *slot.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(Event::record(&self.stream).map_err(|e| e.to_string()));
                *p = None;
                Ok(false)
            }
            Err(e) => {
                *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(Err(e.to_string()));
                *p = None;
                Err(e)
            }
        }
    }

    /// Wait until no operation is being launched (a previous first call still connecting).
    fn settle(&self, op: &str) -> Result<()> {
        let deadline = anyccl_core::deadline_in(self.enqueue_timeout);
        let mut spins = 0u32;
        while self.resolve_pending(op)? {
            if Instant::now() > deadline {
                return Err(self.timed_out(op, self.enqueue_timeout, "an earlier operation never finished connecting"));
            }
            backoff(&mut spins);
        }
        Ok(())
    }

    /// Enqueue NCCL calls on the stream and return a `Work` for them. Never waits for peers:
    /// when NCCL answers `ncclInProgress` (it is connecting), the `Work` starts as launching.
    fn launch<'a>(
        &'a self,
        op: &'static str,
        calls: impl FnOnce(&NcclLib, ncclComm_t, sys::Stream) -> c_int,
    ) -> Result<Work<'a>> {
        if let Some(e) = self.dead() {
            return Err(e);
        }
        self.cuda.bind()?;
        self.settle(op)?;
        let h = self.lock();
        let Some(c) = h.0.filter(|_| !self.freed.load(Ordering::Acquire)) else {
            return Err(self.dead().unwrap_or_else(|| self.aborted_err()));
        };
        self.in_call_since.store(self.epoch.elapsed().as_nanos().max(1) as u64, Ordering::Release);
        let started = Instant::now();
        let code = calls(self.lib, c, self.stream.raw);
        self.in_call_since.store(0, Ordering::Release);
        if self.timed_out.load(Ordering::Acquire) {
            return Err(Error::Timeout {
                op: op.to_string(),
                rank: self.info.rank,
                group: self.label.clone(),
                after: started.elapsed(),
                detail: format!("{}; communicator aborted", self.blocked_why()),
            });
        }
        if let Some(e) = self.dead() {
            return Err(e);
        }
        if code != sys::SUCCESS && code != sys::IN_PROGRESS {
            let e = error(self.lib, op, code, Some(c), self.info.rank, &self.label);
            drop(h);
            self.fail(&e);
            return Err(e);
        }
        if code == sys::IN_PROGRESS {
            self.in_progress_returns.fetch_add(1, Ordering::Relaxed);
            let slot: Arc<LaunchSlot> = Arc::default();
            // Set while the handle is still locked, so no other launch can slip in between.
            *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = Some(slot.clone());
            drop(h);
            return Ok(Work::new(Box::new(NcclWork { comm: self, state: WorkState::Launching(slot) })));
        }
        drop(h);
        let event = match Event::record(&self.stream) {
            Ok(e) => e,
            Err(e) => {
                // The operation is on the stream but untracked: stop it rather than let the
                // caller reuse buffers it may still touch.
                self.fail(&e);
                return Err(e);
            }
        };
        Ok(Work::new(Box::new(NcclWork { comm: self, state: WorkState::Running(event) })))
    }

    fn ptr(b: &Buf<'_>) -> *const c_void {
        b.ptr() as *const c_void
    }
    fn ptr_mut(b: &BufMut<'_>) -> *mut c_void {
        b.ptr() as *mut c_void
    }

    /// `ncclCommMemStats(ncclStatGpuMemTotal)` of one NCCL communicator; `None` when the
    /// library lacks it, the handle is gone, or a call blocked on peers holds its lock.
    fn held_by(&self, which: &Mutex<Handle>) -> Option<u64> {
        let f = self.lib.CommMemStats?;
        let h = which.try_lock().ok()?;
        let c = h.0.filter(|_| !self.freed.load(Ordering::Acquire))?;
        let mut v = 0u64;
        // SAFETY: live handle under its lock; `v` is a valid out-parameter.
        let code = unsafe { f(c, sys::STAT_GPU_MEM_TOTAL, &mut v) };
        (code == sys::SUCCESS).then_some(v)
    }
}

/// Wait for a new communicator to be ready. On an error the caller's `CommPtr` aborts it.
async fn wait_init(lib: &NcclLib, comm: &CommPtr, op: &str, rank: usize, group: &str, deadline: Instant) -> Result<()> {
    let started = Instant::now();
    loop {
        let comm = comm.get();
        // SAFETY: `comm` is the new communicator, used by this task only until it is wrapped.
        let st = unsafe { async_state(lib, comm) };
        match st {
            sys::SUCCESS => return Ok(()),
            sys::IN_PROGRESS => {}
            code => return Err(error(lib, op, code, Some(comm), rank, group)),
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                op: op.to_string(),
                rank,
                group: group.to_string(),
                after: started.elapsed(),
                detail: "not every rank joined; the half-built communicator was aborted".into(),
            });
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let in_progress = self.in_progress_returns.load(Ordering::Relaxed);
        if in_progress > 0 {
            tracing::debug!("'{}' rank {}: {in_progress} launches answered ncclInProgress", self.label, self.info.rank);
        }
        if !self.freed.load(Ordering::Acquire) {
            tracing::debug!("dropping '{}' rank {} without shutdown: aborting", self.label, self.info.rank);
            self.abort_now();
        }
    }
}

/// Spin briefly, then yield, then sleep: completion is usually microseconds away.
fn backoff(spins: &mut u32) {
    *spins += 1;
    if *spins < 2000 {
        std::hint::spin_loop();
    } else if *spins < 20_000 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

enum WorkState {
    /// NCCL has not finished putting the operation on the stream.
    Launching(Arc<LaunchSlot>),
    /// On the stream; done when the event is.
    Running(Event),
}

struct NcclWork<'a> {
    comm: &'a NcclComm,
    state: WorkState,
}

impl NcclWork<'_> {
    /// One look at the operation (`Ok(true)`: done). The device must be current.
    fn step(&mut self) -> Result<bool> {
        if let WorkState::Launching(slot) = &self.state {
            self.comm.resolve_pending("wait")?;
            let mut s = slot.lock().unwrap_or_else(|e| e.into_inner());
            match s.take() {
                None => return Ok(false),
                Some(Err(msg)) => {
                    // Kept, so every later look reports the same failure.
                    *s = Some(Err(msg.clone()));
                    return Err(Error::Aborted {
                        rank: self.comm.info.rank,
                        group: self.comm.label.clone(),
                        detail: msg,
                    });
                }
                Some(Ok(ev)) => {
                    drop(s);
                    self.state = WorkState::Running(ev);
                }
            }
        }
        match &self.state {
            WorkState::Running(ev) => ev.done(),
            WorkState::Launching(_) => Ok(false),
        }
    }
}

impl WorkImpl for NcclWork<'_> {
    fn poll(&mut self) -> Result<bool> {
        self.comm.cuda.bind()?;
        if self.step()? {
            self.comm.completed.fetch_add(1, Ordering::Relaxed);
            return Ok(true);
        }
        self.comm.poll_async("wait")?;
        Ok(false)
    }

    fn wait_for(&mut self, timeout: Duration) -> Result<bool> {
        let deadline = anyccl_core::deadline_in(timeout);
        self.comm.cuda.bind()?;
        let mut spins = 0u32;
        loop {
            if self.step()? {
                self.comm.completed.fetch_add(1, Ordering::Relaxed);
                return Ok(true);
            }
            if spins % 256 == 255 {
                self.comm.poll_async("wait")?;
            }
            if Instant::now() >= deadline {
                self.comm.poll_async("wait")?;
                return Ok(false);
            }
            backoff(&mut spins);
        }
    }

    fn drain(&mut self) {
        // The kernels may still read or write the caller's buffers: wait for them. A hung
        // operation is aborted after the communicator's op timeout so this never blocks forever.
        let started = Instant::now();
        if self.comm.cuda.bind().is_err() {
            return;
        }
        let mut spins = 0u32;
        loop {
            match self.step() {
                Ok(true) | Err(_) => return,
                Ok(false) => {}
            }
            if self.comm.poll_async("drop").is_err() && started.elapsed() > Duration::from_secs(10) {
                tracing::error!("operation on '{}' still running 10 s after its communicator failed", self.comm.label);
                return;
            }
            if started.elapsed() > self.comm.op_timeout && !self.comm.aborted.load(Ordering::Acquire) {
                tracing::error!(
                    "dropped operation on '{}' did not finish in {:?}: aborting",
                    self.comm.label,
                    self.comm.op_timeout
                );
                self.comm.abort_now();
            }
            backoff(&mut spins);
        }
    }
}

fn group(lib: &NcclLib, body: impl FnOnce() -> c_int) -> c_int {
    // SAFETY: group calls only delimit the calls made in `body`.
    let s = unsafe { (lib.GroupStart)() };
    if s != sys::SUCCESS {
        return s;
    }
    let inner = body();
    // SAFETY: closes the group opened above, whatever `body` returned.
    let end = unsafe { (lib.GroupEnd)() };
    if inner != sys::SUCCESS {
        inner
    } else {
        end
    }
}

#[async_trait]
impl Collective for NcclComm {
    fn info(&self) -> &CommInfo {
        &self.info
    }
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn memory_held(&self) -> Option<u64> {
        let data = self.held_by(&self.handle)?;
        let has_ctrl = self.ctrl.lock().unwrap_or_else(|p| p.into_inner()).0.is_some();
        if has_ctrl {
            Some(data + self.held_by(&self.ctrl)?)
        } else {
            Some(data)
        }
    }

    // SAFETY (for every data-plane call below): buffer views were validated by the
    // Communicator to live on this communicator's device with the given counts, and stay
    // borrowed by the returned Work until the stream has finished with them (Work's drop
    // waits for the event).

    fn all_reduce<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        let (r, n) = (Self::ptr_mut(&recv), recv.count());
        let s = send.map(|b| Self::ptr(&b)).unwrap_or(r);
        let (d, o) = (dtype(recv.dtype()), redop(op));
        // SAFETY: see above.
        self.launch("all_reduce", |l, c, st| unsafe { (l.AllReduce)(s, r, n, d, o, c, st) })
    }

    fn reduce<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp, root: usize) -> Result<Work<'a>> {
        let (r, n) = (Self::ptr_mut(&recv), recv.count());
        let s = send.map(|b| Self::ptr(&b)).unwrap_or(r);
        let (d, o) = (dtype(recv.dtype()), redop(op));
        // SAFETY: see above.
        self.launch("reduce", |l, c, st| unsafe { (l.Reduce)(s, r, n, d, o, root as c_int, c, st) })
    }

    fn broadcast<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, root: usize) -> Result<Work<'a>> {
        let (r, n) = (Self::ptr_mut(&recv), recv.count());
        let s = send.map(|b| Self::ptr(&b)).unwrap_or(r);
        let d = dtype(recv.dtype());
        // SAFETY: see above.
        self.launch("broadcast", |l, c, st| unsafe { (l.Broadcast)(s, r, n, d, root as c_int, c, st) })
    }

    fn all_gather<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>) -> Result<Work<'a>> {
        let r = Self::ptr_mut(&recv);
        let per = recv.count() / self.info.size;
        let es = recv.dtype().size();
        let s = send
            .map(|b| Self::ptr(&b))
            .unwrap_or((r as *const u8).wrapping_add(self.info.rank * per * es) as *const c_void);
        let d = dtype(recv.dtype());
        // SAFETY: see above; in place, the input is this rank's chunk of `recv`.
        self.launch("all_gather", |l, c, st| unsafe { (l.AllGather)(s, r, per, d, c, st) })
    }

    fn reduce_scatter<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        let es = recv.dtype().size();
        let (d, o) = (dtype(recv.dtype()), redop(op));
        let base = Self::ptr_mut(&recv);
        let (s, r, per) = match send {
            Some(b) => (Self::ptr(&b), base, recv.count()),
            None => {
                let per = recv.count() / self.info.size;
                (base as *const c_void, (base as *mut u8).wrapping_add(self.info.rank * per * es) as *mut c_void, per)
            }
        };
        // SAFETY: see above; in place, the output is this rank's chunk of the input.
        self.launch("reduce_scatter", |l, c, st| unsafe { (l.ReduceScatter)(s, r, per, d, o, c, st) })
    }

    fn all_to_all<'a>(&'a self, send: Buf<'a>, recv: BufMut<'a>, splits: Option<&AllToAllSplits>) -> Result<Work<'a>> {
        let n = self.info.size;
        let es = send.dtype().size();
        let d = dtype(send.dtype());
        let (s, r) = (Self::ptr(&send), Self::ptr_mut(&recv));
        if splits.is_none() {
            if let Some(a2a) = self.lib.AlltoAll {
                let per = send.count() / n;
                // SAFETY: see above.
                return self.launch("all_to_all", |_, c, st| unsafe { a2a(s, r, per, d, c, st) });
            }
        }
        let (sc, rc): (Vec<usize>, Vec<usize>) = match splits {
            Some(sp) => (sp.send_counts.clone(), sp.recv_counts.clone()),
            None => (vec![send.count() / n; n], vec![recv.count() / n; n]),
        };
        self.launch("all_to_all", |l, c, st| {
            group(l, || {
                let (mut so, mut ro) = (0usize, 0usize);
                for j in 0..n {
                    // SAFETY: see above; offsets stay within the validated counts.
                    let a = unsafe {
                        (l.Send)((s as *const u8).wrapping_add(so * es) as *const c_void, sc[j], d, j as c_int, c, st)
                    };
                    // SAFETY: as above.
                    let b = unsafe {
                        (l.Recv)((r as *mut u8).wrapping_add(ro * es) as *mut c_void, rc[j], d, j as c_int, c, st)
                    };
                    if a != sys::SUCCESS && a != sys::IN_PROGRESS {
                        return a;
                    }
                    if b != sys::SUCCESS && b != sys::IN_PROGRESS {
                        return b;
                    }
                    so += sc[j];
                    ro += rc[j];
                }
                sys::SUCCESS
            })
        })
    }

    fn send<'a>(&'a self, buf: Buf<'a>, peer: usize) -> Result<Work<'a>> {
        let (p, n, d) = (Self::ptr(&buf), buf.count(), dtype(buf.dtype()));
        // SAFETY: see above.
        self.launch("send", |l, c, st| unsafe { (l.Send)(p, n, d, peer as c_int, c, st) })
    }

    fn recv<'a>(&'a self, buf: BufMut<'a>, peer: usize) -> Result<Work<'a>> {
        let (p, n, d) = (Self::ptr_mut(&buf), buf.count(), dtype(buf.dtype()));
        // SAFETY: see above.
        self.launch("recv", |l, c, st| unsafe { (l.Recv)(p, n, d, peer as c_int, c, st) })
    }

    fn p2p_group<'a>(&'a self, ops: Vec<P2POp<'a>>) -> Result<Work<'a>> {
        self.launch("p2p_group", |l, c, st| {
            group(l, || {
                for o in &ops {
                    let code = match o {
                        // SAFETY: see above.
                        P2POp::Send(b, p) => unsafe {
                            (l.Send)(Self::ptr(b), b.count(), dtype(b.dtype()), *p as c_int, c, st)
                        },
                        // SAFETY: see above.
                        P2POp::Recv(b, p) => unsafe {
                            (l.Recv)(Self::ptr_mut(b), b.count(), dtype(b.dtype()), *p as c_int, c, st)
                        },
                    };
                    if code != sys::SUCCESS && code != sys::IN_PROGRESS {
                        return code;
                    }
                }
                sys::SUCCESS
            })
        })
    }

    fn barrier(&self) -> Result<Work<'_>> {
        let p = self.scratch.view().ptr() as *mut c_void;
        // SAFETY: the scratch element lives as long as the communicator.
        let (d, o) = (dtype(DType::F32), redop(ReduceOp::Sum));
        // SAFETY: see above.
        self.launch("barrier", |l, c, st| unsafe { (l.AllReduce)(p, p, 1, d, o, c, st) })
    }

    async fn health(&self, _deadline: Instant) -> Result<()> {
        self.poll_async("health").map(|_| ())
    }

    async fn abort(&self, _deadline: Instant) -> Result<()> {
        self.abort_now();
        Ok(())
    }

    async fn split(
        &self,
        color: Option<u32>,
        key: u32,
        name: &str,
        deadline: Instant,
    ) -> Result<Option<Arc<dyn Collective>>> {
        let Some(split) = self.lib.CommSplit else {
            return Err(Error::Unsupported {
                backend: "nccl",
                op: "split",
                what: "ncclCommSplit is missing from the loaded NCCL".into(),
            });
        };
        if let Some(e) = self.dead() {
            return Err(e);
        }
        self.cuda.bind()?;
        let col = color.map(|c| c as c_int).unwrap_or(sys::SPLIT_NOCOLOR);
        // NCCL writes the child handle asynchronously, through the pointer it was given.
        let slot = OutSlot::new();
        {
            let cname = CString::new(name.replace('\0', "")).unwrap_or_default();
            let mut cfg = sys::config(Some(&cname));
            let hd = self.lock();
            let hc = self.ctrl.lock().unwrap_or_else(|p| p.into_inner());
            let Some(c) = hc.0.or(hd.0) else { return Err(self.aborted_err()) };
            // SAFETY: live parent under the locks; the slot outlives the job; the config is
            // copied by NCCL before it returns.
            let code = unsafe { split(c, col, key as c_int, slot.ptr(), &mut cfg) };
            if code != sys::SUCCESS && code != sys::IN_PROGRESS {
                return Err(error(self.lib, "ncclCommSplit", code, Some(c), self.info.rank, &self.label));
            }
        }
        loop {
            // Poll the communicator the split ran on: NCCL writes the child into the slot
            // from that communicator's asynchronous job.
            match self.poll_ctrl("ncclCommSplit") {
                Ok(false) => break,
                Ok(true) => {}
                Err(e) => {
                    slot.leak();
                    return Err(e);
                }
            }
            if Instant::now() > deadline {
                slot.leak();
                return Err(self.timed_out("split", Duration::ZERO, "ncclCommSplit did not complete"));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let child = CommPtr::new(self.lib, slot.get());
        if child.get().is_null() {
            return Ok(None);
        }
        wait_init(self.lib, &child, "ncclCommSplit", self.info.rank, name, deadline).await?;
        drop(slot);
        let (mut n, mut r): (c_int, c_int) = (0, 0);
        // SAFETY: `child` is a live communicator used only here until wrapped.
        let sz = unsafe { comm_count_rank(self.lib, child.get(), &mut n, &mut r) };
        if !sz {
            return Err(Error::Backend {
                backend: "nccl",
                op: "ncclCommCount".into(),
                code: -1,
                text: "cannot read the new communicator's size".into(),
                recovery: anyccl_core::Recovery::Rebuild,
                source: None,
            });
        }
        let (ctrl, data) = NcclComm::data_comm(self.lib, child, r as usize, name, deadline).await?;
        let c: Arc<dyn Collective> = NcclComm::wrap(
            self.lib,
            self.cuda.clone(),
            ctrl,
            data,
            r as usize,
            n as usize,
            name,
            self.caps.clone(),
            self.op_timeout,
            self.enqueue_timeout,
        )?;
        Ok(Some(c))
    }

    async fn shutdown(&self, deadline: Instant) -> Result<()> {
        if self.freed.load(Ordering::Acquire) {
            return Ok(());
        }
        // Every enqueued operation completes first (bounded by the deadline) ...
        {
            self.cuda.bind()?;
            let ev = Event::record(&self.stream)?;
            let mut spins = 0u32;
            loop {
                if ev.done()? {
                    break;
                }
                self.poll_async("shutdown")?;
                if Instant::now() > deadline {
                    return Err(self.timed_out("shutdown", Duration::ZERO, "operations still running at the deadline"));
                }
                backoff(&mut spins);
            }
        }
        // ... then both NCCL communicators are released locally. ncclCommFinalize is a
        // collective flush that never returned for a blocking communicator split with shared
        // resources (H200, NCCL 2.28); with the stream drained there is nothing left to
        // flush, and ncclCommAbort frees the same resources without waiting on peers.
        self.release();
        Ok(())
    }
}

/// `ncclCommCount` and `ncclCommUserRank` through the loaded library.
///
/// # Safety
/// `comm` must be live and not used concurrently.
unsafe fn comm_count_rank(lib: &NcclLib, comm: ncclComm_t, n: &mut c_int, r: &mut c_int) -> bool {
    // SAFETY: per the caller.
    unsafe { (lib.CommCount)(comm, n) == sys::SUCCESS && (lib.CommUserRank)(comm, r) == sys::SUCCESS }
}
