//! [`DeviceComm`]: anyccl's `Collective` and `Work` over a [`Library`] and its [`Runtime`].
//!
//! Every call on the library's communicator is serialised by one lock (collective
//! libraries' communicators are not thread-safe); polling loops release it between polls
//! so that an abort from another thread gets through. `Drop` frees a communicator that was
//! not shut down and never panics.

use crate::error::LibError;
use crate::library::{Init, Launched, Library, Op, Plane, Poll, Settings};
use crate::runtime::Runtime;
use crate::watchdog::{self, Watched};
use anyccl_core::Ctx;

mod collective;
mod launch;
mod marks;
mod work;
use anyccl_core::{Buf, BufMut, Capabilities, CommInfo, ConnectOptions, DType, Error, Result, Store, Work};
use marks::Marks;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use work::{DeviceWork, WorkState};

/// Where a communicator is in its life. It leaves `Live` once; the first transition wins
/// and fixes what every later call is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lifecycle {
    /// Usable.
    Live,
    /// Shut down by its owner.
    ShutDown,
    /// A call blocked inside the library past the enqueue timeout.
    TimedOut(String),
    /// An operation failed; the communicator cannot be trusted.
    Failed(String),
    /// Aborted by its owner (or by a drop without shutdown).
    Aborted(String),
}

type Event<L> = <<L as Library>::Runtime as Runtime>::Event;
type Stream<L> = <<L as Library>::Runtime as Runtime>::Stream;
type Memory<L> = <<L as Library>::Runtime as Runtime>::Memory;

/// What a launch that the library answered with [`Launched::InProgress`] became: nothing
/// yet, its number once the library finished enqueuing it (unless completion is shared, a
/// mark follows it by then), or why it failed. Shared by the `Work` and the communicator
/// (which resolves it at the next launch or wait).
type LaunchSlot = Mutex<Option<std::result::Result<u64, String>>>;

/// A device library's communicator as anyccl's `Collective`.
// Laid out by hand: what a launch and a `Work`'s first look touch comes first, together (a
// real library's launch pushes this out of the caches between calls, and each line touched
// again is a miss), the rest after.
#[repr(C)]
pub struct DeviceComm<L: Library> {
    lib: &'static L,
    rt: Arc<L::Runtime>,
    comm: L::Comm,
    /// Whether `state` left `Live` (set under its lock): the calls' checks read this, not
    /// the lock.
    left_live: AtomicBool,
    /// Whether `comm` was destroyed (it happens once, sometimes after the lifecycle left
    /// `Live`: a library that cannot stop a blocked call is destroyed when the call returns).
    freed: AtomicBool,
    /// Whether `pending` holds a slot: set after it (both under the call lock), cleared
    /// after it is emptied (under its lock), so a call that finds it clear takes neither
    /// lock to learn that nothing is being launched.
    pending_set: AtomicBool,
    /// `settings.shared_completion`, here with the rest a launch reads.
    shared_completion: bool,
    /// Held for every call on `comm`.
    calls: Mutex<()>,
    /// When a call inside the library began ([`anyccl_core::coarse_now_ns`]); 0 when none
    /// runs. Cleared, and `left_live` read after, in sequential consistency: the watchdog
    /// stores `left_live` and then reads this in the same order, so one of the two sees the
    /// other (the store-then-load pattern) and one of them frees the communicator.
    in_call_since: AtomicU64,
    /// Operations put on the stream so far: the number of the newest (counted once the
    /// library has enqueued it: under the call lock, or, for a launch that was still in
    /// progress, when it is resolved before any later launch; so numbers follow the
    /// stream's order).
    placed: AtomicU64,
    /// Every operation up to this number is done and the library reported no error after
    /// it: their `Work`s are finished without asking the device again (and, above 0, every
    /// peer had joined when a later call blocks).
    finished_upto: AtomicU64,
    /// The newest operation issued with a `Work` (by default, not with shared completion)
    /// whose mark is still owed: recorded when the next thing goes on the stream, so that it
    /// follows that operation alone, unless the operation is known done by then. A `Work`
    /// waited before anything else is issued asks the stream itself where the runtime can
    /// (no event at all); 0: none owed yet.
    owed: AtomicU64,
    /// The marks on the stream not yet seen done, and the events of earlier ones (marks are
    /// recorded, and asked about, under this lock).
    marks: Mutex<Marks<Event<L>>>,
    stream: Stream<L>,
    ctx: Ctx,
    info: CommInfo,
    caps: Capabilities,
    settings: Settings,
    store: Arc<dyn Store>,
    /// Store prefix of this communicator (its splits' keys live under it).
    ns: String,
    splits: AtomicU64,
    /// Windows registered so far (their agreement keys live under `ns`).
    windows: AtomicU64,
    scratch: Memory<L>,
    state: Mutex<Lifecycle>,
    /// The slot of an operation the library is still launching. No other call may be
    /// made until it clears.
    pending: Mutex<Option<Arc<LaunchSlot>>>,
    in_progress_returns: AtomicU64,
}

impl<L: Library> std::fmt::Debug for DeviceComm<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceComm({}, rank {} of {}, '{}', {})",
            self.ctx.backend, self.info.rank, self.info.size, self.ctx.group, self.info.device
        )
    }
}

/// How long one library call may block: `ANYCCL_ENQUEUE_TIMEOUT_S`, else the backend's own
/// `ANYCCL_<BACKEND>_ENQUEUE_TIMEOUT_S`, else the communicator's operation timeout.
fn enqueue_timeout(backend: &str, op_timeout: Duration) -> Result<Duration> {
    if let Some(d) = anyccl_core::env_secs("ANYCCL_ENQUEUE_TIMEOUT_S")? {
        return Ok(d);
    }
    let var = format!("ANYCCL_{}_ENQUEUE_TIMEOUT_S", backend.to_uppercase());
    Ok(anyccl_core::env_secs(&var)?.unwrap_or(op_timeout))
}

/// Spin briefly, then yield, then sleep: completion is usually microseconds away.
fn backoff(spins: &mut u32) {
    *spins += 1;
    if *spins < 2000 {
        std::hint::spin_loop();
    } else if *spins < 20_000 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Drive an init or split to its end within `deadline`; abandons it on error or expiry.
/// `started`: when the step that the init belongs to began (its root-id exchange
/// included), for the time a timeout reports.
async fn drive<L: Library>(
    lib: &'static L,
    mut p: L::Pending,
    (started, deadline): (Instant, Instant),
    ctx: &Ctx,
    op: &str,
    mut step: impl FnMut(&mut L::Pending) -> std::result::Result<Poll<Option<L::Comm>>, Option<LibError>>,
) -> Result<Option<L::Comm>> {
    loop {
        match step(&mut p) {
            Ok(Poll::Ready(c)) => return Ok(c),
            Ok(Poll::Pending) => {}
            Err(e) => {
                lib.abandon(p);
                return Err(match e {
                    Some(e) => e.into_error(ctx, op, started.elapsed()),
                    None => ctx.aborted(format!("{op} was interrupted: the parent communicator was released")),
                });
            }
        }
        if Instant::now() >= deadline {
            lib.abandon(p);
            return Err(ctx.timeout(
                op,
                started.elapsed(),
                "not every rank joined; the half-built communicator was abandoned",
            ));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Rank 0 makes a root id and publishes it under `key`; the others wait for it.
async fn exchange_root_id<L: Library>(
    lib: &'static L,
    rt: &Arc<L::Runtime>,
    store: &dyn Store,
    key: &str,
    first: bool,
    deadline: Instant,
    (ctx, op): (&Ctx, &str),
) -> Result<Vec<u8>> {
    if first {
        rt.bind()?;
        let id = lib.root_id().map_err(|e| e.into_error(ctx, op, Duration::ZERO))?;
        store.set(key, &id).await?;
        return Ok(id);
    }
    let id = match store.wait(key, deadline).await {
        Ok(b) => b,
        Err(Error::Timeout { after, .. }) => {
            return Err(ctx.timeout(
                op,
                after,
                format!("the group's first rank never published the {} root id", ctx.backend),
            ))
        }
        Err(e) => return Err(e),
    };
    if id.len() != L::ROOT_ID_LEN {
        return Err(Error::store_fatal(format!(
            "root id under '{key}' has {} bytes, not {}",
            id.len(),
            L::ROOT_ID_LEN
        )));
    }
    Ok(id)
}

/// The layer's "new communicator from a fresh id" step, which connect, a split the library
/// cannot do itself, and a rebuild share: the group's first rank (`rank` 0) makes a root id
/// and publishes it under `key`, every member inits rank `rank` of `size` from it and polls
/// the init to its end within `deadline`. The device is bound to the calling thread.
///
/// # Errors
/// `Timeout` (naming `op`) when the first rank never publishes or not every member joins in
/// time, the half-built communicator abandoned; the library's errors, in `ctx`.
#[allow(clippy::too_many_arguments)] // One step of a protocol: every argument is a part of it.
pub async fn fresh_comm<L: Library>(
    lib: &'static L,
    rt: &Arc<L::Runtime>,
    store: &dyn Store,
    key: &str,
    rank: usize,
    size: usize,
    settings: &Settings,
    deadline: Instant,
    ctx: &Ctx,
    op: &str,
) -> Result<L::Comm> {
    let started = Instant::now();
    let id = exchange_root_id(lib, rt, store, key, rank == 0, deadline, (ctx, op)).await?;
    rt.bind()?;
    let p = lib
        .init_start(rt, Init { id: &id, rank, size, settings })
        .map_err(|e| e.into_error(ctx, op, started.elapsed()))?;
    let comm = drive(lib, p, (started, deadline), ctx, op, |p| {
        rt.bind().ok();
        lib.poll(p).map_err(Some)
    })
    .await?;
    comm.ok_or_else(|| ctx.aborted(format!("{op}: the library built no communicator")))
}

impl<L: Library> DeviceComm<L> {
    /// Create the communicator of `opts.rank` among `opts.size` over the store, within
    /// `opts.timeout`; every rank calls it.
    ///
    /// # Errors
    /// `Timeout` when not every rank joins in time; the library's errors.
    pub async fn connect(lib: &'static L, rt: Arc<L::Runtime>, opts: ConnectOptions) -> Result<Arc<Self>> {
        let deadline = anyccl_core::deadline_in(opts.timeout);
        let (rank, size) = (opts.rank, opts.size);
        let namespace = opts.namespace.clone();
        let base = format!("{namespace}/{}", lib.backend());
        let store = opts.store.clone();
        let (st, group) = (store.clone(), namespace.clone());
        anyccl_core::in_new_generation(st.as_ref(), &base, rank, &group, deadline, |ns| async move {
            let st = store.as_ref();
            let ctx = Ctx::new(lib.backend(), rank, namespace.clone());
            let settings =
                Settings::from_config(&namespace, &opts.config, enqueue_timeout(lib.backend(), opts.op_timeout)?);
            let key = format!("{ns}/root-id");
            let comm = fresh_comm(lib, &rt, st, &key, rank, size, &settings, deadline, &ctx, "connect").await?;
            let caps = lib.capabilities(&rt);
            Self::wrap(lib, rt, comm, ctx, size, caps, settings, store.clone(), ns)
        })
        .await
    }

    #[allow(clippy::too_many_arguments)]
    fn wrap(
        lib: &'static L,
        rt: Arc<L::Runtime>,
        comm: L::Comm,
        ctx: Ctx,
        size: usize,
        caps: Capabilities,
        settings: Settings,
        store: Arc<dyn Store>,
        ns: String,
    ) -> Result<Arc<Self>> {
        let made = rt.stream().and_then(|s| Ok((s, rt.alloc(DType::F32, 1)?)));
        let (stream, scratch) = match made {
            Ok(v) => v,
            Err(e) => {
                lib.destroy(&comm);
                return Err(e);
            }
        };
        let info = CommInfo { backend: lib.backend(), rank: ctx.rank, size, device: rt.device() };
        let c = Arc::new(DeviceComm {
            shared_completion: settings.shared_completion,
            lib,
            rt,
            ctx,
            info,
            caps,
            settings,
            store,
            ns,
            splits: AtomicU64::new(0),
            windows: AtomicU64::new(0),
            stream,
            scratch,
            comm,
            calls: Mutex::new(()),
            state: Mutex::new(Lifecycle::Live),
            left_live: AtomicBool::new(false),
            freed: AtomicBool::new(false),
            in_call_since: AtomicU64::new(0),
            pending: Mutex::new(None),
            pending_set: AtomicBool::new(false),
            in_progress_returns: AtomicU64::new(0),
            placed: AtomicU64::new(0),
            marks: Mutex::new(Marks::default()),
            finished_upto: AtomicU64::new(0),
            owed: AtomicU64::new(0),
        });
        let weak: std::sync::Weak<dyn Watched> = Arc::downgrade(&(c.clone() as Arc<dyn Watched>));
        watchdog::watch(weak);
        Ok(c)
    }

    /// The lifecycle state.
    pub fn lifecycle(&self) -> Lifecycle {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The library communicator's handles (for calls outside the contract, such as a
    /// backend's own benchmark mode). Only valid while the communicator is live.
    pub fn library_comm(&self) -> &L::Comm {
        &self.comm
    }

    /// Leave `Live` for `to`; `false` when it had already left.
    fn transition(&self, to: Lifecycle) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if *s != Lifecycle::Live {
            return false;
        }
        *s = to;
        // Sequentially consistent: see `in_call_since`.
        self.left_live.store(true, Ordering::SeqCst);
        true
    }

    /// The error for a call on a communicator that left `Live`.
    #[inline]
    fn dead(&self) -> Option<Error> {
        if !self.left_live.load(Ordering::Acquire) {
            return None;
        }
        self.dead_why()
    }

    /// [`DeviceComm::dead`] once the lifecycle left `Live`: out of every call's way.
    #[cold]
    #[inline(never)]
    fn dead_why(&self) -> Option<Error> {
        let why = match &*self.state.lock().unwrap_or_else(|p| p.into_inner()) {
            Lifecycle::Live => return None,
            Lifecycle::ShutDown => "the communicator was shut down".to_string(),
            Lifecycle::TimedOut(w) | Lifecycle::Failed(w) | Lifecycle::Aborted(w) => w.clone(),
        };
        Some(self.ctx.aborted(why))
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The call lock, when the communicator is live and its handles are not freed.
    fn lock_live(&self) -> Result<MutexGuard<'_, ()>> {
        if let Some(e) = self.dead() {
            return Err(e);
        }
        let g = self.lock();
        if self.freed.load(Ordering::Acquire) {
            return Err(self.dead().unwrap_or_else(|| self.ctx.aborted("communicator released")));
        }
        Ok(g)
    }

    /// Destroy the library communicator once. Callers hold the call lock, or another
    /// thread is blocked inside a call that the library's destroy releases.
    fn free(&self) {
        if self.freed.swap(true, Ordering::AcqRel) {
            return;
        }
        let _ = self.rt.bind();
        self.lib.destroy(&self.comm);
    }

    /// Free the library communicator under the call lock. When a call is blocked inside
    /// the library: free beside it where the library's destroy releases it; otherwise
    /// leave the free to that call, which does it when the library lets go.
    #[cold]
    fn release(&self) {
        loop {
            match self.calls.try_lock() {
                Ok(_g) => return self.free(),
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    let _g = p.into_inner();
                    return self.free();
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    // Sequentially consistent: see `in_call_since`.
                    if self.in_call_since.load(Ordering::SeqCst) != 0 {
                        if self.lib.can_stop_blocked() {
                            tracing::warn!(
                                "{} '{}' rank {}: releasing beside a call blocked inside the library",
                                self.ctx.backend,
                                self.ctx.group,
                                self.ctx.rank
                            );
                            self.free();
                        } else {
                            tracing::warn!(
                                "{} '{}' rank {}: a call is blocked inside the library, which cannot stop it; the \
                                 communicator is freed when the library's own timeout returns it",
                                self.ctx.backend,
                                self.ctx.group,
                                self.ctx.rank
                            );
                        }
                        return;
                    }
                    std::thread::yield_now();
                }
            }
        }
    }

    /// Record a failure and free, so every later call fails fast.
    #[cold]
    fn fail(&self, why: &Error) {
        self.transition(Lifecycle::Failed(format!("failed earlier: {why}")));
        self.release();
    }

    #[cold]
    fn abort_now(&self, why: &str) {
        self.transition(Lifecycle::Aborted(why.to_string()));
        self.release();
    }

    /// What a call that blocked inside the library means, from what is known.
    #[cold]
    fn blocked_why(&self) -> String {
        match self.finished_upto.load(Ordering::Relaxed) {
            0 => "no operation of this communicator has completed yet: a peer never joined (or is still connecting)"
                .into(),
            n => format!(
                "{n} operations of this communicator had completed, so every peer had joined: one stopped taking \
                 part (stopped, stuck or dead) and the library's queue filled"
            ),
        }
    }

    /// A `Timeout` for `op` that also fails the communicator (it cannot be trusted after).
    #[cold]
    fn timed_out(&self, op: &str, after: Duration, why: &str) -> Error {
        let e = self.ctx.timeout(op, after, format!("{why}; communicator aborted"));
        self.fail(&e);
        e
    }

    /// The async error on `plane` (`Ok(true)`: an asynchronous step still runs). Never
    /// waits for the lock: a call blocked on peers holds it, and every caller's own
    /// deadline must still apply.
    fn poll_async(&self, plane: Plane, op: &str) -> Result<bool> {
        if let Some(e) = self.dead() {
            return Err(e);
        }
        let g = match self.calls.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Ok(true),
        };
        if self.freed.load(Ordering::Acquire) {
            return Err(self.dead().unwrap_or_else(|| self.ctx.aborted("communicator released")));
        }
        match self.lib.async_error(&self.comm, plane) {
            Ok(b) => Ok(b),
            Err(e) => {
                let e = e.into_error(&self.ctx, op, Duration::ZERO);
                drop(g);
                self.fail(&e);
                Err(e)
            }
        }
    }

    /// The new group's members (parent ranks, in new-rank order) and this rank's place,
    /// from every rank's colour and key exchanged under `base`.
    async fn split_members(
        &self,
        base: &str,
        color: Option<u32>,
        key: u32,
        deadline: Instant,
    ) -> Result<(Vec<usize>, Option<usize>)> {
        let me = self.info.rank;
        let mine = match color {
            Some(c) => format!("{c} {key}"),
            None => "-".into(),
        };
        self.store.set(&format!("{base}/r{me}"), mine.as_bytes()).await?;
        let Some(color) = color else { return Ok((Vec::new(), None)) };
        let mut same = Vec::new();
        for r in 0..self.info.size {
            let v = match self.store.wait(&format!("{base}/r{r}"), deadline).await {
                Ok(v) => v,
                Err(Error::Timeout { after, .. }) => {
                    return Err(self.ctx.timeout("split", after, format!("rank {r} never entered the split")))
                }
                Err(e) => return Err(e),
            };
            let text = String::from_utf8_lossy(&v).to_string();
            let mut it = text.split(' ').map(str::parse::<u32>);
            if let (Some(Ok(c)), Some(Ok(k))) = (it.next(), it.next()) {
                if c == color {
                    same.push((k, r));
                }
            }
        }
        same.sort();
        let members: Vec<usize> = same.into_iter().map(|(_, r)| r).collect();
        let new_rank = members.iter().position(|&r| r == me);
        Ok((members, new_rank))
    }

    /// Run `call` inside the library under the call lock `g` (already held), watched: a
    /// call blocked past the enqueue timeout (a peer that never makes the matching call, or
    /// the library's queue full behind a stopped peer) is ended by the watchdog, which
    /// aborts the communicator, and comes back as a `Timeout`. A call the library failed
    /// fails the communicator (a collective call may have left the peers inside it; freeing
    /// ends their wait too). Returns the call lock, still held, with the result.
    pub(crate) fn watched_call_locked<'g, T>(
        &'g self,
        g: MutexGuard<'g, ()>,
        op: &str,
        call: impl FnOnce() -> std::result::Result<T, LibError>,
    ) -> Result<(MutexGuard<'g, ()>, T)> {
        // The coarse clock: the watchdog measures seconds, and a precise read is a tenth of
        // what anyccl adds to a call.
        let started = anyccl_core::coarse_now_ns();
        let took = || Duration::from_nanos(anyccl_core::coarse_now_ns().saturating_sub(started));
        self.in_call_since.store(started, Ordering::Release);
        let r = call();
        // Cleared, then `left_live` read, both sequentially consistent (see
        // `in_call_since`): a watchdog that timed the call out either sees it cleared and
        // leaves the free to the call lock, or is seen here. The state's lock only when the
        // communicator left `Live`.
        self.in_call_since.store(0, Ordering::SeqCst);
        if self.left_live.load(Ordering::SeqCst) && matches!(self.lifecycle(), Lifecycle::TimedOut(_)) {
            drop(g);
            // A library that could not be stopped was left to this call to free.
            self.release();
            return Err(self.ctx.timeout(op, took(), format!("{}; communicator aborted", self.blocked_why())));
        }
        if let Some(e) = self.dead() {
            drop(g);
            self.release();
            return Err(e);
        }
        match r {
            Ok(v) => Ok((g, v)),
            Err(e) => {
                // A library that reports a timeout gave up at its own limit, which the
                // communicator set from the operation timeout (HCCL's hcclExecTimeOut): that
                // is how long it waited, where the coarse clock of the call may read 0.
                let e = e.into_error(&self.ctx, op, took().max(self.settings.op_timeout));
                drop(g);
                self.fail(&e);
                Err(e)
            }
        }
    }

    /// Poll a split the library runs, under the lock and only while this communicator lives.
    async fn drive_split(&self, p: L::Pending, deadline: Instant, ctx: &Ctx) -> Result<Option<L::Comm>> {
        drive(self.lib, p, (Instant::now(), deadline), ctx, "split", |p| {
            if self.dead().is_some() {
                return Err(None);
            }
            let _g = match self.calls.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return Ok(Poll::Pending),
            };
            if self.freed.load(Ordering::Acquire) {
                return Err(None);
            }
            let _ = self.rt.bind();
            self.lib.poll(p).map_err(Some)
        })
        .await
    }

    fn ptr(b: &Buf<'_>) -> *const c_void {
        b.ptr() as *const c_void
    }
    fn ptr_mut(b: &BufMut<'_>) -> *mut c_void {
        b.ptr() as *mut c_void
    }
}

impl<L: Library> Watched for DeviceComm<L> {
    fn tick(&self) -> bool {
        if self.freed.load(Ordering::Acquire) {
            return false;
        }
        let since = self.in_call_since.load(Ordering::Acquire);
        let limit = self.settings.enqueue_timeout;
        if since != 0 && Duration::from_nanos(anyccl_core::coarse_now_ns().saturating_sub(since)) > limit {
            let how = if self.lib.can_stop_blocked() {
                "communicator aborted"
            } else {
                "the library cannot stop the call: it returns when the library's own timeout passes, and the \
                 communicator is freed then"
            };
            let why =
                format!("a {} call blocked for more than {limit:?}: {}; {how}", self.ctx.backend, self.blocked_why());
            tracing::error!("'{}' rank {}: {why}", self.ctx.group, self.ctx.rank);
            if self.transition(Lifecycle::TimedOut(why)) {
                self.release();
            }
            return false;
        }
        true
    }
}

impl<L: Library> Drop for DeviceComm<L> {
    fn drop(&mut self) {
        let n = self.in_progress_returns.load(Ordering::Relaxed);
        if n > 0 {
            tracing::debug!("'{}' rank {}: {n} launches answered in progress", self.ctx.group, self.ctx.rank);
        }
        if !self.freed.load(Ordering::Acquire) {
            tracing::debug!("dropping '{}' rank {} without shutdown: freeing", self.ctx.group, self.ctx.rank);
            self.transition(Lifecycle::Aborted("dropped without shutdown".into()));
            self.free();
        }
    }
}
