//! The fault matrix: each way a job was seen to hang, orphan processes, load a wrong
//! checkpoint or panic, reproduced against the real programs on the CPU backend. Each case
//! prints its measured time to error.

#[path = "faults/elastic.rs"]
mod elastic;
#[path = "faults/inputs.rs"]
mod inputs;
#[path = "faults/mixed.rs"]
mod mixed;
#[path = "faults/stopped.rs"]
mod stopped;

use inputs::*;
use mixed::*;
use stopped::*;

use anyccl_examples::checkpoint;
use libtest_mimic::{Arguments, Failed, Trial};
use std::collections::HashSet;
use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn bin(name: &str) -> &'static str {
    match name {
        "anyccl-run" => env!("CARGO_BIN_EXE_anyccl-run"),
        "anyccl-demo" => env!("CARGO_BIN_EXE_anyccl-demo"),
        "anyccl-bench" => env!("CARGO_BIN_EXE_anyccl-bench"),
        "anyccl-recover" => env!("CARGO_BIN_EXE_anyccl-recover"),
        "anyccl-trace" => env!("CARGO_BIN_EXE_anyccl-trace"),
        _ => unreachable!("unknown program {name}"),
    }
}

type Outcome = Result<(), Failed>;

fn check(cond: bool, msg: impl FnOnce() -> String) -> Outcome {
    if cond {
        Ok(())
    } else {
        Err(msg().into())
    }
}

/// One process's (pid, ppid, pgid, state) from /proc.
fn stat(pid: i32) -> Option<(i32, i32, i32, char)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = s.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some((pid, f.get(1)?.parse().ok()?, f.get(2)?.parse().ok()?, f.first()?.chars().next()?))
}

fn processes() -> Vec<(i32, i32, i32, char)> {
    std::fs::read_dir("/proc")
        .map(|d| d.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).filter_map(stat).collect())
        .unwrap_or_default()
}

fn comm(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim().to_string()
}

/// The process groups of the ranks a launcher started (its children but the reaper), once
/// `n` exist.
fn rank_groups(launcher: i32, n: usize) -> Result<HashSet<i32>, Failed> {
    let t = Instant::now();
    loop {
        let g: HashSet<i32> =
            processes().into_iter().filter(|p| p.1 == launcher && comm(p.0) != "anyccl-reaper").map(|p| p.2).collect();
        if g.len() == n {
            return Ok(g);
        }
        if t.elapsed() > Duration::from_secs(20) {
            return Err(format!("the launcher started {} of {n} ranks", g.len()).into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Processes (not zombies) still in `groups`.
fn alive(groups: &HashSet<i32>) -> Vec<i32> {
    processes().into_iter().filter(|p| groups.contains(&p.2) && p.3 != 'Z').map(|p| p.0).collect()
}

/// Wait until no process of `groups` is left; how long that took.
fn gone_within(groups: &HashSet<i32>, limit: Duration) -> Result<Duration, Failed> {
    let t = Instant::now();
    while !alive(groups).is_empty() {
        if t.elapsed() > limit {
            return Err(format!("processes {:?} of the job still run after {limit:?}", alive(groups)).into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(t.elapsed())
}

fn signal(pid: i32, sig: &str) {
    let _ = Command::new("kill").args([&format!("-{sig}"), &pid.to_string()]).status();
}

/// A launcher whose stdout and stderr lines arrive, with their time, on one channel.
struct Job {
    child: Child,
    lines: mpsc::Receiver<(Instant, String)>,
    seen: Vec<(Instant, String)>,
    /// The launcher's exit code, once it exited.
    code: Option<i32>,
}

impl Job {
    fn start(cmd: &mut Command) -> Job {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start the launcher");
        let (tx, lines) = mpsc::channel();
        let out: [Box<dyn std::io::Read + Send>; 2] =
            [Box::new(child.stdout.take().expect("stdout")), Box::new(child.stderr.take().expect("stderr"))];
        for r in out {
            let tx = tx.clone();
            // Bytes, not text: a line that is not UTF-8 must not end the reading.
            std::thread::spawn(move || {
                let mut r = BufReader::new(r);
                let mut line = Vec::new();
                while matches!(r.read_until(b'\n', &mut line), Ok(n) if n > 0) {
                    let text = String::from_utf8_lossy(line.strip_suffix(b"\n").unwrap_or(&line)).into_owned();
                    let _ = tx.send((Instant::now(), text));
                    line.clear();
                }
            });
        }
        Job { child, lines, seen: Vec::new(), code: None }
    }
    fn pid(&self) -> i32 {
        self.child.id() as i32
    }
    /// Wait for a line containing `pat`.
    fn expect(&mut self, pat: &str, limit: Duration) -> Result<Instant, Failed> {
        let until = Instant::now() + limit;
        if let Some((t, _)) = self.seen.iter().find(|(_, l)| l.contains(pat)) {
            return Ok(*t);
        }
        loop {
            let left = until.checked_duration_since(Instant::now()).unwrap_or_default();
            match self.lines.recv_timeout(left) {
                Ok((t, l)) => {
                    let hit = l.contains(pat);
                    self.seen.push((t, l));
                    if hit {
                        return Ok(t);
                    }
                }
                Err(_) => return Err(format!("no line with {pat:?} within {limit:?}; saw:\n{}", self.text()).into()),
            }
        }
    }
    /// Wait for the launcher to exit; its exit code.
    fn finish(&mut self, limit: Duration) -> Result<Option<i32>, Failed> {
        let t = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                // Every line: both readers end at the end of their pipe, once the launcher
                // and whatever shared its output (ranks, the reaper) are gone; bounded, in
                // case one of them outlives it (a test then says so).
                let until = Instant::now() + Duration::from_secs(10);
                loop {
                    let left = until.saturating_duration_since(Instant::now());
                    match self.lines.recv_timeout(left) {
                        Ok(x) => self.seen.push(x),
                        Err(mpsc::RecvTimeoutError::Disconnected) => break,
                        Err(mpsc::RecvTimeoutError::Timeout) => {
                            let note = "(test: the launcher's output was still open 10 s after it exited)";
                            self.seen.push((Instant::now(), note.to_string()));
                            break;
                        }
                    }
                }
                self.code = st.code();
                return Ok(st.code());
            }
            if t.elapsed() > limit {
                let _ = self.child.kill();
                return Err(format!("the launcher still ran after {limit:?}:\n{}", self.text()).into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    /// The number of the last `step N:` line so far.
    fn last_step(&mut self) -> Option<u64> {
        while let Ok(x) = self.lines.try_recv() {
            self.seen.push(x);
        }
        self.seen.iter().rev().find_map(|(_, l)| l.strip_prefix("step ")?.split(':').next()?.parse().ok())
    }
    fn child_ok(&self) -> bool {
        self.code == Some(0)
    }
    fn text(&self) -> String {
        self.seen.iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>().join("\n")
    }
}

fn launcher(n: usize, program: &[&str]) -> Command {
    let mut c = Command::new(bin("anyccl-run"));
    c.args(["-n", &n.to_string(), "--grace", "2", "--"]).args(program).env("ANYCCL_BACKEND", "cpu");
    c
}

const WRAPPED_SLEEP: &[&str] = &["sh", "-c", "sleep 300 & wait"];

// ---------------------------------------------------------------- the launcher

fn kill9_launcher() -> Outcome {
    let mut job = Job::start(&mut launcher(4, WRAPPED_SLEEP));
    let groups = rank_groups(job.pid(), 4)?;
    std::thread::sleep(Duration::from_millis(300));
    let reaper = processes().into_iter().find(|p| p.1 == job.pid() && comm(p.0) == "anyccl-reaper").map(|p| p.0);
    let t = Instant::now();
    signal(job.pid(), "KILL");
    let took = gone_within(&groups, Duration::from_secs(5))?;
    let _ = job.finish(Duration::from_secs(5));
    // The reaper too ends once the ranks are gone, not after its grace (it used to wait on
    // ranks that had ended but were not reaped yet).
    let reaper = reaper.ok_or("the launcher's reaper was not found")?;
    while stat(reaper).is_some_and(|p| p.3 != 'Z') && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let all = t.elapsed();
    check(all < Duration::from_secs(1), || format!("the reaper still ran {all:.2?} after kill -9 of the launcher"))?;
    println!(
        "    kill -9 of the launcher: every rank and its children gone after {took:.2?}, the reaper after {all:.2?}"
    );
    Ok(())
}

fn signal_to_launcher(sig: &'static str, code: i32) -> Outcome {
    let mut job = Job::start(&mut launcher(4, WRAPPED_SLEEP));
    let groups = rank_groups(job.pid(), 4)?;
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    signal(job.pid(), sig);
    let got = job.finish(Duration::from_secs(10))?;
    let took = t.elapsed();
    check(alive(&groups).is_empty(), || format!("processes {:?} outlived the launcher", alive(&groups)))?;
    check(got == Some(code), || format!("exit code {got:?}, expected {code}:\n{}", job.text()))?;
    check(job.text().contains(&format!("stopped by SIG{sig}")), || format!("no reason given:\n{}", job.text()))?;
    println!("    SIG{sig} to the launcher: it exited {code} after stopping every rank, in {took:.2?}");
    Ok(())
}

fn failing_rank_under_wrapper() -> Outcome {
    // Rank 2 exits once this test has seen all four ranks (the file `GO`; at most 20 s).
    let go = std::env::temp_dir().join(format!("anyccl-faults-go-{}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    let script = "if [ \"$RANK\" = 2 ]; then i=0; while [ ! -e \"$GO\" ] && [ $i -lt 400 ]; do sleep 0.05; \
                  i=$((i+1)); done; exit 3; fi; sleep 300 & wait";
    let mut job = Job::start(launcher(4, &["sh", "-c", script]).env("GO", &go));
    let groups = rank_groups(job.pid(), 4);
    std::fs::write(&go, b"")?;
    let groups = groups?;
    let t = Instant::now();
    let got = job.finish(Duration::from_secs(10))?;
    let took = t.elapsed();
    check(got == Some(1), || format!("exit code {got:?}:\n{}", job.text()))?;
    check(job.text().contains("FAILED: rank 2 exited with code 3"), || format!("rank 2 not named:\n{}", job.text()))?;
    check(alive(&groups).is_empty(), || format!("processes {:?} outlived the launcher", alive(&groups)))?;
    let _ = std::fs::remove_file(&go);
    check(took < Duration::from_secs(5), || format!("took {took:?}"))?;
    println!("    a wrapper shell's rank exits 3: launcher exited naming it, nothing left, {took:.2?} after its go");
    Ok(())
}

/// A fresh folder for flight-recorder dumps.
fn trace_dir(case: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("anyccl-faults-{case}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// `anyccl-trace DIR`'s verdict line.
fn trace_suspect(dir: &Path) -> Result<String, Failed> {
    let out = Command::new(bin("anyccl-trace")).arg(dir).output()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let _ = std::fs::remove_dir_all(dir);
    check(out.status.success(), || format!("anyccl-trace failed: {text}{}", String::from_utf8_lossy(&out.stderr)))?;
    text.lines()
        .find(|l| l.starts_with("SUSPECT:"))
        .map(str::to_string)
        .ok_or_else(|| format!("no suspect:\n{text}").into())
}

fn rank_pid(launcher: i32, rank: usize) -> Option<i32> {
    processes().into_iter().filter(|p| p.1 == launcher).map(|p| p.0).find(|&pid| {
        std::fs::read(format!("/proc/{pid}/environ"))
            .map(|e| e.split(|&b| b == 0).any(|v| v == format!("RANK={rank}").as_bytes()))
            .unwrap_or(false)
    })
}

fn kill9_rank() -> Outcome {
    let dir = trace_dir("kill9");
    let mut cmd = launcher(4, &[bin("anyccl-demo"), "--count", "4096", "--steps", "100000000"]);
    cmd.env("ANYCCL_TRACE_DIR", &dir);
    let mut job = Job::start(&mut cmd);
    let groups = rank_groups(job.pid(), 4)?;
    job.expect("step 3:", Duration::from_secs(30))?;
    let victim = rank_pid(job.pid(), 2).ok_or("rank 2 not found")?;
    let t = Instant::now();
    signal(victim, "KILL");
    let got = job.finish(Duration::from_secs(10))?;
    let took = t.elapsed();
    check(got == Some(1), || format!("exit code {got:?}:\n{}", job.text()))?;
    check(job.text().contains("FAILED: rank 2 was killed by signal 9"), || {
        format!("rank 2 not named:\n{}", job.text())
    })?;
    check(alive(&groups).is_empty(), || format!("processes {:?} outlived the launcher", alive(&groups)))?;
    check(took < Duration::from_secs(5), || format!("took {took:?}"))?;
    let suspect = trace_suspect(&dir)?;
    check(suspect.contains("ranks [2] left no dump"), || format!("anyccl-trace blamed another rank: {suspect}"))?;
    println!("    kill -9 of rank 2 mid all_reduce: the launcher named it and exited {took:.2?} later; anyccl-trace: {suspect}");
    Ok(())
}

/// A name for this run's processes, set in the launcher's environment (so in every process
/// of the job): what a test looks for in `/proc/PID/environ`.
fn mark(case: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{case}-{}-{nanos}", std::process::id())
}

/// Processes (not zombies) whose environment has `FAULTS_MARK=mark`.
fn marked(mark: &str) -> Vec<i32> {
    let entry = format!("FAULTS_MARK={mark}");
    processes()
        .into_iter()
        .filter(|p| p.3 != 'Z')
        .map(|p| p.0)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .map(|e| e.split(|&b| b == 0).any(|v| v == entry.as_bytes()))
                .unwrap_or(false)
        })
        .collect()
}

/// Wait until no process carries `mark`; how long that took. Whatever is left at `limit` is
/// killed (by pid) after the failure is noted.
fn marked_gone_within(mark: &str, limit: Duration) -> Result<Duration, Failed> {
    let t = Instant::now();
    loop {
        let left = marked(mark);
        if left.is_empty() {
            return Ok(t.elapsed());
        }
        if t.elapsed() > limit {
            let what: Vec<String> = left.iter().map(|&p| format!("{p} ({})", comm(p))).collect();
            for &p in &left {
                signal(p, "KILL");
            }
            return Err(format!("processes {what:?} of the job still run {limit:?} after the launcher").into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A rank starts a child in a session of its own (so in no group the launcher signals) and
/// fails: the launcher, which inherited the child as a subreaper, stops it before it exits.
fn child_in_own_session_goes_with_the_job() -> Outcome {
    let m = mark("setsid");
    let mut job = Job::start(launcher(2, &["sh", "-c", "setsid sleep 3002 & sleep 1; exit 1"]).env("FAULTS_MARK", &m));
    let got = job.finish(Duration::from_secs(20))?;
    let left = marked_gone_within(&m, Duration::ZERO);
    check(got == Some(1), || format!("exit code {got:?}:\n{}", job.text()))?;
    left?;
    println!("    a rank's child in a session of its own: gone when the launcher exited");
    Ok(())
}

/// kill -9 of the launcher while each rank has a child in a session of its own: the reaper
/// stops those too (they carry the job's identity).
fn kill9_launcher_leaves_no_child_in_own_session() -> Outcome {
    let m = mark("setsid9");
    let mut job = Job::start(launcher(2, &["sh", "-c", "setsid sleep 3003 & sleep 300 & wait"]).env("FAULTS_MARK", &m));
    let t = Instant::now();
    while marked(&m).into_iter().filter(|&p| comm(p) == "sleep").count() < 4 {
        if t.elapsed() > Duration::from_secs(20) {
            let _ = marked_gone_within(&m, Duration::ZERO);
            return Err("the ranks' children did not start".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(job.pid(), "KILL");
    let took = marked_gone_within(&m, Duration::from_secs(5))?;
    let _ = job.finish(Duration::from_secs(5));
    println!("    kill -9 of the launcher: the ranks' children in sessions of their own gone after {took:.2?}");
    Ok(())
}

/// A line that is not UTF-8 is passed through as it is, and the rank's output after it
/// (stdout and stderr) still arrives: the rank is not stopped by a closed pipe.
fn output_not_utf8_passes_through() -> Outcome {
    let script = "printf 'a\\377b\\n'; i=0; while [ $i -lt 2000 ]; do echo line $i; i=$((i+1)); done; echo late >&2";
    let out = launcher(2, &["sh", "-c", script]).output()?;
    let (o, e) = (&out.stdout, String::from_utf8_lossy(&out.stderr));
    let has = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
    check(out.status.success(), || format!("{:?}\n{e}", out.status))?;
    for r in 0..2 {
        check(has(o, &[format!("[rank {r}] a").as_bytes(), b"\xffb\n"].concat()), || {
            format!("rank {r}'s line that is not UTF-8 is not passed through as it is")
        })?;
        check(has(o, format!("[rank {r}] line 1999\n").as_bytes()) && e.contains(&format!("[rank {r}] late")), || {
            format!("rank {r}'s output after the line that is not UTF-8 is missing:\n{e}")
        })?;
    }
    Ok(())
}

/// A 64 MiB line without a newline: the launcher writes it in prefixed pieces of at most
/// `--max-line` bytes (64 KiB by default) and its peak memory stays far below the line.
fn long_line_in_bounded_memory() -> Outcome {
    const LINE: usize = 64 << 20;
    let script = format!("head -c {LINE} /dev/zero | tr '\\0' x; echo; echo done; sleep 2");
    let mut child = launcher(1, &["sh", "-c", &script]).stdout(Stdio::piped()).stderr(Stdio::null()).spawn()?;
    let pid = child.id();
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let (tx, rx) = mpsc::channel();
    // Counts the bytes of the long line and the longest record, and says when `done` came.
    let reader = std::thread::spawn(move || {
        let (mut xs, mut longest, mut bad) = (0usize, 0usize, 0usize);
        let mut r = BufReader::new(stdout);
        let mut line = Vec::new();
        while matches!(r.read_until(b'\n', &mut line), Ok(n) if n > 0) {
            longest = longest.max(line.len());
            match line.strip_prefix(b"[rank 0] ") {
                Some(b"done\n") => {
                    let _ = tx.send(());
                }
                Some(rest) => xs += rest.iter().filter(|&&b| b == b'x').count(),
                None => bad += 1,
            }
            line.clear();
        }
        (xs, longest, bad)
    });
    let came = rx.recv_timeout(Duration::from_secs(60));
    // The launcher's peak resident memory, read while it still runs (the rank sleeps).
    let hwm_kib = std::fs::read_to_string(format!("/proc/{pid}/status")).ok().and_then(|s| {
        s.lines().find_map(|l| l.strip_prefix("VmHWM:")?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
    });
    let status = child.wait()?;
    let (xs, longest, bad) = reader.join().map_err(|_| "reader panicked")?;
    check(came.is_ok() && status.success(), || format!("{status:?}: the rank's last line did not come"))?;
    check(xs == LINE && bad == 0, || format!("{xs} of {LINE} bytes came through; {bad} records without the prefix"))?;
    let hwm = hwm_kib.ok_or("the launcher's peak memory could not be read")?;
    check(hwm < 32 << 10, || {
        format!("the launcher's peak memory was {} MiB for a {} MiB line", hwm >> 10, LINE >> 20)
    })?;
    check(longest <= (64 << 10) + 10, || format!("a record of {longest} bytes, longer than --max-line"))?;
    println!(
        "    a {} MiB line: written in pieces of {longest} bytes, launcher peak memory {} MiB",
        LINE >> 20,
        hwm >> 10
    );
    Ok(())
}

fn rank_count_bounds() -> Outcome {
    for (n, want) in [("100000", "-n must be between 1 and 4096"), ("0", "-n must be between 1 and 4096")] {
        let out = Command::new(bin("anyccl-run")).args(["-n", n, "--", "true"]).output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        check(out.status.code() == Some(2) && err.contains(want), || format!("-n {n}: {:?} {err}", out.status))?;
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    // Started as a rank by a launcher in one of the cases below.
    if let Ok(role) = std::env::var(elastic::ROLE_ENV) {
        return elastic::rank_role(&role);
    }
    let mut args = Arguments::from_args();
    // The cases time errors against deadlines: one at a time, so they do not load each other.
    args.test_threads = Some(1);
    let t = |name: &str, f: fn() -> Outcome| Trial::test(name, f);
    let trials = vec![
        t("launcher::faults::kill9_launcher_leaves_no_rank[w=4]", kill9_launcher),
        t("launcher::faults::sigterm_stops_every_rank[w=4]", || signal_to_launcher("TERM", 143)),
        t("launcher::faults::sigint_stops_every_rank[w=4]", || signal_to_launcher("INT", 130)),
        t("launcher::faults::failing_rank_under_a_wrapper_shell[w=4]", failing_rank_under_wrapper),
        t("launcher::faults::kill9_rank_is_named[w=4]", kill9_rank),
        t("launcher::faults::rank_count_is_bounded", rank_count_bounds),
        t("launcher::faults::child_in_own_session_goes_with_the_job[w=2]", child_in_own_session_goes_with_the_job),
        t(
            "launcher::faults::kill9_launcher_leaves_no_child_in_own_session[w=2]",
            kill9_launcher_leaves_no_child_in_own_session,
        ),
        t("launcher::faults::output_not_utf8_passes_through[w=2]", output_not_utf8_passes_through),
        t("launcher::faults::long_line_in_bounded_memory[w=1]", long_line_in_bounded_memory),
        t("cpu::faults::stopped_rank_64kib_errors_within_timeout[w=4]", || stopped_rank(16 << 10)),
        t("cpu::faults::stopped_rank_4mib_errors_within_timeout[w=4]", || stopped_rank(1 << 20)),
        t("cpu::faults::stopped_rank_0_pipelined_is_named[w=4]", || stopped_rank_pipelined(0)),
        t("cpu::faults::stopped_rank_2_pipelined_is_named[w=4]", || stopped_rank_pipelined(2)),
        t("cpu::faults::huge_environment_timeouts_are_errors", huge_timeouts_are_errors),
        t("cpu::faults::detail_mode_names_both_calls[w=3]", detail_mode_mismatch),
        t("store::faults::unresolvable_master_addr_ends_at_init_timeout", unresolvable_master_addr),
        t("bench::faults::bad_sizes_and_counts_are_errors", bench_bad_sizes),
        t("cpu::faults::malformed_settings_are_errors[w=2]", malformed_cpu_settings),
        t("store::faults::a_rank_claimed_twice_is_refused[w=2]", || {
            two_jobs_on_one_port([None, None], "already joined")
        }),
        t("store::faults::a_rank_claimed_twice_fails_both_claimants[w=2]", duplicate_rank_fails_both_sides),
        t("store::faults::another_jobs_rank_is_refused[w=2]", || {
            two_jobs_on_one_port([Some("job-a"), Some("job-b")], "belongs to job 'job-a'")
        }),
        t(
            "launcher::elastic::a_killed_rank_is_restarted_and_the_others_keep_running[w=3]",
            elastic::a_killed_rank_is_restarted_and_the_others_keep_running,
        ),
        t(
            "launcher::elastic::a_crash_loop_uses_up_the_restarts_and_fails_the_job[w=2]",
            elastic::a_crash_loop_uses_up_the_restarts_and_fails_the_job,
        ),
        t("launcher::elastic::bad_restart_flags_are_refused", elastic::bad_restart_flags_are_refused),
        t(
            "launcher::elastic::kill9_launcher_mid_restart_leaves_no_process[w=3]",
            elastic::kill9_launcher_mid_restart_leaves_no_process,
        ),
        t(
            "launcher::elastic::sigterm_after_a_restart_stops_every_rank[w=3]",
            elastic::sigterm_after_a_restart_stops_every_rank,
        ),
        t(
            "launcher::elastic::a_stopped_rank_is_not_restarted_and_the_timeout_holds[w=2]",
            elastic::a_stopped_rank_is_not_restarted_and_the_timeout_holds,
        ),
        t(
            "launcher::elastic::a_stopped_rank_declared_gone_is_killed_and_replaced[w=4]",
            elastic::a_stopped_rank_declared_gone_is_killed_and_replaced,
        ),
        t(
            "launcher::elastic::a_stopped_rank_resumed_after_the_decision_is_still_killed[w=4]",
            elastic::a_stopped_rank_resumed_after_the_decision_is_still_killed,
        ),
        t(
            "launcher::elastic::two_ranks_stopped_at_once_are_both_replaced[w=4]",
            elastic::two_ranks_stopped_at_once_are_both_replaced,
        ),
        t(
            "launcher::elastic::a_gone_record_written_by_another_process_is_acted_on_once[w=2]",
            elastic::a_gone_record_written_by_another_process_is_acted_on_once,
        ),
        t(
            "launcher::elastic::a_gone_record_of_a_rank_that_exited_is_not_a_second_restart[w=2]",
            elastic::a_gone_record_of_a_rank_that_exited_is_not_a_second_restart,
        ),
        t(
            "launcher::elastic::the_report_is_in_the_store_before_the_replacement_starts[w=2]",
            elastic::the_report_is_in_the_store_before_the_replacement_starts,
        ),
        t(
            "store::elastic::a_replacement_claims_its_rank_as_the_next_incarnation[w=2]",
            elastic::a_replacement_claims_its_rank_as_the_next_incarnation,
        ),
        t("recover::faults::bad_arguments_are_errors", recover_bad_arguments),
        t("recover::faults::model_flags_reach_the_ranks[w=4]", recover_forwards_model_flags),
        t("recover::faults::inconsistent_checkpoints_fall_back_or_fail[w=4]", inconsistent_checkpoints),
    ];
    libtest_mimic::run(&args, trials).exit_code()
}
