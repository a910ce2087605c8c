//! Running a warmup: claim the generation, check memory, agree on the plan, run it under a
//! deadline, then agree on the outcome: all ranks succeed or all fail.

use crate::gather;
use crate::plan::{exclusion, merge, plan_for, GroupPlan, Kind, Sizes, Step, Target};
use crate::report::{MemSource, Report, StepReport};
use crate::saved::{choose, Choice};
use crate::watchdog;
use anyccl_core::{Collective, Communicator, Error, P2POp, Platform, ReduceOp, Result, Store, Work};
use serde::{Deserialize, Serialize};
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
    let result = timed(run_claimed(s, &mut plans, choices, cfg, &mut report, deadline, &comms)).await;
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

    // 4. Execution under the process's watchdog, which aborts everything at the deadline.
    let exec = match agreed {
        Err(e) => Err(e),
        Ok(()) => {
            let _watched = watchdog::register(deadline, comms);
            execute(s, plans, report, deadline).await
        }
    };
    if let Err(e) = &exec {
        publish_failure(s, e).await;
        // This rank's failure fails the warmup everywhere, so its communicators go now: peers
        // blocked inside a first connect to this rank see the connections close and return,
        // instead of waiting for their own deadline.
        abort_all(comms);
    }

    // 5. Outcome: all or nothing, decided once for the generation under `verdict` (the
    // first verdict stored wins and every rank adopts it). A failing rank stores a failure
    // at once; rank 0 tallies every rank's report and stores success, or names the ranks
    // that never reported by the deadline.
    let verdict = outcome(s, &exec, deadline).await;
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
            after: waited(),
            detail: format!("{why}; communicators aborted"),
            source: None,
        }
    } else {
        Error::PeerFailed {
            rank: s.rank,
            group,
            peer: None,
            detail: format!("warmup failed: {why}; communicators aborted"),
            source: None,
        }
    })
}

/// This rank's part of the outcome (see step 5 of `run_claimed`): the generation's verdict.
/// Each rank reports (one request) and waits for the verdict (one); rank 0 tallies the
/// reports in one multi-key wait, unless a failure stored the verdict first. Should rank 0
/// never decide (dead or stopped), one rank claims the naming at the deadline and stores
/// which ranks never reported.
async fn outcome(s: &Session<'_>, exec: &Result<()>, deadline: Instant) -> Outcome {
    let key = s.key("verdict");
    let key = key.as_str();
    let read = |v: Vec<u8>| decode(key, &v).unwrap_or_else(|e| Outcome::Failed(e.to_string()));
    let cas = |v: Outcome| async move {
        match s.store.compare_set(key, None, &encode(&v)).await {
            Ok(o) => o.current.and_then(|c| decode(key, &c).ok()).unwrap_or(v),
            Err(_) => v,
        }
    };
    let mine = match exec {
        Ok(()) => Outcome::Ok,
        Err(e) => Outcome::Failed(format!("rank {} failed: {e}", s.rank)),
    };
    let reported = s.store.set(&s.key(&format!("outcome/{}", s.rank)), &encode(&mine)).await;
    if let Outcome::Failed(_) = &mine {
        // No need to hear from anyone else: the generation has failed.
        return cas(mine).await;
    }
    if let Err(e) = reported {
        return cas(Outcome::Failed(format!("rank {} could not report its outcome: {e}", s.rank))).await;
    }
    // Every rank's report key: read by rank 0, or by the namer, only.
    let reports = || (0..s.world_size).map(|r| s.key(&format!("outcome/{r}"))).collect::<Vec<String>>();
    let outcome_deadline = deadline.max(Instant::now()) + Duration::from_secs(1);
    if s.rank == 0 {
        let keys = reports();
        tokio::select! {
            Ok(v) = s.store.wait(key, outcome_deadline) => return read(v),
            all = s.store.wait_many(&keys, outcome_deadline) => if let Ok(all) = all {
                return cas(tally(&keys, &all)).await;
            },
        }
    }
    let grace = Duration::from_secs(1);
    if let Ok(v) = s.store.wait(key, outcome_deadline + grace).await {
        return read(v);
    }
    // No verdict: rank 0 never decided. One rank names the ranks that never reported.
    let namer = s.store.compare_set(&s.key("outcome/namer"), None, s.rank.to_string().as_bytes()).await;
    if namer.is_ok_and(|n| n.swapped) {
        let keys = reports();
        let local = match s.store.wait_many(&keys, Instant::now()).await {
            Ok(all) => tally(&keys, &all),
            Err(e) => Outcome::Timeout(format!("rank 0 decided nothing and the reports cannot be read ({e})")),
        };
        return cas(local).await;
    }
    match s.store.wait(key, Instant::now() + grace).await {
        Ok(v) => read(v),
        Err(_) => cas(Outcome::Timeout("ranks never reported (and no rank named them in time)".into())).await,
    }
}

/// The verdict the reports `all` (of `keys`, one per rank) give.
fn tally(keys: &[String], all: &[Option<Vec<u8>>]) -> Outcome {
    let mut silent = Vec::new();
    let mut failed = Vec::new();
    for (r, v) in all.iter().enumerate() {
        match v.as_deref().map(|v| decode::<Outcome>(&keys[r], v)) {
            None | Some(Err(_)) => silent.push(r),
            Some(Ok(Outcome::Ok)) => {}
            Some(Ok(Outcome::Failed(why) | Outcome::Timeout(why))) => failed.push(why),
        }
    }
    if !failed.is_empty() {
        Outcome::Failed(failed.join("; "))
    } else if silent.is_empty() {
        Outcome::Ok
    } else {
        Outcome::Timeout(format!("ranks {} never reported", ranks_text(&silent)))
    }
}

/// Ranks as a list, shortened past 32 of them.
fn ranks_text(r: &[usize]) -> String {
    if r.len() <= 32 {
        format!("{r:?}")
    } else {
        format!("{:?} and {} more", &r[..32], r.len() - 32)
    }
}

/// The leader's verdict on a group's plans.
#[derive(Debug, Serialize, Deserialize)]
enum PlanVerdict {
    /// Every member's plan, merged or (all equal) as the leader's.
    Agreed(GroupPlan),
    /// Members refused (their reasons).
    Refused(Vec<String>),
    /// Group ranks that published no plan in time.
    Missing(Vec<usize>),
    /// Group ranks whose plan differs from the leader's, and the leader's fingerprint.
    Differ(Vec<usize>, String),
}

fn decide_plans(theirs: Vec<Option<PlanMsg>>) -> PlanVerdict {
    let missing = gather::missing(&theirs);
    if !missing.is_empty() {
        return PlanVerdict::Missing(missing);
    }
    let mut refused = Vec::new();
    let mut plans = Vec::new();
    for m in theirs.into_iter().flatten() {
        match m {
            PlanMsg::Refused(why) => refused.push(why),
            PlanMsg::Plan(p) => plans.push(p),
        }
    }
    if !refused.is_empty() {
        return PlanVerdict::Refused(refused);
    }
    let Some(first) = plans.first() else { return PlanVerdict::Missing(Vec::new()) };
    if first.merge {
        return PlanVerdict::Agreed(merge(&plans).unwrap_or_else(|| first.clone()));
    }
    let differ: Vec<usize> = plans.iter().enumerate().filter(|(_, p)| *p != first).map(|(r, _)| r).collect();
    if differ.is_empty() {
        PlanVerdict::Agreed(first.clone())
    } else {
        PlanVerdict::Differ(differ, first.fingerprint())
    }
}

/// Agree on every group's plan (each group through its leader, [`gather`]) before any device
/// work: plans that differ, a member's refusal or a member that never publishes fail the
/// group on every member.
async fn agree(
    s: &Session<'_>,
    plans: &mut [(&Communicator, GroupPlan)],
    refusal: Option<&str>,
    deadline: Instant,
) -> Result<()> {
    for (comm, plan) in plans.iter() {
        let value = match refusal {
            Some(r) => PlanMsg::Refused(r.to_string()),
            None => PlanMsg::Plan(plan.clone()),
        };
        gather::publish(s, "plan", comm, &value).await?;
    }
    // A refusing rank still leads its groups, so their members learn of the refusal now
    // rather than at the deadline.
    for (comm, _) in plans.iter() {
        gather::lead(s, "plan", comm, deadline, decide_plans).await?;
    }
    if let Some(r) = refusal {
        return Err(err("warmup", s.rank, "", r.to_string()));
    }
    for (comm, plan) in plans.iter_mut() {
        let me = comm.rank();
        match gather::verdict::<PlanVerdict>(s, "plan", comm, "warmup agreement", deadline).await? {
            PlanVerdict::Agreed(p) => *plan = p,
            PlanVerdict::Refused(why) => {
                return Err(err("warmup", me, &plan.group, format!("group members refused: {}", why.join("; "))))
            }
            PlanVerdict::Missing(missing) => {
                return Err(Error::Timeout {
                    op: "warmup agreement".into(),
                    rank: me,
                    group: plan.group.clone(),
                    after: waited(),
                    detail: format!("group ranks {missing:?} never published their plan"),
                    source: None,
                })
            }
            PlanVerdict::Differ(differ, fp) => {
                return Err(err(
                    "warmup",
                    me,
                    &plan.group,
                    format!(
                    "the plan of group ranks {differ:?} differs from the plan of group rank 0 (fingerprint {}; this \
                         rank's {})",
                    &fp[..fp.len().min(12)],
                    &plan.fingerprint()[..12]
                ),
                ))
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
    if let Err(e) = &r {
        if !matches!(w.is_completed(), Ok(true)) {
            // The failure is on record before the abort closes this rank's connections, so a
            // peer that sees them close reads why (a timeout here stays a timeout there).
            publish_failure(s, e).await;
            let _ = comm.abort().await;
        }
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
            // A peer that gave up (its deadline came first, or it failed) published why before
            // its abort closed the connections this wait saw fail: report that cause.
            Err(e) => return Err(failure_on_record(s, what, group, rank).await.ok().flatten().unwrap_or(e)),
        }
        slice = (slice * 2).min(Duration::from_millis(250));
        if Instant::now() >= deadline {
            return Err(warmup_timeout(what, rank, group, "the warmup deadline passed; communicators aborted".into()));
        }
        if let Some(e) = failure_on_record(s, what, group, rank).await? {
            return Err(e);
        }
    }
}

/// Record this rank's failure `e` for the generation, unless a failure is on record already
/// (the first one is the cause).
async fn publish_failure(s: &Session<'_>, e: &Error) {
    let v = Failure { kind: e.kind().into(), who: format!("rank {}: {e}", s.rank) };
    let _ = s.store.compare_set(&s.key("failed"), None, &encode(&v)).await;
}

/// The generation's recorded failure as this rank's error, if another rank published one.
async fn failure_on_record(s: &Session<'_>, what: &str, group: &str, rank: usize) -> Result<Option<Error>> {
    let key = s.key("failed");
    let Some(f) = s.store.get(&key).await? else { return Ok(None) };
    let Failure { kind, who } = decode(&key, &f)?;
    let detail = format!("warmup failed on {who}");
    // A rank that timed out means the warmup as a whole ran out of time.
    Ok(Some(if kind == "Timeout" {
        warmup_timeout(what, rank, group, detail)
    } else {
        Error::PeerFailed { rank, group: group.into(), peer: None, detail, source: None }
    }))
}

fn warmup_timeout(what: &str, rank: usize, group: &str, detail: String) -> Error {
    Error::Timeout { op: format!("warmup {what}"), rank, group: group.into(), after: waited(), detail, source: None }
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
