//! A small operation issued while nothing but such operations' receives is queued, and
//! nothing runs, runs as it is issued: an all_reduce, all_gather, reduce_scatter (out of
//! place), all_to_all (even splits), broadcast or barrier of two ranks of one host; among more
//! than two ranks all of one host, an all_reduce, all_gather, reduce_scatter or all_to_all that
//! goes direct (every rank's message to every rank), a broadcast down the binomial tree and a
//! barrier of up to `BARRIER_DIRECT_MAX` ranks (`direct`); and a sendrecv (a batch of one send
//! to a peer of this host and one receive from one, the same or another: a pipeline's or a
//! ring's step) at any world size. Its messages
//! are sent at once (where the rings have room for them) and, if nothing is queued, the
//! peers' taken if they arrive within `ANYCCL_CPU_EAGER_US`; the call then returns a finished
//! `Work` (no job, no completion, no hand-over, nothing to wait for). Otherwise its receives
//! are left to a job queued in issue order, which only receives (the calls issued after it
//! send at their issue) and never waits once its messages are there: such receives whose
//! messages have arrived run at the next issue, so a pipeline of calls keeps going this way.
//! A peer that has not arrived within the look may be waiting for something this rank does
//! after the issue: the issue never waits longer. After each miss in a row, twice as many
//! calls (up to 1,024) send without looking. In a pipeline (the missed call not waited for by
//! the next issues), a miss whose message the next issues find within 16 times
//! `ANYCCL_CPU_EAGER_US` (1 ms at most) of its issue lengthens the look to take such a
//! message, where a host's ranks do not outnumber its CPUs; one whose message comes later
//! halves it again (see `look`). Every operation goes on the wire as its usual path sends it
//! (the same messages, op codes and numbers), so a rank that goes the usual way meets a peer
//! that did not.

use super::*;
use crate::transport::Eager;

mod direct;
mod look;
pub(super) use look::Eagerness;

/// The largest message of an all_gather (each rank's part), a reduce_scatter (each rank's
/// share), an all_to_all (each segment) or a broadcast that goes this way, and of an all_reduce
/// among more than two ranks (two ranks': their direct size, `ANYCCL_CPU_ALLREDUCE_DIRECT_MAX`);
/// a sendrecv's: [`EAGER_P2P_MAX`].
pub(super) const EAGER_MAX: usize = 8 << 10;

/// The largest message of a sendrecv that goes this way, where its messages go through the
/// rings (below the size from which they go by reference: 8 KiB, or 64 KiB where a host's
/// ranks outnumber its CPUs). 4 ranks on 2 cores, a ring of sendrecvs, 3 alternating rounds:
/// 16 / 32 KiB 5.23 / 8.49 -> 4.21 / 7.58 us a call (Open MPI 6.41 / 8.08); 64 KiB through
/// the rings this way took 14.0 us against 10.9 by reference.
const EAGER_P2P_MAX: usize = 32 << 10;

/// How far an operation tried as it is issued went; `Later`: with what the receive left
/// for later needs.
pub(super) enum Step<S> {
    NotStarted,
    Done,
    Later(S),
}

/// `got` as a [`Step`], `later` making what a receive left for later needs.
pub(super) fn step<S>(got: Eager, later: impl FnOnce() -> S) -> Step<S> {
    match got {
        Eager::NotStarted => Step::NotStarted,
        Eager::Done => Step::Done,
        Eager::Later => Step::Later(later()),
    }
}

/// What a try as the operation is issued did.
pub(super) enum Now<'a, B> {
    /// Issued (finished, or its receive queued).
    Issued(Work<'a>),
    /// Nothing sent: the operation's buffers, given back, go the usual way.
    Usual(B),
}

/// What the issue returns after the try.
enum After {
    NotStarted,
    Done,
    Failed(Box<Error>),
    /// The receive queued as job `done` follows; `true`: the worker is to be woken.
    Queued(Arc<Completion>, bool),
}

/// An operation's send buffer (if any) and receive buffer.
pub(super) type Pair<'a> = (Option<Buf<'a>>, BufMut<'a>);

/// A [`Pair`]'s host bytes: the send buffer's (if any) and the receive buffer's; `None`
/// where either is not in host memory (the usual path then says so).
pub(super) fn host<'p>(
    send: &'p Option<Buf<'_>>,
    recv: &'p mut BufMut<'_>,
) -> Option<(Option<&'p [u8]>, &'p mut [u8])> {
    let src = match send {
        Some(s) => Some(s.as_host_bytes()?),
        None => None,
    };
    Some((src, recv.as_host_bytes_mut()?))
}

/// `(this rank's half, the peer's half)` of a buffer of two halves of `half` bytes each.
fn halves<T>(me: usize, buf: T, half: usize, split: impl FnOnce(T, usize) -> (T, T)) -> (T, T) {
    let (lo, hi) = split(buf, half);
    if me == 0 {
        (lo, hi)
    } else {
        (hi, lo)
    }
}

/// Fold the peer's piece `b` at `at` of this rank's reduce_scatter share into `out`, with
/// `own`, this rank's input of the share (as the usual path's last ring step does).
fn fold_share(out: &mut [u8], own: &[u8], (at, b): (usize, &[u8]), (dtype, op): (DType, ReduceOp)) {
    let r = at..at + b.len();
    algo::fold_piece(&mut out[r.clone()], Some(&own[r]), b, dtype, op)
}

/// The buffers of a [`Pair`] as its `Work` holds them.
pub(super) fn parts(p: Pair<'_>) -> (Few<Buf<'_>>, Few<BufMut<'_>>) {
    (p.0.into_iter().collect(), smallvec::smallvec![p.1])
}

/// The buffers of an operation whose input is always given (all_to_all, sendrecv) as its
/// `Work` holds them.
pub(super) fn given_parts<'a>((s, r): (Buf<'a>, BufMut<'a>)) -> (Few<Buf<'a>>, Few<BufMut<'a>>) {
    (smallvec::smallvec![s], smallvec::smallvec![r])
}

impl CpuComm {
    /// Whether an operation whose messages are `bytes` bytes (at most `max`) may run as it is
    /// issued here (two ranks of one host, the look not turned off).
    pub(super) fn eager_fits(&self, bytes: usize, max: usize) -> bool {
        self.info.size == 2 && bytes <= max && !self.eager.spin.is_zero() && self.mesh.is_local(1 - self.info.rank)
    }

    /// Whether the messages a receive left for later waits for have arrived: of `kind`, from
    /// `from`, or from every other rank (`None`).
    fn arrived(&self, from: Option<usize>, kind: Kind) -> bool {
        match from {
            Some(p) => self.mesh.arrived(p, kind),
            None => self.mesh.arrived_all(),
        }
    }

    /// Try an operation on `bufs` (`bytes` of input) as it is issued, where nothing is
    /// queued or running but receives left for later: those whose messages have arrived run
    /// first, here; if any is still waiting for its message, this operation only sends now
    /// and leaves its receive for later too (messages arrive in order), otherwise it looks
    /// for the peer's message (unless misses before say not to look for a while: it then
    /// only sends too). `attempt` runs the exchange on the engine as operation number
    /// `seq` (`None`: send only), of messages of `kind` (only a collective's counts as an
    /// operation number); `rest` makes the job that receives what did not come, from `from`
    /// (`None`: from every other rank);
    /// `parts` gives the buffers to that job's `Work`. Nothing counts against the queue bound
    /// unless a receive is left queued; what the exchange finds (the peer's failure, a
    /// mismatch) is the returned `Work`'s to report.
    #[allow(clippy::too_many_arguments)] // the operation's kind, size and buffers, its three steps
    pub(super) fn try_now<'a, B, S>(
        &'a self,
        (from, kind): (Option<usize>, Kind),
        bytes: usize,
        mut bufs: B,
        attempt: impl FnOnce(&Mesh, u64, Option<Duration>, &mut B) -> Result<Step<S>>,
        rest: impl FnOnce(u64, S) -> JobFn,
        parts: impl FnOnce(B) -> (Few<Buf<'a>>, Few<BufMut<'a>>),
    ) -> Now<'a, B> {
        // A communicator that failed already says so at the issue, the usual way; so does
        // one whose queue bound a receive left for later would pass (its admission waits).
        if self.mesh.mailbox.dead().is_some() || !self.queue.has_room(work::counted(bytes)) {
            return Now::Usual(bufs);
        }
        let mut missed = self.eager.missed().map(|id| (id, false));
        let mut st = self.sched.lock();
        let engine = if st.closed || st.jobs.len() != st.rests { None } else { st.engine.take() };
        let Some(mut engine) = engine else {
            drop(st);
            return Now::Usual(bufs);
        };
        // Numbered now: a receive left for later is queued ahead of what other threads
        // issue meanwhile.
        let id = st.next_id;
        st.next_id += 1;
        // Receives left for later whose messages are here: run now, in order (they do not
        // wait), so this operation may take its own.
        while st.jobs.front().and_then(|j| j.rest_of).is_some_and(|(p, k)| self.arrived(p, k)) {
            let Some(job) = st.jobs.pop_front() else { break };
            st.rests -= 1;
            if let Some((m, ran)) = &mut missed {
                *ran |= job.id == *m;
            }
            drop(st);
            let r = sched::run_job(&mut engine, job.run, None);
            job.done.set(r, &self.sched.holding);
            drop(job._admission);
            st = self.sched.lock();
        }
        // The receive of the operation that missed last: whether its message came by this
        // issue; the look adapts (see `Eagerness::then`).
        if let Some((m, ran)) = missed {
            // (One still queued has not arrived: the loop above ran every front one that had.)
            self.eager.then(ran || st.jobs.iter().any(|j| j.id == m), ran);
        }
        // After misses, a number of calls send without looking (see `Eagerness`).
        let may_look = self.eager.now();
        let look = (st.jobs.is_empty() && may_look).then(|| self.eager.look());
        // The scheduler's lock stays held through the attempt (a look of 16 times
        // `ANYCCL_CPU_EAGER_US`, 1 ms, at most): another thread's issue waits that long for
        // it rather than finding the engine out, and this call takes the lock once, not twice
        // (each lock and release is a locked instruction, which waits for the ring write
        // before it to reach the peer).
        let seq = engine.seq;
        let ran = sched::guarded(&mut engine, |e| attempt(&e.mesh, seq, look, &mut bufs));
        if kind == Kind::Coll && !matches!(ran, Ok(Step::NotStarted)) {
            engine.seq += 1;
        }
        let after = match ran {
            Ok(Step::NotStarted) => After::NotStarted,
            Ok(Step::Done) => After::Done,
            Err(e) => After::Failed(e),
            Ok(Step::Later(saved)) => {
                let done = st.completion();
                let grace = Job::grace_for(self.sched.grace, bytes, false);
                let wake = Sched::wakes_worker(&st);
                st.woken |= wake;
                let (run, _admission) = (rest(seq, saved), self.admitted_anyway(bytes));
                let job = Job {
                    id,
                    run,
                    done: done.clone(),
                    grace,
                    rescuable: false,
                    rest_of: Some((from, kind)),
                    _admission,
                };
                // After the receives left before it, ahead of what was issued meanwhile.
                let at = st.jobs.iter().position(|j| j.id > id).unwrap_or(st.jobs.len());
                st.jobs.insert(at, job);
                st.rests += 1;
                After::Queued(done, wake)
            }
        };
        st.engine = Some(engine);
        if st.helpers > 0 {
            self.sched.freed.notify_all();
        }
        drop(st);
        match after {
            After::NotStarted => Now::Usual(bufs),
            After::Done => {
                self.eager.hit();
                Now::Issued(Work::completed())
            }
            After::Failed(e) => Now::Issued(Work::new(Failed(Some(*e), self.mesh.ctx.clone()))),
            After::Queued(done, wake) => {
                // A miss only where the look ran out (not a send behind receives left before).
                if look.is_some() {
                    self.eager.miss(id);
                }
                if wake {
                    self.sched.cv.notify_one();
                }
                let (sources, targets) = parts(bufs);
                Now::Issued(self.work(id, done, sources, targets, Lending::No))
            }
        }
    }

    /// all_reduce of `send` (or in place) into `recv`, as it is issued where it may be: the
    /// direct exchange's one message each way, folded in rank order ([`algo::all_reduce_now`]).
    pub(super) fn all_reduce_now<'a>(
        &'a self,
        send: Option<Buf<'a>>,
        recv: BufMut<'a>,
        op: ReduceOp,
    ) -> Now<'a, Pair<'a>> {
        if self.info.size > 2 {
            return self.all_reduce_direct_now(send, recv, op);
        }
        let (n, dtype) = (recv.bytes(), recv.dtype());
        if n == 0 || !self.eager_fits(n, self.tune.all_reduce_direct_max) {
            return Now::Usual((send, recv));
        }
        let pool = &self.pool;
        let attempt = |mesh: &Mesh, seq, spin, (send, recv): &mut Pair<'a>| {
            let Some((src, data)) = host(send, recv) else { return Ok(Step::NotStarted) };
            let got = algo::all_reduce_now(mesh, seq, data, src, (dtype, op), spin)?;
            // Not received: `data` is untouched, so the input as sent is there, or in `src`.
            Ok(step(got, || pool.copy(src.unwrap_or(data))))
        };
        let rest = move |seq, own| all_reduce_rest(seq, own, n, (dtype, op));
        self.try_now((Some(1 - self.info.rank), Kind::Coll), n, (send, recv), attempt, rest, parts)
    }

    /// all_gather of this rank's part (`send`, or in place) into `recv`, as it is issued where
    /// it may be: the ring's one step between two ranks, each part a message.
    pub(super) fn all_gather_now<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>) -> Now<'a, Pair<'a>> {
        if self.info.size > 2 {
            return self.all_gather_direct_now(send, recv);
        }
        let (me, total) = (self.info.rank, recv.bytes());
        let chunk = total / 2;
        if chunk == 0 || total != 2 * chunk || !self.eager_fits(chunk, EAGER_MAX) {
            return Now::Usual((send, recv));
        }
        let pool = &self.pool;
        let attempt = |mesh: &Mesh, seq, spin, (send, recv): &mut Pair<'a>| {
            let Some((src, out)) = host(send, recv) else { return Ok(Step::NotStarted) };
            let (mine, theirs) = halves(me, out, chunk, <[u8]>::split_at_mut);
            if let Some(src) = src.filter(|s| s.len() == chunk) {
                // This rank's part in place first, as the ring's first step puts it.
                mine.copy_from_slice(src);
            }
            let mut take = |at: usize, b: &[u8]| theirs[at..at + b.len()].copy_from_slice(b);
            let got =
                mesh.exchange_now((algo::OP_ALL_GATHER, seq), 1 - me, Some(mine), Some((chunk, &mut take)), spin)?;
            Ok(step(got, || pool.copy(mine)))
        };
        let rest = move |seq, own| pair_rest(algo::OP_ALL_GATHER, seq, own, me, chunk);
        self.try_now((Some(1 - self.info.rank), Kind::Coll), total, (send, recv), attempt, rest, parts)
    }

    /// reduce_scatter of `send` (out of place: an input of two shares) into `recv`, this rank's
    /// share, as it is issued where it may be: the ring's one step between two ranks, the
    /// peer's share of the input sent and the peer's part of this rank's share folded in.
    pub(super) fn reduce_scatter_now<'a>(
        &'a self,
        send: Option<Buf<'a>>,
        recv: BufMut<'a>,
        op: ReduceOp,
    ) -> Now<'a, Pair<'a>> {
        if self.info.size > 2 {
            return self.reduce_scatter_direct_now(send, recv, op);
        }
        let (me, c, dtype) = (self.info.rank, recv.bytes(), recv.dtype());
        let whole = send.as_ref().map_or(0, |s| s.bytes());
        if c == 0 || whole != 2 * c || !self.eager_fits(c, EAGER_MAX) {
            return Now::Usual((send, recv));
        }
        let pool = &self.pool;
        let attempt = |mesh: &Mesh, seq, spin, (send, recv): &mut Pair<'a>| {
            let Some((Some(src), out)) = host(send, recv) else { return Ok(Step::NotStarted) };
            let (own, theirs) = halves(me, src, c, <[u8]>::split_at);
            let mut fold = |at: usize, b: &[u8]| fold_share(out, own, (at, b), (dtype, op));
            let got =
                mesh.exchange_now((algo::OP_REDUCE_SCATTER, seq), 1 - me, Some(theirs), Some((c, &mut fold)), spin)?;
            if got == Eager::Done && op == ReduceOp::Avg {
                crate::reduce::finish_avg(out, dtype, 2);
            }
            Ok(step(got, || pool.copy(own)))
        };
        let rest = move |seq, own| reduce_scatter_rest(seq, own, me, (dtype, op));
        self.try_now((Some(1 - self.info.rank), Kind::Coll), whole, (send, recv), attempt, rest, parts)
    }

    /// all_to_all of `send` into `recv` in even segments, as it is issued where it may be:
    /// this rank's segment copied, the pairwise step's one message each way.
    pub(super) fn all_to_all_now<'a>(&'a self, send: Buf<'a>, recv: BufMut<'a>) -> Now<'a, (Buf<'a>, BufMut<'a>)> {
        if self.info.size > 2 {
            return self.all_to_all_direct_now(send, recv);
        }
        let (me, total) = (self.info.rank, recv.bytes());
        let seg = total / 2;
        if seg == 0 || total != 2 * seg || send.bytes() != total || !self.eager_fits(seg, EAGER_MAX) {
            return Now::Usual((send, recv));
        }
        let pool = &self.pool;
        let attempt = |mesh: &Mesh, seq, spin, (send, recv): &mut (Buf<'a>, BufMut<'a>)| {
            let (Some(src), Some(out)) = (send.as_host_bytes(), recv.as_host_bytes_mut()) else {
                return Ok(Step::NotStarted);
            };
            let (mine, theirs) = halves(me, out, seg, <[u8]>::split_at_mut);
            let (keep, give) = halves(me, src, seg, <[u8]>::split_at);
            mine.copy_from_slice(keep);
            let mut take = |at: usize, b: &[u8]| theirs[at..at + b.len()].copy_from_slice(b);
            let got =
                mesh.exchange_now((algo::OP_ALL_TO_ALL, seq), 1 - me, Some(give), Some((seg, &mut take)), spin)?;
            Ok(step(got, || pool.copy(mine)))
        };
        let rest = move |seq, own| pair_rest(algo::OP_ALL_TO_ALL, seq, own, me, seg);
        self.try_now((Some(1 - self.info.rank), Kind::Coll), total, (send, recv), attempt, rest, given_parts)
    }

    /// broadcast from `root` into `recv` (the root's input `send`, or in place), as it is
    /// issued where it may be: the root's one message (the root never leaves anything for
    /// later: it is done once its message is in the ring).
    pub(super) fn broadcast_now<'a>(
        &'a self,
        send: Option<Buf<'a>>,
        recv: BufMut<'a>,
        root: usize,
    ) -> Now<'a, Pair<'a>> {
        if self.info.size > 2 {
            return self.broadcast_tree_now(send, recv, root);
        }
        let (me, n) = (self.info.rank, recv.bytes());
        if n == 0 || root > 1 || !self.eager_fits(n, EAGER_MAX) {
            return Now::Usual((send, recv));
        }
        let attempt = |mesh: &Mesh, seq, spin, (send, recv): &mut Pair<'a>| {
            let Some((src, data)) = host(send, recv) else { return Ok(Step::NotStarted) };
            let op = (algo::OP_BROADCAST, seq);
            if me != root {
                let mut take = |at: usize, b: &[u8]| data[at..at + b.len()].copy_from_slice(b);
                return Ok(step(mesh.exchange_now(op, root, None, Some((n, &mut take)), spin)?, || ()));
            }
            let out: &[u8] = match src {
                Some(s) if s.len() == n => s,
                Some(_) => return Ok(Step::NotStarted),
                None => data,
            };
            let got = mesh.exchange_now(op, 1 - root, Some(out), None, spin)?;
            if let (Eager::Done, Some(s)) = (got, src) {
                data.copy_from_slice(s);
            }
            Ok(step(got, || ()))
        };
        let rest = move |seq, ()| broadcast_rest(seq, root, n);
        self.try_now((Some(1 - self.info.rank), Kind::Coll), n, (send, recv), attempt, rest, parts)
    }

    /// A batch of one send of `send` to `to` and one receive from `from` into `recv` (peers
    /// of this host, the same or not), as it is issued where it may be: one point-to-point
    /// message each way, as the usual path's `sendrecv` sends them (no operation number:
    /// point-to-point messages are matched in order).
    fn sendrecv_now<'a>(
        &'a self,
        (to, send): (usize, Buf<'a>),
        (from, recv): (usize, BufMut<'a>),
    ) -> Now<'a, (Buf<'a>, BufMut<'a>)> {
        let n = recv.bytes();
        let attempt = |mesh: &Mesh, _seq, spin, (send, recv): &mut (Buf<'a>, BufMut<'a>)| {
            let (Some(src), Some(out)) = (send.as_host_bytes(), recv.as_host_bytes_mut()) else {
                return Ok(Step::NotStarted);
            };
            let mut take = |at: usize, b: &[u8]| out[at..at + b.len()].copy_from_slice(b);
            Ok(step(mesh.sendrecv_now((to, Some(src)), (from, Some((n, &mut take))), spin)?, || ()))
        };
        let rest = move |_seq, ()| -> JobFn {
            finish(move |e| e.pool.zeroed(n), move |e, out| e.mesh.recv_p2p_into(from, out))
        };
        self.try_now((Some(from), Kind::P2p), n.max(send.bytes()), (send, recv), attempt, rest, given_parts)
    }

    /// Whether a batch of one send to `to` and one receive from `from` of at most `bytes`
    /// each way may run as it is issued: both peers of this host other than this rank, the
    /// look not turned off. Any world size: a point-to-point message carries no operation
    /// number, so ranks need not agree on which path each batch takes, and a receive left
    /// for later waits behind the others of this rank in order.
    fn eager_p2p_fits(&self, to: usize, from: usize, bytes: usize) -> bool {
        let me = self.info.rank;
        // (A message that would go by reference goes the usual way: this way sends through
        // the rings.)
        bytes <= EAGER_P2P_MAX
            && bytes < self.mesh.p2p_by_ref_from()
            && !self.eager.spin.is_zero()
            && to != me
            && from != me
            && self.mesh.is_local(to)
            && self.mesh.is_local(from)
    }

    /// A point-to-point batch `ops` as it is issued where it may be ([`CpuComm::sendrecv_now`]:
    /// one send to a peer of this host and one receive from one, in either order, small);
    /// `Err`: the batch, to go the usual way.
    pub(super) fn p2p_group_now<'a>(&'a self, ops: Vec<P2POp<'a>>) -> std::result::Result<Work<'a>, Vec<P2POp<'a>>> {
        let fits = match &ops[..] {
            [P2POp::Send(s, to), P2POp::Recv(r, from)] | [P2POp::Recv(r, from), P2POp::Send(s, to)] => {
                self.eager_p2p_fits(*to, *from, s.bytes().max(r.bytes()))
            }
            _ => false,
        };
        if !fits {
            return Err(ops);
        }
        let [a, b] = <[P2POp<'a>; 2]>::try_from(ops)?;
        let (send, to, recv, from, send_first) = match (a, b) {
            (P2POp::Send(s, to), P2POp::Recv(r, from)) => (s, to, r, from, true),
            (P2POp::Recv(r, from), P2POp::Send(s, to)) => (s, to, r, from, false),
            (a, b) => return Err(vec![a, b]),
        };
        match self.sendrecv_now((to, send), (from, recv)) {
            Now::Issued(w) => Ok(w),
            Now::Usual((s, r)) if send_first => Err(vec![P2POp::Send(s, to), P2POp::Recv(r, from)]),
            Now::Usual((s, r)) => Err(vec![P2POp::Recv(r, from), P2POp::Send(s, to)]),
        }
    }

    /// barrier, as it is issued where it may be: the one empty message each way.
    pub(super) fn barrier_now(&self) -> Now<'_, ()> {
        if self.info.size > 2 {
            return self.barrier_direct_now();
        }
        if !self.eager_fits(0, 0) {
            return Now::Usual(());
        }
        let peer = 1 - self.info.rank;
        let attempt = move |mesh: &Mesh, seq, spin, _: &mut ()| {
            let got = mesh.exchange_now((algo::OP_BARRIER, seq), peer, Some(&[]), Some((0, &mut |_, _| {})), spin)?;
            Ok(step(got, || ()))
        };
        let rest = move |seq, ()| -> JobFn {
            Box::new(move |e: &mut Engine, _| {
                e.mesh.recv_coll_with(peer, algo::OP_BARRIER, seq, 0, &mut |_, _| {})?;
                Ok(Few::new())
            })
        };
        self.try_now((Some(1 - self.info.rank), Kind::Coll), 0, (), attempt, rest, |()| (Few::new(), Few::new()))
    }
}

/// The `Work` of an operation that failed as it was issued: the failure, at the first look.
struct Failed(Option<Error>, anyccl_core::Ctx);

impl WorkImpl for Failed {
    fn poll(&mut self) -> Result<bool> {
        Err(self.0.take().unwrap_or_else(|| self.1.aborted("the operation failed earlier")))
    }
    fn wait_for(&mut self, _timeout: Duration) -> Result<bool> {
        self.poll()
    }
    fn drain(&mut self) {}
}

/// The job that finishes an operation whose receive was left for later: `recv` receives
/// into the output, which is the caller's buffer when it runs in its wait (`fresh` not
/// called), else a buffer of its own (`fresh` makes it).
pub(super) fn finish(
    fresh: impl FnOnce(&Engine) -> Vec<u8> + Send + 'static,
    recv: impl FnOnce(&Engine, &mut [u8]) -> Result<()> + Send + 'static,
) -> JobFn {
    Box::new(move |e: &mut Engine, direct: Option<Direct<'_>>| match direct {
        Some(Direct { mut outs, .. }) => match outs.first_mut() {
            Some(out) => recv(e, out).map(|()| Few::new()),
            None => Err(e.mesh.ctx.aborted("an operation ran without its output buffer")),
        },
        None => {
            let mut data = fresh(e);
            recv(e, &mut data)?;
            Ok(smallvec::smallvec![Some(data)])
        }
    })
}

/// The rest of all_reduce number `seq` (of `n` bytes): the peer's input folded with `own`,
/// this rank's as sent.
fn all_reduce_rest(seq: u64, own: Vec<u8>, n: usize, how: (DType, ReduceOp)) -> JobFn {
    finish(
        move |e| e.pool.zeroed(n),
        move |e, out| {
            let r = algo::all_reduce_rest(&e.mesh, seq, out, &own, how);
            e.pool.put(own);
            r
        },
    )
}

/// The rest of all_gather or all_to_all (`op`) number `seq` (parts of `chunk` bytes): the
/// peer's part, beside `own`, this rank's (in the caller's buffer already when it runs in
/// its wait).
fn pair_rest(op: u8, seq: u64, own: Vec<u8>, me: usize, chunk: usize) -> JobFn {
    let peer = 1 - me;
    let part = move |i: usize| i * chunk..(i + 1) * chunk;
    finish(
        move |e| e.pool.zeroed(2 * chunk),
        move |e, out| {
            out[part(me)].copy_from_slice(&own);
            let r = e.mesh.recv_coll_into(peer, op, seq, &mut out[part(peer)], crate::shm::copy);
            e.pool.put(own);
            r
        },
    )
}

/// The rest of reduce_scatter number `seq` (shares of `own.len()` bytes): the peer's part of
/// this rank's share folded with `own`, this rank's input of it.
fn reduce_scatter_rest(seq: u64, own: Vec<u8>, me: usize, (dtype, op): (DType, ReduceOp)) -> JobFn {
    let c = own.len();
    finish(
        move |e| e.pool.zeroed(c),
        move |e, out| {
            let mut fold = |at: usize, b: &[u8]| fold_share(out, &own, (at, b), (dtype, op));
            let r = e.mesh.recv_coll_with(1 - me, algo::OP_REDUCE_SCATTER, seq, c, &mut fold);
            e.pool.put(own);
            if r.is_ok() && op == ReduceOp::Avg {
                crate::reduce::finish_avg(out, dtype, 2);
            }
            r
        },
    )
}

/// The rest of broadcast number `seq` (of `n` bytes) from `root` on the other rank.
fn broadcast_rest(seq: u64, root: usize, n: usize) -> JobFn {
    finish(
        move |e| e.pool.zeroed(n),
        move |e, out| e.mesh.recv_coll_into(root, algo::OP_BROADCAST, seq, out, crate::shm::copy),
    )
}
