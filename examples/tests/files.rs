//! Files the programs read and write, as a hostile user or a full disk hands them over:
//! shards and dumps that are links to devices, FIFOs or huge sparse files, shard writes that
//! run out of space, and flight-recorder dumps that claim absurd sizes. Each case answers in
//! seconds, with the file named.

use anyccl::{MemoryStore, Store};
use anyccl_examples::checkpoint::{self, Expect, ShardId};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// A fresh folder for one case, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(case: &str) -> Self {
        let p = std::env::temp_dir().join(format!("anyccl-files-{case}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("scratch folder");
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Puts a bad file at a path.
type MakeFile = dyn Fn(&Path);

const LAYOUT: &str = "files-test";
const COUNT: usize = 1000;

fn id(step: u64, rank: usize, world_size: usize, count: usize) -> ShardId {
    ShardId { job: "job-a".into(), step, rank, world_size, layout: LAYOUT.into(), count: count as u64 }
}

/// A complete checkpoint of step `step` for `n` ranks under `dir`.
fn complete_checkpoint(dir: &Path, step: u64, n: usize) {
    for r in 0..n {
        let params: Vec<f32> = (0..COUNT).map(|i| (i + r) as f32).collect();
        checkpoint::write_shard(&checkpoint::shard_path(dir, step, r), &id(step, r, n, COUNT), &params).expect("shard");
    }
    std::fs::write(checkpoint::step_dir(dir, step).join("COMPLETE"), b"").expect("marker");
}

/// Every rank of `n` runs the checkpoint agreement on `dir` (threads sharing one store);
/// each rank's outcome (its error text, or the step it loaded), or `None` for a rank that
/// did not answer within `limit`.
fn agree(dir: &Path, n: usize, timeout: Duration, limit: Duration) -> Vec<Option<Result<u64, String>>> {
    let store = Arc::new(MemoryStore::new());
    let (tx, rx) = mpsc::channel();
    for rank in 0..n {
        let (store, dir, tx) = (store.clone(), dir.to_path_buf(), tx.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            let want = Expect { rank, world_size: n, layout: LAYOUT.into(), count: COUNT as u64 };
            let store: &dyn Store = store.as_ref();
            let got = rt.block_on(checkpoint::agree_and_load(store, "resume", &dir, &want, timeout));
            let _ = tx.send((rank, got.map(|l| l.step).map_err(|e| e.to_string())));
        });
    }
    drop(tx);
    let mut out = vec![None; n];
    let end = Instant::now() + limit;
    while out.iter().any(Option::is_none) {
        match rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok((rank, got)) => out[rank] = Some(got),
            Err(_) => break,
        }
    }
    out
}

/// Item 5: a shard that is a link to `/dev/zero`, a FIFO or an 8 GiB sparse file fails on
/// every rank at once (not at the agreement's timeout), naming the file; the bad checkpoint
/// is passed over for the older sound one.
#[test]
fn shard_that_is_no_regular_file_or_too_large_is_named_at_once_on_every_rank() {
    let scratch = Scratch::new("shards");
    let dir = &scratch.0;
    complete_checkpoint(dir, 1, 2);
    complete_checkpoint(dir, 2, 2);
    let bad = checkpoint::shard_path(dir, 2, 1);
    let cases: [(&str, &MakeFile, &str); 3] = [
        ("a link to /dev/zero", &|p| std::os::unix::fs::symlink("/dev/zero", p).expect("link"), "not a regular file"),
        (
            "a FIFO",
            &|p| {
                let st = Command::new("mkfifo").arg(p).status().expect("mkfifo");
                assert!(st.success(), "mkfifo {}", p.display());
            },
            "not a regular file",
        ),
        (
            "an 8 GiB sparse file",
            &|p| std::fs::File::create(p).and_then(|f| f.set_len(8 << 30)).expect("sparse file"),
            "8589934592 bytes",
        ),
    ];
    for (what, make, says) in cases {
        std::fs::remove_file(&bad).expect("remove the shard");
        make(&bad);
        let t = Instant::now();
        // The agreement's own timeout is far away: only a prompt verdict passes.
        let got = agree(dir, 2, Duration::from_secs(60), Duration::from_secs(10));
        let took = t.elapsed();
        for (rank, g) in got.iter().enumerate() {
            let Some(g) = g else { panic!("{what}: rank {rank} had no answer after {took:?}") };
            assert_eq!(g.as_ref().ok(), Some(&1), "{what}: rank {rank} did not fall back to step 1: {g:?}");
        }
        assert!(took < Duration::from_secs(3), "{what}: the agreement took {took:?}");
        // Every rank heard what was wrong, with the file named: the reader says so directly.
        let direct = checkpoint::read_shard_expecting(&bad, COUNT as u64).expect_err(what).to_string();
        assert!(direct.contains(&bad.display().to_string()) && direct.contains(says), "{what}: {direct}");
        let plain = checkpoint::read_shard(&bad).expect_err(what).to_string();
        assert!(plain.contains(&bad.display().to_string()), "{what}: {plain}");
        println!("    a shard that is {what}: both ranks passed over it in {took:.2?}: {direct}");
    }
    // With nothing older to fall back to, every rank fails naming the file.
    std::fs::remove_dir_all(checkpoint::step_dir(dir, 1)).expect("remove step 1");
    let t = Instant::now();
    let got = agree(dir, 2, Duration::from_secs(60), Duration::from_secs(10));
    for (rank, g) in got.iter().enumerate() {
        match g {
            Some(Err(e)) => assert!(e.contains(&bad.display().to_string()) && e.contains("8589934592 bytes"), "{e}"),
            other => panic!("rank {rank}: {other:?} after {:?}", t.elapsed()),
        }
    }
}

/// Runs as a child of the next case only, under a file-size limit (`RLIMIT_FSIZE`) and with
/// SIGXFSZ ignored, so that writing a shard fails part way as on a full disk.
#[test]
#[ignore = "run by failed_shard_writes_leave_no_partial_file as a child under a file-size limit"]
fn child_writes_a_shard_past_its_file_size_limit() {
    let path = PathBuf::from(std::env::var_os("ANYCCL_FILES_SHARD").expect("ANYCCL_FILES_SHARD"));
    let params = vec![1.5f32; 64 << 10];
    let e = checkpoint::write_shard(&path, &id(3, 0, 1, params.len()), &params).expect_err("a write past the limit");
    println!("WRITE FAILED: {e}");
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

/// Item 6: a shard write that fails (the disk fills up mid-write; the rename onto the shard
/// fails) leaves no partial `.tmp` file behind, and the error names the file.
#[test]
fn failed_shard_writes_leave_no_partial_file() {
    let scratch = Scratch::new("writes");
    // Out of space part way through the write: a child under a 32-64 KiB file-size limit
    // writes a 256 KiB shard.
    let path = scratch.0.join("full/rank0.bin");
    let exe = std::env::current_exe().expect("this test program");
    let out = Command::new("sh")
        .args(["-c", "ulimit -f 64 && trap '' XFSZ && exec \"$0\" \"$@\""])
        .arg(exe)
        .args(["--include-ignored", "--exact", "child_writes_a_shard_past_its_file_size_limit", "--nocapture"])
        .env("ANYCCL_FILES_SHARD", &path)
        .output()
        .expect("the child");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("WRITE FAILED: "), "the child: {:?}\n{text}", out.status);
    let line = text.lines().find(|l| l.contains("WRITE FAILED: ")).unwrap_or_default().to_string();
    assert!(line.contains(&path.display().to_string()), "the error does not name the shard: {line}");
    let left = leftovers(path.parent().expect("folder"));
    assert!(left.is_empty(), "left behind after a failed write: {left:?}");

    // The rename fails (a folder is in the shard's place).
    let path = scratch.0.join("rename/rank0.bin");
    std::fs::create_dir_all(path.join("occupied")).expect("folder in the way");
    let e = checkpoint::write_shard(&path, &id(3, 0, 1, 4), &[1.0; 4]).expect_err("a rename onto a folder");
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");
    let left = leftovers(path.parent().expect("folder"));
    assert_eq!(left, vec!["rank0.bin".to_string()], "left behind after a failed rename");
    println!("    {line}\n    rename failed: {e}");
}

/// `anyccl-trace DIR` with `extra` arguments, under a 2 GB address-space limit and killed
/// after 20 s: its status (None when killed), output and time.
fn trace(dir: &Path, extra: &[&str]) -> (Option<i32>, String, Duration) {
    let t = Instant::now();
    let mut child = Command::new("sh")
        .args(["-c", "ulimit -v 2000000 && exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_anyccl-trace"))
        .arg(dir)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("anyccl-trace");
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s.code();
        }
        if t.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut text = String::new();
    let _ = child.stdout.take().map(|mut s| s.read_to_string(&mut text));
    let _ = child.stderr.take().map(|mut s| s.read_to_string(&mut text));
    (status, text, t.elapsed())
}

fn dump(rank: u64, world_size: u64, records: &str) -> String {
    format!(
        r#"{{"format":{},"rank":{rank},"world_size":{world_size},"pid":1,"host":"h","reason":"test",
           "unix_ms":1,"first_reason":"test","first_unix_ms":1,"records":[{records}]}}"#,
        anyccl::trace::TRACE_FORMAT
    )
}

/// Item 10: a dump that claims a world size or rank of 10^12, one too large for the cap,
/// or one that is a FIFO or a link to `/dev/zero` is refused at once, naming the file and
/// the field; a sound dump is still read.
#[test]
fn trace_dumps_that_claim_too_much_are_refused() {
    let record = r#"{"group":"world","group_rank":0,"seq":1,"op":"all_reduce","dtype":"f32","count":4,
        "bytes":16,"peer":null,"state":"pending","error":null,"started_unix_ms":1,"elapsed_ms":null}"#;
    let scratch = Scratch::new("trace");
    let big = 1_000_000_000_000u64;
    let cases: [(&str, Box<MakeFile>, &[&str], &str); 5] = [
        (
            "world_size 10^12",
            Box::new(move |p| std::fs::write(p, dump(0, big, record)).expect("dump")),
            &[],
            "world_size",
        ),
        ("rank 10^12", Box::new(move |p| std::fs::write(p, dump(big, 2, record)).expect("dump")), &[], "rank"),
        (
            "larger than the cap",
            Box::new(move |p| std::fs::write(p, dump(0, 2, &[record; 64].join(","))).expect("dump")),
            &["--max-dump-bytes", "4K"],
            "4096",
        ),
        (
            "a link to /dev/zero",
            Box::new(move |p| std::os::unix::fs::symlink("/dev/zero", p).expect("link")),
            &[],
            "regular",
        ),
        (
            "a FIFO",
            Box::new(move |p| assert!(Command::new("mkfifo").arg(p).status().expect("mkfifo").success())),
            &[],
            "regular",
        ),
    ];
    for (i, (what, make, extra, field)) in cases.iter().enumerate() {
        let dir = scratch.0.join(format!("case{i}"));
        std::fs::create_dir_all(&dir).expect("folder");
        let file = dir.join("rank0.json");
        make(&file);
        let (status, text, took) = trace(&dir, extra);
        assert_eq!(status, Some(1), "{what}: anyccl-trace ended {status:?} after {took:?}:\n{text}");
        assert!(text.contains(&file.display().to_string()) && text.contains(field), "{what}: {text}");
        assert!(took < Duration::from_secs(5), "{what}: took {took:?}");
        println!("    a dump with {what}: refused in {took:.2?}: {}", text.trim());
    }
    // A sound dump of rank 0 of 2 is read, and rank 1 is named as silent.
    let dir = scratch.0.join("sound");
    std::fs::create_dir_all(&dir).expect("folder");
    std::fs::write(dir.join("rank0.json"), dump(0, 2, record)).expect("dump");
    let (status, text, _) = trace(&dir, &[]);
    assert!(status == Some(0) && text.contains("ranks [1] left no dump"), "{status:?}: {text}");
}
