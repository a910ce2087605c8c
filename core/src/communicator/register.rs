//! Buffers registered with a communicator: the library may then move data to and from them
//! without its staging copies. The registration owns the memory it covers, so the memory
//! cannot be freed while registered, and it is deregistered before it is given back.

use super::Communicator;
use crate::collective::RegHandle;
use crate::error::Result;
use crate::platform::DeviceMemory;
use std::ops::{Deref, DerefMut};

/// Memory registered with a communicator ([`Communicator::register`]). It owns the memory
/// (`Box<dyn DeviceMemory>`, or an `Arc` for buffers that captured operations share):
/// operations use it through `Deref`/`DerefMut` to `dyn DeviceMemory` (`view`, `view_mut`),
/// whose borrows keep it registered while their `Work` lives. The owner itself is only lent
/// shared ([`Registered::memory`]): replacing it would free memory still registered.
/// Dropping it deregisters, then frees the memory; [`Registered::into_inner`] deregisters and
/// gives the memory back. Keep it at least as long as a `Captured` operation on the same
/// memory.
pub struct Registered<'c, M: Deref<Target = dyn DeviceMemory>> {
    comm: &'c Communicator,
    handle: Option<RegHandle>,
    /// A window ([`Communicator::register_window`]), whose deregistration is collective.
    window: bool,
    mem: Option<M>,
}

impl<M: Deref<Target = dyn DeviceMemory>> std::fmt::Debug for Registered<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered")
            .field("group", &self.comm.spec.name)
            .field("handle", &self.handle)
            .field("window", &self.window)
            .finish()
    }
}

impl<'c, M: Deref<Target = dyn DeviceMemory>> Registered<'c, M> {
    /// Whether the library registered it (`false` on a backend without
    /// `Capabilities::buffer_registration`, where registering does nothing).
    pub fn is_registered(&self) -> bool {
        self.handle.is_some()
    }

    /// The registered memory.
    pub fn memory(&self) -> &M {
        self.mem.as_ref().unwrap_or_else(|| unreachable!("taken only by into_inner and drop"))
    }

    /// Deregister, and give the memory back.
    ///
    /// # Errors
    /// The library's, when it refuses to deregister; the memory is then kept registered
    /// until the communicator is freed, and dropped with the error.
    pub fn into_inner(mut self) -> Result<M> {
        self.deregister()?;
        Ok(self.mem.take().unwrap_or_else(|| unreachable!("taken only by into_inner and drop")))
    }

    /// Whether this is a window ([`Communicator::register_window`]).
    pub fn is_window(&self) -> bool {
        self.window
    }

    fn deregister(&mut self) -> Result<()> {
        match (self.handle.take(), self.window) {
            (Some(h), false) => self.comm.inner.deregister(h),
            (Some(h), true) => self.comm.inner.deregister_window(h),
            (None, _) => Ok(()),
        }
    }
}

impl<M: Deref<Target = dyn DeviceMemory>> Drop for Registered<'_, M> {
    fn drop(&mut self) {
        if let Err(e) = self.deregister() {
            // The library keeps the registration until the communicator goes; the memory
            // is still freed (no panic in drop).
            tracing::warn!("{e}");
        }
    }
}

impl Communicator {
    /// Register `mem` with this communicator, so the library may read and write it without
    /// its own staging copies (NCCL's user-buffer registration, HCCL's `HcclCommRegister`).
    /// Memory from [`crate::Platform::alloc_registrable`] is what the library registers best
    /// (NCCL: `ncclMemAlloc`). Registration is local to this rank: each rank registers its own
    /// buffers, in any order. On a backend without `Capabilities::buffer_registration` it
    /// succeeds and does nothing ([`Registered::is_registered`] says which).
    ///
    /// # Errors
    /// `InvalidArgument` (naming `mem`, the rank and the group) for memory on another device
    /// or of no bytes; `Aborted` on a dead communicator; `Backend` when the library refuses.
    pub fn register<M: Deref<Target = dyn DeviceMemory>>(&self, mem: M) -> Result<Registered<'_, M>> {
        const OP: &str = "register";
        let view = mem.view();
        self.check_device(OP, "mem", view.device())?;
        if view.bytes() == 0 {
            return Err(self.invalid(OP, "mem", "the buffer holds no bytes: nothing to register"));
        }
        let handle = self.inner.register(view)?;
        Ok(Registered { comm: self, handle, window: false, mem: Some(mem) })
    }

    /// Register `mem` as a *window* of this communicator: NCCL's symmetric window
    /// (`ncclCommWindowRegister` with `NCCL_WIN_COLL_SYMMETRIC`), which lets the library run small collectives on buffers
    /// inside windows with its faster symmetric kernels. Unlike [`Communicator::register`]:
    ///
    /// - **Collective.** Every member calls it, in the same order relative to its other
    ///   windows, with memory of the same number of bytes; a collective on windows passes the
    ///   same offset into them on every member. The sizes are compared across members before
    ///   the library is called: a mismatch, or memory a member cannot register (of no bytes,
    ///   on another device, or that its library cannot take), is an `InvalidArgument` on
    ///   every member; a member that never calls it, a `Timeout` after the operation
    ///   timeout.
    /// - **Memory** must be what [`crate::Platform::alloc_registrable`] gives (NCCL: cuMem
    ///   memory from `ncclMemAlloc`).
    /// - **Dropping it is collective too** where the library's deregistration is (NCCL):
    ///   members drop their windows in the same order. A member that never does
    ///   leaves the others' drop blocked until the operation timeout, which then aborts
    ///   their communicator (the error is logged from `drop`, returned from `into_inner`).
    ///
    /// Where the backend has no windows (`Capabilities::windows` false) it succeeds and does
    /// nothing ([`Registered::is_registered`] says which); use it there as any buffer.
    ///
    /// # Errors
    /// `InvalidArgument` (naming `mem`, the rank and the group) for memory on another device,
    /// of no bytes, of another size than another member's, or that the library cannot take;
    /// `Timeout` when a member never registers it; `Aborted` on a dead communicator;
    /// `Backend` when the library refuses.
    pub async fn register_window<M: Deref<Target = dyn DeviceMemory>>(&self, mem: M) -> Result<Registered<'_, M>> {
        const OP: &str = "register_window";
        let (device, bytes) = {
            let view = mem.view();
            (view.device(), view.bytes())
        };
        let unfit = self.check_device(OP, "mem", device).and_then(|()| match bytes {
            0 => Err(self.invalid(OP, "mem", "the buffer holds no bytes: nothing to register")),
            _ => Ok(()),
        });
        let deadline = crate::deadline_in(self.config.op_timeout);
        if let Err(e) = unfit {
            // The other members still hear of it (they fail alike instead of waiting), and
            // every member counts the window, so the next ones still pair up.
            let why = match &e {
                crate::Error::InvalidArgument { msg, .. } => msg.clone(),
                e => e.to_string(),
            };
            let _ = self.inner.register_window(mem.view(), Some(&why), deadline).await;
            return Err(e);
        }
        let handle = self.inner.register_window(mem.view(), None, deadline).await?;
        Ok(Registered { comm: self, handle, window: true, mem: Some(mem) })
    }
}

impl<M: Deref<Target = dyn DeviceMemory>> Deref for Registered<'_, M> {
    type Target = dyn DeviceMemory;
    fn deref(&self) -> &Self::Target {
        &**self.memory()
    }
}

impl<M: DerefMut<Target = dyn DeviceMemory>> DerefMut for Registered<'_, M> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut **self.mem.as_mut().unwrap_or_else(|| unreachable!("taken only by into_inner and drop"))
    }
}

/// A window's agreement among the members of a communicator, for backends
/// ([`crate::Collective::register_window`]): window `seq` of `bytes` bytes on rank `rank` of
/// `size` (or, with `refusal`, memory this rank's library cannot take) is published under
/// `prefix` in `store` and compared with every other member's by `deadline`. So a mismatch
/// or a refusal anywhere is an error on every member before the library's collective call,
/// which would otherwise leave the others waiting inside it.
///
/// # Errors
/// `InvalidArgument` naming `mem`, the rank, the group and every member that differs or
/// refused; `Timeout` naming every member that never published; the store's.
#[allow(clippy::too_many_arguments)]
pub async fn agree_window(
    store: &dyn crate::Store,
    prefix: &str,
    group: &str,
    (rank, size): (usize, usize),
    seq: u64,
    bytes: usize,
    refusal: Option<&str>,
    deadline: std::time::Instant,
) -> Result<()> {
    const OP: &str = "register_window";
    use super::meet::{decide, Offer, Verdict};
    let started = std::time::Instant::now();
    let base = format!("{prefix}/window{seq}");
    let ctx = crate::Ctx::new("anyccl", rank, group);
    let sizes = |all: &[(usize, String)]| {
        let each: Vec<String> = all.iter().map(|(r, v)| format!("rank {r} {v}")).collect();
        format!("the sizes differ ({} bytes)", each.join(", "))
    };
    let (value, refused) = (bytes.to_string(), refusal.map(|why| format!("cannot register it: {why}")));
    let offer = match &refused {
        Some(why) => Offer::Refuse(why),
        None => Offer::Ready { value: &value, differ: &sizes },
    };
    // One verdict for every member: a member that saw every size agree and one whose wait
    // ran out would otherwise part, one into the library's collective call, one not.
    match decide(store, &base, (rank, size), &format!("{OP} for window #{seq}"), offer, deadline).await? {
        Verdict::Go => Ok(()),
        Verdict::Missing(who) => Err(ctx.timeout(OP, started.elapsed(), who)),
        Verdict::Refused(why) => Err(ctx.invalid(
            OP,
            "mem",
            format!(
                "window #{seq} ({bytes} bytes here) is registered by no member: {why} (a window is memory the \
                 library can map, of the same size on every member)"
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::agree_window;
    use crate::store::{MemoryStore, Store};
    use crate::Error;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// Every member's result of window `seq`, member `r` offering `offers[r]` (bytes, or a
    /// refusal); `None` for a member that never takes part.
    fn agree(offers: &[Option<Result<usize, &'static str>>], wait: Duration) -> Vec<Option<crate::Result<()>>> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let n = offers.len();
        rt.block_on(async {
            let tasks: Vec<_> = offers
                .iter()
                .enumerate()
                .map(|(r, o)| {
                    let (store, o) = (store.clone(), *o);
                    tokio::spawn(async move {
                        let o = o?;
                        let (bytes, refusal) = match o {
                            Ok(b) => (b, None),
                            Err(why) => (64, Some(why)),
                        };
                        Some(agree_window(&*store, "t", "g", (r, n), 0, bytes, refusal, Instant::now() + wait).await)
                    })
                })
                .collect();
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        })
    }

    fn msg(r: &Option<crate::Result<()>>) -> String {
        match r {
            Some(Err(Error::InvalidArgument { op: "register_window", arg: "mem", group, msg, .. })) if group == "g" => {
                msg.clone()
            }
            other => panic!("expected a refusal naming mem and the group, got {other:?}"),
        }
    }

    #[test]
    fn members_of_one_size_agree() {
        let r = agree(&[Some(Ok(64)), Some(Ok(64)), Some(Ok(64))], Duration::from_secs(5));
        assert!(r.iter().all(|r| matches!(r, Some(Ok(())))), "{r:?}");
    }

    #[test]
    fn a_different_size_is_refused_on_every_member() {
        let r = agree(&[Some(Ok(64)), Some(Ok(64)), Some(Ok(128))], Duration::from_secs(5));
        // One verdict, the same words on every member.
        for m in &r {
            assert!(msg(m).contains("the sizes differ (rank 0 64, rank 1 64, rank 2 128 bytes)"), "{}", msg(m));
        }
    }

    #[test]
    fn a_refusal_is_an_error_on_every_member() {
        let r = agree(&[Some(Ok(64)), Some(Err("not cuMem memory"))], Duration::from_secs(5));
        for m in &r {
            assert!(msg(m).contains("rank 1: cannot register it: not cuMem memory"), "{}", msg(m));
        }
    }

    /// A member that comes after another's wait ran out sees every size agree, yet adopts
    /// the stored verdict: both fail alike (neither enters the library's collective call
    /// while the other does not), and it learns at once.
    #[test]
    fn a_member_that_comes_late_fails_like_the_one_that_timed_out() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let store = MemoryStore::new();
        let (early, late) = rt.block_on(async {
            let early =
                agree_window(&store, "t", "g", (0, 2), 0, 64, None, Instant::now() + Duration::from_millis(200));
            let early = early.await;
            let t = Instant::now();
            let late =
                agree_window(&store, "t", "g", (1, 2), 0, 64, None, Instant::now() + Duration::from_secs(30)).await;
            (early, (late, t.elapsed()))
        });
        for r in [&early, &late.0] {
            assert!(matches!(r, Err(Error::Timeout { op, .. }) if op == "register_window"), "{r:?}");
        }
        assert!(late.1 < Duration::from_secs(1), "the late member waited {:?}", late.1);
    }

    #[test]
    fn a_member_that_never_registers_is_named_at_the_deadline() {
        let t = Instant::now();
        let r = agree(&[Some(Ok(64)), None], Duration::from_millis(300));
        match &r[0] {
            Some(Err(Error::Timeout { op, detail, .. })) if op == "register_window" => {
                assert!(
                    detail.contains("ranks [1] of the group never called register_window for window #0"),
                    "{detail}"
                )
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(3), "took {:?}", t.elapsed());
    }
}
