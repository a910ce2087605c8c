//! A rank's segment: anonymous shared memory (`memfd_create`) that its peers of the host map
//! through `/proc/<pid>/fd/<fd>`, how the rings lie in it, and which ranks count as one host.

use super::{os_err, RingPtr, CTL};
use std::ffi::CString;

/// A mapping of a segment.
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    /// The creator keeps its descriptor so that peers can open it through `/proc`.
    fd: Option<libc::c_int>,
}

// SAFETY: the mapping is plain shared memory; every access to it goes through the atomics of
// the ring control blocks or through byte ranges the ring protocol hands to one side at a time.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Segment({} bytes)", self.len)
    }
}

impl Segment {
    /// Create a segment of `len` bytes (zeroed, allocated as it is touched).
    pub(crate) fn create(len: usize) -> Result<Segment, String> {
        // Its rings' sides read a sleeping flag unfenced after they publish (see
        // `wait::sleep_until`): this process takes the sleepers' barriers from here on.
        super::wait::register_barrier();
        let name = CString::new("anyccl-cpu").map_err(|e| e.to_string())?;
        // SAFETY: `name` is a valid NUL-terminated string; the flags are valid.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_err("memfd_create"));
        }
        // SAFETY: `fd` is the descriptor just created and owned here.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            let e = os_err(&format!("ftruncate to {len} bytes"));
            // SAFETY: closing the descriptor owned here, once.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        match Self::map(fd, len) {
            Ok(base) => Ok(Segment { base, len, fd: Some(fd) }),
            Err(e) => {
                // SAFETY: closing the descriptor owned here, once.
                unsafe { libc::close(fd) };
                Err(e)
            }
        }
    }

    /// Map the segment of process `pid`, descriptor `fd`, which must hold `len` bytes.
    pub(crate) fn open(pid: u32, fd: i32, len: usize) -> Result<Segment, String> {
        super::wait::register_barrier();
        let path = CString::new(format!("/proc/{pid}/fd/{fd}")).map_err(|e| e.to_string())?;
        // SAFETY: `path` is a valid NUL-terminated string.
        let own = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if own < 0 {
            return Err(os_err(&format!("open /proc/{pid}/fd/{fd}")));
        }
        // SAFETY: an all-zero `stat` is a valid value to be overwritten.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `own` is open and `st` is a valid out-pointer.
        let r = if unsafe { libc::fstat(own, &mut st) } != 0 {
            Err(os_err("fstat"))
        } else if (st.st_size as u64) < len as u64 {
            Err(format!("the segment of process {pid} holds {} bytes, {len} expected", st.st_size))
        } else {
            Self::map(own, len)
        };
        // SAFETY: closing the descriptor opened here, once; the mapping outlives it.
        unsafe { libc::close(own) };
        r.map(|base| Segment { base, len, fd: None })
    }

    fn map(fd: libc::c_int, len: usize) -> Result<*mut u8, String> {
        // SAFETY: a fresh shared mapping of an open descriptor; the kernel picks the address.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(os_err(&format!("mmap of {len} bytes")));
        }
        Ok(p.cast())
    }

    /// Where the segment is mapped in this process.
    pub(crate) fn addr(&self) -> usize {
        self.base as usize
    }

    /// This process's descriptor of a segment it created.
    pub(crate) fn fd(&self) -> Option<i32> {
        self.fd
    }

    /// Fault in bytes `offset .. offset + len` of this mapping now, as if written
    /// (`MADV_POPULATE_WRITE`, Linux 5.14 on; elsewhere they fault in as they are first
    /// touched). Contents are unchanged.
    ///
    /// A ring's pages, left to fault in as messages first reach them, cost the first lap a
    /// fault in each mapping per page: 2 ranks calling back to back (1,024 in flight, 1,000
    /// calls a row) ran all_reduce 512 B-4 KiB 1.7-2x slower than one call at a time, the
    /// difference the faults of up to a thousand pages. Made at connect, as every other
    /// resource a step uses is.
    pub(crate) fn populate(&self, offset: usize, len: usize) {
        let page = 4096;
        let start = offset / page * page;
        let end = (offset + len).min(self.len);
        if start >= end {
            return;
        }
        // SAFETY: the range lies inside this mapping; populating reads and writes nothing.
        unsafe { libc::madvise(self.base.add(start).cast(), end - start, libc::MADV_POPULATE_WRITE) };
    }

    /// The ring at byte `offset` with `cap` data bytes.
    pub(super) fn ring(&self, offset: usize, cap: usize) -> RingPtr {
        debug_assert!(offset + CTL + cap <= self.len && cap.is_power_of_two());
        // SAFETY: the range lies inside the mapping (checked by the layout that computed it).
        let ctl = unsafe { self.base.add(offset) };
        // SAFETY: as above.
        let data = unsafe { ctl.add(CTL) };
        RingPtr { ctl: ctl.cast(), data, cap }
    }
}

impl RingPtr {
    /// Where stream position `pos` lies in the ring. The capacity is a power of two (the
    /// layout's rings are), so this is a mask: a division here, at every look and write of a
    /// message, cost tens of cycles each time (several a call of a small collective).
    pub(super) fn at(&self, pos: u64) -> usize {
        debug_assert!(self.cap.is_power_of_two());
        (pos & (self.cap as u64 - 1)) as usize
    }

    /// The stream position where the lap holding `pos` ends (`pos` itself at a lap's start).
    pub(super) fn lap_end(&self, pos: u64) -> u64 {
        let mask = self.cap as u64 - 1;
        (pos + mask) & !mask
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping made in `map`; no ring of it outlives the segment
        // (rings hold an `Arc` of it).
        unsafe { libc::munmap(self.base.cast(), self.len) };
        if let Some(fd) = self.fd {
            // SAFETY: closing the descriptor this segment owns, once.
            unsafe { libc::close(fd) };
        }
    }
}

/// How the rings of one host are laid out in a segment: one ring per *sending* local rank,
/// in the receiving rank's segment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layout {
    /// Ranks on the host.
    pub locals: usize,
    /// Data bytes of each ring (a power of two).
    pub ring: usize,
}

impl Layout {
    /// Bytes of one rank's segment.
    pub(crate) fn segment_bytes(&self) -> usize {
        self.locals * (CTL + self.ring)
    }
    pub(super) fn offset(&self, sender_local: usize) -> usize {
        sender_local * (CTL + self.ring)
    }
}

/// This host's identity: ranks that report the same one share memory. The boot id and the
/// PID namespace, so that containers of one machine that cannot see each other's processes
/// count as different hosts; `split` (from `ANYCCL_CPU_LINKS=hosts:K`) makes rank `r` of a
/// communicator look like host `r % K`, so the mixed path runs on one machine.
pub(crate) fn host_id(rank: usize, split: Option<usize>) -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let pidns = std::fs::read_link("/proc/self/ns/pid").map(|p| p.display().to_string()).unwrap_or_default();
    let mut id = format!("{}:{}", boot.trim(), pidns);
    if let Some(k) = split {
        id.push_str(&format!(":split{}", rank % k.max(1)));
    }
    id.replace(' ', "_")
}
