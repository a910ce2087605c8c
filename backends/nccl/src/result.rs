//! NCCL and CUDA return codes turned into anyccl errors, in one place.

use crate::sys::{self, ncclComm_t, NcclLib};
use anyccl_core::{Error, Recovery};
use std::ffi::{c_int, CStr};

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
pub fn text(lib: &NcclLib, code: c_int, comm: Option<ncclComm_t>) -> String {
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
    format!("{} ({t})", name(code))
}

/// Map a failed NCCL call into anyccl's error.
pub fn error(lib: &NcclLib, op: &str, code: c_int, comm: Option<ncclComm_t>, rank: usize, group: &str) -> Error {
    let text = text(lib, code, comm);
    let call = format!("{op} on rank {rank} of group '{group}'");
    match code {
        8 => Error::Timeout {
            op: op.to_string(),
            rank,
            group: group.to_string(),
            after: std::time::Duration::ZERO,
            detail: text,
        },
        6 => Error::PeerFailed { rank, group: group.to_string(), peer: None, detail: format!("{op}: {text}") },
        4 | 5 => Error::Backend {
            backend: "nccl",
            op: call,
            code: code as i64,
            text,
            recovery: Recovery::Fatal,
            source: None,
        },
        _ => Error::Backend {
            backend: "nccl",
            op: call,
            code: code as i64,
            text,
            recovery: Recovery::Rebuild,
            source: None,
        },
    }
}

/// `Ok` for `ncclSuccess`.
pub fn check(
    lib: &NcclLib,
    op: &str,
    code: c_int,
    comm: Option<ncclComm_t>,
    rank: usize,
    group: &str,
) -> Result<(), Error> {
    if code == sys::SUCCESS {
        Ok(())
    } else {
        Err(error(lib, op, code, comm, rank, group))
    }
}

/// Map a CUDA driver error.
pub fn cuda(op: &str, e: cudarc::driver::DriverError) -> Error {
    let s = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let n = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    Error::Backend {
        backend: "nccl",
        op: op.to_string(),
        code: e.0 as i64,
        text: format!("CUDA {n}: {s}"),
        recovery: if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            Recovery::Retry
        } else {
            Recovery::Fatal
        },
        source: None,
    }
}
