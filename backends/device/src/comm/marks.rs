//! The marks of a communicator's stream: the events that settle `Work`s, each following the
//! operations numbered up to its own number, and the spare events recorded again.

use std::collections::VecDeque;

/// The marks of a communicator's stream: events on the stream, each following every
/// operation numbered up to its own number (operations are numbered in stream order), so
/// that when one is done, so are they, and one look at the device settles many `Work`s.
///
/// The mark an operation with a `Work` is owed is recorded before anything else goes on the
/// stream (the next call, a signal of an engine's stream, a capture), so it follows that
/// operation alone; a `Work` looked at before then finds nothing on the stream after its
/// operation and asks the stream itself where the runtime can (no event at all: a step that
/// issues and waits one call at a time records none). With `Settings::shared_completion` a
/// mark is recorded at the first look at a `Work` whose operation no mark follows yet (a
/// poll, a wait, a drop), at the stream's end then: a run of operations issued back to back
/// and then waited costs one event, not one each (an event record is about a tenth of an
/// all_reduce's host time on H200 hosts), and a wait also waits for what was issued after
/// it.
///
/// A `Work` holds no event, only its operation's number: its look finds the first mark that
/// follows it, here, and asks the device under this lock. So a call moves an event between
/// two lists and records it, and counts no references: with real launches, each reference
/// count touched is a line the library's launch pushed out of the caches.
pub(super) struct Marks<E> {
    /// Marks not yet seen done, oldest first, with the operation each follows.
    pub(super) live: VecDeque<(u64, E)>,
    /// Events of marks seen done, recorded again for new marks: no event is made, and none
    /// goes back to the runtime, on every operation. An event is spare only once every
    /// operation its mark followed is done, so nothing still waits on what it was.
    pub(super) spare: Vec<E>,
    /// Every operation up to this number is done on the device (a mark that follows it was
    /// seen done); whether the library reported an error is asked after.
    pub(super) seen_done: u64,
}

impl<E> Default for Marks<E> {
    fn default() -> Self {
        Marks { live: VecDeque::new(), spare: Vec::new(), seen_done: 0 }
    }
}

/// Live marks past which a new mark that finds no spare event first looks for done ones
/// ([`Marks::newest_done`]), so that operations whose `Work`s nobody looks at (stream-order
/// ones, followed by a mark at each signal of an engine's stream) do not hold an event each
/// for ever, and a caller with more than this in flight reuses events instead of taking one
/// from the runtime on every call.
pub(super) const RECLAIM_FROM: usize = 1024;

/// Events kept for reuse at most: as many as a caller kept in flight, up to this. With
/// 1,024 kept, `anyccl-bench --vs-raw` with 2,000 calls in flight (one H100) paid 1.4 us a
/// call over raw NCCL where it paid 0.5 us with 100: each call past the 1,024th asked the
/// device about the oldest mark and made an event, and each wait gave the event back.
pub(super) const SPARE_MARKS: usize = 1 << 16;

impl<E> Marks<E> {
    /// The first live mark that follows operation `op`.
    pub(super) fn following(&self, op: u64) -> Option<&(u64, E)> {
        self.live.get(self.live.partition_point(|(seq, _)| *seq < op))
    }

    /// The number of the newest live mark that is done, asking `done` about as few as it
    /// can: the marks are on one stream, which passes them in order, so the done ones are the
    /// oldest, found by halving (at most 12 asks for 2,000 live marks). `None` while the
    /// oldest is not done (one ask).
    ///
    /// # Errors
    /// The first error `done` gives.
    pub(super) fn newest_done<X>(&self, mut done: impl FnMut(&E) -> Result<bool, X>) -> Result<Option<u64>, X> {
        let Some((oldest, e)) = self.live.front() else { return Ok(None) };
        if !done(e)? {
            return Ok(None);
        }
        // `lo` is done; every mark from `hi` on is not known to be.
        let (mut lo, mut hi, mut seq) = (0, self.live.len(), *oldest);
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            let (s, e) = &self.live[mid];
            if done(e)? {
                (lo, seq) = (mid, *s);
            } else {
                hi = mid;
            }
        }
        Ok(Some(seq))
    }

    /// The marks up to `upto` are done: their operations are, and their events are spare.
    pub(super) fn done_upto(&mut self, upto: u64) {
        self.seen_done = self.seen_done.max(upto);
        while self.live.front().is_some_and(|(seq, _)| *seq <= upto) {
            if let Some((_, e)) = self.live.pop_front().filter(|_| self.spare.len() < SPARE_MARKS) {
                self.spare.push(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(m: &Marks<u32>) -> Vec<u64> {
        m.live.iter().map(|(seq, _)| *seq).collect()
    }

    #[test]
    fn a_look_finds_the_first_mark_that_follows_its_operation() {
        let mut m = Marks::default();
        m.live.extend([(3, 30), (5, 50), (9, 90)]);
        assert_eq!(m.following(1), Some(&(3, 30)));
        assert_eq!(m.following(3), Some(&(3, 30)));
        assert_eq!(m.following(4), Some(&(5, 50)));
        assert_eq!(m.following(9), Some(&(9, 90)));
        assert_eq!(m.following(10), None, "no mark follows an operation placed after the newest");
    }

    #[test]
    fn marks_seen_done_give_their_events_back_in_order() {
        let mut m = Marks::default();
        m.live.extend([(3, 30), (5, 50), (9, 90)]);
        m.done_upto(5);
        assert_eq!(live(&m), vec![9]);
        assert_eq!(m.spare, vec![30, 50]);
        assert_eq!(m.seen_done, 5);
        // An older answer arriving late moves nothing back.
        m.done_upto(4);
        assert_eq!((m.seen_done, live(&m)), (5, vec![9]));
        // Between two marks: the operations up to it are done, the later mark is not.
        m.done_upto(7);
        assert_eq!((m.seen_done, live(&m)), (7, vec![9]));
    }

    #[test]
    fn spare_events_are_kept_up_to_the_bound() {
        let mut m = Marks::default();
        let n = SPARE_MARKS as u64 + 10;
        m.live.extend((1..=n).map(|s| (s, s as u32)));
        m.done_upto(n);
        assert!(m.live.is_empty());
        assert_eq!(m.spare.len(), SPARE_MARKS, "the rest go back to the runtime");
    }

    #[test]
    fn the_newest_done_mark_is_found_with_few_asks() {
        let mut m = Marks::default();
        m.live.extend((1..=2000u64).map(|s| (s * 2, s as u32)));
        for done_upto in [0u32, 1, 2, 999, 1500, 1999, 2000] {
            let mut asks = 0;
            let r = m.newest_done(|&e| {
                asks += 1;
                Ok::<_, ()>(e <= done_upto)
            });
            let want = (done_upto > 0).then_some(u64::from(done_upto) * 2);
            assert_eq!(r, Ok(want), "{done_upto} of 2000 done");
            assert!(asks <= 12, "{asks} asks for {done_upto} of 2000 done");
            if done_upto == 0 {
                assert_eq!(asks, 1, "a mark not done ends the search at once");
            }
        }
        assert_eq!(m.newest_done(|_| Err::<bool, _>("gone")), Err("gone"));
        m.live.clear();
        assert_eq!(m.newest_done(|_| Ok::<_, ()>(true)), Ok(None));
    }
}
