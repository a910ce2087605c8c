//! Liveness: each member renews its record every beat from a thread of its own, or from a
//! shared [`crate::LivenessDriver`]'s thread (so a member blocked in a collective still beats, and a
//! killed or stopped one stops), watches one peer's record (the next member by rank: every
//! member is watched once, O(N) reads a beat for the job), and hears of a proposed epoch on
//! the same beat, in the same request as that read.

use crate::keys::Keys;
use crate::view::{Member, Proposal, View};
use crate::MembershipConfig;
use anyccl_core::Store;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// When records last changed, as one watcher saw them: a record unchanged for the liveness
/// limit (or never seen for that long) is stale. Only this process's clock is read: no
/// two machines' clocks are compared.
#[derive(Debug)]
pub(crate) struct Staleness {
    seen: HashMap<usize, (Option<Vec<u8>>, Instant)>,
    limit: std::time::Duration,
}

impl Staleness {
    pub(crate) fn new(limit: std::time::Duration) -> Staleness {
        Staleness { seen: HashMap::new(), limit }
    }

    /// Note `rank`'s record as read now; whether incarnation `inc` of the rank has not
    /// renewed it for the limit. Only a renewal by that very process counts (`inc` 0: by
    /// any): an older process of the rank that resumed and still beats, or a newer one, does
    /// not keep it alive.
    pub(crate) fn stale(&mut self, rank: usize, inc: u64, record: Option<&[u8]>) -> bool {
        let now = Instant::now();
        let record = record.filter(|r| inc == 0 || record_incarnation(r) == Some(inc));
        let e = self.seen.entry(rank).or_insert_with(|| (record.map(<[u8]>::to_vec), now));
        if record.is_some() && e.0.as_deref() != record {
            *e = (record.map(<[u8]>::to_vec), now);
        }
        now.duration_since(e.1) >= self.limit
    }
}

/// The incarnation a liveness record names (`<incarnation> <beats>`).
pub(crate) fn record_incarnation(record: &[u8]) -> Option<u64> {
    std::str::from_utf8(record).ok()?.split_whitespace().next()?.parse().ok()
}

/// What a member runs when it hears of a proposed epoch, or that a proposed one is a failure.
pub(crate) type OnProposal = Box<dyn Fn(&Proposal) + Send>;

/// What the heartbeat thread shares with the [`crate::Membership`].
pub(crate) struct Shared {
    /// The view this member is in (the heartbeat watches its next member in it).
    pub(crate) view: Mutex<View>,
    /// The newest proposed epoch heard of.
    pub(crate) proposed: Mutex<Option<Proposal>>,
    /// Called once per proposed epoch, and again when it turns out to be a failure, from
    /// the heartbeat thread.
    pub(crate) on_proposal: Mutex<Option<OnProposal>>,
    pub(crate) stop: AtomicBool,
    pub(crate) beats: AtomicU64,
    /// Tests stop a member's beat without ending it, as SIGSTOP does.
    #[cfg(test)]
    pub(crate) paused: AtomicBool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("beats", &self.beats.load(Ordering::Relaxed)).finish_non_exhaustive()
    }
}

/// The member after `me` in `view` by rank, cyclically; `None` when `me` is alone.
fn watched(view: &View, me: Member) -> Option<Member> {
    let n = view.members.len();
    // Members are sorted by rank.
    let i = view.members.binary_search_by_key(&me.rank, |m| m.rank).ok()?;
    (n > 1).then(|| view.members[(i + 1) % n])
}

/// What a member's beats carry from one to the next.
struct Beating {
    /// When the watched member's record last changed, as this member saw it.
    watch: Staleness,
    /// This member's record as it last wrote it (`None`: not yet).
    renewed: Option<Vec<u8>>,
    /// A newer process of this member's rank renews the record: this one no longer does.
    replaced: bool,
}

/// Renew this member's record (`<incarnation> <beats>`), replacing only its own or an older
/// process's: once a newer process of the rank (a replacement started while this one was
/// thought dead) writes it, the record is the newer one's, and this process stops renewing
/// it, or a reader could take the newer process's record for unrenewed. One request, as a
/// plain write, in the steady state.
async fn renew(store: &dyn Store, keys: &Keys, me: Member, n: u64, b: &mut Beating) -> anyccl_core::Result<()> {
    let (key, new) = (keys.alive(me.rank), format!("{} {n}", me.incarnation).into_bytes());
    let mut expected = b.renewed.clone();
    loop {
        let cas = store.compare_set(&key, expected.as_deref(), &new).await?;
        if cas.swapped {
            b.renewed = Some(new);
            return Ok(());
        }
        match cas.current.as_deref().and_then(record_incarnation) {
            Some(i) if i > me.incarnation => {
                tracing::warn!(
                    "rank {} (incarnation {}): incarnation {i} renews the rank's liveness record; this process \
                     no longer does",
                    me.rank,
                    me.incarnation
                );
                b.replaced = true;
                return Ok(());
            }
            // Absent, this process's own (an earlier write whose answer was lost) or an
            // older process's: replace what is there.
            _ => expected = cas.current,
        }
    }
}

/// One beat: renew this member's record, then in one request hear of a proposal and read the
/// watched member's record; when that went stale, record the evidence and propose the next
/// epoch. Two requests a beat (a third when a proposal is heard).
async fn beat(store: &dyn Store, keys: &Keys, me: Member, shared: &Shared, b: &mut Beating) {
    #[cfg(test)]
    if shared.paused.load(Ordering::Acquire) {
        return;
    }
    let n = shared.beats.fetch_add(1, Ordering::Relaxed) + 1;
    if !b.replaced {
        if let Err(e) = renew(store, keys, me, n, b).await {
            tracing::warn!("rank {} cannot renew its liveness record: {e}", me.rank);
            return;
        }
    }
    let watch = &mut b.watch;
    // The epoch and the watched member, without copying the view (N members) every beat.
    let (next, peer) = {
        let view = shared.view.lock().unwrap_or_else(|p| p.into_inner());
        (view.epoch + 1, watched(&view, me))
    };
    let mut look = vec![keys.proposed(next)];
    look.extend(peer.map(|p| keys.alive(p.rank)));
    // A passed deadline: every key read at once, in one request where the store allows.
    let Ok(got) = store.wait_many(&look, Instant::now()).await else { return };
    let mut got = got.into_iter();
    if let Some(why) = got.next().flatten() {
        let failure = matches!(store.get(&keys.failure(next)).await, Ok(Some(_)));
        let heard = Proposal { epoch: next, reason: String::from_utf8_lossy(&why).into_owned(), failure };
        let news = {
            let mut p = shared.proposed.lock().unwrap_or_else(|p| p.into_inner());
            // News: a newer epoch, or the same one now known to be a failure.
            let news = p.as_ref().is_none_or(|q| q.epoch < next || (q.epoch == next && failure && !q.failure));
            if news {
                *p = Some(heard.clone());
            }
            news
        };
        if news {
            if let Some(f) = shared.on_proposal.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                f(&heard);
            }
        }
    }
    let Some(peer) = peer else { return };
    let record = got.next().flatten();
    let replaced = record.as_deref().and_then(record_incarnation).is_some_and(|i| i > peer.incarnation);
    if replaced || watch.stale(peer.rank, peer.incarnation, record.as_deref()) {
        let what = if replaced {
            format!("a newer process of rank {} renews its record", peer.rank)
        } else {
            format!("no liveness record of rank {} for {:?}", peer.rank, watch.limit)
        };
        let why =
            format!("rank {} (incarnation {}) is gone: {what}, seen by rank {}", peer.rank, peer.incarnation, me.rank);
        let _ = store.compare_set(&keys.gone(peer.rank, peer.incarnation), None, why.as_bytes()).await;
        let _ = store.compare_set(&keys.failure(next), None, why.as_bytes()).await;
        let _ = store.compare_set(&keys.proposed(next), None, why.as_bytes()).await;
    }
}

/// Beat every `every` until `shared.stop`.
async fn beat_loop(
    store: Arc<dyn Store>,
    keys: Keys,
    me: Member,
    every: Duration,
    limit: Duration,
    shared: Arc<Shared>,
) {
    let mut b = Beating { watch: Staleness::new(limit), renewed: None, replaced: false };
    while !shared.stop.load(Ordering::Acquire) {
        let t = Instant::now();
        beat(store.as_ref(), &keys, me, &shared, &mut b).await;
        tokio::time::sleep(every.saturating_sub(t.elapsed())).await;
    }
}

/// Where a member beats: a thread of its own, or a task of a shared [`crate::LivenessDriver`].
#[derive(Debug)]
pub(crate) enum Heart {
    Thread(std::thread::JoinHandle<()>),
    Task(tokio::task::JoinHandle<()>),
}

impl Heart {
    /// Stop beating (`shared.stop` is set): a thread is waited for (up to a beat); a task is
    /// aborted at once, and a renewal it has in flight may still land, as one of a process
    /// killed mid-request may.
    pub(crate) fn stop(self) {
        match self {
            Heart::Thread(h) => {
                let _ = h.join();
            }
            Heart::Task(t) => t.abort(),
        }
    }
}

/// Start beating for one member: on the config's liveness driver, or else on a thread of its
/// own; it beats until `shared.stop`.
pub(crate) fn spawn(
    store: Arc<dyn Store>,
    keys: Keys,
    me: Member,
    cfg: &MembershipConfig,
    shared: Arc<Shared>,
) -> std::io::Result<Heart> {
    let run = beat_loop(store, keys, me, cfg.beat, cfg.stale_after, shared);
    if let Some(driver) = &cfg.liveness_driver {
        return Ok(Heart::Task(driver.spawn(run)));
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let thread =
        std::thread::Builder::new().name(format!("anyccl-liveness-{}", me.rank)).spawn(move || rt.block_on(run))?;
    Ok(Heart::Thread(thread))
}
