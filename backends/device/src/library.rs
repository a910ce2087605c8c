//! The collective library a [`crate::DeviceComm`] drives ([`Library`]), and what passes
//! between them.

use crate::error::LibError;
use crate::runtime::Runtime;
use anyccl_core::{Capabilities, CommConfig, DType, ReduceOp};
use std::ffi::c_void;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Per-communicator settings a library passes to its own init and split calls.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The group name (NCCL's `commName`, HCCL's `hcclCommName`).
    pub name: String,
    /// Staging buffer per direction in MiB (HCCL's `hcclBufferSize`); `None`: the
    /// library's default.
    pub buffer_mb: Option<u32>,
    /// How long one operation may take: libraries that cannot be stopped from outside get
    /// it as their own execution timeout.
    pub op_timeout: Duration,
    /// How long one call may block inside the library (a first call connecting).
    pub enqueue_timeout: Duration,
    /// Thread-block settings (`CommConfig::min_ctas`, `max_ctas`, `cga_cluster_size`), for
    /// libraries with `Capabilities::cta_settings`.
    pub ctas: Ctas,
    /// `CommConfig::shared_completion`: a `Work`'s event is recorded at its first look and
    /// shared, not as the next operation is issued.
    pub shared_completion: bool,
}

/// Per-communicator thread-block settings; `None`: the library's default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ctas {
    /// Fewest thread blocks per collective.
    pub min: Option<u32>,
    /// Most thread blocks per collective.
    pub max: Option<u32>,
    /// Thread-block cluster size.
    pub cga_cluster_size: Option<u32>,
}

impl Settings {
    /// Settings for group `name` from the communicator's configuration.
    pub fn from_config(name: &str, c: &CommConfig, enqueue_timeout: Duration) -> Self {
        Settings {
            name: name.to_string(),
            buffer_mb: c.buffer_mb,
            op_timeout: c.op_timeout,
            enqueue_timeout,
            ctas: Ctas { min: c.min_ctas, max: c.max_ctas, cga_cluster_size: c.cga_cluster_size },
            shared_completion: c.shared_completion,
        }
    }
}

/// One send or receive of a batched group, with a device address.
#[derive(Debug, Clone, Copy)]
pub struct RawP2P {
    /// Send (`true`) or receive.
    pub send: bool,
    /// Device address.
    pub ptr: *mut c_void,
    /// Elements.
    pub count: usize,
    /// Element type.
    pub dtype: DType,
    /// The other rank.
    pub peer: usize,
}

/// One operation to put on a stream, with device addresses. Counts are elements; in-place
/// operations have `send == recv` (all_gather: `send` is this rank's chunk of `recv`).
#[derive(Debug)]
#[allow(missing_docs)] // fields are the C calls' arguments
pub enum Op {
    AllReduce {
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    },
    Reduce {
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    },
    Broadcast {
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
        root: usize,
    },
    /// `count` per rank.
    AllGather {
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
    },
    /// `count` per rank (the output's length).
    ReduceScatter {
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    },
    /// `count` per peer.
    AllToAll {
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
    },
    /// Per-peer counts and element offsets.
    AllToAllV {
        send: *const c_void,
        recv: *mut c_void,
        sends: Parts,
        recvs: Parts,
        dtype: DType,
    },
    Send {
        buf: *const c_void,
        count: usize,
        dtype: DType,
        peer: usize,
    },
    Recv {
        buf: *mut c_void,
        count: usize,
        dtype: DType,
        peer: usize,
    },
    Group(Vec<RawP2P>),
    /// `scratch`: one zeroed `f32` of device memory the communicator owns.
    Barrier {
        scratch: *mut c_void,
    },
}

impl Op {
    /// The operation's name, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Op::AllReduce { .. } => "all_reduce",
            Op::Reduce { .. } => "reduce",
            Op::Broadcast { .. } => "broadcast",
            Op::AllGather { .. } => "all_gather",
            Op::ReduceScatter { .. } => "reduce_scatter",
            Op::AllToAll { .. } | Op::AllToAllV { .. } => "all_to_all",
            Op::Send { .. } => "send",
            Op::Recv { .. } => "recv",
            Op::Group(_) => "p2p_group",
            Op::Barrier { .. } => "barrier",
        }
    }
}

/// Device memory a library registers: `bytes` bytes at `ptr`, of the communicator's device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Where it starts.
    pub ptr: *mut c_void,
    /// How long it is.
    pub bytes: usize,
}

/// One side of an all_to_all_v: elements per peer and where each peer's part starts, in
/// elements from the buffer's start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parts {
    /// Elements per peer.
    pub counts: Vec<usize>,
    /// Element offset of each peer's part.
    pub displs: Vec<usize>,
}

impl Parts {
    /// Parts of `counts` elements laid end to end.
    pub fn packed(counts: &[usize]) -> Self {
        let displs = counts
            .iter()
            .scan(0usize, |at, &c| {
                let d = *at;
                *at += c;
                Some(d)
            })
            .collect();
        Parts { counts: counts.to_vec(), displs }
    }
}

/// What every member of a new communicator passes to [`Library::init_start`]: the root id the
/// group's first rank made, this rank's place and the group's settings.
#[derive(Debug, Clone, Copy)]
pub struct Init<'a> {
    /// The root id's bytes, as the store carried them ([`Library::ROOT_ID_LEN`] of them).
    pub id: &'a [u8],
    /// This rank in the new communicator.
    pub rank: usize,
    /// Members of the new communicator.
    pub size: usize,
    /// The group's settings.
    pub settings: &'a Settings,
}

impl Init<'_> {
    /// The root id as a library's C array of `N` (`ncclUniqueId`'s and `HcclRootInfo`'s
    /// `internal`), zero past the bytes given.
    pub fn id_array<const N: usize>(&self) -> [std::ffi::c_char; N] {
        let mut a = [0; N];
        for (d, s) in a.iter_mut().zip(self.id) {
            *d = *s as std::ffi::c_char;
        }
        a
    }
}

/// A root id as the bytes the store carries, from a library's C array (`ncclUniqueId`'s
/// and `HcclRootInfo`'s `internal`).
pub fn root_id_bytes(internal: &[std::ffi::c_char]) -> Vec<u8> {
    internal.iter().map(|&c| c as u8).collect()
}

/// How a launch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launched {
    /// On the stream: an event recorded now follows it.
    Enqueued,
    /// The library is still putting it on the stream asynchronously (NCCL's
    /// `ncclInProgress`): no other call may be made until [`Library::async_error`] on the
    /// data plane says it finished.
    InProgress,
}

/// Which of a communicator's library handles a poll concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plane {
    /// The one launches run on.
    Data,
    /// The one init and splits run on (the same as `Data` for most libraries).
    Control,
}

/// A step of an asynchronous init or split.
#[derive(Debug)]
pub enum Poll<T> {
    /// Finished.
    Ready(T),
    /// Still running: poll again.
    Pending,
}

/// How a split begins.
#[derive(Debug)]
pub enum SplitStart<P> {
    /// The library splits: poll `P` to completion ([`Library::poll`]).
    Started(P),
    /// The library has no split for this: the members exchange a fresh root id through
    /// the store and init a new communicator ([`Library::init_start`]).
    ViaRootId,
}

/// What a split asks for. Every rank of the parent passes one, in the same order.
#[derive(Debug)]
pub struct SplitRequest<'a> {
    /// Ranks with the same colour form one group; `None` joins none.
    pub color: Option<u32>,
    /// Order within the new group (ties by parent rank).
    pub key: u32,
    /// The new group's parent ranks in new-rank order, when the library asked for them
    /// ([`Library::split_needs_members`]); empty for ranks that join no group.
    pub members: &'a [usize],
    /// This rank's place in `members`.
    pub new_rank: Option<usize>,
    /// A number equal on every member and different for every split of this parent.
    pub id: u64,
    /// The new communicator's settings.
    pub settings: &'a Settings,
}

/// A collective library that enqueues on device streams.
///
/// A new backend starts here: with a [`Runtime`] and a `Library`, [`crate::DeviceComm`] is
/// its communicator (lifecycle, watchdog, `Work`, splits, shutdown) and
/// [`crate::DeviceBackend`] its backend, with no more code; the testing library
/// (`anyccl_device::testing`, a whole `Library` of one rank) is the smallest one to read.
///
/// # Examples
/// A communicator over the testing library (`testing` feature), used as every backend's is:
/// ```
/// # #[cfg(feature = "testing")] {
/// use anyccl_core::{CommConfig, DType, DeviceMemory, HostMemory, ReduceOp};
/// use anyccl_device::testing::{NullLibrary, NullRuntime};
/// use std::sync::Arc;
/// use std::time::Duration;
///
/// let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
/// let lib = NullLibrary::default().leak();
/// let comm = rt.block_on(lib.communicator(Arc::new(NullRuntime::new()), "doc", CommConfig::default()))?;
/// let mut grads = HostMemory::new(DType::F32, 8);
/// comm.all_reduce(None, grads.view_mut(), ReduceOp::Sum)?.wait(Duration::from_secs(1))?;
/// rt.block_on(comm.shutdown())?;
/// # }
/// # Ok::<(), anyccl_core::Error>(())
/// ```
///
/// [`crate::DeviceComm`] guarantees: calls on one communicator are never concurrent,
/// except [`Library::destroy`] while another thread is blocked inside a call when
/// [`Library::can_stop_blocked`] says that unblocks it; `destroy` is called once, and
/// nothing is called on a communicator after it.
pub trait Library: Send + Sync + fmt::Debug + 'static {
    /// The device runtime.
    type Runtime: Runtime;
    /// The library's handles for one communicator.
    type Comm: Send + Sync + fmt::Debug;
    /// An init or split in progress.
    type Pending: Send;

    /// The backend's name (`nccl`, `hccl`).
    fn backend(&self) -> &'static str;
    /// What its communicators support on `rt`'s device.
    fn capabilities(&self, rt: &Self::Runtime) -> Capabilities;
    /// Bytes of a root id.
    const ROOT_ID_LEN: usize;
    /// A new root id; called by the group's first rank, which publishes it. The device is
    /// current.
    ///
    /// # Errors
    /// The library's.
    fn root_id(&self) -> Result<Vec<u8>, LibError>;
    /// Begin creating the communicator `init` describes. The device is current.
    ///
    /// # Errors
    /// The library's.
    fn init_start(&self, rt: &Arc<Self::Runtime>, init: Init<'_>) -> Result<Self::Pending, LibError>;
    /// One look at an init or split in progress: `Ready(None)` when a split put this rank
    /// in no group.
    ///
    /// # Errors
    /// The library's; the caller then calls [`Library::abandon`].
    fn poll(&self, pending: &mut Self::Pending) -> Result<Poll<Option<Self::Comm>>, LibError>;
    /// Give up on an init or split (an error or the deadline): free what it built, now or
    /// when the library lets go of it, never blocking.
    fn abandon(&self, pending: Self::Pending);
    /// Whether a split needs the new group's members ([`SplitRequest::members`]): costs
    /// one store exchange among the parent's ranks.
    fn split_needs_members(&self) -> bool;
    /// Begin a split of `parent` (under the communicator's call lock).
    ///
    /// # Errors
    /// The library's.
    fn split_start(&self, parent: &Self::Comm, req: &SplitRequest<'_>) -> Result<SplitStart<Self::Pending>, LibError>;
    /// The size of and this rank's place in a communicator.
    ///
    /// # Errors
    /// The library's.
    fn rank_size(&self, comm: &Self::Comm) -> Result<(usize, usize), LibError>;
    /// Put `op` on `stream`. The device is current.
    ///
    /// # Safety
    /// Every address in `op` must be device memory of the communicator's device, valid for
    /// the counts given until the stream has passed the operation.
    ///
    /// # Errors
    /// The library's.
    unsafe fn launch(
        &self,
        comm: &Self::Comm,
        stream: &<Self::Runtime as Runtime>::Stream,
        op: &Op,
    ) -> Result<Launched, LibError>;
    /// The communicator's asynchronous error on `plane`: `Ok(true)` while an asynchronous
    /// step is still in progress, `Ok(false)` when idle and healthy.
    ///
    /// # Errors
    /// The error the communicator reported.
    fn async_error(&self, comm: &Self::Comm, plane: Plane) -> Result<bool, LibError>;
    /// Whether [`Library::destroy`] may run while another thread is blocked inside a call on
    /// the communicator, and releases that call (NCCL's abort does; HCCL has no abort).
    fn can_stop_blocked(&self) -> bool;
    /// Free the communicator without waiting for peers.
    fn destroy(&self, comm: &Self::Comm);
    /// Device memory the communicator holds, where the library can say.
    fn memory_held(&self, comm: &Self::Comm) -> Option<u64>;
    /// Register device memory with the communicator (NCCL's `ncclCommRegister`, HCCL's
    /// `HcclCommRegister`): the library's handle, or `None` where the library has no
    /// registration (`Capabilities::buffer_registration` false). The device is current.
    ///
    /// # Safety
    /// `at` is memory of the communicator's device that stays allocated until
    /// [`Library::deregister`] or the communicator's destroy.
    ///
    /// # Errors
    /// The library's.
    unsafe fn register(&self, comm: &Self::Comm, at: Region) -> Result<Option<usize>, LibError> {
        let _ = (comm, at);
        Ok(None)
    }
    /// Undo a [`Library::register`] that returned `handle`. The device is current.
    ///
    /// # Errors
    /// The library's.
    fn deregister(&self, comm: &Self::Comm, handle: usize) -> Result<(), LibError> {
        let _ = (comm, handle);
        Ok(())
    }
    /// Why `at` cannot be a window of this library (NCCL's need memory from
    /// `ncclMemAlloc`), asked on every rank before the members agree to register, so a
    /// refusal is an error on all of them instead of a peer left waiting inside the
    /// library. The device is current.
    fn window_refusal(&self, at: Region) -> Option<String> {
        let _ = at;
        None
    }
    /// Register `at` as a window of the communicator (NCCL's
    /// `ncclCommWindowRegister`, HCCL's `HcclCommSymWinRegister`): collective, called by
    /// the device layer on every rank once all agreed on the size. `None` where the library
    /// has no windows (`Capabilities::windows` false). The device is current.
    ///
    /// # Safety
    /// As [`Library::register`], until [`Library::deregister_window`].
    ///
    /// # Errors
    /// The library's.
    unsafe fn register_window(&self, comm: &Self::Comm, at: Region) -> Result<Option<usize>, LibError> {
        let _ = (comm, at);
        Ok(None)
    }
    /// Undo a [`Library::register_window`] that returned `handle` (collective where the
    /// library's is). The device is current.
    ///
    /// # Errors
    /// The library's.
    fn deregister_window(&self, comm: &Self::Comm, handle: usize) -> Result<(), LibError> {
        let _ = (comm, handle);
        Ok(())
    }
}

/// Declares one `unsafe fn` per data-plane call of a library's function table, for an
/// adapter's result layer: `name => Field(args);` becomes `pub unsafe fn name(lib, args..,
/// comm, stream)`, documented as the C function `<prefix>Field`, which calls
/// `lib.Field(args.., comm, stream)` and hands the code to `then(lib, "<prefix>Field", code,
/// comm)`, the adapter's own code check.
///
/// `common: (send, count, rank);` declares the calls whose C signatures NCCL and the
/// libraries that follow its API share, over the library's send-pointer, count and rank
/// types: `all_reduce`, `reduce`, `all_gather`, `reduce_scatter`, `send`, `recv`.
///
/// ```ignore
/// anyccl_device::launch_fns! {
///     table: NcclLib, comm: ncclComm_t, stream: Stream, prefix: "nccl", then: launched => Result<bool, NcclError>;
///     common: (*const c_void, usize, c_int);
///     broadcast => Broadcast(s: *const c_void, r: *mut c_void, n: usize, d: c_int, root: c_int);
/// }
/// ```
#[macro_export]
macro_rules! launch_fns {
    (table: $lib:ty, comm: $comm:ty, stream: $stream:ty, prefix: $prefix:literal, then: $then:path => $ret:ty;
     common: ($sp:ty, $n:ty, $r:ty); $($rest:tt)*) => {
        $crate::launch_fns! {
            table: $lib, comm: $comm, stream: $stream, prefix: $prefix, then: $then => $ret;
            all_reduce => AllReduce(s: $sp, r: *mut ::std::ffi::c_void, n: $n, d: ::std::ffi::c_int, o: ::std::ffi::c_int);
            reduce => Reduce(s: $sp, r: *mut ::std::ffi::c_void, n: $n, d: ::std::ffi::c_int, o: ::std::ffi::c_int, root: $r);
            all_gather => AllGather(s: $sp, r: *mut ::std::ffi::c_void, n: $n, d: ::std::ffi::c_int);
            reduce_scatter => ReduceScatter(s: $sp, r: *mut ::std::ffi::c_void, n: $n, d: ::std::ffi::c_int, o: ::std::ffi::c_int);
            send => Send(s: $sp, n: $n, d: ::std::ffi::c_int, peer: $r);
            recv => Recv(r: *mut ::std::ffi::c_void, n: $n, d: ::std::ffi::c_int, peer: $r);
            $($rest)*
        }
    };
    (table: $lib:ty, comm: $comm:ty, stream: $stream:ty, prefix: $prefix:literal, then: $then:path => $ret:ty;
     $($(#[$doc:meta])* $fname:ident => $field:ident ($($arg:ident : $ty:ty),*);)*) => {$(
        #[doc = concat!("`", $prefix, stringify!($field), "`.")]
        $(#[$doc])*
        ///
        /// # Safety
        /// See the module's data-plane calls.
        pub unsafe fn $fname(lib: &$lib, $($arg: $ty,)* comm: $comm, stream: $stream) -> $ret {
            // SAFETY: per the caller.
            let code = unsafe { (lib.$field)($($arg,)* comm, stream) };
            $then(lib, concat!($prefix, stringify!($field)), code, comm)
        }
    )*};
}
