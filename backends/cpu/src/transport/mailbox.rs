//! Where a rank's incoming messages wait until its operations take them: a queue per peer
//! and kind, bounded, and the communicator's death, which ends every wait.

use super::*;

pub(super) struct CollMsg {
    pub(super) op: u8,
    pub(super) seq: u64,
    pub(super) data: Vec<u8>,
}

#[derive(Default)]
pub(super) struct Inbox {
    pub(super) coll: VecDeque<CollMsg>,
    p2p: VecDeque<Vec<u8>>,
    pub(super) closed: Option<String>,
    /// Bytes of the messages held.
    pub(super) bytes: usize,
}

impl Inbox {
    pub(super) fn pop_coll(&mut self) -> Option<CollMsg> {
        let m = self.coll.pop_front()?;
        self.bytes -= m.data.len();
        Some(m)
    }
    pub(super) fn pop_p2p(&mut self) -> Option<Vec<u8>> {
        let m = self.p2p.pop_front()?;
        self.bytes -= m.len();
        Some(m)
    }
}

#[derive(Default)]
pub(super) struct State {
    pub(super) inbox: Vec<Inbox>,
    /// Set once the communicator is aborted or has failed: every wait returns this.
    pub(super) dead: Option<Dead>,
}

#[derive(Clone, Debug)]
pub(crate) struct Dead {
    pub aborted: bool,
    pub peer: Option<usize>,
    pub detail: String,
}

/// Why a wait for a peer's message ended without one.
pub(crate) enum Missed {
    /// The communicator is dead (aborted, failed, or the peer closed).
    Dead(Dead),
    /// Nothing arrived before the deadline.
    TimedOut,
}

/// Where reader threads deliver messages and the engine waits for them.
pub(crate) struct Mailbox {
    pub(super) state: Mutex<State>,
    pub(super) cv: Condvar,
    /// Set once `state.dead` is: every send checks it, without taking the lock.
    pub(super) is_dead: AtomicBool,
    /// Set once a peer's connection closed (its inbox's `closed`), read without the lock by
    /// shared-memory waits.
    pub(super) closed: Vec<AtomicBool>,
    /// Messages held from each peer (changed under the lock): a look at an empty inbox, the
    /// usual case between peers of one host, takes no lock.
    queued: Vec<AtomicUsize>,
    /// Bytes a peer's unconsumed messages may hold before its reader stops reading
    /// (`ANYCCL_CPU_MAX_INBOX_BYTES`): the peer's writes then wait, and end at the
    /// operation timeout if this rank consumes nothing.
    pub(crate) inbox_limit: usize,
}

impl Mailbox {
    pub(super) fn new(n: usize, inbox_limit: usize) -> Self {
        let mut st = State::default();
        st.inbox.resize_with(n, Inbox::default);
        let closed = (0..n).map(|_| AtomicBool::new(false)).collect();
        let queued = (0..n).map(|_| AtomicUsize::new(0)).collect();
        Mailbox {
            state: Mutex::new(st),
            cv: Condvar::new(),
            is_dead: AtomicBool::new(false),
            closed,
            queued,
            inbox_limit,
        }
    }

    /// Block the reader of `from` while that peer's unconsumed messages fill the bound (one
    /// message beyond it is always accepted, however large), or until the mailbox dies.
    pub(super) fn wait_room(&self, from: usize) {
        let mut st = self.lock();
        while st.dead.is_none() && st.inbox[from].bytes >= self.inbox_limit {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned mailbox only means a reader panicked mid-push; the data is still
        // consistent (each push is one VecDeque operation), so keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn push_coll(&self, from: usize, m: CollMsg) {
        let mut st = self.lock();
        st.inbox[from].bytes += m.data.len();
        st.inbox[from].coll.push_back(m);
        self.queued[from].fetch_add(1, Ordering::Release);
        drop(st);
        self.cv.notify_all();
    }

    pub(super) fn push_p2p(&self, from: usize, data: Vec<u8>) {
        let mut st = self.lock();
        st.inbox[from].bytes += data.len();
        st.inbox[from].p2p.push_back(data);
        self.queued[from].fetch_add(1, Ordering::Release);
        drop(st);
        self.cv.notify_all();
    }

    pub(super) fn close(&self, from: usize, why: String) {
        let mut st = self.lock();
        if st.inbox[from].closed.is_none() {
            st.inbox[from].closed = Some(why);
            self.closed[from].store(true, Ordering::Release);
        }
        drop(st);
        self.cv.notify_all();
    }

    /// Mark the whole communicator dead (first reason wins).
    pub(crate) fn kill(&self, dead: Dead) {
        let mut st = self.lock();
        if st.dead.is_none() {
            st.dead = Some(dead);
            self.is_dead.store(true, Ordering::Release);
        }
        drop(st);
        self.cv.notify_all();
    }

    pub(crate) fn dead(&self) -> Option<Dead> {
        if !self.is_dead.load(Ordering::Acquire) {
            return None;
        }
        self.lock().dead.clone()
    }

    /// Why `from`'s connection closed, once it has.
    pub(super) fn closed_why(&self, from: usize) -> Option<String> {
        if !self.closed[from].load(Ordering::Acquire) {
            return None;
        }
        self.lock().inbox[from].closed.clone()
    }

    /// The next message `take` selects from what `from` sent and was drained, without waiting.
    pub(super) fn try_take<T>(&self, from: usize, take: impl FnOnce(&mut Inbox) -> Option<T>) -> Option<T> {
        if self.empty(from) {
            return None;
        }
        let mut st = self.lock();
        let v = take(&mut st.inbox[from]);
        if v.is_some() {
            self.queued[from].fetch_sub(1, Ordering::Release);
        }
        v
    }

    /// Nothing from `from` is held (as of the last push or take this thread can have seen).
    fn empty(&self, from: usize) -> bool {
        self.queued[from].load(Ordering::Acquire) == 0
    }

    pub(super) fn has_coll(&self, from: usize) -> bool {
        !self.empty(from) && !self.lock().inbox[from].coll.is_empty()
    }

    pub(super) fn has_p2p(&self, from: usize) -> bool {
        !self.empty(from) && !self.lock().inbox[from].p2p.is_empty()
    }

    pub(super) fn held(&self, from: usize) -> usize {
        if self.empty(from) {
            return 0;
        }
        self.lock().inbox[from].bytes
    }

    /// Wait, until `deadline`, for the next message from `from` selected by `take`.
    pub(super) fn wait_for<T>(
        &self,
        from: usize,
        deadline: Instant,
        mut take: impl FnMut(&mut Inbox) -> Option<T>,
    ) -> std::result::Result<T, Missed> {
        let mut st = self.lock();
        loop {
            if let Some(d) = &st.dead {
                return Err(Missed::Dead(d.clone()));
            }
            let full = st.inbox[from].bytes >= self.inbox_limit;
            if let Some(v) = take(&mut st.inbox[from]) {
                self.queued[from].fetch_sub(1, Ordering::Release);
                if full && st.inbox[from].bytes < self.inbox_limit {
                    // The peer's reader may be waiting for room.
                    drop(st);
                    self.cv.notify_all();
                }
                return Ok(v);
            }
            if let Some(why) = &st.inbox[from].closed {
                return Err(Missed::Dead(Dead { aborted: false, peer: Some(from), detail: why.clone() }));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Missed::TimedOut);
            }
            st = self.cv.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}
