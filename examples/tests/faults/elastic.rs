//! `anyccl-run --elastic`: a failed rank is reported gone to the job's membership and
//! started again as its next incarnation while the others run on; the restarts are counted
//! for the job; every guarantee of the launcher (no orphans, signals, timeout) still holds.
//! Most ranks here are small shell programs; where a rank must read the job's store, this
//! test program is the rank (see [`rank_role`]).

use super::{bin, by_hand, check, mark, marked, marked_gone_within, Job, Outcome};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Set in a launcher's environment: its ranks are this test program, in the role named.
pub const ROLE_ENV: &str = "FAULTS_RANK_ROLE";

fn elastic(n: usize, extra: &[&str], program: &[&str]) -> Command {
    let mut c = Command::new(bin("anyccl-run"));
    c.args(["-n", &n.to_string(), "--grace", "2", "--elastic"]).args(extra).arg("--").args(program);
    c
}

fn unix_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

/// Wait for a file (at most 20 s), in a rank's shell.
const AWAIT_GO: &str = "i=0; while [ ! -e \"$GO\" ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done";

fn go_file(case: &str) -> std::path::PathBuf {
    let go = std::env::temp_dir().join(format!("anyccl-faults-{case}-{}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    go
}

/// Rank 1's first process kills itself with SIGKILL (leaving a child in a session of its
/// own); its replacement starts as incarnation 2 while ranks 0 and 2 keep running (the same
/// processes print after it), the old incarnation's child is gone before the replacement
/// starts, and the job succeeds.
pub fn a_killed_rank_is_restarted_and_the_others_keep_running() -> Outcome {
    let go = go_file("elastic-go");
    let m = mark("elastic");
    let script = format!(
        "echo \"up pid $$ incarnation $ANYCCL_INCARNATION\"; \
         if [ \"$RANK\" = 1 ] && [ \"$ANYCCL_INCARNATION\" = 1 ]; then setsid sleep 3006 & sleep 0.2; kill -9 $$; fi; \
         if [ \"$RANK\" = 1 ]; then echo \"replacement up\"; exit 0; fi; \
         {AWAIT_GO}; echo \"after the restart pid $$\""
    );
    let mut job = Job::start(elastic(3, &[], &["sh", "-c", &script]).env("GO", &go).env("FAULTS_MARK", &m));
    let up = job.expect("[rank 1.2] replacement up", Duration::from_secs(20));
    // Nothing of incarnation 1 is left: its child in a session of its own went with it.
    let old_child = marked(&m).into_iter().filter(|&p| cmdline(p) == "sleep 3006").count();
    let _ = std::fs::write(&go, b"");
    let got = job.finish(Duration::from_secs(30));
    let _ = std::fs::remove_file(&go);
    let left = marked_gone_within(&m, Duration::ZERO);
    up?;
    let got = got?;
    let text = job.text();
    check(got == Some(0), || format!("exit code {got:?}:\n{text}"))?;
    check(text.contains("[rank 1.2] up pid") && text.contains("incarnation 2"), || {
        format!("rank 1's replacement did not start as incarnation 2:\n{text}")
    })?;
    check(
        text.contains("incarnation 1) was killed by signal 9 (SIGKILL)") && text.contains("2 restarts left"),
        || format!("the launcher did not say what happened:\n{text}"),
    )?;
    check(old_child == 0, || format!("incarnation 1's child still ran beside its replacement:\n{text}"))?;
    for r in [0, 2] {
        let pid_at = |what: &str| {
            let pre = format!("[rank {r}] {what} pid ");
            text.lines().find_map(|l| l.strip_prefix(&pre)?.split(' ').next().map(str::to_string))
        };
        let (first, after) = (pid_at("up"), pid_at("after the restart"));
        check(first.is_some() && first == after, || format!("rank {r} did not run on as the same process:\n{text}"))?;
    }
    left?;
    let line = text.lines().find(|l| l.contains("started its incarnation 2")).unwrap_or("");
    println!("    {line}");
    Ok(())
}

/// A rank that fails every time uses up the restarts; then the job fails as without
/// --elastic, naming the rank, its incarnation and the restarts used, and nothing is left.
pub fn a_crash_loop_uses_up_the_restarts_and_fails_the_job() -> Outcome {
    let m = mark("elastic-loop");
    let script = "if [ \"$RANK\" = 1 ]; then setsid sleep 3007 & exit 3; fi; sleep 300 & wait";
    let t = Instant::now();
    let mut job = Job::start(elastic(2, &["--max-restarts", "2"], &["sh", "-c", script]).env("FAULTS_MARK", &m));
    let got = job.finish(Duration::from_secs(30));
    let left = marked_gone_within(&m, Duration::ZERO);
    let got = got?;
    let took = t.elapsed();
    let text = job.text();
    check(got == Some(1), || format!("exit code {got:?}:\n{text}"))?;
    check(text.contains("1 restart left") && text.contains("started its incarnation 3"), || {
        format!("the restarts were not counted:\n{text}")
    })?;
    let want =
        "FAILED: rank 1 (incarnation 3) exited with code 3; the job has no restarts left (2 of --max-restarts 2 \
                used)";
    check(text.contains(want), || format!("the cause is not named:\n{text}"))?;
    check(!text.contains("incarnation 4"), || format!("a restart past --max-restarts:\n{text}"))?;
    left?;
    println!("    a rank that exits 3 every time, --max-restarts 2: the job failed naming it after {took:.2?}");
    Ok(())
}

/// `--max-restarts` without `--elastic`, or with a value that is not a whole number from 0
/// to 1000, is refused before anything starts.
pub fn bad_restart_flags_are_refused() -> Outcome {
    let run = |args: &[&str]| Command::new(bin("anyccl-run")).args(args).args(["--", "true"]).output();
    let out = run(&["-n", "2", "--max-restarts", "2"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    check(out.status.code() == Some(2) && err.contains("--max-restarts needs --elastic"), || {
        format!("--max-restarts without --elastic: {:?} {err}", out.status)
    })?;
    for k in ["-1", "abc", "1001", "2.5", ""] {
        let out = run(&["-n", "2", "--elastic", "--max-restarts", k])?;
        let err = String::from_utf8_lossy(&out.stderr);
        check(
            out.status.code() == Some(2) && err.contains("--max-restarts must be a whole number from 0 to 1000"),
            || format!("--max-restarts {k:?}: {:?} {err}", out.status),
        )?;
    }
    for k in ["0", "1000"] {
        let out = run(&["-n", "1", "--elastic", "--max-restarts", k])?;
        check(out.status.success(), || format!("--max-restarts {k}: {:?}", out.status))?;
    }
    Ok(())
}

/// kill -9 of an elastic launcher while a rank crashes in a loop (so mid-restart, or just
/// after one): no process of the job is left, replacements and their children included.
pub fn kill9_launcher_mid_restart_leaves_no_process() -> Outcome {
    let m = mark("elastic-kill9");
    let script = "if [ \"$RANK\" = 1 ]; then setsid sleep 3008 & sleep 0.02; exit 1; fi; sleep 300 & wait";
    let mut job = Job::start(elastic(3, &["--max-restarts", "1000"], &["sh", "-c", script]).env("FAULTS_MARK", &m));
    let seen = job.expect("started its incarnation 6 ", Duration::from_secs(30));
    signal_now(job.pid(), Signal::SIGKILL);
    let took = marked_gone_within(&m, Duration::from_secs(5));
    let _ = job.finish(Duration::from_secs(5));
    seen?;
    let took = took?;
    println!("    kill -9 of an elastic launcher in a crash loop: every process of the job gone after {took:.2?}");
    Ok(())
}

/// SIGTERM to an elastic launcher after a restart stops every rank, the replacement too.
pub fn sigterm_after_a_restart_stops_every_rank() -> Outcome {
    let m = mark("elastic-term");
    let script = "if [ \"$RANK\" = 1 ] && [ \"$ANYCCL_INCARNATION\" = 1 ]; then exit 1; fi; sleep 300 & wait";
    let mut job = Job::start(elastic(3, &[], &["sh", "-c", script]).env("FAULTS_MARK", &m));
    let seen = job.expect("started its incarnation 2 ", Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(200));
    signal_now(job.pid(), Signal::SIGTERM);
    let got = job.finish(Duration::from_secs(10));
    let left = marked_gone_within(&m, Duration::ZERO);
    seen?;
    let got = got?;
    check(got == Some(143) && job.text().contains("stopped by SIGTERM"), || {
        format!("exit code {got:?}:\n{}", job.text())
    })?;
    left?;
    Ok(())
}

/// A stopped rank (SIGSTOP) is not restarted by the launcher (seeing it gone is the
/// membership's work): the job ends at --timeout, naming it, and nothing is left.
pub fn a_stopped_rank_is_not_restarted_and_the_timeout_holds() -> Outcome {
    let m = mark("elastic-stop");
    let script = "echo \"up pid $$\"; sleep 300 & wait";
    let mut cmd = elastic(2, &["--timeout", "3"], &["sh", "-c", script]);
    let mut job = Job::start(cmd.env("FAULTS_MARK", &m));
    job.expect("[rank 1] up pid", Duration::from_secs(20))?;
    let pid = job
        .text()
        .lines()
        .find_map(|l| l.strip_prefix("[rank 1] up pid ")?.trim().parse::<i32>().ok())
        .ok_or("no pid for rank 1")?;
    signal_now(pid, Signal::SIGSTOP);
    let t = Instant::now();
    let got = job.finish(Duration::from_secs(15));
    let took = t.elapsed();
    let left = marked_gone_within(&m, Duration::ZERO);
    let got = got?;
    let text = job.text();
    check(got == Some(1) && text.contains("timed out") && text.contains("rank 1 is stopped"), || {
        format!("exit code {got:?}:\n{text}")
    })?;
    check(!text.contains("incarnation 2"), || format!("a stopped rank was restarted:\n{text}"))?;
    left?;
    println!("    rank 1 stopped under --elastic --timeout 3: the job ended {took:.2?} after the stop, naming it");
    Ok(())
}

/// `anyccl-recover train --in-place` (80 steps of at least 50 ms, dp 2 x pp 2) under
/// `anyccl-run -n 4 --elastic --max-restarts 2 --timeout 120`, its liveness limit 2 s.
fn in_place(out: &std::path::Path, m: &str) -> Command {
    let out = out.display().to_string();
    let train = [bin("anyccl-recover"), "train", "--in-place", "--steps", "80", "--step-ms", "50"];
    let mut c = elastic(4, &["--max-restarts", "2", "--timeout", "120"], &train);
    c.args(["--run", "X", "--out", &out]).env("ANYCCL_BACKEND", "cpu").env("ANYCCL_LIVENESS_S", "2");
    c.env("FAULTS_MARK", m);
    c
}

/// The process of `rank`'s first incarnation among the job's (`FAULTS_MARK`).
fn first_process_of(m: &str, rank: usize) -> Option<i32> {
    let want = [format!("RANK={rank}"), "ANYCCL_INCARNATION=1".to_string()];
    marked(m).into_iter().find(|p| {
        let env = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
        want.iter().all(|w| env.split(|&b| b == 0).any(|v| v == w.as_bytes())) && cmdline(*p).contains("train")
    })
}

/// Whether `pid` still runs (a zombie does not).
fn runs(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next().map(str::to_string)))
        .is_some_and(|st| st != "Z")
}

/// Training in place, `stopped` ranks are stopped with SIGSTOP (all at once) once the job
/// trains; the job's membership declares them gone when their liveness records go stale,
/// and the launcher kills and replaces each (`resume`: the test sends SIGCONT to each as
/// soon as the launcher's line says it decided, which must not save it). The launcher
/// exits 0 long before --timeout, every rank writes its parameters, nothing is left.
fn stopped_ranks_are_replaced(case: &str, stopped: &[usize], resume: bool) -> Outcome {
    let out = std::env::temp_dir().join(format!("anyccl-faults-{case}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let m = mark(case);
    let t0 = Instant::now();
    let mut job = Job::start(&mut in_place(&out, &m));
    let r = (|| -> Outcome {
        job.expect("[rank 1] step ", Duration::from_secs(60))?;
        let victims: Vec<i32> = stopped.iter().filter_map(|&r| first_process_of(&m, r)).collect();
        check(victims.len() == stopped.len(), || format!("ranks {stopped:?} not found: {victims:?}"))?;
        let at_stop = Instant::now();
        for &v in &victims {
            signal_now(v, Signal::SIGSTOP);
        }
        let mut lines = Vec::new();
        for (&r, &v) in stopped.iter().zip(&victims) {
            let decided = format!("rank {r} (pid {v}, incarnation 1) was declared gone by the job's membership: ");
            let seen = job.expect(&decided, Duration::from_secs(60))?;
            if resume {
                signal_now(v, Signal::SIGCONT);
            }
            let started = job.expect(
                &format!("rank {r} (pid {v}, incarnation 1) was killed by signal 9"),
                Duration::from_secs(30),
            )?;
            lines.push((r, seen - at_stop, started - at_stop));
        }
        let got = job.finish(Duration::from_secs(120))?;
        let took = t0.elapsed();
        let text = job.text();
        check(got == Some(0), || format!("exit code {got:?}:\n{text}"))?;
        check(took < Duration::from_secs(60), || format!("the job took {took:.2?} of --timeout 120:\n{text}"))?;
        for &r in stopped {
            let restart = text
                .lines()
                .find(|l| l.contains(&format!("anyccl-run: rank {r} (pid")) && l.contains("started its incarnation 2"))
                .unwrap_or("");
            check(
                restart.contains("was killed by signal 9 (SIGKILL), after the job's membership declared it gone"),
                || format!("rank {r} was not killed and replaced:\n{text}"),
            )?;
        }
        check(!text.contains("incarnation 3") && !text.contains("is not a member of epoch"), || {
            format!("a second restart, or a resumed process went on:\n{text}")
        })?;
        let finals = (0..4).filter(|r| out.join(format!("X/final/rank{r}.bin")).exists()).count();
        check(finals == 4, || format!("{finals} of 4 ranks wrote their parameters:\n{text}"))?;
        check(victims.iter().all(|&v| !runs(v)), || format!("a stopped process still runs: {victims:?}"))?;
        for (r, decided, started) in lines {
            println!(
                "    SIGSTOP of rank {r} -> the launcher's kill after {decided:.2?}, its replacement running {:.1?} \
                 after the kill",
                started - decided
            );
        }
        println!("    the job ended well after {took:.2?} (--timeout 120)");
        Ok(())
    })();
    if r.is_err() {
        signal_now(job.pid(), Signal::SIGTERM);
        let _ = job.finish(Duration::from_secs(20));
    }
    let left = marked_gone_within(&m, Duration::from_secs(2));
    let _ = std::fs::remove_dir_all(&out);
    r?;
    left.map(|_| ())
}

/// Rank 3 stopped while training in place is declared gone, killed and replaced.
pub fn a_stopped_rank_declared_gone_is_killed_and_replaced() -> Outcome {
    stopped_ranks_are_replaced("elastic-declared", &[3], false)
}

/// SIGCONT of the stopped rank just after the launcher decided: the kill still wins.
pub fn a_stopped_rank_resumed_after_the_decision_is_still_killed() -> Outcome {
    stopped_ranks_are_replaced("elastic-declared-cont", &[3], true)
}

/// Ranks 2 and 3 (one replica) stopped at once: both are declared gone and replaced.
pub fn two_ranks_stopped_at_once_are_both_replaced() -> Outcome {
    stopped_ranks_are_replaced("elastic-declared-two", &[2, 3], false)
}

/// A gone record that another process wrote (rank 0, this program) of rank 1's running first
/// process: the launcher kills it and starts incarnation 2, which runs on past several
/// looks at the records (the record of incarnation 1 stays: it is not acted on again).
pub fn a_gone_record_written_by_another_process_is_acted_on_once() -> Outcome {
    declared_by_role("declare", &["was declared gone by the job's membership: written by rank 0; killing it"])
}

/// A rank that records itself gone and exits at once (the record of a rank that already
/// exited on its own): one restart, not two. Whether the launcher reads the record before it
/// reaps the exit (then it kills a process that is already gone) is up to the moment.
pub fn a_gone_record_of_a_rank_that_exited_is_not_a_second_restart() -> Outcome {
    declared_by_role("exits", &["exited with code 3", "declared gone by the job's membership"])
}

/// The job of role `role` (see [`rank_role`]): it ends well, with one restart, rank 1's
/// incarnation 2 running on, and a line of the launcher about rank 1 saying one of `what`.
fn declared_by_role(role: &str, what: &[&str]) -> Outcome {
    let me = std::env::current_exe()?;
    let me = me.to_str().ok_or("this program's path is not UTF-8")?;
    let m = mark(role);
    let mut job = Job::start(elastic(2, &["--max-restarts", "2"], &[me]).env(ROLE_ENV, role).env("FAULTS_MARK", &m));
    let got = job.finish(Duration::from_secs(30));
    let left = marked_gone_within(&m, Duration::ZERO);
    let got = got?;
    let text = job.text();
    check(got == Some(0), || format!("exit code {got:?}:\n{text}"))?;
    let about = |l: &&str| l.starts_with("anyccl-run: rank 1 (pid ") && what.iter().any(|w| l.contains(w));
    check(text.lines().any(|l| about(&l)), || format!("no line saying one of {what:?}:\n{text}"))?;
    check(text.matches("started its incarnation").count() == 1 && text.contains("1 restart left"), || {
        format!("not exactly one restart:\n{text}")
    })?;
    check(text.contains("[rank 1.2] done after several looks"), || format!("incarnation 2 did not run on:\n{text}"))?;
    left?;
    let line = text.lines().find(|l| l.contains("started its incarnation 2")).unwrap_or("");
    println!("    {line}");
    Ok(())
}

/// A process's command line, its arguments joined by spaces.
fn cmdline(pid: i32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    raw.split(|&b| b == 0).filter(|a| !a.is_empty()).map(String::from_utf8_lossy).collect::<Vec<_>>().join(" ")
}

fn signal_now(pid: i32, sig: Signal) {
    let _ = kill(Pid::from_raw(pid), sig);
}

/// The launcher's report is in the job's store: rank 0 (this program) waits for the record
/// that rank 1's first process is gone while this test kills that process with SIGKILL; the
/// replacement says when it started. Prints both delays after the kill.
pub fn the_report_is_in_the_store_before_the_replacement_starts() -> Outcome {
    let me = std::env::current_exe()?;
    let me = me.to_str().ok_or("this program's path is not UTF-8")?;
    let mut job = Job::start(elastic(2, &[], &[me]).env(ROLE_ENV, "report"));
    let ready = job.expect("[rank 1] ready pid ", Duration::from_secs(20));
    let victim = job.text().lines().find_map(|l| l.strip_prefix("[rank 1] ready pid ")?.trim().parse::<i32>().ok());
    let victim = match (ready, victim) {
        (Ok(_), Some(p)) => p,
        _ => {
            signal_now(job.pid(), Signal::SIGTERM);
            let _ = job.finish(Duration::from_secs(10));
            return Err(format!("rank 1 did not say it is ready:\n{}", job.text()).into());
        }
    };
    // Rank 0 waits on the record (a record already there would come at once, its delay
    // measured too long).
    job.expect("[rank 0] waiting", Duration::from_secs(20))?;
    let killed_at = unix_ns();
    signal_now(victim, Signal::SIGKILL);
    let got = job.finish(Duration::from_secs(30))?;
    let text = job.text();
    check(got == Some(0), || format!("exit code {got:?}:\n{text}"))?;
    let at = |pre: &str| text.lines().find_map(|l| l.strip_prefix(pre)?.split(' ').next()?.parse::<u128>().ok());
    let (recorded, started) = (at("[rank 0] gone record at "), at("[rank 1.2] started at "));
    let (Some(recorded), Some(started)) = (recorded, started) else {
        return Err(format!("no record or no replacement:\n{text}").into());
    };
    let record = text.lines().find_map(|l| l.strip_prefix("[rank 0] record: ")).unwrap_or("");
    let want = format!("rank 1 (pid {victim}, incarnation 1) was killed by signal 9 (SIGKILL), seen by anyccl-run");
    check(record == want, || format!("the record says {record:?}, not {want:?}:\n{text}"))?;
    check(recorded <= started + 5_000_000, || format!("the replacement started before the report:\n{text}"))?;
    let ms = |t: u128| t.saturating_sub(killed_at) as f64 / 1e6;
    println!(
        "    SIGKILL of rank 1 -> the launcher's record read from the store after {:.2} ms, its replacement running \
         after {:.2} ms",
        ms(recorded),
        ms(started)
    );
    let line = text.lines().find(|l| l.contains("started its incarnation 2")).unwrap_or("");
    println!("    {line}");
    Ok(())
}

/// This program as a rank of an elastic launcher: rank 0 waits for the record that rank 1's
/// first process is gone and prints it with the time it came; rank 1's first process waits
/// to be killed; its replacement prints when it started.
///
/// Role `declare`: rank 0 records rank 1's first process gone and exits; rank 1's first
/// process waits to be killed. Role `exits`: rank 1's first process records itself gone and
/// exits with code 3. In both, rank 1's replacement runs 1.5 s (several of the launcher's
/// looks at the records) and exits 0.
pub fn rank_role(role: &str) -> std::process::ExitCode {
    let ok = std::process::ExitCode::SUCCESS;
    let env = match anyccl::LaunchEnv::from_env() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    match role {
        "report" => {}
        "declare" | "exits" => return declaring_role(role, &env),
        _ => {
            eprintln!("unknown role {role:?}");
            return std::process::ExitCode::from(2);
        }
    }
    match (env.rank, env.incarnation) {
        (1, 1) => {
            println!("ready pid {}", std::process::id());
            std::thread::sleep(Duration::from_secs(300));
            ok
        }
        (1, _) => {
            println!("started at {}", unix_ns());
            ok
        }
        _ => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
            let got = rt.block_on(async {
                use anyccl::Store;
                let opts = anyccl::TcpStoreOptions::from_env()?;
                let store = anyccl::TcpStore::connect(format!("{}:{}", env.master_addr, env.master_port), opts).await?;
                let key = format!("{}/gone/1/1", anyccl::membership::MembershipConfig::default().prefix);
                println!("waiting for {key}");
                store.wait(&key, Instant::now() + Duration::from_secs(30)).await
            });
            let at = unix_ns();
            match got {
                Ok(v) => {
                    println!("gone record at {at}");
                    println!("record: {}", String::from_utf8_lossy(&v));
                    ok
                }
                Err(e) => {
                    eprintln!("no record: {e}");
                    std::process::ExitCode::from(1)
                }
            }
        }
    }
}

/// Roles `declare` and `exits` of [`rank_role`].
fn declaring_role(role: &str, env: &anyccl::LaunchEnv) -> std::process::ExitCode {
    let record = |text: &str| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
        rt.block_on(async {
            let opts = anyccl::TcpStoreOptions::from_env()?;
            let store = anyccl::TcpStore::connect(format!("{}:{}", env.master_addr, env.master_port), opts).await?;
            let cfg = anyccl::membership::MembershipConfig::default();
            anyccl::membership::Membership::report_gone(&store, &cfg, 1, Some(1), text).await
        })
    };
    let written = match (role, env.rank, env.incarnation) {
        ("declare", 0, _) => record("rank 1 (incarnation 1) is gone: written by rank 0"),
        ("declare", 1, 1) => {
            std::thread::sleep(Duration::from_secs(300));
            Ok(())
        }
        ("exits", 1, 1) => {
            return match record("rank 1 (incarnation 1) is gone: written by itself as it exits") {
                Ok(()) => std::process::ExitCode::from(3),
                Err(e) => {
                    eprintln!("no record: {e}");
                    std::process::ExitCode::from(1)
                }
            };
        }
        (_, 1, _) => {
            std::thread::sleep(Duration::from_millis(1500));
            println!("done after several looks");
            Ok(())
        }
        _ => Ok(()),
    };
    match written {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("no record: {e}");
            std::process::ExitCode::from(1)
        }
    }
}

/// A replacement of a running rank (`ANYCCL_INCARNATION=2`) is admitted by the store's claim
/// while the rank's first process still holds its own, and a second process claiming the
/// same incarnation is refused ("already joined"; the one that claimed first hears of it).
pub fn a_replacement_claims_its_rank_as_the_next_incarnation() -> Outcome {
    let server = anyccl::TcpStoreServer::start(([127, 0, 0, 1], 0).into(), Default::default())?;
    let port = server.local_addr().port();
    let claim = |incarnation: &str| {
        let mut c = by_hand(1, port, None, "5");
        c.env("ANYCCL_STORE_EXTERNAL", "1").env("ANYCCL_INCARNATION", incarnation);
        c
    };
    let mut first = Job::start(&mut claim("1"));
    std::thread::sleep(Duration::from_millis(1500));
    let mut second = Job::start(&mut claim("2"));
    std::thread::sleep(Duration::from_millis(1500));
    // Both still wait (for rank 0, which never comes), neither refused.
    let claimed = |key: &str| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
        rt.block_on(async {
            use anyccl::Store;
            let store =
                anyccl::TcpStore::connect(format!("127.0.0.1:{port}"), anyccl::TcpStoreOptions::default()).await?;
            store.get(key).await
        })
    };
    let both = first.child.try_wait()?.is_none() && second.child.try_wait()?.is_none();
    let second_claim = claimed("anyccl/restart0/rank1/incarnation2")?;
    let t = Instant::now();
    let mut third = Job::start(&mut claim("2"));
    let c = third.finish(Duration::from_secs(20))?;
    let b = second.finish(Duration::from_secs(20))?;
    let took = t.elapsed();
    let still = first.child.try_wait()?.is_none();
    let _ = first.child.kill();
    let _ = first.finish(Duration::from_secs(10));
    check(both && second_claim.is_some(), || {
        format!("incarnation 2 was not admitted beside incarnation 1:\n{}\n{}", first.text(), second.text())
    })?;
    check(c == Some(1) && third.text().contains("already joined") && third.text().contains("(incarnation 2)"), || {
        format!("a second incarnation 2: {c:?}\n{}", third.text())
    })?;
    check(b == Some(1) && second.text().contains("another process claimed this rank"), || {
        format!("incarnation 2 did not hear of the second claim: {b:?}\n{}", second.text())
    })?;
    check(still && !first.text().contains("another process claimed"), || {
        format!("incarnation 1 was disturbed by incarnation 2's claims:\n{}", first.text())
    })?;
    println!(
        "    incarnation 2 admitted beside incarnation 1; a second incarnation 2 refused, both failed in {took:.2?}"
    );
    Ok(())
}
