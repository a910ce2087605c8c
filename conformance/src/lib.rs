//! anyccl-conformance: one library of cases that every anyccl backend runs, with the
//! harness that runs them and the runners that report them. Not a stable API.
//!
//! Cases are plain functions written from one rank's view; inputs come from
//! [`pattern`], so every rank computes its own expected output. The [`registry`] lists
//! each case with its world sizes and the capabilities it needs; a case a backend cannot
//! run is reported **ignored with the reason**, never as a pass. Ranks run as threads
//! (or, for kill tests, as child processes re-executing the test binary), and a deadline
//! aborts every rank's communicator when a case hangs.
//!
//! The modules form a ladder, each importing only those below it: [`pattern`] and [`fault`]
//! at the bottom, then [`rank`] (one rank's view, what a case is written against), the
//! [`registry`]'s entry type over it, the [`harness`] that runs an entry, and the [`cases`],
//! which list every entry, at the top.
//!
//! Each backend's test entry is one line: [`run_libtest`] for `cargo test`, or
//! [`run_report`] for the `anyccl-conformance` program.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod cases;
pub mod fault;
pub mod harness;
pub mod pattern;
pub mod rank;
pub mod registry;

pub use cases::all_cases;
pub use harness::{child_main, run, Outcome};
pub use rank::{CaseError, CaseResult, RankCtx};
pub use registry::{Case, Mode, DEFAULT_WORLDS};

use anyccl_core::Backend;
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

/// Per-case deadline (`ANYCCL_CASE_TIMEOUT_S`, default 60 s).
///
/// # Errors
/// `InvalidArgument` naming the variable, its value and the rank when it is set to anything
/// but a number of seconds: a run never silently falls back to the default.
pub fn case_timeout() -> anyccl_core::Result<Duration> {
    Ok(anyccl_core::env_secs("ANYCCL_CASE_TIMEOUT_S")?.unwrap_or(Duration::from_secs(60)))
}

/// [`case_timeout`], or the exit code of a run that cannot start because of it.
fn timeout_or_exit() -> Result<Duration, ExitCode> {
    case_timeout().map_err(|e| {
        let _ = writeln!(std::io::stderr(), "conformance: {e}");
        ExitCode::from(2)
    })
}

/// The (case, world size) runs for `worlds` (`None`: every case's own list).
pub fn runs(worlds: Option<&[usize]>) -> Vec<(Case, usize)> {
    let mut v = Vec::new();
    for c in all_cases() {
        for &w in &c.worlds {
            if worlds.is_none_or(|ws| ws.contains(&w)) {
                v.push((c.clone(), w));
            }
        }
    }
    v
}

/// Log to stderr, filtered by `ANYCCL_LOG` (see [`anyccl_core::init_logging`]); a malformed
/// `ANYCCL_LOG` ends the test program with the error and status 2.
pub fn init_tracing(default: tracing::Level) {
    if let Err(e) = anyccl_core::init_logging(default) {
        let _ = writeln!(std::io::stderr(), "{e}");
        std::process::exit(2);
    }
}

/// Run the registry as a libtest-compatible test binary (`cargo test`), one trial per
/// case and world size, named `backend::group::case[w=N]`.
pub fn run_libtest(backend: Arc<dyn Backend>) -> ExitCode {
    let name = backend.name();
    run_libtest_as(backend, name)
}

/// [`run_libtest`] with the trials named `label::group::case[w=N]`: one backend run again
/// with other settings (`cpu-mixed`, the CPU backend over pretend hosts).
pub fn run_libtest_as(backend: Arc<dyn Backend>, label: &str) -> ExitCode {
    if let Some(code) = child_main(&backend, &all_cases()) {
        return code;
    }
    init_tracing(tracing::Level::ERROR);
    let args = libtest_mimic::Arguments::from_args();
    let timeout = match timeout_or_exit() {
        Ok(t) => t,
        Err(code) => return code,
    };
    let trials = runs(None)
        .into_iter()
        .map(|(case, w)| {
            let b = backend.clone();
            libtest_mimic::Trial::ignorable_test(case.test_name(label, w), move || match run(&b, &case, w, timeout) {
                Outcome::Passed => Ok(libtest_mimic::Completion::Completed),
                Outcome::Ignored(why) => Ok(libtest_mimic::Completion::ignored_with(why)),
                Outcome::Failed(why) => Err(why.into()),
            })
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}

/// Run the registry and print one line per case and world size, then
/// `N passed, N failed, N ignored`. Exit code 1 when anything failed.
pub fn run_report(backend: Arc<dyn Backend>, worlds: Option<&[usize]>, filter: Option<&str>) -> ExitCode {
    if let Some(code) = child_main(&backend, &all_cases()) {
        return code;
    }
    let timeout = match timeout_or_exit() {
        Ok(t) => t,
        Err(code) => return code,
    };
    let (mut passed, mut failed, mut ignored) = (0, 0, 0);
    let out = std::io::stdout();
    let mut lost = None;
    for (case, w) in runs(worlds) {
        let name = case.test_name(backend.name(), w);
        if filter.is_some_and(|f| !name.contains(f)) {
            continue;
        }
        let t = std::time::Instant::now();
        let line = match run(&backend, &case, w, timeout) {
            Outcome::Passed => {
                passed += 1;
                format!("{name} ... ok ({:.0?})", t.elapsed())
            }
            Outcome::Failed(why) => {
                failed += 1;
                format!("{name} ... FAILED: {why}")
            }
            Outcome::Ignored(why) => {
                ignored += 1;
                format!("{name} ... ignored: {why}")
            }
        };
        let mut o = out.lock();
        if let Err(e) = writeln!(o, "{line}").and_then(|()| o.flush()) {
            lost.get_or_insert(e);
        }
    }
    let mut o = out.lock();
    if let Err(e) = writeln!(o, "{passed} passed, {failed} failed, {ignored} ignored").and_then(|()| o.flush()) {
        lost.get_or_insert(e);
    }
    // A report that could not be written is not a passed run: nobody can read what passed.
    if let Some(e) = &lost {
        let _ = writeln!(std::io::stderr(), "conformance: the report could not be written to stdout: {e}");
    }
    if failed > 0 || lost.is_some() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
