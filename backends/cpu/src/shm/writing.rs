//! A message being written to a ring: its parts, where the writer is in them, and what it
//! may write at once; a message written whole or not at all.

use super::{copy, lines, Tx, CHUNK, LINE, PIECE};

/// Messages of at most this many bytes (padding included) are written to a ring whole: a
/// header never arrives without the short body that follows it (a by-reference message's
/// address and number, which the reader waits for while it writes nothing: two ranks
/// exchanging such messages over nearly full rings would otherwise each wait for the
/// other's body).
pub(crate) const WHOLE_MAX: usize = 64;

/// A message being written: its parts, where the writer is, and the bytes (padding
/// included) still to write.
pub(crate) struct Writing<'a> {
    pub(super) parts: &'a [&'a [u8]],
    pub(super) part: usize,
    pub(super) off: usize,
    pub(super) left: usize,
    /// Bytes of the message, padding included.
    pub(super) total: usize,
}

impl<'a> Writing<'a> {
    pub(crate) fn new(parts: &'a [&'a [u8]]) -> Self {
        let total = parts.iter().map(|p| p.len()).sum::<usize>().next_multiple_of(8);
        let mut w = Writing { parts, part: 0, off: 0, left: total, total };
        w.skip_finished();
        w
    }
    /// Bytes written so far, padding included.
    pub(crate) fn written(&self) -> usize {
        self.total - self.left
    }
    pub(super) fn skip_finished(&mut self) {
        while self.parts.get(self.part).is_some_and(|p| self.off == p.len()) {
            self.part += 1;
            self.off = 0;
        }
    }
    pub(crate) fn done(&self) -> bool {
        self.left == 0
    }
    /// The fewest bytes the next write may put in the ring: the whole message when it is
    /// of at most [`WHOLE_MAX`] bytes, a word otherwise.
    pub(super) fn next_min(&self) -> usize {
        if self.total <= WHOLE_MAX {
            self.left.max(8)
        } else {
            8
        }
    }
}

/// Whether a message of `bytes` bytes (header and payload) lies in one line of the ring
/// (with its chunk's header), the one its reader polls.
pub(crate) fn in_one_line(bytes: usize) -> bool {
    (CHUNK + bytes.next_multiple_of(8)) as u64 <= LINE
}

impl Tx {
    /// Whether a message of `bytes` bytes (header and payload) would be written whole by
    /// [`Tx::try_write_whole`] now (room only grows until this side writes).
    pub(crate) fn fits_whole(&self, bytes: usize) -> bool {
        let total = bytes.next_multiple_of(8);
        let need = lines((CHUNK + total) as u64);
        let cap = self.ring.cap as u64;
        // The reader's position as last seen first (reading it is a line the reader
        // writes), read again only where that leaves too little room.
        total <= PIECE && (cap - (self.head.get() - self.tail_seen.get()) >= need || self.room() >= need)
    }

    /// Without waiting: write the message `parts` (header and payload, at most a piece)
    /// whole if the ring has room for it now; otherwise write nothing. Returns whether it
    /// was written.
    pub(crate) fn try_write_whole(&self, parts: &[&[u8]]) -> bool {
        let mut w = Writing::new(parts);
        if !self.fits_whole(w.total) {
            return false;
        }
        // Room for the whole message in one chunk (room only grows meanwhile: the reader
        // alone frees it), so this writes all of it.
        self.write_some(&mut w);
        debug_assert!(w.done(), "a message written in part");
        w.done()
    }

    /// Ask now for the lines that a next message of `n` lines written at `head` fills, but its
    /// first (the one a reader that caught up polls): a line the reader read last lap is in
    /// its cache, and a store to it waits for the line to come over; asked for ahead, the
    /// next message's stores (and the lock released after them) do not wait. 2 ranks,
    /// broadcast 128 B-1 KiB 0.29-0.41 -> 0.19-0.22 us a call, all_reduce 64 B 0.51 -> 0.41.
    /// Only lines the reader has read, as last seen (no new read of its position): a line
    /// it has still to read stays in its cache.
    pub(super) fn ask_ahead(&self, head: u64, n: u64) {
        let free_below = self.tail_seen.get() + self.ring.cap as u64;
        for k in 1..=n.min(16) {
            let at = head + k * LINE;
            if at + LINE > free_below {
                break;
            }
            // SAFETY: the offset is below the capacity, so the address lies in the ring's data.
            copy::prefetch_for_write(unsafe { self.ring.data.add(self.ring.at(at)) });
        }
    }
}
