//! A runtime and a library that do nothing (`testing` feature), for measuring what the layer
//! itself costs and for tests that watch which calls the layer makes: every event is done
//! as soon as it is recorded, every launch is enqueued at once, no data moves, one rank.
//! What they answer and what they note is the [`Hooks`]' to say.

use crate::library::{Init, Launched, Library, Op, Plane, Poll, Region, SplitRequest, SplitStart};
use crate::runtime::Runtime;
use crate::LibError;
use anyccl_core::{
    Capabilities, CommConfig, Communicator, ConnectOptions, DType, Device, DeviceKind, GroupSpec, HostMemory, MemInfo,
    MemoryStore, ReduceOp, Result, Store,
};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What a test or benchmark makes the null runtime and library answer and note. Every
/// method has the do-nothing answer as its default.
pub trait Hooks: Send + Sync + fmt::Debug + 'static {
    /// Before each call into the runtime or the library that touches the communicator or
    /// its stream, by name (`launch`, `record an event`, `destroy`, `memory_held`,
    /// `register`, `deregister`).
    fn call(&self, what: &'static str) {
        let _ = what;
    }
    /// How a launch ends.
    fn launch(&self, op: &Op) -> Launched {
        let _ = op;
        Launched::Enqueued
    }
    /// Whether an asynchronous step (a launch that answered `InProgress`) still runs.
    fn in_progress(&self) -> bool {
        false
    }
    /// What the library says it holds.
    fn memory_held(&self) -> Option<u64> {
        None
    }
}

/// The hooks that answer everything with the defaults.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoHooks;

impl Hooks for NoHooks {}

/// A runtime whose streams run nothing: an event is done as soon as it is recorded, a stream
/// always. It counts the events recorded and made, and the questions whether an event or a
/// stream is done.
#[derive(Debug)]
pub struct NullRuntime {
    hooks: Arc<dyn Hooks>,
    records: AtomicU64,
    /// Events made (the rest of the records reused one).
    made: AtomicU64,
    /// Questions whether an event is done.
    queries: AtomicU64,
    /// Questions whether a stream is done.
    stream_queries: AtomicU64,
}

impl NullRuntime {
    /// A runtime with [`NoHooks`].
    pub fn new() -> Self {
        Self::with_hooks(Arc::new(NoHooks))
    }

    /// A runtime that reports to `hooks`.
    pub fn with_hooks(hooks: Arc<dyn Hooks>) -> Self {
        NullRuntime {
            hooks,
            records: AtomicU64::new(0),
            made: AtomicU64::new(0),
            queries: AtomicU64::new(0),
            stream_queries: AtomicU64::new(0),
        }
    }

    /// Events recorded so far.
    pub fn records(&self) -> u64 {
        self.records.load(Ordering::Relaxed)
    }

    /// Events made so far (a record that reused an event made none).
    pub fn events_made(&self) -> u64 {
        self.made.load(Ordering::Relaxed)
    }

    /// Times it was asked whether an event is done.
    pub fn queries(&self) -> u64 {
        self.queries.load(Ordering::Relaxed)
    }

    /// Times it was asked whether a stream is done.
    pub fn stream_queries(&self) -> u64 {
        self.stream_queries.load(Ordering::Relaxed)
    }
}

impl Default for NullRuntime {
    fn default() -> Self {
        Self::new()
    }
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
        self.hooks.call("record an event");
        self.records.fetch_add(1, Ordering::Relaxed);
        self.made.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn record_again(&self, _event: &(), _stream: &()) -> Result<()> {
        self.hooks.call("record an event");
        self.records.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn done(&self, _event: &()) -> Result<bool> {
        self.queries.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }
    fn stream_done(&self, _stream: &()) -> Result<Option<bool>> {
        self.stream_queries.fetch_add(1, Ordering::Relaxed);
        Ok(Some(true))
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

/// A collective library of one rank that enqueues every operation at once and moves no
/// data; its capabilities are a field a test may change (registration, memory statistics).
#[derive(Debug)]
pub struct NullLibrary {
    hooks: Arc<dyn Hooks>,
    /// What it says its communicators support.
    pub capabilities: Capabilities,
    registered: AtomicU64,
}

impl Default for NullLibrary {
    fn default() -> Self {
        Self::with_hooks(Arc::new(NoHooks))
    }
}

impl NullLibrary {
    /// A library that reports to `hooks`, with the capabilities of one rank that supports
    /// every dtype and `Sum`.
    pub fn with_hooks(hooks: Arc<dyn Hooks>) -> Self {
        let capabilities = Capabilities {
            device_kind: DeviceKind::Cpu,
            dtypes: DType::ALL.to_vec(),
            reduce_ops: vec![ReduceOp::Sum],
            all_to_all: false,
            all_to_all_v: false,
            p2p_group: false,
            abort_in_flight: true,
            split: false,
            lazy_connect: false,
            memory_stats: false,
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
            buffer_registration: false,
            windows: false,
        };
        NullLibrary { hooks, capabilities, registered: AtomicU64::new(0) }
    }

    /// This library for the process's life, as [`crate::DeviceComm`] needs it.
    pub fn leak(self) -> &'static NullLibrary {
        Box::leak(Box::new(self))
    }

    /// Connect a `Communicator` of one rank named `name` over this library and `runtime`
    /// (an in-memory store, ten-second deadlines), with `config`.
    ///
    /// # Errors
    /// The layer's.
    pub async fn communicator(
        &'static self,
        runtime: Arc<NullRuntime>,
        name: &str,
        config: CommConfig,
    ) -> Result<Communicator> {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
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
        let dc = crate::DeviceComm::connect(self, runtime, opts).await?;
        Communicator::new(dc, GroupSpec::world(1, name), config)
    }
}

impl Library for NullLibrary {
    type Runtime = NullRuntime;
    type Comm = ();
    type Pending = ();
    fn backend(&self) -> &'static str {
        "null"
    }
    fn capabilities(&self, _rt: &NullRuntime) -> Capabilities {
        self.capabilities.clone()
    }
    const ROOT_ID_LEN: usize = 8;
    fn root_id(&self) -> std::result::Result<Vec<u8>, LibError> {
        Ok(vec![0; 8])
    }
    fn init_start(&self, _rt: &Arc<NullRuntime>, _init: Init<'_>) -> std::result::Result<(), LibError> {
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
    unsafe fn launch(&self, _comm: &(), _stream: &(), op: &Op) -> std::result::Result<Launched, LibError> {
        self.hooks.call("launch");
        Ok(self.hooks.launch(op))
    }
    fn async_error(&self, _comm: &(), _plane: Plane) -> std::result::Result<bool, LibError> {
        Ok(self.hooks.in_progress())
    }
    fn can_stop_blocked(&self) -> bool {
        true
    }
    fn destroy(&self, _comm: &()) {
        self.hooks.call("destroy");
    }
    fn memory_held(&self, _comm: &()) -> Option<u64> {
        self.hooks.call("memory_held");
        self.hooks.memory_held()
    }
    unsafe fn register(&self, _comm: &(), _at: Region) -> std::result::Result<Option<usize>, LibError> {
        self.hooks.call("register");
        if !self.capabilities.buffer_registration {
            return Ok(None);
        }
        Ok(Some(self.registered.fetch_add(1, Ordering::Relaxed) as usize + 1))
    }
    fn deregister(&self, _comm: &(), _handle: usize) -> std::result::Result<(), LibError> {
        self.hooks.call("deregister");
        Ok(())
    }
}
