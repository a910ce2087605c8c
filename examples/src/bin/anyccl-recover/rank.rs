//! `anyccl-recover train`: one rank of one launch. In order: join the job (store, groups),
//! agree with the other ranks on the checkpoint to resume from, recover (release the
//! colocated component's memory, warm the train step's groups, load the checkpoint),
//! optionally squeeze device memory, train (recording the first step's plan and saving it
//! beside every checkpoint), and write the final parameters.

use crate::cli::{usage, Job, OWNER};
use crate::dev::Dev;
use crate::model::Stage;
use crate::step::{kill_self, train_step, StepCtx};
use anyccl::raw::Ctx;
use anyccl::warmup::{warmup, warmup_saved, PlanFile, PlanIdentity, Session, StepRecorder, Target, WarmupConfig};
use anyccl::{
    CommConfig, Communicator, DType, DeviceKind, DeviceMemory, GroupRegistry, GroupSpec, LaunchEnv, Platform, Result,
    Role, Store, TcpStoreServer,
};
use anyccl_examples::checkpoint as ckpt;
use anyccl_examples::machine::{self, DirLock};
use anyccl_examples::{out, outln};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The roles of the groups the train step uses: the warmup takes these from the registry.
const STEP_ROLES: [Role; 4] = [Role::Data, Role::Pipeline, Role::Tensor, Role::Expert];

/// One rank of the job.
pub(crate) async fn train(job: &Job) -> Result<ExitCode> {
    let (rank, colocated) = Rank::join(job).await?;
    let mut model = Stage::new(job.width as usize, job.layers as usize, job.seed, rank.stage)
        .map_err(|e| usage("--width", format!("the model of --width {} --layers {}: {e}", job.width, job.layers)))?;
    let resumed = rank.agree_on_checkpoint(&model).await?;
    let job_id = match &resumed {
        Some(l) => l.job.clone(),
        None => new_job_id(rank.store.as_ref(), rank.me(), rank.cfg.op_timeout).await?,
    };
    let mut colocated = Some(colocated);
    let start = match resumed {
        Some(loaded) => {
            // Released first, so the warmup runs while memory is light.
            drop(colocated.take());
            rank.say(format!("released the colocated component's {} MiB", job.colocated_mib));
            rank.recover(loaded, &job_id, &mut model).await?
        }
        None => Start::default(),
    };
    if job.colocated_phases.is_some() {
        // The rollouts take and give back memory of their own.
        drop(colocated.take());
        let mut rank = rank;
        rank.run_phased(&mut model).await?;
        return rank.finish(&model, job_id, None).await;
    }
    let squeezed = rank.squeeze()?;
    rank.run_steps(&mut model, &job_id, &start, squeezed).await?;
    rank.finish(&model, job_id, colocated).await
}

/// Where the steps start: the first step, or the loaded checkpoint's with how it was warmed.
#[derive(Default)]
struct Start {
    step: u64,
    /// The groups were warmed before the first step.
    warmed: bool,
    /// The plan the warmup used, when it came from a checkpoint: its cold step's cost is
    /// carried into the plans this run saves (this run's own first step runs warm).
    warmed_from: Option<PlanFile>,
}

mod phases;

/// Who this rank is and what it holds: its job's store, device and communicators.
struct Rank<'j> {
    job: &'j Job,
    env: LaunchEnv,
    store: Arc<dyn Store>,
    _server: Option<TcpStoreServer>,
    platform: Arc<dyn Platform>,
    backend: Arc<dyn anyccl::Backend>,
    cfg: CommConfig,
    world: Communicator,
    /// The data group (same stage) and the pipeline group (same replica).
    dpc: Communicator,
    ppc: Communicator,
    registry: GroupRegistry,
    pp: usize,
    replica: usize,
    stage: usize,
    run_dir: PathBuf,
    /// The model and parallel layout every shard and plan records.
    layout: String,
    /// Rank 0 holds the run's folder for the launch's life.
    _lock: Option<DirLock>,
}

impl<'j> Rank<'j> {
    /// Start as the launcher says, check what the run needs, connect the world and split
    /// the data and pipeline groups. Returns the colocated component's memory too.
    async fn join(job: &'j Job) -> Result<(Rank<'j>, Box<dyn DeviceMemory>)> {
        let crate::cli::Started { env, store, server, backend, platform, dp, pp } = job.start().await?;
        let run_dir = job.out.join(job.run_name());
        let lock = match env.rank {
            0 => Some(machine::lock_dir(&run_dir, "anyccl-recover", "--run")?),
            _ => None,
        };
        let (me, replica, stage) = (env.rank, env.rank / pp, env.rank % pp);

        // A colocated component (an inference engine, say) holds device memory.
        let colocated = platform.alloc(DType::U8, (job.colocated_mib as usize) << 20)?;

        let cfg = CommConfig::from_env()?;
        let world = Communicator::connect(
            backend.as_ref(),
            GroupSpec::world(env.world_size, OWNER),
            me,
            store.clone(),
            platform.device(),
            cfg.clone(),
        )
        .await?;
        let registry = GroupRegistry::new();
        let dp_ranks: Vec<usize> = (0..dp).map(|d| d * pp + stage).collect();
        let pp_ranks: Vec<usize> = (0..pp).map(|s| replica * pp + s).collect();
        let dp_spec = GroupSpec::new(format!("dp-stage{stage}"), dp_ranks, OWNER, Role::Data);
        let pp_spec = GroupSpec::new(format!("pp-replica{replica}"), pp_ranks, OWNER, Role::Pipeline);
        let ctx = Ctx::new("anyccl-recover", me, &world.spec().name);
        let not_in = |g: &GroupSpec| ctx.invalid("split", "spec", format!("rank {me} is not a member of {}", g.name));
        let dpc = world.split(Some(dp_spec.clone())).await?.ok_or_else(|| not_in(&dp_spec))?;
        let ppc = world.split(Some(pp_spec.clone())).await?.ok_or_else(|| not_in(&pp_spec))?;
        registry.register(dp_spec);
        registry.register(pp_spec);
        // The weight-sync group with the inference engine: its other member never joins this
        // job's warmup, so nothing may ever issue a collective on it from here.
        registry.register(GroupSpec::new("weight-sync", vec![0, env.world_size], OWNER, Role::CrossEngine));
        let layout = job.layout(dp, pp);
        let rank = Rank {
            job,
            env,
            store,
            _server: server,
            platform,
            backend,
            cfg,
            world,
            dpc,
            ppc,
            registry,
            pp,
            replica,
            stage,
            run_dir,
            layout,
            _lock: lock,
        };
        Ok((rank, colocated))
    }

    fn me(&self) -> usize {
        self.env.rank
    }

    fn step_ctx(&self) -> StepCtx<'_> {
        StepCtx {
            job: self.job,
            dev: Dev { p: self.platform.as_ref(), timeout: self.cfg.op_timeout },
            dpc: &self.dpc,
            ppc: &self.ppc,
            pp: self.pp,
            stage: self.stage,
            replica: self.replica,
            flags: false,
        }
    }

    /// Rank 0 says it.
    fn say(&self, msg: String) {
        if self.me() == 0 {
            outln!("{msg}");
        }
    }

    fn session(&self) -> Session<'_> {
        Session {
            store: self.store.as_ref(),
            job: OWNER,
            generation: 1,
            rank: self.me(),
            world_size: self.env.world_size,
            members: None,
            platform: self.platform.as_ref(),
        }
    }

    /// The identity of the plan saved with the checkpoint of `step`.
    fn plan_id(&self, job_id: &str, step: u64) -> PlanIdentity {
        PlanIdentity {
            job: job_id.to_string(),
            step,
            rank: self.me(),
            world_size: self.env.world_size,
            layout: self.layout.clone(),
        }
    }

    /// The identity of this rank's shard of `step`.
    fn shard_id(&self, job_id: &str, step: u64, model: &Stage) -> ckpt::ShardId {
        ckpt::ShardId {
            job: job_id.to_string(),
            step,
            rank: self.me(),
            world_size: self.env.world_size,
            layout: self.layout.clone(),
            count: model.params.len() as u64,
        }
    }

    /// The checkpoint to resume from (`--resume-from`), agreed by every rank before
    /// anything else happens, so that the warmup belongs to the checkpoint actually loaded.
    async fn agree_on_checkpoint(&self, model: &Stage) -> Result<Option<ckpt::Loaded>> {
        let Some(from) = &self.job.resume_from else { return Ok(None) };
        self.say(format!("recovering from {}", from.display()));
        let want = ckpt::Expect {
            rank: self.me(),
            world_size: self.env.world_size,
            layout: self.layout.clone(),
            count: model.params.len() as u64,
        };
        let loaded = ckpt::agree_and_load(self.store.as_ref(), "resume", from, &want, self.cfg.op_timeout).await?;
        Ok(Some(loaded))
    }

    /// Recovery, once the colocated component's memory is released: warm the train step's
    /// groups, then load the checkpoint.
    async fn recover(&self, loaded: ckpt::Loaded, job_id: &str, model: &mut Stage) -> Result<Start> {
        let mut start = Start::default();
        if self.job.no_warmup {
            self.say("warmup skipped (--no-warmup)".into());
        } else {
            start.warmed_from = self.warm(loaded.step, job_id).await?;
            start.warmed = true;
        }
        model.params = loaded.params;
        start.step = loaded.step;
        self.say(format!("loaded the checkpoint of step {}", start.step));
        Ok(start)
    }

    /// Warm the train step's groups, chosen from the registry by owner and role, from the
    /// plan saved with the checkpoint of `step` (or the groups' roles: `--role-plan`, or
    /// where that plan is missing, corrupt or another job's, which the report says).
    /// Returns the saved plan when there was one.
    async fn warm(&self, step: u64, job_id: &str) -> Result<Option<PlanFile>> {
        let chosen = self.registry.filter(OWNER, &STEP_ROLES);
        let by_name = |n: &str| [&self.dpc, &self.ppc].into_iter().find(|c| c.spec().name == n);
        let targets: Vec<Target<'_>> = chosen.iter().filter_map(|g| by_name(&g.name)).map(Target::new).collect();
        let wcfg = WarmupConfig {
            enabled: true,
            force: true,
            timeout: Duration::from_secs(120),
            ..WarmupConfig::from_env(WarmupConfig::default())?
        };
        let from = self.job.resume_from.as_deref().ok_or_else(|| usage("--resume-from", "not recovering".into()))?;
        let saved = PlanFile::load(&plan_path(from, step, self.me()), &self.plan_id(job_id, step));
        let session = self.session();
        let report = if self.job.role_plan {
            warmup(&session, &targets, &wcfg).await?
        } else {
            warmup_saved(&session, &targets, &saved, &wcfg).await?
        };
        if self.me() == 0 {
            out!("{}", report.table());
            for g in self.registry.all().iter().filter(|g| !STEP_ROLES.contains(&g.role)) {
                outln!(
                    "  not warmed: {} (role {}: the warmup takes the train step's roles from the registry)",
                    g.name,
                    g.role
                );
            }
        }
        Ok(saved.ok())
    }

    /// On GPUs, after a recovery, with `--squeeze`: fill device memory until only that many
    /// MiB are free for the first step. The memory is held until that step is done.
    fn squeeze(&self) -> Result<Vec<Box<dyn DeviceMemory>>> {
        let (Some(leave), Some(_)) = (self.job.squeeze, self.job.resume_from.as_ref()) else { return Ok(Vec::new()) };
        if self.platform.kind() == DeviceKind::Cpu {
            return Ok(Vec::new());
        }
        let squeezed = fill_device(self.platform.as_ref(), leave.saturating_mul(1 << 20))?.0;
        outln!("rank {}: squeezed device memory to {} MiB free", self.me(), self.platform.mem_info()?.free >> 20);
        Ok(squeezed)
    }

    /// The steps from `start` to `--steps`: the first one recorded, a checkpoint every
    /// `--ckpt-every`, and the planned crash of `--crash-at`.
    async fn run_steps(
        &self,
        model: &mut Stage,
        job_id: &str,
        start: &Start,
        mut squeezed: Vec<Box<dyn DeviceMemory>>,
    ) -> Result<()> {
        let me = self.me();
        let mut recorder = Some(StepRecorder::start(&[&self.dpc, &self.ppc], self.platform.as_ref()));
        let mut saved_plan: Option<PlanFile> = None;
        for step in start.step..self.job.steps {
            if self.job.crash_at == Some(step) && me == self.env.world_size - 1 {
                outln!("rank {me}: crashing at step {step} (as asked)");
                std::process::exit(17);
            }
            let t = Instant::now();
            let kill = self.job.kill_at == Some(step) && me == self.env.world_size - 1 && self.env.incarnation == 1;
            let mid_step = || {
                if kill {
                    kill_self(&self.run_dir, me, step);
                }
            };
            let (loss, _) = train_step(&self.step_ctx(), model, step, false, &mid_step)?;
            if step == start.step {
                // When the first good step of this launch ended: the restart path's recovery time.
                crate::timeline::mark(&self.run_dir, me, self.env.incarnation, "first step", 0, step + 1);
            }
            // The first step of every launch is recorded; its plan is saved with each checkpoint.
            if let Some(r) = recorder.take() {
                saved_plan = Some(self.first_step_plan(r, start, job_id).await?);
            }
            if !squeezed.is_empty() {
                squeezed.clear();
                outln!("rank {me}: first step after recovery succeeded with the squeezed memory");
            }
            if self.stage + 1 == self.pp && self.replica == 0 {
                outln!("step {:3}  loss {loss:.6}  {:.2?}", step + 1, t.elapsed());
            }
            let done = step + 1;
            if done % self.job.ckpt_every == 0 {
                self.checkpoint(model, job_id, done, saved_plan.as_ref()).await?;
            }
        }
        Ok(())
    }

    /// The plan the first step recorded, merged across each group's members, with the cost
    /// of a cold step: this step's own, or (when it ran warm) the one saved with the plan
    /// the warmup replayed.
    async fn first_step_plan(&self, recorder: StepRecorder<'_>, start: &Start, job_id: &str) -> Result<PlanFile> {
        let recorded = recorder.finish(&self.session(), self.cfg.op_timeout).await?;
        let cold_step = if start.warmed {
            start.warmed_from.as_ref().filter(|f| f.plans == recorded.plans).and_then(|f| f.cold_step.clone())
        } else {
            recorded.cost
        };
        if let Some(c) = cold_step.as_ref().filter(|_| self.me() == 0) {
            outln!("recorded the first step's plan; it took {:.1} MiB cold", c.total as f64 / (1 << 20) as f64);
        }
        Ok(PlanFile { identity: self.plan_id(job_id, 0), plans: recorded.plans, cold_step, path: None })
    }

    /// The checkpoint of step `done`: this rank's shard and plan, then, once every rank has
    /// written its own, rank 0 marks the step complete.
    async fn checkpoint(&self, model: &Stage, job_id: &str, done: u64, plan: Option<&PlanFile>) -> Result<()> {
        let me = self.me();
        ckpt::write_shard(
            &ckpt::shard_path(&self.run_dir, done, me),
            &self.shard_id(job_id, done, model),
            &model.params,
        )?;
        if let Some(plan) = plan {
            let plan = PlanFile { identity: self.plan_id(job_id, done), ..plan.clone() };
            plan.write(&plan_path(&self.run_dir, done, me))?;
        }
        let key = format!("ckpt/{}/{done}", self.job.run_name());
        anyccl_examples::meet(self.store.as_ref(), &key, me, self.env.world_size, self.cfg.op_timeout).await?;
        if me == 0 {
            let marker = self.run_dir.join(format!("ckpt/step{done:06}/COMPLETE"));
            let ctx = Ctx::new("anyccl-recover", me, "");
            std::fs::write(&marker, b"").map_err(|e| ctx.io("checkpoint: mark complete", &marker, e))?;
        }
        Ok(())
    }

    /// The final parameters, once every rank is done; then the communicators shut down.
    async fn finish(self, model: &Stage, job_id: String, colocated: Option<Box<dyn DeviceMemory>>) -> Result<ExitCode> {
        let (me, steps) = (self.me(), self.job.steps);
        let fin = self.run_dir.join("final").join(format!("rank{me}.bin"));
        ckpt::write_shard(&fin, &self.shard_id(&job_id, steps, model), &model.params)?;
        let key = format!("end/{}", self.job.run_name());
        anyccl_examples::meet(self.store.as_ref(), &key, me, self.env.world_size, self.cfg.op_timeout).await?;
        drop(colocated);
        for c in [&self.ppc, &self.dpc, &self.world] {
            c.shutdown().await?;
        }
        self.say(format!("finished {steps} steps; parameters written to {}", self.run_dir.join("final").display()));
        Ok(ExitCode::SUCCESS)
    }
}

/// Where rank `rank`'s warmup plan of step `step`'s checkpoint lives: beside its shard.
fn plan_path(run_dir: &Path, step: u64, rank: usize) -> PathBuf {
    ckpt::step_dir(run_dir, step).join(format!("warmup-plan-rank{rank}.json"))
}

/// A new training job's identity, recorded in every shard: the launcher's job id
/// (`ANYCCL_JOB_ID`) or one rank 0 draws, the same on every rank.
async fn new_job_id(store: &dyn Store, me: usize, timeout: Duration) -> Result<String> {
    let key = "anyccl-recover/job-id";
    if me == 0 {
        let id = std::env::var("ANYCCL_JOB_ID")
            .ok()
            .filter(|j| !j.is_empty())
            .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()));
        store.set(key, id.as_bytes()).await?;
    }
    let v = store.wait(key, anyccl::raw::deadline_in(timeout)).await?;
    Ok(String::from_utf8_lossy(&v).into_owned())
}

/// Allocate device memory until only `leave` bytes are free, in pieces of 1 GiB down to
/// 1 MiB: ranks that share a device (or anything else allocating meanwhile) then split what
/// is free between them instead of one failing. The pieces, and the bytes they hold.
///
/// # Errors
/// The platform's, when it cannot say how much is free.
pub(crate) fn fill_device(platform: &dyn Platform, leave: u64) -> Result<(Vec<Box<dyn DeviceMemory>>, u64)> {
    let (mut held, mut bytes) = (Vec::new(), 0u64);
    let mut chunk: u64 = 1 << 30;
    while chunk >= 1 << 20 {
        let free = platform.mem_info()?.free;
        if free <= leave.saturating_add(chunk) {
            chunk /= 2;
            continue;
        }
        match platform.alloc(DType::U8, chunk as usize) {
            Ok(m) => {
                held.push(m);
                bytes += chunk;
            }
            Err(_) => chunk /= 2,
        }
    }
    Ok((held, bytes))
}
