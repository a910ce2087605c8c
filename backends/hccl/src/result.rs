//! One function per HCCL and ACL symbol, returning `Result`; HCCL's and ACL's codes mapped
//! into anyccl's errors in one place ([`error`], [`acl_error`]).

#![allow(clippy::too_many_arguments)] // the C signatures

use crate::sys::{
    self, aclrtEvent, aclrtStream, AclLib, Code, HcclComm, HcclCommConfig, HcclLib, HcclRootInfo, HcclSendRecvItem,
};
use anyccl_core::{Error, Recovery};
use anyccl_device::{ErrorKind, LibError, Region};
use std::ffi::{c_int, c_void, CStr};

/// An HCCL call's error.
pub type HcclError = LibError;

/// `HcclResult` names (`hccl_types.h`).
pub fn name(code: Code) -> &'static str {
    const NAMES: [&str; 25] = [
        "HCCL_SUCCESS",
        "HCCL_E_PARA",
        "HCCL_E_PTR",
        "HCCL_E_MEMORY",
        "HCCL_E_INTERNAL",
        "HCCL_E_NOT_SUPPORT",
        "HCCL_E_NOT_FOUND",
        "HCCL_E_UNAVAIL",
        "HCCL_E_SYSCALL",
        "HCCL_E_TIMEOUT",
        "HCCL_E_OPEN_FILE_FAILURE",
        "HCCL_E_TCP_CONNECT",
        "HCCL_E_ROCE_CONNECT",
        "HCCL_E_TCP_TRANSFER",
        "HCCL_E_ROCE_TRANSFER",
        "HCCL_E_RUNTIME",
        "HCCL_E_DRV",
        "HCCL_E_PROFILING",
        "HCCL_E_CCE",
        "HCCL_E_NETWORK",
        "HCCL_E_AGAIN",
        "HCCL_E_REMOTE",
        "HCCL_E_SUSPENDING",
        "HCCL_E_OPRETRY_FAIL",
        "HCCL_E_OOM",
    ];
    usize::try_from(code).ok().and_then(|c| NAMES.get(c).copied()).unwrap_or("unknown HcclResult")
}

/// What each `HcclResult` means for the caller: the one place HCCL's codes get a meaning.
pub fn kind(code: Code) -> ErrorKind {
    match code {
        1 | 2 => ErrorKind::Usage,
        3 | 24 => ErrorKind::OutOfMemory,
        5 => ErrorKind::Unsupported,
        9 => ErrorKind::Timeout,
        11..=14 | 19 | 21 => ErrorKind::Remote,
        _ => ErrorKind::Internal,
    }
}

fn cstr(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the libraries return NUL-terminated strings they own; copied at once.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// ACL's most recent error message on this thread (HCCL reports through it too).
fn recent(acl: Option<&AclLib>) -> String {
    match acl.and_then(|a| a.GetRecentErrMsg) {
        // SAFETY: no arguments; returns a thread-local string or null.
        Some(f) => cstr(unsafe { f() }),
        None => String::new(),
    }
}

/// `code`, returned by `call`, as a library error with HCCL's text
/// (`HcclGetErrorString`, plus ACL's most recent message).
pub fn error(lib: &HcclLib, call: &str, code: Code) -> HcclError {
    // SAFETY: HcclGetErrorString returns a static string for any code.
    let mut text = cstr(unsafe { (lib.GetErrorString)(code) });
    let last = recent(sys::acl().ok());
    if !last.is_empty() {
        text = format!("{text}; {last}");
    }
    LibError { library: "HCCL", call: call.to_string(), code: code as i64, name: name(code), text, kind: kind(code) }
}

fn check(lib: &HcclLib, call: &str, code: Code) -> Result<(), HcclError> {
    if code == sys::SUCCESS {
        Ok(())
    } else {
        Err(error(lib, call, code))
    }
}

/// An ACL error as anyccl's (no rank or group: the runtime has none); ACL's code and
/// message stay the source.
pub fn acl_error(acl: &AclLib, call: &str, code: Code) -> Error {
    let text = recent(Some(acl));
    let e = LibError {
        library: "ACL",
        call: call.to_string(),
        code: code as i64,
        name: if code == sys::ACL_ERROR_RT_MEMORY_ALLOCATION { "ACL_ERROR_RT_MEMORY_ALLOCATION" } else { "aclError" },
        text: text.clone(),
        kind: ErrorKind::Internal,
    };
    let recovery = if code == sys::ACL_ERROR_RT_MEMORY_ALLOCATION { Recovery::Retry } else { Recovery::Fatal };
    let words = format!("ACL error {code}: {text}");
    anyccl_core::Ctx::process("hccl").backend_error(call, code as i64, words, recovery).with_source(e)
}

/// `Ok` for `ACL_SUCCESS`.
///
/// # Errors
/// [`acl_error`].
pub fn acl_check(acl: &AclLib, call: &str, code: Code) -> Result<(), Error> {
    if code == sys::SUCCESS {
        Ok(())
    } else {
        Err(acl_error(acl, call, code))
    }
}

/// `HcclGetRootInfo`.
pub fn get_root_info(lib: &HcclLib) -> Result<Vec<u8>, HcclError> {
    let mut r = HcclRootInfo { internal: [0; sys::ROOT_INFO_BYTES] };
    // SAFETY: `r` is a valid out-parameter of the right size.
    check(lib, "HcclGetRootInfo", unsafe { (lib.GetRootInfo)(&mut r) })?;
    Ok(anyccl_device::root_id_bytes(&r.internal))
}

/// `HcclCommInitRootInfoConfig` (blocks until every rank joined or HCCL times out).
///
/// # Safety
/// The calling thread's device is set (`aclrtSetDevice`).
pub unsafe fn comm_init_root_info_config(
    lib: &HcclLib,
    n: u32,
    root: &HcclRootInfo,
    rank: u32,
    cfg: &HcclCommConfig,
) -> Result<HcclComm, HcclError> {
    let mut c: HcclComm = std::ptr::null_mut();
    // SAFETY: per the caller; valid in and out parameters.
    let code = unsafe { (lib.CommInitRootInfoConfig)(n, root, rank, cfg, &mut c) };
    check(lib, "HcclCommInitRootInfoConfig", code).map(|_| c)
}

/// `HcclCreateSubCommConfig`; `Ok(None)` when the library lacks it or answers
/// `HCCL_E_NOT_SUPPORT`.
///
/// # Safety
/// `parent` live and not used concurrently; the device is set.
pub unsafe fn create_sub_comm_config(
    lib: &HcclLib,
    parent: HcclComm,
    ranks: &mut [u32],
    id: u64,
    sub_rank: u32,
    cfg: &mut HcclCommConfig,
) -> Result<Option<HcclComm>, HcclError> {
    let Some(f) = lib.CreateSubCommConfig else { return Ok(None) };
    let (mut p, mut c): (HcclComm, HcclComm) = (parent, std::ptr::null_mut());
    // SAFETY: per the caller; valid in and out parameters.
    let code = unsafe { f(&mut p, ranks.len() as u32, ranks.as_mut_ptr(), id, sub_rank, cfg, &mut c) };
    match code {
        sys::SUCCESS => Ok(Some(c)),
        sys::E_NOT_SUPPORT => Ok(None),
        code => Err(error(lib, "HcclCreateSubCommConfig", code)),
    }
}

/// `HcclCommSuspend` where present, then `HcclCommDestroy`.
///
/// # Safety
/// `comm` live; not used again.
pub unsafe fn comm_destroy(lib: &HcclLib, comm: HcclComm) -> Result<(), HcclError> {
    if let Some(s) = lib.CommSuspend {
        // SAFETY: per the caller. Suspending first stops queued work from starting.
        let _ = unsafe { s(comm) };
    }
    // SAFETY: per the caller.
    check(lib, "HcclCommDestroy", unsafe { (lib.CommDestroy)(comm) })
}

/// `HcclGetRankId` and `HcclGetRankSize`: (rank, size).
///
/// # Safety
/// `comm` live and not used concurrently.
pub unsafe fn rank_size(lib: &HcclLib, comm: HcclComm) -> Result<(usize, usize), HcclError> {
    let (mut r, mut n) = (0u32, 0u32);
    // SAFETY: per the caller; valid out-parameters.
    check(lib, "HcclGetRankId", unsafe { (lib.GetRankId)(comm, &mut r) })?;
    // SAFETY: as above.
    check(lib, "HcclGetRankSize", unsafe { (lib.GetRankSize)(comm, &mut n) })?;
    Ok((r as usize, n as usize))
}

/// `HcclGetCommAsyncError`: `Err` with the communicator's error when it has one.
///
/// # Safety
/// `comm` live and not used concurrently.
pub unsafe fn get_comm_async_error(lib: &HcclLib, comm: HcclComm) -> Result<(), HcclError> {
    let mut e: Code = sys::SUCCESS;
    // SAFETY: per the caller.
    check(lib, "HcclGetCommAsyncError", unsafe { (lib.GetCommAsyncError)(comm, &mut e) })?;
    check(lib, "HcclGetCommAsyncError", e)
}

/// A data-plane call's code.
fn launched(lib: &HcclLib, call: &str, code: Code, _comm: HcclComm) -> Result<(), HcclError> {
    check(lib, call, code)
}

// The data-plane calls. # Safety (all of them): `comm` live and not used concurrently;
// the buffers are device memory valid for the counts until the stream passes the
// operation; the device is set.
anyccl_device::launch_fns! {
    table: HcclLib, comm: HcclComm, stream: aclrtStream, prefix: "Hccl", then: launched => Result<(), HcclError>;
    common: (*mut c_void, u64, u32);
    /// One buffer, sent from `root` and received in place by every other rank.
    broadcast => Broadcast(b: *mut c_void, n: u64, d: c_int, root: u32);
}

/// `HcclCommRegister` (flag 0, reserved): the handle, or `None` where the library lacks it.
///
/// # Safety
/// `comm` live and not used concurrently; `at` is memory of the communicator's device that
/// stays allocated until deregistered; the device is set.
pub unsafe fn comm_register(lib: &HcclLib, comm: HcclComm, at: Region) -> Result<Option<usize>, HcclError> {
    let (Some(f), Some(_)) = (lib.CommRegister, lib.CommDeregister) else { return Ok(None) };
    let mut h: *mut c_void = std::ptr::null_mut();
    // SAFETY: per the caller; `h` is a valid out-parameter.
    check(lib, "HcclCommRegister", unsafe { f(comm, at.ptr, at.bytes as u64, &mut h, 0) })?;
    Ok(Some(h as usize))
}

/// `HcclCommDeregister`.
///
/// # Safety
/// `comm` live and not used concurrently; `handle` from [`comm_register`] on it, not
/// deregistered before.
pub unsafe fn comm_deregister(lib: &HcclLib, comm: HcclComm, handle: usize) -> Result<(), HcclError> {
    let Some(f) = lib.CommDeregister else { return Ok(()) };
    // SAFETY: per the caller.
    check(lib, "HcclCommDeregister", unsafe { f(comm, handle as *mut c_void) })
}

/// `HcclBarrier`.
///
/// # Safety
/// See the module's data-plane calls.
pub unsafe fn barrier(lib: &HcclLib, comm: HcclComm, stream: aclrtStream) -> Result<(), HcclError> {
    // SAFETY: per the caller.
    check(lib, "HcclBarrier", unsafe { (lib.Barrier)(comm, stream) })
}

fn missing(call: &str) -> HcclError {
    LibError {
        library: "HCCL",
        call: call.to_string(),
        code: 5,
        name: "HCCL_E_NOT_SUPPORT",
        text: format!("{call} is missing from the loaded HCCL"),
        kind: ErrorKind::Unsupported,
    }
}

/// `HcclAlltoAll`.
///
/// # Safety
/// See the module's data-plane calls.
pub unsafe fn all_to_all(
    lib: &HcclLib,
    s: *const c_void,
    n: u64,
    d: c_int,
    r: *const c_void,
    comm: HcclComm,
    stream: aclrtStream,
) -> Result<(), HcclError> {
    let f = lib.AlltoAll.ok_or_else(|| missing("HcclAlltoAll"))?;
    // SAFETY: per the caller.
    check(lib, "HcclAlltoAll", unsafe { f(s, n, d, r, n, d, comm, stream) })
}

/// `HcclAlltoAllV` with `uint64_t` counts and displacements.
///
/// # Safety
/// See the module's data-plane calls; the four arrays hold one entry per rank.
pub unsafe fn all_to_all_v(
    lib: &HcclLib,
    s: *const c_void,
    sc: &[u64],
    sd: &[u64],
    r: *const c_void,
    rc: &[u64],
    rd: &[u64],
    d: c_int,
    comm: HcclComm,
    stream: aclrtStream,
) -> Result<(), HcclError> {
    let f = lib.AlltoAllV.ok_or_else(|| missing("HcclAlltoAllV"))?;
    let p = |v: &[u64]| v.as_ptr() as *const c_void;
    // SAFETY: per the caller; the arrays outlive the call (HCCL copies them when it enqueues).
    check(lib, "HcclAlltoAllV", unsafe { f(s, p(sc), p(sd), d, r, p(rc), p(rd), d, comm, stream) })
}

/// `HcclBatchSendRecv`.
///
/// # Safety
/// See the module's data-plane calls.
pub unsafe fn batch_send_recv(
    lib: &HcclLib,
    items: &mut [HcclSendRecvItem],
    comm: HcclComm,
    stream: aclrtStream,
) -> Result<(), HcclError> {
    let f = lib.BatchSendRecv.ok_or_else(|| missing("HcclBatchSendRecv"))?;
    // SAFETY: per the caller.
    check(lib, "HcclBatchSendRecv", unsafe { f(items.as_mut_ptr(), items.len() as u32, comm, stream) })
}

/// `aclrtCreateEvent` + `aclrtRecordEvent`.
///
/// # Safety
/// `stream` live; the device is set.
pub unsafe fn record_event(acl: &AclLib, stream: aclrtStream) -> Result<aclrtEvent, Error> {
    let mut e: aclrtEvent = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    acl_check(acl, "aclrtCreateEvent", unsafe { (acl.CreateEvent)(&mut e) })?;
    // SAFETY: both handles live.
    if let Err(err) = acl_check(acl, "aclrtRecordEvent", unsafe { (acl.RecordEvent)(e, stream) }) {
        // SAFETY: created above, destroyed once.
        unsafe { (acl.DestroyEvent)(e) };
        return Err(err);
    }
    Ok(e)
}

/// `aclrtQueryEventStatus`: whether the work before the event finished.
///
/// # Safety
/// `e` live.
pub unsafe fn event_done(acl: &AclLib, e: aclrtEvent) -> Result<bool, Error> {
    let mut st: c_int = 0;
    // SAFETY: per the caller; valid out-parameter.
    acl_check(acl, "aclrtQueryEventStatus", unsafe { (acl.QueryEventStatus)(e, &mut st) })?;
    Ok(st == sys::ACL_EVENT_RECORDED_STATUS_COMPLETE)
}

/// Whether everything enqueued on `stream` has finished (`aclrtStreamQuery`); `None` where
/// the loaded ACL lacks it.
///
/// # Safety
/// `stream` is a live stream.
pub unsafe fn stream_done(acl: &AclLib, stream: aclrtStream) -> Result<Option<bool>, Error> {
    let Some(query) = acl.StreamQuery else { return Ok(None) };
    let mut st: c_int = -1;
    // SAFETY: per the caller; valid out-parameter.
    acl_check(acl, "aclrtStreamQuery", unsafe { query(stream, &mut st) })?;
    Ok(Some(st == sys::ACL_STREAM_STATUS_COMPLETE))
}

/// `aclrtMemcpyAsync` device to device on `stream` (a step of an HCCL operation).
///
/// # Safety
/// Both addresses hold `bytes` bytes of the stream's device until the stream passes the copy.
pub unsafe fn memcpy_async_d2d(
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    stream: aclrtStream,
) -> Result<(), HcclError> {
    let acl = sys::acl().map_err(|e| LibError {
        library: "ACL",
        call: "aclrtMemcpyAsync".into(),
        code: -1,
        name: "unavailable",
        text: e,
        kind: ErrorKind::Internal,
    })?;
    // SAFETY: per the caller.
    let code = unsafe { (acl.MemcpyAsync)(dst, bytes, src, bytes, sys::ACL_MEMCPY_DEVICE_TO_DEVICE, stream) };
    if code == sys::SUCCESS {
        return Ok(());
    }
    Err(LibError {
        library: "ACL",
        call: "aclrtMemcpyAsync".into(),
        code: code as i64,
        name: "aclError",
        text: recent(Some(acl)),
        kind: ErrorKind::Internal,
    })
}
