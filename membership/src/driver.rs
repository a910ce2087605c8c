//! A liveness driver: one thread that beats for many members of one process (a simulation
//! of thousands of ranks, a process that hosts several ranks), where a thread per member
//! would cost a stack and a runtime each. Each member still renews its own record, watches
//! its own peer and hears of proposals on its own beat, as a task of the driver's runtime.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// One OS thread, with a runtime of its own, on which the members given it (through
/// [`crate::MembershipConfig::liveness_driver`]) beat. The thread does nothing else, so a
/// member blocked in a collective still beats, as with a thread of its own. The thread ends
/// when the last clone of the driver, and the last member on it, is dropped.
///
/// # Examples
/// ```
/// use anyccl_membership::{LivenessDriver, MembershipConfig};
/// let driver = LivenessDriver::start()?;
/// let cfg = MembershipConfig { liveness_driver: Some(driver.clone()), ..MembershipConfig::default() };
/// assert_eq!(driver.members(), 0);
/// # drop(cfg);
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Clone)]
pub struct LivenessDriver {
    inner: Arc<Driver>,
}

struct Driver {
    handle: tokio::runtime::Handle,
    stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Members beating on it; shared with their tasks, which never hold the driver itself
    /// (its last clone must not be dropped on its own thread).
    members: Arc<AtomicUsize>,
}

impl LivenessDriver {
    /// Start the driver's thread (named `anyccl-liveness`).
    ///
    /// # Errors
    /// When the runtime or the thread cannot be made.
    pub fn start() -> std::io::Result<LivenessDriver> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new().name("anyccl-liveness".into()).spawn(move || {
            // Until the last clone is dropped; the members' tasks run meanwhile.
            let _ = rt.block_on(stopped);
        })?;
        Ok(LivenessDriver {
            inner: Arc::new(Driver {
                handle,
                stop: Mutex::new(Some(stop)),
                thread: Mutex::new(Some(thread)),
                members: Arc::default(),
            }),
        })
    }

    /// Members beating on this driver now.
    pub fn members(&self) -> usize {
        self.inner.members.load(Ordering::Acquire)
    }

    /// Run `beat` (a member's beat loop) on the driver's thread until it returns or the
    /// handle is aborted.
    pub(crate) fn spawn(
        &self,
        beat: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let counted = Counted::new(self.inner.members.clone());
        self.inner.handle.spawn(async move {
            let _counted = counted;
            beat.await
        })
    }
}

/// One member counted on a driver while its task lives (dropped when it ends or is aborted).
struct Counted(Arc<AtomicUsize>);

impl Counted {
    fn new(n: Arc<AtomicUsize>) -> Counted {
        n.fetch_add(1, Ordering::AcqRel);
        Counted(n)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if let Some(s) = self.stop.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = s.send(());
        }
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread.filter(|t| t.thread().id() != std::thread::current().id()) {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for LivenessDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LivenessDriver").field("members", &self.members()).finish_non_exhaustive()
    }
}

/// The same driver (not merely one of the same kind).
impl PartialEq for LivenessDriver {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for LivenessDriver {}
