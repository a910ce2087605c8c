//! Clocks: the coarse clock for bookkeeping on the hot path, and deadlines that never
//! overflow.

use crate::env::MAX_TIMEOUT;
use std::time::{Duration, Instant};

/// Nanoseconds on a monotonic clock read for bookkeeping that needs only milliseconds (a
/// watchdog's "how long has this call been inside the library"): on Linux the coarse
/// clock, a load from the vDSO page where the precise clock costs tens of nanoseconds a
/// read, a fair share of what anyccl adds to a small operation; elsewhere the precise
/// clock. Its tick is the kernel's (1-4 ms); never 0.
pub fn coarse_now_ns() -> u64 {
    #[cfg(target_os = "linux")]
    {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse);
        (t.tv_sec.max(0) as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec.max(0) as u64).max(1)
    }
    #[cfg(not(target_os = "linux"))]
    {
        static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        (BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64).max(1)
    }
}

/// `now + d`, or the latest instant the clock represents when that overflows: a caller's
/// `Duration::MAX` means "no practical limit", never a panic.
pub fn deadline_in(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d).or_else(|| now.checked_add(MAX_TIMEOUT * 100)).unwrap_or(now)
}
