//! What a backend can do, as plain data. Shared code branches on these fields, never on a
//! backend's name.

use crate::buffer::DeviceKind;
use crate::dtype::{DType, ReduceOp};

/// A backend communicator's capabilities.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// Where its buffers must live.
    pub device_kind: DeviceKind,
    /// Element types accepted by every data-plane op.
    pub dtypes: Vec<DType>,
    /// Reduce ops accepted by all_reduce, reduce and reduce_scatter.
    pub reduce_ops: Vec<ReduceOp>,
    /// all_to_all with equal splits.
    pub all_to_all: bool,
    /// all_to_all with explicit per-peer counts.
    pub all_to_all_v: bool,
    /// Batched point-to-point groups.
    pub p2p_group: bool,
    /// `abort` stops in-flight operations (false where the library can only destroy).
    pub abort_in_flight: bool,
    /// `split` builds sub-communicators.
    pub split: bool,
    /// Transports connect on first use, so a warmup is worth running.
    pub lazy_connect: bool,
    /// The backend reports device memory held by the communicator itself.
    pub memory_stats: bool,
    /// A small probe size (bytes) that selects the latency-bound path.
    pub warmup_small_bytes: usize,
    /// A large probe size (bytes) that selects the bandwidth-bound path.
    pub warmup_large_bytes: usize,
    /// Largest group size supported.
    pub max_world_size: usize,
    /// A peer's death or abort ends the other ranks' waits with `PeerFailed` (otherwise
    /// they end at their deadline with `Timeout`).
    pub detects_peer_failure: bool,
    /// The first operation that needs a new connection may block inside the enqueue call
    /// until the peers connect (bounded by the op timeout, then `Timeout`); later ones never
    /// wait for peers.
    pub first_call_may_block: bool,
    /// Ranks issuing different collectives get an error instead of undefined results.
    pub detects_mismatch: bool,
    /// Most ranks that can share one host (one per device for GPU backends).
    pub max_local_ranks: usize,
    /// Operations can be ordered with an engine's own streams without the host waiting
    /// (`Communicator::wait_stream`, `signal_stream`).
    pub streams: bool,
    /// Operations can be captured into an engine's CUDA graph (ACL graph on Ascend) and replayed
    /// (`Communicator::capture_all_reduce`).
    pub graphs: bool,
    /// The library takes per-communicator thread-block settings (`CommConfig::min_ctas`,
    /// `max_ctas`, `cga_cluster_size`); elsewhere connecting with one set is refused.
    pub cta_settings: bool,
    /// Buffers can be registered with a communicator (`Communicator::register`), letting the
    /// library skip its staging copies; elsewhere registering succeeds and does nothing.
    pub buffer_registration: bool,
    /// Buffers can be registered collectively as windows (`Communicator::register_window`:
    /// NCCL's symmetric windows, whose kernels serve small collectives on them faster);
    /// elsewhere registering a window succeeds and does nothing.
    pub windows: bool,
}

impl Capabilities {
    /// Whether `dtype` is accepted.
    pub fn supports_dtype(&self, dtype: DType) -> bool {
        self.dtypes.contains(&dtype)
    }
    /// Whether `op` is accepted.
    pub fn supports_reduce_op(&self, op: ReduceOp) -> bool {
        self.reduce_ops.contains(&op)
    }
}
