//! The links between ranks of one host: rings in shared memory (see [`crate::shm`]), the
//! drain that keeps senders from waiting on each other, and large messages copied once out
//! of the sender's memory. (A step that streams both directions at once is `exchange`; the
//! links are made in `setup`.)

use super::by_ref::Lent;
use super::watch::Watch;
use super::*;

/// Both ends of the rings between this rank and one peer of its host.
pub(super) struct ShmLink {
    pub(super) tx: Mutex<shm::Tx>,
    pub(super) rx: Mutex<RxState>,
    /// The peer's process.
    pid: i32,
    /// Messages sent to it by reference so far.
    refs: AtomicU64,
}

/// The reading end of a link and the message a drain left half read.
pub(super) struct RxState {
    pub(super) rx: shm::Rx,
    pub(super) partial: Option<Partial>,
}

/// A message read in part by a drain (which never waits mid-message: the peer may be
/// draining too, waiting for the rest of this rank's own message).
pub(super) struct Partial {
    hdr: Hdr,
    /// The payload, or for a message sent by reference its address and number.
    body: Vec<u8>,
    /// Bytes consumed, padding included.
    done: usize,
}

/// A message header.
#[derive(Debug, Clone, Copy)]
pub(super) struct Hdr {
    pub(super) kind: u8,
    pub(super) op: u8,
    /// The body is the payload's address in the sender and the message's number: the
    /// receiver copies the payload out of the sender's memory and acknowledges it.
    pub(super) by_ref: bool,
    pub(super) seq: u64,
    pub(super) len: usize,
}

/// Bytes of a by-reference message's body.
pub(super) const REF_BODY: usize = 16;
// A by-reference message is written whole: its reader waits for the body after the header.
const _: () = assert!(SHM_HEADER + REF_BODY <= shm::WHOLE_MAX);

/// Bytes of a message's header in a ring: its kind (by reference: [`BY_REF`] set), its
/// operation and its length below 2^48 in the first word, little-endian (kind in the low byte,
/// length from bit 16), its number in the second. With a chunk's own 16 bytes, a message of up
/// to 32 payload bytes is one cache line, which is what the peer's reader waits on: the
/// 24-byte header sockets use left room for 24, and 25-32 B all_reduces of two ranks ran 1.5x
/// as long as 24 B ones (0.57 against 0.39 us).
pub(super) const SHM_HEADER: usize = 16;

/// The bit of a ring message's kind byte that says its body is the payload's address.
const BY_REF: u8 = 0x80;

/// The kind of a ring message whose header starts with byte `first` (`Rx::peek_first`), its
/// by-reference bit left out.
pub(super) fn kind_of(first: u8) -> u8 {
    first & !BY_REF
}

/// A copy of bytes into a buffer of their length: plain or streaming stores (`shm::copy`,
/// `shm::copy_streaming`).
pub(crate) type Copier = fn(&mut [u8], &[u8]);

/// A buffer that gets a copy of what is sent, and the copy to make.
pub(crate) type Mirror<'a> = Option<(&'a mut [u8], Copier)>;

/// Where a received payload goes.
pub(crate) enum Sink<'a> {
    /// Copied to this buffer by the copier, as it comes through the ring; a message sent by
    /// reference is copied once, by the kernel, straight out of the sender's memory (with
    /// streaming stores it would go through a buffer: two copies, measured 2.4x slower for
    /// an 8 MiB all_gather on a 32 MiB L3).
    Into(&'a mut [u8], Copier),
    /// Handed over in pieces: `f(offset, bytes)`.
    With(&'a mut dyn FnMut(usize, &[u8])),
}

impl ShmLink {
    /// The link made of a peer's ends `tx` and `rx`, the peer's process being `pid`.
    pub(super) fn new(tx: shm::Tx, rx: shm::Rx, pid: i32) -> ShmLink {
        ShmLink { tx: Mutex::new(tx), rx: Mutex::new(RxState { rx, partial: None }), pid, refs: AtomicU64::new(0) }
    }
}

impl Mesh {
    /// The header of a message to a peer of this host, and the body that replaces the
    /// payload when it goes by reference (large, and the peer may read this process), sent
    /// in an exchange or alone.
    ///
    /// # Errors
    /// `InvalidArgument` for a message of 2^48 bytes or more (its length does not fit
    /// [`SHM_HEADER`]), before anything is written.
    pub(super) fn header_for(
        &self,
        tx: &shm::Tx,
        link: &ShmLink,
        (kind, op, seq): (Kind, u8, u64),
        data: Data<'_>,
        exchange: bool,
    ) -> Result<([u8; SHM_HEADER], Option<[u8; REF_BODY]>)> {
        let len = data.len() as u64;
        if len >> 48 != 0 {
            return Err(self.too_long(len));
        }
        let mut h = [0u8; SHM_HEADER];
        h[..8].copy_from_slice(&(len << 16 | u64::from(op) << 8 | kind as u64).to_le_bytes());
        h[8..].copy_from_slice(&seq.to_le_bytes());
        let addr = match data {
            // Lent ranges are only sent where they go by reference (see `Mesh::resolve`).
            Data::At { addr, .. } => addr,
            Data::Bytes(b) if self.by_ref(tx, (kind, op), b.len(), exchange) => b.as_ptr() as usize,
            Data::Bytes(_) => return Ok((h, None)),
        };
        h[0] |= BY_REF;
        let n = link.refs.fetch_add(1, Ordering::Relaxed) + 1;
        let mut b = [0u8; REF_BODY];
        b[..8].copy_from_slice(&(addr as u64).to_le_bytes());
        b[8..].copy_from_slice(&n.to_le_bytes());
        Ok((h, Some(b)))
    }

    #[cold]
    fn too_long(&self, len: u64) -> Error {
        self.ctx.invalid(
            "send",
            "buf",
            format!("a {len}-byte message is beyond what a message between ranks of one host may carry (2^48 bytes)"),
        )
    }

    /// Wait until `peer` has copied the message `lent` sent by reference (the sender's buffer
    /// must stay as it is until then), draining meanwhile (and serving once the wait is long);
    /// then mark it acknowledged.
    pub(super) fn wait_ack(&self, peer: usize, lent: &mut Lent<'_>, what: &dyn Fn() -> String) -> Result<()> {
        let deadline = Watch::new(self.op_timeout).long_after(super::watch::drain_after_copy(lent.len));
        lent.tx.wait_ack(lent.n, &mut || {
            self.stop(peer, &deadline, || false, what)?;
            self.drain()?;
            self.serve_if_long(&deadline)
        })?;
        lent.acked = true;
        Ok(())
    }

    /// Read the payload of message `m` from `peer` into `sink`: from the ring, or, sent by
    /// reference, out of the peer's memory (then acknowledged).
    pub(super) fn take_payload(
        &self,
        peer: usize,
        link: &ShmLink,
        rx: &shm::Rx,
        m: Hdr,
        sink: &mut Sink<'_>,
        stop: shm::Check<'_>,
    ) -> Result<()> {
        if !m.by_ref {
            return match sink {
                Sink::Into(dst, copy) => rx.read(m.len, &mut |at, b| copy(&mut dst[at..at + b.len()], b), stop),
                Sink::With(f) => rx.read(m.len, *f, stop),
            };
        }
        let mut body = [0u8; REF_BODY];
        rx.read(REF_BODY, &mut |at, b| body[at..at + b.len()].copy_from_slice(b), stop)?;
        self.copy_by_ref(peer, link, rx, m.len, &body, sink)
    }

    /// Copy a by-reference message (`body`: address, number) of `len` bytes out of `peer`'s
    /// memory into `sink`, and acknowledge it.
    fn copy_by_ref(
        &self,
        peer: usize,
        link: &ShmLink,
        rx: &shm::Rx,
        len: usize,
        body: &[u8],
        sink: &mut Sink<'_>,
    ) -> Result<()> {
        let addr = u64::from_le_bytes(body[..8].try_into().unwrap_or_default()) as usize;
        let n = u64::from_le_bytes(body[8..16].try_into().unwrap_or_default());
        let withdrawn = || {
            self.peer_err(
                peer,
                format!(
                    "rank {peer} withdrew the {len}-byte message it sent by reference while this rank copied it (its \
                     operation failed)"
                ),
            )
        };
        // A read that fails because the sender's memory went away says why it went, where
        // that is known: the sender withdrew the message (its operation failed) or left.
        let failed = |e: String| {
            if rx.withdrawn(n) {
                return withdrawn();
            }
            match self.mailbox.closed_why(peer) {
                Some(why) => self.dead_err(Dead { aborted: false, peer: Some(peer), detail: why }),
                None => self.peer_err(peer, format!("reading rank {peer}'s message: {e}")),
            }
        };
        match sink {
            Sink::Into(dst, _) => shm::read_remote(link.pid, addr, &mut dst[..len]).map_err(failed)?,
            Sink::With(f) => {
                // Through a buffer that stays in cache, a piece at a time, starting at the
                // sender's offset in its page: the kernel's copy then never meets the slow
                // offsets (`shm::copy::slow_offset`) and never takes the bounce buffer.
                const PIECE: usize = 256 << 10;
                let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
                scratch.resize(PIECE.min(len) + 8192, 0);
                let o = scratch.as_ptr().align_offset(4096) + (addr & 0xfff);
                let scratch = &mut scratch[o..];
                let mut at = 0;
                while at < len {
                    let k = PIECE.min(len - at);
                    shm::read_remote(link.pid, addr + at, &mut scratch[..k]).map_err(failed)?;
                    f(at, &scratch[..k]);
                    at += k;
                }
            }
        }
        if rx.withdrawn(n) {
            return Err(withdrawn());
        }
        rx.ack(n);
        Ok(())
    }

    /// Why a wait on `peer` must end now, if it must: the communicator died, the peer's
    /// process went away (its connection closed and `pending` says nothing it sent is left
    /// to read), or `deadline` passed.
    pub(super) fn stop(
        &self,
        peer: usize,
        deadline: &Watch,
        pending: impl Fn() -> bool,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        if let Some(d) = self.mailbox.dead() {
            return Err(self.dead_err(d));
        }
        if let Some(why) = self.mailbox.closed_why(peer) {
            if !pending() {
                return Err(self.dead_err(Dead { aborted: false, peer: Some(peer), detail: why }));
            }
        }
        if Instant::now() >= deadline.at() {
            let t = self.op_timeout;
            return Err(self.ctx.timeout(
                what(),
                t,
                format!(
                    "rank {peer} made no progress for {t:?} (over shared memory): it has not reached this operation \
                     (a stopped, stuck or slower rank, or one that issued other operations)"
                ),
            ));
        }
        Ok(())
    }

    /// Write one message to a peer of this host. While its ring is full, the messages other
    /// peers of this host wrote to this rank are moved to the inbox, so ranks that send to
    /// each other before receiving never wait on each other. A large message goes by
    /// reference: this waits until the peer has copied it.
    pub(super) fn shm_send(
        &self,
        peer: usize,
        link: &ShmLink,
        kind: Kind,
        op: u8,
        seq: u64,
        data: Data<'_>,
    ) -> Result<()> {
        let tx = link.tx.lock().unwrap_or_else(|p| p.into_inner());
        let what = || what(kind, op, seq);
        let (h, by_ref) = self.header_for(&tx, link, (kind, op, seq), data, false)?;
        let mut lent = by_ref.as_ref().map(|b| Lent::new(&tx, b, data.len()));
        let deadline = Watch::new(self.op_timeout);
        let mut taken = tx.consumed();
        let mut stalled = || -> Result<()> {
            deadline.restart_on_progress(&mut taken, tx.consumed());
            self.stop(peer, &deadline, || false, &what)?;
            self.drain()?;
            self.serve_if_long(&deadline)
        };
        let bytes = if let Data::Bytes(b) = data { b } else { &[] };
        // Only a point-to-point writer says that it is out of room: collectives run in step,
        // and a receiver draining their rings early would only add a copy.
        tx.write(&[&h, by_ref.as_ref().map_or(bytes, |b| &b[..])], &mut stalled, kind == Kind::P2p)?;
        lent.as_mut().map_or(Ok(()), |l| self.wait_ack(peer, l, &what))
    }

    /// [`Mesh::serve`] once a wait has lasted [`super::watch::DRAIN_AFTER`] without
    /// progress: a peer that sent this rank a message by reference waits for its copy,
    /// while this rank waits on another peer (which may wait for the first).
    pub(super) fn serve_if_long(&self, w: &Watch) -> Result<()> {
        if w.long() {
            self.serve()
        } else {
            Ok(())
        }
    }

    /// [`Mesh::drain`] of the rings whose writers wait for this rank to copy a message they
    /// sent by reference.
    pub(super) fn serve(&self) -> Result<()> {
        self.drain_where(|rx| rx.awaited(), true)
    }

    /// Move what has arrived in this rank's rings to the inbox (as far as each peer's inbox
    /// bound allows), without waiting: a message that has arrived in part stays half read.
    /// A message sent by reference is read up to its address and left there: moved now, it
    /// would be copied twice (out of the sender's memory to the inbox, then to the receive
    /// that takes it), where that receive copies it once. A 4-rank sendrecv ring of 8 MiB on
    /// 2 cores, each rank waiting for its send's copy while its sender's next message came,
    /// spent five times the user time moving them. [`Mesh::serve`] moves them once a wait
    /// is long (a peer that sent one may be what this wait waits for, through others).
    fn drain(&self) -> Result<()> {
        self.drain_where(|_| true, false)
    }

    /// [`Mesh::drain`] of the rings that `pick` selects; with `by_ref`, messages sent by
    /// reference too.
    fn drain_where(&self, pick: impl Fn(&shm::Rx) -> bool, by_ref: bool) -> Result<()> {
        for (q, link) in self.shm.iter().enumerate() {
            let Some(link) = link else { continue };
            let Ok(mut st) = link.rx.try_lock() else { continue };
            if !pick(&st.rx) {
                continue;
            }
            loop {
                if st.partial.is_none() {
                    if st.rx.available() < SHM_HEADER as u64 || self.mailbox.held(q) >= self.mailbox.inbox_limit {
                        break;
                    }
                    let mut h = [0u8; SHM_HEADER];
                    st.rx.read_some(0, SHM_HEADER, &mut |at, b| h[at..at + b.len()].copy_from_slice(b));
                    let hdr = self.parse_header(q, &h)?;
                    let n = if hdr.by_ref { REF_BODY } else { hdr.len };
                    let body = self.message_buf(q, n)?;
                    st.partial = Some(Partial { hdr, body, done: 0 });
                }
                let RxState { rx, partial } = &mut *st;
                let Some(p) = partial.as_mut() else { break };
                let len = p.body.len();
                let body = &mut p.body;
                p.done = rx.read_some(p.done, len, &mut |at, b| crate::shm::copy(&mut body[at..at + b.len()], b));
                if p.done < len.next_multiple_of(8) || (p.hdr.by_ref && !by_ref) {
                    break;
                }
                if let Some(p) = partial.take() {
                    self.complete(q, link, &*rx, p)?;
                }
            }
        }
        Ok(())
    }

    /// Deliver a message read whole by a drain to the inbox (copying it out of the sender's
    /// memory first when it came by reference).
    fn complete(&self, peer: usize, link: &ShmLink, rx: &shm::Rx, p: Partial) -> Result<()> {
        let data = if p.hdr.by_ref {
            let mut data = self.message_buf(peer, p.hdr.len)?;
            self.copy_by_ref(peer, link, rx, p.hdr.len, &p.body, &mut Sink::Into(&mut data, crate::shm::copy))?;
            data
        } else {
            p.body
        };
        self.deliver(peer, p.hdr.kind, p.hdr.op, p.hdr.seq, data);
        Ok(())
    }

    /// `n` bytes, to be overwritten whole, for a message from `peer` on its way to the inbox
    /// (its length is the peer's word), or an error naming the peer where they cannot be
    /// allocated. They come from the buffers of earlier such messages where one is large
    /// enough: a 4-rank sendrecv ring of 64 MiB on 2 cores copies most messages out of their
    /// senders' memory before their receive starts, and a fresh buffer for each faulted
    /// about 16,000 pages in (a million page faults in 30 calls).
    fn message_buf(&self, peer: usize, n: usize) -> Result<Vec<u8>> {
        self.bufs
            .filled(n)
            .ok_or_else(|| self.peer_err(peer, format!("a {n}-byte message from rank {peer} cannot be allocated")))
    }

    /// Move message `m` from `peer`, whose header was just read, whole to the inbox (one of
    /// the other kind than the receive that met it).
    pub(super) fn to_inbox(
        &self,
        peer: usize,
        link: &ShmLink,
        rx: &shm::Rx,
        m: Hdr,
        stop: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let mut data = self.message_buf(peer, m.len)?;
        self.take_payload(peer, link, rx, m, &mut Sink::Into(&mut data, crate::shm::copy), stop)?;
        self.deliver(peer, m.kind, m.op, m.seq, data);
        Ok(())
    }

    fn deliver(&self, peer: usize, kind: u8, op: u8, seq: u64, data: Vec<u8>) {
        if kind == Kind::Coll as u8 {
            self.mailbox.push_coll(peer, CollMsg { op, seq, data });
        } else {
            self.mailbox.push_p2p(peer, data);
        }
    }

    pub(super) fn parse_header(&self, peer: usize, h: &[u8; SHM_HEADER]) -> Result<Hdr> {
        let first = u64::from_le_bytes(h[..8].try_into().unwrap_or_default());
        let seq = u64::from_le_bytes(h[8..].try_into().unwrap_or_default());
        let kind = kind_of(h[0]);
        if kind != Kind::Coll as u8 && kind != Kind::P2p as u8 {
            return Err(self.peer_err(peer, format!("rank {peer} wrote an unknown message kind {kind}")));
        }
        Ok(Hdr { kind, op: h[1], by_ref: h[0] & BY_REF != 0, seq, len: (first >> 16) as usize })
    }

    /// Where a drain left the next message from `peer` read up to its address (one sent by
    /// reference, of `kind`; the caller found none of that kind in the inbox, so it is the
    /// next of its kind), check it against what this rank runs and copy it once, out of
    /// the sender's memory, into `sink`. `Ok(false)`: the next message is no such one.
    #[allow(clippy::too_many_arguments)] // a receive's identity, as `shm_recv` takes it
    pub(super) fn take_left_ref(
        &self,
        peer: usize,
        link: &ShmLink,
        st: &mut RxState,
        kind: Kind,
        (op, seq): (u8, u64),
        expect: usize,
        sink: &mut Sink<'_>,
    ) -> Result<bool> {
        let left = st
            .partial
            .as_ref()
            .is_some_and(|p| p.hdr.by_ref && p.hdr.kind == kind as u8 && p.done >= p.body.len().next_multiple_of(8));
        let Some(p) = st.partial.take_if(|_| left) else { return Ok(false) };
        if kind == Kind::Coll {
            self.check_coll(peer, op, seq, expect, (p.hdr.op, p.hdr.seq, p.hdr.len))?;
        } else if p.hdr.len != expect {
            return Err(self.p2p_size(peer, p.hdr.len, expect));
        }
        self.copy_by_ref(peer, link, &st.rx, p.hdr.len, &p.body, sink)?;
        Ok(true)
    }

    /// Read the next message header from `peer`'s ring (waiting for it until `deadline`).
    fn shm_header(&self, peer: usize, rx: &shm::Rx, deadline: &Watch, what: &dyn Fn() -> String) -> Result<Hdr> {
        let pending = || rx.available() >= SHM_HEADER as u64;
        let mut h = [0u8; SHM_HEADER];
        rx.wait_for(SHM_HEADER, &mut || {
            self.stop(peer, deadline, pending, what)?;
            self.serve_if_long(deadline)
        })?;
        rx.read(SHM_HEADER, &mut |at, b| h[at..at + b.len()].copy_from_slice(b), &mut || {
            self.stop(peer, deadline, pending, what)
        })?;
        self.parse_header(peer, &h)
    }

    /// Receive the next message of `kind` from a peer of this host into `sink`: first what
    /// was moved to the inbox, then its ring (messages of the other kind found on the way
    /// go to the inbox).
    pub(super) fn shm_recv(
        &self,
        peer: usize,
        link: &ShmLink,
        kind: Kind,
        (op, seq): (u8, u64),
        expect: usize,
        sink: &mut Sink<'_>,
    ) -> Result<()> {
        let coll = kind == Kind::Coll;
        let queued = if coll {
            match self.mailbox.try_take(peer, Inbox::pop_coll) {
                Some(m) => {
                    self.check_coll(peer, op, seq, expect, (m.op, m.seq, m.data.len()))?;
                    Some(m.data)
                }
                None => None,
            }
        } else {
            match self.mailbox.try_take(peer, Inbox::pop_p2p) {
                Some(d) if d.len() != expect => return Err(self.p2p_size(peer, d.len(), expect)),
                d => d,
            }
        };
        if let Some(d) = queued {
            match sink {
                Sink::Into(dst, copy) => copy(dst, &d),
                Sink::With(f) => f(0, &d),
            }
            self.bufs.put(d);
            return Ok(());
        }
        let deadline = Watch::new(self.op_timeout);
        let mut st = link.rx.lock().unwrap_or_else(|p| p.into_inner());
        let what = || if coll { what(Kind::Coll, op, seq) } else { format!("recv from rank {peer}") };
        if let Some(mut p) = st.partial.take() {
            // A drain began the next message: finish it.
            let len = p.body.len();
            let body = &mut p.body;
            let rx = &st.rx;
            let done = p.done;
            let pending = || rx.available() > 0;
            rx.read(
                len.next_multiple_of(8) - done,
                &mut |at, b| {
                    let at = at + done;
                    let n = b.len().min(len.saturating_sub(at));
                    body[at..at + n].copy_from_slice(&b[..n]);
                },
                &mut || self.stop(peer, &deadline, pending, &what),
            )?;
            p.done = len.next_multiple_of(8);
            st.partial = Some(p);
            if self.take_left_ref(peer, link, &mut st, kind, (op, seq), expect, sink)? {
                return Ok(());
            }
            // Another kind's, or whole in the ring: to the inbox, then look again.
            if let Some(p) = st.partial.take() {
                self.complete(peer, link, &st.rx, p)?;
            }
            drop(st);
            return self.shm_recv(peer, link, kind, (op, seq), expect, sink);
        }
        let rx = &st.rx;
        loop {
            let m = self.shm_header(peer, rx, &deadline, &what)?;
            let pending = || rx.available() > 0;
            let mut got = rx.consumed();
            let mut stop = || {
                deadline.restart_on_progress(&mut got, rx.consumed());
                self.stop(peer, &deadline, pending, &what)
            };
            if m.kind == kind as u8 {
                if coll {
                    self.check_coll(peer, op, seq, expect, (m.op, m.seq, m.len))?;
                } else if m.len != expect {
                    return Err(self.p2p_size(peer, m.len, expect));
                }
                return self.take_payload(peer, link, rx, m, sink, &mut stop);
            }
            self.to_inbox(peer, link, rx, m, &mut stop)?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{kind_of, Kind, BY_REF};

    /// A message sent by reference is still of its kind where the ring's look-ahead reads it
    /// (the eager path takes a collective it finds first; any other kind is left for later).
    #[test]
    fn by_reference_messages_keep_their_kind() {
        for k in [Kind::Coll, Kind::P2p] {
            assert_eq!(kind_of(k as u8 | BY_REF), k as u8);
            assert_eq!(kind_of(k as u8), k as u8);
        }
    }
}
