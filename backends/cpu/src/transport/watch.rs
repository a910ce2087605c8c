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
    /// How long a wait lasts before [`Watch::long`] says so.
    long_after: Duration,
}

/// How long a wait on one peer lasts before it also copies what other peers of this host
/// sent it by reference and wait for to its inbox (`Mesh::serve`): such a sender may be
/// the rank that this wait waits for, through others.
pub(super) const DRAIN_AFTER: Duration = Duration::from_millis(1);

/// How long a wait for the copy of a message of `len` bytes sent by reference lasts before
/// it serves: [`DRAIN_AFTER`] and the copy's own time at 2 GB/s (a receiver sharing its CPU
/// with other ranks), so a peer still copying is not taken for one in a cycle. Served after
/// a millisecond, a 4-rank sendrecv ring of 32 MiB on 2 cores moved most messages to the
/// inbox, copying each twice: 24.5 ms a call, 17.6 with 20 ms.
pub(super) fn drain_after_copy(len: usize) -> Duration {
    DRAIN_AFTER + Duration::from_nanos(len as u64 / 2)
}

impl Watch {
    pub(super) fn new(timeout: Duration) -> Watch {
        Watch { timeout, at: std::cell::Cell::new(None), since: std::cell::Cell::new(None), long_after: DRAIN_AFTER }
    }

    /// A watch whose wait is long after `d` instead of [`DRAIN_AFTER`].
    pub(super) fn long_after(self, d: Duration) -> Watch {
        Watch { long_after: d, ..self }
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

    /// Whether the peer has made no progress for [`DRAIN_AFTER`] (or the watch's own time).
    pub(super) fn long(&self) -> bool {
        self.since.get().is_some_and(|t| t.elapsed() >= self.long_after)
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
