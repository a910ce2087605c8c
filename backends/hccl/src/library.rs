//! HCCL as an [`anyccl_device::Library`]: what is HCCL's own (the config, root info,
//! sub-communicators, codes) on top of [`crate::result`]; lifecycle, watchdog, polling,
//! drain and shutdown are `anyccl-device`'s.
//!
//! HCCL has no abort. Its init blocks until every rank joined, and the first call of each
//! operator blocks while it sets up links; neither can be stopped from outside. So: init
//! runs on a helper thread and the caller waits with its deadline (on expiry the
//! communicator is destroyed when HCCL returns it); every communicator gets the
//! communicator's operation timeout as its own `hcclExecTimeOut`; a call blocked past the
//! enqueue timeout fails the communicator, and the call returns `Timeout` when HCCL's
//! own timeout (`HCCL_CONNECT_TIMEOUT` for link set-up) releases it.

use crate::acl::{Acl, AclStream};
use crate::result::{self as r, HcclError};
use crate::sys::{self, HcclComm, HcclCommConfig, HcclLib, HcclRootInfo, HcclSendRecvItem};
use anyccl_core::{Capabilities, DType, DeviceKind, ReduceOp};
use anyccl_device::{Init, Launched, Library, Op, Plane, Poll, Region, Runtime, Settings, SplitRequest, SplitStart};
use std::ffi::c_int;
use std::sync::{mpsc, Arc};

/// `HcclDataType` of an anyccl dtype (HCCL has every one).
fn dtype(d: DType) -> c_int {
    match d {
        DType::I8 => 0,
        DType::I32 => 2,
        DType::F16 => 3,
        DType::F32 => 4,
        DType::I64 => 5,
        DType::U64 => 6,
        DType::U8 => 7,
        DType::U32 => 9,
        DType::F64 => 10,
        DType::BF16 => 11,
    }
}

/// `HcclReduceOp`; HCCL has no average (declared in the capabilities, so the
/// `Communicator` never passes it).
fn redop(o: ReduceOp) -> c_int {
    match o {
        ReduceOp::Sum | ReduceOp::Avg => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    }
}

/// What the HCCL backend supports with the loaded library.
pub fn hccl_capabilities(lib: &HcclLib, devices: usize) -> Capabilities {
    Capabilities {
        device_kind: DeviceKind::Npu,
        dtypes: DType::ALL.to_vec(),
        // No HCCL_REDUCE_AVG: programs that average sum and scale themselves.
        reduce_ops: vec![ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min],
        all_to_all: lib.AlltoAll.is_some(),
        all_to_all_v: lib.AlltoAllV.is_some(),
        p2p_group: lib.BatchSendRecv.is_some(),
        // No HcclCommAbort: a call blocked in link set-up returns only at HCCL's timeout.
        abort_in_flight: false,
        // HcclCreateSubCommConfig where present, else a new root-info exchange.
        split: true,
        lazy_connect: true,
        // No per-communicator memory statistics: the warmup measures free memory.
        memory_stats: false,
        warmup_small_bytes: 8 << 10,
        warmup_large_bytes: 32 << 20,
        max_world_size: usize::MAX,
        max_local_ranks: devices,
        // Capture into an engine's ACL graph (`aclmdlRICaptureBegin` on its stream): the
        // all_reduce goes on the engine's capturing stream itself (`Acl::borrow_raw`).
        graphs: crate::sys::acl().is_ok_and(|a| a.CaptureGetInfo.is_some()),
        // Ordering with an engine's streams through ACL events.
        streams: crate::sys::acl().is_ok_and(|a| a.StreamWaitEvent.is_some()),
        cta_settings: false,
        buffer_registration: lib.CommRegister.is_some() && lib.CommDeregister.is_some(),
        // `HcclCommSymWinRegister` (CANN 9, Atlas A3 only) wants memory from
        // `HcommMemAlloc` and has no stand-in here to test against: not wired.
        windows: false,
        // Not verified on Ascend hardware: claimed only once measured there.
        detects_peer_failure: false,
        first_call_may_block: true,
        detects_mismatch: false,
    }
}

/// The HCCL library as the device layer drives it.
#[derive(Debug)]
pub struct HcclLibrary {
    pub(crate) lib: &'static HcclLib,
    pub(crate) devices: usize,
}

/// One HCCL communicator handle.
#[derive(Debug)]
pub struct HcclHandle(HcclComm);
// SAFETY: HCCL communicators may be used from any thread (one call at a time, which the
// device layer guarantees) with the device set.
unsafe impl Send for HcclHandle {}
// SAFETY: as above.
unsafe impl Sync for HcclHandle {}

/// An init or split in progress.
#[derive(Debug)]
pub enum HcclPending {
    /// A helper thread is inside `HcclCommInitRootInfoConfig`.
    Thread(mpsc::Receiver<Result<HcclHandle, HcclError>>),
    /// Finished synchronously (`None`: this rank joins no group).
    Ready(Option<HcclHandle>),
}

impl HcclLibrary {
    /// `HcclCommConfigInit`, with the settings HCCL honours for this library version.
    fn config(&self, s: &Settings) -> HcclCommConfig {
        let mut c = sys::comm_config_init();
        // SAFETY: no arguments.
        let cap = self.lib.GetCommConfigCapability.map(|f| unsafe { f() }).unwrap_or(0);
        if sys::CAP_BUFFER_SIZE < cap {
            if let Some(mb) = s.buffer_mb {
                c.hcclBufferSize = mb;
            }
        }
        if sys::CAP_COMM_NAME < cap {
            for (d, b) in c.hcclCommName.iter_mut().zip(s.name.bytes().filter(|&b| b != 0).take(127)) {
                *d = b as _;
            }
        }
        if sys::CAP_EXEC_TIMEOUT < cap {
            // Whole seconds, at least one: HCCL's own bound on a stuck operation.
            c.hcclExecTimeOut = s.op_timeout.as_secs().clamp(1, i32::MAX as u64) as i32;
        }
        c
    }
}

impl Library for HcclLibrary {
    type Runtime = Acl;
    type Comm = HcclHandle;
    type Pending = HcclPending;
    const ROOT_ID_LEN: usize = sys::ROOT_INFO_BYTES;

    fn backend(&self) -> &'static str {
        "hccl"
    }

    fn capabilities(&self, _rt: &Acl) -> Capabilities {
        hccl_capabilities(self.lib, self.devices)
    }

    fn root_id(&self) -> Result<Vec<u8>, HcclError> {
        r::get_root_info(self.lib)
    }

    fn init_start(&self, rt: &Arc<Acl>, init: Init<'_>) -> Result<HcclPending, HcclError> {
        let (root, rank, size) = (HcclRootInfo { internal: init.id_array() }, init.rank, init.size);
        let cfg = self.config(init.settings);
        let (lib, rt) = (self.lib, rt.clone());
        let (tx, rx) = mpsc::channel();
        let spawned = std::thread::Builder::new().name("anyccl-hccl-init".into()).spawn(move || {
            let made = match rt.bind() {
                // SAFETY: the device is set on this thread.
                Ok(()) => unsafe { r::comm_init_root_info_config(lib, size as u32, &root, rank as u32, &cfg) },
                Err(e) => Err(r::error(lib, &format!("aclrtSetDevice ({e})"), 15)),
            };
            match made {
                Ok(c) => {
                    // The waiter gave up (deadline): the communicator is nobody's; free it.
                    if let Err(mpsc::SendError(Ok(h))) = tx.send(Ok(HcclHandle(c))) {
                        // SAFETY: a live communicator that nothing else holds.
                        let _ = unsafe { r::comm_destroy(lib, h.0) };
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            }
        });
        match spawned {
            Ok(_) => Ok(HcclPending::Thread(rx)),
            Err(e) => Err(r::error(self.lib, &format!("starting the init thread ({e})"), 4)),
        }
    }

    fn poll(&self, p: &mut HcclPending) -> Result<Poll<Option<HcclHandle>>, HcclError> {
        match p {
            HcclPending::Ready(h) => Ok(Poll::Ready(h.take())),
            HcclPending::Thread(rx) => match rx.try_recv() {
                Ok(Ok(h)) => Ok(Poll::Ready(Some(h))),
                Ok(Err(e)) => Err(e),
                Err(mpsc::TryRecvError::Empty) => Ok(Poll::Pending),
                Err(mpsc::TryRecvError::Disconnected) => {
                    Err(r::error(self.lib, "HcclCommInitRootInfoConfig (init thread ended)", 4))
                }
            },
        }
    }

    fn abandon(&self, p: HcclPending) {
        match p {
            // Dropping the receiver makes the init thread free what HCCL returns.
            HcclPending::Thread(rx) => drop(rx),
            HcclPending::Ready(Some(h)) => self.destroy(&h),
            HcclPending::Ready(None) => {}
        }
    }

    fn split_needs_members(&self) -> bool {
        true
    }

    fn split_start(&self, parent: &HcclHandle, req: &SplitRequest<'_>) -> Result<SplitStart<HcclPending>, HcclError> {
        if self.lib.CreateSubCommConfig.is_none() {
            return Ok(SplitStart::ViaRootId);
        }
        let Some(me) = req.new_rank else {
            // Members create the sub-communicator among themselves; others have nothing to do.
            return Ok(SplitStart::Started(HcclPending::Ready(None)));
        };
        let mut ranks: Vec<u32> = req.members.iter().map(|&r| r as u32).collect();
        let mut cfg = self.config(req.settings);
        // SAFETY: live parent under the device layer's lock; the device is set.
        match unsafe { r::create_sub_comm_config(self.lib, parent.0, &mut ranks, req.id, me as u32, &mut cfg) }? {
            Some(c) => Ok(SplitStart::Started(HcclPending::Ready(Some(HcclHandle(c))))),
            None => Ok(SplitStart::ViaRootId),
        }
    }

    fn rank_size(&self, comm: &HcclHandle) -> Result<(usize, usize), HcclError> {
        // SAFETY: a live communicator not yet shared.
        unsafe { r::rank_size(self.lib, comm.0) }
    }

    unsafe fn launch(&self, comm: &HcclHandle, stream: &AclStream, op: &Op) -> Result<Launched, HcclError> {
        let (l, c, st) = (self.lib, comm.0, stream.raw);
        let m = |p: *const std::ffi::c_void| p as *mut std::ffi::c_void;
        // SAFETY: every call below is covered by this method's contract; the device layer
        // holds the communicator's lock and the device is set.
        unsafe {
            match *op {
                Op::AllReduce { send, recv, count, dtype: d, op } => {
                    r::all_reduce(l, m(send), recv, count as u64, dtype(d), redop(op), c, st)
                }
                Op::Reduce { send, recv, count, dtype: d, op, root } => {
                    r::reduce(l, m(send), recv, count as u64, dtype(d), redop(op), root as u32, c, st)
                }
                Op::Broadcast { send, recv, count, dtype: d, root } => {
                    // HCCL broadcasts in place: a root that sends from another buffer
                    // copies it into `recv` first, in stream order.
                    if !std::ptr::eq(send, recv) && r::rank_size(l, c)?.0 == root {
                        let bytes = count * d.size();
                        r::memcpy_async_d2d(recv, send, bytes, st)?;
                    }
                    r::broadcast(l, recv, count as u64, dtype(d), root as u32, c, st)
                }
                Op::AllGather { send, recv, count, dtype: d } => {
                    r::all_gather(l, m(send), recv, count as u64, dtype(d), c, st)
                }
                Op::ReduceScatter { send, recv, count, dtype: d, op } => {
                    r::reduce_scatter(l, m(send), recv, count as u64, dtype(d), redop(op), c, st)
                }
                Op::AllToAll { send, recv, count, dtype: d } => {
                    r::all_to_all(l, send, count as u64, dtype(d), recv, c, st)
                }
                Op::AllToAllV { send, recv, ref sends, ref recvs, dtype: d } => {
                    let v = |x: &[usize]| x.iter().map(|&y| y as u64).collect::<Vec<u64>>();
                    r::all_to_all_v(
                        l,
                        send,
                        &v(&sends.counts),
                        &v(&sends.displs),
                        recv,
                        &v(&recvs.counts),
                        &v(&recvs.displs),
                        dtype(d),
                        c,
                        st,
                    )
                }
                Op::Send { buf, count, dtype: d, peer } => {
                    r::send(l, m(buf), count as u64, dtype(d), peer as u32, c, st)
                }
                Op::Recv { buf, count, dtype: d, peer } => r::recv(l, buf, count as u64, dtype(d), peer as u32, c, st),
                Op::Group(ref ops) => {
                    let mut items: Vec<HcclSendRecvItem> = ops
                        .iter()
                        .map(|o| HcclSendRecvItem {
                            sendRecvType: if o.send { 0 } else { 1 },
                            buf: o.ptr,
                            count: o.count as u64,
                            dataType: dtype(o.dtype),
                            remoteRank: o.peer as u32,
                        })
                        .collect();
                    r::batch_send_recv(l, &mut items, c, st)
                }
                Op::Barrier { .. } => r::barrier(l, c, st),
            }
        }
        .map(|()| Launched::Enqueued)
    }

    fn async_error(&self, comm: &HcclHandle, _plane: Plane) -> Result<bool, HcclError> {
        // SAFETY: live handle under the device layer's lock.
        unsafe { r::get_comm_async_error(self.lib, comm.0) }.map(|()| false)
    }

    fn can_stop_blocked(&self) -> bool {
        false
    }

    fn destroy(&self, comm: &HcclHandle) {
        // SAFETY: called once per communicator by the device layer, with no call inside it.
        if let Err(e) = unsafe { r::comm_destroy(self.lib, comm.0) } {
            tracing::warn!("{e}");
        }
    }

    fn memory_held(&self, _comm: &HcclHandle) -> Option<u64> {
        None
    }

    unsafe fn register(&self, comm: &HcclHandle, at: Region) -> Result<Option<usize>, HcclError> {
        // SAFETY: a live handle under the device layer's lock; per the caller for the memory.
        unsafe { r::comm_register(self.lib, comm.0, at) }
    }

    fn deregister(&self, comm: &HcclHandle, handle: usize) -> Result<(), HcclError> {
        // SAFETY: a live handle under the device layer's lock; `handle` came from `register`
        // on it and the device layer deregisters it once.
        unsafe { r::comm_deregister(self.lib, comm.0, handle) }
    }
}
