//! The device layer: allocate, copy, synchronize and account for memory on the device a
//! rank uses. Conformance cases and the warmup use it so they run unchanged on every backend.

use crate::buffer::{Buf, BufMut, Device, DeviceKind};
use crate::dtype::DType;
use crate::error::{Error, Result};
use std::fmt;

/// Free and total memory of a device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    /// Bytes free.
    pub free: u64,
    /// Bytes in total.
    pub total: u64,
}

/// An allocation on a device, freed on drop.
pub trait DeviceMemory: Send + Sync + fmt::Debug {
    /// Element type.
    fn dtype(&self) -> DType;
    /// Number of elements.
    fn count(&self) -> usize;
    /// A read-only view of the whole allocation.
    fn view(&self) -> Buf<'_>;
    /// A writable view of the whole allocation.
    fn view_mut(&mut self) -> BufMut<'_>;
}

/// Device operations for one rank's device.
pub trait Platform: Send + Sync + fmt::Debug {
    /// Kind of device.
    fn kind(&self) -> DeviceKind;
    /// The device.
    fn device(&self) -> Device;
    /// Allocate `count` elements of `dtype`, zero-filled.
    ///
    /// # Errors
    /// `Backend` (out of memory or a driver error).
    fn alloc(&self, dtype: DType, count: usize) -> Result<Box<dyn DeviceMemory>>;
    /// `count` zeroed elements of `dtype` allocated the way the collective library registers
    /// best ([`crate::Communicator::register`]; NCCL: `ncclMemAlloc`, which the library's
    /// zero-copy paths need); plain [`Platform::alloc`] where there is no such way.
    ///
    /// # Errors
    /// As [`Platform::alloc`].
    fn alloc_registrable(&self, dtype: DType, count: usize) -> Result<Box<dyn DeviceMemory>> {
        self.alloc(dtype, count)
    }
    /// Copy `src` into the whole of `dst` (lengths must match).
    ///
    /// # Errors
    /// `InvalidArgument` on a length mismatch; `Backend` on a driver error.
    fn copy_from_host(&self, dst: &mut dyn DeviceMemory, src: &[u8]) -> Result<()>;
    /// Copy the whole of `src` into `dst` (lengths must match).
    ///
    /// # Errors
    /// As [`Platform::copy_from_host`].
    fn copy_to_host(&self, src: &dyn DeviceMemory, dst: &mut [u8]) -> Result<()>;
    /// Wait until all work queued on this device has finished.
    ///
    /// # Errors
    /// `Backend` on a driver error.
    fn synchronize(&self) -> Result<()>;
    /// Free and total memory.
    ///
    /// # Errors
    /// `Backend` on a driver error.
    fn mem_info(&self) -> Result<MemInfo>;
}

/// Host memory as a device: the platform of the CPU backend.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostPlatform;

/// A host allocation, 8-byte aligned so every dtype can be viewed in place; one of a page
/// or more starts at a page boundary, and one of 2 MiB or more at a 2 MiB boundary.
///
/// Two buffers at arbitrary addresses can sit 1 to 63 bytes apart modulo a page, where the
/// string-move copy that the C library's `memcpy` and the kernel's copies between processes
/// use runs many times slower (CPU backend, 2 ranks: all_gather 4 MiB read its peer's input
/// at 3.6-4.7 GB/s busbw out of place, 7.9 in place); aligned buffers never do. And huge
/// pages can back the whole of an aligned large buffer, not only its aligned middle.
#[derive(Debug)]
pub struct HostMemory {
    words: Vec<u64>,
    /// Index of the first word of the bytes (past the slack that aligns them).
    start: usize,
    dtype: DType,
    count: usize,
}

/// Allocations from this size on start at a page boundary.
const PAGE: usize = 4096;

impl HostMemory {
    /// Allocations from this size on start at a boundary of this size (a huge page).
    pub const HUGE_ALIGN: usize = 2 << 20;

    /// Zero-filled storage for `count` elements of `dtype`.
    pub fn new(dtype: DType, count: usize) -> Self {
        let bytes = count * dtype.size();
        let align = match bytes {
            b if b >= Self::HUGE_ALIGN => Self::HUGE_ALIGN,
            b if b >= PAGE => PAGE,
            _ => 8,
        };
        // Slack of `align - 8` bytes past the bytes lets them start at an `align` boundary
        // wherever the allocator puts the words (always at 8).
        let words = vec![0u64; (bytes + align - 8).div_ceil(8)];
        let at = words.as_ptr() as usize;
        let start = (at.next_multiple_of(align) - at) / 8;
        HostMemory { words, start, dtype, count }
    }
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        let n = self.count * self.dtype.size();
        &bytemuck::cast_slice(&self.words[self.start..])[..n]
    }
    /// The bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.count * self.dtype.size();
        &mut bytemuck::cast_slice_mut(&mut self.words[self.start..])[..n]
    }
}

impl DeviceMemory for HostMemory {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn count(&self) -> usize {
        self.count
    }
    fn view(&self) -> Buf<'_> {
        Buf::host_bytes(self.bytes(), self.dtype)
    }
    fn view_mut(&mut self) -> BufMut<'_> {
        let dtype = self.dtype;
        BufMut::host_bytes(self.bytes_mut(), dtype)
    }
}

impl Platform for HostPlatform {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }
    fn device(&self) -> Device {
        Device::CPU
    }
    fn alloc(&self, dtype: DType, count: usize) -> Result<Box<dyn DeviceMemory>> {
        Ok(Box::new(HostMemory::new(dtype, count)))
    }
    fn copy_from_host(&self, dst: &mut dyn DeviceMemory, src: &[u8]) -> Result<()> {
        let mut v = dst.view_mut();
        let want = v.bytes();
        let bytes = v.as_host_bytes_mut().ok_or_else(|| not_host("copy_from_host"))?;
        if want != src.len() {
            return Err(Error::length_mismatch("copy_from_host", "src", want, src.len()));
        }
        bytes.copy_from_slice(src);
        Ok(())
    }
    fn copy_to_host(&self, src: &dyn DeviceMemory, dst: &mut [u8]) -> Result<()> {
        let v = src.view();
        let bytes = v.as_host_bytes().ok_or_else(|| not_host("copy_to_host"))?;
        if bytes.len() != dst.len() {
            return Err(Error::length_mismatch("copy_to_host", "dst", bytes.len(), dst.len()));
        }
        dst.copy_from_slice(bytes);
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn mem_info(&self) -> Result<MemInfo> {
        let text = std::fs::read_to_string("/proc/meminfo").map_err(|e| {
            crate::Ctx::process("cpu").unsupported("mem_info", format!("cannot read /proc/meminfo: {e}"))
        })?;
        let field = |name: &str| -> u64 {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
                * 1024
        };
        Ok(MemInfo { free: field("MemAvailable:"), total: field("MemTotal:") })
    }
}

fn not_host(op: &'static str) -> Error {
    crate::Ctx::new("platform", 0, "").invalid(op, "buffer", "the host platform was given a device buffer")
}

#[cfg(test)]
mod tests {
    use super::{DType, DeviceMemory, HostMemory, PAGE};
    const HUGE: usize = HostMemory::HUGE_ALIGN;

    /// Every size lands where it should (8 bytes below a page, a page below 2 MiB, 2 MiB
    /// from there), is zeroed, holds exactly its bytes and keeps them through writes.
    #[test]
    fn host_memory_is_aligned_zeroed_and_exact() {
        for (dtype, count) in [
            (DType::U8, 0),
            (DType::U8, 1),
            (DType::F16, 2047),
            (DType::F32, 1024),
            (DType::F64, 4097),
            (DType::U8, HUGE - 1),
            (DType::F32, HUGE / 4),
            (DType::BF16, 3 * HUGE / 2 + 1),
        ] {
            let mut m = HostMemory::new(dtype, count);
            let n = count * dtype.size();
            let want = if n >= HUGE {
                HUGE
            } else if n >= PAGE {
                PAGE
            } else {
                8
            };
            assert_eq!(m.bytes().len(), n);
            assert_eq!(m.view().bytes(), n);
            assert_eq!(m.bytes().as_ptr() as usize % want, 0, "{n} bytes");
            assert!(m.bytes().iter().all(|&b| b == 0));
            m.bytes_mut().iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8);
            assert!(m.bytes().iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        }
    }
}
