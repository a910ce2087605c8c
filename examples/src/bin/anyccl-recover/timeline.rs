//! What happened when, on every rank, for the demo's timeline: each process appends its
//! events to a file of its own (`timeline/rank<r>-inc<i>.jsonl` under the run's folder) as
//! they happen, so a process killed later keeps what it wrote. Times are the host's wall
//! clock in milliseconds: the ranks of a demo share one host.

use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

/// One event of one process.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Event {
    pub(crate) rank: usize,
    pub(crate) incarnation: u64,
    pub(crate) what: String,
    pub(crate) epoch: u64,
    pub(crate) step: u64,
    pub(crate) at_ms: u64,
    /// What else the event says (a first step's device memory, say).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub(crate) detail: String,
}

/// The wall clock, in milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Append `what` (at `epoch`, `step`) to this process's timeline. Best effort: a timeline
/// that cannot be written costs the demo its table, never the run.
pub(crate) fn mark(run_dir: &Path, rank: usize, incarnation: u64, what: &str, epoch: u64, step: u64) {
    mark_with(run_dir, rank, incarnation, what, epoch, step, String::new());
}

/// [`mark`] with a detail.
pub(crate) fn mark_with(
    run_dir: &Path,
    rank: usize,
    incarnation: u64,
    what: &str,
    epoch: u64,
    step: u64,
    detail: String,
) {
    let e = Event { rank, incarnation, what: what.into(), epoch, step, at_ms: now_ms(), detail };
    let dir = run_dir.join("timeline");
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!("rank{rank}-inc{incarnation}.jsonl"));
    if let (Ok(mut f), Ok(line)) =
        (std::fs::OpenOptions::new().create(true).append(true).open(&path), serde_json::to_string(&e))
    {
        let _ = writeln!(f, "{line}");
    }
}

/// Every event of a run, in time order (lines that do not parse are skipped: a process
/// killed while writing leaves half a line).
pub(crate) fn read(run_dir: &Path) -> Vec<Event> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(run_dir.join("timeline")) else { return out };
    for e in entries.flatten() {
        let Some(text) = small_file(&e.path()) else { continue };
        out.extend(text.lines().filter_map(|l| serde_json::from_str::<Event>(l).ok()));
    }
    out.sort_by_key(|e| (e.at_ms, e.rank));
    out
}

/// The fault the run's victim recorded before it killed itself: (rank, step, when).
pub(crate) fn fault(run_dir: &Path) -> Option<(usize, u64, u64)> {
    let text = small_file(&run_dir.join("fault.json"))?;
    let v: serde_json::Value = serde_json::from_str(text.trim()).ok()?;
    Some((v["rank"].as_u64()? as usize, v["step"].as_u64()?, v["at_ms"].as_u64()?))
}

/// A timeline file's text: a regular file of at most 1 MiB (a FIFO or `/dev/zero` put in
/// the run's folder is skipped, never waited on or read without end).
fn small_file(path: &Path) -> Option<String> {
    let ctx = anyccl::raw::Ctx::process("anyccl-recover");
    let bytes = anyccl::raw::read_regular_file(&ctx, "read a timeline", path, 1 << 20).ok()?;
    Some(String::from_utf8_lossy(&bytes).into_owned())
}
