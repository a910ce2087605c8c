//! The CPU backend's memory bounds, in a process of their own (they are set through the
//! environment): a sender whose peer consumes nothing is held to the queue and inbox
//! bounds and fails at the operation timeout, instead of growing without limit.

mod common;

use anyccl_core::{Communicator, Error, MemoryStore, Store};
use libtest_mimic::{Arguments, Failed, Trial};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

fn connect(store: Arc<dyn Store>, rank: usize) -> Result<Communicator, Error> {
    common::connect(store, rank, 2, "limits", Duration::from_secs(2))
}

fn sender_is_bounded() -> Result<(), Failed> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let s1 = store.clone();
    // Rank 1 connects and then consumes nothing for longer than rank 0's timeout.
    let idle = std::thread::spawn(move || -> Result<(), String> {
        let c = connect(s1, 1).map_err(|e| e.to_string())?;
        std::thread::sleep(Duration::from_secs(6));
        drop(c);
        Ok(())
    });
    let comm = connect(store, 0)?;
    let bufs: Vec<Vec<u8>> = (0..400).map(|_| vec![7u8; MIB]).collect();
    let t = Instant::now();
    let mut works = Vec::new();
    let mut failure = None;
    for b in &bufs {
        match comm.send(anyccl_core::Buf::host(b.as_slice()), 1) {
            Ok(w) => works.push(w),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let took = t.elapsed();
    let accepted = works.len();
    let _ = comm.abort_blocking();
    drop(works);
    idle.join().map_err(|_| "rank 1 panicked")??;
    let e = failure.ok_or_else(|| format!("all {} sends of 1 MiB were queued: nothing bounded them", bufs.len()))?;
    if !matches!(e, Error::Timeout { .. } | Error::PeerFailed { .. } | Error::Aborted { .. }) {
        return Err(format!("expected a timeout, got {e}").into());
    }
    // 8 MiB queued + 8 MiB (one message more) in the peer's inbox + the sockets' buffers.
    if accepted > 64 {
        return Err(format!("{accepted} sends of 1 MiB were accepted with 8 MiB bounds").into());
    }
    if took > Duration::from_secs(8) {
        return Err(format!("the bound took {took:?} to turn into an error (timeout 2 s)").into());
    }
    println!("    {accepted} x 1 MiB accepted, then after {took:.2?}: {e}");
    Ok(())
}

fn main() -> std::process::ExitCode {
    // Set before any thread starts: this process runs this one case.
    std::env::set_var("ANYCCL_CPU_MAX_QUEUED_BYTES", (8 * MIB).to_string());
    std::env::set_var("ANYCCL_CPU_MAX_INBOX_BYTES", (8 * MIB).to_string());
    let args = Arguments::from_args();
    let trials = vec![Trial::test("cpu::limits::sender_bounded_when_peer_consumes_nothing[w=2]", sender_is_bounded)];
    libtest_mimic::run(&args, trials).exit_code()
}
