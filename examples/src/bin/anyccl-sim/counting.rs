//! A store wrapper that counts each request by warmup phase (told by its key) and notes when
//! each phase's requests began and ended, across the ranks of a process.

use anyccl::raw::async_trait;
use anyccl::{CasOutcome, Result, Store};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Phases, in the order the warmup runs them; `poll` is the failure polling while
/// operations run (it depends on wall time, so it is counted apart).
pub const PHASES: [&str; 8] = ["claim", "source", "agree", "outcome", "final", "record", "poll", "other"];

fn phase_of(key: &str, read_only: bool) -> usize {
    // warmup/{job}/{generation}/{what}/...
    let what = key.split('/').nth(3).unwrap_or("");
    match what {
        // The replay check at the start (a read of `final/<rank>`) belongs to the claim.
        "claim" => 0,
        "final" if read_only => 0,
        "source" => 1,
        "plan" => 2,
        "failed" if read_only => 6,
        "outcome" | "verdict" | "failed" => 3,
        "final" => 4,
        "recorded" => 5,
        _ => 7,
    }
}

pub(crate) fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// One phase's figures.
#[derive(Debug, Default)]
pub struct PhaseCount {
    ops: AtomicU64,
    keys: AtomicU64,
    first: AtomicU64,
    last: AtomicU64,
    busy_ns: AtomicU64,
}

/// What a process's ranks did, per phase.
#[derive(Debug)]
pub struct Counters {
    phases: Vec<PhaseCount>,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            phases: PHASES
                .iter()
                .map(|_| PhaseCount { first: AtomicU64::new(u64::MAX), ..Default::default() })
                .collect(),
        }
    }
}

/// A phase's figures as a process reports them.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PhaseFigures {
    /// Store requests.
    pub ops: u64,
    /// Keys they named (a multi-key request names several).
    pub keys: u64,
    /// First request's start, ns since the epoch (`u64::MAX`: none).
    pub first_ns: u64,
    /// Last request's end, ns since the epoch.
    pub last_ns: u64,
    /// Time spent inside requests, summed over ranks.
    pub busy_ns: u64,
}

impl Counters {
    /// A request sent (counted even if its caller stops waiting for the answer).
    fn sent(&self, phase: usize, keys: usize, start: u64) {
        let p = &self.phases[phase];
        p.ops.fetch_add(1, Ordering::Relaxed);
        p.keys.fetch_add(keys as u64, Ordering::Relaxed);
        p.first.fetch_min(start, Ordering::Relaxed);
    }

    /// Its answer arrived.
    fn answered(&self, phase: usize, started: Instant) {
        let p = &self.phases[phase];
        p.last.fetch_max(now_ns(), Ordering::Relaxed);
        p.busy_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// The figures so far, by phase name.
    pub fn figures(&self) -> Vec<(String, PhaseFigures)> {
        PHASES
            .iter()
            .zip(&self.phases)
            .map(|(n, p)| {
                let f = PhaseFigures {
                    ops: p.ops.load(Ordering::Relaxed),
                    keys: p.keys.load(Ordering::Relaxed),
                    first_ns: p.first.load(Ordering::Relaxed),
                    last_ns: p.last.load(Ordering::Relaxed),
                    busy_ns: p.busy_ns.load(Ordering::Relaxed),
                };
                (n.to_string(), f)
            })
            .collect()
    }
}

/// A rank's store, counted.
#[derive(Debug)]
pub struct Counting {
    inner: Arc<dyn Store>,
    counters: Arc<Counters>,
    /// This rank's last agreement request's end and first outcome request's start (ns).
    agreed: AtomicU64,
    outcome: AtomicU64,
}

impl Counting {
    /// Count `inner`'s requests into `counters`.
    pub fn new(inner: Arc<dyn Store>, counters: Arc<Counters>) -> Self {
        Counting { inner, counters, agreed: AtomicU64::new(0), outcome: AtomicU64::new(u64::MAX) }
    }

    /// This rank's time between its agreement and its outcome (the execution).
    pub fn execute(&self) -> Duration {
        let (a, o) = (self.agreed.load(Ordering::Relaxed), self.outcome.load(Ordering::Relaxed));
        Duration::from_nanos(if a > 0 && o != u64::MAX { o.saturating_sub(a) } else { 0 })
    }

    async fn count<T>(
        &self,
        key: &str,
        keys: usize,
        read_only: bool,
        f: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let (start, started) = (now_ns(), Instant::now());
        let phase = phase_of(key, read_only);
        self.counters.sent(phase, keys, start);
        let r = f.await;
        self.counters.answered(phase, started);
        match PHASES[phase] {
            "source" | "agree" => {
                self.agreed.fetch_max(now_ns(), Ordering::Relaxed);
            }
            "outcome" => {
                self.outcome.fetch_min(start, Ordering::Relaxed);
            }
            _ => {}
        }
        r
    }
}

#[async_trait]
impl Store for Counting {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.count(key, 1, false, self.inner.set(key, value)).await
    }
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.count(key, 1, true, self.inner.get(key)).await
    }
    async fn wait(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        self.count(key, 1, false, self.inner.wait(key, deadline)).await
    }
    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.count(key, 1, false, self.inner.add(key, delta)).await
    }
    async fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
        self.count(key, 1, false, self.inner.compare_set(key, expected, new)).await
    }
    async fn delete(&self, key: &str) -> Result<bool> {
        self.count(key, 1, false, self.inner.delete(key)).await
    }
    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        self.count(prefix, 1, false, self.inner.delete_prefix(prefix)).await
    }
    async fn wait_many(&self, keys: &[String], deadline: Instant) -> Result<Vec<Option<Vec<u8>>>> {
        let first = keys.first().map(String::as_str).unwrap_or("");
        self.count(first, keys.len(), false, self.inner.wait_many(keys, deadline)).await
    }
}
