//! Where each group's plan comes from: a saved plan when every member of the group has one,
//! else the role plan for all of them, agreed through the group's leader.

use crate::gather;
use crate::plan::GroupPlan;
use crate::report::Report;
use crate::session::{ctx, waited, Session};
use anyccl_core::{Communicator, Result};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Where a group's plan comes from.
pub(crate) enum Choice {
    /// The plan given (its source described).
    Fixed(String),
    /// A saved plan with its description, or why this rank has none; the members agree.
    Saved(std::result::Result<(GroupPlan, String), String>),
}

/// `source/<group>/<rank>`: whether a member has a saved plan for the group (its
/// fingerprint, or why not).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum SourceMsg {
    Saved(String),
    None(String),
}

/// Settle where each group's plan comes from, each group through its leader
/// ([`gather`]). A saved plan is used only when every member of the group has one;
/// otherwise every member takes the role plan, and the report says which rank lacked it
/// and why. Store only: no device work.
pub(crate) async fn choose(
    s: &Session<'_>,
    plans: &mut [(&Communicator, GroupPlan)],
    choices: Vec<Choice>,
    report: &mut Report,
    deadline: Instant,
) -> Result<()> {
    let mut pending = Vec::new();
    for ((comm, plan), choice) in plans.iter_mut().zip(choices) {
        match choice {
            Choice::Fixed(why) => report.sources.push((plan.group.clone(), why)),
            Choice::Saved(found) => {
                let msg = match &found {
                    Ok((p, _)) => SourceMsg::Saved(p.fingerprint()),
                    Err(why) => SourceMsg::None(why.clone()),
                };
                gather::publish(s, "source", comm, &msg).await?;
                pending.push((comm, plan, found));
            }
        }
    }
    for (comm, _, _) in &pending {
        gather::lead(s, "source", comm, deadline, |all: Vec<Option<SourceMsg>>| {
            let missing = gather::missing(&all);
            if !missing.is_empty() {
                return Err(missing);
            }
            Ok(all
                .into_iter()
                .enumerate()
                .filter_map(|(r, m)| match m {
                    Some(SourceMsg::None(why)) => Some(format!("group rank {r}: {why}")),
                    _ => None,
                })
                .collect::<Vec<String>>())
        })
        .await?;
    }
    for (comm, plan, found) in pending {
        let verdict: std::result::Result<Vec<String>, Vec<usize>> =
            gather::verdict(s, "source", comm, "warmup agreement", deadline).await?;
        let lacking = verdict.map_err(|missing| {
            ctx(comm.rank(), &plan.group).timeout(
                "warmup agreement",
                waited(),
                format!("group ranks {missing:?} never said whether they have a saved plan"),
            )
        })?;
        match found {
            Ok((saved, what)) if lacking.is_empty() => {
                *plan = saved;
                report.sources.push((plan.group.clone(), what));
            }
            _ => {
                let why =
                    format!("role plan ({}), since no saved plan on every member: {}", plan.role, lacking.join("; "));
                tracing::warn!("warmup of group '{}': {why}", plan.group);
                report.sources.push((plan.group.clone(), why));
            }
        }
    }
    Ok(())
}
