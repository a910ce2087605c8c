//! The flight recorder: the last N operations of every communicator that shares it, with
//! their state, for a dump when something hangs.

use crate::dtype::DType;
use std::collections::VecDeque;
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
    entries: Mutex<VecDeque<OpRecord>>,
}

impl FlightRecorder {
    /// A recorder keeping the last `capacity` operations.
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(FlightRecorder { capacity: capacity.max(1), entries: Mutex::new(VecDeque::new()) })
    }

    /// Record a newly enqueued operation.
    pub fn push(&self, rec: OpRecord) {
        if let Ok(mut e) = self.entries.lock() {
            if e.len() == self.capacity {
                e.pop_front();
            }
            e.push_back(rec);
        }
    }

    /// Mark operation `seq` of `group` as finished.
    pub fn finish(&self, group: &str, seq: u64, state: OpState) {
        if let Ok(mut e) = self.entries.lock() {
            if let Some(r) = e.iter_mut().rev().find(|r| r.seq == seq && &*r.group == group) {
                if r.state == OpState::Pending {
                    r.elapsed = Some(r.started.elapsed());
                    r.state = state;
                }
            }
        }
    }

    /// A copy of the recorded operations, oldest first.
    pub fn snapshot(&self) -> Vec<OpRecord> {
        self.entries.lock().map(|e| e.iter().cloned().collect()).unwrap_or_default()
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
