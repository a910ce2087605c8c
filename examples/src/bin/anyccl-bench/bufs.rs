//! The rows' buffers: plain or registered (`--register`, `--window`), and how many receive
//! buffers a run back to back may hold.

use anyccl::{Communicator, DType, DeviceKind, DeviceMemory, Platform, Result};

/// A buffer of the benchmark: plain, or registered with the communicator (`--register`).
pub(crate) enum Mem<'c> {
    Plain(Box<dyn DeviceMemory>),
    Registered(anyccl::Registered<'c, Box<dyn DeviceMemory>>),
}

impl std::ops::Deref for Mem<'_> {
    type Target = dyn DeviceMemory;
    fn deref(&self) -> &Self::Target {
        match self {
            Mem::Plain(m) => m.as_ref(),
            Mem::Registered(r) => &**r,
        }
    }
}

impl std::ops::DerefMut for Mem<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        match self {
            Mem::Plain(m) => m.as_mut(),
            Mem::Registered(r) => &mut **r,
        }
    }
}

/// How the rows' buffers are allocated and registered.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Registration {
    Plain,
    /// `--register`.
    Local,
    /// `--window`.
    Window,
}

impl Registration {
    /// What the header says of the buffers, where they are registered.
    pub(crate) fn header(self, caps: &anyccl::Capabilities) -> Option<&'static str> {
        match self {
            Registration::Plain => None,
            Registration::Local if caps.buffer_registration => {
                Some("allocated for registration and registered with the communicator (--register)")
            }
            Registration::Local => Some("--register: this backend has no buffer registration; plain buffers"),
            Registration::Window if caps.windows => {
                Some("allocated for registration and registered as windows of the communicator (--window)")
            }
            Registration::Window => Some("--window: this backend has no windows; plain buffers"),
        }
    }
}

/// Receive buffers per size with `--window` when `--depth` does not say: each is a
/// collective registration, and every rank must make the same ones.
pub(crate) const WINDOW_DEPTH: usize = 8;

/// `count` elements for the rows: allocated the way the library registers best and
/// registered with `comm` (`--register`), or registered as a window of it (`--window`:
/// collective), or plain.
pub(crate) async fn alloc_mem<'c>(
    platform: &dyn Platform,
    comm: &'c Communicator,
    how: Registration,
    dtype: DType,
    count: usize,
) -> Result<Mem<'c>> {
    Ok(match how {
        _ if count == 0 => Mem::Plain(platform.alloc(dtype, count)?),
        Registration::Plain => Mem::Plain(platform.alloc(dtype, count)?),
        Registration::Local => Mem::Registered(comm.register(platform.alloc_registrable(dtype, count)?)?),
        Registration::Window => Mem::Registered(comm.register_window(platform.alloc_registrable(dtype, count)?).await?),
    })
}

pub(crate) struct Bufs<'c> {
    pub(crate) send: Mem<'c>,
    /// Receive buffers of out-of-place calls, then the buffers of in-place calls
    /// (re-allocated where the shape differs: reduce_scatter's hold the whole input).
    pub(crate) recvs: Vec<Mem<'c>>,
    /// The encoded input of an in-place call (that buffer's size).
    pub(crate) in_place_input: Vec<u8>,
}

/// What a rank may hold for a run back to back ([`budget`]).
#[derive(Clone, Copy)]
pub(crate) struct Budget {
    /// Bytes of receive buffers.
    bytes: usize,
    /// What each operation in flight counts at least: besides its output it holds a record
    /// in the library, and both take room in the cache ([`HOST_PER_OP`]).
    per_op: usize,
    /// Outputs at most, whatever their size ([`DEVICE_OUTPUTS`] on a device).
    outputs: usize,
}

/// Bytes of receive buffers a rank may hold for a run back to back: host memory is shared
/// by this host's ranks, a device's is its rank's own. The bench holds up to three copies of
/// the depth (results, in-place inputs, and a backend's copy of results not yet waited for),
/// so each rank takes an eighth of its share, 4 GiB at most on a device and
/// [`HOST_IN_FLIGHT`] on the host, where each operation counts [`HOST_PER_OP`] at least.
pub(crate) fn budget(platform: &dyn Platform, local_world_size: usize) -> Budget {
    let free = platform.mem_info().map(|m| m.free).unwrap_or(u64::MAX);
    let host = platform.kind() == DeviceKind::Cpu;
    let sharing = if host { local_world_size.max(1) as u64 } else { 1 };
    let most = if host { HOST_IN_FLIGHT } else { 4 << 30 };
    Budget {
        bytes: (free / sharing / 8).min(most as u64) as usize,
        per_op: if host { HOST_PER_OP } else { 1 },
        outputs: if host { usize::MAX } else { DEVICE_OUTPUTS },
    }
}

/// The header's word for `--depth d` (the budget of a size may hold fewer; a device keeps
/// [`DEVICE_OUTPUTS`] at most).
pub(crate) fn depth_said(d: usize, device: bool) -> String {
    let most = if device { d.min(DEVICE_OUTPUTS) } else { d };
    format!("up to {most} (--depth {d})")
}

/// The header's word for the default depth on a device.
pub(crate) fn device_depth_said() -> String {
    format!("as many as fit, {DEVICE_OUTPUTS} at most")
}

/// The header's word for the default depth on the host.
pub(crate) fn host_depth_said() -> String {
    format!("as many as {} KiB holds, {} KiB an operation at least", HOST_IN_FLIGHT >> 10, HOST_PER_OP >> 10)
}

/// What an operation in flight counts at least on the host ([`Budget::per_op`]): 64 in
/// flight at most. A small operation between two ranks of a host completes as it is issued
/// (the CPU backend's eager path), so a longer list only adds its outputs and its `Work`s to
/// what the cache must hold: 2 ranks, all_reduce, 1,000 calls a row, 512 B took 0.65-0.79 us
/// a call with 1,024 in flight, 0.39-0.46 with 64 and 0.37-0.41 waited one by one; 4-64 KiB
/// measured the same with 64 as with 1,024 and 256.
const HOST_PER_OP: usize = 16 << 10;

/// The receive buffers a rank on the host cycles through back to back, at most (about a
/// core's own cache): the host's processor is the device there, and outputs beyond its
/// cache measured the memory traffic of the bench's own buffers, not the library (2 ranks
/// all_reduce, every call run on its caller's buffers: 16 KiB with 20,000 outputs in flight,
/// 320 MiB, 12-21 us a call against 4.6-6.1 with 1,024 and 2.6-4.7 waited one by one; 2 MiB
/// with 16 in flight 229-297 us against 143-147 waited; 8 B with 100,000 in flight, whose
/// records alone took tens of MiB, 1.05 us against 0.5). `--depth` sets a smaller depth.
const HOST_IN_FLIGHT: usize = 1 << 20;

/// Outputs a rank on a device keeps in flight at most (each its own allocation, made and
/// written before the timing): small sizes fit thousands in the budget, and `-n 2000000` at
/// 8 B made two million allocations a size (minutes before the first row against the HCCL
/// stand-in, and as long on a GPU with `-n 10000`). 4,096 still takes the device layer past
/// its 1,024 spare events (`--vs-raw -n 2000`).
const DEVICE_OUTPUTS: usize = 4096;

/// Receive buffers of `bytes` each for `iters` calls back to back within `budget`.
pub(crate) fn depth(budget: Budget, bytes: usize, iters: usize) -> usize {
    budget.bytes.checked_div(bytes.max(budget.per_op)).unwrap_or(1).min(budget.outputs).clamp(1, iters.max(1))
}
