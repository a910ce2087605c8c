//! Communicator validation that needs raw buffer views: overlapping send/recv buffers and
//! buffers on the wrong device are rejected before any communication.

use anyccl_core::{
    Backend, Buf, BufMut, CommConfig, Communicator, DType, Device, DeviceKind, Error, GroupSpec, MemoryStore, ReduceOp,
};
use std::sync::Arc;

fn world() -> Communicator {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(Communicator::connect(
        &anyccl_cpu::Cpu as &dyn Backend,
        GroupSpec::world(1, "test"),
        0,
        Arc::new(MemoryStore::new()),
        Device::CPU,
        CommConfig::default(),
    ))
    .expect("connect")
}

fn assert_invalid(r: anyccl_core::Result<anyccl_core::Work<'_>>, arg: &str, needle: &str) {
    match r {
        Err(Error::InvalidArgument { arg: a, rank, group, msg, .. }) => {
            assert_eq!(a, arg, "{msg}");
            assert_eq!((rank, group.as_str()), (0, "world"));
            assert!(msg.contains(needle), "message '{msg}' lacks '{needle}'");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn overlapping_send_and_recv_are_rejected() {
    let comm = world();
    let mut data = vec![0f32; 64];
    let p = data.as_mut_ptr().cast::<u8>();
    // SAFETY: both views point into `data`, which outlives them; the communicator rejects
    // the call before reading or writing either view.
    let (send, recv) = unsafe {
        (Buf::from_raw(p.add(16 * 4), 32, DType::F32, Device::CPU), BufMut::from_raw(p, 32, DType::F32, Device::CPU))
    };
    assert_invalid(comm.all_reduce(Some(send), recv, ReduceOp::Sum), "send", "overlap");
    assert_eq!(comm.issued(), 0);
}

#[test]
fn buffers_on_another_device_are_rejected() {
    let comm = world();
    let gpu = Device { kind: DeviceKind::Cuda, ordinal: 0 };
    // SAFETY: the pointer is never dereferenced: the call is rejected on the device check.
    let recv = unsafe { BufMut::from_raw(std::ptr::null_mut(), 8, DType::F32, gpu) };
    assert_invalid(comm.all_reduce(None, recv, ReduceOp::Sum), "recv", "cuda:0");
    assert_eq!(comm.issued(), 0);
}

#[test]
fn a_group_larger_than_the_backend_allows_is_rejected_before_connecting() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let max = anyccl_cpu::Cpu.capabilities().expect("caps").max_world_size;
    // A rendezvous of that many ranks would end in Timeout: InvalidArgument means none started.
    let r = rt.block_on(Communicator::connect(
        &anyccl_cpu::Cpu as &dyn Backend,
        GroupSpec::world(max + 1, "test"),
        3,
        Arc::new(MemoryStore::new()),
        Device::CPU,
        CommConfig::default(),
    ));
    match r {
        Err(Error::InvalidArgument { arg, rank, group, msg, .. }) => {
            assert_eq!((arg, rank, group.as_str()), ("spec.ranks", 3, "world"));
            assert!(msg.contains(&format!("at most {max}")), "{msg}");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn thread_block_settings_are_checked_and_refused_where_the_backend_has_none() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let bad = [
        (CommConfig { min_ctas: Some(0), ..CommConfig::default() }, "min_ctas = 0"),
        (CommConfig { max_ctas: Some(65), ..CommConfig::default() }, "max_ctas = 65"),
        (CommConfig { min_ctas: Some(16), max_ctas: Some(8), ..CommConfig::default() }, "above max_ctas"),
        (CommConfig { cga_cluster_size: Some(9), ..CommConfig::default() }, "cga_cluster_size = 9"),
        (CommConfig { buffer_mb: Some(0), ..CommConfig::default() }, "buffer_mb = 0"),
        // Sound, but the CPU backend has no thread blocks: refused, not ignored.
        (CommConfig { min_ctas: Some(16), ..CommConfig::default() }, "no per-communicator thread-block settings"),
    ];
    assert!(!anyccl_cpu::Cpu.capabilities().expect("caps").cta_settings);
    for (config, needle) in bad {
        let r = rt.block_on(Communicator::connect(
            &anyccl_cpu::Cpu as &dyn Backend,
            GroupSpec::world(1, "test"),
            0,
            Arc::new(MemoryStore::new()),
            Device::CPU,
            config,
        ));
        match r {
            Err(Error::InvalidArgument { arg, rank, group, msg, .. }) => {
                assert_eq!((arg, rank, group.as_str()), ("config", 0, "world"));
                assert!(msg.contains(needle), "'{msg}' lacks '{needle}'");
            }
            other => panic!("expected InvalidArgument for '{needle}', got {other:?}"),
        }
    }
    let fine =
        CommConfig { min_ctas: Some(16), max_ctas: Some(32), cga_cluster_size: Some(0), ..CommConfig::default() };
    assert_eq!(fine.check(), Ok(()));
    assert_eq!(fine.cta_settings(), ["min_ctas", "max_ctas", "cga_cluster_size"]);
}
