//! The job's processes as `/proc` shows them: which of the ranks' process groups still have a
//! live member, and every process of the job wherever it went (a group or a session of its
//! own, another parent), so that stopping the job leaves nothing behind.

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// How often a stop looks again at what is left.
const POLL: Duration = Duration::from_millis(10);
/// How long the last sweep keeps killing what appears (a process forking while it is killed).
const SWEEP: Duration = Duration::from_secs(2);

/// A process's parent, group and state letter, from `/proc/PID/stat`.
#[derive(Debug, Clone, Copy)]
pub struct Proc {
    pub pid: i32,
    pub ppid: i32,
    pub pgid: i32,
    pub state: char,
}

pub fn stat(pid: i32) -> Option<Proc> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces; the state follows it.
    let f: Vec<&str> = s.rsplit_once(')')?.1.split_whitespace().collect();
    Some(Proc { pid, state: f.first()?.chars().next()?, ppid: f.get(1)?.parse().ok()?, pgid: f.get(2)?.parse().ok()? })
}

/// Whether `pid` is stopped: by a signal (SIGSTOP, SIGTSTP) or by a debugger tracing it.
pub fn is_stopped(pid: i32) -> bool {
    stat(pid).is_some_and(|p| p.state == 'T' || p.state == 't')
}

/// Every process but zombies (a zombie has ended; only its parent's wait is left of it).
fn live() -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter_map(stat)
        .filter(|p| p.state != 'Z')
        .collect()
}

/// The groups among `groups` with a member that is not a zombie. `kill(-g, 0)` alone also
/// answers yes for a group whose members all ended but were not reaped yet, which is what a
/// launcher killed with SIGKILL leaves to whichever process inherits its ranks.
pub fn live_groups(groups: &[i32]) -> Vec<i32> {
    let maybe: Vec<i32> = groups.iter().copied().filter(|&g| kill(Pid::from_raw(-g), None).is_ok()).collect();
    if maybe.is_empty() {
        return maybe;
    }
    let live: HashSet<i32> = live().iter().map(|p| p.pgid).collect();
    maybe.into_iter().filter(|g| live.contains(g)).collect()
}

fn signal_groups(groups: &[i32], sig: Signal) {
    for &g in groups {
        let _ = kill(Pid::from_raw(-g), sig);
    }
}

/// Which processes belong to a job, beyond its ranks' process groups.
#[derive(Debug, Clone, Default)]
pub struct Job {
    /// The launcher: every process descended from it belongs to the job (a subreaper, it
    /// inherits the orphans of its ranks, so while it lives every process a rank started,
    /// in whatever group or session, descends from it).
    pub root: Option<i32>,
    /// Environment entries that, all present, mark the job's processes: `ANYCCL_JOB_ID=...`,
    /// which each rank has and passes on to what it starts, read where the processes no
    /// longer descend from the launcher (the reaper's case, once the launcher is gone); with
    /// `RANK=...` and `ANYCCL_INCARNATION=...` too, one process of a rank and what it started
    /// (elastic mode's case, before the rank's replacement starts). Empty: no mark.
    pub marks: Vec<Vec<u8>>,
    /// A process that never belongs (the reaper), nor do its descendants.
    pub keep: Option<i32>,
}

impl Job {
    /// The job's processes that are alive now (this process never among them).
    pub fn members(&self) -> Vec<i32> {
        if self.root.is_none() && self.marks.is_empty() {
            return Vec::new();
        }
        let procs = live();
        let me = std::process::id() as i32;
        let parent: HashMap<i32, i32> = procs.iter().map(|p| (p.pid, p.ppid)).collect();
        let descends = |pid: i32| {
            let Some(root) = self.root else { return false };
            let mut p = pid;
            // Bounded: /proc is read while it changes.
            for _ in 0..parent.len() {
                match parent.get(&p) {
                    Some(&pp) if pp == root => return true,
                    Some(&pp) if Some(pp) == self.keep || pp <= 1 => return false,
                    Some(&pp) => p = pp,
                    None => return false,
                }
            }
            false
        };
        let marked = |pid: i32| {
            !self.marks.is_empty()
                && std::fs::read(format!("/proc/{pid}/environ"))
                    .map(|env| self.marks.iter().all(|m| env.split(|&b| b == 0).any(|v| v == m.as_slice())))
                    .unwrap_or(false)
        };
        procs
            .iter()
            .map(|p| p.pid)
            .filter(|&pid| pid != me && Some(pid) != self.keep && Some(pid) != self.root)
            .filter(|&pid| descends(pid) || marked(pid))
            .collect()
    }
}

fn signal_each(pids: &[i32], sig: Signal) {
    for &p in pids {
        let _ = kill(Pid::from_raw(p), sig);
    }
}

/// Stop a job: SIGCONT and SIGTERM to every group in `groups` and every other process of
/// `job`, SIGKILL to whatever is left after `grace`, again until nothing is left (a process
/// may fork while it is being killed) or the sweep's time is up. What is left at the end
/// (processes that SIGKILL did not end in time): pids, and groups with a live member.
pub fn stop_job(groups: &[i32], job: &Job, grace: Duration) -> (Vec<i32>, Vec<i32>) {
    // A stopped process cannot act on SIGTERM until it runs again.
    signal_groups(groups, Signal::SIGCONT);
    signal_groups(groups, Signal::SIGTERM);
    let others = job.members();
    signal_each(&others, Signal::SIGCONT);
    signal_each(&others, Signal::SIGTERM);
    let until = Instant::now() + grace;
    let mut left_groups = live_groups(groups);
    let mut left = others;
    while (!left_groups.is_empty() || !left.is_empty()) && Instant::now() < until {
        std::thread::sleep(POLL);
        left_groups = live_groups(&left_groups);
        left = job.members();
    }
    let until = Instant::now() + SWEEP;
    loop {
        signal_groups(&left_groups, Signal::SIGKILL);
        signal_each(&left, Signal::SIGKILL);
        left_groups = live_groups(&left_groups);
        left = job.members();
        if left_groups.is_empty() && left.is_empty() || Instant::now() >= until {
            break;
        }
        std::thread::sleep(POLL);
    }
    (left, left_groups)
}
