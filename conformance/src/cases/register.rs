//! Buffers registered with the communicator: operations on them give the same results as
//! on plain buffers, registration is what the capability says, bad input is refused before
//! the library sees it, and a registration outliving its communicator's abort goes quietly.

use crate::ensure;
use crate::harness::{CaseResult, RankCtx};
use crate::pattern::{check, reduced, values};
use crate::registry::Case;
use anyccl_core::{DType, DeviceMemory, Error, ReduceOp};
use std::sync::Arc;

/// `alloc_registrable` memory holding `vals`.
pub(crate) fn registrable(cx: &RankCtx, dtype: DType, vals: &[f64]) -> Result<Box<dyn DeviceMemory>, crate::CaseError> {
    let mut m = cx.platform.alloc_registrable(dtype, vals.len())?;
    cx.platform.copy_from_host(m.as_mut(), &crate::pattern::encode(vals, dtype))?;
    Ok(m)
}

/// `mem` registered with the communicator, as a window when `window` (collective: every
/// member registers its windows in the same order).
fn reg<M: std::ops::Deref<Target = dyn DeviceMemory>>(
    cx: &RankCtx,
    mem: M,
    window: bool,
) -> Result<anyccl_core::Registered<'_, M>, crate::CaseError> {
    Ok(if window { cx.block_on(cx.comm.register_window(mem))? } else { cx.comm.register(mem)? })
}

/// all_reduce out of place and in place, several times and at sizes on both sides of the
/// libraries' small-message paths, on registered send and receive buffers (one of them
/// shared, as captured operations hold theirs), or on windows when `window`; the memory comes
/// back from `into_inner` holding the result. Every member registers and drops its buffers
/// in the same order, as windows need.
pub(crate) fn registered_all_reduce_on(cx: &RankCtx, window: bool) -> CaseResult {
    let (n, dtype, op) = (cx.size, DType::F32, ReduceOp::Sum);
    let caps = cx.comm.capabilities();
    let want_registered = if window { caps.windows } else { caps.buffer_registration };
    for (salt, count) in [(0usize, 1usize), (1, 1031), (2, 1 << 18)] {
        let input = values(cx.rank, count, Some(op), salt);
        let want: Vec<f64> = (0..count).map(|i| reduced(n, i, dtype, op, salt)).collect();
        let send: Arc<dyn DeviceMemory> = Arc::from(registrable(cx, dtype, &input)?);
        let send_reg = reg(cx, send.clone(), window)?;
        let mut recv = reg(cx, cx.platform.alloc_registrable(dtype, count)?, window)?;
        ensure!(
            send_reg.is_window() == window && recv.is_window() == window,
            "windows: send {}, recv {}; asked for windows: {window}",
            send_reg.is_window(),
            recv.is_window()
        );
        ensure!(
            send_reg.is_registered() == want_registered && recv.is_registered() == want_registered,
            "registered: send {}, recv {}; the backend's capability says {want_registered}",
            send_reg.is_registered(),
            recv.is_registered()
        );
        for round in 0..3 {
            cx.wait(cx.comm.all_reduce(Some(send_reg.view()), recv.view_mut(), op)?)?;
            check(
                &format!("out of place, {count} elements, round {round}"),
                &cx.download(&*recv)?,
                &want,
                dtype,
                Some(op),
            )?;
        }
        let mut buf = reg(cx, registrable(cx, dtype, &input)?, window)?;
        cx.wait(cx.comm.all_reduce(None, buf.view_mut(), op)?)?;
        check(&format!("in place, {count} elements"), &cx.download(&*buf)?, &want, dtype, Some(op))?;
        let recv = recv.into_inner()?;
        check(&format!("memory given back, {count} elements"), &cx.download(recv.as_ref())?, &want, dtype, Some(op))?;
        drop(buf);
        drop(send_reg);
        ensure!(Arc::strong_count(&send) == 1, "the registration kept its share of the memory after it was dropped");
    }
    Ok(())
}

fn registered_all_reduce(cx: &RankCtx) -> CaseResult {
    registered_all_reduce_on(cx, false)
}

/// Memory of no bytes is refused before the library sees it, naming the argument, the rank
/// and the group; the communicator works on.
fn register_rejects_empty(cx: &RankCtx) -> CaseResult {
    let empty = cx.platform.alloc_registrable(DType::F32, 0)?;
    match cx.comm.register(empty) {
        Err(Error::InvalidArgument { op: "register", arg: "mem", rank, group, .. })
            if rank == cx.rank && group == cx.comm.spec().name => {}
        Err(e) => return Err(crate::CaseError(format!("wrong error for an empty buffer: {e}"))),
        Ok(_) => return Err(crate::CaseError("an empty buffer was registered".into())),
    }
    all_reduce_works_on(cx, "all_reduce after the refusal")
}

/// A 7-element all_reduce on a plain buffer gives the right sums: the communicator still
/// works (after a refusal).
pub(crate) fn all_reduce_works_on(cx: &RankCtx, what: &str) -> CaseResult {
    let mut b = cx.upload(DType::F32, &values(cx.rank, 7, Some(ReduceOp::Sum), 0))?;
    cx.wait(cx.comm.all_reduce(None, b.view_mut(), ReduceOp::Sum)?)?;
    let want: Vec<f64> = (0..7).map(|i| reduced(cx.size, i, DType::F32, ReduceOp::Sum, 0)).collect();
    check(what, &cx.download(b.as_ref())?, &want, DType::F32, Some(ReduceOp::Sum))?;
    Ok(())
}

/// A registration (a window when `window`) still held when the communicator is aborted is
/// dropped without an error, a panic or a wait for the peers (the library dropped it with the
/// communicator), and its memory is usable.
pub(crate) fn outlives_abort_on(cx: &RankCtx, window: bool) -> CaseResult {
    let mut reg = reg(cx, registrable(cx, DType::F32, &[1.0; 64])?, window)?;
    cx.wait(cx.comm.all_reduce(None, reg.view_mut(), ReduceOp::Sum)?)?;
    cx.block_on(cx.comm.abort())?;
    let started = std::time::Instant::now();
    let mem = reg.into_inner()?;
    ensure!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "dropping the registration waited {:?}",
        started.elapsed()
    );
    let got = cx.download(mem.as_ref())?;
    ensure!(got.iter().all(|&v| v == cx.size as f64), "memory after the abort holds {:?}, not the sums", &got[..4]);
    Ok(())
}

fn registration_outlives_abort(cx: &RankCtx) -> CaseResult {
    outlives_abort_on(cx, false)
}

/// Add the registration cases to `v`.
pub fn register(v: &mut Vec<Case>) {
    v.push(Case::new("registration", "registered_all_reduce", &[1, 2, 3, 4], registered_all_reduce));
    v.push(Case::new("registration", "register_rejects_empty", &[1, 2], register_rejects_empty));
    v.push(Case::new("registration", "registration_outlives_abort", &[1, 2], registration_outlives_abort));
}
