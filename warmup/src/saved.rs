//! Saved plans: what a real step issued, recorded while the job runs, merged across each
//! group's members and written beside a checkpoint, so the warmup at recovery connects what
//! the step uses and nothing more; and the replay ([`warmup_saved`]), with the members'
//! agreement on where each group's plan comes from.
//!
//! The file is versioned and checksummed, written atomically (temporary file, fsync, rename,
//! fsync of the folder) and carries the identity of the checkpoint it belongs to (job, step,
//! rank, world size, layout), so a plan is never replayed against another job's groups.

use crate::gather;
use crate::plan::{merge, plan_from_recording, GroupPlan, Target};
use crate::report::{MemSource, Report};
use crate::run::{role_plans, run_plans, Session, WarmupConfig};
use anyccl_core::{Communicator, Error, Platform, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// First word of a plan file.
const MAGIC: &str = "anyccl-warmup-plan";
/// Format this code writes and reads.
pub const PLAN_FORMAT: u32 = 1;
/// Largest plan file read (a plan is a few KiB of JSON per group).
const MAX_FILE: u64 = 64 << 20;

/// Which checkpoint (and which rank of which job) a saved plan belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanIdentity {
    /// The training job (kept across its restarts).
    pub job: String,
    /// The checkpoint's step.
    pub step: u64,
    /// The rank that wrote the file.
    pub rank: usize,
    /// Ranks in the job.
    pub world_size: usize,
    /// The model and parallel layout, as the checkpoint's shards record it.
    pub layout: String,
}

/// Device memory one step took while connecting, per group and in all.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepCost {
    /// Per group: bytes the step left allocated on that group's communicator (present only
    /// where the communicator keeps a count of its own).
    pub groups: Vec<(String, i64)>,
    /// Bytes in all.
    pub total: i64,
    /// How `total` was counted.
    pub source: MemSource,
}

/// A saved plan: every group this rank is a member of, as the members merged it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanFile {
    /// Whose it is.
    pub identity: PlanIdentity,
    /// One plan per group, merged across the group's members.
    pub plans: Vec<GroupPlan>,
    /// What the step took when it connected lazily (its communicators cold), when that was
    /// measured: the figure a warmup from this plan should match.
    pub cold_step: Option<StepCost>,
    /// Where it was read from (not stored).
    #[serde(skip)]
    pub path: Option<PathBuf>,
}

impl PlanFile {
    /// Write atomically to `path`: a temporary file beside it, fsync, rename, fsync of the
    /// folder. A reader sees the old file or the new one, never a part.
    ///
    /// # Errors
    /// `Backend` naming the file on any I/O failure.
    pub fn write(&self, path: &Path) -> Result<()> {
        let io = |what: &str, e: std::io::Error| file_err(path, format!("cannot {what}: {e}"));
        let body = serde_json::to_vec_pretty(self).map_err(|e| file_err(path, format!("cannot encode: {e}")))?;
        let sum = hex(&Sha256::digest(&body));
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| io("create its folder", e))?;
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("plan");
        let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
        let written = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(format!("{MAGIC} {PLAN_FORMAT} sha256={sum}\n").as_bytes())?;
            f.write_all(&body)?;
            f.write_all(b"\n")?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)?;
            std::fs::File::open(dir)?.sync_all()
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(io("write it", e));
        }
        Ok(())
    }

    /// Read and check a plan file: its format, its checksum, its JSON.
    ///
    /// # Errors
    /// A message naming the file and what is wrong with it (missing, too large, not a plan
    /// file, another format, checksum mismatch, unreadable JSON). A caller falls back to the
    /// role plans with it ([`crate::warmup_saved`]).
    pub fn read(path: &Path) -> std::result::Result<PlanFile, String> {
        let bad = |why: String| format!("warmup plan file {}: {why}", path.display());
        let meta = std::fs::metadata(path).map_err(|e| bad(format!("missing or unreadable ({e})")))?;
        if meta.len() > MAX_FILE {
            return Err(bad(format!("{} bytes, more than a plan file can be ({MAX_FILE})", meta.len())));
        }
        let raw = std::fs::read(path).map_err(|e| bad(format!("unreadable ({e})")))?;
        let nl = raw.iter().position(|&b| b == b'\n').ok_or_else(|| bad("no header line".into()))?;
        let header = std::str::from_utf8(&raw[..nl]).map_err(|_| bad("not a plan file (binary header)".into()))?;
        let mut words = header.split(' ');
        if words.next() != Some(MAGIC) {
            return Err(bad(format!("not a plan file (it does not start with '{MAGIC}')")));
        }
        let format = words.next().and_then(|f| f.parse::<u32>().ok());
        if format != Some(PLAN_FORMAT) {
            return Err(bad(format!("format {format:?}, this program reads format {PLAN_FORMAT}")));
        }
        let want = words.next().and_then(|w| w.strip_prefix("sha256=")).ok_or_else(|| bad("no checksum".into()))?;
        let mut body = &raw[nl + 1..];
        if body.last() == Some(&b'\n') {
            body = &body[..body.len() - 1];
        }
        if hex(&Sha256::digest(body)) != want {
            return Err(bad("checksum mismatch (the file is corrupt or was edited)".into()));
        }
        let mut file: PlanFile = serde_json::from_slice(body).map_err(|e| bad(format!("unreadable plan ({e})")))?;
        file.path = Some(path.to_path_buf());
        Ok(file)
    }

    /// Check that the file belongs to `want` (job, step, rank, world size, layout).
    ///
    /// # Errors
    /// A message naming the file and every field that differs.
    pub fn check(&self, want: &PlanIdentity) -> std::result::Result<(), String> {
        let have = &self.identity;
        let mut wrong = Vec::new();
        if have.job != want.job {
            wrong.push(format!("belongs to job '{}', not '{}'", have.job, want.job));
        }
        if have.step != want.step {
            wrong.push(format!("is of step {}, the checkpoint of step {}", have.step, want.step));
        }
        if have.rank != want.rank {
            wrong.push(format!("was written by rank {}, not {}", have.rank, want.rank));
        }
        if have.world_size != want.world_size {
            wrong.push(format!("is from {} ranks, this job has {}", have.world_size, want.world_size));
        }
        if have.layout != want.layout {
            wrong.push(format!("has layout '{}', this job '{}'", have.layout, want.layout));
        }
        if wrong.is_empty() {
            Ok(())
        } else {
            Err(format!("warmup plan file {} {}", self.describe(), wrong.join(", ")))
        }
    }

    /// Read `path` and check it against `want`: the plan to give [`crate::warmup_saved`], or
    /// why there is none.
    ///
    /// # Errors
    /// As [`PlanFile::read`] and [`PlanFile::check`].
    pub fn load(path: &Path, want: &PlanIdentity) -> std::result::Result<PlanFile, String> {
        let f = PlanFile::read(path)?;
        f.check(want)?;
        Ok(f)
    }

    /// Where the file came from, for reports.
    pub fn describe(&self) -> String {
        match &self.path {
            Some(p) => p.display().to_string(),
            None => format!("of step {}", self.identity.step),
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn file_err(path: &Path, text: String) -> Error {
    Error::Backend {
        backend: "warmup",
        op: "plan file".into(),
        code: -1,
        text: format!("warmup plan file {}: {text}", path.display()),
        recovery: anyccl_core::Recovery::Fatal,
        source: None,
    }
}

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
        crate::run::timed(self.finish_timed(s, timeout)).await
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
        Err(missing) => Err(Error::Timeout {
            op: "warmup recording".into(),
            rank: comm.rank(),
            group: comm.spec().name.clone(),
            after: crate::run::waited(),
            detail: format!("group ranks {missing:?} never published their recorded step"),
            source: None,
        }),
    }
}

// ---------------------------------------------------------------- replay

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
        let lacking = verdict.map_err(|missing| Error::Timeout {
            op: "warmup agreement".into(),
            rank: comm.rank(),
            group: plan.group.clone(),
            after: crate::run::waited(),
            detail: format!("group ranks {missing:?} never said whether they have a saved plan"),
            source: None,
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
