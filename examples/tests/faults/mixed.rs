//! Jobs that mix (two jobs on one port, a rank claimed twice) and checkpoints (model flags
//! reach the ranks; inconsistent checkpoints fall back or fail on every rank).

#[allow(clippy::wildcard_imports)]
use super::*;

pub(super) fn by_hand(rank: usize, port: u16, job: Option<&str>, steps: &str) -> Command {
    let mut c = Command::new(bin("anyccl-demo"));
    c.args(["--count", "1024", "--steps", steps])
        .env("ANYCCL_BACKEND", "cpu")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("ANYCCL_INIT_TIMEOUT_S", "20")
        .env_remove("ANYCCL_STORE_EXTERNAL")
        .env_remove("ANYCCL_STORE_TOKEN")
        .env_remove("ANYCCL_JOB_ID");
    if let Some(j) = job {
        c.env("ANYCCL_JOB_ID", j);
    }
    c
}

pub(super) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(29611)
}

/// A second job's rank 1 that comes to the first job's port is refused with `want`, and the
/// first job (running until stopped, so it is surely there) goes on stepping after it.
pub(super) fn two_jobs_on_one_port(ids: [Option<&str>; 2], want: &str) -> Outcome {
    let port = free_port();
    let mut a0 = Job::start(&mut by_hand(0, port, ids[0], "100000000"));
    let mut a1 = Job::start(&mut by_hand(1, port, ids[0], "100000000"));
    a0.expect("step 2:", Duration::from_secs(30))?;
    let t = Instant::now();
    let mut b1 = Job::start(&mut by_hand(1, port, ids[1], "400"));
    let b = b1.finish(Duration::from_secs(20))?;
    let took = t.elapsed();
    check(b == Some(1) && b1.text().contains(want), || format!("the second job's rank 1: {b:?}\n{}", b1.text()))?;
    let after = a0.last_step().unwrap_or(0) + 20;
    let went_on = a0.expect(&format!("step {after}:"), Duration::from_secs(30));
    for j in [&a0, &a1] {
        signal(j.pid(), "TERM");
    }
    let (x, y) = (a0.finish(Duration::from_secs(60))?, a1.finish(Duration::from_secs(60))?);
    check(went_on.is_ok(), || {
        format!("the first job did not step on after the refusal ({x:?} {y:?}):\n{}\n{}", a0.text(), a1.text())
    })?;
    println!(
        "    a second job's rank 1 on the same port was refused after {took:.2?}: {}",
        b1.text().lines().last().unwrap_or("")
    );
    Ok(())
}

/// Without job identities, the process that claimed a rank first hears of a second claim
/// too while it is still in its store phase: both fail, neither runs the other's job.
pub(super) fn duplicate_rank_fails_both_sides() -> Outcome {
    // A store of its own, so the first claimant of rank 1 waits in a store call (for rank 0,
    // which never comes) when the second claims rank 1.
    let server = anyccl::TcpStoreServer::start(([127, 0, 0, 1], 0).into(), Default::default())?;
    let port = server.local_addr().port();
    let claim = || {
        let mut c = by_hand(1, port, None, "5");
        c.env("ANYCCL_STORE_EXTERNAL", "1");
        c
    };
    let mut first = Job::start(&mut claim());
    std::thread::sleep(Duration::from_millis(1500));
    let t = Instant::now();
    let mut second = Job::start(&mut claim());
    let b = second.finish(Duration::from_secs(20))?;
    let f = first.finish(Duration::from_secs(20))?;
    let took = t.elapsed();
    check(b == Some(1) && second.text().contains("already joined"), || format!("second: {b:?}\n{}", second.text()))?;
    check(f == Some(1) && first.text().contains("another process claimed this rank"), || {
        format!("the first claimant did not hear of the second: {f:?}\n{}", first.text())
    })?;
    check(took < Duration::from_secs(5), || format!("took {took:?}"))?;
    println!("    a rank claimed twice: both claimants failed within {took:.2?}");
    Ok(())
}

// ---------------------------------------------------------------- checkpoints

/// The demo's model flags reach its ranks: a run with --width 8 trains width 8.
pub(super) fn recover_forwards_model_flags() -> Outcome {
    let out = std::env::temp_dir().join(format!("anyccl-faults-width-{}", std::process::id()));
    let o = out.display().to_string();
    let args =
        ["demo", "--out", &o, "--width", "8", "--layers", "1", "--steps", "6", "--ckpt-every", "2", "--crash-at", "3"];
    let run = Command::new(bin("anyccl-recover")).args(args).env("ANYCCL_BACKEND", "cpu").output()?;
    let shard = checkpoint::read_shard(&out.join("recovered/final/rank0.bin"));
    let _ = std::fs::remove_dir_all(&out);
    let text = String::from_utf8_lossy(&run.stdout);
    check(run.status.success() && text.contains("bit-for-bit match"), || format!("{:?}\n{text}", run.status))?;
    let (id, params) = shard?;
    check(id.layout.contains("width8 layers1") && params.len() == 8 * 8 + 8, || {
        format!("the ranks trained layout '{}' with {} parameters", id.layout, params.len())
    })?;
    Ok(())
}

pub(super) fn train(out: &Path, run: &str, extra: &[&str]) -> Job {
    let o = out.display().to_string();
    let mut args = vec![bin("anyccl-recover"), "train", "--dp", "2", "--pp", "2", "--steps", "12"];
    args.extend(["--ckpt-every", "4", "--out", &o, "--run", run]);
    args.extend(extra);
    let mut job = Job::start(&mut launcher(4, &args));
    let _ = job.finish(Duration::from_secs(120));
    job
}

pub(super) fn params(dir: &Path, rank: usize) -> Result<Vec<u32>, Failed> {
    let (_, p) = checkpoint::read_shard(&dir.join(format!("final/rank{rank}.bin")))?;
    Ok(p.iter().map(|x| x.to_bits()).collect())
}

pub(super) fn inconsistent_checkpoints() -> Outcome {
    let out: PathBuf = std::env::temp_dir().join(format!("anyccl-faults-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let r = (|| -> Outcome {
        let reference = train(&out, "ref", &[]);
        check(reference.child_ok(), || format!("reference run failed:\n{}", reference.text()))?;
        let crash = train(&out, "crash", &["--crash-at", "10"]);
        check(crash.text().contains("crashing at step 10"), || format!("no crash:\n{}", crash.text()))?;
        let ck = |run: &str, step: u64, rank: usize| checkpoint::shard_path(&out.join(run), step, rank);

        // An older shard of the same job in the newest checkpoint.
        std::fs::copy(ck("crash", 4, 0), ck("crash", 8, 0))?;
        let from = out.join("crash").display().to_string();
        let t = Instant::now();
        let rec = train(&out, "stale", &["--resume-from", &from]);
        for r in 0..4 {
            let line =
                format!("[rank {r}] rank {r}: the checkpoint of step 8 is inconsistent: rank 0: checkpoint shard");
            check(rec.text().contains(&line) && rec.text().contains("holds step 4"), || {
                format!("rank {r} did not name the stale file:\n{}", rec.text())
            })?;
        }
        check(rec.text().contains("loaded the checkpoint of step 4"), || format!("no fall-back:\n{}", rec.text()))?;
        for r in 0..4 {
            check(params(&out.join("stale"), r)? == params(&out.join("ref"), r)?, || {
                format!("rank {r}: parameters after the fall-back differ from the uninterrupted run")
            })?;
        }
        println!(
            "    stale shard in the newest checkpoint: every rank named it, fell back to step 4 and matched ({:.2?})",
            t.elapsed()
        );

        // A shard of another job (same step, rank and layout).
        std::fs::copy(ck("ref", 8, 2), ck("crash", 8, 2))?;
        std::fs::copy(ck("crash", 4, 0), ck("crash", 8, 0)).map(|_| ())?;
        let rec = train(&out, "foreign", &["--resume-from", &from]);
        check(rec.text().contains("belongs to job"), || format!("another job's shard not caught:\n{}", rec.text()))?;
        check(rec.text().contains("loaded the checkpoint of step 4"), || format!("no fall-back:\n{}", rec.text()))?;

        // Nothing consistent: every rank fails, naming the files.
        for step in [4, 8] {
            std::fs::write(ck("crash", step, 3), b"ACK2 garbage")?;
        }
        let rec = train(&out, "none", &["--resume-from", &from]);
        check(!rec.child_ok(), || "loaded a checkpoint with a corrupt shard in each".to_string())?;
        for r in 0..4 {
            check(
                rec.text().contains(&format!("[rank {r}] anyccl-recover: "))
                    && rec.text().contains("rank3.bin is corrupt"),
                || format!("rank {r} did not fail naming the corrupt file:\n{}", rec.text()),
            )?;
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&out);
    r
}
