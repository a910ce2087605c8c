//! The host's last-level cache, read from sysfs, and the size thresholds it sets: up to what
//! size the algorithms keep whole buffers in cache, and whether the rings are written with
//! streaming stores.
//!
//! Measured on two kinds of 2-core host (2 ranks, busbw of alternating runs and whole
//! `bench/cpu_peers.sh` tables). AMD EPYC under KVM, a 32 MiB L3 per core complex: from
//! 8 MiB the input, the output and the rings leave the L3, so pieces and streaming stores win
//! from there (see [`crate::settings::STREAM_MIN`]); plain stores into a ring ran at about 25 or
//! about 4 GB/s from one moment to the next (where the host placed the two vCPUs), streaming
//! ones at 9-14 (see [`crate::settings::RING_STREAM_MIN`]). Intel Xeon with one 260 MiB L3 shared
//! by both vCPUs: whole buffers stay in the L3 to 32 MiB, and plain stores into the rings,
//! read from the shared L3, beat streaming ones: default -> 32 MiB steps and plain stores,
//! busbw against Open MPI's in the same table, all_reduce 8 and 16 MiB 0.79 and 0.72 -> 1.69
//! and 1.66, 32 MiB 1.51 -> 2.48, 128-256 KiB 0.82-0.87 -> 1.04-1.08; broadcast 64 KiB-1 MiB
//! 0.40-0.94 -> 0.74-1.32, 8-64 MiB 0.73-1.41 -> 1.28-2.17; all_to_all 4 MiB 0.68 -> 1.26;
//! sendrecv 32 and 64 MiB 0.94 and 0.93 -> 1.11 and 1.22.

use std::path::Path;

/// An L3 at least this large, shared by every CPU this process may run on, holds the rings:
/// they are written with plain stores.
pub(crate) const LARGE_L3: usize = 128 << 20;

/// What the host's last-level cache is, as seen by this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct L3 {
    /// Bytes of the smallest L3 among the CPUs this process may run on.
    pub bytes: usize,
    /// Whether one L3 serves every CPU this process may run on. Ranks of this host share it
    /// when each says so of the same L3 ([`L3::tag`]): a rank pinned to one core says so of
    /// its own core's L3 alone.
    pub shared: bool,
    /// Which L3 on this host: the lowest CPU it serves.
    pub id: usize,
}

impl L3 {
    /// This host's, from `/proc/self/status` and `/sys/devices/system/cpu` (read once), for
    /// the CPUs this process may run on that are online; `None` where the system does not
    /// say.
    pub(crate) fn this_host() -> Option<L3> {
        static ONCE: std::sync::OnceLock<Option<L3>> = std::sync::OnceLock::new();
        *ONCE.get_or_init(|| L3::read(Path::new("/sys/devices/system/cpu"), &allowed_cpus()?))
    }

    /// The L3 of the CPUs in the list `allowed` (`0-3,8`) that the sysfs tree at `root` lists
    /// as online (an affinity mask may name CPUs that are offline or absent, which have no
    /// cache directory; all of `allowed` where `online` is not there).
    fn read(root: &Path, allowed: &str) -> Option<L3> {
        let mut cpus = cpu_list(allowed)?;
        if let Some(online) = std::fs::read_to_string(root.join("online")).ok().and_then(|s| cpu_list(&s)) {
            cpus.retain(|c| online.contains(c));
        }
        let mut smallest: Option<usize> = None;
        let mut first_shares: Option<Vec<usize>> = None;
        for &cpu in &cpus {
            let (bytes, shares) = l3_of(&root.join(format!("cpu{cpu}/cache")))?;
            smallest = Some(smallest.map_or(bytes, |s| s.min(bytes)));
            first_shares.get_or_insert(shares);
        }
        let shares = first_shares?;
        let id = shares.iter().copied().min()?;
        Some(L3 { bytes: smallest?, shared: cpus.iter().all(|c| shares.contains(c)), id })
    }

    /// What a rank publishes of its L3 at connect: the L3's id when it serves all of the
    /// rank's CPUs, `-` otherwise. A host's ranks that publish the same id run under one L3
    /// ([`one_l3`]).
    pub(crate) fn tag(l3: Option<L3>) -> String {
        match l3 {
            Some(l) if l.shared => l.id.to_string(),
            _ => "-".into(),
        }
    }

    /// The whole-buffer step this L3 gives: an eighth of it (the input, the output, the rings
    /// and the other rank's share at once), to a power of two; 0 when it is not shared or not
    /// known. The stream and pair sizes are at least this ([`crate::settings::STREAM_MIN`] and
    /// [`crate::settings::PAIR_MIN`] otherwise): a 32 MiB L3 gives 4 MiB (they stay 8), a 260 MiB
    /// one 32 MiB.
    pub(crate) fn step(l3: Option<L3>) -> usize {
        match l3 {
            Some(l) if l.shared => prev_power_of_two(l.bytes / 8),
            _ => 0,
        }
    }

    /// Whether messages of at least `ANYCCL_CPU_RING_STREAM_MIN` go into the rings with
    /// streaming stores (no: one L3 of at least [`LARGE_L3`] holds them for the reader).
    pub(crate) fn ring_streaming(l3: Option<L3>) -> bool {
        !matches!(l3, Some(l) if l.shared && l.bytes >= LARGE_L3)
    }
}

impl std::fmt::Display for L3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = if self.shared { "shared by this process's CPUs" } else { "the smallest of several" };
        if self.bytes >= 1 << 20 {
            write!(f, "{} MiB L3, {how}", self.bytes >> 20)
        } else {
            write!(f, "{} KiB L3, {how}", self.bytes >> 10)
        }
    }
}

/// Per rank, whether the ranks of its host all run under one L3, from every rank's host and
/// [`L3::tag`] (the same answer on every rank: the group's thresholds depend on it). A rank
/// whose host is `-` (its own: TCP links only) is alone on it.
pub(crate) fn one_l3(hosts: &[String], tags: &[String]) -> Vec<bool> {
    let mut per_host: std::collections::HashMap<&str, Option<&str>> = std::collections::HashMap::new();
    for (h, t) in hosts.iter().zip(tags) {
        let seen = per_host.entry(h.as_str()).or_insert(Some(t.as_str()));
        if *seen != Some(t.as_str()) {
            *seen = None;
        }
    }
    hosts
        .iter()
        .zip(tags)
        .map(|(h, t)| t != "-" && (h == "-" || per_host.get(h.as_str()).is_some_and(|s| s.is_some())))
        .collect()
}

fn prev_power_of_two(v: usize) -> usize {
    if v == 0 {
        0
    } else {
        1 << (usize::BITS - 1 - v.leading_zeros())
    }
}

/// The L3 (bytes, CPUs sharing it) in a CPU's `cache` directory.
fn l3_of(dir: &Path) -> Option<(usize, Vec<usize>)> {
    for i in 0..16 {
        let idx = dir.join(format!("index{i}"));
        let Ok(level) = std::fs::read_to_string(idx.join("level")) else { continue };
        if level.trim() != "3" {
            continue;
        }
        let size = std::fs::read_to_string(idx.join("size")).ok()?;
        let shares = cpu_list(&std::fs::read_to_string(idx.join("shared_cpu_list")).ok()?)?;
        return Some((size_bytes(&size)?, shares));
    }
    None
}

/// A cache size as sysfs writes it (`266240K`, `32M`, `1024`).
fn size_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mult) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1 << 10),
        b'M' => (&s[..s.len() - 1], 1 << 20),
        b'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mult)
}

/// The CPUs this process may run on, as a list such as `0-3,8` (`/proc/self/status`), or
/// `None` where the system does not say.
pub(crate) fn allowed_cpus() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?.trim();
    cpu_list(list).is_some().then(|| list.to_string())
}

/// The CPUs a quota (a cgroup's `cpu.max`, as `available_parallelism` reads it) leaves this
/// process where that is fewer than its CPU list (`allowed`, [`allowed_cpus`]) names; `None`
/// where no quota binds.
pub(crate) fn quota(allowed: &str) -> Option<usize> {
    let listed = cpu_list(allowed)?.len();
    let available = std::thread::available_parallelism().ok()?.get();
    (available < listed).then_some(available)
}

/// Whether the ranks of a host, whose CPU lists are `lists` (as [`allowed_cpus`] gives them,
/// `-` where unknown), outnumber the CPUs they may run on together, or the CPUs a quota leaves
/// this rank (`quota`: [`quota`]; ranks in one container share it). Each rank bound to a CPU
/// of its own (`anyccl-run`'s default) sees one CPU, so its own count says nothing of the
/// others'; where a list is unknown, this rank's count of CPUs stands for the host's.
pub(crate) fn crowded<'a>(lists: impl Iterator<Item = &'a str>, quota: Option<usize>) -> bool {
    let mut ranks = 0;
    let mut all = std::collections::BTreeSet::new();
    let mut known = true;
    for l in lists {
        ranks += 1;
        match cpu_list(l) {
            Some(c) => all.extend(c),
            None => known = false,
        }
    }
    let cpus = if known { all.len() } else { std::thread::available_parallelism().map_or(1, |c| c.get()) };
    ranks > cpus || quota.is_some_and(|q| ranks > q)
}

/// Whether the ranks of any host (`hosts[r]`, `-` where unknown: such a rank is a host of its
/// own) outnumber the CPUs their lists (`lists[r]`) name together, from what every rank
/// published alone (no quota, no list left unknown counted), so that every rank of a group
/// answers the same and may choose an algorithm by it.
pub(crate) fn any_host_crowded(hosts: &[String], lists: &[String]) -> bool {
    let mut per_host: std::collections::HashMap<&str, Vec<&str>> = std::collections::HashMap::new();
    for (h, l) in hosts.iter().zip(lists).filter(|(h, _)| h.as_str() != "-") {
        per_host.entry(h.as_str()).or_default().push(l.as_str());
    }
    per_host.values().any(|ls| ls.iter().all(|l| cpu_list(l).is_some()) && crowded(ls.iter().copied(), None))
}

/// The CPUs in a list such as `0-3,8,10-11` (at most 1 << 16 of them).
fn cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse::<usize>().ok()?, b.trim().parse::<usize>().ok()?),
            None => {
                let a = part.trim().parse::<usize>().ok()?;
                (a, a)
            }
        };
        if b < a || b - a >= 1 << 16 || out.len() + (b - a) >= 1 << 16 {
            return None;
        }
        out.extend(a..=b);
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::{any_host_crowded, cpu_list, crowded, one_l3, size_bytes, L3};
    use std::path::Path;

    /// A sysfs tree at `root` whose CPUs have the L3s `(cpus sharing it, size)`, behind an L1
    /// and an L2 in lower indices.
    fn tree(root: &Path, l3s: &[(&str, &str)]) {
        for (list, size) in l3s {
            for cpu in cpu_list(list).unwrap() {
                for (i, (level, size, shares)) in
                    [("1", "48K", cpu.to_string()), ("2", "2048K", cpu.to_string()), ("3", *size, list.to_string())]
                        .iter()
                        .enumerate()
                {
                    let d = root.join(format!("cpu{cpu}/cache/index{i}"));
                    std::fs::create_dir_all(&d).unwrap();
                    std::fs::write(d.join("level"), format!("{level}\n")).unwrap();
                    std::fs::write(d.join("size"), format!("{size}\n")).unwrap();
                    std::fs::write(d.join("shared_cpu_list"), format!("{shares}\n")).unwrap();
                }
            }
        }
    }

    /// The two kinds of host measured, and the cases in between: one L3 shared by every
    /// allowed CPU sets the step and, when large, plain ring stores; CPUs on several L3s, an
    /// unknown L3 or a malformed file give no step and streaming stores.
    #[test]
    fn thresholds_follow_the_l3() {
        let root = std::env::temp_dir().join(format!("anyccl-l3-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let intel = root.join("intel");
        tree(&intel, &[("0-1", "266240K")]);
        let amd = root.join("amd");
        tree(&amd, &[("0-7", "32768K"), ("8-15", "32768K")]);
        let big = root.join("big");
        tree(&big, &[("0-3", "256M"), ("4-7", "96M")]);

        let l = L3::read(&intel, "0-1");
        assert_eq!(l, Some(L3 { bytes: 260 << 20, shared: true, id: 0 }));
        assert_eq!((L3::step(l), L3::ring_streaming(l)), (32 << 20, false));
        assert_eq!(L3::tag(l), "0");
        assert_eq!(
            format!("{}", L3 { bytes: 512 << 10, shared: true, id: 0 }),
            "512 KiB L3, shared by this process's CPUs"
        );

        let l = L3::read(&amd, "0-1");
        assert_eq!(l, Some(L3 { bytes: 32 << 20, shared: true, id: 0 }));
        assert_eq!((L3::step(l), L3::ring_streaming(l)), (4 << 20, true));
        let l = L3::read(&amd, "6-9");
        assert_eq!(l, Some(L3 { bytes: 32 << 20, shared: false, id: 0 }));
        assert_eq!((L3::step(l), L3::ring_streaming(l)), (0, true));
        assert_eq!(L3::tag(l), "-");
        // A discontiguous list under one L3, and one across both.
        assert_eq!(L3::read(&amd, "8-9,12-15").map(|l| (l.shared, l.id)), Some((true, 8)));
        assert_eq!(L3::read(&amd, "0-3,8-11").map(|l| l.shared), Some(false));

        // Across two L3s of 256 and 96 MiB: not shared, the defaults.
        let l = L3::read(&big, "2-5");
        assert_eq!(l, Some(L3 { bytes: 96 << 20, shared: false, id: 0 }));
        assert_eq!((L3::step(l), L3::ring_streaming(l)), (0, true));
        let l = L3::read(&big, "4,5-7");
        assert_eq!((L3::step(l), L3::ring_streaming(l)), (8 << 20, true));
        assert_eq!(L3::step(L3::read(&big, "0-3")), 32 << 20);

        // Unknown: a CPU without a cache directory, a malformed list or size.
        assert_eq!(L3::read(&intel, "0-2"), None);
        assert_eq!(L3::read(&intel, "1-0"), None);
        assert_eq!(L3::read(&intel, ""), None);
        assert_eq!(L3::read(&intel, "0-99999999"), None);
        // An affinity mask naming CPUs that are offline: those are left out.
        std::fs::write(intel.join("online"), "0-1\n").unwrap();
        assert_eq!(L3::read(&intel, "0-7").map(|l| l.shared), Some(true));
        assert_eq!(L3::read(&intel, "5-7"), None);
        std::fs::write(intel.join("cpu1/cache/index1/size"), "lots\n").unwrap();
        assert!(L3::read(&intel, "0-1").is_some(), "an L2's size is not read");
        std::fs::write(intel.join("cpu1/cache/index2/size"), "lots\n").unwrap();
        assert_eq!(L3::read(&intel, "0-1"), None);
        assert_eq!((L3::step(None), L3::ring_streaming(None)), (0, true));

        assert_eq!(size_bytes("1024\n"), Some(1024));
        assert_eq!(size_bytes("2G"), Some(2 << 30));
        assert_eq!(size_bytes("K"), None);
        assert_eq!(size_bytes("99999999999999999999G"), None);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_group_is_crowded_where_any_host_is() {
        let v = |x: &[&str]| x.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(!any_host_crowded(&v(&["a", "a"]), &v(&["0", "1"])));
        assert!(any_host_crowded(&v(&["a", "a", "b"]), &v(&["0", "0", "0-7"])), "host a: 2 ranks on CPU 0");
        assert!(!any_host_crowded(&v(&["a", "b"]), &v(&["0", "0"])), "one rank a host");
        assert!(!any_host_crowded(&v(&["a", "a"]), &v(&["0", "-"])), "a list unknown: not counted");
        assert!(!any_host_crowded(&v(&["-", "-"]), &v(&["0", "0"])), "hosts unknown: each its own");
    }

    #[test]
    fn a_host_is_crowded_when_its_ranks_outnumber_their_cpus_together() {
        // Bound one a CPU, each rank sees one: not crowded.
        assert!(!crowded(["0", "1"].into_iter(), None));
        assert!(!crowded(["0-1", "0-1"].into_iter(), None));
        assert!(crowded(["0-1", "0-1", "0-1"].into_iter(), None));
        assert!(crowded(["0", "0"].into_iter(), None));
        assert!(!crowded(["0-3", "4-7", "8,9"].into_iter(), None));
        // Unknown lists: this process's count stands in (at least 1 CPU, so 1 rank fits).
        assert!(!crowded(["-"].into_iter(), None));
        // A quota of 2 CPUs over 64 listed: 4 ranks crowd it, 2 do not.
        assert!(crowded(["0-63"; 4].into_iter(), Some(2)));
        assert!(!crowded(["0-31", "32-63"].into_iter(), Some(2)));
    }

    /// A host's ranks share one L3 only when all name the same one: two ranks pinned to
    /// cores under different L3s (each sees its own as shared) do not; a rank alone on a
    /// TCP-only host (`-`) stands for itself.
    #[test]
    fn one_l3_needs_every_rank_of_the_host() {
        let v = |x: &[&str]| x.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(one_l3(&v(&["a", "a", "b", "b"]), &v(&["0", "0", "0", "8"])), [true, true, false, false]);
        assert_eq!(one_l3(&v(&["a", "a", "a"]), &v(&["0", "0", "-"])), [false, false, false]);
        assert_eq!(one_l3(&v(&["-", "-"]), &v(&["0", "8"])), [true, true]);
        assert_eq!(one_l3(&v(&["-", "a"]), &v(&["-", "4"])), [false, true]);
    }
}
