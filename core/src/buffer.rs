//! Borrowed buffer views: pointer, count, dtype and device.
//!
//! This module and `platform`'s host allocator are the only places in core that use
//! `unsafe`: they turn slices into views and back.

use crate::dtype::{DType, Element};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::marker::PhantomData;

/// Kind of device a buffer lives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DeviceKind {
    /// Host memory.
    Cpu,
    /// An NVIDIA GPU.
    Cuda,
    /// An Ascend NPU.
    Npu,
}

/// A device: kind plus ordinal (always 0 for the host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Device {
    /// The kind.
    pub kind: DeviceKind,
    /// Ordinal among devices of that kind on this host.
    pub ordinal: i32,
}

/// An engine's own device stream (a `CUstream`, an `aclrtStream`), by its raw handle, for
/// ordering a communicator's operations with the engine's work without the host waiting:
/// [`crate::Communicator::wait_stream`] and [`crate::Communicator::signal_stream`].
/// The lifetime is that of whatever owns the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StreamRef<'a> {
    device: Device,
    raw: usize,
    owner: std::marker::PhantomData<&'a ()>,
}

impl<'a> StreamRef<'a> {
    /// A reference to stream `raw` of `device`.
    ///
    /// # Safety
    /// `raw` must be a live stream of `device`'s primary context for `'a` (the calls given
    /// it only enqueue: the stream may be destroyed once they return, as the vendor runtime
    /// allows).
    pub unsafe fn from_raw(device: Device, raw: *mut std::ffi::c_void) -> StreamRef<'a> {
        StreamRef { device, raw: raw as usize, owner: std::marker::PhantomData }
    }
    /// The device.
    pub fn device(&self) -> Device {
        self.device
    }
    /// The raw handle.
    pub fn as_ptr(&self) -> *mut std::ffi::c_void {
        self.raw as *mut std::ffi::c_void
    }
}

impl Device {
    /// The host.
    pub const CPU: Device = Device { kind: DeviceKind::Cpu, ordinal: 0 };
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            DeviceKind::Cpu => f.write_str("cpu"),
            DeviceKind::Cuda => write!(f, "cuda:{}", self.ordinal),
            DeviceKind::Npu => write!(f, "npu:{}", self.ordinal),
        }
    }
}

/// A read-only view of `count` elements of `dtype` on `device`, borrowed for `'a`.
#[derive(Clone, Copy)]
pub struct Buf<'a> {
    ptr: *const u8,
    count: usize,
    dtype: DType,
    device: Device,
    _life: PhantomData<&'a [u8]>,
}

/// A writable view of `count` elements of `dtype` on `device`, borrowed for `'a`.
pub struct BufMut<'a> {
    ptr: *mut u8,
    count: usize,
    dtype: DType,
    device: Device,
    _life: PhantomData<&'a mut [u8]>,
}

// SAFETY: a Buf is a shared borrow of memory that is never written through it; sending it
// to another thread is the same as sending a `&[u8]`.
unsafe impl Send for Buf<'_> {}
// SAFETY: as above, a Buf only permits reads.
unsafe impl Sync for Buf<'_> {}
// SAFETY: a BufMut is an exclusive borrow, like `&mut [u8]`, which is Send.
unsafe impl Send for BufMut<'_> {}
// SAFETY: shared access to a BufMut only exposes its address and metadata.
unsafe impl Sync for BufMut<'_> {}

impl fmt::Debug for Buf<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Buf({:p}, {} x {}, {})", self.ptr, self.count, self.dtype, self.device)
    }
}
impl fmt::Debug for BufMut<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BufMut({:p}, {} x {}, {})", self.ptr, self.count, self.dtype, self.device)
    }
}

impl<'a> Buf<'a> {
    /// A view of a host slice.
    pub fn host<T: Element>(data: &'a [T]) -> Self {
        Buf { ptr: data.as_ptr().cast(), count: data.len(), dtype: T::DTYPE, device: Device::CPU, _life: PhantomData }
    }

    /// A view of host bytes reinterpreted as `dtype` (`bytes.len()` must be a multiple of its size).
    ///
    /// # Panics
    /// If the length is not a multiple of the dtype size (a programming error).
    pub fn host_bytes(bytes: &'a [u8], dtype: DType) -> Self {
        assert!(bytes.len().is_multiple_of(dtype.size()), "byte length not a multiple of {dtype}");
        Buf { ptr: bytes.as_ptr(), count: bytes.len() / dtype.size(), dtype, device: Device::CPU, _life: PhantomData }
    }

    /// A view from a raw pointer.
    ///
    /// # Safety
    /// `ptr` must point to `count * dtype.size()` bytes on `device` that stay valid, and are
    /// not written by anyone else, for `'a`. For device memory the pointer must be a device
    /// address usable by the backend's library on that device.
    pub unsafe fn from_raw(ptr: *const u8, count: usize, dtype: DType, device: Device) -> Self {
        Buf { ptr, count, dtype, device, _life: PhantomData }
    }

    /// Start address.
    pub fn ptr(&self) -> *const u8 {
        self.ptr
    }
    /// Number of elements.
    pub fn count(&self) -> usize {
        self.count
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Device.
    pub fn device(&self) -> Device {
        self.device
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }

    /// The bytes, when the view is host memory.
    pub fn as_host_bytes(&self) -> Option<&'a [u8]> {
        if self.device.kind != DeviceKind::Cpu {
            return None;
        }
        if self.count == 0 {
            return Some(&[]);
        }
        // SAFETY: host views are built from slices (or from_raw, whose contract requires the
        // bytes to be valid and unwritten for 'a), so the range is a live shared borrow.
        Some(unsafe { std::slice::from_raw_parts(self.ptr, self.bytes()) })
    }

    /// A sub-view of `count` elements starting at element `offset`.
    ///
    /// # Panics
    /// If the range is out of bounds (a programming error; the Communicator validates first).
    pub fn slice(&self, offset: usize, count: usize) -> Buf<'a> {
        assert!(offset.checked_add(count).is_some_and(|end| end <= self.count), "Buf::slice out of bounds");
        Buf {
            ptr: self.ptr.wrapping_add(offset * self.dtype.size()),
            count,
            dtype: self.dtype,
            device: self.device,
            _life: PhantomData,
        }
    }
}

impl<'a> BufMut<'a> {
    /// A view of a mutable host slice.
    pub fn host<T: Element>(data: &'a mut [T]) -> Self {
        BufMut {
            ptr: data.as_mut_ptr().cast(),
            count: data.len(),
            dtype: T::DTYPE,
            device: Device::CPU,
            _life: PhantomData,
        }
    }

    /// A view of mutable host bytes reinterpreted as `dtype`.
    ///
    /// # Panics
    /// If the length is not a multiple of the dtype size (a programming error).
    pub fn host_bytes(bytes: &'a mut [u8], dtype: DType) -> Self {
        assert!(bytes.len().is_multiple_of(dtype.size()), "byte length not a multiple of {dtype}");
        BufMut {
            ptr: bytes.as_mut_ptr(),
            count: bytes.len() / dtype.size(),
            dtype,
            device: Device::CPU,
            _life: PhantomData,
        }
    }

    /// A view from a raw pointer.
    ///
    /// # Safety
    /// `ptr` must point to `count * dtype.size()` writable bytes on `device` that nobody else
    /// reads or writes for `'a`. For device memory the pointer must be a device address
    /// usable by the backend's library on that device.
    pub unsafe fn from_raw(ptr: *mut u8, count: usize, dtype: DType, device: Device) -> Self {
        BufMut { ptr, count, dtype, device, _life: PhantomData }
    }

    /// Start address.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    /// Number of elements.
    pub fn count(&self) -> usize {
        self.count
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Device.
    pub fn device(&self) -> Device {
        self.device
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }

    /// A read-only view of the same memory, borrowed from this one.
    pub fn as_buf(&self) -> Buf<'_> {
        Buf { ptr: self.ptr, count: self.count, dtype: self.dtype, device: self.device, _life: PhantomData }
    }

    /// The bytes, when the view is host memory.
    pub fn as_host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        if self.device.kind != DeviceKind::Cpu {
            return None;
        }
        if self.count == 0 {
            return Some(&mut []);
        }
        // SAFETY: host views come from exclusive slice borrows (or from_raw, whose contract
        // grants exclusive access), and `&mut self` keeps this the only live access.
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes()) })
    }

    /// Consume the view into the host bytes it covers, keeping the original lifetime.
    pub fn into_host_bytes(self) -> Option<&'a mut [u8]> {
        if self.device.kind != DeviceKind::Cpu {
            return None;
        }
        if self.count == 0 {
            return Some(&mut []);
        }
        // SAFETY: as in as_host_bytes_mut; consuming self hands the exclusive borrow on.
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes()) })
    }
}

/// Whether two byte ranges `[a, a+alen)` and `[b, b+blen)` on the same device overlap.
pub fn overlaps(a: usize, alen: usize, b: usize, blen: usize) -> bool {
    alen > 0 && blen > 0 && a < b + blen && b < a + alen
}
