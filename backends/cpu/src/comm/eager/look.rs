//! How long an operation tried as it is issued looks for its peer's message, and how often it
//! looks at all: misses in a row make calls send without looking; in a pipeline of calls, a
//! miss whose message came within the longest look (a near miss) lengthens the look to what
//! would have taken it, a later one shortens it again.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How many times the configured look a look may grow to after near misses, and the longest
/// it grows to (the longest that may be configured).
const GROWTH: u32 = 16;
const LONGEST: Duration = Duration::from_millis(1);

/// How a communicator tries the eager path.
#[derive(Debug)]
pub(in crate::comm) struct Eagerness {
    /// The configured look (zero: never tried), the shortest the look gets.
    pub(in crate::comm) spin: Duration,
    /// The longest: `GROWTH` times `spin` up to `LONGEST` (never shorter than `spin`), or
    /// `spin` where a host's ranks outnumber its CPUs (a rank that looks longer there keeps a
    /// CPU its peer may need).
    most: Duration,
    /// The look now, in nanoseconds.
    look_ns: AtomicU64,
    /// Calls left that send without looking for the peer's message.
    skip: AtomicU32,
    /// Tries in a row whose peer had not arrived.
    misses: AtomicU32,
    /// One more than the number of the operation whose look ran out last (0: none since the
    /// last issue), and when, in nanoseconds since `base`.
    missed: AtomicU64,
    missed_ns: AtomicU64,
    /// When an issue last found that operation's message not come yet (at first: the miss).
    checked_ns: AtomicU64,
    base: Instant,
}

/// What an issue after a miss found of the missed operation's receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::comm) enum Then {
    /// Its message came within the longest look of the issue: the look grows to take it.
    Near,
    /// It came later than that, or has not come that long after.
    Far,
    /// Not come yet, and the longest look is not over: the next issue asks again.
    Pending,
    /// Found more than a look after it was last found missing (the rank was away: its
    /// thread descheduled, or the program computing between calls): when it came is not
    /// known, and the look stays.
    Unknown,
    /// Not queued any more: a wait ran it (the program waits for each call, or computes
    /// before it waits, and would lose that overlap to a long look), so the look shortens
    /// as after a far miss: a long look is for pipelines.
    Waited,
}

impl Eagerness {
    pub(in crate::comm) fn new(spin: Duration, crowded: bool) -> Eagerness {
        Eagerness::up_to(spin, if crowded { spin } else { (spin * GROWTH).min(LONGEST).max(spin) })
    }

    /// A look of `spin` that grows to `most` at most.
    fn up_to(spin: Duration, most: Duration) -> Eagerness {
        Eagerness {
            spin,
            most,
            look_ns: AtomicU64::new(spin.as_nanos() as u64),
            skip: AtomicU32::new(0),
            misses: AtomicU32::new(0),
            missed: AtomicU64::new(0),
            missed_ns: AtomicU64::new(0),
            checked_ns: AtomicU64::new(0),
            base: Instant::now(),
        }
    }

    /// The look as `path` tells it: "5 us", or "5 us (up to 80 after near misses)".
    pub(in crate::comm) fn describe(&self) -> String {
        let us = self.spin.as_micros();
        match self.most.as_micros() {
            m if m > us => format!("{us} us (up to {m} after near misses)"),
            _ => format!("{us} us"),
        }
    }

    /// The look now.
    pub(in crate::comm) fn look(&self) -> Duration {
        Duration::from_nanos(self.look_ns.load(Ordering::Relaxed))
    }

    /// Whether this call may look for the peer's message (one that may not counts the skip
    /// down).
    pub(in crate::comm) fn now(&self) -> bool {
        // Calls on other threads may count it down at once: a try more or less.
        match self.skip.load(Ordering::Relaxed) {
            0 => true,
            s => {
                self.skip.store(s - 1, Ordering::Relaxed);
                false
            }
        }
    }

    pub(in crate::comm) fn hit(&self) {
        if self.misses.load(Ordering::Relaxed) != 0 {
            self.misses.store(0, Ordering::Relaxed);
        }
    }

    /// The look of operation `id` ran out: its receive was queued.
    pub(in crate::comm) fn miss(&self, id: u64) {
        let m = self.misses.fetch_add(1, Ordering::Relaxed).saturating_add(1).min(10);
        self.skip.store(1 << m, Ordering::Relaxed);
        if self.most > self.spin {
            let now = self.base.elapsed().as_nanos() as u64;
            self.missed_ns.store(now, Ordering::Relaxed);
            self.checked_ns.store(now, Ordering::Relaxed);
            self.missed.store(id.wrapping_add(1), Ordering::Relaxed);
        }
    }

    /// The operation whose look ran out last, until an issue has learnt how late its
    /// message was ([`Eagerness::then`]).
    pub(in crate::comm) fn missed(&self) -> Option<u64> {
        self.missed.load(Ordering::Relaxed).checked_sub(1)
    }

    /// How the receive of the operation that missed last stands at this issue: `queued`,
    /// whether it was still queued (or ran at this issue: the program issues calls without
    /// waiting for each, a pipeline); `arrived`, whether its message has come. Issues come
    /// often in a pipeline, so the first that finds the message tells about when it came: a
    /// look of the time from the missed issue to this one would have taken it. Where that is
    /// within `most` (a near miss), the look grows to it (a power of two times `spin`);
    /// otherwise (a far miss) it halves, down to `spin`. It halves too where the receive ran
    /// in a wait (not a pipeline), and stays where this issue found the message more than a
    /// look after the one before found it missing (when it came is not known: a program that
    /// computes between its calls never lengthens the look). Misses in a row still make
    /// calls skip the look: a peer that sends only after something this rank does after the
    /// issue comes just after every look, however long, and is then looked for rarely.
    pub(in crate::comm) fn then(&self, queued: bool, arrived: bool) -> Then {
        let now = self.base.elapsed().as_nanos() as u64;
        let after = |at: &AtomicU64| Duration::from_nanos(now.saturating_sub(at.load(Ordering::Relaxed)));
        let look = self.look();
        let needed = look + after(&self.missed_ns);
        let then = match (queued, arrived, needed <= self.most) {
            (false, _, _) => Then::Waited,
            (true, false, true) => {
                self.checked_ns.store(now, Ordering::Relaxed);
                return Then::Pending;
            }
            (true, _, false) => Then::Far,
            (true, true, true) if after(&self.checked_ns) <= look => Then::Near,
            (true, true, true) => Then::Unknown,
        };
        self.missed.store(0, Ordering::Relaxed);
        let ns = |d: Duration| d.as_nanos() as u64;
        match then {
            Then::Near => {
                let mut grown = look * 2;
                while grown < needed {
                    grown *= 2;
                }
                self.look_ns.store(ns(grown.min(self.most)), Ordering::Relaxed);
            }
            Then::Far | Then::Waited => self.look_ns.store(ns((look / 2).max(self.spin)), Ordering::Relaxed),
            Then::Pending | Then::Unknown => {}
        }
        then
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Milliseconds, not the default microseconds: the tests' own steps never take a look.
    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn near_misses_lengthen_the_look_to_what_would_have_taken_them() {
        let e = Eagerness::up_to(10 * MS, 160 * MS);
        e.miss(7);
        assert!(!e.now(), "a miss makes the next call send without looking");
        assert_eq!(e.missed(), Some(7));
        assert_eq!(e.then(true, false), Then::Pending, "not come, the longest look not over");
        assert_eq!(e.then(true, true), Then::Near);
        assert_eq!(e.look(), 20 * MS, "came within twice the look");
        assert!(!e.now(), "a near miss keeps the skip: misses in a row still make calls skip");
        assert_eq!(e.missed(), None, "learnt");
        e.miss(8);
        std::thread::sleep(25 * MS);
        assert_eq!(e.then(true, true), Then::Unknown, "found 25 ms after the miss: when it came is not known");
        assert_eq!(e.look(), 20 * MS, "nothing learnt: the look stays");
        e.miss(9);
        for _ in 0..5 {
            std::thread::sleep(5 * MS);
            assert_eq!(e.then(true, false), Then::Pending);
        }
        assert_eq!(e.then(true, true), Then::Near);
        // 20 + 25 ms: the next power of two times 10 ms (160 if the sleeps ran 60% long).
        let grown = e.look();
        assert!(grown == 80 * MS || grown == 160 * MS, "{grown:?}");
        e.miss(10);
        std::thread::sleep(100 * MS);
        assert_eq!(e.then(true, true), Then::Far, "80 + 100 ms is past the longest look (160 ms)");
        assert_eq!(e.look(), grown / 2);
        e.miss(11);
        assert_eq!(e.then(false, false), Then::Waited, "a wait ran it");
        assert_eq!(e.look(), grown / 4, "a long look is for pipelines");
    }

    #[test]
    fn far_misses_shorten_the_look_down_to_the_configured_one() {
        let e = Eagerness::up_to(MS, 16 * MS);
        e.miss(1);
        assert_eq!(e.then(true, true), Then::Near);
        for want in [1, 1] {
            e.miss(2);
            std::thread::sleep(16 * MS);
            assert_eq!(e.then(true, false), Then::Far, "not come within the longest look");
            assert_eq!(e.look(), want * MS);
        }
        assert!(!e.now(), "far misses keep the skip");
        e.miss(3);
        assert_eq!(e.then(false, false), Then::Waited, "a wait ran it");
        assert_eq!(e.look(), MS);
        assert_eq!(e.missed(), None);
    }

    #[test]
    fn the_look_grows_to_a_millisecond_at_most() {
        assert_eq!(Eagerness::new(Duration::from_micros(5), false).describe(), "5 us (up to 80 after near misses)");
        assert_eq!(
            Eagerness::new(Duration::from_micros(100), false).describe(),
            "100 us (up to 1000 after near misses)"
        );
        assert_eq!(Eagerness::new(Duration::from_micros(1000), false).describe(), "1000 us");
        assert_eq!(Eagerness::new(Duration::from_micros(5), true).describe(), "5 us");
    }

    #[test]
    fn where_ranks_outnumber_cpus_the_look_stays() {
        let e = Eagerness::new(Duration::from_micros(5), true);
        e.miss(3);
        assert_eq!(e.missed(), None, "nothing to learn: the look cannot grow");
        assert_eq!(e.look(), Duration::from_micros(5));
    }
}
