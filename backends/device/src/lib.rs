//! anyccl-device: what every stream-based device collective library needs, written once,
//! so the NCCL and HCCL backends are adapters of a few hundred lines each.
//!
//! # Design choices
//! - **Two small traits.** [`Runtime`] is the device runtime (bind a device to the
//!   calling thread, streams, events, memory, free memory); [`Library`] is the collective
//!   library (root id, init, split, launch one operation on a stream, async error,
//!   destroy, memory held). [`DeviceComm`] implements `Collective` and its `Work` over
//!   them; [`DevicePlatform`] implements `Platform` over a runtime.
//! - **Differences are data.** Whether a library can stop a call blocked inside it
//!   (NCCL's abort can, HCCL has no abort), whether a split needs the new group's members
//!   or a fresh root id (HCCL), and whether a launch may still be in progress when it
//!   returns (NCCL's non-blocking communicators) are answered by the library, never by
//!   its name.
//! - **One lifecycle.** A communicator is [`Lifecycle::Live`] until it shuts down, times
//!   out, fails or is aborted; the first transition wins, frees the library's
//!   communicator once and fixes the error every later call gets.
//! - **Every wait has a deadline.** Init, split and shutdown take one; a launch that
//!   blocks inside the library (a first call connecting to a peer that never comes) is
//!   watched by one process-wide watchdog thread, which stops it where the library can
//!   and otherwise fails the communicator so the call returns an error when the library's
//!   own timeout (set from the communicator's) releases it.
//! - **Marks settle many `Work`s.** Operations are numbered in stream order; an event (a
//!   mark) recorded after one settles every operation before it. The mark an operation
//!   with a `Work` is owed is recorded before anything else goes on the stream (the next
//!   call), so it follows that operation alone; a `Work` waited before then asks the stream
//!   itself (`Runtime::stream_done`) and no event is recorded. With
//!   `CommConfig::shared_completion`, a mark is recorded at a `Work`'s first look, so calls
//!   issued back to back and then waited share one event.
//! - **Errors keep their cause.** Libraries report [`LibError`] (code, name, text, kind);
//!   [`LibError::into_error`] turns one into anyccl's in a communicator's context (core's `Ctx`), keeping
//!   the `LibError` as the source.
//! - **Loading at run time.** [`loader`] opens the first of a list of candidates and
//!   reports every place looked; newer symbols are optional.
#![warn(missing_docs)]

mod backend;
mod buffer;
mod comm;
mod error;
mod library;
pub mod loader;
mod runtime;
#[cfg(feature = "testing")]
pub mod testing;
mod watchdog;

pub use backend::{Adapter, DeviceBackend, Loaded};
pub use buffer::{DeviceBuffer, Free};
pub use comm::{fresh_comm, DeviceComm, Lifecycle};
pub use error::{ErrorKind, LibError};
pub use library::{
    root_id_bytes, Ctas, Init, Launched, Library, Op, Parts, Plane, Poll, RawP2P, Region, Settings, SplitRequest,
    SplitStart,
};
pub use runtime::{DevicePlatform, Runtime};
