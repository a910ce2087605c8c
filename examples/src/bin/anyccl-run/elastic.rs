//! Elastic mode (`--elastic`): a rank whose process fails while the job has restarts left is
//! reported gone to the job's membership (`anyccl::membership`), through the store the
//! launcher hosts, and then started again as its next incarnation while the other ranks
//! run on. The report comes first: it is the fastest evidence the survivors get (sooner than
//! a liveness record going stale), and the replacement takes the next incarnation after it.
//!
//! The launcher also acts on the membership's own evidence: every `WATCH_EVERY` it reads
//! the gone records of each running rank's newest process (one multi-key read), and a
//! process the membership declared gone without the launcher (its liveness record went
//! stale: stopped with SIGSTOP, say, which no exit reports) is killed, its whole group with
//! SIGKILL, and then replaced as any failed rank is. Records of older incarnations are not
//! read; a record the launcher wrote itself is not news.

use crate::ranks::End;
use anyccl::membership::{Member, Membership, MembershipConfig};
use anyccl::{TcpStore, TcpStoreOptions};
use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The most restarts `--max-restarts` allows.
pub const MAX_RESTARTS: u32 = 1000;
/// Restarts with `--elastic` alone.
pub const DEFAULT_RESTARTS: u32 = 3;
/// The longest a report to the membership may take: past it the replacement starts anyway
/// (the survivors still see the process gone when its liveness record goes stale).
const REPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the launcher reads the membership's gone records of the running processes.
const WATCH_EVERY: Duration = Duration::from_millis(250);
/// The longest one such read may take (the launcher answers signals and exits meanwhile).
const WATCH_TIMEOUT: Duration = Duration::from_secs(1);

/// `--max-restarts`: a whole number from 0 to 1000.
pub fn restarts(s: &str) -> Result<u32, String> {
    s.parse::<u32>()
        .ok()
        .filter(|k| *k <= MAX_RESTARTS)
        .ok_or_else(|| format!("--max-restarts must be a whole number from 0 to {MAX_RESTARTS}, not {s:?}"))
}

/// A process of the job that ended: which, and how.
#[derive(Debug, Clone, Copy)]
pub struct Gone {
    pub rank: usize,
    pub pid: i32,
    pub incarnation: u64,
    pub end: End,
    /// The job's membership had declared it gone (and the launcher killed it).
    pub declared: bool,
}

impl Gone {
    /// "rank 3 (pid 1234, incarnation 1) was killed by signal 9 (SIGKILL)", with ", after
    /// the job's membership declared it gone" where it did.
    pub fn describe(&self) -> String {
        let after = if self.declared { ", after the job's membership declared it gone" } else { "" };
        format!(
            "rank {} (pid {}, incarnation {}) {}{after}",
            self.rank,
            self.pid,
            self.incarnation,
            self.end.describe()
        )
    }
}

/// The restarts left, and the way to the job's membership.
pub struct Elastic {
    pub max: u32,
    pub left: u32,
    cfg: MembershipConfig,
    addr: String,
    opts: TcpStoreOptions,
    rt: tokio::runtime::Runtime,
    /// A client of the launcher's own store, made at the first request and kept.
    store: Option<Arc<TcpStore>>,
    /// The processes the launcher itself reported gone: their records are not news.
    reported: HashSet<Member>,
    /// When the membership's records were last read.
    watched_at: Instant,
}

impl Elastic {
    /// Elastic mode with `max` restarts for the job whose store listens on `addr`.
    ///
    /// # Errors
    /// A malformed membership setting in the environment (the ranks would refuse it too), or
    /// no runtime for the store client.
    pub fn new(max: u32, addr: std::net::SocketAddr, token: &str) -> Result<Elastic, String> {
        let cfg = MembershipConfig::from_env()
            .map_err(|e| format!("--elastic reads the membership's settings as the ranks will: {e}"))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the store client's runtime: {e}"))?;
        let opts = TcpStoreOptions {
            token: Some(token.to_string()),
            connect_timeout: REPORT_TIMEOUT,
            request_timeout: REPORT_TIMEOUT,
            ..Default::default()
        };
        Ok(Elastic {
            max,
            left: max,
            cfg,
            addr: addr.to_string(),
            opts,
            rt,
            store: None,
            reported: HashSet::new(),
            watched_at: Instant::now(),
        })
    }

    /// Run `op` on a client of the job's store within `limit`: the kept client, or a new one
    /// when there is none or the kept one failed (the server may have closed it), once more.
    /// A client whose request did not finish in time is dropped, its answer unread.
    fn on_store<T, F, Fut>(&mut self, limit: Duration, op: F) -> Result<T, String>
    where
        F: Fn(Arc<TcpStore>) -> Fut,
        Fut: Future<Output = anyccl::Result<T>>,
    {
        let (addr, opts, store) = (&self.addr, &self.opts, &mut self.store);
        let once = async {
            for attempt in 0..2 {
                let s = match store.as_ref() {
                    Some(s) => s.clone(),
                    None => {
                        let s = TcpStore::connect(addr.clone(), opts.clone()).await.map_err(|e| e.to_string())?;
                        store.insert(Arc::new(s)).clone()
                    }
                };
                match op(s).await {
                    Ok(v) => return Ok(v),
                    Err(e) if attempt == 0 => {
                        tracing::debug!("a request to the job's store failed, once more on a new connection: {e}");
                        *store = None;
                    }
                    Err(e) => return Err(e.to_string()),
                }
            }
            Err("no connection to the store".to_string())
        };
        match self.rt.block_on(async { tokio::time::timeout(limit, once).await }) {
            Ok(r) => r,
            Err(_) => {
                self.store = None;
                Err(format!("no answer from the job's store within {limit:?}"))
            }
        }
    }

    /// Record in the job's store that `gone` is gone (`Membership::report_gone`, which also
    /// proposes the next epoch to a running membership); how long that took.
    ///
    /// # Errors
    /// The store's error, or none in `REPORT_TIMEOUT`.
    pub fn report(&mut self, gone: &Gone) -> Result<Duration, String> {
        let t = Instant::now();
        let why = format!("{}, seen by anyccl-run", gone.describe());
        // Noted first: whatever the store answers, a record of it is the launcher's own.
        self.reported.insert(Member { rank: gone.rank, incarnation: gone.incarnation });
        let (cfg, rank, inc) = (self.cfg.clone(), gone.rank, gone.incarnation);
        self.on_store(REPORT_TIMEOUT, |s| {
            let (cfg, why) = (cfg.clone(), why.clone());
            async move { Membership::report_gone(s.as_ref(), &cfg, rank, Some(inc), &why).await }
        })?;
        Ok(t.elapsed())
    }

    /// When the next look at the membership's records is due (`WATCH_EVERY` after the last).
    pub fn watch_due(&self) -> Instant {
        self.watched_at + WATCH_EVERY
    }

    /// Look at the membership's records for `running` (each rank's newest process, as rank
    /// and incarnation): those it declared gone on its own evidence (a liveness record gone
    /// stale: stopped, or killed without the launcher knowing), with the record's text. A
    /// record the launcher wrote itself is not one; a store that does not answer is none
    /// (looked at again at the next beat).
    pub fn declared(&mut self, running: &[Member]) -> Vec<(Member, String)> {
        self.watched_at = Instant::now();
        if running.is_empty() {
            return Vec::new();
        }
        let (cfg, of) = (self.cfg.clone(), running.to_vec());
        let got = self.on_store(WATCH_TIMEOUT, |s| {
            let (cfg, of) = (cfg.clone(), of.clone());
            async move { Membership::gone_records(s.as_ref(), &cfg, &of).await }
        });
        match got {
            Ok(records) => running
                .iter()
                .zip(records)
                .filter(|(m, _)| !self.reported.contains(m))
                .filter_map(|(m, r)| Some((*m, r?)))
                .collect(),
            Err(e) => {
                tracing::debug!("cannot read the membership's gone records: {e}");
                Vec::new()
            }
        }
    }

    /// Restarts used so far.
    pub fn used(&self) -> u32 {
        self.max - self.left
    }
}
