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
use std::io::{Read, Write};
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

/// Write a shard atomically: temporary file, fsync, rename, fsync the folder. When any
/// step fails (a full disk, an fsync or rename error) the temporary file is removed: a
/// failed write leaves the folder as it found it.
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
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(&body).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let mut msg = format!("checkpoint {}: {e}", path.display());
        match std::fs::remove_file(&tmp) {
            Ok(()) => msg.push_str(&format!(" (its partial file {} was removed)", tmp.display())),
            Err(r) if r.kind() == std::io::ErrorKind::NotFound => {}
            Err(r) => msg.push_str(&format!(" (and its partial file {} could not be removed: {r})", tmp.display())),
        }
        return Err(err(msg));
    }
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
    Ok(())
}

/// What a file that is not a regular one is, for an error.
fn file_kind(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a folder"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Open `path` for reading only if it is a regular file (a link is followed to what it
/// names): opened non-blocking, so that a FIFO cannot hold the open, then checked by
/// `fstat` on what was opened. Its size.
fn open_regular(path: &Path, what: &str) -> Result<(std::fs::File, u64)> {
    use std::os::unix::fs::OpenOptionsExt;
    let unreadable = |e: std::io::Error| err(format!("{what} {} is missing or unreadable: {e}", path.display()));
    let f =
        std::fs::OpenOptions::new().read(true).custom_flags(nix::libc::O_NONBLOCK).open(path).map_err(unreadable)?;
    let meta = f.metadata().map_err(unreadable)?;
    if !meta.file_type().is_file() {
        let kind = file_kind(meta.file_type());
        return Err(err(format!("{what} {} is not a regular file ({kind})", path.display())));
    }
    Ok((f, meta.len()))
}

/// Bytes of a shard whose header is `hlen` bytes and which holds `count` parameters; `None`
/// past `u64`.
fn shard_bytes(hlen: u64, count: u64) -> Option<u64> {
    count.checked_mul(4)?.checked_add(12 + 4)?.checked_add(hlen)
}

/// Read a shard and check its checksum and sizes (not whose it is: see [`ShardId`]). Only
/// a regular file is read, and only when its size is the one its header gives; a reader
/// that knows how many parameters to expect caps the file by that ([`read_shard_expecting`]).
///
/// # Errors
/// A missing, unreadable, irregular or corrupt file, naming it and what is wrong.
pub fn read_shard(path: &Path) -> Result<(ShardId, Vec<f32>)> {
    read_shard_within(path, None)
}

/// [`read_shard`] of a shard that should hold `count` parameters: a file larger than such a
/// shard can be is refused before anything is read, naming both sizes.
///
/// # Errors
/// As [`read_shard`]; a file too large for `count` parameters.
pub fn read_shard_expecting(path: &Path, count: u64) -> Result<(ShardId, Vec<f32>)> {
    read_shard_within(path, Some(count))
}

fn read_shard_within(path: &Path, expect: Option<u64>) -> Result<(ShardId, Vec<f32>)> {
    let (mut f, size) = open_regular(path, "checkpoint shard")?;
    if let Some(count) = expect {
        let max = shard_bytes(MAX_HEADER as u64, count).unwrap_or(u64::MAX);
        if size > max {
            return Err(err(format!(
                "checkpoint shard {} is {size} bytes, more than a shard of {count} parameters can be ({max} bytes)",
                path.display()
            )));
        }
    }
    let corrupt = |why: String| err(format!("checkpoint shard {} is corrupt: {why}", path.display()));
    let unreadable = |e: std::io::Error| err(format!("checkpoint shard {} is unreadable: {e}", path.display()));
    let mut head = [0u8; 12];
    if size < 16 || f.read_exact(&mut head).is_err() || &head[..4] != MAGIC {
        return Err(corrupt("not an anyccl checkpoint shard (bad magic)".into()));
    }
    let format = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    if format != FORMAT {
        return Err(corrupt(format!("format {format}, this program reads format {FORMAT}")));
    }
    let hlen = u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize;
    if hlen > MAX_HEADER || 12 + 4 + hlen as u64 > size {
        return Err(corrupt(format!("header of {hlen} bytes does not fit")));
    }
    let mut header = vec![0u8; hlen];
    f.read_exact(&mut header).map_err(unreadable)?;
    let id: ShardId = serde_json::from_slice(&header).map_err(|e| corrupt(format!("unreadable header: {e}")))?;
    // The whole size is known now: a file of any other size is refused before its
    // parameters are read.
    let want = shard_bytes(hlen as u64, id.count);
    if want != Some(size) {
        let want = want.map_or("more than 2^64 bytes".into(), |w| format!("{w} bytes"));
        return Err(corrupt(format!("{size} bytes, its header ({} parameters) makes it {want}", id.count)));
    }
    let rest_len = size - 12 - hlen as u64;
    let mut rest = Vec::with_capacity(rest_len as usize);
    (&mut f).take(rest_len + 1).read_to_end(&mut rest).map_err(unreadable)?;
    if rest.len() as u64 != rest_len {
        return Err(corrupt(format!("it changed while read ({} bytes after the header, not {rest_len})", rest.len())));
    }
    let (payload, crc) = rest.split_at(rest.len() - 4);
    let mut sum = crc32fast::Hasher::new();
    sum.update(&head);
    sum.update(&header);
    sum.update(payload);
    if sum.finalize() != u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]) {
        return Err(corrupt("checksum mismatch".into()));
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
    let (id, params) = read_shard_expecting(&path, want.count).map_err(|e| e.to_string())?;
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
