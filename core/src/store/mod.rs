//! Rendezvous key-value stores: unique-id exchange, connection setup, warmup agreement.
//!
//! [`MemoryStore`] serves ranks that are threads of one process; [`TcpStore`] serves ranks
//! that are processes, against a [`TcpStoreServer`] hosted by rank 0 or the launcher.

mod tcp;

pub use tcp::{TcpStore, TcpStoreOptions, TcpStoreServer, DEFAULT_MAX_FRAME};

use crate::error::{Error, Result};
use async_trait::async_trait;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::Notify;

/// Outcome of [`Store::compare_set`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CasOutcome {
    /// Whether the new value was stored.
    pub swapped: bool,
    /// The value stored under the key after the call (`None`: absent).
    pub current: Option<Vec<u8>>,
}

/// An async key-value store shared by the ranks of a job.
///
/// # Cancel safety
/// Every method is cancel safe: a dropped call either took effect or did not, and leaves
/// the store usable.
#[async_trait]
pub trait Store: Send + Sync + fmt::Debug {
    /// Store `value` under `key`, replacing any value.
    async fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// The value under `key`, if any.
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>>;
    /// Wait until `key` exists, then return its value.
    ///
    /// # Errors
    /// [`Error::Timeout`] (rank and group left empty, the caller adds them) at `deadline`.
    async fn wait(&self, key: &str, deadline: Instant) -> Result<Vec<u8>>;
    /// Add `delta` to the integer under `key` (absent counts as 0) and return the new value.
    async fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// Store `new` if the current value equals `expected` (`None`: the key is absent).
    async fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome>;
    /// Remove `key`; whether it existed.
    async fn delete(&self, key: &str) -> Result<bool>;
}

/// Wait until all `n` ranks have reached the barrier named `key` (each name once per job),
/// without any collective: the last to arrive marks it done.
///
/// # Errors
/// `Timeout` at `deadline`, naming `rank` and the ranks that never arrived (the group is left
/// empty: the caller's barrier belongs to no communicator); store errors.
pub async fn store_barrier(store: &dyn Store, key: &str, rank: usize, n: usize, deadline: Instant) -> Result<()> {
    let started = Instant::now();
    let done = format!("{key}/done");
    store.set(&format!("{key}/rank/{rank}"), b"1").await?;
    if usize::try_from(store.add(key, 1).await?).is_ok_and(|a| a == n) {
        store.set(&done, b"1").await?;
    }
    match store.wait(&done, deadline).await {
        Err(Error::Timeout { .. }) => {
            let mut missing = Vec::new();
            for r in 0..n {
                if store.get(&format!("{key}/rank/{r}")).await?.is_none() {
                    missing.push(r);
                }
            }
            Err(Error::Timeout {
                op: format!("store barrier '{key}'"),
                rank,
                group: String::new(),
                after: started.elapsed(),
                detail: format!("ranks {missing:?} never arrived"),
            })
        }
        r => r.map(|_| ()),
    }
}

/// The generation of a new connect under `ns`, agreed through the store. Rank 0 starts a
/// new generation on every call; every other rank joins the newest generation rank 0 has
/// started since the last one this rank joined (recorded by [`joined_generation`] in the
/// store, so a restarted process never reuses an old one). A rank that retries alone thus
/// meets rank 0's next attempt rather than drifting onto a generation no one else uses.
///
/// # Errors
/// `Timeout` naming `rank` and `group` when rank 0 starts no new generation by `deadline`;
/// store errors.
pub async fn connect_generation(
    store: &dyn Store,
    ns: &str,
    rank: usize,
    group: &str,
    deadline: Instant,
) -> Result<u64> {
    let counter = format!("{ns}/gen/counter");
    if rank == 0 {
        let gen = u64::try_from(store.add(&counter, 1).await?).unwrap_or(0);
        store.set(&format!("{ns}/gen/started/{gen}"), b"1").await?;
        return Ok(gen);
    }
    let joined_key = format!("{ns}/gen/joined/{rank}");
    let joined = match store.get(&joined_key).await? {
        None => 0,
        Some(b) => std::str::from_utf8(&b)
            .ok()
            .and_then(|t| t.parse::<u64>().ok())
            .ok_or_else(|| Error::store_fatal(format!("value under '{joined_key}' is not a generation")))?,
    };
    let started = Instant::now();
    let timeout = |detail: String| Error::Timeout {
        op: "connect".into(),
        rank,
        group: group.into(),
        after: started.elapsed(),
        detail,
    };
    // Wait for a generation after the last joined one; take the newest rank 0 has started,
    // unless rank 0 has given it up already: then wait for the one after it.
    let mut want = joined + 1;
    let mut why = format!("rank 0 started no connect after generation {joined}, the last this rank joined");
    loop {
        match store.wait(&format!("{ns}/gen/started/{want}"), deadline).await {
            Ok(_) => {}
            Err(Error::Timeout { .. }) => return Err(timeout(why)),
            Err(e) => return Err(e),
        }
        let latest = u64::try_from(store.add(&counter, 0).await?).unwrap_or(0).max(want);
        if store.get(&format!("{ns}/gen/abandoned/{latest}")).await?.is_none() {
            return Ok(latest);
        }
        want = latest + 1;
        why = format!("rank 0 gave up generation {latest} and started no other");
    }
}

/// Rank 0's connect in generation `gen` of `ns` failed: ranks that arrive later skip it
/// (see [`connect_generation`]).
///
/// # Errors
/// Store errors.
pub async fn abandon_generation(store: &dyn Store, ns: &str, rank: usize, gen: u64) -> Result<()> {
    if rank == 0 {
        store.set(&format!("{ns}/gen/abandoned/{gen}"), b"1").await?;
    }
    Ok(())
}

/// Record that `rank` connected in generation `gen` of `ns` (see [`connect_generation`]).
///
/// # Errors
/// Store errors.
pub async fn joined_generation(store: &dyn Store, ns: &str, rank: usize, gen: u64) -> Result<()> {
    if rank != 0 {
        store.set(&format!("{ns}/gen/joined/{rank}"), gen.to_string().as_bytes()).await?;
    }
    Ok(())
}

/// Connect in a new generation of `ns` (see [`connect_generation`]): `connect` gets the
/// generation's namespace; its success is recorded ([`joined_generation`]), its failure (or
/// a failure to record it) lets the other ranks skip the generation
/// ([`abandon_generation`]). The one sequence every backend's connect follows.
///
/// # Errors
/// As [`connect_generation`], then `connect`'s own error; store errors.
pub async fn in_new_generation<T, Fut>(
    store: &dyn Store,
    ns: &str,
    rank: usize,
    group: &str,
    deadline: Instant,
    connect: impl FnOnce(String) -> Fut,
) -> Result<T>
where
    Fut: std::future::Future<Output = Result<T>>,
{
    let gen = connect_generation(store, ns, rank, group, deadline).await?;
    let r = match connect(format!("{ns}{gen}")).await {
        Ok(v) => joined_generation(store, ns, rank, gen).await.map(|()| v),
        Err(e) => Err(e),
    };
    if r.is_err() {
        let _ = abandon_generation(store, ns, rank, gen).await;
    }
    r
}

/// The shared state behind [`MemoryStore`] and [`TcpStoreServer`].
#[derive(Debug, Default)]
pub(crate) struct KvCore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Notify,
}

fn poisoned() -> Error {
    Error::store_fatal("store state poisoned by a panic")
}

pub(crate) fn wait_timeout(key: &str, started: Instant) -> Error {
    Error::Timeout {
        op: format!("store wait for '{key}'"),
        rank: 0,
        group: String::new(),
        after: started.elapsed(),
        detail: "the key was never set".into(),
    }
}

impl KvCore {
    pub(crate) fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.map.lock().map_err(|_| poisoned())?.insert(key.to_string(), value.to_vec());
        self.changed.notify_waiters();
        Ok(())
    }
    pub(crate) fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.map.lock().map_err(|_| poisoned())?.get(key).cloned())
    }
    /// `Ok(None)` at the deadline.
    pub(crate) async fn wait(&self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>> {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(v) = self.get(key)? {
                return Ok(Some(v));
            }
            if tokio::time::timeout_at(deadline.into(), notified).await.is_err() {
                return self.get(key);
            }
        }
    }
    pub(crate) fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut m = self.map.lock().map_err(|_| poisoned())?;
        let cur = match m.get(key) {
            None => 0,
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                .ok_or_else(|| Error::store_fatal(format!("add: value under '{key}' is not an integer")))?,
        };
        let new = cur.wrapping_add(delta);
        m.insert(key.to_string(), new.to_string().into_bytes());
        drop(m);
        self.changed.notify_waiters();
        Ok(new)
    }
    pub(crate) fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
        let mut m = self.map.lock().map_err(|_| poisoned())?;
        let cur = m.get(key).map(|v| v.as_slice());
        if cur == expected {
            m.insert(key.to_string(), new.to_vec());
            drop(m);
            self.changed.notify_waiters();
            Ok(CasOutcome { swapped: true, current: Some(new.to_vec()) })
        } else {
            Ok(CasOutcome { swapped: false, current: cur.map(|v| v.to_vec()) })
        }
    }
    pub(crate) fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.map.lock().map_err(|_| poisoned())?.remove(key).is_some())
    }
}

/// An in-process store, for ranks that are threads of one process.
#[derive(Debug, Default, Clone)]
pub struct MemoryStore {
    core: Arc<KvCore>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.core.set(key, value)
    }
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.core.get(key)
    }
    async fn wait(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        let started = Instant::now();
        self.core.wait(key, deadline).await?.ok_or_else(|| wait_timeout(key, started))
    }
    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.core.add(key, delta)
    }
    async fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
        self.core.compare_set(key, expected, new)
    }
    async fn delete(&self, key: &str) -> Result<bool> {
        self.core.delete(key)
    }
}

/// A view of another store with every key prefixed by `prefix/`.
#[derive(Debug, Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// Keys become `prefix/key` in `inner`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        PrefixStore { prefix: prefix.into(), inner }
    }
    fn k(&self, key: &str) -> String {
        format!("{}/{key}", self.prefix)
    }
}

#[async_trait]
impl Store for PrefixStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.k(key), value).await
    }
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.inner.get(&self.k(key)).await
    }
    async fn wait(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        self.inner.wait(&self.k(key), deadline).await
    }
    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.k(key), delta).await
    }
    async fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
        self.inner.compare_set(&self.k(key), expected, new).await
    }
    async fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&self.k(key)).await
    }
}
