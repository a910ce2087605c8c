//! Agreement on every group's plan before any device work: each member publishes its plan
//! (or why it refuses), the group's leader decides, every member adopts the verdict.

use crate::gather;
use crate::plan::{merge, GroupPlan};
use crate::session::{ctx, waited, Session};
use anyccl_core::{Communicator, Result};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// `plan/<group>/<rank>`: a member's plan of the group, or why it refuses to run any.
#[derive(Debug, Serialize, Deserialize)]
enum PlanMsg {
    Plan(GroupPlan),
    Refused(String),
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
pub(crate) async fn agree(
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
        return Err(ctx(s.rank, "").invalid("warmup", "plan", r));
    }
    for (comm, plan) in plans.iter_mut() {
        let cx = ctx(comm.rank(), &plan.group);
        match gather::verdict::<PlanVerdict>(s, "plan", comm, "warmup agreement", deadline).await? {
            PlanVerdict::Agreed(p) => *plan = p,
            PlanVerdict::Refused(why) => {
                return Err(cx.invalid("warmup", "plan", format!("group members refused: {}", why.join("; "))))
            }
            PlanVerdict::Missing(missing) => {
                return Err(cx.timeout(
                    "warmup agreement",
                    waited(),
                    format!("group ranks {missing:?} never published their plan"),
                ))
            }
            PlanVerdict::Differ(differ, fp) => {
                return Err(cx.invalid(
                    "warmup",
                    "plan",
                    format!(
                        "the plan of group ranks {differ:?} differs from the plan of group rank 0 (fingerprint {}; \
                         this rank's {})",
                        &fp[..fp.len().min(12)],
                        &plan.fingerprint()[..12]
                    ),
                ))
            }
        }
    }
    Ok(())
}
