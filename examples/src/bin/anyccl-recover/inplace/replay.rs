//! The reference run: an in-place run's participation record replayed with no fault and no
//! membership.

use super::{step_ctx, InPlace};
use crate::cli::usage;
use crate::participation::Segment;
use crate::step::train_step;
use anyccl::Result;

impl InPlace<'_> {
    /// A reference run: the record's stretches, in order, with no fault and no membership.
    pub(super) async fn replay(&mut self, record: &[Segment]) -> Result<()> {
        for (i, seg) in record.iter().enumerate() {
            let end = record.get(i + 1).map_or(self.job.steps, |n| n.from_step);
            if !seg.active.contains(&self.replica) {
                continue;
            }
            let g = self.connect(seg, &format!("replay{}", seg.epoch)).await?;
            self.feed(seg, &g)?;
            if self.applied != seg.from_step {
                return Err(usage(
                    "--replay",
                    format!(
                        "the record's stretch of epoch {} starts at step {}, but this rank has completed {}: not a \
                         record of this job",
                        seg.epoch, seg.from_step, self.applied
                    ),
                ));
            }
            self.segments.push(seg.clone());
            let cx = step_ctx(self.job, self.platform.as_ref(), &self.cfg, &g, (self.pp, self.stage, self.replica));
            for step in seg.from_step..end {
                train_step(&cx, &mut self.model, step, false, &|| {})?;
                self.applied = step + 1;
            }
            for c in [&g.dpc, &g.ppc] {
                c.shutdown().await?;
            }
        }
        Ok(())
    }
}
