//! A backend that moves no data but connects like a lazy device library: the first
//! operation of each kind (and size class, and peer for point-to-point) "connects", taking
//! simulated device memory and time; a collective completes only when every member of its
//! group that lives in this process has issued it; a rank can be told to fail, hang or kill
//! its process at its first operation.

use anyccl::raw::{async_trait, Collective, CommInfo, Ctx, WorkImpl};
use anyccl::{
    AllToAllSplits, Backend, Buf, BufMut, Capabilities, DType, Device, DeviceKind, DeviceMemory, HostMemory, MemInfo,
    P2POp, Platform, Recovery, ReduceOp, Result, Work,
};
use anyccl_examples::errln;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a simulated rank does wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Nothing.
    None,
    /// Its first operation fails at enqueue.
    Fail,
    /// Its first operation never completes (until the communicator is aborted).
    Hang,
    /// Its first operation kills its process (`SIGKILL`, as `kill -9` would).
    Die,
}

/// How a simulated connect costs.
#[derive(Debug, Clone, Copy)]
pub struct Costs {
    /// Time of each new connection.
    pub connect: Duration,
    /// Device memory each new connection takes.
    pub memory: u64,
}

/// What the ranks of one process share: arrivals at each collective.
#[derive(Debug, Default)]
pub struct Arrivals {
    /// (group id, collective number) → members arrived.
    seen: Mutex<HashMap<(u64, u64), usize>>,
}

impl Arrivals {
    fn arrive(&self, key: (u64, u64)) {
        let mut m = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry(key).or_default() += 1;
    }
    fn count(&self, key: (u64, u64)) -> usize {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).get(&key).copied().unwrap_or(0)
    }
}

/// One rank's communicator of one group.
#[derive(Debug)]
pub struct SimComm {
    info: CommInfo,
    caps: Capabilities,
    group: u64,
    /// Members of the group in this process (a collective waits for them).
    local_members: usize,
    arrivals: Arc<Arrivals>,
    connected: Mutex<HashSet<String>>,
    /// Simulated device memory held by this communicator.
    held: AtomicU64,
    /// The rank's device memory in use, shared by its communicators and its platform.
    used: Arc<AtomicU64>,
    collectives: AtomicU64,
    aborted: Arc<AtomicBool>,
    fault: Fault,
    costs: Costs,
}

/// The simulated device's capabilities: the CPU backend's host buffers and dtypes, but
/// lazy connects, memory counted per communicator, small probes (nothing moves, so size
/// only selects the connection), any rank count, and none of the CPU backend's checks.
pub fn capabilities() -> Result<Capabilities> {
    let host = anyccl::backends::Cpu.capabilities()?;
    Ok(Capabilities {
        split: false,
        lazy_connect: true,
        memory_stats: true,
        warmup_small_bytes: 64,
        warmup_large_bytes: 4096,
        max_world_size: 1 << 20,
        max_local_ranks: 1 << 20,
        detects_peer_failure: false,
        detects_mismatch: false,
        ..host
    })
}

impl SimComm {
    /// Rank `rank` of a group of `size` (id `group`), `local_members` of them in this process.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        caps: Capabilities,
        rank: usize,
        size: usize,
        group: u64,
        local_members: usize,
        arrivals: Arc<Arrivals>,
        used: Arc<AtomicU64>,
        fault: Fault,
        costs: Costs,
    ) -> Self {
        SimComm {
            info: CommInfo { backend: "sim", rank, size, device: Device::CPU },
            caps,
            group,
            local_members,
            arrivals,
            connected: Mutex::new(HashSet::new()),
            held: AtomicU64::new(0),
            used,
            collectives: AtomicU64::new(0),
            aborted: Arc::new(AtomicBool::new(false)),
            fault,
            costs,
        }
    }

    /// Issue one operation: connect on first use of `conn`, wait for the local members of a
    /// collective (`collective`), inject this rank's fault.
    fn issue<'a>(&'a self, op: &'static str, conn: String, collective: bool) -> Result<Work<'a>> {
        match self.fault {
            Fault::None => {}
            Fault::Fail => {
                let text = format!("injected failure of {op} on rank {}", self.info.rank);
                return Err(Ctx::new("sim", self.info.rank, "").backend_error(op, -99, text, Recovery::Rebuild));
            }
            Fault::Hang => {
                return Ok(Work::new(SimWork {
                    ready: None,
                    rendezvous: None,
                    arrivals: self.arrivals.clone(),
                    aborted: self.aborted.clone(),
                    rank: self.info.rank,
                }))
            }
            Fault::Die => {
                errln!("anyccl-sim: rank {} kills its process at its first {op} (as kill -9)", self.info.rank);
                let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL);
                std::process::abort();
            }
        }
        let fresh = self.connected.lock().unwrap_or_else(|p| p.into_inner()).insert(conn);
        let ready = if fresh {
            self.held.fetch_add(self.costs.memory, Ordering::Relaxed);
            self.used.fetch_add(self.costs.memory, Ordering::Relaxed);
            Instant::now() + self.costs.connect
        } else {
            Instant::now()
        };
        let rendezvous = collective.then(|| {
            let key = (self.group, self.collectives.fetch_add(1, Ordering::Relaxed));
            self.arrivals.arrive(key);
            (key, self.local_members)
        });
        Ok(Work::new(SimWork {
            ready: Some(ready),
            rendezvous,
            arrivals: self.arrivals.clone(),
            aborted: self.aborted.clone(),
            rank: self.info.rank,
        }))
    }

    fn sized(&self, op: &'static str, bytes: usize) -> Result<Work<'_>> {
        let class = if bytes <= self.caps.warmup_small_bytes { "small" } else { "large" };
        self.issue(op, format!("{op}/{class}"), true)
    }
}

struct SimWork {
    /// When the connect finishes; `None`: never (a hang).
    ready: Option<Instant>,
    rendezvous: Option<((u64, u64), usize)>,
    arrivals: Arc<Arrivals>,
    aborted: Arc<AtomicBool>,
    rank: usize,
}

impl WorkImpl for SimWork {
    fn poll(&mut self) -> Result<bool> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(Ctx::new("sim", self.rank, "").aborted("aborted"));
        }
        let Some(ready) = self.ready else { return Ok(false) };
        if Instant::now() < ready {
            return Ok(false);
        }
        Ok(self.rendezvous.is_none_or(|(key, n)| self.arrivals.count(key) >= n))
    }
    fn wait_for(&mut self, timeout: Duration) -> Result<bool> {
        let end = Instant::now() + timeout;
        loop {
            if self.poll()? {
                return Ok(true);
            }
            if Instant::now() >= end {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    fn drain(&mut self) {}
}

#[async_trait]
impl Collective for SimComm {
    fn info(&self) -> &CommInfo {
        &self.info
    }
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }
    fn memory_held(&self) -> Option<u64> {
        Some(self.held.load(Ordering::Relaxed))
    }
    fn all_reduce<'a>(&'a self, _: Option<Buf<'a>>, recv: BufMut<'a>, _: ReduceOp) -> Result<Work<'a>> {
        self.sized("all_reduce", recv.bytes())
    }
    fn reduce<'a>(&'a self, _: Option<Buf<'a>>, recv: BufMut<'a>, _: ReduceOp, _: usize) -> Result<Work<'a>> {
        self.sized("reduce", recv.bytes())
    }
    fn broadcast<'a>(&'a self, _: Option<Buf<'a>>, recv: BufMut<'a>, _: usize) -> Result<Work<'a>> {
        self.sized("broadcast", recv.bytes())
    }
    fn all_gather<'a>(&'a self, _: Option<Buf<'a>>, recv: BufMut<'a>) -> Result<Work<'a>> {
        self.sized("all_gather", recv.bytes())
    }
    fn reduce_scatter<'a>(&'a self, _: Option<Buf<'a>>, recv: BufMut<'a>, _: ReduceOp) -> Result<Work<'a>> {
        self.sized("reduce_scatter", recv.bytes())
    }
    fn all_to_all<'a>(&'a self, _: Buf<'a>, recv: BufMut<'a>, _: Option<&AllToAllSplits>) -> Result<Work<'a>> {
        self.sized("all_to_all", recv.bytes())
    }
    fn send<'a>(&'a self, _: Buf<'a>, peer: usize) -> Result<Work<'a>> {
        self.issue("send", format!("p2p/{peer}"), false)
    }
    fn recv<'a>(&'a self, _: BufMut<'a>, peer: usize) -> Result<Work<'a>> {
        self.issue("recv", format!("p2p/{peer}"), false)
    }
    fn p2p_group<'a>(&'a self, ops: Vec<P2POp<'a>>) -> Result<Work<'a>> {
        let mut peers: Vec<usize> = ops.iter().map(P2POp::peer).collect();
        peers.sort_unstable();
        peers.dedup();
        let conn = peers.iter().map(|p| format!("p2p/{p}")).collect::<Vec<_>>().join(",");
        self.issue("p2p_group", conn, false)
    }
    fn barrier(&self) -> Result<Work<'_>> {
        self.issue("barrier", "barrier".into(), true)
    }
    async fn health(&self, _: Instant) -> Result<()> {
        Ok(())
    }
    async fn abort(&self, _: Instant) -> Result<()> {
        self.aborted.store(true, Ordering::Release);
        Ok(())
    }
    async fn split(&self, _: Option<u32>, _: u32, _: &str, _: Instant) -> Result<Option<Arc<dyn Collective>>> {
        Err(Ctx::new("sim", self.info.rank, "").unsupported("split", "the simulation builds its groups"))
    }
    async fn shutdown(&self, _: Instant) -> Result<()> {
        Ok(())
    }
}

/// A rank's simulated device: host buffers for the (tiny) probes, and the memory its
/// communicators' connects took, out of a fixed total.
#[derive(Debug, Clone)]
pub struct SimPlatform {
    /// Shared with the rank's communicators.
    pub used: Arc<AtomicU64>,
    /// The device's size.
    pub total: u64,
}

impl Platform for SimPlatform {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }
    fn device(&self) -> Device {
        Device::CPU
    }
    fn alloc(&self, dtype: DType, count: usize) -> Result<Box<dyn DeviceMemory>> {
        Ok(Box::new(HostMemory::new(dtype, count)))
    }
    fn copy_from_host(&self, dst: &mut dyn DeviceMemory, src: &[u8]) -> Result<()> {
        anyccl::HostPlatform.copy_from_host(dst, src)
    }
    fn copy_to_host(&self, src: &dyn DeviceMemory, dst: &mut [u8]) -> Result<()> {
        anyccl::HostPlatform.copy_to_host(src, dst)
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn mem_info(&self) -> Result<MemInfo> {
        let used = self.used.load(Ordering::Relaxed).min(self.total);
        Ok(MemInfo { free: self.total - used, total: self.total })
    }
}
