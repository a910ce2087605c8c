//! Flight-recorder dumps: when `ANYCCL_TRACE_DIR` is set, each rank writes every live
//! flight recorder of its process as one JSON file (`rank<R>.json`, [`TraceDump`]) when an
//! operation times out, fails or is aborted, and on SIGTERM or SIGUSR1 in programs that
//! opt in with [`dump_on_signals`] (the library never installs a signal handler by itself).
//! `anyccl-trace DIR` reads the files of every rank and says which rank is behind.

use crate::recorder::{FlightRecorder, OpState};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Version of the dump format.
pub const TRACE_FORMAT: u32 = 1;

/// One rank's dump.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TraceDump {
    /// [`TRACE_FORMAT`].
    pub format: u32,
    /// Global rank (from the launcher's variables).
    pub rank: usize,
    /// Ranks in the job (from the launcher's variables).
    pub world_size: usize,
    /// Process id.
    pub pid: u32,
    /// Host name.
    pub host: String,
    /// What made the rank dump (the timeout, error, abort or signal).
    pub reason: String,
    /// When, in milliseconds since the Unix epoch.
    pub unix_ms: u64,
    /// The first reason this process dumped for, and when: a rank that was stopped or
    /// busy notices the trouble only after the others, and only when it runs again.
    pub first_reason: String,
    /// When that was, in milliseconds since the Unix epoch.
    pub first_unix_ms: u64,
    /// The recorded operations, oldest first per recorder.
    pub records: Vec<TraceRecord>,
}

/// One recorded operation in a dump.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Group name.
    pub group: String,
    /// Rank in the group.
    pub group_rank: usize,
    /// Sequence number in the group.
    pub seq: u64,
    /// Operation.
    pub op: String,
    /// Element type.
    pub dtype: Option<String>,
    /// Elements.
    pub count: usize,
    /// Bytes.
    pub bytes: usize,
    /// Peer or root.
    pub peer: Option<usize>,
    /// `pending`, `completed`, `failed` or `dropped`.
    pub state: String,
    /// The failure, for `failed`.
    pub error: Option<String>,
    /// When it was enqueued, in milliseconds since the Unix epoch.
    pub started_unix_ms: u64,
    /// How long until completion was seen, for finished operations.
    pub elapsed_ms: Option<f64>,
}

/// When an error last caused a dump (ms since the epoch), to write one per burst.
static LAST_ERROR_DUMP: AtomicU64 = AtomicU64::new(0);
/// The first reason this process dumped for, and when.
static FIRST: std::sync::OnceLock<(u64, String)> = std::sync::OnceLock::new();

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// This process's dump, now.
pub fn snapshot(reason: &str) -> TraceDump {
    let (now, wall) = (Instant::now(), SystemTime::now());
    let first = FIRST.get_or_init(|| (unix_ms(wall), reason.to_string())).clone();
    let mut records = Vec::new();
    for r in FlightRecorder::live() {
        for o in r.snapshot() {
            let (state, error) = match o.state {
                OpState::Pending => ("pending", None),
                OpState::Completed => ("completed", None),
                OpState::Failed(e) => ("failed", Some(e)),
                OpState::Dropped => ("dropped", None),
            };
            records.push(TraceRecord {
                group: o.group.to_string(),
                group_rank: o.rank,
                seq: o.seq,
                op: o.op.to_string(),
                dtype: o.dtype.map(|d| d.name().to_string()),
                count: o.count,
                bytes: o.bytes,
                peer: o.peer,
                state: state.into(),
                error,
                started_unix_ms: unix_ms(wall - now.saturating_duration_since(o.started)),
                elapsed_ms: o.elapsed.map(|d| d.as_secs_f64() * 1e3),
            });
        }
    }
    TraceDump {
        format: TRACE_FORMAT,
        rank: crate::env::env_rank(),
        world_size: crate::env::env_world_size(),
        pid: std::process::id(),
        host: crate::env::host_name(),
        reason: reason.to_string(),
        unix_ms: unix_ms(wall),
        first_reason: first.1,
        first_unix_ms: first.0,
        records,
    }
}

/// Write this process's dump to `ANYCCL_TRACE_DIR/rank<R>.json` (replacing an earlier one),
/// when the variable is set; where it went. Failures are logged, never raised: a dump is
/// written while something else already went wrong.
pub fn dump(reason: &str) -> Option<PathBuf> {
    // A path, read as the OS gives it (any bytes a path may hold).
    let dir = PathBuf::from(std::env::var_os("ANYCCL_TRACE_DIR").filter(|d| !d.is_empty())?);
    // One writer at a time: a signal's dump and an error's may race in one process, and
    // share the temporary file.
    static WRITING: Mutex<()> = Mutex::new(());
    let _one = WRITING.lock().unwrap_or_else(|p| p.into_inner());
    let d = snapshot(reason);
    let path = dir.join(format!("rank{}.json", d.rank));
    let tmp = dir.join(format!(".rank{}.json.{}", d.rank, d.pid));
    let written = std::fs::create_dir_all(&dir)
        .and_then(|_| serde_json::to_vec_pretty(&d).map_err(std::io::Error::other))
        .and_then(|b| std::fs::write(&tmp, b))
        .and_then(|_| std::fs::rename(&tmp, &path));
    match written {
        Ok(()) => {
            tracing::info!("flight recorder dumped to {} ({reason})", path.display());
            Some(path)
        }
        Err(e) => {
            tracing::warn!("cannot write the flight recorder dump {}: {e}", path.display());
            None
        }
    }
}

/// A dump for a failed operation: at most one a second, since one failure fails every
/// queued operation after it.
pub(crate) fn dump_error(reason: &str) {
    let now = unix_ms(SystemTime::now());
    let last = LAST_ERROR_DUMP.load(Ordering::Relaxed);
    if now.saturating_sub(last) >= 1000
        && LAST_ERROR_DUMP.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    {
        dump(reason);
    }
}

/// Opt in to dumps on signals: SIGUSR1 writes a dump and the program goes on; SIGTERM
/// writes one and exits with status 143 (as the default action would have ended it).
/// For programs, not libraries: it replaces the process's handling of both signals.
///
/// # Errors
/// `Unavailable` when the handlers or their thread cannot be set up.
pub fn dump_on_signals() -> crate::Result<()> {
    use signal_hook::consts::{SIGTERM, SIGUSR1};
    let unavailable = |e: std::io::Error| {
        crate::Error::unavailable("trace", format!("cannot handle SIGTERM and SIGUSR1 for flight-recorder dumps: {e}"))
    };
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGUSR1]).map_err(unavailable)?;
    std::thread::Builder::new()
        .name("anyccl-trace-signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                if sig == SIGTERM {
                    dump("SIGTERM");
                    std::process::exit(143);
                }
                dump("SIGUSR1");
            }
        })
        .map_err(unavailable)?;
    Ok(())
}
