//! The scheduler of a communicator's operations: a queue in issue order, the engine that
//! runs one at a time, and the worker thread, which leaves a job to a caller that waits
//! for it (then it runs on the caller's thread) before taking it.

use super::*;

pub(super) struct Job {
    /// Issue order on the communicator.
    pub(super) id: u64,
    pub(super) run: JobFn,
    pub(super) done: Arc<Completion>,
    /// How long the worker leaves the job to a caller that may come to wait for it
    /// ([`Job::grace_for`]).
    pub(super) grace: Duration,
    /// Its input is a small lent one ([`super::work::Lending::Rescuable`]).
    pub(super) rescuable: bool,
    /// The receive an operation run as it was issued left for later, of a message of this
    /// kind from this peer, or from every other rank (`None`: a direct collective among more
    /// than two; the operation's messages went already: see `eager`): it does not wait once
    /// the messages have arrived.
    pub(super) rest_of: Option<(Option<usize>, Kind)>,
    /// The job's share of the queue bound, given back when the job is dropped (it has run).
    pub(super) _admission: Admission,
}

impl Job {
    /// The worker's patience with a job before it takes it: the communicator's `grace`
    /// (`ANYCCL_CPU_HANDOFF_US`), plus, for a job that
    /// reads lent memory, about the time the worker's way costs it on top (a copy of the
    /// input in, the results out and their pages: `bytes` at 4 GB/s). A caller descheduled
    /// between issue and wait (ranks outnumbering cores) then still runs its large job on
    /// its own buffers, and a job nobody waits for starts at most that late.
    pub(super) fn grace_for(grace: Duration, bytes: usize, lent: bool) -> Duration {
        let extra = if lent { Duration::from_nanos((bytes / 4) as u64) } else { Duration::ZERO };
        grace + extra
    }
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Job")
    }
}

/// A worker that saw no job issued for this long sleeps until an enqueue wakes it.
const IDLE: Duration = Duration::from_millis(50);
/// The longest a worker sleeps between looks while jobs come and callers run them: a job
/// nobody waits for, issued after a run of jobs that were all waited for at once, starts at
/// most this late (an enqueue behind a job still queued wakes the worker at once, unless
/// callers run the queue themselves: [`SchedState::driving`]).
const MAX_POLL: Duration = Duration::from_millis(20);

/// A communicator's operations in issue order and the engine that runs them, one at a time,
/// on the worker thread or on the thread of a caller waiting for one of them.
pub(super) struct Sched {
    st: Mutex<SchedState>,
    /// The worker waits here.
    pub(super) cv: Condvar,
    /// Callers waiting for the engine ([`SchedState::helpers`]) wait here; a runner that
    /// gives the engine back wakes them.
    pub(super) freed: Condvar,
    /// How long a queued job is left to a caller that waits for it (it then runs on the
    /// caller's thread, with no hand-over between threads) before the worker takes it; also
    /// how often a worker that ran something recently looks at the queue without being
    /// woken (`ANYCCL_CPU_HANDOFF_US`).
    pub(super) grace: Duration,
    /// Bytes of results set in completions and not taken yet ([`Completion::set`],
    /// [`Completion::take`]): from [`HOLD_AHEAD`] on, the worker stops running the queue
    /// ahead of the callers' waits.
    pub(super) holding: AtomicUsize,
}

/// Results the worker may hold for callers that have not waited yet before it stops running
/// the queue ahead of them: each further job is then left to its caller for the grace (a
/// caller's wait runs it on its own buffers, with no copy in or out), or run at once for a
/// caller that waits without running it. A program that issues thousands of operations and
/// then waits for them had every result copied twice into buffers the size of its whole
/// output (20,000 of 64 KiB all_reduce issued back to back, then waited, on 2 ranks: 94-194
/// us a call against 10-16 when the callers ran them; 16 KiB: 17-30 against 4-6).
pub(super) const HOLD_AHEAD: usize = 8 << 20;

pub(super) struct SchedState {
    pub(super) jobs: std::collections::VecDeque<Job>,
    /// The engine, while no thread runs a job (the runner takes it out: boxed, so that
    /// taking it and giving it back, twice an operation, moves a pointer).
    pub(super) engine: Option<Box<Engine>>,
    pub(super) next_id: u64,
    pub(super) closed: bool,
    /// The worker sleeps until woken (it has been idle for [`IDLE`]).
    pub(super) parked: bool,
    /// An enqueue woke the worker: jobs are queued behind each other (the program does not
    /// wait for each), so the worker looks again within the grace.
    pub(super) woken: bool,
    /// The worker sleeps longer than the grace before its next look: a job queued behind
    /// another then wakes it (so the job starts within about the grace if nobody waits for
    /// it), unless callers drive the queue ([`SchedState::driving`]). While it looks within
    /// the grace anyway, an enqueue wakes nobody: a program that issues a few operations and
    /// then waits for them, over and over, would otherwise pay a wake-up and a thread switch
    /// per batch (on a host whose ranks fill its cores, a rank's CPU taken away: 8 B
    /// all_reduce 4 in flight took 1.3-1.6 us a call against 0.5 waited one by one).
    pub(super) dozing: bool,
    /// A caller waits for a queued job without running it itself (its wait is shorter than
    /// the operation timeout, or it polls): the worker runs the queue at once rather than
    /// leaving each job the grace. Cleared once the queue is empty.
    pub(super) hurry: bool,
    /// Callers blocked in a wait until the engine comes free, to run their jobs themselves:
    /// while there are any, the worker ends its run after the job it has, rather than
    /// running the queue while they sleep and waking each in turn.
    pub(super) helpers: usize,
    /// Jobs callers have run on their own buffers in their waits: while this grows, callers
    /// are taking the queue in order, and the worker leaves it to them.
    pub(super) caller_runs: u64,
    /// Callers run the queue in their waits with jobs still queued behind theirs (a
    /// pipeline: the program issues several, then waits for each): an enqueue then wakes no
    /// dozing worker, which looks at least every [`Sched::poll_for`] instead. Cleared
    /// at a look that finds no job run by a caller since the previous one (the callers
    /// stopped), when the worker takes a job that nobody came for, and when it parks.
    pub(super) driving: bool,
    /// Jobs queued that are receives left for later ([`Job::rest_of`]).
    pub(super) rests: usize,
    /// Completions kept for the next operations, oldest first ([`SchedState::completion`]).
    spare: std::collections::VecDeque<Arc<Completion>>,
}

/// How many completions a scheduler keeps for reuse: as many operations in flight take no
/// allocation for theirs.
const SPARE: usize = 64;

impl SchedState {
    /// Nothing queued, nothing issued yet, `engine` free (if given).
    fn new(engine: Option<Box<Engine>>) -> SchedState {
        SchedState {
            jobs: Default::default(),
            engine,
            next_id: 0,
            closed: false,
            parked: false,
            woken: false,
            dozing: false,
            hurry: false,
            helpers: 0,
            caller_runs: 0,
            driving: false,
            rests: 0,
            spare: Default::default(),
        }
    }

    /// A completion for a new job: the oldest kept one when nothing else holds it any more
    /// (its job has run and its `Work` is gone), else a new one, kept too while there is
    /// room. (An allocation and its release were a tenth of an 8-byte operation's own cost.)
    pub(super) fn completion(&mut self) -> Arc<Completion> {
        if let Some(mut c) = self.spare.pop_front() {
            match Arc::get_mut(&mut c) {
                Some(free) => {
                    *free = Completion::default();
                    self.spare.push_back(c.clone());
                    return c;
                }
                None => self.spare.push_front(c),
            }
        }
        let c = Arc::new(Completion::default());
        if self.spare.len() < SPARE {
            self.spare.push_back(c.clone());
        }
        c
    }
}

impl std::fmt::Debug for Sched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sched")
    }
}

impl Sched {
    /// A scheduler with `engine` free and nothing queued, leaving jobs to their callers for
    /// `grace`.
    pub(super) fn new(engine: Engine, grace: Duration) -> Sched {
        Sched {
            st: Mutex::new(SchedState::new(Some(Box::new(engine)))),
            cv: Condvar::new(),
            freed: Condvar::new(),
            grace,
            holding: AtomicUsize::new(0),
        }
    }

    /// The worker's `poll`, at most four times the grace (2 ms by default) while callers
    /// drive the queue ([`SchedState::driving`]), when no enqueue wakes it: a job nobody
    /// waits for, issued after a pipeline, then starts within about this and the grace (the
    /// next look finds that no caller ran a job, and the job then has its grace). A look
    /// every twice the grace made about twice the context switches (2 ranks, 64 KiB
    /// all_reduce 16 in flight: about 2,400 for 20,000 calls against 1,300, and 7 % against
    /// 1 % slower than waited one by one).
    fn poll_for(&self, st: &SchedState, poll: Duration) -> Duration {
        if st.driving {
            poll.min(self.grace * 4)
        } else {
            poll
        }
    }

    /// Whether an enqueue behind a queued job should wake the worker: it sleeps past the
    /// grace and no wake-up is on its way. (While callers drive the queue it is not dozing:
    /// a wake-up there took a rank's CPU for a look that found the job left to its caller,
    /// 2 ranks, 64 KiB all_reduce 16 in flight, 7,000-7,700 context switches for 20,000 calls
    /// against about 350 waited one by one, 12.6-13.6 us a call against 10.8-12.4.)
    pub(super) fn wakes_worker(st: &SchedState) -> bool {
        st.parked || (st.dozing && !st.jobs.is_empty() && !st.woken)
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, SchedState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Run the first queued job (the engine must be free), with `st` unlocked meanwhile;
    /// `direct` goes to it if it is job `direct.0`, and its result then comes back here
    /// instead of through its completion (the caller that ran it is the one that waits).
    pub(super) fn run_front<'g>(
        &'g self,
        mut st: std::sync::MutexGuard<'g, SchedState>,
        direct: Option<(u64, Direct<'_>)>,
    ) -> (std::sync::MutexGuard<'g, SchedState>, Option<Done>) {
        let (Some(job), Some(mut engine)) = (st.jobs.pop_front(), st.engine.take()) else { return (st, None) };
        st.rests -= usize::from(job.rest_of.is_some());
        drop(st);
        let direct = direct.and_then(|(id, d)| (id == job.id).then_some(d));
        let mine = direct.is_some();
        if job.rescuable && !mine {
            engine.current = Some(job.done.clone());
        }
        let r = run_job(&mut engine, job.run, direct);
        engine.current = None;
        let r = if mine {
            Some(r)
        } else {
            job.done.set(r, &self.holding);
            None
        };
        drop(job._admission);
        let mut st = self.lock();
        st.engine = Some(engine);
        st.caller_runs += u64::from(mine);
        st.driving |= mine && !st.jobs.is_empty();
        if st.helpers > 0 {
            self.freed.notify_all();
        }
        (st, r)
    }

    /// The worker holds as many results ahead of their callers' waits as it may
    /// ([`HOLD_AHEAD`]).
    fn holds_enough(&self) -> bool {
        self.holding.load(Ordering::Relaxed) >= HOLD_AHEAD
    }

    /// A caller waits for a job that it will not run itself: have the worker run the queue
    /// now (it would otherwise leave each job the grace, or look only at its next poll).
    pub(super) fn hurry(&self) {
        let mut st = self.lock();
        if st.jobs.is_empty() || st.hurry {
            return;
        }
        st.hurry = true;
        drop(st);
        self.cv.notify_one();
    }

    /// Wait at most `slice` for the engine to come free, if a job runs now (the caller then
    /// runs its own job, or finds it run).
    pub(super) fn wait_engine(&self, slice: Duration) {
        let mut st = self.lock();
        if st.engine.is_some() {
            return;
        }
        st.helpers += 1;
        st = self.freed.wait_timeout(st, slice).unwrap_or_else(|p| p.into_inner()).0;
        st.helpers -= 1;
    }
}

/// Run one job on the engine; a failure (or a panic) fails the whole communicator.
pub(super) fn run_job(engine: &mut Engine, run: JobFn, direct: Option<Direct<'_>>) -> Done {
    guarded(engine, |e| run(e, direct))
}

/// Run `f` on the engine as a job runs: not once the communicator has failed; a panic fails
/// it, and so does an error (other than its abort), naming the peer where one failed.
pub(super) fn guarded<T>(
    engine: &mut Engine,
    f: impl FnOnce(&mut Engine) -> Result<T>,
) -> std::result::Result<T, Box<Error>> {
    if let Some(d) = engine.mesh.mailbox.dead() {
        return Err(Box::new(engine.mesh.dead_err(d)));
    }
    // A panic in an operation must not take the worker (and every later Work) with it: it
    // fails the communicator like any error.
    let Ok(r) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(engine))) else {
        // No library failed (there is no code to give): the communicator is gone, and every
        // peer hears why.
        let why = "an operation panicked; communicator failed";
        engine.mesh.kill(Dead { aborted: false, peer: None, detail: why.into() });
        return Err(Box::new(engine.mesh.ctx.aborted(why)));
    };
    let r = r.map_err(Box::new);
    if let Err(e) = &r {
        // A failed collective leaves peers mid-protocol: fail the whole communicator so
        // every rank hears of it at once.
        if !matches!(**e, Error::Aborted { .. }) {
            let peer = if let Error::PeerFailed { peer, .. } = **e { peer } else { None };
            engine.mesh.kill(Dead { aborted: false, peer, detail: format!("failed earlier: {e}") });
        }
    }
    r
}

/// The worker: runs queued jobs in order, leaving a job that was just queued to its caller
/// for [`Sched::grace`].
pub(super) fn worker_loop(sched: &Sched) {
    let mut st = sched.lock();
    let mut idle_since = Instant::now();
    // The front job when the worker first saw it, and when: a job is the worker's once it
    // has waited [`Sched::grace`] (no clock is read when a job is queued).
    let mut seen: Option<(u64, Instant)> = None;
    // How long the worker sleeps when nothing is its own: the grace after it ran a job or
    // was woken, doubling (to [`MAX_POLL`]) while callers run their own jobs, so that a
    // program waiting for each operation is not interrupted thousands of times a second.
    let mut poll = sched.grace;
    // Jobs issued when the worker last looked: any issued since count as activity (it then
    // does not park, which would make every enqueue wake it).
    let mut issued = st.next_id;
    // Jobs callers had run in their waits when the worker last looked.
    let mut callers_ran = st.caller_runs;
    // Jobs callers had run at the last look while they drove the queue.
    let mut drove = st.caller_runs;
    loop {
        if st.closed && st.jobs.is_empty() {
            return;
        }
        if st.driving && st.caller_runs == drove {
            // The callers ran none of the queue since the last look: they stopped driving
            // it, and a job nobody waits for is taken within the grace again.
            st.driving = false;
        }
        drove = st.caller_runs;
        if st.next_id != issued {
            issued = st.next_id;
            idle_since = Instant::now();
        }
        if std::mem::take(&mut st.woken) {
            poll = sched.grace;
        }
        let Some(front) = st.jobs.front() else {
            seen = None;
            st.hurry = false;
            if idle_since.elapsed() >= IDLE && !st.closed {
                st.parked = true;
                st.driving = false;
                st = sched.cv.wait(st).unwrap_or_else(|p| p.into_inner());
                st.parked = false;
                idle_since = Instant::now();
            } else {
                let pause = sched.poll_for(&st, poll);
                st.dozing = pause > sched.grace && !st.driving;
                st = sched.cv.wait_timeout(st, pause).unwrap_or_else(|p| p.into_inner()).0;
                st.dozing = false;
                poll = (poll * 2).min(MAX_POLL);
            }
            continue;
        };
        idle_since = Instant::now();
        let (id, patience) = (front.id, front.grace);
        let first_seen = match seen {
            Some((i, t)) if i == id => t,
            _ => {
                let now = Instant::now();
                seen = Some((id, now));
                now
            }
        };
        let mut age = first_seen.elapsed();
        if age >= patience && st.caller_runs != callers_ran && !st.closed && !st.hurry {
            // Callers ran jobs in their waits since the last look: they take the queue in
            // order, each on its own buffers (no copy in or out). Taking the next job now
            // would make its caller wait for the worker and copy its result, on a host
            // whose cores the ranks fill with two threads each running (2 ranks, 2 MiB
            // all_reduce, 16 issued then waited: 277-305 us a call against 149-152 waited
            // one by one). Leave the front its patience again; once callers stop
            // running jobs, the worker takes them.
            callers_ran = st.caller_runs;
            seen = Some((id, Instant::now()));
            age = Duration::ZERO;
        }
        if st.engine.is_none() || st.helpers > 0 || (age < patience && !st.closed && !st.hurry) {
            // A caller runs a job, waits to run its own, or may take this one: look again
            // later (within the grace once callers stop waiting: the jobs nobody waits for
            // must go on).
            let pause = if st.helpers > 0 {
                sched.grace
            } else if st.engine.is_none() {
                sched.poll_for(&st, poll)
            } else if st.driving {
                // Callers run the queue: looked at again after the patience left or the
                // poll, whichever is longer (a look that finds no caller ran a job since
                // ends the driving, and the job then has its patience).
                patience.saturating_sub(age).max(sched.poll_for(&st, poll))
            } else {
                patience.saturating_sub(age)
            };
            let pause = pause.max(Duration::from_micros(50));
            // Dozing only on the long look while callers run jobs: a front job left to its
            // caller is looked at again when its patience ends, which a wake-up would not
            // bring forward (its grace grows with a lent input's size, so that sleep was
            // taken for dozing and every enqueue behind it woke the worker, which took a
            // rank's CPU: 2 ranks, 64 KiB all_reduce 4 in flight, 36,000 wake-ups a second,
            // 13.6-14.3 us a call against 11.5-12.2 waited; now 12.4).
            st.dozing = st.engine.is_none() && st.helpers == 0 && pause > sched.grace && !st.driving;
            st = sched.cv.wait_timeout(st, pause).unwrap_or_else(|p| p.into_inner()).0;
            st.dozing = false;
            poll = (poll * 2).min(MAX_POLL);
            continue;
        }
        // A job nobody came for: the callers no longer run the queue themselves.
        st.driving = false;
        st = sched.run_front(st, None).0;
        // The jobs queued behind it are run at once: their callers are not waiting yet. A
        // caller that waits runs its own (and those before it) on its thread. Past
        // `HOLD_AHEAD` of results not taken, each job is left to its caller for the grace
        // again (unless a caller hurries it).
        while st.engine.is_some() && !st.jobs.is_empty() && st.helpers == 0 && (st.hurry || !sched.holds_enough()) {
            st = sched.run_front(st, None).0;
        }
        idle_since = Instant::now();
        poll = sched.grace;
    }
}

#[derive(Default)]
pub(super) struct Completion {
    pub(super) slot: Mutex<Option<Done>>,
    pub(super) cv: Condvar,
    /// Threads blocked on `cv` (a completion nobody waits for is set without a wake-up).
    pub(super) waiters: AtomicUsize,
    /// Set once `slot` holds the result: a caller about to block looks at it for a while
    /// first (see [`Completion::spin`]).
    pub(super) done: std::sync::atomic::AtomicBool,
    /// Its `Work` went without the result (changed under `slot`'s lock): a result set after
    /// that is dropped, not kept in a completion waiting for reuse.
    pub(super) abandoned: std::sync::atomic::AtomicBool,
    /// A small lent input: whether the job read it, or the copy its dropped `Work` left.
    pub(super) rescue: Mutex<Rescue>,
}

/// The bytes of a result's outputs (what it counts in [`Sched::holding`] while it is set).
fn held_bytes(r: &Done) -> usize {
    r.as_ref().map_or(0, |outs| outs.iter().flatten().map(Vec::len).sum())
}

/// See [`Completion::rescue`].
#[derive(Default)]
pub(super) struct Rescue {
    pub(super) taken: bool,
    pub(super) copy: Option<Vec<u8>>,
}

impl Completion {
    /// Wait on `g` for at most `slice`, counted among the waiters.
    pub(super) fn park<'g>(
        &self,
        g: std::sync::MutexGuard<'g, Option<Done>>,
        slice: Duration,
    ) -> std::sync::MutexGuard<'g, Option<Done>> {
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let g = self.cv.wait_timeout(g, slice).unwrap_or_else(|p| p.into_inner()).0;
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        g
    }

    /// Look for the result for at most `SPIN` before the caller blocks: the worker that was
    /// just asked to run the job (a small one takes microseconds) then sets it without a
    /// wake-up, which costs tens of microseconds on a host whose cores are all busy (the
    /// caller looks at `slot` again after it).
    pub(super) fn spin(&self) {
        const SPIN: Duration = Duration::from_micros(50);
        let start = Instant::now();
        loop {
            for _ in 0..64 {
                if self.done.load(Ordering::Acquire) {
                    return;
                }
                std::hint::spin_loop();
            }
            if start.elapsed() >= SPIN {
                return;
            }
            std::thread::yield_now();
        }
    }

    /// The job reads its small lent input into `dst`: the copy its dropped `Work` left, or
    /// through `read`; either way under the lock a dropping `Work` takes, so that the caller's
    /// buffer is not released while the job reads it.
    pub(super) fn take_input(&self, dst: &mut [u8], read: impl FnOnce(&mut [u8]) -> Result<()>) -> Result<()> {
        let mut r = self.rescue.lock().unwrap_or_else(|p| p.into_inner());
        r.taken = true;
        match r.copy.take() {
            Some(c) if c.len() == dst.len() => {
                dst.copy_from_slice(&c);
                Ok(())
            }
            _ => read(dst),
        }
    }

    /// Take the result out of `slot` (locked as `g`), giving back what it counted in
    /// `holding` (its scheduler's [`Sched::holding`]).
    pub(super) fn take(&self, g: &mut Option<Done>, holding: &AtomicUsize) -> Option<Done> {
        let r = g.take()?;
        holding.fetch_sub(held_bytes(&r), Ordering::Relaxed);
        Some(r)
    }

    /// Set the result, counting its bytes in `holding` (its scheduler's [`Sched::holding`])
    /// until it is taken ([`Completion::take`]); a result nobody will take is dropped.
    pub(super) fn set(&self, r: Done, holding: &AtomicUsize) {
        let mut g = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        let unwanted = if self.abandoned.load(Ordering::Relaxed) {
            Some(r)
        } else {
            holding.fetch_add(held_bytes(&r), Ordering::Relaxed);
            // (A completion is set once; one set again gives back what it held.)
            let old = self.take(&mut g, holding);
            *g = Some(r);
            old
        };
        drop(g);
        drop(unwanted);
        self.done.store(true, Ordering::Release);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.cv.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> SchedState {
        SchedState::new(None)
    }

    /// A completion is given again once only the scheduler holds it, emptied; never while a
    /// job or a `Work` holds it.
    #[test]
    fn completions_are_reused_only_when_free() {
        let mut st = state();
        let a = st.completion();
        a.set(Ok(smallvec::smallvec![Some(vec![1u8; 8])]), &AtomicUsize::new(0));
        let b = st.completion();
        assert!(!Arc::ptr_eq(&a, &b), "a completion still held was given again");
        drop(a);
        let c = st.completion();
        assert!(Arc::ptr_eq(&st.spare[st.spare.len() - 1], &c), "the free completion was not reused");
        assert!(c.slot.lock().unwrap().is_none() && !c.done.load(Ordering::Relaxed), "reused with the old result");
        drop((b, c));
        let kept = (0..SPARE + 10).map(|_| st.completion()).collect::<Vec<_>>();
        assert_eq!(st.spare.len(), SPARE, "more completions kept than SPARE");
        drop(kept);
    }

    /// A result set after its `Work` went without it is dropped, not kept in the completion.
    #[test]
    fn a_result_nobody_takes_is_not_kept() {
        let mut st = state();
        let done = st.completion();
        let holding = AtomicUsize::new(0);
        done.abandoned.store(true, Ordering::Relaxed);
        done.set(Ok(smallvec::smallvec![Some(vec![0u8; 1 << 20])]), &holding);
        assert!(done.slot.lock().unwrap().is_none(), "an abandoned result was kept");
        assert!(done.done.load(Ordering::Acquire));
        assert_eq!(holding.load(Ordering::Relaxed), 0, "an abandoned result was counted as held");
    }

    /// A result set counts its bytes as held until it is taken; an error counts nothing.
    #[test]
    fn held_results_are_counted_until_taken() {
        let mut st = state();
        let holding = AtomicUsize::new(0);
        let (a, b, c) = (st.completion(), st.completion(), st.completion());
        a.set(Ok(smallvec::smallvec![Some(vec![0u8; 3000]), None, Some(vec![0u8; 96])]), &holding);
        b.set(Ok(smallvec::smallvec![Some(vec![0u8; 5000])]), &holding);
        c.set(Err(Box::new(anyccl_core::Ctx::new("cpu", 0, "g").aborted("x"))), &holding);
        assert_eq!(holding.load(Ordering::Relaxed), 8096);
        let taken = a.take(&mut a.slot.lock().unwrap(), &holding);
        assert!(taken.is_some_and(|r| r.is_ok_and(|o| o.len() == 3)), "the result was not given");
        assert_eq!(holding.load(Ordering::Relaxed), 5000, "a taken result still counted");
        assert!(a.take(&mut a.slot.lock().unwrap(), &holding).is_none(), "a result taken twice");
        assert!(c.take(&mut c.slot.lock().unwrap(), &holding).is_some_and(|r| r.is_err()));
        assert!(b.take(&mut b.slot.lock().unwrap(), &holding).is_some());
        assert_eq!(holding.load(Ordering::Relaxed), 0);
    }
}
