//! Detail mode (`ANYCCL_DEBUG=detail`, [`crate::CommConfig::detail`]): before a collective
//! runs, the members of its group compare the call's fingerprint (op, dtype, count, reduce
//! op, root, and its number among the group's collectives) through the store. A mismatch is
//! an error on every member naming both calls, before any data moves; a member that never
//! issues the call is named when the operation timeout passes.
//!
//! The comparison never uses a device connection (that would change what the warmup must
//! connect and what a recording sees), and it works the same on every backend. It costs a
//! store round trip per member and collective, and makes each collective wait for every
//! member to issue it: a debugging mode, off by default. Point-to-point operations are not
//! compared (members issue different ones by design).
//!
//! The store calls run on one process-wide thread with its own runtime, so a collective
//! issued from inside the caller's async runtime can block on them without stalling it.

use crate::error::{Error, Result};
use crate::store::Store;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{Duration, Instant};

/// One communicator's detail-mode state.
#[derive(Debug)]
pub(crate) struct Detail {
    store: Arc<dyn Store>,
    /// Keys of this communicator instance: `anyccl/detail/<group>/<instance>`.
    prefix: String,
    /// Where each member counts the communicators of the group it made in detail mode.
    created: String,
    /// This communicator's instance number among them.
    instance: i64,
    rank: usize,
    size: usize,
    group: String,
    /// Collectives issued so far.
    issued: AtomicU64,
}

struct Request {
    store: Arc<dyn Store>,
    prefix: String,
    created: String,
    instance: i64,
    n: u64,
    rank: usize,
    size: usize,
    mine: String,
    deadline: Instant,
    reply: mpsc::Sender<Result<Vec<(usize, String)>>>,
}

fn checker() -> std::result::Result<&'static tokio::sync::mpsc::UnboundedSender<Request>, String> {
    static CHECKER: OnceLock<std::result::Result<tokio::sync::mpsc::UnboundedSender<Request>, String>> =
        OnceLock::new();
    CHECKER
        .get_or_init(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("cannot start the detail-mode runtime: {e}"))?;
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Request>();
            std::thread::Builder::new()
                .name("anyccl-detail".into())
                .spawn(move || {
                    rt.block_on(async move {
                        while let Some(req) = rx.recv().await {
                            tokio::spawn(async move {
                                let r = compare(&req).await;
                                let _ = req.reply.send(r);
                            });
                        }
                    })
                })
                .map_err(|e| format!("cannot start the detail-mode thread: {e}"))?;
            Ok(tx)
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Publish this member's fingerprint of collective `n`, then read every other member's;
/// the ones that differ.
async fn compare(req: &Request) -> Result<Vec<(usize, String)>> {
    let key = |r: usize| format!("{}/{}/{r}", req.prefix, req.n);
    req.store.set(&key(req.rank), req.mine.as_bytes()).await?;
    let mut differ = Vec::new();
    let mut missing = Vec::new();
    for r in (0..req.size).filter(|&r| r != req.rank) {
        match req.store.wait(&key(r), req.deadline).await {
            Ok(v) => {
                let theirs = String::from_utf8_lossy(&v).into_owned();
                if theirs != req.mine {
                    differ.push((r, theirs));
                }
            }
            Err(Error::Timeout { .. }) => missing.push(r),
            Err(e) => return Err(e),
        }
    }
    if !missing.is_empty() && differ.is_empty() {
        // A member that made no communicator of the group in detail mode publishes no
        // fingerprint at all: say so, rather than blame it for a call it may have issued.
        let mut plain = Vec::new();
        for &r in &missing {
            let made = req.store.get(&format!("{}/{r}", req.created)).await?;
            let made = made.and_then(|v| String::from_utf8(v).ok()).and_then(|v| v.trim().parse::<i64>().ok());
            if made.unwrap_or(0) < req.instance {
                plain.push(r);
            }
        }
        let why = if plain.is_empty() {
            format!("ranks {missing:?} never issued it")
        } else {
            format!(
                "ranks {missing:?} never issued it; ranks {plain:?} do not run in detail mode (ANYCCL_DEBUG=detail \
                 or CommConfig::detail must be set on every member, or on none)"
            )
        };
        // The caller names the group and how long it waited (see `check`).
        return Err(crate::Ctx::new("detail", req.rank, "").timeout("", Duration::ZERO, why));
    }
    Ok(differ)
}

impl Detail {
    /// Detail-mode state for this rank's next communicator of `group` (the k-th one a
    /// rank creates for a group name meets the k-th of every other member).
    pub(crate) async fn new(store: Arc<dyn Store>, group: &str, rank: usize, size: usize) -> Result<Detail> {
        let created = format!("anyccl/detail/{group}/created");
        let k = store.add(&format!("{created}/{rank}"), 1).await?;
        Ok(Detail {
            store,
            prefix: format!("anyccl/detail/{group}/{k}"),
            created,
            instance: k,
            rank,
            size,
            group: group.to_string(),
            issued: AtomicU64::new(0),
        })
    }

    /// A child communicator's state (after a split), sharing the store.
    pub(crate) async fn child(&self, group: &str, rank: usize, size: usize) -> Result<Detail> {
        Detail::new(self.store.clone(), group, rank, size).await
    }

    /// Compare collective `fingerprint` with every other member's next collective; blocks
    /// the caller until all have issued theirs, at most `timeout`.
    ///
    /// # Errors
    /// `InvalidArgument` naming both calls when a member issued a different collective;
    /// `Timeout` naming the members that issued none; store errors.
    pub(crate) fn check(&self, op: &'static str, fingerprint: &str, timeout: Duration) -> Result<()> {
        let n = self.issued.fetch_add(1, Ordering::Relaxed);
        if self.size == 1 {
            return Ok(());
        }
        let (reply, answer) = mpsc::channel();
        let deadline = crate::deadline_in(timeout);
        let req = Request {
            store: self.store.clone(),
            prefix: self.prefix.clone(),
            created: self.created.clone(),
            instance: self.instance,
            n,
            rank: self.rank,
            size: self.size,
            mine: fingerprint.to_string(),
            deadline,
            reply,
        };
        let ctx = crate::Ctx::new("detail", self.rank, self.group.clone());
        // Process-wide and kept: no rebuild brings the checker back.
        let unavailable =
            |why: String| Error::unavailable("detail", format!("{op}: detail mode cannot check it: {why}"));
        checker().map_err(unavailable)?.send(req).map_err(|_| unavailable("the detail-mode thread ended".into()))?;
        // The checker's own store waits end at the deadline; a little more for its answer.
        let answer = answer
            .recv_timeout(deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(5))
            .map_err(|_| unavailable("no answer from the detail-mode thread".into()))?;
        let started = deadline.checked_sub(timeout).unwrap_or_else(Instant::now);
        match answer {
            Ok(differ) if differ.is_empty() => Ok(()),
            Ok(differ) => Err(ctx.invalid(
                op,
                "collective",
                format!(
                    "ranks issue different collectives as collective #{n} of the group: this rank calls {fingerprint}, {}",
                    differ.iter().map(|(r, f)| format!("rank {r} calls {f}")).collect::<Vec<_>>().join(", ")
                ),
            )),
            Err(Error::Timeout { detail, .. }) => Err(ctx.timeout(
                format!("{op} (collective #{n}, detail-mode check)"),
                started.elapsed(),
                detail,
            )),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
    }

    /// Detail mode on one member only: its check ends at the timeout saying which members
    /// do not run in detail mode, not only that they "never issued" the call.
    #[test]
    fn a_member_without_detail_mode_is_named_as_such() {
        let rt = runtime();
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let d = rt.block_on(Detail::new(store, "dp", 1, 3)).expect("detail state");
        let e = d.check("all_reduce", "all_reduce f32 x4", Duration::from_millis(200)).unwrap_err().to_string();
        assert!(e.contains("ranks [0, 2] never issued it"), "{e}");
        assert!(e.contains("ranks [0, 2] do not run in detail mode"), "{e}");
        assert!(e.contains("group 'dp'") && e.contains("rank 1"), "{e}");
    }

    /// Members that run in detail mode but never issue the call are not told to turn it on.
    #[test]
    fn a_member_in_detail_mode_that_never_issues_is_named_only_as_missing() {
        let rt = runtime();
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let d = rt.block_on(Detail::new(store.clone(), "tp", 0, 2)).expect("detail state");
        let _other = rt.block_on(Detail::new(store, "tp", 1, 2)).expect("detail state");
        let e = d.check("all_reduce", "all_reduce f32 x4", Duration::from_millis(200)).unwrap_err().to_string();
        assert!(e.contains("ranks [1] never issued it") && !e.contains("detail mode ("), "{e}");
    }
}
