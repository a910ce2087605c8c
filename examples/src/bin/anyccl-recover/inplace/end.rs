//! A rank's end: its final parameters and participation record. Every rank's final shard
//! holds the job's parameters after its last step: a rank whose replica trained to the end
//! writes its own and names it in the store; a rank whose replica did not (it lost a stage
//! to the end, or its process replaced one after the last step) takes its stage's from one
//! that did, so that `final/` never mixes steps.

use super::InPlace;
use anyccl::raw::Ctx;
use anyccl::{Error, Result};
use anyccl_examples::checkpoint as ckpt;
use anyccl_examples::outln;
use std::process::ExitCode;
use std::time::Instant;

impl InPlace<'_> {
    /// The store key naming the rank whose final shard holds stage `stage`'s parameters.
    fn final_key(&self, stage: usize) -> String {
        self.key(&format!("final/stage{stage}"))
    }

    /// Whether this rank's parameters are the job's after its last step.
    fn trained_to_the_end(&self) -> bool {
        self.valid && self.applied == self.job.steps
    }

    /// Take this stage's final parameters from the rank that named its shard in the store
    /// (waiting for it for at most the operation timeout).
    ///
    /// # Errors
    /// `Timeout` when no rank of this stage finished within the operation timeout; a file
    /// error when its shard cannot be read or is not the one the store names.
    async fn adopt_final(&mut self) -> Result<()> {
        let me = self.me();
        let ctx = Ctx::new("anyccl-recover", me, "");
        let deadline = Instant::now() + self.cfg.op_timeout;
        let named = match self.store.wait(&self.final_key(self.stage), deadline).await {
            Ok(v) => v,
            Err(Error::Timeout { .. }) => {
                let why = format!("no rank of stage {} that trained to the end named its final shard", self.stage);
                return Err(ctx.timeout("take the final parameters", self.cfg.op_timeout, why));
            }
            Err(e) => return Err(e),
        };
        let text = String::from_utf8_lossy(&named);
        let bad = |why: String| ctx.invalid("take the final parameters", "the store's final key", why);
        let (src, step) = match text.split_once(' ').map(|(r, s)| (r.parse::<usize>(), s.parse::<u64>())) {
            Some((Ok(r), Ok(s))) => (r, s),
            _ => return Err(bad(format!("'{text}' is not '<rank> <step>'"))),
        };
        let path = self.run_dir.join("final").join(format!("rank{src}.bin"));
        let (id, params) = ckpt::read_shard_expecting(&path, self.model.params.len() as u64)?;
        let layout = self.job.layout(self.dp, self.pp);
        if id.step != step
            || id.layout != layout
            || params.len() != self.model.params.len()
            || src % self.pp != self.stage
        {
            return Err(ctx.file(
                "take the final parameters",
                &path,
                format!(
                    "holds step {} of '{}' ({} parameters) from rank {}; stage {} of '{layout}' at step {step} \
                     ({} parameters) was named",
                    id.step,
                    id.layout,
                    params.len(),
                    id.rank,
                    self.stage,
                    self.model.params.len()
                ),
            ));
        }
        outln!(
            "rank {me}: its replica did not train to the end (this process completed {} steps); its final parameters \
             are stage {}'s after step {step}, from rank {src}",
            self.applied,
            self.stage
        );
        self.model.params = params;
        self.applied = step;
        self.valid = true;
        Ok(())
    }

    /// The final parameters and the participation record of this process.
    pub(super) async fn finish(mut self) -> Result<ExitCode> {
        let me = self.me();
        let trained = self.trained_to_the_end();
        if !trained {
            self.adopt_final().await?;
        }
        let id = ckpt::ShardId {
            job: self.job.run_name().to_string(),
            step: self.applied,
            rank: me,
            world_size: self.env.world_size,
            layout: self.job.layout(self.dp, self.pp),
            count: self.model.params.len() as u64,
        };
        let path = self.run_dir.join("final").join(format!("rank{me}.bin"));
        ckpt::write_shard(&path, &id, &self.model.params)?;
        if trained {
            // Written first, then named: a rank that takes it reads a whole shard.
            self.store.set(&self.final_key(self.stage), format!("{me} {}", self.applied).as_bytes()).await?;
        }
        let path = self.run_dir.join("participation").join(format!("rank{me}-inc{}.json", self.env.incarnation));
        let text = serde_json::to_vec_pretty(&self.segments).unwrap_or_default();
        anyccl::raw::write_file_atomically(
            &Ctx::new("anyccl-recover", me, ""),
            "participation record",
            &path,
            &[&text],
        )?;
        self.mark("finished", self.segments.last().map_or(0, |s| s.epoch));
        if me == 0 {
            outln!("finished {} steps; parameters written to {}", self.applied, self.run_dir.join("final").display());
        }
        Ok(ExitCode::SUCCESS)
    }
}
