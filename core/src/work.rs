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

/// A handle to an enqueued operation. The buffers it borrows stay borrowed until it is
/// dropped.
///
/// # Blocking
/// Dropping a `Work` that has not completed blocks until the backend no longer touches the
/// buffers. After a timeout, call `abort` on the communicator first: the drop then returns
/// promptly.
#[must_use = "completion is only known after `wait`"]
pub struct Work<'a> {
    /// Everything, the backend's part included, in one allocation: the handle every call
    /// returns is one pointer, moved through each layer and into the caller's lists (as 128
    /// bytes it was copied at each step, and those copies were a fifth of the per-call
    /// cost that a library doing nothing leaves: `anyccl-device`'s `host_cost` example).
    held: Box<Held<'a, dyn WorkImpl + 'a>>,
}

/// What a [`Work`] holds.
struct Held<'a, T: ?Sized> {
    /// Set by the communicator that issued it; `None` for a backend's bare work. What
    /// [`Work::info`] is made from when asked (errors, traces, a caller's look): no copy is
    /// kept, so the allocation stays small (a completed `Work` is under 100 bytes, which
    /// glibc serves from its fast lists when hundreds are held in flight and its per-thread
    /// cache, seven a size, runs dry).
    issued: Option<Issued<'a>>,
    /// How it ended, once it has: its failure's message kept for every later look. The
    /// backend's part is asked only while this is `None`.
    state: Option<std::result::Result<(), Box<str>>>,
    imp: T,
}

/// The backend's part of work that was complete when it was made.
struct Done;

impl WorkImpl for Done {
    fn poll(&mut self) -> Result<bool> {
        Ok(true)
    }
    fn wait_for(&mut self, _timeout: Duration) -> Result<bool> {
        Ok(true)
    }
    fn drain(&mut self) {}
}

/// What the communicator records of an operation as it issues it: a [`WorkInfo`] whose
/// group name is lent rather than counted (every operation takes this path).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Issued<'a> {
    pub(crate) op: &'static str,
    pub(crate) seq: u64,
    pub(crate) group: &'a Arc<str>,
    pub(crate) rank: usize,
    /// From the flight recorder's coarse clock ([`FlightRecorder::now_coarse_ns`]).
    pub(crate) started_ns: u64,
    /// The flight recorder that holds its entry, and the entry.
    pub(crate) recorder: &'a FlightRecorder,
    pub(crate) ticket: Ticket,
}

impl fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Work").field("info", &self.info()).field("state", &self.held.state).finish()
    }
}

impl<'a> Work<'a> {
    /// Wrap a backend's work. Backends call this; the Communicator fills in `info`.
    pub fn new(imp: impl WorkImpl + 'a) -> Self {
        Self::holding(imp, None)
    }

    /// Work that is already complete (e.g. an operation on zero elements).
    pub fn completed() -> Self {
        Self::holding(Done, Some(Ok(())))
    }

    fn holding(imp: impl WorkImpl + 'a, state: Option<std::result::Result<(), Box<str>>>) -> Self {
        let held = Box::new(Held { issued: None, state, imp });
        Work { held }
    }

    pub(crate) fn attach(&mut self, issued: Issued<'a>) {
        if self.held.state.is_some() {
            // Complete at its issue ([`Work::completed`]): its entry is finished now, its
            // time zero to the recorder's coarse tick.
            issued.recorder.finish_at_issue(issued.ticket);
        }
        self.held.issued = Some(issued);
    }

    /// Identity of the operation, made when asked (the group's name is shared, not copied).
    /// A backend's work that no communicator issued has an empty one.
    pub fn info(&self) -> WorkInfo {
        match &self.held.issued {
            Some(i) => WorkInfo {
                op: i.op,
                seq: i.seq,
                group: i.group.clone(),
                rank: i.rank,
                started: i.recorder.instant(i.started_ns),
            },
            None => WorkInfo { op: "", seq: 0, group: Arc::from(""), rank: 0, started: Instant::now() },
        }
    }

    fn finish(&mut self, r: std::result::Result<(), Box<str>>) {
        if let Some(i) = &self.held.issued {
            let st = match &r {
                Ok(()) => OpState::Completed,
                Err(e) => OpState::Failed(e.to_string()),
            };
            i.recorder.finish(i.ticket, st);
        }
        self.held.state = Some(r);
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
        self.finish(Err(e.to_string().into_boxed_str()));
        let info = self.info();
        crate::trace::dump_error(&format!("{} #{} failed: {e}", info.op, info.seq));
        e
    }

    fn repeat_outcome(&self) -> Result<bool> {
        match &self.held.state {
            Some(Ok(())) => Ok(true),
            Some(Err(msg)) => Err(self.failed_earlier(msg)),
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
        if self.held.state.is_some() {
            return self.repeat_outcome();
        }
        let r = self.held.imp.poll();
        self.settle(r)
    }

    /// Block until the operation finishes or `timeout` passes.
    ///
    /// # Errors
    /// [`Error::Timeout`] when `timeout` passes; the `Work` stays alive so the caller can
    /// abort the communicator and then drop it. Otherwise the operation's own failure.
    pub fn wait(&mut self, timeout: Duration) -> Result<()> {
        if self.held.state.is_some() {
            return self.repeat_outcome().map(|_| ());
        }
        let r = self.held.imp.wait_for(timeout);
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
        let history = match self.held.issued.as_ref().map(|i| i.recorder.last_completed(&info.group)) {
            Some(Some((op, seq, ago))) => format!(
                "every member had taken part before (the group's last completed operation here: {op} #{seq}, \
                 {ago:.1?} ago), so one stopped taking part"
            ),
            Some(None) => "no operation of the group had completed here yet (a member may never have joined)".into(),
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
        if self.held.state.is_none() {
            self.held.imp.drain();
            if let Some(i) = &self.held.issued {
                i.recorder.finish(i.ticket, OpState::Dropped);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every operation returns a `Work` by value through the backend, the communicator and
    /// the caller: a larger one is copied at each step (with a 128-byte handle the copies, and
    /// the stalls of reading back what was just written, were a fifth of `host_cost`'s
    /// per-call path).
    #[test]
    fn work_is_one_pointer() {
        assert!(std::mem::size_of::<Work<'static>>() <= 16, "Work is {} bytes", std::mem::size_of::<Work<'static>>());
    }

    /// A completed `Work`'s allocation stays in glibc's fast lists (chunks up to 128 bytes
    /// with their header): a pipelined caller holding hundreds of them paid 0.02-0.05 us a
    /// call more than a waiting one at 8 B when they did not fit.
    #[test]
    fn completed_work_is_a_small_allocation() {
        let n = std::mem::size_of::<Held<'static, Done>>();
        assert!(n <= 96, "a completed Work holds {n} bytes");
    }
}
