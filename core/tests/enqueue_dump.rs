//! An operation that fails at enqueue (the communicator already failed or was aborted, an
//! enqueue that timed out) writes the flight-recorder dump, as a failed wait does: without
//! it, a rank whose peers stopped left no evidence and the analyzer blamed it.
//! Its own test binary: it sets `ANYCCL_TRACE_DIR` for the whole process.

use anyccl_core::{Backend, CommConfig, Communicator, DType, GroupSpec, MemoryStore, ReduceOp, Store};
use std::sync::Arc;

#[test]
fn an_enqueue_that_fails_writes_the_dump() {
    let dir = std::env::temp_dir().join(format!("anyccl-enqueue-dump-{}", std::process::id()));
    std::env::set_var("ANYCCL_TRACE_DIR", &dir);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let cpu = anyccl_cpu::Cpu;
    let platform = cpu.platform(0).expect("platform");
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let spec = GroupSpec::world(1, "enqueue-dump");
    let comm = rt
        .block_on(Communicator::connect(&cpu, spec, 0, store, platform.device(), CommConfig::default()))
        .expect("connect");
    rt.block_on(comm.abort()).expect("abort");
    // The abort's own dump is written; the failed enqueue's must replace it.
    let _ = std::fs::remove_file(dir.join("rank0.json"));
    let mut buf = platform.alloc(DType::F32, 4).expect("alloc");
    let e = comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum).map(|_| ()).expect_err("an aborted communicator");
    let dump = std::fs::read_to_string(dir.join("rank0.json")).expect("a dump after the failed enqueue");
    assert!(dump.contains("all_reduce of group 'world' failed at enqueue"), "{e}: {dump}");
    let _ = std::fs::remove_dir_all(&dir);
}
