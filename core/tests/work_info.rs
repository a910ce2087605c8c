//! A `Work`'s identity is made when asked, from what the communicator recorded as it
//! issued the operation: the same for an operation complete at its issue (no elements) as
//! for one that ran, and each operation its own sequence number.

use anyccl_core::{Backend, BufMut, CommConfig, Communicator, Device, GroupSpec, MemoryStore, ReduceOp};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[test]
fn a_works_info_names_its_operation_group_rank_and_sequence_number() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let comm = rt
        .block_on(Communicator::connect(
            &anyccl_cpu::Cpu as &dyn Backend,
            GroupSpec::world(1, "test"),
            0,
            Arc::new(MemoryStore::new()),
            Device::CPU,
            CommConfig::default(),
        ))
        .expect("connect");
    let before = Instant::now();
    let (mut none, mut two) = (Vec::<f32>::new(), vec![1f32, 2.0]);
    let mut empty = comm.all_reduce(None, BufMut::host(&mut none[..]), ReduceOp::Sum).expect("no elements");
    let mut ran = comm.broadcast(None, BufMut::host(&mut two[..]), 0).expect("two elements");
    empty.wait(Duration::from_secs(10)).expect("complete");
    ran.wait(Duration::from_secs(10)).expect("complete");
    let (a, b) = (empty.info(), ran.info());
    assert_eq!((a.op, &*a.group, a.rank), ("all_reduce", "world", 0), "{a:?}");
    assert_eq!((b.op, &*b.group, b.rank), ("broadcast", "world", 0), "{b:?}");
    assert_eq!(b.seq, a.seq + 1, "{a:?} {b:?}");
    // To the recorder's coarse tick: never later than the call, and not long before it.
    for i in [&a, &b] {
        assert!(i.started <= Instant::now() && i.started + Duration::from_millis(50) >= before, "{i:?}");
    }
    let shown = format!("{ran:?}");
    assert!(shown.contains("broadcast") && shown.contains(&format!("seq: {}", b.seq)), "{shown}");
}
