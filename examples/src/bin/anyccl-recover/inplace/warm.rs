//! Warming an epoch's rebuilt groups, and recording the first step's plan they are warmed
//! from.

use super::{Groups, InPlace};
use crate::participation::Segment;
use anyccl::warmup::{warmup, warmup_plans, GroupPlan, Session, StepRecorder, Target, WarmupConfig};
use anyccl::{Communicator, Result};
use anyccl_examples::out;
use std::time::Duration;

impl InPlace<'_> {
    /// A warmup session (or a recording's) of the epoch of `seg` among its training ranks
    /// `members`: the epoch is the generation, so nothing of an earlier epoch is replayed.
    fn session<'a>(&'a self, job: &'a str, seg: &Segment, members: &'a [usize]) -> Session<'a> {
        Session {
            store: self.store.as_ref(),
            job,
            generation: seg.epoch + 1,
            rank: self.me(),
            world_size: self.env.world_size,
            members: Some(members),
            platform: self.platform.as_ref(),
        }
    }

    /// Warm the rebuilt groups from the recorded plan (re-made for their sizes), or from
    /// their roles where there is none, among the epoch's training ranks.
    pub(super) async fn warm(&mut self, seg: &Segment, g: &Groups) -> Result<()> {
        if self.plans.is_none() {
            self.plans = self.recorded_plans().await?;
        }
        let (job, members) = (self.key("warmup"), self.ranks_of(&seg.active));
        let session = self.session(&job, seg, &members);
        let wcfg = WarmupConfig {
            enabled: true,
            force: true,
            timeout: Duration::from_secs(120),
            ..WarmupConfig::from_env(WarmupConfig::default())?
        };
        let comms = [&g.dpc, &g.ppc];
        let report = match &self.plans {
            Some(recorded) => {
                let base = |name: &str| name.split('@').next().unwrap_or(name).to_string();
                let plans: Vec<(&Communicator, GroupPlan)> = comms
                    .iter()
                    .filter_map(|c| {
                        let p = recorded.iter().find(|p| base(&p.group) == base(&c.spec().name))?;
                        Some((*c, p.rebuilt_for(c)?))
                    })
                    .collect();
                warmup_plans(&session, plans, &wcfg).await?
            }
            None => warmup(&session, &comms.map(Target::new), &wcfg).await?,
        };
        if members.first() == Some(&self.me()) {
            out!("{}", report.table());
        }
        Ok(())
    }

    /// The plans a replacement warms from: those its rank recorded in the store; else (its
    /// first process was stopped or killed after the recording, before it stored them) each
    /// group's plan as another rank stored it: a recorded plan is merged across the group's
    /// members, so every member holds the same. `None` when no rank stored any.
    async fn recorded_plans(&self) -> Result<Option<Vec<GroupPlan>>> {
        let key = |r: usize| self.key(&format!("plan/{r}"));
        if let Some(v) = self.store.get(&key(self.me())).await? {
            return Ok(serde_json::from_slice(&v).ok());
        }
        let base = |name: &str| name.split('@').next().unwrap_or(name).to_string();
        let mut found: Vec<GroupPlan> = Vec::new();
        for r in (0..self.env.world_size).filter(|&r| r != self.me()) {
            let Some(v) = self.store.get(&key(r)).await? else { continue };
            let Ok(plans) = serde_json::from_slice::<Vec<GroupPlan>>(&v) else { continue };
            for p in plans {
                if !found.iter().any(|f| base(&f.group) == base(&p.group)) {
                    found.push(p);
                }
            }
        }
        Ok((!found.is_empty()).then_some(found))
    }

    /// The first step's plan, merged across each group's members, kept in the store under
    /// this rank (where its replacement finds it).
    pub(super) async fn record(&mut self, r: StepRecorder<'_>, seg: &Segment) -> Result<()> {
        let (job, members) = (self.key("record"), self.ranks_of(&seg.active));
        let session = self.session(&job, seg, &members);
        let recorded = r.finish(&session, self.cfg.op_timeout).await?;
        let bytes = serde_json::to_vec(&recorded.plans).unwrap_or_default();
        self.store.set(&self.key(&format!("plan/{}", self.me())), &bytes).await?;
        self.plans = Some(recorded.plans);
        Ok(())
    }
}
