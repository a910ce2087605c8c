//! A small all_reduce of two ranks of one host, issued while nothing else is queued or
//! running, runs as it is issued: its input is sent at once and the peer's taken if it
//! arrives within `ANYCCL_CPU_EAGER_US`, and the call returns a finished `Work` (no job,
//! no completion, no hand-over, nothing to wait for). A peer that has not arrived by then
//! (it may wait for something this rank does after the issue) leaves the receive to a job
//! queued first, run the usual way; a communicator whose peer keeps missing tries less
//! often (after each miss in a row, twice as many calls the usual way, up to 1,024).

use super::*;
use crate::transport::Eager;
use std::sync::atomic::AtomicU32;

/// How a communicator tries the eager path.
#[derive(Debug)]
pub(super) struct Eagerness {
    /// How long the issue looks for the peer's input (zero: never tried).
    spin: Duration,
    /// Calls left to go the usual way before the next try.
    skip: AtomicU32,
    /// Tries in a row whose peer had not arrived.
    misses: AtomicU32,
}

impl Eagerness {
    pub(super) fn new(spin: Duration) -> Eagerness {
        Eagerness { spin, skip: AtomicU32::new(0), misses: AtomicU32::new(0) }
    }

    /// Whether this call may try (one that may not counts the skip down).
    fn now(&self) -> bool {
        // Calls on other threads may count it down at once: a try more or less.
        match self.skip.load(Ordering::Relaxed) {
            0 => true,
            s => {
                self.skip.store(s - 1, Ordering::Relaxed);
                false
            }
        }
    }

    fn hit(&self) {
        if self.misses.load(Ordering::Relaxed) != 0 {
            self.misses.store(0, Ordering::Relaxed);
        }
    }

    fn miss(&self) {
        let m = self.misses.fetch_add(1, Ordering::Relaxed).saturating_add(1).min(10);
        self.skip.store(1 << m, Ordering::Relaxed);
    }
}

/// What [`CpuComm::all_reduce_now`] did.
pub(super) enum Now<'a> {
    /// Issued (finished, or its receive queued).
    Issued(Work<'a>),
    /// Nothing sent: the operation, given back, goes the usual way.
    Usual(Option<Buf<'a>>, BufMut<'a>),
}

impl CpuComm {
    /// Whether an all_reduce of `n` bytes may run as it is issued here (two ranks of one
    /// host, a size the direct exchange takes, the look not turned off): the look's
    /// microseconds.
    pub(super) fn eager_look(&self, n: usize) -> Option<u128> {
        let fits = self.info.size == 2
            && n > 0
            && n <= self.tune.all_reduce_direct_max
            && !self.eager.spin.is_zero()
            && self.mesh.is_local(1 - self.info.rank);
        fits.then_some(self.eager.spin.as_micros())
    }

    /// The all_reduce of `send` (or in place) into `recv`, run as it is issued where it may
    /// be (see the module doc). Nothing counts against the queue bound unless a receive is
    /// left queued. What the exchange finds (the peer's failure, a mismatch) is the returned
    /// `Work`'s to report.
    pub(super) fn all_reduce_now<'a>(&'a self, send: Option<Buf<'a>>, mut recv: BufMut<'a>, op: ReduceOp) -> Now<'a> {
        let (n, dtype) = (recv.bytes(), recv.dtype());
        // A skip after misses counts every call that could go this way, queued behind
        // another or not (a pipeline's batch then tries again at its next start); then only
        // a call issued while nothing is queued or running tries. A communicator that failed
        // already says so at the issue, the usual way.
        let fits = self.eager_look(n).is_some()
            && self.eager.now()
            && self.queue.held() == 0
            && self.mesh.mailbox.dead().is_none();
        if !fits {
            return Now::Usual(send, recv);
        }
        let mut st = self.sched.lock();
        let engine = if st.closed || !st.jobs.is_empty() { None } else { st.engine.take() };
        let Some(mut engine) = engine else {
            drop(st);
            return Now::Usual(send, recv);
        };
        // Numbered now: a receive left for later is queued ahead of what other threads
        // issue meanwhile.
        let id = st.next_id;
        st.next_id += 1;
        drop(st);
        let seq = engine.seq;
        let ran = {
            let src = send.as_ref().and_then(|s| s.as_host_bytes());
            match recv.as_host_bytes_mut() {
                Some(data) if send.is_none() || src.is_some() => {
                    let spin = self.eager.spin;
                    match sched::guarded(&mut engine, |e| {
                        algo::all_reduce_now(&e.mesh, seq, data, src, (dtype, op), spin)
                    }) {
                        Ok(Eager::NotStarted) => Ran::NotStarted,
                        Ok(Eager::Done) => Ran::Done,
                        // Sent and not received: `data` is untouched, so the input as sent
                        // is there, or in the send buffer.
                        Ok(Eager::Sent) => Ran::Sent(self.pool.copy(src.unwrap_or(data))),
                        Err(e) => Ran::Failed(e),
                    }
                }
                _ => Ran::NotStarted,
            }
        };
        if !matches!(ran, Ran::NotStarted) {
            engine.seq += 1;
        }
        let mut st = self.sched.lock();
        let after = match ran {
            Ran::NotStarted => After::NotStarted,
            Ran::Done => After::Done,
            Ran::Failed(e) => After::Failed(e),
            Ran::Sent(own) => {
                let done = st.completion();
                let grace = Job::grace_for(self.sched.grace, n, false);
                let wake = st.parked || (st.dozing && !st.jobs.is_empty() && !st.woken);
                st.woken |= wake;
                let run = rest(seq, own, n, (dtype, op));
                let _admission = self.admitted_anyway(n);
                st.jobs.push_front(Job { id, run, done: done.clone(), grace, rescuable: false, _admission });
                After::Queued(done, wake)
            }
        };
        st.engine = Some(engine);
        if st.helpers > 0 {
            self.sched.freed.notify_all();
        }
        drop(st);
        match after {
            After::NotStarted => Now::Usual(send, recv),
            After::Done => {
                self.eager.hit();
                Now::Issued(Work::completed())
            }
            // What the operation found (the peer's failure, a mismatch) is its `Work`'s to
            // report, as on the usual path.
            After::Failed(e) => Now::Issued(Work::new(Box::new(Failed(Some(*e), self.mesh.ctx.clone())))),
            After::Queued(done, wake) => {
                self.eager.miss();
                if wake {
                    self.sched.cv.notify_one();
                }
                let targets = smallvec::smallvec![recv];
                Now::Issued(self.work(id, done, send.into_iter().collect(), targets, Lending::No))
            }
        }
    }
}

/// How far the eager exchange went, with what its next step needs.
enum Ran {
    NotStarted,
    Done,
    /// Sent; this rank's input as sent, for the receive left for later.
    Sent(Vec<u8>),
    Failed(Box<Error>),
}

/// What the issue returns after the eager exchange.
enum After {
    NotStarted,
    Done,
    Failed(Box<Error>),
    /// The receive queued as job `done` follows; `true`: the worker is to be woken.
    Queued(Arc<Completion>, bool),
}

/// The `Work` of an operation that failed as it was issued: the failure, at the first look.
struct Failed(Option<Error>, anyccl_core::Ctx);

impl WorkImpl for Failed {
    fn poll(&mut self) -> Result<bool> {
        Err(self.0.take().unwrap_or_else(|| self.1.aborted("the all_reduce failed earlier")))
    }
    fn wait_for(&mut self, _timeout: Duration) -> Result<bool> {
        self.poll()
    }
    fn drain(&mut self) {}
}

/// The job that receives the peer's input of all_reduce number `seq` (of `n` bytes) and
/// folds it with `own`, this rank's as sent: into the caller's buffer when it runs in its
/// wait, into a buffer of its own otherwise.
fn rest(seq: u64, own: Vec<u8>, n: usize, how: (DType, ReduceOp)) -> JobFn {
    Box::new(move |e: &mut Engine, direct: Option<Direct<'_>>| {
        let out = match direct {
            Some(Direct { mut outs, .. }) => match outs.first_mut() {
                Some(out) => {
                    algo::all_reduce_rest(&e.mesh, seq, out, &own, how)?;
                    Few::new()
                }
                None => return Err(e.mesh.ctx.aborted("an all_reduce ran without its output buffer")),
            },
            None => {
                let mut data = e.pool.zeroed(n);
                algo::all_reduce_rest(&e.mesh, seq, &mut data, &own, how)?;
                smallvec::smallvec![Some(data)]
            }
        };
        e.pool.put(own);
        Ok(out)
    })
}
