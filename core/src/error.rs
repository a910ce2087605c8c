//! The one public error type, split by what the caller does next.

use std::time::Duration;

/// What a caller should do after an [`Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Recovery {
    /// The same call may succeed if repeated (a transient store or network hiccup).
    Retry,
    /// The communicator is unusable: abort it on every rank and build a new one.
    Rebuild,
    /// Retrying or rebuilding will not help: fix the call, the configuration or the machine.
    Fatal,
}

/// Every error anyccl returns.
///
/// Variants are chosen by the caller's next step; backend codes and library text
/// travel in fields. Use [`Error::recovery`] to decide between retry, rebuild and
/// giving up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A backend cannot run here: a library, device or driver is missing.
    #[error("{backend} backend unavailable: {reason}")]
    Unavailable {
        /// Backend name.
        backend: &'static str,
        /// What was looked for, and where.
        reason: String,
    },
    /// A call was rejected before any communication started.
    #[error("invalid argument `{arg}` to {op} on rank {rank} of group '{group}': {msg}")]
    InvalidArgument {
        /// Operation name.
        op: &'static str,
        /// The offending argument.
        arg: &'static str,
        /// The calling rank (in the group).
        rank: usize,
        /// The group name.
        group: String,
        /// What is wrong.
        msg: String,
    },
    /// The backend does not offer this operation, dtype or reduce op (see its capabilities).
    #[error("{op} is not supported by the {backend} backend: {what}")]
    Unsupported {
        /// Backend name.
        backend: &'static str,
        /// Operation name.
        op: &'static str,
        /// What exactly is missing.
        what: String,
    },
    /// A deadline passed. The communicator may be stuck: abort it.
    #[error("{op} timed out after {after:?} on rank {rank} of group '{group}'{}", fmt_detail(.detail))]
    Timeout {
        /// Operation name (with its sequence number when there is one).
        op: String,
        /// The waiting rank.
        rank: usize,
        /// The group name.
        group: String,
        /// How long the caller waited.
        after: Duration,
        /// Extra context, e.g. which peers never arrived.
        detail: String,
    },
    /// A peer died, closed its connection or reported a failure.
    #[error("peer failure seen by rank {rank} of group '{group}'{}: {detail}", fmt_peer(.peer))]
    PeerFailed {
        /// The rank that noticed.
        rank: usize,
        /// The group name.
        group: String,
        /// The failed peer, when known.
        peer: Option<usize>,
        /// What happened.
        detail: String,
    },
    /// The communicator was aborted (locally, or because it failed earlier).
    #[error("communicator of group '{group}' on rank {rank} was aborted{}", fmt_detail(.detail))]
    Aborted {
        /// The rank.
        rank: usize,
        /// The group name.
        group: String,
        /// Why, when known.
        detail: String,
    },
    /// The backend library returned an error code.
    #[error("{backend} {op} failed with code {code}: {text}")]
    Backend {
        /// Backend name.
        backend: &'static str,
        /// Operation or library call.
        op: String,
        /// The library's numeric code.
        code: i64,
        /// The library's own text (error string plus last-error text).
        text: String,
        /// What the caller should do next.
        recovery: Recovery,
        /// The library's own error value, when there is one (see [`std::error::Error::source`]).
        #[source]
        source: Option<std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>>,
    },
    /// The rendezvous store failed (connection, protocol or authentication).
    #[error("store error: {msg}")]
    Store {
        /// What happened.
        msg: String,
        /// What the caller should do next.
        recovery: Recovery,
    },
}

fn fmt_detail(d: &str) -> String {
    if d.is_empty() {
        String::new()
    } else {
        format!(": {d}")
    }
}

fn fmt_peer(p: &Option<usize>) -> String {
    match p {
        Some(p) => format!(" (peer rank {p})"),
        None => String::new(),
    }
}

impl Error {
    /// What the caller should do next.
    pub fn recovery(&self) -> Recovery {
        match self {
            Error::Unavailable { .. } | Error::InvalidArgument { .. } | Error::Unsupported { .. } => Recovery::Fatal,
            Error::Timeout { .. } | Error::PeerFailed { .. } | Error::Aborted { .. } => Recovery::Rebuild,
            Error::Backend { recovery, .. } | Error::Store { recovery, .. } => *recovery,
        }
    }

    /// Short name of the variant, for reports and tests.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Unavailable { .. } => "Unavailable",
            Error::InvalidArgument { .. } => "InvalidArgument",
            Error::Unsupported { .. } => "Unsupported",
            Error::Timeout { .. } => "Timeout",
            Error::PeerFailed { .. } => "PeerFailed",
            Error::Aborted { .. } => "Aborted",
            Error::Backend { .. } => "Backend",
            Error::Store { .. } => "Store",
        }
    }

    /// A store error that a retry may fix.
    pub fn store(msg: impl Into<String>) -> Self {
        Error::Store { msg: msg.into(), recovery: Recovery::Retry }
    }

    /// A store error that no retry fixes (protocol or authentication).
    pub fn store_fatal(msg: impl Into<String>) -> Self {
        Error::Store { msg: msg.into(), recovery: Recovery::Fatal }
    }

    /// A platform copy whose host slice (`arg`: `src` or `dst`) is not the device buffer's
    /// length; a platform has no rank or group.
    pub fn length_mismatch(op: &'static str, arg: &'static str, device_bytes: usize, host_bytes: usize) -> Self {
        Error::InvalidArgument {
            op,
            arg,
            rank: 0,
            group: String::new(),
            msg: format!("device buffer holds {device_bytes} bytes, host buffer {host_bytes}"),
        }
    }
}

/// Result with anyccl's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
