//! Where a warmup runs ([`Session`]: the job's store, name, generation and this rank), the
//! store keys and value encoding every agreement step uses, and the clock its timeouts read.

use anyccl_core::{Communicator, Ctx, Error, Platform, Result, Store};
use serde::Serialize;
use std::time::{Duration, Instant};

/// Where this warmup runs: the job's store, its name and generation, this rank.
#[derive(Debug, Clone, Copy)]
pub struct Session<'a> {
    /// The job's store.
    pub store: &'a dyn Store,
    /// Job name (keys are `warmup/{job}/{generation}/...`).
    pub job: &'a str,
    /// Generation: a new one per recovery. Repeating a generation replays its outcome.
    pub generation: u64,
    /// This rank in the job.
    pub rank: usize,
    /// Ranks in the job; every one of them calls the warmup, unless `members` names fewer.
    pub world_size: usize,
    /// The ranks that call this warmup, when not every rank of the job does: after a
    /// recovery in place, the members of the new epoch (in increasing order, this rank among
    /// them; the first one tallies the outcome). `None`: ranks `0..world_size`.
    pub members: Option<&'a [usize]>,
    /// This rank's device.
    pub platform: &'a dyn Platform,
}

tokio::task_local! {
    /// When the running warmup (or recording) began, for the `after` of its timeouts.
    static STARTED: Instant;
}

/// Run `f` as one warmup (or recording): its timeouts say how long it had run.
pub(crate) async fn timed<F: std::future::Future>(f: F) -> F::Output {
    STARTED.scope(Instant::now(), f).await
}

/// How long the running warmup has run (zero outside one).
pub(crate) fn waited() -> Duration {
    STARTED.try_with(|s| s.elapsed()).unwrap_or(Duration::ZERO)
}

pub(crate) fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    // Plain data of strings, numbers and enums: serialising it cannot fail.
    serde_json::to_vec(v).unwrap_or_default()
}

pub(crate) fn decode<T: serde::de::DeserializeOwned>(key: &str, v: &[u8]) -> Result<T> {
    serde_json::from_slice(v).map_err(|e| Error::store_fatal(format!("unreadable warmup value under '{key}': {e}")))
}

impl Session<'_> {
    pub(crate) fn key(&self, rest: &str) -> String {
        format!("warmup/{}/{}/{rest}", self.job, self.generation)
    }

    /// The ranks that take part, in order.
    pub(crate) fn ranks(&self) -> Vec<usize> {
        match self.members {
            Some(m) => m.to_vec(),
            None => (0..self.world_size).collect(),
        }
    }

    /// A session that cannot work, before anything is published.
    pub(crate) fn check(&self) -> Result<()> {
        let Some(m) = self.members else { return Ok(()) };
        let bad = |msg: String| ctx(self.rank, "").invalid("warmup", "session.members", msg);
        if !m.contains(&self.rank) {
            return Err(bad(format!("rank {} is not among the members {m:?}", self.rank)));
        }
        if let Some(w) = m.windows(2).find(|w| w[0] >= w[1]) {
            return Err(bad(format!("the members {m:?} are not in increasing order ({} before {})", w[0], w[1])));
        }
        if let Some(r) = m.iter().find(|&&r| r >= self.world_size) {
            return Err(bad(format!("member {r} is not below the world size {}", self.world_size)));
        }
        Ok(())
    }
}

/// Where an error of the warmup happened: `rank` of `group` (empty for the job as a whole).
pub(crate) fn ctx(rank: usize, group: &str) -> Ctx {
    Ctx::new("warmup", rank, group)
}

/// Where an error on `comm`'s group happened: this member's group rank in that group.
pub(crate) fn comm_ctx(comm: &Communicator) -> Ctx {
    ctx(comm.rank(), &comm.spec().name)
}
