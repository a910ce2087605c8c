//! A stopped rank (SIGSTOP): the others fail with a timeout that names it, each leaves a
//! flight-recorder dump, and `anyccl-trace` blames the stopped rank, not the ones that waited.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(super) fn stopped_rank(count: usize) -> Outcome {
    const TIMEOUT_S: u64 = 3;
    let mut cmd = launcher(4, &[bin("anyccl-demo"), "--count", &count.to_string(), "--steps", "100000000"]);
    let dir = trace_dir(&format!("stop{count}"));
    cmd.env("ANYCCL_TIMEOUT_S", TIMEOUT_S.to_string()).env("ANYCCL_TRACE_DIR", &dir);
    let mut job = Job::start(&mut cmd);
    job.expect("step 3:", Duration::from_secs(30))?;
    let victim = rank_pid(job.pid(), 1).ok_or("rank 1 not found")?;
    let t = Instant::now();
    signal(victim, "STOP");
    // Each rank's error as this test reads it, through the launcher: a loaded machine adds
    // seconds to that relay, never a hang.
    let limit = Duration::from_secs(TIMEOUT_S + 5);
    let mut times = Vec::new();
    for r in [0, 2, 3] {
        let at = job.expect(&format!("[rank {r}] anyccl-demo:"), Duration::from_secs(30))?;
        times.push((r, at.duration_since(t)));
    }
    let got = job.finish(Duration::from_secs(15))?;
    check(got == Some(1), || format!("exit code {got:?}"))?;
    check(job.text().contains("rank 1 is stopped"), || format!("the launcher did not name rank 1:\n{}", job.text()))?;
    for (r, d) in &times {
        check(*d <= limit, || format!("rank {r} erred {d:?} after the stop, more than {limit:?}:\n{}", job.text()))?;
    }
    let suspect = trace_suspect(&dir)?;
    check(suspect.contains("[1]") || suspect.contains("rank 1:"), || {
        format!("anyccl-trace blamed another rank: {suspect}")
    })?;
    println!(
        "    {} B all_reduce, rank 1 stopped, ANYCCL_TIMEOUT_S={TIMEOUT_S}: errors on ranks {}",
        count * 4,
        times.iter().map(|(r, d)| format!("{r} after {d:.2?}")).collect::<Vec<_>>().join(", ")
    );
    println!("    anyccl-trace: {suspect}");
    Ok(())
}

/// A rank stopped in the benchmark's default pipelined mode: the others fail with their
/// enqueue timed out (the queue full of operations that cannot progress), and each writes
/// its dump, so `anyccl-trace` names the stopped rank, not the healthy ones that waited for
/// it (before, an enqueue timeout wrote no dump and the analyzer blamed every other rank).
pub(super) fn stopped_rank_pipelined(victim: usize) -> Outcome {
    const TIMEOUT_S: u64 = 3;
    let program = [bin("anyccl-bench"), "all_reduce", "-b", "64K", "-e", "64K", "-n", "100000000", "-w", "5"];
    let mut cmd = launcher(4, &program);
    let dir = trace_dir(&format!("stop-pipelined{victim}"));
    cmd.env("ANYCCL_TIMEOUT_S", TIMEOUT_S.to_string()).env("ANYCCL_TRACE_DIR", &dir);
    let mut job = Job::start(&mut cmd);
    job.expect("(B)    (elements)", Duration::from_secs(30))?;
    // Past the cold first call (a connect and a store barrier) and well into the timed
    // calls, with operations in flight.
    std::thread::sleep(Duration::from_secs(3));
    let pid = rank_pid(job.pid(), victim).ok_or_else(|| format!("rank {victim} not found"))?;
    signal(pid, "STOP");
    let got = job.finish(Duration::from_secs(TIMEOUT_S + 20))?;
    check(got == Some(1), || {
        format!(
            "exit code {got:?}:
{}",
            job.text()
        )
    })?;
    let suspect = trace_suspect(&dir)?;
    check(suspect.contains(&format!("[{victim}]")), || format!("anyccl-trace blamed another rank: {suspect}"))?;
    println!("    pipelined 64 KiB all_reduce, rank {victim} stopped: {suspect}");
    Ok(())
}

/// `ANYCCL_DEBUG=detail`: rank 1 calls all_gather while the others call all_reduce; every
/// rank fails within 10 s naming both calls.
pub(super) fn detail_mode_mismatch() -> Outcome {
    let mut cmd = launcher(3, &[bin("anyccl-demo"), "--count", "1024", "--steps", "5", "--mismatch-rank", "1"]);
    cmd.env("ANYCCL_DEBUG", "detail");
    let t = Instant::now();
    let mut job = Job::start(&mut cmd);
    let got = job.finish(Duration::from_secs(30))?;
    let took = t.elapsed();
    check(got == Some(1), || format!("exit code {got:?}:\n{}", job.text()))?;
    for r in 0..3 {
        let line = job
            .seen
            .iter()
            .find(|(_, l)| l.starts_with(&format!("[rank {r}] anyccl-demo: invalid argument `collective`")));
        check(line.is_some_and(|(_, l)| l.contains("all_gather") && l.contains("all_reduce")), || {
            format!("rank {r} did not fail naming both calls:\n{}", job.text())
        })?;
    }
    check(took < Duration::from_secs(10), || format!("took {took:?}"))?;
    println!(
        "    ANYCCL_DEBUG=detail, all_gather against all_reduce: every rank failed naming both, job done in {took:.2?}"
    );
    Ok(())
}
