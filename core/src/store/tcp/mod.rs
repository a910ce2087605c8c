//! The TCP store: a small framed protocol (`wire`), a server on its own thread whose limits
//! bound what clients can make it hold (`server`, `limits`), and a pooled client (`client`);
//! `options` are the settings both sides share.
//!
//! A malformed or oversized frame closes that connection only. The first frame of a
//! connection is a hello carrying the protocol version and the shared token, compared in
//! constant time.

mod client;
mod limits;
mod options;
mod server;
mod wire;

pub use client::TcpStore;
pub use options::{TcpStoreOptions, DEFAULT_MAX_FRAME};
pub use server::{StoreStats, TcpStoreServer};
