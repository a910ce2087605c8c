//! What the CPU backend's own test programs share: a rank's communicator on an in-process
//! store.

use anyccl_core::{Backend, CommConfig, Communicator, Error, GroupSpec, Store};
use std::sync::Arc;
use std::time::Duration;

/// Rank `rank` of a world of `size` named `name`, with operation timeout `op_timeout`.
pub fn connect(
    store: Arc<dyn Store>,
    rank: usize,
    size: usize,
    name: &str,
    op_timeout: Duration,
) -> Result<Communicator, Error> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::unavailable("test", e.to_string()))?;
    let config = CommConfig { op_timeout, ..CommConfig::default() };
    let cpu = anyccl_cpu::Cpu;
    rt.block_on(Communicator::connect(
        &cpu,
        GroupSpec::world(size, name),
        rank,
        store,
        cpu.platform(0)?.device(),
        config,
    ))
}
