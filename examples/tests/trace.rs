//! `anyccl-trace` on dumps written by hand: the verdicts its fault tests reach through real
//! jobs, without a job's timing.

use std::path::Path;
use std::process::Command;

fn record(seq: u64, state: &str, error: Option<String>) -> serde_json::Value {
    serde_json::json!({
        "group": "world", "group_rank": 0, "seq": seq, "op": "all_reduce", "dtype": "f32",
        "count": 16384, "bytes": 65536, "peer": null, "state": state, "error": error,
        "started_unix_ms": 1_000_000 + seq, "elapsed_ms": null
    })
}

fn dump(dir: &Path, rank: usize, first_ms: u64, reason: &str, records: Vec<serde_json::Value>) {
    let mut records = records;
    for r in &mut records {
        r["group_rank"] = rank.into();
    }
    let d = serde_json::json!({
        "format": anyccl::trace::TRACE_FORMAT, "rank": rank, "world_size": 4, "pid": 100 + rank, "host": "h",
        "reason": reason, "unix_ms": first_ms, "first_reason": reason, "first_unix_ms": first_ms,
        "records": records
    });
    std::fs::write(dir.join(format!("rank{rank}.json")), serde_json::to_vec(&d).unwrap()).unwrap();
}

fn suspect(dir: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_anyccl-trace")).arg(dir).output().expect("anyccl-trace runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines().find(|l| l.starts_with("SUSPECT:")).map(str::to_string).unwrap_or(text)
}

/// A ring all_reduce with rank 0 stopped: ranks 1, 2 and 3 each time out waiting for the
/// rank before it, at the same moment, and rank 0 dumps when it is stopped for good, in
/// time with them. The errors name ranks 0, 1 and 2 once each; the ones that failed with a
/// timeout of their own waited for a peer, so rank 0 is the suspect.
#[test]
fn trace_ring_waits_blame_the_rank_that_waited_for_nobody() {
    let dir = std::env::temp_dir().join(format!("anyccl-trace-ring-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let done = |n: u64| (0..n).map(|s| record(s, "completed", None)).collect::<Vec<_>>();
    let mut r0 = done(10);
    r0.push(record(10, "pending", None));
    dump(&dir, 0, 5_000_040, "SIGTERM", r0);
    for r in 1..4usize {
        let mut rs = done(10);
        let e = format!(
            "all_reduce #10 timed out after 3s on rank {r} of group 'world': rank {} made no progress for 3s",
            r - 1
        );
        rs.push(record(10, "failed", Some(e.clone())));
        dump(&dir, r, 5_000_000 + r as u64, &e, rs);
    }
    let s = suspect(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(s.starts_with("SUSPECT:") && s.contains("rank 0") && !s.contains("rank 1") && !s.contains("rank 2"), "{s}");
}

/// A rank stopped before the others reached a store barrier (a cold first call's): no
/// operation is left unfinished, but the barrier's timeout names who never came, and that
/// rank is the suspect (the others only waited).
#[test]
fn trace_a_store_barrier_timeout_names_the_rank_that_never_arrived() {
    let dir = std::env::temp_dir().join(format!("anyccl-trace-barrier-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let done = |n: u64| (0..n).map(|s| record(s, "completed", None)).collect::<Vec<_>>();
    dump(&dir, 0, 5_000_400, "SIGTERM", done(3));
    for r in 1..4usize {
        let e = "store barrier 'bench/barrier/cold65536/1' timed out after 3s on rank 1: ranks [0] never arrived";
        dump(&dir, r, 5_000_000 + r as u64, e, done(3));
    }
    let s = suspect(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(s.starts_with("SUSPECT:") && s.contains("[0]") && !s.contains("[1]"), "{s}");
}
