//! Device memory as every device runtime hands it out ([`DeviceBuffer`]): an address, its
//! element type and count, its device, and how the runtime frees it ([`Free`]); the views
//! a `Communicator` validates are made here, once, for every runtime.

use anyccl_core::{Buf, BufMut, DType, Device, DeviceMemory};
use std::ffi::c_void;
use std::fmt;

/// How a runtime gives an allocation back (`cuMemFree`, `ncclMemFree`, `aclrtFree`).
pub trait Free: Send + Sync + fmt::Debug + 'static {
    /// Free the `bytes` bytes at `ptr`, once, never panicking (a failure is logged).
    fn free(&mut self, ptr: *mut c_void, bytes: usize);
}

/// `count` elements of `dtype` at a device address, freed by `F` on drop.
#[derive(Debug)]
pub struct DeviceBuffer<F: Free> {
    ptr: *mut c_void,
    dtype: DType,
    count: usize,
    device: Device,
    free: F,
}

// SAFETY: plain device memory, addressable from any thread; `F` is Send + Sync.
unsafe impl<F: Free> Send for DeviceBuffer<F> {}
// SAFETY: shared references only expose the address.
unsafe impl<F: Free> Sync for DeviceBuffer<F> {}

impl<F: Free> DeviceBuffer<F> {
    /// Own the allocation at `ptr` (null for an empty one, which is never freed).
    ///
    /// # Safety
    /// `ptr` addresses `count` elements of `dtype` on `device`, allocated so that `free`
    /// releases it, and nothing else frees it.
    pub unsafe fn from_raw(ptr: *mut c_void, dtype: DType, count: usize, device: Device, free: F) -> Self {
        DeviceBuffer { ptr, dtype, count, device, free }
    }

    /// The device address.
    pub fn ptr(&self) -> *mut c_void {
        self.ptr
    }
}

impl<F: Free> Drop for DeviceBuffer<F> {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            self.free.free(self.ptr, self.count * self.dtype.size());
        }
    }
}

impl<F: Free> DeviceMemory for DeviceBuffer<F> {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn count(&self) -> usize {
        self.count
    }
    fn view(&self) -> Buf<'_> {
        // SAFETY: the allocation holds `count` elements (from_raw's contract) and outlives
        // the borrow of self.
        unsafe { Buf::from_raw(self.ptr as *const u8, self.count, self.dtype, self.device) }
    }
    fn view_mut(&mut self) -> BufMut<'_> {
        // SAFETY: as above, and `&mut self` makes the view exclusive.
        unsafe { BufMut::from_raw(self.ptr as *mut u8, self.count, self.dtype, self.device) }
    }
}
