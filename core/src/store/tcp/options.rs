//! The settings a [`super::TcpStoreServer`] and its [`super::TcpStore`] clients share.

use crate::error::Result;
use std::time::Duration;

/// Largest frame accepted by default (64 MiB).
pub const DEFAULT_MAX_FRAME: usize = 64 << 20;

/// Settings shared by [`super::TcpStoreServer`] and [`super::TcpStore`]. The server's
/// limits bound what clients can make it hold: connections that have not authenticated
/// (`max_pending`, `hello_timeout`) and bytes of frames (`max_frame` per connection,
/// `max_buffered` over all of them).
#[derive(Debug, Clone)]
pub struct TcpStoreOptions {
    /// Shared secret; when the server has one, clients must present the same.
    pub token: Option<String>,
    /// Largest frame either side accepts. On the server it is also the most one connection
    /// buffers: a connection reads one frame at a time, and an answer larger than this is
    /// refused with an error.
    pub max_frame: usize,
    /// How long a client keeps trying to reach the server.
    pub connect_timeout: Duration,
    /// How long a client waits for the answer to a request (other than `wait`). On the
    /// server: how long the rest of a frame may take to arrive once its length has, and how
    /// long a frame may wait for room under `max_buffered`; past either, the connection is
    /// closed and what it held is freed.
    pub request_timeout: Duration,
    /// Server: how long a new connection may take to send its hello (a real client sends
    /// it as soon as it is connected).
    pub hello_timeout: Duration,
    /// Server: connections that have not authenticated yet, at most. A new connection past
    /// the limit is still served: the oldest of those that have sent nothing yet (else the
    /// oldest of them all) is closed to make room, so connections left silent cannot keep a
    /// real client out.
    pub max_pending: usize,
    /// Server: bytes that all connections together may hold in frames being read and
    /// answers being written. A frame of more than 64 KiB waits for room (up to
    /// `request_timeout`) before its body is read; smaller ones never wait, so a few large
    /// frames cannot hold up the small requests that ranks mostly make. A frame larger than
    /// this is read only while nothing else is held (small requests are brief).
    pub max_buffered: usize,
}

impl Default for TcpStoreOptions {
    fn default() -> Self {
        TcpStoreOptions {
            token: None,
            max_frame: DEFAULT_MAX_FRAME,
            connect_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(60),
            hello_timeout: Duration::from_secs(2),
            max_pending: 256,
            max_buffered: 4 * DEFAULT_MAX_FRAME,
        }
    }
}

impl TcpStoreOptions {
    /// Defaults with the token from `ANYCCL_STORE_TOKEN` when set, and `ANYCCL_INIT_TIMEOUT_S`
    /// (when set) bounding how long a client keeps trying to reach the server.
    ///
    /// # Errors
    /// `InvalidArgument` naming a malformed variable.
    pub fn from_env() -> Result<Self> {
        let mut o = TcpStoreOptions { token: crate::env_string("ANYCCL_STORE_TOKEN")?, ..Default::default() };
        if let Some(d) = crate::env_secs("ANYCCL_INIT_TIMEOUT_S")? {
            o.connect_timeout = d;
        }
        Ok(o)
    }
}
