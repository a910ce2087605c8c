//! `anyccl-recover demo --in-place`: recovery without a restart, beside today's restart.
//!
//! 1. An in-place run under `anyccl-run --elastic`: the last rank kills itself with SIGKILL
//!    in the middle of step `--kill-at`; the survivors agree, rebuild and go on; the
//!    launcher starts a replacement, which rejoins and is fed the parameters.
//! 2. A reference run replaying the in-place run's participation record with no fault:
//!    the final parameters must be equal bit for bit.
//! 3. The same fault on the restart path: every rank stopped, the job restarted from its
//!    last checkpoint; how long until its first good step, and how many steps were lost.
//!
//! Then the timeline of the in-place recovery, from each rank's events.

use crate::cli::{ranks, usage, Job};
use crate::driver::{ended, fault_step, launch_train, layout, programs, same_bits};
use crate::participation::{merge_records, write_record};
use crate::timeline::{self, Event};
use anyccl::Result;
use anyccl_examples::checkpoint as ckpt;
use anyccl_examples::machine;
use anyccl_examples::outln;
use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Instant;

const RUNS: [&str; 4] = ["inplace", "inplace-ref", "restart-crash", "restart-recovered"];

/// The demo.
pub(crate) fn demo(job: &Job) -> Result<ExitCode> {
    let job = &Job { step_ms: Some(job.step_ms.unwrap_or(150)), ..job.clone() };
    let (dp, pp, accel) = layout(job)?;
    let n = ranks(dp, pp)?;
    let (here, runner) = programs()?;
    if job.resume_from.is_some() || job.run.is_some() || job.replay.is_some() {
        return Err(usage(
            "--run",
            "--run, --resume-from and --replay belong to `anyccl-recover train`; the demo names its runs".into(),
        ));
    }
    if dp < 2 {
        return Err(usage("--dp", format!("--dp {dp}: recovery in place needs a second replica to keep training")));
    }
    // 2/5 of the steps: the rest leaves the replacement time to rejoin.
    let kill_at = fault_step(job, "--kill-at", job.kill_at, 2)?;
    job.check_memory(n, !accel)?;
    let _lock = machine::lock_dir(&job.out, "anyccl-recover", "--out")?;
    for run in RUNS {
        let _ = std::fs::remove_dir_all(job.out.join(run));
    }
    let go = |title: &str, launcher: &[&str], extra: &[String]| {
        launch_train(job, &runner, &here, n, (dp, pp), title, launcher, extra)
    };
    let s = |x: &str| x.to_string();
    let t = Instant::now();
    outln!(
        "anyccl-recover: dp {dp} x pp {pp} = {n} ranks, {} steps; rank {} is killed (SIGKILL) in the middle of step {}",
        job.steps,
        n - 1,
        kill_at + 1
    );
    let mut inplace = vec![s("--in-place"), s("--run"), s("inplace"), s("--kill-at"), kill_at.to_string()];
    if job.no_warmup {
        inplace.push(s("--no-warmup"));
    }
    if !go("1/4 recovery in place (anyccl-run --elastic)", &["--elastic", "--max-restarts", "1"], &inplace)? {
        return Ok(ended("the in-place run failed (the launcher said why, above)"));
    }
    let record = merge_records(&job.out.join("inplace"))?;
    let record_path = job.out.join("inplace").join("participation.json");
    write_record(&record_path, &record)?;
    outln!("\nparticipation record ({}):", record_path.display());
    for seg in &record {
        outln!(
            "  epoch {}: from step {}, replicas {:?} train{}",
            seg.epoch,
            seg.from_step + 1,
            seg.active,
            match seg.source {
                Some(src) if !seg.fresh.is_empty() => format!(", replicas {:?} fed by replica {src}", seg.fresh),
                _ => String::new(),
            }
        );
    }
    let replay = [s("--in-place"), s("--run"), s("inplace-ref"), s("--replay"), record_path.display().to_string()];
    if !go("2/4 reference: the record replayed with no fault", &[], &replay)? {
        return Ok(ended("the reference run failed (the launcher said why, above)"));
    }
    let restart = [s("--run"), s("restart-crash"), s("--kill-at"), kill_at.to_string()];
    if go("3/4 the restart path: the same fault, every rank stopped", &[], &restart)? {
        return Ok(ended("the run of the restart path was not stopped by its fault"));
    }
    let resume = job.out.join("restart-crash").display().to_string();
    let recovered = [s("--run"), s("restart-recovered"), s("--resume-from"), resume];
    if !go("4/4 the restart path: every rank restarted from the last checkpoint", &[], &recovered)? {
        return Ok(ended("the restarted run failed (the launcher said why, above)"));
    }

    outln!("\n=== timeline of the recovery in place (ms after the SIGKILL) ===");
    let summary = timeline_table(job, kill_at, dp, pp);
    outln!("\n=== restart path, same fault ===");
    restart_figures(job, kill_at);
    outln!("\n=== verdict ===");
    let ok = same_bits(&job.out, "inplace", "inplace-ref", n)?;
    if let Some(s) = summary {
        outln!("{s}");
    }
    if ok {
        outln!(
            "bit-for-bit match: the in-place run's parameters equal its replayed participation record on all {n} ranks \
             ({:.1?} in all)",
            t.elapsed()
        );
        Ok(ExitCode::SUCCESS)
    } else {
        outln!("MISMATCH: the in-place run differs from the replay of its own participation record");
        Ok(ExitCode::from(1))
    }
}

/// Print each process's events after the fault; return the summary line.
fn timeline_table(job: &Job, kill_at: u64, dp: usize, pp: usize) -> Option<String> {
    let run = job.out.join("inplace");
    let Some((victim, _, fault)) = timeline::fault(&run) else {
        outln!("(no fault was recorded: the victim did not reach step {})", kill_at + 1);
        return None;
    };
    let events = timeline::read(&run);
    let mut by_proc: BTreeMap<(usize, u64), Vec<&Event>> = BTreeMap::new();
    for e in events.iter().filter(|e| e.at_ms >= fault) {
        by_proc.entry((e.rank, e.incarnation)).or_default().push(e);
    }
    for ((rank, inc), evs) in &by_proc {
        let mut seen: Vec<String> = Vec::new();
        let mut line = format!("  rank {rank} (process {inc}):");
        for e in evs {
            // The first of each event of each epoch.
            let k = format!("{}/{}", e.what, e.epoch);
            if seen.contains(&k) || e.what == "finished" {
                continue;
            }
            seen.push(k);
            let step = match (e.what.as_str(), e.detail.is_empty()) {
                ("first step", true) => format!(", step {}", e.step),
                ("first step", false) => format!(", step {}, {}", e.step, e.detail),
                _ => String::new(),
            };
            line.push_str(&format!(" | {} {} (e{}{step})", e.what, e.at_ms - fault, e.epoch));
        }
        outln!("{line}");
    }
    let victim_replica = victim / pp;
    // The healthy replicas' next completed step: every one of their ranks completed it.
    let first_after = |rank: usize| {
        events.iter().filter(|e| e.rank == rank && e.what == "first step" && e.at_ms >= fault).map(|e| e.at_ms).min()
    };
    let healthy: Vec<usize> = (0..dp * pp).filter(|r| r / pp != victim_replica).collect();
    let next = healthy.iter().map(|&r| first_after(r)).collect::<Option<Vec<u64>>>().and_then(|v| v.into_iter().max());
    // The victim's replica back: its ranks' first step in the epoch that admitted the replacement.
    let admitted =
        events.iter().filter(|e| e.rank == victim && e.incarnation > 1 && e.what == "agreed").map(|e| e.epoch).min();
    let back = admitted.and_then(|ep| {
        (0..pp)
            .map(|s| victim_replica * pp + s)
            .map(|r| {
                events
                    .iter()
                    .filter(|e| e.rank == r && e.what == "first step" && e.epoch >= ep && e.at_ms >= fault)
                    .map(|e| e.at_ms)
                    .min()
            })
            .collect::<Option<Vec<u64>>>()
            .and_then(|v| v.into_iter().max())
    });
    let record = merge_records(&run).ok()?;
    let resumed = record.iter().find(|s| s.epoch > 0).map(|s| s.from_step);
    let lost = resumed.map(|r| kill_at.saturating_sub(r));
    let ms = |v: Option<u64>| v.map_or_else(|| "never".to_string(), |v| format!("{} ms", v - fault));
    let summary = format!(
        "in place: the healthy replica's next completed step {} after the SIGKILL; replica {victim_replica} back \
         (the replacement's first step) {} after it; steps lost: {}",
        ms(next),
        ms(back),
        lost.map_or_else(|| "?".into(), |l| l.to_string())
    );
    Some(summary)
}

/// The restart path's figures: from the fault to the restarted job's first good step, and
/// the steps between the checkpoint it resumed from and the fault.
fn restart_figures(job: &Job, kill_at: u64) {
    let crash = job.out.join("restart-crash");
    let Some((_, _, fault)) = timeline::fault(&crash) else {
        outln!("(no fault was recorded in the restart path's run)");
        return;
    };
    let events = timeline::read(&job.out.join("restart-recovered"));
    let first = events.iter().filter(|e| e.what == "first step").map(|e| e.at_ms).max();
    let resumed = ckpt::complete_steps(&crash).ok().and_then(|v| v.into_iter().filter(|s| *s <= kill_at).max());
    match (first, resumed) {
        (Some(f), Some(r)) => outln!(
            "restart: every rank stopped, restarted and resumed from the checkpoint of step {r}: first good step {} ms \
             after the SIGKILL; steps lost: {}",
            f.saturating_sub(fault),
            kill_at - r
        ),
        _ => outln!("(the restarted run recorded no first step)"),
    }
}
