//! Windows (`Communicator::register_window`): collective registrations whose operations give
//! the same results as on plain buffers, that are registered where the capability says, that
//! every member refuses alike when the members' sizes differ (the communicator working on),
//! and that go quietly once their communicator was aborted.

use super::register::{registered_all_reduce_on, registrable};
use crate::ensure;
use crate::harness::{CaseResult, RankCtx};
use crate::pattern::{check, reduced, values};
use crate::registry::Case;
use anyccl_core::{DType, Error, ReduceOp};

/// `registration::registered_all_reduce` on windows.
fn windowed_all_reduce(cx: &RankCtx) -> CaseResult {
    registered_all_reduce_on(cx, true)
}

/// Memory of no bytes on one member is refused there on the spot and on the others through
/// the agreement; windows whose sizes differ between members are refused on every member
/// (naming the argument, the rank, the group and the member that differs) before the library
/// sees them; the communicator works on, and a later window of one size on all members
/// registers (every member counted the refused ones alike).
fn window_size_mismatch(cx: &RankCtx) -> CaseResult {
    let group = cx.comm.spec().name.clone();
    // Only rank 0's memory is empty.
    let count = if cx.rank == 0 { 0 } else { 64 };
    match cx.block_on(cx.comm.register_window(cx.platform.alloc_registrable(DType::F32, count)?)) {
        Err(Error::InvalidArgument { op: "register_window", arg: "mem", rank, group: g, msg })
            if rank == cx.rank && g == group =>
        {
            let why = if cx.rank == 0 { "no bytes" } else { "rank 0 cannot register it" };
            ensure!(msg.contains(why), "the refusal does not say why ({why}): {msg}");
        }
        Err(e) => return Err(crate::CaseError(format!("wrong error for an empty window on rank 0: {e}"))),
        Ok(_) => return Err(crate::CaseError("a window that is empty on rank 0 was registered".into())),
    }
    // Rank 0 asks for twice the others' size.
    let count = if cx.rank == 0 { 128 } else { 64 };
    match cx.block_on(cx.comm.register_window(cx.platform.alloc_registrable(DType::F32, count)?)) {
        Err(Error::InvalidArgument { op: "register_window", arg: "mem", rank, group: g, msg })
            if rank == cx.rank && g == group =>
        {
            let other = if cx.rank == 0 { "rank 1 registers 256 bytes" } else { "rank 0 registers 512 bytes" };
            ensure!(msg.contains(other), "the refusal does not name the member that differs ({other}): {msg}");
        }
        Err(e) => return Err(crate::CaseError(format!("wrong error for windows of different sizes: {e}"))),
        Ok(_) => return Err(crate::CaseError("windows of different sizes were registered".into())),
    }
    let input = values(cx.rank, 64, Some(ReduceOp::Sum), 3);
    let want: Vec<f64> = (0..64).map(|i| reduced(cx.size, i, DType::F32, ReduceOp::Sum, 3)).collect();
    let mut w = cx.block_on(cx.comm.register_window(registrable(cx, DType::F32, &input)?))?;
    cx.wait(cx.comm.all_reduce(None, w.view_mut(), ReduceOp::Sum)?)?;
    check("all_reduce on a window after the refusal", &cx.download(&*w)?, &want, DType::F32, Some(ReduceOp::Sum))?;
    Ok(())
}

/// Memory the library cannot take as a window (plain `Platform::alloc` memory, where the
/// library needs its own allocator's) is refused on every member before the library's
/// collective call, naming the member, and the communicator works on.
fn window_rejects_plain_memory(cx: &RankCtx) -> CaseResult {
    // Only rank 0 passes plain memory: the others learn of it from the agreement.
    let mem = if cx.rank == 0 {
        cx.platform.alloc(DType::F32, 64)?
    } else {
        cx.platform.alloc_registrable(DType::F32, 64)?
    };
    match cx.block_on(cx.comm.register_window(mem)) {
        Err(Error::InvalidArgument { op: "register_window", arg: "mem", rank, msg, .. }) if rank == cx.rank => {
            let who = if cx.rank == 0 { "this rank cannot register it" } else { "rank 0 cannot register it" };
            ensure!(msg.contains(who), "the refusal does not say who cannot register ({who}): {msg}");
        }
        Err(e) => return Err(crate::CaseError(format!("wrong error for plain memory as a window: {e}"))),
        Ok(_) => return Err(crate::CaseError("plain memory was registered as a window".into())),
    }
    let mut b = cx.upload(DType::F32, &values(cx.rank, 7, Some(ReduceOp::Sum), 0))?;
    cx.wait(cx.comm.all_reduce(None, b.view_mut(), ReduceOp::Sum)?)?;
    let want: Vec<f64> = (0..7).map(|i| reduced(cx.size, i, DType::F32, ReduceOp::Sum, 0)).collect();
    check("all_reduce after the refusal", &cx.download(b.as_ref())?, &want, DType::F32, Some(ReduceOp::Sum))?;
    Ok(())
}

/// A window still held when the communicator is aborted is dropped without an error, a
/// panic or a wait for the peers, and its memory is usable.
fn window_outlives_abort(cx: &RankCtx) -> CaseResult {
    let mut w = cx.block_on(cx.comm.register_window(registrable(cx, DType::F32, &[1.0; 64])?))?;
    cx.wait(cx.comm.all_reduce(None, w.view_mut(), ReduceOp::Sum)?)?;
    cx.block_on(cx.comm.abort())?;
    let started = std::time::Instant::now();
    let mem = w.into_inner()?;
    ensure!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "dropping the window waited {:?}",
        started.elapsed()
    );
    let got = cx.download(mem.as_ref())?;
    ensure!(got.iter().all(|&v| v == cx.size as f64), "memory after the abort holds {:?}, not the sums", &got[..4]);
    Ok(())
}

/// Add the window cases to `v`.
pub fn register(v: &mut Vec<Case>) {
    v.push(Case::new("windows", "windowed_all_reduce", &[1, 2, 3, 4], windowed_all_reduce));
    v.push(Case::new("windows", "window_size_mismatch", &[2, 3], window_size_mismatch));
    v.push(Case::new("windows", "window_outlives_abort", &[1, 2], window_outlives_abort));
    v.push(
        Case::new("windows", "window_rejects_plain_memory", &[1, 2], window_rejects_plain_memory)
            .needs(|c, _| (!c.windows).then(|| "backend has no windows".into())),
    );
}
