//! A step that sends to one peer while it receives from another (a ring step, a sendrecv):
//! between peers of this host both streams advance together, a piece at a time, so neither
//! waits for the other to finish and nothing is buffered on the way.

use super::by_ref::Lent;
use super::local::{Hdr, Mirror, Sink, SHM_HEADER};
use super::watch::Watch;
use super::*;

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
        let mut st = inc.rx.lock().unwrap_or_else(|p| p.into_inner());
        let queued = if kind == Kind::Coll { self.mailbox.has_coll(from) } else { self.mailbox.has_p2p(from) };
        // What `from` sent by reference, left by a drain at its address (a wait for this
        // rank's previous send's copy met it): copied now, before this rank's own message,
        // which the loop below then writes alone.
        let taken = !queued && self.take_left_ref(from, inc, &mut st, kind, (op, seq), expect, sink)?;
        if st.partial.is_some() || queued {
            // Part of what `from` sent was moved to the inbox already: one after the other.
            drop(st);
            mirror_all(&mut mirror);
            self.send_data(to, kind, op, seq, data)?;
            return self.recv_kind(kind, (op, seq), from, expect, sink);
        }
        let tx = out.tx.lock().unwrap_or_else(|p| p.into_inner());
        let (h, by_ref) = self.header_for(&tx, out, (kind, op, seq), data, true)?;
        let mut lent = by_ref.as_ref().map(|b| Lent::new(&tx, b, data.len()));
        if by_ref.is_some() {
            mirror_all(&mut mirror);
        }
        let parts = [&h[..], by_ref.as_ref().map_or(bytes, |b| &b[..])];
        let mut w = shm::Writing::new(&parts);
        // Payload bytes copied to the mirror so far.
        let mut mirrored = 0;
        let mut hdr = [0u8; SHM_HEADER];
        let (mut hdone, mut body, mut bdone) = (0usize, None::<Hdr>, 0usize);
        if taken {
            body = Some(Hdr { kind: kind as u8, op, by_ref: true, seq, len: 0 });
        }
        let what =
            || if kind == Kind::Coll { what(kind, op, seq) } else { format!("sendrecv with ranks {to} and {from}") };
        let deadline = Watch::new(self.op_timeout);
        {
            let rx = &st.rx;
            loop {
                let mut progressed = !w.done() && tx.write_some(&mut w);
                if let Some((m, copy)) = mirror.as_mut() {
                    let upto = w.written().saturating_sub(SHM_HEADER).min(bytes.len());
                    if upto > mirrored {
                        copy(&mut m[mirrored..upto], &bytes[mirrored..upto]);
                        mirrored = upto;
                    }
                }
                let received = match body {
                    None => {
                        let d = rx.take_some(hdone, SHM_HEADER, &mut |at, b| hdr[at..at + b.len()].copy_from_slice(b));
                        progressed |= d != hdone;
                        hdone = d;
                        if hdone == SHM_HEADER {
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
                // The header read above is told to the writer before any wait.
                rx.publish();
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
        st.rx.publish();
        drop(st);
        lent.as_mut().map_or(Ok(()), |l| self.wait_ack(to, l, &what))
    }
}
