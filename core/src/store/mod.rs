//! Rendezvous key-value stores: unique-id exchange, connection setup, warmup agreement.
//!
//! [`MemoryStore`] serves ranks that are threads of one process; [`TcpStore`] serves ranks
//! that are processes, against a [`TcpStoreServer`] hosted by rank 0 or the launcher;
//! [`EtcdStore`] keeps a job's keys on an etcd cluster, for jobs whose rendezvous outgrows
//! one store host.

mod etcd;
mod tcp;

pub use etcd::EtcdStore;
pub use tcp::{StoreStats, TcpStore, TcpStoreOptions, TcpStoreServer, DEFAULT_MAX_FRAME};

use crate::error::{Ctx, Error, Result};
use async_trait::async_trait;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
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
    /// Remove every key that starts with `prefix` (a non-empty prefix), in one request where
    /// the store allows; how many there were. What a long job no longer needs (an old
    /// epoch's or generation's keys) goes this way, so that the store does not grow with
    /// the job's length. A store that does not implement it (the default) keeps them and
    /// says so: `Unsupported`, which the library's callers log and go on after (the keys
    /// stay, and the store grows with the job).
    ///
    /// # Errors
    /// `InvalidArgument` for an empty prefix; `Unsupported` by default; store errors.
    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        if prefix.is_empty() {
            return Err(empty_prefix());
        }
        Err(Ctx::new("store", 0, "").unsupported(
            "delete_prefix",
            format!("this store cannot remove the keys under '{prefix}' (Store::delete_prefix is not implemented)"),
        ))
    }
    /// Wait until every key in `keys` exists or `deadline` passes, in one request where
    /// the store allows: each key's value, `None` for those still absent at the deadline
    /// (never a `Timeout`). With a deadline already passed it reads them all at once. A
    /// group leader gathers its members' values with it, so a group of `n` costs the
    /// store one request instead of `n`.
    ///
    /// # Errors
    /// Store errors.
    async fn wait_many(&self, keys: &[String], deadline: Instant) -> Result<Vec<Option<Vec<u8>>>> {
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            out.push(match self.wait(k, deadline).await {
                Ok(v) => Some(v),
                Err(Error::Timeout { .. }) => None,
                Err(e) => return Err(e),
            });
        }
        Ok(out)
    }
}

/// Wait until all `n` ranks have reached the barrier named `key` (each name once per job),
/// without any collective. Each rank marks its arrival; rank 0 gathers every mark in one
/// multi-key wait and marks the barrier done, so the store serves a constant number of
/// requests per rank however many ranks there are.
///
/// # Errors
/// `InvalidArgument` when `rank` is not below `n`; `Timeout` at `deadline`, naming `rank`
/// and the ranks that never arrived (the group is left empty: the caller's barrier belongs
/// to no communicator); store errors.
pub async fn store_barrier(store: &dyn Store, key: &str, rank: usize, n: usize, deadline: Instant) -> Result<()> {
    if rank >= n {
        return Err(Ctx::new("store", rank, "").invalid(
            "store_barrier",
            "rank",
            format!("rank {rank} is not one of the barrier's {n} ranks"),
        ));
    }
    let started = Instant::now();
    let done = format!("{key}/done");
    let mark = |r: usize| format!("{key}/rank/{r}");
    store.set(&mark(rank), b"1").await?;
    // Every rank's mark: read by rank 0, or at the deadline, only.
    let marks = || (0..n).map(mark).collect::<Vec<String>>();
    let timeout = |arrived: &[Option<Vec<u8>>]| {
        let missing: Vec<usize> = arrived.iter().enumerate().filter(|(_, a)| a.is_none()).map(|(r, _)| r).collect();
        let e = Ctx::new("store", rank, "").timeout(
            format!("store barrier '{key}'"),
            started.elapsed(),
            format!("ranks {missing:?} never arrived"),
        );
        // A failure path like any other: the flight recorder's dump says this rank waited.
        crate::trace::dump_error(&e.to_string());
        e
    };
    if rank == 0 {
        let arrived = store.wait_many(&marks(), deadline).await?;
        if arrived.iter().any(Option::is_none) {
            return Err(timeout(&arrived));
        }
        return store.set(&done, b"1").await;
    }
    match store.wait(&done, deadline).await {
        Err(Error::Timeout { .. }) => Err(timeout(&store.wait_many(&marks(), Instant::now()).await?)),
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
    let timeout = |detail: String| Ctx::new("store", rank, group).timeout("connect", started.elapsed(), detail);
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

/// The shared state behind [`MemoryStore`] and [`TcpStoreServer`]. Waiters wait on their
/// own key: a write wakes only the waiters of the key it wrote, so a store with thousands of
/// waiting clients does work per write in proportion to that key's waiters, not to all.
#[derive(Debug, Default)]
pub(crate) struct KvCore {
    state: Mutex<Kv>,
}

#[derive(Debug, Default)]
struct Kv {
    map: HashMap<String, Vec<u8>>,
    /// The notifier of each key someone waits for; removed when the key is written.
    waiters: HashMap<String, Arc<Notify>>,
}

/// A waiter's registration, removed on drop when no other waiter shares it.
struct Waiting<'a> {
    core: &'a KvCore,
    key: &'a str,
    notify: Arc<Notify>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Ok(mut kv) = self.core.state.lock() {
            // Two references: the map's and this one; none other waits on it.
            let mine = kv.waiters.get(self.key).is_some_and(|n| Arc::ptr_eq(n, &self.notify));
            if mine && Arc::strong_count(&self.notify) == 2 {
                kv.waiters.remove(self.key);
            }
        }
    }
}

fn poisoned() -> Error {
    Error::store_fatal("store state poisoned by a panic")
}

pub(crate) fn wait_timeout(key: &str, started: Instant) -> Error {
    Ctx::new("store", 0, "").timeout(format!("store wait for '{key}'"), started.elapsed(), "the key was never set")
}

impl KvCore {
    fn lock(&self) -> Result<MutexGuard<'_, Kv>> {
        self.state.lock().map_err(|_| poisoned())
    }
    /// Wake the waiters of `key`, after the write under `kv`.
    fn wrote(kv: MutexGuard<'_, Kv>, key: &str) {
        let mut kv = kv;
        let waiters = kv.waiters.remove(key);
        drop(kv);
        if let Some(n) = waiters {
            n.notify_waiters();
        }
    }
    pub(crate) fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut kv = self.lock()?;
        kv.map.insert(key.to_string(), value.to_vec());
        Self::wrote(kv, key);
        Ok(())
    }
    pub(crate) fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.lock()?.map.get(key).cloned())
    }
    /// `Ok(None)` at the deadline.
    pub(crate) async fn wait(&self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>> {
        loop {
            let notify = {
                let mut kv = self.lock()?;
                if let Some(v) = kv.map.get(key) {
                    return Ok(Some(v.clone()));
                }
                kv.waiters.entry(key.to_string()).or_default().clone()
            };
            let waiting = Waiting { core: self, key, notify };
            let notified = waiting.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // A write between the lock's release and `enable` woke no one: look again.
            if let Some(v) = self.get(key)? {
                return Ok(Some(v));
            }
            if tokio::time::timeout_at(deadline.into(), notified).await.is_err() {
                return self.get(key);
            }
        }
    }
    /// Each key's value once it exists, `None` for those absent at `deadline`.
    pub(crate) async fn wait_many(&self, keys: &[String], deadline: Instant) -> Result<Vec<Option<Vec<u8>>>> {
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            out.push(self.wait(k, deadline).await?);
        }
        Ok(out)
    }
    pub(crate) fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut kv = self.lock()?;
        let cur = match kv.map.get(key) {
            None => 0,
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                .ok_or_else(|| Error::store_fatal(format!("add: value under '{key}' is not an integer")))?,
        };
        let new = cur.wrapping_add(delta);
        kv.map.insert(key.to_string(), new.to_string().into_bytes());
        Self::wrote(kv, key);
        Ok(new)
    }
    pub(crate) fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
        let mut kv = self.lock()?;
        let cur = kv.map.get(key).map(|v| v.as_slice());
        if cur == expected {
            kv.map.insert(key.to_string(), new.to_vec());
            Self::wrote(kv, key);
            Ok(CasOutcome { swapped: true, current: Some(new.to_vec()) })
        } else {
            Ok(CasOutcome { swapped: false, current: cur.map(|v| v.to_vec()) })
        }
    }
    pub(crate) fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.lock()?.map.remove(key).is_some())
    }
    pub(crate) fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        if prefix.is_empty() {
            return Err(empty_prefix());
        }
        let mut kv = self.lock()?;
        let before = kv.map.len();
        kv.map.retain(|k, _| !k.starts_with(prefix));
        Ok((before - kv.map.len()) as u64)
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

    /// How many keys it holds, and their keys' and values' bytes (what a long job leaves in
    /// its store).
    pub fn size(&self) -> (usize, usize) {
        self.core.lock().map_or((0, 0), |kv| (kv.map.len(), kv.map.iter().map(|(k, v)| k.len() + v.len()).sum()))
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
    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        self.core.delete_prefix(prefix)
    }
    async fn wait_many(&self, keys: &[String], deadline: Instant) -> Result<Vec<Option<Vec<u8>>>> {
        self.core.wait_many(keys, deadline).await
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
    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        if prefix.is_empty() {
            return Err(empty_prefix());
        }
        self.inner.delete_prefix(&self.k(prefix)).await
    }
    async fn wait_many(&self, keys: &[String], deadline: Instant) -> Result<Vec<Option<Vec<u8>>>> {
        let keys: Vec<String> = keys.iter().map(|k| self.k(k)).collect();
        self.inner.wait_many(&keys, deadline).await
    }
}

/// The error for `delete_prefix("")`, which would remove every key of the job.
pub(crate) fn empty_prefix() -> Error {
    Ctx::new("store", 0, "").invalid("delete_prefix", "prefix", "an empty prefix would delete every key of the store")
}

#[cfg(test)]
mod tests {
    use super::{CasOutcome, MemoryStore, Store};
    use crate::{Error, Result};
    use std::time::Instant;

    /// A store that implements only what it must: its `delete_prefix` is the default.
    #[derive(Debug, Default)]
    struct Minimal(MemoryStore);

    #[async_trait::async_trait]
    impl Store for Minimal {
        async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
            self.0.set(key, value).await
        }
        async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
            self.0.get(key).await
        }
        async fn wait(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
            self.0.wait(key, deadline).await
        }
        async fn add(&self, key: &str, delta: i64) -> Result<i64> {
            self.0.add(key, delta).await
        }
        async fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
            self.0.compare_set(key, expected, new).await
        }
        async fn delete(&self, key: &str) -> Result<bool> {
            self.0.delete(key).await
        }
    }

    /// A store without `delete_prefix` says so (the callers log it and go on), rather than
    /// answering "0 removed" while every key stays.
    #[test]
    fn a_store_without_delete_prefix_says_so() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let s = Minimal::default();
        rt.block_on(async {
            s.set("old/1", b"x").await.unwrap();
            match s.delete_prefix("old/").await {
                Err(Error::Unsupported { op: "delete_prefix", what, .. }) => assert!(what.contains("'old/'"), "{what}"),
                other => panic!("expected Unsupported, got {other:?}"),
            }
            assert!(matches!(s.delete_prefix("").await, Err(Error::InvalidArgument { .. })));
            assert!(s.get("old/1").await.unwrap().is_some());
        });
    }
}
