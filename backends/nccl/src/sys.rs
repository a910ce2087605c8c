//! Loading NCCL: our own loader and type definitions.
//!
//! Nothing of cudarc's NCCL module is used: its `nccl` feature makes cudarc's build script
//! link `libnccl` when an engine (candle) selects cudarc's `dynamic-linking`, and a binary
//! would then not start without NCCL. The three NCCL types anyccl passes are defined here.
//!
//! cudarc's NCCL loader tries only names such as `libnccl.so` and `libnccl.so.13`, never
//! the `libnccl.so.2` soname that NCCL packages (and the Python wheels) ship, and panics
//! when none loads. So NCCL is opened here, from `ANYCCL_NCCL_LIBRARY`, the soname, the
//! development name, or the `nvidia/nccl/lib` folder of a Python environment, and every
//! symbol is resolved once into [`NcclLib`]. Return codes are plain integers (an unknown
//! code in a Rust enum would be undefined behaviour); symbols newer than NCCL 2.18 are
//! optional and gated on the version.

#![allow(non_snake_case, non_camel_case_types)] // NCCL's C names.

use anyccl_device::loader::{self, sym, Loaded};
use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

/// `struct ncclComm`, opaque.
#[repr(C)]
#[derive(Debug)]
pub struct ncclComm {
    _opaque: [u8; 0],
}

/// `ncclComm_t`.
pub type ncclComm_t = *mut ncclComm;

/// `ncclUniqueId`: 128 bytes (`NCCL_UNIQUE_ID_BYTES`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ncclUniqueId {
    /// The id's bytes.
    pub internal: [c_char; 128],
}

/// `ncclConfig_t` with the fields of NCCL 2.28 (`ncclConfig_v22800` up to
/// `nvlinkCentricSched`). [`config`] sets `size` and `version` so that a newer NCCL copies
/// only these bytes and gives its newer fields their defaults; an older one reads the
/// fields it knows.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ncclConfig_t {
    pub size: usize,
    pub magic: std::ffi::c_uint,
    pub version: std::ffi::c_uint,
    pub blocking: c_int,
    pub cgaClusterSize: c_int,
    pub minCTAs: c_int,
    pub maxCTAs: c_int,
    pub netName: *const c_char,
    pub splitShare: c_int,
    pub trafficClass: c_int,
    pub commName: *const c_char,
    pub collnetEnable: c_int,
    pub CTAPolicy: c_int,
    pub shrinkShare: c_int,
    pub nvlsCTAs: c_int,
    pub nChannelsPerNetPeer: c_int,
    pub nvlinkCentricSched: c_int,
}

/// `cudaStream_t` / `CUstream`.
pub type Stream = cudarc::driver::sys::CUstream;

/// `ncclSuccess`.
pub const SUCCESS: c_int = 0;
/// `ncclInProgress`.
pub const IN_PROGRESS: c_int = 7;
/// `NCCL_SPLIT_NOCOLOR`.
pub const SPLIT_NOCOLOR: c_int = -1;
/// `NCCL_API_MAGIC`.
pub const API_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`.
pub const UNDEF_INT: c_int = c_int::MIN;
/// `ncclStatGpuMemTotal`.
pub const STAT_GPU_MEM_TOTAL: c_int = 3;
/// `NCCL_WIN_COLL_SYMMETRIC`: every rank passes the same offset into its window to a
/// collective, so the library may use its symmetric kernels.
pub const WIN_COLL_SYMMETRIC: c_int = 0x01;

/// NCCL's version code for `major.minor.patch` (2.9 and later).
pub const fn version_code(major: i32, minor: i32, patch: i32) -> i32 {
    major * 10000 + minor * 100 + patch
}

type Coll = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, ncclComm_t, Stream) -> c_int;
type Rooted = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, ncclComm_t, Stream) -> c_int;
type Bcast = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, ncclComm_t, Stream) -> c_int;
type Gather = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, ncclComm_t, Stream) -> c_int;
type Send = unsafe extern "C" fn(*const c_void, usize, c_int, c_int, ncclComm_t, Stream) -> c_int;
type Recv = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, ncclComm_t, Stream) -> c_int;

/// Every NCCL entry point anyccl uses.
#[derive(Debug)]
pub struct NcclLib {
    _lib: Loaded,
    /// Where it was loaded from.
    pub path: String,
    /// `ncclGetVersion`'s code, e.g. 22803.
    pub version: i32,
    pub GetUniqueId: unsafe extern "C" fn(*mut ncclUniqueId) -> c_int,
    pub CommInitRankConfig:
        unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int, *mut ncclConfig_t) -> c_int,
    pub CommSplit: Option<unsafe extern "C" fn(ncclComm_t, c_int, c_int, *mut ncclComm_t, *mut ncclConfig_t) -> c_int>,
    pub CommAbort: unsafe extern "C" fn(ncclComm_t) -> c_int,
    pub CommGetAsyncError: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
    pub CommCount: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
    pub CommUserRank: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
    pub GetErrorString: unsafe extern "C" fn(c_int) -> *const c_char,
    pub GetLastError: Option<unsafe extern "C" fn(ncclComm_t) -> *const c_char>,
    pub CommMemStats: Option<unsafe extern "C" fn(ncclComm_t, c_int, *mut u64) -> c_int>,
    /// `ncclCommRegister(comm, buff, size, &handle)` (2.19).
    pub CommRegister: Option<unsafe extern "C" fn(ncclComm_t, *mut c_void, usize, *mut *mut c_void) -> c_int>,
    /// `ncclCommDeregister(comm, handle)` (2.19).
    pub CommDeregister: Option<unsafe extern "C" fn(ncclComm_t, *mut c_void) -> c_int>,
    /// `ncclCommWindowRegister(comm, buff, size, &win, flags)` (2.27.3): collective; memory
    /// from `ncclMemAlloc` (cuMem), the same size on every rank.
    pub CommWindowRegister:
        Option<unsafe extern "C" fn(ncclComm_t, *mut c_void, usize, *mut *mut c_void, c_int) -> c_int>,
    /// `ncclCommWindowDeregister(comm, win)` (2.27.3).
    pub CommWindowDeregister: Option<unsafe extern "C" fn(ncclComm_t, *mut c_void) -> c_int>,
    /// `ncclMemAlloc(&ptr, size)` (2.19): memory the library's zero-copy paths can map.
    pub MemAlloc: Option<unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int>,
    /// `ncclMemFree(ptr)` (2.19).
    pub MemFree: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
    pub AllReduce: Coll,
    pub Reduce: Rooted,
    pub Broadcast: Bcast,
    pub AllGather: Gather,
    pub ReduceScatter: Coll,
    pub AlltoAll: Option<Gather>,
    pub Send: Send,
    pub Recv: Recv,
    pub GroupStart: unsafe extern "C" fn() -> c_int,
    pub GroupEnd: unsafe extern "C" fn() -> c_int,
}

/// Every place the loader looked and what happened there.
pub fn candidates() -> Vec<PathBuf> {
    let mut v = Vec::new();
    // A path, read as the OS gives it (any bytes a path may hold), as every library-path
    // variable is (the device layer's `loader::env_dir`).
    if let Some(p) = std::env::var_os("ANYCCL_NCCL_LIBRARY").filter(|p| !p.is_empty()) {
        v.push(PathBuf::from(p));
    }
    v.push(PathBuf::from("libnccl.so.2"));
    v.push(PathBuf::from("libnccl.so"));
    for prefix in ["VIRTUAL_ENV", "CONDA_PREFIX"].iter().filter_map(|k| std::env::var(k).ok()) {
        v.extend(site_packages_nccl(&PathBuf::from(prefix)));
    }
    if let Ok(path) = std::env::var("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join("python3").exists() {
                if let Some(prefix) = dir.parent() {
                    v.extend(site_packages_nccl(prefix));
                }
            }
        }
    }
    v.dedup();
    v
}

fn site_packages_nccl(prefix: &std::path::Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for lib in ["lib", "lib64"] {
        let Ok(rd) = std::fs::read_dir(prefix.join(lib)) else { continue };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with("python3") {
                let p = e.path().join("site-packages/nvidia/nccl/lib/libnccl.so.2");
                if p.exists() {
                    out.push(p);
                }
            }
        }
    }
    out
}

fn load() -> Result<NcclLib, String> {
    let lib = loader::open("NCCL", &candidates(), "set ANYCCL_NCCL_LIBRARY to libnccl.so.2")?;
    let path = lib.path.clone();
    // SAFETY: every signature below is NCCL's public C API (nccl.h), with ncclResult_t,
    // ncclDataType_t and ncclRedOp_t as C ints.
    unsafe {
        let get_version: unsafe extern "C" fn(*mut c_int) -> c_int = sym(&lib, "ncclGetVersion")?;
        let mut version = 0;
        if get_version(&mut version) != SUCCESS {
            return Err(format!("{path}: ncclGetVersion failed"));
        }
        if version < version_code(2, 18, 0) {
            return Err(format!(
                "{path} is NCCL {version}; anyccl needs 2.18 or later (ncclCommSplit, non-blocking init)"
            ));
        }
        let at_least = |minor, patch| version >= version_code(2, minor, patch);
        Ok(anyccl_device::symbols!(NcclLib from lib, "nccl" {
            required: [GetUniqueId, CommInitRankConfig, CommAbort, CommGetAsyncError, CommCount, CommUserRank,
                GetErrorString, AllReduce, Reduce, Broadcast, AllGather, ReduceScatter, Send, Recv, GroupStart,
                GroupEnd],
            optional: [CommSplit, GetLastError],
            gated: [
                (at_least(19, 0)) => [CommRegister, CommDeregister, MemAlloc, MemFree],
                (at_least(27, 3)) => [CommWindowRegister, CommWindowDeregister],
                (at_least(28, 0)) => [AlltoAll],
                (at_least(29, 7)) => [CommMemStats],
            ],
            rest: { _lib: lib, path, version },
        }))
    }
}

/// The process-wide NCCL, loaded on first use.
///
/// # Errors
/// Every place looked at, when NCCL cannot be loaded.
pub fn lib() -> Result<&'static NcclLib, String> {
    static LIB: OnceLock<Result<NcclLib, String>> = OnceLock::new();
    LIB.get_or_init(load).as_ref().map_err(|e| e.clone())
}

/// A config initialised like `NCCL_CONFIG_INITIALIZER`, non-blocking.
///
/// `version` and `size` say the caller knows the fields of NCCL 2.28; a newer NCCL gives
/// its newer fields their defaults.
pub fn config(comm_name: Option<&std::ffi::CStr>) -> ncclConfig_t {
    // SAFETY: ncclConfig_t is plain C data (integers and raw pointers); all-zero is a
    // valid value of every field.
    let mut c: ncclConfig_t = unsafe { std::mem::MaybeUninit::zeroed().assume_init() };
    c.size = std::mem::size_of::<ncclConfig_t>();
    c.magic = API_MAGIC;
    c.version = version_code(2, 28, 0) as u32;
    c.blocking = 0;
    c.cgaClusterSize = UNDEF_INT;
    c.minCTAs = UNDEF_INT;
    c.maxCTAs = UNDEF_INT;
    c.splitShare = UNDEF_INT;
    c.trafficClass = UNDEF_INT;
    c.collnetEnable = UNDEF_INT;
    c.CTAPolicy = UNDEF_INT;
    c.shrinkShare = UNDEF_INT;
    c.nvlsCTAs = UNDEF_INT;
    c.nChannelsPerNetPeer = UNDEF_INT;
    c.nvlinkCentricSched = UNDEF_INT;
    if let Some(n) = comm_name {
        c.commName = n.as_ptr();
    }
    c
}
