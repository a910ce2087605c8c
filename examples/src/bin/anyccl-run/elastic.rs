//! Elastic mode (`--elastic`): a rank whose process fails while the job has restarts left is
//! reported gone to the job's membership (`anyccl::membership`), through the store the
//! launcher hosts, and then started again as its next incarnation while the other ranks
//! run on. The report comes first: it is the fastest evidence the survivors get (sooner than
//! a liveness record going stale), and the replacement takes the next incarnation after it.

use crate::ranks::End;
use anyccl::membership::{Membership, MembershipConfig};
use anyccl::{TcpStore, TcpStoreOptions};
use std::time::{Duration, Instant};

/// The most restarts `--max-restarts` allows.
pub const MAX_RESTARTS: u32 = 1000;
/// Restarts with `--elastic` alone.
pub const DEFAULT_RESTARTS: u32 = 3;
/// The longest a report to the membership may take: past it the replacement starts anyway
/// (the survivors still see the process gone when its liveness record goes stale).
const REPORT_TIMEOUT: Duration = Duration::from_secs(5);

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
}

impl Gone {
    /// "rank 3 (pid 1234, incarnation 1) was killed by signal 9 (SIGKILL)".
    pub fn describe(&self) -> String {
        format!("rank {} (pid {}, incarnation {}) {}", self.rank, self.pid, self.incarnation, self.end.describe())
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
    /// A client of the launcher's own store, made at the first report and kept.
    store: Option<TcpStore>,
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
        Ok(Elastic { max, left: max, cfg, addr: addr.to_string(), opts, rt, store: None })
    }

    /// Record in the job's store that `gone` is gone (`Membership::report_gone`, which also
    /// proposes the next epoch to a running membership); how long that took.
    ///
    /// # Errors
    /// The store's error, or none in `REPORT_TIMEOUT`.
    pub fn report(&mut self, gone: &Gone) -> Result<Duration, String> {
        let t = Instant::now();
        let why = format!("{}, seen by anyccl-run", gone.describe());
        let (cfg, addr, opts, store) = (&self.cfg, &self.addr, &self.opts, &mut self.store);
        let once = async {
            // A kept connection may have been closed by the server: one more try on a new one.
            for attempt in 0..2 {
                if store.is_none() {
                    *store = Some(TcpStore::connect(addr.clone(), opts.clone()).await.map_err(|e| e.to_string())?);
                }
                let Some(s) = store.as_ref() else { continue };
                match Membership::report_gone(s, cfg, gone.rank, Some(gone.incarnation), &why).await {
                    Ok(()) => return Ok(()),
                    Err(e) if attempt == 0 => {
                        tracing::debug!("report to the membership failed, once more on a new connection: {e}");
                        *store = None;
                    }
                    Err(e) => return Err(e.to_string()),
                }
            }
            Err("no connection to the store".to_string())
        };
        match self.rt.block_on(async { tokio::time::timeout(REPORT_TIMEOUT, once).await }) {
            Ok(Ok(())) => Ok(t.elapsed()),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(format!("no answer from the job's store within {REPORT_TIMEOUT:?}")),
        }
    }

    /// Restarts used so far.
    pub fn used(&self) -> u32 {
        self.max - self.left
    }
}
