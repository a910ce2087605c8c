//! Checkpoint shards that carry their identity, and the agreement on which checkpoint to
//! load.
//!
//! A shard says which job, step, rank, world size and model layout it belongs to, and a
//! checksum guards it. Before any rank loads, every rank reads its own shard of the newest
//! complete checkpoint and publishes its verdict through the store; the checkpoint is loaded
//! only when every shard is sound and all belong to one job. Otherwise every rank prints
//! which files are wrong and why, and all fall back together to the newest checkpoint
//! that is consistent; when none is, every rank fails with the same list of files.

use anyccl::{Error, Recovery, Result, Store};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

const MAGIC: &[u8; 4] = b"ACK2";
const FORMAT: u32 = 2;
/// Largest header accepted (it is a few hundred bytes of JSON).
const MAX_HEADER: usize = 64 << 10;

/// Who a shard belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardId {
    /// The training job (kept across its restarts).
    pub job: String,
    /// The step the parameters are from.
    pub step: u64,
    /// The rank that wrote it.
    pub rank: usize,
    /// Ranks in the job that wrote it.
    pub world_size: usize,
    /// The model and parallel layout, e.g. `dp2 pp2 width64 layers2`.
    pub layout: String,
    /// Parameters in the shard.
    pub count: u64,
}

fn err(msg: String) -> Error {
    Error::Backend {
        backend: "checkpoint",
        op: "shard".into(),
        code: -1,
        text: msg,
        recovery: Recovery::Fatal,
        source: None,
    }
}

/// Where rank `rank`'s shard of step `step` lives under the run directory `dir`.
pub fn shard_path(dir: &Path, step: u64, rank: usize) -> PathBuf {
    step_dir(dir, step).join(format!("rank{rank}.bin"))
}

/// The folder of step `step`'s checkpoint.
pub fn step_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("ckpt/step{step:06}"))
}

/// Write a shard atomically: temporary file, fsync, rename, fsync the folder.
///
/// # Errors
/// I/O errors, naming the file.
pub fn write_shard(path: &Path, id: &ShardId, params: &[f32]) -> Result<()> {
    let io = |e: std::io::Error| err(format!("checkpoint {}: {e}", path.display()));
    let dir = path.parent().ok_or_else(|| err(format!("{} has no folder", path.display())))?;
    std::fs::create_dir_all(dir).map_err(io)?;
    let header = serde_json::to_vec(id).map_err(|e| err(format!("checkpoint header: {e}")))?;
    let mut body = Vec::with_capacity(params.len() * 4 + header.len() + 16);
    body.extend_from_slice(MAGIC);
    body.extend_from_slice(&FORMAT.to_le_bytes());
    body.extend_from_slice(&(header.len() as u32).to_le_bytes());
    body.extend_from_slice(&header);
    for p in params {
        body.extend_from_slice(&p.to_le_bytes());
    }
    let crc = crc32fast::hash(&body);
    body.extend_from_slice(&crc.to_le_bytes());
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&body).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
    Ok(())
}

/// Read a shard and check its checksum and sizes (not whose it is: see [`ShardId`]).
///
/// # Errors
/// A missing, unreadable or corrupt file, naming it and what is wrong.
pub fn read_shard(path: &Path) -> Result<(ShardId, Vec<f32>)> {
    let body = std::fs::read(path)
        .map_err(|e| err(format!("checkpoint shard {} is missing or unreadable: {e}", path.display())))?;
    let corrupt = |why: String| err(format!("checkpoint shard {} is corrupt: {why}", path.display()));
    if body.len() < 16 || &body[..4] != MAGIC {
        return Err(corrupt("not an anyccl checkpoint shard (bad magic)".into()));
    }
    let (data, crc) = body.split_at(body.len() - 4);
    if crc32fast::hash(data) != u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]) {
        return Err(corrupt("checksum mismatch".into()));
    }
    let format = u32::from_le_bytes([data[4], data[5], data[6], data[7]]);
    if format != FORMAT {
        return Err(corrupt(format!("format {format}, this program reads format {FORMAT}")));
    }
    let hlen = u32::from_le_bytes([data[8], data[9], data[10], data[11]]) as usize;
    if hlen > MAX_HEADER || 12 + hlen > data.len() {
        return Err(corrupt(format!("header of {hlen} bytes does not fit")));
    }
    let id: ShardId =
        serde_json::from_slice(&data[12..12 + hlen]).map_err(|e| corrupt(format!("unreadable header: {e}")))?;
    let payload = &data[12 + hlen..];
    if payload.len() as u64 != id.count.saturating_mul(4) {
        return Err(corrupt(format!("{} bytes of parameters, the header says {} parameters", payload.len(), id.count)));
    }
    Ok((id, payload.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
}

/// Steps whose checkpoint every rank finished (a `COMPLETE` marker), newest first.
///
/// # Errors
/// The checkpoint folder cannot be read.
pub fn complete_steps(dir: &Path) -> Result<Vec<u64>> {
    let rd =
        std::fs::read_dir(dir.join("ckpt")).map_err(|e| err(format!("no checkpoints under {}: {e}", dir.display())))?;
    let mut steps: Vec<u64> = rd
        .flatten()
        .filter(|e| e.path().join("COMPLETE").exists())
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_prefix("step")).and_then(|s| s.parse().ok()))
        .collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    Ok(steps)
}

/// What this rank expects of its shard.
#[derive(Debug, Clone)]
pub struct Expect {
    /// This rank.
    pub rank: usize,
    /// Ranks in this job.
    pub world_size: usize,
    /// This job's model and parallel layout.
    pub layout: String,
    /// Parameters this rank holds.
    pub count: u64,
}

/// The checkpoint the ranks agreed on.
#[derive(Debug)]
pub struct Loaded {
    /// Its step.
    pub step: u64,
    /// The job that wrote it.
    pub job: String,
    /// This rank's parameters.
    pub params: Vec<f32>,
    /// Newer checkpoints passed over, each with what was wrong.
    pub skipped: Vec<String>,
}

#[derive(Serialize, Deserialize)]
struct Verdict {
    job: Option<String>,
    problem: Option<String>,
}

/// Check one shard against what this rank expects of step `step`.
fn check(dir: &Path, step: u64, want: &Expect) -> std::result::Result<(ShardId, Vec<f32>), String> {
    let path = shard_path(dir, step, want.rank);
    let (id, params) = read_shard(&path).map_err(|e| e.to_string())?;
    let mut wrong = Vec::new();
    if id.step != step {
        wrong.push(format!("holds step {} (its folder is step {step})", id.step));
    }
    if id.rank != want.rank {
        wrong.push(format!("was written by rank {}", id.rank));
    }
    if id.world_size != want.world_size {
        wrong.push(format!("is from a job of {} ranks, this one has {}", id.world_size, want.world_size));
    }
    if id.layout != want.layout {
        wrong.push(format!("has layout '{}', this job '{}'", id.layout, want.layout));
    }
    if id.count != want.count {
        wrong.push(format!("holds {} parameters, this rank {}", id.count, want.count));
    }
    if wrong.is_empty() {
        Ok((id, params))
    } else {
        Err(format!("checkpoint shard {} {}", path.display(), wrong.join(", ")))
    }
}

/// Agree with every other rank on the newest checkpoint under `dir` whose shards are all
/// sound and from one job, and read this rank's shard of it. Every rank calls this; rank
/// 0's view of which checkpoints are complete is the one used. Keys go under `key` in the
/// store (one agreement per key). Each wait is bounded by `timeout`.
///
/// # Errors
/// No consistent checkpoint: every rank gets the same list of files and what is wrong with
/// each. `Timeout` naming the ranks that did not answer; store errors.
pub async fn agree_and_load(
    store: &dyn Store,
    key: &str,
    dir: &Path,
    want: &Expect,
    timeout: Duration,
) -> Result<Loaded> {
    let deadline = anyccl::raw::deadline_in(timeout);
    let steps_key = format!("{key}/steps");
    if want.rank == 0 {
        let steps = match complete_steps(dir) {
            Ok(s) => s,
            Err(e) => {
                // The others must hear of it rather than wait.
                store.set(&format!("{key}/none"), e.to_string().as_bytes()).await?;
                Vec::new()
            }
        };
        let v = serde_json::to_vec(&steps).map_err(|e| err(e.to_string()))?;
        store.set(&steps_key, &v).await?;
    }
    let raw = store
        .wait(&steps_key, deadline)
        .await
        .map_err(|e| named_timeout(e, want.rank, "the list of checkpoints from rank 0"))?;
    let steps: Vec<u64> = serde_json::from_slice(&raw).map_err(|e| err(format!("bad value under {steps_key}: {e}")))?;
    if steps.is_empty() {
        let why = store.get(&format!("{key}/none")).await?.map(|b| String::from_utf8_lossy(&b).into_owned());
        return Err(err(why.unwrap_or_else(|| format!("no complete checkpoint under {}", dir.display()))));
    }
    let mut skipped = Vec::new();
    for step in steps {
        let mine = check(dir, step, want);
        let verdict = match &mine {
            Ok((id, _)) => Verdict { job: Some(id.job.clone()), problem: None },
            Err(p) => Verdict { job: None, problem: Some(p.clone()) },
        };
        let v = serde_json::to_vec(&verdict).map_err(|e| err(e.to_string()))?;
        store.set(&format!("{key}/{step}/{}", want.rank), &v).await?;
        let mut problems = Vec::new();
        let mut jobs: Vec<(usize, String)> = Vec::new();
        for r in 0..want.world_size {
            let raw = store.wait(&format!("{key}/{step}/{r}"), deadline).await.map_err(|e| {
                named_timeout(e, want.rank, &format!("rank {r}'s verdict on the checkpoint of step {step}"))
            })?;
            let v: Verdict = serde_json::from_slice(&raw).map_err(|e| err(format!("bad verdict of rank {r}: {e}")))?;
            match (v.problem, v.job) {
                (Some(p), _) => problems.push(format!("rank {r}: {p}")),
                (None, Some(j)) => jobs.push((r, j)),
                (None, None) => problems.push(format!("rank {r}: no verdict")),
            }
        }
        if let Some((r0, j0)) = jobs.first().cloned() {
            for (r, j) in &jobs[1..] {
                if *j != j0 {
                    problems.push(format!("rank {r}'s shard belongs to job {j}, rank {r0}'s to job {j0}"));
                }
            }
        }
        match mine {
            Ok((id, params)) if problems.is_empty() => return Ok(Loaded { step, job: id.job, params, skipped }),
            _ => {
                let what = format!("the checkpoint of step {step} is inconsistent: {}", problems.join("; "));
                eprintln!("rank {}: {what}; trying an older one", want.rank);
                skipped.push(what);
            }
        }
    }
    Err(err(format!("no consistent checkpoint under {}: {}", dir.display(), skipped.join(" | "))))
}

fn named_timeout(e: Error, rank: usize, what: &str) -> Error {
    match e {
        Error::Timeout { op, after, .. } => Error::Timeout {
            op,
            rank,
            group: String::new(),
            after,
            detail: format!("waiting for {what}"),
            source: None,
        },
        e => e,
    }
}
