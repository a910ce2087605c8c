//! The `Work` of an operation on a [`DeviceComm`]: its number, asked of the mark that follows
//! it (recorded at the call, or at the first look with shared completion), polled against the
//! communicator's async error and the caller's deadline; drained on drop.

use super::{backoff, DeviceComm, LaunchSlot};
use crate::library::{Library, Plane};
use crate::runtime::Runtime;
use anyccl_core::{Result, TrackedWork, WorkImpl};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) enum WorkState {
    /// The library has not finished putting the operation on the stream.
    Launching(Arc<LaunchSlot>),
    /// On the stream as operation number `op`; done when a mark that follows it is
    /// ([`DeviceComm::look`]).
    Placed(u64),
}

pub(super) struct DeviceWork<'a, L: Library> {
    pub(super) comm: &'a DeviceComm<L>,
    pub(super) state: WorkState,
}

impl<L: Library> DeviceWork<'_, L> {
    /// One look at the operation (`Ok(true)`: done). The device must be current.
    fn step(&mut self) -> Result<bool> {
        if let WorkState::Launching(slot) = &self.state {
            self.comm.resolve_pending("wait")?;
            let mut s = slot.lock().unwrap_or_else(|e| e.into_inner());
            match s.take() {
                None => return Ok(false),
                Some(Err(msg)) => {
                    // Kept, so every later look reports the same failure.
                    *s = Some(Err(msg.clone()));
                    return Err(self.comm.ctx.aborted(msg));
                }
                Some(Ok(op)) => {
                    drop(s);
                    self.state = WorkState::Placed(op);
                }
            }
        }
        match self.state {
            // Done, and the library's asynchronous error checked after it.
            WorkState::Placed(op) => self.comm.look(op),
            WorkState::Launching(_) => Ok(false),
        }
    }

    /// Settled without asking the device: a mark that follows it was seen done.
    fn settled(&self) -> bool {
        match self.state {
            WorkState::Placed(op) => self.comm.finished_upto.load(Ordering::Acquire) >= op,
            WorkState::Launching(_) => false,
        }
    }
}

impl<L: Library> DeviceWork<'_, L> {
    /// The stream passed the operation and the library reported no error since (counted in
    /// `finished_upto`, which settled it).
    fn finished(&self) -> Result<bool> {
        Ok(true)
    }
}

/// Operations on the stream are tracked by their number: their `Work` is that number and a
/// reference to the communicator ([`anyccl_core::Work::tracked`]), asked as a
/// `DeviceWork` that is placed.
impl<L: Library> TrackedWork for DeviceComm<L> {
    fn poll_op(&self, op: u64) -> Result<bool> {
        DeviceWork { comm: self, state: WorkState::Placed(op) }.poll()
    }
    fn wait_op(&self, op: u64, timeout: Duration) -> Result<bool> {
        DeviceWork { comm: self, state: WorkState::Placed(op) }.wait_for(timeout)
    }
    fn drain_op(&self, op: u64) {
        DeviceWork { comm: self, state: WorkState::Placed(op) }.drain()
    }
}

impl<L: Library> WorkImpl for DeviceWork<'_, L> {
    fn poll(&mut self) -> Result<bool> {
        if self.settled() {
            return self.finished();
        }
        self.comm.rt.bind()?;
        if self.step()? {
            return self.finished();
        }
        self.comm.poll_async(Plane::Data, "wait")?;
        Ok(false)
    }

    fn wait_for(&mut self, timeout: Duration) -> Result<bool> {
        if self.settled() {
            return self.finished();
        }
        self.comm.rt.bind()?;
        // One look before the clock is read: the operation is often done by now.
        if self.step()? {
            return self.finished();
        }
        let deadline = anyccl_core::deadline_in(timeout);
        let mut spins = 0u32;
        loop {
            // The back-off before each further look, the first included: the look just made
            // said not yet, and each asks the device (a `cuEventQuery` is over a microsecond).
            backoff(&mut spins);
            if self.step()? {
                return self.finished();
            }
            if spins % 256 == 255 {
                self.comm.poll_async(Plane::Data, "wait")?;
            }
            if Instant::now() >= deadline {
                self.comm.poll_async(Plane::Data, "wait")?;
                return Ok(false);
            }
        }
    }

    fn drain(&mut self) {
        // The device may still read or write the caller's buffers: wait for it. A hung
        // operation is aborted after the operation timeout so this never blocks forever.
        let c = self.comm;
        let started = Instant::now();
        if c.rt.bind().is_err() {
            return;
        }
        let mut spins = 0u32;
        loop {
            match self.step() {
                Ok(true) | Err(_) => return,
                Ok(false) => {}
            }
            if c.poll_async(Plane::Data, "drop").is_err() && started.elapsed() > Duration::from_secs(10) {
                tracing::error!("operation on '{}' still running 10 s after its communicator failed", c.ctx.group);
                return;
            }
            if started.elapsed() > c.settings.op_timeout && c.dead().is_none() {
                tracing::error!(
                    "dropped operation on '{}' did not finish in {:?}: aborting",
                    c.ctx.group,
                    c.settings.op_timeout
                );
                c.abort_now("a dropped operation did not finish within the operation timeout");
            }
            backoff(&mut spins);
        }
    }
}
