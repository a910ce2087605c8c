//! `Communicator`: what users hold. It validates every call once, numbers operations per
//! group, traces them and records them in the flight recorder.

use crate::buffer::{Buf, BufMut};
use crate::capability::Capabilities;
use crate::collective::{AllToAllSplits, Backend, Collective, CommInfo, ConnectOptions, P2POp};
use crate::config::CommConfig;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Ctx, Error, Result};
use crate::group::{spec_color, validate_spec, GroupSpec};
use crate::recorder::FlightRecorder;
use crate::store::Store;
use crate::work::{Issuer, Work};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod helpers;
mod issue;
mod meet;
mod register;
pub use register::{agree_window, Registered};
mod sleep;
mod streams;
pub use streams::Captured;
mod validate;

/// A communicator of one group: the user API over a backend's [`Collective`].
///
/// # Examples
/// Two ranks as threads of one process (a [`crate::MemoryStore`] for their rendezvous; a
/// job of processes uses the TCP store), every operation family, and a split:
/// ```
/// use anyccl_core::{CommConfig, Communicator, Device, GroupSpec, MemoryStore, P2POp, ReduceOp, Role, Store};
/// use std::sync::Arc;
///
/// fn rank(r: usize, store: Arc<dyn Store>) -> anyccl_core::Result<Vec<f32>> {
///     let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
///     let world = rt.block_on(Communicator::connect(
///         &anyccl_cpu::Cpu, GroupSpec::world(2, "doc"), r, store, Device::CPU, CommConfig::default(),
///     ))?;
///     // Reductions and broadcasts, in place.
///     let mut x = vec![r as f32 + 1.0; 4];
///     world.all_reduce_in_place(&mut x, ReduceOp::Sum)?; // [3, 3, 3, 3] on both ranks
///     world.broadcast_in_place(&mut x, 0)?;
///     // Gathers: each rank's 2 elements, in rank order.
///     let mut all = vec![0f32; 4];
///     world.all_gather_into(&[r as f32; 2], &mut all)?; // [0, 0, 1, 1]
///     // Reduce-scatter (each rank gets its reduced half) and all-to-all (chunk k to rank k).
///     let t = world.config().op_timeout;
///     let (mut half, mut swapped) = ([0f32; 2], [0f32; 4]);
///     let four = [1f32, 2.0, 3.0, 4.0];
///     let h = anyccl_core::BufMut::host(&mut half);
///     world.reduce_scatter(Some(anyccl_core::Buf::host(&four)), h, ReduceOp::Sum)?.wait(t)?;
///     let s = anyccl_core::BufMut::host(&mut swapped);
///     world.all_to_all(anyccl_core::Buf::host(&four), s, None)?.wait(t)?;
///     // Point to point, batched so that neither side waits for the other.
///     let (out, mut inbox) = ([r as f32; 3], [0f32; 3]);
///     let peer = 1 - r;
///     let ops = vec![P2POp::Send(anyccl_core::Buf::host(&out), peer), P2POp::Recv(anyccl_core::BufMut::host(&mut inbox), peer)];
///     world.p2p_group(ops)?.wait(world.config().op_timeout)?;
///     world.barrier_wait()?;
///     // A sub-group: here both ranks, as a data-parallel group.
///     let dp = rt.block_on(world.split(Some(GroupSpec::new("dp", vec![0, 1], "doc", Role::Data))))?;
///     if let Some(dp) = dp {
///         dp.all_reduce_in_place(&mut all, ReduceOp::Max)?;
///         rt.block_on(dp.shutdown())?;
///     }
///     rt.block_on(world.shutdown())?;
///     assert_eq!(half, if r == 0 { [2.0, 4.0] } else { [6.0, 8.0] });
///     assert_eq!(swapped, if r == 0 { [1.0, 2.0, 1.0, 2.0] } else { [3.0, 4.0, 3.0, 4.0] });
///     Ok(x.into_iter().chain(all).chain(inbox).collect())
/// }
///
/// let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
/// let other = { let s = store.clone(); std::thread::spawn(move || rank(1, s)) };
/// let mine = rank(0, store).expect("rank 0");
/// let theirs = other.join().expect("thread").expect("rank 1");
/// assert_eq!(&mine[..4], &[3.0; 4]);
/// assert_eq!(&mine[4..8], &[0.0, 0.0, 1.0, 1.0]);
/// assert_eq!(&mine[8..], &[1.0; 3]); // rank 1's message
/// assert_eq!(&theirs[8..], &[0.0; 3]);
/// ```
#[derive(Debug)]
// Laid out by hand: what every operation reads and writes comes first, in one cache line (a
// real library's launch pushes the communicator out of the caches between calls, and each
// line it touches again is a miss: measured with real NCCL launches, the sequence number,
// the recording flag and the name's count, each on its own line, were most of the
// `Communicator`'s own time per call).
#[repr(C, align(64))]
pub struct Communicator {
    inner: Arc<dyn Collective>,
    seq: AtomicU64,
    /// What calls are validated against.
    accepts: validate::Accepts,
    /// The flight recorder and this rank in the group (the backend's, copied here to be read
    /// with the rest) in the first line; the group's name after them. Each `Work` this
    /// communicator issues lends them.
    who: Issuer,
    /// Whether `recording` is on: checked on every operation without taking the lock.
    recording_on: std::sync::atomic::AtomicBool,
    /// This group's index in the flight recorder.
    group_id: u16,
    /// Detail mode's cross-member check of every collective (`CommConfig::detail`).
    detail: Option<crate::detail::Detail>,
    spec: Arc<GroupSpec>,
    config: CommConfig,
    /// While recording: the largest byte count per signature (op, dtype, size class, peer).
    recording: std::sync::Mutex<Option<std::collections::BTreeMap<SigKey, usize>>>,
    /// The store its members meet through (for sleep and wake), when it was connected or
    /// split from a connected one.
    store: Option<Arc<dyn Store>>,
    /// Its sleeps and wakes.
    sleeps: sleep::Sleeps,
}

/// The shape of one operation, as recorded for a warmup plan: distinct signatures of a real
/// step are what a later recovery must connect.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub struct OpSignature {
    /// Operation name (`all_reduce`, `send`, ...).
    pub op: String,
    /// Element type.
    pub dtype: Option<DType>,
    /// Size class: `floor(log2(bytes))` (0 for empty buffers).
    pub size_class: u32,
    /// Largest byte count seen in this class.
    pub bytes: usize,
    /// Peer (point-to-point; a batch gives one signature per peer, with the larger of the
    /// bytes sent to and received from it) or root (rooted collectives).
    pub peer: Option<usize>,
}

/// An [`OpSignature`] without its byte count.
type SigKey = (&'static str, Option<DType>, u32, Option<usize>);

/// Facts about one call, gathered by validation.
struct Call {
    op: &'static str,
    dtype: Option<DType>,
    count: usize,
    bytes: usize,
    peer: Option<usize>,
    redop: Option<ReduceOp>,
    /// A batch's peers with the larger of the bytes sent to and received from each: what a
    /// recording keeps of a batch (one signature per peer, as the library connects them).
    /// Made only while a recording is on ([`Communicator::p2p_group`]); empty otherwise.
    batch: Vec<(usize, usize)>,
    /// A batch of point-to-point operations (`batch` says what a recording keeps of it).
    batched: bool,
}

impl Call {
    /// A call on `count` elements of `dtype` moving `bytes` on this rank.
    fn new(op: &'static str, dtype: Option<DType>, count: usize, bytes: usize) -> Call {
        Call { op, dtype, count, bytes, peer: None, redop: None, batch: Vec::new(), batched: false }
    }
    /// With its peer (point-to-point) or root (rooted collectives).
    fn peer(self, p: usize) -> Call {
        self.peer_opt(Some(p))
    }
    fn peer_opt(self, peer: Option<usize>) -> Call {
        Call { peer, ..self }
    }
    /// With its reduce op.
    fn redop(self, r: ReduceOp) -> Call {
        Call { redop: Some(r), ..self }
    }
    /// What detail mode compares across members (see the `detail` module).
    fn fingerprint(&self) -> String {
        let mut f = format!("{} {} x{}", self.op, self.dtype.map(|d| d.name()).unwrap_or("-"), self.count);
        if let Some(r) = self.redop {
            f.push_str(&format!(" op={r}"));
        }
        if let Some(p) = self.peer {
            f.push_str(&format!(" root={p}"));
        }
        f
    }
    fn is_point_to_point(&self) -> bool {
        matches!(self.op, "send" | "recv" | "p2p_group")
    }
}

impl Communicator {
    /// Wrap a backend communicator created for `spec`.
    ///
    /// # Errors
    /// `InvalidArgument` when `spec` does not match the communicator's size.
    pub fn new(inner: Arc<dyn Collective>, spec: GroupSpec, config: CommConfig) -> Result<Self> {
        let recorder = FlightRecorder::new(config.flight_recorder);
        Self::with_recorder(inner, spec, config, recorder)
    }

    /// As [`Communicator::new`], sharing an existing flight recorder.
    ///
    /// # Errors
    /// As [`Communicator::new`].
    pub fn with_recorder(
        inner: Arc<dyn Collective>,
        spec: GroupSpec,
        config: CommConfig,
        recorder: Arc<FlightRecorder>,
    ) -> Result<Self> {
        let info = inner.info().clone();
        if spec.ranks.len() != info.size {
            let msg = format!("spec lists {} ranks, the communicator has {}", spec.ranks.len(), info.size);
            return Err(Ctx::new(info.backend, info.rank, spec.name.clone()).invalid("Communicator::new", "spec", msg));
        }
        let accepts = validate::Accepts::of(inner.capabilities(), info.device);
        let name: Arc<str> = Arc::from(spec.name.as_str());
        let group_id = recorder.intern(&name);
        Ok(Communicator {
            who: Issuer { recorder, rank: info.rank, name },
            inner,
            spec: Arc::new(spec),
            seq: AtomicU64::new(0),
            config,
            recording: std::sync::Mutex::new(None),
            recording_on: std::sync::atomic::AtomicBool::new(false),
            detail: None,
            accepts,
            group_id,
            store: None,
            sleeps: Default::default(),
        })
    }

    /// Start recording the distinct operation signatures issued on this communicator.
    pub fn start_recording(&self) {
        if let Ok(mut r) = self.recording.lock() {
            *r = Some(Default::default());
            self.recording_on.store(true, Ordering::Release);
        }
    }

    /// Stop recording and return what was recorded (empty when not recording).
    pub fn take_recording(&self) -> Vec<OpSignature> {
        self.recording_on.store(false, Ordering::Release);
        let recorded = self.recording.lock().ok().and_then(|mut r| r.take()).unwrap_or_default();
        recorded
            .into_iter()
            .map(|((op, dtype, size_class, peer), bytes)| OpSignature {
                op: op.to_string(),
                dtype,
                size_class,
                bytes,
                peer,
            })
            .collect()
    }

    /// Connect a new communicator for `spec` through `backend`; `rank` is this process's
    /// position in `spec.ranks`. Every member calls this.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad spec or rank, or a group larger than the backend's
    /// `max_world_size` (before any communication); otherwise as [`Backend::connect`].
    pub async fn connect(
        backend: &dyn Backend,
        spec: GroupSpec,
        rank: usize,
        store: Arc<dyn Store>,
        device: crate::buffer::Device,
        config: CommConfig,
    ) -> Result<Self> {
        validate_spec(&spec, rank, None)?;
        let caps = backend.capabilities()?;
        let ctx = Ctx::new(backend.name(), rank, spec.name.clone());
        let bad_config = |msg: String| ctx.invalid("connect", "config", msg);
        config.check().map_err(bad_config)?;
        let unsupported = config.cta_settings();
        if !caps.cta_settings && !unsupported.is_empty() {
            return Err(bad_config(format!(
                "the {} backend has no per-communicator thread-block settings; unset CommConfig::{} \
                 (ANYCCL_MIN_CTAS, ANYCCL_MAX_CTAS, ANYCCL_CGA_CLUSTER_SIZE)",
                backend.name(),
                unsupported.join(", ")
            )));
        }
        let max = caps.max_world_size;
        if spec.ranks.len() > max {
            let msg = format!("{} ranks, the {} backend supports at most {max}", spec.ranks.len(), backend.name());
            return Err(ctx.invalid("connect", "spec.ranks", msg));
        }
        let opts = ConnectOptions {
            rank,
            size: spec.ranks.len(),
            store,
            namespace: spec.name.clone(),
            device,
            timeout: config.init_timeout,
            op_timeout: config.op_timeout,
            config: config.clone(),
        };
        let detail = match config.detail {
            true => Some(crate::detail::Detail::new(opts.store.clone(), &spec.name, rank, spec.ranks.len()).await?),
            false => None,
        };
        let store = opts.store.clone();
        let inner = backend.connect(opts).await?;
        let mut c = Communicator::new(inner, spec, config)?;
        c.detail = detail;
        c.store = Some(store);
        Ok(c)
    }

    /// Backend, rank, size and device.
    pub fn info(&self) -> &CommInfo {
        self.inner.info()
    }
    /// This communicator's backend, rank and group, for the errors it raises.
    pub fn ctx(&self) -> Ctx {
        Ctx::new(self.inner.info().backend, self.rank(), self.spec.name.clone())
    }

    /// This rank in the group.
    pub fn rank(&self) -> usize {
        self.who.rank
    }
    /// Group size.
    pub fn size(&self) -> usize {
        self.inner.info().size
    }
    /// The group's name, members, owner and role.
    pub fn spec(&self) -> &GroupSpec {
        &self.spec
    }
    /// The backend's capabilities.
    pub fn capabilities(&self) -> &Capabilities {
        self.inner.capabilities()
    }
    /// Bytes of device memory the backend communicator itself holds, where the backend can
    /// count them (`Capabilities::memory_stats`).
    pub fn memory_held(&self) -> Option<u64> {
        self.inner.memory_held()
    }
    /// How the backend runs `op` on a receive buffer of `bytes` bytes, in words (see
    /// [`Collective::path`]); `None` where the library chooses inside each call.
    pub fn path(&self, op: &str, bytes: usize) -> Option<String> {
        self.inner.path(op, bytes)
    }
    /// The settings.
    pub fn config(&self) -> &CommConfig {
        &self.config
    }
    /// The flight recorder.
    pub fn flight_recorder(&self) -> &Arc<FlightRecorder> {
        &self.who.recorder
    }
    /// The backend communicator (for wrappers such as fault injection).
    pub fn collective(&self) -> &Arc<dyn Collective> {
        &self.inner
    }
    /// Operations issued so far.
    pub fn issued(&self) -> u64 {
        self.seq.load(Ordering::Relaxed)
    }

    /// Element-wise reduction across the group; `send: None` reduces `recv` in place.
    ///
    /// # Errors
    /// `InvalidArgument` (before any communication) for mismatched counts or dtypes,
    /// overlapping buffers, an unsupported dtype or op, or a buffer on the wrong device.
    pub fn all_reduce<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        const OP: &str = "all_reduce";
        self.check_pair(OP, &send, &recv)?;
        self.check_reduce_op(OP, op)?;
        self.check_same_count(OP, &send, &recv)?;
        let call = Call::new(OP, Some(recv.dtype()), recv.count(), recv.bytes()).redop(op);
        self.issue(call, |c| c.all_reduce(send, recv, op))
    }

    /// Element-wise reduction to `root`.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`], plus `root` out of range.
    pub fn reduce<'a>(
        &'a self,
        send: Option<Buf<'a>>,
        recv: BufMut<'a>,
        op: ReduceOp,
        root: usize,
    ) -> Result<Work<'a>> {
        const OP: &str = "reduce";
        self.check_rank(OP, "root", root)?;
        self.check_pair(OP, &send, &recv)?;
        self.check_reduce_op(OP, op)?;
        self.check_same_count(OP, &send, &recv)?;
        let call = Call::new(OP, Some(recv.dtype()), recv.count(), recv.bytes()).peer(root).redop(op);
        self.issue(call, |c| c.reduce(send, recv, op, root))
    }

    /// `root`'s buffer to every rank; `send: None` broadcasts `recv` in place.
    ///
    /// # Errors
    /// `InvalidArgument` for `root` out of range, mismatched counts, dtypes or devices.
    pub fn broadcast<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, root: usize) -> Result<Work<'a>> {
        const OP: &str = "broadcast";
        self.check_rank(OP, "root", root)?;
        self.check_pair(OP, &send, &recv)?;
        self.check_same_count(OP, &send, &recv)?;
        let call = Call::new(OP, Some(recv.dtype()), recv.count(), recv.bytes()).peer(root);
        self.issue(call, |c| c.broadcast(send, recv, root))
    }

    /// Every rank's `send` concatenated in rank order into `recv` (`size × send` elements).
    /// In place (`send: None`), this rank's input is its own chunk of `recv`.
    ///
    /// # Errors
    /// `InvalidArgument` when `recv` is not `size` times `send`, or not divisible in place.
    pub fn all_gather<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>) -> Result<Work<'a>> {
        const OP: &str = "all_gather";
        self.check_pair(OP, &send, &recv)?;
        self.check_gathered(&send, &recv)?;
        let call = Call::new(OP, Some(recv.dtype()), recv.count(), recv.bytes());
        self.issue(call, |c| c.all_gather(send, recv))
    }

    /// Reduction of every rank's `send` (`size × recv` elements); chunk `r` lands on rank
    /// `r`. In place (`send: None`), `recv` is the whole input and the result is this
    /// rank's chunk of it.
    ///
    /// # Errors
    /// `InvalidArgument` when `send` is not `size` times `recv`, or not divisible in place.
    pub fn reduce_scatter<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        const OP: &str = "reduce_scatter";
        self.check_pair(OP, &send, &recv)?;
        self.check_reduce_op(OP, op)?;
        self.check_scattered(&send, &recv)?;
        let count = send.as_ref().map(|s| s.count()).unwrap_or(recv.count());
        let call = Call::new(OP, Some(recv.dtype()), count, count * recv.dtype().size()).redop(op);
        self.issue(call, |c| c.reduce_scatter(send, recv, op))
    }

    /// Chunk `j` of `send` to rank `j`, chunk `i` of `recv` from rank `i`; equal chunks
    /// unless `splits` gives per-peer counts.
    ///
    /// # Errors
    /// `InvalidArgument` for counts that do not divide or do not add up.
    pub fn all_to_all<'a>(
        &'a self,
        send: Buf<'a>,
        recv: BufMut<'a>,
        splits: Option<&AllToAllSplits>,
    ) -> Result<Work<'a>> {
        const OP: &str = "all_to_all";
        let s = Some(send);
        self.check_pair(OP, &s, &recv)?;
        self.check_all_to_all(&send, &recv, splits)?;
        let call = Call::new(OP, Some(recv.dtype()), send.count(), send.bytes());
        self.issue(call, |c| c.all_to_all(send, recv, splits))
    }

    /// Send `buf` to `peer` (not this rank; use a [`Communicator::p2p_group`] for that).
    ///
    /// # Errors
    /// `InvalidArgument` for a peer out of range or equal to this rank.
    pub fn send<'a>(&'a self, buf: Buf<'a>, peer: usize) -> Result<Work<'a>> {
        const OP: &str = "send";
        self.check_p2p_peer(OP, peer, false)?;
        self.check_dtype(OP, "buf", buf.dtype())?;
        self.check_device(OP, "buf", buf.device())?;
        let call = Call::new(OP, Some(buf.dtype()), buf.count(), buf.bytes()).peer(peer);
        self.issue(call, |c| c.send(buf, peer))
    }

    /// Receive into `buf` from `peer`; the sender's count must match.
    ///
    /// # Errors
    /// `InvalidArgument` for a peer out of range or equal to this rank.
    pub fn recv<'a>(&'a self, buf: BufMut<'a>, peer: usize) -> Result<Work<'a>> {
        const OP: &str = "recv";
        self.check_p2p_peer(OP, peer, false)?;
        self.check_dtype(OP, "buf", buf.dtype())?;
        self.check_device(OP, "buf", buf.device())?;
        let call = Call::new(OP, Some(buf.dtype()), buf.count(), buf.bytes()).peer(peer);
        self.issue(call, |c| c.recv(buf, peer))
    }

    /// Sends and receives issued as one batch, which cannot deadlock on ordering.
    ///
    /// # Errors
    /// `InvalidArgument` for an empty batch, a peer out of range, or a bad buffer.
    pub fn p2p_group<'a>(&'a self, ops: Vec<P2POp<'a>>) -> Result<Work<'a>> {
        const OP: &str = "p2p_group";
        let (dtype, bytes) = self.check_p2p_batch(&ops)?;
        let first = ops[0].peer();
        let peer = ops.iter().all(|o| o.peer() == first).then_some(first);
        let mut call = Call { batched: true, ..Call::new(OP, dtype, ops.len(), bytes).peer_opt(peer) };
        // Only a recording keeps it (every call would otherwise allocate it).
        if self.recording_on.load(std::sync::atomic::Ordering::Acquire) {
            call.batch = Self::batch_signature(&ops);
        }
        self.issue(call, |c| c.p2p_group(ops))
    }

    /// A batch's peers with the larger of the bytes sent to and received from each, in
    /// the order of their first operation ([`Call`]'s `batch`).
    fn batch_signature(ops: &[P2POp<'_>]) -> Vec<(usize, usize)> {
        let mut batch: Vec<(usize, usize, usize)> = Vec::new();
        for o in ops {
            let (p, b, send) = match o {
                P2POp::Send(b, p) => (*p, b.bytes(), true),
                P2POp::Recv(b, p) => (*p, b.bytes(), false),
            };
            let i = batch.iter().position(|e| e.0 == p).unwrap_or_else(|| {
                batch.push((p, 0, 0));
                batch.len() - 1
            });
            if send {
                batch[i].1 += b;
            } else {
                batch[i].2 += b;
            }
        }
        batch.into_iter().map(|(p, s, r)| (p, s.max(r))).collect()
    }

    /// Completes once every rank has entered it.
    ///
    /// # Errors
    /// As the backend's barrier.
    pub fn barrier(&self) -> Result<Work<'_>> {
        let call = Call::new("barrier", None, 0, 0);
        self.issue(call, |c| c.barrier())
    }

    /// Report an asynchronous failure, if any.
    ///
    /// # Errors
    /// The failure.
    pub async fn health(&self) -> Result<()> {
        self.inner.health(crate::deadline_in(self.config.init_timeout)).await
    }

    /// Abort: every pending operation on this rank fails with `Aborted`.
    ///
    /// # Errors
    /// When the backend could not abort in time.
    pub async fn abort(&self) -> Result<()> {
        tracing::warn!(group = %self.who.name, rank = self.rank(), "aborting communicator");
        crate::trace::dump(&format!("abort of group '{}'", self.who.name));
        self.inner.abort(Instant::now() + Duration::from_secs(30)).await
    }

    /// [`Communicator::abort`] from synchronous code.
    ///
    /// # Errors
    /// As [`Communicator::abort`].
    pub fn abort_blocking(&self) -> Result<()> {
        futures::executor::block_on(self.abort())
    }

    /// Flush and release; idempotent.
    ///
    /// # Errors
    /// When the backend could not shut down in time.
    pub async fn shutdown(&self) -> Result<()> {
        self.inner.shutdown(crate::deadline_in(self.config.init_timeout)).await
    }

    /// Build a sub-group. Every rank of this communicator calls it; members pass the spec
    /// of their group (its `ranks` are ranks of this communicator), others `None`.
    ///
    /// # Errors
    /// `InvalidArgument` (before communicating) when this rank is not in its spec, a rank
    /// is out of range or repeated; `InvalidArgument` after the split when members passed
    /// different specs; otherwise as the backend's split.
    pub async fn split(&self, spec: Option<GroupSpec>) -> Result<Option<Communicator>> {
        let me = self.rank();
        let (color, key) = match &spec {
            None => (None, 0),
            Some(s) => {
                validate_spec(s, me, Some(self.size())).map_err(|e| match e {
                    Error::InvalidArgument { msg, .. } => self.invalid("split", "spec", msg),
                    e => e,
                })?;
                let key = s.group_rank(me).unwrap_or(0) as u32;
                (Some(spec_color(s)), key)
            }
        };
        let deadline = crate::deadline_in(self.config.init_timeout);
        let name = spec.as_ref().map(|s| s.name.clone()).unwrap_or_default();
        let child = self.inner.split(color, key, &name, deadline).await?;
        match (child, spec) {
            (None, None) => Ok(None),
            (Some(c), Some(s)) => {
                let ci = c.info();
                if ci.size != s.ranks.len() || Some(ci.rank) != s.group_rank(me) {
                    return Err(self.invalid("split", "spec", format!("group '{}' formed with {} ranks (this rank at {}), but the spec lists {:?}: members passed different specs", s.name, ci.size, ci.rank, s.ranks)));
                }
                let detail = match &self.detail {
                    Some(d) => Some(d.child(&s.name, ci.rank, ci.size).await?),
                    None => None,
                };
                let mut child = Communicator::with_recorder(c, s, self.config.clone(), self.who.recorder.clone())?;
                child.detail = detail;
                child.store = self.store.clone();
                Ok(Some(child))
            }
            // Not the library's error: this rank got a communicator where the spec says it
            // is no member, or none where it is one.
            (Some(_), None) | (None, Some(_)) => {
                // The same split would disagree again: fatal, as a library's usage error is.
                let text = "the backend's split disagreed with the requested membership";
                Err(self.ctx().backend_error("split", -1, text, crate::Recovery::Fatal))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// What every operation reads lies in the first line: the backend, the sequence number,
    /// what calls are validated against, the flight recorder and the rank.
    #[test]
    fn the_fields_of_every_call_share_a_line() {
        let who = std::mem::offset_of!(super::Communicator, who);
        let rank_ends = who + std::mem::offset_of!(crate::work::Issuer, rank) + std::mem::size_of::<usize>();
        assert!(rank_ends <= 64, "the rank ends at byte {rank_ends}");
    }
}
