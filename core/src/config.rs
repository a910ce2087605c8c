//! Configuration: launcher variables read the way PyTorch reads them (with Slurm and Open
//! MPI fallbacks), typed settings with `ANYCCL_*` overrides, and the store bootstrap.

use crate::env::{env_flag, env_parse, env_parse_at, env_secs, first_var, host_name, parse_flag};
use crate::error::{Ctx, Error, Result};
use crate::store::{Store, TcpStore, TcpStoreOptions, TcpStoreServer};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where this process sits in the job, from the launcher's variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank (`RANK`, `SLURM_PROCID`, `OMPI_COMM_WORLD_RANK`, `PMI_RANK`).
    pub rank: usize,
    /// Number of ranks (`WORLD_SIZE`, `SLURM_NTASKS`, `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`).
    pub world_size: usize,
    /// Rank on this host (`LOCAL_RANK`, `SLURM_LOCALID`, `OMPI_COMM_WORLD_LOCAL_RANK`).
    pub local_rank: usize,
    /// Ranks on this host (`LOCAL_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_SIZE`, `SLURM_NTASKS_PER_NODE`).
    pub local_world_size: usize,
    /// Store host (`MASTER_ADDR`, default `127.0.0.1`).
    pub master_addr: String,
    /// Store port (`MASTER_PORT`, default 29500).
    pub master_port: u16,
    /// The job's identity (`ANYCCL_JOB_ID`, `TORCHELASTIC_RUN_ID`, `SLURM_JOB_ID`), checked when
    /// a rank joins the store so ranks of two jobs never mix.
    pub job_id: Option<String>,
    /// How often the job was restarted (`ANYCCL_RESTART_COUNT`, `TORCHELASTIC_RESTART_COUNT`,
    /// `SLURM_RESTART_COUNT`; default 0): a restarted rank claims its rank anew.
    pub restart: usize,
    /// Which process of this rank this is within the restart (`ANYCCL_INCARNATION`, from 1;
    /// default 1): an elastic launcher starts a failed rank's replacement as the next one,
    /// which claims the rank anew while the others keep running (recovery in place). Two
    /// processes of one rank and incarnation are still refused as "started twice".
    pub incarnation: u64,
}

const OP_LAUNCH: &str = "LaunchEnv::from_env";
const OP_STORE: &str = "LaunchEnv::connect_store";
const OP_CONFIG: &str = "CommConfig::from_env";

fn parse_num(names: &[&str]) -> Result<Option<usize>> {
    match first_var(names) {
        None => Ok(None),
        Some((name, v)) => {
            // Slurm writes tasks-per-node as e.g. "4(x2)".
            let head = v.split('(').next().unwrap_or("").split(',').next().unwrap_or("");
            head.trim().parse::<usize>().map(Some).map_err(|_| {
                crate::env::bad_env(&Ctx::process("anyccl"), OP_LAUNCH, &name, &v, "a non-negative integer")
            })
        }
    }
}

impl LaunchEnv {
    /// Read the launcher's variables. Without any, this is a single-rank job.
    ///
    /// # Examples
    /// Under `torchrun` or `anyccl-run` (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
    /// ...), under Slurm (`SLURM_PROCID`, ...) or Open MPI (`OMPI_COMM_WORLD_RANK`, ...):
    /// ```
    /// let env = anyccl_core::LaunchEnv::from_env()?;
    /// assert!(env.rank < env.world_size && env.local_rank < env.local_world_size.max(1));
    /// println!("rank {} of {}, store at {}:{}", env.rank, env.world_size, env.master_addr, env.master_port);
    /// # Ok::<(), anyccl_core::Error>(())
    /// ```
    ///
    /// # Errors
    /// `InvalidArgument` naming the variable when one is malformed or inconsistent.
    pub fn from_env() -> Result<Self> {
        let rank =
            parse_num(&["ANYCCL_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"])?.unwrap_or(0);
        let world_size =
            parse_num(&["ANYCCL_WORLD_SIZE", "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])?
                .unwrap_or(1);
        let local_rank = parse_num(&[
            "ANYCCL_LOCAL_RANK",
            "LOCAL_RANK",
            "SLURM_LOCALID",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "MPI_LOCALRANKID",
        ])?
        .unwrap_or(rank);
        let local_world_size = parse_num(&[
            "ANYCCL_LOCAL_WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
            "SLURM_NTASKS_PER_NODE",
        ])?
        .unwrap_or(world_size);
        let ctx = Ctx::new("anyccl", rank, "");
        let master_addr =
            first_var(&["ANYCCL_MASTER_ADDR", "MASTER_ADDR"]).map(|x| x.1).unwrap_or_else(|| "127.0.0.1".into());
        let master_port = match first_var(&["ANYCCL_MASTER_PORT", "MASTER_PORT"]) {
            None => 29500,
            // Port 0 would bind a port no other rank can know, and connect to nothing.
            Some((n, v)) => v
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| crate::env::bad_env(&ctx, OP_LAUNCH, &n, &v, "a port number from 1 to 65535"))?,
        };
        let bad = |msg: String| ctx.invalid(OP_LAUNCH, "environment", msg);
        if world_size == 0 {
            return Err(bad("WORLD_SIZE is 0".into()));
        }
        if rank >= world_size {
            return Err(bad(format!("RANK {rank} is not below WORLD_SIZE {world_size}")));
        }
        if local_rank >= local_world_size.max(1) {
            return Err(bad(format!("LOCAL_RANK {local_rank} is not below LOCAL_WORLD_SIZE {local_world_size}")));
        }
        let job_id = first_var(&["ANYCCL_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"]).map(|x| x.1);
        let restart =
            parse_num(&["ANYCCL_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"])?.unwrap_or(0);
        let incarnation = env_parse_at(&ctx, OP_LAUNCH, "ANYCCL_INCARNATION", "a whole number from 1", |v| {
            v.parse::<u64>().ok().filter(|i| *i >= 1)
        })?
        .unwrap_or(1);
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            job_id,
            restart,
            incarnation,
        })
    }

    /// Variables a launcher sets for one rank only, from `ANYCCL_RANK_ENV`: `NAME=VALUE`
    /// pairs separated by `;`, with `{rank}` in a value replaced by the rank. Two ranks
    /// sharing one GPU under NCCL, for example, need different host identities:
    /// `ANYCCL_RANK_ENV='NCCL_HOSTID=h{rank}'`.
    ///
    /// # Errors
    /// `InvalidArgument` naming the malformed entry.
    pub fn rank_env(rank: usize) -> Result<Vec<(String, String)>> {
        let Some(spec) = env_parse("ANYCCL_RANK_ENV", "NAME=VALUE pairs", |s| Some(s.to_string()))? else {
            return Ok(Vec::new());
        };
        parse_rank_env(&spec, rank)
    }

    /// Connect to the job's store. By default the TCP store: rank 0 hosts it unless
    /// `ANYCCL_STORE_EXTERNAL=1` (the launcher sets that when it hosts the store). The
    /// server binds `ANYCCL_STORE_BIND` (default loopback); the token comes from
    /// `ANYCCL_STORE_TOKEN`. With `ANYCCL_STORE=etcd://host:port[,host:port...]` the job's
    /// keys live on that etcd cluster instead, under `anyccl/jobs/<job identity>/` (the
    /// identity is required there: etcd keeps keys across jobs).
    ///
    /// # Errors
    /// `InvalidArgument` for a malformed `ANYCCL_STORE` or an etcd store without a job
    /// identity; `Store` when the server cannot be bound or reached.
    pub async fn connect_store(&self) -> Result<(Arc<dyn Store>, Option<TcpStoreServer>)> {
        let opts = TcpStoreOptions::from_env()?;
        let ctx = Ctx::new("anyccl", self.rank, "");
        let store = env_parse_at(&ctx, OP_STORE, "ANYCCL_STORE", "tcp or etcd://...", |s| Some(s.to_string()))?;
        if let Some(spec) = store.filter(|s| s != "tcp") {
            let bad = |msg: String| ctx.invalid(OP_STORE, "ANYCCL_STORE", msg);
            let endpoints = spec
                .strip_prefix("etcd://")
                .ok_or_else(|| bad(format!("{spec:?}: expected tcp or etcd://host:port[,host:port...]")))?;
            let job = self.job_id.clone().ok_or_else(|| {
                bad("an etcd store keeps keys across jobs: set a job identity (ANYCCL_JOB_ID, TORCHELASTIC_RUN_ID or \
                     SLURM_JOB_ID) to keep this job's apart"
                    .into())
            })?;
            let client: Arc<dyn Store> = Arc::new(
                crate::EtcdStore::connect(endpoints, &format!("anyccl/jobs/{job}"), opts.connect_timeout).await?,
            );
            self.join(client.as_ref(), &spec).await?;
            return Ok((Arc::new(ClaimedStore::watch(client, self.duplicate_key(), self.rank)), None));
        }
        let external = env_parse_at(&ctx, OP_STORE, "ANYCCL_STORE_EXTERNAL", "0 or 1", parse_flag)?.unwrap_or(false);
        let bind = env_parse_at(&ctx, OP_STORE, "ANYCCL_STORE_BIND", "an IP address", |h| h.parse::<IpAddr>().ok())?;
        let server = if self.rank == 0 && !external {
            let host = bind.unwrap_or(IpAddr::from([127, 0, 0, 1]));
            Some(TcpStoreServer::start(SocketAddr::new(host, self.master_port), opts.clone())?)
        } else {
            None
        };
        let addr = format!("{}:{}", self.master_addr, self.master_port);
        let client: Arc<dyn Store> = Arc::new(TcpStore::connect(addr.clone(), opts).await?);
        self.join(client.as_ref(), &addr).await?;
        let store = ClaimedStore::watch(client, self.duplicate_key(), self.rank);
        Ok((Arc::new(store), server))
    }

    /// This process's claim on its rank: per restart, and per incarnation past the first.
    fn claim_key(&self) -> String {
        match self.incarnation {
            1 => format!("anyccl/restart{}/rank{}", self.restart, self.rank),
            i => format!("anyccl/restart{}/rank{}/incarnation{i}", self.restart, self.rank),
        }
    }

    fn duplicate_key(&self) -> String {
        format!("{}/duplicate", self.claim_key())
    }

    /// Join the job in its store: the first rank to arrive records the job's identity and
    /// every later one must carry the same; each rank claims its number once per restart.
    /// Two jobs started by hand on one port thus fail at once with an error naming both,
    /// instead of one job's rank finishing the other's work.
    async fn join(&self, store: &dyn Store, addr: &str) -> Result<()> {
        let refuse = |msg: String| Ctx::new("anyccl", self.rank, "").invalid(OP_STORE, "environment", msg);
        let job = self.job_id.clone().unwrap_or_default();
        let cas = store.compare_set("anyccl/job", None, job.as_bytes()).await?;
        let theirs = cas.current.map(|c| String::from_utf8_lossy(&c).into_owned()).unwrap_or_default();
        if !cas.swapped && theirs != job {
            let name = |j: &str| if j.is_empty() { "no job identity".to_string() } else { format!("job '{j}'") };
            return Err(refuse(format!(
                "the store at {addr} belongs to {}, this rank has {} (two jobs on one MASTER_PORT?)",
                name(&theirs),
                name(&job)
            )));
        }
        let me = format!("pid {} on {} ({:016x})", std::process::id(), host_name(), rand::random::<u64>());
        let cas = store.compare_set(&self.claim_key(), None, me.as_bytes()).await?;
        if !cas.swapped {
            let other = cas.current.map(|c| String::from_utf8_lossy(&c).into_owned()).unwrap_or_default();
            // The process that claimed the rank first hears of it too (see ClaimedStore).
            let _ = store.set(&self.duplicate_key(), format!("{me} claimed rank {} too", self.rank).as_bytes()).await;
            return Err(refuse(format!(
                "rank {}{} of this job already joined the store at {addr} ({other}); this process ({me}) claims \
                 it too: two jobs on one MASTER_PORT, or a rank started twice (set ANYCCL_JOB_ID to tell jobs apart; \
                 a replacement in the same restart needs the next ANYCCL_INCARNATION)",
                self.rank,
                match self.incarnation {
                    1 => String::new(),
                    i => format!(" (incarnation {i})"),
                }
            )));
        }
        Ok(())
    }
}

/// The job store as a rank holds it: once another process claims this rank too (and is
/// refused, see [`LaunchEnv::connect_store`]), every call fails with an error saying so,
/// waits in progress included. A duplicate that arrives after this process's last store
/// call fails alone: a job identity (`ANYCCL_JOB_ID`, which the launcher sets) tells jobs
/// apart from the start.
#[derive(Debug)]
struct ClaimedStore {
    inner: Arc<dyn Store>,
    duplicate: Arc<(std::sync::OnceLock<String>, tokio::sync::Notify)>,
    rank: usize,
    watcher: Option<tokio::task::JoinHandle<()>>,
}

impl ClaimedStore {
    fn watch(inner: Arc<dyn Store>, key: String, rank: usize) -> ClaimedStore {
        let duplicate: Arc<(std::sync::OnceLock<String>, tokio::sync::Notify)> = Arc::default();
        let (st, dup) = (inner.clone(), duplicate.clone());
        let watcher = tokio::runtime::Handle::try_current().ok().map(|h| {
            h.spawn(async move {
                loop {
                    match st.wait(&key, Instant::now() + Duration::from_secs(3600)).await {
                        Ok(v) => {
                            let _ = dup.0.set(String::from_utf8_lossy(&v).into_owned());
                            dup.1.notify_waiters();
                            return;
                        }
                        Err(Error::Timeout { .. }) => continue,
                        // The store went away (the job ended): nothing left to watch.
                        Err(_) => return,
                    }
                }
            })
        });
        ClaimedStore { inner, duplicate, rank, watcher }
    }

    /// A wait of the inner store, ended early when another process claims this rank.
    async fn waiting<T>(&self, wait: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        let notified = self.duplicate.1.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        self.check()?;
        tokio::select! {
            r = wait => r,
            _ = notified => Err(self.check().err().unwrap_or_else(|| Error::store("duplicate rank"))),
        }
    }

    fn check(&self) -> Result<()> {
        match self.duplicate.0.get() {
            None => Ok(()),
            Some(who) => Err(Ctx::new("anyccl", self.rank, "").invalid(
                "store",
                "environment",
                format!(
                    "another process claimed this rank after this one ({who}): two jobs on one MASTER_PORT, or a \
                     rank started twice; this rank stops rather than run another job's work (set ANYCCL_JOB_ID)"
                ),
            )),
        }
    }
}

impl Drop for ClaimedStore {
    fn drop(&mut self) {
        if let Some(w) = self.watcher.take() {
            w.abort();
        }
    }
}

#[async_trait::async_trait]
impl Store for ClaimedStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.check()?;
        self.inner.set(key, value).await
    }
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.check()?;
        self.inner.get(key).await
    }
    async fn wait(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        self.waiting(self.inner.wait(key, deadline)).await
    }
    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.check()?;
        self.inner.add(key, delta).await
    }
    async fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<crate::store::CasOutcome> {
        self.check()?;
        self.inner.compare_set(key, expected, new).await
    }
    async fn delete(&self, key: &str) -> Result<bool> {
        self.check()?;
        self.inner.delete(key).await
    }
    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        self.check()?;
        self.inner.delete_prefix(prefix).await
    }
    async fn wait_many(&self, keys: &[String], deadline: Instant) -> Result<Vec<Option<Vec<u8>>>> {
        self.waiting(self.inner.wait_many(keys, deadline)).await
    }
}

fn parse_rank_env(spec: &str, rank: usize) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for entry in spec.split(';').map(str::trim).filter(|e| !e.is_empty()) {
        let valid = |n: &str| {
            !n.is_empty()
                && !n.starts_with(|c: char| c.is_ascii_digit())
                && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        };
        match entry.split_once('=') {
            Some((name, value)) if valid(name.trim()) => {
                out.push((name.trim().to_string(), value.replace("{rank}", &rank.to_string())))
            }
            _ => {
                return Err(Ctx::new("anyccl", rank, "").invalid(
                    "LaunchEnv::rank_env",
                    "ANYCCL_RANK_ENV",
                    format!("entry {entry:?} is not NAME=VALUE with NAME a variable name"),
                ))
            }
        }
    }
    Ok(out)
}

/// Settings of a communicator, with `ANYCCL_*` overrides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommConfig {
    /// Default wait for one operation in typed helpers (`ANYCCL_TIMEOUT_S`, default 600).
    pub op_timeout: Duration,
    /// Limit on connecting and splitting (`ANYCCL_INIT_TIMEOUT_S`, default 300).
    pub init_timeout: Duration,
    /// Operations kept by the flight recorder (`ANYCCL_FLIGHT_RECORDER`, default 2048, at
    /// most 1048576: 64 bytes each, allocated when the communicator is made).
    pub flight_recorder: usize,
    /// Detail mode (`ANYCCL_DEBUG=detail`): members compare every collective's fingerprint
    /// through the store before it runs, so ranks issuing different collectives get an
    /// error naming both calls on every backend. Costs a store round trip per collective.
    pub detail: bool,
    /// Staging buffer a device library reserves per communicator and direction, in MiB
    /// (`ANYCCL_BUFFER_MB`; HCCL's `hcclBufferSize`, which each communicator holds twice).
    /// `None` leaves the library's default (HCCL: `HCCL_BUFFSIZE`, else 200).
    pub buffer_mb: Option<u32>,
    /// Fewest thread blocks (CTAs) a collective uses (`ANYCCL_MIN_CTAS`, 1 to 64; NCCL's
    /// `minCTAs`). More than the library's default buys large-message bandwidth for more
    /// connect memory (the warmup report shows it). `None`: the library's default. A
    /// backend without the setting (`Capabilities::cta_settings` false) refuses it.
    pub min_ctas: Option<u32>,
    /// Most thread blocks a collective uses (`ANYCCL_MAX_CTAS`, 1 to 64; NCCL's `maxCTAs`).
    pub max_ctas: Option<u32>,
    /// Thread-block cluster size (`ANYCCL_CGA_CLUSTER_SIZE`, 0 to 8; NCCL's
    /// `cgaClusterSize`).
    pub cga_cluster_size: Option<u32>,
    /// Device backends: a `Work` gets no event at its call; the first look at it (a poll, a
    /// wait, its drop) records one at the stream's end, shared by every operation issued
    /// before that look (`ANYCCL_SHARED_COMPLETION=1`). It saves an event record per
    /// operation (0.5-0.9 us measured on H200 hosts, a tenth of a small all_reduce's host time) for
    /// engines that issue runs of operations and wait them in order. The cost: waiting on
    /// a `Work` also waits for every operation issued after it before the look, so a
    /// program whose later operation needs its peers to pass a host-side step that waits
    /// for this rank (a barrier after the wait) blocks until the operation timeout.
    /// Off by default: each operation gets its own event, recorded as the next one is issued
    /// (a `Work` waited before anything else is issued asks the stream, and needs none).
    pub shared_completion: bool,
}

impl CommConfig {
    /// Whether the settings hold together: CTA counts 1 to 64 with the minimum at most the
    /// maximum, a cluster size 0 to 8, a buffer of at least 1 MiB.
    ///
    /// # Errors
    /// A message naming the setting.
    pub fn check(&self) -> std::result::Result<(), String> {
        for (name, v) in [("min_ctas", self.min_ctas), ("max_ctas", self.max_ctas)] {
            if let Some(v) = v.filter(|v| !(1..=64).contains(v)) {
                return Err(format!("CommConfig::{name} = {v} is not from 1 to 64"));
            }
        }
        if let (Some(lo), Some(hi)) = (self.min_ctas, self.max_ctas) {
            if lo > hi {
                return Err(format!("CommConfig::min_ctas = {lo} is above max_ctas = {hi}"));
            }
        }
        if let Some(c) = self.cga_cluster_size.filter(|c| *c > 8) {
            return Err(format!("CommConfig::cga_cluster_size = {c} is not from 0 to 8"));
        }
        if self.buffer_mb == Some(0) {
            return Err("CommConfig::buffer_mb = 0: at least 1 MiB".into());
        }
        let most = crate::recorder::MAX_RECORDS;
        if !(1..=most).contains(&self.flight_recorder) {
            return Err(format!(
                "CommConfig::flight_recorder = {} (ANYCCL_FLIGHT_RECORDER) is not from 1 to {most} records (64 bytes \
                 each, allocated at connect)",
                self.flight_recorder
            ));
        }
        Ok(())
    }

    /// The settings that need `Capabilities::cta_settings`, by name, where set.
    pub fn cta_settings(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.min_ctas.is_some() {
            v.push("min_ctas");
        }
        if self.max_ctas.is_some() {
            v.push("max_ctas");
        }
        if self.cga_cluster_size.is_some() {
            v.push("cga_cluster_size");
        }
        v
    }
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            op_timeout: Duration::from_secs(600),
            init_timeout: Duration::from_secs(300),
            flight_recorder: 2048,
            detail: false,
            buffer_mb: None,
            min_ctas: None,
            max_ctas: None,
            cga_cluster_size: None,
            shared_completion: false,
        }
    }
}

impl CommConfig {
    /// Defaults with `ANYCCL_*` overrides applied.
    ///
    /// # Errors
    /// `InvalidArgument` naming a malformed variable.
    pub fn from_env() -> Result<Self> {
        let mut c = CommConfig::default();
        if let Some(d) = env_secs("ANYCCL_TIMEOUT_S")? {
            c.op_timeout = d;
        }
        if let Some(d) = env_secs("ANYCCL_INIT_TIMEOUT_S")? {
            c.init_timeout = d;
        }
        if let Some(mode) = crate::env::env_choice("ANYCCL_DEBUG", &["off", "info", "detail"])? {
            c.detail = mode == "detail";
        }
        let most = u32::MAX - 1;
        c.buffer_mb = env_parse("ANYCCL_BUFFER_MB", &format!("a whole number of MiB from 1 to {most}"), |v| {
            v.parse::<u32>().ok().filter(|m| (1..=most).contains(m))
        })?;
        for (var, slot, least, most) in [
            ("ANYCCL_MIN_CTAS", &mut c.min_ctas, 1u32, 64u32),
            ("ANYCCL_MAX_CTAS", &mut c.max_ctas, 1, 64),
            ("ANYCCL_CGA_CLUSTER_SIZE", &mut c.cga_cluster_size, 0, 8),
        ] {
            let expected = format!("a whole number from {least} to {most}");
            if let Some(n) =
                env_parse(var, &expected, |v| v.parse::<u32>().ok().filter(|n| (least..=most).contains(n)))?
            {
                *slot = Some(n);
            }
        }
        c.check().map_err(|msg| {
            Ctx::process("anyccl").invalid(
                OP_CONFIG,
                "environment",
                format!("{msg} (ANYCCL_MIN_CTAS, ANYCCL_MAX_CTAS)"),
            )
        })?;
        if let Some(on) = env_flag("ANYCCL_SHARED_COMPLETION")? {
            c.shared_completion = on;
        }
        if let Some(n) = env_parse("ANYCCL_FLIGHT_RECORDER", "a count", |v| v.parse().ok())? {
            c.flight_recorder = n;
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::parse_rank_env;

    #[test]
    fn rank_env_substitutes_the_rank() {
        let got = parse_rank_env("NCCL_HOSTID=h{rank}; FOO=a=b ;", 3).unwrap();
        assert_eq!(got, vec![("NCCL_HOSTID".into(), "h3".into()), ("FOO".into(), "a=b".into())]);
        assert!(parse_rank_env("", 0).unwrap().is_empty());
    }

    #[test]
    fn rank_env_rejects_entries_without_a_name() {
        for bad in ["novalue", "=x", "1A=x", "A B=x"] {
            let e = parse_rank_env(bad, 1).unwrap_err().to_string();
            assert!(e.contains("ANYCCL_RANK_ENV"), "{bad}: {e}");
        }
    }

    #[test]
    fn flight_recorder_sizes_outside_1_to_max_are_refused() {
        use super::CommConfig;
        for bad in [0, crate::recorder::MAX_RECORDS + 1, usize::MAX] {
            let e = CommConfig { flight_recorder: bad, ..CommConfig::default() }.check().unwrap_err();
            assert!(e.contains("flight_recorder") && e.contains("ANYCCL_FLIGHT_RECORDER"), "{e}");
        }
        for good in [1, 2048, crate::recorder::MAX_RECORDS] {
            assert!(CommConfig { flight_recorder: good, ..CommConfig::default() }.check().is_ok());
        }
    }
}
