//! One training step of one pipeline stage, on whichever data and pipeline groups the caller
//! holds now (the launch's, or an epoch's rebuilt ones).

use crate::cli::Job;
use crate::dev::Dev;
use crate::model::{batch, Stage};
use anyccl::{Communicator, Result};
use anyccl_examples::outln;

/// What one step needs: the model's flags, the device, this rank's place and its groups.
pub(crate) struct StepCtx<'a> {
    pub(crate) job: &'a Job,
    pub(crate) dev: Dev<'a>,
    /// The data group: this stage of every replica that trains.
    pub(crate) dpc: &'a Communicator,
    /// The pipeline group: this replica's stages.
    pub(crate) ppc: &'a Communicator,
    pub(crate) pp: usize,
    pub(crate) stage: usize,
    pub(crate) replica: usize,
    /// Carry a flag through the step (one more element in every message: the activations,
    /// their gradients and the data group's average), so that every rank ends the step
    /// knowing whether any rank raised it: how an in-place job takes a joiner at the same
    /// step boundary on every rank. The reference run carries it too, so both reduce
    /// buffers of the same length (the same chunks, the same sums).
    pub(crate) flags: bool,
}

/// Forward (receiving from the stage before, sending to the one after), the loss on the
/// last stage, backward, the data group's gradient average, the update. `mid_step` runs
/// between the forward pass and the backward one (where the demo's fault strikes). Returns
/// the loss (0 off the last stage) and, with [`StepCtx::flags`], whether any rank of the
/// job raised its flag for this step (the forward pass carries it down the pipeline, the
/// backward pass back up, the data group's average across the replicas).
pub(crate) fn train_step(
    cx: &StepCtx<'_>,
    model: &mut Stage,
    step: u64,
    raised: bool,
    mid_step: &dyn Fn(),
) -> Result<(f32, bool)> {
    let (job, dev) = (cx.job, &cx.dev);
    let extra = usize::from(cx.flags);
    let mut flag = if raised { 1f32 } else { 0f32 };
    // The flag travels as the last element of a message.
    let take = |v: &mut Vec<f32>| if cx.flags { v.pop().unwrap_or(0.0) } else { 0.0 };
    if let Some(ms) = job.step_ms.filter(|ms| *ms > 0) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    let (h, rows, stage) = (job.width as usize, job.batch as usize, cx.stage);
    let x = if stage == 0 {
        batch(job.seed, step, cx.replica, rows, h)
    } else {
        let mut x = vec![0f32; rows * h + extra];
        dev.recv(cx.ppc, &mut x, stage - 1)?;
        flag = flag.max(take(&mut x));
        x
    };
    let acts = model.forward(&x, rows);
    let out = acts.last().cloned().unwrap_or_default();
    let mut loss = 0f32;
    let with_flag = |v: &[f32], flag: f32| -> Vec<f32> {
        let mut m = v.to_vec();
        if cx.flags {
            m.push(flag);
        }
        m
    };
    let dout = if stage + 1 < cx.pp {
        dev.send(cx.ppc, &with_flag(&out, flag), stage + 1)?;
        let mut d = vec![0f32; rows * h + extra];
        dev.recv(cx.ppc, &mut d, stage + 1)?;
        flag = flag.max(take(&mut d));
        d
    } else {
        let input = batch(job.seed, step, cx.replica, rows, h);
        let scale = 2.0 / (rows * h) as f32;
        out.iter()
            .zip(&input)
            .map(|(y, x)| {
                let e = y - (3.0 * x).sin() * 0.5;
                loss += e * e / (rows * h) as f32;
                e * scale
            })
            .collect()
    };
    mid_step();
    let (grads, dx) = model.backward(&acts, &dout, rows);
    if stage > 0 {
        dev.send(cx.ppc, &with_flag(&dx, flag), stage - 1)?;
    }
    let mut grads = with_flag(&grads, flag);
    dev.all_reduce_avg(cx.dpc, &mut grads)?;
    let mut any = false;
    if cx.flags {
        any = grads.pop().unwrap_or(0.0) > 0.0;
    }
    for (p, g) in model.params.iter_mut().zip(&grads) {
        *p -= job.lr * g;
    }
    Ok((loss, any))
}

/// The demo's fault: this process records when it strikes (`fault.json` in `run_dir`), then
/// sends itself SIGKILL, in the middle of a step: no exit path runs, no connection says
/// goodbye, as when a machine or a process dies for real.
pub(crate) fn kill_self(run_dir: &std::path::Path, rank: usize, step: u64) {
    let at = crate::timeline::now_ms();
    let text = format!("{{\"rank\":{rank},\"step\":{step},\"at_ms\":{at}}}\n");
    let _ = std::fs::create_dir_all(run_dir);
    let _ = std::fs::write(run_dir.join("fault.json"), text);
    outln!("rank {rank}: killing itself with SIGKILL in the middle of step {} (as asked)", step + 1);
    let _ = std::io::Write::flush(&mut std::io::stdout());
    let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL);
    // SIGKILL cannot be caught: this line is never reached while the kernel delivers it.
    std::thread::sleep(std::time::Duration::from_secs(3600));
}
