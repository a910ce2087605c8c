//! The path every operation takes once validated: detail mode's cross-member check, the
//! sequence number, the debug span, the flight recorder's entry and the recording of its
//! signature.

use super::{Call, Communicator};
use crate::collective::Collective;
use crate::error::Result;
use crate::recorder::{OpFields, OpState};
use crate::work::{Issued, Work};
use std::sync::atomic::Ordering;

impl Communicator {
    /// Add `call`'s signature to the recording, keeping one entry per (op, dtype, size
    /// class, peer) with the largest size seen.
    fn record(&self, call: &Call) {
        let Ok(mut rec) = self.recording.lock() else { return };
        let Some(map) = rec.as_mut() else { return };
        if call.batched && call.batch.is_empty() {
            // A batch issued as the recording started: its peers were not taken (a signature
            // of its whole bytes would be of no pair's size); the recording begins after it.
            return;
        }
        let one: [(Option<usize>, usize); 1] = [(call.peer, call.bytes)];
        let batch: Vec<(Option<usize>, usize)> = call.batch.iter().map(|&(p, b)| (Some(p), b)).collect();
        let entries: &[(Option<usize>, usize)] = if batch.is_empty() { &one } else { &batch };
        for &(peer, bytes) in entries {
            let class = if bytes == 0 { 0 } else { usize::BITS - 1 - bytes.leading_zeros() };
            let most = map.entry((call.op, call.dtype, class, peer)).or_default();
            *most = (*most).max(bytes);
        }
    }

    /// A flight-recorder dump (where `ANYCCL_TRACE_DIR` is set) for a call that failed
    /// before it became a `Work`: an enqueue that timed out or found the communicator
    /// failed leaves the same evidence as a wait that did (a refused argument leaves none).
    fn dump(&self, call: &Call, e: &crate::Error) {
        if !matches!(e, crate::Error::InvalidArgument { .. } | crate::Error::Unsupported { .. }) {
            crate::trace::dump_error(&format!("{} of group '{}' failed at enqueue: {e}", call.op, self.who.name));
        }
    }

    /// A call the backend refused or failed to enqueue: its entry says so, and `e` is
    /// given back.
    #[cold]
    #[inline(never)]
    fn not_enqueued(&self, call: &Call, ticket: crate::recorder::Ticket, e: crate::Error) -> crate::Error {
        self.who.recorder.finish(ticket, OpState::Failed(e.to_string()));
        tracing::debug!(error = %e, "enqueue failed");
        self.dump(call, &e);
        e
    }

    pub(super) fn issue<'a>(
        &'a self,
        call: Call,
        f: impl FnOnce(&'a dyn Collective) -> Result<Work<'a>>,
    ) -> Result<Work<'a>> {
        // Asleep: no cross-member check (the others are not issuing); the stand-in refuses.
        if let Some(d) = self.detail.as_ref().filter(|_| !call.is_point_to_point() && !self.sleeps.asleep) {
            d.check(call.op, &call.fingerprint(), self.config.op_timeout).inspect_err(|e| self.dump(&call, e))?;
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let rank = self.who.rank;
        // The fields are read only when the span is enabled.
        let span = tracing::debug_span!(
            "collective",
            backend = self.inner.info().backend,
            group = %self.who.name,
            rank,
            world_size = self.inner.info().size,
            op = call.op,
            seq,
            bytes = call.bytes
        );
        let _g = span.enter();
        // To the coarse clock's tick: the recorder stamps completions on it too, and this
        // runs on every operation (kept as the recorder keeps it: an `Instant` only if asked).
        let started_ns = self.who.recorder.now_coarse_ns();
        let ticket = self.who.recorder.push_pending(
            self.group_id,
            &OpFields {
                rank,
                seq,
                op: call.op,
                dtype: call.dtype,
                count: call.count,
                bytes: call.bytes,
                peer: call.peer,
                started_ns,
            },
        );
        match f(self.inner.as_ref()) {
            Ok(mut w) => {
                // Only what the backend accepted: a rejected call is nothing to warm.
                if self.recording_on.load(Ordering::Acquire) {
                    self.record(&call);
                }
                // The communicator is lent: its name's count is another line missed a call.
                w.attach(Issued { by: &self.who, op: call.op, seq, started_ns, ticket });
                tracing::trace!("enqueued");
                Ok(w)
            }
            Err(e) => Err(self.not_enqueued(&call, ticket, e)),
        }
    }
}
