//! Buffers registered with a communicator: the library may then move data to and from them
//! without its staging copies. The registration owns the memory it covers, so the memory
//! cannot be freed while registered, and it is deregistered before it is given back.

use super::Communicator;
use crate::collective::RegHandle;
use crate::error::Result;
use crate::platform::DeviceMemory;
use std::ops::{Deref, DerefMut};

/// Memory registered with a communicator ([`Communicator::register`]). It owns the memory
/// (`Box<dyn DeviceMemory>`, or an `Arc` for buffers that captured operations share):
/// operations use it through `Deref`/`DerefMut` to `dyn DeviceMemory` (`view`, `view_mut`),
/// whose borrows keep it registered while their `Work` lives. The owner itself is only lent
/// shared ([`Registered::memory`]): replacing it would free memory still registered.
/// Dropping it deregisters, then frees the memory; [`Registered::into_inner`] deregisters and
/// gives the memory back. Keep it at least as long as a `Captured` operation on the same
/// memory.
pub struct Registered<'c, M: Deref<Target = dyn DeviceMemory>> {
    comm: &'c Communicator,
    handle: Option<RegHandle>,
    mem: Option<M>,
}

impl<M: Deref<Target = dyn DeviceMemory>> std::fmt::Debug for Registered<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered").field("group", &self.comm.spec.name).field("handle", &self.handle).finish()
    }
}

impl<'c, M: Deref<Target = dyn DeviceMemory>> Registered<'c, M> {
    /// Whether the library registered it (`false` on a backend without
    /// `Capabilities::buffer_registration`, where registering does nothing).
    pub fn is_registered(&self) -> bool {
        self.handle.is_some()
    }

    /// The registered memory.
    pub fn memory(&self) -> &M {
        self.mem.as_ref().unwrap_or_else(|| unreachable!("taken only by into_inner and drop"))
    }

    /// Deregister, and give the memory back.
    ///
    /// # Errors
    /// The library's, when it refuses to deregister; the memory is then kept registered
    /// until the communicator is freed, and dropped with the error.
    pub fn into_inner(mut self) -> Result<M> {
        self.deregister()?;
        Ok(self.mem.take().unwrap_or_else(|| unreachable!("taken only by into_inner and drop")))
    }

    fn deregister(&mut self) -> Result<()> {
        match self.handle.take() {
            Some(h) => self.comm.inner.deregister(h),
            None => Ok(()),
        }
    }
}

impl<M: Deref<Target = dyn DeviceMemory>> Drop for Registered<'_, M> {
    fn drop(&mut self) {
        if let Err(e) = self.deregister() {
            // The library keeps the registration until the communicator goes; the memory
            // is still freed (no panic in drop).
            tracing::warn!("{e}");
        }
    }
}

impl Communicator {
    /// Register `mem` with this communicator, so the library may read and write it without
    /// its own staging copies (NCCL's user-buffer registration, HCCL's `HcclCommRegister`).
    /// Memory from [`crate::Platform::alloc_registrable`] is what the library registers best
    /// (NCCL: `ncclMemAlloc`). Registration is local to this rank: each rank registers its own
    /// buffers, in any order. On a backend without `Capabilities::buffer_registration` it
    /// succeeds and does nothing ([`Registered::is_registered`] says which).
    ///
    /// # Errors
    /// `InvalidArgument` (naming `mem`, the rank and the group) for memory on another device
    /// or of no bytes; `Aborted` on a dead communicator; `Backend` when the library refuses.
    pub fn register<M: Deref<Target = dyn DeviceMemory>>(&self, mem: M) -> Result<Registered<'_, M>> {
        const OP: &str = "register";
        let view = mem.view();
        self.check_device(OP, "mem", view.device())?;
        if view.bytes() == 0 {
            return Err(self.invalid(OP, "mem", "the buffer holds no bytes: nothing to register"));
        }
        let handle = self.inner.register(view)?;
        Ok(Registered { comm: self, handle, mem: Some(mem) })
    }
}

impl<M: Deref<Target = dyn DeviceMemory>> Deref for Registered<'_, M> {
    type Target = dyn DeviceMemory;
    fn deref(&self) -> &Self::Target {
        &**self.memory()
    }
}

impl<M: DerefMut<Target = dyn DeviceMemory>> DerefMut for Registered<'_, M> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut **self.mem.as_mut().unwrap_or_else(|| unreachable!("taken only by into_inner and drop"))
    }
}
