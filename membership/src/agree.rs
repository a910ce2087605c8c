//! One agreement: every member (and every process waiting to join) arrives at the epoch;
//! one of them leads, and decides who is in once each expected process has either arrived
//! or left evidence that it is gone; the decision is one store key, so every member reads
//! the same view or the same error. A leader that goes stale is replaced by the first
//! member to notice; a decision, once written, is never replaced.

use crate::keys::Keys;
use crate::liveness::{record_incarnation, Staleness};
use crate::view::{Decision, Member, View};
use crate::MembershipConfig;
use anyccl_core::{Ctx, Error, Result, Store};
use std::collections::BTreeMap;
use std::time::Instant;

/// How many epochs back a decision is kept (a process stopped that long, resumed inside an
/// old agreement, reads it there and learns it was left out).
pub(crate) const KEPT_EPOCHS: u64 = 16;

/// The decision of epoch `e` as the store holds it.
///
/// # Errors
/// `Store` (fatal) when the bytes are not a decision.
pub(crate) fn decode(e: u64, d: &[u8]) -> Result<Decision> {
    serde_json::from_slice(d).map_err(|err| Error::store_fatal(format!("the decision of epoch {e} is not one: {err}")))
}

/// What an agreement needs to know about the caller.
pub(crate) struct Agreement<'a> {
    pub(crate) store: &'a dyn Store,
    pub(crate) keys: &'a Keys,
    pub(crate) cfg: &'a MembershipConfig,
    pub(crate) me: Member,
    /// Ranks of the job (every process has one below it).
    pub(crate) world: usize,
}

pub(crate) fn ctx(me: Member) -> Ctx {
    Ctx::new("membership", me.rank, "membership")
}

fn text(v: Option<Vec<u8>>) -> Option<String> {
    v.map(|b| String::from_utf8_lossy(&b).into_owned())
}

impl Agreement<'_> {
    /// Agree on epoch `e` after `prev` (`None`: the job's start, where every rank of the
    /// world is expected), proposed for `reason` unless another reason came first.
    ///
    /// # Errors
    /// `Timeout` when no member could lead to a decision; store errors. The decision itself,
    /// a failure included, is the `Ok` value.
    pub(crate) async fn run(&self, e: u64, prev: Option<&View>, reason: &str) -> Result<Decision> {
        let (store, keys, me) = (self.store, self.keys, self.me);
        let started = Instant::now();
        let deadline = started + self.cfg.agree_timeout + self.cfg.stale_after;
        store.compare_set(&keys.proposed(e), None, reason.as_bytes()).await?;
        self.arrive(e).await?;
        let mine = format!("{} {}", me.rank, me.incarnation);
        // What this process saw of liveness records, kept across its looks at the leader
        // and its own lead: a leader it replaced is known stale when it leads.
        let mut watch = Staleness::new(self.cfg.stale_after);
        loop {
            // The decision and who leads, in one request (a passed deadline reads both at once).
            let mut got = store.wait_many(&[keys.decision(e), keys.leader(e)], Instant::now()).await?.into_iter();
            if let Some(d) = got.next().flatten() {
                return decode(e, &d);
            }
            let leader = text(got.next().flatten());
            let take = match &leader {
                None => true,
                Some(l) if *l == mine => true,
                Some(l) => {
                    // A leader is replaced only on evidence: a record that it is gone, a
                    // newer process of its rank, or its liveness record stale.
                    let mut it = l.split_whitespace().map(|x| x.parse::<u64>().ok());
                    let (rank, inc) = (it.next().flatten().unwrap_or(u64::MAX), it.next().flatten().unwrap_or(0));
                    let rank = usize::try_from(rank).unwrap_or(usize::MAX);
                    if rank >= self.world {
                        true
                    } else {
                        let look = [keys.gone(rank, inc), keys.alive(rank)];
                        let mut got = store.wait_many(&look, Instant::now()).await?.into_iter();
                        let gone = got.next().flatten().is_some();
                        let record = got.next().flatten();
                        let newer = record.as_deref().and_then(record_incarnation).is_some_and(|i| i > inc);
                        gone || newer || watch.stale(rank, inc, record.as_deref())
                    }
                }
            };
            if take {
                let cas =
                    store.compare_set(&keys.leader(e), leader.as_deref().map(str::as_bytes), mine.as_bytes()).await?;
                if cas.swapped || leader.as_deref() == Some(mine.as_str()) {
                    self.lead(e, prev, started, &mut watch).await?;
                    continue;
                }
            }
            if Instant::now() >= deadline {
                let msg = format!(
                    "no decision of epoch {e} within {:?}: every member that could lead is gone",
                    deadline - started
                );
                return Err(ctx(me).timeout(format!("agreement of epoch {e}"), started.elapsed(), msg));
            }
            // A third of the liveness limit between looks at the leader: a stale one is
            // noticed within the limit plus a third, and waiting costs few requests.
            let look = (self.cfg.stale_after / 3).max(self.cfg.beat);
            match store.wait(&keys.decision(e), (Instant::now() + look).min(deadline)).await {
                Ok(d) => return decode(e, &d),
                Err(Error::Timeout { .. }) => {}
                Err(err) => return Err(err),
            }
        }
    }

    /// Mark this process arrived at epoch `e`, unless a newer process of its rank has: an old
    /// process that still runs (its replacement started while it was thought dead) must not
    /// hide its replacement's arrival, or the leader would wait for the replacement to the
    /// timeout. One request, as a plain write, unless an older process's arrival is there.
    async fn arrive(&self, e: u64) -> Result<()> {
        let (key, mine) = (self.keys.arrived(e, self.me.rank), self.me.incarnation.to_string());
        let mut expected: Option<Vec<u8>> = None;
        loop {
            let cas = self.store.compare_set(&key, expected.as_deref(), mine.as_bytes()).await?;
            if cas.swapped {
                return Ok(());
            }
            let there = cas.current.as_deref().and_then(|c| std::str::from_utf8(c).ok()?.trim().parse::<u64>().ok());
            match there {
                // This process's, or a newer one's: the decision will name that one.
                Some(i) if i >= self.me.incarnation => return Ok(()),
                _ => expected = cas.current,
            }
        }
    }

    /// The processes that wait to join epoch `e`: rank -> incarnation, where newer than
    /// `prev`'s. None when `e` is a failure: its members go on first, without waiting for a
    /// process that may still be starting (a device context, a library's first init), and
    /// a joiner left out proposes the next epoch, which the members take at their next step
    /// boundary. One request (the failure record read with the joining ones).
    async fn joiners(&self, e: u64, prev: Option<&View>) -> Result<BTreeMap<usize, u64>> {
        let mut keys: Vec<String> = (0..self.world).map(|r| self.keys.joining(r)).collect();
        keys.push(self.keys.failure(e));
        let mut got = self.store.wait_many(&keys, Instant::now()).await?;
        let mut out = BTreeMap::new();
        if got.pop().flatten().is_some() {
            return Ok(out);
        }
        for (r, v) in got.into_iter().enumerate() {
            let Some(inc) = text(v).and_then(|t| t.trim().parse::<u64>().ok()) else { continue };
            if prev.and_then(|p| p.member(r)).is_none_or(|m| m.incarnation < inc) {
                out.insert(r, inc);
            }
        }
        Ok(out)
    }

    /// Decide epoch `e`: wait until every expected process has arrived or is gone (on
    /// evidence: a record of it, a newer process of its rank, its liveness record stale),
    /// then write the view; past the agreement timeout, write the error instead.
    async fn lead(&self, e: u64, prev: Option<&View>, started: Instant, watch: &mut Staleness) -> Result<()> {
        let (store, keys) = (self.store, self.keys);
        loop {
            // rank -> the incarnation expected (None: any, at the job's start).
            let mut expected: BTreeMap<usize, Option<u64>> = match prev {
                Some(p) => p.members.iter().map(|m| (m.rank, Some(m.incarnation))).collect(),
                None => (0..self.world).map(|r| (r, None)).collect(),
            };
            // A joiner's older process of the same rank is left out on the evidence of the
            // joiner itself (its record written with the decision, as for any left out).
            let mut replaced = Vec::new();
            for (r, inc) in self.joiners(e, prev).await? {
                if let Some(Some(old)) = expected.insert(r, Some(inc)) {
                    replaced.push((r, old, format!("a newer process of rank {r} (incarnation {inc}) joins")));
                }
            }
            let ranks: Vec<usize> = expected.keys().copied().collect();
            let now = Instant::now();
            let alive_keys: Vec<String> = ranks.iter().map(|&r| keys.alive(r)).collect();
            let alive = store.wait_many(&alive_keys, now).await?;
            let gone_keys: Vec<String> = ranks.iter().map(|&r| keys.gone(r, expected[&r].unwrap_or(1))).collect();
            let gone = store.wait_many(&gone_keys, now).await?;
            // Gone on evidence: a record of it, a newer process of its rank, or its liveness
            // record stale. At the job's start a rank with no record yet has not started: it
            // is waited for (to the agreement timeout).
            let mut live = Vec::new();
            // Processes left out on evidence that no record names yet: the leader writes
            // their records with the decision, so that whoever watches for them (a launcher
            // that replaces a process declared gone) learns of every process left out, not
            // only of one whose watcher was alive to see it.
            let mut unrecorded = replaced;
            for ((&r, record), gone) in ranks.iter().zip(alive).zip(gone) {
                let want = expected[&r];
                let newer = record.as_deref().and_then(record_incarnation).zip(want).is_some_and(|(s, w)| s > w);
                let stale = match (&record, want) {
                    (None, None) => false,
                    (_, Some(w)) => watch.stale(r, w, record.as_deref()),
                    (Some(_), None) => watch.stale(r, 0, record.as_deref()),
                };
                if gone.is_some() {
                    continue;
                }
                if !newer && !stale {
                    live.push(r);
                    continue;
                }
                if let Some(inc) = want.or_else(|| record.as_deref().and_then(record_incarnation)) {
                    let what = if newer {
                        format!("a newer process of rank {r} renews its record")
                    } else {
                        format!("no liveness record of rank {r} for {:?}", self.cfg.stale_after)
                    };
                    unrecorded.push((r, inc, what));
                }
            }
            // Only those without evidence are waited for: the wait ends at the last one's
            // arrival, not a beat later for a process that is gone.
            let arrived_keys: Vec<String> = live.iter().map(|&r| keys.arrived(e, r)).collect();
            let arrived = store.wait_many(&arrived_keys, now + self.cfg.beat).await?;
            let mut members = Vec::new();
            let mut waiting = Vec::new();
            for (&r, a) in live.iter().zip(arrived) {
                let want = expected[&r];
                match (text(a).and_then(|t| t.trim().parse::<u64>().ok()), want) {
                    (Some(got), Some(w)) if got == w => members.push(Member { rank: r, incarnation: got }),
                    (Some(got), None) => members.push(Member { rank: r, incarnation: got }),
                    _ => waiting.push(r),
                }
            }
            if waiting.is_empty() {
                for (r, inc, what) in unrecorded {
                    let why = format!(
                        "rank {r} (incarnation {inc}) is gone: {what}, seen by rank {} leading epoch {e}",
                        self.me.rank
                    );
                    store.compare_set(&keys.gone(r, inc), None, why.as_bytes()).await?;
                }
                let view = self.view(e, prev, members, store).await?;
                let d = serde_json::to_vec(&Decision::View(view)).map_err(|err| Error::store_fatal(err.to_string()))?;
                if store.compare_set(&keys.decision(e), None, &d).await?.swapped {
                    store.set(&keys.current(), e.to_string().as_bytes()).await?;
                    self.trim(e).await;
                }
                return Ok(());
            }
            if started.elapsed() >= self.cfg.agree_timeout {
                let msg = format!(
                    "ranks {waiting:?} are alive (their liveness records are renewed) but never arrived at epoch {e} \
                     within {:?} (blocked in a call that cannot be stopped?)",
                    self.cfg.agree_timeout
                );
                let d =
                    serde_json::to_vec(&Decision::Failed(msg)).map_err(|err| Error::store_fatal(err.to_string()))?;
                store.compare_set(&keys.decision(e), None, &d).await?;
                return Ok(());
            }
        }
    }

    /// After epoch `e`'s view is decided, remove what no process needs any more, so the store
    /// does not grow with the epochs: the arrivals at the epoch before (every member of `e`
    /// arrived at `e`, so none is in an earlier agreement; a process left out may be, and
    /// reads that epoch's decision, which stays), and every key of the epoch
    /// [`KEPT_EPOCHS`] before. A failure to remove costs nothing but the space.
    async fn trim(&self, e: u64) {
        let old =
            [e.checked_sub(1).map(|p| self.keys.arrivals(p)), e.checked_sub(KEPT_EPOCHS).map(|p| self.keys.epoch(p))];
        for prefix in old.into_iter().flatten() {
            if let Err(err) = self.store.delete_prefix(&prefix).await {
                tracing::debug!("membership: keys under {prefix} left in the store: {err}");
            }
        }
    }

    /// The view of epoch `e` with `members`, and what changed since `prev`.
    async fn view(&self, e: u64, prev: Option<&View>, mut members: Vec<Member>, store: &dyn Store) -> Result<View> {
        members.sort();
        let reason = text(store.get(&self.keys.proposed(e)).await?).unwrap_or_default();
        let (left, joined) = match prev {
            None => (Vec::new(), Vec::new()),
            Some(p) => (
                p.members.iter().filter(|m| !members.contains(m)).map(|m| m.rank).collect(),
                members.iter().filter(|m| !p.contains(**m)).map(|m| m.rank).collect(),
            ),
        };
        Ok(View { epoch: e, members, left, joined, reason })
    }
}
