//! Operations on the stream, in order: numbering, marks (the events that settle `Work`s),
//! launches the library answered "in progress", and the launch itself.

use super::marks::RECLAIM_FROM;
use super::*;

impl<L: Library> DeviceComm<L> {
    /// Make sure a mark follows operation `op`: the newest, if it does, else one recorded
    /// now at the stream's end (following every operation placed so far). The device must
    /// be current. A mark that cannot be recorded leaves operations on the stream that
    /// nothing tracks: the caller fails the communicator (outside the call lock) rather than
    /// let a caller reuse buffers they may still touch.
    pub(super) fn mark_following(&self, op: u64) -> Result<()> {
        let mut marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        if marks.live.back().is_some_and(|(seq, _)| *seq >= op) || marks.seen_done >= op {
            return Ok(());
        }
        self.record_mark(&mut marks)
    }

    /// Before anything more goes on the stream (the call lock held): the mark owed to the
    /// newest operation issued with a `Work`, so that it follows that operation alone. None
    /// where the operation is known done (its `Work` was waited before this call: the stream
    /// was asked, no event was recorded) or a mark follows it already. A mark that cannot be
    /// recorded leaves an operation on the stream that nothing tracks: the caller fails the
    /// communicator (outside the call lock) rather than let a caller reuse buffers the
    /// device may still touch.
    #[inline]
    pub(super) fn mark_owed(&self) -> Result<()> {
        let owed = self.owed.load(Ordering::Acquire);
        if owed > self.finished_upto.load(Ordering::Acquire) {
            return self.mark_following(owed);
        }
        Ok(())
    }

    /// Record a mark at the stream's end, on a spare event if there is one.
    fn record_mark(&self, marks: &mut Marks<Event<L>>) -> Result<()> {
        // Read before the record: every operation counted was enqueued before it.
        let seq = self.placed.load(Ordering::Acquire);
        if marks.spare.is_empty() && marks.live.len() >= RECLAIM_FROM {
            // Many marks nobody asked about yet: the events of those done are spare.
            if let Some(upto) = marks.newest_done(|e| self.rt.done(e))? {
                marks.done_upto(upto);
            }
        }
        let event = match marks.spare.pop() {
            Some(e) => match self.rt.record_again(&e, &self.stream) {
                Ok(()) => e,
                Err(err) => {
                    marks.spare.push(e);
                    return Err(err);
                }
            },
            None => self.rt.record(&self.stream)?,
        };
        marks.live.push_back((seq, event));
        Ok(())
    }

    /// Follow every operation placed so far with a mark, if the newest does not: before
    /// this communicator's stream may join a graph capture (a mark recorded during it would
    /// be part of the graph), and before an engine's stream is signalled (a later first
    /// look then finds a mark the engine's stream has passed). Takes the call lock `g` and
    /// gives it back; where the record fails, the lock is released and the communicator
    /// failed.
    pub(super) fn mark_placed<G>(&self, g: G) -> Result<G> {
        let n = self.placed.load(Ordering::Acquire);
        if n > self.finished_upto.load(Ordering::Acquire) {
            if let Err(e) = self.mark_following(n) {
                drop(g);
                self.fail(&e);
                return Err(e);
            }
        }
        Ok(g)
    }

    /// Whether operation `op` is done (the device must be current): asked of the first mark
    /// that follows it. Where none does and nothing was put on the stream after it (a `Work`
    /// waited before the next call), of the stream itself if the runtime can say; else a
    /// mark is recorded now (also shared completion's first look). When it is done, the
    /// operations that mark follows are settled, with those of the newest mark if that is
    /// done too, and the library's asynchronous error is checked once for all of them.
    pub(super) fn look(&self, op: u64) -> Result<bool> {
        if self.finished_upto.load(Ordering::Acquire) >= op {
            return Ok(true);
        }
        let upto = {
            let mut marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
            if marks.seen_done < op && marks.following(op).is_none() {
                // Where nothing was put on the stream after `op` (by default, each call
                // first records the mark owed to the one before it, under this lock), the
                // stream is done exactly when `op` is: asked where the runtime can. Not
                // yet: by default a later call gives `op` its mark, which the next look
                // asks; with shared completion a mark is recorded now, so that `op` has
                // one of its own.
                let placed = self.placed.load(Ordering::Acquire);
                let asked = if placed == op { self.rt.stream_done(&self.stream)? } else { None };
                match asked {
                    Some(true) => marks.done_upto(op),
                    Some(false) if !self.shared_completion => return Ok(false),
                    _ => {
                        if let Err(e) = self.record_mark(&mut marks) {
                            drop(marks);
                            self.fail(&e);
                            return Err(e);
                        }
                    }
                }
            }
            if marks.seen_done < op {
                let Some((seq, e)) = marks.following(op) else { return Ok(false) };
                if !self.rt.done(e)? {
                    return Ok(false);
                }
                // Usually the operations after it are done too (waits come after a run of
                // launches): one more look settles all of them.
                let upto = match marks.live.back() {
                    Some((newest, e)) if newest > seq && self.rt.done(e).unwrap_or(false) => *newest,
                    _ => *seq,
                };
                marks.done_upto(upto);
            }
            marks.seen_done
        };
        // A failed operation still lets the stream move on: finished means succeeded only
        // if the library reported no error.
        self.poll_async(Plane::Data, "wait")?;
        self.finished_upto.fetch_max(upto, Ordering::AcqRel);
        Ok(true)
    }

    /// If an operation is still being launched, see whether the library is done with it
    /// and, if so, number it. `Ok(true)` while it is still in progress.
    pub(super) fn resolve_pending(&self, op: &str) -> Result<bool> {
        if !self.pending_set.load(Ordering::Acquire) {
            return Ok(false);
        }
        let Some(slot) = self.pending.lock().unwrap_or_else(|e| e.into_inner()).clone() else { return Ok(false) };
        // Asked without the pending lock: a failure here fails the communicator, whose
        // release waits for the call lock, and the holder of that lock may be about to take
        // the pending lock (the order is call lock, then pending).
        let r = self.poll_async(Plane::Data, op);
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if !p.as_ref().is_some_and(|s| Arc::ptr_eq(s, &slot)) {
            // Another look resolved it meanwhile (a newer launch may be pending now).
            return r.map(|_| p.is_some());
        }
        match r {
            Ok(true) => Ok(true),
            Ok(false) => {
                // No other call was made while it was pending (`lock_settled`): the next
                // number is its own, and a mark recorded now follows it alone.
                let n = self.placed.fetch_add(1, Ordering::AcqRel) + 1;
                let mark = if self.shared_completion { Ok(()) } else { self.mark_following(n) };
                match mark {
                    Ok(()) => {
                        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(Ok(n));
                        *p = None;
                        self.pending_set.store(false, Ordering::Release);
                        Ok(false)
                    }
                    Err(e) => {
                        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(Err(e.to_string()));
                        *p = None;
                        self.pending_set.store(false, Ordering::Release);
                        drop(p);
                        // Outside the pending lock (see above).
                        self.fail(&e);
                        Err(e)
                    }
                }
            }
            Err(e) => {
                *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(Err(e.to_string()));
                *p = None;
                self.pending_set.store(false, Ordering::Release);
                Err(e)
            }
        }
    }

    /// Wait until no operation is being launched (a previous first call still connecting).
    #[inline]
    pub(super) fn settle(&self, op: &str) -> Result<()> {
        // Nothing pending (every call but a first one that connects): no call, no clock read.
        if !self.pending_set.load(Ordering::Acquire) {
            return Ok(());
        }
        self.settle_pending(op)
    }

    /// [`DeviceComm::settle`] while a launch is pending.
    #[cold]
    #[inline(never)]
    fn settle_pending(&self, op: &str) -> Result<()> {
        let mut deadline = None;
        let mut spins = 0u32;
        while self.resolve_pending(op)? {
            let deadline = *deadline.get_or_insert_with(|| anyccl_core::deadline_in(self.settings.enqueue_timeout));
            if Instant::now() > deadline {
                return Err(self.timed_out(
                    op,
                    self.settings.enqueue_timeout,
                    "an earlier operation never finished connecting",
                ));
            }
            backoff(&mut spins);
        }
        Ok(())
    }

    /// The call lock, live, with no operation still being launched: settled first, and
    /// checked again under the lock, since another thread's launch may have come back in
    /// progress between the two.
    ///
    /// # Errors
    /// As [`DeviceComm::settle`] and [`DeviceComm::lock_live`].
    pub(super) fn lock_settled(&self, op: &str) -> Result<MutexGuard<'_, ()>> {
        loop {
            self.settle(op)?;
            let g = self.lock_live()?;
            // Set only under the call lock, which is held: clear means nothing pending.
            if !self.pending_set.load(Ordering::Acquire) {
                return Ok(g);
            }
            drop(g);
            std::thread::yield_now();
        }
    }

    /// [`DeviceComm::lock_settled`] for releasing something the library holds: `None` where
    /// the communicator failed or was freed meanwhile (destroying it drops what it held).
    pub(super) fn lock_settled_unless_gone(&self, op: &str) -> Result<Option<MutexGuard<'_, ()>>> {
        match self.lock_settled(op) {
            Ok(g) => Ok(Some(g)),
            Err(_) if self.dead().is_some() || self.freed.load(Ordering::Acquire) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Put `op` on the stream and return a `Work` for it.
    ///
    /// # Safety
    /// As [`Library::launch`]: the addresses were validated by the `Communicator` and the
    /// buffers they come from stay borrowed by the returned `Work`.
    pub(super) unsafe fn launch(&self, op: Op) -> Result<Work<'_>> {
        // SAFETY: per this function's contract.
        let w = unsafe { self.launch_op(&op, true) }?;
        w.ok_or_else(|| self.ctx.aborted("no completion handle for a marked launch".to_string()))
    }

    /// Put `op` on the stream, in stream order only: no mark and no `Work`.
    ///
    /// # Safety
    /// As [`Library::launch`]; the caller keeps the buffers allocated until the stream has
    /// passed the operation.
    pub(super) unsafe fn launch_unmarked(&self, op: Op) -> Result<()> {
        // SAFETY: per this function's contract.
        unsafe { self.launch_op(&op, false) }.map(|_| ())
    }

    /// Put `op` on the stream; with `mark`, a `Work` follows it.
    ///
    /// # Safety
    /// As [`DeviceComm::launch`].
    pub(super) unsafe fn launch_op(&self, op: &Op, mark: bool) -> Result<Option<Work<'_>>> {
        let name = op.name();
        if let Some(e) = self.dead() {
            return Err(e);
        }
        self.rt.bind()?;
        let g = self.lock_settled(name)?;
        if let Err(e) = self.mark_owed() {
            drop(g);
            self.fail(&e);
            return Err(e);
        }
        let (g, launched) = self.watched_call_locked(g, name, || {
            // SAFETY: per this function's contract; the call lock is held.
            unsafe { self.lib.launch(&self.comm, &self.stream, op) }
        })?;
        if launched == Launched::InProgress {
            self.in_progress_returns.fetch_add(1, Ordering::Relaxed);
            let slot: Arc<LaunchSlot> = Arc::default();
            // Set while the lock is held, so no other launch can slip in between.
            // The flag under the pending lock too: a look that empties the slot at once (its
            // communicator failed) then clears the flag after this sets it.
            let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            *p = Some(slot.clone());
            self.pending_set.store(true, Ordering::Release);
            drop(p);
            drop(g);
            if !mark {
                return Ok(None);
            }
            return Ok(Some(Work::new(DeviceWork { comm: self, state: WorkState::Launching(slot) })));
        }
        let n = self.placed.fetch_add(1, Ordering::AcqRel) + 1;
        if mark && !self.shared_completion {
            // Its mark is recorded before anything else goes on the stream (the next call's
            // `mark_owed`, under the call lock), so it follows this operation alone; a wait
            // before that asks the stream instead, and no event is recorded at all.
            self.owed.store(n, Ordering::Release);
        }
        drop(g);
        if !mark {
            return Ok(None);
        }
        Ok(Some(Work::tracked(self, n)))
    }
}
