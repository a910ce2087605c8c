//! Marks reuse their events: an operation waited before the next is issued records its mark
//! on an event an earlier one let go of, so a long run makes a handful of events, not one a
//! call; operations in flight at once hold one each, and a held one is never taken; past
//! 1,024 in flight the events of marks already done are found and reused.

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
    // More in flight at once than the live marks (1,024) past which a new mark that finds
    // no spare event looks for done ones.
    const BURST: usize = 3000;
    let mut recvs: Vec<HostMemory> = (0..BURST).map(|_| HostMemory::new(DType::F32, 2)).collect();
    let (records, made) = (runtime.records(), runtime.events_made());
    // One at a time: each call's event is free again by the next call.
    for _ in 0..1000 {
        comm.all_reduce(Some(send.view()), recvs[0].view_mut(), ReduceOp::Sum).expect("issue").wait(T).expect("wait");
    }
    assert_eq!(runtime.records() - records, 1000, "an event a call");
    assert!(runtime.events_made() - made <= 2, "{} events made for 1000 calls", runtime.events_made() - made);
    // BURST in flight: each holds its own event until its mark is seen done (a held one is
    // never recorded again).
    let (records, made) = (runtime.records(), runtime.events_made());
    // The questions to the device while issuing (none is needed below 1,024 live marks).
    let burst = |recvs: &mut [HostMemory]| -> u64 {
        let asked = runtime.queries();
        let works: Vec<_> = recvs
            .iter_mut()
            .map(|r| comm.all_reduce(Some(send.view()), r.view_mut(), ReduceOp::Sum).expect("issue"))
            .collect();
        let asked = runtime.queries() - asked;
        for mut w in works {
            w.wait(T).expect("wait");
        }
        asked
    };
    let asked = burst(&mut recvs);
    // The done marks are found by halving, a dozen questions each time the spare events run
    // out, not one a call past the 1,024th.
    assert!(asked <= 40, "{asked} questions to the device while issuing {BURST}");
    assert_eq!(runtime.records() - records, BURST as u64);
    // Every event of this runtime is done once recorded: past 1,024 live marks the done ones
    // are found and their events reused, so the burst makes about 1,024, not one a call.
    let first = runtime.events_made() - made;
    assert!((1000..=1026).contains(&first), "{first} events made for {BURST} in flight");
    // The same burst again: all on kept events (up to 65,536 are kept), found again by
    // halving once the spare ones are out.
    let made = runtime.events_made();
    let asked = burst(&mut recvs);
    assert!(asked <= 40, "{asked} questions to the device while issuing {BURST} again");
    assert!(
        runtime.events_made() - made <= 2,
        "{} events made for a second burst of {BURST}",
        runtime.events_made() - made
    );
    // And again one at a time: back to reuse.
    let made = runtime.events_made();
    for _ in 0..1000 {
        comm.all_reduce(Some(send.view()), recvs[1].view_mut(), ReduceOp::Sum).expect("issue").wait(T).expect("wait");
    }
    assert!(runtime.events_made() - made <= 2, "{} events made after the burst", runtime.events_made() - made);
}
