//! HCCL cannot abort a call blocked in link set-up; the deadline holds through HCCL's own
//! timeout, which the backend sets from the communicator's. On the stand-in (which blocks
//! in link set-up as HCCL does and lets nothing interrupt it): rank 1 joins but never
//! issues its first collective; rank 0's first all_reduce blocks, then returns `Timeout`
//! naming the operation, the rank and the group within the operation timeout plus a
//! margin, and the communicator is unusable afterwards.

use anyccl_core::{Backend, CommConfig, Communicator, DType, GroupSpec, MemoryStore, ReduceOp, Role, Store};
use anyccl_hccl::Hccl;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

mod hccl {
    pub mod deadline {
        use super::super::*;

        #[test]
        fn first_call_blocked_in_link_setup_times_out() {
            std::env::set_var("ANYCCL_HCCL_LIBRARY_DIR", anyccl_hccl_standin::library_dir());
            let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
            let op_timeout = Duration::from_secs(3);
            let (done_tx, done_rx) = mpsc::channel::<()>();
            let mut done_rx = Some(done_rx);
            let mut handles = Vec::new();
            let (tx, rx) = mpsc::channel();
            for rank in 0..2usize {
                let (store, tx) = (store.clone(), tx.clone());
                let done = if rank == 1 { done_rx.take() } else { None };
                let done_tx = done_tx.clone();
                handles.push(std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                    let platform = Hccl.platform(rank).unwrap();
                    let config =
                        CommConfig { op_timeout, init_timeout: Duration::from_secs(20), ..CommConfig::default() };
                    let spec = GroupSpec::new("blocked", vec![0, 1], "test", Role::Data);
                    let comm = rt
                        .block_on(Communicator::connect(&Hccl, spec, rank, store, platform.device(), config))
                        .unwrap();
                    if let Some(done) = done {
                        // Rank 1 never calls: it waits until rank 0 is finished.
                        let _ = done.recv_timeout(Duration::from_secs(60));
                        return;
                    }
                    let mut buf = platform.alloc(DType::F32, 1024).unwrap();
                    let t = Instant::now();
                    let r = comm
                        .all_reduce(None, buf.view_mut(), ReduceOp::Sum)
                        .and_then(|mut w| w.wait(op_timeout).map(|_| ()));
                    let took = t.elapsed();
                    let again = comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum).map(|_| ());
                    tx.send((r, took, again)).unwrap();
                    let _ = done_tx.send(());
                }));
            }
            let (r, took, again) = rx.recv_timeout(Duration::from_secs(60)).expect("rank 0 returned");
            let err = r.expect_err("a first call with a missing peer cannot succeed");
            let text = err.to_string();
            assert_eq!(err.kind(), "Timeout", "{text}");
            assert!(text.contains("all_reduce") && text.contains("rank 0") && text.contains("'blocked'"), "{text}");
            assert!(
                took >= Duration::from_secs(2),
                "returned after {took:?}: the stand-in did not block in link set-up"
            );
            assert!(took < op_timeout + Duration::from_secs(3), "returned after {took:?}");
            assert!(again.is_err(), "the communicator is still usable after the timeout");
            for h in handles {
                h.join().unwrap();
            }
        }
    }
}
