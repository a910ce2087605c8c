//! The example programs, run as a user runs them: the launcher's failure handling and the
//! recovery demo's bit-for-bit verdict, on the CPU backend.

use std::process::Command;
use std::time::{Duration, Instant};

fn bin(name: &str) -> &'static str {
    match name {
        "anyccl-run" => env!("CARGO_BIN_EXE_anyccl-run"),
        "anyccl-demo" => env!("CARGO_BIN_EXE_anyccl-demo"),
        "anyccl-recover" => env!("CARGO_BIN_EXE_anyccl-recover"),
        "anyccl-conformance" => env!("CARGO_BIN_EXE_anyccl-conformance"),
        "anyccl-candle" => env!("CARGO_BIN_EXE_anyccl-candle"),
        "anyccl-sim" => env!("CARGO_BIN_EXE_anyccl-sim"),
        _ => unreachable!("unknown program {name}"),
    }
}

#[test]
fn launcher_names_the_rank_that_exits_and_stops_the_others() {
    let t = Instant::now();
    let out = Command::new(bin("anyccl-run"))
        .args(["-n", "4", "--timeout", "60", "--", bin("anyccl-demo")])
        .args(["--count", "10000", "--steps", "1000", "--exit-rank", "2", "--exit-code", "3", "--exit-at", "2"])
        .env("ANYCCL_BACKEND", "cpu")
        .output()
        .expect("run the launcher");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the launcher succeeded although rank 2 exited with 3");
    assert!(err.contains("FAILED: rank 2 exited with code 3"), "the launcher did not name rank 2:\n{err}");
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
}

#[test]
fn launcher_times_out_hung_ranks() {
    let t = Instant::now();
    let out = Command::new(bin("anyccl-run"))
        .args(["-n", "2", "--timeout", "1", "--grace", "1", "--", "sleep", "60"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("timed out"), "no timeout message");
    assert!(t.elapsed() < Duration::from_secs(10), "took {:?}", t.elapsed());
}

#[test]
fn launcher_sets_per_rank_variables() {
    let out = Command::new(bin("anyccl-run"))
        .args(["-n", "3", "--timeout", "30", "--", "sh", "-c", "echo value=$ANYCCL_TEST_VAR"])
        .env("ANYCCL_RANK_ENV", "ANYCCL_TEST_VAR=host-{rank}")
        .output()
        .expect("run the launcher");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    for r in 0..3 {
        assert!(text.contains(&format!("[rank {r}] value=host-{r}")), "rank {r} lacks its value:\n{text}");
    }
    let bad = Command::new(bin("anyccl-run"))
        .args(["-n", "2", "--", "true"])
        .env("ANYCCL_RANK_ENV", "no-equals-sign")
        .output()
        .expect("run the launcher");
    assert!(!bad.status.success(), "a malformed ANYCCL_RANK_ENV was accepted");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("ANYCCL_RANK_ENV"), "the error does not name the variable");
}

/// A rank that stops itself after the others ended: the launcher says, once, that nothing
/// can progress (no other process is left to notice), and the job ends well when the rank is
/// resumed.
#[test]
fn launcher_says_when_every_running_rank_is_stopped_and_waits_for_it() {
    use std::io::BufRead;
    let t = Instant::now();
    let mut job = Command::new(bin("anyccl-run"))
        .args(["-n", "2", "--timeout", "60", "--", "sh", "-c", "[ $RANK = 1 ] && kill -STOP $$; echo done"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run the launcher");
    let err = std::io::BufReader::new(job.stderr.take().expect("stderr"));
    let mut said = String::new();
    for line in err.lines() {
        let line = line.expect("read the launcher's stderr");
        if line.contains("is stopped (SIGSTOP or a debugger) and no other rank runs") {
            said = line;
            break;
        }
    }
    let pid: String = said.split("(pid ").nth(1).unwrap_or("").chars().take_while(char::is_ascii_digit).collect();
    assert!(said.contains("rank 1 (pid") && !pid.is_empty(), "the launcher did not say rank 1 is stopped: {said}");
    let waited = t.elapsed();
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
    let status = job.wait().expect("the launcher ends");
    assert!(status.success(), "the resumed job failed: {status}");
    assert!(waited >= Duration::from_secs(5) && waited < Duration::from_secs(30), "said after {waited:?}");
}

/// `/dev/full`, opened for writing: every write fails with "No space left on device".
fn full() -> std::fs::File {
    std::fs::OpenOptions::new().write(true).open("/dev/full").expect("open /dev/full (Linux)")
}

/// `anyccl-run -n 2 --timeout 30 -- sh -c script`, to be given its streams.
fn two_ranks(script: &str) -> Command {
    let mut c = Command::new(bin("anyccl-run"));
    c.args(["-n", "2", "--timeout", "30", "--", "sh", "-c", script]);
    c
}

#[test]
fn launcher_output_that_cannot_be_written_fails_the_run_and_says_how_much() {
    // Stdout full: the ranks succeed, their lines ("[rank R] a line\n", 16 bytes each) are
    // lost, and the launcher says so on stderr.
    let out = two_ranks("echo a line").stdout(full()).output().expect("run the launcher");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "lost output did not fail the run:\n{err}");
    assert!(err.contains("output could not be written: 32 bytes to stdout (No space left"), "{err}");
    // Stderr full and a rank failing: no panic (code 101); the note goes to stdout.
    let out = two_ranks("echo oops >&2; exit 3").stderr(full()).output().expect("run the launcher");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("bytes to stderr (No space left"), "{text}");
    // A reader that goes away (`| head -1`): the ranks run to the end, not stopped by the pipe.
    let mut child = two_ranks("seq 1 20000; echo done > /dev/stderr")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run the launcher");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait for the launcher");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.matches("] done").count(), 2, "a rank was stopped by the closed pipe:\n{err}");
    assert!(err.contains("bytes to stdout (Broken pipe"), "{err}");
}

#[test]
fn a_program_whose_report_cannot_be_written_fails() {
    let out = Command::new(bin("anyccl-conformance"))
        .args(["--backend", "cpu", "--world-sizes", "1", "--filter", "barrier"])
        .stdout(full())
        .output()
        .expect("run the conformance runner");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "a report lost to a full disk passed:\n{err}");
    assert!(err.contains("the report could not be written to stdout: No space left"), "{err}");
    let out =
        Command::new(bin("anyccl-sim")).args(["--ranks", "8"]).stdout(full()).output().expect("run the simulator");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("anyccl-sim: output could not be written"), "{err}");
}

#[test]
fn recovery_demo_matches_the_uninterrupted_run_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("anyccl-recover-test-{}", std::process::id()));
    let out = Command::new(bin("anyccl-recover"))
        .args(["demo", "--out", &dir.display().to_string(), "--steps", "12", "--ckpt-every", "4", "--crash-at", "9"])
        .env("ANYCCL_BACKEND", "cpu")
        .output()
        .expect("run the demo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "demo failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("crashing at step 9"), "no crash:\n{text}");
    assert!(text.contains("loaded the checkpoint of step 8"), "no recovery from step 8:\n{text}");
    assert!(text.contains("not warmed: weight-sync"), "the cross-engine group is not reported:\n{text}");
    assert!(text.contains("bit-for-bit match"), "no match:\n{text}");
    // The warmup replayed the plan saved with the checkpoint it loaded.
    let plan = dir.join("crash/ckpt/step000008/warmup-plan-rank1.json");
    for g in ["dp-stage0", "pp-replica0"] {
        let want = format!("plan of '{g}': recorded with the checkpoint of step 8");
        assert!(text.contains(&want), "'{want}' missing:\n{text}");
    }

    // Rank 1's plan corrupt: its groups fall back to the role plans, saying why; the
    // recovery goes on and still matches.
    let mut raw = std::fs::read(&plan).expect("the saved plan");
    let at = raw.len() - 10;
    raw[at] ^= 0x20;
    std::fs::write(&plan, &raw).expect("corrupt it");
    let out = Command::new(bin("anyccl-run"))
        .args(["-n", "4", "--timeout", "120", "--", bin("anyccl-recover"), "train"])
        .args(["--steps", "12", "--ckpt-every", "4", "--run", "again", "--out", &dir.display().to_string()])
        .args(["--resume-from", &dir.join("crash").display().to_string()])
        .env("ANYCCL_BACKEND", "cpu")
        .output()
        .expect("run the recovery");
    let (text, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the recovery failed:\n{text}\n{err}");
    let why = format!("warmup plan file {}: checksum mismatch", plan.display());
    assert!(err.contains(&why), "rank 1 does not name its corrupt file:\n{err}");
    // Rank 0 reports its groups: its pipeline group has rank 1 in it, its data group not.
    let fell_back = "plan of 'pp-replica0': role plan (pipeline), since no saved plan on every member: group rank 1";
    assert!(text.contains(fell_back), "{text}");
    assert!(text.contains("plan of 'dp-stage0': recorded with the checkpoint of step 8"), "{text}");
    let bits = |run: &str| {
        let (_, p) = anyccl_examples::checkpoint::read_shard(&dir.join(run).join("final/rank1.bin")).expect("shard");
        p.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
    };
    assert!(bits("again") == bits("ref"), "the recovery after the fallback differs from the reference");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A real engine's tensors: candle on the CPU, gradients all-reduced through anyccl from
/// candle's own storage, checkpointed, crashed and recovered with the warmup.
#[test]
fn candle_data_parallel_recovers_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("anyccl-candle-test-{}", std::process::id()));
    let out = Command::new(bin("anyccl-candle"))
        .args(["demo", "--out", &dir.display().to_string(), "--ranks", "2", "--steps", "12", "--ckpt-every", "4"])
        .output()
        .expect("run the candle demo");
    let text = String::from_utf8_lossy(&out.stdout);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "demo failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("crashing at step 7"), "no crash:\n{text}");
    assert!(text.contains("loaded the checkpoint of step 4"), "no recovery from step 4:\n{text}");
    assert!(text.contains("bit-for-bit match"), "no match:\n{text}");
}

/// Recovery in place when the last rank dies in the middle of the last step: the healthy
/// replica finishes alone, and the ranks of the broken one (a survivor that completed one
/// step fewer, and the replacement, which trained none) take their stage's final
/// parameters from it (or, where the replacement joins before that step ends, are fed them).
/// Every final shard then holds the last step (before, the survivor's held step 39 and the
/// replacement's step 0, and the job still exited 0).
#[test]
fn in_place_kill_in_the_last_step_leaves_every_final_shard_at_the_last_step() {
    let dir = std::env::temp_dir().join(format!("anyccl-inplace-last-{}", std::process::id()));
    let out = Command::new(bin("anyccl-run"))
        .args(["-n", "4", "--elastic", "--max-restarts", "2", "--timeout", "120", "--"])
        .args([bin("anyccl-recover"), "train", "--in-place", "--steps", "40", "--step-ms", "5", "--kill-at", "39"])
        .args(["--run", "last", "--out", &dir.display().to_string()])
        .env("ANYCCL_BACKEND", "cpu")
        .output()
        .expect("run the launcher");
    let text = format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let shards: Vec<_> =
        (0..4).map(|r| anyccl_examples::checkpoint::read_shard(&dir.join(format!("last/final/rank{r}.bin")))).collect();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "the job failed:\n{text}");
    assert!(text.contains("killing itself with SIGKILL in the middle of step 40"), "no kill:\n{text}");
    // Its replica's ranks take their stage's final parameters from replica 0, or, where the
    // replacement joined before replica 0's last step ended (a loaded host), are fed them.
    let took = text.contains("did not train to the end") || text.contains("received the parameters of step 40");
    assert!(took, "replica 1 holds neither the final parameters nor those it was fed:\n{text}");
    let shards: Vec<_> = shards.into_iter().map(|s| s.expect("every rank wrote its final shard")).collect();
    for (r, (id, _)) in shards.iter().enumerate() {
        assert_eq!(id.step, 40, "rank {r}'s final shard holds step {}:\n{text}", id.step);
    }
    // dp 2 x pp 2: ranks 0 and 2 are stage 0, ranks 1 and 3 stage 1.
    assert!(shards[0].1 == shards[2].1 && shards[1].1 == shards[3].1, "replicas differ at the end:\n{text}");
}

/// The recovery demo on the HCCL backend against the workspace's stand-in library (no
/// Ascend hardware here): with 8 MiB of device memory left for the first step, the warmed
/// run recovers bit for bit and reports each group's connect memory; the cold run fails
/// with HCCL's out-of-memory error naming the group, and nothing hangs.
mod hccl {
    /// With no HCCL anywhere, every case is ignored with the probe's reason, which lists
    /// every place looked; nothing fails or panics.
    #[test]
    fn no_library_ignores_every_case_with_the_places_looked() {
        let out = std::process::Command::new(super::bin("anyccl-conformance"))
            .args(["--backend", "hccl"])
            .env("ANYCCL_HCCL_LIBRARY_DIR", "/nonexistent-hccl")
            .env_remove("ASCEND_HOME_PATH")
            .env_remove("ASCEND_TOOLKIT_HOME")
            .output()
            .expect("run the conformance runner");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "runner failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
        let last = text.lines().last().unwrap_or_default();
        assert!(last.starts_with("0 passed, 0 failed,") && !last.contains(" 0 ignored"), "{last}");
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("... ")).collect();
        assert!(!lines.is_empty());
        for l in lines {
            assert!(l.contains("ignored: hccl backend unavailable"), "{l}");
            assert!(l.contains("/nonexistent-hccl/libhccl.so") && l.contains("libascendcl.so"), "{l}");
        }
    }

    mod recover {
        use super::super::bin;
        use std::process::Command;

        fn demo(extra: &[&str], tag: &str) -> (bool, String) {
            let dir = std::env::temp_dir().join(format!("anyccl-hccl-{tag}-{}", std::process::id()));
            let mut cmd = Command::new(bin("anyccl-recover"));
            cmd.args(["demo", "--backend", "hccl", "--squeeze", "8", "--out", &dir.display().to_string()])
                .args(["--steps", "12", "--ckpt-every", "4", "--crash-at", "9"])
                .args(extra)
                // A small device (links are counted, not allocated; the squeeze allocates).
                .env("ANYCCL_STANDIN_DEVICE_MEMORY", "512M")
                .env("ANYCCL_BUFFER_MB", "20");
            run_in(cmd, &dir)
        }

        #[test]
        fn squeezed_first_step_succeeds_warmed() {
            let (ok, text) = demo(&[], "warm");
            assert!(ok, "demo failed:\n{text}");
            assert!(text.contains("warmup of job"), "no warmup report:\n{text}");
            assert!(text.contains("dp-stage0") && text.contains("pp-replica0"), "no per-group rows:\n{text}");
            assert!(text.contains("memory: from the device's free memory"), "no memory source:\n{text}");
            assert!(text.contains("first step after recovery succeeded with the squeezed memory"), "{text}");
            assert!(text.contains("bit-for-bit match"), "no match:\n{text}");
        }

        /// Recovery in place on 8 ranks (dp 4 x pp 2): the replacement's replica rejoins,
        /// warmed, and the first step after it allocates nothing from the counted pool; not
        /// warmed, the same step reports its connect memory.
        fn in_place(extra: &[&str], tag: &str) -> (bool, String) {
            let dir = std::env::temp_dir().join(format!("anyccl-hccl-inplace-{tag}-{}", std::process::id()));
            let mut cmd = Command::new(bin("anyccl-recover"));
            cmd.args(["demo", "--in-place", "--backend", "hccl", "--dp", "4", "--pp", "2"])
                .args(["--steps", "40", "--ckpt-every", "5", "--out", &dir.display().to_string()])
                .args(extra);
            run_in(cmd, &dir)
        }

        /// `cmd` against the stand-in, then `dir` removed: whether it succeeded, and its output.
        fn run_in(mut cmd: Command, dir: &std::path::Path) -> (bool, String) {
            let out =
                cmd.env("ANYCCL_HCCL_LIBRARY_DIR", anyccl_hccl_standin::library_dir()).output().expect("run the demo");
            let _ = std::fs::remove_dir_all(dir);
            let text = format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            (out.status.success(), text)
        }

        #[test]
        fn in_place_first_step_after_the_rejoin_allocates_nothing_warmed() {
            let (ok, text) = in_place(&[], "warm");
            assert!(ok, "demo failed:\n{text}");
            let firsts: Vec<&str> = text.lines().filter(|l| l.contains("the first step of epoch")).collect();
            assert!(!firsts.is_empty(), "no first step after a rebuild was measured:\n{text}");
            assert!(firsts.iter().all(|l| l.contains("allocated 0.0 MiB")), "{firsts:#?}");
            assert!(text.contains("received the parameters"), "no replica was fed:\n{text}");
            assert!(
                !text.contains("back (the replacement's first step) never"),
                "the replica never came back:\n{text}"
            );
            assert!(text.contains("bit-for-bit match"), "no match:\n{text}");
        }

        #[test]
        fn in_place_first_step_after_the_rejoin_pays_its_connects_cold() {
            let (ok, text) = in_place(&["--no-warmup"], "cold");
            assert!(ok, "demo failed:\n{text}");
            let paid =
                text.lines().filter(|l| l.contains("the first step of epoch") && !l.contains(" 0.0 MiB")).count();
            assert!(paid > 0, "no first step paid for its connects:\n{text}");
        }

        #[test]
        fn squeezed_first_step_fails_cold_with_hccl_oom() {
            let t = std::time::Instant::now();
            let (ok, text) = demo(&["--no-warmup"], "cold");
            assert!(!ok, "the cold recovery should fail:\n{text}");
            assert!(text.contains("HCCL_E_OOM") && text.contains("of group 'pp-replica"), "{text}");
            assert!(t.elapsed() < std::time::Duration::from_secs(120), "took {:?}", t.elapsed());
        }
    }
}

/// Recovery in place on the CPU backend (dp 2 x pp 2 under `anyccl-run --elastic`): a rank
/// killed with SIGKILL mid-step, the healthy replica goes on, the replacement's replica is
/// fed and rejoins, and the run equals the replay of its participation record bit for bit.
mod cpu {
    mod inplace {
        use super::super::bin;
        use std::process::Command;

        #[test]
        fn killed_rank_rejoins_and_the_run_matches_its_replay_bit_for_bit() {
            let dir = std::env::temp_dir().join(format!("anyccl-inplace-cpu-{}", std::process::id()));
            let out = Command::new(bin("anyccl-recover"))
                .args(["demo", "--in-place", "--steps", "40", "--ckpt-every", "5", "--out", &dir.display().to_string()])
                .env("ANYCCL_BACKEND", "cpu")
                .output()
                .expect("run the demo");
            let _ = std::fs::remove_dir_all(&dir);
            let text = format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success(), "demo failed:\n{text}");
            assert!(text.contains("killing itself with SIGKILL in the middle of step"), "no fault:\n{text}");
            assert!(text.contains("received the parameters"), "no replica was fed:\n{text}");
            let summary = text.lines().find(|l| l.starts_with("in place:")).unwrap_or_default();
            assert!(summary.ends_with("steps lost: 0"), "steps were lost in place: {summary}\n{text}");
            assert!(!text.contains("never"), "a recovery step never happened:\n{text}");
            assert!(text.contains("bit-for-bit match"), "no match:\n{text}");
        }
    }
}

/// `anyccl-recover train --in-place` under `anyccl-run --elastic`, with rank 0 (the first
/// member, whose leadership must move) killed by hand at a moment no script chose: the job
/// ends well, every rank writes its parameters, and the membership says who left.
mod launcher {
    mod inplace {
        use super::super::bin;
        use std::process::{Command, Stdio};
        use std::time::Duration;

        fn rank_pid(rank: usize) -> Option<u32> {
            for e in std::fs::read_dir("/proc").ok()?.flatten() {
                let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
                let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else { continue };
                let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
                let is_rank = env.split(|b| *b == 0).any(|v| v == format!("RANK={rank}").as_bytes());
                let ours = String::from_utf8_lossy(&cmd).contains("anyccl-inplace-byhand");
                if is_rank && ours && String::from_utf8_lossy(&cmd).contains("train") {
                    return Some(pid);
                }
            }
            None
        }

        #[test]
        fn rank_0_killed_by_hand_is_replaced_and_the_job_ends_well() {
            let dir = std::env::temp_dir().join(format!("anyccl-inplace-byhand-{}", std::process::id()));
            let job = Command::new(bin("anyccl-run"))
                .args(["-n", "4", "--elastic", "--max-restarts", "2", "--timeout", "120", "--"])
                .args([bin("anyccl-recover"), "train", "--in-place", "--steps", "60", "--step-ms", "40"])
                .args(["--run", "byhand", "--out", &dir.display().to_string()])
                .env("ANYCCL_BACKEND", "cpu")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start the launcher");
            std::thread::sleep(Duration::from_millis(1200));
            let pid = rank_pid(0).expect("rank 0 is running");
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            let out = job.wait_with_output().expect("the launcher ends");
            let text = format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            let finals = (0..4).filter(|r| dir.join(format!("byhand/final/rank{r}.bin")).exists()).count();
            let _ = std::fs::remove_dir_all(&dir);
            assert!(out.status.success(), "the job failed:\n{text}");
            assert!(text.contains("rank 0 (pid") && text.contains("started its incarnation 2"), "{text}");
            assert!(text.contains("left [0]"), "no epoch left rank 0 out:\n{text}");
            assert_eq!(finals, 4, "not every rank wrote its parameters:\n{text}");
        }
    }
}

/// The simulation's figures (`anyccl-sim --json`) and whether its own check passed.
fn simulate(args: &[&str]) -> serde_json::Value {
    let out = Command::new(bin("anyccl-sim")).args(args).arg("--json").output().expect("run anyccl-sim");
    let text = String::from_utf8_lossy(&out.stdout);
    let j: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| {
        panic!("anyccl-sim {args:?} printed no figures ({e}):\n{text}\n{}", String::from_utf8_lossy(&out.stderr))
    });
    assert!(out.status.success() && j["fault"]["passed"] == true, "anyccl-sim {args:?}: {}", j["fault"]["check"]);
    j
}

/// The warmup protocol's store requests per rank stay flat as the job grows (64 to 256
/// ranks, over 2 processes each, warming from saved plans, then repeating the generation,
/// which must replay): no phase reads every rank's key on every rank.
#[test]
fn sim_warmup_protocol_cost_is_linear_in_ranks() {
    let small =
        simulate(&["--ranks", "64", "--procs", "2", "--layout", "2x8x4", "--connect-ms", "2", "--saved", "--repeat"]);
    let large =
        simulate(&["--ranks", "256", "--procs", "2", "--layout", "8x8x4", "--connect-ms", "2", "--saved", "--repeat"]);
    let per_rank = |j: &serde_json::Value| j["store_ops_per_rank"].as_f64().expect("store_ops_per_rank");
    let (a, b) = (per_rank(&small), per_rank(&large));
    assert!(a > 0.0 && b <= a * 1.1 && b <= 24.0, "store requests per rank: {a} at 64 ranks, {b} at 256");
    for j in [&small, &large] {
        assert_eq!(j["ranks_ok"], j["ranks"], "{j}");
        for phase in ["claim", "source", "agree", "outcome", "final"] {
            let ops = j["phases"][phase]["per_rank"].as_f64().expect("per_rank");
            assert!(ops > 0.0 && ops <= 8.0, "phase {phase}: {ops} requests per rank: {j}");
        }
        assert_eq!(j["server"]["waiting_at_end"], 0, "waits left on the store: {j}");
    }
}

/// One rank fails, one hangs, one's process dies (with every rank in it, rank 0 included):
/// every other rank returns an error within the deadline + 5 s (anyccl-sim checks it).
#[test]
fn sim_warmup_faults_reach_every_rank() {
    for fault in ["fail:37", "hang:5", "die:0"] {
        let j = simulate(&["--ranks", "128", "--procs", "2", "--timeout", "4", "--connect-ms", "2", "--fault", fault]);
        assert_eq!(j["ranks_ok"], 0, "{fault}: {j}");
        assert_eq!(j["server"]["waiting_at_end"], 0, "{fault}: waits left on the store: {j}");
    }
}
