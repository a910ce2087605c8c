//! The check of a row's results: every expected output, tabulated once, and the count of
//! wrong elements in a receive buffer.

use crate::op::Op;
use anyccl::raw::pattern;
use anyccl::{Communicator, DType, DeviceMemory, Platform, ReduceOp, Result};

/// Every expected output of a row, tabulated once: inputs repeat every `pattern::PERIOD`
/// elements, so an output element is a lookup by its source rank and index modulo the
/// period (the check of a 1 GiB buffer allocates nothing per element).
struct Expected {
    op: Op,
    n: usize,
    me: usize,
    root: usize,
    /// Output elements this rank checks.
    count: usize,
    /// The reduction over all ranks, by index modulo the period.
    reduced: [f64; pattern::PERIOD],
    /// Each rank's input as stored, by index modulo the period.
    inputs: Vec<[f64; pattern::PERIOD]>,
}

impl Expected {
    fn new(op: Op, dtype: DType, rop: ReduceOp, n: usize, me: usize, root: usize, count: usize) -> Self {
        let reduced = std::array::from_fn(|k| pattern::reduced(n, k, dtype, rop, 0));
        let inputs = (0..n)
            .map(|r| std::array::from_fn(|k| pattern::round_trip(pattern::value(r, k, Some(rop), 0), dtype)))
            .collect();
        Expected { op, n, me, root, count, reduced, inputs }
    }

    /// Output element `i` on this rank (`None`: not defined here, e.g. reduce off the root).
    fn at(&self, i: usize) -> Option<f64> {
        const P: usize = pattern::PERIOD;
        let (n, me) = (self.n, self.me);
        let per = (self.count / n).max(1);
        Some(match self.op {
            Op::AllReduce => self.reduced[i % P],
            Op::Reduce => {
                if me != self.root {
                    return None;
                }
                self.reduced[i % P]
            }
            Op::Broadcast => self.inputs[self.root][i % P],
            Op::AllGather => self.inputs[i / per][(i % per) % P],
            Op::ReduceScatter => self.reduced[(me * self.count + i) % P],
            Op::AllToAll => self.inputs[i / per][(me * per + i % per) % P],
            Op::SendRecv => self.inputs[(me + n - 1) % n][i % P],
            Op::Barrier => return None,
        })
    }
}

/// Wrong elements in `recv` after one operation of the row, counted on this host's share of
/// the cores.
#[allow(clippy::too_many_arguments)] // the row's shape and the buffer
pub(crate) fn wrong(
    platform: &dyn Platform,
    op: Op,
    dtype: DType,
    rop: ReduceOp,
    comm: &Communicator,
    root: usize,
    recv: &dyn DeviceMemory,
    in_place: bool,
    local_ranks: usize,
) -> Result<usize> {
    let es = dtype.size();
    let mut bytes = vec![0u8; recv.count() * es];
    platform.copy_to_host(recv, &mut bytes)?;
    let (n, me) = (comm.size(), comm.rank());
    let (mut data, mut count) = (&bytes[..], recv.count());
    if in_place && op == Op::ReduceScatter {
        // The result is this rank's chunk of the whole buffer.
        count = recv.count() / n;
        data = &bytes[me * count * es..(me + 1) * count * es];
    }
    let want = Expected::new(op, dtype, rop, n, me, root, count);
    let tol = pattern::tolerance(dtype, Some(rop));
    let check = |first: usize, chunk: &[u8]| {
        chunk
            .chunks_exact(es)
            .enumerate()
            .filter(|(j, b)| want.at(first + j).is_some_and(|w| !pattern::close(pattern::decode_one(b, dtype), w, tol)))
            .count()
    };
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = (cores / local_ranks.max(1)).clamp(1, 16).min(count.div_ceil(1 << 20)).max(1);
    let per = count.div_ceil(threads);
    let bad = std::thread::scope(|s| {
        let parts: Vec<_> = data
            .chunks(per * es)
            .enumerate()
            .map(|(t, chunk)| {
                let check = &check;
                s.spawn(move || check(t * per, chunk))
            })
            .collect();
        parts.into_iter().map(|h| h.join().unwrap_or(usize::MAX)).fold(0usize, usize::saturating_add)
    });
    Ok(bad)
}
