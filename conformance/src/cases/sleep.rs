//! Sleep and wake: a group gives its communicator back ([`Communicator::sleep`]) and
//! connects a new one among the same members ([`Communicator::wake`]), the program keeping
//! its `Communicator`. Results after each wake are checked element by element; misuse is an
//! error naming the group before anything is exchanged; a member that never calls sleep or
//! wake is a `Timeout` on the others, never a hang. Each case connects a group of its own
//! with short deadlines, so a case that goes wrong fails in seconds.

use crate::ensure;
use crate::harness::{CaseError, CaseResult, RankCtx};
use crate::pattern::{check, value, values};
use crate::registry::Case;
use anyccl_core::{CommConfig, Communicator, DType, Error, ReduceOp, Role};
use std::time::Duration;

/// How long connecting (and so sleeping and waking) may take.
const CONNECT: Duration = Duration::from_secs(10);
/// How long one operation may take.
const OP: Duration = Duration::from_secs(5);
/// Elements each check reduces: odd, and more than a ring step's worth.
const COUNT: usize = 1031;
/// Sleep and wake cycles of `wake_gives_correct_results`.
const CYCLES: usize = 3;

/// A group of every rank named `name` with `role`, connected within `limit`.
fn connect_as(cx: &RankCtx, name: &str, role: Role, limit: Duration) -> Result<Communicator, CaseError> {
    let config = CommConfig { op_timeout: OP, init_timeout: limit, ..cx.comm.config().clone() };
    cx.connect_all(name, role, config).map_err(|e| CaseError(format!("connect '{name}': {} error: {e}", e.kind())))
}

/// A data group of every rank named `name`, connected within `limit`.
fn connect(cx: &RankCtx, name: &str, limit: Duration) -> Result<Communicator, CaseError> {
    connect_as(cx, name, Role::Data, limit)
}

/// A summed all_reduce of every rank's pattern (salted by `salt`), checked.
fn reduce_checked(cx: &RankCtx, comm: &Communicator, salt: usize) -> CaseResult {
    let mut b = cx.upload(DType::F32, &values(cx.rank, COUNT, None, salt))?;
    comm.all_reduce(None, b.view_mut(), ReduceOp::Sum)?.wait(OP)?;
    let want: Vec<f64> = (0..COUNT).map(|i| (0..cx.size).map(|r| value(r, i, None, salt)).sum()).collect();
    check(
        &format!("all_reduce on '{}' (salt {salt})", comm.spec().name),
        &cx.download(b.as_ref())?,
        &want,
        DType::F32,
        None,
    )?;
    Ok(())
}

/// `r` is an `InvalidArgument` naming `op`, the group and `words`.
fn refused<T>(r: anyccl_core::Result<T>, op: &str, group: &str, words: &str) -> CaseResult {
    match r {
        Ok(_) => Err(CaseError(format!("{op} succeeded; expected an InvalidArgument saying '{words}'"))),
        Err(e @ Error::InvalidArgument { .. }) => {
            let text = e.to_string();
            ensure!(
                text.contains(group) && text.contains(words),
                "{op}: the error names neither '{group}' nor '{words}': {text}"
            );
            Ok(())
        }
        Err(e) => Err(CaseError(format!("{op}: expected InvalidArgument, got {} error: {e}", e.kind()))),
    }
}

/// Results are right before, between and after sleep and wake cycles; while asleep every
/// operation is refused naming the group.
fn wake_gives_correct_results(cx: &RankCtx) -> CaseResult {
    let mut comm = connect(cx, "sleepy", CONNECT)?;
    reduce_checked(cx, &comm, 0)?;
    for cycle in 1..=CYCLES {
        cx.block_on(comm.sleep())?;
        ensure!(comm.is_asleep(), "cycle {cycle}: not asleep after sleep");
        let mut b = cx.zeros(DType::F32, COUNT)?;
        refused(comm.all_reduce(None, b.view_mut(), ReduceOp::Sum), "all_reduce while asleep", "sleepy", "asleep")?;
        refused(comm.barrier(), "barrier while asleep", "sleepy", "asleep")?;
        cx.block_on(comm.wake(cx.backend.as_ref()))?;
        ensure!(!comm.is_asleep(), "cycle {cycle}: asleep after wake");
        reduce_checked(cx, &comm, cycle)?;
    }
    cx.block_on(comm.shutdown())?;
    Ok(())
}

/// Misuse is refused before anything is exchanged, and leaves the group as it was: a wake
/// without a sleep, a second sleep.
fn misuse_is_refused(cx: &RankCtx) -> CaseResult {
    let mut comm = connect(cx, "misused", CONNECT)?;
    refused(cx.block_on(comm.wake(cx.backend.as_ref())), "wake without sleep", "misused", "not asleep")?;
    reduce_checked(cx, &comm, 1)?;
    cx.block_on(comm.sleep())?;
    refused(cx.block_on(comm.sleep()), "a second sleep", "misused", "asleep already")?;
    cx.block_on(comm.wake(cx.backend.as_ref()))?;
    reduce_checked(cx, &comm, 2)?;
    Ok(())
}

/// Detail mode (every collective checked across the members first): an operation while
/// asleep is refused at once, not after the check's wait for members that issue nothing.
fn detail_mode_refuses_at_once(cx: &RankCtx) -> CaseResult {
    let config = CommConfig { detail: true, op_timeout: OP, init_timeout: CONNECT, ..cx.comm.config().clone() };
    let mut comm = cx.connect_all("sleepy-detail", Role::Data, config)?;
    reduce_checked(cx, &comm, 6)?;
    cx.block_on(comm.sleep())?;
    let mut b = cx.zeros(DType::F32, COUNT)?;
    let t = std::time::Instant::now();
    refused(comm.all_reduce(None, b.view_mut(), ReduceOp::Sum), "all_reduce while asleep", "sleepy-detail", "asleep")?;
    ensure!(t.elapsed() < Duration::from_secs(1), "refused after {:?}: it waited for the other members", t.elapsed());
    cx.block_on(comm.wake(cx.backend.as_ref()))?;
    reduce_checked(cx, &comm, 7)
}

/// A member that never calls sleep: the others' sleep is a `Timeout` naming it, and the
/// group is still awake and usable on every member.
fn member_never_sleeps(cx: &RankCtx) -> CaseResult {
    let mut comm = connect(cx, "insomniac", Duration::from_secs(2))?;
    let last = cx.size - 1;
    if cx.rank != last {
        match cx.block_on(comm.sleep()) {
            Err(e @ Error::Timeout { .. }) => {
                ensure!(e.to_string().contains(&format!("[{last}]")), "the timeout does not name rank {last}: {e}")
            }
            other => return Err(CaseError(format!("sleep without rank {last}: expected a Timeout, got {other:?}"))),
        }
        ensure!(!comm.is_asleep(), "asleep though a member never slept");
        cx.signal("insomniac-timed-out")?;
    } else {
        cx.await_signal("insomniac-timed-out")?;
        // Late: it adopts the verdict the others stored, at once, and stays awake too.
        let t = std::time::Instant::now();
        match cx.block_on(comm.sleep()) {
            Err(Error::Timeout { .. }) => {}
            other => {
                return Err(CaseError(format!("a sleep after the others timed out: expected a Timeout, got {other:?}")))
            }
        }
        ensure!(
            t.elapsed() < Duration::from_secs(1),
            "the late sleep waited {:?} instead of adopting the verdict",
            t.elapsed()
        );
        ensure!(!comm.is_asleep(), "the late member is asleep alone");
    }
    reduce_checked(cx, &comm, 3)?;
    // Every member counted the failed meeting alike: the next sleep and wake meet.
    cx.block_on(comm.sleep())?;
    cx.block_on(comm.wake(cx.backend.as_ref()))?;
    reduce_checked(cx, &comm, 8)
}

/// A member that never wakes: the others' wake fails with a `Timeout` within the connect
/// deadline (never a hang), and they stay asleep.
fn member_never_wakes(cx: &RankCtx) -> CaseResult {
    let mut comm = connect(cx, "sleeper", Duration::from_secs(3))?;
    cx.block_on(comm.sleep())?;
    let last = cx.size - 1;
    if cx.rank == last {
        cx.await_signal("sleeper-woke-alone")?;
        return Ok(());
    }
    let r = cx.block_on(comm.wake(cx.backend.as_ref()));
    cx.signal("sleeper-woke-alone")?;
    match r {
        Err(Error::Timeout { .. }) => {}
        other => return Err(CaseError(format!("wake without rank {last}: expected a Timeout, got {other:?}"))),
    }
    ensure!(comm.is_asleep(), "awake though a member never woke");
    Ok(())
}

/// The warmup session of an engine's phases in job `job`: every rank of the case.
fn phase_session<'a>(cx: &'a RankCtx, job: &'a str, generation: u64) -> anyccl_warmup::Session<'a> {
    anyccl_warmup::Session {
        store: cx.store.as_ref(),
        job,
        generation,
        rank: cx.rank,
        world_size: cx.size,
        members: None,
        platform: cx.platform.as_ref(),
    }
}

/// The warmup of a wake: on, forced (the CPU backend connects at init), within [`CONNECT`].
fn phase_config() -> anyccl_warmup::WarmupConfig {
    anyccl_warmup::WarmupConfig { enabled: true, force: true, timeout: CONNECT, ..Default::default() }
}

/// An engine's groups sleep and wake in one call each (`anyccl_warmup::sleep_groups`,
/// `wake_groups`): the data and pipeline groups sleep, the cross-engine group is never
/// touched; the wake warms both again (its report names them), results are right, and a
/// second wake touches nothing.
fn engine_groups(cx: &RankCtx) -> CaseResult {
    use anyccl_warmup::{sleep_groups, wake_groups};
    let group = |name: &str, role: Role| connect_as(cx, name, role, CONNECT);
    let (mut dp, mut pp, mut sync) = (
        group("engine-dp", Role::Data)?,
        group("engine-pp", Role::Pipeline)?,
        group("engine-sync", Role::CrossEngine)?,
    );
    let session = |generation| phase_session(cx, "conformance-phases", generation);
    let cfg = phase_config();
    let slept = cx.block_on(sleep_groups(&session(1), &mut [&mut sync, &mut pp, &mut dp]))?;
    let names: Vec<&str> = slept.groups.iter().map(|g| g.group.as_str()).collect();
    ensure!(names == ["engine-dp", "engine-pp"], "slept {names:?}, expected the data and pipeline groups by name");
    ensure!(
        slept.untouched.iter().any(|(g, _)| g == "engine-sync"),
        "the cross-engine group is not reported untouched"
    );
    ensure!(dp.is_asleep() && pp.is_asleep() && !sync.is_asleep(), "the wrong groups sleep");
    reduce_checked(cx, &sync, 4)?;
    let woke =
        cx.block_on(wake_groups(&session(2), &mut [&mut dp, &mut pp, &mut sync], cx.backend.as_ref(), None, &cfg))?;
    ensure!(!dp.is_asleep() && !pp.is_asleep(), "asleep after wake_groups");
    let warmed = woke.warmup.as_ref().ok_or_else(|| CaseError("the wake warmed nothing".into()))?;
    for g in ["engine-dp", "engine-pp"] {
        ensure!(warmed.steps.iter().any(|s| s.group == g), "the warmup after the wake has no step on '{g}'");
    }
    reduce_checked(cx, &dp, 5)?;
    let again = cx.block_on(wake_groups(&session(3), &mut [&mut dp, &mut pp], cx.backend.as_ref(), None, &cfg))?;
    ensure!(again.groups.is_empty() && again.warmup.is_none(), "a second wake touched {:?}", again.groups);
    Ok(())
}

/// All or nothing across an engine's groups: the last rank leaves its pipeline group out of
/// `wake_groups`, so that group's wake times out on the others, while its data group wakes
/// everywhere. Every rank (the last one too, whose own wakes all succeeded) gets an error,
/// and both groups are asleep again on every rank; a retry in a new generation wakes both,
/// and results are right.
fn failed_wake_fails_everywhere(cx: &RankCtx) -> CaseResult {
    use anyccl_warmup::{sleep_groups, wake_groups};
    let group = |name: &str, role: Role| connect_as(cx, name, role, Duration::from_secs(3));
    let (mut dp, mut pp) = (group("partial-dp", Role::Data)?, group("partial-pp", Role::Pipeline)?);
    let session = |generation| phase_session(cx, "conformance-partial-wake", generation);
    let cfg = phase_config();
    cx.block_on(sleep_groups(&session(1), &mut [&mut dp, &mut pp]))?;
    let last = cx.rank == cx.size - 1;
    let woke = if last {
        cx.block_on(wake_groups(&session(2), &mut [&mut dp], cx.backend.as_ref(), None, &cfg))
    } else {
        cx.block_on(wake_groups(&session(2), &mut [&mut dp, &mut pp], cx.backend.as_ref(), None, &cfg))
    };
    match woke {
        Ok(r) => return Err(CaseError(format!("wake_groups succeeded though a group's wake failed: {r:?}"))),
        Err(e) => ensure!(
            matches!(e, Error::Timeout { .. } | Error::PeerFailed { .. }),
            "expected a Timeout or PeerFailed, got {} error: {e}",
            e.kind()
        ),
    }
    ensure!(
        dp.is_asleep() && pp.is_asleep(),
        "after the failed wake: dp asleep {}, pp asleep {}",
        dp.is_asleep(),
        pp.is_asleep()
    );
    cx.block_on(wake_groups(&session(3), &mut [&mut dp, &mut pp], cx.backend.as_ref(), None, &cfg))?;
    reduce_checked(cx, &dp, 9)?;
    reduce_checked(cx, &pp, 10)
}

/// Register the sleep cases.
pub fn register(v: &mut Vec<Case>) {
    v.push(Case::new("sleep", "wake_gives_correct_results", &[1, 2, 3, 4, 8], wake_gives_correct_results));
    v.push(Case::new("sleep", "misuse_is_refused", &[1, 2, 3], misuse_is_refused));
    v.push(Case::new("sleep", "member_never_sleeps", &[2, 3], member_never_sleeps));
    v.push(Case::new("sleep", "detail_mode_refuses_at_once", &[2, 3], detail_mode_refuses_at_once));
    v.push(Case::new("sleep", "member_never_wakes", &[2, 3], member_never_wakes));
    v.push(Case::new("sleep", "engine_groups_sleep_and_wake_warmed", &[2, 3, 4], engine_groups));
    v.push(Case::new("sleep", "failed_wake_fails_everywhere", &[2, 3], failed_wake_fails_everywhere));
}
