//! anyccl-warmup: connect every transport a train step will use, before the step, while
//! device memory is still free, written once against the public `Communicator` API.
//!
//! # Design choices (each closes a known way for a warmup to hang, crash or lie)
//! - **Named groups only.** The caller lists the groups ([`Target`]s); nothing sweeps a
//!   registry. Cross-engine groups (e.g. weight sync with inference workers, whose other
//!   members never join) are excluded unless a target explicitly allows it.
//! - **Plans from roles, valid for every size.** Data and tensor groups get all_reduce and
//!   reduce_scatter/all_gather with per-rank counts (so any group size divides), pipelines
//!   get point-to-point in both directions, unbatched and batched, expert groups all_to_all.
//!   Sizes come from the backend's capabilities (a small and a large probe), overridable.
//!   Plans are data (JSON) with a fingerprint, and can be recorded from a real step.
//! - **Recorded plans travel with the checkpoint.** A job records its first step
//!   ([`StepRecorder`]), the members merge their recordings, and the plan is written beside
//!   each checkpoint ([`PlanFile`]: versioned, checksummed, atomic, carrying the checkpoint's
//!   identity). Recovery warms from it ([`warmup_saved`]): exactly what the step uses, which
//!   a library keeps connected for the job's life. A missing or corrupt file falls back to the
//!   role plans, group by group, and the report says so.
//! - **Agreement before device work.** Members publish their group's plan under
//!   `(job, generation)`; the group's leader (group rank 0) gathers them in one multi-key
//!   wait and publishes one verdict; a difference or a missing member is an error on every
//!   rank. The store cost is linear in the job's ranks (a few requests per rank per group).
//! - **Deadlock-free order.** Groups run in name order, pairs in sorted order, the lower
//!   rank of a pair sending first: a global order, so waits cannot form a cycle.
//! - **All or nothing.** Every rank reports its outcome; a failure stores the generation's
//!   verdict at once, rank 0 tallies the reports in one multi-key wait and stores success or
//!   names those that never reported (another rank does that if rank 0 is gone). If any failed or did not report,
//!   every rank aborts the plan's communicators and returns an error. There is no "fall
//!   back to lazy": a communicator that failed mid-collective is not trusted again.
//! - **Idempotent generations.** A second call with the same generation returns the
//!   recorded outcome and issues no collective, so an outer retry can never re-enter a
//!   collective alone.
//! - **Opt-in, bounded, measured.** Off unless enabled (`ANYCCL_WARMUP=1`); skipped where
//!   the backend connects at init (no `lazy_connect`) unless forced; a memory pre-check
//!   refuses to start below a recorded need; one watchdog thread per process aborts a
//!   warmup's communicators at its deadline; the report gives time and device memory
//!   per group and step.
//!
//! - **Phases.** An engine's train-step groups sleep between its phases and wake warmed
//!   ([`sleep_groups`], [`wake_groups`]), chosen as the warmup chooses them (never a
//!   cross-engine group).
//!
//! Call it where memory is light: after a colocated inference engine has released its
//! memory, before loading the checkpoint and running the first step.
//!
//! # Module ladder
//! Each module imports only modules below it. At the bottom, data and settings with no
//! imports of their own: `plan`, `report`, `session` (store keys and the warmup's clock) and
//! `watchdog`; then `config` and `plan_file` over them; the store agreements through a group's
//! leader (`gather`), with `outcome` beside it; the steps that use `gather` (`agree` on plans,
//! `source` of each plan, `record` of a real step); `execute`, which runs an agreed plan;
//! `run`, one whole warmup; and `saved`, the warmup from a plan file, and `phases` (an
//! engine's groups slept, woken and warmed again), at the top.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod agree;
mod config;
mod execute;
mod gather;
mod outcome;
mod phases;
mod plan;
mod plan_file;
mod record;
mod report;
mod run;
mod saved;
mod session;
mod source;
mod watchdog;

pub use config::WarmupConfig;
pub use phases::{sleep_groups, wake_groups, PhaseGroup, PhaseReport};
pub use plan::{
    exclusion, merge, pipeline_pairs, plan_for, plan_from_recording, role_kinds, GroupPlan, Kind, Sizes, Step, Target,
    TargetOptions,
};
pub use plan_file::{PlanFile, PlanIdentity, PLAN_FORMAT};
pub use record::{RecordedStep, StepRecorder};
pub use report::{MemSource, Report, StepCost, StepReport};
pub use run::{warmup, warmup_plans};
pub use saved::warmup_saved;
pub use session::Session;
