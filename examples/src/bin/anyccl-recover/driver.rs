//! `anyccl-recover demo`: three launches of `anyccl-run` (a reference run, a run that
//! crashes, the recovered run) and the bit-for-bit comparison of their final parameters.

use crate::cli::{ranks, usage, Job};
use anyccl::raw::Ctx;
use anyccl::{DeviceKind, Result};
use anyccl_examples::checkpoint as ckpt;
use anyccl_examples::machine;
use anyccl_examples::{errln, outln};
use std::io::Write;
use std::path::Path;
use std::process::{Command, ExitCode};
use std::time::Instant;

/// The parallel layout: `--dp`, `--pp` or their defaults for this host, and whether the
/// ranks run on an accelerator (else their device memory is host memory).
pub(crate) fn layout(job: &Job) -> Result<(usize, usize, bool)> {
    // On an accelerator backend: how many ranks this host can run (one per device unless
    // the backend says otherwise) and the backend's name for messages.
    // A backend asked for by name must be usable here: say why not before launching ranks.
    let picked = match anyccl_examples::pick_backend(job.backend.as_deref()) {
        Err(e) if job.backend.is_some() => return Err(e),
        r => r.ok(),
    };
    let accel = picked.and_then(|b| {
        let caps = b.capabilities().ok().filter(|c| c.device_kind != DeviceKind::Cpu)?;
        let devices = b.probe().ok()?.devices;
        Some((b.name(), devices.min(caps.max_local_ranks), caps.max_local_ranks))
    });
    let pp = job.pp.unwrap_or(match accel {
        Some((_, n, _)) if n < 2 => 1,
        _ => 2,
    });
    let dp = job.dp.unwrap_or(match accel {
        Some((_, n, _)) => (n / pp.max(1)).max(1),
        None => 2,
    });
    if dp == 0 || pp == 0 {
        return Err(usage(if dp == 0 { "--dp" } else { "--pp" }, "--dp and --pp must be at least 1".into()));
    }
    let n = ranks(dp, pp)?;
    if let Some((name, _, max)) = accel {
        if n > max {
            return Err(usage(
                "--dp",
                format!(
                    "--dp {dp} x --pp {pp} = {n} ranks, but the {name} backend runs at most {max} rank(s) on this host \
                     (one per device)"
                ),
            ));
        }
    }
    Ok((dp, pp, accel.is_some()))
}

/// The demo: three launches of this host's `anyccl-run`, then the verdict.
pub(crate) fn demo(job: &Job) -> Result<ExitCode> {
    if job.in_place {
        return crate::inplace_demo::demo(job);
    }
    if let Some(rollouts) = job.colocated_phases {
        return phases_demo(job, rollouts);
    }
    let (dp, pp, accel) = layout(job)?;
    let n = ranks(dp, pp)?;
    let (here, runner) = programs()?;
    if job.resume_from.is_some() || job.run.is_some() {
        return Err(usage(
            if job.run.is_some() { "--run" } else { "--resume-from" },
            "--resume-from and --run belong to `anyccl-recover train`; the demo names its three runs and recovers \
             from its own crashing run"
                .into(),
        ));
    }
    // 3/5 of the steps.
    let crash_at = fault_step(job, "--crash-at", job.crash_at, 3)?;
    // Every rank runs on this host, at once.
    job.check_memory(n, !accel)?;
    // One demo per folder at a time: a second one would clear and write the same runs.
    let _lock = machine::lock_dir(&job.out, "anyccl-recover", "--out")?;
    // Only this demo's own runs are cleared, never anything else under --out.
    for run in ["ref", "crash", "recovered"] {
        let _ = std::fs::remove_dir_all(job.out.join(run));
    }
    let launch = |title: &str, extra: &[String]| launch_train(job, &runner, &here, n, (dp, pp), title, &[], extra);
    let t = Instant::now();
    outln!(
        "anyccl-recover: dp {dp} x pp {pp} = {n} ranks, {} steps, checkpoint every {}, crash at step {crash_at}",
        job.steps,
        job.ckpt_every
    );
    if !launch("1/3 reference run, uninterrupted", &["--run".into(), "ref".into()])? {
        return Ok(ended("the reference run failed (the launcher said why, above)"));
    }
    if launch(
        &format!("2/3 run that crashes at step {crash_at}"),
        &["--run".into(), "crash".into(), "--crash-at".into(), crash_at.to_string()],
    )? {
        return Ok(ended("the crashing run did not crash"));
    }
    outln!("(the crash was planned: the launcher stopped every rank)");
    let resume = job.out.join("crash").display().to_string();
    let mut extra = vec!["--run".into(), "recovered".into(), "--resume-from".into(), resume];
    if job.no_warmup {
        extra.push("--no-warmup".into());
    }
    if job.role_plan {
        extra.push("--role-plan".into());
    }
    if let Some(s) = job.squeeze {
        extra.extend(["--squeeze".into(), s.to_string()]);
    }
    if !launch("3/3 recovered run", &extra)? {
        return Ok(ended("the recovered run failed (the launcher said why, above)"));
    }
    outln!("\n=== verdict ===");
    if same_bits(&job.out, "ref", "recovered", n)? {
        outln!("bit-for-bit match: the recovered run's parameters equal the uninterrupted run's on all {n} ranks ({:.1?} in all)", t.elapsed());
        Ok(ExitCode::SUCCESS)
    } else {
        outln!("MISMATCH: the recovered run differs from the uninterrupted one");
        Ok(ExitCode::from(1))
    }
}

/// `demo --colocated-phases N`: an uninterrupted reference run, then the same run with N
/// rollouts between its training phases; the two must end equal bit for bit.
fn phases_demo(job: &Job, rollouts: u64) -> Result<ExitCode> {
    let (dp, pp, accel) = layout(job)?;
    let n = ranks(dp, pp)?;
    let (here, runner) = programs()?;
    if job.steps <= rollouts {
        return Err(usage("--steps", format!("{} steps cannot surround {rollouts} rollouts", job.steps)));
    }
    job.check_memory(n, !accel)?;
    let _lock = machine::lock_dir(&job.out, "anyccl-recover", "--out")?;
    for run in ["ref", "phases"] {
        let _ = std::fs::remove_dir_all(job.out.join(run));
    }
    let launch = |title: &str, extra: &[String]| launch_train(job, &runner, &here, n, (dp, pp), title, &[], extra);
    let t = Instant::now();
    outln!("anyccl-recover: dp {dp} x pp {pp} = {n} ranks, {} steps, {rollouts} rollouts between them", job.steps);
    if !launch("1/2 reference run, no rollouts", &["--run".into(), "ref".into()])? {
        return Ok(ended("the reference run failed (the launcher said why, above)"));
    }
    let mut extra = vec!["--run".into(), "phases".into(), "--colocated-phases".into(), rollouts.to_string()];
    if job.no_sleep {
        extra.push("--no-sleep".into());
    }
    if let Some(s) = job.squeeze {
        extra.extend(["--squeeze".into(), s.to_string()]);
    }
    let how = if job.no_sleep { "awake through them" } else { "asleep through them" };
    if !launch(&format!("2/2 {rollouts} rollouts, the training groups {how}"), &extra)? {
        return Ok(ended("the run with rollouts failed (the launcher said why, above)"));
    }
    outln!("\n=== verdict ===");
    if same_bits(&job.out, "ref", "phases", n)? {
        outln!(
            "bit-for-bit match: the run with rollouts equals the reference on all {n} ranks ({:.1?} in all)",
            t.elapsed()
        );
        Ok(ExitCode::SUCCESS)
    } else {
        outln!("MISMATCH: the run with rollouts differs from the reference");
        Ok(ExitCode::from(1))
    }
}

/// This program and the launcher beside it.
///
/// # Errors
/// `Io` when this program's path cannot be read.
pub(crate) fn programs() -> Result<(std::path::PathBuf, std::path::PathBuf)> {
    let ctx = Ctx::process("anyccl-recover");
    let here = std::env::current_exe().map_err(|e| ctx.io("demo: find this program", "/proc/self/exe", e))?;
    let dir = here.parent().ok_or_else(|| ctx.file("demo: find anyccl-run", &here, "this program has no folder"))?;
    let runner = dir.join("anyccl-run");
    Ok((here, runner))
}

/// The step a demo's fault strikes: `given`, or `fifths`/5 of the steps (without the
/// overflow of a product), after the first checkpoint and before the last step.
///
/// # Errors
/// `InvalidArgument` naming `flag`.
pub(crate) fn fault_step(job: &Job, flag: &'static str, given: Option<u64>, fifths: u64) -> Result<u64> {
    let at = given.unwrap_or(job.steps / 5 * fifths + job.steps % 5 * fifths / 5);
    if at == 0 || at >= job.steps || at < job.ckpt_every {
        return Err(usage(
            flag,
            format!(
                "{flag} {at} must be after the first checkpoint (--ckpt-every {}) and before --steps {}",
                job.ckpt_every, job.steps
            ),
        ));
    }
    Ok(at)
}

/// One launch of `anyccl-run` (`launcher` flags first) with every rank running `train` with
/// the demo's model flags and `extra`. Whether it succeeded.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_train(
    job: &Job,
    runner: &Path,
    here: &Path,
    n: usize,
    (dp, pp): (usize, usize),
    title: &str,
    launcher: &[&str],
    extra: &[String],
) -> Result<bool> {
    let ctx = Ctx::process("anyccl-recover");
    outln!("\n=== {title} ===");
    let _ = std::io::stdout().flush();
    let mut args: Vec<String> = vec!["-n".into(), n.to_string(), "--timeout".into(), "600".into()];
    args.extend(launcher.iter().map(|a| a.to_string()));
    args.push("--".into());
    args.push(here.display().to_string());
    args.push("train".into());
    let same: [(&str, String); 10] = [
        ("--dp", dp.to_string()),
        ("--pp", pp.to_string()),
        ("--steps", job.steps.to_string()),
        ("--ckpt-every", job.ckpt_every.to_string()),
        ("--width", job.width.to_string()),
        ("--layers", job.layers.to_string()),
        ("--batch", job.batch.to_string()),
        ("--lr", job.lr.to_string()),
        ("--seed", job.seed.to_string()),
        ("--colocated-mib", job.colocated_mib.to_string()),
    ];
    for (k, v) in same {
        args.push(k.into());
        args.push(v);
    }
    args.extend(["--out".into(), job.out.display().to_string()]);
    if let Some(ms) = job.step_ms {
        args.extend(["--step-ms".into(), ms.to_string()]);
    }
    if let Some(b) = &job.backend {
        args.extend(["--backend".into(), b.clone()]);
    }
    args.extend(extra.iter().cloned());
    let st = Command::new(runner).args(&args).status().map_err(|e| ctx.io("demo: launch", runner, e))?;
    Ok(st.success())
}

/// Whether run `a`'s final parameters equal run `b`'s bit for bit on all `n` ranks; the
/// ranks that differ are printed.
pub(crate) fn same_bits(out: &Path, a: &str, b: &str, n: usize) -> Result<bool> {
    let mut same = 0;
    for r in 0..n {
        // The parameters, bit for bit (the shards' headers name different jobs).
        let bits = |run: &str| -> Result<Vec<u32>> {
            let (_, p) = ckpt::read_shard(&out.join(run).join("final").join(format!("rank{r}.bin")))?;
            Ok(p.iter().map(|x| x.to_bits()).collect())
        };
        if bits(a)? == bits(b)? {
            same += 1;
        } else {
            outln!("rank {r}: the parameters of run '{a}' DIFFER from run '{b}'");
        }
    }
    Ok(same == n)
}

/// The demo's end when one of its launches did not end as planned: what went wrong is the
/// launcher's to say (it did, above); the demo says which launch, and fails.
pub(crate) fn ended(what: &str) -> ExitCode {
    errln!("anyccl-recover: {what}");
    ExitCode::from(1)
}
