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

/// Rank 0 sends `count` messages of `len` bytes to a rank 1 that consumes nothing for
/// longer than rank 0's timeout: enqueue must fail (at the timeout) after at least `least`
/// (what the queue bound alone admits) and at most `most` were accepted.
fn sender_is_bounded(len: usize, count: usize, least: usize, most: usize) -> Result<(), Failed> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let s1 = store.clone();
    let idle = std::thread::spawn(move || -> Result<(), String> {
        let c = connect(s1, 1).map_err(|e| e.to_string())?;
        std::thread::sleep(Duration::from_secs(6));
        drop(c);
        Ok(())
    });
    let comm = connect(store, 0)?;
    let bufs: Vec<Vec<u8>> = (0..count).map(|_| vec![7u8; len]).collect();
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
    let e = failure.ok_or_else(|| format!("all {count} sends of {len} bytes were queued: nothing bounded them"))?;
    if !matches!(e, Error::Timeout { .. } | Error::PeerFailed { .. } | Error::Aborted { .. }) {
        return Err(format!("expected a timeout, got {e}").into());
    }
    if accepted > most || accepted < least {
        return Err(format!(
            "{accepted} sends of {len} bytes were accepted with 8 MiB bounds (expected {least} ..= {most})"
        )
        .into());
    }
    if took > Duration::from_secs(8) {
        return Err(format!("the bound took {took:?} to turn into an error (timeout 2 s)").into());
    }
    println!("    {accepted} x {len} bytes accepted, then after {took:.2?}: {e}");
    Ok(())
}

/// Rank 0 issues barriers, which hold no input, with a rank 1 that joins none of them:
/// each counts its record (1 KiB), so the 8 MiB bound stops enqueue after about 8192.
fn barriers_are_bounded() -> Result<(), Failed> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let s1 = store.clone();
    let idle = std::thread::spawn(move || -> Result<(), String> {
        let c = connect(s1, 1).map_err(|e| e.to_string())?;
        std::thread::sleep(Duration::from_secs(6));
        drop(c);
        Ok(())
    });
    let comm = connect(store, 0)?;
    let t = Instant::now();
    let mut works = Vec::new();
    let failure = loop {
        if works.len() > 100_000 {
            break None;
        }
        match comm.barrier() {
            Ok(w) => works.push(w),
            Err(e) => break Some(e),
        }
    };
    let (took, accepted) = (t.elapsed(), works.len());
    let _ = comm.abort_blocking();
    drop(works);
    idle.join().map_err(|_| "rank 1 panicked")??;
    let e = failure.ok_or_else(|| format!("{accepted} barriers were queued: nothing bounded them"))?;
    if !matches!(e, Error::Timeout { .. } | Error::PeerFailed { .. } | Error::Aborted { .. }) {
        return Err(format!("expected a timeout, got {e}").into());
    }
    if accepted > 8200 {
        return Err(format!(
            "{accepted} barriers were accepted with an 8 MiB bound (at most 8192 and the one running)"
        )
        .into());
    }
    if took > Duration::from_secs(8) {
        return Err(format!("the bound took {took:?} to turn into an error (timeout 2 s)").into());
    }
    println!("    {accepted} barriers accepted, then after {took:.2?}: {e}");
    Ok(())
}

fn main() -> std::process::ExitCode {
    // Set before any thread starts: this process runs this one case.
    std::env::set_var("ANYCCL_CPU_MAX_QUEUED_BYTES", (8 * MIB).to_string());
    std::env::set_var("ANYCCL_CPU_MAX_INBOX_BYTES", (8 * MIB).to_string());
    let args = Arguments::from_args();
    // Copied sends (under 64 KiB) count their size: 8 MiB queued (256) + 12 MiB in the
    // peer's ring and inbox (384) + the sockets' buffers. Lent sends (from 64 KiB) count 64
    // KiB each while queued: 128 + 12 + the sockets' buffers (counted at their size, 8 + 12).
    let trials = vec![
        Trial::test("cpu::limits::sender_bounded_when_peer_consumes_nothing[w=2]", || {
            sender_is_bounded(32 << 10, 4000, 256, 1024)
        }),
        Trial::test("cpu::limits::lent_sends_bounded_when_peer_consumes_nothing[w=2]", || {
            sender_is_bounded(MIB, 400, 128, 192)
        }),
        Trial::test("cpu::limits::operations_bounded_in_number[w=2]", barriers_are_bounded),
    ];
    libtest_mimic::run(&args, trials).exit_code()
}
