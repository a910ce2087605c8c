//! Stream order and graph capture: operations ordered after an engine's own stream and that
//! stream ordered after them, both without the host waiting (`Communicator::wait_stream`,
//! `signal_stream`); an all_reduce in stream order only (`enqueue_all_reduce`); and
//! all_reduces captured into the engine's graph and replayed (`capture_all_reduce`).
//!
//! An engine's stream is the backend's vendor runtime, which the suite cannot reach: a
//! backend's test entry gives it one with [`set_engine`] before running the registry (the
//! NCCL entry a CUDA stream with two small kernels, the HCCL entry an ACL stream). Where the
//! capability is missing (`Capabilities::streams`, `Capabilities::graphs`) or no engine was
//! given, the cases are reported ignored with that reason.

use crate::ensure;
use crate::harness::{CaseError, CaseResult, RankCtx};
use crate::registry::Case;
use anyccl_core::{Capabilities, DType, DeviceMemory, Error, Platform, ReduceOp, StreamRef};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Elements of every buffer the cases use (`f32`).
const COUNT: usize = 1 << 16;
/// How long the last rank's engine holds its stream before writing its input: longer than
/// any enqueue takes, so an operation that does not wait for the engine reads stale input,
/// and one that the engine does not wait for is still running when the engine finishes.
const HOLD: Duration = Duration::from_millis(300);

/// An engine's own stream on one rank's device, as the cases drive it. The engine keeps
/// every buffer it was given (and whatever it staged) until it is dropped, and its drop
/// waits for the stream, so nothing it enqueued or captured outlives the memory it uses.
pub trait Engine {
    /// The stream, for `wait_stream`, `signal_stream` and `capture_all_reduce`.
    fn stream(&self) -> StreamRef<'_>;
    /// Hold the stream for about `d`, as an engine's long kernel would; the host does not
    /// wait.
    ///
    /// # Errors
    /// The runtime's failure, or a library with no way to hold a stream.
    fn delay(&mut self, d: Duration) -> Result<(), CaseError>;
    /// Set every element of `dst` (`f32`) to `value` in the stream's order (captured when
    /// the stream captures); the host does not wait.
    ///
    /// # Errors
    /// The runtime's failure; `dst` not `f32`.
    fn fill_f32(&mut self, dst: &Arc<dyn DeviceMemory>, value: f32) -> Result<(), CaseError>;
    /// Start capturing the stream's work into a graph.
    ///
    /// # Errors
    /// The runtime's failure.
    fn begin_capture(&mut self) -> Result<(), CaseError>;
    /// End the capture; the graph's number, for [`Engine::replay`].
    ///
    /// # Errors
    /// The runtime's failure (e.g. the capture was invalidated).
    fn end_capture(&mut self) -> Result<usize, CaseError>;
    /// Enqueue one replay of graph `graph`; the host does not wait.
    ///
    /// # Errors
    /// The runtime's failure; an unknown graph.
    fn replay(&mut self, graph: usize) -> Result<(), CaseError>;
    /// Wait on the host until the stream has done everything enqueued on it.
    ///
    /// # Errors
    /// The runtime's failure, or `timeout` passed first.
    fn synchronize(&mut self, timeout: Duration) -> Result<(), CaseError>;
}

/// How a backend's test entry opens an engine stream on a rank's device.
pub type OpenEngine = fn(&Arc<dyn Platform>) -> Result<Box<dyn Engine>, CaseError>;

static OPEN: OnceLock<OpenEngine> = OnceLock::new();

/// Give the stream cases their engine streams; call it in the test entry's `main` before
/// running the registry (child processes run the same `main`). The first call wins.
pub fn set_engine(open: OpenEngine) {
    let _ = OPEN.set(open);
}

fn need_streams(c: &Capabilities) -> Option<String> {
    if !c.streams {
        return Some("the backend cannot order operations with an engine's streams (Capabilities::streams)".into());
    }
    OPEN.get().is_none().then(|| {
        "the backend has streams, but its test entry gave the suite no engine stream (cases::streams::set_engine)"
            .into()
    })
}

fn need_graphs(c: &Capabilities) -> Option<String> {
    if !c.graphs {
        return Some("the backend cannot capture operations into an engine's graph (Capabilities::graphs)".into());
    }
    need_streams(c)
}

/// This rank's engine stream, and a first all_reduce of `COUNT` elements, waited: the
/// communicator is connected, so what follows measures ordering, not the first connect.
fn start(cx: &RankCtx) -> Result<Box<dyn Engine>, CaseError> {
    let open = OPEN.get().ok_or("no engine stream was given (cases::streams::set_engine)")?;
    let engine = open(&cx.platform)?;
    let mut b = cx.zeros(DType::F32, COUNT)?;
    cx.wait(cx.comm.all_reduce(None, b.view_mut(), ReduceOp::Sum)?)?;
    Ok(engine)
}

/// A shared buffer of `COUNT` zeroed `f32`s.
fn shared(cx: &RankCtx) -> Result<Arc<dyn DeviceMemory>, CaseError> {
    Ok(Arc::from(cx.zeros(DType::F32, COUNT)?))
}

/// Every element of `m` is `want`: read with a plain copy, no device-wide synchronize
/// (which would hide an engine's stream that finished before the operation it was ordered
/// after).
fn expect(cx: &RankCtx, m: &dyn DeviceMemory, want: f32, what: &str) -> CaseResult {
    let mut bytes = vec![0u8; m.count() * 4];
    cx.platform.copy_to_host(m, &mut bytes)?;
    let got = |c: &[u8]| f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    let wrong = bytes.chunks_exact(4).filter(|c| got(c) != want).count();
    ensure!(
        wrong == 0,
        "rank {}, {what}: {wrong} of {} elements are not {want} (the first reads {})",
        cx.rank,
        m.count(),
        got(&bytes[..4])
    );
    Ok(())
}

/// The sum of `rank + 1` over the ranks.
fn rank_sum(n: usize) -> f32 {
    (n * (n + 1) / 2) as f32
}

/// The engine's input: the last rank's engine holds its stream before writing it.
fn engine_input(cx: &RankCtx, engine: &mut dyn Engine, input: &Arc<dyn DeviceMemory>) -> CaseResult {
    if cx.rank == cx.size - 1 {
        engine.delay(HOLD)?;
    }
    engine.fill_f32(input, (cx.rank + 1) as f32)
}

/// The engine writes an all_reduce's input on its stream (the last rank's engine late);
/// `wait_stream` holds the all_reduce until then, and `signal_stream` holds the engine's
/// stream until the all_reduce is done: the sum is right, and the all_reduce's `Work` is
/// complete once the engine's stream is, though no host thread waited for either.
fn engine_stream_orders_operations(cx: &RankCtx) -> CaseResult {
    let mut engine = start(cx)?;
    let input = shared(cx)?;
    let mut output = cx.zeros(DType::F32, COUNT)?;
    engine_input(cx, engine.as_mut(), &input)?;
    cx.comm.wait_stream(engine.stream())?;
    let mut w = cx.comm.all_reduce(Some(input.view()), output.view_mut(), ReduceOp::Sum)?;
    cx.comm.signal_stream(engine.stream())?;
    engine.synchronize(cx.timeout)?;
    ensure!(
        w.is_completed()?,
        "rank {}: the engine's stream finished before the all_reduce it was ordered after (signal_stream)",
        cx.rank
    );
    drop(w);
    expect(cx, output.as_ref(), rank_sum(cx.size), "the sum of rank + 1 (wait_stream: the input was written late)")
}

/// The same ordering with an all_reduce in stream order only (`enqueue_all_reduce`, in
/// place, no `Work`): once the engine's stream is done, the buffer holds the sum.
fn enqueued_all_reduce_in_stream_order(cx: &RankCtx) -> CaseResult {
    let mut engine = start(cx)?;
    let buf = shared(cx)?;
    engine_input(cx, engine.as_mut(), &buf)?;
    cx.comm.wait_stream(engine.stream())?;
    let held = cx.comm.enqueue_all_reduce(None, &buf, ReduceOp::Sum)?;
    cx.comm.signal_stream(engine.stream())?;
    engine.synchronize(cx.timeout)?;
    expect(cx, buf.as_ref(), rank_sum(cx.size), "the sum of rank + 1, once the engine's stream is done")?;
    drop(engine);
    drop(held);
    Ok(())
}

/// Capturing on a stream that is not capturing is refused, naming the stream. Then a graph
/// of the engine's fill of `rank + 1` and three all_reduces, replayed five times with the
/// buffer spoiled before each (in stream order): each replay ends at `S * n * n` (`S` the
/// sum of `rank + 1`), so a replay that did not run, or ran without its fill, shows. And a
/// graph of one all_reduce replayed ten times queued at once from `rank + 1`: `S * n^9`
/// counts the replays that ran.
fn captured_all_reduce_replays(cx: &RankCtx) -> CaseResult {
    let mut engine = start(cx)?;
    let n = cx.size;
    let (g, h) = (shared(cx)?, shared(cx)?);
    match cx.comm.capture_all_reduce(engine.stream(), None, &g, ReduceOp::Sum) {
        Err(Error::InvalidArgument { arg: "stream", .. }) => {}
        Err(e) => {
            return Err(CaseError(format!("capturing outside a capture: want InvalidArgument for 'stream', got {e}")))
        }
        Ok(c) => return Err(CaseError(format!("capturing outside a capture was accepted: {}", c.describe()))),
    }
    let mut captured = Vec::new();
    engine.begin_capture()?;
    engine.fill_f32(&g, (cx.rank + 1) as f32)?;
    for _ in 0..3 {
        captured.push(cx.comm.capture_all_reduce(engine.stream(), None, &g, ReduceOp::Sum)?);
    }
    let fill_and_reduce = engine.end_capture()?;
    engine.begin_capture()?;
    captured.push(cx.comm.capture_all_reduce(engine.stream(), None, &h, ReduceOp::Sum)?);
    let reduce = engine.end_capture()?;

    let s = rank_sum(n);
    for i in 0..5 {
        engine.fill_f32(&g, -1.0)?;
        engine.replay(fill_and_reduce)?;
        engine.synchronize(cx.timeout)?;
        expect(cx, g.as_ref(), s * (n * n) as f32, &format!("replay {i} of fill and three all_reduces"))?;
    }
    engine.fill_f32(&h, (cx.rank + 1) as f32)?;
    for _ in 0..10 {
        engine.replay(reduce)?;
    }
    engine.synchronize(cx.timeout)?;
    expect(cx, h.as_ref(), s * (n as f32).powi(9), "ten queued replays of one all_reduce")?;
    // The graphs go with the engine, before the buffers their operations use.
    drop(engine);
    drop(captured);
    Ok(())
}

/// Add the stream and graph cases to `v`.
pub fn register(v: &mut Vec<Case>) {
    let worlds = &[1, 2, 3, 4];
    v.push(
        Case::new("streams", "engine_stream_orders_operations", worlds, engine_stream_orders_operations)
            .needs(|c, _| need_streams(c)),
    );
    v.push(
        Case::new("streams", "enqueued_all_reduce_in_stream_order", worlds, enqueued_all_reduce_in_stream_order)
            .needs(|c, _| need_streams(c)),
    );
    v.push(
        Case::new("streams", "captured_all_reduce_replays", worlds, captured_all_reduce_replays)
            .needs(|c, _| need_graphs(c)),
    );
}
