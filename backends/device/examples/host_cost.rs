//! What anyccl itself costs the host per operation on a device backend: the `Communicator`
//! (validation, sequence number, flight recorder) and the device layer (lifecycle, call
//! lock, watchdog bookkeeping, `Work`, marks) over a library and a runtime that do nothing
//! (every launch is enqueued at once, every event is done). On a GPU host, raw NCCL's own
//! call comes on top (`anyccl-bench all_reduce --vs-raw`); this isolates the rest, on any
//! machine.
//!
//! `cargo run --release -p anyccl-device --example host_cost [CALLS] [SWEEP_KIB]` prints, per
//! pattern, nanoseconds per call (median of 9 runs of CALLS calls, default 100000). With
//! SWEEP_KIB, each launch of the null library reads that many KiB (a line in every 64 B), as
//! a real library's launch pushes anyccl's state out of the caches; the first row is that
//! launch alone, and each row says what anyccl adds to it.

use anyccl_core::{
    Capabilities, CommConfig, Communicator, ConnectOptions, DType, Device, DeviceKind, DeviceMemory, GroupSpec,
    HostMemory, MemInfo, MemoryStore, ReduceOp, Result, Store,
};
use anyccl_device::{
    DeviceComm, Launched, LibError, Library, Op, Plane, Poll, Runtime, Settings, SplitRequest, SplitStart,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// A runtime whose streams run nothing: events are done as soon as they are recorded.
#[derive(Debug)]
struct NullRuntime {
    records: AtomicU64,
}

impl Runtime for NullRuntime {
    type Stream = ();
    type Event = ();
    type Memory = HostMemory;
    fn device(&self) -> Device {
        Device { kind: DeviceKind::Cpu, ordinal: 0 }
    }
    fn bind(&self) -> Result<()> {
        Ok(())
    }
    fn stream(self: &Arc<Self>) -> Result<()> {
        Ok(())
    }
    fn record(&self, _stream: &()) -> Result<()> {
        self.records.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn done(&self, _event: &()) -> Result<bool> {
        Ok(true)
    }
    fn alloc(self: &Arc<Self>, dtype: DType, count: usize) -> Result<HostMemory> {
        Ok(HostMemory::new(dtype, count))
    }
    unsafe fn copy_to_device(&self, _dst: *mut u8, _src: &[u8]) -> Result<()> {
        Ok(())
    }
    unsafe fn copy_to_host(&self, _dst: &mut [u8], _src: *const u8) -> Result<()> {
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn mem_info(&self) -> Result<MemInfo> {
        Ok(MemInfo { free: 1 << 40, total: 1 << 40 })
    }
}

/// A collective library of one rank that enqueues every operation at once and moves no data.
#[derive(Debug)]
struct NullLibrary;

impl Library for NullLibrary {
    type Runtime = NullRuntime;
    type Comm = ();
    type Pending = ();
    fn backend(&self) -> &'static str {
        "null"
    }
    fn capabilities(&self, _rt: &NullRuntime) -> Capabilities {
        Capabilities {
            device_kind: DeviceKind::Cpu,
            dtypes: DType::ALL.to_vec(),
            reduce_ops: vec![ReduceOp::Sum],
            all_to_all: false,
            all_to_all_v: false,
            p2p_group: false,
            abort_in_flight: true,
            split: false,
            lazy_connect: false,
            memory_stats: false,
            warmup_small_bytes: 8,
            warmup_large_bytes: 8,
            max_world_size: 1,
            detects_peer_failure: false,
            first_call_may_block: false,
            detects_mismatch: false,
            max_local_ranks: 1,
            streams: false,
            graphs: false,
            cta_settings: false,
            buffer_registration: false,
            windows: false,
        }
    }
    fn root_id_len(&self) -> usize {
        8
    }
    fn root_id(&self, _rt: &Arc<NullRuntime>) -> std::result::Result<Vec<u8>, LibError> {
        Ok(vec![0; 8])
    }
    fn init_start(
        &self,
        _rt: &Arc<NullRuntime>,
        _id: &[u8],
        _rank: usize,
        _size: usize,
        _settings: &Settings,
    ) -> std::result::Result<(), LibError> {
        Ok(())
    }
    fn poll(&self, _pending: &mut ()) -> std::result::Result<Poll<Option<()>>, LibError> {
        Ok(Poll::Ready(Some(())))
    }
    fn abandon(&self, _pending: ()) {}
    fn split_needs_members(&self) -> bool {
        false
    }
    fn split_start(&self, _parent: &(), _req: &SplitRequest<'_>) -> std::result::Result<SplitStart<()>, LibError> {
        Ok(SplitStart::ViaRootId)
    }
    fn rank_size(&self, _comm: &()) -> std::result::Result<(usize, usize), LibError> {
        Ok((0, 1))
    }
    unsafe fn launch(&self, _comm: &(), _stream: &(), _op: &Op) -> std::result::Result<Launched, LibError> {
        std::hint::black_box(sweep());
        Ok(Launched::Enqueued)
    }
    fn async_error(&self, _comm: &(), _plane: Plane) -> std::result::Result<bool, LibError> {
        Ok(false)
    }
    fn can_stop_blocked(&self) -> bool {
        true
    }
    fn destroy(&self, _comm: &()) {}
    fn memory_held(&self, _comm: &()) -> Option<u64> {
        None
    }
}

static LIB: NullLibrary = NullLibrary;

/// What each launch reads (SWEEP_KIB), one `u64` per cache line.
static SWEPT: OnceLock<Vec<AtomicU64>> = OnceLock::new();

/// Read a line in every 64 B of `SWEPT`: the null library's launch.
fn sweep() -> u64 {
    SWEPT.get().map_or(0, |v| v.iter().step_by(8).map(|x| x.load(Ordering::Relaxed)).fold(0, u64::wrapping_add))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let calls: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(100_000).max(1);
    let sweep_kib: usize = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(0);
    SWEPT.get_or_init(|| (0..sweep_kib * 128).map(|i| AtomicU64::new(i as u64)).collect());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| {
        anyccl_core::Error::InvalidArgument {
            op: "host_cost",
            arg: "runtime",
            rank: 0,
            group: "null".into(),
            msg: e.to_string(),
        }
    })?;
    println!("# anyccl host cost per call over a library and a runtime that do nothing (all_reduce, 8 B)");
    println!("# {calls} calls a run, median of 9 runs; events: device events recorded per call");
    println!("# each launch reads {sweep_kib} KiB; anyccl's own cost: the row's time less the launch alone");
    let mut alone = Vec::new();
    for _ in 0..9 {
        let t = Instant::now();
        for _ in 0..calls {
            std::hint::black_box(sweep());
        }
        alone.push(t.elapsed().as_secs_f64() * 1e9 / calls as f64);
    }
    let alone = median(alone);
    println!(" {:>52} {alone:>12.1}", "the null library's launch alone");
    println!("#{:>52} {:>12} {:>10} {:>12}", "pattern", "ns/call", "events", "anyccl ns");
    for shared_completion in [false, true] {
        run(&rt, calls, shared_completion, alone)?;
    }
    Ok(())
}

/// Both patterns on a communicator with `shared_completion` as given.
/// `alone`: the null launch's own ns per call, taken off each row.
fn run(rt: &tokio::runtime::Runtime, calls: usize, shared_completion: bool, alone: f64) -> Result<()> {
    let runtime = Arc::new(NullRuntime { records: AtomicU64::new(0) });
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let config = CommConfig { shared_completion, ..CommConfig::default() };
    let opts = ConnectOptions {
        rank: 0,
        size: 1,
        store,
        namespace: "host-cost".into(),
        device: runtime.device(),
        timeout: Duration::from_secs(10),
        op_timeout: config.op_timeout,
        config: config.clone(),
    };
    let dc = rt.block_on(DeviceComm::connect(&LIB, runtime.clone(), opts))?;
    let comm = Communicator::new(dc, GroupSpec::world(1, "host-cost"), config)?;
    let mode = if shared_completion { "shared_completion" } else { "an event per call" };
    let send = HostMemory::new(DType::F32, 2);
    let depth = 100usize;
    let mut recvs: Vec<HostMemory> = (0..depth).map(|_| HostMemory::new(DType::F32, 2)).collect();
    let t_wait = Duration::from_secs(10);

    type Pattern<'c> = (&'c str, Box<dyn Fn(&mut Vec<HostMemory>) -> Result<()> + 'c>);
    let patterns: Vec<Pattern<'_>> = vec![
        (
            "issue + wait, one at a time",
            Box::new(|recvs: &mut Vec<HostMemory>| {
                for i in 0..calls {
                    let r = &mut recvs[i % depth];
                    comm.all_reduce(Some(send.view()), r.view_mut(), ReduceOp::Sum)?.wait(t_wait)?;
                }
                Ok(())
            }),
        ),
        (
            "100 back to back, then waited",
            Box::new(|recvs: &mut Vec<HostMemory>| {
                let mut left = calls;
                while left > 0 {
                    let k = left.min(depth);
                    let mut works = Vec::with_capacity(k);
                    for r in recvs.iter_mut().take(k) {
                        works.push(comm.all_reduce(Some(send.view()), r.view_mut(), ReduceOp::Sum)?);
                    }
                    for mut w in works {
                        w.wait(t_wait)?;
                    }
                    left -= k;
                }
                Ok(())
            }),
        ),
    ];
    for (name, run) in &patterns {
        run(&mut recvs)?;
        let mut times = Vec::new();
        let before = runtime.records.load(Ordering::Relaxed);
        for _ in 0..9 {
            let t = Instant::now();
            run(&mut recvs)?;
            times.push(t.elapsed().as_secs_f64() * 1e9 / calls as f64);
        }
        let events = (runtime.records.load(Ordering::Relaxed) - before) as f64 / (9 * calls) as f64;
        let t = median(times);
        println!(" {:>52} {t:>12.1} {events:>10.3} {:>12.1}", format!("{name} ({mode})"), t - alone);
        // An event at each call, unless completion is shared and calls run back to back
        // (one event a run of 100).
        let want = if shared_completion && name.starts_with("100") { 0.01 } else { 1.0 };
        if (events - want).abs() > 0.001 {
            return Err(anyccl_core::Error::Aborted {
                rank: 0,
                group: "host-cost".into(),
                detail: format!("{name} ({mode}) recorded {events:.3} events a call, not {want}"),
            });
        }
    }
    rt.block_on(comm.shutdown())?;
    Ok(())
}
