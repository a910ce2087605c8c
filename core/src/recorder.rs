//! The flight recorder: the last N operations of every communicator that shares it, with
//! their state, for a dump when something hangs.

use crate::dtype::DType;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where an operation stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpState {
    /// Enqueued, not yet seen complete.
    Pending,
    /// Completed.
    Completed,
    /// Failed with this text.
    Failed(String),
    /// Dropped before completion was observed.
    Dropped,
}

/// One recorded operation.
#[derive(Debug, Clone)]
pub struct OpRecord {
    /// Group name.
    pub group: Arc<str>,
    /// Rank in the group.
    pub rank: usize,
    /// Sequence number in the group.
    pub seq: u64,
    /// Operation name.
    pub op: &'static str,
    /// Element type, when the op has one.
    pub dtype: Option<DType>,
    /// Elements of the largest buffer involved.
    pub count: usize,
    /// Bytes moved by this rank (the size of its largest buffer).
    pub bytes: usize,
    /// Peer rank for point-to-point ops (or root for rooted collectives).
    pub peer: Option<usize>,
    /// When it was enqueued.
    pub started: Instant,
    /// How long until its completion was observed.
    pub elapsed: Option<Duration>,
    /// State.
    pub state: OpState,
}

/// A bounded ring of [`OpRecord`]s.
#[derive(Debug)]
pub struct FlightRecorder {
    capacity: usize,
    entries: Mutex<Ring>,
}

/// The records, ticket `t` at `records[t % capacity]`: a full ring overwrites its oldest
/// record in place (a push moves one record, not two).
#[derive(Debug, Default)]
struct Ring {
    records: Vec<OpRecord>,
    /// Records ever pushed: the ring holds tickets `pushed - len .. pushed`.
    pushed: u64,
}

impl Ring {
    /// The records, oldest first.
    fn iter(&self, capacity: usize) -> impl DoubleEndedIterator<Item = &OpRecord> {
        let first = self.pushed - self.records.len() as u64;
        (first..self.pushed).map(move |t| &self.records[(t % capacity as u64) as usize])
    }
}

/// Names one pushed record, so finishing it is a lookup, not a search (it runs on every
/// operation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket(u64);

impl FlightRecorder {
    /// A recorder keeping the last `capacity` operations.
    pub fn new(capacity: usize) -> Arc<Self> {
        let r = Arc::new(FlightRecorder { capacity: capacity.max(1), entries: Mutex::new(Ring::default()) });
        crate::trace::register(&r);
        r
    }

    /// Record a newly enqueued operation.
    pub fn push(&self, rec: OpRecord) -> Ticket {
        let Ok(mut e) = self.entries.lock() else { return Ticket(u64::MAX) };
        let slot = (e.pushed % self.capacity as u64) as usize;
        if e.records.len() == self.capacity {
            e.records[slot] = rec;
        } else {
            e.records.push(rec);
        }
        e.pushed += 1;
        Ticket(e.pushed - 1)
    }

    /// Mark a pending operation as finished (a no-op once it has left the ring).
    pub fn finish(&self, ticket: Ticket, state: OpState) {
        if let Ok(mut e) = self.entries.lock() {
            let first = e.pushed - e.records.len() as u64;
            if !(first..e.pushed).contains(&ticket.0) {
                return;
            }
            let i = (ticket.0 % self.capacity as u64) as usize;
            if let Some(r) = e.records.get_mut(i) {
                if r.state == OpState::Pending {
                    r.elapsed = Some(r.started.elapsed());
                    r.state = state;
                }
            }
        }
    }

    /// A copy of the recorded operations, oldest first.
    pub fn snapshot(&self) -> Vec<OpRecord> {
        self.entries.lock().map(|e| e.iter(self.capacity).cloned().collect()).unwrap_or_default()
    }

    /// The newest completed operation of `group` still in the ring: its name, sequence
    /// number and how long ago it finished (for errors: whether a group ever ran).
    pub fn last_completed(&self, group: &str) -> Option<(&'static str, u64, Duration)> {
        let e = self.entries.lock().ok()?;
        let found =
            e.iter(self.capacity).rev().find(|r| r.state == OpState::Completed && &*r.group == group).map(|r| {
                let done = r.started + r.elapsed.unwrap_or_default();
                (r.op, r.seq, done.elapsed())
            });
        found
    }

    /// A human-readable table of the recorded operations, oldest first.
    pub fn dump(&self) -> String {
        let mut s =
            String::from("group            rank   seq  op              dtype  bytes        peer  state      elapsed\n");
        for r in self.snapshot() {
            let state = match &r.state {
                OpState::Pending => "PENDING".to_string(),
                OpState::Completed => "ok".to_string(),
                OpState::Failed(m) => format!("FAILED: {m}"),
                OpState::Dropped => "dropped".to_string(),
            };
            let _ = writeln!(
                s,
                "{:<16} {:>4} {:>5}  {:<15} {:<5} {:>12} {:>5}  {:<10} {}",
                r.group,
                r.rank,
                r.seq,
                r.op,
                r.dtype.map(|d| d.name()).unwrap_or("-"),
                r.bytes,
                r.peer.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
                state,
                r.elapsed.map(|d| format!("{d:?}")).unwrap_or_else(|| format!("{:?}+", r.started.elapsed())),
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(group: &str, seq: u64) -> OpRecord {
        OpRecord {
            group: Arc::from(group),
            rank: 0,
            seq,
            op: "all_reduce",
            dtype: None,
            count: 1,
            bytes: 4,
            peer: None,
            started: Instant::now(),
            elapsed: None,
            state: OpState::Pending,
        }
    }

    #[test]
    fn tickets_finish_their_own_record_even_after_the_ring_wraps() {
        let r = FlightRecorder::new(3);
        let t: Vec<Ticket> = (0..5).map(|i| r.push(rec(if i % 2 == 0 { "a" } else { "b" }, i))).collect();
        // Tickets 0 and 1 have left the ring: finishing them changes nothing.
        r.finish(t[0], OpState::Completed);
        r.finish(t[1], OpState::Dropped);
        r.finish(t[3], OpState::Failed("x".into()));
        let s = r.snapshot();
        assert_eq!(s.iter().map(|x| x.seq).collect::<Vec<_>>(), vec![2, 3, 4]);
        assert_eq!(
            s.iter().map(|x| x.state.clone()).collect::<Vec<_>>(),
            vec![OpState::Pending, OpState::Failed("x".into()), OpState::Pending]
        );
        assert!(s[1].elapsed.is_some() && s[0].elapsed.is_none());
        // A finished record keeps its first outcome.
        r.finish(t[3], OpState::Completed);
        assert_eq!(r.snapshot()[1].state, OpState::Failed("x".into()));
    }
}
