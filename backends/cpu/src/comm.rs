//! `CpuComm`: the CPU backend's communicator. Operations run in issue order on one worker
//! thread per communicator, or on the thread of a caller that waits for one of them; a
//! small all_reduce, all_gather, broadcast or barrier of two ranks issued while nothing
//! else is queued, on its caller's thread as it is issued, where the peer's message arrives
//! within a few microseconds (`eager`).
//!
//! The worker never dereferences a caller's buffer: a small input (under 4 KiB) is copied
//! at enqueue, a larger one, or a collective's issued while nothing else is queued (likely
//! waited for at once), is lent (its address is kept, and the worker copies it through the
//! kernel, which fails cleanly instead of faulting, or a peer of this host copies it out the
//! same way), and results are copied into the caller's buffers when completion is observed. A
//! job that runs inside its own caller's wait, where the borrow is live, reads and writes
//! the caller's buffers directly: no copy in or out. Dropping an unfinished `Work` whose
//! large inputs were lent waits until its job has run (every step of which has a deadline);
//! one whose small input was lent leaves its job a copy if the job has not read it yet (the
//! job reads it first thing), and never waits for peers.
//!
//! Memory is bounded: inputs queued and not yet run may hold at most
//! `ANYCCL_CPU_MAX_QUEUED_BYTES` (default 256 MiB), a lent input counted as 64 KiB (about
//! what the largest copied one holds; it holds nothing while queued) and a job as 1 KiB at
//! least (its record), so the bound also caps how many operations wait; past that, enqueue
//! waits for the worker, up to the operation timeout (then `Timeout`), as a device library
//! blocks the host when its queue is full. Messages from a peer that this rank has not
//! consumed are bounded by `ANYCCL_CPU_MAX_INBOX_BYTES` (default 256 MiB, see the
//! transport). The results of an operation the worker ran before its caller waited are held
//! until that wait: at most the size of the caller's own output buffers, and the worker stops
//! running the queue ahead of its callers once it holds 8 MiB of them (`sched::HOLD_AHEAD`).

use crate::algo::{self, Coll};
use crate::settings::Tuning;
use crate::transport::{Data, Dead, Kind, Links, Mesh};
use anyccl_core::{
    async_trait, AllToAllSplits, Buf, BufMut, Capabilities, Collective, CommInfo, DType, Device, DeviceKind, Error,
    P2POp, ReduceOp, Result, Store, Work, WorkImpl,
};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

mod eager;
mod pool;
mod sched;
mod split;
mod work;

use crate::bufs::Pool;
use pool::{Admission, Queue};
use sched::{worker_loop, Completion, Job, Sched};
use work::{Direct, Input, Lending};

/// What a job leaves for each of its target buffers (`None`, or no entry: leave it
/// unchanged; a job run on its caller's buffers returns an empty list).
type Output = Few<Option<Vec<u8>>>;
/// A few buffers (most operations have one), kept inline: no allocation.
type Few<T> = smallvec::SmallVec<[T; 1]>;
type JobFn = Box<dyn for<'d> FnOnce(&mut Engine, Option<Direct<'d>>) -> Result<Output> + Send>;
/// A job's result on its way to its `Work`: the error boxed, so that the result, handed on
/// through several calls, is moved as three words rather than as a whole error.
type Done = std::result::Result<Output, Box<Error>>;

/// State owned by the worker thread.
struct Engine {
    mesh: Arc<Mesh>,
    seq: u64,
    tune: Tuning,
    pool: Arc<Pool>,
    /// The completion of the job now running off its caller's buffers whose small input was
    /// lent ([`Lending::Rescuable`]): its input is read through it ([`Engine::read_lent`]).
    current: Option<Arc<Completion>>,
}

impl Engine {
    fn coll(&mut self, op: u8) -> Coll<'_> {
        let seq = self.seq;
        self.seq += 1;
        Coll { mesh: &self.mesh, op, seq, stream: false }
    }

    /// Read the lent input at `addr` into `dst`: through the kernel, or from the copy its
    /// `Work` left when it was dropped before the job read it ([`Completion::take_input`]).
    fn read_lent(&self, addr: usize, dst: &mut [u8]) -> Result<()> {
        match &self.current {
            Some(c) => c.take_input(dst, |d| self.mesh.read_own(addr, d)),
            None => self.mesh.read_own(addr, dst),
        }
    }

    /// [`Engine::coll`] for an operation that writes `bytes` into the caller's buffer:
    /// received bytes go there with streaming stores from `Tuning::stream_min` on.
    fn coll_writing(&mut self, op: u8, bytes: usize) -> Coll<'_> {
        let stream = bytes >= self.tune.stream_min;
        Coll { stream, ..self.coll(op) }
    }
}

/// The CPU backend's communicator.
#[derive(Debug)]
pub struct CpuComm {
    info: CommInfo,
    caps: Capabilities,
    mesh: Arc<Mesh>,
    sched: Arc<Sched>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    store: Arc<dyn Store>,
    ns: String,
    splits: AtomicU64,
    /// Windows registered so far: nothing is registered on the host, but the members still
    /// agree on each, so a program that would fail on a device backend fails here too.
    windows: AtomicU64,
    queue: Arc<Queue>,
    pool: Arc<Pool>,
    /// The engine's thresholds, for [`Collective::path`].
    tune: Tuning,
    /// Whether and how a small all_reduce runs as it is issued.
    eager: eager::Eagerness,
}

/// What the CPU backend supports.
pub fn cpu_capabilities() -> Capabilities {
    Capabilities {
        device_kind: DeviceKind::Cpu,
        dtypes: DType::ALL.to_vec(),
        reduce_ops: ReduceOp::ALL.to_vec(),
        all_to_all: true,
        all_to_all_v: true,
        p2p_group: true,
        abort_in_flight: true,
        split: true,
        lazy_connect: false,
        memory_stats: false,
        warmup_small_bytes: 4 << 10,
        warmup_large_bytes: 4 << 20,
        max_world_size: 4096,
        max_local_ranks: 4096,
        graphs: false,
        streams: false,
        cta_settings: false,
        // Ranks of a host copy through shared memory or read each other's memory directly:
        // there is nothing to register.
        buffer_registration: false,
        windows: false,
        detects_peer_failure: true,
        first_call_may_block: false,
        detects_mismatch: true,
    }
}

impl CpuComm {
    pub(crate) async fn connect(
        store: Arc<dyn Store>,
        namespace: &str,
        rank: usize,
        size: usize,
        deadline: Instant,
        op_timeout: Duration,
        links: Option<Links>,
    ) -> Result<Arc<CpuComm>> {
        // The group's name in errors is its namespace.
        let label = namespace;
        // Every setting first, on every rank: none fails while its peers wait for it.
        crate::settings::check(&anyccl_core::Ctx::new("cpu", rank, label), links.is_some())?;
        // A generation per connect, started by rank 0: reconnecting under the same name
        // never reads a previous generation's addresses, and a rank retrying alone joins
        // rank 0's next attempt.
        let base = format!("{namespace}/cpu");
        let st = store.as_ref();
        let (mesh, ns) = anyccl_core::in_new_generation(st, &base, rank, label, deadline, |ns| async move {
            Ok((Mesh::connect(st, &ns, label, rank, size, deadline, op_timeout, links).await?, ns))
        })
        .await?;
        CpuComm::start(Arc::new(mesh), store, ns)
    }

    fn start(mesh: Arc<Mesh>, store: Arc<dyn Store>, ns: String) -> Result<Arc<CpuComm>> {
        let tune = Tuning::from_env(&mesh.ctx, mesh.step, (mesh.size, mesh.crowded_anywhere))?;
        let limit = crate::settings::max_queued_bytes(&mesh.ctx)?;
        let grace = crate::settings::handoff(&mesh.ctx)?;
        let eager = eager::Eagerness::new(crate::settings::eager(&mesh.ctx)?, mesh.crowded_anywhere);
        let queue = Arc::new(Queue::new(limit));
        let pool = Arc::new(Pool::new(limit));
        let engine = Engine { mesh: mesh.clone(), seq: 0, tune, pool: pool.clone(), current: None };
        let sched = Arc::new(Sched::new(engine, grace));
        let s2 = sched.clone();
        let worker = std::thread::Builder::new()
            .name(format!("anyccl-cpu-{}", mesh.rank))
            .spawn(move || worker_loop(&s2))
            .map_err(|e| Error::unavailable("cpu", format!("cannot start worker thread: {e}")))?;
        let info = CommInfo { backend: "cpu", rank: mesh.rank, size: mesh.size, device: Device::CPU };
        Ok(Arc::new(CpuComm {
            info,
            caps: cpu_capabilities(),
            mesh,
            sched,
            worker: Mutex::new(Some(worker)),
            store,
            ns,
            splits: AtomicU64::new(0),
            windows: AtomicU64::new(0),
            queue,
            pool,
            tune,
            eager,
        }))
    }

    fn stop_worker(&self) {
        self.sched.lock().closed = true;
        self.sched.cv.notify_all();
    }

    fn join_worker(&self) {
        let h = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = h {
            let _ = h.join();
        }
    }
}

impl Drop for CpuComm {
    fn drop(&mut self) {
        self.mesh.kill(Dead { aborted: true, peer: None, detail: "communicator dropped".into() });
        self.stop_worker();
        self.join_worker();
        self.mesh.join_readers();
    }
}

#[async_trait]
impl Collective for CpuComm {
    fn info(&self) -> &CommInfo {
        &self.info
    }
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }
    fn path(&self, op: &str, bytes: usize) -> Option<String> {
        let route = |peer, what, len, exchange| self.mesh.route(peer, what, len, exchange);
        let path = algo::path(op, bytes, (self.info.rank, self.info.size), &self.tune, &route)?;
        Some(match self.eager_path_look(op, bytes) {
            Some(look) => {
                let when = match op {
                    "reduce_scatter" => " out of place",
                    "all_to_all" => " with even splits",
                    _ => "",
                };
                let whose =
                    if self.info.size == 2 || op == "sendrecv" { "the peer's input comes" } else { "the inputs come" };
                format!("{path}; as it is issued{when} where nothing else is queued and {whose} within {look}")
            }
            _ => path,
        })
    }

    fn all_reduce<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        let n = recv.bytes();
        let (send, mut recv) = match self.all_reduce_now(send, recv, op) {
            eager::Now::Issued(w) => return Ok(w),
            eager::Now::Usual(bufs) => bufs,
        };
        let adm = self.admit([n])?;
        let input = match &send {
            Some(s) => self.input("all_reduce", s, adm.alone)?,
            None => self.input_mut("all_reduce", &mut recv, 0, n, adm.alone)?,
        };
        let (dtype, lent) = (recv.dtype(), input.lent());
        self.enqueue_lent(
            send.into_iter().collect(),
            smallvec::smallvec![recv],
            lent,
            adm,
            Box::new(move |e, direct| {
                let tune = e.tune;
                if let Some(Direct { srcs, mut outs }) = direct {
                    // In the caller's wait: reduced in its own buffer (which holds the input
                    // already when in place), reading the send buffer where it is needed.
                    let out = &mut *outs[0];
                    algo::all_reduce(&e.coll(algo::OP_ALL_REDUCE), out, srcs.first().copied(), dtype, op, &tune)?;
                    return Ok(Few::new());
                }
                let mut data = input.take(e)?;
                algo::all_reduce(&e.coll(algo::OP_ALL_REDUCE), &mut data, None, dtype, op, &tune)?;
                Ok(smallvec::smallvec![Some(data)])
            }),
        )
    }

    fn reduce<'a>(
        &'a self,
        send: Option<Buf<'a>>,
        mut recv: BufMut<'a>,
        op: ReduceOp,
        root: usize,
    ) -> Result<Work<'a>> {
        let n = recv.bytes();
        let adm = self.admit([n])?;
        let input = match &send {
            Some(s) => self.input("reduce", s, adm.alone)?,
            None => self.input_mut("reduce", &mut recv, 0, n, adm.alone)?,
        };
        let (dtype, me, lent) = (recv.dtype(), self.info.rank, input.lent());
        self.enqueue_lent(
            send.into_iter().collect(),
            smallvec::smallvec![recv],
            lent,
            adm,
            Box::new(move |e, direct| {
                if let Some(Direct { srcs, mut outs }) = direct {
                    // In the caller's wait: sent from, or folded into, the caller's buffers.
                    let out = &mut *outs[0];
                    algo::reduce(&e.coll(algo::OP_REDUCE), out, srcs.first().copied(), dtype, op, root)?;
                    return Ok(Few::new());
                }
                let mut data = input.take(e)?;
                algo::reduce(&e.coll(algo::OP_REDUCE), &mut data, None, dtype, op, root)?;
                Ok(smallvec::smallvec![(me == root).then_some(data)])
            }),
        )
    }

    fn broadcast<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, root: usize) -> Result<Work<'a>> {
        let (send, mut recv) = match self.broadcast_now(send, recv, root) {
            eager::Now::Issued(w) => return Ok(w),
            eager::Now::Usual(bufs) => bufs,
        };
        let (n, me) = (recv.bytes(), self.info.rank);
        let adm = self.admit([n])?;
        let input = match (me == root, &send) {
            (false, _) => None,
            (true, Some(s)) => Some(self.input("broadcast", s, adm.alone)?),
            (true, None) => Some(self.input_mut("broadcast", &mut recv, 0, n, adm.alone)?),
        };
        let lent = input.as_ref().map_or(Lending::No, Input::lent);
        self.enqueue_lent(
            send.into_iter().collect(),
            smallvec::smallvec![recv],
            lent,
            adm,
            Box::new(move |e, direct| {
                if let Some(Direct { srcs, mut outs }) = direct {
                    let out = &mut *outs[0];
                    if let (true, Some(src)) = (me == root, srcs.first()) {
                        crate::shm::copy(out, src);
                    }
                    algo::broadcast(&e.coll_writing(algo::OP_BROADCAST, out.len()), out, root)?;
                    return Ok(Few::new());
                }
                let mut data = match input {
                    Some(i) => i.take(e)?,
                    None => e.pool.zeroed(n),
                };
                algo::broadcast(&e.coll(algo::OP_BROADCAST), &mut data, root)?;
                Ok(smallvec::smallvec![Some(data)])
            }),
        )
    }

    fn all_gather<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>) -> Result<Work<'a>> {
        let (send, mut recv) = match self.all_gather_now(send, recv) {
            eager::Now::Issued(w) => return Ok(w),
            eager::Now::Usual(bufs) => bufs,
        };
        let (n, me) = (self.info.size, self.info.rank);
        let chunk = recv.bytes() / n;
        let adm = self.admit([recv.bytes()])?;
        // Only this rank's chunk is input; the others are all overwritten.
        let own = match &send {
            Some(s) => self.input("all_gather", s, adm.alone)?,
            None => self.input_mut("all_gather", &mut recv, me * chunk, chunk, adm.alone)?,
        };
        let (total, lent) = (recv.bytes(), own.lent());
        self.enqueue_lent(
            send.into_iter().collect(),
            smallvec::smallvec![recv],
            lent,
            adm,
            Box::new(move |e, direct| {
                if let Some(Direct { srcs, mut outs }) = direct {
                    let direct_max = e.tune.all_gather_direct_max;
                    let cx = e.coll_writing(algo::OP_ALL_GATHER, outs[0].len());
                    algo::all_gather(&cx, outs[0], srcs.first().copied(), chunk, direct_max)?;
                    return Ok(Few::new());
                }
                let mut out = e.pool.zeroed(total);
                own.read_into(e, &mut out[me * chunk..(me + 1) * chunk])?;
                let direct_max = e.tune.all_gather_direct_max;
                algo::all_gather(&e.coll(algo::OP_ALL_GATHER), &mut out, None, chunk, direct_max)?;
                Ok(smallvec::smallvec![Some(out)])
            }),
        )
    }

    fn reduce_scatter<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        let (send, mut recv) = match self.reduce_scatter_now(send, recv, op) {
            eager::Now::Issued(w) => return Ok(w),
            eager::Now::Usual(bufs) => bufs,
        };
        let (n, me) = (self.info.size, self.info.rank);
        let total = send.as_ref().map_or(recv.bytes(), |s| s.bytes());
        let c = total / n;
        let adm = self.admit([total])?;
        let input = match &send {
            Some(s) => self.input("reduce_scatter", s, adm.alone)?,
            None => self.input_mut("reduce_scatter", &mut recv, 0, total, adm.alone)?,
        };
        let (dtype, lent, send_given) = (recv.dtype(), input.lent(), send.is_some());
        self.enqueue_lent(
            send.into_iter().collect(),
            smallvec::smallvec![recv],
            lent,
            adm,
            Box::new(move |e, direct| {
                // Two chunks to fold into from 3 ranks on (the ring's), kept by the pool
                // between operations.
                let (pool, how, direct_max) = (e.pool.clone(), (dtype, op), e.tune.all_reduce_direct_max);
                let mut scratch = pool.zeroed(if n > 2 && n * c > direct_max { 2 * c } else { 0 });
                if let Some(Direct { srcs, mut outs }) = direct {
                    let cx = e.coll(algo::OP_REDUCE_SCATTER);
                    // In the caller's wait: the send buffer read where it is, the result
                    // written into the caller's chunk.
                    let out = &mut *outs[0];
                    match srcs.first() {
                        Some(src) => {
                            algo::reduce_scatter(&cx, &algo::Parts::of(src, me, c), out, &mut scratch, how, direct_max)?
                        }
                        None => {
                            // In place: this rank's chunk of the buffer is its input and output.
                            let (before, rest) = out.split_at_mut(me * c);
                            let (mine, after) = rest.split_at_mut(c);
                            let parts = algo::Parts { before, own: None, after };
                            algo::reduce_scatter(&cx, &parts, mine, &mut scratch, how, direct_max)?;
                        }
                    }
                    pool.put(scratch);
                    return Ok(Few::new());
                }
                let mut data = input.take(e)?;
                let cx = e.coll(algo::OP_REDUCE_SCATTER);
                let r = if send_given {
                    let mut out = pool.zeroed(c);
                    algo::reduce_scatter(&cx, &algo::Parts::of(&data, me, c), &mut out, &mut scratch, how, direct_max)?;
                    pool.put(data);
                    smallvec::smallvec![Some(out)]
                } else {
                    // The whole buffer comes back: the other chunks as they were.
                    let (before, rest) = data.split_at_mut(me * c);
                    let (mine, after) = rest.split_at_mut(c);
                    let parts = algo::Parts { before, own: None, after };
                    algo::reduce_scatter(&cx, &parts, mine, &mut scratch, how, direct_max)?;
                    smallvec::smallvec![Some(data)]
                };
                pool.put(scratch);
                Ok(r)
            }),
        )
    }

    fn all_to_all<'a>(&'a self, send: Buf<'a>, recv: BufMut<'a>, splits: Option<&AllToAllSplits>) -> Result<Work<'a>> {
        let (send, recv) = match splits {
            None => match self.all_to_all_now(send, recv) {
                eager::Now::Issued(w) => return Ok(w),
                eager::Now::Usual(bufs) => bufs,
            },
            Some(_) => (send, recv),
        };
        let n = self.info.size;
        let es = send.dtype().size();
        let (sb, rb): (Vec<usize>, Vec<usize>) = match splits {
            Some(sp) => {
                (sp.send_counts.iter().map(|c| c * es).collect(), sp.recv_counts.iter().map(|c| c * es).collect())
            }
            None => (vec![send.bytes() / n; n], vec![recv.bytes() / n; n]),
        };
        let adm = self.admit([send.bytes()])?;
        let data = self.input("all_to_all", &send, adm.alone)?;
        let (total, lent) = (recv.bytes(), data.lent());
        self.enqueue_lent(
            smallvec::smallvec![send],
            smallvec::smallvec![recv],
            lent,
            adm,
            Box::new(move |e, direct| {
                let max = e.tune.all_to_all_direct_max;
                if let Some(Direct { srcs, mut outs }) = direct {
                    let cx = e.coll_writing(algo::OP_ALL_TO_ALL, outs[0].len());
                    algo::all_to_all(&cx, srcs[0], &sb, outs[0], &rb, max)?;
                    return Ok(Few::new());
                }
                let data = data.take(e)?;
                let mut out = e.pool.zeroed(total);
                algo::all_to_all(&e.coll(algo::OP_ALL_TO_ALL), &data, &sb, &mut out, &rb, max)?;
                e.pool.put(data);
                Ok(smallvec::smallvec![Some(out)])
            }),
        )
    }

    fn send<'a>(&'a self, buf: Buf<'a>, peer: usize) -> Result<Work<'a>> {
        let adm = self.admit([buf.bytes()])?;
        let data = self.input("send", &buf, false)?;
        let lent = data.lent();
        self.enqueue_lent(
            smallvec::smallvec![buf],
            Few::new(),
            lent,
            adm,
            Box::new(move |e, direct| {
                let d = match &direct {
                    Some(d) => Data::Bytes(d.srcs[0]),
                    None => data.data(),
                };
                e.mesh.send_data(peer, Kind::P2p, 0, 0, d)?;
                Ok(Few::new())
            }),
        )
    }

    fn recv<'a>(&'a self, buf: BufMut<'a>, peer: usize) -> Result<Work<'a>> {
        let bytes = buf.bytes();
        let adm = self.admit([])?;
        self.enqueue(
            smallvec::smallvec![buf],
            adm,
            Box::new(move |e, direct| {
                if let Some(Direct { mut outs, .. }) = direct {
                    e.mesh.recv_p2p_into(peer, outs[0])?;
                    return Ok(Few::new());
                }
                let mut out = e.pool.zeroed(bytes);
                e.mesh.recv_p2p_into(peer, &mut out)?;
                Ok(smallvec::smallvec![Some(out)])
            }),
        )
    }

    fn p2p_group<'a>(&'a self, ops: Vec<P2POp<'a>>) -> Result<Work<'a>> {
        let ops = match self.p2p_group_now(ops) {
            Ok(w) => return Ok(w),
            Err(ops) => ops,
        };
        let adm =
            self.admit(ops.iter().filter_map(|o| if let P2POp::Send(b, _) = o { Some(b.bytes()) } else { None }))?;
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        let mut sources = Few::new();
        let mut targets = Few::new();
        for o in ops {
            match o {
                P2POp::Send(b, p) => {
                    sends.push((p, self.input("p2p_group", &b, false)?));
                    sources.push(b);
                }
                P2POp::Recv(b, p) => {
                    recvs.push((p, b.bytes()));
                    targets.push(b);
                }
            }
        }
        let lent = if sends.iter().any(|(_, i)| i.lent() != Lending::No) { Lending::Held } else { Lending::No };
        self.enqueue_lent(
            sources,
            targets,
            lent,
            adm,
            Box::new(move |e, direct| {
                // The received bytes: the caller's buffers in its wait, the job's own otherwise.
                let mut own: Vec<Vec<u8>> = Vec::new();
                let (srcs, mut outs): (Vec<Data<'_>>, Vec<&mut [u8]>) = match direct {
                    Some(Direct { srcs, outs }) => (srcs.into_iter().map(Data::Bytes).collect(), outs.into_vec()),
                    None => {
                        own = recvs.iter().map(|(_, n)| e.pool.zeroed(*n)).collect();
                        (sends.iter().map(|(_, i)| i.data()).collect(), own.iter_mut().map(|v| &mut v[..]).collect())
                    }
                };
                if let ([d], [(to, _)], [(from, _)], [out]) = (&srcs[..], &sends[..], &recvs[..], &mut outs[..]) {
                    // One of each (a pipeline or ring step): both directions at once.
                    e.mesh.sendrecv(*to, *d, *from, out)?;
                } else {
                    for (d, (p, _)) in srcs.iter().zip(&sends) {
                        e.mesh.send_data(*p, Kind::P2p, 0, 0, *d)?;
                    }
                    for (out, (p, _)) in outs.iter_mut().zip(&recvs) {
                        e.mesh.recv_p2p_into(*p, out)?;
                    }
                }
                drop(outs);
                let n = recvs.len();
                Ok(if own.is_empty() { smallvec::smallvec![None; n] } else { own.into_iter().map(Some).collect() })
            }),
        )
    }

    fn barrier(&self) -> Result<Work<'_>> {
        if let eager::Now::Issued(w) = self.barrier_now() {
            return Ok(w);
        }
        let adm = self.admit([])?;
        self.enqueue(
            Few::new(),
            adm,
            Box::new(|e, _| {
                algo::barrier(&e.coll(algo::OP_BARRIER))?;
                Ok(Few::new())
            }),
        )
    }

    async fn register_window(
        &self,
        buf: Buf<'_>,
        refusal: Option<&str>,
        deadline: Instant,
    ) -> Result<Option<anyccl_core::RegHandle>> {
        if let Some(d) = self.mesh.mailbox.dead() {
            return Err(self.mesh.dead_err(d));
        }
        let seq = self.windows.fetch_add(1, Ordering::Relaxed);
        let who = (self.info.rank, self.info.size);
        anyccl_core::agree_window(&*self.store, &self.ns, &self.mesh.label, who, seq, buf.bytes(), refusal, deadline)
            .await?;
        Ok(None)
    }

    async fn health(&self, _deadline: Instant) -> Result<()> {
        match self.mesh.mailbox.dead() {
            None => Ok(()),
            Some(d) => Err(self.mesh.dead_err(d)),
        }
    }

    async fn abort(&self, _deadline: Instant) -> Result<()> {
        self.mesh.kill(Dead { aborted: true, peer: None, detail: "aborted by the caller".into() });
        Ok(())
    }

    async fn split(
        &self,
        color: Option<u32>,
        key: u32,
        name: &str,
        deadline: Instant,
    ) -> Result<Option<Arc<dyn Collective>>> {
        let k = self.splits.fetch_add(1, Ordering::Relaxed);
        let base = format!("{}/split{k}", self.ns);
        let me = self.info.rank;
        let mine = match color {
            Some(c) => format!("{c} {key}"),
            None => "-".to_string(),
        };
        self.store.set(&format!("{base}/{me}"), mine.as_bytes()).await?;
        let Some(color) = color else { return Ok(None) };
        let members = self.split_members(&base, color, deadline).await?;
        let rank = members.iter().position(|&(_, r)| r == me).unwrap_or(0);
        let ns = format!("{base}/c{color}");
        let mesh = Arc::new(
            Mesh::connect(
                self.store.as_ref(),
                &ns,
                name,
                rank,
                members.len(),
                deadline,
                self.mesh.op_timeout,
                Some(self.mesh.links),
            )
            .await?,
        );
        let c: Arc<dyn Collective> = CpuComm::start(mesh, self.store.clone(), ns)?;
        Ok(Some(c))
    }

    async fn shutdown(&self, deadline: Instant) -> Result<()> {
        let started = Instant::now();
        self.stop_worker();
        loop {
            let finished =
                self.worker.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_none_or(|h| h.is_finished());
            if finished {
                break;
            }
            if Instant::now() >= deadline {
                self.mesh.kill(Dead { aborted: true, peer: None, detail: "shutdown deadline passed".into() });
                let detail = "pending operations did not finish; the communicator was aborted";
                return Err(self.mesh.ctx.timeout("shutdown", started.elapsed(), detail));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.join_worker();
        self.mesh.close();
        Ok(())
    }
}
