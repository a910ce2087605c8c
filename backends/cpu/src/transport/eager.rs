//! A collective's exchange with one peer of this host, a send to one and a receive from one
//! (the same or another), or a direct collective's messages to and from every other rank, or
//! sends alone, tried as it is issued: messages are sent only if the rings have room for all
//! of them now, and the peers' are taken only once they have arrived, within a short spin;
//! otherwise the receives are left for later (a peer may be waiting for something this rank
//! does after the issue).

use super::local::{kind_of, Sink, SHM_HEADER};
use super::watch::Watch;
use super::*;

/// A message to receive: its length, and where its bytes go (`sink(offset, bytes)`).
pub(crate) type Take<'s> = (usize, &'s mut dyn FnMut(usize, &[u8]));

/// Messages to receive from every other rank: each one's length, and where its bytes go
/// (`sink(peer, offset, bytes)`).
pub(crate) type TakeEach<'s> = (usize, &'s mut dyn FnMut(usize, usize, &[u8]));

/// The look of an operation tried as it is issued for its peers' messages: `round` looks
/// before the clock is read and the CPU given away between looks (`ANYCCL_CPU_ROUND`: 64 where
/// each rank has a CPU of its own, a few hundred nanoseconds, by which a peer in step has
/// arrived; 4 where the host's ranks outnumber its CPUs: there the peer is often waiting for
/// this very CPU, and 64 looks, about a microsecond here, kept it out each time: 3 ranks on 2
/// cores, a ring's sendrecv of 8-256 B 1.9-2.2 -> 1.2-1.5 us), until `spin` has passed.
struct Look {
    round: u32,
    spin: Duration,
    looks: u32,
    since: Option<Instant>,
}

impl Look {
    fn new(round: u32, spin: Duration) -> Look {
        Look { round, spin, looks: 0, since: None }
    }

    /// After a look that found nothing: spin, or give the CPU away, and say whether to look
    /// again (`false`: the look's time is over).
    fn again(&mut self) -> bool {
        self.looks += 1;
        if self.looks < self.round {
            std::hint::spin_loop();
            return true;
        }
        if self.since.get_or_insert_with(Instant::now).elapsed() >= self.spin {
            return false;
        }
        std::thread::yield_now();
        true
    }
}

/// How far [`Mesh::exchange_now`] (or [`Mesh::exchange_all_now`], [`Mesh::send_all_now`]) got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Eager {
    /// Nothing was sent: the operation goes the usual way, from the start.
    NotStarted,
    /// The message, if any, was sent; the peer's has not arrived: receive it later
    /// ([`Mesh::recv_coll_with`], a point-to-point one [`Mesh::recv_p2p_into`]).
    Later,
    /// Sent and received (whichever the step has).
    Done,
}

impl Mesh {
    /// Whether `peer` is a peer of this host (linked by shared memory).
    pub(crate) fn is_local(&self, peer: usize) -> bool {
        self.shm.get(peer).is_some_and(Option::is_some)
    }

    /// Whether `peer`'s next message of `kind` to this rank has begun to arrive (a receive of
    /// it then does not wait for the peer).
    pub(crate) fn arrived(&self, peer: usize, kind: Kind) -> bool {
        let Some(link) = self.shm.get(peer).and_then(Option::as_ref) else { return false };
        if self.queued(peer, kind) {
            return true;
        }
        let st = link.rx.lock().unwrap_or_else(|p| p.into_inner());
        st.partial.is_none() && st.rx.peek_first().map(kind_of) == Some(kind as u8)
    }

    /// Whether a message of `kind` from `peer` waits in the inbox.
    fn queued(&self, peer: usize, kind: Kind) -> bool {
        match kind {
            Kind::Coll => self.mailbox.has_coll(peer),
            Kind::P2p => self.mailbox.has_p2p(peer),
            Kind::Bye | Kind::Fail => false,
        }
    }

    /// Send `data` (if any) to `peer`, a peer of this host, as collective message `op` number
    /// `seq`, then receive its message of that number, `expect` bytes into `sink` (if one is
    /// expected), if it arrives within `spin` (`None`: not now; earlier receives wait
    /// already); without ever waiting for room or for a message that has not arrived.
    ///
    /// # Errors
    /// The peer's failure, a mismatched message, this communicator's failure.
    pub(crate) fn exchange_now(
        &self,
        (op, seq): (u8, u64),
        peer: usize,
        data: Option<&[u8]>,
        recv: Option<Take<'_>>,
        spin: Option<Duration>,
    ) -> Result<Eager> {
        self.message_now((Kind::Coll, op, seq), (peer, data), (peer, recv), spin)
    }

    /// [`Mesh::exchange_now`] for a point-to-point send of `data` (if any) to `to` and
    /// receive of the next point-to-point message from `from` (if `recv`), which must be of
    /// exactly the expected length; `to` and `from` are peers of this host, the same or not
    /// (a ring's step sends to one neighbour and receives from the other).
    ///
    /// # Errors
    /// As [`Mesh::exchange_now`]; a message of another length.
    pub(crate) fn sendrecv_now(
        &self,
        (to, data): (usize, Option<&[u8]>),
        (from, recv): (usize, Option<Take<'_>>),
        spin: Option<Duration>,
    ) -> Result<Eager> {
        self.message_now((Kind::P2p, 0, 0), (to, data), (from, recv), spin)
    }

    fn message_now(
        &self,
        (kind, op, seq): (Kind, u8, u64),
        (to, data): (usize, Option<&[u8]>),
        (from, recv): (usize, Option<Take<'_>>),
        spin: Option<Duration>,
    ) -> Result<Eager> {
        // (Called as a job runs: not on a communicator that failed already.)
        let (Some(out), Some(link)) = (&self.shm[to], &self.shm[from]) else { return Ok(Eager::NotStarted) };
        // Where this receives, held throughout: only the thread that runs this
        // communicator's operations reads its rings (and moves what it finds there to the
        // inbox). Then the ring to `to`, as the usual exchange takes them. A send alone (a
        // broadcast's root) takes no lock of a ring it does not read: two locked instructions
        // fewer, one of them the release that waited for the written line to reach the reader.
        let st = recv.as_ref().map(|_| link.rx.lock().unwrap_or_else(|p| p.into_inner()));
        if let Some(st) = &st {
            if spin.is_some() && (st.partial.is_some() || self.queued(from, kind)) {
                // What the peer sent is on its way through the inbox: the usual way takes it.
                return Ok(Eager::NotStarted);
            }
        }
        // A message of one line: the writer's lock is given back as the call returns, not
        // right after the write. Its release is a locked instruction, which would wait for
        // the written line to reach the peer polling it before the look for the peer's
        // message could start (the write itself publishes with no fence: `shm::wait`). 2
        // ranks, 8-32 B all_reduce, 7 alternating rounds: 0.37-0.38 -> 0.35-0.36 us; held for
        // longer messages too, 64 B-2 KiB took 2-6% longer, so those release it at once.
        let mut _sent = None;
        if let Some(data) = data {
            let tx = out.tx.lock().unwrap_or_else(|p| p.into_inner());
            let (h, by_ref) = self.header_for(&tx, out, (kind, op, seq), Data::Bytes(data), false)?;
            if by_ref.is_some() || !tx.try_write_whole(&[&h, data]) {
                return Ok(Eager::NotStarted);
            }
            if shm::in_one_line(h.len() + data.len()) {
                _sent = Some(tx);
            }
        }
        let (Some((expect, sink)), Some(st)) = (recv, st) else { return Ok(Eager::Done) };
        let Some(spin) = spin else { return Ok(Eager::Later) };
        // Looked at until the peer's next message is there: one of this kind is taken;
        // one of another kind first, or the spin's end, leaves it for later. The clock is
        // read only once the first looks found nothing, and after those each look gives the
        // CPU away first: the peer may be waiting for this very CPU (threads of one process,
        // or more ranks than cores), and a spin that keeps it would keep the peer out for
        // the whole look (in a test on 2 cores, a 1 ms look missed this way 15% of the time).
        let mut look = Look::new(st.rx.round(), spin);
        loop {
            // (A message sent by reference is of its kind too: the bit is left out.)
            match st.rx.peek_first().map(kind_of) {
                Some(k) if k == kind as u8 => {
                    self.take_msg(from, link, &st.rx, (kind, op, seq), expect, sink)?;
                    return Ok(Eager::Done);
                }
                Some(_) => return Ok(Eager::Later),
                None => {}
            }
            if !look.again() {
                return Ok(Eager::Later);
            }
        }
    }

    /// Whether every other rank's next collective message to this rank has begun to arrive
    /// (all of them peers of this host).
    pub(crate) fn arrived_all(&self) -> bool {
        (0..self.size).all(|p| p == self.rank || self.arrived(p, Kind::Coll))
    }

    /// Send each other rank of this world (each a peer of this host) its collective message
    /// `op` number `seq`, `data(peer)`, then, once every one's message of that number has
    /// arrived within `spin` (`None`: not now), take them in rank order, `expect` bytes each,
    /// into `sink(peer, offset, bytes)`; as the direct algorithms send and receive them. It
    /// never waits for room or for a message: nothing is sent unless every ring has room for
    /// its message now, and nothing is taken unless every message has arrived (a receive
    /// left for later is then the usual one from every peer).
    ///
    /// # Errors
    /// A peer's failure, a mismatched message, this communicator's failure.
    pub(crate) fn exchange_all_now<'d>(
        &self,
        (op, seq): (u8, u64),
        data: &dyn Fn(usize) -> &'d [u8],
        (expect, sink): TakeEach<'_>,
        spin: Option<Duration>,
    ) -> Result<Eager> {
        let me = self.rank;
        let peers = || (0..self.size).filter(move |&p| p != me);
        if !peers().all(|p| self.is_local(p)) {
            return Ok(Eager::NotStarted);
        }
        let link = |p: usize| {
            self.shm[p].as_ref().ok_or_else(|| self.ctx.aborted(format!("rank {p} is no peer of this host")))
        };
        // Nothing of theirs on its way through the inbox (the usual way takes it).
        if spin.is_some() {
            for p in peers() {
                let st = link(p)?.rx.lock().unwrap_or_else(|e| e.into_inner());
                if st.partial.is_some() || self.queued(p, Kind::Coll) {
                    return Ok(Eager::NotStarted);
                }
            }
        }
        // A send that had to wait for room may have moved what the peers sent to the inbox:
        // the receives are then left for later, which take them from there.
        let Some(waited) = self.send_each_now((op, seq), peers(), data)? else { return Ok(Eager::NotStarted) };
        let Some(spin) = spin.filter(|_| !waited) else { return Ok(Eager::Later) };
        // Looked at as `message_now` looks for one message, until every peer's is there.
        let round = match peers().next() {
            Some(p) => link(p)?.rx.lock().unwrap_or_else(|e| e.into_inner()).rx.round(),
            None => 1,
        };
        let mut look = Look::new(round, spin);
        // The peers whose messages were seen arrived (they stay so: only this thread reads).
        let mut seen = 0;
        loop {
            for p in peers().skip(seen) {
                let st = link(p)?.rx.lock().unwrap_or_else(|e| e.into_inner());
                match st.rx.peek_first().map(kind_of) {
                    Some(k) if k == Kind::Coll as u8 => seen += 1,
                    Some(_) => return Ok(Eager::Later),
                    None => break,
                }
            }
            if seen == self.size - 1 {
                for p in peers() {
                    let l = link(p)?;
                    let st = l.rx.lock().unwrap_or_else(|e| e.into_inner());
                    self.take_msg(p, l, &st.rx, (Kind::Coll, op, seq), expect, &mut |at, b| sink(p, at, b))?;
                }
                return Ok(Eager::Done);
            }
            if !look.again() {
                return Ok(Eager::Later);
            }
        }
    }

    /// Send `data` to each of `to` (peers of this host) as collective message `op` number
    /// `seq`, where every one's ring has room for it now: `Done` (should a message not go
    /// whole after all, it is sent the usual way, waiting for room); otherwise nothing is
    /// sent: `NotStarted`.
    ///
    /// # Errors
    /// This communicator's failure.
    pub(crate) fn send_all_now(&self, op: (u8, u64), to: &[usize], data: &[u8]) -> Result<Eager> {
        let sent = self.send_each_now(op, to.iter().copied(), &|_| data)?;
        Ok(if sent.is_some() { Eager::Done } else { Eager::NotStarted })
    }

    /// Send each of `to` (peers of this host) its collective message `op` number `seq`,
    /// `data(peer)`, where every one's ring has room for it now (each gets its message or
    /// none does): whether a message had to wait for room after all (room only grows while
    /// this thread runs the operations, so only a message written by another thread makes it
    /// wait; it then goes the usual way); `None`: nothing was sent.
    ///
    /// # Errors
    /// This communicator's failure.
    fn send_each_now<'d>(
        &self,
        (op, seq): (u8, u64),
        to: impl Iterator<Item = usize> + Clone,
        data: &dyn Fn(usize) -> &'d [u8],
    ) -> Result<Option<bool>> {
        for p in to.clone() {
            let Some(l) = self.shm.get(p).and_then(Option::as_ref) else { return Ok(None) };
            let tx = l.tx.lock().unwrap_or_else(|e| e.into_inner());
            let len = data(p).len();
            if self.by_ref(&tx, (Kind::Coll, op), len, false) || !tx.fits_whole(SHM_HEADER + len) {
                return Ok(None);
            }
        }
        let mut waited = false;
        for p in to {
            let l =
                self.shm[p].as_ref().ok_or_else(|| self.ctx.aborted(format!("rank {p} is no peer of this host")))?;
            let tx = l.tx.lock().unwrap_or_else(|e| e.into_inner());
            let (h, _) = self.header_for(&tx, l, (Kind::Coll, op, seq), Data::Bytes(data(p)), false)?;
            if !tx.try_write_whole(&[&h, data(p)]) {
                drop(tx);
                self.shm_send(p, l, Kind::Coll, op, seq, Data::Bytes(data(p)))?;
                waited = true;
            }
        }
        Ok(Some(waited))
    }

    /// Consume the message of `kind` that starts at `rx`'s position (it has begun to
    /// arrive): its header checked against collective `op` number `seq` of `expect` bytes
    /// (a point-to-point message: its length), its payload to `sink`; the reader's position
    /// told to the writer once.
    fn take_msg(
        &self,
        peer: usize,
        link: &super::local::ShmLink,
        rx: &shm::Rx,
        (kind, op, seq): (Kind, u8, u64),
        expect: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        // The deadline starts at the first wait (usually none: the message is whole).
        let deadline = std::cell::OnceCell::new();
        let what = || what(kind, op, seq);
        let mut stop = || {
            rx.publish();
            self.stop(peer, deadline.get_or_init(|| Watch::new(self.op_timeout)), || rx.available() > 0, &what)
        };
        let mut hdr = [0u8; SHM_HEADER];
        let mut to_hdr = |at: usize, b: &[u8]| hdr[at..at + b.len()].copy_from_slice(b);
        let got = rx.take_some(0, SHM_HEADER, &mut to_hdr);
        if got < SHM_HEADER {
            rx.read_from(got, SHM_HEADER, &mut to_hdr, &mut stop)?;
        }
        let m = self.parse_header(peer, &hdr)?;
        match kind {
            Kind::Coll => self.check_coll(peer, op, seq, expect, (m.op, m.seq, m.len))?,
            Kind::P2p if m.len != expect => return Err(self.p2p_size(peer, m.len, expect)),
            Kind::P2p => {}
            // (Never asked for: only collective and point-to-point messages are taken here.)
            Kind::Bye | Kind::Fail => {
                return Err(self.peer_err(peer, format!("rank {peer}: a control message taken as data")))
            }
        }
        if m.by_ref {
            self.take_payload(peer, link, rx, m, &mut Sink::With(sink), &mut stop)?;
        } else {
            let got = rx.take_some(0, m.len, sink);
            if got < m.len.next_multiple_of(8) {
                rx.read_from(got, m.len, sink, &mut stop)?;
            }
        }
        rx.publish();
        Ok(())
    }
}
