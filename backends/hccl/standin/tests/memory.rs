//! Device memory costs host memory only for what is written: `aclrtMalloc` reserves
//! address space and touches none of it (issue: the default 64 GiB pool backed by host
//! memory took four ranks of the recovery demo to 19.8 GB RSS, or to the OOM killer).
//! One test in its own binary, so no other test's memory moves the process's RSS.

use std::ffi::c_void;

type Code = i32;
type SetDevice = unsafe extern "C" fn(i32) -> Code;
type Malloc = unsafe extern "C" fn(*mut *mut c_void, usize, i32) -> Code;
type Free = unsafe extern "C" fn(*mut c_void) -> Code;
type Memset = unsafe extern "C" fn(*mut c_void, usize, i32, usize) -> Code;
type Memcpy = unsafe extern "C" fn(*mut c_void, usize, *const c_void, usize, i32) -> Code;

/// Resident bytes of this process (`/proc/self/statm`'s second field, in pages).
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("read /proc/self/statm");
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).expect("statm's resident field");
    pages * 4096
}

#[test]
fn eight_gib_of_device_memory_costs_only_what_is_written() {
    const GIB: usize = 1 << 30;
    const MIB: u64 = 1 << 20;
    let path = anyccl_hccl_standin::library_dir().join("libascendcl.so");
    // SAFETY: the stand-in, loaded once; its initialisers only set up statics.
    let lib = unsafe { libloading::Library::new(&path) }.expect("load the stand-in");
    type Symbols<'l> = (
        libloading::Symbol<'l, SetDevice>,
        libloading::Symbol<'l, Malloc>,
        libloading::Symbol<'l, Free>,
        libloading::Symbol<'l, Memset>,
        libloading::Symbol<'l, Memcpy>,
    );
    // SAFETY: the stand-in's entry points, each with its C signature.
    let (set_device, malloc, free, memset, memcpy): Symbols<'_> = unsafe {
        (
            lib.get(b"aclrtSetDevice").unwrap(),
            lib.get(b"aclrtMalloc").unwrap(),
            lib.get(b"aclrtFree").unwrap(),
            lib.get(b"aclrtMemset").unwrap(),
            lib.get(b"aclrtMemcpy").unwrap(),
        )
    };
    // SAFETY: a plain call.
    assert_eq!(unsafe { set_device(0) }, 0);
    let before = rss();
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: a valid out-parameter.
    assert_eq!(unsafe { malloc(&mut p, 8 * GIB, 0) }, 0, "aclrtMalloc of 8 GiB");
    let grew = rss().saturating_sub(before);
    assert!(grew < 64 * MIB, "allocating 8 GiB of device memory took {} MiB of host memory", grew / MIB);
    // The backend zeroes every allocation (ACL's are not): that costs nothing either.
    // SAFETY: the whole allocation.
    assert_eq!(unsafe { memset(p, 8 * GIB, 0, 8 * GIB) }, 0, "aclrtMemset of 8 GiB");
    let grew = rss().saturating_sub(before);
    assert!(grew < 64 * MIB, "allocating and zeroing 8 GiB of device memory took {} MiB of host memory", grew / MIB);

    // Fresh memory reads as zeros; writing 16 MiB at the far end costs about that much.
    let mut probe = vec![1u8; 4096];
    let far = 8 * GIB - (16 << 20);
    // SAFETY: `p` holds 8 GiB; `probe` is 4096 bytes.
    assert_eq!(unsafe { memcpy(probe.as_mut_ptr() as *mut c_void, 4096, (p as *const u8).add(far) as _, 4096, 2) }, 0);
    assert!(probe.iter().all(|&b| b == 0), "fresh device memory is not zeroed");
    let ones = vec![1u8; 16 << 20];
    let before_write = rss();
    // SAFETY: the last 16 MiB of the allocation.
    assert_eq!(unsafe { memcpy((p as *mut u8).add(far) as _, ones.len(), ones.as_ptr() as _, ones.len(), 1) }, 0);
    let after_write = rss();
    let wrote = after_write.saturating_sub(before_write);
    assert!((15 * MIB..64 * MIB).contains(&wrote), "writing 16 MiB of device memory took {} MiB", wrote / MIB);
    // Zeroing the written part from one byte before it gives its pages back and reads zero.
    // SAFETY: inside the allocation.
    assert_eq!(unsafe { memset((p as *mut u8).add(far - 1) as _, (16 << 20) + 1, 0, (16 << 20) + 1) }, 0);
    let kept = rss().saturating_sub(before_write);
    assert!(kept < MIB, "zeroing kept {} KiB of the 16 MiB written", kept >> 10);
    probe.fill(1);
    // SAFETY: as above.
    assert_eq!(unsafe { memcpy(probe.as_mut_ptr() as *mut c_void, 4096, (p as *const u8).add(far) as _, 4096, 2) }, 0);
    assert!(probe.iter().all(|&b| b == 0), "zeroed device memory is not zero");
    // Written again, then freed: the pages go back.
    // SAFETY: as above.
    assert_eq!(unsafe { memcpy((p as *mut u8).add(far) as _, ones.len(), ones.as_ptr() as _, ones.len(), 1) }, 0);
    let after_write = rss();
    // SAFETY: allocated above, freed once.
    assert_eq!(unsafe { free(p) }, 0);
    let kept = rss().saturating_sub(after_write - wrote);
    assert!(kept < MIB, "freeing kept {} KiB of the 16 MiB written", kept >> 10);
}
