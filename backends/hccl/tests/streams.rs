//! Ordering with an engine's own ACL stream, against the stand-in (two ranks as threads of
//! this process): `wait_stream` holds the all_reduce until the engine's copy has written
//! its input, and `signal_stream` holds the engine's stream until the all_reduce is done,
//! neither host thread waiting. Rank 1's engine starts 300 ms late, so leaving out either
//! call gives a wrong result (checked: each was left out once while this test was written).
//! And all_reduces captured into the engine's ACL graph (`aclmdlRICaptureBegin`), replayed.

use anyccl_core::{Backend, CommConfig, Communicator, DType, GroupSpec, MemoryStore, ReduceOp, Store, StreamRef};
use anyccl_hccl::Hccl;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

const COUNT: usize = 1 << 16;
const T: Duration = Duration::from_secs(20);

type Code = i32;

/// The stand-in's ACL calls an engine makes on its own stream.
struct Engine {
    _lib: libloading::Library,
    set_device: unsafe extern "C" fn(i32) -> Code,
    create: unsafe extern "C" fn(*mut *mut c_void) -> Code,
    destroy: unsafe extern "C" fn(*mut c_void) -> Code,
    sync: unsafe extern "C" fn(*mut c_void) -> Code,
    copy: unsafe extern "C" fn(*mut c_void, usize, *const c_void, usize, i32, *mut c_void) -> Code,
    sleep: unsafe extern "C" fn(*mut c_void, u32) -> Code,
    begin: unsafe extern "C" fn(*mut c_void, i32) -> Code,
    end: unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> Code,
    execute: unsafe extern "C" fn(*mut c_void, *mut c_void) -> Code,
    destroy_model: unsafe extern "C" fn(*mut c_void) -> Code,
}

impl Engine {
    fn load() -> Engine {
        let path = anyccl_hccl_standin::library_dir().join("libascendcl.so");
        // SAFETY: the stand-in the backend loaded: the same object, its initialisers ran.
        let lib = unsafe { libloading::Library::new(&path) }.unwrap();
        // SAFETY: the stand-in's entry points, each with its C signature.
        unsafe {
            Engine {
                set_device: *lib.get(b"aclrtSetDevice").unwrap(),
                create: *lib.get(b"aclrtCreateStream").unwrap(),
                destroy: *lib.get(b"aclrtDestroyStream").unwrap(),
                sync: *lib.get(b"aclrtSynchronizeStream").unwrap(),
                copy: *lib.get(b"aclrtMemcpyAsync").unwrap(),
                sleep: *lib.get(b"anyccl_standin_stream_sleep").unwrap(),
                begin: *lib.get(b"aclmdlRICaptureBegin").unwrap(),
                end: *lib.get(b"aclmdlRICaptureEnd").unwrap(),
                execute: *lib.get(b"aclmdlRIExecuteAsync").unwrap(),
                destroy_model: *lib.get(b"aclmdlRIDestroy").unwrap(),
                _lib: lib,
            }
        }
    }
}

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

fn ok(what: &str, code: Code) -> Result<(), String> {
    if code == 0 {
        Ok(())
    } else {
        Err(format!("{what}: {code}"))
    }
}

/// A rank's start: its communicator on group `name` (already connected by one all_reduce,
/// so that what follows measures ordering, not the first connect), that all_reduce's
/// buffer, and an engine stream of its own on the rank's device.
struct Start {
    rt: tokio::runtime::Runtime,
    platform: Arc<dyn anyccl_core::Platform>,
    comm: Communicator,
    buf: Box<dyn anyccl_core::DeviceMemory>,
    eng: Engine,
    raw: *mut c_void,
}

fn start(r: usize, store: Arc<dyn Store>, name: &str) -> Result<Start, String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(e)?;
    let platform = Hccl.platform(r).map_err(e)?;
    let config = CommConfig { op_timeout: T, init_timeout: T, ..CommConfig::default() };
    let comm = rt
        .block_on(Communicator::connect(&Hccl, GroupSpec::world(2, name), r, store, platform.device(), config))
        .map_err(e)?;
    let mut buf = platform.alloc(DType::F32, COUNT).map_err(e)?;
    comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum).and_then(|mut w| w.wait(T)).map_err(e)?;
    let eng = Engine::load();
    let mut raw: *mut c_void = std::ptr::null_mut();
    // SAFETY: plain calls with valid out-parameters.
    unsafe {
        ok("aclrtSetDevice", (eng.set_device)(r as i32))?;
        ok("aclrtCreateStream", (eng.create)(&mut raw))?;
    }
    Ok(Start { rt, platform, comm, buf, eng, raw })
}

/// `None` when every f32 of `output` is `want`; else how many are not, and the first.
fn mismatch(output: &[u8], want: f32) -> Option<(usize, f32)> {
    let wrong = output.chunks_exact(4).filter(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) != want).count();
    (wrong > 0).then(|| (wrong, f32::from_le_bytes([output[0], output[1], output[2], output[3]])))
}

fn rank(r: usize, store: Arc<dyn Store>) -> Result<(), String> {
    let Start { rt, platform, comm, mut buf, eng, raw } = start(r, store, "streams")?;
    if !comm.capabilities().streams {
        return Err("the stand-in has aclrtStreamWaitEvent, but the backend claims no streams".into());
    }
    // SAFETY: the stream lives until it is destroyed at the end of this function.
    let engine = unsafe { StreamRef::from_raw(platform.device(), raw) };
    let bytes = COUNT * 4;
    let input: Vec<u8> = ((r + 1) as f32).to_le_bytes().repeat(COUNT);
    let mut output = vec![0u8; bytes];
    let dev = buf.view_mut().ptr() as *mut c_void;
    // SAFETY: the host vectors and the device buffer outlive the stream's synchronize below.
    unsafe {
        if r == 1 {
            ok("anyccl_standin_stream_sleep", (eng.sleep)(raw, 300))?;
        }
        ok("aclrtMemcpyAsync in", (eng.copy)(dev, bytes, input.as_ptr() as *const c_void, bytes, 1, raw))?;
    }
    comm.wait_stream(engine).map_err(e)?;
    let w = comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum).map_err(e)?;
    comm.signal_stream(engine).map_err(e)?;
    // SAFETY: as above.
    unsafe {
        ok("aclrtMemcpyAsync out", (eng.copy)(output.as_mut_ptr() as *mut c_void, bytes, dev, bytes, 2, raw))?;
        ok("aclrtSynchronizeStream", (eng.sync)(raw))?;
    }
    let mut w = w;
    if !w.is_completed().map_err(e)? {
        return Err(format!("rank {r}: the engine's stream finished before the all_reduce it was ordered after"));
    }
    drop(w);
    // SAFETY: created above, destroyed once, nothing queued on it any more.
    unsafe { ok("aclrtDestroyStream", (eng.destroy)(raw))? };
    if let Some((wrong, first)) = mismatch(&output, 3.0) {
        return Err(format!("rank {r}: {wrong} of {COUNT} elements are not 1 + 2 (the first reads {first})"));
    }
    rt.block_on(comm.shutdown()).map_err(e)
}

/// Three all_reduces captured into the engine's graph behind a captured device-to-device
/// copy of the input (staged from the host before each replay: a capture may not copy from
/// pageable host memory), replayed: replay `i` stages `(rank + 1) * (i + 1)` and reduces
/// three times, so every element ends at `3 * (i + 1) * 2 * 2` (a replay that did not run,
/// or ran against the wrong input, shows). Then 30 replays queued at once after staging
/// `6 * (rank + 1)`: 72. Capturing on a stream that is not capturing is refused.
fn graph_rank(r: usize, store: Arc<dyn Store>) -> Result<(), String> {
    let Start { rt, platform, comm, buf, eng, raw } = start(r, store, "graphs")?;
    let g: Arc<dyn anyccl_core::DeviceMemory> = Arc::from(buf);
    // Nothing is queued on the stream yet: these early returns leave it idle.
    if !comm.capabilities().graphs {
        return Err("the stand-in has aclmdlRICaptureGetInfo, but the backend claims no graphs".into());
    }
    let mut staging = platform.alloc(DType::F32, COUNT).map_err(e)?;
    let mut model: *mut c_void = std::ptr::null_mut();
    let body = graph_body(r, &eng, raw, &mut model, &comm, platform.as_ref(), &g, staging.as_mut());
    // Whatever happened, nothing runs on the stream once this function returns: the model
    // and the stream go after their work, before the buffers they use.
    // SAFETY: created above, destroyed once.
    unsafe {
        let _ = (eng.sync)(raw);
        if !model.is_null() {
            let _ = (eng.destroy_model)(model);
        }
        let _ = (eng.destroy)(raw);
    }
    body?;
    rt.block_on(comm.shutdown()).map_err(e)
}

/// [`graph_rank`]'s capture and replays on the engine's stream `raw`; the model it made is
/// left in `model` for the caller to destroy.
#[allow(clippy::too_many_arguments)]
fn graph_body(
    r: usize,
    eng: &Engine,
    raw: *mut c_void,
    model: &mut *mut c_void,
    comm: &Communicator,
    platform: &dyn anyccl_core::Platform,
    g: &Arc<dyn anyccl_core::DeviceMemory>,
    staging: &mut dyn anyccl_core::DeviceMemory,
) -> Result<(), String> {
    // SAFETY: the caller keeps the stream alive until after this returns.
    let engine = unsafe { StreamRef::from_raw(platform.device(), raw) };
    match comm.capture_all_reduce(engine, None, g, ReduceOp::Sum) {
        Err(anyccl_core::Error::InvalidArgument { arg: "stream", .. }) => {}
        other => return Err(format!("capturing outside a capture: expected InvalidArgument, got {other:?}")),
    }
    let bytes = COUNT * 4;
    let (dev, stage) = (g.view().ptr() as *mut c_void, staging.view().ptr() as *const c_void);
    // SAFETY: both device buffers outlive every replay (the caller synchronizes the stream
    // before they go).
    unsafe {
        ok("aclmdlRICaptureBegin", (eng.begin)(raw, 1))?;
        ok("aclrtMemcpyAsync in", (eng.copy)(dev, bytes, stage, bytes, 3, raw))?;
    }
    let mut captured = Vec::new();
    for _ in 0..3 {
        captured.push(comm.capture_all_reduce(engine, None, g, ReduceOp::Sum).map_err(e)?);
    }
    // SAFETY: valid out-parameter; the capture began on this stream.
    unsafe { ok("aclmdlRICaptureEnd", (eng.end)(raw, model))? };
    let mut output = vec![0u8; bytes];
    let mut check = |want: f32, what: &str| -> Result<(), String> {
        platform.copy_to_host(g.as_ref(), &mut output).map_err(e)?;
        if let Some((wrong, first)) = mismatch(&output, want) {
            return Err(format!(
                "rank {r}, {what}: {wrong} of {COUNT} elements are not {want} (the first reads {first})"
            ));
        }
        Ok(())
    };
    let stage_value = |staging: &mut dyn anyccl_core::DeviceMemory, v: usize| {
        platform.copy_from_host(staging, &(v as f32).to_le_bytes().repeat(COUNT)).map_err(e)
    };
    for i in 0..5 {
        stage_value(staging, (r + 1) * (i + 1))?;
        // SAFETY: the model and the stream are live; the previous replay was synchronized.
        unsafe {
            ok("aclmdlRIExecuteAsync", (eng.execute)(*model, raw))?;
            ok("aclrtSynchronizeStream", (eng.sync)(raw))?;
        }
        check((3 * (i + 1) * 4) as f32, &format!("replay {i}"))?;
    }
    stage_value(staging, 6 * (r + 1))?;
    for _ in 0..30 {
        // SAFETY: as above; the staging buffer is not written while these run.
        unsafe { ok("aclmdlRIExecuteAsync", (eng.execute)(*model, raw))? };
    }
    // SAFETY: the stream is live.
    unsafe { ok("aclrtSynchronizeStream", (eng.sync)(raw))? };
    check(72.0, "after 30 queued replays")?;
    drop(captured);
    Ok(())
}

/// Run `f` as ranks 0 and 1 on threads of this process, against the stand-in.
fn two_ranks(f: fn(usize, Arc<dyn Store>) -> Result<(), String>) {
    // Once, before any rank runs: the stand-in reads the environment from its own threads.
    static SET: std::sync::Once = std::sync::Once::new();
    SET.call_once(|| std::env::set_var("ANYCCL_HCCL_LIBRARY_DIR", anyccl_hccl_standin::library_dir()));
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            let s = store.clone();
            std::thread::spawn(move || f(r, s))
        })
        .collect();
    let errors: Vec<String> = ranks.into_iter().filter_map(|h| h.join().unwrap().err()).collect();
    assert!(errors.is_empty(), "{}", errors.join("; "));
}

mod hccl {
    pub mod streams {
        use super::super::*;

        #[test]
        fn engine_stream_orders_an_all_reduce() {
            two_ranks(rank);
        }
    }

    pub mod graphs {
        use super::super::*;

        #[test]
        fn captured_all_reduce_replays() {
            two_ranks(graph_rank);
        }
    }
}
