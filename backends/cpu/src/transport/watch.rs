//! The deadline of a wait on a peer of this host, and when such a wait also serves the
//! peers that wait for it.

use std::time::{Duration, Instant};

/// The deadline of a wait on a peer: the operation timeout from when a wait first looks at
/// it, again from the next look after the peer made progress. A message that needs no
/// waiting reads no clock.
pub(super) struct Watch {
    timeout: Duration,
    at: std::cell::Cell<Option<Instant>>,
    /// When the deadline last started.
    since: std::cell::Cell<Option<Instant>>,
}

/// How long a wait on one peer lasts before it also copies what other peers of this host
/// sent it by reference and wait for to its inbox (`Mesh::serve`): such a sender may be
/// the rank that this wait waits for, through others.
pub(super) const DRAIN_AFTER: Duration = Duration::from_millis(1);

impl Watch {
    pub(super) fn new(timeout: Duration) -> Watch {
        Watch { timeout, at: std::cell::Cell::new(None), since: std::cell::Cell::new(None) }
    }

    /// The deadline, started now if it was not running.
    pub(super) fn at(&self) -> Instant {
        match self.at.get() {
            Some(t) => t,
            None => {
                let t = anyccl_core::deadline_in(self.timeout);
                self.at.set(Some(t));
                self.since.set(Some(Instant::now()));
                t
            }
        }
    }

    /// Whether the peer has made no progress for [`DRAIN_AFTER`] (or longer).
    pub(super) fn long(&self) -> bool {
        self.since.get().is_some_and(|t| t.elapsed() >= DRAIN_AFTER)
    }

    /// The peer made progress: the next look starts the deadline again.
    pub(super) fn restart(&self) {
        self.at.set(None);
        self.since.set(None);
    }

    /// [`Watch::restart`] when `now` (the bytes the peer has moved) is not `*last`: the
    /// deadline is for a peer that moves nothing, so it runs again while data flows.
    pub(super) fn restart_on_progress(&self, last: &mut u64, now: u64) {
        if std::mem::replace(last, now) != now {
            self.restart();
        }
    }
}
