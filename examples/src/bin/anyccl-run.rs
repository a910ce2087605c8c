//! `anyccl-run -n N [--timeout S] -- PROGRAM ARGS`: start N local ranks of PROGRAM with
//! the conventional variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//! MASTER_ADDR, MASTER_PORT), host their store, prefix each output line with the rank,
//! and when one rank fails, stop the others and exit non-zero naming it. Variables for
//! one rank only come from `ANYCCL_RANK_ENV` (see `LaunchEnv::rank_env`).
#![forbid(unsafe_code)]

use anyccl_core::{LaunchEnv, TcpStoreOptions, TcpStoreServer};
use clap::Parser;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, ExitCode, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(name = "anyccl-run", about = "Start N local ranks of a program, anyccl-style")]
struct Args {
    /// Number of ranks.
    #[arg(short = 'n', long = "nprocs")]
    n: usize,
    /// Stop every rank and fail after this many seconds (0: no limit).
    #[arg(long, default_value_t = 3600.0)]
    timeout: f64,
    /// Seconds between asking ranks to stop (SIGTERM) and killing them.
    #[arg(long, default_value_t = 5.0)]
    grace: f64,
    /// Do not prefix output lines with the rank.
    #[arg(long)]
    no_prefix: bool,
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

fn describe(s: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => "ended".into(),
    }
}

/// Copy a rank's output, prefixed; report when it ends. An exiting process closes its
/// standard streams before its sockets, so the end of its output comes before any peer can
/// notice its death: the earliest end among failed ranks names the rank that failed first,
/// even when a peer that noticed is reaped before it.
fn pump(
    rank: usize,
    prefix: bool,
    r: impl std::io::Read + Send + 'static,
    to_err: bool,
    ended: mpsc::Sender<(usize, Instant)>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let _guard = EndGuard(rank, ended);
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            let text = if prefix { format!("[rank {rank}] {line}\n") } else { format!("{line}\n") };
            if to_err {
                let _ = std::io::stderr().lock().write_all(text.as_bytes());
            } else {
                let _ = std::io::stdout().lock().write_all(text.as_bytes());
            }
        }
    })
}

/// Ask every rank still running to stop (SIGTERM), then kill what is left after `grace`.
struct EndGuard(usize, mpsc::Sender<(usize, Instant)>);
impl Drop for EndGuard {
    fn drop(&mut self) {
        let _ = self.1.send((self.0, Instant::now()));
    }
}

fn stop_all(pids: &[i32], done: &mut [bool], rx: &mpsc::Receiver<(usize, Option<ExitStatus>)>, grace: Duration) {
    for (r, &pid) in pids.iter().enumerate() {
        if !done[r] {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
    }
    let until = Instant::now() + grace;
    while done.iter().any(|d| !d) {
        let now = Instant::now();
        if now >= until {
            break;
        }
        if let Ok((r, _)) = rx.recv_timeout(until - now) {
            done[r] = true;
        }
    }
    for (r, &pid) in pids.iter().enumerate() {
        if !done[r] {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
    while done.iter().any(|d| !d) {
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok((r, _)) => done[r] = true,
            Err(_) => break,
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.n == 0 {
        eprintln!("anyccl-run: -n must be at least 1");
        return ExitCode::from(2);
    }
    let token = format!("{:032x}", rand::random::<u128>());
    let opts = TcpStoreOptions { token: Some(token.clone()), ..Default::default() };
    let server = match TcpStoreServer::start(([127, 0, 0, 1], 0).into(), opts) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("anyccl-run: cannot host the store: {e}");
            return ExitCode::from(2);
        }
    };
    // Checked once here: a malformed entry is the same for every rank.
    if let Err(e) = LaunchEnv::rank_env(0) {
        eprintln!("anyccl-run: {e}");
        return ExitCode::from(2);
    }
    let program = resolve(&args.command[0]);
    let (tx, rx) = mpsc::channel::<(usize, Option<ExitStatus>)>();
    let (ended_tx, ended_rx) = mpsc::channel::<(usize, Instant)>();
    let mut pids = Vec::new();
    let mut pumps = Vec::new();
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
            .envs(LaunchEnv::rank_env(rank).unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        match child {
            Ok(mut c) => {
                if let Some(o) = c.stdout.take() {
                    pumps.push(pump(rank, !args.no_prefix, o, false, ended_tx.clone()));
                }
                if let Some(e) = c.stderr.take() {
                    pumps.push(pump(rank, !args.no_prefix, e, true, ended_tx.clone()));
                }
                pids.push(c.id() as i32);
                // One waiter per rank: exits arrive in the order they happen, so the rank
                // that failed first is the one named, not a peer that failed because of it.
                let tx = tx.clone();
                std::thread::spawn(move || {
                    let st = c.wait().ok();
                    let _ = tx.send((rank, st));
                });
            }
            Err(e) => {
                eprintln!("anyccl-run: cannot start rank {rank} ({}): {e}", program.display());
                let mut done = vec![false; pids.len()];
                stop_all(&pids, &mut done, &rx, Duration::ZERO);
                return ExitCode::from(2);
            }
        }
    }
    let started = Instant::now();
    // Out of range (infinite, NaN): no limit, and the default grace.
    let limit = (args.timeout > 0.0).then(|| Duration::try_from_secs_f64(args.timeout).ok()).flatten();
    let grace = Duration::try_from_secs_f64(args.grace.max(0.0)).unwrap_or(Duration::from_secs(5));
    let mut done = vec![false; args.n];
    let verdict: Result<(), String> = loop {
        if done.iter().all(|d| *d) {
            break Ok(());
        }
        let wait = match limit {
            Some(l) => match l.checked_sub(started.elapsed()) {
                Some(left) => left,
                None => {
                    let running: Vec<usize> = (0..args.n).filter(|&r| !done[r]).collect();
                    let msg = format!("timed out after {l:.0?}; ranks {running:?} were still running");
                    eprintln!("anyccl-run: {msg}; stopping them");
                    stop_all(&pids, &mut done, &rx, grace);
                    break Err(msg);
                }
            },
            None => Duration::from_secs(3600),
        };
        match rx.recv_timeout(wait) {
            Ok((rank, st)) => {
                done[rank] = true;
                let ok = st.as_ref().is_some_and(|s| s.success());
                if !ok {
                    // Other ranks may be failing because of this one, or this one because of
                    // another reaped later: gather exits for a moment, then name the failed
                    // rank whose output ended first.
                    let mut failed = vec![(rank, st)];
                    let until = Instant::now() + Duration::from_millis(300);
                    while let Some(left) = until.checked_duration_since(Instant::now()) {
                        match rx.recv_timeout(left) {
                            Ok((r, s2)) => {
                                done[r] = true;
                                if !s2.as_ref().is_some_and(|s| s.success()) {
                                    failed.push((r, s2));
                                }
                            }
                            Err(_) => break,
                        }
                    }
                    let mut ended: Vec<Option<Instant>> = vec![None; args.n];
                    while let Ok((r, t)) = ended_rx.try_recv() {
                        ended[r] = Some(ended[r].map_or(t, |e| e.min(t)));
                    }
                    // The primary: a rank whose way of failing no other rank shares (peers that
                    // fail because of it tend to fail alike), else the earliest end of output,
                    // else the order of reaping. Every failed rank is named.
                    let how: Vec<String> = failed
                        .iter()
                        .map(|(_, st)| st.as_ref().map(describe).unwrap_or_else(|| "could not be waited for".into()))
                        .collect();
                    let unique: Vec<usize> =
                        (0..failed.len()).filter(|&i| how.iter().filter(|h| **h == how[i]).count() == 1).collect();
                    let pick = if unique.len() == 1 && failed.len() > 1 {
                        unique[0]
                    } else {
                        (0..failed.len())
                            .min_by_key(|&i| (ended[failed[i].0].is_none(), ended[failed[i].0], i))
                            .unwrap_or(0)
                    };
                    let rank = failed[pick].0;
                    let mut f = format!("rank {rank} {}", how[pick]);
                    let others: Vec<String> = (0..failed.len())
                        .filter(|&i| i != pick)
                        .map(|i| format!("rank {} {}", failed[i].0, how[i]))
                        .collect();
                    if !others.is_empty() {
                        f.push_str(&format!(" (also failed: {})", others.join(", ")));
                    }
                    let running: Vec<usize> = (0..args.n).filter(|&r| !done[r]).collect();
                    eprintln!("anyccl-run: {f}; stopping ranks {running:?}");
                    stop_all(&pids, &mut done, &rx, grace);
                    break Err(f);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break Err("lost track of the ranks".into()),
        }
    };
    for p in pumps {
        let _ = p.join();
    }
    drop(server);
    match verdict {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("anyccl-run: FAILED: {msg}");
            ExitCode::from(1)
        }
    }
}
