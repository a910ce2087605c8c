//! `anyccl-run -n N [--timeout S] [--bind cpus|none] [--elastic [--max-restarts K]] --
//! PROGRAM ARGS`: start N local ranks of PROGRAM with the conventional variables (RANK,
//! WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), host their store,
//! prefix each output line with the rank, and when one rank fails, stop the others and exit
//! non-zero naming it.
//! Variables for one rank only come from `ANYCCL_RANK_ENV` (see `LaunchEnv::rank_env`).
//!
//! With `--elastic`, a rank that fails while the job has restarts left (K, 3 by default,
//! counted for the whole job) is reported gone to the job's membership and started again as
//! its next incarnation (`ANYCCL_INCARNATION`), the others running on (see `elastic`).
//! Between the two, what is left of the failed process (its group, and whatever it started
//! elsewhere that carries its job, rank and incarnation) is killed, so nothing of the old
//! incarnation runs beside the new one. A process that the membership declares gone on its
//! own evidence (its liveness record went stale: stopped with SIGSTOP, say, which no exit
//! reports) is killed with its whole group and replaced the same way. The job succeeds when
//! every rank's newest process exits 0.
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
//! Each rank starts bound to its share of the launcher's CPUs where the ranks do not
//! outnumber them (see `bind`).
//!
//! Module ladder: `output`, `procs` and `bind` at the foot; `ranks` on `output` and `bind`;
//! `elastic` on `ranks`; this file on everything.
#![forbid(unsafe_code)]

mod bind;
mod elastic;
mod output;
mod procs;
mod ranks;
mod stall;

use anyccl_examples::errln;
use elastic::{Elastic, Gone};
use output::{Copying, Outputs};
use ranks::{End, Ranks, Slot, Starter};

use anyccl::membership::Member;
use anyccl::{LaunchEnv, TcpStoreOptions, TcpStoreServer};
use clap::Parser;
use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid;
use std::io::BufRead;
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
    /// Recovery in place: a rank that fails is reported gone to the job's membership and
    /// started again (its next ANYCCL_INCARNATION) while the others run on, as long as the
    /// job has restarts left.
    #[arg(long)]
    elastic: bool,
    /// Where ranks run: `cpus` gives each rank its share of the CPUs this launcher may use
    /// (contiguous, as even as they can be, as mpirun binds its ranks), where the ranks do not
    /// outnumber them; `none` leaves every rank to the kernel, which at times puts two busy
    /// ranks on one CPU for seconds while another idles (each exchange then waits for the
    /// other's turn: 4 us a small all_reduce on 2 cores instead of 0.26).
    #[arg(long, value_enum, default_value_t = bind::Bind::Cpus)]
    bind: bind::Bind,
    /// Restarts the whole job may use with --elastic (0 to 1000; default 3).
    #[arg(long, value_name = "K", value_parser = elastic::restarts, allow_hyphen_values = true)]
    max_restarts: Option<u32>,
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

enum Event {
    /// A child of the launcher ended: a rank's process, or an orphan it inherited.
    Exit(i32, End),
    /// The launcher received a signal.
    Signal(i32),
    /// The reaper ended before the launcher asked it to.
    ReaperGone,
}

/// "; rank 2 is stopped (...)" for each running rank that is stopped, else "".
fn stopped_note(ranks: &Ranks) -> String {
    let stopped: Vec<usize> = ranks.running().into_iter().filter(|&r| procs::is_stopped(ranks.slots[r].pid)).collect();
    match stopped.as_slice() {
        [] => String::new(),
        [r] => format!("; rank {r} is stopped (SIGSTOP or a debugger), the likely cause"),
        rs => format!("; ranks {rs:?} are stopped (SIGSTOP or a debugger), the likely cause"),
    }
}

/// Stop every rank still running (its whole group), and note their exits.
fn stop_all(ranks: &mut Ranks, rx: &mpsc::Receiver<Event>, grace: Duration) {
    procs::stop_job(&ranks.running_pids(), &procs::Job::default(), grace);
    let until = Instant::now() + Duration::from_secs(5);
    while !ranks.all_done() {
        let Some(left) = until.checked_duration_since(Instant::now()) else { break };
        match rx.recv_timeout(left) {
            Ok(Event::Exit(pid, _)) => {
                if let Some(r) = ranks.rank_of(pid) {
                    ranks.slots[r].done = true;
                }
            }
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
                Some(id) => job.marks = vec![format!("ANYCCL_JOB_ID={id}").into_bytes()],
                None => groups.extend(l.parse::<i32>().ok().filter(|&g| g > 1)),
            },
            Err(_) => break,
        }
    }
    // The groups are signalled first, before anything that reads /proc.
    if groups.iter().any(|&g| kill(Pid::from_raw(-g), None).is_ok()) {
        errln!("anyccl-run: the launcher died; stopping the job");
    }
    procs::stop_job(&groups, &job, grace);
    ExitCode::from(1)
}

fn main() -> ExitCode {
    // Output that could not be written fails the run, and says so.
    anyccl_examples::out::finish("anyccl-run", program())
}

fn program() -> ExitCode {
    let secs = |s: &str| s.parse::<f64>().ok().and_then(|g| Duration::try_from_secs_f64(g).ok());
    match anyccl::raw::env_parse(REAPER_ENV, "the job's grace in seconds", secs) {
        Ok(Some(grace)) => return reaper(grace),
        Ok(None) => {}
        Err(e) => {
            errln!("anyccl-run: {e}");
            return ExitCode::from(2);
        }
    }
    let args = Args::parse();
    if args.max_restarts.is_some() && !args.elastic {
        errln!(
            "anyccl-run: --max-restarts needs --elastic (without --elastic a failed rank ends the job, and nothing \
             is restarted)"
        );
        return ExitCode::from(2);
    }
    match launch(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err((msg, code)) => {
            errln!("anyccl-run: FAILED: {msg}");
            ExitCode::from(code)
        }
    }
}

/// Pick the failed rank to name first among `failed`: a rank whose way of failing no other
/// rank shares (peers that fail because of it tend to fail alike), else the earliest end
/// of output, else the order of reaping. Every failed rank is named (`name`: "rank 3", or
/// "rank 3 (incarnation 2)" for a replacement).
fn blame(failed: &[(usize, End)], ended: &[Option<Instant>], name: impl Fn(usize) -> String) -> String {
    let how: Vec<String> = failed.iter().map(|(_, e)| e.describe()).collect();
    let unique: Vec<usize> = (0..failed.len()).filter(|&i| how.iter().filter(|h| **h == how[i]).count() == 1).collect();
    let pick = if unique.len() == 1 && failed.len() > 1 {
        unique[0]
    } else {
        (0..failed.len()).min_by_key(|&i| (ended[failed[i].0].is_none(), ended[failed[i].0], i)).unwrap_or(0)
    };
    let mut f = format!("{} {}", name(failed[pick].0), how[pick]);
    let others: Vec<String> =
        (0..failed.len()).filter(|&i| i != pick).map(|i| format!("{} {}", name(failed[i].0), how[i])).collect();
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
    // Elastic mode's settings (the membership's, from the environment) are checked before
    // any rank starts: the ranks would refuse a malformed one too.
    let elastic = match args.elastic {
        true => Some(
            Elastic::new(args.max_restarts.unwrap_or(elastic::DEFAULT_RESTARTS), server.local_addr(), &token)
                .map_err(setup)?,
        ),
        false => None,
    };

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
    let (ended_tx, ended_rx) = mpsc::channel();
    let mut starter = Starter {
        program: resolve(&args.command[0]),
        args: args.command[1..].to_vec(),
        world: args.n,
        port: server.local_addr().port(),
        token,
        job_id,
        elastic: args.elastic,
        copying: Copying { prefix: !args.no_prefix, max_line: args.max_line, moved: Arc::new(AtomicU64::new(0)) },
        ended: ended_tx,
        reaper: reaper.stdin.take(),
        pumps: 0,
        groups: Vec::new(),
        binding: match args.bind {
            bind::Bind::Cpus => {
                bind::Binding::new(args.n).inspect_err(|why| tracing::debug!("ranks not bound: {why}")).ok()
            }
            bind::Bind::None => None,
        },
    };
    // The job's identity first: once the launcher is gone, it is how the reaper knows the
    // processes that left their rank's group.
    starter.tell_reaper_job();
    let mut ranks = Ranks::default();
    let mut start_err = None;
    for rank in 0..args.n {
        match starter.start(rank, 1) {
            Ok(pid) => ranks.slots.push(Slot { pid, incarnation: 1, done: false, declared: false }),
            Err(e) => {
                start_err = Some(e);
                break;
            }
        }
    }

    // One waiter for every child: exits arrive in the order they happen, so the rank that
    // failed first is the one named, not a peer that failed because of it. Which rank a
    // process was is looked up where the exit is handled, where replacements are started.
    let wtx = tx.clone();
    let waiter = std::thread::Builder::new().stack_size(THREAD_STACK).spawn(move || loop {
        let (pid, end) = match waitpid(None, None) {
            Ok(WaitStatus::Exited(pid, code)) => (pid.as_raw(), End::Code(code)),
            Ok(WaitStatus::Signaled(pid, sig, _)) => (pid.as_raw(), End::Signal(sig)),
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(_) => break,
        };
        let _ = wtx.send(if pid == reaper_pid { Event::ReaperGone } else { Event::Exit(pid, end) });
    });
    if let Err(e) = waiter {
        start_err = Some(format!("cannot start the waiter thread: {e}"));
    }

    let outputs = Outputs::new(ended_rx, args.n, starter.copying.moved.clone());
    let mut job = Supervisor { args, ranks, starter, elastic, rx, outputs, grace, stops: stall::StopWatch::new() };
    let verdict: Result<(), (String, u8)> = if let Some(msg) = start_err {
        errln!("anyccl-run: {msg}; stopping the ranks started");
        stop_all(&mut job.ranks, &job.rx, Duration::ZERO);
        Err(setup(msg))
    } else {
        job.supervise()
    };

    // Whatever the verdict, no process of the job stays: every group ever started is stopped
    // (a rank that exited may have left children behind), and so is every other process
    // that descends from the launcher but the reaper (a rank's child in a group or session
    // of its own, which the launcher inherited as a subreaper when its parent ended).
    let me = procs::Job { root: Some(std::process::id() as i32), marks: Vec::new(), keep: Some(reaper_pid) };
    let (pids_left, groups_left) = procs::stop_job(&job.starter.groups, &me, grace.min(Duration::from_secs(2)));
    if !pids_left.is_empty() || !groups_left.is_empty() {
        errln!("anyccl-run: processes {pids_left:?} and groups {groups_left:?} of the job outlived SIGKILL");
    }
    job.starter.release_reaper();
    let _ = kill(Pid::from_raw(reaper_pid), None);
    // What is still in the ranks' pipes, for as long as it moves.
    job.outputs.drain(job.starter.pumps, DRAIN);
    drop(server);
    verdict
}

/// A running job: its ranks, how to start one again, and what it hears.
struct Supervisor<'a> {
    args: &'a Args,
    ranks: Ranks,
    starter: Starter,
    /// Elastic mode: restarts left, and the way to the job's membership.
    elastic: Option<Elastic>,
    rx: mpsc::Receiver<Event>,
    outputs: Outputs,
    grace: Duration,
    /// Says so when every rank still running is stopped.
    stops: stall::StopWatch,
}

/// "no restarts left", "1 restart left", "2 restarts left".
fn restarts_left(n: u32) -> String {
    match n {
        0 => "no restarts left".into(),
        1 => "1 restart left".into(),
        n => format!("{n} restarts left"),
    }
}

impl Supervisor<'_> {
    /// Wait for the ranks; on the first failure (past the restarts of elastic mode), the
    /// launcher's timeout or a signal, stop the others and say why.
    fn supervise(&mut self) -> Result<(), (String, u8)> {
        let started = Instant::now();
        let limit = (self.args.timeout > 0.0).then(|| Duration::from_secs_f64(self.args.timeout));
        let grace = self.grace;
        loop {
            if self.ranks.all_done() {
                return Ok(());
            }
            if self.elastic.as_ref().is_some_and(|e| e.watch_due() <= Instant::now()) {
                self.kill_declared();
            }
            let wait = match limit {
                Some(l) => match l.checked_sub(started.elapsed()) {
                    Some(left) => left,
                    None => {
                        let msg = format!(
                            "timed out after {l:.0?}; ranks {:?} were still running{}",
                            self.ranks.running(),
                            stopped_note(&self.ranks)
                        );
                        errln!("anyccl-run: {msg}; stopping them");
                        stop_all(&mut self.ranks, &self.rx, grace);
                        return Err((msg, 1));
                    }
                },
                None => Duration::from_secs(3600),
            };
            if self.stops.due() <= Instant::now() {
                let running: Vec<(usize, i32)> =
                    self.ranks.running().into_iter().map(|r| (r, self.ranks.slots[r].pid)).collect();
                if let Some(line) = self.stops.look(&running) {
                    errln!("anyccl-run: {line}");
                }
            }
            let wait = wait.min(self.stops.due().saturating_duration_since(Instant::now()));
            let wait = match &self.elastic {
                Some(e) => wait.min(e.watch_due().saturating_duration_since(Instant::now())),
                None => wait,
            };
            match self.rx.recv_timeout(wait) {
                Ok(Event::Exit(pid, end)) => {
                    // Else an orphan the launcher reaped as a subreaper.
                    let Some(rank) = self.ranks.rank_of(pid) else { continue };
                    self.ranks.slots[rank].done = true;
                    if end.success() {
                        continue;
                    }
                    let slot = self.ranks.slots[rank];
                    let gone = Gone { rank, pid, incarnation: slot.incarnation, end, declared: slot.declared };
                    if self.elastic.as_ref().is_some_and(|e| e.left > 0) {
                        if let Err(msg) = self.restart(gone) {
                            errln!("anyccl-run: {msg}; stopping ranks {:?}", self.ranks.running());
                            stop_all(&mut self.ranks, &self.rx, grace);
                            return Err((msg, 1));
                        }
                        continue;
                    }
                    return Err((self.fail(rank, end), 1));
                }
                Ok(Event::Signal(sig)) => {
                    let name = Signal::try_from(sig).map(|s| s.as_str()).unwrap_or("a signal");
                    errln!("anyccl-run: received {name}; stopping ranks {:?}", self.ranks.running());
                    stop_all(&mut self.ranks, &self.rx, grace);
                    return Err((format!("stopped by {name}"), 128u8.saturating_add(sig as u8)));
                }
                Ok(Event::ReaperGone) => {
                    let msg = "the job's reaper ended; without it ranks could outlive this launcher".to_string();
                    errln!("anyccl-run: {msg}; stopping every rank");
                    stop_all(&mut self.ranks, &self.rx, grace);
                    return Err((msg, 1));
                }
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(("lost track of the ranks".into(), 1)),
            }
        }
    }

    /// Elastic mode: kill every running process that the job's membership declared gone on
    /// its own evidence, its whole group with SIGKILL (a stopped process dies of it too, and
    /// a SIGCONT now cannot save it); its exit then comes to `supervise` as any failure's.
    fn kill_declared(&mut self) {
        let Some(el) = self.elastic.as_mut() else { return };
        let running: Vec<Member> = self
            .ranks
            .running()
            .into_iter()
            .filter(|&r| !self.ranks.slots[r].declared)
            .map(|r| Member { rank: r, incarnation: self.ranks.slots[r].incarnation })
            .collect();
        for (m, record) in el.declared(&running) {
            let slot = &mut self.ranks.slots[m.rank];
            // The membership's records open with who is gone; the launcher's line says it.
            let head = format!("rank {} (incarnation {}) is gone: ", m.rank, m.incarnation);
            let why = record.strip_prefix(&head).unwrap_or(&record);
            errln!(
                "anyccl-run: rank {} (pid {}, incarnation {}) was declared gone by the job's membership: {why}; \
                 killing it",
                m.rank,
                slot.pid,
                m.incarnation
            );
            slot.declared = true;
            let _ = kill(Pid::from_raw(-slot.pid), Signal::SIGKILL);
            // The process itself too, should it have left its group.
            let _ = kill(Pid::from_raw(slot.pid), Signal::SIGKILL);
        }
    }

    /// `rank` failed with no restart left: stop the job; why it failed.
    fn fail(&mut self, rank: usize, end: End) -> String {
        // Other ranks may be failing because of this one, or this one because of another
        // reaped later: gather exits for a moment, then name one.
        let mut failed = vec![(rank, end)];
        let until = Instant::now() + Duration::from_millis(300);
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            match self.rx.recv_timeout(left) {
                Ok(Event::Exit(pid, e2)) => {
                    let Some(r) = self.ranks.rank_of(pid) else { continue };
                    self.ranks.slots[r].done = true;
                    if !e2.success() {
                        failed.push((r, e2));
                    }
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        self.outputs.poll();
        let ranks = &self.ranks;
        let mut f = format!("{}{}", blame(&failed, &self.outputs.first_end, |r| ranks.name(r)), stopped_note(ranks));
        let declared: Vec<usize> = failed.iter().map(|f| f.0).filter(|&r| ranks.slots[r].declared).collect();
        match declared.as_slice() {
            [] => {}
            [r] => {
                f.push_str(&format!("; the job's membership had declared rank {r} gone, and the launcher killed it"))
            }
            rs => f.push_str(&format!(
                "; the job's membership had declared ranks {rs:?} gone, and the launcher killed them"
            )),
        }
        if let Some(el) = &self.elastic {
            f.push_str(&format!(
                "; the job has {} ({} of --max-restarts {} used)",
                restarts_left(0),
                el.used(),
                el.max
            ));
        }
        errln!("anyccl-run: {f}; stopping ranks {:?}", self.ranks.running());
        stop_all(&mut self.ranks, &self.rx, self.grace);
        f
    }

    /// Elastic mode: report `gone` gone to the job's membership (unless the membership
    /// declared it gone itself), stop what is left of its process group, and start its
    /// rank's next incarnation.
    ///
    /// # Errors
    /// The replacement cannot be started.
    fn restart(&mut self, gone: Gone) -> Result<(), String> {
        let t = Instant::now();
        let Some(el) = self.elastic.as_mut() else { return Err("not in elastic mode".into()) };
        // The report first: it is the survivors' evidence, the sooner the better. Not where
        // the membership declared the process gone: its record is there, and a report now
        // would propose a failed epoch after the one the survivors may have agreed already.
        let reported = if gone.declared { Ok(None) } else { el.report(&gone).map(Some) };
        // Nothing of the old incarnation runs beside the new one (holding its rank's device,
        // say): the rest of its group (a wrapper's children) and whatever it started that
        // left the group but carries its identity go first, at once (the rank has ended).
        let old = procs::Job {
            root: None,
            marks: [
                format!("ANYCCL_JOB_ID={}", self.starter.job_id),
                format!("RANK={}", gone.rank),
                format!("ANYCCL_INCARNATION={}", gone.incarnation),
            ]
            .map(String::into_bytes)
            .to_vec(),
            keep: None,
        };
        let (pids_left, groups_left) = procs::stop_job(&[gone.pid], &old, Duration::ZERO);
        if !pids_left.is_empty() || !groups_left.is_empty() {
            errln!(
                "anyccl-run: processes {pids_left:?} and groups {groups_left:?} of {} outlived SIGKILL",
                gone.describe()
            );
        }
        let inc = gone.incarnation + 1;
        self.outputs.replaced(gone.rank, inc);
        let pid = self.starter.start(gone.rank, inc)?;
        let took = t.elapsed();
        self.ranks.slots[gone.rank] = Slot { pid, incarnation: inc, done: false, declared: false };
        el.left -= 1;
        let report = match reported {
            Ok(Some(d)) => format!("reported it gone to the job's membership in {d:.1?}"),
            Ok(None) => "the job's membership has its own record of it".to_string(),
            Err(e) => format!(
                "could not report it gone to the job's membership ({e}; the others see it gone once its liveness \
                 record goes stale)"
            ),
        };
        errln!(
            "anyccl-run: {}; {report}; started its incarnation {inc} (pid {pid}) {took:.1?} after its end; {}",
            gone.describe(),
            restarts_left(el.left)
        );
        Ok(())
    }
}
