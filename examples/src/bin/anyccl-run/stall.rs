//! A job that cannot progress because every rank still running is stopped (SIGSTOP, a
//! debugger): no other process can notice (the other ranks have ended; in elastic mode no
//! member is left to see the stopped one's liveness record go stale), so the launcher says
//! so, once, and goes on waiting: a stopped process may be resumed.

use crate::procs;
use std::time::{Duration, Instant};

/// How often the running ranks are looked at.
const EVERY: Duration = Duration::from_secs(1);
/// How long every running rank must have been stopped before the launcher says so.
pub const STALL: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub struct StopWatch {
    next: Instant,
    /// The running ranks, all stopped, and since when.
    seen: Option<(Vec<usize>, Instant)>,
    /// The ranks last said to be stopped.
    said: Option<Vec<usize>>,
}

impl StopWatch {
    pub fn new() -> StopWatch {
        StopWatch { next: Instant::now() + EVERY, seen: None, said: None }
    }

    /// When the next look is due.
    pub fn due(&self) -> Instant {
        self.next
    }

    /// Look at the running ranks `(rank, pid)` if a look is due: the line to print once they
    /// have all been stopped for [`STALL`] (once for one set of ranks).
    pub fn look(&mut self, running: &[(usize, i32)]) -> Option<String> {
        let now = Instant::now();
        if now < self.next {
            return None;
        }
        self.next = now + EVERY;
        if running.is_empty() || !running.iter().all(|&(_, pid)| procs::is_stopped(pid)) {
            self.seen = None;
            self.said = None;
            return None;
        }
        let ranks: Vec<usize> = running.iter().map(|&(r, _)| r).collect();
        let since = match &self.seen {
            Some((rs, since)) if *rs == ranks => *since,
            _ => {
                self.seen = Some((ranks, now));
                return None;
            }
        };
        if now - since < STALL || self.said.as_ref() == Some(&ranks) {
            return None;
        }
        self.said = Some(ranks);
        let who: Vec<String> = running.iter().map(|&(r, pid)| format!("rank {r} (pid {pid})")).collect();
        let (verb, them) = if running.len() == 1 { ("is", "it is") } else { ("are", "they are") };
        Some(format!(
            "{} {verb} stopped (SIGSTOP or a debugger) and no other rank runs: nothing progresses until {them} \
             resumed (SIGCONT); the job waits (--timeout, SIGINT or SIGTERM ends it)",
            who.join(", ")
        ))
    }
}
