//! The participation record: which replicas trained from which step, per membership
//! epoch. An in-place run writes it (one file per process, merged after the run); a
//! reference run replays it with no fault and must end equal bit for bit.

use anyccl::raw::Ctx;
use anyccl::Result;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// One stretch of steps with one set of replicas training: what a run records, and what a
/// reference run replays.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Segment {
    /// The membership epoch.
    pub(crate) epoch: u64,
    /// The step it starts from (every training rank has completed this many).
    pub(crate) from_step: u64,
    /// The replicas that train, in order (each data group's member order).
    pub(crate) active: Vec<usize>,
    /// Replicas that (re)joined at its start, fed the parameters by `source`.
    pub(crate) fresh: Vec<usize>,
    /// The replica whose parameters the fresh ones receive.
    pub(crate) source: Option<usize>,
}

/// The participation record of a run: every process's stretches, one per epoch.
pub(crate) fn merge_records(run_dir: &Path) -> Result<Vec<Segment>> {
    let ctx = Ctx::process("anyccl-recover");
    let dir = run_dir.join("participation");
    let entries = std::fs::read_dir(&dir).map_err(|e| ctx.io("read the participation records", &dir, e))?;
    let mut by_epoch: BTreeMap<u64, Segment> = BTreeMap::new();
    for e in entries.flatten() {
        let segs: Vec<Segment> = read_record(&e.path())?;
        for s in segs {
            if let Some(had) = by_epoch.get(&s.epoch) {
                if *had != s {
                    return Err(ctx.file(
                        "merge the participation records",
                        e.path(),
                        format!("epoch {} differs between ranks: {had:?} and {s:?}", s.epoch),
                    ));
                }
            }
            by_epoch.insert(s.epoch, s);
        }
    }
    Ok(by_epoch.into_values().collect())
}

/// A participation record, as a file holds it.
pub(crate) fn read_record(path: &Path) -> Result<Vec<Segment>> {
    let ctx = Ctx::process("anyccl-recover");
    let bytes = anyccl::raw::read_regular_file(&ctx, "read a participation record", path, 16 << 20)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ctx.file("read a participation record", path, format!("not a record: {e}")))
}

/// The record, for the reference run to replay.
pub(crate) fn write_record(path: &Path, record: &[Segment]) -> Result<()> {
    let text = serde_json::to_vec_pretty(record).unwrap_or_default();
    anyccl::raw::write_file_atomically(&Ctx::process("anyccl-recover"), "participation record", path, &[&text])
}
