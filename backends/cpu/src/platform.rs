//! The CPU backend's platform: host memory, where allocations of 2 MiB and more ask the
//! kernel for transparent huge pages (`ANYCCL_CPU_HUGE_PAGES=0` does not ask).

use anyccl_core::{DType, Device, DeviceKind, DeviceMemory, HostMemory, HostPlatform, MemInfo, Platform, Result};

/// Host memory as a device, as [`HostPlatform`], except that large allocations ask for
/// transparent huge pages (`MADV_HUGEPAGE`, which the kernel honours in its `madvise` THP
/// mode, for the whole huge pages of the buffer, which [`HostMemory`] starts at a huge-page
/// boundary; in `always` mode it gives them anyway, and `never` refuses). Buffers far
/// larger than the cache then cost fewer TLB misses and page faults: 2 ranks, 256 MiB
/// all_reduce, 8 alternating runs, busbw median 3.12 GB/s without the advice and 4.08 with
/// it.
#[derive(Debug, Clone, Copy)]
pub struct CpuPlatform {
    huge: bool,
}

impl CpuPlatform {
    /// The platform, asking for huge pages unless `ANYCCL_CPU_HUGE_PAGES=0`.
    ///
    /// # Errors
    /// `InvalidArgument` naming the setting when it is neither `0` nor `1`.
    pub fn from_env(rank: usize) -> Result<CpuPlatform> {
        let huge = anyccl_core::env_flag("ANYCCL_CPU_HUGE_PAGES", "platform", rank, "")?.unwrap_or(true);
        Ok(CpuPlatform { huge })
    }
}

impl Platform for CpuPlatform {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }
    fn device(&self) -> Device {
        Device::CPU
    }
    fn alloc(&self, dtype: DType, count: usize) -> Result<Box<dyn DeviceMemory>> {
        let mut m = HostMemory::new(dtype, count);
        if self.huge && m.bytes().len() >= HostMemory::HUGE_ALIGN {
            crate::shm::advise_huge_pages(m.bytes_mut());
        }
        Ok(Box::new(m))
    }
    fn copy_from_host(&self, dst: &mut dyn DeviceMemory, src: &[u8]) -> Result<()> {
        HostPlatform.copy_from_host(dst, src)
    }
    fn copy_to_host(&self, src: &dyn DeviceMemory, dst: &mut [u8]) -> Result<()> {
        HostPlatform.copy_to_host(src, dst)
    }
    fn synchronize(&self) -> Result<()> {
        HostPlatform.synchronize()
    }
    fn mem_info(&self) -> Result<MemInfo> {
        HostPlatform.mem_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_allocations_are_zeroed_and_usable() {
        let p = CpuPlatform { huge: true };
        let mut m = p.alloc(DType::F32, 3 << 20).expect("alloc");
        let bytes = (3 << 20) * 4;
        let mut back = vec![1u8; bytes];
        p.copy_to_host(m.as_ref(), &mut back).expect("read");
        assert!(back.iter().all(|&b| b == 0));
        let data: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
        p.copy_from_host(m.as_mut(), &data).expect("write");
        p.copy_to_host(m.as_ref(), &mut back).expect("read");
        assert_eq!(back, data);
    }
}
