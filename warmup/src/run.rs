//! Running a warmup: claim the generation, check memory, agree on the plan, run it under a
//! deadline, then agree on the outcome: all ranks succeed or all fail.

use crate::plan::{exclusion, merge, plan_for, GroupPlan, Kind, Sizes, Step, Target};
use crate::report::{MemSource, Report, StepReport};
use crate::saved::{choose, Choice};
use anyccl_core::{Collective, Communicator, Error, P2POp, Platform, ReduceOp, Result, Store, Work};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Warmup settings, with `ANYCCL_WARMUP*` overrides.
#[derive(Debug, Clone)]
pub struct WarmupConfig {
    /// Run at all (`ANYCCL_WARMUP=1|0`; default off: the caller opts in).
    pub enabled: bool,
    /// Run even where the backend connects every transport at init (the CPU backend;
    /// tests).
    pub force: bool,
    /// Deadline for the whole warmup, agreement to outcome (`ANYCCL_WARMUP_TIMEOUT_S`, 300).
    pub timeout: Duration,
    /// Probe sizes and dtype.
    pub sizes: Sizes,
    /// Device memory a recorded report says the plan needs; the warmup refuses to start
    /// below this plus `memory_margin`.
    pub memory_need: Option<u64>,
    /// Head room over `memory_need` (`ANYCCL_WARMUP_MARGIN_MIB`, default 256 MiB).
    pub memory_margin: u64,
}

impl Default for WarmupConfig {
    fn default() -> Self {
        WarmupConfig {
            enabled: false,
            force: false,
            timeout: Duration::from_secs(300),
            sizes: Sizes::default(),
            memory_need: None,
            memory_margin: 256 << 20,
        }
    }
}

impl WarmupConfig {
    /// `default` with the environment's overrides.
    ///
    /// # Errors
    /// `InvalidArgument` naming the variable when one is malformed.
    pub fn from_env(default: WarmupConfig) -> Result<Self> {
        let mut c = default;
        if let Ok(v) = std::env::var("ANYCCL_WARMUP") {
            c.enabled = matches!(v.as_str(), "1" | "true" | "on" | "yes");
        }
        if let Some(t) = anyccl_core::env_secs("ANYCCL_WARMUP_TIMEOUT_S")? {
            c.timeout = t;
        }
        if let Ok(v) = std::env::var("ANYCCL_WARMUP_MARGIN_MIB") {
            let m = v.parse::<u64>().ok().filter(|m| m.leading_zeros() >= 20).ok_or_else(|| {
                err("WarmupConfig::from_env", 0, "", format!("ANYCCL_WARMUP_MARGIN_MIB={v:?} is not a number of MiB"))
            })?;
            c.memory_margin = m << 20;
        }
        Ok(c)
    }
}

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
    /// Ranks in the job; every one of them calls the warmup.
    pub world_size: usize,
    /// This rank's device.
    pub platform: &'a dyn Platform,
}

/// `final/<rank>`: the outcome of a generation on one rank, replayed by a repeated call.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Final {
    Ok(Report),
    Err { kind: String, msg: String },
}

/// `plan/<group>/<rank>`: a member's plan of the group, or why it refuses to run any.
#[derive(Debug, Serialize, Deserialize)]
enum PlanMsg {
    Plan(GroupPlan),
    Refused(String),
}

/// `failed`: the first failure of the generation (the error kind, and which rank said what);
/// ranks waiting on an operation stop when they see it.
#[derive(Debug, Serialize, Deserialize)]
struct Failure {
    kind: String,
    who: String,
}

/// `outcome/<rank>` (`Ok` or `Failed`) and `verdict`, the first outcome of the whole
/// generation stored, which every rank adopts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Outcome {
    Ok,
    Failed(String),
    Timeout(String),
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
}

fn err(op: &'static str, rank: usize, group: &str, msg: String) -> Error {
    Error::InvalidArgument { op, arg: "plan", rank, group: group.into(), msg }
}

/// Warm `targets` (the groups the caller names; never a registry sweep).
///
/// Every rank of the job calls this with the same generation. Groups whose role is
/// cross-engine are excluded unless their target allows it; groups of one rank are
/// excluded (nothing to connect).
///
/// # Errors
/// On any rank's failure, every rank returns an error and aborts the communicators of the
/// plan: `InvalidArgument` for plans that differ or a memory refusal, `Timeout` for ranks
/// that did not arrive or finish in time, `PeerFailed` naming the ranks that failed.
///
/// # Cancel safety
/// Not cancel safe: dropping the future part-way leaves the generation claimed; a later
/// call with the same generation waits for the recorded outcome and times out.
///
/// # Examples
/// After a restart, before loading the checkpoint: warm the train step's groups, chosen by
/// owner and role, never a cross-engine group.
/// ```no_run
/// use anyccl_core::{Communicator, GroupRegistry, Platform, Role, Store};
/// use anyccl_warmup::{warmup, Session, Target, WarmupConfig};
///
/// async fn recover(
///     store: &dyn Store, platform: &dyn Platform, registry: &GroupRegistry, comms: &[Communicator],
///     rank: usize, world_size: usize, restarts: u64,
/// ) -> anyccl_core::Result<()> {
///     let train_step = registry.filter("trainer", &[Role::Data, Role::Pipeline, Role::Tensor]);
///     let targets: Vec<Target<'_>> = comms
///         .iter()
///         .filter(|c| train_step.iter().any(|g| g.name == c.spec().name))
///         .map(Target::new)
///         .collect();
///     let session = Session { store, job: "trainer", generation: restarts, rank, world_size, platform };
///     let report = warmup(&session, &targets, &WarmupConfig::from_env(WarmupConfig::default())?).await?;
///     print!("{}", report.table());
///     Ok(())
/// }
/// ```
pub async fn warmup(s: &Session<'_>, targets: &[Target<'_>], cfg: &WarmupConfig) -> Result<Report> {
    let (plans, report) = role_plans(s, targets, cfg);
    let choices = plans.iter().map(|(_, p)| Choice::Fixed(format!("role plan ({})", p.role))).collect();
    run_plans(s, plans, choices, cfg, report).await
}

pub(crate) fn role_plans<'a>(
    s: &Session<'_>,
    targets: &[Target<'a>],
    cfg: &WarmupConfig,
) -> (Vec<(&'a Communicator, GroupPlan)>, Report) {
    let mut report = Report::new(s.job, s.generation, s.rank);
    let mut plans = Vec::new();
    for t in targets {
        let caps = t.comm.capabilities().clone();
        match exclusion(t.comm, t.options.allow_cross_engine) {
            Some(why) => report.excluded.push((t.comm.spec().name.clone(), why.into())),
            None => plans.extend(plan_for(t, &caps, &cfg.sizes).map(|p| (t.comm, p))),
        }
    }
    (plans, report)
}

/// Warm explicit plans (e.g. recorded ones), one per communicator.
///
/// # Errors
/// As [`warmup`].
pub async fn warmup_plans(
    s: &Session<'_>,
    plans: Vec<(&Communicator, GroupPlan)>,
    cfg: &WarmupConfig,
) -> Result<Report> {
    let choices = plans.iter().map(|_| Choice::Fixed("plan given by the caller".into())).collect();
    run_plans(s, plans, choices, cfg, Report::new(s.job, s.generation, s.rank)).await
}

pub(crate) async fn run_plans(
    s: &Session<'_>,
    plans: Vec<(&Communicator, GroupPlan)>,
    choices: Vec<Choice>,
    cfg: &WarmupConfig,
    mut report: Report,
) -> Result<Report> {
    if !cfg.enabled {
        report.skipped = Some("warmup is off (set ANYCCL_WARMUP=1 or enable it in the config)".into());
        return Ok(report);
    }
    if !cfg.force && plans.iter().all(|(c, _)| !c.capabilities().lazy_connect) {
        tracing::info!("warmup skipped: the backend connects every transport at init");
        report.skipped = Some("the backend connects every transport at init (no lazy connect)".into());
        return Ok(report);
    }
    let deadline = anyccl_core::deadline_in(cfg.timeout);

    // 1. One run per (job, generation, rank): a retried call replays the outcome.
    let final_key = s.key(&format!("final/{}", s.rank));
    if let Some(f) = s.store.get(&final_key).await? {
        return replay(&final_key, &f);
    }
    let claim = s.store.compare_set(&s.key(&format!("claim/{}", s.rank)), None, b"running").await?;
    if !claim.swapped {
        tracing::warn!(
            "warmup generation {} already running or done on rank {}: waiting for its outcome",
            s.generation,
            s.rank
        );
        let f = s.store.wait(&final_key, deadline).await?;
        return replay(&final_key, &f);
    }

    let mut planned: Vec<((&Communicator, GroupPlan), Choice)> = plans.into_iter().zip(choices).collect();
    planned.sort_by(|a, b| a.0 .1.group.cmp(&b.0 .1.group));
    let (mut plans, choices): (Vec<_>, Vec<_>) = planned.into_iter().unzip();
    let comms: Vec<Arc<dyn Collective>> = plans.iter().map(|(c, _)| c.collective().clone()).collect();
    let result = run_claimed(s, &mut plans, choices, cfg, &mut report, deadline, &comms).await;
    let fin = match &result {
        Ok(()) => Final::Ok(report.clone()),
        Err(e) => Final::Err { kind: e.kind().into(), msg: e.to_string() },
    };
    let _ = s.store.set(&final_key, &encode(&fin)).await;
    result.map(|_| report)
}

fn replay(key: &str, f: &[u8]) -> Result<Report> {
    match decode::<Final>(key, f)? {
        Final::Ok(mut r) => {
            r.replayed = true;
            Ok(r)
        }
        Final::Err { kind, msg } => Err(Error::Aborted {
            rank: 0,
            group: String::new(),
            detail: format!("this warmup generation already failed ({kind}): {msg}"),
        }),
    }
}

fn abort_all(comms: &[Arc<dyn Collective>]) {
    anyccl_core::abort_all(comms, Duration::from_secs(10));
}

async fn run_claimed(
    s: &Session<'_>,
    plans: &mut [(&Communicator, GroupPlan)],
    choices: Vec<Choice>,
    cfg: &WarmupConfig,
    report: &mut Report,
    deadline: Instant,
    comms: &[Arc<dyn Collective>],
) -> Result<()> {
    // 2. Memory pre-check, before anything touches the device.
    let refusal = match cfg.memory_need {
        Some(need) => match s.platform.mem_info() {
            Err(e) => Some(format!("rank {} cannot read free device memory: {e}", s.rank)),
            Ok(m) => (m.free < need + cfg.memory_margin).then(|| {
                let free = m.free;
                format!(
                    "rank {} refuses: {} MiB free, the plan needs {} MiB + {} MiB margin",
                    s.rank,
                    free >> 20,
                    need >> 20,
                    cfg.memory_margin >> 20
                )
            }),
        },
        None => None,
    };

    // 3. Agreement, group by group, before any device work: where each plan comes from,
    //    then the plan itself.
    let agreed = match choose(s, plans, choices, report, deadline).await {
        Ok(()) => agree(s, plans, refusal.as_deref(), deadline).await,
        Err(e) => Err(e),
    };

    // 4. Execution under a watchdog that aborts everything at the deadline.
    let exec = match agreed {
        Err(e) => Err(e),
        Ok(()) => {
            let stop = Arc::new(AtomicBool::new(false));
            let watchdog = {
                let (stop, comms) = (stop.clone(), comms.to_vec());
                std::thread::Builder::new()
                    .name("anyccl-warmup-watchdog".into())
                    .spawn(move || {
                        // A grace second lets every wait report Timeout itself; the watchdog
                        // is for calls that block inside the backend (a first connect).
                        while !stop.load(Ordering::Acquire) {
                            if Instant::now() >= deadline + Duration::from_secs(1) {
                                tracing::error!("warmup deadline passed: aborting its communicators");
                                abort_all(&comms);
                                return;
                            }
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    })
                    .ok()
            };
            let r = execute(s, plans, report, deadline).await;
            stop.store(true, Ordering::Release);
            if let Some(w) = watchdog {
                let _ = w.join();
            }
            r
        }
    };
    if let Err(e) = &exec {
        let v = Failure { kind: e.kind().into(), who: format!("rank {}: {e}", s.rank) };
        let _ = s.store.compare_set(&s.key("failed"), None, &encode(&v)).await;
        // This rank's failure fails the warmup everywhere, so its communicators go now: peers
        // blocked inside a first connect to this rank see the connections close and return,
        // instead of waiting for their own deadline.
        abort_all(comms);
    }

    // 5. Outcome: all or nothing. Every rank publishes its outcome and reads everyone's;
    // the first verdict stored wins and every rank adopts it, so ranks whose deadlines fall
    // on either side of a slow rank's report still agree.
    let mine = match &exec {
        Ok(()) => Outcome::Ok,
        Err(e) => Outcome::Failed(e.to_string()),
    };
    let published = s.store.set(&s.key(&format!("outcome/{}", s.rank)), &encode(&mine)).await;
    let mut failed = Vec::new();
    let mut missing = Vec::new();
    if let Err(e) = published {
        failed.push(format!("rank {} could not publish its outcome: {e}", s.rank));
    } else {
        let outcome_deadline = deadline.max(Instant::now()) + Duration::from_secs(2);
        for r in 0..s.world_size {
            let key = s.key(&format!("outcome/{r}"));
            match s.store.wait(&key, outcome_deadline).await.and_then(|v| decode::<Outcome>(&key, &v)) {
                Ok(Outcome::Ok) => {}
                Ok(Outcome::Failed(why) | Outcome::Timeout(why)) => failed.push(format!("rank {r} failed: {why}")),
                Err(_) => missing.push(r),
            }
        }
    }
    let local = if !failed.is_empty() {
        Outcome::Failed(failed.join("; "))
    } else if let Outcome::Failed(why) = &mine {
        Outcome::Failed(format!("rank {} failed: {why}", s.rank))
    } else if !missing.is_empty() {
        Outcome::Timeout(format!("ranks {missing:?} never reported"))
    } else {
        Outcome::Ok
    };
    let key = s.key("verdict");
    let verdict = match s.store.compare_set(&key, None, &encode(&local)).await {
        Ok(o) => o.current.and_then(|v| decode(&key, &v).ok()).unwrap_or(local),
        Err(_) => local,
    };
    let (timed_out, why) = match verdict {
        Outcome::Ok => return Ok(()),
        Outcome::Timeout(t) => (true, t),
        Outcome::Failed(why) => (false, why),
    };
    abort_all(comms);
    exec?;
    let group = format!("warmup {}", s.job);
    Err(if timed_out {
        Error::Timeout {
            op: "warmup outcome".into(),
            rank: s.rank,
            group,
            after: Duration::ZERO,
            detail: format!("{why}; communicators aborted"),
        }
    } else {
        Error::PeerFailed {
            rank: s.rank,
            group,
            peer: None,
            detail: format!("warmup failed: {why}; communicators aborted"),
        }
    })
}

/// Where group rank `r` publishes its plan: by the group's name and members, since two
/// groups may share a name (one "tp" per replica).
fn plan_key(s: &Session<'_>, comm: &Communicator, r: usize) -> String {
    let spec = comm.spec();
    s.key(&format!("plan/{}-{:016x}/{r}", spec.name, spec.id()))
}

async fn agree(
    s: &Session<'_>,
    plans: &mut [(&Communicator, GroupPlan)],
    refusal: Option<&str>,
    deadline: Instant,
) -> Result<()> {
    for (comm, plan) in plans.iter() {
        let me = comm.rank();
        let value = match refusal {
            Some(r) => PlanMsg::Refused(r.to_string()),
            None => PlanMsg::Plan(plan.clone()),
        };
        s.store.set(&plan_key(s, comm, me), &encode(&value)).await?;
    }
    if let Some(r) = refusal {
        return Err(err("warmup", s.rank, "", r.to_string()));
    }
    for (comm, plan) in plans.iter_mut() {
        let (me, n) = (comm.rank(), comm.size());
        let mut theirs: Vec<Option<GroupPlan>> = vec![None; n];
        let mut missing = Vec::new();
        let mut refused = Vec::new();
        for (r, slot) in theirs.iter_mut().enumerate() {
            let key = plan_key(s, comm, r);
            match s.store.wait(&key, deadline).await {
                Ok(v) => match decode(&key, &v)? {
                    PlanMsg::Refused(why) => refused.push(why),
                    PlanMsg::Plan(p) => *slot = Some(p),
                },
                Err(Error::Timeout { .. }) => missing.push(r),
                Err(e) => return Err(e),
            }
        }
        if !refused.is_empty() {
            return Err(err("warmup", me, &plan.group, format!("group members refused: {}", refused.join("; "))));
        }
        if !missing.is_empty() {
            return Err(Error::Timeout {
                op: "warmup agreement".into(),
                rank: me,
                group: plan.group.clone(),
                after: Duration::ZERO,
                detail: format!("group ranks {missing:?} never published their plan"),
            });
        }
        let all: Vec<GroupPlan> = theirs.into_iter().flatten().collect();
        if plan.merge {
            if let Some(m) = merge(&all) {
                *plan = m;
            }
        } else {
            let differ: Vec<usize> = all.iter().enumerate().filter(|(_, p)| *p != plan).map(|(r, _)| r).collect();
            if !differ.is_empty() {
                let fp = plan.fingerprint();
                return Err(err(
                    "warmup",
                    me,
                    &plan.group,
                    format!("the plan of group ranks {differ:?} differs from this rank's (fingerprint {})", &fp[..12]),
                ));
            }
        }
    }
    Ok(())
}

/// Wait for `w` in short slices, giving up when another rank reports failure or the
/// deadline passes. Giving up aborts `comm` before the unfinished operation is dropped: its
/// kernels may wait forever on the failed peer, and the warmup fails as a whole anyway.
async fn settle(
    s: &Session<'_>,
    comm: &Communicator,
    w: Work<'_>,
    what: &str,
    group: &str,
    rank: usize,
    deadline: Instant,
) -> Result<()> {
    let mut w = w;
    let r = wait_slices(s, &mut w, what, group, rank, deadline).await;
    if r.is_err() && !matches!(w.is_completed(), Ok(true)) {
        let _ = comm.abort().await;
    }
    drop(w);
    r
}

async fn wait_slices(
    s: &Session<'_>,
    w: &mut Work<'_>,
    what: &str,
    group: &str,
    rank: usize,
    deadline: Instant,
) -> Result<()> {
    // Short slices first (most steps finish in microseconds once connected), longer ones
    // while a first connect takes seconds, so the store is not asked 50 times a second.
    let mut slice = Duration::from_millis(20);
    loop {
        let wait = slice.min(deadline.saturating_duration_since(Instant::now())).max(Duration::from_millis(1));
        // Any other error, also one after the deadline, goes to `execute`, which reports an
        // error past the deadline as the Timeout it is.
        match w.wait_async(wait).await {
            Ok(()) => return Ok(()),
            Err(Error::Timeout { .. }) => {}
            Err(e) => return Err(e),
        }
        slice = (slice * 2).min(Duration::from_millis(250));
        if Instant::now() >= deadline {
            return Err(warmup_timeout(what, rank, group, "the warmup deadline passed; communicators aborted".into()));
        }
        let key = s.key("failed");
        if let Some(f) = s.store.get(&key).await? {
            let Failure { kind, who } = decode(&key, &f)?;
            let detail = format!("warmup failed on {who}");
            // A rank that timed out means the warmup as a whole ran out of time.
            if kind == "Timeout" {
                return Err(warmup_timeout(what, rank, group, detail));
            }
            return Err(Error::PeerFailed { rank, group: group.into(), peer: None, detail });
        }
    }
}

fn warmup_timeout(what: &str, rank: usize, group: &str, detail: String) -> Error {
    Error::Timeout { op: format!("warmup {what}"), rank, group: group.into(), after: Duration::ZERO, detail }
}

fn op_name(k: Kind) -> &'static str {
    match k {
        Kind::AllReduce => "all_reduce",
        Kind::ReduceScatter => "reduce_scatter",
        Kind::AllGather => "all_gather",
        Kind::Broadcast => "broadcast",
        Kind::AllToAll => "all_to_all",
        Kind::SendRecv => "send/recv",
        Kind::SendRecvBatched => "send/recv batched",
    }
}

async fn execute(
    s: &Session<'_>,
    plans: &[(&Communicator, GroupPlan)],
    report: &mut Report,
    deadline: Instant,
) -> Result<()> {
    for (comm, plan) in plans {
        for step in &plan.steps {
            let held_before = comm.memory_held();
            let before = s.platform.mem_info()?.free as i64;
            let t = Instant::now();
            match run_step(s, comm, plan, step, deadline).await {
                Ok(()) => {}
                // Past the deadline an error is the deadline's doing (a wait cut short, or a
                // call blocked inside the backend that the watchdog's abort ended), not a
                // failure of its own.
                Err(e) if Instant::now() >= deadline && !matches!(e, Error::Timeout { .. }) => {
                    let detail = format!("the warmup deadline passed; communicators aborted ({e})");
                    return Err(warmup_timeout(op_name(step.kind), comm.rank(), &plan.group, detail));
                }
                Err(e) => return Err(e),
            }
            let time_us = t.elapsed().as_secs_f64() * 1e6;
            let after = s.platform.mem_info()?.free as i64;
            // The communicator's own count when it keeps one: free memory also moves with
            // whatever else the process (or another on the device) allocates meanwhile.
            let (mem_delta, mem_source) = match (held_before, comm.memory_held()) {
                (Some(b), Some(a)) => (a as i64 - b as i64, MemSource::Communicator),
                _ => (before - after, MemSource::FreeMemory),
            };
            report.steps.push(StepReport {
                group: plan.group.clone(),
                role: plan.role.to_string(),
                op: op_name(step.kind).into(),
                bytes: step.count * step.dtype.size(),
                time_us,
                mem_delta,
                mem_source,
            });
        }
    }
    Ok(())
}

async fn run_step(
    s: &Session<'_>,
    comm: &Communicator,
    plan: &GroupPlan,
    step: &Step,
    deadline: Instant,
) -> Result<()> {
    let (n, me, p) = (comm.size(), comm.rank(), s.platform);
    let (g, c, d) = (plan.group.as_str(), step.count, step.dtype);
    let what = op_name(step.kind);
    match step.kind {
        Kind::AllReduce => {
            let mut b = p.alloc(d, c)?;
            settle(s, comm, comm.all_reduce(None, b.view_mut(), ReduceOp::Sum)?, what, g, me, deadline).await?;
        }
        Kind::Broadcast => {
            let mut b = p.alloc(d, c)?;
            settle(s, comm, comm.broadcast(None, b.view_mut(), 0)?, what, g, me, deadline).await?;
        }
        Kind::ReduceScatter => {
            let src = p.alloc(d, c * n)?;
            let mut dst = p.alloc(d, c)?;
            settle(
                s,
                comm,
                comm.reduce_scatter(Some(src.view()), dst.view_mut(), ReduceOp::Sum)?,
                what,
                g,
                me,
                deadline,
            )
            .await?;
        }
        Kind::AllGather => {
            let src = p.alloc(d, c)?;
            let mut dst = p.alloc(d, c * n)?;
            settle(s, comm, comm.all_gather(Some(src.view()), dst.view_mut())?, what, g, me, deadline).await?;
        }
        Kind::AllToAll => {
            let src = p.alloc(d, c)?;
            let mut dst = p.alloc(d, c)?;
            settle(s, comm, comm.all_to_all(src.view(), dst.view_mut(), None)?, what, g, me, deadline).await?;
        }
        Kind::SendRecv | Kind::SendRecvBatched => {
            let src = p.alloc(d, c)?;
            let mut dst = p.alloc(d, c)?;
            // Pairs run in the plan's (sorted) order on every member: a global order on
            // pairs, so no cycle of waits can form. In a pair the lower rank sends first.
            for &(a, b) in step.pairs.iter().filter(|(a, b)| *a == me || *b == me) {
                let other = if a == me { b } else { a };
                if step.kind == Kind::SendRecvBatched {
                    let ops = vec![P2POp::Send(src.view(), other), P2POp::Recv(dst.view_mut(), other)];
                    settle(s, comm, comm.p2p_group(ops)?, what, g, me, deadline).await?;
                } else if me == a {
                    settle(s, comm, comm.send(src.view(), other)?, what, g, me, deadline).await?;
                    settle(s, comm, comm.recv(dst.view_mut(), other)?, what, g, me, deadline).await?;
                } else {
                    settle(s, comm, comm.recv(dst.view_mut(), other)?, what, g, me, deadline).await?;
                    settle(s, comm, comm.send(src.view(), other)?, what, g, me, deadline).await?;
                }
            }
        }
    }
    p.synchronize()?;
    Ok(())
}
