//! What the members agree on: a [`View`] of who is in at an epoch, or the error every
//! member gets.

use serde::{Deserialize, Serialize};

/// One process of the job: its rank (fixed for the job's life) and its incarnation (which
/// process of that rank: 1 for the first, 2 for its first replacement, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Member {
    /// The rank in the job.
    pub rank: usize,
    /// Which process of the rank.
    pub incarnation: u64,
}

/// Who is in the job at an epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct View {
    /// The epoch: 0 at start, one more at each agreement.
    pub epoch: u64,
    /// The members, by rank.
    pub members: Vec<Member>,
    /// Ranks of the previous epoch that are not in this one.
    pub left: Vec<usize>,
    /// Ranks in this epoch with a process that was not in the previous one (a replacement
    /// with a new incarnation, or a rank coming back).
    pub joined: Vec<usize>,
    /// Why the epoch began (the first reason given).
    pub reason: String,
}

impl View {
    /// The members' ranks, in order.
    pub fn ranks(&self) -> Vec<usize> {
        self.members.iter().map(|m| m.rank).collect()
    }
    /// The member with rank `rank`, when it is one.
    pub fn member(&self, rank: usize) -> Option<Member> {
        self.members.iter().copied().find(|m| m.rank == rank)
    }
    /// Whether `m` (this very process of its rank) is a member.
    pub fn contains(&self, m: Member) -> bool {
        self.member(m.rank) == Some(m)
    }
}

/// A proposed next epoch, as a member hears of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proposal {
    /// The epoch proposed.
    pub epoch: u64,
    /// Why (the first reason given).
    pub reason: String,
    /// A process failed (a member's [`crate::Membership::fail`], a launcher's
    /// [`crate::Membership::report_gone`], a liveness record gone stale): a member should
    /// abort its communicators now, as a peer of some of them is gone. `false`: the epoch
    /// only admits a joiner, and a member may finish its step before it agrees.
    pub failure: bool,
}

/// What the leader of an epoch publishes: the same for every member.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(into = "Stored", from = "Stored")]
pub(crate) enum Decision {
    /// The new view.
    View(View),
    /// The agreement failed: every member returns this error.
    Failed(String),
}

/// A decision as the store holds it: a view's members as one incarnation per rank (0: not a
/// member; incarnations start at 1), about two bytes a rank where a list of members would
/// take thirty. Every member reads the decision, so its size is paid N times: at 4,096
/// members that is 32 MiB through the store instead of 500.
#[derive(Serialize, Deserialize)]
enum Stored {
    View { epoch: u64, incarnations: Vec<u64>, left: Vec<usize>, joined: Vec<usize>, reason: String },
    Failed(String),
}

impl From<Decision> for Stored {
    fn from(d: Decision) -> Stored {
        match d {
            Decision::View(v) => {
                let mut incarnations = vec![0; v.members.iter().map(|m| m.rank + 1).max().unwrap_or(0)];
                for m in &v.members {
                    incarnations[m.rank] = m.incarnation;
                }
                Stored::View { epoch: v.epoch, incarnations, left: v.left, joined: v.joined, reason: v.reason }
            }
            Decision::Failed(msg) => Stored::Failed(msg),
        }
    }
}

impl From<Stored> for Decision {
    fn from(s: Stored) -> Decision {
        match s {
            Stored::View { epoch, incarnations, left, joined, reason } => {
                let members = incarnations
                    .iter()
                    .enumerate()
                    .filter(|(_, &i)| i > 0)
                    .map(|(rank, &incarnation)| Member { rank, incarnation })
                    .collect();
                Decision::View(View { epoch, members, left, joined, reason })
            }
            Stored::Failed(msg) => Decision::Failed(msg),
        }
    }
}
