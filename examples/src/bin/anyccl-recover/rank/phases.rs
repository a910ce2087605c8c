//! `--colocated-phases N`: training alternates with N rollout phases, as colocated RL does
//! on shared devices. In each rollout a colocated inference engine takes the device's free
//! memory but a margin (on the CPU backend, a fixed amount of host memory) and gives it
//! back. The training groups sleep through it (`sleep_groups`: their communicators' memory
//! goes to the rollout) and wake warmed from the first step's recorded plan
//! (`wake_groups`), so the first step after each rollout takes no memory; with `--no-sleep`
//! they stay awake, and the rollout gets that much less. Each rollout prints one row.

use super::Rank;
use crate::model::Stage;
use crate::step::train_step;
use anyccl::warmup::{sleep_groups, wake_groups, GroupPlan, Session, StepRecorder, WarmupConfig};
use anyccl::{DType, DeviceKind, Result};
use anyccl_examples::outln;
use std::time::{Duration, Instant};

/// What a rollout leaves free on a device, MiB, unless `--squeeze` says otherwise.
const MARGIN_MIB: u64 = 512;
/// How long a rollout holds its memory.
const ROLLOUT: Duration = Duration::from_millis(50);

fn mib(bytes: i64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

impl Rank<'_> {
    /// Device memory free now, bytes, once every rank got to `at` (so none is mid-call).
    async fn free_at(&self, at: &str) -> Result<i64> {
        let (me, n) = (self.me(), self.env.world_size);
        anyccl_examples::meet(self.store.as_ref(), &format!("phases/{at}"), me, n, self.cfg.op_timeout).await?;
        self.platform.synchronize()?;
        Ok(self.platform.mem_info()?.free as i64)
    }

    /// The steps in `--colocated-phases` + 1 training phases with a rollout between each two;
    /// the first step is recorded, for the warmup after each wake.
    pub(super) async fn run_phased(&mut self, model: &mut Stage) -> Result<()> {
        let (job, me) = (self.job, self.me());
        let rollouts = job.colocated_phases.unwrap_or(0);
        if job.steps <= rollouts {
            let msg = format!("{} steps cannot surround {rollouts} rollouts: at least {}", job.steps, rollouts + 1);
            return Err(crate::cli::usage("--steps", msg));
        }
        let plans: Vec<GroupPlan> = {
            let recorder = StepRecorder::start(&[&self.dpc, &self.ppc], self.platform.as_ref());
            train_step(&self.step_ctx(), model, 0, false, &|| {})?;
            recorder.finish(&self.session(), self.cfg.op_timeout).await?.plans
        };
        if me == 0 {
            outln!(
                "# {rollouts} rollouts; the training groups {} through them",
                if job.no_sleep { "stay awake (--no-sleep)" } else { "sleep" }
            );
            outln!(
                "{:>7} {:>16} {:>15} {:>10} {:>10} {:>17}",
                "rollout",
                "given back MiB",
                "rollout MiB",
                "wake ms",
                "warm ms",
                "next step MiB"
            );
        }
        let mut step = 1;
        for phase in 1..=rollouts + 1 {
            let end = job.steps * phase / (rollouts + 1);
            let mut row = None;
            if phase > 1 {
                row = Some(self.rollout(phase - 1, &plans).await?);
            }
            while step < end {
                // Only the first step after a rollout is measured (two meetings of all ranks).
                let Some((k, given, took, woke, warm)) = row.take() else {
                    train_step(&self.step_ctx(), model, step, false, &|| {})?;
                    step += 1;
                    continue;
                };
                let before = self.free_at(&format!("step{step}/before")).await?;
                train_step(&self.step_ctx(), model, step, false, &|| {})?;
                let after = self.free_at(&format!("step{step}/after")).await?;
                outln!(
                    "{k:>7} {:>16.1} {:>15.1} {woke:>10.1} {warm:>10.1} {:>17.1}   (rank {me})",
                    mib(given) + 0.0,
                    mib(took),
                    mib(before - after) + 0.0
                );
                step += 1;
            }
        }
        Ok(())
    }

    /// Rollout `k`: the training groups sleep (unless `--no-sleep`), the colocated engine
    /// takes its memory and gives it back, the groups wake and are warmed from `plans`.
    /// Returns `k`, the bytes the sleep gave back, the bytes the rollout took, and the wake's
    /// and the warmup's times in ms.
    async fn rollout(&mut self, k: u64, plans: &[GroupPlan]) -> Result<(u64, i64, i64, f64, f64)> {
        let (store, platform, backend) = (self.store.clone(), self.platform.clone(), self.backend.clone());
        let session = Session {
            store: store.as_ref(),
            job: crate::cli::OWNER,
            generation: 1 + k,
            rank: self.me(),
            world_size: self.env.world_size,
            members: None,
            platform: platform.as_ref(),
        };
        let before = self.free_at(&format!("rollout{k}/before")).await?;
        if !self.job.no_sleep {
            sleep_groups(&session, &mut [&mut self.dpc, &mut self.ppc]).await?;
        }
        let free = self.free_at(&format!("rollout{k}/asleep")).await?;
        // The colocated engine: the device's free memory but a margin, taken in pieces (ranks
        // that share a device split it); host memory is capped.
        let (engine, take) = match platform.kind() {
            DeviceKind::Cpu => {
                let take = self.job.colocated_mib << 20;
                (vec![platform.alloc(DType::U8, take as usize)?], take as i64)
            }
            _ => {
                let (held, bytes) =
                    super::fill_device(platform.as_ref(), self.job.squeeze.unwrap_or(MARGIN_MIB) << 20)?;
                (held, bytes as i64)
            }
        };
        std::thread::sleep(ROLLOUT);
        drop(engine);
        let (mut woke, mut warm) = (0.0, 0.0);
        if !self.job.no_sleep {
            let cfg = WarmupConfig { enabled: true, force: true, ..WarmupConfig::from_env(WarmupConfig::default())? };
            let t = Instant::now();
            let r =
                wake_groups(&session, &mut [&mut self.dpc, &mut self.ppc], backend.as_ref(), Some(plans), &cfg).await?;
            woke = t.elapsed().as_secs_f64() * 1e3 - r.warm_ms;
            warm = r.warm_ms;
        }
        Ok((k, free - before, take, woke, warm))
    }
}
