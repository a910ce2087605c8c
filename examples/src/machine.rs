//! What this machine can give a run, read before the run starts, so that a run it cannot
//! hold is refused with the figures instead of aborting on an allocation or waiting on a
//! store it can never reach: available memory, the open-file limit, the loopback port range;
//! and a folder's lock, so that two runs never write one output folder at once.

use anyccl::raw::{env_parse, parse_bytes, Ctx};
use anyccl::{Error, Result};
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

/// The setting that caps the memory these programs count as available (bytes, with K, M or
/// G): for tests, and for machines shared with other jobs.
pub const MEM_LIMIT_VAR: &str = "ANYCCL_MEM_LIMIT";

/// Memory a run may count on, and where the figure comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Available {
    /// Bytes.
    pub bytes: u64,
    /// What said so, for messages.
    pub source: &'static str,
}

impl std::fmt::Display for Available {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} available ({})", size(self.bytes), self.source)
    }
}

/// `bytes` for people: GiB, MiB or KiB with one decimal, or bytes.
pub fn size(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        _ if bytes >= 1 << 30 => format!("{:.1} GiB", b / (1u64 << 30) as f64),
        _ if bytes >= 1 << 20 => format!("{:.1} MiB", b / (1u64 << 20) as f64),
        _ if bytes >= 1 << 10 => format!("{:.1} KiB", b / 1024.0),
        _ => format!("{bytes} B"),
    }
}

/// `ANYCCL_MEM_LIMIT`, when set.
///
/// # Errors
/// `InvalidArgument` naming the variable, its value and the rank when it is not a size.
pub fn memory_limit() -> Result<Option<u64>> {
    let expected = "a byte count above 0 (a whole number with an optional K, M or G)";
    let limit = env_parse(MEM_LIMIT_VAR, expected, |s| parse_bytes(s).filter(|&b| b > 0))?;
    Ok(limit.map(|b| b as u64))
}

/// Host memory a run may count on: `MemAvailable` of `/proc/meminfo`, or `ANYCCL_MEM_LIMIT`
/// where that is lower. `None` where neither says (no `/proc/meminfo`): nothing to check.
///
/// # Errors
/// A malformed `ANYCCL_MEM_LIMIT`.
pub fn host_available() -> Result<Option<Available>> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| {
        let line = t.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(Available { bytes: kib.saturating_mul(1024), source: "MemAvailable in /proc/meminfo" })
    });
    Ok(capped(meminfo, memory_limit()?))
}

/// `measured`, or the limit where that is lower (or where nothing was measured).
pub fn capped(measured: Option<Available>, limit: Option<u64>) -> Option<Available> {
    let limit = limit.map(|bytes| Available { bytes, source: "ANYCCL_MEM_LIMIT" });
    match (measured, limit) {
        (Some(m), Some(l)) if l.bytes < m.bytes => Some(l),
        (Some(m), _) => Some(m),
        (None, l) => l,
    }
}

/// This process's open-file limit: (soft, hard); `None` where it cannot be read.
pub fn open_file_limit() -> Option<(u64, u64)> {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).ok()
}

/// Raise this process's open-file soft limit to `want` where the hard limit allows it
/// (child processes inherit it). Returns the limit now in force: (soft, hard).
pub fn raise_open_file_limit(want: u64) -> Option<(u64, u64)> {
    use nix::sys::resource::{setrlimit, Resource};
    let (soft, hard) = open_file_limit()?;
    if soft >= want || hard <= soft {
        return Some((soft, hard));
    }
    let to = want.min(hard);
    match setrlimit(Resource::RLIMIT_NOFILE, to, hard) {
        Ok(()) => Some((to, hard)),
        Err(_) => Some((soft, hard)),
    }
}

/// The local port range clients' connections take their ports from
/// (`net.ipv4.ip_local_port_range`): connections from one address to one server address
/// are at most its size.
pub fn local_port_range() -> Option<(u32, u32)> {
    let t = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut it = t.split_whitespace().map(|v| v.parse::<u32>().ok());
    let (lo, hi) = (it.next()??, it.next()??);
    (lo <= hi).then_some((lo, hi))
}

/// A folder held by one run: an exclusive `flock(2)` on a lock file in it, released when
/// this is dropped or when the process ends in any way (kill -9 included).
#[derive(Debug)]
pub struct DirLock {
    _held: nix::fcntl::Flock<File>,
    path: PathBuf,
}

impl DirLock {
    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Hold `dir` (created where missing) for this run of `tool`: a second run on the same
/// folder is refused at once, naming the folder and the process that holds it.
///
/// # Errors
/// `InvalidArgument` naming `arg` when another process holds the folder; `arg` too when the
/// folder or its lock file cannot be made.
pub fn lock_dir(dir: &Path, tool: &str, arg: &'static str) -> Result<DirLock> {
    use nix::fcntl::{Flock, FlockArg};
    let path = dir.join(format!(".{tool}.lock"));
    let open = || -> std::io::Result<File> {
        std::fs::create_dir_all(dir)?;
        std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path)
    };
    let file = open().map_err(|e| refused(arg, format!("cannot make the lock file {}: {e}", path.display())))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(mut held) => {
            // Who holds it, for the message of a run refused meanwhile.
            let _ = held.set_len(0).and_then(|()| held.rewind()).and_then(|()| {
                let me = format!("{}\n", std::process::id());
                held.write_all(me.as_bytes())
            });
            Ok(DirLock { _held: held, path })
        }
        Err((mut file, errno)) if errno == nix::errno::Errno::EWOULDBLOCK => {
            let mut pid = String::new();
            let _ = file.read_to_string(&mut pid);
            let by = match pid.trim().parse::<u32>() {
                Ok(p) => format!("process {p}"),
                Err(_) => "another process".to_string(),
            };
            Err(refused(
                arg,
                format!(
                    "{} is in use by {by} (it holds {}): wait for that run to end, or choose another folder",
                    dir.display(),
                    path.display()
                ),
            ))
        }
        Err((_, errno)) => Err(refused(arg, format!("cannot lock {}: {errno}", path.display()))),
    }
}

/// A run refused before it starts, naming the flag or setting to change.
fn refused(arg: &'static str, msg: String) -> Error {
    Ctx::process("anyccl-examples").invalid("start", arg, msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lower_of_measured_and_limit_counts() {
        let m = Some(Available { bytes: 100, source: "MemAvailable in /proc/meminfo" });
        assert_eq!(capped(m, Some(50)).map(|a| (a.bytes, a.source)), Some((50, "ANYCCL_MEM_LIMIT")));
        assert_eq!(capped(m, Some(500)), m);
        assert_eq!(capped(None, Some(7)).map(|a| a.bytes), Some(7));
        assert_eq!(capped(None, None), None);
        assert_eq!(size(64 << 30), "64.0 GiB");
        assert_eq!(size(1536), "1.5 KiB");
    }

    #[test]
    fn a_second_lock_on_a_folder_is_refused_naming_the_holder() {
        let dir = std::env::temp_dir().join(format!("anyccl-lock-unit-{}", std::process::id()));
        let first = lock_dir(&dir, "t", "--out").expect("first lock");
        let second = lock_dir(&dir, "t", "--out").expect_err("second lock on the same folder");
        let text = second.to_string();
        assert!(text.contains("--out") && text.contains(&format!("process {}", std::process::id())), "{text}");
        drop(first);
        let again = lock_dir(&dir, "t", "--out");
        assert!(again.is_ok(), "not released on drop: {again:?}");
        drop(again);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
