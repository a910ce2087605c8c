//! anyccl-membership: who is in a job at which epoch, agreed through the job's store on
//! evidence, for recovery in place (survivors go on past a failed rank, a replacement
//! joins). A layer on anyccl-core's public API, as the warmup is; a backend only rebuilds
//! communicators for the members it is given.
//!
//! # Design choices
//! 1. **Evidence, not a short deadline.** A process counts as gone when there is evidence:
//!    a record that it is gone (written by the launcher that saw it exit, or by the member
//!    that watches its liveness record), a newer process of its rank, or its liveness
//!    record unrenewed for [`MembershipConfig::stale_after`]. A process left out of an
//!    epoch on evidence always has a record (the leader writes the ones nobody wrote, as
//!    when its watcher was stopped too), which a launcher reads to replace it
//!    ([`Membership::gone_records`]). Records are renewed from a thread of the member's
//!    own, so a member blocked in a collective still beats, and a killed or stopped
//!    (SIGSTOP) one does not. A process that hosts many members (a simulation of thousands
//!    of ranks) gives them one [`LivenessDriver`] instead: one thread beats for all, each
//!    member still renewing its own record. A member that beats but never arrives is
//!    waited for to the agreement timeout, and then every member gets the same error.
//! 2. **One decision, read by all.** The leader of an epoch writes the decision once
//!    (compare-and-set): every member reads the same view or the same error, never a mix.
//!    A leader that goes stale is replaced; a second failure during an agreement is
//!    decided by the same evidence (the new leader does not wait for the gone process),
//!    and a failure after it starts the next epoch. An epoch proposed as a failure admits
//!    no joiner: the survivors go on at once, never waiting for a replacement that may
//!    still be starting its device and library; the joiner proposes the next epoch, which
//!    the members take at a point of their choosing (a step boundary).
//! 3. **O(N) store requests per epoch.** Each process proposes, arrives and reads the
//!    decision; the leader gathers arrivals and records with multi-key waits. Liveness
//!    costs two requests per member a beat, a renewal and one read of both the next
//!    epoch's proposal and the watched member's record: each member watches the next one.
//!    A decision stores one incarnation per rank (about two bytes a rank), since every
//!    member reads it.
//! 4. **Names, one story.** The *job* (its identity) runs until it ends; the launcher's
//!    *restart* count numbers whole-job restarts (a new store claim per rank); within a
//!    restart, the *epoch* numbers agreed memberships (0 at start); a rank's *incarnation*
//!    numbers its processes (1 for the first, 2 for its first replacement). A caller that
//!    rebuilds communicators at an epoch names their namespaces by it and warms them with
//!    the epoch as the warmup's generation, so nothing of an earlier epoch is replayed.
//!
//! # Module ladder
//! `driver`, `keys` and `view` at the foot; `config` on `driver`; `liveness` on them; `agree`
//! on `config`, `keys`, `view` and `liveness`; the crate root on everything.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod agree;
mod config;
mod driver;
mod keys;
mod liveness;
mod view;

pub use config::MembershipConfig;
pub use driver::LivenessDriver;
pub use view::{Member, Proposal, View};

use agree::Agreement;
use anyccl_core::{Ctx, Error, Recovery, Result, Store};
use keys::Keys;
use liveness::{Heart, Shared};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use view::Decision;

/// This process's place in the job's membership: its view, its liveness record (renewed
/// while it lives), and the agreements it takes part in.
#[derive(Debug)]
pub struct Membership {
    store: Arc<dyn Store>,
    keys: Keys,
    cfg: MembershipConfig,
    me: Member,
    world: usize,
    shared: Arc<Shared>,
    heart: Option<Heart>,
}

impl Membership {
    /// Join the job as rank `rank` of `world`: take the next incarnation of the rank, start
    /// beating, and agree on the first epoch (at the job's start, every rank is waited
    /// for; a replacement process is admitted at the next epoch, which it proposes).
    ///
    /// # Errors
    /// `InvalidArgument` for a rank not below `world` or settings that cannot work; the
    /// agreement's errors.
    pub async fn join(store: Arc<dyn Store>, rank: usize, world: usize, cfg: MembershipConfig) -> Result<Membership> {
        let ctx = Ctx::new("membership", rank, "");
        if rank >= world {
            return Err(ctx.invalid(
                "Membership::join",
                "rank",
                format!("rank {rank} is not below the world size {world}"),
            ));
        }
        cfg.check().map_err(|m| ctx.invalid("Membership::join", "cfg", m))?;
        let keys = Keys::new(&cfg.prefix);
        let inc = store.add(&keys.incarnation(rank), 1).await?;
        let me = Member { rank, incarnation: inc.max(1) as u64 };
        let placeholder =
            View { epoch: 0, members: Vec::new(), left: Vec::new(), joined: Vec::new(), reason: String::new() };
        let shared = Arc::new(Shared {
            view: Mutex::new(placeholder),
            proposed: Mutex::new(None),
            on_proposal: Mutex::new(None),
            stop: Default::default(),
            beats: Default::default(),
            #[cfg(test)]
            paused: Default::default(),
        });
        let heart = liveness::spawn(store.clone(), keys.clone(), me, &cfg, shared.clone())
            .map_err(|e| ctx.io("start the liveness thread", "", e))?;
        let mut m = Membership { store, keys, cfg, me, world, shared, heart: Some(heart) };
        let view = m.first_view().await?;
        m.set_view(view);
        Ok(m)
    }

    /// The job's start (no epoch decided yet), or this process's admission into a running
    /// job at its next epoch.
    async fn first_view(&mut self) -> Result<View> {
        let Some(current) = self.current().await? else {
            let started = Instant::now();
            let d = self.agreement().run(0, None, "the job starts").await?;
            return self.outcome(0, d, started);
        };
        // A replacement: say so, then agree on the next epochs until one admits it.
        let me = self.me;
        self.store.set(&self.keys.joining(me.rank), me.incarnation.to_string().as_bytes()).await?;
        let started = Instant::now();
        let mut e = current + 1;
        loop {
            // The newest view decided (a failed epoch decides none) is what the epoch follows.
            let latest = self.current().await?.unwrap_or(current);
            let prev = self.decided(latest).await?;
            e = e.max(latest + 1);
            let why = format!("rank {} (incarnation {}) joins", me.rank, me.incarnation);
            match self.agreement().run(e, Some(&prev), &why).await? {
                Decision::View(v) if v.contains(me) => return Ok(v),
                // Decided without this process (before it arrived), or failed: ask again at
                // the next epoch, within the agreement timeout.
                d if started.elapsed() < self.cfg.agree_timeout => {
                    tracing::info!("rank {} not admitted at epoch {e}: {d:?}", me.rank);
                    e += 1;
                }
                d => return self.outcome(e, d, started),
            }
        }
    }

    /// The newest epoch whose decision is a view.
    async fn current(&self) -> Result<Option<u64>> {
        let c = self.store.get(&self.keys.current()).await?;
        Ok(c.and_then(|c| String::from_utf8_lossy(&c).trim().parse::<u64>().ok()))
    }

    /// The view decided at epoch `e`.
    async fn decided(&self, e: u64) -> Result<View> {
        let d = self.store.get(&self.keys.decision(e)).await?;
        let d =
            d.ok_or_else(|| Error::store_fatal(format!("the store names epoch {e} current but holds no decision")))?;
        match agree::decode(e, &d)? {
            Decision::View(v) => Ok(v),
            Decision::Failed(msg) => {
                Err(Error::store_fatal(format!("the store names failed epoch {e} current: {msg}")))
            }
        }
    }

    /// What the decision of epoch `e` means for this process, which waited since `started`:
    /// its view; or, when the agreement failed, a `Timeout` after which its view moves on to
    /// `e` (members unchanged), so the next agreement is a new epoch and not this failed
    /// one again; or, when the others went on without it, a fatal error (this process must
    /// start again as a new incarnation), after which it stops beating, so its record does
    /// not stand for a replacement of its rank.
    fn outcome(&self, e: u64, d: Decision, started: Instant) -> Result<View> {
        let me = self.me;
        match d {
            Decision::View(v) if v.contains(me) => Ok(v),
            Decision::View(v) => {
                self.shared.stop.store(true, Ordering::Release);
                let text = format!(
                    "rank {} (incarnation {}) is not a member of epoch {e} (members {:?}): the others went on \
                     without it, having seen it gone (stopped, or killed and replaced); start it again as a new \
                     process",
                    me.rank,
                    me.incarnation,
                    v.ranks()
                );
                Err(agree::ctx(me).backend_error(&format!("agreement of epoch {e}"), 0, text, Recovery::Fatal))
            }
            Decision::Failed(msg) => {
                let mut moved = self.view();
                if moved.epoch < e {
                    moved = View { epoch: e, left: Vec::new(), joined: Vec::new(), reason: msg.clone(), ..moved };
                    self.set_view(moved);
                }
                Err(agree::ctx(me).timeout(format!("agreement of epoch {e}"), started.elapsed(), msg))
            }
        }
    }

    fn agreement(&self) -> Agreement<'_> {
        Agreement { store: self.store.as_ref(), keys: &self.keys, cfg: &self.cfg, me: self.me, world: self.world }
    }

    fn set_view(&self, v: View) {
        *self.shared.view.lock().unwrap_or_else(|p| p.into_inner()) = v;
    }

    /// This process: its rank and incarnation.
    pub fn me(&self) -> Member {
        self.me
    }

    /// The view this process is in now.
    pub fn view(&self) -> View {
        self.shared.view.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The next epoch, once some process proposed it (heard on the liveness beat, without a
    /// store request). A failure: stop the step, abort the communicators and call
    /// [`Membership::agree`]; a joiner: finish the step first.
    pub fn proposed(&self) -> Option<Proposal> {
        let p = self.shared.proposed.lock().unwrap_or_else(|p| p.into_inner()).clone();
        p.filter(|p| p.epoch > self.view().epoch)
    }

    /// Call `f` from the liveness thread once for each epoch proposed after this one, and
    /// again when a proposed epoch turns out to be a failure: the place to abort this
    /// process's communicators on a failure, so a rank blocked in a collective of a
    /// "healthy" group returns instead of waiting for a peer that is itself in recovery
    /// (NCCL over NVLink reports no dead peer). `f` must not block.
    pub fn on_proposal(&self, f: impl Fn(&Proposal) + Send + 'static) {
        *self.shared.on_proposal.lock().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(f));
    }

    /// Agree on the next epoch, proposing it for `reason` unless another process proposed it
    /// first; every member calls it (after [`Membership::proposed`] says so, or after a
    /// failure of its own: then [`Membership::fail`]).
    ///
    /// # Errors
    /// The same error on every member when they cannot agree; an error on this process
    /// alone when the others went on without it.
    pub async fn agree(&self, reason: &str) -> Result<View> {
        let prev = self.view();
        let started = Instant::now();
        let d = self.agreement().run(prev.epoch + 1, Some(&prev), reason).await?;
        let v = self.outcome(prev.epoch + 1, d, started)?;
        self.set_view(v.clone());
        Ok(v)
    }

    /// Agree on the next epoch after a failure this process saw (a backend's `PeerFailed`,
    /// a closed connection, an operation that timed out): the epoch is marked a failure, so
    /// every member hears to abort its communicators, then as [`Membership::agree`]. Who is
    /// gone is still decided on evidence: a member that only saw an error does not exclude
    /// the peer it blames.
    ///
    /// # Errors
    /// As [`Membership::agree`].
    pub async fn fail(&self, reason: &str) -> Result<View> {
        let next = self.view().epoch + 1;
        let why = format!("rank {}: {reason}", self.me.rank);
        self.store.compare_set(&self.keys.failure(next), None, why.as_bytes()).await?;
        self.agree(&why).await
    }

    /// Record that incarnation `incarnation` of `rank` is gone (the launcher saw it exit, a
    /// backend saw its connection close for good) and propose the next epoch. For callers
    /// that are not members (a launcher); members call [`Membership::agree`]. Without an
    /// incarnation it is the rank's newest: call it before the rank's replacement starts
    /// (the replacement takes the next one). With one, the rank's counter is moved up to it
    /// when lower (the process died before it joined and took its number), so the
    /// replacement takes the next one and not the number recorded gone. A record already
    /// there (the membership's own: a watcher or a leader saw the process's liveness record
    /// go stale; or an earlier report) is kept, and nothing is proposed again: whoever wrote
    /// it proposed the epoch that leaves the process out, and a proposal now, once that epoch
    /// is agreed, would mark the next one a failure that nobody had.
    ///
    /// # Errors
    /// Store errors.
    pub async fn report_gone(
        store: &dyn Store,
        cfg: &MembershipConfig,
        rank: usize,
        incarnation: Option<u64>,
        why: &str,
    ) -> Result<()> {
        let keys = Keys::new(&cfg.prefix);
        let taken = store.add(&keys.incarnation(rank), 0).await?.max(0) as u64;
        let inc = match incarnation {
            Some(i) => {
                if let Some(short) = i.checked_sub(taken).filter(|d| *d > 0) {
                    store.add(&keys.incarnation(rank), i64::try_from(short).unwrap_or(i64::MAX)).await?;
                }
                i
            }
            None => taken.max(1),
        };
        if !store.compare_set(&keys.gone(rank, inc), None, why.as_bytes()).await?.swapped {
            return Ok(());
        }
        if let Some(c) = store.get(&keys.current()).await? {
            if let Ok(e) = String::from_utf8_lossy(&c).trim().parse::<u64>() {
                store.compare_set(&keys.failure(e + 1), None, why.as_bytes()).await?;
                store.compare_set(&keys.proposed(e + 1), None, why.as_bytes()).await?;
            }
        }
        Ok(())
    }

    /// The records that these processes are gone, in their order (`None` where there is
    /// none): the text says who saw what, as `report_gone` or a member watching a liveness
    /// record wrote it. One multi-key read that does not wait, for callers that are not
    /// members (a launcher watching for processes the membership declared gone on its own
    /// evidence: stopped, or killed without the launcher knowing).
    ///
    /// # Errors
    /// Store errors.
    pub async fn gone_records(store: &dyn Store, cfg: &MembershipConfig, of: &[Member]) -> Result<Vec<Option<String>>> {
        let keys = Keys::new(&cfg.prefix);
        let gone: Vec<String> = of.iter().map(|m| keys.gone(m.rank, m.incarnation)).collect();
        let got = store.wait_many(&gone, Instant::now()).await?;
        Ok(got.into_iter().map(|v| v.map(|b| String::from_utf8_lossy(&b).into_owned())).collect())
    }

    /// Beats this process has sent (for tests and reports).
    pub fn beats(&self) -> u64 {
        self.shared.beats.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests;

impl Drop for Membership {
    fn drop(&mut self) {
        // Stops beating: the others see the record go stale, as after a kill.
        self.shared.stop.store(true, Ordering::Release);
        if let Some(h) = self.heart.take() {
            h.stop();
        }
    }
}
