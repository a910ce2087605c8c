//! A library's error ([`LibError`]) and how it becomes anyccl's, in a communicator's
//! context (core's `Ctx`).

use anyccl_core::{Ctx, Error, Recovery};
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

impl LibError {
    /// This error, raised by `op` after waiting `waited` (how long the failing call or the
    /// init it belongs to ran), as anyccl's, in `ctx`'s backend, rank and group. The
    /// `LibError` stays reachable as the source and its words are in every variant's text.
    pub fn into_error(self, ctx: &Ctx, op: &str, waited: Duration) -> Error {
        let text = self.to_string();
        match self.kind {
            ErrorKind::Timeout => ctx.timeout(op, waited, text).with_source(self),
            ErrorKind::Remote => ctx.peer_failed(None, format!("{op}: {text}")).with_source(self),
            kind => {
                let recovery = match kind {
                    ErrorKind::Usage | ErrorKind::Unsupported => Recovery::Fatal,
                    _ => Recovery::Rebuild,
                };
                let words = format!("{} ({})", self.name, self.text);
                ctx.backend_error(op, self.code, words, recovery).with_source(self)
            }
        }
    }
}
