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

use crate::shm;
use anyccl_core::{Error, Result, Store};
use by_ref::by_ref_sizes;
pub(crate) use by_ref::{BY_REF_EXCHANGE, BY_REF_MIN, BY_REF_P2P_EXCHANGE};
use local::{shm_links, ShmLink};
pub(crate) use local::{Copier, Sink};
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod by_ref;
mod local;
mod mailbox;
mod watch;

use mailbox::{CollMsg, Inbox};
pub(crate) use mailbox::{Dead, Mailbox, Missed};

const MAGIC: u64 = 0x616e_7963_636c_4350; // "anycclCP"
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

/// Op codes carried by collective messages.
pub(crate) fn op_name(code: u8) -> &'static str {
    match code {
        1 => "all_reduce",
        2 => "reduce",
        3 => "broadcast",
        4 => "all_gather",
        5 => "reduce_scatter",
        6 => "all_to_all",
        7 => "barrier",
        _ => "unknown",
    }
}

/// The connections of one rank to every other rank.
pub(crate) struct Mesh {
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

/// Which transport links ranks (`ANYCCL_CPU_LINKS`, or [`crate::CpuLinks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Links {
    /// Shared memory between ranks of one host, TCP between hosts (the default).
    #[default]
    Auto,
    /// TCP between every pair.
    Tcp,
    /// As `Auto`, with rank `r` of each communicator pretending to live on host `r % K`: the
    /// mixed shared-memory and TCP path on one machine (`hosts:K`).
    Hosts(usize),
}

impl Links {
    /// Parse `auto`, `tcp` or `hosts:K`.
    pub fn parse(s: &str) -> Option<Links> {
        match s.trim() {
            "auto" | "" => Some(Links::Auto),
            "tcp" => Some(Links::Tcp),
            x => x.strip_prefix("hosts:")?.parse().ok().filter(|&k| k >= 1).map(Links::Hosts),
        }
    }

    fn from_env(rank: usize, label: &str) -> Result<Links> {
        match std::env::var("ANYCCL_CPU_LINKS") {
            Err(_) => Ok(Links::Auto),
            Ok(v) => Links::parse(&v).ok_or_else(|| Error::InvalidArgument {
                op: "connect",
                arg: "environment",
                rank,
                group: label.into(),
                msg: format!("ANYCCL_CPU_LINKS={v:?} is not auto, tcp or hosts:K (K at least 1)"),
            }),
        }
    }
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mesh(rank {} of {}, '{}')", self.rank, self.size, self.label)
    }
}

fn hello(ns: &str, rank: usize, size: usize) -> [u8; 24] {
    let mut b = [0u8; 24];
    b[..8].copy_from_slice(&MAGIC.to_le_bytes());
    b[8..16].copy_from_slice(&anyccl_core::stable_hash(ns.bytes()).to_le_bytes());
    b[16..20].copy_from_slice(&(rank as u32).to_le_bytes());
    b[20..24].copy_from_slice(&(size as u32).to_le_bytes());
    b
}

fn timeout(label: &str, rank: usize, what: &str, missing: &[usize], started: Instant) -> Error {
    Error::Timeout {
        op: "connect".into(),
        rank,
        group: label.to_string(),
        after: started.elapsed(),
        detail: format!("{what}: ranks {missing:?} never arrived"),
        source: None,
    }
}

impl Mesh {
    /// Build the mesh: publish this rank's listening address under `ns`, connect to lower
    /// ranks, accept higher ranks. Every rank of the communicator calls this.
    #[allow(clippy::too_many_arguments)] // the connect's identity, deadlines and links
    pub(crate) async fn connect(
        store: &dyn Store,
        ns: &str,
        label: &str,
        rank: usize,
        size: usize,
        deadline: Instant,
        op_timeout: Duration,
        links: Option<Links>,
    ) -> Result<Mesh> {
        let started = Instant::now();
        let inbox_limit = crate::algo::env_bytes("ANYCCL_CPU_MAX_INBOX_BYTES", 256 << 20, rank, label)?;
        let host = std::env::var("ANYCCL_CPU_HOST").unwrap_or_else(|_| "127.0.0.1".into());
        let listener = tokio::net::TcpListener::bind((host.as_str(), 0)).await.map_err(|e| Error::Unavailable {
            backend: "cpu",
            reason: format!("cannot listen on {host}: {e} (set ANYCCL_CPU_HOST)"),
        })?;
        let me = listener.local_addr().map_err(|e| Error::Unavailable { backend: "cpu", reason: e.to_string() })?;
        let links = match links {
            Some(l) => l,
            None => Links::from_env(rank, label)?,
        };
        let split = if let Links::Hosts(k) = links { Some(k) } else { None };
        let host_of_me = if links == Links::Tcp { "-".to_string() } else { shm::host_id(rank, split) };
        let l3 = crate::cache::L3::this_host();
        let (my_step, my_l3) = (crate::cache::L3::step(l3), crate::cache::L3::tag(l3));
        store.set(&format!("{ns}/addr/{rank}"), format!("{me} {host_of_me} {my_step} {my_l3}").as_bytes()).await?;
        // Every rank's address, host, whole-buffer step and L3, in one request.
        let keys: Vec<String> = (0..size).map(|r| format!("{ns}/addr/{r}")).collect();
        let got = store.wait_many(&keys, deadline).await?;
        let missing: Vec<usize> = got.iter().enumerate().filter(|(_, v)| v.is_none()).map(|(r, _)| r).collect();
        if !missing.is_empty() {
            return Err(timeout(label, rank, "waiting for addresses", &missing, started));
        }
        let mut addrs = Vec::with_capacity(size);
        let mut hosts = Vec::with_capacity(size);
        let mut steps = Vec::with_capacity(size);
        let mut l3s = Vec::with_capacity(size);
        for (r, v) in got.into_iter().enumerate() {
            let v = String::from_utf8_lossy(&v.unwrap_or_default()).into_owned();
            let mut it = v.split(' ');
            let malformed = || Error::store_fatal(format!("malformed address under '{}'", keys[r]));
            let a: SocketAddr = it.next().and_then(|a| a.parse().ok()).ok_or_else(malformed)?;
            let h = it.next().ok_or_else(malformed)?;
            let s: usize = it.next().and_then(|s| s.parse().ok()).ok_or_else(malformed)?;
            let l = it.next().ok_or_else(malformed)?;
            addrs.push(a);
            hosts.push(h.to_string());
            steps.push(s);
            l3s.push(l.to_string());
        }
        // The group's step: the smallest, and none from a host whose ranks run under several
        // L3s (ranks pinned to cores of different sockets each see their own L3 as shared).
        let one_l3 = crate::cache::one_l3(&hosts, &l3s);
        let step = steps.iter().zip(&one_l3).map(|(&s, &one)| if one { s } else { 0 }).min().unwrap_or(0);
        let ring_streaming = !one_l3[rank] || crate::cache::L3::ring_streaming(l3);
        let locals: Vec<usize> =
            if host_of_me == "-" { vec![rank] } else { (0..size).filter(|&r| hosts[r] == host_of_me).collect() };
        let crowded = locals.len() > std::thread::available_parallelism().map_or(1, |c| c.get());
        let shm = if locals.len() > 1 {
            shm_links(store, ns, label, rank, size, &locals, ring_streaming, deadline, started).await?
        } else {
            (0..size).map(|_| None).collect()
        };

        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        // Connect to every lower rank.
        // `peer` is a rank: it names errors, not only a slot of `streams`.
        #[allow(clippy::needless_range_loop)]
        for peer in 0..rank {
            let addr = addrs[peer];
            let mut s = loop {
                match tokio::time::timeout_at(deadline.into(), tokio::net::TcpStream::connect(addr)).await {
                    Err(_) => return Err(timeout(label, rank, "connecting", &[peer], started)),
                    Ok(Ok(s)) => break s,
                    Ok(Err(e)) if Instant::now() < deadline => {
                        tracing::debug!("connect to rank {peer} at {addr}: {e}; retrying");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Ok(Err(e)) => {
                        return Err(Error::PeerFailed {
                            rank,
                            group: label.into(),
                            peer: Some(peer),
                            detail: format!("cannot connect to {addr}: {e}"),
                            source: None,
                        })
                    }
                }
            };
            use tokio::io::AsyncWriteExt;
            s.write_all(&hello(ns, rank, size)).await.map_err(|e| Error::PeerFailed {
                rank,
                group: label.into(),
                peer: Some(peer),
                detail: format!("hello to {addr} failed: {e}"),
                source: None,
            })?;
            streams[peer] = Some(into_std(s, rank, label, op_timeout)?);
        }
        // Accept every higher rank.
        let ns_hash = anyccl_core::stable_hash(ns.bytes());
        let mut pending: Vec<usize> = (rank + 1..size).collect();
        while !pending.is_empty() {
            let (mut s, from) = match tokio::time::timeout_at(deadline.into(), listener.accept()).await {
                Err(_) => return Err(timeout(label, rank, "accepting connections", &pending, started)),
                Ok(Err(e)) => {
                    tracing::warn!("accept failed: {e}");
                    continue;
                }
                Ok(Ok(x)) => x,
            };
            use tokio::io::AsyncReadExt;
            let mut h = [0u8; 24];
            let got = tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut h)).await;
            if !matches!(got, Ok(Ok(_))) {
                tracing::warn!("connection from {from} sent no hello; dropped");
                continue;
            }
            let magic = u64::from_le_bytes(h[..8].try_into().unwrap_or_default());
            let nsh = u64::from_le_bytes(h[8..16].try_into().unwrap_or_default());
            let peer = u32::from_le_bytes(h[16..20].try_into().unwrap_or_default()) as usize;
            let psize = u32::from_le_bytes(h[20..24].try_into().unwrap_or_default()) as usize;
            if magic != MAGIC || nsh != ns_hash || psize != size || !pending.contains(&peer) {
                tracing::warn!("connection from {from} is not an expected peer of '{label}'; dropped");
                continue;
            }
            pending.retain(|&p| p != peer);
            streams[peer] = Some(into_std(s, rank, label, op_timeout)?);
        }

        let mailbox = Arc::new(Mailbox::new(size, inbox_limit));
        let mut writers = Vec::with_capacity(size);
        let mut ctl = Vec::with_capacity(size);
        let mut readers = Vec::new();
        for (peer, s) in streams.into_iter().enumerate() {
            match s {
                None => {
                    writers.push(None);
                    ctl.push(None);
                }
                Some(s) => {
                    let clone = || {
                        s.try_clone()
                            .map_err(|e| Error::Unavailable { backend: "cpu", reason: format!("socket clone: {e}") })
                    };
                    let r = clone()?;
                    ctl.push(Some(clone()?));
                    let mb = mailbox.clone();
                    let h = std::thread::Builder::new()
                        .name(format!("anyccl-cpu-rx{rank}<{peer}"))
                        .spawn(move || read_loop(r, peer, mb))
                        .map_err(|e| Error::Unavailable {
                            backend: "cpu",
                            reason: format!("cannot start reader thread: {e}"),
                        })?;
                    readers.push(h);
                    writers.push(Some(Mutex::new(s)));
                }
            }
        }
        Ok(Mesh {
            rank,
            size,
            label: label.into(),
            links,
            op_timeout,
            step,
            writers,
            ctl,
            shm,
            by_ref_sizes: by_ref_sizes(rank, label, crowded)?,
            scratch: Mutex::new(Vec::new()),
            bufs: crate::bufs::Pool::new(inbox_limit),
            mailbox,
            readers: Mutex::new(readers),
        })
    }

    fn peer_err(&self, peer: usize, detail: String) -> Error {
        Error::PeerFailed { rank: self.rank, group: self.label.clone(), peer: Some(peer), detail, source: None }
    }

    pub(crate) fn dead_err(&self, d: Dead) -> Error {
        if d.aborted {
            Error::Aborted { rank: self.rank, group: self.label.clone(), detail: d.detail }
        } else {
            Error::PeerFailed {
                rank: self.rank,
                group: self.label.clone(),
                peer: d.peer,
                detail: d.detail,
                source: None,
            }
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
        let mut h = [0u8; HEADER];
        h[0] = kind as u8;
        h[1] = op;
        h[8..16].copy_from_slice(&seq.to_le_bytes());
        h[16..24].copy_from_slice(&(data.len() as u64).to_le_bytes());
        if let Some(link) = &self.shm[peer] {
            return self.shm_send(peer, link, kind, op, seq, Data::Bytes(data));
        }
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
                Error::Timeout {
                    op: what(kind, op, seq),
                    rank: self.rank,
                    group: self.label.clone(),
                    after: self.op_timeout,
                    detail: format!(
                        "rank {peer} accepted no data for {:?}: it stopped reading (a stopped or stuck process)",
                        self.op_timeout
                    ),
                    source: None,
                }
            }
            None => self.peer_err(peer, format!("send failed: {e}")),
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
                Missed::TimedOut => Error::Timeout {
                    op: what(),
                    rank: self.rank,
                    group: self.label.clone(),
                    after: t,
                    detail: format!(
                        "nothing arrived from rank {peer} for {t:?}: it has not reached this operation (a stopped, \
                         stuck or slower rank, or one that issued other operations)"
                    ),
                    source: None,
                },
            });
        }
    }

    /// Check a collective message's identity against what this rank runs.
    fn check_coll(&self, peer: usize, op: u8, seq: u64, expect: usize, got: (u8, u64, usize)) -> Result<()> {
        let (m_op, m_seq, len) = got;
        if m_op != op || m_seq != seq {
            return Err(Error::PeerFailed {
                rank: self.rank,
                group: self.label.clone(),
                peer: Some(peer),
                detail: format!(
                    "collective mismatch: this rank runs {} #{seq}, rank {peer} sent {} #{m_seq}",
                    op_name(op),
                    op_name(m_op),
                ),
                source: None,
            });
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
        shm::read_remote(std::process::id() as i32, addr, out).map_err(|e| Error::InvalidArgument {
            op: "enqueue",
            arg: "buf",
            rank: self.rank,
            group: self.label.clone(),
            msg: format!("a buffer lent to an operation is no longer readable (its Work was leaked?): {e}"),
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

fn into_std(s: tokio::net::TcpStream, rank: usize, label: &str, op_timeout: Duration) -> Result<TcpStream> {
    let s = s.into_std().map_err(|e| Error::Unavailable { backend: "cpu", reason: format!("socket: {e}") })?;
    // A zero timeout means "none" to the socket layer: keep at least a millisecond.
    let send_timeout = op_timeout.max(Duration::from_millis(1));
    s.set_nonblocking(false)
        .and_then(|_| s.set_nodelay(true))
        .and_then(|_| s.set_write_timeout(Some(send_timeout)))
        .map_err(|e| Error::PeerFailed {
            rank,
            group: label.into(),
            peer: None,
            detail: format!("socket setup: {e}"),
            source: None,
        })?;
    Ok(s)
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
