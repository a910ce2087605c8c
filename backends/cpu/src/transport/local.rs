//! The links between ranks of one host: rings in shared memory (see [`crate::shm`]), the
//! drain that keeps senders from waiting on each other, steps that stream both directions
//! at once, and large messages copied once out of the sender's memory.

use super::by_ref::Lent;
use super::watch::Watch;
use super::*;

/// Both ends of the rings between this rank and one peer of its host.
pub(super) struct ShmLink {
    tx: Mutex<shm::Tx>,
    rx: Mutex<RxState>,
    /// The peer's process.
    pid: i32,
    /// Messages sent to it by reference so far.
    refs: AtomicU64,
}

/// The reading end of a link and the message a drain left half read.
struct RxState {
    rx: shm::Rx,
    partial: Option<Partial>,
}

/// A message read in part by a drain (which never waits mid-message: the peer may be
/// draining too, waiting for the rest of this rank's own message).
struct Partial {
    hdr: Hdr,
    /// The payload, or for a message sent by reference its address and number.
    body: Vec<u8>,
    /// Bytes consumed, padding included.
    done: usize,
}

/// A message header.
#[derive(Debug, Clone, Copy)]
struct Hdr {
    kind: u8,
    op: u8,
    /// The body is the payload's address in the sender and the message's number: the
    /// receiver copies the payload out of the sender's memory and acknowledges it.
    by_ref: bool,
    seq: u64,
    len: usize,
}

/// Bytes of a by-reference message's body.
pub(super) const REF_BODY: usize = 16;
// A by-reference message is written whole: its reader waits for the body after the header.
const _: () = assert!(HEADER + REF_BODY <= shm::WHOLE_MAX);

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

/// Data bytes of each ring for `locals` ranks on a host: 4 MiB up to 8 ranks, then less, so
/// a rank's segment stays near 32 MiB (at least 64 KiB a ring).
fn ring_bytes(locals: usize, rank: usize, label: &str) -> Result<usize> {
    let default = (32usize << 20).checked_div(locals.saturating_sub(1)).unwrap_or(4 << 20).clamp(64 << 10, 4 << 20);
    let v = crate::algo::env_bytes("ANYCCL_CPU_SHM_RING_BYTES", default, rank, label)?;
    if !(4096..=(1 << 30)).contains(&v) {
        return Err(Error::InvalidArgument {
            op: "connect",
            arg: "environment",
            rank,
            group: label.into(),
            msg: format!("ANYCCL_CPU_SHM_RING_BYTES={v} is outside 4096 ..= 1 GiB"),
        });
    }
    Ok(v.next_power_of_two().min(1 << 30))
}

/// Create this rank's segment, learn the segments of the other ranks of its host through
/// the store, and map them: a link to each. `ring_streaming`: whether large messages go into
/// the rings with streaming stores by default (not where the host's ranks run under one
/// large L3: [`crate::cache::L3::ring_streaming`]).
#[allow(clippy::too_many_arguments)] // the connect's identity and deadline
pub(super) async fn shm_links(
    store: &dyn Store,
    ns: &str,
    label: &str,
    rank: usize,
    size: usize,
    locals: &[usize],
    ring_streaming: bool,
    deadline: Instant,
    started: Instant,
) -> Result<Vec<Option<ShmLink>>> {
    let fail = |what: String| Error::Unavailable {
        backend: "cpu",
        reason: format!(
            "rank {rank} of '{label}': shared memory with the ranks {locals:?} of its host: {what} (set \
             ANYCCL_CPU_LINKS=tcp to use TCP between them)"
        ),
    };
    let layout = shm::Layout { locals: locals.len(), ring: ring_bytes(locals.len(), rank, label)? };
    let own = Arc::new(shm::Segment::create(layout.segment_bytes()).map_err(fail)?);
    let fd = own.fd().unwrap_or(-1);
    store
        .set(
            &format!("{ns}/seg/{rank}"),
            format!("{} {fd} {} {}", std::process::id(), layout.ring, own.addr()).as_bytes(),
        )
        .await?;
    let keys: Vec<String> = locals.iter().map(|r| format!("{ns}/seg/{r}")).collect();
    let got = store.wait_many(&keys, deadline).await?;
    let missing: Vec<usize> = locals.iter().zip(&got).filter(|(_, v)| v.is_none()).map(|(r, _)| *r).collect();
    if !missing.is_empty() {
        return Err(timeout(label, rank, "waiting for shared-memory segments", &missing, started));
    }
    let patience = shm::Patience::for_host(locals.len(), |name, default| {
        crate::algo::env_number(name, default, "a whole number", rank, label)
    })?;
    let stream_min = match std::env::var("ANYCCL_CPU_RING_STREAM_MIN") {
        Ok(v) if v.trim() == "off" => usize::MAX,
        Err(std::env::VarError::NotPresent) if !ring_streaming => usize::MAX,
        _ => crate::algo::env_bytes("ANYCCL_CPU_RING_STREAM_MIN", shm::RING_STREAM_MIN, rank, label)?,
    };
    let me_local = locals.iter().position(|&r| r == rank).unwrap_or(0);
    let mut links: Vec<Option<ShmLink>> = (0..size).map(|_| None).collect();
    for (i, (&peer, v)) in locals.iter().zip(got).enumerate() {
        if peer == rank {
            continue;
        }
        let v = String::from_utf8_lossy(&v.unwrap_or_default()).into_owned();
        let mut it = v.split(' ').map(|x| x.parse::<i64>().ok());
        let (Some(Some(pid)), Some(Some(fd)), Some(Some(ring)), Some(Some(addr))) =
            (it.next(), it.next(), it.next(), it.next())
        else {
            return Err(Error::store_fatal(format!("malformed segment under '{ns}/seg/{peer}'")));
        };
        if ring as usize != layout.ring {
            return Err(Error::InvalidArgument {
                op: "connect",
                arg: "environment",
                rank,
                group: label.into(),
                msg: format!(
                    "rank {peer} uses rings of {ring} bytes, this rank {} (ANYCCL_CPU_SHM_RING_BYTES differs)",
                    layout.ring
                ),
            });
        }
        let seg = shm::Segment::open(pid as u32, fd as i32, layout.segment_bytes())
            .map_err(|e| fail(format!("rank {peer}: {e}")))?;
        let (tx, rx) = shm::link(&own, &Arc::new(seg), layout, me_local, i, patience, stream_min);
        // May this process read the peer's memory? (Not where a security module forbids
        // it.) The peer reads the answer before its first large message to this rank.
        let mut probe = [0u8; 8];
        let readable = shm::read_remote(pid as i32, addr as usize, &mut probe);
        if let Err(e) = &readable {
            tracing::debug!("rank {rank} of '{label}': large messages from rank {peer} go through the ring: {e}");
        }
        rx.allow_by_ref(readable.is_ok());
        links[peer] = Some(ShmLink {
            tx: Mutex::new(tx),
            rx: Mutex::new(RxState { rx, partial: None }),
            pid: pid as i32,
            refs: AtomicU64::new(0),
        });
    }
    tracing::debug!(
        backend = "cpu",
        group = label,
        rank,
        locals = locals.len(),
        ring_bytes = layout.ring,
        segment_bytes = layout.segment_bytes(),
        host_bytes = layout.segment_bytes() * locals.len(),
        "shared memory connected: {} bytes in this rank's segment, {} on the host",
        layout.segment_bytes(),
        layout.segment_bytes() * locals.len()
    );
    Ok(links)
}

impl Mesh {
    /// Send `data` to `to` and receive an `expect`-byte message from `from` into `sink`, both
    /// collective message `op` number `seq`, at once: between peers of this host the two
    /// streams advance together, a piece at a time, so neither waits for the other to finish
    /// (and nothing is buffered on the way, whatever the size). `mirror` (of `data`'s length)
    /// gets a copy of `data`, made by its copier (plain or streaming stores): between peers
    /// of this host a piece at a time as it goes into the ring, while it is in cache, so
    /// `data` is read once for both. `Sink::Into` takes a message sent by reference straight
    /// out of the sender's memory.
    #[allow(clippy::too_many_arguments)] // the two halves of one step, and the copy
    pub(crate) fn exchange(
        &self,
        (op, seq): (u8, u64),
        to: usize,
        data: &[u8],
        mirror: Mirror<'_>,
        from: usize,
        expect: usize,
        sink: &mut Sink<'_>,
    ) -> Result<()> {
        self.exchange_kind(Kind::Coll, (op, seq), to, Data::Bytes(data), mirror, from, expect, sink)
    }

    /// Whether a message of `kind` and `len` bytes on `tx` goes by reference (the peer
    /// copies it out of this process's memory), sent in an exchange or alone.
    fn by_ref(&self, tx: &shm::Tx, kind: Kind, len: usize, exchange: bool) -> bool {
        let m = &self.by_ref_sizes;
        let (in_step, alone) = match kind {
            Kind::P2p => (len >= m.p2p_exchange, m.alone.0),
            _ => (m.exchange.contains(&len), m.alone.1),
        };
        ((exchange && in_step) || len >= alone) && tx.by_ref_ok()
    }

    /// Whether a point-to-point message of `len` bytes to `peer` goes by reference, sent in
    /// an exchange (a sendrecv) or alone.
    pub(super) fn lends_to(&self, peer: usize, len: usize, exchange: bool) -> bool {
        self.shm[peer]
            .as_ref()
            .is_some_and(|l| self.by_ref(&l.tx.lock().unwrap_or_else(|p| p.into_inner()), Kind::P2p, len, exchange))
    }

    /// A point-to-point send to `to` and receive from `from` (a batch of one of each), with
    /// both streams advancing together between peers of this host, as [`Mesh::exchange`].
    pub(crate) fn sendrecv(&self, to: usize, data: Data<'_>, from: usize, out: &mut [u8]) -> Result<()> {
        let n = out.len();
        self.exchange_kind(Kind::P2p, (0, 0), to, data, None, from, n, &mut Sink::Into(out, crate::shm::copy))
    }

    /// The receive half of [`Mesh::exchange_kind`] done alone, after the send.
    fn recv_kind(
        &self,
        kind: Kind,
        (op, seq): (u8, u64),
        from: usize,
        expect: usize,
        sink: &mut Sink<'_>,
    ) -> Result<()> {
        match (kind, sink) {
            (Kind::Coll, Sink::With(f)) => self.recv_coll_with(from, op, seq, expect, *f),
            (Kind::Coll, Sink::Into(dst, copy)) => {
                debug_assert_eq!(dst.len(), expect, "a destination of another length");
                self.recv_coll_into(from, op, seq, dst, *copy)
            }
            (_, sink) => match &self.shm[from] {
                Some(link) => self.shm_recv(from, link, Kind::P2p, (0, 0), expect, sink),
                None => {
                    let d = self.recv_p2p_tcp(from, expect)?;
                    match sink {
                        Sink::Into(dst, copy) => copy(dst, &d),
                        Sink::With(f) => f(0, &d),
                    }
                    Ok(())
                }
            },
        }
    }

    #[allow(clippy::too_many_arguments)] // the two halves of one step
    fn exchange_kind(
        &self,
        kind: Kind,
        (op, seq): (u8, u64),
        to: usize,
        data: Data<'_>,
        mirror: Mirror<'_>,
        from: usize,
        expect: usize,
        sink: &mut Sink<'_>,
    ) -> Result<()> {
        let mut own = Vec::new();
        let data = self.resolve(to, data, &mut own, true)?;
        let bytes = if let Data::Bytes(b) = data { b } else { &[] };
        // Where the message does not go through the ring a piece at a time, the copy is made
        // first, whole.
        let mut mirror = mirror;
        debug_assert!(mirror.as_ref().is_none_or(|m| m.0.len() == bytes.len()), "a mirror of another length");
        let mirror_all = |m: &mut Mirror<'_>| {
            if let Some((m, copy)) = m.take() {
                copy(m, bytes);
            }
        };
        let (Some(out), Some(inc)) = (&self.shm[to], &self.shm[from]) else {
            mirror_all(&mut mirror);
            self.send_data(to, kind, op, seq, data)?;
            return self.recv_kind(kind, (op, seq), from, expect, sink);
        };
        if let Some(d) = self.mailbox.dead() {
            return Err(self.dead_err(d));
        }
        let st = inc.rx.lock().unwrap_or_else(|p| p.into_inner());
        let queued = if kind == Kind::Coll { self.mailbox.has_coll(from) } else { self.mailbox.has_p2p(from) };
        if st.partial.is_some() || queued {
            // Part of what `from` sent was moved to the inbox already: one after the other.
            drop(st);
            mirror_all(&mut mirror);
            self.send_data(to, kind, op, seq, data)?;
            return self.recv_kind(kind, (op, seq), from, expect, sink);
        }
        let tx = out.tx.lock().unwrap_or_else(|p| p.into_inner());
        let (h, by_ref) = self.header_for(&tx, out, (kind, op, seq), data, true);
        let mut lent = by_ref.as_ref().map(|b| Lent::new(&tx, b));
        if by_ref.is_some() {
            mirror_all(&mut mirror);
        }
        let parts = [&h[..], by_ref.as_ref().map_or(bytes, |b| &b[..])];
        let mut w = shm::Writing::new(&parts);
        // Payload bytes copied to the mirror so far.
        let mut mirrored = 0;
        let mut hdr = [0u8; HEADER];
        let (mut hdone, mut body, mut bdone) = (0usize, None::<Hdr>, 0usize);
        let what =
            || if kind == Kind::Coll { what(kind, op, seq) } else { format!("sendrecv with ranks {to} and {from}") };
        let deadline = Watch::new(self.op_timeout);
        {
            let rx = &st.rx;
            loop {
                let mut progressed = !w.done() && tx.write_some(&mut w);
                if let Some((m, copy)) = mirror.as_mut() {
                    let upto = w.written().saturating_sub(HEADER).min(bytes.len());
                    if upto > mirrored {
                        copy(&mut m[mirrored..upto], &bytes[mirrored..upto]);
                        mirrored = upto;
                    }
                }
                let received = match body {
                    None => {
                        let d = rx.read_some(hdone, HEADER, &mut |at, b| hdr[at..at + b.len()].copy_from_slice(b));
                        progressed |= d != hdone;
                        hdone = d;
                        if hdone == HEADER {
                            hdone = 0;
                            let m = self.parse_header(from, &hdr)?;
                            let mut got = rx.consumed();
                            let mut stop = || {
                                deadline.restart_on_progress(&mut got, rx.consumed());
                                self.stop(from, &deadline, || rx.available() > 0, &what)
                            };
                            if m.kind != kind as u8 {
                                // A message of the other kind sent before this one: to the inbox.
                                self.to_inbox(from, inc, rx, m, &mut stop)?;
                            } else {
                                if kind == Kind::Coll {
                                    self.check_coll(from, op, seq, expect, (m.op, m.seq, m.len))?;
                                } else if m.len != expect {
                                    return Err(self.p2p_size(from, m.len, expect));
                                }
                                if m.by_ref {
                                    self.take_payload(from, inc, rx, m, sink, &mut stop)?;
                                    body = Some(Hdr { len: 0, ..m });
                                    progressed = true;
                                } else {
                                    body = Some(m);
                                }
                            }
                        }
                        false
                    }
                    Some(m) => {
                        let d = match sink {
                            Sink::Into(dst, copy) => {
                                rx.read_some(bdone, m.len, &mut |at, b| copy(&mut dst[at..at + b.len()], b))
                            }
                            Sink::With(f) => rx.read_some(bdone, m.len, *f),
                        };
                        progressed |= d != bdone;
                        bdone = d;
                        bdone >= m.len.next_multiple_of(8)
                    }
                };
                if w.done() && received {
                    break;
                }
                if progressed {
                    deadline.restart();
                    continue;
                }
                let sending = !w.done();
                let ready = || (sending && tx.has_room(&w)) || (!received && rx.available() > 0);
                // A point-to-point writer out of room says so (see `shm_send`).
                let stuck = kind == Kind::P2p && sending && !tx.has_room(&w);
                if stuck {
                    tx.stuck(true);
                }
                let waited = shm::wait_either(&tx, rx, ready, &mut || {
                    if sending {
                        self.stop(to, &deadline, || false, &what)?;
                    }
                    self.stop(from, &deadline, || rx.available() > 0, &what)?;
                    self.serve_if_long(&deadline)
                });
                if stuck {
                    tx.stuck(false);
                }
                waited?;
            }
        }
        drop(st);
        lent.as_mut().map_or(Ok(()), |l| self.wait_ack(to, l, &what))
    }

    /// The header of a message to a peer of this host, and the body that replaces the
    /// payload when it goes by reference (large, and the peer may read this process), sent
    /// in an exchange or alone.
    fn header_for(
        &self,
        tx: &shm::Tx,
        link: &ShmLink,
        (kind, op, seq): (Kind, u8, u64),
        data: Data<'_>,
        exchange: bool,
    ) -> ([u8; HEADER], Option<[u8; REF_BODY]>) {
        let mut h = [0u8; HEADER];
        h[0] = kind as u8;
        h[1] = op;
        h[8..16].copy_from_slice(&seq.to_le_bytes());
        h[16..24].copy_from_slice(&(data.len() as u64).to_le_bytes());
        let addr = match data {
            // Lent ranges are only sent where they go by reference (see `Mesh::resolve`).
            Data::At { addr, .. } => addr,
            Data::Bytes(b) if self.by_ref(tx, kind, b.len(), exchange) => b.as_ptr() as usize,
            Data::Bytes(_) => return (h, None),
        };
        h[2] = 1;
        let n = link.refs.fetch_add(1, Ordering::Relaxed) + 1;
        let mut b = [0u8; REF_BODY];
        b[..8].copy_from_slice(&(addr as u64).to_le_bytes());
        b[8..].copy_from_slice(&n.to_le_bytes());
        (h, Some(b))
    }

    /// Wait until `peer` has copied the message `lent` sent by reference (the sender's buffer
    /// must stay as it is until then), draining meanwhile; then mark it acknowledged.
    fn wait_ack(&self, peer: usize, lent: &mut Lent<'_>, what: &dyn Fn() -> String) -> Result<()> {
        let deadline = Watch::new(self.op_timeout);
        lent.tx.wait_ack(lent.n, &mut || {
            self.stop(peer, &deadline, || false, what)?;
            self.drain()
        })?;
        lent.acked = true;
        Ok(())
    }

    /// Read the payload of message `m` from `peer` into `sink`: from the ring, or, sent by
    /// reference, out of the peer's memory (then acknowledged).
    fn take_payload(
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
        let failed = |e: String| self.peer_err(peer, format!("reading rank {peer}'s message: {e}"));
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
            return Err(self.peer_err(
                peer,
                format!(
                    "rank {peer} withdrew the {len}-byte message it sent by reference while this rank copied it (its \
                     operation failed)"
                ),
            ));
        }
        rx.ack(n);
        Ok(())
    }

    /// Why a wait on `peer` must end now, if it must: the communicator died, the peer's
    /// process went away (its connection closed and `pending` says nothing it sent is left
    /// to read), or `deadline` passed.
    fn stop(&self, peer: usize, deadline: &Watch, pending: impl Fn() -> bool, what: &dyn Fn() -> String) -> Result<()> {
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
            return Err(Error::Timeout {
                op: what(),
                rank: self.rank,
                group: self.label.clone(),
                after: t,
                detail: format!(
                    "rank {peer} made no progress for {t:?} (over shared memory): it has not reached this operation \
                     (a stopped, stuck or slower rank, or one that issued other operations)"
                ),
                source: None,
            });
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
        let (h, by_ref) = self.header_for(&tx, link, (kind, op, seq), data, false);
        let mut lent = by_ref.as_ref().map(|b| Lent::new(&tx, b));
        let deadline = Watch::new(self.op_timeout);
        let mut taken = tx.consumed();
        let mut stalled = || -> Result<()> {
            deadline.restart_on_progress(&mut taken, tx.consumed());
            self.stop(peer, &deadline, || false, &what)?;
            self.drain()
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
    fn serve_if_long(&self, w: &Watch) -> Result<()> {
        if w.long() {
            self.serve()
        } else {
            Ok(())
        }
    }

    /// [`Mesh::drain`] of the rings whose writers wait for this rank to copy a message they
    /// sent by reference.
    pub(super) fn serve(&self) -> Result<()> {
        self.drain_where(|rx| rx.awaited())
    }

    /// Move what has arrived in this rank's rings to the inbox (as far as each peer's inbox
    /// bound allows), without waiting: a message that has arrived in part stays half read.
    fn drain(&self) -> Result<()> {
        self.drain_where(|_| true)
    }

    /// [`Mesh::drain`] of the rings that `pick` selects.
    fn drain_where(&self, pick: impl Fn(&shm::Rx) -> bool) -> Result<()> {
        for (q, link) in self.shm.iter().enumerate() {
            let Some(link) = link else { continue };
            let Ok(mut st) = link.rx.try_lock() else { continue };
            if !pick(&st.rx) {
                continue;
            }
            loop {
                if st.partial.is_none() {
                    if st.rx.available() < HEADER as u64 || self.mailbox.held(q) >= self.mailbox.inbox_limit {
                        break;
                    }
                    let mut h = [0u8; HEADER];
                    st.rx.read_some(0, HEADER, &mut |at, b| h[at..at + b.len()].copy_from_slice(b));
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
                if p.done < len.next_multiple_of(8) {
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
    fn to_inbox(
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

    fn parse_header(&self, peer: usize, h: &[u8; HEADER]) -> Result<Hdr> {
        let seq = u64::from_le_bytes(h[8..16].try_into().unwrap_or_default());
        let len = u64::from_le_bytes(h[16..24].try_into().unwrap_or_default()) as usize;
        if h[0] != Kind::Coll as u8 && h[0] != Kind::P2p as u8 {
            return Err(self.peer_err(peer, format!("rank {peer} wrote an unknown message kind {}", h[0])));
        }
        Ok(Hdr { kind: h[0], op: h[1], by_ref: h[2] == 1, seq, len })
    }

    /// Read the next message header from `peer`'s ring (waiting for it until `deadline`).
    fn shm_header(&self, peer: usize, rx: &shm::Rx, deadline: &Watch, what: &dyn Fn() -> String) -> Result<Hdr> {
        let pending = || rx.available() >= HEADER as u64;
        let mut h = [0u8; HEADER];
        rx.wait_for(HEADER, &mut || {
            self.stop(peer, deadline, pending, what)?;
            self.serve_if_long(deadline)
        })?;
        rx.read(HEADER, &mut |at, b| h[at..at + b.len()].copy_from_slice(b), &mut || {
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
            // A drain began the next message: finish it, then look again.
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
            self.complete(peer, link, rx, p)?;
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
