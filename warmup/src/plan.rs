//! Warmup plans: what to run on each group, as data with a fingerprint.
//!
//! A group's plan is *group-global*: every member holds the same steps (point-to-point steps
//! list every pair), and each member runs the parts that involve it. That is what lets the
//! members agree on a fingerprint and run the same order.

use anyccl_core::{Capabilities, Communicator, DType, OpSignature, Role};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// A collective kind a plan can warm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Kind {
    /// all_reduce.
    AllReduce,
    /// reduce_scatter (then all_gather: the sharded-optimizer pair).
    ReduceScatter,
    /// all_gather.
    AllGather,
    /// broadcast from group rank 0.
    Broadcast,
    /// all_to_all with equal splits (token dispatch).
    AllToAll,
    /// Unbatched send/recv between the pairs, lower rank sending first.
    SendRecv,
    /// One batched send+recv per pair.
    SendRecvBatched,
}

/// One step of a group's plan.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Step {
    /// What to run.
    pub kind: Kind,
    /// Element type.
    pub dtype: DType,
    /// Elements of this rank's input (for reduce_scatter: of each output chunk).
    pub count: usize,
    /// Point-to-point pairs `(a, b)` in group ranks, `a < b`, in the order they run.
    pub pairs: Vec<(usize, usize)>,
}

/// The plan for one group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupPlan {
    /// Group name.
    pub group: String,
    /// Role.
    pub role: Role,
    /// Owner.
    pub owner: String,
    /// Number of members.
    pub size: usize,
    /// Steps, in the order every member runs them.
    pub steps: Vec<Step>,
    /// Whether members' steps are merged (recorded plans, where each rank saw only its own
    /// peers) instead of required to be identical.
    pub merge: bool,
}

impl GroupPlan {
    fn of(spec: &anyccl_core::GroupSpec, size: usize, steps: Vec<Step>, merge: bool) -> Self {
        GroupPlan { group: spec.name.clone(), role: spec.role.clone(), owner: spec.owner.clone(), size, steps, merge }
    }

    /// Whether every step can run on a group of `size` members: pairs of two distinct
    /// members, a non-empty count, buffers that fit in memory, all_to_all counts divisible by
    /// the size. A plan read from a file is checked before it is agreed on, so a bad one falls
    /// back to the role plan instead of failing the warmup on one rank.
    ///
    /// # Errors
    /// What is wrong with the first bad step.
    pub fn check(&self) -> std::result::Result<(), String> {
        const MOST: usize = 1 << 40;
        let n = self.size;
        for (i, s) in self.steps.iter().enumerate() {
            let bad = |why: String| Err(format!("group '{}' step {i} ({:?}): {why}", self.group, s.kind));
            if s.count == 0 {
                return bad("count 0".into());
            }
            let whole = match s.kind {
                Kind::ReduceScatter | Kind::AllGather => s.count.checked_mul(n),
                _ => Some(s.count),
            };
            match whole.and_then(|c| c.checked_mul(s.dtype.size())) {
                Some(b) if b <= MOST => {}
                _ => return bad(format!("{} elements of {} do not fit in 1 TiB", s.count, s.dtype.name())),
            }
            if s.kind == Kind::AllToAll && s.count % n != 0 {
                return bad(format!("all_to_all count {} is not a multiple of the group size {n}", s.count));
            }
            let p2p = matches!(s.kind, Kind::SendRecv | Kind::SendRecvBatched);
            if p2p == s.pairs.is_empty() {
                return bad(if p2p { "no pairs".into() } else { "pairs on a collective".into() });
            }
            if let Some((a, b)) = s.pairs.iter().find(|(a, b)| a >= b || *b >= n) {
                return bad(format!("pair ({a}, {b}) is not two members a < b of {n}"));
            }
        }
        Ok(())
    }

    /// SHA-256 of the canonical JSON, hex.
    pub fn fingerprint(&self) -> String {
        let json = serde_json::to_vec(self).unwrap_or_default();
        Sha256::digest(&json).iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Per-group choices the caller can make; defaults come from the role.
#[derive(Debug, Clone, Default)]
pub struct TargetOptions {
    /// Collective kinds to warm instead of the role's defaults.
    pub kinds: Option<Vec<Kind>>,
    /// Point-to-point pairs (group ranks) instead of the role's default (pipeline
    /// neighbours `(i, i+1)`).
    pub pairs: Option<Vec<(usize, usize)>>,
    /// Warm a cross-engine group. Only when every member outside this job takes part in a
    /// coordinated warmup of its own; never by default.
    pub allow_cross_engine: bool,
}

/// A group to warm: its communicator and options.
#[derive(Debug, Clone)]
pub struct Target<'a> {
    /// The group's communicator.
    pub comm: &'a Communicator,
    /// Options.
    pub options: TargetOptions,
}

impl<'a> Target<'a> {
    /// A target with the role's defaults.
    pub fn new(comm: &'a Communicator) -> Self {
        Target { comm, options: TargetOptions::default() }
    }
    /// With options.
    pub fn with(comm: &'a Communicator, options: TargetOptions) -> Self {
        Target { comm, options }
    }
}

/// Sizes and dtype used for plans built from roles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sizes {
    /// Small probe, bytes per rank (`None`: the backend's capability).
    pub small_bytes: Option<usize>,
    /// Large probe, bytes per rank (`None`: the backend's capability).
    pub large_bytes: Option<usize>,
    /// Element type of the probes.
    pub dtype: DType,
}

impl Default for Sizes {
    fn default() -> Self {
        Sizes { small_bytes: None, large_bytes: None, dtype: DType::BF16 }
    }
}

/// The collective kinds a role's train step issues in the common frameworks, and nothing
/// more: a library keeps what a warmup connects for the communicator's whole life, so an
/// extra kind is device memory lost for the job (a caller wanting more passes its own
/// kinds in [`TargetOptions`]).
///
/// - data (and data+context): gradient all_reduce (DDP), or reduce_scatter and all_gather
///   (ZeRO / FSDP / Megatron's distributed optimizer);
/// - tensor and context: all_reduce, reduce_scatter and all_gather (Megatron's tensor and
///   sequence parallelism, ring attention's exchanges);
/// - pipeline: send/recv with the neighbouring stages in both directions, unbatched and
///   batched (Megatron's `p2p_communication`); no broadcast, which no common schedule issues;
/// - expert: all_to_all (token dispatch and combine); no all_reduce, since an expert's
///   gradients are reduced on its data group.
pub fn role_kinds(role: &Role) -> Vec<Kind> {
    match role {
        Role::Data | Role::DataContext => vec![Kind::AllReduce, Kind::ReduceScatter, Kind::AllGather],
        Role::Tensor | Role::Context => vec![Kind::AllReduce, Kind::ReduceScatter, Kind::AllGather],
        Role::Pipeline => vec![Kind::SendRecv, Kind::SendRecvBatched],
        Role::Expert => vec![Kind::AllToAll],
        Role::World | Role::Custom(_) => vec![Kind::AllReduce],
        Role::CrossEngine => vec![],
    }
}

/// Adjacent pipeline stages `(i, i+1)`.
pub fn pipeline_pairs(n: usize) -> Vec<(usize, usize)> {
    (0..n.saturating_sub(1)).map(|i| (i, i + 1)).collect()
}

fn elems(bytes: usize, dtype: DType) -> usize {
    (bytes / dtype.size()).max(1)
}

/// Why a group is left out of every warmup plan, if it is: a group of one rank has nothing to
/// connect; a cross-engine group's other members are not part of this job's warmup, unless the
/// caller says they are (`allow_cross_engine`).
pub fn exclusion(comm: &Communicator, allow_cross_engine: bool) -> Option<&'static str> {
    if comm.size() < 2 {
        Some("a group of one rank has nothing to connect")
    } else if comm.spec().role == Role::CrossEngine && !allow_cross_engine {
        Some("cross-engine group: its other members are not part of this warmup")
    } else {
        None
    }
}

/// The plan of one group from its role (or the caller's kinds and pairs). `None` when the
/// group is excluded ([`exclusion`]).
pub fn plan_for(t: &Target<'_>, caps: &Capabilities, sizes: &Sizes) -> Option<GroupPlan> {
    if exclusion(t.comm, t.options.allow_cross_engine).is_some() {
        return None;
    }
    let spec = t.comm.spec();
    let n = t.comm.size();
    let kinds = t.options.kinds.clone().unwrap_or_else(|| role_kinds(&spec.role));
    let small = elems(sizes.small_bytes.unwrap_or(caps.warmup_small_bytes), sizes.dtype);
    let large = elems(sizes.large_bytes.unwrap_or(caps.warmup_large_bytes), sizes.dtype);
    let mut pairs = t.options.pairs.clone().unwrap_or_else(|| pipeline_pairs(n));
    pairs = pairs.into_iter().map(|(a, b)| (a.min(b), a.max(b))).filter(|(a, b)| a != b && *b < n).collect();
    pairs.sort();
    pairs.dedup();
    let mut steps = Vec::new();
    for k in kinds {
        if k == Kind::AllToAll && !caps.all_to_all {
            continue;
        }
        if k == Kind::SendRecvBatched && !caps.p2p_group {
            continue;
        }
        for count in [small, large] {
            let p = if matches!(k, Kind::SendRecv | Kind::SendRecvBatched) { pairs.clone() } else { Vec::new() };
            if p.is_empty() && matches!(k, Kind::SendRecv | Kind::SendRecvBatched) {
                continue;
            }
            // all_to_all sends count/n to each peer: round up to a multiple of n.
            let count = if k == Kind::AllToAll { count.div_ceil(n) * n } else { count };
            steps.push(Step { kind: k, dtype: sizes.dtype, count, pairs: p });
        }
    }
    Some(GroupPlan::of(spec, n, steps, false))
}

/// A plan replaying what a real step issued on this group (from
/// [`Communicator::take_recording`]). Members merge their recordings during agreement,
/// since each saw only its own peers.
pub fn plan_from_recording(
    comm: &Communicator,
    recording: &[OpSignature],
    allow_cross_engine: bool,
) -> Option<GroupPlan> {
    if exclusion(comm, allow_cross_engine).is_some() {
        return None;
    }
    let spec = comm.spec();
    let (n, me) = (comm.size(), comm.rank());
    let mut steps = Vec::new();
    for s in recording {
        let dtype = s.dtype.unwrap_or(DType::U8);
        let count = (s.bytes / dtype.size()).max(1);
        let kind = match s.op.as_str() {
            "all_reduce" | "barrier" | "reduce" => Kind::AllReduce,
            "reduce_scatter" => Kind::ReduceScatter,
            "all_gather" => Kind::AllGather,
            "broadcast" => Kind::Broadcast,
            "all_to_all" => Kind::AllToAll,
            "send" | "recv" => Kind::SendRecv,
            "p2p_group" => Kind::SendRecvBatched,
            _ => continue,
        };
        let (count, pairs) = match kind {
            // Recorded sizes are this rank's whole buffers: per-rank inputs are smaller.
            Kind::ReduceScatter => (count.div_ceil(n).max(1), vec![]),
            Kind::AllGather => (count.div_ceil(n).max(1), vec![]),
            Kind::AllToAll => (count.div_ceil(n) * n, vec![]),
            Kind::SendRecv | Kind::SendRecvBatched => match s.peer {
                Some(p) if p != me && p < n => (count, vec![(me.min(p), me.max(p))]),
                _ => continue,
            },
            _ => (count, vec![]),
        };
        steps.push(Step { kind, dtype, count, pairs });
    }
    steps.sort();
    steps.dedup();
    Some(GroupPlan::of(spec, n, steps, true))
}

impl GroupPlan {
    /// This plan, recorded on a group of the same name before a recovery in place, re-made
    /// for the group's rebuilt communicator `comm` (a new name per epoch, perhaps another
    /// size): point-to-point pairs outside the new size are dropped (a pipeline's are
    /// re-made for the new number of stages), all_to_all counts are made divisible by it,
    /// and the result is checked. `None` when the group is excluded from warmups (one
    /// member, cross-engine) or nothing of the plan can run on it.
    pub fn rebuilt_for(&self, comm: &Communicator) -> Option<GroupPlan> {
        if exclusion(comm, false).is_some() {
            return None;
        }
        let n = comm.size();
        let mut steps = Vec::new();
        for s in &self.steps {
            let mut s = s.clone();
            if s.kind == Kind::AllToAll {
                s.count = s.count.div_ceil(n).max(1) * n;
            }
            if !s.pairs.is_empty() {
                s.pairs = if n != self.size && comm.spec().role == Role::Pipeline {
                    pipeline_pairs(n)
                } else {
                    s.pairs.iter().copied().filter(|&(a, b)| a < n && b < n).collect()
                };
                if s.pairs.is_empty() {
                    continue;
                }
            }
            steps.push(s);
        }
        let plan = GroupPlan::of(comm.spec(), n, steps, false);
        (!plan.steps.is_empty() && plan.check().is_ok()).then_some(plan)
    }
}

/// Merge members' recorded plans: the union of their steps, point-to-point pairs of the
/// same (kind, dtype, count) joined.
pub fn merge(plans: &[GroupPlan]) -> Option<GroupPlan> {
    let first = plans.first()?.clone();
    let mut steps: Vec<Step> = plans.iter().flat_map(|p| p.steps.iter().cloned()).collect();
    steps.sort();
    let mut merged: Vec<Step> = Vec::new();
    for s in steps {
        match merged.last_mut() {
            Some(l) if l.kind == s.kind && l.dtype == s.dtype && l.count == s.count && !s.pairs.is_empty() => {
                l.pairs.extend(s.pairs);
                l.pairs.sort();
                l.pairs.dedup();
            }
            Some(l) if *l == s => {}
            _ => merged.push(s),
        }
    }
    Some(GroupPlan { steps: merged, merge: false, ..first })
}
