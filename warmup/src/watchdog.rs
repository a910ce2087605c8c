//! One watchdog thread per process for every warmup running in it: it sleeps until the
//! earliest registered deadline (plus a grace second) and aborts that warmup's
//! communicators, for calls that block inside a backend (a first connect) where no wait of
//! the warmup's own can end them. A warmup that finishes in time deregisters; nothing wakes
//! in between.

use anyccl_core::Collective;
use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The grace after a deadline: every wait of the warmup reports its own `Timeout` first.
const GRACE: Duration = Duration::from_secs(1);

/// (deadline, id) → the communicators to abort then.
type Due = BTreeMap<(Instant, u64), Vec<Arc<dyn Collective>>>;

#[derive(Default)]
struct Watch {
    due: Mutex<Due>,
    changed: Condvar,
    started: OnceLock<bool>,
}

static WATCH: OnceLock<Watch> = OnceLock::new();
static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A registered warmup; dropping it deregisters.
pub(crate) struct Registration {
    key: (Instant, u64),
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(w) = WATCH.get() {
            if let Ok(mut due) = w.due.lock() {
                due.remove(&self.key);
            }
        }
    }
}

/// Abort `comms` if the warmup is still registered at `deadline` + a grace second. Where
/// the watchdog thread cannot start, the warmup runs without it (its own waits still end
/// at the deadline) and says so.
pub(crate) fn register(deadline: Instant, comms: &[Arc<dyn Collective>]) -> Registration {
    let w = WATCH.get_or_init(Watch::default);
    let key = (deadline + GRACE, NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    if let Ok(mut due) = w.due.lock() {
        due.insert(key, comms.to_vec());
    }
    let running = *w.started.get_or_init(|| {
        std::thread::Builder::new().name("anyccl-warmup-watchdog".into()).spawn(|| run(WATCH.get())).is_ok()
    });
    if !running {
        tracing::warn!("warmup watchdog thread could not start: a call blocked inside the backend is not aborted");
    }
    w.changed.notify_one();
    Registration { key }
}

fn run(w: Option<&'static Watch>) {
    let Some(w) = w else { return };
    let Ok(mut due) = w.due.lock() else { return };
    loop {
        let now = Instant::now();
        let next = due.keys().next().copied();
        match next {
            None => match w.changed.wait(due) {
                Ok(g) => due = g,
                Err(_) => return,
            },
            Some(k) if k.0 <= now => {
                let comms = due.remove(&k).unwrap_or_default();
                drop(due);
                tracing::error!("warmup deadline passed: aborting its communicators");
                anyccl_core::abort_all(&comms, Duration::from_secs(10));
                due = match w.due.lock() {
                    Ok(g) => g,
                    Err(_) => return,
                };
            }
            Some(k) => match w.changed.wait_timeout(due, k.0 - now) {
                Ok((g, _)) => due = g,
                Err(_) => return,
            },
        }
    }
}
