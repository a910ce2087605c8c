//! What a communicator's operations hold in memory: the bound on queued input bytes, and
//! the admission of each operation under it (the buffers kept for the next operations are
//! a [`crate::bufs::Pool`]).

use super::*;

/// Queued input bytes counted against the bound until dropped.
pub(super) struct Admission {
    pub(super) queue: Arc<Queue>,
    /// What the job's inputs hold while queued ([`super::work::held`]).
    pub(super) bytes: usize,
    /// The inputs' sizes.
    pub(super) size: usize,
    /// No other job was queued or running when this one was admitted.
    pub(super) alone: bool,
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
    /// queue); the bytes held before, if taken.
    pub(super) fn try_take(&self, n: usize) -> Option<usize> {
        let mut cur = self.bytes.load(Ordering::SeqCst);
        while cur == 0 || cur.saturating_add(n) <= self.limit {
            match self.bytes.compare_exchange_weak(cur, cur.saturating_add(n), Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return Some(cur),
                Err(c) => cur = c,
            }
        }
        None
    }

    /// Wait until `n` bytes fit the bound and take them, at most `slice`; whether they were
    /// taken.
    pub(super) fn take_within(&self, n: usize, slice: Duration) -> bool {
        let g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.waiters.fetch_add(1, Ordering::SeqCst);
        // Looked at after announcing the wait: a release now either is seen here or wakes it.
        let taken = self.try_take(n).is_some() || {
            drop(self.cv.wait_timeout(g, slice).unwrap_or_else(|p| p.into_inner()));
            self.try_take(n).is_some()
        };
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        taken
    }

    /// Whether `n` bytes more fit the bound now.
    pub(super) fn has_room(&self, n: usize) -> bool {
        self.held().saturating_add(n) <= self.limit
    }

    /// Count `n` bytes in, over the bound if need be (for a job that must be queued: its
    /// operation is under way).
    pub(super) fn take_anyway(&self, n: usize) {
        self.bytes.fetch_add(n, Ordering::SeqCst);
    }

    pub(super) fn release(&self, n: usize) {
        let _ = self.bytes.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| Some(b.saturating_sub(n)));
        if self.waiters.load(Ordering::SeqCst) > 0 {
            drop(self.lock.lock().unwrap_or_else(|p| p.into_inner()));
            self.cv.notify_all();
        }
    }
}

impl CpuComm {
    /// The admission of a job with one input of `n` bytes that must be queued now (its
    /// operation is under way): counted even past the bound (by one job at most: the eager
    /// path starts only where there is room, `Queue::has_room`).
    pub(super) fn admitted_anyway(&self, n: usize) -> Admission {
        let bytes = work::counted(n);
        self.queue.take_anyway(bytes);
        Admission { queue: self.queue.clone(), bytes, size: n, alone: false }
    }

    /// Wait until a job with inputs of these sizes fits the queue bound (a job larger than
    /// the bound waits for an empty queue), at most the operation timeout. Each input counts
    /// what it holds while queued ([`work::held`]: a lent one as the largest copied one), the
    /// job at least its record ([`work::RECORD`]), so
    /// that many large operations issued before a wait stay lent and run in their callers'
    /// waits on the callers' buffers. (Counting a lent input at its size, ten 32 MiB
    /// all_reduce in flight on 2 ranks ran at 0.8-0.9 GB/s against 3.0 one at a time: past
    /// 256 MiB every enqueue ran a queued job here, copying its input in and results out.)
    pub(super) fn admit(&self, inputs: impl IntoIterator<Item = usize>) -> Result<Admission> {
        let (mut bytes, mut size) = (0usize, 0usize);
        for n in inputs {
            bytes = bytes.saturating_add(work::held(n));
            size = size.saturating_add(n);
        }
        let bytes = bytes.max(work::RECORD);
        let q = &self.queue;
        if let Some(before) = q.try_take(bytes) {
            return Ok(Admission { queue: q.clone(), bytes, size, alone: before == 0 });
        }
        let t = self.mesh.op_timeout;
        let deadline = anyccl_core::deadline_in(t);
        loop {
            // Run queued jobs on this thread while the engine is free, as many as make room: a
            // job run here copies its lent input in and its results out, while one left queued
            // may still run in its own caller's wait, on the caller's buffers.
            let mut st = self.sched.lock();
            let mut room = false;
            while !room && st.engine.is_some() && !st.jobs.is_empty() {
                st = self.sched.run_front(st, None).0;
                room = q.try_take(bytes).is_some();
            }
            drop(st);
            if room || q.try_take(bytes).is_some() {
                break;
            }
            if let Some(d) = self.mesh.mailbox.dead() {
                return Err(self.mesh.dead_err(d));
            }
            let now = Instant::now();
            if now >= deadline {
                let detail = format!(
                    "{} bytes of earlier operations stayed queued (limit {}, ANYCCL_CPU_MAX_QUEUED_BYTES): the \
                     communicator made no progress",
                    q.held(),
                    q.limit
                );
                return Err(self.mesh.ctx.timeout("enqueue", t, detail));
            }
            if q.take_within(bytes, (deadline - now).min(Duration::from_millis(100))) {
                break;
            }
        }
        Ok(Admission { queue: q.clone(), bytes, size, alone: false })
    }
}
