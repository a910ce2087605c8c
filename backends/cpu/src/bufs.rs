//! Buffers kept for reuse, so that large operations and messages do not fault fresh pages
//! in on every call.

use std::sync::Mutex;

/// `n` zeroed bytes, or `None` where they cannot be allocated (a length a peer announced).
pub(crate) fn try_zeroed(n: usize) -> Option<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).ok()?;
    v.resize(n, 0);
    Some(v)
}

/// Buffers kept for the next operations or messages: a fresh buffer of MiBs costs a page
/// fault and a zeroed page every 4 KiB, more than the copy into it. It keeps at most a
/// bound's worth of capacity (a communicator's, `ANYCCL_CPU_MAX_QUEUED_BYTES`; a mesh's
/// inbox, `ANYCCL_CPU_MAX_INBOX_BYTES`).
#[derive(Debug)]
pub(crate) struct Pool {
    bufs: Mutex<Vec<Vec<u8>>>,
    /// Bytes of capacity kept at most.
    limit: usize,
}

impl Pool {
    /// Buffers below this size come from the allocator's own caches.
    const MIN: usize = 64 << 10;
    const MAX_BUFS: usize = 1024;

    /// An empty pool that keeps at most `limit` bytes.
    pub(crate) fn new(limit: usize) -> Pool {
        Pool { bufs: Mutex::new(Vec::new()), limit }
    }

    /// The smallest kept buffer that `fits`, for a request of `len` bytes (none below
    /// [`Pool::MIN`]): a small request does not take a large buffer that a later one needs.
    fn take(&self, len: usize, fits: impl Fn(&Vec<u8>) -> bool) -> Option<Vec<u8>> {
        if len < Self::MIN {
            return None;
        }
        let mut bufs = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let i = bufs.iter().enumerate().filter(|(_, b)| fits(b)).min_by_key(|(_, b)| b.capacity())?.0;
        Some(bufs.swap_remove(i))
    }

    /// An empty buffer with room for `len` bytes.
    pub(crate) fn get(&self, len: usize) -> Vec<u8> {
        match self.take(len, |b| b.capacity() >= len) {
            Some(mut b) => {
                b.clear();
                b
            }
            None => Vec::with_capacity(len),
        }
    }

    /// A copy of `src`.
    pub(crate) fn copy(&self, src: &[u8]) -> Vec<u8> {
        let mut v = self.get(src.len());
        crate::shm::copy_to_vec(&mut v, src);
        v
    }

    /// `len` zero bytes.
    pub(crate) fn zeroed(&self, len: usize) -> Vec<u8> {
        let mut v = self.get(len);
        v.resize(len, 0);
        v
    }

    /// `len` bytes to be overwritten whole (what they hold is left from an earlier use), or
    /// `None` where they cannot be allocated: the smallest kept buffer of at least that
    /// length is only shortened, where zeroing it would cost a pass over the memory.
    pub(crate) fn filled(&self, len: usize) -> Option<Vec<u8>> {
        if let Some(mut b) = self.take(len, |b| b.len() >= len) {
            b.truncate(len);
            return Some(b);
        }
        try_zeroed(len)
    }

    /// Keep `b` for a later request, within the bound: where it is full, in place of the
    /// smallest kept buffer if `b` is larger. The capacity held is summed here, a pass over
    /// the few buffers kept, as [`Pool::take`] makes one.
    pub(crate) fn put(&self, b: Vec<u8>) {
        if b.capacity() < Self::MIN || b.capacity() > self.limit {
            return;
        }
        let mut bufs = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let held: usize = bufs.iter().map(|b| b.capacity()).sum();
        if bufs.len() < Self::MAX_BUFS && held + b.capacity() <= self.limit {
            bufs.push(b);
        } else if let Some((i, _)) = bufs.iter().enumerate().min_by_key(|(_, x)| x.capacity()) {
            // Keep the larger buffers: they are the ones worth keeping.
            if bufs[i].capacity() < b.capacity() && held - bufs[i].capacity() + b.capacity() <= self.limit {
                bufs[i] = b;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Pool;

    #[test]
    fn a_kept_buffer_is_shortened_not_zeroed() {
        let pool = Pool::new(1 << 20);
        let n = Pool::MIN * 2;
        let b = vec![7u8; n];
        let at = b.as_ptr();
        pool.put(b);
        let again = pool.filled(Pool::MIN).expect("kept");
        assert_eq!((again.len(), again.as_ptr()), (Pool::MIN, at), "the kept buffer, shortened");
        assert!(again.iter().all(|&x| x == 7), "left as it was: every byte is to be overwritten");
        // The smallest that is long enough.
        pool.put(vec![8u8; n * 4]);
        pool.put(vec![9u8; n]);
        assert_eq!(pool.filled(n).expect("kept")[0], 9, "the smallest kept buffer that fits");
        // Nothing kept is long enough: a fresh buffer, zeroed.
        let fresh = pool.filled(n * 8).expect("allocated");
        assert_eq!(fresh.len(), n * 8);
        assert!(fresh.iter().all(|&x| x == 0));
        // Beyond the bound: not kept.
        pool.put(vec![1u8; 2 << 20]);
        assert!(pool.filled(2 << 20).expect("allocated").iter().all(|&x| x == 0));
    }

    #[test]
    fn what_is_taken_out_no_longer_counts_against_the_bound() {
        let q = 256 << 10;
        let pool = Pool::new(4 * q);
        for v in 0..4 {
            pool.put(vec![v; q]);
        }
        pool.put(vec![9; q]);
        let firsts: Vec<u8> = (0..4).map(|_| pool.filled(q).expect("kept")[0]).collect();
        assert!(firsts.iter().all(|&x| x < 4), "the bound was full: the fifth was not kept ({firsts:?})");
        for v in 4..8 {
            pool.put(vec![v; q]);
        }
        let again: Vec<u8> = (0..4).map(|_| pool.filled(q).expect("kept")[0]).collect();
        assert!(again.iter().all(|&x| (4..8).contains(&x)), "taken out, they made room ({again:?})");
    }
}
