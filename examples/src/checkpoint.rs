//! Checkpoint shards that carry their identity, and the agreement on which checkpoint to
//! load.
//!
//! A shard says which job, step, rank, world size and model layout it belongs to, and a
//! checksum guards it. Before any rank loads, every rank reads its own shard of the newest
//! complete checkpoint and publishes its verdict through the store; the checkpoint is loaded
//! only when every shard is sound and all belong to one job. Otherwise every rank prints
//! which files are wrong and why, and all fall back together to the newest checkpoint
//! that is consistent; when none is, every rank fails with the same list of files.

use crate::errln;
use anyccl::raw::{read_regular_file, write_file_atomically, Ctx};
use anyccl::{Error, Result, Store};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

const MAGIC: &[u8; 4] = b"ACK2";
const FORMAT: u32 = 2;
/// Largest header accepted (it is a few hundred bytes of JSON).
const MAX_HEADER: usize = 64 << 10;
/// Largest shard [`read_shard`] reads (a billion parameters): a reader that knows how many
/// parameters to expect caps the file by that instead ([`read_shard_expecting`]).
pub const MAX_SHARD_BYTES: u64 = 4 << 30;
/// The tool named by errors about shard files, and what they were doing.
const BACKEND: &str = "checkpoint";
const LOAD: &str = "load checkpoint shard";
const WRITE: &str = "write checkpoint shard";
const LOAD_ANY: &str = "load a checkpoint";

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

/// Where rank `rank`'s shard of step `step` lives under the run directory `dir`.
pub fn shard_path(dir: &Path, step: u64, rank: usize) -> PathBuf {
    step_dir(dir, step).join(format!("rank{rank}.bin"))
}

/// The folder of step `step`'s checkpoint.
pub fn step_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("ckpt/step{step:06}"))
}

/// Write a shard atomically: temporary file, fsync, rename, fsync the folder. When any
/// step fails (a full disk, an fsync or rename error) the temporary file is removed: a
/// failed write leaves the folder as it found it.
///
/// # Errors
/// I/O errors, naming the file.
pub fn write_shard(path: &Path, id: &ShardId, params: &[f32]) -> Result<()> {
    let ctx = Ctx::process(BACKEND);
    let header = serde_json::to_vec(id).map_err(|e| ctx.file(WRITE, path, format!("cannot encode its header: {e}")))?;
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
    write_file_atomically(&ctx, WRITE, path, &[&body])
}

/// Bytes of a shard whose header is `hlen` bytes and which holds `count` parameters; `None`
/// past `u64`.
fn shard_bytes(hlen: u64, count: u64) -> Option<u64> {
    count.checked_mul(4)?.checked_add(12 + 4)?.checked_add(hlen)
}

/// Read a shard and check its checksum and sizes (not whose it is: see [`ShardId`]). Only
/// a regular file of at most [`MAX_SHARD_BYTES`] is read (never a FIFO or a device, which
/// are refused at once); a reader that knows how many parameters the shard holds caps it
/// by that ([`read_shard_expecting`]).
///
/// # Errors
/// `Io` naming the file: missing, unreadable, not a regular file, too large, or corrupt.
pub fn read_shard(path: &Path) -> Result<(ShardId, Vec<f32>)> {
    read_shard_within(&Ctx::process(BACKEND), path, MAX_SHARD_BYTES)
}

/// [`read_shard`] of a shard that should hold `count` parameters: a file larger than such a
/// shard can be is refused before anything is read, naming both sizes.
///
/// # Errors
/// As [`read_shard`]; a file too large for `count` parameters.
pub fn read_shard_expecting(path: &Path, count: u64) -> Result<(ShardId, Vec<f32>)> {
    read_shard_of(&Ctx::process(BACKEND), path, count)
}

fn read_shard_of(ctx: &Ctx, path: &Path, count: u64) -> Result<(ShardId, Vec<f32>)> {
    read_shard_within(ctx, path, shard_bytes(MAX_HEADER as u64, count).unwrap_or(u64::MAX))
}

fn read_shard_within(ctx: &Ctx, path: &Path, max_bytes: u64) -> Result<(ShardId, Vec<f32>)> {
    let body = read_regular_file(ctx, LOAD, path, max_bytes)?;
    let corrupt = |why: String| ctx.file(LOAD, path, format!("corrupt: {why}"));
    if body.len() < 16 || &body[..4] != MAGIC {
        return Err(corrupt("not an anyccl checkpoint shard (bad magic)".into()));
    }
    let (data, crc) = body.split_at(body.len() - 4);
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
    let want = shard_bytes(hlen as u64, id.count);
    if want != Some(body.len() as u64) {
        let want = want.map_or("more than 2^64 bytes".into(), |w| format!("{w} bytes"));
        return Err(corrupt(format!("{} bytes, its header ({} parameters) makes it {want}", body.len(), id.count)));
    }
    if crc32fast::hash(data) != u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]) {
        return Err(corrupt("checksum mismatch".into()));
    }
    let payload = &data[12 + hlen..];
    Ok((id, payload.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
}

/// Steps whose checkpoint every rank finished (a `COMPLETE` marker), newest first.
///
/// # Errors
/// The checkpoint folder cannot be read.
pub fn complete_steps(dir: &Path) -> Result<Vec<u64>> {
    let ckpt = dir.join("ckpt");
    let rd = std::fs::read_dir(&ckpt).map_err(|e| Ctx::process(BACKEND).io("list checkpoints", &ckpt, e))?;
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

/// What is wrong with a shard that could not be read, as every rank is told: the file
/// first, then what it is (`... rank3.bin is corrupt: checksum mismatch`).
fn problem(e: &Error) -> String {
    match e {
        Error::Io { path, detail, source: Some(_), .. } => format!("checkpoint shard {path} cannot be read: {detail}"),
        Error::Io { path, detail, .. } => format!("checkpoint shard {path} is {detail}"),
        e => e.to_string(),
    }
}

/// Check one shard against what this rank expects of step `step`.
fn check(ctx: &Ctx, dir: &Path, step: u64, want: &Expect) -> std::result::Result<(ShardId, Vec<f32>), String> {
    let path = shard_path(dir, step, want.rank);
    let (id, params) = read_shard_of(ctx, &path, want.count).map_err(|e| problem(&e))?;
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
    let ctx = Ctx::new(BACKEND, want.rank, "");
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
        let v =
            serde_json::to_vec(&steps).map_err(|e| Error::store_fatal(format!("cannot encode {steps_key}: {e}")))?;
        store.set(&steps_key, &v).await?;
    }
    let raw = store
        .wait(&steps_key, deadline)
        .await
        .map_err(|e| named_timeout(&ctx, e, "the list of checkpoints from rank 0"))?;
    let steps: Vec<u64> =
        serde_json::from_slice(&raw).map_err(|e| Error::store_fatal(format!("bad value under {steps_key}: {e}")))?;
    if steps.is_empty() {
        let why = store.get(&format!("{key}/none")).await?.map(|b| String::from_utf8_lossy(&b).into_owned());
        let why = why.map_or_else(|| "no complete checkpoint".to_string(), |w| format!("rank 0 found none: {w}"));
        return Err(ctx.file(LOAD_ANY, dir, why));
    }
    let mut skipped = Vec::new();
    for step in steps {
        let mine = check(&ctx, dir, step, want);
        let verdict = match &mine {
            Ok((id, _)) => Verdict { job: Some(id.job.clone()), problem: None },
            Err(p) => Verdict { job: None, problem: Some(p.clone()) },
        };
        let v =
            serde_json::to_vec(&verdict).map_err(|e| Error::store_fatal(format!("cannot encode a verdict: {e}")))?;
        store.set(&format!("{key}/{step}/{}", want.rank), &v).await?;
        let mut problems = Vec::new();
        let mut jobs: Vec<(usize, String)> = Vec::new();
        for r in 0..want.world_size {
            let raw = store
                .wait(&format!("{key}/{step}/{r}"), deadline)
                .await
                .map_err(|e| named_timeout(&ctx, e, &format!("rank {r}'s verdict on the checkpoint of step {step}")))?;
            let v: Verdict = serde_json::from_slice(&raw)
                .map_err(|e| Error::store_fatal(format!("bad verdict of rank {r} under {key}: {e}")))?;
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
                errln!("rank {}: {what}; trying an older one", want.rank);
                skipped.push(what);
            }
        }
    }
    Err(ctx.file(LOAD_ANY, dir, format!("no consistent checkpoint: {}", skipped.join(" | "))))
}

/// A store's timeout, said as this agreement's: what this rank waited for.
fn named_timeout(ctx: &Ctx, e: Error, what: &str) -> Error {
    match &e {
        Error::Timeout { op, after, .. } => {
            let (op, after) = (op.clone(), *after);
            ctx.timeout(op, after, format!("waiting for {what}")).with_source(e)
        }
        _ => e,
    }
}
