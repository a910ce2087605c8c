//! `Collective` for [`DeviceComm`]: each operation as an [`Op`] with device addresses
//! (in-place offsets worked out once here), and the lifecycle calls.

use super::{backoff, fresh_comm, DeviceComm, Lifecycle};
use crate::library::{Library, Op, Parts, Plane, RawP2P, Region, Settings, SplitRequest, SplitStart};
use crate::runtime::Runtime;
use anyccl_core::{
    async_trait, AllToAllSplits, Buf, BufMut, Capabilities, Collective, CommInfo, DeviceMemory, GraphOp, P2POp,
    ReduceOp, RegHandle, Result, StreamRef, Work,
};
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[async_trait]
impl<L: Library> Collective for DeviceComm<L> {
    fn info(&self) -> &CommInfo {
        &self.info
    }
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn wait_stream(&self, stream: StreamRef<'_>) -> Result<()> {
        // Under the call lock, so "operations issued after this call" is well defined
        // against launches from other threads.
        self.rt.bind()?;
        let g = self.lock_settled("wait_stream")?;
        // The engine's stream may be capturing: waiting on it brings this stream into the
        // capture, where a mark must not be recorded.
        let _g = self.mark_placed(g)?;
        // SAFETY: the Communicator checked the device; the caller vouched for the stream
        // (`StreamRef::from_raw`).
        unsafe { self.rt.wait_raw(&self.stream, stream.as_ptr()) }
    }

    fn signal_stream(&self, stream: StreamRef<'_>) -> Result<()> {
        self.rt.bind()?;
        // An operation the library is still putting on the stream must be there first.
        let g = self.lock_settled("signal_stream")?;
        // So a `Work` first looked at after the engine's stream has passed this point finds
        // its mark done, with no event to record and wait for then.
        let _g = self.mark_placed(g)?;
        // SAFETY: as in `wait_stream`.
        unsafe { self.rt.signal_raw(&self.stream, stream.as_ptr()) }
    }

    fn enqueue(&self, op: GraphOp) -> Result<()> {
        let GraphOp::AllReduce { send, recv, count, dtype, op } = op;
        let op = Op::AllReduce { send: send as *const c_void, recv: recv as *mut c_void, count, dtype, op };
        // SAFETY: the Communicator validated the addresses, and its `Captured` keeps the
        // buffers allocated until the engine's stream has passed the operation.
        unsafe { self.launch_unmarked(op) }
    }

    fn capture(&self, stream: StreamRef<'_>, op: GraphOp) -> Result<()> {
        let raw = stream.as_ptr();
        self.rt.bind()?;
        let g = self.lock_settled("capture")?;
        // SAFETY: the caller vouched for the stream (`StreamRef::from_raw`).
        if !unsafe { self.rt.capturing(raw) }? {
            return Err(self.ctx.invalid(
                "capture",
                "stream",
                "the stream is not capturing a graph (begin the capture first; an invalidated capture records \
                 nothing more)",
            ));
        }
        // Operations not followed by a mark yet get one now: recorded once this stream has
        // joined the capture, it would be part of the graph.
        let g = self.mark_placed(g)?;
        let GraphOp::AllReduce { send, recv, count, dtype, op } = op;
        let op = Op::AllReduce { send: send as *const c_void, recv: recv as *mut c_void, count, dtype, op };
        // Where the runtime can launch on the engine's stream itself, the operation goes
        // there, in the capture's own order, with nothing between streams to keep alive for
        // the graph's replays. Elsewhere, fork: this communicator's stream joins the capture
        // after the engine's work so far; the operation is recorded, not run; join (below):
        // the engine's stream continues after it.
        // SAFETY: as above; the borrowed stream is dropped before this call returns.
        let borrowed = unsafe { self.rt.borrow_raw(raw) };
        if borrowed.is_none() {
            // SAFETY: as above.
            unsafe { self.rt.wait_raw(&self.stream, raw) }?;
        }
        // Watched like every launch (a call blocked inside the library is ended by the
        // watchdog); a library error fails the communicator there.
        let (g, launched) = self.watched_call_locked(g, "capture", || {
            // SAFETY: the Communicator validated the addresses, and its `Captured` keeps the
            // buffers allocated for as long as the graph may replay; the call lock is held.
            unsafe { self.lib.launch(&self.comm, borrowed.as_ref().unwrap_or(&self.stream), &op) }
        })?;
        if launched == crate::library::Launched::InProgress {
            drop(g);
            let e = self.ctx.aborted("the library could not put the operation into the graph at once".to_string());
            self.fail(&e);
            return Err(e);
        }
        if borrowed.is_some() {
            return Ok(());
        }
        // SAFETY: as above.
        unsafe { self.rt.signal_raw(&self.stream, raw) }
    }

    fn register(&self, buf: Buf<'_>) -> Result<Option<RegHandle>> {
        self.rt.bind()?;
        let _g = self.lock_settled("register")?;
        // SAFETY: the Communicator checked that the view is this device's memory, and its
        // `Registered` owns that memory until it has called `deregister`.
        let h = unsafe { self.lib.register(&self.comm, Region { ptr: buf.ptr() as *mut c_void, bytes: buf.bytes() }) };
        // A refused registration leaves the communicator as it was: only this call fails.
        h.map(|h| h.map(RegHandle)).map_err(|e| e.into_error(&self.ctx, "register", Duration::ZERO))
    }

    fn deregister(&self, handle: RegHandle) -> Result<()> {
        self.rt.bind()?;
        let Some(_g) = self.lock_settled_unless_gone("deregister")? else { return Ok(()) };
        if self.freed.load(Ordering::Acquire) {
            // Destroying the communicator dropped its registrations.
            return Ok(());
        }
        self.lib.deregister(&self.comm, handle.0).map_err(|e| e.into_error(&self.ctx, "deregister", Duration::ZERO))
    }

    async fn register_window(
        &self,
        buf: Buf<'_>,
        refusal: Option<&str>,
        deadline: Instant,
    ) -> Result<Option<RegHandle>> {
        if let Some(e) = self.dead() {
            return Err(e);
        }
        let bytes = buf.bytes();
        self.rt.bind()?;
        let refusal = match refusal {
            Some(why) => Some(why.to_string()),
            None if self.caps.windows => self.lib.window_refusal(Region { ptr: buf.ptr() as *mut c_void, bytes }),
            None => None,
        };
        let seq = self.windows.fetch_add(1, Ordering::Relaxed);
        let who = (self.info.rank, self.info.size);
        anyccl_core::agree_window(
            &*self.store,
            &self.ns,
            &self.ctx.group,
            who,
            seq,
            bytes,
            refusal.as_deref(),
            deadline,
        )
        .await?;
        if !self.caps.windows {
            return Ok(None);
        }
        // The agreement may have resumed on another thread.
        self.rt.bind()?;
        let g = self.lock_settled("register_window")?;
        let at = Region { ptr: buf.ptr() as *mut c_void, bytes };
        let (_g, h) = self.watched_call_locked(g, "register_window", || {
            // SAFETY: the Communicator checked that the view is this device's memory, and its
            // `Registered` owns that memory until it has called `deregister_window`.
            unsafe { self.lib.register_window(&self.comm, at) }
        })?;
        Ok(h.map(RegHandle))
    }

    fn deregister_window(&self, handle: RegHandle) -> Result<()> {
        self.rt.bind()?;
        if self.freed.load(Ordering::Acquire) || self.dead().is_some() {
            // Destroying (or aborting) the communicator drops its windows.
            return Ok(());
        }
        let Some(g) = self.lock_settled_unless_gone("deregister_window")? else { return Ok(()) };
        self.watched_call_locked(g, "deregister_window", || self.lib.deregister_window(&self.comm, handle.0))
            .map(|_| ())
    }

    fn memory_held(&self) -> Option<u64> {
        let _g = self.calls.try_lock().ok()?;
        // Not while a launch is pending (the library takes no other call then).
        if self.freed.load(Ordering::Acquire) || self.pending_set.load(Ordering::Acquire) {
            return None;
        }
        self.lib.memory_held(&self.comm)
    }

    // SAFETY (for every `launch` below): buffer views were validated by the Communicator
    // to live on this communicator's device with the given counts, and stay borrowed by
    // the returned Work until the stream has finished with them (Work's drop waits).

    fn all_reduce<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        let r = Self::ptr_mut(&recv);
        let s = send.map(|b| Self::ptr(&b)).unwrap_or(r);
        // SAFETY: see above.
        unsafe { self.launch(Op::AllReduce { send: s, recv: r, count: recv.count(), dtype: recv.dtype(), op }) }
    }

    fn reduce<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp, root: usize) -> Result<Work<'a>> {
        let r = Self::ptr_mut(&recv);
        let s = send.map(|b| Self::ptr(&b)).unwrap_or(r);
        // SAFETY: see above.
        unsafe { self.launch(Op::Reduce { send: s, recv: r, count: recv.count(), dtype: recv.dtype(), op, root }) }
    }

    fn broadcast<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, root: usize) -> Result<Work<'a>> {
        let r = Self::ptr_mut(&recv);
        let s = send.map(|b| Self::ptr(&b)).unwrap_or(r);
        // SAFETY: see above.
        unsafe { self.launch(Op::Broadcast { send: s, recv: r, count: recv.count(), dtype: recv.dtype(), root }) }
    }

    fn all_gather<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>) -> Result<Work<'a>> {
        let r = Self::ptr_mut(&recv);
        let per = recv.count() / self.info.size;
        let es = recv.dtype().size();
        let s = send
            .map(|b| Self::ptr(&b))
            .unwrap_or((r as *const u8).wrapping_add(self.info.rank * per * es) as *const c_void);
        // SAFETY: see above; in place, the input is this rank's chunk of `recv`.
        unsafe { self.launch(Op::AllGather { send: s, recv: r, count: per, dtype: recv.dtype() }) }
    }

    fn reduce_scatter<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        let es = recv.dtype().size();
        let base = Self::ptr_mut(&recv);
        let (s, r, per) = match send {
            Some(b) => (Self::ptr(&b), base, recv.count()),
            None => {
                let per = recv.count() / self.info.size;
                (base as *const c_void, (base as *mut u8).wrapping_add(self.info.rank * per * es) as *mut c_void, per)
            }
        };
        // SAFETY: see above; in place, the output is this rank's chunk of the input.
        unsafe { self.launch(Op::ReduceScatter { send: s, recv: r, count: per, dtype: recv.dtype(), op }) }
    }

    fn all_to_all<'a>(&'a self, send: Buf<'a>, recv: BufMut<'a>, splits: Option<&AllToAllSplits>) -> Result<Work<'a>> {
        let n = self.info.size;
        let (s, r, dtype) = (Self::ptr(&send), Self::ptr_mut(&recv), send.dtype());
        let op = match splits {
            None => Op::AllToAll { send: s, recv: r, count: send.count() / n, dtype },
            Some(sp) => Op::AllToAllV {
                send: s,
                recv: r,
                sends: Parts::packed(&sp.send_counts),
                recvs: Parts::packed(&sp.recv_counts),
                dtype,
            },
        };
        // SAFETY: see above; offsets stay within the validated counts.
        unsafe { self.launch(op) }
    }

    fn send<'a>(&'a self, buf: Buf<'a>, peer: usize) -> Result<Work<'a>> {
        // SAFETY: see above.
        unsafe { self.launch(Op::Send { buf: Self::ptr(&buf), count: buf.count(), dtype: buf.dtype(), peer }) }
    }

    fn recv<'a>(&'a self, buf: BufMut<'a>, peer: usize) -> Result<Work<'a>> {
        // SAFETY: see above.
        unsafe { self.launch(Op::Recv { buf: Self::ptr_mut(&buf), count: buf.count(), dtype: buf.dtype(), peer }) }
    }

    fn p2p_group<'a>(&'a self, ops: Vec<P2POp<'a>>) -> Result<Work<'a>> {
        let raw = ops
            .iter()
            .map(|o| match o {
                P2POp::Send(b, p) => RawP2P {
                    send: true,
                    ptr: Self::ptr(b) as *mut c_void,
                    count: b.count(),
                    dtype: b.dtype(),
                    peer: *p,
                },
                P2POp::Recv(b, p) => {
                    RawP2P { send: false, ptr: Self::ptr_mut(b), count: b.count(), dtype: b.dtype(), peer: *p }
                }
            })
            .collect();
        // SAFETY: see above; `ops` are borrowed by the Work through their lifetimes.
        unsafe { self.launch(Op::Group(raw)) }
    }

    fn barrier(&self) -> Result<Work<'_>> {
        let p = self.scratch.view().ptr() as *mut c_void;
        // SAFETY: the scratch element lives as long as the communicator.
        unsafe { self.launch(Op::Barrier { scratch: p }) }
    }

    async fn health(&self, _deadline: Instant) -> Result<()> {
        self.poll_async(Plane::Data, "health").map(|_| ())
    }

    async fn abort(&self, _deadline: Instant) -> Result<()> {
        self.abort_now("aborted by the caller");
        Ok(())
    }

    async fn split(
        &self,
        color: Option<u32>,
        key: u32,
        name: &str,
        deadline: Instant,
    ) -> Result<Option<Arc<dyn Collective>>> {
        if let Some(e) = self.dead() {
            return Err(e);
        }
        if !self.caps.split {
            return Err(self.ctx.unsupported("split", "the loaded library cannot split communicators"));
        }
        self.rt.bind()?;
        let seq = self.splits.fetch_add(1, Ordering::Relaxed);
        let base = format!("{}/split{seq}", self.ns);
        let (members, new_rank) = if self.lib.split_needs_members() {
            self.split_members(&base, color, key, deadline).await?
        } else {
            (Vec::new(), None)
        };
        let settings = Settings { name: name.to_string(), ..self.settings.clone() };
        let req = SplitRequest {
            color,
            key,
            members: &members,
            new_rank,
            id: (seq << 32) | u64::from(color.unwrap_or(u32::MAX)),
            settings: &settings,
        };
        let start = {
            self.rt.bind()?;
            let _g = self.lock_settled("split")?;
            self.lib.split_start(&self.comm, &req)
        };
        let ctx = self.ctx.child(new_rank.unwrap_or(self.info.rank), name);
        let start = start.map_err(|e| e.into_error(&ctx, "split", Duration::ZERO))?;
        let child = match start {
            SplitStart::Started(p) => self.drive_split(p, deadline, &ctx).await?,
            SplitStart::ViaRootId => match (color, new_rank) {
                (None, _) => None,
                (Some(c), Some(r)) => {
                    let key = format!("{base}/c{c}/root-id");
                    let store = self.store.as_ref();
                    let n = members.len();
                    Some(fresh_comm(self.lib, &self.rt, store, &key, r, n, &settings, deadline, &ctx, "split").await?)
                }
                (Some(c), None) => {
                    return Err(
                        ctx.aborted(format!("rank {} passed colour {c} but is not among its members", self.info.rank))
                    )
                }
            },
        };
        let Some(child) = child else { return Ok(None) };
        let (r, n) = match self.lib.rank_size(&child) {
            Ok(v) => v,
            Err(e) => {
                self.lib.destroy(&child);
                return Err(e.into_error(&ctx, "split", Duration::ZERO));
            }
        };
        let ctx = ctx.child(r, name);
        let ns = format!("{base}/c{}", color.unwrap_or(0));
        let c: Arc<dyn Collective> =
            Self::wrap(self.lib, self.rt.clone(), child, ctx, n, self.caps.clone(), settings, self.store.clone(), ns)?;
        Ok(Some(c))
    }

    async fn shutdown(&self, deadline: Instant) -> Result<()> {
        if self.freed.load(Ordering::Acquire) {
            return Ok(());
        }
        // Every enqueued operation completes first (bounded by the deadline), a launch still
        // pending included: the mark below must follow it ...
        {
            self.rt.bind()?;
            self.settle("shutdown")?;
            let ev = self.rt.record(&self.stream)?;
            let mut spins = 0u32;
            loop {
                if self.rt.done(&ev)? {
                    break;
                }
                self.poll_async(Plane::Data, "shutdown")?;
                if Instant::now() > deadline {
                    return Err(self.timed_out("shutdown", Duration::ZERO, "operations still running at the deadline"));
                }
                backoff(&mut spins);
            }
        }
        // ... then the library's communicator is released locally: with the stream
        // drained there is nothing left to flush, and no peer is waited for.
        self.transition(Lifecycle::ShutDown);
        self.release();
        Ok(())
    }
}
