//! The saved plan file: what a recorded step issued, written beside a checkpoint.
//!
//! The file is versioned and checksummed, written atomically (temporary file, fsync, rename,
//! fsync of the folder) and carries the identity of the checkpoint it belongs to (job, step,
//! rank, world size, layout), so a plan is never replayed against another job's groups.

use crate::plan::GroupPlan;
use crate::report::StepCost;
use anyccl_core::{env_parse_at, parse_bytes, read_regular_file, write_file_atomically, Ctx, Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// First word of a plan file.
const MAGIC: &str = "anyccl-warmup-plan";
/// Format this code writes and reads.
pub const PLAN_FORMAT: u32 = 1;
/// Largest plan file [`PlanFile::read`] reads unless `ANYCCL_WARMUP_PLAN_MAX_BYTES` says
/// otherwise (a plan is a few KiB of JSON per group).
const MAX_FILE: u64 = 64 << 20;
/// What reading and writing a plan file is called in errors.
const READ: &str = "warmup plan file read";
const WRITE: &str = "warmup plan file write";

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
    /// `Io` naming the file, its temporary file or its folder, whichever failed, and the rank
    /// of the identity, with the system's error as the source.
    pub fn write(&self, path: &Path) -> Result<()> {
        let cx = Ctx::new("warmup", self.identity.rank, "");
        let body = serde_json::to_vec_pretty(self).map_err(|e| cx.file(WRITE, path, format!("cannot encode: {e}")))?;
        let sum = hex(&Sha256::digest(&body));
        let head = format!("{MAGIC} {PLAN_FORMAT} sha256={sum}\n");
        write_file_atomically(&cx, WRITE, path, &[head.as_bytes(), &body, b"\n"])
    }

    /// Read and check a plan file: its format, its checksum, its JSON. Only a regular file is
    /// read (a link to a device, a FIFO or a folder is refused at once, never read or waited
    /// on), and at most `ANYCCL_WARMUP_PLAN_MAX_BYTES` of it (a byte count, default 64 MiB).
    ///
    /// # Errors
    /// A message naming the file and what is wrong with it (missing, not a regular file, too
    /// large, not a plan file, another format, checksum mismatch, unreadable JSON), or the
    /// variable when it does not parse. A caller falls back to the role plans with it
    /// (`warmup_saved`).
    pub fn read(path: &Path) -> std::result::Result<PlanFile, String> {
        let cx = Ctx::process("warmup");
        let max = env_parse_at(&cx, READ, "ANYCCL_WARMUP_PLAN_MAX_BYTES", "a byte count (K, M or G allowed)", |s| {
            parse_bytes(s).map(|b| b as u64)
        })
        .map_err(|e| format!("warmup plan file {}: not read: {e}", path.display()))?;
        PlanFile::read_at_most(path, max.unwrap_or(MAX_FILE))
    }

    /// [`PlanFile::read`] with its own cap: at most `max_bytes` of the file.
    ///
    /// # Errors
    /// As [`PlanFile::read`].
    pub fn read_at_most(path: &Path, max_bytes: u64) -> std::result::Result<PlanFile, String> {
        let bad = |why: String| format!("warmup plan file {}: {why}", path.display());
        let raw = read_regular_file(&Ctx::process("warmup"), READ, path, max_bytes).map_err(|e| match e {
            // The system's error: the file cannot be opened or read.
            Error::Io { detail, source: Some(_), .. } => bad(format!("missing or unreadable ({detail})")),
            // What is wrong with the file itself (not a regular file, too large).
            Error::Io { detail, .. } => bad(detail),
            e => bad(e.to_string()),
        })?;
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

    /// Read `path` and check it against `want`: the plan to give `warmup_saved`, or
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
