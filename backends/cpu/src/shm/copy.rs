//! Copies of message bytes: within this process, avoiding the destination offsets that the
//! string-move instruction runs many times slower, and out of another process's memory
//! (`process_vm_readv`).

use super::os_err;

/// Whether a copy to `dst` from `src` is one that the string-move instruction (`rep movsb`,
/// used by the C library's `memcpy` from a few KiB up and by the kernel's copies between
/// processes) runs many times slower than usual: on several AMD cores, when the
/// destination sits 1 to 63 bytes past the source modulo a page. Measured here at 128 KiB:
/// 1.5 GB/s instead of 27 (memcpy), and 1.4 instead of 9 (`process_vm_readv`).
pub(crate) fn slow_offset(dst: usize, src: usize) -> bool {
    (1..64).contains(&(dst.wrapping_sub(src) & 0xfff))
}

/// `dst.copy_from_slice(src)` (which it is, except where [`slow_offset`] holds: then a
/// vector loop that does not use the string-move instruction).
///
/// # Panics
/// If the lengths differ (a programming error, as for `copy_from_slice`).
pub(crate) fn copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy between buffers of different lengths");
    if src.len() < 2048 || !slow_offset(dst.as_ptr() as usize, src.as_ptr() as usize) {
        dst.copy_from_slice(src);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let i = blocks64(dst, src, 0, false);
        dst[i..].copy_from_slice(&src[i..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Copy `src[from..]` to `dst[from..]` in 64-byte blocks of 16-byte vector loads and stores
/// (streaming stores when `stream`, which need `dst[from..]` 16-byte aligned), never with
/// the string-move instruction; returns where the blocks end (the tail is the caller's).
#[cfg(target_arch = "x86_64")]
fn blocks64(dst: &mut [u8], src: &[u8], from: usize, stream: bool) -> usize {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_storeu_si128, _mm_stream_si128};
    let (n, s, d) = (src.len().min(dst.len()), src.as_ptr(), dst.as_mut_ptr());
    debug_assert!(!stream || from + 64 > n || (d as usize + from).is_multiple_of(16));
    let mut i = from;
    while i + 64 <= n {
        // SAFETY: `i + 64 <= n`, the length of both slices, so the four 16-byte loads and
        // stores stay inside them; streaming stores go to 16-byte aligned addresses (`from`
        // is, per the caller, and steps are 64); `&[u8]` and `&mut [u8]` never overlap. SSE2
        // is part of every x86_64 target.
        unsafe {
            let v = [0, 16, 32, 48].map(|k| _mm_loadu_si128(s.add(i + k).cast::<__m128i>()));
            for (k, x) in [0, 16, 32, 48].into_iter().zip(v) {
                let p = d.add(i + k).cast::<__m128i>();
                if stream {
                    _mm_stream_si128(p, x)
                } else {
                    _mm_storeu_si128(p, x)
                }
            }
        }
        i += 64;
    }
    i
}

/// `dst.copy_from_slice(src)` with streaming (non-temporal) stores: the destination's lines
/// are written to memory without being read into the cache first, which a plain store
/// does (a third of a large copy's memory traffic) and which evicts what the cache holds.
/// For destinations far larger than the cache that nothing reads soon. Ends with a store
/// fence, so the bytes are ordered before whatever the caller publishes next.
///
/// # Panics
/// If the lengths differ (a programming error, as for `copy_from_slice`).
pub(crate) fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy between buffers of different lengths");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::_mm_sfence;
        let n = src.len();
        // Plain stores up to the destination's first 16-byte boundary.
        let head = dst.as_ptr().align_offset(16).min(n);
        dst[..head].copy_from_slice(&src[..head]);
        let i = blocks64(dst, src, head, true);
        dst[i..].copy_from_slice(&src[i..]);
        // SAFETY: a store fence has no memory operands.
        unsafe { _mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Ask the CPU to bring the line at `p` into this core's cache for writing, without waiting.
pub(crate) fn prefetch_for_write(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults and changes no memory or flags.
    unsafe {
        std::arch::asm!("prefetchw [{}]", in(reg) p, options(nostack, preserves_flags, readonly));
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// A copy of `src` in `v` (cleared first), through [`copy`].
pub(crate) fn copy_to_vec(v: &mut Vec<u8>, src: &[u8]) {
    v.clear();
    v.reserve(src.len());
    let spare = &mut v.spare_capacity_mut()[..src.len()];
    // SAFETY: `MaybeUninit<u8>` and `u8` have the same layout, and the bytes are only
    // written here (by `copy`) before being read.
    let dst = unsafe { std::slice::from_raw_parts_mut(spare.as_mut_ptr().cast::<u8>(), src.len()) };
    copy(dst, src);
    // SAFETY: the first `src.len()` bytes of the spare capacity were initialised above.
    unsafe { v.set_len(src.len()) };
}

/// Copy `dst.len()` bytes from address `addr` of process `pid` (a single copy between
/// processes, `process_vm_readv`). Where the kernel's copy would be slow ([`slow_offset`]),
/// a piece at a time through a buffer at the source's page offset, then [`copy`].
pub(crate) fn read_remote(pid: i32, addr: usize, dst: &mut [u8]) -> Result<(), String> {
    if dst.len() >= 4096 && slow_offset(dst.as_ptr() as usize, addr) {
        const PIECE: usize = 64 << 10;
        thread_local! {
            static BOUNCE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        return BOUNCE.with(|b| {
            let mut b = b.borrow_mut();
            b.resize(PIECE + 4096, 0);
            let start = (addr.wrapping_sub(b.as_ptr() as usize)) & 0xfff;
            let mut at = 0;
            while at < dst.len() {
                let k = PIECE.min(dst.len() - at);
                let bounce = &mut b[start..start + k];
                read_direct(pid, addr + at, bounce)?;
                copy(&mut dst[at..at + k], bounce);
                at += k;
            }
            Ok(())
        });
    }
    read_direct(pid, addr, dst)
}

fn read_direct(pid: i32, addr: usize, dst: &mut [u8]) -> Result<(), String> {
    let mut done = 0;
    while done < dst.len() {
        let local = libc::iovec { iov_base: dst[done..].as_mut_ptr().cast(), iov_len: dst.len() - done };
        let remote = libc::iovec { iov_base: (addr + done) as *mut libc::c_void, iov_len: dst.len() - done };
        // SAFETY: `local` describes writable memory this function borrows mutably; the remote
        // range is only read, by the kernel, which checks it against the other process's
        // mappings and fails instead of faulting.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        if n <= 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
                return Err(format!("process {pid} is gone (it exited or was killed)"));
            }
            return Err(os_err(&format!("process_vm_readv of {} bytes from process {pid}", dst.len() - done)));
        }
        done += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{copy, copy_streaming, copy_to_vec, read_remote, slow_offset};

    fn bytes(n: usize, salt: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt)).collect()
    }

    /// Every relative page offset between source and destination, around the slow ones, and
    /// lengths that do not end on a vector: the same bytes as `copy_from_slice`, by both
    /// copies (the streaming one starting at every alignment of the destination).
    #[test]
    fn copy_is_exact_at_every_offset() {
        let src = bytes(70_000 + 4096, 3);
        let mut dst = vec![0u8; 70_000 + 8192];
        type Copy = fn(&mut [u8], &[u8]);
        let copies: [(&str, Copy); 2] = [("copy", copy), ("copy_streaming", copy_streaming)];
        for ((name, f), off) in copies.iter().flat_map(|c| (0..130).chain(4000..4096).map(move |o| (c, o))) {
            for len in [0, 1, 15, 16, 63, 64, 65, 2047, 2048, 4097, 65_537, 70_000] {
                let s = &src[..len];
                // A destination `off` bytes past the source modulo a page.
                let base = (s.as_ptr() as usize).wrapping_sub(dst.as_ptr() as usize).wrapping_add(off) & 0xfff;
                dst.iter_mut().for_each(|b| *b = 0xAA);
                f(&mut dst[base..base + len], s);
                assert_eq!(&dst[base..base + len], s, "{name}: offset {off}, {len} bytes");
                let outside = dst[..base].iter().chain(&dst[base + len..]).all(|&b| b == 0xAA);
                assert!(outside, "{name} wrote outside at {off}");
                if len >= 2048 {
                    assert_eq!(slow_offset(dst[base..].as_ptr() as usize, s.as_ptr() as usize), (1..64).contains(&off));
                }
            }
        }
        let mut v = Vec::new();
        copy_to_vec(&mut v, &src);
        assert_eq!(v, src);
    }

    /// A read from a process that has exited says so (the sender of a message by reference
    /// killed while its receiver copies), not only the kernel's word for it.
    #[test]
    fn read_remote_names_a_process_that_is_gone() {
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = child.id() as i32;
        child.wait().expect("wait for true");
        let mut out = [0u8; 64];
        let e = read_remote(pid, out.as_ptr() as usize, &mut out).expect_err("a read from a reaped process");
        // (Its number may have gone to another process meanwhile: then not ours to read.)
        assert!(e.contains("is gone") || e.contains("Operation not permitted") || e.contains("Bad address"), "{e}");
    }

    /// Reads of this process's own memory (what a lent input costs the worker), through the
    /// bounce buffer at slow offsets and directly otherwise.
    #[test]
    fn read_remote_is_exact_at_slow_offsets() {
        let src = bytes(300_000, 9);
        let mut dst = vec![0u8; 300_000 + 8192];
        for off in [0, 8, 16, 40, 63, 64, 1000] {
            let base = (src.as_ptr() as usize).wrapping_sub(dst.as_ptr() as usize).wrapping_add(off) & 0xfff;
            let d = &mut dst[base..base + src.len()];
            read_remote(std::process::id() as i32, src.as_ptr() as usize, d).unwrap();
            assert_eq!(d, &src[..], "offset {off}");
        }
    }
}
