//! HCCL's and ACL's C types, and loading both libraries.
//!
//! Codes are plain integers (an unknown code in a Rust enum would be undefined
//! behaviour); symbols that older CANN releases lack are optional. `HcclCommConfigInit`
//! is an inline function of `hccl_types.h`, not an exported symbol: [`comm_config_init`]
//! reproduces it.

#![allow(non_snake_case, non_camel_case_types)] // HCCL's and ACL's C names.

use anyccl_device::loader::{self, opt, sym, Loaded};
use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

/// `HcclComm`.
pub type HcclComm = *mut c_void;
/// `aclrtStream`.
pub type aclrtStream = *mut c_void;
/// `aclrtEvent`.
pub type aclrtEvent = *mut c_void;
/// `HcclResult` and `aclError`: C enums and ints.
pub type Code = c_int;

/// `HCCL_SUCCESS`, `ACL_SUCCESS`.
pub const SUCCESS: Code = 0;
/// `HCCL_E_NOT_SUPPORT`.
pub const E_NOT_SUPPORT: Code = 5;
/// `ACL_ERROR_REPEAT_INITIALIZE`: `aclInit` called before, which is fine.
pub const ACL_ERROR_REPEAT_INITIALIZE: Code = 100002;
/// `ACL_ERROR_RT_MEMORY_ALLOCATION`.
pub const ACL_ERROR_RT_MEMORY_ALLOCATION: Code = 207001;
/// `ACL_MEM_MALLOC_HUGE_FIRST`.
pub const ACL_MEM_MALLOC_HUGE_FIRST: c_int = 0;
/// `ACL_MEMCPY_HOST_TO_DEVICE`.
pub const ACL_MEMCPY_HOST_TO_DEVICE: c_int = 1;
/// `ACL_MEMCPY_DEVICE_TO_HOST`.
pub const ACL_MEMCPY_DEVICE_TO_HOST: c_int = 2;
/// `ACL_MEMCPY_DEVICE_TO_DEVICE`.
pub const ACL_MEMCPY_DEVICE_TO_DEVICE: c_int = 3;
/// `ACL_HBM_MEM`.
pub const ACL_HBM_MEM: c_int = 1;
/// `ACL_EVENT_RECORDED_STATUS_COMPLETE`.
pub const ACL_EVENT_RECORDED_STATUS_COMPLETE: c_int = 1;
/// `ACL_STREAM_STATUS_COMPLETE` (`aclrtStreamStatus`; 1 is `ACL_STREAM_STATUS_NOT_READY`).
pub const ACL_STREAM_STATUS_COMPLETE: c_int = 0;

/// `HCCL_ROOT_INFO_BYTES`.
pub const ROOT_INFO_BYTES: usize = 4108;

/// `HcclRootInfo`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HcclRootInfo {
    /// Opaque bytes.
    pub internal: [c_char; ROOT_INFO_BYTES],
}

/// `HcclSendRecvItem` (32 bytes on LP64).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct HcclSendRecvItem {
    /// `HCCL_SEND` (0) or `HCCL_RECV` (1).
    pub sendRecvType: c_int,
    pub buf: *mut c_void,
    pub count: u64,
    pub dataType: c_int,
    pub remoteRank: u32,
}

/// `HcclCommConfig` of config version 10 (2,232 bytes on LP64).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HcclCommConfig {
    /// `{ size_t size; uint32 magicWord; uint32 version; uint64 reserved; }`.
    pub reserved: [u8; 24],
    pub hcclBufferSize: u32,
    pub hcclDeterministic: u32,
    pub hcclCommName: [c_char; 128],
    pub hcclUdi: [c_char; 128],
    pub hcclOpExpansionMode: u32,
    pub hcclRdmaTrafficClass: u32,
    pub hcclRdmaServiceLevel: u32,
    pub hcclWorldRankID: u32,
    pub hcclJobID: u64,
    pub aclGraphZeroCopyEnable: u8,
    pub hcclExecTimeOut: i32,
    pub hcclAlgo: [c_char; 1600],
    pub hcclRetryEnable: [c_char; 50],
    pub hcclRetryParams: [c_char; 128],
    pub hcclBufferName: [c_char; 128],
    pub hcclQos: u32,
}

impl std::fmt::Debug for HcclRootInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HcclRootInfo(4108 bytes)")
    }
}

impl std::fmt::Debug for HcclCommConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HcclCommConfig")
            .field("hcclBufferSize", &self.hcclBufferSize)
            .field("hcclExecTimeOut", &self.hcclExecTimeOut)
            .finish_non_exhaustive()
    }
}

const _: () = {
    assert!(std::mem::size_of::<HcclCommConfig>() == 2232);
    assert!(std::mem::offset_of!(HcclCommConfig, hcclJobID) == 304);
    assert!(std::mem::offset_of!(HcclCommConfig, hcclExecTimeOut) == 316);
    assert!(std::mem::offset_of!(HcclCommConfig, hcclAlgo) == 320);
    assert!(std::mem::offset_of!(HcclCommConfig, hcclQos) == 2228);
    assert!(std::mem::size_of::<HcclSendRecvItem>() == 32);
    assert!(std::mem::size_of::<HcclRootInfo>() == 4108);
};

/// `HCCL_COMM_CONFIG_MAGIC_WORD`.
pub const CONFIG_MAGIC: u32 = 0xf0f0_f0f0;
/// `HCCL_COMM_CONFIG_VERSION` of the fields above.
pub const CONFIG_VERSION: u32 = 10;
/// `..._CONFIG_NOT_SET`.
pub const NOT_SET: u32 = 0xffff_ffff;
/// `HcclCommConfigCapability`: a field is honoured when its number is below
/// `HcclGetCommConfigCapability()`.
pub const CAP_BUFFER_SIZE: u32 = 0;
/// See [`CAP_BUFFER_SIZE`].
pub const CAP_COMM_NAME: u32 = 2;
/// See [`CAP_BUFFER_SIZE`].
pub const CAP_EXEC_TIMEOUT: u32 = 8;

/// `HcclCommConfigInit` (an inline function of `hccl_types.h`): size, magic word and
/// version in the reserved header, every field "not set" or zero.
pub fn comm_config_init() -> HcclCommConfig {
    let mut reserved = [0u8; 24];
    reserved[..8].copy_from_slice(&(std::mem::size_of::<HcclCommConfig>() as u64).to_ne_bytes());
    reserved[8..12].copy_from_slice(&CONFIG_MAGIC.to_ne_bytes());
    reserved[12..16].copy_from_slice(&CONFIG_VERSION.to_ne_bytes());
    HcclCommConfig {
        reserved,
        hcclBufferSize: NOT_SET,
        hcclDeterministic: NOT_SET,
        hcclCommName: [0; 128],
        hcclUdi: [0; 128],
        hcclOpExpansionMode: 0,
        hcclRdmaTrafficClass: NOT_SET,
        hcclRdmaServiceLevel: NOT_SET,
        hcclWorldRankID: 0,
        hcclJobID: 0,
        aclGraphZeroCopyEnable: 0,
        hcclExecTimeOut: NOT_SET as i32,
        hcclAlgo: [0; 1600],
        hcclRetryEnable: [0; 50],
        hcclRetryParams: [0; 128],
        hcclBufferName: [0; 128],
        hcclQos: NOT_SET,
    }
}

type Stream = aclrtStream;
type Coll = unsafe extern "C" fn(*mut c_void, *mut c_void, u64, c_int, c_int, HcclComm, Stream) -> Code;

/// Every HCCL entry point anyccl uses.
#[derive(Debug)]
pub struct HcclLib {
    _lib: Loaded,
    /// Where it was loaded from.
    pub path: String,
    pub GetRootInfo: unsafe extern "C" fn(*mut HcclRootInfo) -> Code,
    pub CommInitRootInfoConfig:
        unsafe extern "C" fn(u32, *const HcclRootInfo, u32, *const HcclCommConfig, *mut HcclComm) -> Code,
    pub CreateSubCommConfig: Option<
        unsafe extern "C" fn(*mut HcclComm, u32, *mut u32, u64, u32, *mut HcclCommConfig, *mut HcclComm) -> Code,
    >,
    pub CommDestroy: unsafe extern "C" fn(HcclComm) -> Code,
    pub CommSuspend: Option<unsafe extern "C" fn(HcclComm) -> Code>,
    pub GetRankSize: unsafe extern "C" fn(HcclComm, *mut u32) -> Code,
    pub GetRankId: unsafe extern "C" fn(HcclComm, *mut u32) -> Code,
    pub GetCommAsyncError: unsafe extern "C" fn(HcclComm, *mut Code) -> Code,
    pub GetErrorString: unsafe extern "C" fn(Code) -> *const c_char,
    pub GetCommConfigCapability: Option<unsafe extern "C" fn() -> u32>,
    pub AllReduce: Coll,
    pub Reduce: unsafe extern "C" fn(*mut c_void, *mut c_void, u64, c_int, c_int, u32, HcclComm, Stream) -> Code,
    pub Broadcast: unsafe extern "C" fn(*mut c_void, u64, c_int, u32, HcclComm, Stream) -> Code,
    pub AllGather: unsafe extern "C" fn(*mut c_void, *mut c_void, u64, c_int, HcclComm, Stream) -> Code,
    pub ReduceScatter: Coll,
    pub AlltoAll:
        Option<unsafe extern "C" fn(*const c_void, u64, c_int, *const c_void, u64, c_int, HcclComm, Stream) -> Code>,
    #[allow(clippy::type_complexity)]
    pub AlltoAllV: Option<
        unsafe extern "C" fn(
            *const c_void,
            *const c_void,
            *const c_void,
            c_int,
            *const c_void,
            *const c_void,
            *const c_void,
            c_int,
            HcclComm,
            Stream,
        ) -> Code,
    >,
    pub Send: unsafe extern "C" fn(*mut c_void, u64, c_int, u32, HcclComm, Stream) -> Code,
    pub Recv: unsafe extern "C" fn(*mut c_void, u64, c_int, u32, HcclComm, Stream) -> Code,
    pub BatchSendRecv: Option<unsafe extern "C" fn(*mut HcclSendRecvItem, u32, HcclComm, Stream) -> Code>,
    pub Barrier: unsafe extern "C" fn(HcclComm, Stream) -> Code,
    /// `HcclCommRegister(comm, addr, size, &handle, flag)`.
    pub CommRegister: Option<unsafe extern "C" fn(HcclComm, *mut c_void, u64, *mut *mut c_void, u32) -> Code>,
    /// `HcclCommDeregister(comm, handle)`.
    pub CommDeregister: Option<unsafe extern "C" fn(HcclComm, *mut c_void) -> Code>,
}

/// Every ACL entry point anyccl uses.
#[derive(Debug)]
pub struct AclLib {
    _lib: Loaded,
    /// Where it was loaded from.
    pub path: String,
    pub Init: unsafe extern "C" fn(*const c_char) -> Code,
    pub SetDevice: unsafe extern "C" fn(i32) -> Code,
    pub GetDeviceCount: unsafe extern "C" fn(*mut u32) -> Code,
    pub CreateStream: unsafe extern "C" fn(*mut aclrtStream) -> Code,
    pub DestroyStream: unsafe extern "C" fn(aclrtStream) -> Code,
    pub SynchronizeStream: unsafe extern "C" fn(aclrtStream) -> Code,
    pub SynchronizeDevice: Option<unsafe extern "C" fn() -> Code>,
    pub CreateEvent: unsafe extern "C" fn(*mut aclrtEvent) -> Code,
    pub DestroyEvent: unsafe extern "C" fn(aclrtEvent) -> Code,
    pub RecordEvent: unsafe extern "C" fn(aclrtEvent, aclrtStream) -> Code,
    pub QueryEventStatus: unsafe extern "C" fn(aclrtEvent, *mut c_int) -> Code,
    /// `aclrtStreamQuery(stream, &status)`: whether everything on the stream has finished
    /// (status [`ACL_STREAM_STATUS_COMPLETE`]); where missing, a mark is recorded instead.
    pub StreamQuery: Option<unsafe extern "C" fn(aclrtStream, *mut c_int) -> Code>,
    /// `aclrtStreamWaitEvent(stream, event)`: the stream waits for the event's work.
    pub StreamWaitEvent: Option<unsafe extern "C" fn(aclrtStream, aclrtEvent) -> Code>,
    /// `aclmdlRICaptureGetInfo(stream, &status, &modelRI)` (CANN 8.1+, an experimental
    /// feature there): whether the stream is capturing a graph (status 1).
    pub CaptureGetInfo: Option<unsafe extern "C" fn(aclrtStream, *mut c_int, *mut *mut c_void) -> Code>,
    pub Malloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_int) -> Code,
    pub Free: unsafe extern "C" fn(*mut c_void) -> Code,
    pub Memcpy: unsafe extern "C" fn(*mut c_void, usize, *const c_void, usize, c_int) -> Code,
    pub MemcpyAsync: unsafe extern "C" fn(*mut c_void, usize, *const c_void, usize, c_int, aclrtStream) -> Code,
    pub Memset: unsafe extern "C" fn(*mut c_void, usize, i32, usize) -> Code,
    pub GetMemInfo: unsafe extern "C" fn(c_int, *mut usize, *mut usize) -> Code,
    pub GetRecentErrMsg: Option<unsafe extern "C" fn() -> *const c_char>,
}

/// Folders searched, in order: `ANYCCL_HCCL_LIBRARY_DIR`, `ASCEND_HOME_PATH/lib64`,
/// `ASCEND_TOOLKIT_HOME/lib64`, the default toolkit location; then the loader's path.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = Vec::new();
    v.extend(loader::env_dir("ANYCCL_HCCL_LIBRARY_DIR", ""));
    v.extend(loader::env_dir("ASCEND_HOME_PATH", "lib64"));
    v.extend(loader::env_dir("ASCEND_TOOLKIT_HOME", "lib64"));
    v.push(PathBuf::from("/usr/local/Ascend/ascend-toolkit/latest/lib64"));
    v
}

const HINT: &str = "set ANYCCL_HCCL_LIBRARY_DIR, or ASCEND_HOME_PATH (source CANN's set_env.sh)";

fn load_hccl() -> Result<HcclLib, String> {
    let lib = loader::open("HCCL (libhccl.so)", &loader::candidates(&["libhccl.so"], &search_dirs()), HINT)?;
    let path = lib.path.clone();
    // SAFETY: every signature below is HCCL's public C API (hccl.h, hccl_types.h), with
    // HcclResult, HcclDataType and HcclReduceOp as C ints.
    unsafe {
        Ok(anyccl_device::symbols!(HcclLib from lib, "Hccl" {
            required: [GetRootInfo, CommInitRootInfoConfig, CommDestroy, GetRankSize, GetRankId, GetCommAsyncError,
                GetErrorString, AllReduce, Reduce, Broadcast, AllGather, ReduceScatter, Send, Recv, Barrier],
            optional: [CreateSubCommConfig, CommSuspend, GetCommConfigCapability, AlltoAll, AlltoAllV, BatchSendRecv,
                CommRegister, CommDeregister],
            rest: { _lib: lib, path },
        }))
    }
}

fn load_acl() -> Result<AclLib, String> {
    let lib = loader::open("ACL (libascendcl.so)", &loader::candidates(&["libascendcl.so"], &search_dirs()), HINT)?;
    let path = lib.path.clone();
    // SAFETY: every signature below is ACL's public C API (acl_rt.h, acl_base_rt.h), with
    // aclError and the enums as C ints.
    unsafe {
        Ok(AclLib {
            Init: sym(&lib, "aclInit")?,
            SetDevice: sym(&lib, "aclrtSetDevice")?,
            GetDeviceCount: sym(&lib, "aclrtGetDeviceCount")?,
            CreateStream: sym(&lib, "aclrtCreateStream")?,
            DestroyStream: sym(&lib, "aclrtDestroyStream")?,
            SynchronizeStream: sym(&lib, "aclrtSynchronizeStream")?,
            SynchronizeDevice: opt(&lib, "aclrtSynchronizeDevice"),
            CreateEvent: sym(&lib, "aclrtCreateEvent")?,
            DestroyEvent: sym(&lib, "aclrtDestroyEvent")?,
            RecordEvent: sym(&lib, "aclrtRecordEvent")?,
            QueryEventStatus: sym(&lib, "aclrtQueryEventStatus")?,
            StreamQuery: opt(&lib, "aclrtStreamQuery"),
            StreamWaitEvent: opt(&lib, "aclrtStreamWaitEvent"),
            CaptureGetInfo: opt(&lib, "aclmdlRICaptureGetInfo"),
            Malloc: sym(&lib, "aclrtMalloc")?,
            Free: sym(&lib, "aclrtFree")?,
            Memcpy: sym(&lib, "aclrtMemcpy")?,
            MemcpyAsync: sym(&lib, "aclrtMemcpyAsync")?,
            Memset: sym(&lib, "aclrtMemset")?,
            GetMemInfo: sym(&lib, "aclrtGetMemInfo")?,
            GetRecentErrMsg: opt(&lib, "aclGetRecentErrMsg"),
            _lib: lib,
            path,
        })
    }
}

/// The process-wide HCCL, loaded on first use.
///
/// # Errors
/// Every place looked at, when HCCL cannot be loaded.
pub fn hccl() -> Result<&'static HcclLib, String> {
    static LIB: OnceLock<Result<HcclLib, String>> = OnceLock::new();
    LIB.get_or_init(load_hccl).as_ref().map_err(|e| e.clone())
}

/// The process-wide ACL, loaded on first use.
///
/// # Errors
/// Every place looked at, when ACL cannot be loaded.
pub fn acl() -> Result<&'static AclLib, String> {
    static LIB: OnceLock<Result<AclLib, String>> = OnceLock::new();
    LIB.get_or_init(load_acl).as_ref().map_err(|e| e.clone())
}
