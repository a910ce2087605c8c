//! What a communicator's operations hold in memory: the bound on queued input bytes (the
//! buffers kept for the next operations are a [`crate::bufs::Pool`]).

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
