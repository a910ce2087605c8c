//! `Work`: the handle every data-plane operation returns.

use crate::error::{Error, Result};
use crate::recorder::{FlightRecorder, OpState, Ticket};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a backend implements for one enqueued operation.
pub trait WorkImpl: Send {
    /// Without blocking: `Ok(true)` once the operation finished and its results are in the
    /// caller's buffers, `Ok(false)` while it runs, `Err` if it failed.
    fn poll(&mut self) -> Result<bool>;
    /// Block up to `timeout`: `Ok(true)` completed, `Ok(false)` still running, `Err` failed.
    fn wait_for(&mut self, timeout: Duration) -> Result<bool>;
    /// Block until the backend no longer touches the caller's buffers. Called by `Drop` for
    /// work that was not waited on; must return promptly once the communicator is aborted.
    fn drain(&mut self);
}

/// Identity of one operation, for errors, traces and the flight recorder.
#[derive(Debug, Clone)]
pub struct WorkInfo {
    /// Operation name.
    pub op: &'static str,
    /// Sequence number within the group.
    pub seq: u64,
    /// Group name.
    pub group: Arc<str>,
    /// Rank within the group.
    pub rank: usize,
    /// When it was enqueued, to the coarse clock's tick (a few milliseconds at most; never
    /// later than the precise time).
    pub started: Instant,
}

/// What a backend implements once for all the operations it tracks by a number (a device
/// library's stream position): a `Work` for one of them is that number and a reference to
/// the backend, so a call allocates nothing ([`Work::tracked`]).
pub trait TrackedWork: Sync {
    /// [`WorkImpl::poll`] of operation `op`.
    ///
    /// # Errors
    /// The operation's failure.
    fn poll_op(&self, op: u64) -> Result<bool>;
    /// [`WorkImpl::wait_for`] of operation `op`.
    ///
    /// # Errors
    /// The operation's failure.
    fn wait_op(&self, op: u64, timeout: Duration) -> Result<bool>;
    /// [`WorkImpl::drain`] of operation `op`.
    fn drain_op(&self, op: u64);
}

/// A handle to an enqueued operation. The buffers it borrows stay borrowed until it is
/// dropped.
///
/// # Blocking
/// Dropping a `Work` that has not completed blocks until the backend no longer touches the
/// buffers. After a timeout, call `abort` on the communicator first: the drop then returns
/// promptly.
#[must_use = "completion is only known after `wait`"]
pub struct Work<'a> {
    /// The backend's part.
    imp: Imp<'a>,
    /// Set by the communicator that issued it; `None` for a backend's bare work. What
    /// [`Work::info`] is made from when asked (errors, traces, a caller's look): no copy is
    /// kept.
    issued: Option<Issued<'a>>,
    /// How it ended, once it has: its failure's message kept for every later look. The
    /// backend's part is asked only while this is `None`.
    state: Option<std::result::Result<(), Box<Failure>>>,
}

/// A failed operation's message, behind one thin pointer (so `Work::state` takes 16 bytes).
#[derive(Debug)]
struct Failure(Box<str>);

/// The backend's part of a [`Work`]: held in the handle, with no allocation of its own, where
/// the backend tracks its operations by number. A `Work` in one allocation was one pointer to
/// move, but with more than seven in flight glibc's per-thread cache (seven chunks a size)
/// ran dry and every call ran `malloc`'s and `free`'s slow paths: `bench/host_footprint.sh`
/// counted 211 lines of code a call (55 of them glibc's) and 1,526 instructions with it, 165
/// (2 of glibc's) and 1,334 without; code that each real launch pushes out of the caches.
enum Imp<'a> {
    /// Operation `.1` of a backend that tracks its operations by number.
    Tracked(&'a (dyn TrackedWork + 'a), u64),
    /// A backend's own handle.
    Boxed(Box<dyn WorkImpl + 'a>),
}

/// The backend's part of work that was complete when it was made ([`Work::completed`]): a
/// tracked operation of nobody's, so that `Imp` needs no third variant (and no tag beside
/// its two references).
struct Done;

impl TrackedWork for Done {
    fn poll_op(&self, _op: u64) -> Result<bool> {
        Ok(true)
    }
    fn wait_op(&self, _op: u64, _timeout: Duration) -> Result<bool> {
        Ok(true)
    }
    fn drain_op(&self, _op: u64) {}
}

impl Imp<'_> {
    fn poll(&mut self) -> Result<bool> {
        match self {
            Imp::Tracked(src, op) => src.poll_op(*op),
            Imp::Boxed(b) => b.poll(),
        }
    }
    fn wait_for(&mut self, timeout: Duration) -> Result<bool> {
        match self {
            Imp::Tracked(src, op) => src.wait_op(*op, timeout),
            Imp::Boxed(b) => b.wait_for(timeout),
        }
    }
    fn drain(&mut self) {
        match self {
            Imp::Tracked(src, op) => src.drain_op(*op),
            Imp::Boxed(b) => b.drain(),
        }
    }
}

/// Who issues operations: a communicator's flight recorder, rank and group name, which each
/// `Work` it issues lends (read when the `Work` finishes or is asked who it is).
#[derive(Debug)]
#[repr(C)]
pub(crate) struct Issuer {
    pub(crate) recorder: Arc<FlightRecorder>,
    pub(crate) rank: usize,
    pub(crate) name: Arc<str>,
}

/// What the communicator records of an operation as it issues it: a [`WorkInfo`] whose
/// group, rank and flight recorder are the communicator's own, lent rather than copied
/// (every operation takes this path).
#[derive(Clone, Copy)]
pub(crate) struct Issued<'a> {
    pub(crate) by: &'a Issuer,
    pub(crate) op: &'static str,
    pub(crate) seq: u64,
    /// From the flight recorder's coarse clock ([`FlightRecorder::now_coarse_ns`]).
    pub(crate) started_ns: u64,
    /// The flight recorder's entry.
    pub(crate) ticket: Ticket,
}

impl<'a> Issued<'a> {
    fn recorder(&self) -> &'a FlightRecorder {
        &self.by.recorder
    }
}

impl fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Work").field("info", &self.info()).field("state", &self.state).finish()
    }
}

impl<'a> Work<'a> {
    /// Wrap a backend's work. Backends call this; the Communicator fills in `info`.
    pub fn new(imp: impl WorkImpl + 'a) -> Self {
        Work { imp: Imp::Boxed(Box::new(imp)), issued: None, state: None }
    }

    /// Operation `op` of a backend that tracks its operations by number: nothing is
    /// allocated.
    pub fn tracked(by: &'a (dyn TrackedWork + 'a), op: u64) -> Self {
        Work { imp: Imp::Tracked(by, op), issued: None, state: None }
    }

    /// Work that is already complete (e.g. an operation on zero elements).
    pub fn completed() -> Self {
        Work { imp: Imp::Tracked(&Done, 0), issued: None, state: Some(Ok(())) }
    }

    pub(crate) fn attach(&mut self, issued: Issued<'a>) {
        if self.state.is_some() {
            // Complete at its issue ([`Work::completed`]): its entry is finished now, its
            // time zero to the recorder's coarse tick.
            issued.recorder().finish_at_issue(issued.ticket);
        }
        self.issued = Some(issued);
    }

    /// Identity of the operation, made when asked (the group's name is shared, not copied).
    /// A backend's work that no communicator issued has an empty one.
    pub fn info(&self) -> WorkInfo {
        match &self.issued {
            Some(i) => WorkInfo {
                op: i.op,
                seq: i.seq,
                group: i.by.name.clone(),
                rank: i.by.rank,
                started: i.recorder().instant(i.started_ns),
            },
            None => WorkInfo { op: "", seq: 0, group: Arc::from(""), rank: 0, started: Instant::now() },
        }
    }

    fn finish(&mut self, r: std::result::Result<(), Box<Failure>>) {
        if let Some(i) = &self.issued {
            let st = match &r {
                Ok(()) => OpState::Completed,
                Err(e) => OpState::Failed(e.0.to_string()),
            };
            i.recorder().finish(i.ticket, st);
        }
        self.state = Some(r);
    }

    fn settle(&mut self, r: Result<bool>) -> Result<bool> {
        match r {
            Ok(true) => {
                self.finish(Ok(()));
                Ok(true)
            }
            Ok(false) => Ok(false),
            Err(e) => Err(self.failed(e)),
        }
    }

    /// Record the operation's failure `e` (kept for every later look) and give it back.
    #[cold]
    #[inline(never)]
    fn failed(&mut self, e: Error) -> Error {
        self.finish(Err(Box::new(Failure(e.to_string().into_boxed_str()))));
        let info = self.info();
        crate::trace::dump_error(&format!("{} #{} failed: {e}", info.op, info.seq));
        e
    }

    fn repeat_outcome(&self) -> Result<bool> {
        match &self.state {
            Some(Ok(())) => Ok(true),
            Some(Err(f)) => Err(self.failed_earlier(&f.0)),
            None => Ok(false),
        }
    }

    /// The error every look after a failure gives: the failure's message, `msg`.
    #[cold]
    #[inline(never)]
    fn failed_earlier(&self, msg: &str) -> Error {
        let info = self.info();
        let ctx = crate::Ctx::new("anyccl", info.rank, info.group.to_string());
        ctx.aborted(format!("{} #{} failed earlier: {msg}", info.op, info.seq))
    }

    /// Whether the operation finished; `Err` if it failed.
    ///
    /// # Errors
    /// The operation's failure (peer failure, abort, backend error).
    pub fn is_completed(&mut self) -> Result<bool> {
        if self.state.is_some() {
            return self.repeat_outcome();
        }
        let r = self.imp.poll();
        self.settle(r)
    }

    /// Block until the operation finishes or `timeout` passes.
    ///
    /// # Errors
    /// [`Error::Timeout`] when `timeout` passes; the `Work` stays alive so the caller can
    /// abort the communicator and then drop it. Otherwise the operation's own failure.
    pub fn wait(&mut self, timeout: Duration) -> Result<()> {
        if self.state.is_some() {
            return self.repeat_outcome().map(|_| ());
        }
        let r = self.imp.wait_for(timeout);
        if self.settle(r)? {
            Ok(())
        } else {
            Err(self.timeout_error(timeout))
        }
    }

    /// Like [`Work::wait`], without blocking the async runtime's thread.
    ///
    /// # Errors
    /// As [`Work::wait`].
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves the `Work` as it was.
    pub async fn wait_async(&mut self, timeout: Duration) -> Result<()> {
        let deadline = crate::deadline_in(timeout);
        let mut pause = Duration::from_micros(20);
        loop {
            if self.is_completed()? {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timeout_error(timeout));
            }
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    }

    #[cold]
    #[inline(never)]
    fn timeout_error(&self, after: Duration) -> Error {
        let info = self.info();
        crate::trace::dump(&format!("{} #{} of group '{}' timed out after {after:?}", info.op, info.seq, info.group));
        // What is known of the group: whether its members ever ran an operation together.
        let recorder = self.issued.as_ref().map(|i| i.recorder());
        let history = match recorder.map(|r| (r.last_completed(&info.group), r.overwritten())) {
            Some((Some((op, seq, ago)), _)) => format!(
                "every member had taken part before (the group's last completed operation here: {op} #{seq}, \
                 {ago:.1?} ago), so one stopped taking part"
            ),
            Some((None, false)) => {
                "no operation of the group had completed here yet (a member may never have joined)".into()
            }
            Some((None, true)) => "none of the group's operations still in the flight recorder had completed, and \
                older ones were overwritten (it keeps ANYCCL_FLIGHT_RECORDER entries), so whether every member \
                ever took part is not known here"
                .into(),
            None => String::new(),
        };
        crate::Ctx::new("anyccl", info.rank, info.group.to_string()).timeout(
            format!("{} #{}", info.op, info.seq),
            after,
            format!(
                "the operation is still pending{}{history}; abort the communicator before dropping it",
                if history.is_empty() { "" } else { "; " }
            ),
        )
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        if self.state.is_none() {
            self.imp.drain();
            if let Some(i) = &self.issued {
                i.recorder().finish(i.ticket, OpState::Dropped);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every operation returns a `Work` by value through the backend, the communicator and
    /// the caller: a larger one is copied at each step.
    #[test]
    fn work_is_small() {
        let n = std::mem::size_of::<Work<'static>>();
        assert!(n <= 88, "Work is {n} bytes");
    }

    /// What a tracked `Work` asks its backend, and that a finished one asks no more.
    #[test]
    fn a_tracked_work_asks_its_backend_by_number() {
        use std::sync::atomic::{AtomicU64, Ordering};
        struct Stream {
            passed: AtomicU64,
            asked: AtomicU64,
        }
        impl TrackedWork for Stream {
            fn poll_op(&self, op: u64) -> Result<bool> {
                self.asked.fetch_add(1, Ordering::Relaxed);
                Ok(self.passed.load(Ordering::Relaxed) >= op)
            }
            fn wait_op(&self, op: u64, _timeout: Duration) -> Result<bool> {
                self.poll_op(op)
            }
            fn drain_op(&self, _op: u64) {}
        }
        let s = Stream { passed: AtomicU64::new(1), asked: AtomicU64::new(0) };
        let mut first = Work::tracked(&s, 1);
        let mut second = Work::tracked(&s, 2);
        assert!(first.is_completed().unwrap());
        assert!(!second.is_completed().unwrap());
        assert!(second.wait(Duration::ZERO).is_err(), "not passed yet: a timeout");
        s.passed.store(2, Ordering::Relaxed);
        second.wait(Duration::ZERO).unwrap();
        let asked = s.asked.load(Ordering::Relaxed);
        assert!(first.is_completed().unwrap() && second.is_completed().unwrap());
        assert_eq!(s.asked.load(Ordering::Relaxed), asked, "a finished Work keeps its outcome");
        assert!(Work::completed().is_completed().unwrap());
    }
}
