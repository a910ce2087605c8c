//! The job's ranks: starting a rank's process (its first, or a replacement in elastic mode)
//! with the job's variables, its output copied and its process group told to the reaper; and
//! which process is each rank's newest.

use crate::bind::Binding;
use crate::output::{self, Copying, Ended};
use anyccl::LaunchEnv;
use nix::sys::signal::Signal;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc;

/// How a rank's process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    Code(i32),
    Signal(Signal),
}

impl End {
    pub fn success(self) -> bool {
        self == End::Code(0)
    }
    pub fn describe(self) -> String {
        match self {
            End::Code(c) => format!("exited with code {c}"),
            End::Signal(s) => format!("was killed by signal {} ({s})", s as i32),
        }
    }
}

/// A rank's newest process.
#[derive(Debug, Clone, Copy)]
pub struct Slot {
    pub pid: i32,
    /// 1 for the rank's first process, 2 for its first replacement.
    pub incarnation: u64,
    /// The process ended (and is not being replaced).
    pub done: bool,
    /// Elastic mode: the job's membership declared the process gone, and the launcher
    /// killed it (its exit is then handled as any failure).
    pub declared: bool,
}

/// Every rank's newest process.
#[derive(Debug, Default)]
pub struct Ranks {
    pub slots: Vec<Slot>,
}

impl Ranks {
    /// The rank whose newest process, still running, is `pid`: none for a process the
    /// launcher reaped as a subreaper (a rank's orphaned child).
    pub fn rank_of(&self, pid: i32) -> Option<usize> {
        self.slots.iter().position(|s| s.pid == pid && !s.done)
    }
    pub fn running(&self) -> Vec<usize> {
        (0..self.slots.len()).filter(|&r| !self.slots[r].done).collect()
    }
    pub fn running_pids(&self) -> Vec<i32> {
        self.slots.iter().filter(|s| !s.done).map(|s| s.pid).collect()
    }
    pub fn all_done(&self) -> bool {
        self.slots.iter().all(|s| s.done)
    }
    /// "rank 3", or "rank 3 (incarnation 2)" for a replacement.
    pub fn name(&self, rank: usize) -> String {
        match self.slots.get(rank).map(|s| s.incarnation) {
            None | Some(1) => format!("rank {rank}"),
            Some(i) => format!("rank {rank} (incarnation {i})"),
        }
    }
}

/// What each rank's process gets, and where what it prints goes.
pub struct Starter {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub world: usize,
    pub port: u16,
    pub token: String,
    pub job_id: String,
    /// Elastic mode: every process learns its incarnation (`ANYCCL_INCARNATION`).
    pub elastic: bool,
    pub copying: Copying,
    pub ended: mpsc::Sender<Ended>,
    /// The reaper's standard input: each process group started is written to it.
    pub reaper: Option<ChildStdin>,
    /// Output streams being copied: a drain waits for the end of each.
    pub pumps: usize,
    /// The process group of every process started, replaced ones too: what the launcher
    /// stops before it exits.
    pub groups: Vec<i32>,
    /// Each rank's CPUs (`--bind`); `None`: where the kernel puts it.
    pub binding: Option<Binding>,
}

impl Starter {
    /// Start incarnation `incarnation` of `rank` in a process group of its own; its pid. A
    /// process that started is in `groups` even when what follows fails.
    ///
    /// # Errors
    /// A message naming the rank: the program cannot be started, a thread for its output
    /// cannot, or the reaper is gone.
    pub fn start(&mut self, rank: usize, incarnation: u64) -> Result<i32, String> {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", self.world.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", self.world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", self.port.to_string())
            .env("ANYCCL_STORE_EXTERNAL", "1")
            .env("ANYCCL_STORE_TOKEN", &self.token)
            .env("ANYCCL_JOB_ID", &self.job_id)
            .envs(LaunchEnv::rank_env(rank).unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        if self.elastic {
            cmd.env("ANYCCL_INCARNATION", incarnation.to_string());
        }
        let which = match incarnation {
            1 => format!("rank {rank}"),
            i => format!("rank {rank}'s incarnation {i}"),
        };
        let (spawned, unbound) = match &self.binding {
            Some(b) => b.spawning(rank, || cmd.spawn()),
            None => (cmd.spawn(), None),
        };
        if let Some(why) = unbound {
            tracing::debug!("{which}: {why}");
        }
        let mut c = spawned.map_err(|e| format!("cannot start {which} ({}): {e}", self.program.display()))?;
        let pid = c.id() as i32;
        self.groups.push(pid);
        if let Some(w) = self.reaper.as_mut() {
            if writeln!(w, "{pid}").and_then(|_| w.flush()).is_err() {
                return Err("the job's reaper ended early".into());
            }
        }
        let outs: [(Option<Box<dyn std::io::Read + Send>>, bool); 2] = [
            (c.stdout.take().map(|o| Box::new(o) as Box<dyn std::io::Read + Send>), false),
            (c.stderr.take().map(|e| Box::new(e) as Box<dyn std::io::Read + Send>), true),
        ];
        let mut err = None;
        for (stream, to_err) in outs {
            let Some(stream) = stream else { continue };
            match output::pump((rank, incarnation), &self.copying, stream, to_err, self.ended.clone()) {
                Ok(()) => self.pumps += 1,
                Err(e) => err = Some(format!("cannot start a thread for {which}'s output: {e}")),
            }
        }
        err.map_or(Ok(pid), Err)
    }

    /// Tell the reaper the job's identity (first, before any group).
    pub fn tell_reaper_job(&mut self) {
        if let Some(w) = self.reaper.as_mut() {
            let _ = writeln!(w, "job {}", self.job_id).and_then(|_| w.flush());
        }
    }

    /// Tell the reaper that the launcher stopped the job itself, and let it go.
    pub fn release_reaper(&mut self) {
        if let Some(mut w) = self.reaper.take() {
            let _ = writeln!(w, "done");
        }
    }
}
