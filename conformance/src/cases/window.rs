//! Windows (`Communicator::register_window`): collective registrations whose operations give
//! the same results as on plain buffers, that are registered where the capability says, that
//! every member refuses alike when the members' sizes differ (the communicator working on),
//! and that go quietly once their communicator was aborted.

use super::register::{all_reduce_works_on, outlives_abort_on, registered_all_reduce_on, registrable};
use crate::ensure;
use crate::harness::{CaseResult, RankCtx};
use crate::pattern::{check, reduced, values};
use crate::registry::Case;
use anyccl_core::{DType, DeviceMemory, Error, ReduceOp};

/// `registration::registered_all_reduce` on windows.
fn windowed_all_reduce(cx: &RankCtx) -> CaseResult {
    registered_all_reduce_on(cx, true)
}

/// Registering `mem` as a window is refused with `InvalidArgument` naming `mem`, this rank and
/// the group, its message holding `why`; `what` says which refusal this is.
fn refused(cx: &RankCtx, mem: Box<dyn DeviceMemory>, why: &str, what: &str) -> CaseResult {
    match cx.block_on(cx.comm.register_window(mem)) {
        Err(Error::InvalidArgument { op: "register_window", arg: "mem", rank, group, msg })
            if rank == cx.rank && group == cx.comm.spec().name =>
        {
            ensure!(msg.contains(why), "the refusal of {what} does not say \"{why}\": {msg}");
            Ok(())
        }
        Err(e) => Err(crate::CaseError(format!("wrong error for {what}: {e}"))),
        Ok(_) => Err(crate::CaseError(format!("{what} was registered"))),
    }
}

/// Memory of no bytes on one member is refused there on the spot and on the others through
/// the agreement; windows whose sizes differ between members are refused on every member
/// (naming the argument, the rank, the group and every member's size) before the library
/// sees them; the communicator works on, and a later window of one size on all members
/// registers (every member counted the refused ones alike).
fn window_size_mismatch(cx: &RankCtx) -> CaseResult {
    let first = cx.rank == 0;
    // Only rank 0's memory is empty.
    let why = if first { "no bytes" } else { "rank 0: cannot register it" };
    refused(
        cx,
        cx.platform.alloc_registrable(DType::F32, if first { 0 } else { 64 })?,
        why,
        "a window empty on rank 0",
    )?;
    // Rank 0 asks for twice the others' size.
    let why = "the sizes differ (rank 0 512, rank 1 256";
    let mem = cx.platform.alloc_registrable(DType::F32, if first { 128 } else { 64 })?;
    refused(cx, mem, why, "windows of different sizes")?;
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
    // Only rank 0 passes plain memory: the others learn of it from the agreement, whose one
    // verdict every member reports.
    let mem = if cx.rank == 0 {
        cx.platform.alloc(DType::F32, 64)?
    } else {
        cx.platform.alloc_registrable(DType::F32, 64)?
    };
    refused(cx, mem, "rank 0: cannot register it", "plain memory as a window")?;
    all_reduce_works_on(cx, "all_reduce after the refusal")
}

/// `registration::registration_outlives_abort` on a window.
fn window_outlives_abort(cx: &RankCtx) -> CaseResult {
    outlives_abort_on(cx, true)
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
