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
        let rest = move |seq, own| all_gather_direct_rest(seq, own, (me, n));
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
        let rest = move |seq, own: Vec<u8>| -> JobFn {
            finish(
                move |e| e.pool.zeroed(n),
                move |e, out| {
                    let r = algo::direct_all_reduce_rest(&e.mesh, seq, out, &own, (dtype, op));
                    e.pool.put(own);
                    r
                },
            )
        };
        self.try_now((None, Kind::Coll), n, (send, recv), attempt, rest, parts)
    }
}

/// The rest of a direct all_gather number `seq` among `n` ranks: every other rank's part
/// (received as the usual path receives them), beside `own`, this rank's.
fn all_gather_direct_rest(seq: u64, own: Vec<u8>, (me, n): (usize, usize)) -> JobFn {
    let chunk = own.len();
    let part = move |i: usize| i * chunk..(i + 1) * chunk;
    finish(
        move |e| e.pool.zeroed(n * chunk),
        move |e, out| {
            out[part(me)].copy_from_slice(&own);
            e.pool.put(own);
            for k in 1..n {
                let from = (me + n - k) % n;
                e.mesh.recv_coll_into(from, algo::OP_ALL_GATHER_DIRECT, seq, &mut out[part(from)], crate::shm::copy)?;
            }
            Ok(())
        },
    )
}
