//! Marks reuse their events: an operation waited before the next is issued records its mark
//! on an event an earlier one let go of, so a long run makes a handful of events, not one a
//! call; operations in flight at once hold one each, and a held one is never taken.

use anyccl_core::{CommConfig, Communicator, DType, DeviceMemory, HostMemory, ReduceOp};
use anyccl_device::testing::{NullLibrary, NullRuntime};
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

fn comm(runtime: &Arc<NullRuntime>) -> Communicator {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let lib = NullLibrary::default().leak();
    rt.block_on(lib.communicator(runtime.clone(), "marks", CommConfig::default())).expect("communicator")
}

#[test]
fn device_marks_reuse_events_that_nothing_holds() {
    let runtime = Arc::new(NullRuntime::new());
    let comm = comm(&runtime);
    let send = HostMemory::new(DType::F32, 2);
    // More in flight at once than the events kept for reuse (1,024).
    const BURST: usize = 1200;
    let mut recvs: Vec<HostMemory> = (0..BURST).map(|_| HostMemory::new(DType::F32, 2)).collect();
    let (records, made) = (runtime.records(), runtime.events_made());
    // One at a time: each call's event is free again by the next call.
    for _ in 0..1000 {
        comm.all_reduce(Some(send.view()), recvs[0].view_mut(), ReduceOp::Sum).expect("issue").wait(T).expect("wait");
    }
    assert_eq!(runtime.records() - records, 1000, "an event a call");
    assert!(runtime.events_made() - made <= 2, "{} events made for 1000 calls", runtime.events_made() - made);
    // BURST in flight: each holds its own (held ones are not recorded again), at most the
    // kept ones reused.
    let (records, made) = (runtime.records(), runtime.events_made());
    let burst = |recvs: &mut [HostMemory]| {
        let works: Vec<_> = recvs
            .iter_mut()
            .map(|r| comm.all_reduce(Some(send.view()), r.view_mut(), ReduceOp::Sum).expect("issue"))
            .collect();
        for mut w in works {
            w.wait(T).expect("wait");
        }
    };
    burst(&mut recvs);
    assert_eq!(runtime.records() - records, BURST as u64);
    assert!(
        runtime.events_made() - made >= (BURST - 1024) as u64,
        "{} events made for {BURST} in flight",
        runtime.events_made() - made
    );
    // A burst of a thousand again: all on kept events (a thousand in flight is what a
    // benchmark keeps; each new one costs the runtime's pool and an allocation).
    let made = runtime.events_made();
    burst(&mut recvs[..1000]);
    assert!(
        runtime.events_made() - made <= 2,
        "{} events made for a second burst of 1,000",
        runtime.events_made() - made
    );
    // And again one at a time: back to reuse.
    let made = runtime.events_made();
    for _ in 0..1000 {
        comm.all_reduce(Some(send.view()), recvs[1].view_mut(), ReduceOp::Sum).expect("issue").wait(T).expect("wait");
    }
    assert!(runtime.events_made() - made <= 2, "{} events made after the burst", runtime.events_made() - made);
}
