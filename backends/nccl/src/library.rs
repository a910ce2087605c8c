//! NCCL as an [`anyccl_device::Library`]: what is NCCL's own (handles, config, the
//! control/data pair, codes) on top of [`crate::result`]; the machinery every device
//! library needs (lifecycle, watchdog, polling, drain, shutdown) is `anyccl-device`'s.
//!
//! Each anyccl communicator is two NCCL communicators: a non-blocking *control* one (init
//! and splits, bounded by deadlines) and a blocking *data* one split from it with shared
//! resources, so a warm operation launches synchronously (a non-blocking communicator
//! hands every launch to an asynchronous path, costing tens of microseconds each). A first
//! call that blocks while NCCL connects is bounded by the device layer's watchdog, which
//! aborts (NCCL's abort releases a blocked call). `ANYCCL_NCCL_BLOCKING=0` runs the data
//! plane on the control communicator.

use crate::cuda::{Cuda, Stream};
use crate::result::{self as r, NcclError};
use crate::sys::{self, ncclComm_t, ncclUniqueId, NcclLib};
use anyccl_core::{Capabilities, DType, ReduceOp};
use anyccl_device::{Ctas, Init, Launched, Library, Op, Parts, Plane, Poll, Region, SplitRequest, SplitStart};
use std::ffi::{c_int, c_void, CString};
use std::sync::Arc;

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

/// Whether the data plane runs on a blocking communicator (`ANYCCL_NCCL_BLOCKING`, `0` or
/// `1`, default on): read once; the backend's probe refuses a malformed value.
pub(crate) fn blocking_setting() -> anyccl_core::Result<bool> {
    // Read each time it is asked (at the probe and at each capabilities query): a
    // variable's read is cheap next to what follows, and the error is the parser's own.
    Ok(anyccl_core::env_flag("ANYCCL_NCCL_BLOCKING")?.unwrap_or(true))
}

/// [`blocking_setting`] once the probe has accepted it.
fn blocking_data_plane() -> bool {
    blocking_setting().unwrap_or(true)
}

/// What the NCCL backend supports with the loaded library.
pub fn nccl_capabilities(lib: &NcclLib, devices: usize) -> Capabilities {
    // The data plane is a blocking communicator split off the control one.
    let blocking_data = blocking_data_plane() && lib.CommSplit.is_some();
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
        graphs: true,
        streams: true,
        cta_settings: true,
        buffer_registration: lib.CommRegister.is_some() && lib.CommDeregister.is_some(),
        // Only on a blocking data communicator: a non-blocking one writes the window handle
        // after the call returned, into an out-parameter the call no longer owns.
        windows: lib.CommWindowRegister.is_some() && lib.CommWindowDeregister.is_some() && blocking_data,
        // NCCL reports neither: a dead peer leaves kernels waiting, a mismatched collective
        // runs with whatever arrives (NVIDIA/nccl#279).
        detects_peer_failure: false,
        // Enqueues can block on peers exactly when the data plane is blocking.
        first_call_may_block: blocking_data,
        detects_mismatch: false,
    }
}

/// The NCCL library as the device layer drives it.
#[derive(Debug)]
pub struct NcclLibrary {
    pub(crate) lib: &'static NcclLib,
}

/// One anyccl communicator's NCCL handles: the data communicator and, when separate, the
/// control communicator it was split from.
#[derive(Debug)]
pub struct NcclHandles {
    data: ncclComm_t,
    ctrl: Option<ncclComm_t>,
}
// SAFETY: NCCL communicator handles may be used from any thread as long as calls on one
// communicator are not concurrent, which the device layer guarantees.
unsafe impl Send for NcclHandles {}
// SAFETY: as above.
unsafe impl Sync for NcclHandles {}

/// A communicator not yet handed over: aborted when dropped, so every error path frees it.
#[derive(Debug)]
pub struct CommPtr {
    lib: &'static NcclLib,
    comm: ncclComm_t,
}

impl CommPtr {
    fn into_raw(mut self) -> ncclComm_t {
        std::mem::replace(&mut self.comm, std::ptr::null_mut())
    }
}

impl Drop for CommPtr {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: a live communicator that nothing else holds; not used again.
            let _ = unsafe { r::comm_abort(self.lib, self.comm) };
        }
    }
}

/// Heap storage for a `ncclComm_t*` out-parameter that NCCL may write asynchronously.
#[derive(Debug)]
pub struct OutSlot(Option<Box<ncclComm_t>>);

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

/// An init or split in progress. Fields drop in order: a half-built data communicator is
/// aborted before the control communicator it was split from.
#[derive(Debug)]
pub enum NcclPending {
    /// `parent` is splitting into `slot` (a user split, or the data split of `ctrl`).
    Splitting { parent: ncclComm_t, slot: OutSlot, data: bool, ctrl: Option<CommPtr>, ctas: Ctas },
    /// `comm` is being made ready (init, or after a split); `data` when it is the data
    /// communicator split from `ctrl`.
    Readying { comm: CommPtr, slot: OutSlot, data: bool, ctrl: Option<CommPtr>, ctas: Ctas },
    /// Taken apart by a poll.
    Done,
}
// SAFETY: the handles are only used by the task driving the init or split.
unsafe impl Send for NcclPending {}

/// The thread-block settings into NCCL's config (unset ones stay `NCCL_CONFIG_UNDEF_INT`:
/// NCCL's default, or its environment variable).
fn apply(cfg: &mut sys::ncclConfig_t, ctas: Ctas) {
    let int = |v: u32| c_int::try_from(v).unwrap_or(c_int::MAX);
    if let Some(v) = ctas.min {
        cfg.minCTAs = int(v);
    }
    // NCCL compares minCTAs with maxCTAs before filling in defaults, so a minimum alone
    // needs the default maximum (MAXCHANNELS, 64) spelt out.
    match (ctas.min, ctas.max) {
        (_, Some(v)) => cfg.maxCTAs = int(v),
        (Some(_), None) => cfg.maxCTAs = 64,
        (None, None) => {}
    }
    if let Some(v) = ctas.cga_cluster_size {
        cfg.cgaClusterSize = int(v);
    }
}

impl NcclLibrary {
    /// The state after `ctrl` is ready: its data communicator being split off, or the
    /// finished handles when the data plane runs on the control communicator.
    fn after_ctrl(&self, ctrl: CommPtr, ctas: Ctas) -> Result<(NcclPending, Option<NcclHandles>), NcclError> {
        if !(blocking_data_plane() && self.lib.CommSplit.is_some()) {
            return Ok((NcclPending::Done, Some(NcclHandles { data: ctrl.into_raw(), ctrl: None })));
        }
        let slot = OutSlot::new();
        let mut cfg = sys::config(None);
        cfg.blocking = 1;
        cfg.splitShare = 1;
        apply(&mut cfg, ctas);
        // SAFETY: `ctrl` is ready and used only by this task; the slot outlives the job.
        unsafe { r::comm_split(self.lib, ctrl.comm, 0, 0, slot.ptr(), &mut cfg) }?;
        Ok((NcclPending::Splitting { parent: ctrl.comm, slot, data: true, ctrl: Some(ctrl), ctas }, None))
    }
}

impl Library for NcclLibrary {
    type Runtime = Cuda;
    type Comm = NcclHandles;
    type Pending = NcclPending;
    const ROOT_ID_LEN: usize = 128;

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn capabilities(&self, _rt: &Cuda) -> Capabilities {
        nccl_capabilities(self.lib, crate::cuda::probe().unwrap_or(1))
    }

    fn root_id(&self) -> Result<Vec<u8>, NcclError> {
        r::get_unique_id(self.lib)
    }

    fn init_start(&self, _rt: &Arc<Cuda>, init: Init<'_>) -> Result<NcclPending, NcclError> {
        let (uid, rank, size, settings) =
            (ncclUniqueId { internal: init.id_array() }, init.rank, init.size, init.settings);
        // NCCL keeps the address of the out-parameter in its asynchronous init job and may
        // write through it until the communicator is ready: it lives in the pending state.
        let slot = OutSlot::new();
        let name = CString::new(settings.name.replace('\0', "")).unwrap_or_default();
        let mut cfg = sys::config(Some(&name));
        apply(&mut cfg, settings.ctas);
        // SAFETY: the slot outlives the job; the device is current (the device layer binds).
        unsafe { r::comm_init_rank_config(self.lib, slot.ptr(), size as c_int, uid, rank as c_int, &mut cfg) }?;
        let comm = CommPtr { lib: self.lib, comm: slot.get() };
        Ok(NcclPending::Readying { comm, slot, data: false, ctrl: None, ctas: settings.ctas })
    }

    fn poll(&self, p: &mut NcclPending) -> Result<Poll<Option<NcclHandles>>, NcclError> {
        match std::mem::replace(p, NcclPending::Done) {
            NcclPending::Done => Ok(Poll::Ready(None)),
            NcclPending::Splitting { parent, slot, data, ctrl, ctas } => {
                // NCCL writes the child into the slot from the parent's asynchronous job.
                // SAFETY: `parent` is live: the device layer polls a user split under the
                // parent's lock, and a data split's parent is `ctrl`, owned here.
                match unsafe { r::comm_get_async_error(self.lib, parent) } {
                    Ok(true) => {
                        *p = NcclPending::Splitting { parent, slot, data, ctrl, ctas };
                        Ok(Poll::Pending)
                    }
                    Err(e) => {
                        *p = NcclPending::Splitting { parent, slot, data, ctrl, ctas };
                        Err(e)
                    }
                    Ok(false) => {
                        let child = slot.get();
                        if child.is_null() {
                            if data {
                                *p = NcclPending::Splitting { parent, slot, data, ctrl, ctas };
                                return Err(NcclError {
                                    library: "NCCL",
                                    call: "ncclCommSplit (data)".into(),
                                    code: 3,
                                    name: "ncclInternalError",
                                    text: "NCCL returned no communicator".into(),
                                    kind: anyccl_device::ErrorKind::Internal,
                                });
                            }
                            return Ok(Poll::Ready(None));
                        }
                        *p = NcclPending::Readying {
                            comm: CommPtr { lib: self.lib, comm: child },
                            slot,
                            data,
                            ctrl,
                            ctas,
                        };
                        Ok(Poll::Pending)
                    }
                }
            }
            NcclPending::Readying { comm, slot, data, ctrl, ctas } => {
                // SAFETY: `comm` is the new communicator, used only by this task.
                match unsafe { r::comm_get_async_error(self.lib, comm.comm) } {
                    Ok(true) => {
                        *p = NcclPending::Readying { comm, slot, data, ctrl, ctas };
                        Ok(Poll::Pending)
                    }
                    Err(e) => {
                        *p = NcclPending::Readying { comm, slot, data, ctrl, ctas };
                        Err(e)
                    }
                    Ok(false) if data => {
                        drop(slot);
                        let data = comm.into_raw();
                        Ok(Poll::Ready(Some(NcclHandles { data, ctrl: ctrl.map(CommPtr::into_raw) })))
                    }
                    Ok(false) => {
                        drop(slot);
                        let (next, done) = self.after_ctrl(comm, ctas)?;
                        *p = next;
                        Ok(match done {
                            Some(h) => Poll::Ready(Some(h)),
                            None => Poll::Pending,
                        })
                    }
                }
            }
        }
    }

    fn abandon(&self, p: NcclPending) {
        match p {
            NcclPending::Splitting { slot, ctrl, .. } => {
                // The job may still write the slot; the control communicator is aborted.
                slot.leak();
                drop(ctrl);
            }
            NcclPending::Readying { comm, slot, ctrl, .. } => {
                slot.leak();
                drop(comm);
                drop(ctrl);
            }
            NcclPending::Done => {}
        }
    }

    fn split_needs_members(&self) -> bool {
        false
    }

    fn split_start(&self, parent: &NcclHandles, req: &SplitRequest<'_>) -> Result<SplitStart<NcclPending>, NcclError> {
        let c = parent.ctrl.unwrap_or(parent.data);
        let color = req.color.map(|c| c as c_int).unwrap_or(sys::SPLIT_NOCOLOR);
        let slot = OutSlot::new();
        let name = CString::new(req.settings.name.replace('\0', "")).unwrap_or_default();
        let mut cfg = sys::config(Some(&name));
        apply(&mut cfg, req.settings.ctas);
        // SAFETY: live parent under the device layer's lock; the slot outlives the job.
        unsafe { r::comm_split(self.lib, c, color, req.key as c_int, slot.ptr(), &mut cfg) }?;
        Ok(SplitStart::Started(NcclPending::Splitting {
            parent: c,
            slot,
            data: false,
            ctrl: None,
            ctas: req.settings.ctas,
        }))
    }

    fn rank_size(&self, comm: &NcclHandles) -> Result<(usize, usize), NcclError> {
        // SAFETY: a live communicator not yet shared.
        unsafe { r::comm_rank_size(self.lib, comm.data) }
    }

    unsafe fn launch(&self, comm: &NcclHandles, stream: &Stream, op: &Op) -> Result<Launched, NcclError> {
        let (l, c, st) = (self.lib, comm.data, stream.raw);
        // SAFETY: every call below is covered by this method's contract; the device layer
        // holds the communicator's lock and the device is current.
        let in_progress = unsafe {
            match *op {
                Op::AllReduce { send, recv, count, dtype: d, op } => {
                    r::all_reduce(l, send, recv, count, dtype(d), redop(op), c, st)
                }
                Op::Reduce { send, recv, count, dtype: d, op, root } => {
                    r::reduce(l, send, recv, count, dtype(d), redop(op), root as c_int, c, st)
                }
                Op::Broadcast { send, recv, count, dtype: d, root } => {
                    r::broadcast(l, send, recv, count, dtype(d), root as c_int, c, st)
                }
                Op::AllGather { send, recv, count, dtype: d } => r::all_gather(l, send, recv, count, dtype(d), c, st),
                Op::ReduceScatter { send, recv, count, dtype: d, op } => {
                    r::reduce_scatter(l, send, recv, count, dtype(d), redop(op), c, st)
                }
                Op::AllToAll { send, recv, count, dtype: d } => {
                    match r::all_to_all(l, send, recv, count, dtype(d), c, st) {
                        Some(res) => res,
                        None => {
                            let n = self.rank_size(comm)?.1;
                            let even = Parts::packed(&vec![count; n]);
                            pairwise(l, c, st, (send, &even), (recv, &even), d)
                        }
                    }
                }
                Op::AllToAllV { send, recv, ref sends, ref recvs, dtype: d } => {
                    pairwise(l, c, st, (send, sends), (recv, recvs), d)
                }
                Op::Send { buf, count, dtype: d, peer } => r::send(l, buf, count, dtype(d), peer as c_int, c, st),
                Op::Recv { buf, count, dtype: d, peer } => r::recv(l, buf, count, dtype(d), peer as c_int, c, st),
                Op::Group(ref ops) => r::group(l, || {
                    let mut any = false;
                    for o in ops {
                        any |= if o.send {
                            r::send(l, o.ptr, o.count, dtype(o.dtype), o.peer as c_int, c, st)?
                        } else {
                            r::recv(l, o.ptr, o.count, dtype(o.dtype), o.peer as c_int, c, st)?
                        };
                    }
                    Ok(any)
                }),
                Op::Barrier { scratch } => {
                    r::all_reduce(l, scratch, scratch, 1, dtype(DType::F32), redop(ReduceOp::Sum), c, st)
                }
            }
        }?;
        Ok(if in_progress { Launched::InProgress } else { Launched::Enqueued })
    }

    fn async_error(&self, comm: &NcclHandles, plane: Plane) -> Result<bool, NcclError> {
        let c = match plane {
            Plane::Data => comm.data,
            Plane::Control => comm.ctrl.unwrap_or(comm.data),
        };
        // SAFETY: live handle under the device layer's lock.
        unsafe { r::comm_get_async_error(self.lib, c) }
    }

    fn can_stop_blocked(&self) -> bool {
        // ncclCommAbort may run while another thread is blocked in a call on the
        // communicator, which it then releases (NCCL's documented way to unblock it).
        true
    }

    fn destroy(&self, comm: &NcclHandles) {
        // ncclCommFinalize is a collective flush that never returned for a blocking
        // communicator split with shared resources (H200, NCCL 2.28); the device layer
        // drains the stream first, and ncclCommAbort frees without waiting on peers. The
        // data communicator goes first: it was split from the control one.
        for c in std::iter::once(comm.data).chain(comm.ctrl) {
            // SAFETY: called once per communicator by the device layer.
            if let Err(e) = unsafe { r::comm_abort(self.lib, c) } {
                tracing::warn!("{e}");
            }
        }
    }

    fn memory_held(&self, comm: &NcclHandles) -> Option<u64> {
        // SAFETY: live handles under the device layer's lock.
        let data = unsafe { r::comm_mem_stats(self.lib, comm.data) }?;
        match comm.ctrl {
            // SAFETY: as above.
            Some(c) => Some(data + unsafe { r::comm_mem_stats(self.lib, c) }?),
            None => Some(data),
        }
    }

    unsafe fn register(&self, comm: &NcclHandles, at: Region) -> Result<Option<usize>, NcclError> {
        // On the data communicator, which runs the operations (the control one shares its
        // resources but launches nothing).
        // SAFETY: live handles under the device layer's lock; per the caller for the memory.
        unsafe { r::comm_register(self.lib, comm.data, at) }
    }

    fn deregister(&self, comm: &NcclHandles, handle: usize) -> Result<(), NcclError> {
        // SAFETY: live handles under the device layer's lock; `handle` came from `register`
        // on the same data communicator and the device layer deregisters it once.
        unsafe { r::comm_deregister(self.lib, comm.data, handle) }
    }

    fn window_refusal(&self, at: Region) -> Option<String> {
        crate::cuda::window_refusal(at.ptr, at.bytes)
    }

    unsafe fn register_window(&self, comm: &NcclHandles, at: Region) -> Result<Option<usize>, NcclError> {
        // On the data communicator, which runs the operations (as `register`).
        // SAFETY: live handles under the device layer's lock; per the caller for the memory.
        unsafe { r::comm_window_register(self.lib, comm.data, at) }
    }

    fn deregister_window(&self, comm: &NcclHandles, handle: usize) -> Result<(), NcclError> {
        // SAFETY: live handles under the device layer's lock; `handle` came from
        // `register_window` on the same data communicator, deregistered once.
        unsafe { r::comm_window_deregister(self.lib, comm.data, handle) }
    }
}

/// all_to_all as grouped sends and receives, one pair per peer.
///
/// # Safety
/// As [`Library::launch`]; offsets stay within the validated counts.
#[allow(clippy::too_many_arguments)]
unsafe fn pairwise(
    l: &NcclLib,
    c: ncclComm_t,
    st: sys::Stream,
    (send, sends): (*const c_void, &Parts),
    (recv, recvs): (*mut c_void, &Parts),
    d: DType,
) -> Result<bool, NcclError> {
    let (sc, sd, rc, rd) = (&sends.counts, &sends.displs, &recvs.counts, &recvs.displs);
    let es = d.size();
    r::group(l, || {
        let mut any = false;
        for j in 0..sc.len() {
            // SAFETY: per the caller.
            unsafe {
                any |= r::send(
                    l,
                    (send as *const u8).wrapping_add(sd[j] * es) as *const c_void,
                    sc[j],
                    dtype(d),
                    j as c_int,
                    c,
                    st,
                )?;
                any |= r::recv(
                    l,
                    (recv as *mut u8).wrapping_add(rd[j] * es) as *mut c_void,
                    rc[j],
                    dtype(d),
                    j as c_int,
                    c,
                    st,
                )?;
            }
        }
        Ok(any)
    })
}
