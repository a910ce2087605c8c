//! `anyccl-run -n N [--timeout S] -- PROGRAM ARGS`: start N local ranks of PROGRAM with
//! the conventional variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//! MASTER_ADDR, MASTER_PORT), host their store, prefix each output line with the rank,
//! and when one rank fails, stop the others and exit non-zero naming it. Variables for
//! one rank only come from `ANYCCL_RANK_ENV` (see `LaunchEnv::rank_env`).
//!
//! No process of the job outlives the launcher:
//! - each rank runs in a process group of its own, and stopping a rank signals its whole
//!   group, so a rank started through a wrapper (`sh -c '...'`) takes the wrapper's
//!   children with it;
//! - SIGINT, SIGTERM and SIGHUP to the launcher stop every rank (SIGTERM, then SIGKILL after
//!   `--grace`) before it exits;
//! - a reaper process, started first and in a group of its own, holds the read end of a pipe
//!   whose write end only the launcher has: when the launcher dies in a way it cannot
//!   handle (SIGKILL), the reaper reads end of file and stops every rank's group and every
//!   process that carries the job's identity (`ANYCCL_JOB_ID`) in its environment;
//! - when the launcher exits, whatever else of the job is left (a rank's child in a group
//!   or session of its own, which the launcher inherited as a subreaper) is stopped too.
//!
//! Output is copied as bytes, cut into lines of at most `--max-line` bytes (see `output`).
#![forbid(unsafe_code)]

mod output;
mod procs;

use output::{Copying, Outputs};

use anyccl::{LaunchEnv, TcpStoreOptions, TcpStoreServer};
use clap::Parser;
use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid;
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::AtomicU64;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// The most ranks one launcher starts (the CPU backend's largest world).
const MAX_RANKS: usize = 4096;
/// Set (to the grace in seconds) when this program runs as a job's reaper.
const REAPER_ENV: &str = "ANYCCL_RUN_REAPER";
/// Stack of the launcher's helper threads: they only copy lines.
const THREAD_STACK: usize = 128 << 10;
/// How long the ranks' output may stay still (no stream ends, no byte moves) before the
/// launcher stops waiting for the rest of it.
const DRAIN: Duration = Duration::from_secs(2);
/// The longest piece of a line held by default (64 KiB).
const MAX_LINE: usize = 64 << 10;

fn seconds(what: &'static str, max: f64) -> impl Fn(&str) -> Result<f64, String> + Clone {
    move |s: &str| {
        let v: f64 = s.parse().map_err(|_| format!("{what} must be a number of seconds, not {s:?}"))?;
        if !v.is_finite() || !(0.0..=max).contains(&v) {
            return Err(format!("{what} must be between 0 and {max} seconds, not {s}"));
        }
        Ok(v)
    }
}

/// A size in bytes, with an optional K, M or G suffix (powers of 1024), up to 1 GiB.
fn line_bytes(s: &str) -> Result<usize, String> {
    anyccl::raw::parse_bytes(s)
        .filter(|n| (1..=1 << 30).contains(n))
        .ok_or_else(|| format!("--max-line must be a size in bytes such as 4096 or 64K, between 1 and 1G, not {s:?}"))
}

fn ranks(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|_| format!("-n must be a whole number of ranks, not {s:?}"))?;
    if !(1..=MAX_RANKS).contains(&n) {
        return Err(format!("-n must be between 1 and {MAX_RANKS}, not {n}"));
    }
    Ok(n)
}

#[derive(Parser, Debug)]
#[command(name = "anyccl-run", about = "Start N local ranks of a program, anyccl-style")]
struct Args {
    /// Number of ranks (1 to 4096).
    #[arg(short = 'n', long = "nprocs", value_parser = ranks)]
    n: usize,
    /// Stop every rank and fail after this many seconds (0: no limit).
    #[arg(long, default_value_t = 3600.0, value_parser = seconds("--timeout", 1e9))]
    timeout: f64,
    /// Seconds between asking ranks to stop (SIGTERM) and killing them.
    #[arg(long, default_value_t = 3.0, value_parser = seconds("--grace", 3600.0))]
    grace: f64,
    /// Do not prefix output lines with the rank.
    #[arg(long)]
    no_prefix: bool,
    /// Longest piece of an output line held before it is written out (K, M, G: powers of
    /// 1024); a longer line is written in pieces, each with the rank's prefix.
    #[arg(long, default_value_t = MAX_LINE, value_parser = line_bytes)]
    max_line: usize,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn resolve(program: &str) -> PathBuf {
    // A bare name is looked up next to this launcher first, so `anyccl-run -- anyccl-demo`
    // runs the demo built with it.
    if !program.contains('/') {
        if let Some(dir) = std::env::current_exe().ok().and_then(|p| p.parent().map(|d| d.to_path_buf())) {
            let cand = dir.join(program);
            if cand.is_file() {
                return cand;
            }
        }
    }
    PathBuf::from(program)
}

/// How a rank ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Code(i32),
    Signal(Signal),
}

impl End {
    fn success(self) -> bool {
        self == End::Code(0)
    }
    fn describe(self) -> String {
        match self {
            End::Code(c) => format!("exited with code {c}"),
            End::Signal(s) => format!("was killed by signal {} ({s})", s as i32),
        }
    }
}

enum Event {
    /// A rank's process ended.
    Exit(usize, End),
    /// The launcher received a signal.
    Signal(i32),
    /// The reaper ended before the launcher asked it to.
    ReaperGone,
}

/// "; rank 2 is stopped (...)" for each running rank that is stopped, else "".
fn stopped_note(pids: &[i32], done: &[bool]) -> String {
    let stopped: Vec<usize> =
        (0..pids.len()).filter(|&r| !done[r] && procs::stat(pids[r]).is_some_and(|p| p.state == 'T')).collect();
    match stopped.as_slice() {
        [] => String::new(),
        [r] => format!("; rank {r} is stopped (SIGSTOP or a debugger), the likely cause"),
        rs => format!("; ranks {rs:?} are stopped (SIGSTOP or a debugger), the likely cause"),
    }
}

/// Stop every rank still running (its whole group), and note their exits.
fn stop_all(pids: &[i32], done: &mut [bool], rx: &mpsc::Receiver<Event>, grace: Duration) {
    let running: Vec<i32> = (0..pids.len()).filter(|&r| !done[r]).map(|r| pids[r]).collect();
    procs::stop_job(&running, &procs::Job::default(), grace);
    let until = Instant::now() + Duration::from_secs(5);
    while done.iter().any(|d| !d) {
        let Some(left) = until.checked_duration_since(Instant::now()) else { break };
        match rx.recv_timeout(left) {
            Ok(Event::Exit(r, _)) => done[r] = true,
            Ok(_) => {}
            Err(_) => break,
        }
    }
}

/// The job's reaper (see the crate doc): reads the job's identity (`job ID`) and the ranks'
/// process groups, one a line, from standard input; `done` means the launcher finished and
/// stopped them itself.
fn reaper(grace: Duration) -> ExitCode {
    let _ = nix::sys::prctl::set_name(c"anyccl-reaper");
    let mut groups = Vec::new();
    let mut job = procs::Job::default();
    for line in std::io::stdin().lock().lines() {
        match line.as_deref().map(str::trim) {
            Ok("done") => return ExitCode::SUCCESS,
            Ok(l) => match l.strip_prefix("job ") {
                Some(id) => job.mark = Some(format!("ANYCCL_JOB_ID={id}").into_bytes()),
                None => groups.extend(l.parse::<i32>().ok().filter(|&g| g > 1)),
            },
            Err(_) => break,
        }
    }
    // The groups are signalled first, before anything that reads /proc.
    if groups.iter().any(|&g| kill(Pid::from_raw(-g), None).is_ok()) {
        eprintln!("anyccl-run: the launcher died; stopping the job");
    }
    procs::stop_job(&groups, &job, grace);
    ExitCode::from(1)
}

fn main() -> ExitCode {
    let secs = |s: &str| s.parse::<f64>().ok().and_then(|g| Duration::try_from_secs_f64(g).ok());
    match anyccl::raw::env_parse(REAPER_ENV, "the job's grace in seconds", secs) {
        Ok(Some(grace)) => return reaper(grace),
        Ok(None) => {}
        Err(e) => {
            eprintln!("anyccl-run: {e}");
            return ExitCode::from(2);
        }
    }
    let args = Args::parse();
    match launch(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err((msg, code)) => {
            eprintln!("anyccl-run: FAILED: {msg}");
            ExitCode::from(code)
        }
    }
}

/// Pick the failed rank to name first among `failed`: a rank whose way of failing no other
/// rank shares (peers that fail because of it tend to fail alike), else the earliest end
/// of output, else the order of reaping. Every failed rank is named.
fn blame(failed: &[(usize, End)], ended: &[Option<Instant>]) -> String {
    let how: Vec<String> = failed.iter().map(|(_, e)| e.describe()).collect();
    let unique: Vec<usize> = (0..failed.len()).filter(|&i| how.iter().filter(|h| **h == how[i]).count() == 1).collect();
    let pick = if unique.len() == 1 && failed.len() > 1 {
        unique[0]
    } else {
        (0..failed.len()).min_by_key(|&i| (ended[failed[i].0].is_none(), ended[failed[i].0], i)).unwrap_or(0)
    };
    let mut f = format!("rank {} {}", failed[pick].0, how[pick]);
    let others: Vec<String> =
        (0..failed.len()).filter(|&i| i != pick).map(|i| format!("rank {} {}", failed[i].0, how[i])).collect();
    if !others.is_empty() {
        f.push_str(&format!(" (also failed: {})", others.join(", ")));
    }
    f
}

fn launch(args: &Args) -> Result<(), (String, u8)> {
    let setup = |msg: String| (msg, 2u8);
    let grace = Duration::from_secs_f64(args.grace);
    // Checked once here: a malformed entry is the same for every rank.
    LaunchEnv::rank_env(0).map_err(|e| setup(e.to_string()))?;
    let token = format!("{:032x}", rand::random::<u128>());
    let job_id = format!("{:016x}", rand::random::<u64>());
    let opts = TcpStoreOptions { token: Some(token.clone()), ..Default::default() };
    let server = TcpStoreServer::start(([127, 0, 0, 1], 0).into(), opts)
        .map_err(|e| setup(format!("cannot host the store: {e}")))?;

    // Signals first, so none arriving while ranks start is lost.
    let (tx, rx) = mpsc::channel::<Event>();
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ])
    .map_err(|e| setup(format!("cannot handle signals: {e}")))?;
    let stx = tx.clone();
    std::thread::Builder::new()
        .stack_size(THREAD_STACK)
        .spawn(move || {
            for s in signals.forever() {
                let _ = stx.send(Event::Signal(s));
            }
        })
        .map_err(|e| setup(format!("cannot start a thread: {e}")))?;

    // Orphaned descendants of a rank (a wrapper shell's children) are re-parented to the
    // launcher and reaped by its waiter, so a stopped group empties at once.
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        tracing::debug!("cannot become a child subreaper: {e}");
    }
    let me = std::env::current_exe().map_err(|e| setup(format!("cannot find this program: {e}")))?;
    let mut reaper = Command::new(me)
        .arg0("anyccl-reaper")
        // The reaper acts when nobody watches: it ends the job within 3 s whatever --grace says.
        .env(REAPER_ENV, args.grace.min(3.0).to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| setup(format!("cannot start the job's reaper: {e}")))?;
    let reaper_pid = reaper.id() as i32;
    let mut reaper_in = reaper.stdin.take();
    // The job's identity first: once the launcher is gone, it is how the reaper knows the
    // processes that left their rank's group.
    if let Some(w) = reaper_in.as_mut() {
        let _ = writeln!(w, "job {job_id}");
    }
    let copying = Copying { prefix: !args.no_prefix, max_line: args.max_line, moved: Arc::new(AtomicU64::new(0)) };

    let program = resolve(&args.command[0]);
    let (ended_tx, ended_rx) = mpsc::channel::<(usize, Instant)>();
    let mut pids: Vec<i32> = Vec::new();
    let mut pumps = 0usize;
    let mut start_err = None;
    for rank in 0..args.n {
        let child = Command::new(&program)
            .args(&args.command[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", args.n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", args.n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", server.local_addr().port().to_string())
            .env("ANYCCL_STORE_EXTERNAL", "1")
            .env("ANYCCL_STORE_TOKEN", &token)
            .env("ANYCCL_JOB_ID", &job_id)
            .envs(LaunchEnv::rank_env(rank).unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn();
        let mut c = match child {
            Ok(c) => c,
            Err(e) => {
                start_err = Some(format!("cannot start rank {rank} ({}): {e}", program.display()));
                break;
            }
        };
        let pid = c.id() as i32;
        pids.push(pid);
        if let Some(w) = reaper_in.as_mut() {
            if writeln!(w, "{pid}").and_then(|_| w.flush()).is_err() {
                start_err = Some("the job's reaper ended early".into());
                break;
            }
        }
        let outs: [(Option<Box<dyn std::io::Read + Send>>, bool); 2] = [
            (c.stdout.take().map(|o| Box::new(o) as Box<dyn std::io::Read + Send>), false),
            (c.stderr.take().map(|e| Box::new(e) as Box<dyn std::io::Read + Send>), true),
        ];
        for (stream, to_err) in outs {
            let Some(stream) = stream else { continue };
            match output::pump(rank, &copying, stream, to_err, ended_tx.clone()) {
                Ok(()) => pumps += 1,
                Err(e) => start_err = Some(format!("cannot start a thread for rank {rank}'s output: {e}")),
            }
        }
        if start_err.is_some() {
            break;
        }
    }

    // One waiter for every child: exits arrive in the order they happen, so the rank that
    // failed first is the one named, not a peer that failed because of it.
    let rank_of: HashMap<i32, usize> = pids.iter().enumerate().map(|(r, &p)| (p, r)).collect();
    let wtx = tx.clone();
    let waiter = std::thread::Builder::new().stack_size(THREAD_STACK).spawn(move || loop {
        match waitpid(None, None) {
            Ok(WaitStatus::Exited(pid, code)) => {
                let ev = match rank_of.get(&pid.as_raw()) {
                    Some(&r) => Event::Exit(r, End::Code(code)),
                    None if pid.as_raw() == reaper_pid => Event::ReaperGone,
                    None => continue,
                };
                let _ = wtx.send(ev);
            }
            Ok(WaitStatus::Signaled(pid, sig, _)) => {
                let ev = match rank_of.get(&pid.as_raw()) {
                    Some(&r) => Event::Exit(r, End::Signal(sig)),
                    None if pid.as_raw() == reaper_pid => Event::ReaperGone,
                    None => continue,
                };
                let _ = wtx.send(ev);
            }
            Ok(_) | Err(Errno::EINTR) => {}
            Err(_) => break,
        }
    });
    if let Err(e) = waiter {
        start_err = Some(format!("cannot start the waiter thread: {e}"));
    }

    let mut done = vec![false; pids.len()];
    let mut outputs =
        Outputs { rx: ended_rx, seen: 0, first_end: vec![None; pids.len()], moved: copying.moved.clone() };
    let verdict: Result<(), (String, u8)> = if let Some(msg) = start_err {
        eprintln!("anyccl-run: {msg}; stopping the ranks started");
        stop_all(&pids, &mut done, &rx, Duration::ZERO);
        Err(setup(msg))
    } else {
        supervise(args, &pids, &mut done, &rx, &mut outputs, grace)
    };

    // Whatever the verdict, no process of the job stays: every rank's group is stopped (a
    // rank that exited may have left children behind), and so is every other process that
    // descends from the launcher but the reaper (a rank's child in a group or session of its
    // own, which the launcher inherited as a subreaper when its parent ended).
    let job = procs::Job { root: Some(std::process::id() as i32), mark: None, keep: Some(reaper_pid) };
    let (pids_left, groups_left) = procs::stop_job(&pids, &job, grace.min(Duration::from_secs(2)));
    if !pids_left.is_empty() || !groups_left.is_empty() {
        eprintln!("anyccl-run: processes {pids_left:?} and groups {groups_left:?} of the job outlived SIGKILL");
    }
    if let Some(mut w) = reaper_in.take() {
        let _ = writeln!(w, "done");
    }
    let _ = kill(Pid::from_raw(reaper_pid), None);
    // What is still in the ranks' pipes, for as long as it moves.
    outputs.drain(pumps, DRAIN);
    drop(server);
    verdict
}

/// Wait for the ranks; on the first failure, the launcher's timeout or a signal, stop the
/// others and say why.
fn supervise(
    args: &Args,
    pids: &[i32],
    done: &mut [bool],
    rx: &mpsc::Receiver<Event>,
    outputs: &mut Outputs,
    grace: Duration,
) -> Result<(), (String, u8)> {
    let n = pids.len();
    let started = Instant::now();
    let limit = (args.timeout > 0.0).then(|| Duration::from_secs_f64(args.timeout));
    loop {
        if done.iter().all(|d| *d) {
            return Ok(());
        }
        let wait = match limit {
            Some(l) => match l.checked_sub(started.elapsed()) {
                Some(left) => left,
                None => {
                    let running: Vec<usize> = (0..n).filter(|&r| !done[r]).collect();
                    let msg = format!(
                        "timed out after {l:.0?}; ranks {running:?} were still running{}",
                        stopped_note(pids, done)
                    );
                    eprintln!("anyccl-run: {msg}; stopping them");
                    stop_all(pids, done, rx, grace);
                    return Err((msg, 1));
                }
            },
            None => Duration::from_secs(3600),
        };
        match rx.recv_timeout(wait) {
            Ok(Event::Exit(rank, end)) => {
                done[rank] = true;
                if end.success() {
                    continue;
                }
                // Other ranks may be failing because of this one, or this one because of
                // another reaped later: gather exits for a moment, then name one.
                let mut failed = vec![(rank, end)];
                let until = Instant::now() + Duration::from_millis(300);
                while let Some(left) = until.checked_duration_since(Instant::now()) {
                    match rx.recv_timeout(left) {
                        Ok(Event::Exit(r, e2)) => {
                            done[r] = true;
                            if !e2.success() {
                                failed.push((r, e2));
                            }
                        }
                        Ok(_) => {}
                        Err(_) => break,
                    }
                }
                outputs.poll();
                let f = format!("{}{}", blame(&failed, &outputs.first_end), stopped_note(pids, done));
                let running: Vec<usize> = (0..n).filter(|&r| !done[r]).collect();
                eprintln!("anyccl-run: {f}; stopping ranks {running:?}");
                stop_all(pids, done, rx, grace);
                return Err((f, 1));
            }
            Ok(Event::Signal(sig)) => {
                let name = Signal::try_from(sig).map(|s| s.as_str()).unwrap_or("a signal");
                let running: Vec<usize> = (0..n).filter(|&r| !done[r]).collect();
                eprintln!("anyccl-run: received {name}; stopping ranks {running:?}");
                stop_all(pids, done, rx, grace);
                return Err((format!("stopped by {name}"), 128u8.saturating_add(sig as u8)));
            }
            Ok(Event::ReaperGone) => {
                let msg = "the job's reaper ended; without it ranks could outlive this launcher".to_string();
                eprintln!("anyccl-run: {msg}; stopping every rank");
                stop_all(pids, done, rx, grace);
                return Err((msg, 1));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(("lost track of the ranks".into(), 1)),
        }
    }
}
