//! What a `Work` costs the host on a device backend, counted against the stand-in (which
//! counts `aclrtRecordEvent` calls): by default every operation but the newest has its
//! completion event, recorded as the next call is issued, and the newest's wait asks the
//! stream (`aclrtStreamQuery`); with `CommConfig::shared_completion`, operations issued back
//! to back and then waited share one, recorded at the first look at one of them, and a `Work`
//! looked at right after its call gets an event of its own where it is not done; every
//! output is still right.

use anyccl_core::{Backend, CommConfig, Communicator, DType, GroupSpec, MemoryStore, Platform, ReduceOp, Store};
use anyccl_hccl::Hccl;
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(20);
const COUNT: usize = 4096;

/// The stand-in's count of recorded events.
struct Events {
    _lib: libloading::Library,
    recorded: extern "C" fn() -> u64,
}

impl Events {
    fn load() -> Events {
        let path = anyccl_hccl_standin::library_dir().join("libhccl.so");
        // SAFETY: the stand-in the backend loaded: the same object, its initialisers ran.
        let lib = unsafe { libloading::Library::new(&path) }.unwrap();
        // SAFETY: the stand-in's test hook, with its C signature.
        let recorded = unsafe { *lib.get::<extern "C" fn() -> u64>(b"anyccl_standin_events_recorded").unwrap() };
        Events { _lib: lib, recorded }
    }

    fn now(&self) -> u64 {
        (self.recorded)()
    }
}

/// Device buffers holding `v` in every element, one per value.
fn filled(platform: &dyn Platform, values: &[f32]) -> Vec<Box<dyn anyccl_core::DeviceMemory>> {
    values
        .iter()
        .map(|v| {
            let mut m = platform.alloc(DType::F32, COUNT).unwrap();
            platform.copy_from_host(m.as_mut(), &v.to_le_bytes().repeat(COUNT)).unwrap();
            m
        })
        .collect()
}

/// `all_reduce`s of each input into its output, issued back to back, their `Work`s kept.
fn issue_all<'a>(
    comm: &'a Communicator,
    inputs: &'a [Box<dyn anyccl_core::DeviceMemory>],
    outputs: &'a mut [Box<dyn anyccl_core::DeviceMemory>],
    n: usize,
) -> Vec<anyccl_core::Work<'a>> {
    inputs
        .iter()
        .zip(outputs.iter_mut())
        .take(n)
        .map(|(i, o)| comm.all_reduce(Some(i.view()), o.view_mut(), ReduceOp::Sum).unwrap())
        .collect()
}

/// `n` all_reduces of the values 1..=n issued back to back on `comm`, then waited in order,
/// their outputs checked: the events the issuing recorded, and those the waits recorded.
fn issue_then_wait(p: &dyn Platform, comm: &Communicator, events: &Events, n: usize, what: &str) -> (u64, u64) {
    let values: Vec<f32> = (1..=n).map(|v| v as f32).collect();
    let inputs = filled(p, &values);
    let mut outputs = filled(p, &vec![0.0; n]);
    let before = events.now();
    let mut works = issue_all(comm, &inputs, &mut outputs, n);
    let issued = events.now() - before;
    for w in &mut works {
        w.wait(T).unwrap();
    }
    let waited = events.now() - before - issued;
    drop(works);
    for (o, v) in outputs.iter().zip(&values) {
        check(p, o.as_ref(), *v, what);
    }
    (issued, waited)
}

/// Every element of `m` is `want`.
fn check(platform: &dyn Platform, m: &dyn anyccl_core::DeviceMemory, want: f32, what: &str) {
    let mut host = vec![0u8; COUNT * 4];
    platform.copy_to_host(m, &mut host).unwrap();
    let wrong = host.chunks_exact(4).filter(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) != want).count();
    assert_eq!(wrong, 0, "{what}: {wrong} of {COUNT} elements are not {want}");
}

mod hccl {
    pub mod work {
        use super::super::*;

        #[test]
        fn back_to_back_calls_share_one_event() {
            std::env::set_var("ANYCCL_HCCL_LIBRARY_DIR", anyccl_hccl_standin::library_dir());
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let platform = Hccl.platform(0).unwrap();
            let p = platform.as_ref();
            let events = Events::load();
            let connect = |name: &str, shared_completion: bool| {
                let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
                let config = CommConfig { op_timeout: T, init_timeout: T, shared_completion, ..CommConfig::default() };
                rt.block_on(Communicator::connect(
                    &Hccl,
                    GroupSpec::world(1, name),
                    0,
                    store,
                    platform.device(),
                    config,
                ))
                .unwrap()
            };

            // By default, an event at every call but the first, for the call before it.
            let per_call = connect("work-per-call", false);
            let (issued, waited) = issue_then_wait(p, &per_call, &events, 8, "an event per call");
            assert_eq!(issued, 7, "8 calls, each but the newest with its event");
            assert_eq!(waited, 0, "waits record nothing more (the newest asks the stream)");
            // One at a time: each wait asks the stream, and no event is recorded.
            let (issued, waited) = issue_then_wait(p, &per_call, &events, 1, "one at a time");
            assert_eq!((issued, waited), (0, 0), "a call waited before the next records no event");

            // 32 out-of-place all_reduces issued back to back, then waited in order.
            let comm = connect("work-shared", true);
            let (issued, waited) = issue_then_wait(p, &comm, &events, 32, "back to back");
            assert_eq!(issued, 0, "issuing recorded events");
            assert_eq!(issued + waited, 1, "32 calls back to back, waited in order");

            let inputs = filled(p, &(1..=8).map(|v| v as f32).collect::<Vec<_>>());
            let mut outputs = filled(p, &[0.0; 8]);

            // Dropped without a wait: the drop's look records the one event.
            let before = events.now();
            drop(issue_all(&comm, &inputs, &mut outputs, 8));
            assert_eq!(events.now() - before, 1, "8 calls dropped unwaited");

            // A Work polled right after its call asks the stream, on which nothing follows it
            // yet; not done, it gets an event of its own there, so a later call does not
            // hold it back. The later call, waited last, asks the stream too: at most one
            // event each.
            let before = events.now();
            let (first, rest) = outputs.split_at_mut(1);
            let mut a = comm.all_reduce(Some(inputs[0].view()), first[0].view_mut(), ReduceOp::Sum).unwrap();
            a.is_completed().unwrap();
            let mut b = comm.all_reduce(Some(inputs[1].view()), rest[0].view_mut(), ReduceOp::Sum).unwrap();
            a.wait(T).unwrap();
            b.wait(T).unwrap();
            let n = events.now() - before;
            assert!(n <= 2, "a call looked at at once, then another: {n} events");
            drop((a, b));
            check(p, outputs[0].as_ref(), 1.0, "looked at at once");
            check(p, outputs[1].as_ref(), 2.0, "the call after it");
        }
    }
}
