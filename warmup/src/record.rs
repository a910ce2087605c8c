//! Recording a real step: every operation a job's step issues on its communicators, merged
//! across each group's members (each group's leader merges), and the device memory the
//! step took; the plan a checkpoint's [`crate::PlanFile`] carries.

use crate::gather;
use crate::plan::{merge, plan_from_recording, GroupPlan};
use crate::report::{MemSource, StepCost};
use crate::session::{comm_ctx, timed, waited, Session};
use anyccl_core::{Communicator, Platform, Result};
use std::time::Instant;

/// Records one real step on a set of communicators: start it before the step, finish it
/// after; the result is each group's plan, merged across the group's members, and the
/// device memory the step took.
pub struct StepRecorder<'a> {
    comms: Vec<&'a Communicator>,
    held: Vec<Option<u64>>,
    free: Option<u64>,
    platform: &'a dyn Platform,
}

/// A recorded step: each group's merged plan, and what the step took.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedStep {
    /// One plan per recorded group (groups excluded from warmups are left out), merged
    /// across the group's members, sorted by name.
    pub plans: Vec<GroupPlan>,
    /// Device memory the step left allocated; `None` on host memory without a communicator's
    /// own count (the machine's free memory says nothing about connecting).
    pub cost: Option<StepCost>,
}

impl std::fmt::Debug for StepRecorder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let groups: Vec<&str> = self.comms.iter().map(|c| c.spec().name.as_str()).collect();
        f.debug_struct("StepRecorder").field("groups", &groups).field("held", &self.held).finish()
    }
}

impl<'a> StepRecorder<'a> {
    /// Start recording every operation issued on `comms`, and take their memory count.
    pub fn start(comms: &[&'a Communicator], platform: &'a dyn Platform) -> Self {
        let held = comms.iter().map(|c| c.memory_held()).collect();
        let free = platform.mem_info().ok().map(|m| m.free);
        for c in comms {
            c.start_recording();
        }
        StepRecorder { comms: comms.to_vec(), held, free, platform }
    }

    /// Stop recording (call after the step's operations completed), measure what the step
    /// took, and merge each group's recordings with its other members' through the store
    /// (keys `warmup/{job}/{generation}/recorded/...`; each group's leader merges). Every member of every recorded
    /// group calls this. No device work.
    ///
    /// # Errors
    /// `Timeout` naming the members that never published their recording within `timeout`;
    /// store errors.
    pub async fn finish(self, s: &Session<'_>, timeout: std::time::Duration) -> Result<RecordedStep> {
        timed(self.finish_timed(s, timeout)).await
    }

    async fn finish_timed(self, s: &Session<'_>, timeout: std::time::Duration) -> Result<RecordedStep> {
        let deadline = anyccl_core::deadline_in(timeout);
        let _ = self.platform.synchronize();
        let mut mine = Vec::new();
        let mut groups = Vec::new();
        let mut counted = 0i64;
        let mut all_counted = true;
        for (c, before) in self.comms.iter().zip(&self.held) {
            let rec = c.take_recording();
            match (before, c.memory_held()) {
                (Some(b), Some(a)) => {
                    let d = a as i64 - *b as i64;
                    groups.push((c.spec().name.clone(), d));
                    counted += d;
                }
                _ => all_counted = false,
            }
            if let Some(p) = plan_from_recording(c, &rec, false) {
                mine.push((*c, p));
            }
        }
        let free_after = self.platform.mem_info().ok().map(|m| m.free);
        let on_host = self.platform.kind() == anyccl_core::DeviceKind::Cpu;
        let cost = match (all_counted && !self.comms.is_empty(), self.free, free_after) {
            (true, _, _) => Some(StepCost { groups, total: counted, source: MemSource::Communicator }),
            (false, Some(b), Some(a)) if !on_host => {
                Some(StepCost { groups, total: b as i64 - a as i64, source: MemSource::FreeMemory })
            }
            _ => None,
        };
        mine.sort_by(|a, b| a.1.group.cmp(&b.1.group));
        // Publish every group's recording before leading any group (see `gather`).
        for (comm, plan) in &mine {
            gather::publish(s, "recorded", comm, plan).await?;
        }
        for (comm, _) in &mine {
            lead_recorded(s, comm, deadline).await?;
        }
        let mut plans = Vec::new();
        for (comm, plan) in mine {
            plans.push(merged_recording(s, comm, plan, deadline).await?);
        }
        Ok(RecordedStep { plans, cost })
    }
}

/// The leader's part of merging `comm`'s group's recordings: every member's plan merged, or
/// the group ranks that published none.
async fn lead_recorded(s: &Session<'_>, comm: &Communicator, deadline: Instant) -> Result<()> {
    gather::lead(s, "recorded", comm, deadline, |all: Vec<Option<GroupPlan>>| {
        let missing = gather::missing(&all);
        if missing.is_empty() {
            let all: Vec<GroupPlan> = all.into_iter().flatten().collect();
            Ok(merge(&all))
        } else {
            Err(missing)
        }
    })
    .await
}

/// The merged recording of `comm`'s group (this member's `plan` where nothing merges).
async fn merged_recording(
    s: &Session<'_>,
    comm: &Communicator,
    plan: GroupPlan,
    deadline: Instant,
) -> Result<GroupPlan> {
    type Merged = std::result::Result<Option<GroupPlan>, Vec<usize>>;
    match gather::verdict::<Merged>(s, "recorded", comm, "warmup recording", deadline).await? {
        Ok(merged) => Ok(merged.unwrap_or(plan)),
        Err(missing) => Err(comm_ctx(comm).timeout(
            "warmup recording",
            waited(),
            format!("group ranks {missing:?} never published their recorded step"),
        )),
    }
}
