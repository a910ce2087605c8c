//! One watchdog thread for every device communicator of the process: it looks at each
//! registered communicator ten times a second and drops those that are gone.

use std::sync::{Mutex, OnceLock, Weak};
use std::time::Duration;

/// Something the watchdog looks at.
pub(crate) trait Watched: Send + Sync {
    /// One look; `false` once it needs no more looks.
    fn tick(&self) -> bool;
}

static WATCHED: OnceLock<Mutex<Vec<Weak<dyn Watched>>>> = OnceLock::new();

/// Watch `w` until it is dropped or its `tick` says done. Starts the thread on first use;
/// if the thread cannot start, says so (blocked calls are then bounded by the library's
/// own timeouts only).
pub(crate) fn watch(w: Weak<dyn Watched>) {
    let mut started = false;
    let list = WATCHED.get_or_init(|| {
        started = true;
        Mutex::new(Vec::new())
    });
    list.lock().unwrap_or_else(|p| p.into_inner()).push(w);
    if started {
        let spawned = std::thread::Builder::new().name("anyccl-device-watchdog".into()).spawn(|| loop {
            std::thread::sleep(Duration::from_millis(100));
            let Some(list) = WATCHED.get() else { return };
            // Upgrade under the lock, tick outside it: a tick may take the time of an abort.
            let live: Vec<_> = {
                let mut l = list.lock().unwrap_or_else(|p| p.into_inner());
                l.retain(|w| w.strong_count() > 0);
                l.iter().filter_map(Weak::upgrade).collect()
            };
            let mut finished = Vec::new();
            for w in &live {
                if !w.tick() {
                    finished.push(std::sync::Arc::as_ptr(w) as *const () as usize);
                }
            }
            drop(live);
            if !finished.is_empty() {
                let mut l = list.lock().unwrap_or_else(|p| p.into_inner());
                l.retain(|w| !finished.contains(&(w.as_ptr() as *const () as usize)));
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("no device watchdog thread ({e}): blocked library calls end only at the library's timeouts");
        }
    }
}
