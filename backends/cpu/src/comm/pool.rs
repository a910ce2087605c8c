//! What a communicator's operations hold in memory: the bound on queued input bytes, and
//! the buffers kept for the next operations.

use super::*;

/// Queued input bytes counted against the bound until dropped.
pub(super) struct Admission {
    pub(super) queue: Arc<Queue>,
    pub(super) bytes: usize,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.queue.release(self.bytes);
    }
}

/// Buffers of finished operations kept for the next ones: a fresh buffer of MiBs costs a
/// page fault and a zeroed page every 4 KiB, more than the copy into it. It holds at most
/// the queue bound (`ANYCCL_CPU_MAX_QUEUED_BYTES`), what operations in flight may hold.
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

/// Input bytes of queued jobs, bounded (see the module doc).
#[derive(Debug)]
pub(super) struct Queue {
    pub(super) bytes: Mutex<usize>,
    pub(super) cv: Condvar,
    /// Threads waiting in `admit` (a release with none makes no system call).
    pub(super) waiters: AtomicUsize,
    pub(super) limit: usize,
}

impl Queue {
    pub(super) fn release(&self, n: usize) {
        let mut b = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
        *b = b.saturating_sub(n);
        drop(b);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.cv.notify_all();
        }
    }
}
