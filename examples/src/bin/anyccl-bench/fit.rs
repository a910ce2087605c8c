//! What the run's largest row needs against what the machine has, checked before the first
//! row: a row the machine cannot hold is refused with both figures, naming `-e`, instead of
//! aborting on an allocation (`-b 64G -e 64G` took 128 GiB and more).

use crate::op::{counts, Op};
use anyccl::{DType, DeviceKind, Platform, Result};
use anyccl_examples::machine::{self, Available};

/// The largest row of `first`, `first × factor`, ... up to `max`.
fn largest_row(first: usize, max: usize, factor: usize) -> usize {
    let mut row = first;
    while let Some(next) = row.checked_mul(factor).filter(|&b| b <= max && b > row) {
        row = next;
    }
    row
}

/// The run as the refusal names it: its size flags (`-b 8 -e 64G`), the op and element
/// type as written.
pub(crate) struct Run<'a> {
    pub(crate) flags: String,
    pub(crate) op: (Op, &'a str),
    pub(crate) dtype: (DType, &'a str),
    pub(crate) ranks: usize,
    /// The smallest and largest row, and the factor between rows.
    pub(crate) rows: (usize, usize, usize),
}

/// Why the run's largest row does not fit, if it does not: on the device (its send buffer
/// and one receive buffer of the larger shape), or on the host (the encoded input, the
/// in-place input and the check's copy; with the buffers too where the device is the
/// host), for every rank on this host. The caller refuses `-e` with it.
///
/// # Errors
/// A malformed `ANYCCL_MEM_LIMIT`.
pub(crate) fn shortfall(run: &Run<'_>, platform: &dyn Platform, local_ranks: usize) -> Result<Option<String>> {
    let (first, max, factor) = run.rows;
    let row = largest_row(first, max, factor);
    let (sc, rc) = counts(run.op.0, row, run.dtype.0.size(), run.ranks);
    let es = run.dtype.0.size() as u64;
    let (sc, big) = (sc as u64, sc.max(rc) as u64);
    let device = es.saturating_mul(sc.saturating_add(big));
    let host = es.saturating_mul(sc.saturating_add(big.saturating_mul(2)));
    let on_cpu = platform.kind() == DeviceKind::Cpu;
    let local = local_ranks.max(1) as u64;
    let say = |what: &str, each: u64, ranks: u64, have: Available| {
        let all = if ranks > 1 {
            format!(", {ranks} ranks on this host {}", machine::size(each.saturating_mul(ranks)))
        } else {
            String::new()
        };
        format!(
            "{}: the largest row ({row} B of {} in {} on {} rank(s)) needs about {} of {what} memory per rank{all}, \
             and this {what} has {have}: choose a smaller -e",
            run.flags,
            run.op.1,
            run.dtype.1,
            run.ranks,
            machine::size(each),
        )
    };
    let host_each = if on_cpu { host.saturating_add(device) } else { host };
    if let Some(have) = machine::host_available()? {
        if host_each.saturating_mul(local) > have.bytes {
            return Ok(Some(say("host", host_each, local, have)));
        }
    }
    if !on_cpu {
        if let Ok(m) = platform.mem_info() {
            let free = Available { bytes: m.free, source: "free device memory" };
            if let Some(have) = machine::capped(Some(free), machine::memory_limit()?) {
                if device > have.bytes {
                    return Ok(Some(say("device", device, 1, have)));
                }
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::largest_row;

    #[test]
    fn the_largest_row_is_the_last_one_run() {
        assert_eq!(largest_row(8, 128 << 20, 2), 128 << 20);
        assert_eq!(largest_row(8, 100, 2), 64);
        assert_eq!(largest_row(64 << 30, 64 << 30, 2), 64 << 30);
        assert_eq!(largest_row(3, 3, 7), 3);
    }
}
