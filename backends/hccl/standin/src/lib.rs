//! anyccl-hccl-standin: a test-only HCCL and ACL that moves data, so the HCCL backend's
//! loading, marshalling, status mapping and the warmup run for real in CI. Never a
//! substitute for Ascend hardware.
//!
//! The build script compiles `src/standin.rs` into [`library_dir`] as `libhccl.so`, with
//! `libascendcl.so` and `libhcomm.so` linking to it. Point `ANYCCL_HCCL_LIBRARY_DIR` there.
//!
//! What it models: the HCCL and ACL symbols the backend uses with their real signatures
//! and type sizes (`HcclCommConfigInit` is not exported, as in HCCL); device memory from a
//! fixed pool per device (`ANYCCL_STANDIN_DEVICE_MEMORY`, default 64 GiB as on an Ascend 910B; `ANYCCL_STANDIN_DEVICES`
//! devices, default 8) reported by `aclrtGetMemInfo`, each allocation a mapping of host
//! address space that costs host memory only for the pages written (so the default pool fits
//! any machine, and a rank's RSS is what it wrote); the current device per thread; streams
//! that execute in order on a worker thread, and wait for each other's events
//! (`aclrtStreamWaitEvent`; the test hook `anyccl_standin_stream_sleep` delays a stream as
//! an engine's long kernel would); collectives that exchange data between
//! ranks (threads or processes) through a hub that the root rank's process runs; lazy
//! link set-up at the first use of each operator and of each send/recv pair, taking 2 ×
//! the buffer size from the pool and failing with `HCCL_E_OOM` when it does not fit, and
//! blocking until the peers arrive (bounded by `HCCL_CONNECT_TIMEOUT`, and by the
//! communicator's `hcclExecTimeOut` when set: an assumption about HCCL to verify on
//! Ascend); registration of device ranges per communicator (`HcclCommRegister`: a range
//! inside one allocation of the communicator's device, a handle valid once, dropped with
//! the communicator); error codes injected on request (`anyccl_standin_inject`, or
//! `ANYCCL_STANDIN_INJECT=call:code[:rank[:times]],...`); graph capture
//! (`aclmdlRICaptureBegin` to `aclmdlRIExecuteAsync`): work put on a capturing stream, or on
//! a stream that joined the capture by waiting for an event recorded in it, is recorded and
//! replayed in recorded order, collectives taking fresh sequence numbers at each replay.
#![forbid(unsafe_code)]

/// The folder holding the built stand-in (`libhccl.so`, `libascendcl.so`, `libhcomm.so`).
pub fn library_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("ANYCCL_HCCL_STANDIN_DIR"))
}
