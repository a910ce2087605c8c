//! Typed helpers for host buffers: enqueue, wait with the configured timeout, and abort the
//! communicator when that timeout passes.

use super::Communicator;
use crate::buffer::{Buf, BufMut};
use crate::dtype::{Element, ReduceOp};
use crate::error::{Error, Result};
use crate::work::Work;

impl Communicator {
    fn finish(&self, mut w: Work<'_>) -> Result<()> {
        match w.wait(self.config.op_timeout) {
            Ok(()) => Ok(()),
            Err(e) => {
                if matches!(e, Error::Timeout { .. }) {
                    let _ = self.abort_blocking();
                }
                drop(w);
                Err(e)
            }
        }
    }

    /// All-reduce a host slice in place and wait.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`] and [`Work::wait`]; on a timeout the communicator
    /// is aborted.
    pub fn all_reduce_in_place<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        let w = self.all_reduce(None, BufMut::host(data), op)?;
        self.finish(w)
    }

    /// Broadcast a host slice from `root` in place and wait.
    ///
    /// # Errors
    /// As [`Communicator::broadcast`] and [`Work::wait`].
    pub fn broadcast_in_place<T: Element>(&self, data: &mut [T], root: usize) -> Result<()> {
        let w = self.broadcast(None, BufMut::host(data), root)?;
        self.finish(w)
    }

    /// All-gather host slices and wait.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`] and [`Work::wait`].
    pub fn all_gather_into<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let w = self.all_gather(Some(Buf::host(send)), BufMut::host(recv))?;
        self.finish(w)
    }

    /// Send a host slice and wait.
    ///
    /// # Errors
    /// As [`Communicator::send`] and [`Work::wait`].
    pub fn send_host<T: Element>(&self, data: &[T], peer: usize) -> Result<()> {
        let w = self.send(Buf::host(data), peer)?;
        self.finish(w)
    }

    /// Receive into a host slice and wait.
    ///
    /// # Errors
    /// As [`Communicator::recv`] and [`Work::wait`].
    pub fn recv_host<T: Element>(&self, data: &mut [T], peer: usize) -> Result<()> {
        let w = self.recv(BufMut::host(data), peer)?;
        self.finish(w)
    }

    /// Barrier and wait.
    ///
    /// # Errors
    /// As [`Communicator::barrier`] and [`Work::wait`].
    pub fn barrier_wait(&self) -> Result<()> {
        let w = self.barrier()?;
        self.finish(w)
    }
}
