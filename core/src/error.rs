//! The one public error type, split by what the caller does next, and [`Ctx`], the one
//! way to build it: who an error happens to (backend, rank, group) is said once, and every
//! constructor adds it.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The cause an error keeps (its [`std::error::Error::source`]): a library's error, an I/O
/// error, a store's socket error.
pub type Source = Arc<dyn std::error::Error + Send + Sync + 'static>;

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
    #[error("invalid argument `{arg}` to {op} on rank {rank}{}: {msg}", fmt_group(.group))]
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
    #[error("{op} timed out after {after:?} on rank {rank}{}{}", fmt_group(.group), fmt_detail(.detail))]
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
        /// What reported the timeout (a library's error), when something did.
        #[source]
        source: Option<Source>,
    },
    /// A peer died, closed its connection or reported a failure.
    #[error("peer failure seen by rank {rank}{}{}: {detail}", fmt_group(.group), fmt_peer(.peer))]
    PeerFailed {
        /// The rank that noticed.
        rank: usize,
        /// The group name.
        group: String,
        /// The failed peer, when known.
        peer: Option<usize>,
        /// What happened.
        detail: String,
        /// The error that showed it (a closed socket, a library's remote error), when known.
        #[source]
        source: Option<Source>,
    },
    /// The communicator was aborted (locally, or because it failed earlier).
    #[error("communicator{} on rank {rank} was aborted{}", fmt_group(.group), fmt_detail(.detail))]
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
        source: Option<Source>,
    },
    /// The rendezvous store failed (connection, protocol or authentication).
    #[error("store error: {msg}")]
    Store {
        /// What happened.
        msg: String,
        /// What the caller should do next.
        recovery: Recovery,
        /// The socket's or server's error, when there is one.
        #[source]
        source: Option<Source>,
    },
    /// Reading or writing a file (a checkpoint shard, a saved plan, a dump, a lock) failed, or
    /// its content is not what it must be.
    #[error("{op}{} failed on rank {rank}: {detail}", fmt_path(.path))]
    Io {
        /// What was being done (`load checkpoint shard`, `save plan`).
        op: String,
        /// The file.
        path: String,
        /// The rank that failed.
        rank: usize,
        /// What is wrong (the system's words are also in `source`).
        detail: String,
        /// What the caller should do next: `Retry` for transient system errors, `Fatal` for a
        /// file whose content or kind is wrong.
        recovery: Recovery,
        /// The system's error, when there is one.
        #[source]
        source: Option<Source>,
    },
}

fn fmt_detail(d: &str) -> String {
    if d.is_empty() {
        String::new()
    } else {
        format!(": {d}")
    }
}

/// ` of group 'g'`, or nothing for an error raised outside any group (a tool, start-up).
fn fmt_group(g: &str) -> String {
    if g.is_empty() {
        String::new()
    } else {
        format!(" of group '{g}'")
    }
}

fn fmt_path(p: &str) -> String {
    if p.is_empty() {
        String::new()
    } else {
        format!(" of '{p}'")
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
            Error::Backend { recovery, .. } | Error::Store { recovery, .. } | Error::Io { recovery, .. } => *recovery,
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
            Error::Io { .. } => "Io",
        }
    }

    /// A backend that cannot run here, with what was looked for and where.
    pub fn unavailable(backend: &'static str, reason: impl Into<String>) -> Self {
        Error::Unavailable { backend, reason: reason.into() }
    }

    /// A store error that a retry may fix.
    pub fn store(msg: impl Into<String>) -> Self {
        Error::Store { msg: msg.into(), recovery: Recovery::Retry, source: None }
    }

    /// A store error that no retry fixes (protocol or authentication).
    pub fn store_fatal(msg: impl Into<String>) -> Self {
        Error::Store { msg: msg.into(), recovery: Recovery::Fatal, source: None }
    }

    /// The same error keeping `cause` as its [`std::error::Error::source`], on the variants
    /// that keep one (timeout, peer failure, backend, store, I/O); the others are returned as
    /// they are.
    #[must_use]
    pub fn with_source(mut self, cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        match &mut self {
            Error::Timeout { source, .. }
            | Error::PeerFailed { source, .. }
            | Error::Backend { source, .. }
            | Error::Store { source, .. }
            | Error::Io { source, .. } => *source = Some(Arc::new(cause)),
            _ => {}
        }
        self
    }

    /// The same error, with `what` before its detail (timeouts, peer failures, aborts, I/O,
    /// store and invalid arguments; the others are returned as they are): for a caller that
    /// knows more of the story than the place that raised it.
    #[must_use]
    pub fn context(mut self, what: impl std::fmt::Display) -> Self {
        match &mut self {
            Error::Timeout { detail, .. }
            | Error::PeerFailed { detail, .. }
            | Error::Aborted { detail, .. }
            | Error::Io { detail, .. }
            | Error::InvalidArgument { msg: detail, .. }
            | Error::Store { msg: detail, .. } => {
                *detail = if detail.is_empty() { what.to_string() } else { format!("{what}: {detail}") }
            }
            _ => {}
        }
        self
    }

    /// A platform copy whose host slice (`arg`: `src` or `dst`) is not the device buffer's
    /// length; a platform has no rank or group.
    pub fn length_mismatch(op: &'static str, arg: &'static str, device_bytes: usize, host_bytes: usize) -> Self {
        Ctx::new("platform", 0, "").invalid(
            op,
            arg,
            format!("device buffer holds {device_bytes} bytes, host buffer {host_bytes}"),
        )
    }
}

/// Who errors happen to: the backend (or tool), the rank and the group, said once and added
/// by every constructor.
///
/// # Examples
/// ```
/// use anyccl_core::{Ctx, Recovery};
/// let ctx = Ctx::new("cpu", 3, "dp");
/// let e = ctx.invalid("all_reduce", "count", "must be a multiple of 4");
/// assert_eq!(e.to_string(), "invalid argument `count` to all_reduce on rank 3 of group 'dp': must be a multiple of 4");
/// assert_eq!(e.recovery(), Recovery::Fatal);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ctx {
    /// Backend or tool name (`nccl`, `cpu`, `anyccl-recover`).
    pub backend: &'static str,
    /// Rank in the group (in the job where there is no group yet).
    pub rank: usize,
    /// Group name (empty where there is no group yet).
    pub group: String,
}

impl Ctx {
    /// The context of rank `rank` of group `group` on `backend`.
    pub fn new(backend: &'static str, rank: usize, group: impl Into<String>) -> Self {
        Ctx { backend, rank, group: group.into() }
    }

    /// The same backend for another group (a split's child).
    pub fn child(&self, rank: usize, group: &str) -> Ctx {
        Ctx { backend: self.backend, rank, group: group.to_string() }
    }

    /// A call rejected before any communication: `arg` of `op` is wrong because `msg`.
    #[cold]
    pub fn invalid(&self, op: &'static str, arg: &'static str, msg: impl Into<String>) -> Error {
        Error::InvalidArgument { op, arg, rank: self.rank, group: self.group.clone(), msg: msg.into() }
    }

    /// The backend lacks `op` (`what` says which part).
    #[cold]
    pub fn unsupported(&self, op: &'static str, what: impl Into<String>) -> Error {
        Error::Unsupported { backend: self.backend, op, what: what.into() }
    }

    /// A deadline that passed in `op` after waiting `after`.
    #[cold]
    pub fn timeout(&self, op: impl Into<String>, after: Duration, detail: impl Into<String>) -> Error {
        Error::Timeout {
            op: op.into(),
            rank: self.rank,
            group: self.group.clone(),
            after,
            detail: detail.into(),
            source: None,
        }
    }

    /// A peer (`peer`, when known) died, closed its connection or reported a failure.
    #[cold]
    pub fn peer_failed(&self, peer: Option<usize>, detail: impl Into<String>) -> Error {
        Error::PeerFailed { rank: self.rank, group: self.group.clone(), peer, detail: detail.into(), source: None }
    }

    /// The communicator is no longer usable, because of `detail`.
    #[cold]
    pub fn aborted(&self, detail: impl Into<String>) -> Error {
        Error::Aborted { rank: self.rank, group: self.group.clone(), detail: detail.into() }
    }

    /// The library returned `code` in `op`, with its own `text`.
    #[cold]
    pub fn backend_error(&self, op: &str, code: i64, text: impl Into<String>, recovery: Recovery) -> Error {
        Error::Backend { backend: self.backend, op: self.located(op), code, text: text.into(), recovery, source: None }
    }

    /// `op` on the file or device at `path` failed with the system's error `cause` (kept as
    /// the source); interrupted, would-block and timed-out errors are `Retry`, the rest
    /// `Fatal`.
    #[cold]
    pub fn io(&self, op: impl Into<String>, path: impl AsRef<Path>, cause: std::io::Error) -> Error {
        use std::io::ErrorKind as K;
        let recovery = match cause.kind() {
            K::Interrupted | K::WouldBlock | K::TimedOut => Recovery::Retry,
            _ => Recovery::Fatal,
        };
        Error::Io {
            op: op.into(),
            path: path.as_ref().display().to_string(),
            rank: self.rank,
            detail: cause.to_string(),
            recovery,
            source: Some(Arc::new(cause)),
        }
    }

    /// The file at `path` is not what `op` needs (corrupt, too large, not a regular file):
    /// `detail` says how. Fatal: reading it again gives the same.
    pub fn file(&self, op: impl Into<String>, path: impl AsRef<Path>, detail: impl Into<String>) -> Error {
        Error::Io {
            op: op.into(),
            path: path.as_ref().display().to_string(),
            rank: self.rank,
            detail: detail.into(),
            recovery: Recovery::Fatal,
            source: None,
        }
    }

    /// `op` with this context's place, for text that names it (`all_reduce on rank 1 of group
    /// 'dp'`).
    pub fn located(&self, op: &str) -> String {
        if self.group.is_empty() {
            format!("{op} on rank {}", self.rank)
        } else {
            format!("{op} on rank {} of group '{}'", self.rank, self.group)
        }
    }
}

/// Result with anyccl's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
