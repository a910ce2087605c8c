//! Group specifications: every communicator knows its name, members, owner and role.
//!
//! Nothing in anyccl sweeps "all groups": callers name the groups they mean, or filter a
//! [`GroupRegistry`] by owner and role.

use crate::error::{Ctx, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::{Arc, Mutex};

/// What a group is used for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Role {
    /// Every rank of the job.
    World,
    /// Data-parallel replicas (gradient all_reduce, or reduce_scatter/all_gather when sharded).
    Data,
    /// Tensor-parallel shards.
    Tensor,
    /// Pipeline stages (point-to-point between neighbours).
    Pipeline,
    /// Context (sequence) parallel.
    Context,
    /// Expert parallel (token dispatch by all_to_all).
    Expert,
    /// Data-parallel combined with context-parallel (sharded optimizer).
    DataContext,
    /// Anything else; the string says what.
    Custom(String),
    /// Includes processes outside this job (e.g. weight sync with inference workers).
    /// Never touched by anything that is not coordinated with those processes.
    CrossEngine,
}

impl Role {
    /// Short name.
    pub fn name(&self) -> &str {
        match self {
            Role::World => "world",
            Role::Data => "data",
            Role::Tensor => "tensor",
            Role::Pipeline => "pipeline",
            Role::Context => "context",
            Role::Expert => "expert",
            Role::DataContext => "data+context",
            Role::Custom(s) => s,
            Role::CrossEngine => "cross-engine",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A group: name, members (ranks in the parent communicator, in group-rank order), owner and role.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GroupSpec {
    /// Name, unique within the job (e.g. `dp-0`).
    pub name: String,
    /// Members, as ranks of the parent communicator, in the order of their group ranks.
    pub ranks: Vec<usize>,
    /// Which engine or job created it.
    pub owner: String,
    /// What it is for.
    pub role: Role,
}

impl GroupSpec {
    /// A spec.
    pub fn new(name: impl Into<String>, ranks: Vec<usize>, owner: impl Into<String>, role: Role) -> Self {
        GroupSpec { name: name.into(), ranks, owner: owner.into(), role }
    }

    /// What tells groups apart: the name and the members (two groups may share a name, e.g.
    /// a "tp" group in every replica). Equal on every member, in every process.
    pub fn id(&self) -> u64 {
        stable_hash(self.name.bytes().chain(self.ranks.iter().flat_map(|r| (*r as u64).to_le_bytes())))
    }

    /// The world group of `size` ranks.
    pub fn world(size: usize, owner: impl Into<String>) -> Self {
        GroupSpec::new("world", (0..size).collect(), owner, Role::World)
    }

    /// Group rank of parent rank `r`, if a member.
    pub fn group_rank(&self, r: usize) -> Option<usize> {
        self.ranks.iter().position(|&x| x == r)
    }
}

/// Groups a process created, with their owners and roles.
///
/// A registry records; it never chooses. Callers filter it by owner and role.
#[derive(Debug, Default, Clone)]
pub struct GroupRegistry {
    inner: Arc<Mutex<Vec<GroupSpec>>>,
}

impl GroupRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }
    /// Record a group.
    pub fn register(&self, spec: GroupSpec) {
        if let Ok(mut v) = self.inner.lock() {
            if !v.contains(&spec) {
                v.push(spec);
            }
        }
    }
    /// Every recorded group.
    pub fn all(&self) -> Vec<GroupSpec> {
        self.inner.lock().map(|v| v.clone()).unwrap_or_default()
    }
    /// Groups of `owner` whose role is one of `roles`.
    pub fn filter(&self, owner: &str, roles: &[Role]) -> Vec<GroupSpec> {
        self.all().into_iter().filter(|g| g.owner == owner && roles.contains(&g.role)).collect()
    }
}

/// Check a spec. Splitting a parent of `parent_size` ranks, `me` is this rank in the parent
/// and must be a member; connecting (`None`), `me` is this rank's position in the spec.
pub(crate) fn validate_spec(spec: &GroupSpec, me: usize, parent_size: Option<usize>) -> Result<()> {
    let ctx = Ctx::new("anyccl", me, spec.name.clone());
    let bad = |msg: String| ctx.invalid("group", "spec", msg);
    if spec.name.is_empty() {
        return Err(bad("the group has no name".into()));
    }
    if spec.ranks.is_empty() {
        return Err(bad("the group has no ranks".into()));
    }
    let mut seen = std::collections::HashSet::new();
    for &r in &spec.ranks {
        if let Some(size) = parent_size.filter(|&n| r >= n) {
            return Err(bad(format!("rank {r} is out of range for a parent of {size} ranks")));
        }
        if !seen.insert(r) {
            return Err(bad(format!("rank {r} is listed twice")));
        }
    }
    match parent_size {
        Some(_) if !spec.ranks.contains(&me) => {
            Err(bad(format!("this rank ({me}) is not a member of {:?}", spec.ranks)))?;
        }
        None if me >= spec.ranks.len() => {
            Err(bad(format!("rank {me} is out of range for a group of {} ranks", spec.ranks.len())))?;
        }
        _ => {}
    }
    Ok(())
}

/// A color that only members passing an identical spec share.
pub(crate) fn spec_color(s: &GroupSpec) -> u32 {
    (s.id() as u32) & 0x7fff_ffff
}

/// FNV-1a of `bytes`: the same in every process, build and platform (unlike `std`'s
/// hashers), for values that ranks derive independently and must agree on.
pub fn stable_hash(bytes: impl IntoIterator<Item = u8>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_tells_same_named_groups_apart_and_is_stable() {
        let a = GroupSpec::new("tp", vec![0, 1], "trainer", Role::Tensor);
        let b = GroupSpec::new("tp", vec![2, 3], "trainer", Role::Tensor);
        assert_ne!(a.id(), b.id());
        assert_eq!(a.id(), GroupSpec::new("tp", vec![0, 1], "someone else", Role::Data).id());
        // FNV-1a of "tp" then 0u64 and 1u64 little-endian: fixed across processes and builds.
        assert_eq!(a.id(), 0xe11c0ae6fa987ca8);
    }
}
