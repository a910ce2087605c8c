//! Ordering with an engine's own stream, on two GPUs (two ranks as threads of this
//! process): `wait_stream` holds the all_reduce until the engine's kernel has written its
//! input, and `signal_stream` holds the engine's stream until the all_reduce is done; and
//! all_reduces captured into the engine's CUDA graph, replayed.
//! Without two CUDA devices and NCCL the case is reported ignored with the reason.

use anyccl_core::{Backend, CommConfig, Communicator, DType, GroupSpec, MemoryStore, ReduceOp, Store};
use anyccl_nccl::{EngineStream, Nccl};
use libtest_mimic::{Arguments, Failed, Trial};
use std::sync::Arc;
use std::time::Duration;

const COUNT: usize = 1 << 20;
const T: Duration = Duration::from_secs(60);

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

/// A rank's start: its communicator (already connected by one all_reduce, so that what
/// follows measures ordering, not the first connect), an engine stream, and a buffer of
/// COUNT f32s (returned beside it).
struct Rank {
    rt: tokio::runtime::Runtime,
    platform: Arc<dyn anyccl_core::Platform>,
    comm: Communicator,
    engine: EngineStream,
}

fn start(r: usize, store: Arc<dyn Store>, name: &str) -> Result<(Rank, Box<dyn anyccl_core::DeviceMemory>), String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(e)?;
    let platform = Nccl.platform(r).map_err(e)?;
    let config = CommConfig { op_timeout: T, ..CommConfig::default() };
    let comm = rt
        .block_on(Communicator::connect(&Nccl, GroupSpec::world(2, name), r, store, platform.device(), config))
        .map_err(e)?;
    let engine = EngineStream::new(platform.device()).map_err(e)?;
    let mut buf = platform.alloc(DType::F32, COUNT).map_err(e)?;
    comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum).and_then(|mut w| w.wait(T)).map_err(e)?;
    Ok((Rank { rt, platform, comm, engine }, buf))
}

/// Every element of `m` equals `want`, then the communicator shuts down.
fn check_and_stop(k: &Rank, r: usize, m: &dyn anyccl_core::DeviceMemory, want: f32, why: &str) -> Result<(), String> {
    let mut host = vec![0u8; COUNT * 4];
    k.platform.copy_to_host(m, &mut host).map_err(e)?;
    let wrong = host.chunks_exact(4).filter(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) != want).count();
    if wrong > 0 {
        return Err(format!("rank {r}: {wrong} of {COUNT} elements are not {want} ({why})"));
    }
    k.rt.block_on(k.comm.shutdown()).map_err(e)
}

fn rank(r: usize, store: Arc<dyn Store>) -> Result<(), String> {
    let (k, mut buf) = start(r, store, "streams")?;
    // Rank 1's engine writes its input 200 ms late: without wait_stream its all_reduce
    // would read the zeros; rank 0's all_reduce then finishes 200 ms after its own input
    // is ready: without signal_stream its engine would finish first.
    if r == 1 {
        k.engine.spin_us(200_000.0).map_err(e)?;
    }
    let ptr = buf.view_mut().ptr() as *mut std::ffi::c_void;
    // SAFETY: the buffer holds COUNT f32s and outlives the engine's synchronize below;
    // nothing else writes it until the all_reduce, which is ordered after the kernel.
    unsafe { k.engine.fill_f32(ptr, COUNT, (r + 1) as f32) }.map_err(e)?;
    k.comm.wait_stream(k.engine.stream_ref()).map_err(e)?;
    let mut w = k.comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum).map_err(e)?;
    k.comm.signal_stream(k.engine.stream_ref()).map_err(e)?;
    k.engine.synchronize(T).map_err(e)?;
    if !w.is_completed().map_err(e)? {
        return Err(format!("rank {r}: the engine's stream finished before the all_reduce it was ordered after"));
    }
    drop(w);
    check_and_stop(&k, r, buf.as_ref(), 3.0, "1 + 2: the all_reduce read its input early")
}

/// Three all_reduces captured into the engine's graph behind a fill kernel, replayed 50
/// times: each replay refills with `rank + 1` and reduces three times, so every element
/// ends at 3 x 2 x 2 = 12. Capturing on a stream that is not capturing is refused.
fn graph_rank(r: usize, store: Arc<dyn Store>) -> Result<(), String> {
    let (k, buf) = start(r, store, "graphs")?;
    let g: Arc<dyn anyccl_core::DeviceMemory> = Arc::from(buf);
    match k.comm.capture_all_reduce(k.engine.stream_ref(), None, &g, ReduceOp::Sum) {
        Err(anyccl_core::Error::InvalidArgument { arg: "stream", .. }) => {}
        other => return Err(format!("capturing outside a capture: expected InvalidArgument, got {other:?}")),
    }
    k.engine.begin_capture().map_err(e)?;
    let ptr = g.view().ptr() as *mut std::ffi::c_void;
    // SAFETY: `g` holds COUNT f32s and outlives the graph (the `Captured`s and `g` are
    // dropped after the last replay has been synchronized).
    unsafe { k.engine.fill_f32(ptr, COUNT, (r + 1) as f32) }.map_err(e)?;
    let mut captured = Vec::new();
    for _ in 0..3 {
        captured.push(k.comm.capture_all_reduce(k.engine.stream_ref(), None, &g, ReduceOp::Sum).map_err(e)?);
    }
    let graph = k.engine.end_capture().map_err(e)?;
    for _ in 0..50 {
        k.engine.replay(&graph).map_err(e)?;
    }
    k.engine.synchronize(T).map_err(e)?;
    drop(graph);
    drop(captured);
    check_and_stop(&k, r, g.as_ref(), 12.0, "after the replays")
}

/// The same ordering with an all_reduce in stream order only (`enqueue_all_reduce`: no
/// Work): rank 1's engine writes late, and both engines' streams must see the sum.
fn enqueued_rank(r: usize, store: Arc<dyn Store>) -> Result<(), String> {
    let (k, buf) = start(r, store, "enqueued")?;
    let g: Arc<dyn anyccl_core::DeviceMemory> = Arc::from(buf);
    if r == 1 {
        k.engine.spin_us(200_000.0).map_err(e)?;
    }
    let ptr = g.view().ptr() as *mut std::ffi::c_void;
    // SAFETY: `g` holds COUNT f32s and outlives the engine's synchronize below.
    unsafe { k.engine.fill_f32(ptr, COUNT, (r + 1) as f32) }.map_err(e)?;
    k.comm.wait_stream(k.engine.stream_ref()).map_err(e)?;
    let held = k.comm.enqueue_all_reduce(None, &g, ReduceOp::Sum).map_err(e)?;
    k.comm.signal_stream(k.engine.stream_ref()).map_err(e)?;
    k.engine.synchronize(T).map_err(e)?;
    drop(held);
    check_and_stop(&k, r, g.as_ref(), 3.0, "1 + 2")
}

/// One rank of a case.
type RankFn = fn(usize, Arc<dyn Store>) -> Result<(), String>;

fn two_ranks(f: RankFn) -> Result<(), Failed> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            let s = store.clone();
            std::thread::spawn(move || f(r, s))
        })
        .collect();
    let mut errors = Vec::new();
    for h in ranks {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => errors.push(e),
            Err(_) => errors.push("a rank panicked".into()),
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; ").into())
    }
}

fn main() -> std::process::ExitCode {
    let args = Arguments::from_args();
    let cases: [(&str, RankFn); 3] = [
        ("nccl::streams::engine_stream_orders_operations[w=2]", rank),
        ("nccl::streams::enqueued_all_reduce_in_stream_order[w=2]", enqueued_rank),
        ("nccl::graphs::captured_all_reduce_replays[w=2]", graph_rank),
    ];
    let probe = Nccl.probe();
    let trials = cases
        .into_iter()
        .map(|(name, f)| match &probe {
            Err(e) => Trial::test(name, || Ok(())).with_ignored_flag(true).with_kind(format!("ignored: {e}")),
            Ok(info) if info.devices < 2 => Trial::test(name, || Ok(()))
                .with_ignored_flag(true)
                .with_kind(format!("ignored: {} CUDA device(s), the case needs 2", info.devices)),
            Ok(_) => Trial::test(name, move || two_ranks(f)),
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}
