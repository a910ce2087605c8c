//! Running a warmup: claim the generation, check memory, agree on the plan, run it under a
//! deadline, then agree on the outcome: all ranks succeed or all fail.

use crate::agree::agree;
use crate::config::WarmupConfig;
use crate::execute::execute;
use crate::outcome::{outcome, publish_failure, trim_generations, Outcome};
use crate::plan::{exclusion, plan_for, GroupPlan, Target};
use crate::report::Report;
use crate::session::{ctx, decode, encode, timed, waited, Session};
use crate::source::{choose, Choice};
use crate::watchdog;
use anyccl_core::{Collective, Communicator, Result};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `final/<rank>`: the outcome of a generation on one rank, replayed by a repeated call.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Final {
    Ok(Report),
    Err { kind: String, msg: String },
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
///     let session = Session { store, job: "trainer", generation: restarts, rank, world_size, members: None, platform };
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
    s.check()?;
    let deadline = anyccl_core::deadline_in(cfg.timeout);

    // 1. One run per (job, generation, rank): a retried call replays the outcome.
    let final_key = s.key(&format!("final/{}", s.rank));
    if let Some(f) = s.store.get(&final_key).await? {
        return replay(s, &final_key, &f);
    }
    let claim = s.store.compare_set(&s.key(&format!("claim/{}", s.rank)), None, b"running").await?;
    if !claim.swapped {
        tracing::warn!(
            "warmup generation {} already running or done on rank {}: waiting for its outcome",
            s.generation,
            s.rank
        );
        let f = s.store.wait(&final_key, deadline).await?;
        return replay(s, &final_key, &f);
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

/// The outcome `f` (under `key`) that an earlier call of this generation recorded.
fn replay(s: &Session<'_>, key: &str, f: &[u8]) -> Result<Report> {
    match decode::<Final>(key, f)? {
        Final::Ok(mut r) => {
            r.replayed = true;
            Ok(r)
        }
        Final::Err { kind, msg } => {
            Err(ctx(s.rank, &job_group(s)).aborted(format!("this warmup generation already failed ({kind}): {msg}")))
        }
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
    trim_generations(s).await;
    let (timed_out, why) = match verdict {
        Outcome::Ok => return Ok(()),
        Outcome::Timeout(t) => (true, t),
        Outcome::Failed(why) => (false, why),
    };
    abort_all(comms);
    exec?;
    let cx = ctx(s.rank, &job_group(s));
    Err(if timed_out {
        cx.timeout("warmup outcome", waited(), format!("{why}; communicators aborted"))
    } else {
        cx.peer_failed(None, format!("warmup failed: {why}; communicators aborted"))
    })
}

/// The name errors give the whole warmup of a job (its groups' own errors name the group).
fn job_group(s: &Session<'_>) -> String {
    format!("warmup {}", s.job)
}
