//! Runs a case on `w` ranks: as threads of this process (the default) or as child
//! processes of it (for cases that kill a rank). A deadline bounds every run; on expiry
//! every rank's communicator is aborted.

use crate::registry::{Case, Mode};
use anyccl_core::{
    Backend, Collective, CommConfig, Communicator, GroupSpec, LaunchEnv, MemoryStore, Store, TcpStoreOptions,
    TcpStoreServer,
};
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// What a case is written against, defined below the harness so that the registry's
/// entries can name it.
pub use crate::rank::{CaseError, CaseResult, RankCtx};

/// Result of one case at one world size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every rank passed.
    Passed,
    /// Why it failed.
    Failed(String),
    /// Why it did not run.
    Ignored(String),
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| format!("runtime: {e}"))
}

/// Run `case` on `w` ranks.
pub fn run(backend: &Arc<dyn Backend>, case: &Case, w: usize, timeout: Duration) -> Outcome {
    if let Err(e) = backend.probe() {
        return Outcome::Ignored(e.to_string());
    }
    match backend.capabilities() {
        Err(e) => return Outcome::Ignored(e.to_string()),
        Ok(caps) => {
            if w > caps.max_local_ranks {
                return Outcome::Ignored(format!(
                    "needs {w} ranks on this host; the backend supports {}",
                    caps.max_local_ranks
                ));
            }
            if let Some(why) = (case.needs)(&caps, w) {
                return Outcome::Ignored(why);
            }
        }
    }
    // Variables set per rank (`ANYCCL_RANK_ENV`) can only differ between processes.
    let per_rank_env = LaunchEnv::rank_env(0).map(|v| !v.is_empty()).unwrap_or(true);
    match case.mode {
        Mode::Threads if per_rank_env && w > 1 => run_processes(case, w, None, timeout),
        Mode::Threads => run_threads(backend, case, w, timeout),
        Mode::Processes { dies } => run_processes(case, w, dies, timeout),
    }
}

fn run_threads(backend: &Arc<dyn Backend>, case: &Case, w: usize, timeout: Duration) -> Outcome {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let comms: Arc<Mutex<Vec<Arc<dyn Collective>>>> = Arc::default();
    let (tx, rx) = mpsc::channel::<(usize, Result<(), String>)>();
    let deadline = Instant::now() + timeout;
    for rank in 0..w {
        let (store, comms, tx, backend, run) =
            (store.clone(), comms.clone(), tx.clone(), backend.clone(), case.run.clone());
        let spawned = std::thread::Builder::new().name(format!("case-rank{rank}")).spawn(move || {
            let r = catch_unwind(AssertUnwindSafe(|| -> Result<(), String> {
                let ctx = connect_rank(
                    backend,
                    store,
                    rank,
                    w,
                    timeout,
                    |c| {
                        if let Ok(mut v) = comms.lock() {
                            v.push(c.clone());
                        }
                    },
                    None,
                )?;
                run(&ctx).map_err(|e| e.0)?;
                ctx.finish_together(None);
                Ok(())
            }));
            let r = r.unwrap_or_else(|p| Err(format!("panicked: {}", panic_text(p))));
            let _ = tx.send((rank, r));
        });
        if let Err(e) = spawned {
            return Outcome::Failed(format!("cannot start rank thread: {e}"));
        }
    }
    drop(tx);
    let mut results: Vec<Option<Result<(), String>>> = vec![None; w];
    let mut timed_out = false;
    let mut fails_at_deadline = false;
    while results.iter().any(|r| r.is_none()) {
        let now = Instant::now();
        let limit = if timed_out { deadline + Duration::from_secs(5) } else { deadline };
        if now >= limit {
            if timed_out {
                break;
            }
            timed_out = true;
            fails_at_deadline = true;
            abort_all(&comms);
            continue;
        }
        match rx.recv_timeout(limit - now) {
            Ok((r, res)) => {
                if res.is_err() && !timed_out {
                    // One rank failed: the others may wait forever on it. Abort them all.
                    timed_out = true;
                    abort_all(&comms);
                }
                results[r] = Some(res);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let mut fails = Vec::new();
    if fails_at_deadline {
        fails.push(format!("timed out after {timeout:?}; all communicators aborted"));
    }
    for (r, res) in results.iter().enumerate() {
        match res {
            Some(Ok(())) => {}
            Some(Err(e)) => fails.push(format!("rank {r}: {e}")),
            None => fails.push(format!("rank {r}: never finished")),
        }
    }
    if fails.is_empty() {
        Outcome::Passed
    } else {
        Outcome::Failed(fails.join("; "))
    }
}

fn abort_all(comms: &Mutex<Vec<Arc<dyn Collective>>>) {
    anyccl_core::abort_all(&comms.lock().map(|v| v.clone()).unwrap_or_default(), Duration::from_secs(5));
}

fn connect_rank(
    backend: Arc<dyn Backend>,
    store: Arc<dyn Store>,
    rank: usize,
    w: usize,
    timeout: Duration,
    register: impl FnOnce(&Arc<dyn Collective>),
    rt: Option<tokio::runtime::Runtime>,
) -> Result<RankCtx, String> {
    let rt = match rt {
        Some(rt) => rt,
        None => runtime()?,
    };
    let platform = backend.platform(rank).map_err(|e| e.to_string())?;
    // Operations get a quarter of the case's time: a backend whose first call blocks while
    // connecting (NCCL) times such a call out by this, well inside the case's deadline.
    let op_timeout = (timeout / 4).max(Duration::from_secs(2));
    let config = CommConfig { op_timeout, init_timeout: timeout, ..CommConfig::default() };
    let comm = rt
        .block_on(Communicator::connect(
            backend.as_ref(),
            GroupSpec::world(w, "conformance"),
            rank,
            store.clone(),
            platform.device(),
            config,
        ))
        .map_err(|e| format!("connect: {e}"))?;
    register(comm.collective());
    Ok(RankCtx { comm, platform, store, backend, rank, size: w, timeout, rt })
}

const CHILD_ENV: &str = "ANYCCL_CONFORMANCE_CHILD";

fn run_processes(case: &Case, w: usize, dies: Option<usize>, timeout: Duration) -> Outcome {
    let token = format!("{:016x}", rand_token());
    let opts = TcpStoreOptions { token: Some(token.clone()), ..Default::default() };
    let server = match TcpStoreServer::start(([127, 0, 0, 1], 0).into(), opts) {
        Ok(s) => s,
        Err(e) => return Outcome::Failed(format!("store server: {e}")),
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return Outcome::Failed(format!("cannot find own executable: {e}")),
    };
    if let Err(e) = LaunchEnv::rank_env(0) {
        return Outcome::Failed(e.to_string());
    }
    let mut children = Vec::new();
    for rank in 0..w {
        let child = Command::new(&exe)
            .args(std::env::args_os().skip(1))
            .env(CHILD_ENV, case.full_name())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", w.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", w.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", server.local_addr().port().to_string())
            .env("ANYCCL_STORE_EXTERNAL", "1")
            .env("ANYCCL_STORE_TOKEN", &token)
            .env("ANYCCL_CASE_TIMEOUT_MS", timeout.as_millis().to_string())
            .envs(LaunchEnv::rank_env(rank).unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn();
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                for mut c in children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Outcome::Failed(format!("cannot start rank {rank}: {e}"));
            }
        }
    }
    let deadline = Instant::now() + timeout + Duration::from_secs(5);
    let mut status = vec![None; w];
    while status.iter().any(|s| s.is_none()) && Instant::now() < deadline {
        for (r, c) in children.iter_mut().enumerate() {
            if status[r].is_none() {
                if let Ok(Some(s)) = c.try_wait() {
                    status[r] = Some(s);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut fails = Vec::new();
    for (r, c) in children.iter_mut().enumerate() {
        if status[r].is_none() {
            let _ = c.kill();
            fails.push(format!("rank {r} still running at the deadline; killed"));
        }
        let s = c.wait().ok();
        let mut err = String::new();
        if let Some(mut e) = c.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut err);
        }
        let ok = s.map(|s| s.success()).unwrap_or(false);
        if Some(r) == dies {
            if ok {
                fails.push(format!("rank {r} was meant to die but exited cleanly"));
            }
        } else if !ok && status[r].is_some() {
            let tail: String =
                err.lines().rev().take(5).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join(" | ");
            fails.push(format!("rank {r} exited with {s:?}: {tail}"));
        }
    }
    if fails.is_empty() {
        Outcome::Passed
    } else {
        Outcome::Failed(fails.join("; "))
    }
}

fn rand_token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos() ^ std::process::id() as u128);
    h.finish()
}

/// In a child process started by the process-mode harness, run the requested case and
/// return the exit code; `None` in any other process.
pub fn child_main(backend: &Arc<dyn Backend>, cases: &[Case]) -> Option<std::process::ExitCode> {
    let name = match anyccl_core::env_string(CHILD_ENV) {
        Ok(name) => name?,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "conformance child: {e}");
            return Some(std::process::ExitCode::from(1));
        }
    };
    let code = match child_run(backend, cases, &name) {
        Ok(()) => 0,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "{name}: {e}");
            1
        }
    };
    Some(std::process::ExitCode::from(code))
}

fn child_run(backend: &Arc<dyn Backend>, cases: &[Case], name: &str) -> Result<(), String> {
    let case = cases.iter().find(|c| c.full_name() == name).ok_or_else(|| format!("no case named {name}"))?;
    let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
    let ms = |s: &str| s.parse::<u64>().ok().filter(|&ms| ms > 0).map(Duration::from_millis);
    let timeout = anyccl_core::env_parse("ANYCCL_CASE_TIMEOUT_MS", "a whole number of milliseconds above 0", ms)
        .map_err(|e| e.to_string())?
        .unwrap_or(Duration::from_secs(60));
    let rt = runtime()?;
    let (store, _server) = rt.block_on(env.connect_store()).map_err(|e| e.to_string())?;
    let ctx = connect_rank(backend.clone(), store, env.rank, env.world_size, timeout, |_| {}, Some(rt))?;
    (case.run)(&ctx).map_err(|e| e.0)?;
    // A rank the case kills never reports.
    let dies = match case.mode {
        Mode::Processes { dies } => dies.filter(|&d| d < env.world_size),
        Mode::Threads => None,
    };
    ctx.finish_together(dies);
    Ok(())
}
