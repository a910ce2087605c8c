//! A launch the library answers "in progress" (NCCL's non-blocking communicators while a
//! first call connects) forbids every other call on that communicator until the library
//! says it is done: a library standing in for one counts every call, event and stream
//! operation made while its launch is pending, and each case checks there was none.

use anyccl_core::{
    Capabilities, CommConfig, Communicator, ConnectOptions, DType, Device, DeviceKind, DeviceMemory, GroupSpec,
    HostMemory, MemInfo, MemoryStore, ReduceOp, Result, Store,
};
use anyccl_device::{
    DeviceComm, Launched, LibError, Library, Op, Plane, Poll, Runtime, Settings, SplitRequest, SplitStart,
};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long the library keeps a launch in progress.
const PENDING_FOR: Duration = Duration::from_millis(150);

/// What the stand-in saw.
#[derive(Debug, Default)]
struct Seen {
    /// When the launch in progress is done; `None` when none is.
    pending_until: Mutex<Option<Instant>>,
    /// The next launch answers "in progress".
    in_progress_next: AtomicBool,
    /// Calls made while a launch was pending, by name.
    violations: Mutex<Vec<&'static str>>,
    launches: AtomicU64,
    deregistered: AtomicU64,
}

impl Seen {
    fn pending(&self) -> bool {
        let mut p = self.pending_until.lock().unwrap_or_else(|e| e.into_inner());
        match *p {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                *p = None;
                false
            }
            None => false,
        }
    }
    /// Note `what` if a launch is pending.
    fn call(&self, what: &'static str) {
        if self.pending() {
            self.violations.lock().unwrap_or_else(|e| e.into_inner()).push(what);
        }
    }
    fn violations(&self) -> Vec<&'static str> {
        self.violations.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// A runtime whose streams run nothing (events are done when recorded); it notes events
/// recorded while the library's launch is pending, which would precede that launch.
#[derive(Debug)]
struct NullRuntime {
    seen: &'static Seen,
}

impl Runtime for NullRuntime {
    type Stream = ();
    type Event = ();
    type Memory = HostMemory;
    fn device(&self) -> Device {
        Device { kind: DeviceKind::Cpu, ordinal: 0 }
    }
    fn bind(&self) -> Result<()> {
        Ok(())
    }
    fn stream(self: &Arc<Self>) -> Result<()> {
        Ok(())
    }
    fn record(&self, _stream: &()) -> Result<()> {
        self.seen.call("record an event");
        Ok(())
    }
    fn done(&self, _event: &()) -> Result<bool> {
        Ok(true)
    }
    fn alloc(self: &Arc<Self>, dtype: DType, count: usize) -> Result<HostMemory> {
        Ok(HostMemory::new(dtype, count))
    }
    unsafe fn copy_to_device(&self, _dst: *mut u8, _src: &[u8]) -> Result<()> {
        Ok(())
    }
    unsafe fn copy_to_host(&self, _dst: &mut [u8], _src: *const u8) -> Result<()> {
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn mem_info(&self) -> Result<MemInfo> {
        Ok(MemInfo { free: 1 << 40, total: 1 << 40 })
    }
}

/// A library of one rank whose launches answer "in progress" when told to, for
/// [`PENDING_FOR`]; `async_error` (the one call allowed meanwhile) says when it is done.
#[derive(Debug)]
struct PendingLibrary {
    seen: &'static Seen,
}

impl Library for PendingLibrary {
    type Runtime = NullRuntime;
    type Comm = ();
    type Pending = ();
    fn backend(&self) -> &'static str {
        "pending"
    }
    fn capabilities(&self, _rt: &NullRuntime) -> Capabilities {
        Capabilities {
            device_kind: DeviceKind::Cpu,
            dtypes: DType::ALL.to_vec(),
            reduce_ops: vec![ReduceOp::Sum],
            all_to_all: false,
            all_to_all_v: false,
            p2p_group: false,
            abort_in_flight: true,
            split: false,
            lazy_connect: false,
            memory_stats: true,
            warmup_small_bytes: 8,
            warmup_large_bytes: 8,
            max_world_size: 1,
            detects_peer_failure: false,
            first_call_may_block: false,
            detects_mismatch: false,
            max_local_ranks: 1,
            streams: false,
            graphs: false,
            cta_settings: false,
            buffer_registration: true,
            windows: false,
        }
    }
    fn root_id_len(&self) -> usize {
        8
    }
    fn root_id(&self, _rt: &Arc<NullRuntime>) -> std::result::Result<Vec<u8>, LibError> {
        Ok(vec![0; 8])
    }
    fn init_start(
        &self,
        _rt: &Arc<NullRuntime>,
        _id: &[u8],
        _rank: usize,
        _size: usize,
        _settings: &Settings,
    ) -> std::result::Result<(), LibError> {
        Ok(())
    }
    fn poll(&self, _pending: &mut ()) -> std::result::Result<Poll<Option<()>>, LibError> {
        Ok(Poll::Ready(Some(())))
    }
    fn abandon(&self, _pending: ()) {}
    fn split_needs_members(&self) -> bool {
        false
    }
    fn split_start(&self, _parent: &(), _req: &SplitRequest<'_>) -> std::result::Result<SplitStart<()>, LibError> {
        Ok(SplitStart::ViaRootId)
    }
    fn rank_size(&self, _comm: &()) -> std::result::Result<(usize, usize), LibError> {
        Ok((0, 1))
    }
    unsafe fn launch(&self, _comm: &(), _stream: &(), _op: &Op) -> std::result::Result<Launched, LibError> {
        self.seen.call("launch");
        self.seen.launches.fetch_add(1, Ordering::Relaxed);
        if self.seen.in_progress_next.swap(false, Ordering::AcqRel) {
            *self.seen.pending_until.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + PENDING_FOR);
            return Ok(Launched::InProgress);
        }
        Ok(Launched::Enqueued)
    }
    fn async_error(&self, _comm: &(), _plane: Plane) -> std::result::Result<bool, LibError> {
        Ok(self.seen.pending())
    }
    fn can_stop_blocked(&self) -> bool {
        true
    }
    fn destroy(&self, _comm: &()) {
        self.seen.call("destroy");
    }
    fn memory_held(&self, _comm: &()) -> Option<u64> {
        self.seen.call("memory_held");
        Some(0)
    }
    unsafe fn register(
        &self,
        _comm: &(),
        _ptr: *mut std::ffi::c_void,
        _bytes: usize,
    ) -> std::result::Result<Option<usize>, LibError> {
        self.seen.call("register");
        Ok(Some(1))
    }
    fn deregister(&self, _comm: &(), _handle: usize) -> std::result::Result<(), LibError> {
        self.seen.call("deregister");
        self.seen.deregistered.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// A communicator of one rank over a fresh stand-in, and what the stand-in sees.
fn start(rt: &tokio::runtime::Runtime, name: &str) -> std::result::Result<(Communicator, &'static Seen), String> {
    let seen: &'static Seen = Box::leak(Box::default());
    let lib: &'static PendingLibrary = Box::leak(Box::new(PendingLibrary { seen }));
    let runtime = Arc::new(NullRuntime { seen });
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let config = CommConfig { op_timeout: Duration::from_secs(10), ..CommConfig::default() };
    let opts = ConnectOptions {
        rank: 0,
        size: 1,
        store,
        namespace: name.into(),
        device: runtime.device(),
        timeout: Duration::from_secs(10),
        op_timeout: config.op_timeout,
        config: config.clone(),
    };
    let dc = rt.block_on(DeviceComm::connect(lib, runtime, opts)).map_err(|e| e.to_string())?;
    let comm = Communicator::new(dc, GroupSpec::world(1, name), config).map_err(|e| e.to_string())?;
    Ok((comm, seen))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime")
}

/// The first launch answers "in progress"; everything `then` does must wait for it.
fn case(name: &str, then: impl FnOnce(&tokio::runtime::Runtime, &Communicator, &Seen) -> Result<()>) {
    let rt = runtime();
    let (comm, seen) = start(&rt, name).unwrap_or_else(|e| panic!("connect: {e}"));
    let mut buf = HostMemory::new(DType::F32, 4);
    seen.in_progress_next.store(true, Ordering::Release);
    let t = Instant::now();
    let mut w = comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum).expect("the first all_reduce is accepted");
    assert!(seen.pending(), "the stand-in answered in progress");
    then(&rt, &comm, seen).unwrap_or_else(|e| panic!("{name}: {e}"));
    let during = seen.violations();
    assert!(during.is_empty(), "{name}: called while the first launch was pending: {during:?}");
    // Whatever `then` did came after the pending launch was done (or did not call the library).
    let _ = w.wait(Duration::from_secs(10));
    drop(w);
    assert!(t.elapsed() >= PENDING_FOR, "{name}: finished before the pending launch was done");
    assert!(seen.violations().is_empty(), "{name}: {:?}", seen.violations());
}

mod pending {
    use super::*;

    #[test]
    fn the_next_launch_waits_for_it() {
        case("next-launch", |_, comm, seen| {
            let mut b = HostMemory::new(DType::F32, 4);
            let t = Instant::now();
            comm.all_reduce(None, b.view_mut(), ReduceOp::Sum)?.wait(Duration::from_secs(10))?;
            assert_eq!(seen.launches.load(Ordering::Relaxed), 2);
            assert!(t.elapsed() >= PENDING_FOR / 2, "the second launch did not wait: {:?}", t.elapsed());
            Ok(())
        });
    }

    #[test]
    fn shutdown_waits_for_it() {
        // Its drain records an event at the stream's end, which must follow the pending launch.
        case("shutdown", |rt, comm, _| rt.block_on(comm.shutdown()));
    }

    #[test]
    fn deregistering_waits_for_it() {
        let rt = runtime();
        let (comm, seen) = start(&rt, "deregister").unwrap_or_else(|e| panic!("connect: {e}"));
        let mem: Box<dyn DeviceMemory> = Box::new(HostMemory::new(DType::F32, 16));
        let reg = comm.register(mem).expect("registered");
        let mut buf = HostMemory::new(DType::F32, 4);
        seen.in_progress_next.store(true, Ordering::Release);
        let mut w = comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum).expect("accepted");
        assert!(seen.pending());
        drop(reg);
        assert_eq!(seen.deregistered.load(Ordering::Relaxed), 1, "deregistered once the launch was done");
        assert!(seen.violations().is_empty(), "{:?}", seen.violations());
        w.wait(Duration::from_secs(10)).expect("the all_reduce finishes");
    }

    #[test]
    fn memory_held_does_not_call_the_library_meanwhile() {
        let rt = runtime();
        let (comm, seen) = start(&rt, "memory-held").unwrap_or_else(|e| panic!("connect: {e}"));
        assert_eq!(comm.memory_held(), Some(0), "asked when nothing is pending");
        let mut buf = HostMemory::new(DType::F32, 4);
        seen.in_progress_next.store(true, Ordering::Release);
        let mut w = comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum).expect("accepted");
        assert_eq!(comm.memory_held(), None, "not known while a launch is pending");
        assert!(seen.violations().is_empty(), "{:?}", seen.violations());
        w.wait(Duration::from_secs(10)).expect("the all_reduce finishes");
        assert_eq!(comm.memory_held(), Some(0), "asked again once it is done");
    }
}
