//! Where each rank may run: the CPUs the launcher may use, split among the ranks in
//! contiguous shares (as `mpirun` binds its ranks by default) where the ranks do not
//! outnumber them, else dealt out one CPU a rank in turn.
//!
//! Left to the kernel, two busy ranks of a host sometimes share one CPU for a long time
//! (seconds) while another CPU idles: every exchange between them then waits for the other's
//! turn on that CPU. On a 2-core machine, 2 ranks pinned together (`taskset -c 0`) took 4.1-4.5
//! us an all_reduce of 8 B-4 KiB against 0.26-0.9 apart, and unpinned runs of `cpu_peers.sh`
//! showed rows of exactly that 4.0-4.5 us in a fifth of the runs, for several sizes in a row,
//! where Open MPI's bound ranks never did.
//!
//! Where the ranks outnumber the CPUs, the kernel's placement moves too: 4 ranks on 2 cores
//! left to it ran a barrier in 1.96-2.2 us in some runs and 3.0-3.25 in others (8 runs), 64 B
//! all_gather and all_to_all in 3.3-3.4 us in 5 runs of 6, sendrecv in 1.75 in 2 of 3; bound
//! one CPU a rank in turn (rank r on CPU r mod 2), every run of those took 1.88-2.13, 2.01-2.17
//! and 1.03-1.08 (Open MPI beside them: 1.83-2.61, 2.14-3.26, 1.01-1.18). In turn rather than
//! in blocks (ranks 0 and 1 on CPU 0): ring neighbours then run at once (sendrecv 1.43-1.48 us
//! in blocks).
//!
//! A rank's process is started with its share as its affinity (the launcher's starting
//! thread takes the share for the spawn and its own mask back after), so the process and
//! every thread it makes inherit it from the first instruction.

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;

/// Whether ranks are bound (`--bind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Bind {
    /// Each rank to its share of the launcher's CPUs; where the ranks outnumber them, one
    /// CPU a rank in turn.
    Cpus,
    /// Every rank may run on every CPU the launcher may.
    None,
}

/// Each rank's share of the launcher's CPUs.
pub struct Binding {
    shares: Vec<CpuSet>,
}

/// The CPUs in `set`.
fn cpus(set: &CpuSet) -> Vec<usize> {
    (0..CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect()
}

/// `0-3,6` for CPUs 0, 1, 2, 3, 6.
fn ranges(cpus: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if i == j { cpus[i].to_string() } else { format!("{}-{}", cpus[i], cpus[j]) });
        i = j + 1;
    }
    out.join(",")
}

/// The shares of `cpus` for `ranks` ranks: contiguous, as even as they can be (the first ones
/// one CPU larger where they do not divide); where the ranks outnumber the CPUs, rank `r`'s
/// is CPU `r mod count`. `None` for no ranks or no CPUs.
pub fn split(cpus: &[usize], ranks: usize) -> Option<Vec<Vec<usize>>> {
    if ranks == 0 || cpus.is_empty() {
        return None;
    }
    if cpus.len() < ranks {
        return Some((0..ranks).map(|r| vec![cpus[r % cpus.len()]]).collect());
    }
    let (per, extra) = (cpus.len() / ranks, cpus.len() % ranks);
    let mut at = 0;
    let shares = (0..ranks)
        .map(|r| {
            let n = per + usize::from(r < extra);
            let s = cpus[at..at + n].to_vec();
            at += n;
            s
        })
        .collect();
    Some(shares)
}

impl Binding {
    /// The shares for `ranks` ranks, or why there are none: the launcher's own affinity
    /// cannot be read (each rank then runs where the kernel puts it).
    pub fn new(ranks: usize) -> Result<Binding, String> {
        let own = sched_getaffinity(Pid::from_raw(0)).map_err(|e| format!("cannot read this process's CPUs: {e}"))?;
        let all = cpus(&own);
        let Some(shares) = split(&all, ranks) else {
            return Err(format!("{ranks} ranks on {} CPUs: each runs where the kernel puts it", all.len()));
        };
        let mut sets = Vec::with_capacity(ranks);
        for share in &shares {
            let mut set = CpuSet::new();
            for &c in share {
                set.set(c).map_err(|e| format!("CPU {c}: {e}"))?;
            }
            sets.push(set);
        }
        Ok(Binding { shares: sets })
    }

    /// Run `spawn` (which starts rank `rank`'s process) with this thread on the rank's share,
    /// so that the process inherits it, then give the thread its own CPUs back. Where the
    /// share cannot be taken, the rank starts unbound (the reason is returned with the
    /// result).
    pub fn spawning<T>(&self, rank: usize, spawn: impl FnOnce() -> T) -> (T, Option<String>) {
        let Some(share) = self.shares.get(rank) else { return (spawn(), None) };
        let me = Pid::from_raw(0);
        let own = match sched_getaffinity(me) {
            Ok(s) => s,
            Err(e) => return (spawn(), Some(format!("cannot read the launcher's CPUs: {e}"))),
        };
        if let Err(e) = sched_setaffinity(me, share) {
            return (spawn(), Some(format!("cannot bind to CPUs {}: {e}", ranges(&cpus(share)))));
        }
        let r = spawn();
        let back = sched_setaffinity(me, &own).err().map(|e| format!("cannot take the launcher's CPUs back: {e}"));
        (r, back)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_are_contiguous_and_cover_every_cpu() {
        assert_eq!(split(&[0, 1], 2), Some(vec![vec![0], vec![1]]));
        assert_eq!(split(&[0, 1, 2, 3, 4], 2), Some(vec![vec![0, 1, 2], vec![3, 4]]));
        assert_eq!(split(&[2, 3, 8, 9], 4), Some(vec![vec![2], vec![3], vec![8], vec![9]]));
        assert_eq!(split(&[0, 1], 3), Some(vec![vec![0], vec![1], vec![0]]), "more ranks than CPUs: in turn");
        assert_eq!(split(&[2, 5], 4), Some(vec![vec![2], vec![5], vec![2], vec![5]]));
        assert_eq!(split(&[0], 0), None);
        assert_eq!(split(&[], 2), None);
        assert_eq!(ranges(&[0, 1, 2, 3, 6]), "0-3,6");
        assert_eq!(ranges(&[5]), "5");
    }
}
