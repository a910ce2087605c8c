//! Full-mesh TCP between the ranks of one communicator.
//!
//! Each peer connection has a reader thread that drains incoming messages into a
//! [`Mailbox`], so a sender never waits for the receiver to post a matching receive and no
//! ordering of sends can deadlock (on one host, a message sent by reference waits for its
//! receiver's copy, which a receiver waiting on another peer makes to its inbox: see
//! `local`). Messages carry a kind (collective or point-to-point), an
//! op code and a collective sequence number, so a rank that issued a different collective
//! than its peers gets an error naming both instead of silently mixing data.
//!
//! Every blocking step has the communicator's operation timeout as its deadline: a wait for
//! a peer's data that sees nothing for that long, and a write that a peer accepts nothing of
//! for that long (a stopped or stuck process stops reading; its socket buffers fill), end
//! with `Timeout` naming the peer. A rank whose communicator fails tells every peer why
//! before it closes its connections, so the error on every rank names the peer at fault.

pub(crate) use crate::settings::Links;
use crate::shm;
use anyccl_core::{Ctx, Error, Result, Store};
use local::ShmLink;
pub(crate) use local::{Copier, Sink};
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod by_ref;
mod eager;
mod exchange;
mod local;
mod mailbox;
mod setup;
mod watch;

pub(crate) use eager::Eager;
use mailbox::{CollMsg, Inbox};
pub(crate) use mailbox::{Dead, Mailbox, Missed};

const MAGIC: u64 = 0x616e_7963_636c_4350; // "anycclCP"
/// Bytes of a message's header on a socket: kind, operation, 6 unused, number, length (a
/// ring's is shorter: `local::SHM_HEADER`).
const HEADER: usize = 24;

/// Message kinds on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    Coll = 0,
    P2p = 1,
    Bye = 2,
    /// The sender's communicator failed; the body says why.
    Fail = 3,
}

/// What a send carries.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Data<'a> {
    /// Bytes this rank holds.
    Bytes(&'a [u8]),
    /// A range of this process's memory that the sending thread may not dereference: a
    /// caller's buffer, lent to the operation while its `Work` lives. A peer of this host
    /// copies it out (through the kernel) when the message goes by reference; otherwise it
    /// is first copied here the same way. Either copy fails cleanly, and never touches
    /// other memory, if the range is no longer mapped.
    At { addr: usize, len: usize },
}

impl Data<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Data::Bytes(b) => b.len(),
            Data::At { len, .. } => *len,
        }
    }
}

/// How long a failing rank tries to tell each peer why, before closing.
const FAIL_NOTICE: Duration = Duration::from_millis(200);

/// Op codes carried by collective messages (the algorithms name them as `algo::OP_*`).
pub(crate) const OP_ALL_REDUCE: u8 = 1;
pub(crate) const OP_REDUCE: u8 = 2;
pub(crate) const OP_BROADCAST: u8 = 3;
pub(crate) const OP_ALL_GATHER: u8 = 4;
pub(crate) const OP_REDUCE_SCATTER: u8 = 5;
pub(crate) const OP_ALL_TO_ALL: u8 = 6;
pub(crate) const OP_BARRIER: u8 = 7;
/// all_gather's direct algorithm (every part to every rank): a code of its own, so ranks
/// whose `ANYCCL_CPU_ALLGATHER_DIRECT_MAX` differ fail on a mismatch rather than take the
/// ring's messages, of the same size, for parts.
pub(crate) const OP_ALL_GATHER_DIRECT: u8 = 8;
/// reduce_scatter's direct algorithm (every share to its rank, folded in rank order): a code
/// of its own, as [`OP_ALL_GATHER_DIRECT`]'s.
pub(crate) const OP_REDUCE_SCATTER_DIRECT: u8 = 9;

/// The name of a collective message's op code.
pub(crate) fn op_name(code: u8) -> &'static str {
    match code {
        OP_ALL_REDUCE => "all_reduce",
        OP_REDUCE => "reduce",
        OP_BROADCAST => "broadcast",
        OP_ALL_GATHER => "all_gather",
        OP_REDUCE_SCATTER => "reduce_scatter",
        OP_ALL_TO_ALL => "all_to_all",
        OP_BARRIER => "barrier",
        OP_ALL_GATHER_DIRECT => "all_gather (direct: ANYCCL_CPU_ALLGATHER_DIRECT_MAX)",
        OP_REDUCE_SCATTER_DIRECT => "reduce_scatter (direct: ANYCCL_CPU_ALLREDUCE_DIRECT_MAX)",
        _ => "unknown",
    }
}

/// The connections of one rank to every other rank.
pub(crate) struct Mesh {
    /// Who this mesh's errors happen to: the backend, this rank and the group.
    pub ctx: Ctx,
    pub rank: usize,
    pub size: usize,
    pub label: String,
    /// How this mesh chose its links (a split reuses it).
    pub links: Links,
    /// The deadline of every blocking step (see the module doc).
    pub op_timeout: Duration,
    /// The size up to which the algorithms keep whole buffers in cache (`crate::cache`): the
    /// smallest of every rank's host, so all ranks choose the same algorithm.
    pub step: usize,
    /// Whether the ranks of any host of the group outnumber their CPUs, from what every rank
    /// published ([`crate::cache::any_host_crowded`]): the same on every rank.
    pub crowded_anywhere: bool,
    writers: Vec<Option<Mutex<TcpStream>>>,
    /// Clones of every socket, to shut them down while a writer is blocked.
    ctl: Vec<Option<TcpStream>>,
    /// Shared-memory links to the peers of this host (their TCP connections stay, for
    /// failure notices and to learn that the peer's process exited).
    shm: Vec<Option<ShmLink>>,
    /// Messages to peers of this host of at least these sizes go by reference: the receiver
    /// copies them out of the sender's memory (`ANYCCL_CPU_BY_REF_MIN`).
    by_ref_sizes: by_ref::ByRef,
    /// Where a message read by reference lands on its way to a reduction.
    scratch: Mutex<Vec<u8>>,
    /// Buffers of messages that went through the inbox from peers of this host, kept for
    /// the next ones.
    bufs: crate::bufs::Pool,
    pub mailbox: Arc<Mailbox>,
    readers: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mesh(rank {} of {}, '{}')", self.rank, self.size, self.label)
    }
}

impl Mesh {
    fn peer_err(&self, peer: usize, detail: String) -> Error {
        self.ctx.peer_failed(Some(peer), detail)
    }

    pub(crate) fn dead_err(&self, d: Dead) -> Error {
        if d.aborted {
            self.ctx.aborted(d.detail)
        } else {
            self.ctx.peer_failed(d.peer, d.detail)
        }
    }

    /// Send one message to `peer` (to itself: straight into the mailbox).
    pub(crate) fn send(&self, peer: usize, kind: Kind, op: u8, seq: u64, data: &[u8]) -> Result<()> {
        if let Some(d) = self.mailbox.dead() {
            return Err(self.dead_err(d));
        }
        if peer == self.rank {
            match kind {
                Kind::P2p => self.mailbox.push_p2p(peer, data.to_vec()),
                Kind::Coll => self.mailbox.push_coll(peer, CollMsg { op, seq, data: data.to_vec() }),
                Kind::Bye | Kind::Fail => {}
            }
            return Ok(());
        }
        if let Some(link) = &self.shm[peer] {
            return self.shm_send(peer, link, kind, op, seq, Data::Bytes(data));
        }
        let mut h = [0u8; HEADER];
        h[0] = kind as u8;
        h[1] = op;
        h[8..16].copy_from_slice(&seq.to_le_bytes());
        h[16..24].copy_from_slice(&(data.len() as u64).to_le_bytes());
        let Some(w) = &self.writers[peer] else {
            return Err(self.peer_err(peer, "no connection".into()));
        };
        let mut s = w.lock().unwrap_or_else(|p| p.into_inner());
        let r = s.write_all(&h).and_then(|_| s.write_all(data));
        drop(s);
        r.map_err(|e| match self.mailbox.dead() {
            Some(d) => self.dead_err(d),
            // The socket's send timeout: the peer took no data for a whole operation timeout.
            None if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                let detail = format!(
                    "rank {peer} accepted no data for {:?}: it stopped reading (a stopped or stuck process)",
                    self.op_timeout
                );
                self.ctx.timeout(what(kind, op, seq), self.op_timeout, detail).with_source(e)
            }
            None => self.peer_err(peer, format!("send failed: {e}")).with_source(e),
        })
    }

    /// Wait for the next message from `peer` that `take` selects, for at most the operation
    /// timeout.
    fn wait_msg<T>(
        &self,
        peer: usize,
        what: impl Fn() -> String,
        mut take: impl FnMut(&mut Inbox) -> Option<T>,
    ) -> Result<T> {
        let t = self.op_timeout;
        let deadline = anyccl_core::deadline_in(t);
        let started = Instant::now();
        // With peers on this host, the wait looks up every few milliseconds and, once it has
        // lasted `DRAIN_AFTER`, copies what they sent by reference (they wait for that copy,
        // and one of them may be what this wait waits for, through others).
        let serves = self.shm.iter().any(Option::is_some);
        loop {
            let until = if serves { deadline.min(Instant::now() + Duration::from_millis(2)) } else { deadline };
            let missed = match self.mailbox.wait_for(peer, until, &mut take) {
                Ok(v) => return Ok(v),
                Err(Missed::TimedOut) if until < deadline => {
                    if started.elapsed() >= watch::DRAIN_AFTER {
                        self.serve()?;
                    }
                    continue;
                }
                Err(m) => m,
            };
            return Err(match missed {
                Missed::Dead(d) => self.dead_err(d),
                Missed::TimedOut => self.ctx.timeout(
                    what(),
                    t,
                    format!(
                        "nothing arrived from rank {peer} for {t:?}: it has not reached this operation (a stopped, \
                         stuck or slower rank, or one that issued other operations)"
                    ),
                ),
            });
        }
    }

    /// Check a collective message's identity against what this rank runs.
    fn check_coll(&self, peer: usize, op: u8, seq: u64, expect: usize, got: (u8, u64, usize)) -> Result<()> {
        let (m_op, m_seq, len) = got;
        if m_op != op || m_seq != seq {
            return Err(self.peer_err(
                peer,
                format!(
                    "collective mismatch: this rank runs {} #{seq}, rank {peer} sent {} #{m_seq}",
                    op_name(op),
                    op_name(m_op),
                ),
            ));
        }
        if len != expect {
            return Err(self.peer_err(
                peer,
                format!(
                    "{} #{seq}: rank {peer} sent {len} bytes, this rank expected {expect} (counts, or the ANYCCL_CPU_* \
                     algorithm settings, differ across ranks)",
                    op_name(op)
                ),
            ));
        }
        Ok(())
    }

    /// Receive the next collective message from `peer` over TCP (the callers take shared
    /// memory where the peer has it), which must be `op` number `seq` of `expect` bytes.
    fn recv_coll_tcp(&self, peer: usize, op: u8, seq: u64, expect: usize) -> Result<Vec<u8>> {
        let m = self.wait_msg(peer, || what(Kind::Coll, op, seq), Inbox::pop_coll)?;
        self.check_coll(peer, op, seq, expect, (m.op, m.seq, m.data.len()))?;
        Ok(m.data)
    }

    /// The next collective message from `peer` (`op` number `seq`, `expect` bytes), handed
    /// to `sink(offset, bytes)` in pieces as it arrives (straight from shared memory where
    /// the peer is on this host): every piece but the last is a multiple of 8 bytes.
    pub(crate) fn recv_coll_with(
        &self,
        peer: usize,
        op: u8,
        seq: u64,
        expect: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        match &self.shm[peer] {
            Some(link) => self.shm_recv(peer, link, Kind::Coll, (op, seq), expect, &mut Sink::With(sink)),
            None => {
                let d = self.recv_coll_tcp(peer, op, seq, expect)?;
                sink(0, &d);
                Ok(())
            }
        }
    }

    /// The next collective message from `peer` (`op` number `seq`), into `dst`, written by
    /// `copy` ([`Sink::Into`]: straight out of the sender's memory where the peer is on this
    /// host and the message large).
    pub(crate) fn recv_coll_into(&self, peer: usize, op: u8, seq: u64, dst: &mut [u8], copy: Copier) -> Result<()> {
        match &self.shm[peer] {
            Some(link) => self.shm_recv(peer, link, Kind::Coll, (op, seq), dst.len(), &mut Sink::Into(dst, copy)),
            None => {
                let d = self.recv_coll_tcp(peer, op, seq, dst.len())?;
                copy(dst, &d);
                Ok(())
            }
        }
    }

    /// Send `data` to `peer` ([`Mesh::send`]): a lent range goes by reference where `peer`
    /// may read it, and is copied here first otherwise.
    pub(crate) fn send_data(&self, peer: usize, kind: Kind, op: u8, seq: u64, data: Data<'_>) -> Result<()> {
        let mut own = Vec::new();
        match (self.resolve(peer, data, &mut own, false)?, &self.shm[peer]) {
            (Data::Bytes(b), _) => self.send(peer, kind, op, seq, b),
            (d, Some(link)) => self.shm_send(peer, link, kind, op, seq, d),
            (_, None) => Err(self.peer_err(peer, "no shared-memory link".into())),
        }
    }

    /// `data` as it goes to `peer`, sent in an exchange or alone: a lent range stays one
    /// only where `peer` copies it out by reference ([`Mesh::lends_to`]); otherwise it is
    /// first copied into `own`.
    fn resolve<'d>(&self, peer: usize, data: Data<'d>, own: &'d mut Vec<u8>, exchange: bool) -> Result<Data<'d>> {
        match data {
            Data::At { addr, len } if !self.lends_to(peer, len, exchange) => {
                own.resize(len, 0);
                self.read_own(addr, own)?;
                Ok(Data::Bytes(own))
            }
            d => Ok(d),
        }
    }

    /// Copy the bytes at `addr` of this process into `out` through the kernel: a lent range
    /// ([`Data::At`]).
    pub(crate) fn read_own(&self, addr: usize, out: &mut [u8]) -> Result<()> {
        shm::read_remote(std::process::id() as i32, addr, out).map_err(|e| {
            let msg = format!("a buffer lent to an operation is no longer readable (its Work was leaked?): {e}");
            self.ctx.invalid("enqueue", "buf", msg)
        })
    }

    /// The next point-to-point message from `peer` over TCP, of exactly `expect` bytes.
    fn recv_p2p_tcp(&self, peer: usize, expect: usize) -> Result<Vec<u8>> {
        let d = self.wait_msg(peer, || format!("recv from rank {peer}"), Inbox::pop_p2p)?;
        if d.len() != expect {
            return Err(self.p2p_size(peer, d.len(), expect));
        }
        Ok(d)
    }

    /// Receive the next point-to-point message from `peer`, of exactly `dst.len()` bytes,
    /// into `dst` (straight out of the sender's memory where the peer is on this host and
    /// the message large).
    pub(crate) fn recv_p2p_into(&self, peer: usize, dst: &mut [u8]) -> Result<()> {
        if let Some(link) = &self.shm[peer] {
            return self.shm_recv(peer, link, Kind::P2p, (0, 0), dst.len(), &mut Sink::Into(dst, crate::shm::copy));
        }
        let d = self.recv_p2p_tcp(peer, dst.len())?;
        crate::shm::copy(dst, &d);
        Ok(())
    }

    fn p2p_size(&self, peer: usize, got: usize, expect: usize) -> Error {
        self.peer_err(peer, format!("recv: rank {peer} sent {got} bytes, this rank posted {expect}"))
    }

    /// Mark the mesh dead and shut every socket, so local waits and every peer's reader
    /// see it at once. A failure (not an abort) is first told to every peer whose writer is
    /// free, briefly, so their errors say what failed here rather than only that this rank
    /// closed its connection.
    pub(crate) fn kill(&self, dead: Dead) {
        let notice = (!dead.aborted).then(|| format!("rank {} of '{}' failed: {}", self.rank, self.label, dead.detail));
        let culprit = dead.peer;
        self.mailbox.kill(dead);
        if let Some(text) = notice {
            for (peer, w) in self.writers.iter().enumerate() {
                let Some(Ok(mut s)) = w.as_ref().map(|w| w.try_lock()) else { continue };
                if Some(peer) == culprit {
                    continue;
                }
                let mut h = [0u8; HEADER];
                h[0] = Kind::Fail as u8;
                h[16..24].copy_from_slice(&(text.len() as u64).to_le_bytes());
                let _ = s.set_write_timeout(Some(FAIL_NOTICE));
                let _ = s.write_all(&h).and_then(|_| s.write_all(text.as_bytes()));
            }
        }
        for s in self.ctl.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Say goodbye to every peer and close.
    pub(crate) fn close(&self) {
        for (peer, w) in self.writers.iter().enumerate() {
            if let Some(w) = w {
                if let Ok(mut s) = w.try_lock() {
                    let mut h = [0u8; HEADER];
                    h[0] = Kind::Bye as u8;
                    let _ = s.write_all(&h);
                } else {
                    tracing::debug!("rank {} could not say goodbye to {peer}: writer busy", self.rank);
                }
            }
        }
        self.kill(Dead { aborted: true, peer: None, detail: "communicator shut down".into() });
    }

    pub(crate) fn join_readers(&self) {
        let hs: Vec<_> = self.readers.lock().map(|mut v| v.drain(..).collect()).unwrap_or_default();
        for h in hs {
            let _ = h.join();
        }
    }
}

/// An operation's name in errors: `all_reduce #3`, `send`.
fn what(kind: Kind, op: u8, seq: u64) -> String {
    match kind {
        Kind::Coll => format!("{} #{seq}", op_name(op)),
        _ => "send".into(),
    }
}

fn read_loop(mut s: TcpStream, peer: usize, mb: Arc<Mailbox>) {
    let why = loop {
        mb.wait_room(peer);
        let mut h = [0u8; HEADER];
        if let Err(e) = s.read_exact(&mut h) {
            break if e.kind() == std::io::ErrorKind::UnexpectedEof {
                format!("rank {peer} closed its connection (process exited or communicator failed)")
            } else {
                format!("connection to rank {peer} failed: {e}")
            };
        }
        let len = u64::from_le_bytes(h[16..24].try_into().unwrap_or_default()) as usize;
        let seq = u64::from_le_bytes(h[8..16].try_into().unwrap_or_default());
        let Some(mut data) = crate::bufs::try_zeroed(len) else {
            break format!("rank {peer} announced a {len}-byte message that cannot be allocated");
        };
        if let Err(e) = s.read_exact(&mut data) {
            break format!("connection to rank {peer} failed mid-message: {e}");
        }
        match h[0] {
            0 => mb.push_coll(peer, CollMsg { op: h[1], seq, data }),
            1 => mb.push_p2p(peer, data),
            2 => break format!("rank {peer} shut down its communicator"),
            3 => break String::from_utf8_lossy(&data).into_owned(),
            k => break format!("rank {peer} sent an unknown message kind {k}"),
        }
    };
    mb.close(peer, why);
}
