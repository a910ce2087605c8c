//! `anyccl-recover train --in-place`: one rank of a job that recovers without a restart.
//!
//! Every process is a member of the job's membership (anyccl's `membership`). A failure
//! (a peer's connection closed, an operation aborted or timed out, the launcher's report
//! of a rank's exit, a liveness record gone stale) starts the next epoch: every rank aborts
//! its communicators (at once, on the membership's beat, so none waits on a peer that is
//! itself recovering) and the members agree on who is in. Each epoch's groups are new
//! communicators (`<group>@e<epoch>`) among the replicas whose every stage is a member; a
//! replica that lost a stage waits. A replacement (`anyccl-run --elastic`) joins at the
//! next epoch, which the training ranks take at the end of the same step: ranks hear of the
//! joiner at different steps, so each raises a flag that the step carries through every
//! message (down the pipeline, back up, across the replicas' average), and every rank ends
//! that step knowing whether any rank heard (one that went to agree alone would leave its
//! peers in a collective, or inside a lazy connect their library cannot stop). Its replica
//! is fed the parameters by a healthy replica over the rebuilt data groups (no checkpoint
//! is read).
//!
//! Steps are transactional: a rank keeps the parameters from before its last two steps, and
//! the members of an epoch start it from the fewest steps any of them completed (a kill in
//! the middle of a step can complete one stage's all_reduce and fail another's), so a step
//! counts on every rank or on none. Each rank records which replicas trained from which
//! step (`participation/`); `--replay` runs that record with no fault, and must end equal
//! bit for bit. Every rebuilt group is warmed before its first step, from the plan the
//! first step recorded (kept in the store, where a replacement finds its rank's plan).

use crate::cli::{usage, Job, OWNER};
use crate::dev::Dev;
use crate::model::Stage;
use anyccl_examples::outln;
mod end;
mod replay;
mod warm;

use crate::participation::{read_record, Segment};
use crate::step::{kill_self, train_step, StepCtx};
use crate::timeline::{mark, mark_with};
use anyccl::membership::{Membership, MembershipConfig, Proposal, View};
use anyccl::raw::{Collective, Ctx};
use anyccl::warmup::{GroupPlan, StepRecorder};
use anyccl::{
    Backend, CommConfig, Communicator, DeviceKind, Error, GroupSpec, LaunchEnv, Platform, Recovery, Result, Role, Store,
};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How an epoch's training ended.
enum EpochEnd {
    /// Every step is done.
    Done,
    /// A process joins: the step finished, agree now.
    Join(Proposal),
    /// Something failed: the epoch's communicators are to be aborted and the next agreed.
    Failed(Error),
}

/// An epoch's groups.
struct Groups {
    dpc: Communicator,
    ppc: Communicator,
}

/// The communicators of an epoch, and the epoch.
type Live = (u64, Vec<Arc<dyn Collective>>);

/// One rank of an in-place job.
pub(crate) async fn train(job: &Job) -> Result<ExitCode> {
    let crate::cli::Started { env, store, server: _server, backend, platform, dp, pp } = job.start().await?;
    let (replica, stage) = (env.rank / pp, env.rank % pp);
    let valid = env.incarnation == 1 || job.replay.is_some();
    let model = Stage::new(job.width as usize, job.layers as usize, job.seed, stage)
        .map_err(|e| usage("--width", format!("the model of --width {} --layers {}: {e}", job.width, job.layers)))?;
    let cfg = CommConfig::from_env()?;
    let run_dir = job.out.join(job.run_name());
    let mut r = InPlace {
        job,
        env,
        store,
        backend,
        platform,
        cfg,
        dp,
        pp,
        replica,
        stage,
        run_dir,
        model,
        applied: 0,
        valid,
        history: VecDeque::new(),
        segments: Vec::new(),
        plans: None,
        live: Arc::default(),
    };
    mark(&r.run_dir, r.me(), r.env.incarnation, "started", 0, 0);
    match &job.replay {
        Some(path) => {
            let record = read_record(path)?;
            r.replay(&record).await?;
        }
        None => r.run().await?,
    }
    r.finish().await
}

struct InPlace<'j> {
    job: &'j Job,
    env: LaunchEnv,
    store: Arc<dyn Store>,
    backend: Arc<dyn Backend>,
    platform: Arc<dyn Platform>,
    cfg: CommConfig,
    dp: usize,
    pp: usize,
    replica: usize,
    stage: usize,
    run_dir: PathBuf,
    model: Stage,
    /// Steps this rank's parameters have completed.
    applied: u64,
    /// Whether this process holds the job's parameters: a first process does; a
    /// replacement once a healthy replica has fed it.
    valid: bool,
    /// The parameters from before the last steps: (steps completed then, parameters).
    history: VecDeque<(u64, Vec<f32>)>,
    /// The stretches this rank trained in.
    segments: Vec<Segment>,
    /// The plan the first step recorded, one per group (by the group's name before `@`).
    plans: Option<Vec<GroupPlan>>,
    /// The epoch's communicators (and the epoch), which the next epoch's proposal, heard on
    /// the membership's beat, aborts.
    live: Arc<Mutex<Live>>,
}

/// Whether the in-place recovery takes `e` (a peer failed, an operation was aborted or
/// timed out, a communicator must be rebuilt); anything else ends the rank.
fn recoverable(e: &Error) -> bool {
    matches!(e.recovery(), Recovery::Rebuild | Recovery::Retry)
}

impl InPlace<'_> {
    fn me(&self) -> usize {
        self.env.rank
    }

    fn mark(&self, what: &str, epoch: u64) {
        mark(&self.run_dir, self.me(), self.env.incarnation, what, epoch, self.applied);
    }

    /// A store key of this run's recovery.
    fn key(&self, rest: &str) -> String {
        format!("anyccl-recover/{}/inplace/{rest}", self.job.run_name())
    }

    fn ranks_of(&self, replicas: &[usize]) -> Vec<usize> {
        replicas.iter().flat_map(|d| (0..self.pp).map(move |s| d * self.pp + s)).collect()
    }

    /// The stretch an epoch's view starts: the replicas whose every stage is a member train
    /// (the same on every member, a replacement included: it follows from the view alone).
    /// Which of them must be fed, and from which, the members work out when they meet
    /// ([`InPlace::start_step`]).
    fn segment(&self, view: &View) -> Segment {
        let pp = self.pp;
        let active: Vec<usize> = (0..self.dp).filter(|d| (0..pp).all(|s| view.member(d * pp + s).is_some())).collect();
        Segment { epoch: view.epoch, from_step: 0, active, fresh: Vec::new(), source: None }
    }

    /// The recovery loop: agree, rebuild, warm, train, until every step is done.
    async fn run(&mut self) -> Result<()> {
        let mcfg = MembershipConfig::from_env()?;
        if self.env.incarnation > 1 && self.store.get(&self.key("done")).await?.is_some() {
            // Nothing to rejoin: `finish` takes the stage's final parameters from a replica
            // that trained to the end.
            outln!("rank {}: the job finished before this replacement started", self.me());
            return Ok(());
        }
        let m = Membership::join(self.store.clone(), self.me(), self.env.world_size, mcfg).await?;
        self.mark("agreed", m.view().epoch);
        let (live, dir, me, inc) = (self.live.clone(), self.run_dir.clone(), self.me(), self.env.incarnation);
        m.on_proposal(move |p| {
            mark(&dir, me, inc, if p.failure { "failure heard" } else { "join heard" }, p.epoch, 0);
            if !p.failure {
                // Taken at a step boundary that every rank agrees on (the step's flag): an
                // abort now could leave a peer inside a lazy connect that its library cannot
                // stop (HCCL's link set-up), waiting there to the library's own timeout.
                return;
            }
            // Only communicators of an earlier epoch: by the time this runs, the main
            // thread may have agreed on `p.epoch` and built its groups already.
            let comms: Vec<Arc<dyn Collective>> = match live.lock() {
                Ok(v) if v.0 < p.epoch => v.1.clone(),
                _ => Vec::new(),
            };
            // Abort off the beat's thread (the callback must not block), every one at once.
            drop(abort_in_threads(comms));
        });
        // Epochs in a row that changed no member and completed no step: a failure that a
        // rebuild does not cure is an error, not a loop.
        let mut fruitless = 0;
        loop {
            let view = m.view();
            let mut seg = self.segment(&view);
            if !seg.active.contains(&self.replica) {
                // This replica lost a stage: wait for its replacement (or the job's end).
                self.mark("waiting for the replica", view.epoch);
                match self.idle(&m).await? {
                    None => return Ok(()),
                    Some(p) => {
                        self.agree(&m, &p.reason, false).await?;
                        continue;
                    }
                }
            }
            let before = self.applied;
            let end = match self.epoch(&m, &mut seg).await {
                Ok(end) => end,
                Err(e) if recoverable(&e) => EpochEnd::Failed(e),
                Err(e) => return Err(e),
            };
            let comms: Vec<Arc<dyn Collective>> =
                self.live.lock().map(|mut v| v.1.drain(..).collect()).unwrap_or_default();
            match end {
                EpochEnd::Done => {
                    self.store.set(&self.key("done"), self.applied.to_string().as_bytes()).await?;
                    return Ok(());
                }
                EpochEnd::Join(p) => {
                    self.mark("join taken", p.epoch);
                    self.agree(&m, &p.reason, false).await?;
                }
                EpochEnd::Failed(e) => {
                    self.mark("failure seen", view.epoch + 1);
                    // Aborts run while the members agree (an NCCL abort over sockets takes
                    // about a second), and are over before the next epoch's groups connect.
                    let aborting = abort_in_threads(comms.clone());
                    let why = format!("rank {} at step {}: {e}", self.me(), self.applied);
                    let fresh = m.proposed().is_some();
                    let next = self.agree(&m, &why, !fresh).await;
                    for t in aborting {
                        let _ = t.join();
                    }
                    let next = next?;
                    let same = next.members == view.members;
                    fruitless = if same && self.applied == before { fruitless + 1 } else { 0 };
                    if fruitless >= 3 {
                        return Err(e);
                    }
                }
            }
            drop(comms);
        }
    }

    /// Agree on the next epoch (as a failure, when this rank saw one first); the timeline
    /// says when.
    async fn agree(&self, m: &Membership, why: &str, failure: bool) -> Result<View> {
        let v = if failure { m.fail(why).await? } else { m.agree(why).await? };
        self.mark("agreed", v.epoch);
        // Said once, by the first member that was in before (a joiner's view comes from its join).
        if Some(self.me()) == v.ranks().into_iter().find(|r| !v.joined.contains(r)) {
            outln!(
                "membership: epoch {} members {:?} (left {:?}, joined {:?}): {}",
                v.epoch,
                v.ranks(),
                v.left,
                v.joined,
                v.reason
            );
        }
        Ok(v)
    }

    /// A rank whose replica lost a stage: wait until a process joins (the proposal to take)
    /// or the training ranks finish (`None`), for at most the operation timeout.
    async fn idle(&self, m: &Membership) -> Result<Option<Proposal>> {
        let started = Instant::now();
        loop {
            if let Some(p) = m.proposed() {
                return Ok(Some(p));
            }
            if started.elapsed() >= self.cfg.op_timeout {
                let ctx = Ctx::new("anyccl-recover", self.me(), "");
                let why = "no replacement joined this rank's replica and the job did not finish";
                return Err(ctx.timeout("wait for a replacement", started.elapsed(), why));
            }
            // One store request a look: the store wakes this wait when the job ends; a
            // proposal is heard on the membership's beat, looked at between waits.
            match self.store.wait(&self.key("done"), Instant::now() + Duration::from_millis(100)).await {
                Ok(_) => {
                    outln!("rank {}: the job finished while its replica waited for a replacement", self.me());
                    return Ok(None);
                }
                Err(Error::Timeout { .. }) => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// One epoch: rebuild the groups, agree where to start, feed fresh replicas, warm, train.
    async fn epoch(&mut self, m: &Membership, seg: &mut Segment) -> Result<EpochEnd> {
        let tag = format!("e{}", seg.epoch);
        let groups = until_failure(m, self.connect(seg, &tag)).await?;
        if let Ok(mut v) = self.live.lock() {
            *v = (seg.epoch, vec![groups.dpc.collective().clone(), groups.ppc.collective().clone()]);
        }
        self.mark("rebuilt", seg.epoch);
        until_failure(m, self.start_step(seg)).await?;
        self.forget_old_epochs(&groups).await;
        self.feed(seg, &groups)?;
        if seg.epoch > 0 && !self.job.no_warmup {
            until_failure(m, self.warm(seg, &groups)).await?;
            self.mark("warmed", seg.epoch);
        }
        self.segments.push(seg.clone());
        self.train(m, seg, &groups).await
    }

    /// Once every training rank met in this epoch (`start_step`), the keys of the epoch this
    /// process trained before the last are no one's: each group's first member removes its
    /// group's namespaces of those epochs, and the first member of stage 0's those epochs'
    /// step counts, so the store does not grow with the recoveries (the membership and the
    /// warmup remove their own).
    async fn forget_old_epochs(&self, g: &Groups) {
        // The epoch before the last one this process trained (one a call, so each once).
        let Some(s) = self.segments.len().checked_sub(2).map(|i| &self.segments[i]) else { return };
        let mut prefixes = Vec::new();
        if g.ppc.rank() == 0 {
            prefixes.push(format!("pp-replica{}@e{}/", self.replica, s.epoch));
        }
        if g.dpc.rank() == 0 {
            prefixes.push(format!("dp-stage{}@e{}/", self.stage, s.epoch));
            if self.stage == 0 {
                prefixes.push(self.key(&format!("e{}/applied/", s.epoch)));
            }
        }
        for p in prefixes {
            if let Err(e) = self.store.delete_prefix(&p).await {
                tracing::debug!("keys under {p} left in the store: {e}");
            }
        }
    }

    /// The epoch's groups: this replica's pipeline, and this stage of every training replica.
    async fn connect(&self, seg: &Segment, tag: &str) -> Result<Groups> {
        let (me, pp, stage, replica) = (self.me(), self.pp, self.stage, self.replica);
        let pp_ranks: Vec<usize> = (0..pp).map(|s| replica * pp + s).collect();
        let dp_ranks: Vec<usize> = seg.active.iter().map(|d| d * pp + stage).collect();
        let specs = [
            GroupSpec::new(format!("pp-replica{replica}@{tag}"), pp_ranks, OWNER, Role::Pipeline),
            GroupSpec::new(format!("dp-stage{stage}@{tag}"), dp_ranks, OWNER, Role::Data),
        ];
        let mut comms = Vec::new();
        for spec in specs {
            let at = spec.group_rank(me).ok_or_else(|| {
                Ctx::new("anyccl-recover", me, &spec.name).invalid("connect", "spec", "this rank is no member")
            })?;
            let c = Communicator::connect(
                self.backend.as_ref(),
                spec,
                at,
                self.store.clone(),
                self.platform.device(),
                self.cfg.clone(),
            )
            .await?;
            comms.push(c);
        }
        let dpc = comms.pop();
        let ppc = comms.pop();
        match (dpc, ppc) {
            (Some(dpc), Some(ppc)) => Ok(Groups { dpc, ppc }),
            _ => Err(Ctx::new("anyccl-recover", me, "").aborted("the epoch's groups were not both built")),
        }
    }

    /// Where the epoch starts, and which replicas are fed from which. Every training rank
    /// publishes the steps it completed and whether its parameters are the job's (a first
    /// process, or a replacement once fed); every rank reads them all, so all work out the
    /// same: a replica kept its parameters when all its ranks hold the job's; the others are
    /// fed by the first that kept them; the epoch starts from the fewest steps a rank of a
    /// kept replica completed, and a rank past it goes back to its parameters from before.
    async fn start_step(&mut self, seg: &mut Segment) -> Result<()> {
        let e = seg.epoch;
        let ctx = Ctx::new("anyccl-recover", self.me(), "");
        let mine = format!("{} {}", self.applied, u8::from(self.valid));
        self.store.set(&self.key(&format!("e{e}/applied/{}", self.me())), mine.as_bytes()).await?;
        let ranks = self.ranks_of(&seg.active);
        let keys: Vec<String> = ranks.iter().map(|r| self.key(&format!("e{e}/applied/{r}"))).collect();
        let got = self.store.wait_many(&keys, anyccl::raw::deadline_in(self.cfg.op_timeout)).await?;
        let parse = |v: &Option<Vec<u8>>| -> Option<(u64, bool)> {
            let t = std::str::from_utf8(v.as_deref()?).ok()?;
            let (a, ok) = t.split_once(' ')?;
            Some((a.parse().ok()?, ok == "1"))
        };
        let states: Vec<(u64, bool)> = got.iter().map(parse).collect::<Option<_>>().ok_or_else(|| {
            ctx.timeout(
                format!("epoch {e}: meet the training ranks"),
                self.cfg.op_timeout,
                "a training rank published no step count in time",
            )
        })?;
        let state = |r: usize| ranks.iter().position(|x| *x == r).map(|i| states[i]);
        let kept_by = |d: &usize| (0..self.pp).all(|s| state(d * self.pp + s).is_some_and(|(_, ok)| ok));
        let mut kept: Vec<usize> = seg.active.iter().copied().filter(kept_by).collect();
        // Nothing trained yet: every process holds the same initial parameters.
        if kept.is_empty() && states.iter().all(|(a, _)| *a == 0) {
            kept = seg.active.clone();
        }
        seg.fresh = seg.active.iter().copied().filter(|d| !kept.contains(d)).collect();
        seg.source = kept.first().copied();
        if seg.source.is_none() {
            let text = format!(
                "epoch {e}: no replica kept its parameters (every training replica has a rank that was replaced \
                 and not yet fed): recovery in place cannot go on; restart the job from its last checkpoint"
            );
            return Err(ctx.backend_error("recover in place", 0, text, Recovery::Fatal));
        }
        let start = self.ranks_of(&kept).iter().filter_map(|r| state(*r).map(|(a, _)| a)).min().unwrap_or(self.applied);
        if kept.contains(&self.replica) && self.applied > start {
            let Some((_, params)) = self.history.iter().find(|(s, _)| *s == start) else {
                let text = format!(
                    "epoch {e} starts at step {start}, but this rank completed {} and keeps the parameters of steps {:?} \
                     only",
                    self.applied,
                    self.history.iter().map(|(s, _)| *s).collect::<Vec<_>>()
                );
                return Err(ctx.backend_error("recover in place", 0, text, Recovery::Fatal));
            };
            outln!(
                "rank {}: step {} is undone (not every rank completed it): back to step {start}",
                self.me(),
                start + 1
            );
            self.model.params = params.clone();
            self.applied = start;
        }
        self.history.retain(|(s, _)| *s <= start);
        seg.from_step = start;
        Ok(())
    }

    /// Fresh replicas receive the parameters from the source replica over each data group.
    fn feed(&mut self, seg: &Segment, g: &Groups) -> Result<()> {
        let Some(source) = seg.source.filter(|_| !seg.fresh.is_empty()) else { return Ok(()) };
        let root = seg.active.iter().position(|d| *d == source).unwrap_or(0);
        let dev = Dev { p: self.platform.as_ref(), timeout: self.cfg.op_timeout };
        dev.broadcast(&g.dpc, &mut self.model.params, root)?;
        if seg.fresh.contains(&self.replica) {
            self.applied = seg.from_step;
            self.valid = true;
            self.history.clear();
            self.mark("fed", seg.epoch);
            outln!(
                "rank {}: received the parameters of step {} from replica {source} (no checkpoint read)",
                self.me(),
                seg.from_step
            );
        }
        Ok(())
    }

    /// The epoch's steps, until the last, a join (at a step boundary) or a failure.
    async fn train(&mut self, m: &Membership, seg: &Segment, g: &Groups) -> Result<EpochEnd> {
        let me = self.me();
        let platform = self.platform.clone();
        let mut recorder =
            (self.plans.is_none() && seg.epoch == 0).then(|| StepRecorder::start(&[&g.dpc, &g.ppc], platform.as_ref()));
        let mut first = true;
        while self.applied < self.job.steps {
            let step = self.applied;
            // A failure ends the epoch now; a joiner at the end of the first step in which
            // any rank has heard of it, the same step on every rank (the step's flag).
            let heard = m.proposed();
            if let Some(p) = heard.as_ref().filter(|p| p.failure) {
                return Ok(EpochEnd::Failed(self.heard(p)));
            }
            self.history.push_back((step, self.model.params.clone()));
            while self.history.len() > 2 {
                self.history.pop_front();
            }
            let kill = self.job.kill_at == Some(step) && me + 1 == self.env.world_size && self.env.incarnation == 1;
            let run_dir = self.run_dir.clone();
            let mid_step = move || {
                if kill {
                    kill_self(&run_dir, me, step);
                }
            };
            let cx = step_ctx(self.job, self.platform.as_ref(), &self.cfg, g, (self.pp, self.stage, self.replica));
            let t = Instant::now();
            // The device memory the epoch's first step allocates: 0.0 MiB when its groups
            // were warmed (the lazy connects happened before it).
            let free_before = if first { self.platform.mem_info().ok().map(|m| m.free) } else { None };
            let (loss, join) = match train_step(&cx, &mut self.model, step, heard.is_some(), &mid_step) {
                Ok(l) => l,
                Err(e) => return Ok(EpochEnd::Failed(e)),
            };
            self.applied = step + 1;
            if first {
                let _ = self.platform.synchronize();
                let took = free_before.zip(self.platform.mem_info().ok().map(|m| m.free));
                let detail = match took {
                    Some((b, a)) if self.platform.kind() != DeviceKind::Cpu => {
                        format!("{:.1} MiB", b.saturating_sub(a) as f64 / (1 << 20) as f64)
                    }
                    _ => String::new(),
                };
                if !detail.is_empty() && seg.epoch > 0 {
                    outln!(
                        "rank {me}: the first step of epoch {} allocated {detail} of device memory ({})",
                        seg.epoch,
                        if self.job.no_warmup { "not warmed" } else { "warmed" }
                    );
                }
                mark_with(&self.run_dir, me, self.env.incarnation, "first step", seg.epoch, self.applied, detail);
                first = false;
            }
            if let Some(r) = recorder.take() {
                self.record(r, seg).await?;
            }
            if self.stage + 1 == self.pp && seg.active.first() == Some(&self.replica) {
                outln!("step {:3}  loss {loss:.6}  {:.2?}  epoch {}", step + 1, t.elapsed(), seg.epoch);
            }
            if join {
                // This rank may not have heard of it yet itself: another rank's flag says so.
                let p = m.proposed().unwrap_or_else(|| Proposal {
                    epoch: seg.epoch + 1,
                    reason: "a process joins (heard by another rank)".into(),
                    failure: false,
                });
                return Ok(EpochEnd::Join(p));
            }
        }
        Ok(EpochEnd::Done)
    }

    /// The error a failure heard from the membership stands for.
    fn heard(&self, p: &Proposal) -> Error {
        Ctx::new("anyccl-recover", self.me(), "").aborted(format!("epoch {} proposed: {}", p.epoch, p.reason))
    }
}

/// A step of stage `stage` of `replica` (of `pp` stages) on the epoch's groups `g`, with the
/// join flag (the run and its replay carry it alike).
fn step_ctx<'a>(
    job: &'a Job,
    p: &'a dyn Platform,
    cfg: &CommConfig,
    g: &'a Groups,
    (pp, stage, replica): (usize, usize, usize),
) -> StepCtx<'a> {
    let dev = Dev { p, timeout: cfg.op_timeout };
    StepCtx { job, dev, dpc: &g.dpc, ppc: &g.ppc, pp, stage, replica, flags: true }
}

/// Abort each communicator on a thread of its own, all at once, each within 5 s (here, when
/// no thread can be started): the threads, to join before the communicators' resources are
/// needed again.
fn abort_in_threads(comms: Vec<Arc<dyn Collective>>) -> Vec<std::thread::JoinHandle<()>> {
    let abort = |c: &Arc<dyn Collective>| {
        let _ = futures::executor::block_on(c.abort(Instant::now() + Duration::from_secs(5)));
    };
    let mut threads = Vec::new();
    for c in comms {
        let mine = c.clone();
        match std::thread::Builder::new().name("anyccl-recover-abort".into()).spawn(move || abort(&mine)) {
            Ok(t) => threads.push(t),
            Err(_) => abort(&c),
        }
    }
    threads
}

/// `f`, ended early with `Aborted` when the membership hears of a failure: a connect, a
/// store wait or a warmup whose peer died returns at once instead of at its deadline (a
/// joiner waits for the epoch's first step boundary).
async fn until_failure<T>(m: &Membership, f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    let watch = async {
        loop {
            if let Some(p) = m.proposed().filter(|p| p.failure) {
                return p;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::select! {
        r = f => r,
        p = watch => Err(Ctx::new("anyccl-recover", m.me().rank, "").aborted(format!(
            "epoch {} proposed while rebuilding: {}", p.epoch, p.reason
        ))),
    }
}
