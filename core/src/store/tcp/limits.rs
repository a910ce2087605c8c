//! What the server lets clients make it hold: connections awaiting their hello, and bytes of
//! frames. Both are shared by every connection of one server.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::Notify;

/// Frames up to this size never wait for room under the byte budget (they still count).
pub(super) const SMALL_FRAME: usize = 64 << 10;

/// A connection awaiting its hello, as the queue of such connections sees it.
#[derive(Debug, Default)]
pub(super) struct Newcomer {
    /// Whether the client has sent anything (a real client sends its hello at once).
    spoke: AtomicBool,
    /// Told when the connection is closed to make room for a newer one.
    evict: Notify,
}

impl Newcomer {
    /// The client has sent something.
    pub(super) fn spoke(&self) {
        self.spoke.store(true, Ordering::Release);
    }

    /// Resolves when this connection is closed to make room.
    pub(super) async fn evicted(&self) {
        self.evict.notified().await
    }
}

/// The last number given to a newcomer, and the newcomers by number, oldest first.
type Queue = (u64, VecDeque<(u64, Arc<Newcomer>)>);

/// Connections awaiting their hello, oldest first, at most `max`.
#[derive(Debug)]
pub(super) struct Hellos {
    max: usize,
    queue: Mutex<Queue>,
    evicted: AtomicU64,
}

impl Hellos {
    pub(super) fn new(max: usize) -> Hellos {
        Hellos { max: max.max(1), queue: Mutex::new((0, VecDeque::new())), evicted: AtomicU64::new(0) }
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        // The queue holds no invariant a panic could break halfway.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue a new connection. When the queue is full, the oldest connection that has sent
    /// nothing (else the oldest of all) is told to close: a newcomer is always read, so
    /// clients that connect and stay silent, however many and however fast they come back,
    /// cannot keep out one that says hello at once.
    pub(super) fn admit(self: &Arc<Self>) -> HelloSlot {
        let me = Arc::new(Newcomer::default());
        let mut q = self.lock();
        if q.1.len() >= self.max {
            self.make_room(&mut q, true);
        }
        q.0 += 1;
        let id = q.0;
        q.1.push_back((id, me.clone()));
        HelloSlot { hellos: self.clone(), id, newcomer: me }
    }

    /// Tell the oldest queued connection that has sent nothing (else, with `or_oldest`, the
    /// oldest of all) to close, and take it out: whether there was one.
    fn make_room(&self, q: &mut Queue, or_oldest: bool) -> bool {
        let victim = q.1.iter().position(|(_, n)| !n.spoke.load(Ordering::Acquire)).or(or_oldest.then_some(0));
        let Some((_, n)) = victim.and_then(|v| q.1.remove(v)) else { return false };
        n.evict.notify_one();
        self.evicted.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Connections closed so far to make room for newer ones.
    pub(super) fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }
}

/// A connection's place in the queue of those awaiting their hello, until dropped.
pub(super) struct HelloSlot {
    hellos: Arc<Hellos>,
    id: u64,
    pub(super) newcomer: Arc<Newcomer>,
}

impl HelloSlot {
    /// Back at the end of the queue as one that has spoken, after being told to close while
    /// its client had in fact spoken (its bytes were not read yet): in the place of the oldest
    /// that has not (told to close in turn), or of nobody while there is room. False when
    /// every connection queued has spoken: this one closes as told. The queue never holds
    /// more than its bound, and a client that said hello at once is not closed while a silent
    /// one is queued, however slowly its connection's task gets to read.
    pub(super) fn requeue_spoken(&self) -> bool {
        self.newcomer.spoke();
        let h = &self.hellos;
        let mut q = h.lock();
        if q.1.len() >= h.max && !h.make_room(&mut q, false) {
            return false;
        }
        q.1.push_back((self.id, self.newcomer.clone()));
        true
    }
}

impl Drop for HelloSlot {
    fn drop(&mut self) {
        let mut q = self.hellos.lock();
        if let Some(i) = q.1.iter().position(|(id, _)| *id == self.id) {
            q.1.remove(i);
        }
    }
}

/// The bytes all connections may hold in frames at once.
#[derive(Debug)]
pub(super) struct Budget {
    cap: usize,
    used: Mutex<usize>,
    freed: Notify,
    pub(super) peak: AtomicUsize,
}

impl Budget {
    pub(super) fn new(cap: usize) -> Budget {
        Budget { cap, used: Mutex::new(0), freed: Notify::new(), peak: AtomicUsize::new(0) }
    }

    fn used(&self) -> MutexGuard<'_, usize> {
        self.used.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes held now.
    pub(super) fn held(&self) -> usize {
        *self.used()
    }

    fn try_take(&self, n: usize) -> bool {
        let mut used = self.used();
        // A frame larger than the whole budget goes alone, or it would never go.
        if n > SMALL_FRAME && *used + n > self.cap && *used > 0 {
            return false;
        }
        *used += n;
        self.peak.fetch_max(*used, Ordering::Relaxed);
        true
    }

    /// Room for `n` bytes, waiting until `until` for other frames to free it (frames up to
    /// [`SMALL_FRAME`] never wait); `None` at `until`.
    pub(super) async fn take(&self, n: usize, until: Instant) -> Option<Share<'_>> {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            // Registered before the check, so a release between the two is not missed.
            freed.as_mut().enable();
            if self.try_take(n) {
                return Some(Share { budget: self, n });
            }
            if tokio::time::timeout_at(until.into(), freed).await.is_err() {
                return None;
            }
        }
    }
}

impl Budget {
    /// Count `n` bytes without waiting (an answer already built).
    pub(super) fn force(&self, n: usize) -> Share<'_> {
        let mut used = self.used();
        *used += n;
        self.peak.fetch_max(*used, Ordering::Relaxed);
        Share { budget: self, n }
    }
}

/// Bytes held under a [`Budget`] until dropped.
pub(super) struct Share<'a> {
    budget: &'a Budget,
    n: usize,
}

impl Drop for Share<'_> {
    fn drop(&mut self) {
        let mut used = self.budget.used();
        *used = used.saturating_sub(self.n);
        drop(used);
        self.budget.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queued(h: &Hellos) -> Vec<u64> {
        h.lock().1.iter().map(|(id, _)| *id).collect()
    }

    #[test]
    fn a_connection_told_to_close_with_its_hello_unread_takes_a_silent_ones_place() {
        let h = Arc::new(Hellos::new(2));
        let (a, b) = (h.admit(), h.admit());
        let c = h.admit();
        assert_eq!((h.evicted(), queued(&h)), (1, vec![b.id, c.id]), "the oldest silent one goes");
        // a's hello was in its socket: it stays, and the oldest silent one (b) goes instead.
        assert!(a.requeue_spoken());
        assert_eq!((h.evicted(), queued(&h)), (2, vec![c.id, a.id]));
        // With every queued one spoken, one told to close goes as told; the queue stays at 2.
        c.newcomer.spoke();
        let d = h.admit();
        assert_eq!((h.evicted(), queued(&h)), (3, vec![a.id, d.id]), "none silent: the oldest of all (c) goes");
        d.newcomer.spoke();
        assert!(!c.requeue_spoken());
        assert_eq!(queued(&h), vec![a.id, d.id]);
        drop(a);
        assert_eq!(queued(&h), vec![d.id], "a slot dropped leaves the queue");
    }
}
