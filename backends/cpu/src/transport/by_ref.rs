//! When a message to a peer of this host goes by reference: the receiver copies it once,
//! out of the sender's memory (`process_vm_readv`), and the sender waits for that copy, or
//! withdraws the message when its operation fails first (`Lent`).

use super::local::REF_BODY;
use anyccl_core::Result;

/// The default of [`ByRef::alone`] for point-to-point messages: a message sent alone
/// goes through the ring a piece at a time, copied in by the sender and out by the
/// receiver at once, faster there than the kernel's single copy between processes (9-12
/// GB/s on the 2-core machines measured, and it pins every page) up to 16 MiB; a large
/// send alone gained 10-25% from 16 MiB up.
pub(crate) const BY_REF_MIN: usize = 16 << 20;

/// The default of [`ByRef::exchange`]: in a collective's exchange (a ring step) both ranks
/// copy at once, and by reference each copies once instead of twice. 2 ranks, busbw medians
/// of 3 alternating runs, rings -> by reference: all_reduce 1 and 4 MiB (messages of half
/// that) 4.4 and 4.9 -> 7.7 and 9.5 GB/s, all_to_all 1 and 4 MiB 3.2 and 2.0 -> 7.1 and
/// 7.0, all_gather 512 KiB and 4 MiB 1.6 and 6.1 -> 7.9 and 7.1 (1 MiB 8.1 -> 7.8); the
/// rings' runs swing between about 1.5 and 10 GB/s from run to run here, by reference's
/// less. From 16 MiB, where memory bounds both, by reference lost 30% at 4 ranks on 2 cores
/// (all_reduce 32 MiB 2.10 -> 1.45, 256 MiB 1.43 -> 1.01; all_gather 256 MiB 1.89 -> 1.30),
/// so there larger messages go as they would alone; where the host's ranks do not outnumber
/// the CPUs a rank may run on, the range has no end ([`crowded_end`]).
pub(crate) const BY_REF_EXCHANGE: std::ops::Range<usize> = (256 << 10)..BY_REF_MIN;

/// The end of [`ByRef::exchange`] by default: [`BY_REF_EXCHANGE`]'s on a host whose ranks
/// outnumber the CPUs a rank may run on (`crowded`: its affinity and CPU quota, as
/// `available_parallelism` says), none otherwise. 2 ranks on 2 cores, 32-256 MiB, busbw
/// medians of 4 alternating runs, rings -> by reference: all_to_all 3.68/2.82/3.08/3.09 ->
/// 5.0/3.5/3.23/3.28 GB/s, all_gather 3.41/2.77/2.80/2.65 -> 4.8/2.96/2.73/2.94,
/// reduce_scatter 2.30/2.37/2.24/2.30 -> 3.29/3.01/2.85/2.71 (an Intel host with a shared
/// 260 MiB L3; on the AMD hosts the two were within 10% of each other at 2 ranks).
pub(crate) fn crowded_end(crowded: bool) -> usize {
    if crowded {
        BY_REF_EXCHANGE.end
    } else {
        usize::MAX
    }
}

/// The default of [`ByRef::p2p_exchange`]: a sendrecv's message (sent while one is
/// received) from this size goes by reference. 2 ranks, busbw medians of 4 alternating runs,
/// rings -> by reference: 64 KiB 5.1 -> 6.5 GB/s, 256 KiB 4.1 -> 8.8, 1 MiB 5.9 -> 8.2, 2
/// MiB 6.2 -> 21.1, 8 MiB 4.6 -> 7.3. Its send then waits for the receiver's copy, as a
/// large send does in NCCL; a receiver waiting on another rank meanwhile copies it to its
/// inbox once that wait has lasted [`super::watch::DRAIN_AFTER`], so ranks that exchange in
/// a cycle never wait on each other for good. A send whose operation fails before that copy
/// withdraws the message (`Lent`): the receiver fails rather than deliver a buffer that the
/// sender may have reused.
pub(crate) const BY_REF_P2P_EXCHANGE: usize = 64 << 10;

/// Message sizes from which messages to peers of this host go by reference (the receiver
/// copies them out of the sender's memory): `ANYCCL_CPU_BY_REF_MIN` sets them all (any
/// message from that size), `off` none.
#[derive(Debug, Clone)]
pub(crate) struct ByRef {
    /// Sizes of a collective's message that go by reference when sent while one from a
    /// peer is received (a ring step); others go as they would alone.
    pub exchange: std::ops::Range<usize>,
    /// From this size a sendrecv's message goes by reference (sent while one is received).
    pub p2p_exchange: usize,
    /// From these sizes a message sent alone goes by reference: point-to-point, collective
    /// (a broadcast's or a reduce's: never by default, the ring's two copies at once being
    /// faster than the kernel's one).
    pub alone: (usize, usize),
}

/// [`ByRef`] from the environment, for a host whose ranks outnumber a rank's CPUs or not
/// (`crowded`).
pub(crate) fn by_ref_sizes(rank: usize, label: &str, crowded: bool) -> Result<ByRef> {
    match std::env::var("ANYCCL_CPU_BY_REF_MIN") {
        Ok(v) if v.trim() == "off" => {
            Ok(ByRef { exchange: 0..0, p2p_exchange: usize::MAX, alone: (usize::MAX, usize::MAX) })
        }
        Ok(_) => {
            let v = crate::algo::env_bytes("ANYCCL_CPU_BY_REF_MIN", BY_REF_MIN, rank, label)?.max(REF_BODY + 1);
            // Every message from `v`, sent alone or not: `alone` says so for both kinds.
            Ok(ByRef { exchange: 0..0, p2p_exchange: usize::MAX, alone: (v, v) })
        }
        Err(_) => {
            let exchange = BY_REF_EXCHANGE.start..crowded_end(crowded);
            Ok(ByRef { exchange, p2p_exchange: BY_REF_P2P_EXCHANGE, alone: (BY_REF_MIN, usize::MAX) })
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
    /// Set once the receiver acknowledged its copy.
    pub acked: bool,
}

impl<'a> Lent<'a> {
    pub(super) fn new(tx: &'a crate::shm::Tx, body: &[u8; REF_BODY]) -> Self {
        Lent { tx, n: u64::from_le_bytes(body[8..].try_into().unwrap_or_default()), acked: false }
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        if !self.acked {
            self.tx.withdraw(self.n);
        }
    }
}
