//! The rings' own tests: a stream through restarts, short messages written whole, and chunks
//! of earlier laps never read again.

use super::{init_rings, link, restart_at, Layout, Patience, Rx, Segment, Tx, Writing, CHUNK, WHOLE_MAX};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The two ends of one 4 KiB ring in a segment of this process: rank 0 writes to the ring
/// that rank 1 reads.
fn ring(patience: Patience, stream_min: usize) -> (Tx, Rx) {
    let layout = Layout { locals: 2, ring: 4096 };
    let seg = Arc::new(Segment::create(layout.segment_bytes()).unwrap());
    init_rings(&seg, layout);
    let (tx, _) = link(&seg, &seg, layout, 0, 1, patience, stream_min);
    let (_, rx) = link(&seg, &seg, layout, 1, 0, patience, stream_min);
    (tx, rx)
}

/// A ring whose waits never spin or yield (the single-thread cases never wait).
fn quiet_ring() -> (Tx, Rx) {
    let patience = Patience { spin: std::time::Duration::ZERO, yield_for: std::time::Duration::ZERO, round: 1 };
    ring(patience, usize::MAX)
}

/// A writer and a reader thread on one ring of 4 KiB: messages of every size from a word
/// to twice the ring, sent in bursts (the ring fills) and one at a time (it empties, so
/// the writer restarts at offset 0), arrive whole and in order, and the restarts happen;
/// written with plain stores, and from 1000 bytes with streaming stores.
#[test]
fn ring_stream_survives_restarts() {
    for stream_min in [usize::MAX, 1000] {
        ring_stream(stream_min);
    }
}

fn ring_stream(stream_min: usize) {
    let patience = Patience {
        spin: std::time::Duration::from_micros(50),
        yield_for: std::time::Duration::from_micros(500),
        round: 64,
    };
    let (tx, rx) = ring(patience, stream_min);
    let sizes: Vec<usize> = (0..3000).map(|i| [1, 8, 13, 100, 1024, 1500, 4096, 5000, 8191][i % 9] + i % 7).collect();
    let msg = |i: usize, n: usize| -> Vec<u8> { (0..n).map(|k| (i * 7 + k * 13) as u8).collect() };
    let expect = sizes.clone();
    // Every wait ends within 30 s, so a lost restart fails instead of hanging.
    let start = std::time::Instant::now();
    let check = move || -> Result<(), anyccl_core::Error> {
        match start.elapsed() > std::time::Duration::from_secs(30) {
            true => Err(anyccl_core::Ctx::process("cpu").timeout("ring test", start.elapsed(), "stuck")),
            false => Ok(()),
        }
    };
    let reader = std::thread::spawn(move || {
        for (i, &n) in expect.iter().enumerate() {
            let mut got = vec![0u8; n];
            rx.read(n, &mut |at, b| got[at..at + b.len()].copy_from_slice(b), &mut { check }).unwrap();
            assert_eq!(got, msg(i, n), "message {i} of {n} bytes");
            if i % 10 == 9 {
                // A pause now and then: the writer finds the ring empty.
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        }
    });
    let mut restarts = 0;
    let mut last = 0;
    for (i, &n) in sizes.iter().enumerate() {
        let m = msg(i, n);
        tx.write(&[&m], &mut { check }, false).unwrap();
        let r = tx.ring.ctl().writer.restart.load(Ordering::Relaxed);
        if r != last {
            assert!(r % 4096 >= restart_at(4096), "restart at offset {}", r % 4096);
            restarts += 1;
            last = r;
        }
    }
    reader.join().unwrap();
    assert!(restarts > 10, "only {restarts} restarts");
    assert_eq!(tx.consumed(), tx.ring.ctl().writer.pos.load(Ordering::Relaxed));
}

/// With a line free (a chunk's header and 48 bytes), a message of 56 (a header and a body)
/// writes nothing until the reader makes room, then goes whole; one of 72 writes what fits.
#[test]
fn short_messages_are_written_whole() {
    let (tx, rx) = quiet_ring();
    let never = || -> Result<(), anyccl_core::Error> { panic!("the ring has room") };
    tx.write(&[&[7u8; 4096 - 64 - CHUNK]], &mut { never }, false).unwrap();
    let (h, body) = ([1u8; 24], [2u8; 32]);
    let parts: [&[u8]; 2] = [&h, &body];
    let mut short = Writing::new(&parts);
    assert!(short.total <= WHOLE_MAX);
    assert!(!tx.has_room(&short) && !tx.write_some(&mut short), "a short message went in part");
    assert_eq!(short.written(), 0);
    let long_bytes = [3u8; 72];
    let long_parts: [&[u8]; 1] = [&long_bytes];
    let mut long = Writing::new(&long_parts);
    assert!(tx.has_room(&long) && tx.write_some(&mut long));
    assert_eq!(long.written(), 64 - CHUNK);
    let mut first = vec![0u8; 4096 - 64 - CHUNK];
    rx.read(first.len(), &mut |at, b| first[at..at + b.len()].copy_from_slice(b), &mut { never }).unwrap();
    assert!(tx.write_some(&mut long) && long.done());
    assert!(tx.write_some(&mut short) && short.done());
    let mut rest = vec![0u8; 72 + 56];
    rx.read(rest.len(), &mut |at, b| rest[at..at + b.len()].copy_from_slice(b), &mut { never }).unwrap();
    assert_eq!(rest, [&long_bytes[..], &h, &body].concat());
}

/// Chunks of earlier laps are never taken for new ones: with the ring read empty after each
/// message (messages of 8 to 1,500 bytes, so chunk headers of many laps lie at every
/// offset), the reader sees nothing, and each message is what was sent.
#[test]
fn stale_chunks_are_not_read() {
    let (tx, rx) = quiet_ring();
    let never = || -> Result<(), anyccl_core::Error> { panic!("the ring has room and the message") };
    for i in 0..3000usize {
        let n = 8 + (i * 37) % 1500;
        let m: Vec<u8> = (0..n).map(|k| (i + k) as u8).collect();
        tx.write(&[&m], &mut { never }, false).unwrap();
        assert!(rx.available() >= n.min(64) as u64, "message {i}: not seen");
        let mut got = vec![0u8; n];
        rx.read(n, &mut |at, b| got[at..at + b.len()].copy_from_slice(b), &mut { never }).unwrap();
        assert_eq!(got, m, "message {i} of {n} bytes");
        assert_eq!(rx.available(), 0, "after message {i}: an old chunk was taken for a new one");
    }
}

/// Past the offset where a writer may start again at 0 ([`restart_at`]), a writer whose
/// reader is behind reads the reader's position (a line the reader writes at every message)
/// only every sixteenth of that offset, not at every message: after the reader catches up,
/// the restart comes with the first look due (within 4 KiB of a 256 KiB ring's messages),
/// not at the next message.
#[test]
fn a_writer_past_the_restart_mark_looks_for_the_reader_now_and_then() {
    let layout = Layout { locals: 2, ring: 256 << 10 };
    let seg = Arc::new(Segment::create(layout.segment_bytes()).unwrap());
    init_rings(&seg, layout);
    let patience = Patience { spin: std::time::Duration::ZERO, yield_for: std::time::Duration::ZERO, round: 1 };
    let (tx, _) = link(&seg, &seg, layout, 0, 1, patience, usize::MAX);
    let (_, rx) = link(&seg, &seg, layout, 1, 0, patience, usize::MAX);
    let never = || -> Result<(), anyccl_core::Error> { panic!("the ring has room and the message") };
    let (mark, msg) = (restart_at(layout.ring), [5u8; 8]);
    let restart = || tx.ring.ctl().writer.restart.load(Ordering::Relaxed);
    // One line a message: past the mark by three messages, the reader behind all along.
    let mut sent = 0usize;
    while tx.ring.at(tx.head.get()) as u64 <= mark + 2 * 64 {
        tx.write(&[&msg], &mut { never }, false).unwrap();
        sent += 1;
    }
    assert_eq!(restart(), 0, "a restart while the reader was behind");
    for _ in 0..sent {
        let mut got = [0u8; 8];
        rx.read(8, &mut |at, b| got[at..at + b.len()].copy_from_slice(b), &mut { never }).unwrap();
        assert_eq!(got, msg);
    }
    // The reader has taken everything; the writer sees it at its next look.
    let mut after = 0;
    while restart() == 0 {
        assert!(after <= (mark / 16 / 64) as usize, "no restart {after} messages after the reader caught up");
        tx.write(&[&msg], &mut { never }, false).unwrap();
        let mut got = [0u8; 8];
        rx.read(8, &mut |at, b| got[at..at + b.len()].copy_from_slice(b), &mut { never }).unwrap();
        after += 1;
    }
    assert!(after > 1, "the writer read the reader's position at every message past the mark");
}
