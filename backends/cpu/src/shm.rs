//! Shared memory between the ranks of one host: each rank owns one anonymous segment
//! (`memfd_create`) holding a single-producer single-consumer byte ring for every other rank
//! of its host; a peer maps it through `/proc/<pid>/fd/<fd>` and writes its messages there.
//!
//! - **Nothing to leak.** The segment has no name in any file system: it lives while a
//!   process maps it or holds its descriptor, so `kill -9` of every rank leaves nothing
//!   behind (no `/dev/shm` entry to clean up).
//! - **Waiting.** A waiter spins briefly (less when the host's ranks outnumber its cores,
//!   not at all for a peer that last ran on the waiter's own CPU), then yields, then sleeps
//!   on a futex in the segment; a writer wakes it only when it announced that it sleeps, so
//!   the fast path makes no system call.
//! - **Liveness** is not this module's job: the caller's `check` closure, run between waits,
//!   ends a wait when the communicator died, the peer's control connection closed (its
//!   process exited), or the deadline passed.
//!
//! The byte stream in a ring is the same framing the TCP transport uses; every message is
//! padded to 8 bytes, so every piece a reader sees starts 8-byte aligned. A writer publishes
//! what it writes as chunks, each behind a 16-byte header whose stamp, written last, says
//! the chunk is there (see [`CHUNK`]): a reader looks at the word where the next chunk
//! starts, in the line a small message lies in, and never at the writer's position, so a
//! small message costs the reader one cache line from the writer (it cost two: the
//! position's line, then the data's) and the writer no line taken back from a polling
//! reader.
//!
//! **Restarts.** A writer that finds its ring empty past the first [`restart_at`] bytes
//! starts again at the ring's first byte: the stream position jumps to the next multiple of
//! the capacity, and the position it left is recorded for the reader (which jumps too when
//! it reaches it). Small messages thus cycle through the same few lines of the caches instead
//! of walking the whole ring. The first MiB of each ring is faulted in at connect, in both
//! mappings (`Segment::populate`): left to the first lap of messages, each page cost a fault
//! in each mapping (a few microseconds) inside the first calls of a job.
//!
//! The segments themselves, and how the rings lie in them, are `segment`. Also here, because
//! they are the other memory this backend maps itself: the platform's buffers in huge pages
//! (`huge`), and the copies between processes (`copy`).
#![allow(unsafe_code)]

mod copy;
mod huge;
mod segment;
mod wait;
mod writing;

pub(crate) use copy::{copy, copy_streaming, copy_to_vec, read_remote};
pub(crate) use huge::HugeMemory;
pub(crate) use segment::{host_id, Layout, Segment};
use wait::{futex_wake, publish_cpu, published, sleep_until, spin_then_yield, wait_until};
pub(crate) use wait::{Check, Patience};
pub(crate) use writing::{in_one_line, Writing, WHOLE_MAX};

use anyccl_core::Error;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Bytes of a ring's control block (two sides of two cache-line pairs each).
const CTL: usize = 512;
const _: () = assert!(std::mem::size_of::<Ctl>() <= CTL);
/// Bytes at the start of each ring faulted in at connect ([`Segment::populate`]): where small
/// messages and pipelines of medium ones travel (larger messages walk the whole ring, and a
/// large call absorbs the rest's faults; all of it cost every connect of 8 ranks 150 ms).
const POPULATED: usize = 1 << 20;
/// The largest piece a writer publishes at once, so a reader starts on a large message
/// before all of it is written.
const PIECE: usize = 256 << 10;

/// One side of a ring's control block: a position in the stream, a futex word bumped when
/// a sleeper on this side must wake, and whether the other side sleeps.
///
/// The position, written at every message, has a cache-line pair of its own: the other
/// fields change rarely, so the other side reads them from its own cache. (The reader's
/// position is read by the writer only when its last look leaves too little room; the
/// writer's by nobody on the way of a message: readers look at chunk stamps.)
#[repr(C, align(128))]
struct Side {
    /// Bytes written (writer's side) or consumed (reader's side) since the start.
    pos: Own<AtomicU64>,
    /// Bumped before a wake; sleepers of the *other* side wait on it.
    bell: AtomicU32,
    /// Set by this side while it sleeps, waiting for the other side.
    sleeping: AtomicU32,
    /// Reader's side: the number of the last message sent by reference that the reader has
    /// copied out of the writer's memory (the writer's buffer is free again).
    ack: AtomicU64,
    /// Writer's side: the number of the last message sent by reference whose copy the
    /// writer has waited for (while it is above the reader's `ack`, the writer waits).
    awaited: AtomicU64,
    /// Writer's side: the number of the last message sent by reference that the writer
    /// stopped waiting for (its operation failed): its buffer may change or go, so a reader
    /// that finishes copying it after this was set must not deliver it.
    withdrawn: AtomicU64,
    /// Writer's side: 1 while the writer waits for room in the ring.
    stuck: AtomicU32,
    /// Reader's side: 1 when the reader may read the writer's memory
    /// (`process_vm_readv`), so the writer may send large messages by reference.
    by_ref: AtomicU32,
    /// Writer's side: the position of the last restart (the stream continues at the next
    /// multiple of the capacity); written before the head that follows it is published.
    restart: AtomicU64,
    /// The CPU this side last wrote or read from, plus one (0: not yet): the other side stops
    /// spinning for it where that is its own CPU (see `wait::spin_then_yield`).
    cpu: AtomicU32,
    /// Reader's side: the ring's stamp key (see [`CHUNK`]), set by the segment's owner before
    /// any peer maps the segment.
    key: AtomicU64,
}

/// A value alone in its cache-line pair (no false sharing with its neighbours).
#[repr(C, align(128))]
struct Own<T>(T);

impl<T> std::ops::Deref for Own<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

#[repr(C)]
struct Ctl {
    writer: Side,
    reader: Side,
}

/// Whether this process may read its own memory through the kernel (`process_vm_readv`,
/// which some sandboxes forbid): looked at once.
pub(crate) fn self_read_ok() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        let word = std::hint::black_box([0x5au8; 8]);
        let mut out = [0u8; 8];
        read_remote(std::process::id() as i32, word.as_ptr() as usize, &mut out).is_ok() && out == word
    })
}

/// The last OS error, after `what`.
pub(super) fn os_err(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

#[derive(Clone, Copy)]
struct RingPtr {
    ctl: *const Ctl,
    data: *mut u8,
    cap: usize,
}

/// The ring offset from which a writer that finds its ring empty starts again at offset 0:
/// a quarter of the ring, at most 64 KiB (a small message's working set stays in a few
/// pages and in the cache; a 4 KiB test ring restarts every kilobyte, so the conformance
/// suite runs the restarts all the time).
pub(crate) fn restart_at(cap: usize) -> u64 {
    (cap / 4).clamp(8, 64 << 10) as u64
}

/// Bytes of a chunk's header: its stamp (the chunk's stream position XOR the ring's key),
/// then its payload's length. A writer publishes each piece it writes as one chunk, header
/// after payload, the stamp last: a reader that finds the stamp it expects at its position
/// has the whole chunk, having read one cache line, the one a small message lies in (it
/// never reads the writer's position). A stamp of an earlier lap, or payload bytes, never
/// match: positions only grow, and the key is random.
const CHUNK: usize = 16;

/// Chunks start on cache-line boundaries: a message of up to 32 bytes (with its chunk and
/// message headers, 64) lies in one line, which the reader polls and the writer fills, and no
/// line holds the end of one message and the start of the next.
const LINE: u64 = 64;

/// `n` rounded up to a whole number of lines.
fn lines(n: u64) -> u64 {
    n.next_multiple_of(LINE)
}

/// A new random stamp key (top bit set: no stream position reaches it, so no stamp is 0 and
/// zeroed memory never matches).
fn new_key() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id().into());
    h.finish() | 1 << 63
}

impl RingPtr {
    /// The word at stream position `pos` (a multiple of 8).
    fn word(&self, pos: u64) -> &AtomicU64 {
        let at = self.at(pos);
        debug_assert!(at.is_multiple_of(8), "an unaligned ring word");
        // SAFETY: `at` is a multiple of 8 below the capacity (a multiple of 8), so the word
        // lies inside the ring's data, which is 8-aligned (a page-aligned segment, control
        // blocks and rings of multiples of 8 bytes) and lives while the ring's mapping does.
        unsafe { &*self.data.add(at).cast::<AtomicU64>() }
    }

    fn ctl(&self) -> &Ctl {
        // SAFETY: `ctl` points into a live mapping (the ring's owner keeps the segment) and
        // the control block is only ever accessed through atomics.
        unsafe { &*self.ctl }
    }

    /// Where the reader at `pos` really is: past the restart that the writer made at `pos`
    /// (recorded before the head beyond it was published), if any. Restarts are made only
    /// at positions the reader had reached and only move forward, so an older record never
    /// equals the reader's position.
    fn resume(&self, pos: u64) -> u64 {
        if self.at(pos) as u64 >= restart_at(self.cap) && self.ctl().writer.restart.load(Ordering::Acquire) == pos {
            self.lap_end(pos)
        } else {
            pos
        }
    }
}

/// The writing end of a ring (in the receiver's segment).
pub(crate) struct Tx {
    ring: RingPtr,
    _seg: std::sync::Arc<Segment>,
    patience: Patience,
    /// The reader's position as last read (at most the real one): the writer reads the
    /// reader's line only when this leaves too little room, not at every message.
    tail_seen: std::cell::Cell<u64>,
    /// The writer's position, kept here as well: only this end moves it, and the reader's
    /// polling takes the shared line away between messages (a load of it missed the cache
    /// at every message).
    head: std::cell::Cell<u64>,
    /// The writer's position when it last read the reader's to see whether to restart
    /// ([`restart_at`]); read again a sixteenth of that offset later, not at every message
    /// (a reader behind writes that line at every message: each read missed the cache).
    restart_looked: std::cell::Cell<u64>,
    /// Messages of at least this many bytes are written with streaming stores
    /// ([`crate::settings::RING_STREAM_MIN`]).
    stream_min: usize,
    /// The ring's stamp key ([`CHUNK`]).
    key: u64,
}

// SAFETY: the ring's writer side is used by one thread at a time (the caller holds `Tx`
// behind a mutex); the segment is kept alive by the `Arc`.
unsafe impl Send for Tx {}

/// The reading end of a ring (in this rank's own segment).
pub(crate) struct Rx {
    ring: RingPtr,
    _seg: std::sync::Arc<Segment>,
    patience: Patience,
    /// The reader's position, kept here as well (only this end moves it; the writer reads
    /// the shared line). Inside a chunk, past its header.
    tail: std::cell::Cell<u64>,
    /// The end of the chunk the reader is in (equal to `tail` between chunks).
    chunk_end: std::cell::Cell<u64>,
    /// The position last published to the writer ([`Rx::publish`]).
    published: std::cell::Cell<u64>,
    /// The ring's stamp key ([`CHUNK`]).
    key: u64,
}

// SAFETY: as for `Tx`, for the reader side.
unsafe impl Send for Rx {}

/// Give every ring of `own` (this rank's segment, laid out as `layout`, not yet mapped by
/// any peer) its stamp key.
pub(crate) fn init_rings(own: &Segment, layout: Layout) {
    for sender in 0..layout.locals {
        own.ring(layout.offset(sender), layout.ring).ctl().reader.key.store(new_key(), Ordering::Release);
    }
}

/// The two ends between this rank and one peer of its host, the first [`POPULATED`] bytes of
/// each faulted in, in this process's mappings (the ring to the peer in the peer's segment,
/// the ring from it in this rank's own; the ring a segment holds for its own rank is never
/// used, and never faulted in).
pub(crate) fn link(
    own: &std::sync::Arc<Segment>,
    peer: &std::sync::Arc<Segment>,
    layout: Layout,
    me_local: usize,
    peer_local: usize,
    patience: Patience,
    stream_min: usize,
) -> (Tx, Rx) {
    let populated = CTL + layout.ring.min(POPULATED);
    peer.populate(layout.offset(me_local), populated);
    own.populate(layout.offset(peer_local), populated);
    let ring = peer.ring(layout.offset(me_local), layout.ring);
    let tail_seen = std::cell::Cell::new(ring.ctl().reader.pos.load(Ordering::Acquire));
    let head = std::cell::Cell::new(ring.ctl().writer.pos.load(Ordering::Acquire));
    let key = ring.ctl().reader.key.load(Ordering::Acquire);
    let restart_looked = std::cell::Cell::new(0);
    let tx = Tx { ring, _seg: peer.clone(), patience, tail_seen, head, restart_looked, stream_min, key };
    let ring = own.ring(layout.offset(peer_local), layout.ring);
    let pos = ring.ctl().reader.pos.load(Ordering::Acquire);
    let (tail, chunk_end, published) =
        (std::cell::Cell::new(pos), std::cell::Cell::new(pos), std::cell::Cell::new(pos));
    let key = ring.ctl().reader.key.load(Ordering::Acquire);
    let rx = Rx { ring, _seg: own.clone(), patience, tail, chunk_end, published, key };
    (tx, rx)
}

impl Tx {
    /// Append `parts` (one message: header and payload) to the stream, padded to 8 bytes,
    /// waiting for room as the reader consumes; `stalled` runs while there is no room (the
    /// caller drains its own incoming rings there, so two ranks sending to each other never
    /// wait on each other) and ends the wait with its error. `announce`: say while waiting
    /// that this writer is out of room ([`Tx::stuck`]).
    pub(crate) fn write(&self, parts: &[&[u8]], stalled: Check<'_>, announce: bool) -> Result<(), Error> {
        let mut w = Writing::new(parts);
        loop {
            self.write_some(&mut w);
            if w.done() {
                return Ok(());
            }
            self.wait_room(&w, stalled, announce)?;
        }
    }

    /// Messages of at least this many bytes are written with streaming stores.
    pub(crate) fn stream_min(&self) -> usize {
        self.stream_min
    }

    /// Whether the reader can read this process's memory (large messages go by reference).
    pub(crate) fn by_ref_ok(&self) -> bool {
        self.ring.ctl().reader.by_ref.load(Ordering::Acquire) == 1
    }

    /// Wait until the reader has copied the message sent by reference with number `n`.
    pub(crate) fn wait_ack(&self, n: u64, stalled: Check<'_>) -> Result<(), Error> {
        let ctl = self.ring.ctl();
        ctl.writer.awaited.store(n, Ordering::Release);
        wait_until(
            self.patience,
            (&ctl.reader.bell, &ctl.writer.sleeping, &ctl.reader.cpu),
            || ctl.reader.ack.load(Ordering::Acquire) >= n,
            stalled,
        )
    }

    /// Bytes the reader has consumed since the start (it moves while the reader reads).
    pub(crate) fn consumed(&self) -> u64 {
        self.ring.ctl().reader.pos.load(Ordering::Acquire)
    }

    /// Free bytes in the ring, the reader's position read now.
    fn room(&self) -> u64 {
        let ctl = self.ring.ctl();
        let tail = self.ring.resume(ctl.reader.pos.load(Ordering::Acquire));
        self.ring.cap as u64 - (self.head.get() - tail)
    }

    /// Whether there is room in the ring for what [`Tx::write_some`] writes of `w` next.
    pub(crate) fn has_room(&self, w: &Writing<'_>) -> bool {
        self.room() >= lines((CHUNK + w.next_min()) as u64)
    }

    /// Wait until there is room in the ring for what [`Tx::write_some`] writes of `w` next.
    fn wait_room(&self, w: &Writing<'_>, check: Check<'_>, announce: bool) -> Result<(), Error> {
        let ctl = self.ring.ctl();
        if announce {
            self.stuck(true);
        }
        let r = wait_until(
            self.patience,
            (&ctl.reader.bell, &ctl.writer.sleeping, &ctl.reader.cpu),
            || self.has_room(w),
            check,
        );
        if announce {
            self.stuck(false);
        }
        r
    }

    /// Say whether this writer waits for room (a reader waiting on another peer then moves
    /// what this writer sent to its inbox: see `Rx::awaited`).
    pub(crate) fn stuck(&self, on: bool) {
        self.ring.ctl().writer.stuck.store(u32::from(on), Ordering::SeqCst);
    }

    /// Stop waiting for the copy of message `n` sent by reference: the reader must not
    /// deliver it unless its copy finished before this.
    pub(crate) fn withdraw(&self, n: u64) {
        self.ring.ctl().writer.withdrawn.store(n, Ordering::SeqCst);
        // The caller's next writes to the buffer come after the store, on every CPU (a
        // SeqCst store alone orders only what precedes it).
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Without waiting: write as much of the message as there is room for (whole words; a
    /// message of at most [`WHOLE_MAX`] bytes whole or not at all). Returns whether anything
    /// was written.
    pub(crate) fn write_some(&self, w: &mut Writing<'_>) -> bool {
        let ctl = self.ring.ctl();
        let cap = self.ring.cap as u64;
        let mut head = self.head.get();
        let want = w.left.min(PIECE);
        let mark = restart_at(self.ring.cap);
        if want > 0 && self.ring.at(head) as u64 >= mark && head - self.restart_looked.get() >= mark / 16 {
            // Past the warm start of the ring: if the reader has taken everything, start
            // again at offset 0, recorded before the head that follows is published below
            // (there is room for at least a word then, so this call publishes one).
            self.restart_looked.set(head);
            self.tail_seen.set(self.ring.resume(ctl.reader.pos.load(Ordering::Acquire)));
            if self.tail_seen.get() == head {
                ctl.writer.restart.store(head, Ordering::Relaxed);
                head = self.ring.lap_end(head);
                self.tail_seen.set(head);
            }
        }
        let mut room = (cap - (head - self.tail_seen.get())) as usize;
        if room < lines((CHUNK + want) as u64) as usize {
            self.tail_seen.set(self.ring.resume(ctl.reader.pos.load(Ordering::Acquire)));
            room = (cap - (head - self.tail_seen.get())) as usize;
        }
        // Whole lines (the head is at a line's start; the reader's position may not be).
        let mut n = (room & !(LINE as usize - 1)).saturating_sub(CHUNK).min(want) & !7;
        if n < w.next_min() {
            return false;
        }
        w.left -= n;
        // One chunk: its payload from after the header, then its length and its stamp.
        let chunk = head;
        head += CHUNK as u64;
        let len = n as u64;
        while n > 0 {
            let at = self.ring.at(head);
            let contiguous = n.min(self.ring.cap - at);
            let mut filled = 0;
            while filled < contiguous {
                let (len, src): (usize, Option<&[u8]>) = match w.parts.get(w.part) {
                    Some(p) => {
                        let k = (p.len() - w.off).min(contiguous - filled);
                        (k, Some(&p[w.off..w.off + k]))
                    }
                    None => (contiguous - filled, None), // padding
                };
                // SAFETY: `at + filled .. + len` lies inside the ring's data (at most
                // `contiguous` bytes from `at`), a range the reader does not touch until the
                // chunk's stamp is published.
                let dst = unsafe { self.ring.data.add(at + filled) };
                match src {
                    Some(s) => {
                        // SAFETY: `dst` has `s.len()` writable bytes (above); the source is a
                        // distinct slice.
                        let d = unsafe { std::slice::from_raw_parts_mut(dst, s.len()) };
                        if w.total >= self.stream_min && s.len() >= 256 {
                            copy_streaming(d, s)
                        } else {
                            copy(d, s)
                        }
                    }
                    // SAFETY: as above, for the padding bytes.
                    None => unsafe { std::ptr::write_bytes(dst, 0, len) },
                }
                filled += len;
                if src.is_some() {
                    w.off += len;
                    w.skip_finished();
                }
            }
            head += contiguous as u64;
            n -= contiguous;
        }
        // (Streaming stores end with a store fence: they too come before the stamp.)
        self.ring.word(chunk + 8).store(len, Ordering::Relaxed);
        self.ring.word(chunk).store(chunk ^ self.key, Ordering::Release);
        let head = lines(head);
        self.head.set(head);
        self.ask_ahead(head, (head - chunk) / LINE);
        publish_cpu(&ctl.writer.cpu);
        ctl.writer.pos.store(head, Ordering::Release);
        if published(&ctl.reader.sleeping) {
            futex_wake(&ctl.writer.bell);
        }
        true
    }
}

/// Wait until `ready()` holds for a thread that both writes to `tx` and reads from `rx`:
/// it spins and yields, then sleeps briefly (either side's progress may be what it waits for,
/// so it cannot sleep on one futex alone).
pub(crate) fn wait_either(tx: &Tx, rx: &Rx, mut ready: impl FnMut() -> bool, check: Check<'_>) -> Result<(), Error> {
    let awaited = [&tx.ring.ctl().reader.cpu, &rx.ring.ctl().writer.cpu];
    if spin_then_yield(tx.patience, &mut ready, &awaited, check)? {
        return Ok(());
    }
    // Sleep on the incoming ring's bell, briefly: its writer rings it, and room that the
    // reader of `tx` frees is seen at the next look.
    let ctl = rx.ring.ctl();
    sleep_until(&ctl.writer.bell, &ctl.reader.sleeping, Duration::from_micros(200), &mut ready, check)
}

impl Rx {
    /// Tell the writer whether this process may read its memory.
    pub(crate) fn allow_by_ref(&self, ok: bool) {
        self.ring.ctl().reader.by_ref.store(u32::from(ok), Ordering::Release);
    }

    /// Acknowledge the message sent by reference with number `n`: copied.
    pub(crate) fn ack(&self, n: u64) {
        let ctl = self.ring.ctl();
        ctl.reader.ack.store(n, Ordering::SeqCst);
        if ctl.writer.sleeping.load(Ordering::SeqCst) != 0 {
            futex_wake(&ctl.reader.bell);
        }
    }

    /// Whether the writer waits for this reader: for room, or for the copy of a message it
    /// sent by reference.
    pub(crate) fn awaited(&self) -> bool {
        let ctl = self.ring.ctl();
        ctl.writer.stuck.load(Ordering::Acquire) == 1
            || ctl.writer.awaited.load(Ordering::Acquire) > ctl.reader.ack.load(Ordering::Relaxed)
    }

    /// Whether the writer withdrew message `n` sent by reference (looked at after copying
    /// it: a copy that finished before the withdrawal read the buffer as sent).
    pub(crate) fn withdrawn(&self, n: u64) -> bool {
        // The copy's reads come before the load, on every CPU.
        std::sync::atomic::fence(Ordering::SeqCst);
        self.ring.ctl().writer.withdrawn.load(Ordering::SeqCst) >= n
    }

    /// Bytes this reader has consumed since the start.
    pub(crate) fn consumed(&self) -> u64 {
        self.tail.get()
    }

    /// The chunk at stream position `pos` (past a restart there), if its writer has
    /// published it: where its payload starts, and its length.
    fn chunk_at(&self, pos: u64) -> Option<(u64, u64)> {
        let at = self.ring.resume(pos);
        if self.ring.word(at).load(Ordering::Acquire) != at ^ self.key {
            return None;
        }
        let len = self.ring.word(at + 8).load(Ordering::Relaxed);
        // A length no writer writes (the peer's memory was overwritten): nothing readable,
        // so the wait runs out and fails naming the peer.
        (len > 0 && len.is_multiple_of(8) && len <= (self.ring.cap - CHUNK) as u64).then_some((at + CHUNK as u64, len))
    }

    /// Unread bytes of the chunk the reader is in, entering the next chunk when the reader
    /// is between chunks and its writer has published it (0: nothing has arrived).
    fn current(&self) -> u64 {
        let (tail, end) = (self.tail.get(), self.chunk_end.get());
        if tail < end {
            return end - tail;
        }
        match self.chunk_at(tail) {
            Some((start, len)) => {
                self.tail.set(start);
                self.chunk_end.set(start + len);
                len
            }
            None => 0,
        }
    }

    /// Unread bytes in the ring: the rest of the chunk the reader is in and the chunks
    /// published after it, looked at until they make [`SEEN_MAX`] bytes.
    pub(crate) fn available(&self) -> u64 {
        let (tail, end) = (self.tail.get(), self.chunk_end.get());
        let (mut seen, mut next) = if tail < end { (end - tail, lines(end)) } else { (0, tail) };
        while seen < SEEN_MAX {
            let Some((start, len)) = self.chunk_at(next) else { break };
            seen += len;
            next = lines(start + len);
        }
        seen
    }

    /// Looks at the ring between clock reads while waiting (`ANYCCL_CPU_ROUND`, see
    /// [`Patience`]).
    pub(crate) fn round(&self) -> u32 {
        self.patience.round
    }

    /// Without consuming anything: the first byte of the next message, where the reader is
    /// between messages and its writer has published the chunk it starts (`None`: nothing
    /// has arrived, or the reader is inside a message).
    pub(crate) fn peek_first(&self) -> Option<u8> {
        let (tail, end) = (self.tail.get(), self.chunk_end.get());
        if tail < end {
            return None;
        }
        let (start, _) = self.chunk_at(tail)?;
        // A chunk's payload starts in the line of its header (chunks start on lines).
        let word = self.ring.word(start).load(Ordering::Relaxed);
        Some(word.to_le_bytes()[0])
    }

    /// Wait until at least `n` bytes (at most the ring's capacity) are unread.
    pub(crate) fn wait_for(&self, n: usize, check: Check<'_>) -> Result<(), Error> {
        let n = (n as u64).min(self.ring.cap as u64);
        let ctl = self.ring.ctl();
        wait_until(
            self.patience,
            (&ctl.writer.bell, &ctl.reader.sleeping, &ctl.writer.cpu),
            || self.available() >= n,
            check,
        )
    }

    /// Consume the next `len` bytes of the stream (and the padding to 8 after them), giving
    /// them to `sink` in pieces as they arrive: `sink(offset, bytes)`. Every piece but the
    /// last holds a multiple of 8 bytes and starts 8-byte aligned in memory.
    pub(crate) fn read(&self, len: usize, sink: &mut dyn FnMut(usize, &[u8]), check: Check<'_>) -> Result<(), Error> {
        self.read_from(0, len, sink, check)
    }

    /// [`Rx::read`] of a message of which `done` bytes were consumed before.
    pub(crate) fn read_from(
        &self,
        mut done: usize,
        len: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
        check: Check<'_>,
    ) -> Result<(), Error> {
        loop {
            done = self.read_some(done, len, sink);
            if done >= len.next_multiple_of(8) {
                return Ok(());
            }
            self.wait_for(8, check)?;
        }
    }

    /// Without waiting: consume what has arrived of a `len`-byte message of which `done`
    /// bytes (padding included) were consumed before, giving it to `sink` as [`Rx::read`]
    /// does. Returns the bytes consumed so far; the message is complete at `len` rounded up
    /// to 8.
    pub(crate) fn read_some(&self, done: usize, len: usize, sink: &mut dyn FnMut(usize, &[u8])) -> usize {
        let done = self.take_some(done, len, sink);
        self.publish();
        done
    }

    /// [`Rx::read_some`] without telling the writer: the caller reads on at once (a
    /// message's body after its header) and then calls [`Rx::publish`], once for both, and
    /// before it waits for anything (a writer may be waiting for the room).
    pub(crate) fn take_some(&self, mut done: usize, len: usize, sink: &mut dyn FnMut(usize, &[u8])) -> usize {
        let padded = len.next_multiple_of(8);
        while done < padded {
            let here = self.current() as usize;
            if here == 0 {
                break;
            }
            let mut take = here.min(padded - done);
            let mut tail = self.tail.get();
            while take > 0 {
                let at = self.ring.at(tail);
                let contiguous = take.min(self.ring.cap - at);
                let useful = contiguous.min(len.saturating_sub(done));
                if useful > 0 {
                    // SAFETY: `at .. at + contiguous` lies inside the ring's data and holds
                    // bytes of a chunk the writer published (its stamp was seen) and will not
                    // touch until the reader's position moves past them.
                    let piece = unsafe { std::slice::from_raw_parts(self.ring.data.add(at), useful) };
                    sink(done, piece);
                }
                done += contiguous;
                tail += contiguous as u64;
                take -= contiguous;
            }
            if tail == self.chunk_end.get() {
                // The chunk is read: on to the line where the next one starts.
                tail = lines(tail);
                self.chunk_end.set(tail);
            }
            self.tail.set(tail);
        }
        done
    }

    /// Tell the writer how far this reader has read, if it moved since it last did.
    pub(crate) fn publish(&self) {
        let tail = self.tail.get();
        if tail == self.published.get() {
            return;
        }
        self.published.set(tail);
        let ctl = self.ring.ctl();
        publish_cpu(&ctl.reader.cpu);
        ctl.reader.pos.store(tail, Ordering::Release);
        if published(&ctl.writer.sleeping) {
            futex_wake(&ctl.reader.bell);
        }
    }
}

/// [`Rx::available`] looks at chunks ahead until it has seen this many bytes (a caller asks
/// for a message header at most).
const SEEN_MAX: u64 = 64;

#[cfg(test)]
mod tests;
