//! Marks reuse their events: an operation waited before the next is issued records no event
//! at all (its wait asks the stream, on which nothing follows it); operations in flight at
//! once hold one each, recorded as the next call is issued, and a held one is never taken;
//! past 1,024 in flight the events of marks already done are found and reused.

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
    let (records, made, streams) = (runtime.records(), runtime.events_made(), runtime.stream_queries());
    // One at a time: each wait asks the stream, on which nothing follows its operation, and
    // no event is recorded.
    for _ in 0..1000 {
        comm.all_reduce(Some(send.view()), recvs[0].view_mut(), ReduceOp::Sum).expect("issue").wait(T).expect("wait");
    }
    assert_eq!(runtime.records() - records, 0, "no event for calls waited one at a time");
    assert_eq!(runtime.events_made() - made, 0);
    assert_eq!(runtime.stream_queries() - streams, 1000, "a question to the stream a wait");
    // BURST in flight: each but the newest holds its own event, recorded as the next call is
    // issued, until its mark is seen done (a held one is never recorded again).
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
    assert_eq!(runtime.records() - records, BURST as u64 - 1, "an event a call but the newest");
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
    // And again one at a time: no event.
    let records = runtime.records();
    for _ in 0..1000 {
        comm.all_reduce(Some(send.view()), recvs[1].view_mut(), ReduceOp::Sum).expect("issue").wait(T).expect("wait");
    }
    assert_eq!(runtime.records() - records, 0, "events recorded after the burst");
}

/// Once anything is issued after an operation, its wait asks the mark recorded then, never
/// the stream (which would make it wait for the later operation too: a later receive whose
/// peer sends only after a host-side step that waits for this rank would block it).
#[test]
fn device_marks_a_wait_asks_the_stream_only_while_nothing_follows_its_operation() {
    let runtime = Arc::new(NullRuntime::new());
    let comm = comm(&runtime);
    let send = HostMemory::new(DType::F32, 2);
    let mut r: Vec<HostMemory> = (0..4).map(|_| HostMemory::new(DType::F32, 2)).collect();
    let counts = || (runtime.records(), runtime.queries(), runtime.stream_queries());
    let [r0, r1, r2, r3] = &mut r[..] else { unreachable!() };
    let c0 = counts();
    let mut a = comm.all_reduce(Some(send.view()), r0.view_mut(), ReduceOp::Sum).expect("issue a");
    assert_eq!(counts(), c0, "the call records nothing: its mark is owed");
    let mut b = comm.all_reduce(Some(send.view()), r1.view_mut(), ReduceOp::Sum).expect("issue b");
    let c1 = counts();
    assert_eq!(c1.0 - c0.0, 1, "b's call records the mark a is owed, before b goes on the stream");
    a.wait(T).expect("wait a");
    let c2 = counts();
    assert_eq!((c2.1 - c1.1, c2.2 - c1.2), (1, 0), "a's wait asks its mark, not the stream");
    b.wait(T).expect("wait b");
    let c3 = counts();
    assert_eq!((c3.0 - c2.0, c3.2 - c2.2), (0, 1), "b, the newest, asks the stream");
    // b is known done: the next call owes it nothing.
    let mut c = comm.all_reduce(Some(send.view()), r2.view_mut(), ReduceOp::Sum).expect("issue c");
    assert_eq!(counts().0, c3.0, "no mark for an operation known done");
    // Waited newest first: the stream, then nothing more for the older one.
    let mut d = comm.all_reduce(Some(send.view()), r3.view_mut(), ReduceOp::Sum).expect("issue d");
    let c4 = counts();
    d.wait(T).expect("wait d");
    c.wait(T).expect("wait c");
    let c5 = counts();
    assert_eq!((c5.0 - c4.0, c5.1 - c4.1, c5.2 - c4.2), (0, 0, 1), "d's stream question settles c too");
    // A barrier is a call like any other: the mark owed to the operation before it goes
    // on the stream first.
    drop((a, b, c, d));
    let before = counts();
    let mut e = comm.all_reduce(Some(send.view()), r0.view_mut(), ReduceOp::Sum).expect("issue e");
    comm.barrier().expect("barrier").wait(T).expect("wait barrier");
    assert_eq!(counts().0 - before.0, 1, "the barrier's call records e's mark");
    e.wait(T).expect("wait e");
}
