//! Host buffers in huge pages: mapped fresh, aligned and advised for transparent huge
//! pages before their first touch, so the kernel backs them with huge pages whenever it
//! has them, whatever the process allocated and freed before (a heap allocation advised
//! after the fact may reuse memory the C library has already touched with small pages: 2
//! ranks, sendrecv 2 MiB ran at 9.7 GB/s busbw after smaller buffers had come and gone, 21
//! fresh). A buffer smaller than a huge page takes slots of one that such buffers share.

use anyccl_core::{Buf, BufMut, Ctx, DType, DeviceMemory, HostMemory, Recovery, Result};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// A huge page.
const HUGE: usize = HostMemory::HUGE_ALIGN;
/// A slot of a shared huge page: buffers smaller than a huge page take whole slots.
const SLOT: usize = HUGE / 8;

/// A private anonymous mapping, aligned to a huge page and advised for huge pages;
/// unmapped on drop.
#[derive(Debug)]
struct Mapping {
    at: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; who reads or writes which bytes
// of it is ruled by the `HugeMemory` values that hold it (disjoint ranges, see `Shared`).
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// `len` bytes (a multiple of the page size) starting at a huge-page boundary.
    fn new(len: usize) -> std::result::Result<Mapping, (i64, String)> {
        // One huge page more than needed, so that an aligned run of `len` bytes fits
        // wherever the kernel puts it; the rest is unmapped again.
        let over =
            len.checked_add(HUGE).filter(|n| *n <= isize::MAX as usize).ok_or((0, "too large to map".to_string()))?;
        // SAFETY: a new private anonymous mapping; no existing memory is touched.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                over,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err((e.raw_os_error().unwrap_or(0).into(), format!("mmap of {over} bytes: {e}")));
        }
        let base = raw as usize;
        let start = base.next_multiple_of(HUGE);
        let (head, tail) = (start - base, base + over - (start + len));
        // SAFETY: `base..start` and `start + len..base + over` lie in the mapping just made,
        // which nothing refers to; unmapping them leaves `start..start + len` mapped. A
        // failure leaves those bytes mapped and unused (released at exit), never unsafe.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
            // Advice only: where the kernel has no huge pages, small ones back the buffer.
            libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        // The kernel never maps address 0 for a hint-less mmap; were it to, this refuses it
        // (and leaves the mapping).
        let at = NonNull::new(start as *mut u8).ok_or((0, "mmap returned address 0".to_string()))?;
        Ok(Mapping { at, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping this value made and owns; no `HugeMemory` refers to it any
        // more (each holds an `Arc` of it). A failure leaves it mapped: no panic in drop.
        unsafe { libc::munmap(self.at.as_ptr().cast(), self.len) };
    }
}

/// The system's page size (4 KiB where it does not say).
fn page_size() -> usize {
    // SAFETY: a plain query.
    match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 && (p as usize).is_power_of_two() && (p as usize) <= HUGE => p as usize,
        _ => 4096,
    }
}

/// A huge page shared by buffers smaller than one, and which of its slots they hold.
struct Shared {
    page: Arc<Mapping>,
    /// Bit `i`: slot `i` is held.
    held: u8,
}

/// The process's shared huge pages that hold a buffer.
static SHARED: Mutex<Vec<Shared>> = Mutex::new(Vec::new());

/// `count` zeroed elements of `dtype` in huge pages: a mapping of its own from a huge page
/// up (rounded up to a small page; its tail past the last whole huge page in small pages), slots of a shared huge page
/// below that. Freed on drop.
#[derive(Debug)]
pub(crate) struct HugeMemory {
    page: Arc<Mapping>,
    /// Where the bytes start in `page`.
    at: usize,
    /// The slots held in a shared page (0: the mapping is this buffer's own).
    slots: u8,
    dtype: DType,
    count: usize,
}

impl HugeMemory {
    /// The buffer, or `Backend` naming its size when the system refuses the memory.
    pub(crate) fn new(dtype: DType, count: usize) -> Result<HugeMemory> {
        let ctx = Ctx::process("cpu");
        let failed = |(code, text): (i64, String)| {
            ctx.backend_error(&format!("alloc of {count} {dtype:?} elements"), code, text, Recovery::Fatal)
        };
        let bytes = count.checked_mul(dtype.size()).ok_or_else(|| failed((0, "the size overflows".into())))?;
        if bytes >= HUGE {
            let len =
                bytes.checked_next_multiple_of(page_size()).ok_or_else(|| failed((0, "the size overflows".into())))?;
            let page = Arc::new(Mapping::new(len).map_err(failed)?);
            return Ok(HugeMemory { page, at: 0, slots: 0, dtype, count });
        }
        let k = bytes.div_ceil(SLOT).max(1);
        let want = ((1u16 << k) - 1) as u8;
        let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        let free = shared.iter_mut().find_map(|s| {
            let i = (0..=8 - k).find(|&i| s.held & (want << i) == 0)?;
            Some((s, i))
        });
        let (page, i) = match free {
            Some((s, i)) => {
                s.held |= want << i;
                (s.page.clone(), i)
            }
            None => {
                let page = Arc::new(Mapping::new(HUGE).map_err(failed)?);
                shared.push(Shared { page: page.clone(), held: want });
                (page, 0)
            }
        };
        drop(shared);
        let mut m = HugeMemory { page, at: i * SLOT, slots: want << i, dtype, count };
        // A slot may have held an earlier buffer.
        m.bytes_mut().fill(0);
        Ok(m)
    }

    fn len(&self) -> usize {
        self.count * self.dtype.size()
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: `at..at + len()` lies in the mapping (checked at creation) and is this
        // buffer's alone (its own mapping, or its slots of a shared one, which no other
        // buffer holds); mapped memory is initialized (it reads as zeros until written); it
        // lives while `self.page` does.
        unsafe { std::slice::from_raw_parts(self.page.at.as_ptr().add(self.at), self.len()) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; `&mut self` makes this the only reference to those bytes.
        unsafe { std::slice::from_raw_parts_mut(self.page.at.as_ptr().add(self.at), self.len()) }
    }
}

impl Drop for HugeMemory {
    fn drop(&mut self) {
        if self.slots == 0 {
            return;
        }
        let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = shared.iter().position(|s| Arc::ptr_eq(&s.page, &self.page)) {
            shared[i].held &= !self.slots;
            if shared[i].held == 0 {
                // The last buffer in this page: it is unmapped when this one's `Arc` goes.
                shared.swap_remove(i);
            }
        }
    }
}

impl DeviceMemory for HugeMemory {
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

#[cfg(test)]
mod tests {
    use super::{HugeMemory, HUGE, SLOT};
    use anyccl_core::{DType, DeviceMemory};

    fn fill(m: &mut HugeMemory, salt: usize) {
        m.bytes_mut().iter_mut().enumerate().for_each(|(i, b)| *b = ((i + salt) % 251) as u8);
    }
    fn holds(m: &HugeMemory, salt: usize) -> bool {
        m.bytes().iter().enumerate().all(|(i, &b)| b == ((i + salt) % 251) as u8)
    }

    /// Sizes below, at and past a huge page: zeroed, exactly their bytes, which keep what
    /// is written; own mappings start at a huge page, shared ones at a slot.
    #[test]
    fn huge_memory_is_aligned_zeroed_and_exact() {
        for (dtype, count) in [(DType::U8, 0), (DType::F32, 1), (DType::U8, HUGE - 1), (DType::BF16, 3 * HUGE / 2 + 1)]
        {
            let mut m = HugeMemory::new(dtype, count).expect("map");
            let n = count * dtype.size();
            assert_eq!(m.view().bytes(), n);
            let align = if n >= HUGE { HUGE } else { SLOT };
            assert_eq!(m.bytes().as_ptr() as usize % align, 0, "{n} bytes");
            assert!(m.bytes().iter().all(|&b| b == 0));
            fill(&mut m, 0);
            assert!(holds(&m, 0));
        }
    }

    /// Buffers that share huge pages never overlap, keep their bytes while others come and
    /// go, and a slot given again after a drop is zeroed.
    #[test]
    fn shared_pages_keep_buffers_apart() {
        let sizes = [SLOT, 3 * SLOT - 1, 1, HUGE - 1, 2 * SLOT, SLOT + 1, 5 * SLOT];
        let mut ms: Vec<HugeMemory> = sizes.iter().map(|&n| HugeMemory::new(DType::U8, n).expect("map")).collect();
        for (i, m) in ms.iter_mut().enumerate() {
            fill(m, i);
        }
        for (i, m) in ms.iter().enumerate() {
            assert!(holds(m, i), "buffer {i} was overwritten");
        }
        let ranges: Vec<_> = ms.iter().map(|m| (m.bytes().as_ptr() as usize, m.bytes().len())).collect();
        for (a, (pa, la)) in ranges.iter().enumerate() {
            for (pb, lb) in &ranges[a + 1..] {
                assert!(pa + la <= *pb || pb + lb <= *pa, "buffers overlap");
            }
        }
        // Drop every other one; new ones take their slots, zeroed, and the rest keep theirs.
        let kept: Vec<(usize, HugeMemory)> = ms.into_iter().enumerate().filter(|(i, _)| i % 2 == 1).collect();
        let again: Vec<HugeMemory> = (0..4).map(|_| HugeMemory::new(DType::U8, 2 * SLOT).expect("map")).collect();
        assert!(again.iter().all(|m| m.bytes().iter().all(|&b| b == 0)), "a reused slot was not zeroed");
        for (i, m) in &kept {
            assert!(holds(m, *i), "buffer {i} was overwritten by a new one");
        }
    }

    /// The last buffer of a page unmaps it: a buffer of 8 slots has its page alone, and
    /// nothing holds that page once the buffer is gone.
    #[test]
    fn last_buffer_unmaps_its_page() {
        let m = HugeMemory::new(DType::U8, HUGE - 1).expect("map");
        let page = std::sync::Arc::downgrade(&m.page);
        drop(m);
        assert!(page.upgrade().is_none(), "the page outlived its last buffer");
    }

    /// Sizes no machine can map are errors naming them, not a panic or an abort: one whose
    /// byte count overflows, one past the address space, one the kernel refuses.
    #[test]
    fn impossible_sizes_are_errors() {
        for (dtype, count) in [(DType::F64, usize::MAX / 4), (DType::U8, usize::MAX / 2), (DType::U8, 1 << 60)] {
            let e = HugeMemory::new(dtype, count).expect_err("cannot map");
            assert!(e.to_string().contains(&format!("alloc of {count}")), "{e}");
        }
    }
}
