//! What an operation holds of its caller: the caller's buffers handed to a job that runs in
//! its wait ([`Direct`]), its input as the worker sees it ([`Input`]: copied, or lent), and
//! the `Work` that runs, waits for and delivers the job ([`CpuWork`]), and the queueing of
//! the job with its `Work` (`CpuComm::enqueue`).

use super::*;

/// A caller's own buffers, handed to its job when the job runs on the caller's thread inside
/// its wait (the borrow is live there): the job reads its inputs and writes its results in
/// place, and leaves `None` for every target.
pub(super) struct Direct<'d> {
    /// The send buffers of the operation, in issue order (none for an in-place operation).
    pub(super) srcs: Few<&'d [u8]>,
    /// The target buffers, in issue order.
    pub(super) outs: Few<&'d mut [u8]>,
}

/// Inputs from this size on are lent rather than copied at enqueue, and a `Work` dropped
/// before its job ran waits for the job rather than leaving it a copy.
const LEND_MIN: usize = 64 << 10;

/// Inputs from this size on are lent while other jobs are queued too (where this process
/// may read its own memory through the kernel): a copy at enqueue went to memory nobody
/// touched since the last batch (its pages faulted in again on every batch of thousands of
/// operations) and is wasted when the caller's wait runs the job on its own buffers. 2 ranks,
/// 16 KiB all_reduce, 1,024 issued then waited: 4.6-6.1 us a call lent, 9.0-18.1 copied.
const LEND_QUEUED_MIN: usize = 4 << 10;

/// What an input of `len` bytes counts against the queue bound while its job is queued: a
/// copied one its size, a lent one (which holds nothing until the job runs) as the largest
/// copied one, so that the bound also caps how many operations are queued.
pub(super) fn held(len: usize) -> usize {
    len.min(LEND_MIN)
}

/// What a job with one input of `len` bytes counts against the queue bound ([`held`], at
/// least [`RECORD`]).
pub(super) fn counted(len: usize) -> usize {
    held(len).max(RECORD)
}

/// What a queued job counts against the queue bound at least: its record (the job, its
/// completion and its closure take a few hundred bytes), so that operations with small or
/// no inputs (barriers, receives) are bounded in number too: 262,144 at the default bound.
pub(super) const RECORD: usize = 1 << 10;

/// Inputs up to this size are copied into the job itself (no allocation).
const INLINE_MAX: usize = 64;

/// An operation's input as the worker sees it.
pub(super) enum Input {
    /// A small input, copied at enqueue into the job.
    Inline { bytes: [u8; INLINE_MAX], len: usize },
    /// Copied at enqueue.
    Copied(Vec<u8>),
    /// The caller's memory, lent while its `Work` lives (see the module doc).
    Lent { addr: usize, len: usize },
}

impl Input {
    /// Copy a small input; lend a large one, one from [`LEND_QUEUED_MIN`], or, with `lend`,
    /// any one above [`INLINE_MAX`] bytes (where this process may read its own memory
    /// through the kernel).
    pub(super) fn of(bytes: &[u8], pool: &Pool, lend: bool) -> Input {
        let len = bytes.len();
        if len >= LEND_MIN || ((lend || len >= LEND_QUEUED_MIN) && len > INLINE_MAX && crate::shm::self_read_ok()) {
            Input::Lent { addr: bytes.as_ptr() as usize, len }
        } else if len <= INLINE_MAX {
            let mut inline = [0u8; INLINE_MAX];
            inline[..len].copy_from_slice(bytes);
            Input::Inline { bytes: inline, len }
        } else {
            Input::Copied(pool.copy(bytes))
        }
    }

    /// How the input is lent, if it is.
    pub(super) fn lent(&self) -> Lending {
        match *self {
            Input::Lent { addr, len } if len < LEND_MIN => Lending::Rescuable { addr, len },
            Input::Lent { .. } => Lending::Held,
            _ => Lending::No,
        }
    }

    /// What to send: the copy, or the lent range (which a peer of this host copies out).
    pub(super) fn data(&self) -> Data<'_> {
        match self {
            Input::Inline { bytes, len } => Data::Bytes(&bytes[..*len]),
            Input::Copied(v) => Data::Bytes(v),
            Input::Lent { addr, len } => Data::At { addr: *addr, len: *len },
        }
    }

    /// The bytes, in a buffer of the job's own.
    pub(super) fn take(self, e: &Engine) -> Result<Vec<u8>> {
        match self {
            Input::Inline { bytes, len } => Ok(e.pool.copy(&bytes[..len])),
            Input::Copied(v) => Ok(v),
            Input::Lent { addr, len } => {
                let mut v = e.pool.zeroed(len);
                e.read_lent(addr, &mut v)?;
                Ok(v)
            }
        }
    }

    /// Copy the bytes into `dst`.
    pub(super) fn read_into(&self, e: &Engine, dst: &mut [u8]) -> Result<()> {
        match self {
            Input::Inline { bytes, len } => dst.copy_from_slice(&bytes[..*len]),
            Input::Copied(v) => crate::shm::copy(dst, v),
            Input::Lent { addr, .. } => e.read_lent(*addr, dst)?,
        }
        Ok(())
    }
}

/// Whether and how an operation's input is lent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lending {
    No,
    /// A large input, read while its job runs: dropping the `Work` waits for the job.
    Held,
    /// A small input lent because its collective was issued while nothing else was queued:
    /// the job reads it first thing, so a `Work` dropped before that leaves it a copy
    /// instead of waiting (the job may need peers that wait for this rank's next steps).
    Rescuable {
        addr: usize,
        len: usize,
    },
}

pub(super) struct CpuWork<'a> {
    pub(super) id: u64,
    pub(super) pool: &'a Pool,
    /// The communicator's operation timeout: a wait at least this long may run the job.
    pub(super) op_timeout: Duration,
    pub(super) sched: &'a Sched,
    pub(super) done: Arc<Completion>,
    /// The send buffers, for the job to read when it runs inside this caller's wait.
    pub(super) sources: Few<Buf<'a>>,
    pub(super) targets: Few<BufMut<'a>>,
    /// How its input is lent: dropping this waits for a job with a `Held` one, and leaves a
    /// job that has not read its `Rescuable` one a copy.
    pub(super) lending: Lending,
    /// This handle asked the worker to hurry ([`Sched::hurry`]) already.
    pub(super) prodded: bool,
    /// The result was delivered (or its error returned).
    pub(super) delivered: bool,
}

impl CpuWork<'_> {
    fn deliver(&mut self, r: Done) -> Result<bool> {
        self.delivered = true;
        let outs = r.map_err(|e| *e)?;
        for (t, o) in self.targets.iter_mut().zip(outs) {
            if let Some(o) = o {
                if let Some(dst) = t.as_host_bytes_mut() {
                    crate::shm::copy(dst, &o);
                }
                self.pool.put(o);
            }
        }
        Ok(true)
    }

    /// Ask the worker, once, to run the queue now: this job's caller waits for it.
    fn prod(&mut self) {
        if !self.prodded {
            self.prodded = true;
            self.sched.hurry();
        }
    }

    /// Run queued jobs on this thread up to this one, while the engine is free; this one
    /// with the caller's buffers when `direct`, returning its result.
    fn help(&mut self, direct: bool) -> Option<Done> {
        let mut st = self.sched.lock();
        while st.engine.is_some() && st.jobs.front().is_some_and(|j| j.id <= self.id) {
            let mine = direct && st.jobs.front().is_some_and(|j| j.id == self.id);
            let d = mine.then(|| {
                let srcs = self.sources.iter().filter_map(|b| b.as_host_bytes()).collect();
                let outs = self.targets.iter_mut().filter_map(|t| t.as_host_bytes_mut()).collect();
                (self.id, Direct { srcs, outs })
            });
            let (next, r) = self.sched.run_front(st, d);
            if r.is_some() {
                return r;
            }
            st = next;
        }
        None
    }

    /// Leave the job a copy of its lent input (`len` bytes at `addr`, inside one of this
    /// `Work`'s buffers, borrowed until it is dropped), unless it has read it already.
    fn rescue_input(&mut self, addr: usize, len: usize) {
        let within = |b: &[u8]| {
            let base = b.as_ptr() as usize;
            (addr >= base && addr + len <= base + b.len()).then(|| b[addr - base..addr - base + len].to_vec())
        };
        let mut r = self.done.rescue.lock().unwrap_or_else(|p| p.into_inner());
        if r.taken {
            return;
        }
        let from_sources = self.sources.iter().find_map(|b| b.as_host_bytes().and_then(within));
        let copy = from_sources
            .or_else(|| self.targets.iter_mut().find_map(|b| b.as_host_bytes_mut().and_then(|b| within(b))));
        match copy {
            Some(c) => r.copy = Some(c),
            // Not in any buffer of this Work (it always is): wait for the job, as for a
            // large input.
            None => self.lending = Lending::Held,
        }
    }
}

impl WorkImpl for CpuWork<'_> {
    fn poll(&mut self) -> Result<bool> {
        let mut g = self.done.slot.lock().unwrap_or_else(|p| p.into_inner());
        let r = self.done.take(&mut g, &self.sched.holding);
        drop(g);
        match r {
            None => {
                // Someone looks for it: the worker runs it now (a program that polls, or an
                // async wait, would otherwise wait for the grace or the worker's next look).
                self.prod();
                Ok(false)
            }
            Some(r) => self.deliver(r),
        }
    }

    fn wait_for(&mut self, timeout: Duration) -> Result<bool> {
        // A job run on this thread returns when it ends: each of its steps waits at most the
        // operation timeout, so only a wait at least that long may run it (a shorter wait is
        // a probe that must return on time; the worker runs the job).
        let may_help = timeout >= self.op_timeout;
        // Read the clock only once this wait has to block.
        let mut deadline: Option<Instant> = None;
        loop {
            if may_help {
                if let Some(r) = self.help(true) {
                    return self.deliver(r);
                }
            }
            let mut g = self.done.slot.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(r) = self.done.take(&mut g, &self.sched.holding) {
                drop(g);
                return self.deliver(r);
            }
            let now = Instant::now();
            let deadline = *deadline.get_or_insert_with(|| anyccl_core::deadline_in(timeout));
            if now >= deadline {
                return Ok(false);
            }
            let slice = (deadline - now).min(Duration::from_millis(5));
            if may_help {
                // Another thread runs a job (this one or an earlier one): wait for the engine,
                // then run what is left up to this job here (the worker stops after its
                // current job for a caller waiting here).
                drop(g);
                self.sched.wait_engine(slice);
                continue;
            }
            // The worker runs it (or an earlier job): have it start now, and wait for it,
            // looking again now and then in case the engine came free with this job still
            // queued. (Without the prod, a wait of 60 s on a communicator whose operation
            // timeout is 600 s waited for the worker's next look: 378-485 us an 8 B call.)
            if !self.prodded {
                drop(g);
                self.prod();
                self.done.spin();
                continue;
            }
            g = self.done.park(g, slice);
            if let Some(r) = self.done.take(&mut g, &self.sched.holding) {
                drop(g);
                return self.deliver(r);
            }
        }
    }

    fn drain(&mut self) {
        if let (Lending::Rescuable { addr, len }, false) = (self.lending, self.delivered) {
            self.rescue_input(addr, len);
        }
        if self.lending != Lending::Held {
            // The job only touches its own copies: nothing to wait for. A result that comes
            // later is dropped (the completion is kept for reuse).
            if !self.delivered {
                let mut g = self.done.slot.lock().unwrap_or_else(|p| p.into_inner());
                self.done.abandoned.store(true, Ordering::Relaxed);
                drop(self.done.take(&mut g, &self.sched.holding));
            }
            return;
        }
        // It may still read the caller's memory: wait until it has run (each of its steps
        // ends by its deadline, at once once the communicator is aborted).
        loop {
            let _ = self.help(false);
            let g = self.done.slot.lock().unwrap_or_else(|p| p.into_inner());
            let mut g = if g.is_some() { g } else { self.done.park(g, Duration::from_millis(5)) };
            if let Some(r) = self.done.take(&mut g, &self.sched.holding) {
                for o in r.into_iter().flatten().flatten() {
                    self.pool.put(o);
                }
                return;
            }
        }
    }
}

impl CpuComm {
    /// The error for a buffer of `op` that is not in host memory.
    fn not_host(&self, op: &'static str) -> Error {
        self.mesh.ctx.invalid(op, "buf", "the cpu backend needs host buffers")
    }

    /// Queue `run`, admitted (see [`CpuComm::admit`]) before its input was copied.
    pub(super) fn enqueue<'a>(
        &'a self,
        targets: Few<BufMut<'a>>,
        admission: Admission,
        run: JobFn,
    ) -> Result<Work<'a>> {
        self.enqueue_lent(Few::new(), targets, Lending::No, admission, run)
    }

    /// [`CpuComm::enqueue`] of a job that reads `sources` when it runs in its caller's wait;
    /// `lent`: an input was lent.
    pub(super) fn enqueue_lent<'a>(
        &'a self,
        sources: Few<Buf<'a>>,
        targets: Few<BufMut<'a>>,
        lent: Lending,
        admission: Admission,
        run: JobFn,
    ) -> Result<Work<'a>> {
        if let Some(d) = self.mesh.mailbox.dead() {
            return Err(self.mesh.dead_err(d));
        }
        if let Some(op) = sources
            .iter()
            .any(|b| b.device().kind != DeviceKind::Cpu)
            .then_some("send")
            .or_else(|| targets.iter().any(|b| b.device().kind != DeviceKind::Cpu).then_some("recv"))
        {
            return Err(self.not_host(op));
        }
        let mut st = self.sched.lock();
        if st.closed {
            return Err(self.mesh.ctx.aborted("communicator shut down"));
        }
        let done = st.completion();
        let id = st.next_id;
        st.next_id += 1;
        // Wake the worker when it sleeps for good, or when a job is already queued (the
        // program issues several before it waits: they must progress without it) and the
        // worker would not look again within the grace.
        let wake = Sched::wakes_worker(&st);
        st.woken |= wake;
        let grace = Job::grace_for(self.sched.grace, admission.size, lent != Lending::No);
        let rescuable = matches!(lent, Lending::Rescuable { .. });
        st.jobs.push_back(Job { id, run, done: done.clone(), grace, rescuable, rest_of: None, _admission: admission });
        drop(st);
        if wake {
            self.sched.cv.notify_one();
        }
        Ok(self.work(id, done, sources, targets, lent))
    }

    /// The `Work` of queued job `id`, which reads `sources` and writes `targets` when it runs
    /// in its caller's wait.
    pub(super) fn work<'a>(
        &'a self,
        id: u64,
        done: Arc<Completion>,
        sources: Few<Buf<'a>>,
        targets: Few<BufMut<'a>>,
        lending: Lending,
    ) -> Work<'a> {
        Work::new(CpuWork {
            id,
            pool: &self.pool,
            op_timeout: self.mesh.op_timeout,
            sched: &self.sched,
            done,
            sources,
            targets,
            lending,
            prodded: false,
            delivered: false,
        })
    }

    /// A send buffer's bytes as a job's input ([`Input::of`]), lent with `lend`. A
    /// collective issued while no other operation was queued or running
    /// ([`Admission::alone`]) is likely waited for at once, and then runs on its caller's
    /// buffers: its input is lent rather than copied (a copy nothing would read; should the
    /// worker run it after all, it reads the lent bytes through the kernel). Point-to-point
    /// sends are copied: a send is often left while its receive is waited for, and then
    /// runs first, off its caller's buffers.
    pub(super) fn input(&self, op: &'static str, b: &Buf<'_>, lend: bool) -> Result<Input> {
        b.as_host_bytes().map(|s| Input::of(s, &self.pool, lend)).ok_or_else(|| self.not_host(op))
    }

    /// An in-place operation's input: the target's bytes `[at, at + len)` ([`CpuComm::input`]).
    pub(super) fn input_mut(
        &self,
        op: &'static str,
        b: &mut BufMut<'_>,
        at: usize,
        len: usize,
        lend: bool,
    ) -> Result<Input> {
        let pool = &self.pool;
        b.as_host_bytes_mut().map(|s| Input::of(&s[at..at + len], pool, lend)).ok_or_else(|| self.not_host(op))
    }
}
