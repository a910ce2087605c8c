//! An engine's train-step groups given back between phases and taken again
//! ([`sleep_groups`], [`wake_groups`]), with the warmup's rules: groups are chosen by owner
//! and role as the warmup chooses them (a cross-engine group, whose other members are
//! another engine's, is never touched), in name order, so every member decides the same;
//! a group sleeps or wakes on all its members or on none (`Communicator::sleep` and `wake`
//! meet the members first); the wake warms what it rebuilt in the session's generation, so
//! a retried wake replays the warmup's outcome instead of entering a collective alone, and
//! a group already awake (or asleep) is not touched again. The report gives, per group, the
//! device memory held before and after and how long each part took.

use crate::outcome::{outcome, trim_generations, Outcome};
use crate::plan::exclusion;
use crate::run::{warmup, warmup_plans};
use crate::session::{comm_ctx, ctx, Session};
use crate::{GroupPlan, Report, Target, WarmupConfig};
use anyccl_core::{Backend, Communicator, Result};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::time::Instant;

/// One group's sleep or wake.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseGroup {
    /// Group name.
    pub group: String,
    /// Device memory the group's communicator held before, as its library counts it (where
    /// it can: `ncclCommMemStats`), in bytes.
    pub held_before: Option<u64>,
    /// Device memory in use before minus after, bytes: what the sleep gave back (negative
    /// for a wake: what it took), from the device's free memory (anything else the process
    /// did meanwhile shows too).
    pub freed: i64,
    /// Time of the sleep or the wake (without the warmup), milliseconds.
    pub ms: f64,
}

/// What [`sleep_groups`] or [`wake_groups`] did on this rank.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseReport {
    /// Whether this was a wake (the table then shows what each group took).
    #[serde(default)]
    pub wake: bool,
    /// Groups slept or woken, in the order done.
    pub groups: Vec<PhaseGroup>,
    /// Groups left as they were, and why (cross-engine, one rank, asleep or awake already).
    pub untouched: Vec<(String, String)>,
    /// The warmup after a wake (`None` after a sleep, or when nothing woke).
    pub warmup: Option<Report>,
    /// Time of the warmup, milliseconds (the re-warming part of a wake).
    pub warm_ms: f64,
}

impl PhaseReport {
    /// Bytes given back in all (negative: taken).
    pub fn freed(&self) -> i64 {
        self.groups.iter().map(|g| g.freed).sum()
    }

    /// A table for people: one row per group, then what was left alone. A sleep's shows the
    /// memory each group gave back, a wake's the memory each took; `what` names the total.
    pub fn table(&self, what: &str) -> String {
        let mib = |b: i64| b as f64 / (1 << 20) as f64;
        // What a wake took is what it freed, negated; `+ 0.0`: no "-0.0".
        let shown = |b: i64| if self.wake { -mib(b) + 0.0 } else { mib(b) + 0.0 };
        let col = if self.wake { "taken MiB" } else { "freed MiB" };
        let mut out = format!("  {:<16} {:>14} {:>12} {:>10}\n", "group", "library MiB", col, "ms");
        for g in &self.groups {
            let held = g.held_before.map_or("-".to_string(), |b| format!("{:.1}", mib(b as i64)));
            let _ = writeln!(out, "  {:<16} {held:>14} {:>12.1} {:>10.1}", g.group, shown(g.freed), g.ms);
        }
        let _ = writeln!(out, "  {what}: {:.1} MiB in all", shown(self.freed()));
        if self.warmup.is_some() {
            let _ = writeln!(out, "  warmed again in {:.1} ms", self.warm_ms);
        }
        for (g, why) in &self.untouched {
            let _ = writeln!(out, "  untouched: {g} ({why})");
        }
        out
    }
}

/// Device memory in use on this rank's device, bytes (0 where it cannot be read).
fn in_use(s: &Session<'_>) -> i64 {
    s.platform.mem_info().map(|m| m.total.saturating_sub(m.free) as i64).unwrap_or(0)
}

/// Which of `groups` a phase touches: not cross-engine, more than one rank, and `want`
/// (asleep or awake) not yet; by name, so every member takes them in the same order.
fn chosen<'c, 'g>(
    groups: &'g mut [&'c mut Communicator],
    asleep_now: bool,
    report: &mut PhaseReport,
) -> Vec<&'g mut &'c mut Communicator> {
    let mut out = Vec::new();
    for g in groups.iter_mut() {
        let why = match exclusion(g, false) {
            Some(why) => Some(why.to_string()),
            None if g.is_asleep() != asleep_now => {
                Some(if asleep_now { "awake already" } else { "asleep already" }.to_string())
            }
            None => None,
        };
        match why {
            Some(why) => report.untouched.push((g.spec().name.clone(), why)),
            None => out.push(g),
        }
    }
    out.sort_by(|a, b| a.spec().name.cmp(&b.spec().name));
    out
}

/// Put an engine's train-step groups to sleep (see the module): every member of each calls
/// it with its own communicators of the same groups.
///
/// # Errors
/// The first group's sleep that failed ([`Communicator::sleep`]: the same on all its members),
/// naming the groups asleep by then; those before it stay asleep, and a retry skips them.
pub async fn sleep_groups(s: &Session<'_>, groups: &mut [&mut Communicator]) -> Result<PhaseReport> {
    let mut report = PhaseReport::default();
    let todo = chosen(groups, false, &mut report);
    let mut done: Vec<String> = Vec::new();
    for g in todo {
        let (held_before, before, t) = (g.memory_held(), in_use(s), Instant::now());
        if let Err(e) = g.sleep().await {
            let asleep = if done.is_empty() { "none".to_string() } else { done.join(", ") };
            tracing::warn!("{}: sleep failed ({e}); asleep before it: {asleep}", g.spec().name);
            return Err(e);
        }
        let ms = t.elapsed().as_secs_f64() * 1e3;
        done.push(g.spec().name.clone());
        report.groups.push(PhaseGroup { group: g.spec().name.clone(), held_before, freed: before - in_use(s), ms });
    }
    Ok(report)
}

/// Wake an engine's groups that [`sleep_groups`] put to sleep, through `backend`, and warm
/// them in the session's generation: from `plans` (one per group, by name: a recorded step)
/// where given, else from their roles. Every rank of the session calls it.
///
/// All or nothing: each group wakes on all its members or on none ([`Communicator::wake`]),
/// and then every rank of the session learns whether every wake succeeded (a rank outside
/// the group that failed would not know otherwise); should one have failed anywhere, or the
/// warmup after, every rank puts the groups it woke in this call back to sleep
/// ([`Communicator::sleep_agreed`]) and returns an error. A group's failed wake does not stop
/// the others' (their members would wait for this rank until the connect timeout).
///
/// # Errors
/// This rank's first failed wake; `PeerFailed` naming the ranks whose wake failed, or a
/// `Timeout` naming those that never came; the warmup's (the same on every rank). The
/// groups are then asleep on every member. A retry takes a new generation (the same
/// generation replays the failure).
pub async fn wake_groups(
    s: &Session<'_>,
    groups: &mut [&mut Communicator],
    backend: &dyn Backend,
    plans: Option<&[GroupPlan]>,
    cfg: &WarmupConfig,
) -> Result<PhaseReport> {
    let (begun, mut report) = (Instant::now(), PhaseReport { wake: true, ..PhaseReport::default() });
    let mut woke = Vec::new();
    let mut failed = None;
    for g in chosen(groups, true, &mut report) {
        let (before, t) = (in_use(s), Instant::now());
        if let Err(e) = g.wake(backend).await {
            tracing::warn!("{}: wake failed ({e})", g.spec().name);
            failed.get_or_insert(e);
            continue;
        }
        let ms = t.elapsed().as_secs_f64() * 1e3;
        report.groups.push(PhaseGroup {
            group: g.spec().name.clone(),
            held_before: None,
            freed: before - in_use(s),
            ms,
        });
        woke.push(g.spec().name.clone());
    }
    let phase_job = format!("{}/wake", s.job);
    let phase = Session { job: &phase_job, ..*s };
    let exec = failed.map_or(Ok(()), Err);
    let verdict = outcome(&phase, &exec, anyccl_core::deadline_in(cfg.timeout)).await;
    trim_generations(&phase).await;
    let failure = match verdict {
        Outcome::Ok => None,
        Outcome::Timeout(why) => Some((why, true)),
        Outcome::Failed(why) => Some((why, false)),
    };
    if let Some((why, timed_out)) = failure {
        asleep_again(groups, &woke).await;
        exec?;
        let cx = ctx(s.rank, &format!("wake {}", s.job));
        let msg = format!("{why}; the groups this rank woke are asleep again");
        return Err(if timed_out {
            cx.timeout("wake outcome", begun.elapsed(), msg)
        } else {
            cx.peer_failed(None, msg)
        });
    }
    if woke.is_empty() {
        return Ok(report);
    }
    let t = Instant::now();
    let warmed = warm(s, groups, &woke, plans, cfg).await;
    report.warm_ms = t.elapsed().as_secs_f64() * 1e3;
    match warmed {
        Ok(w) => report.warmup = Some(w),
        Err(e) => {
            asleep_again(groups, &woke).await;
            return Err(e);
        }
    }
    Ok(report)
}

/// Put the groups named `woke` back to sleep on this rank, every rank having learnt that the
/// phase failed.
async fn asleep_again(groups: &mut [&mut Communicator], woke: &[String]) {
    for g in groups.iter_mut().filter(|g| woke.contains(&g.spec().name)) {
        g.sleep_agreed().await;
    }
}

/// Warm the groups named `woke`, from `plans` where given.
async fn warm(
    s: &Session<'_>,
    groups: &[&mut Communicator],
    woke: &[String],
    plans: Option<&[GroupPlan]>,
    cfg: &WarmupConfig,
) -> Result<Report> {
    let awake: Vec<&Communicator> = groups.iter().map(|g| &**g).filter(|g| woke.contains(&g.spec().name)).collect();
    match plans {
        Some(plans) => {
            let mut pairs = Vec::new();
            for c in &awake {
                let name = &c.spec().name;
                let p = plans.iter().find(|p| &p.group == name).ok_or_else(|| {
                    comm_ctx(c).invalid("wake_groups", "plans", format!("no plan for group '{name}' among those given"))
                })?;
                pairs.push((*c, p.clone()));
            }
            warmup_plans(s, pairs, cfg).await
        }
        None => {
            let targets: Vec<Target<'_>> = awake.iter().map(|c| Target::new(c)).collect();
            warmup(s, &targets, cfg).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(wake: bool, freed: i64) -> PhaseReport {
        let g = PhaseGroup { group: "dp".into(), held_before: None, freed, ms: 1.0 };
        PhaseReport { wake, groups: vec![g], ..PhaseReport::default() }
    }

    #[test]
    fn a_sleep_shows_what_it_gave_back_and_a_wake_what_it_took() {
        let slept = report(false, 64 << 20).table("given back");
        assert!(slept.contains("freed MiB") && slept.contains("given back: 64.0 MiB in all"), "{slept}");
        let woke = report(true, -(64 << 20)).table("taken by the wake");
        assert!(woke.contains("taken MiB") && woke.contains("taken by the wake: 64.0 MiB in all"), "{woke}");
        assert!(!woke.contains("-64.0"), "{woke}");
    }
}
