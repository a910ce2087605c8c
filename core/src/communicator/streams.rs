//! Ordering with an engine's own streams, operations in stream order only, and capture
//! into an engine's CUDA or ACL graph: the calls for GPU engines, which share their
//! buffers (`Arc`) where no `Work` keeps them borrowed.

use super::Communicator;
use crate::buffer::StreamRef;
use crate::collective::GraphOp;
use crate::dtype::ReduceOp;
use crate::error::Result;
use crate::platform::DeviceMemory;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// An operation captured into an engine's CUDA or ACL graph
/// ([`Communicator::capture_all_reduce`]) or issued in stream order only
/// ([`Communicator::enqueue_all_reduce`]): it holds the operation's buffers, which the
/// device reads and writes after the call (at every replay of a graph). Keep it as long
/// as the graph may be replayed, or until the engine's stream has passed the operation.
#[derive(Debug)]
pub struct Captured {
    recv: Arc<dyn DeviceMemory>,
    send: Option<Arc<dyn DeviceMemory>>,
    op: &'static str,
    group: Arc<str>,
    /// Counted while it exists when a graph holds it: the group refuses to sleep.
    _graph: Option<super::sleep::GraphHeld>,
}

impl Captured {
    /// What it is: the operation, its size and its group.
    pub fn describe(&self) -> String {
        format!("{} of {} x {} on '{}'", self.op, self.recv.count(), self.recv.dtype(), self.group)
    }
    /// The buffers it keeps allocated (output first).
    pub fn buffers(&self) -> impl Iterator<Item = &Arc<dyn DeviceMemory>> {
        std::iter::once(&self.recv).chain(self.send.as_ref())
    }
}

impl Communicator {
    /// Order this communicator after an engine's stream: operations issued after this call
    /// start only once the device has done the work enqueued on `stream` so far (the
    /// engine's kernels that produce their inputs). The host does not wait.
    ///
    /// Buffers: an operation's `Work` keeps its buffers borrowed as always; with
    /// [`Communicator::signal_stream`] the engine's stream waits for the result on the
    /// device, and the `Work` can be dropped once that stream has passed the point (dropping
    /// it earlier waits on the host, which is safe but gives up the overlap).
    ///
    /// # Errors
    /// `InvalidArgument` for a stream on another device; `Unsupported` where the backend
    /// has no streams (`Capabilities::streams`); `Aborted` on a dead communicator.
    ///
    /// # Examples
    /// ```no_run
    /// # fn step(comm: &anyccl_core::Communicator, engine: anyccl_core::StreamRef,
    /// #         grads: anyccl_core::BufMut<'_>) -> anyccl_core::Result<()> {
    /// comm.wait_stream(engine)?; // after the backward kernels that wrote `grads`
    /// let work = comm.all_reduce(None, grads, anyccl_core::ReduceOp::Sum)?;
    /// comm.signal_stream(engine)?; // the optimizer's kernels run after the all_reduce
    /// // ... enqueue more of the engine's work, then synchronize its stream ...
    /// drop(work); // done on the device by now: no host wait
    /// # Ok(()) }
    /// ```
    pub fn wait_stream(&self, stream: StreamRef<'_>) -> Result<()> {
        self.check_stream("wait_stream", stream)?;
        self.inner.wait_stream(stream)
    }

    /// Order an engine's stream after this communicator: work enqueued on `stream` after
    /// this call starts only once every operation issued here so far has finished on the
    /// device. The host does not wait. See [`Communicator::wait_stream`] for buffers.
    ///
    /// # Errors
    /// As [`Communicator::wait_stream`].
    pub fn signal_stream(&self, stream: StreamRef<'_>) -> Result<()> {
        self.check_stream("signal_stream", stream)?;
        self.inner.signal_stream(stream)
    }

    /// Capture an all_reduce into the CUDA (or ACL) graph being recorded on `stream` (the
    /// engine began capturing it, e.g. for a decode step): the all_reduce becomes part of
    /// the graph and runs at every replay, in the graph's order; nothing runs now.
    ///
    /// The contract differs from issued operations: there is no `Work` (a captured operation
    /// never completes as such; the engine synchronizes its stream after a replay), and
    /// the buffers are shared (`Arc`): the returned [`Captured`] keeps them allocated and
    /// must live as long as the graph may be replayed. Between this call and the end of the
    /// capture, issue nothing else on this communicator: its stream is part of the capture.
    ///
    /// # Errors
    /// `InvalidArgument` for mismatched buffers, a stream on another device, or a stream
    /// that is not capturing; `Unsupported` where the backend has no graphs
    /// (`Capabilities::graphs`); `Backend` when the library refuses.
    pub fn capture_all_reduce(
        &self,
        stream: StreamRef<'_>,
        send: Option<&Arc<dyn DeviceMemory>>,
        recv: &Arc<dyn DeviceMemory>,
        op: ReduceOp,
    ) -> Result<Captured> {
        const OP: &str = "capture_all_reduce";
        self.check_stream(OP, stream)?;
        if !self.capabilities().graphs {
            return Err(self.info().ctx().unsupported(OP, "graph capture"));
        }
        let g = self.shared_all_reduce(OP, send, recv, op)?;
        self.inner.capture(stream, g)?;
        let mut c = self.captured("all_reduce", send, recv);
        c._graph = Some(super::sleep::GraphHeld::new(&self.sleeps.graphs));
        Ok(c)
    }

    /// An all_reduce in stream order only, for engines that order their streams with
    /// [`Communicator::wait_stream`] and [`Communicator::signal_stream`] and never wait for
    /// single operations: it runs now on the communicator's stream, with no `Work` and no
    /// completion marker (nor a flight-recorder entry, which could never be closed), so it
    /// costs the host what the library's own call costs. The
    /// buffers are shared; the returned [`Captured`] keeps them allocated and is dropped
    /// once the engine's stream, signalled after the operation, has passed it.
    ///
    /// # Errors
    /// As [`Communicator::capture_all_reduce`], with `Capabilities::streams`.
    pub fn enqueue_all_reduce(
        &self,
        send: Option<&Arc<dyn DeviceMemory>>,
        recv: &Arc<dyn DeviceMemory>,
        op: ReduceOp,
    ) -> Result<Captured> {
        const OP: &str = "enqueue_all_reduce";
        if !self.capabilities().streams {
            return Err(self.info().ctx().unsupported(OP, "stream order only"));
        }
        let g = self.shared_all_reduce(OP, send, recv, op)?;
        self.seq.fetch_add(1, Ordering::Relaxed);
        self.inner.enqueue(g)?;
        Ok(self.captured("all_reduce", send, recv))
    }

    fn captured(
        &self,
        op: &'static str,
        send: Option<&Arc<dyn DeviceMemory>>,
        recv: &Arc<dyn DeviceMemory>,
    ) -> Captured {
        Captured { recv: recv.clone(), send: send.cloned(), op, group: self.who.name.clone(), _graph: None }
    }

    /// Validate an all_reduce on shared buffers and describe it by address.
    fn shared_all_reduce(
        &self,
        op_name: &'static str,
        send: Option<&Arc<dyn DeviceMemory>>,
        recv: &Arc<dyn DeviceMemory>,
        op: ReduceOp,
    ) -> Result<GraphOp> {
        let r = recv.view();
        let s = send.map(|b| b.view());
        if let Some(s) = &s {
            if s.count() != r.count() || s.dtype() != r.dtype() {
                return Err(self.invalid(
                    op_name,
                    "send",
                    format!("{} x {} against recv's {} x {}", s.count(), s.dtype(), r.count(), r.dtype()),
                ));
            }
        }
        self.check_reduce_op(op_name, op)?;
        self.check_dtype(op_name, "recv", r.dtype())?;
        self.check_device(op_name, "recv", r.device())?;
        if let Some(s) = &s {
            self.check_device(op_name, "send", s.device())?;
        }
        let g = GraphOp::AllReduce {
            send: s.as_ref().map_or(r.ptr(), |s| s.ptr()),
            recv: r.ptr() as *mut u8,
            count: r.count(),
            dtype: r.dtype(),
            op,
        };
        Ok(g)
    }

    fn check_stream(&self, op: &'static str, stream: StreamRef<'_>) -> Result<()> {
        let mine = self.info().device;
        if stream.device() != mine {
            return Err(self.invalid(
                op,
                "stream",
                format!("the stream is on {}, this communicator on {mine}", stream.device()),
            ));
        }
        if !self.capabilities().streams {
            return Err(self.info().ctx().unsupported(op, "ordering with an engine's streams"));
        }
        Ok(())
    }
}
