//! anyccl-core: the contracts every anyccl backend implements and every user relies on.
//!
//! # Design choices
//! 1. **Portable.** Correct use gives the same results on every backend; the conformance
//!    suite (`anyccl-conformance`) defines "correct".
//! 2. **Two traits, two audiences.** [`Collective`] is the implementor contract: object
//!    safe, every method required, no conveniences. [`Communicator`] is what users hold: it
//!    validates every call once (dtype, counts, divisibility, root and peer ranges, device,
//!    aliasing), numbers operations per group, emits `tracing` spans with the fields
//!    `backend, group, rank, world_size, op, seq, bytes` and records each operation in a
//!    [`FlightRecorder`]. Backends may assume valid arguments.
//! 3. **Enqueue never waits for peers.** Data-plane calls return a [`Work`]; completion,
//!    failure and timeouts are observed through it. A timeout leaves the `Work` alive so the
//!    caller can abort the communicator; dropping an unfinished `Work` blocks until the
//!    backend no longer touches its buffers.
//! 4. **Every blocking path has a deadline.** Lifecycle calls (connect, health, abort,
//!    split, shutdown) take one; store waits take one.
//! 5. **Errors say what to do next.** One [`Error`] enum; [`Error::recovery`] answers retry,
//!    rebuild or give up. Backend codes and library text travel in its fields.
//! 6. **Capabilities are data.** Shared code branches on [`Capabilities`], never on a
//!    backend's name.
//! 7. **Groups are declared, never swept.** Every communicator has a [`GroupSpec`] with an
//!    owner and a [`Role`]; cross-engine groups are marked as such.
//! 8. **No panics for environmental problems.** A missing library is `Unavailable`.
//! 9. **`unsafe` only in buffer conversion** (the `buffer` module); the rest of core
//!    forbids it.
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[allow(unsafe_code)]
mod buffer;
mod capability;
mod clock;
mod collective;
mod communicator;
mod config;
mod detail;
mod dtype;
mod env;
mod error;
mod file;
mod group;
mod logging;
pub mod pattern;
mod platform;
mod recorder;
pub mod store;
pub mod trace;
mod work;

pub use buffer::{overlaps, Buf, BufMut, Device, DeviceKind, StreamRef};
pub use capability::Capabilities;
pub use clock::{coarse_now_ns, deadline_in};
pub use collective::{
    abort_all, AllToAllSplits, Backend, BackendInfo, Collective, CommInfo, ConnectOptions, GraphOp, P2POp, RegHandle,
};
pub use communicator::{agree_window, Captured, Communicator, OpSignature, Registered};
pub use config::{CommConfig, LaunchEnv};
pub use dtype::{DType, Element, ReduceOp};
pub use env::{
    bad_env, env_bytes, env_choice, env_flag, env_parse, env_parse_at, env_rank, env_secs, env_string, env_world_size,
    parse_bytes, parse_flag, parse_secs, MAX_TIMEOUT,
};
pub use error::{Ctx, Error, Recovery, Result, Source};
pub use file::{read_regular_file, write_file_atomically};
pub use group::{stable_hash, GroupRegistry, GroupSpec, Role};
pub use logging::init_logging;
pub use platform::{DeviceMemory, HostMemory, HostPlatform, MemInfo, Platform};
pub use recorder::{FlightRecorder, OpRecord, OpState, Ticket, MAX_RECORDS};
pub use store::{
    abandon_generation, connect_generation, in_new_generation, joined_generation, store_barrier, CasOutcome, EtcdStore,
    MemoryStore, PrefixStore, Store, StoreStats, TcpStore, TcpStoreOptions, TcpStoreServer,
};
pub use work::{TrackedWork, Work, WorkImpl, WorkInfo};

/// Re-exported so backends implement [`Collective`] with the same macro version.
pub use async_trait::async_trait;
/// Re-exported element types for 16-bit floats.
pub use half::{bf16, f16};
