//! The example programs, run as a user runs them: the launcher's failure handling and the
//! recovery demo's bit-for-bit verdict, on the CPU backend.

use std::process::Command;
use std::time::{Duration, Instant};

fn bin(name: &str) -> &'static str {
    match name {
        "anyccl-run" => env!("CARGO_BIN_EXE_anyccl-run"),
        "anyccl-demo" => env!("CARGO_BIN_EXE_anyccl-demo"),
        "anyccl-recover" => env!("CARGO_BIN_EXE_anyccl-recover"),
        "anyccl-candle" => env!("CARGO_BIN_EXE_anyccl-candle"),
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

#[test]
fn recovery_demo_matches_the_uninterrupted_run_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("anyccl-recover-test-{}", std::process::id()));
    let out = Command::new(bin("anyccl-recover"))
        .args(["demo", "--out", &dir.display().to_string(), "--steps", "12", "--ckpt-every", "4", "--crash-at", "9"])
        .env("ANYCCL_BACKEND", "cpu")
        .output()
        .expect("run the demo");
    let text = String::from_utf8_lossy(&out.stdout);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "demo failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("crashing at step 9"), "no crash:\n{text}");
    assert!(text.contains("loaded the checkpoint of step 8"), "no recovery from step 8:\n{text}");
    assert!(text.contains("not warmed: weight-sync"), "the cross-engine group is not reported:\n{text}");
    assert!(text.contains("bit-for-bit match"), "no match:\n{text}");
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
