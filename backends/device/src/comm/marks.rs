//! The marks of a communicator's stream: the events that settle `Work`s, each following the
//! operations numbered up to its own number, and the spare events recorded again.

use std::collections::VecDeque;

/// The marks of a communicator's stream: events on the stream, each following every
/// operation numbered up to its own number (operations are numbered in stream order), so
/// that when one is done, so are they, and one look at the device settles many `Work`s.
///
/// A mark is recorded at each operation's call, or, with `Settings::shared_completion`, at
/// the first look at a `Work` whose operation no mark follows yet (a poll, a wait, a drop),
/// at the stream's end then: a run of operations issued back to back and then waited costs
/// one event, not one each (an event record is about a tenth of an all_reduce's host time
/// on H200 hosts), and a wait also waits for what was issued after it.
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

/// Events kept for reuse at most, and live marks past which a new mark first asks whether
/// the oldest is done (so that operations whose `Work`s nobody looks at, such as stream-order
/// ones followed by a mark at each signal of an engine's stream, do not hold an event each
/// for ever). As many as a benchmark or a pipelined engine keeps in flight (a thousand calls
/// back to back, then waited): past it, each call takes an event from the runtime (on an H100
/// host, `anyccl-bench --vs-raw` with 1,000 in flight paid about 0.1 us a call more than with
/// 100 at 128 kept).
pub(super) const SPARE_MARKS: usize = 1024;

impl<E> Marks<E> {
    /// The first live mark that follows operation `op`.
    pub(super) fn following(&self, op: u64) -> Option<&(u64, E)> {
        self.live.get(self.live.partition_point(|(seq, _)| *seq < op))
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
}
