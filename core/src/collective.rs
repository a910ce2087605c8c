//! The implementor contract (`Collective`) and the backend factory (`Backend`).

use crate::buffer::{Buf, BufMut, Device, StreamRef};
use crate::capability::Capabilities;
use crate::dtype::ReduceOp;
use crate::error::Result;
use crate::platform::Platform;
use crate::store::Store;
use crate::work::Work;
use async_trait::async_trait;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A library's handle for a registered buffer ([`Collective::register`]): an address-sized
/// value only the backend that issued it interprets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegHandle(pub usize);

/// Who a backend communicator is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommInfo {
    /// Backend name (`cpu`, `nccl`, `hccl`).
    pub backend: &'static str,
    /// Rank in this communicator.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// The device its buffers live on.
    pub device: Device,
}

impl CommInfo {
    /// This backend and rank, for errors that name no group (what the backend lacks);
    /// [`crate::Communicator`] adds its group to the rest.
    pub fn ctx(&self) -> crate::Ctx {
        crate::Ctx::new(self.backend, self.rank, "")
    }
}

/// An operation put into an engine's stream capture ([`Collective::capture`]), by device
/// address: the graph reads and writes these buffers at every replay, long after the call
/// (the `Captured` the Communicator returns keeps them allocated).
#[derive(Debug, Clone, Copy)]
pub enum GraphOp {
    /// all_reduce of `count` elements; `send == recv` in place.
    AllReduce {
        /// Input.
        send: *const u8,
        /// Output.
        recv: *mut u8,
        /// Elements.
        count: usize,
        /// Element type.
        dtype: crate::dtype::DType,
        /// Reduction.
        op: ReduceOp,
    },
}

/// One point-to-point operation of a batched group.
#[derive(Debug)]
pub enum P2POp<'a> {
    /// Send the buffer to `peer`.
    Send(Buf<'a>, usize),
    /// Receive into the buffer from `peer`.
    Recv(BufMut<'a>, usize),
}

impl P2POp<'_> {
    /// The peer rank.
    pub fn peer(&self) -> usize {
        match self {
            P2POp::Send(_, p) | P2POp::Recv(_, p) => *p,
        }
    }
}

/// Explicit per-peer element counts for all_to_all; data for peer `j` is contiguous and in
/// peer order in both buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllToAllSplits {
    /// Elements this rank sends to each peer.
    pub send_counts: Vec<usize>,
    /// Elements this rank receives from each peer.
    pub recv_counts: Vec<usize>,
}

/// The implementor contract: what a backend communicator provides.
///
/// Data-plane methods enqueue and return a [`Work`] without waiting for peers. Lifecycle
/// methods may wait on peers and always take a deadline. Arguments reaching these methods
/// have been validated by [`crate::Communicator`]; backends may assume they are valid.
///
/// In-place operations pass `send: None`: all_reduce and reduce use `recv` as input and
/// output; broadcast's root sends `recv`; all_gather takes this rank's input from its own
/// chunk of `recv`; reduce_scatter takes the whole `recv` as input and leaves this rank's
/// result in its own chunk.
#[async_trait]
pub trait Collective: Send + Sync + fmt::Debug + 'static {
    /// Backend, rank, size and device.
    fn info(&self) -> &CommInfo;
    /// What this communicator supports.
    fn capabilities(&self) -> &Capabilities;
    /// Bytes of device memory this communicator itself holds, where the backend can count
    /// them (`Capabilities::memory_stats`); `None` otherwise. Never waits for peers.
    fn memory_held(&self) -> Option<u64> {
        None
    }
    /// How this communicator runs `op` (an operation's name: "all_reduce", "broadcast",
    /// "sendrecv"...) on a receive buffer of `bytes` bytes: the algorithm and the transport,
    /// in words, for benchmarks and logs to print beside their numbers, so that a slow run
    /// can be told from a fast one. `None` where the library chooses inside each call, or
    /// for an operation the backend does not name.
    fn path(&self, op: &str, bytes: usize) -> Option<String> {
        let _ = (op, bytes);
        None
    }

    /// Element-wise reduction of every rank's input, result on every rank.
    fn all_reduce<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp) -> Result<Work<'a>>;
    /// Element-wise reduction, result on `root` only (`recv` is written on the root only).
    fn reduce<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp, root: usize) -> Result<Work<'a>>;
    /// `root`'s data to every rank (`send` is read on the root only).
    fn broadcast<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, root: usize) -> Result<Work<'a>>;
    /// Every rank's input, concatenated in rank order, on every rank.
    fn all_gather<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>) -> Result<Work<'a>>;
    /// Reduction of every rank's input, chunk `r` of the result on rank `r`.
    fn reduce_scatter<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp) -> Result<Work<'a>>;
    /// Chunk `j` of each rank's input to rank `j`; equal chunks unless `splits` is given.
    fn all_to_all<'a>(&'a self, send: Buf<'a>, recv: BufMut<'a>, splits: Option<&AllToAllSplits>) -> Result<Work<'a>>;
    /// Send to `peer`.
    fn send<'a>(&'a self, buf: Buf<'a>, peer: usize) -> Result<Work<'a>>;
    /// Receive from `peer`.
    fn recv<'a>(&'a self, buf: BufMut<'a>, peer: usize) -> Result<Work<'a>>;
    /// Several sends and receives issued together; they cannot deadlock on ordering.
    fn p2p_group<'a>(&'a self, ops: Vec<P2POp<'a>>) -> Result<Work<'a>>;
    /// Completes once every rank has entered it.
    fn barrier(&self) -> Result<Work<'_>>;

    /// Operations issued on this communicator after this call start only once the device
    /// has done the work enqueued on `stream` so far; the host does not wait
    /// (`Capabilities::streams`; `stream` is on this communicator's device).
    fn wait_stream(&self, stream: StreamRef<'_>) -> Result<()> {
        let _ = stream;
        Err(self.info().ctx().unsupported("wait_stream", "ordering with an engine's streams"))
    }
    /// Work enqueued on `stream` after this call starts only once every operation issued
    /// on this communicator so far has finished on the device; the host does not wait.
    fn signal_stream(&self, stream: StreamRef<'_>) -> Result<()> {
        let _ = stream;
        Err(self.info().ctx().unsupported("signal_stream", "ordering with an engine's streams"))
    }

    /// Put `op` into the capture under way on `stream` (a CUDA or ACL graph being recorded): it
    /// becomes part of the graph and runs at every replay; nothing runs now and no `Work`
    /// follows (`Capabilities::graphs`). The addresses were validated by the
    /// Communicator, which keeps the buffers allocated for as long as the graph may replay.
    fn capture(&self, stream: StreamRef<'_>, op: GraphOp) -> Result<()> {
        let _ = (stream, op);
        Err(self.info().ctx().unsupported("capture", "graph capture"))
    }

    /// Run `op` now, in stream order only: no `Work` and no completion marker (the engine
    /// orders its stream after it with [`Collective::signal_stream`]); `Capabilities::streams`.
    /// The Communicator keeps the buffers allocated.
    fn enqueue(&self, op: GraphOp) -> Result<()> {
        let _ = op;
        Err(self.info().ctx().unsupported("enqueue", "operations in stream order only"))
    }

    /// Register the memory `buf` views with the communicator, so the library may move data
    /// to and from it without its own staging copies (NCCL's `ncclCommRegister`, HCCL's
    /// `HcclCommRegister`); `Capabilities::buffer_registration`. Returns the library's handle,
    /// `None` where the backend has nothing to register. The Communicator validated the
    /// buffer and keeps it allocated until [`Collective::deregister`].
    fn register(&self, buf: Buf<'_>) -> Result<Option<RegHandle>> {
        let _ = buf;
        Ok(None)
    }

    /// Undo a [`Collective::register`] (a no-op once the communicator is freed: the library
    /// drops its registrations with it).
    fn deregister(&self, handle: RegHandle) -> Result<()> {
        let _ = handle;
        Ok(())
    }

    /// Register the memory `buf` views as a *window* of this communicator (NCCL's
    /// `ncclCommWindowRegister` with `NCCL_WIN_COLL_SYMMETRIC`); `Capabilities::windows`. Collective: every member calls it,
    /// in the same order relative to its other windows, with the same number of bytes; the
    /// backend compares the sizes across members ([`crate::agree_window`]) before the library
    /// sees them, and returns by `deadline`. With `refusal` (the Communicator found the buffer
    /// unfit, and says why) the backend only tells the other members, so that every member
    /// fails alike and counts the window (the Communicator returns its own error). `None`
    /// where the backend has no windows. The Communicator validated the buffer otherwise and keeps it allocated
    /// until [`Collective::deregister_window`].
    async fn register_window(
        &self,
        buf: Buf<'_>,
        refusal: Option<&str>,
        deadline: Instant,
    ) -> Result<Option<RegHandle>> {
        let _ = (buf, refusal, deadline);
        Ok(None)
    }

    /// Undo a [`Collective::register_window`]: collective where the library's is (every
    /// member drops its windows in the same order); a no-op once the communicator is freed.
    fn deregister_window(&self, handle: RegHandle) -> Result<()> {
        let _ = handle;
        Ok(())
    }

    /// Report an asynchronous failure of the communicator, if any (`Ok` when healthy).
    async fn health(&self, deadline: Instant) -> Result<()>;
    /// Stop every pending operation on this rank (they fail with `Aborted`); the
    /// communicator is unusable afterwards. Callable from any thread, repeatedly.
    async fn abort(&self, deadline: Instant) -> Result<()>;
    /// Collective over every rank of this communicator: ranks passing the same `color`
    /// form a new communicator named `name`, ordered by `key` (ties by rank); `None` joins
    /// none. Every rank must call it, in the same order relative to other splits.
    async fn split(
        &self,
        color: Option<u32>,
        key: u32,
        name: &str,
        deadline: Instant,
    ) -> Result<Option<Arc<dyn Collective>>>;
    /// Flush and release the communicator; idempotent.
    async fn shutdown(&self, deadline: Instant) -> Result<()>;
}

/// Abort every communicator in `comms`, giving each `within` (see [`Collective::abort`]).
/// Needs no async runtime, so watchdog threads and failure paths can call it.
pub fn abort_all(comms: &[Arc<dyn Collective>], within: Duration) {
    for c in comms {
        let _ = futures::executor::block_on(c.abort(Instant::now() + within));
    }
}

/// Options for [`Backend::connect`].
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Rendezvous store shared by all ranks.
    pub store: Arc<dyn Store>,
    /// Key prefix, unique to this communicator within the store.
    pub namespace: String,
    /// Device this rank uses.
    pub device: Device,
    /// How long connecting may take.
    pub timeout: Duration,
    /// How long one operation may take (`CommConfig::op_timeout`). A backend whose first
    /// call blocks while it connects bounds that call by this.
    pub op_timeout: Duration,
    /// The communicator's whole configuration, for per-communicator library settings
    /// (buffer sizes, execution timeouts) that a backend passes to its library.
    pub config: crate::config::CommConfig,
}

/// What a successful probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendInfo {
    /// Backend name.
    pub name: &'static str,
    /// Library version, when there is one.
    pub version: String,
    /// Devices visible to it.
    pub devices: usize,
}

/// A backend: probes its libraries, provides the device layer and connects communicators.
#[async_trait]
pub trait Backend: Send + Sync + fmt::Debug {
    /// Backend name.
    fn name(&self) -> &'static str;
    /// Whether the backend can run here.
    ///
    /// # Errors
    /// [`crate::Error::Unavailable`] listing everything looked for and where; never panics.
    fn probe(&self) -> Result<BackendInfo>;
    /// What communicators of this backend support (after a successful probe).
    ///
    /// # Errors
    /// As [`Backend::probe`].
    fn capabilities(&self) -> Result<Capabilities>;
    /// The device layer for local rank `local_rank`.
    ///
    /// # Errors
    /// As [`Backend::probe`], or when that device does not exist.
    fn platform(&self, local_rank: usize) -> Result<Arc<dyn Platform>>;
    /// The settings that choose this backend's algorithms and transports for communicators
    /// connected now (size thresholds and the like, after the environment's overrides), as
    /// `(name, value)` pairs that benchmarks and logs print; empty when it has none.
    fn tuning(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// Build a communicator among `opts.size` ranks; every rank calls this.
    ///
    /// # Errors
    /// `Timeout` when not all ranks arrive in time; `Unavailable` when the backend cannot run.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropping the future leaves the other ranks waiting until their deadline.
    async fn connect(&self, opts: ConnectOptions) -> Result<Arc<dyn Collective>>;
}
