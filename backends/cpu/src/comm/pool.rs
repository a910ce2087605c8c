//! What a communicator's operations hold in memory: the bound on queued input bytes, and
//! the buffers kept for the next operations.

use super::*;

/// Queued input bytes counted against the bound until dropped.
pub(super) struct Admission {
    pub(super) queue: Arc<Queue>,
    /// What the job's inputs hold while queued ([`super::work::held`]).
    pub(super) bytes: usize,
    /// The inputs' sizes.
    pub(super) size: usize,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.queue.release(self.bytes);
    }
}

/// Buffers of finished operations kept for the next ones: a fresh buffer of MiBs costs a
/// page fault and a zeroed page every 4 KiB, more than the copy into it. It keeps at most
/// the queue bound's worth of capacity (`ANYCCL_CPU_MAX_QUEUED_BYTES`).
#[derive(Debug)]
pub(super) struct Pool {
    bufs: Mutex<Vec<Vec<u8>>>,
    /// Bytes of capacity kept at most.
    limit: usize,
}

impl Pool {
    /// Buffers below this size come from the allocator's own caches.
    const MIN: usize = 64 << 10;
    const MAX_BUFS: usize = 1024;

    /// An empty pool that keeps at most `limit` bytes.
    pub(super) fn new(limit: usize) -> Pool {
        Pool { bufs: Mutex::new(Vec::new()), limit }
    }

    /// An empty buffer with room for `len` bytes.
    pub(super) fn get(&self, len: usize) -> Vec<u8> {
        if len >= Self::MIN {
            let mut bufs = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = bufs.iter().position(|b| b.capacity() >= len) {
                let mut b = bufs.swap_remove(i);
                b.clear();
                return b;
            }
        }
        Vec::with_capacity(len)
    }

    /// A copy of `src`.
    pub(super) fn copy(&self, src: &[u8]) -> Vec<u8> {
        let mut v = self.get(src.len());
        crate::shm::copy_to_vec(&mut v, src);
        v
    }

    /// `len` zero bytes.
    pub(super) fn zeroed(&self, len: usize) -> Vec<u8> {
        let mut v = self.get(len);
        v.resize(len, 0);
        v
    }

    pub(super) fn put(&self, b: Vec<u8>) {
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

/// Input bytes of queued jobs, bounded (see the module doc). Taking and giving back a share
/// is one atomic operation; the lock and the condition variable serve only callers that
/// wait for room.
#[derive(Debug)]
pub(super) struct Queue {
    bytes: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
    /// Threads waiting for room (a release with none takes no lock).
    waiters: AtomicUsize,
    pub(super) limit: usize,
}

impl Queue {
    pub(super) fn new(limit: usize) -> Queue {
        Queue {
            bytes: AtomicUsize::new(0),
            lock: Mutex::new(()),
            cv: Condvar::new(),
            waiters: AtomicUsize::new(0),
            limit,
        }
    }

    /// Bytes held now.
    pub(super) fn held(&self) -> usize {
        self.bytes.load(Ordering::SeqCst)
    }

    /// Take `n` bytes if they fit the bound (a share larger than the bound fits an empty
    /// queue).
    pub(super) fn try_take(&self, n: usize) -> bool {
        let mut cur = self.bytes.load(Ordering::SeqCst);
        while cur == 0 || cur.saturating_add(n) <= self.limit {
            match self.bytes.compare_exchange_weak(cur, cur.saturating_add(n), Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return true,
                Err(c) => cur = c,
            }
        }
        false
    }

    /// Wait until `n` bytes fit the bound and take them, at most `slice`; whether they were
    /// taken.
    pub(super) fn take_within(&self, n: usize, slice: Duration) -> bool {
        let g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.waiters.fetch_add(1, Ordering::SeqCst);
        // Looked at after announcing the wait: a release now either is seen here or wakes it.
        let taken = self.try_take(n) || {
            drop(self.cv.wait_timeout(g, slice).unwrap_or_else(|p| p.into_inner()));
            self.try_take(n)
        };
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        taken
    }

    pub(super) fn release(&self, n: usize) {
        let _ = self.bytes.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| Some(b.saturating_sub(n)));
        if self.waiters.load(Ordering::SeqCst) > 0 {
            drop(self.lock.lock().unwrap_or_else(|p| p.into_inner()));
            self.cv.notify_all();
        }
    }
}
