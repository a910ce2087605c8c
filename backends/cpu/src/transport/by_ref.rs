//! When a message to a peer of this host goes by reference: the receiver copies it once,
//! out of the sender's memory (`process_vm_readv`), and the sender waits for that copy, or
//! withdraws the message when its operation fails first (`Lent`).

use super::local::REF_BODY;
use super::{Kind, Mesh};
use crate::settings::{
    by_ref_defaults, ByRefMin, BY_REF_ALONE_CROWDED, BY_REF_ALONE_OWN_CPU, BY_REF_EXCHANGE, BY_REF_MIN,
};
use crate::shm;
use anyccl_core::{Ctx, Result};

/// Message sizes from which messages to peers of this host go by reference (the receiver
/// copies them out of the sender's memory): `ANYCCL_CPU_BY_REF_MIN` sets them all (any
/// message from that size), `off` none. The defaults, and the measurements behind them, are
/// with the other settings ([`crate::settings::BY_REF_EXCHANGE`] and its neighbours).
#[derive(Debug, Clone)]
pub(crate) struct ByRef {
    /// Sizes of a collective's message that go by reference when sent while one from a
    /// peer is received (a ring step); others go as they would alone.
    pub exchange: std::ops::Range<usize>,
    /// The same for all_reduce's messages: from [`BY_REF_EXCHANGE`]'s start on any host
    /// (two ranks' all_reduce from 32 MiB exchanges 128 KiB pieces, one after the other: by
    /// reference each waits for the peer's copy, and 32-128 MiB took 14-20% longer).
    pub exchange_all_reduce: std::ops::Range<usize>,
    /// The same for all_to_all's: each of its steps is a sendrecv with another pair of
    /// ranks, so its messages go by reference from where a sendrecv's or a ring step's do,
    /// whichever is sooner, with no end. 4 ranks on 2 cores (a sendrecv's from 64 KiB, a ring
    /// step's from 256 KiB), 5 alternating runs, messages of 64 and 128 KiB (256 and 512 KiB
    /// in all): 45.4 and 112.6 -> 32.6 and 53.7 us (Open MPI 28.6 and 65.6); a ring's steps
    /// (all_gather, reduce_scatter) from 32 or 64 KiB gained nothing there.
    pub exchange_all_to_all: std::ops::Range<usize>,
    /// From this size a sendrecv's message goes by reference (sent while one is received).
    pub p2p_exchange: usize,
    /// From these sizes a message sent alone goes by reference: point-to-point, collective
    /// (a broadcast's or a reduce's: [`BY_REF_ALONE_OWN_CPU`] where a host's ranks do not
    /// outnumber its CPUs, [`BY_REF_ALONE_CROWDED`] where they do).
    pub alone: (usize, usize),
}

/// [`ByRef`] from the environment, for a host whose ranks outnumber a rank's CPUs or not
/// (`crowded`).
pub(crate) fn by_ref_sizes(ctx: &Ctx, crowded: bool) -> Result<ByRef> {
    match crate::settings::by_ref_min(ctx)? {
        ByRefMin::Off => Ok(ByRef {
            exchange: 0..0,
            exchange_all_reduce: 0..0,
            exchange_all_to_all: 0..0,
            p2p_exchange: usize::MAX,
            alone: (usize::MAX, usize::MAX),
        }),
        ByRefMin::From(v) => {
            let v = v.max(REF_BODY + 1);
            // Every message from `v`, sent alone or not: `alone` says so for both kinds.
            Ok(ByRef {
                exchange: 0..0,
                exchange_all_reduce: 0..0,
                exchange_all_to_all: 0..0,
                p2p_exchange: usize::MAX,
                alone: (v, v),
            })
        }
        ByRefMin::Defaults => {
            let (exchange, p2p_exchange) = by_ref_defaults(crowded);
            Ok(ByRef {
                exchange_all_reduce: BY_REF_EXCHANGE.start..exchange.end,
                exchange_all_to_all: exchange.start.min(p2p_exchange)..usize::MAX,
                exchange,
                p2p_exchange,
                alone: (BY_REF_MIN, if crowded { BY_REF_ALONE_CROWDED } else { BY_REF_ALONE_OWN_CPU }),
            })
        }
    }
}

/// A message sent by reference whose copy the receiver has not acknowledged yet: dropped
/// before it is (the operation failed, and the sender's buffer may change or go), it is
/// withdrawn, so that the receiver fails instead of delivering what it read.
pub(super) struct Lent<'a> {
    pub tx: &'a crate::shm::Tx,
    /// The message's number on its link.
    pub n: u64,
    /// Its bytes.
    pub len: usize,
    /// Set once the receiver acknowledged its copy.
    pub acked: bool,
}

impl<'a> Lent<'a> {
    pub(super) fn new(tx: &'a crate::shm::Tx, body: &[u8; REF_BODY], len: usize) -> Self {
        Lent { tx, n: u64::from_le_bytes(body[8..].try_into().unwrap_or_default()), len, acked: false }
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        if !self.acked {
            self.tx.withdraw(self.n);
        }
    }
}

impl Mesh {
    /// Whether a message of `kind` (a collective's: of operation `op`, `algo::OP_*`) and
    /// `len` bytes on `tx` goes by reference (the peer copies it out of this process's
    /// memory), sent in an exchange or alone.
    pub(super) fn by_ref(&self, tx: &shm::Tx, (kind, op): (Kind, u8), len: usize, exchange: bool) -> bool {
        let m = &self.by_ref_sizes;
        let (in_step, alone) = match kind {
            Kind::P2p => (len >= m.p2p_exchange, m.alone.0),
            _ if op == super::OP_ALL_REDUCE => (m.exchange_all_reduce.contains(&len), m.alone.1),
            _ if op == super::OP_ALL_TO_ALL => (m.exchange_all_to_all.contains(&len), m.alone.1),
            _ => (m.exchange.contains(&len), m.alone.1),
        };
        ((exchange && in_step) || len >= alone) && tx.by_ref_ok()
    }

    /// The size from which a sendrecv's message goes by reference on this host (`usize::MAX`:
    /// never in an exchange).
    pub(crate) fn p2p_by_ref_from(&self) -> usize {
        self.by_ref_sizes.p2p_exchange
    }

    /// How a message of `what` (as [`Mesh::by_ref`] takes it) and `len` bytes to `peer` travels, sent in an exchange or
    /// alone, in words: over TCP, by reference (the peer copies it out of this process's
    /// memory), or through the shared-memory ring (with streaming stores from the ring's
    /// threshold on).
    pub(crate) fn route(&self, peer: usize, what: (Kind, u8), len: usize, exchange: bool) -> &'static str {
        let Some(l) = self.shm.get(peer).and_then(Option::as_ref) else {
            return if peer == self.rank { "none" } else { "tcp" };
        };
        let tx = l.tx.lock().unwrap_or_else(|p| p.into_inner());
        if self.by_ref(&tx, what, len, exchange) {
            "shm by reference"
        } else if len >= tx.stream_min() {
            "shm ring, streaming stores"
        } else {
            "shm ring"
        }
    }

    /// Whether a point-to-point message of `len` bytes to `peer` goes by reference, sent in
    /// an exchange (a sendrecv) or alone.
    pub(super) fn lends_to(&self, peer: usize, len: usize, exchange: bool) -> bool {
        self.shm[peer].as_ref().is_some_and(|l| {
            self.by_ref(&l.tx.lock().unwrap_or_else(|p| p.into_inner()), (Kind::P2p, 0), len, exchange)
        })
    }
}
