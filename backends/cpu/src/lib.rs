//! anyccl-cpu: a Gloo-like CPU backend: ranks are processes (or threads, in tests) joined
//! by a full mesh of TCP connections, running every anyccl operation on every dtype.
//!
//! # Design choices
//! - **Eager transport.** Each connection has a reader thread that drains messages into
//!   per-peer queues, so sends never wait for receives and no send order can deadlock.
//! - **Ordered execution.** A communicator's operations run in issue order on one worker
//!   thread, as NCCL runs them in stream order; collectives carry an op code and sequence
//!   number, so mismatched collectives across ranks are reported, not mixed.
//! - **Copy-in, copy-out.** Inputs are copied at enqueue and results delivered when the
//!   caller observes completion; the worker never holds the caller's borrowed memory.
//! - **Deterministic results.** all_reduce gives bit-identical results on every rank:
//!   small buffers are folded in rank order on each rank, large ones reduced once per chunk
//!   on a ring and then shared.
//! - **Failure spreads.** A failed operation or a closed connection kills the
//!   communicator and shuts its sockets, so every other rank's wait ends with an error.
//!
//! Performance work (shared memory between ranks of one host, algorithm tuning) comes on
//! top of this structure without changing it.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod algo;
mod comm;
mod reduce;
mod transport;

pub use comm::{cpu_capabilities, CpuComm};

use anyccl_core::{
    async_trait, Backend, BackendInfo, Capabilities, Collective, ConnectOptions, HostPlatform, Platform, Result,
};
use std::sync::Arc;

/// The CPU backend.
#[derive(Debug, Default, Clone, Copy)]
pub struct Cpu;

#[async_trait]
impl Backend for Cpu {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn probe(&self) -> Result<BackendInfo> {
        Ok(BackendInfo { name: "cpu", version: env!("CARGO_PKG_VERSION").into(), devices: 1 })
    }
    fn capabilities(&self) -> Result<Capabilities> {
        Ok(cpu_capabilities())
    }
    fn platform(&self, _local_rank: usize) -> Result<Arc<dyn Platform>> {
        Ok(Arc::new(HostPlatform))
    }
    async fn connect(&self, opts: ConnectOptions) -> Result<Arc<dyn Collective>> {
        let deadline = anyccl_core::deadline_in(opts.timeout);
        let c: Arc<dyn Collective> =
            CpuComm::connect(opts.store, &opts.namespace, opts.rank, opts.size, deadline, opts.op_timeout).await?;
        Ok(c)
    }
}
