//! Waiting on a peer of this host: spin briefly (less when the host's ranks outnumber its
//! cores), then yield, then sleep on a futex word in the shared segment, hearing the
//! caller's `check` between looks.

pub(crate) use crate::settings::Patience;
use anyccl_core::Error;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// What a waiting loop hears from its caller between waits.
pub(crate) type Check<'a> = &'a mut dyn FnMut() -> Result<(), Error>;

/// The CPU this thread runs on, plus one (0: unknown).
pub(super) fn this_cpu() -> u32 {
    // SAFETY: `sched_getcpu` takes no arguments; it returns the CPU or -1.
    let cpu = unsafe { libc::sched_getcpu() };
    u32::try_from(cpu).map_or(0, |c| c.saturating_add(1))
}

/// Record in `word` that this side runs on this thread's CPU, where that changed (the word
/// is read by the other side only while it waits; an unchanged one is not written, so its
/// line stays shared).
pub(super) fn publish_cpu(word: &AtomicU32) {
    let me = this_cpu();
    if word.load(Ordering::Relaxed) != me {
        word.store(me, Ordering::Relaxed);
    }
}

/// Whether none of the sides whose CPUs `awaited` holds last ran on this thread's CPU (or
/// this thread's CPU is unknown).
fn elsewhere(awaited: &[&AtomicU32]) -> bool {
    let me = this_cpu();
    me == 0 || awaited.iter().all(|c| c.load(Ordering::Relaxed) != me)
}

/// Spin, then yield, until `ready()` holds (`Ok(true)`) or the patience is spent
/// (`Ok(false)`: time to sleep); `check` runs every few rounds. `awaited`: the CPUs ([`this_cpu`])
/// the sides this wait is for last ran on. Where one is this thread's, the spin gives way to
/// yielding: that side cannot progress while this thread holds the CPU. With two ranks on
/// one CPU (`taskset -c 0`, a 5 us spin otherwise), all_gather 8 B-4 KiB took 4.2-6.1 us a
/// call instead of 9.3-13.2.
pub(super) fn spin_then_yield(
    patience: Patience,
    ready: &mut impl FnMut() -> bool,
    awaited: &[&AtomicU32],
    check: Check<'_>,
) -> Result<bool, Error> {
    if ready() {
        return Ok(true);
    }
    // The clock is read from the end of the first round on: a message that arrives within
    // it (the usual case between ranks in step) costs no clock read.
    let mut start: Option<Instant> = None;
    let mut i = 0u32;
    let mut spinning = true;
    loop {
        for _ in 0..patience.round {
            std::hint::spin_loop();
            if ready() {
                return Ok(true);
            }
        }
        i += 1;
        if i.is_multiple_of(16) {
            check()?;
        }
        // Where an awaited side is on this CPU, yield instead of spinning for the rest of the
        // spin (the total before sleeping stays the same).
        spinning = spinning && elsewhere(awaited);
        let spent = start.get_or_insert_with(Instant::now).elapsed();
        if spinning && spent < patience.spin {
            continue;
        }
        if spent < patience.spin + patience.yield_for {
            std::thread::yield_now();
            continue;
        }
        return Ok(false);
    }
}

/// Sleep on `bell` (with `sleeping` raised, so that the other side rings it) until `ready()`
/// holds, at most `nap` at a time; `check` runs before the first sleep and after each nap.
///
/// The other side publishes its progress and then reads `sleeping` with no fence between
/// (see [`published`]): a locked instruction there would wait for the published line to
/// reach this CPU on every message. So the order between its store and its load is made
/// here, once a sleep, by [`heavy_barrier`] after raising the flag: past it, either the
/// other side's next look at the flag sees it raised and rings, or its progress is visible
/// to `ready()`. Where the barrier is not available (an old kernel, or a peer process that
/// could not register for it), a ring that was missed costs at most one `nap`.
pub(super) fn sleep_until(
    bell: &AtomicU32,
    sleeping: &AtomicU32,
    nap: Duration,
    ready: &mut impl FnMut() -> bool,
    check: Check<'_>,
) -> Result<(), Error> {
    check()?;
    sleeping.store(1, Ordering::SeqCst);
    heavy_barrier();
    // Raised until the wait ends: every message meanwhile rings (one barrier a wait, not
    // one a nap).
    let r = loop {
        let seen = bell.load(Ordering::SeqCst);
        if ready() {
            break Ok(());
        }
        futex_wait(bell, seen, nap);
        if ready() {
            break Ok(());
        }
        if let Err(e) = check() {
            break Err(e);
        }
    };
    sleeping.store(0, Ordering::SeqCst);
    r
}

/// After a side published its progress (a release store): whether the other side sleeps,
/// read without a fence (see [`sleep_until`]). The compiler keeps the two in order; the
/// CPU may not, which the sleeper's [`heavy_barrier`] covers.
pub(super) fn published(sleeping: &AtomicU32) -> bool {
    std::sync::atomic::compiler_fence(Ordering::SeqCst);
    sleeping.load(Ordering::Relaxed) != 0
}

/// `membarrier(2)` commands: a barrier on every CPU that runs a thread of a process that
/// registered for it, and that registration.
const MEMBARRIER_CMD_GLOBAL_EXPEDITED: libc::c_long = 1 << 1;
const MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED: libc::c_long = 1 << 2;

/// Whether this process registered for the peers' barriers (once, at its first ring).
static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Register this process, once, so that a peer's [`heavy_barrier`] reaches its threads (the
/// writers and readers whose loads of a sleeping flag follow their stores unfenced).
pub(super) fn register_barrier() -> bool {
    *REGISTERED.get_or_init(|| {
        // SAFETY: `membarrier` takes a command and flags, no memory.
        let r = unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED, 0) };
        r == 0
    })
}

/// A full barrier on this CPU and on every CPU that runs a thread of a registered process
/// (`membarrier`), where this process could register; else this CPU's alone.
fn heavy_barrier() {
    std::sync::atomic::fence(Ordering::SeqCst);
    if register_barrier() {
        // SAFETY: as above.
        unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_GLOBAL_EXPEDITED, 0) };
    }
}

/// Wait until `ready()` holds, spinning (while the side that `awaited` tells of runs
/// elsewhere, see [`spin_then_yield`]), then yielding, then sleeping on `bell` with `sleeping`
/// raised; `check` runs between sleeps and every few yields.
pub(super) fn wait_until(
    patience: Patience,
    (bell, sleeping, awaited): (&AtomicU32, &AtomicU32, &AtomicU32),
    mut ready: impl FnMut() -> bool,
    check: Check<'_>,
) -> Result<(), Error> {
    if spin_then_yield(patience, &mut ready, &[awaited], check)? {
        return Ok(());
    }
    sleep_until(bell, sleeping, Duration::from_millis(2), &mut ready, check)
}

pub(super) fn futex_wait(word: &AtomicU32, expect: u32, timeout: Duration) {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as _ };
    // SAFETY: `word` is a valid, aligned u32 in a shared mapping (not a private futex, so
    // waiters and wakers of other processes meet); the timeout is a valid timespec.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expect, &ts as *const libc::timespec);
    }
}

pub(super) fn futex_wake(word: &AtomicU32) {
    word.fetch_add(1, Ordering::SeqCst);
    // SAFETY: `word` is a valid, aligned u32 in a shared mapping.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    /// A side that last ran on this thread's CPU is not elsewhere (a wait for it yields
    /// rather than spins); one on another CPU, or on none known yet, is.
    #[test]
    fn a_side_on_this_cpu_is_not_elsewhere() {
        assert!(this_cpu() > 0, "sched_getcpu failed here");
        // The thread may move to another CPU between the two reads: a few tries.
        assert!((0..5).any(|_| !elsewhere(&[&AtomicU32::new(this_cpu())])), "a side on this CPU counted as elsewhere");
        assert!(elsewhere(&[&AtomicU32::new(u32::MAX), &AtomicU32::new(0)]));
        assert!(elsewhere(&[]));
    }

    /// A sleeper is woken by the other side's publish, not by the end of its nap: the nap is
    /// ten seconds, and each of 200 publishes, made at a different moment of the sleeper's
    /// way into its sleep (just before, during and after it raised its flag), must end the
    /// wait within two. A flag lowered between naps, or a publish that rang no bell, fails.
    #[test]
    fn a_publish_wakes_a_sleeper() {
        // With or without the barrier (a kernel or seccomp profile may refuse it): the ring
        // itself must wake the sleeper; only the rare race the barrier closes is untested.
        register_barrier();
        for round in 0..200u64 {
            let (bell, sleeping, data) =
                (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)), Arc::new(AtomicBool::new(false)));
            let (b, s, d) = (bell.clone(), sleeping.clone(), data.clone());
            let publisher = std::thread::spawn(move || {
                // Spread over the sleeper's entry: from before its flag is up to well after.
                if round % 2 == 0 {
                    while s.load(Ordering::Relaxed) == 0 {
                        std::hint::spin_loop();
                    }
                }
                for _ in 0..(round * 37) % 2000 {
                    std::hint::spin_loop();
                }
                d.store(true, Ordering::Release);
                if published(&s) {
                    futex_wake(&b);
                }
            });
            let t = Instant::now();
            let mut ready = || data.load(Ordering::Acquire);
            sleep_until(&bell, &sleeping, Duration::from_secs(10), &mut ready, &mut || Ok(())).expect("no check fails");
            let took = t.elapsed();
            publisher.join().expect("the publisher does not panic");
            assert!(
                took < Duration::from_secs(2),
                "round {round}: the sleeper woke after {took:?} (its nap, not the publish)"
            );
            assert_eq!(sleeping.load(Ordering::Relaxed), 0, "round {round}: the flag is lowered when the wait ends");
        }
    }
}
