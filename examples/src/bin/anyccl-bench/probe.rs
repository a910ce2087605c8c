//! The host's own cross-CPU latency, for the header: two threads, each bound to one of the
//! host's first two CPUs, pass a cache line back and forth. On a shared virtual machine the
//! hypervisor at times places the two virtual CPUs far apart for minutes (on the 2-core AMD
//! EPYC machine: 51-68 ns a round trip, then 321-341 ns), and every row of a run then takes
//! longer (4 ranks, all_reduce 32 KiB: 24-36 us against 65-86 us, Open MPI alike); the line
//! tells such a run from the library's own slow run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Round trips timed, after [`WARM`] untimed ones (both threads bound and running).
const TRIPS: u64 = 50_000;
const WARM: u64 = 2_000;
/// The probe gives up past this (a CPU taken by something else).
const LIMIT: Duration = Duration::from_millis(200);

/// The first two CPUs the host has online (`/sys/devices/system/cpu/online`, e.g. `0-1`,
/// `0,2-7`).
fn first_two_cpus() -> Option<(usize, usize)> {
    first_two(&std::fs::read_to_string("/sys/devices/system/cpu/online").ok()?)
}

/// The first two CPUs of a CPU list (`0-1`, `0,2-7`).
fn first_two(text: &str) -> Option<(usize, usize)> {
    let mut cpus: Vec<usize> = Vec::new();
    for part in text.trim().split(',') {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
            None => {
                let c = part.parse::<usize>().ok()?;
                (c, c)
            }
        };
        cpus.extend((lo..=hi).take(2));
        if cpus.len() >= 2 {
            return Some((cpus[0], cpus[1]));
        }
    }
    None
}

/// Bind the calling thread to `cpu`.
fn bind(cpu: usize) -> bool {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu).is_ok() && nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).is_ok()
}

/// Wait until `line` holds `want`; `false` once `until` has passed.
fn await_value(line: &AtomicU64, want: u64, until: Instant) -> bool {
    let mut spins = 0u32;
    while line.load(Ordering::Acquire) != want {
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(4096) && Instant::now() >= until {
            return false;
        }
    }
    true
}

/// The header's line: "a cache line's round trip between CPUs 0 and 1: 55 ns", or why
/// there is none.
pub(crate) fn host_line() -> String {
    let Some((a, b)) = first_two_cpus() else { return "no second CPU online: no cross-CPU probe".into() };
    let line = AtomicU64::new(0);
    let until = Instant::now() + LIMIT;
    let took = std::thread::scope(|s| {
        let other = s.spawn(|| {
            if !bind(b) {
                line.store(u64::MAX, Ordering::Release);
                return;
            }
            for i in 0..WARM + TRIPS {
                if !await_value(&line, 2 * i + 1, until) {
                    return;
                }
                line.store(2 * i + 2, Ordering::Release);
            }
        });
        let mine = s.spawn(|| {
            if !bind(a) {
                return None;
            }
            let mut t = Instant::now();
            for i in 0..WARM + TRIPS {
                if i == WARM {
                    t = Instant::now();
                }
                if line.load(Ordering::Acquire) == u64::MAX {
                    return None;
                }
                line.store(2 * i + 1, Ordering::Release);
                if !await_value(&line, 2 * i + 2, until) {
                    return None;
                }
            }
            Some(t.elapsed())
        });
        let took = mine.join().ok().flatten();
        let _ = other.join();
        took
    });
    match took {
        Some(t) => format!(
            "a cache line's round trip between CPUs {a} and {b}: {:.0} ns (a host that puts them far apart makes it \
             several times longer, and every row with it)",
            t.as_nanos() as f64 / TRIPS as f64
        ),
        None => {
            format!("the cross-CPU probe between CPUs {a} and {b} could not run (binding refused, or over {LIMIT:?})")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::first_two;

    #[test]
    fn the_first_two_cpus_of_a_list() {
        assert_eq!(first_two("0-1\n"), Some((0, 1)));
        assert_eq!(first_two("0,2-7"), Some((0, 2)));
        assert_eq!(first_two("0-0,4"), Some((0, 4)));
        assert_eq!(first_two("3-9"), Some((3, 4)));
        assert_eq!(first_two("3"), None);
        assert_eq!(first_two("x-1"), None);
    }
}
