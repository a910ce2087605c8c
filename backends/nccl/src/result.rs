//! One function per NCCL symbol, returning `Result`; NCCL's and CUDA's codes mapped into
//! anyccl's errors in one place ([`error`], [`cuda`]).

#![allow(clippy::too_many_arguments)] // the C signatures

use crate::sys::{self, ncclComm_t, ncclConfig_t, ncclUniqueId, NcclLib, Stream};
use anyccl_core::{Error, Recovery};
use anyccl_device::{ErrorKind, LibError, Region};
use std::ffi::{c_int, c_void, CStr};

/// An NCCL call's error.
pub type NcclError = LibError;

/// `ncclResult_t` names.
fn name(code: c_int) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "unknown ncclResult_t",
    }
}

/// The library's own text for `code`, plus the communicator's last warning when there is one.
fn text(lib: &NcclLib, code: c_int, comm: Option<ncclComm_t>) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
    let mut t = unsafe {
        let p = (lib.GetErrorString)(code);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    if let (Some(last), Some(c)) = (lib.GetLastError, comm) {
        // SAFETY: `c` is a live communicator (callers hold its lock); the returned string is
        // owned by NCCL and valid until the next NCCL call on this thread; we copy it at once.
        let l = unsafe {
            let p = last(c);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        if !l.is_empty() {
            t = format!("{t}; last error: {l}");
        }
    }
    t
}

/// `code`, returned by `call`, as a library error: the one place NCCL's codes get a meaning.
pub fn error(lib: &NcclLib, call: &str, code: c_int, comm: Option<ncclComm_t>) -> NcclError {
    let text = text(lib, code, comm);
    let kind = match code {
        8 => ErrorKind::Timeout,
        6 => ErrorKind::Remote,
        4 | 5 => ErrorKind::Usage,
        _ if text.contains("out of memory") => ErrorKind::OutOfMemory,
        _ => ErrorKind::Internal,
    };
    LibError { library: "NCCL", call: call.to_string(), code: code as i64, name: name(code), text, kind }
}

/// Whether an NCCL call finished (`Ok(false)`) or goes on asynchronously (`Ok(true)`,
/// `ncclInProgress`).
fn progress(lib: &NcclLib, call: &str, code: c_int, comm: Option<ncclComm_t>) -> Result<bool, NcclError> {
    match code {
        sys::SUCCESS => Ok(false),
        sys::IN_PROGRESS => Ok(true),
        c => Err(error(lib, call, c, comm)),
    }
}

/// `ncclGetUniqueId`.
pub fn get_unique_id(lib: &NcclLib) -> Result<Vec<u8>, NcclError> {
    let mut id = ncclUniqueId { internal: [0; 128] };
    // SAFETY: `id` is a valid out-parameter.
    let code = unsafe { (lib.GetUniqueId)(&mut id) };
    progress(lib, "ncclGetUniqueId", code, None)?;
    Ok(anyccl_device::root_id_bytes(&id.internal))
}

/// `ncclCommInitRankConfig`; `Ok(true)` while it goes on asynchronously.
///
/// # Safety
/// `out` must stay valid until the communicator is ready (NCCL writes it from its job);
/// the device must be current.
pub unsafe fn comm_init_rank_config(
    lib: &NcclLib,
    out: *mut ncclComm_t,
    n: c_int,
    id: ncclUniqueId,
    rank: c_int,
    cfg: &mut ncclConfig_t,
) -> Result<bool, NcclError> {
    // SAFETY: per the caller; NCCL copies the config before returning.
    let code = unsafe { (lib.CommInitRankConfig)(out, n, id, rank, cfg) };
    progress(lib, "ncclCommInitRankConfig", code, None)
}

/// `ncclCommSplit`; `Ok(true)` while it goes on asynchronously.
///
/// # Safety
/// `comm` live and not used concurrently; `out` valid until the split finished.
pub unsafe fn comm_split(
    lib: &NcclLib,
    comm: ncclComm_t,
    color: c_int,
    key: c_int,
    out: *mut ncclComm_t,
    cfg: &mut ncclConfig_t,
) -> Result<bool, NcclError> {
    let Some(split) = lib.CommSplit else {
        return Err(LibError {
            library: "NCCL",
            call: "ncclCommSplit".into(),
            code: 5,
            name: "ncclInvalidUsage",
            text: "ncclCommSplit is missing from the loaded NCCL".into(),
            kind: ErrorKind::Unsupported,
        });
    };
    // SAFETY: per the caller; NCCL copies the config before returning.
    let code = unsafe { split(comm, color, key, out, cfg) };
    progress(lib, "ncclCommSplit", code, Some(comm))
}

/// `ncclCommGetAsyncError` folded with its own return code: `Ok(true)` in progress.
///
/// # Safety
/// `comm` live and not used concurrently.
pub unsafe fn comm_get_async_error(lib: &NcclLib, comm: ncclComm_t) -> Result<bool, NcclError> {
    let mut st: c_int = sys::SUCCESS;
    // SAFETY: per the caller.
    let code = unsafe { (lib.CommGetAsyncError)(comm, &mut st) };
    let code = if code != sys::SUCCESS { code } else { st };
    progress(lib, "ncclCommGetAsyncError", code, Some(comm))
}

/// `ncclCommAbort`.
///
/// # Safety
/// `comm` live; it is not used again.
pub unsafe fn comm_abort(lib: &NcclLib, comm: ncclComm_t) -> Result<(), NcclError> {
    // SAFETY: per the caller.
    let code = unsafe { (lib.CommAbort)(comm) };
    progress(lib, "ncclCommAbort", code, None).map(|_| ())
}

/// `ncclCommCount` and `ncclCommUserRank`: (rank, size).
///
/// # Safety
/// `comm` live and not used concurrently.
pub unsafe fn comm_rank_size(lib: &NcclLib, comm: ncclComm_t) -> Result<(usize, usize), NcclError> {
    let (mut n, mut r): (c_int, c_int) = (0, 0);
    // SAFETY: per the caller; valid out-parameters.
    let code = unsafe { (lib.CommCount)(comm, &mut n) };
    progress(lib, "ncclCommCount", code, Some(comm))?;
    // SAFETY: as above.
    let code = unsafe { (lib.CommUserRank)(comm, &mut r) };
    progress(lib, "ncclCommUserRank", code, Some(comm))?;
    Ok((r as usize, n as usize))
}

/// `ncclCommMemStats(ncclStatGpuMemTotal)`; `None` where the library lacks it.
///
/// # Safety
/// `comm` live and not used concurrently.
pub unsafe fn comm_mem_stats(lib: &NcclLib, comm: ncclComm_t) -> Option<u64> {
    let f = lib.CommMemStats?;
    let mut v = 0u64;
    // SAFETY: per the caller; `v` is a valid out-parameter.
    let code = unsafe { f(comm, sys::STAT_GPU_MEM_TOTAL, &mut v) };
    (code == sys::SUCCESS).then_some(v)
}

/// `ncclCommRegister`: the handle, or `None` where the library lacks it.
///
/// # Safety
/// `comm` live and not used concurrently; `at` is memory of the communicator's device that
/// stays allocated until deregistered; the device is current.
pub unsafe fn comm_register(lib: &NcclLib, comm: ncclComm_t, at: Region) -> Result<Option<usize>, NcclError> {
    let (Some(f), Some(_)) = (lib.CommRegister, lib.CommDeregister) else { return Ok(None) };
    let mut h: *mut c_void = std::ptr::null_mut();
    // SAFETY: per the caller; `h` is a valid out-parameter.
    let code = unsafe { f(comm, at.ptr, at.bytes, &mut h) };
    progress(lib, "ncclCommRegister", code, Some(comm))?;
    Ok(Some(h as usize))
}

/// `ncclCommDeregister`.
///
/// # Safety
/// `comm` live and not used concurrently; `handle` from [`comm_register`] on it, not
/// deregistered before.
pub unsafe fn comm_deregister(lib: &NcclLib, comm: ncclComm_t, handle: usize) -> Result<(), NcclError> {
    let Some(f) = lib.CommDeregister else { return Ok(()) };
    // SAFETY: per the caller.
    let code = unsafe { f(comm, handle as *mut c_void) };
    progress(lib, "ncclCommDeregister", code, Some(comm)).map(|_| ())
}

/// `ncclCommWindowRegister` with `NCCL_WIN_COLL_SYMMETRIC`: the window, or `None` where
/// the library lacks windows. Collective: returns once every rank registered its window.
///
/// # Safety
/// `comm` live and not used concurrently; `at` is memory of the communicator's device that
/// stays allocated until deregistered; the device is current.
pub unsafe fn comm_window_register(lib: &NcclLib, comm: ncclComm_t, at: Region) -> Result<Option<usize>, NcclError> {
    let (Some(f), Some(_)) = (lib.CommWindowRegister, lib.CommWindowDeregister) else { return Ok(None) };
    let mut w: *mut c_void = std::ptr::null_mut();
    // SAFETY: per the caller; `w` is a valid out-parameter.
    let code = unsafe { f(comm, at.ptr, at.bytes, &mut w, sys::WIN_COLL_SYMMETRIC) };
    progress(lib, "ncclCommWindowRegister", code, Some(comm))?;
    Ok(Some(w as usize))
}

/// `ncclCommWindowDeregister` (collective, as its register).
///
/// # Safety
/// `comm` live and not used concurrently; `win` from [`comm_window_register`] on it, not
/// deregistered before.
pub unsafe fn comm_window_deregister(lib: &NcclLib, comm: ncclComm_t, win: usize) -> Result<(), NcclError> {
    let Some(f) = lib.CommWindowDeregister else { return Ok(()) };
    // SAFETY: per the caller.
    let code = unsafe { f(comm, win as *mut c_void) };
    progress(lib, "ncclCommWindowDeregister", code, Some(comm)).map(|_| ())
}

/// `ncclMemAlloc`: `bytes` of device memory on the current device, `None` where the
/// library lacks it.
///
/// # Errors
/// The library's (out of memory among them).
pub fn mem_alloc(lib: &NcclLib, bytes: usize) -> Result<Option<*mut c_void>, NcclError> {
    let (Some(f), Some(_)) = (lib.MemAlloc, lib.MemFree) else { return Ok(None) };
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: a valid out-parameter; the device is current (callers bind it).
    let code = unsafe { f(&mut p, bytes) };
    progress(lib, "ncclMemAlloc", code, None)?;
    Ok(Some(p))
}

/// `ncclMemFree`.
///
/// # Safety
/// `ptr` from [`mem_alloc`], not freed before and not used after.
pub unsafe fn mem_free(lib: &NcclLib, ptr: *mut c_void) -> Result<(), NcclError> {
    let Some(f) = lib.MemFree else { return Ok(()) };
    // SAFETY: per the caller.
    let code = unsafe { f(ptr) };
    progress(lib, "ncclMemFree", code, None).map(|_| ())
}

/// A data-plane call's code: `Ok(true)` while NCCL still puts it on the stream.
fn launched(lib: &NcclLib, call: &str, code: c_int, comm: ncclComm_t) -> Result<bool, NcclError> {
    progress(lib, call, code, Some(comm))
}

// The data-plane calls: each returns `Ok(true)` when NCCL goes on asynchronously.
//
// # Safety (all of them)
// `comm` live and not used concurrently; the buffers are device memory valid for the
// counts until the stream passes the operation; the device is current.
anyccl_device::launch_fns! {
    table: NcclLib, comm: ncclComm_t, stream: Stream, prefix: "nccl", then: launched => Result<bool, NcclError>;
    common: (*const c_void, usize, c_int);
    broadcast => Broadcast(s: *const c_void, r: *mut c_void, n: usize, d: c_int, root: c_int);
}

/// `ncclAlltoAll`, where the library has it (`None` otherwise).
///
/// # Safety
/// See the module's data-plane calls.
pub unsafe fn all_to_all(
    lib: &NcclLib,
    s: *const c_void,
    r: *mut c_void,
    n: usize,
    d: c_int,
    comm: ncclComm_t,
    stream: Stream,
) -> Option<Result<bool, NcclError>> {
    let f = lib.AlltoAll?;
    // SAFETY: per the caller.
    let code = unsafe { f(s, r, n, d, comm, stream) };
    Some(progress(lib, "ncclAlltoAll", code, Some(comm)))
}

/// `ncclGroupStart`, `body`, `ncclGroupEnd` (always closed, whatever `body` returned).
pub fn group(lib: &NcclLib, body: impl FnOnce() -> Result<bool, NcclError>) -> Result<bool, NcclError> {
    // SAFETY: group calls only delimit the calls made in `body`.
    let s = unsafe { (lib.GroupStart)() };
    progress(lib, "ncclGroupStart", s, None)?;
    let inner = body();
    // SAFETY: closes the group opened above.
    let end = unsafe { (lib.GroupEnd)() };
    let end = progress(lib, "ncclGroupEnd", end, None);
    let inner = inner?;
    Ok(end? || inner)
}

/// Map a CUDA driver error; the driver's error stays the source.
pub fn cuda(op: &str, e: cudarc::driver::DriverError) -> Error {
    let s = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let n = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let recovery = match e.0 {
        cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Recovery::Retry,
        _ => Recovery::Fatal,
    };
    anyccl_core::Ctx::process("nccl").backend_error(op, e.0 as i64, format!("CUDA {n}: {s}"), recovery).with_source(e)
}
