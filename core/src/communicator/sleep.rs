//! Sleep and wake: a group gives its library communicator (and everything the library
//! connected for it) back between phases, and gets a new one among the same members when it
//! wakes, while the program keeps its [`Communicator`]. Written once for every backend: sleep
//! shuts the backend's communicator down and puts [`Asleep`] in its place, wake connects a
//! new one through the backend in a namespace of its own. Both take `&mut self`, so no
//! `Work` or registration of the group can outlive a sleep: the compiler checks it. The live
//! path pays nothing: an operation while asleep reaches [`Asleep`], which refuses it.

use super::meet::{decide, Offer, Verdict};
use super::Communicator;
use crate::buffer::{Buf, BufMut, StreamRef};
use crate::capability::Capabilities;
use crate::collective::{AllToAllSplits, Backend, Collective, CommInfo, ConnectOptions, GraphOp, P2POp, RegHandle};
use crate::dtype::ReduceOp;
use crate::error::{Ctx, Error, Result};
use crate::work::Work;
use async_trait::async_trait;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long after the connect deadline a wake's members wait for each other's outcome (one
/// may have connected at the last moment).
const WAKE_GRACE: Duration = Duration::from_secs(5);

/// How long a communicator that a failed wake connected gets to abort.
const ABORT_WAIT: Duration = Duration::from_secs(10);

/// Where a group stands between its sleeps and wakes.
#[derive(Debug, Default)]
pub(super) struct Sleeps {
    /// Sleeps so far (each wake's namespace is numbered by it).
    pub(super) count: u64,
    /// Sleep meetings that failed since the last sleep: a failed meeting's store keys keep
    /// its verdict (a member that comes late adopts it), so the next try meets under new
    /// ones. Every member counts the same failures. (A wake finds its try in the store: a
    /// member that never took part in a failed wake joins the next one.)
    pub(super) tries: u64,
    /// Whether the group is asleep now.
    pub(super) asleep: bool,
    /// Operations captured into graphs that still exist ([`super::Captured`]): a graph
    /// replays them on the library communicator a sleep would release.
    pub(super) graphs: Arc<AtomicUsize>,
}

/// One captured operation counted while it exists.
#[derive(Debug)]
pub(super) struct GraphHeld(Arc<AtomicUsize>);

impl GraphHeld {
    pub(super) fn new(n: &Arc<AtomicUsize>) -> GraphHeld {
        n.fetch_add(1, Ordering::AcqRel);
        GraphHeld(n.clone())
    }
}

impl Drop for GraphHeld {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What stands in for a sleeping group's communicator: every operation is refused, naming
/// the group; abort, health and shutdown have nothing to do.
#[derive(Debug)]
pub(super) struct Asleep {
    info: CommInfo,
    caps: Capabilities,
    ctx: Ctx,
}

impl Asleep {
    fn refuse(&self, op: &'static str) -> Error {
        self.ctx.invalid(
            op,
            "communicator",
            format!("group '{}' is asleep: call Communicator::wake first (every member does)", self.ctx.group),
        )
    }
}

#[async_trait]
impl Collective for Asleep {
    fn info(&self) -> &CommInfo {
        &self.info
    }
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }
    fn memory_held(&self) -> Option<u64> {
        Some(0)
    }
    fn all_reduce<'a>(&'a self, _: Option<Buf<'a>>, _: BufMut<'a>, _: ReduceOp) -> Result<Work<'a>> {
        Err(self.refuse("all_reduce"))
    }
    fn reduce<'a>(&'a self, _: Option<Buf<'a>>, _: BufMut<'a>, _: ReduceOp, _: usize) -> Result<Work<'a>> {
        Err(self.refuse("reduce"))
    }
    fn broadcast<'a>(&'a self, _: Option<Buf<'a>>, _: BufMut<'a>, _: usize) -> Result<Work<'a>> {
        Err(self.refuse("broadcast"))
    }
    fn all_gather<'a>(&'a self, _: Option<Buf<'a>>, _: BufMut<'a>) -> Result<Work<'a>> {
        Err(self.refuse("all_gather"))
    }
    fn reduce_scatter<'a>(&'a self, _: Option<Buf<'a>>, _: BufMut<'a>, _: ReduceOp) -> Result<Work<'a>> {
        Err(self.refuse("reduce_scatter"))
    }
    fn all_to_all<'a>(&'a self, _: Buf<'a>, _: BufMut<'a>, _: Option<&AllToAllSplits>) -> Result<Work<'a>> {
        Err(self.refuse("all_to_all"))
    }
    fn send<'a>(&'a self, _: Buf<'a>, _: usize) -> Result<Work<'a>> {
        Err(self.refuse("send"))
    }
    fn recv<'a>(&'a self, _: BufMut<'a>, _: usize) -> Result<Work<'a>> {
        Err(self.refuse("recv"))
    }
    fn p2p_group<'a>(&'a self, _: Vec<P2POp<'a>>) -> Result<Work<'a>> {
        Err(self.refuse("p2p_group"))
    }
    fn barrier(&self) -> Result<Work<'_>> {
        Err(self.refuse("barrier"))
    }
    fn wait_stream(&self, _: StreamRef<'_>) -> Result<()> {
        Err(self.refuse("wait_stream"))
    }
    fn signal_stream(&self, _: StreamRef<'_>) -> Result<()> {
        Err(self.refuse("signal_stream"))
    }
    fn capture(&self, _: StreamRef<'_>, _: GraphOp) -> Result<()> {
        Err(self.refuse("capture"))
    }
    fn enqueue(&self, _: GraphOp) -> Result<()> {
        Err(self.refuse("enqueue"))
    }
    fn register(&self, _: Buf<'_>) -> Result<Option<RegHandle>> {
        Err(self.refuse("register"))
    }
    async fn register_window(&self, _: Buf<'_>, _: Option<&str>, _: Instant) -> Result<Option<RegHandle>> {
        Err(self.refuse("register_window"))
    }
    async fn health(&self, _: Instant) -> Result<()> {
        Ok(())
    }
    async fn abort(&self, _: Instant) -> Result<()> {
        Ok(())
    }
    async fn split(&self, _: Option<u32>, _: u32, _: &str, _: Instant) -> Result<Option<Arc<dyn Collective>>> {
        Err(self.refuse("split"))
    }
    async fn shutdown(&self, _: Instant) -> Result<()> {
        Ok(())
    }
}

impl Communicator {
    /// Give the group's library communicator back, with everything its library connected
    /// (NCCL's and HCCL's buffers on the device, the CPU backend's sockets, shared-memory
    /// segments and threads), keeping this `Communicator`: an engine sleeps its training
    /// groups while a colocated inference engine wants the memory, and wakes them after.
    /// Collective: every member calls it; all sleep, or none does. Operations issued before
    /// it are finished first. While asleep, every operation is an `InvalidArgument` naming
    /// the group.
    ///
    /// `&mut self`: no `Work`, registered buffer or window of the group can be alive (they
    /// borrow the communicator). Operations captured into a graph must be dropped first (a
    /// graph replays them on the communicator sleep releases): sleep refuses otherwise, on
    /// every member. A captured graph is captured again after the wake.
    ///
    /// ```compile_fail
    /// # async fn f(comm: &mut anyccl_core::Communicator, mem: Box<dyn anyccl_core::DeviceMemory>)
    /// #     -> anyccl_core::Result<()> {
    /// let registered = comm.register(mem)?;
    /// comm.sleep().await?; // refused by the compiler: `registered` borrows the communicator
    /// drop(registered);
    /// # Ok(()) }
    /// ```
    ///
    /// ```
    /// # async fn f(comm: &mut anyccl_core::Communicator, mem: Box<dyn anyccl_core::DeviceMemory>)
    /// #     -> anyccl_core::Result<()> {
    /// let registered = comm.register(mem)?;
    /// drop(registered); // deregistered first
    /// comm.sleep().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// `InvalidArgument` (on every member) when the group is asleep already, was not made by
    /// [`Communicator::connect`] or a split of one (it knows no store), or a member holds
    /// captured operations; `Timeout` naming the members that never called it; the
    /// backend's, when draining fails (the group is then asleep all the same: its
    /// communicator is released, and a wake builds a new one).
    pub async fn sleep(&mut self) -> Result<()> {
        const OP: &str = "sleep";
        if self.sleeps.asleep {
            return Err(self.invalid(OP, "communicator", "the group is asleep already: wake it before the next sleep"));
        }
        let store = self.store_for(OP)?;
        let graphs = self.sleeps.graphs.load(Ordering::Acquire);
        let refusal = (graphs > 0).then(|| {
            format!(
                "{graphs} operations captured into graphs on this group still exist (a graph replays them on the \
                 communicator that sleep releases): drop them first, capture again after the wake"
            )
        });
        let deadline = crate::deadline_in(self.config.init_timeout);
        let (started, prefix) =
            (Instant::now(), format!("{}/sleep{}.{}", self.who.name, self.sleeps.count, self.sleeps.tries));
        let verdict = decide(
            store.as_ref(),
            &prefix,
            (self.rank(), self.size()),
            OP,
            Offer::ready_unless(refusal.as_deref()),
            deadline,
        )
        .await?;
        match verdict {
            Verdict::Go => {}
            Verdict::Refused(why) => {
                self.sleeps.tries += 1;
                return Err(self.invalid(OP, "communicator", format!("no member can sleep: {why}")));
            }
            Verdict::Missing(why) => {
                self.sleeps.tries += 1;
                return Err(self.ctx().timeout(OP, started.elapsed(), why));
            }
        }
        self.trim_before(store.as_ref()).await;
        let drained = self.inner.shutdown(deadline).await;
        self.fall_asleep();
        drained
    }

    /// Once every member is in this sleep, nobody needs the keys of the sleep and wake before
    /// it (their meetings, and the namespace of the communicator the sleep before released):
    /// the group's first member removes them, so the store does not grow with the cycles.
    /// A failure to remove them costs nothing but the space.
    async fn trim_before(&self, store: &dyn crate::Store) {
        let Some(k) = self.sleeps.count.checked_sub(1) else { return };
        if self.rank() != 0 {
            return;
        }
        let name = &self.who.name;
        for prefix in [format!("{name}/sleep{k}."), format!("{name}/wake{k}."), format!("{name}@wake{k}.")] {
            if let Err(e) = store.delete_prefix(&prefix).await {
                tracing::debug!("{name}: keys under {prefix} left in the store: {e}");
            }
        }
    }

    /// Put the group to sleep on this member without meeting the others, for a caller whose
    /// own agreement decided that every member does the same: the warmup's `wake_groups`
    /// after a wake or warmup that failed on another member. The library communicator is
    /// aborted, not drained (a member may be gone). A group asleep already is left so.
    pub async fn sleep_agreed(&mut self) {
        if self.sleeps.asleep {
            return;
        }
        if let Err(e) = self.inner.abort(crate::deadline_in(ABORT_WAIT)).await {
            tracing::warn!("{}: abort before an agreed sleep failed ({e}); released all the same", self.who.name);
        }
        self.fall_asleep();
    }

    /// Release the library communicator (the last reference, unless the program kept a
    /// clone of it, and everything it holds with it) and stand [`Asleep`] in its place.
    fn fall_asleep(&mut self) {
        let info = self.inner.info().clone();
        let caps = self.inner.capabilities().clone();
        let asleep = Arc::new(Asleep { ctx: self.ctx(), info, caps });
        drop(std::mem::replace(&mut self.inner, asleep));
        self.sleeps.count += 1;
        self.sleeps.tries = 0;
        self.sleeps.asleep = true;
    }

    /// Connect the group again after [`Communicator::sleep`], among the same members,
    /// through `backend` (the one it was connected with), in a namespace of its own for each
    /// wake. Collective: every member calls it, within the connect timeout
    /// (`CommConfig::init_timeout`). The new communicator connects lazily, as a first one
    /// does: warm it again before the step that needs its memory (`anyccl-warmup`).
    ///
    /// # Errors
    /// `InvalidArgument` when the group is not asleep or `backend` is another backend's; the
    /// backend's connect errors (a member that never calls it, or died while the group
    /// slept: `Timeout` naming what it waited for). The group then stays asleep, and a later
    /// wake may try again.
    pub async fn wake(&mut self, backend: &dyn Backend) -> Result<()> {
        const OP: &str = "wake";
        if !self.sleeps.asleep {
            return Err(self.invalid(OP, "communicator", "the group is not asleep: wake follows a sleep"));
        }
        let info = self.inner.info().clone();
        if backend.name() != info.backend {
            let msg = format!("the {} backend, but the group was connected with {}", backend.name(), info.backend);
            return Err(self.invalid(OP, "backend", msg));
        }
        let store = self.store_for(OP)?;
        // The first try of this wake whose meeting has not decided yet: the one the others are
        // in, or the next.
        let count = self.sleeps.count;
        let mut tries = 0u64;
        while store.get(&format!("{}/wake{count}.{tries}/verdict", self.who.name)).await?.is_some() {
            tries += 1;
        }
        let deadline = crate::deadline_in(self.config.init_timeout);
        let opts = ConnectOptions {
            rank: info.rank,
            size: info.size,
            store: store.clone(),
            namespace: format!("{}@wake{count}.{tries}", self.who.name),
            device: info.device,
            timeout: self.config.init_timeout,
            op_timeout: self.config.op_timeout,
            config: self.config.clone(),
        };
        let started = Instant::now();
        let connected = backend.connect(opts).await.and_then(|inner| {
            let got = inner.info();
            if (got.rank, got.size) == (info.rank, info.size) {
                return Ok(inner);
            }
            let msg =
                format!("rank {} of {} after the wake, {} of {} before", got.rank, got.size, info.rank, info.size);
            Err(self.ctx().backend_error(OP, -1, msg, crate::Recovery::Fatal))
        });
        // The members agree on the outcome, so that the group wakes on all of them or on none
        // (one may have connected while another's connect failed).
        let refusal = connected.as_ref().err().map(|e| format!("its connect failed: {e}"));
        let prefix = format!("{}/wake{count}.{tries}", self.who.name);
        let who = (self.rank(), self.size());
        let verdict =
            decide(store.as_ref(), &prefix, who, OP, Offer::ready_unless(refusal.as_deref()), deadline + WAKE_GRACE)
                .await;
        let (inner, verdict) = match (connected, verdict) {
            (Ok(inner), Ok(Verdict::Go)) => {
                self.inner = inner;
                self.sleeps.asleep = false;
                return Ok(());
            }
            (Err(e), _) => return Err(e),
            (Ok(inner), verdict) => (inner, verdict),
        };
        if let Err(e) = inner.abort(crate::deadline_in(ABORT_WAIT)).await {
            tracing::warn!("{}: abort of the communicator a failed wake connected failed: {e}", self.who.name);
        }
        drop(inner);
        let stays = "the group stays asleep on every member, and a later wake may try again";
        Err(match verdict? {
            Verdict::Refused(why) => self.ctx().peer_failed(None, format!("the wake failed on {why}; {stays}")),
            Verdict::Missing(why) => self.ctx().timeout(OP, started.elapsed(), format!("{why}; {stays}")),
            // Not reached: a wake all agreed on is kept above.
            Verdict::Go => self.ctx().aborted(format!("this member's wake agreed but could not be kept; {stays}")),
        })
    }

    /// Whether the group is asleep ([`Communicator::sleep`]).
    pub fn is_asleep(&self) -> bool {
        self.sleeps.asleep
    }

    fn store_for(&self, op: &'static str) -> Result<Arc<dyn crate::Store>> {
        self.store.clone().ok_or_else(|| {
            self.invalid(
                op,
                "communicator",
                "the group was built from a backend's communicator (Communicator::new), so it knows no store to meet \
                 its members through: connect it with Communicator::connect (or split it from one) to sleep and wake",
            )
        })
    }
}
