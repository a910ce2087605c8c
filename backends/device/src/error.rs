//! A library's error ([`LibError`]) and the context that turns it into anyccl's ([`Ctx`]).

use anyccl_core::{Error, Recovery};
use std::sync::Arc;
use std::time::Duration;

/// What a library's error means for the caller; each adapter maps its codes into this in
/// one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The call was wrong (argument, usage): fix the program.
    Usage,
    /// The library gave up waiting (peers, links, execution).
    Timeout,
    /// A peer failed or reported an error.
    Remote,
    /// Device or host memory ran out (a lazy connect, typically).
    OutOfMemory,
    /// The library lacks the operation or feature.
    Unsupported,
    /// Anything else: the communicator cannot be trusted.
    Internal,
}

/// One failed library call: the library's code, its name, the library's own text.
#[derive(Debug, Clone)]
pub struct LibError {
    /// Library name (`NCCL`, `HCCL`, `ACL`, `CUDA`).
    pub library: &'static str,
    /// The C function that failed.
    pub call: String,
    /// The numeric code it returned.
    pub code: i64,
    /// The code's name (`ncclSystemError`, `HCCL_E_OOM`).
    pub name: &'static str,
    /// The library's text (error string, last error).
    pub text: String,
    /// What it means for the caller.
    pub kind: ErrorKind,
}

impl std::fmt::Display for LibError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} returned {} ({})", self.call, self.name, self.code)?;
        if !self.text.is_empty() {
            write!(f, ": {}", self.text)?;
        }
        Ok(())
    }
}

impl std::error::Error for LibError {}

/// Who errors happen to: the backend, the rank and the group, added once to every error a
/// communicator raises.
#[derive(Debug, Clone)]
pub struct Ctx {
    /// Backend name (`nccl`, `hccl`).
    pub backend: &'static str,
    /// Rank in the group.
    pub rank: usize,
    /// Group name.
    pub group: String,
}

impl Ctx {
    /// `e`, raised by `op`, as anyccl's error; the `LibError` stays reachable as the source
    /// of `Backend` errors and its words are in every variant's text.
    pub fn error(&self, op: &str, e: LibError) -> Error {
        let (rank, group) = (self.rank, self.group.clone());
        match e.kind {
            ErrorKind::Timeout => {
                Error::Timeout { op: op.to_string(), rank, group, after: Duration::ZERO, detail: e.to_string() }
            }
            ErrorKind::Remote => Error::PeerFailed { rank, group, peer: None, detail: format!("{op}: {e}") },
            kind => Error::Backend {
                backend: self.backend,
                op: format!("{op} on rank {rank} of group '{group}'"),
                code: e.code,
                text: format!("{} ({})", e.name, e.text),
                recovery: match kind {
                    ErrorKind::Usage | ErrorKind::Unsupported => Recovery::Fatal,
                    _ => Recovery::Rebuild,
                },
                source: Some(Arc::new(e)),
            },
        }
    }

    /// A deadline that passed in `op` after `after`.
    pub fn timeout(&self, op: &str, after: Duration, detail: impl Into<String>) -> Error {
        Error::Timeout { op: op.to_string(), rank: self.rank, group: self.group.clone(), after, detail: detail.into() }
    }

    /// The communicator is no longer usable, because of `detail`.
    pub fn aborted(&self, detail: impl Into<String>) -> Error {
        Error::Aborted { rank: self.rank, group: self.group.clone(), detail: detail.into() }
    }

    /// The backend lacks `op` (`what` says which part).
    pub fn unsupported(&self, op: &'static str, what: impl Into<String>) -> Error {
        Error::Unsupported { backend: self.backend, op, what: what.into() }
    }

    /// The same context for another group (a split's child).
    pub fn child(&self, rank: usize, group: &str) -> Ctx {
        Ctx { backend: self.backend, rank, group: group.to_string() }
    }
}
