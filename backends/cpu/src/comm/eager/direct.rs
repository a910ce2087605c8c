//! The operations among more than two ranks of one host that run as they are issued (see
//! the parent module): the direct collectives' messages, every rank's to every rank, sent
//! where every ring has room, and taken once every one has arrived.

use super::*;

impl CpuComm {
    /// Whether an operation among more than two ranks, all of this host, whose messages are
    /// `bytes` bytes may run as it is issued (the look not turned off).
    fn eager_all_fits(&self, bytes: usize) -> bool {
        let (n, me) = (self.info.size, self.info.rank);
        n > 2 && bytes <= EAGER_MAX && !self.eager.spin.is_zero() && (0..n).all(|p| p == me || self.mesh.is_local(p))
    }

    /// Whether the benchmark's operation `op` of `bytes` (the larger buffer: an all_gather's
    /// output, a reduce_scatter's input; a sendrecv with the ring's neighbours) would be
    /// tried as it is issued here: the look, as words.
    pub(crate) fn eager_path_look(&self, op: &str, bytes: usize) -> Option<String> {
        let (n, me, t) = (self.info.size, self.info.rank, &self.tune);
        let part = bytes / n.max(1);
        let fits = match (op, n) {
            (_, 0 | 1) => false,
            ("sendrecv", _) => self.eager_p2p_fits((me + 1) % n, (me + n - 1) % n, bytes),
            (_, 2) => {
                let (message, max) = match op {
                    "all_reduce" => (bytes, t.all_reduce_direct_max),
                    "all_gather" | "all_to_all" | "reduce_scatter" => (part, EAGER_MAX),
                    "broadcast" | "barrier" => (bytes, EAGER_MAX),
                    _ => return None,
                };
                self.eager_fits(message, max)
            }
            ("all_reduce", _) => bytes <= t.all_reduce_direct_max && self.eager_all_fits(bytes),
            ("all_gather", _) => part <= t.all_gather_direct_max && self.eager_all_fits(part),
            ("reduce_scatter", _) => bytes <= t.all_reduce_direct_max && self.eager_all_fits(part),
            ("all_to_all", _) => part <= t.all_to_all_direct_max && self.eager_all_fits(part),
            ("broadcast", _) => self.eager_all_fits(bytes),
            ("barrier", _) => n <= crate::settings::BARRIER_DIRECT_MAX && self.eager_all_fits(0),
            _ => false,
        };
        (fits && (bytes > 0 || op == "barrier")).then(|| self.eager.describe())
    }

    /// all_gather among more than two ranks of this host, as it is issued where it may be:
    /// the direct all_gather's messages (this rank's part to every rank, every part from its
    /// rank), where parts of that size go direct (`ANYCCL_CPU_ALLGATHER_DIRECT_MAX`).
    pub(super) fn all_gather_direct_now<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>) -> Now<'a, Pair<'a>> {
        let (me, n, total) = (self.info.rank, self.info.size, recv.bytes());
        let chunk = total / n;
        if chunk == 0 || total != n * chunk || chunk > self.tune.all_gather_direct_max || !self.eager_all_fits(chunk) {
            return Now::Usual((send, recv));
        }
        let pool = &self.pool;
        let attempt = |mesh: &Mesh, seq, spin, (send, recv): &mut Pair<'a>| {
            let Some((src, out)) = host(send, recv) else { return Ok(Step::NotStarted) };
            let (before, rest) = out.split_at_mut(me * chunk);
            let (own, after) = rest.split_at_mut(chunk);
            match src {
                Some(s) if s.len() == chunk => own.copy_from_slice(s),
                Some(_) => return Ok(Step::NotStarted),
                None => {}
            }
            let own = &*own;
            let mut sink = |p: usize, at: usize, b: &[u8]| {
                let dst = if p < me { &mut before[p * chunk..] } else { &mut after[(p - me - 1) * chunk..] };
                dst[at..at + b.len()].copy_from_slice(b);
            };
            let got = mesh.exchange_all_now((algo::OP_ALL_GATHER_DIRECT, seq), &|_| own, (chunk, &mut sink), spin)?;
            Ok(step(got, || pool.copy(own)))
        };
        let rest = move |seq, own| gathered_rest(algo::OP_ALL_GATHER_DIRECT, seq, own, (me, n));
        self.try_now((None, Kind::Coll), total, (send, recv), attempt, rest, parts)
    }

    /// all_reduce among more than two ranks of this host, as it is issued where it may be:
    /// the direct all_reduce's messages (this rank's input to every rank, every rank's
    /// folded in rank order: [`algo::direct_all_reduce_now`]), where a buffer of that size
    /// goes direct (`ANYCCL_CPU_ALLREDUCE_DIRECT_MAX`).
    pub(super) fn all_reduce_direct_now<'a>(
        &'a self,
        send: Option<Buf<'a>>,
        recv: BufMut<'a>,
        op: ReduceOp,
    ) -> Now<'a, Pair<'a>> {
        let (n, dtype) = (recv.bytes(), recv.dtype());
        if n == 0 || n > self.tune.all_reduce_direct_max || !self.eager_all_fits(n) {
            return Now::Usual((send, recv));
        }
        let pool = &self.pool;
        let attempt = |mesh: &Mesh, seq, spin, (send, recv): &mut Pair<'a>| {
            let Some((src, data)) = host(send, recv) else { return Ok(Step::NotStarted) };
            let got = algo::direct_all_reduce_now(mesh, seq, data, src, (dtype, op), spin)?;
            // Not received: `data` holds the input as sent (in place), or it is in `src`.
            Ok(step(got, || pool.copy(src.unwrap_or(data))))
        };
        let rest = move |seq, own| fold_rest((algo::OP_ALL_REDUCE, seq), own, n, (dtype, op));
        self.try_now((None, Kind::Coll), n, (send, recv), attempt, rest, parts)
    }

    /// reduce_scatter (out of place) among more than two ranks of this host, as it is
    /// issued where it may be: the direct reduce_scatter's messages (each rank's chunk to it,
    /// this rank's chunk from every rank, folded in rank order:
    /// [`algo::direct_reduce_scatter_now`]), where the buffer's all_reduce goes direct.
    pub(super) fn reduce_scatter_direct_now<'a>(
        &'a self,
        send: Option<Buf<'a>>,
        recv: BufMut<'a>,
        op: ReduceOp,
    ) -> Now<'a, Pair<'a>> {
        let (me, n, c, dtype) = (self.info.rank, self.info.size, recv.bytes(), recv.dtype());
        let whole = send.as_ref().map_or(0, |s| s.bytes());
        if c == 0 || whole != n * c || whole > self.tune.all_reduce_direct_max || !self.eager_all_fits(c) {
            return Now::Usual((send, recv));
        }
        let pool = &self.pool;
        let attempt = |mesh: &Mesh, seq, spin, (send, recv): &mut Pair<'a>| {
            let Some((Some(src), out)) = host(send, recv) else { return Ok(Step::NotStarted) };
            let got = algo::direct_reduce_scatter_now(mesh, seq, out, src, (dtype, op), spin)?;
            Ok(step(got, || pool.copy(&src[me * c..(me + 1) * c])))
        };
        let rest = move |seq, own| fold_rest((algo::OP_REDUCE_SCATTER_DIRECT, seq), own, c, (dtype, op));
        self.try_now((None, Kind::Coll), whole, (send, recv), attempt, rest, parts)
    }

    /// all_to_all in even segments among more than two ranks of this host, as it is issued
    /// where it may be: the direct all_to_all's messages (each rank's segment to it, this
    /// rank's from every rank), where segments of that size go direct
    /// (`ANYCCL_CPU_ALLTOALL_DIRECT_MAX`).
    pub(super) fn all_to_all_direct_now<'a>(
        &'a self,
        send: Buf<'a>,
        recv: BufMut<'a>,
    ) -> Now<'a, (Buf<'a>, BufMut<'a>)> {
        let (me, n, total) = (self.info.rank, self.info.size, recv.bytes());
        let seg = total / n;
        if seg == 0
            || total != n * seg
            || send.bytes() != total
            || seg > self.tune.all_to_all_direct_max
            || !self.eager_all_fits(seg)
        {
            return Now::Usual((send, recv));
        }
        let pool = &self.pool;
        let attempt = |mesh: &Mesh, seq, spin, (send, recv): &mut (Buf<'a>, BufMut<'a>)| {
            let (Some(src), Some(out)) = (send.as_host_bytes(), recv.as_host_bytes_mut()) else {
                return Ok(Step::NotStarted);
            };
            let (before, rest) = out.split_at_mut(me * seg);
            let (mine, after) = rest.split_at_mut(seg);
            mine.copy_from_slice(&src[me * seg..(me + 1) * seg]);
            let mut sink = |p: usize, at: usize, b: &[u8]| {
                let dst = if p < me { &mut before[p * seg..] } else { &mut after[(p - me - 1) * seg..] };
                dst[at..at + b.len()].copy_from_slice(b);
            };
            let segment = |p: usize| &src[p * seg..(p + 1) * seg];
            let got = mesh.exchange_all_now((algo::OP_ALL_TO_ALL, seq), &segment, (seg, &mut sink), spin)?;
            Ok(step(got, || pool.copy(mine)))
        };
        let rest = move |seq, own| gathered_rest(algo::OP_ALL_TO_ALL, seq, own, (me, n));
        self.try_now((None, Kind::Coll), total, (send, recv), attempt, rest, given_parts)
    }

    /// broadcast from `root` among more than two ranks of this host, as it is issued where it
    /// may be: the binomial tree's messages ([`algo::tree_broadcast_now`]), small ones.
    pub(super) fn broadcast_tree_now<'a>(
        &'a self,
        send: Option<Buf<'a>>,
        recv: BufMut<'a>,
        root: usize,
    ) -> Now<'a, Pair<'a>> {
        let (me, n) = (self.info.rank, recv.bytes());
        if n == 0 || root >= self.info.size || !self.eager_all_fits(n) {
            return Now::Usual((send, recv));
        }
        let attempt = |mesh: &Mesh, seq, spin, (send, recv): &mut Pair<'a>| {
            let Some((src, data)) = host(send, recv) else { return Ok(Step::NotStarted) };
            if src.is_some_and(|s| s.len() != n) {
                return Ok(Step::NotStarted);
            }
            Ok(step(algo::tree_broadcast_now(mesh, seq, data, src, root, spin)?, || ()))
        };
        let rest = move |seq, ()| -> JobFn {
            finish(
                move |e| e.pool.zeroed(n),
                move |e, out| {
                    let cx = algo::Coll { mesh: &e.mesh, op: algo::OP_BROADCAST, seq, stream: false };
                    algo::broadcast(&cx, out, root)
                },
            )
        };
        // The root leaves nothing for later, nor does a rank with children
        // (`algo::tree_broadcast_now`): only a leaf's receive is left for later, and the usual
        // broadcast it runs then only receives.
        let parent = algo::tree((self.info.size, me), root).0.unwrap_or(me);
        self.try_now((Some(parent), Kind::Coll), n, (send, recv), attempt, rest, parts)
    }

    /// barrier among more than two ranks of this host, as it is issued where it may be: the
    /// direct barrier's messages (an empty one to every rank, every rank's taken), where the
    /// world goes direct ([`crate::settings::BARRIER_DIRECT_MAX`]).
    pub(super) fn barrier_direct_now(&self) -> Now<'_, ()> {
        let (me, n) = (self.info.rank, self.info.size);
        if n > crate::settings::BARRIER_DIRECT_MAX || !self.eager_all_fits(0) {
            return Now::Usual(());
        }
        let attempt = |mesh: &Mesh, seq, spin, _: &mut ()| {
            let got = mesh.exchange_all_now((algo::OP_BARRIER, seq), &|_| &[], (0, &mut |_, _, _| {}), spin)?;
            Ok(step(got, || ()))
        };
        let rest = move |seq, ()| -> JobFn {
            Box::new(move |e: &mut Engine, _| {
                for k in 1..n {
                    e.mesh.recv_coll_with((me + n - k) % n, algo::OP_BARRIER, seq, 0, &mut |_, _| {})?;
                }
                Ok(Few::new())
            })
        };
        self.try_now((None, Kind::Coll), 0, (), attempt, rest, |()| (Few::new(), Few::new()))
    }
}

/// The rest of a direct all_reduce or reduce_scatter (message `code` number `seq`) with
/// `own`, this rank's operand: every other rank's received and folded with it in rank order
/// into an output of `len` bytes ([`algo::fold_all_rest`]).
fn fold_rest(code: (u8, u64), own: Vec<u8>, len: usize, how: (DType, ReduceOp)) -> JobFn {
    finish(
        move |e| e.pool.zeroed(len),
        move |e, out| {
            let r = algo::fold_all_rest(&e.mesh, code, out, &own, how);
            e.pool.put(own);
            r
        },
    )
}

/// The rest of a direct all_gather or all_to_all (`op`) number `seq` among `n` ranks: every
/// other rank's part (received as the usual path receives them), beside `own`, this rank's.
fn gathered_rest(op: u8, seq: u64, own: Vec<u8>, (me, n): (usize, usize)) -> JobFn {
    let chunk = own.len();
    let part = move |i: usize| i * chunk..(i + 1) * chunk;
    finish(
        move |e| e.pool.zeroed(n * chunk),
        move |e, out| {
            out[part(me)].copy_from_slice(&own);
            e.pool.put(own);
            for k in 1..n {
                let from = (me + n - k) % n;
                e.mesh.recv_coll_into(from, op, seq, &mut out[part(from)], crate::shm::copy)?;
            }
            Ok(())
        },
    )
}
