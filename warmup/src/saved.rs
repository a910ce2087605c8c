//! Warming from a saved plan ([`warmup_saved`]): the plan recorded with the checkpoint being
//! restored, group by group, and the role plan where a member has none.

use crate::config::WarmupConfig;
use crate::plan::Target;
use crate::plan_file::PlanFile;
use crate::report::Report;
use crate::run::{role_plans, run_plans};
use crate::session::Session;
use crate::source::Choice;
use anyccl_core::Result;

/// Warm `targets` from a saved plan (the one recorded with the checkpoint being restored,
/// [`PlanFile::load`]), group by group, and from their roles where there is none.
///
/// The members of each group first agree on where its plan comes from: the saved plan when
/// every member has one for the group, else the role plan, for all of them (a missing,
/// corrupt or foreign file on one rank never blocks recovery; the report names the file and
/// why). Members whose saved plans differ refuse before any device work, as agreement does
/// for every plan. The report says each group's source, and carries the saved file's cold
/// step cost, so its table gives the ratio of warmed to cold memory.
///
/// # Errors
/// As [`crate::warmup`].
pub async fn warmup_saved(
    s: &Session<'_>,
    targets: &[Target<'_>],
    saved: &std::result::Result<PlanFile, String>,
    cfg: &WarmupConfig,
) -> Result<Report> {
    let (plans, mut report) = role_plans(s, targets, cfg);
    if let Ok(f) = saved {
        report.cold_step = f.cold_step.clone();
    }
    let choices = plans
        .iter()
        .map(|(c, role)| {
            let spec = c.spec();
            let found = match saved {
                Err(why) => Err(why.clone()),
                Ok(f) => match f.plans.iter().find(|p| p.group == spec.name) {
                    None => Err(format!("warmup plan file {} has no plan for group '{}'", f.describe(), spec.name)),
                    Some(p) if p.size != role.size || p.role != role.role || p.owner != role.owner => Err(format!(
                        "warmup plan file {} plans group '{}' as {} ranks, role {}, owner {}; the group is {} ranks, \
                         role {}, owner {}",
                        f.describe(),
                        spec.name,
                        p.size,
                        p.role,
                        p.owner,
                        role.size,
                        role.role,
                        role.owner
                    )),
                    Some(p) => match p.check() {
                        Err(why) => Err(format!("warmup plan file {}: {why}", f.describe())),
                        Ok(()) => Ok((
                            p.clone(),
                            format!("recorded with the checkpoint of step {} ({})", f.identity.step, f.describe()),
                        )),
                    },
                },
            };
            Choice::Saved(found)
        })
        .collect();
    run_plans(s, plans, choices, cfg, report).await
}
