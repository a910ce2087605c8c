//! A launch the library answers "in progress" (NCCL's non-blocking communicators while a
//! first call connects) forbids every other call on that communicator until the library
//! says it is done: a library standing in for one counts every call, event and stream
//! operation made while its launch is pending, and each case checks there was none.

use anyccl_core::{CommConfig, Communicator, DType, DeviceMemory, HostMemory, ReduceOp, Result};
use anyccl_device::testing::{Hooks, NullLibrary, NullRuntime};
use anyccl_device::{Launched, Op};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long the library keeps a launch in progress.
const PENDING_FOR: Duration = Duration::from_millis(150);

/// What the stand-in saw, and its one switch: the next launch answers "in progress".
#[derive(Debug, Default)]
struct Seen {
    /// When the launch in progress is done; `None` when none is.
    pending_until: Mutex<Option<Instant>>,
    /// The next launch answers "in progress".
    in_progress_next: AtomicBool,
    /// Calls made while a launch was pending, by name.
    violations: Mutex<Vec<&'static str>>,
    launches: AtomicU64,
    deregistered: AtomicU64,
}

impl Seen {
    fn pending(&self) -> bool {
        let mut p = self.pending_until.lock().unwrap_or_else(|e| e.into_inner());
        match *p {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                *p = None;
                false
            }
            None => false,
        }
    }
    fn violations(&self) -> Vec<&'static str> {
        self.violations.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// A library of one rank whose launches answer "in progress" when told to, for
/// [`PENDING_FOR`]; `async_error` (the one call allowed meanwhile) says when it is done.
/// Every other call, and every event recorded, while it is pending is noted.
impl Hooks for Seen {
    fn call(&self, what: &'static str) {
        if self.pending() {
            self.violations.lock().unwrap_or_else(|e| e.into_inner()).push(what);
        }
        if what == "deregister" {
            self.deregistered.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn launch(&self, _op: &Op) -> Launched {
        self.launches.fetch_add(1, Ordering::Relaxed);
        if self.in_progress_next.swap(false, Ordering::AcqRel) {
            *self.pending_until.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + PENDING_FOR);
            return Launched::InProgress;
        }
        Launched::Enqueued
    }
    fn in_progress(&self) -> bool {
        self.pending()
    }
    fn memory_held(&self) -> Option<u64> {
        Some(0)
    }
}

/// A communicator of one rank over a fresh stand-in, and what the stand-in sees.
fn start(rt: &tokio::runtime::Runtime, name: &str) -> std::result::Result<(Communicator, Arc<Seen>), String> {
    let seen = Arc::new(Seen::default());
    let mut lib = NullLibrary::with_hooks(seen.clone());
    lib.capabilities.memory_stats = true;
    lib.capabilities.buffer_registration = true;
    let runtime = Arc::new(NullRuntime::with_hooks(seen.clone()));
    let config = CommConfig { op_timeout: Duration::from_secs(10), ..CommConfig::default() };
    let comm = rt.block_on(lib.leak().communicator(runtime, name, config)).map_err(|e| e.to_string())?;
    Ok((comm, seen))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime")
}

/// The first launch answers "in progress"; everything `then` does must wait for it.
fn case(name: &str, then: impl FnOnce(&tokio::runtime::Runtime, &Communicator, &Seen) -> Result<()>) {
    let rt = runtime();
    let (comm, seen) = start(&rt, name).unwrap_or_else(|e| panic!("connect: {e}"));
    let mut buf = HostMemory::new(DType::F32, 4);
    seen.in_progress_next.store(true, Ordering::Release);
    let t = Instant::now();
    let mut w = comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum).expect("the first all_reduce is accepted");
    assert!(seen.pending(), "the stand-in answered in progress");
    then(&rt, &comm, &seen).unwrap_or_else(|e| panic!("{name}: {e}"));
    let during = seen.violations();
    assert!(during.is_empty(), "{name}: called while the first launch was pending: {during:?}");
    // Whatever `then` did came after the pending launch was done (or did not call the library).
    let _ = w.wait(Duration::from_secs(10));
    drop(w);
    assert!(t.elapsed() >= PENDING_FOR, "{name}: finished before the pending launch was done");
    assert!(seen.violations().is_empty(), "{name}: {:?}", seen.violations());
}

mod pending {
    use super::*;

    #[test]
    fn the_next_launch_waits_for_it() {
        case("next-launch", |_, comm, seen| {
            let mut b = HostMemory::new(DType::F32, 4);
            let t = Instant::now();
            comm.all_reduce(None, b.view_mut(), ReduceOp::Sum)?.wait(Duration::from_secs(10))?;
            assert_eq!(seen.launches.load(Ordering::Relaxed), 2);
            assert!(t.elapsed() >= PENDING_FOR / 2, "the second launch did not wait: {:?}", t.elapsed());
            Ok(())
        });
    }

    #[test]
    fn shutdown_waits_for_it() {
        // Its drain records an event at the stream's end, which must follow the pending launch.
        case("shutdown", |rt, comm, _| rt.block_on(comm.shutdown()));
    }

    #[test]
    fn deregistering_waits_for_it() {
        let rt = runtime();
        let (comm, seen) = start(&rt, "deregister").unwrap_or_else(|e| panic!("connect: {e}"));
        let mem: Box<dyn DeviceMemory> = Box::new(HostMemory::new(DType::F32, 16));
        let reg = comm.register(mem).expect("registered");
        let mut buf = HostMemory::new(DType::F32, 4);
        seen.in_progress_next.store(true, Ordering::Release);
        let mut w = comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum).expect("accepted");
        assert!(seen.pending());
        drop(reg);
        assert_eq!(seen.deregistered.load(Ordering::Relaxed), 1, "deregistered once the launch was done");
        assert!(seen.violations().is_empty(), "{:?}", seen.violations());
        w.wait(Duration::from_secs(10)).expect("the all_reduce finishes");
    }

    #[test]
    fn memory_held_does_not_call_the_library_meanwhile() {
        let rt = runtime();
        let (comm, seen) = start(&rt, "memory-held").unwrap_or_else(|e| panic!("connect: {e}"));
        assert_eq!(comm.memory_held(), Some(0), "asked when nothing is pending");
        let mut buf = HostMemory::new(DType::F32, 4);
        seen.in_progress_next.store(true, Ordering::Release);
        let mut w = comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum).expect("accepted");
        assert_eq!(comm.memory_held(), None, "not known while a launch is pending");
        assert!(seen.violations().is_empty(), "{:?}", seen.violations());
        w.wait(Duration::from_secs(10)).expect("the all_reduce finishes");
        assert_eq!(comm.memory_held(), Some(0), "asked again once it is done");
    }
}
