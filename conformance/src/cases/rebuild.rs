//! Recovery in place: when a rank fails, the survivors abort their communicators and each
//! rebuilt group is a **new** communicator among the surviving members, connected under the
//! next epoch's namespace (`<name>@e<epoch>`; never `split`, which waits for every parent
//! rank, the dead one included). A replacement later connects the following epoch's groups
//! among all members again ("grow back").
//!
//! A rank "dies" in thread mode by aborting and dropping its communicators and taking no
//! further part (it may come back as a replacement, which uses none of its old handles); in
//! process mode it really dies (`std::process::abort`). Who is in at each epoch is told
//! through the store here, standing in for the membership layer. Every rebuilt group has a
//! short connect and operation deadline, so a case that goes wrong fails in seconds.

use crate::ensure;
use crate::harness::{CaseError, CaseResult, RankCtx};
use crate::pattern::{check, value, values};
use crate::registry::Case;
use anyccl_core::{CommConfig, Communicator, DType, Error, GroupSpec, ReduceOp, Role};
use std::time::{Duration, Instant};

/// How long connecting a rebuilt group may take.
const CONNECT: Duration = Duration::from_secs(10);
/// How long one operation on a rebuilt group may take.
const OP: Duration = Duration::from_secs(5);
/// Elements each check reduces or sends: odd, and more than a ring step's worth.
const COUNT: usize = 1031;
/// Abort, rebuild and grow-back cycles of `repeated_cycles`.
const CYCLES: usize = 10;

/// The namespace of group `name` at `epoch`.
fn epoch_name(name: &str, epoch: usize) -> String {
    format!("{name}@e{epoch}")
}

/// Connect group `name` at `epoch` among `members` (world ranks, in group-rank order; this
/// rank is one of them), waiting at most `limit`.
fn connect_within(
    cx: &RankCtx,
    name: &str,
    epoch: usize,
    members: &[usize],
    role: Role,
    limit: Duration,
) -> anyccl_core::Result<Communicator> {
    let me = members.iter().position(|&r| r == cx.rank).unwrap_or(usize::MAX);
    let spec = GroupSpec::new(epoch_name(name, epoch), members.to_vec(), "conformance", role);
    let config = CommConfig { op_timeout: OP, init_timeout: limit, ..cx.comm.config().clone() };
    cx.block_on(Communicator::connect(cx.backend.as_ref(), spec, me, cx.store.clone(), cx.platform.device(), config))
}

/// [`connect_within`] the usual connect deadline, its error naming the group.
fn connect(cx: &RankCtx, name: &str, epoch: usize, members: &[usize], role: Role) -> Result<Communicator, CaseError> {
    connect_within(cx, name, epoch, members, role, CONNECT).map_err(|e| {
        CaseError(format!("connect '{}' among {members:?}: {} error: {e}", epoch_name(name, epoch), e.kind()))
    })
}

/// A summed all_reduce of every member's pattern (salted by `salt`) on `comm`, whose members
/// are `members` (world ranks), checked element by element.
fn reduce_checked(cx: &RankCtx, comm: &Communicator, members: &[usize], salt: usize) -> CaseResult {
    let mut b = cx.upload(DType::F32, &values(cx.rank, COUNT, None, salt))?;
    comm.all_reduce(None, b.view_mut(), ReduceOp::Sum)?.wait(OP)?;
    let want: Vec<f64> = (0..COUNT).map(|i| members.iter().map(|&r| value(r, i, None, salt)).sum()).collect();
    check(&format!("all_reduce on '{}'", comm.spec().name), &cx.download(b.as_ref())?, &want, DType::F32, None)?;
    Ok(())
}

/// Both stages of a two-member pipeline group pass their pattern to the other (stage 0
/// first), and each checks what it got.
fn pipe_checked(cx: &RankCtx, pp: &Communicator, members: &[usize], salt: usize) -> CaseResult {
    let (me, peer) = (pp.rank(), 1 - pp.rank());
    let mine = cx.upload(DType::F32, &values(cx.rank, COUNT, None, salt))?;
    let mut got = cx.zeros(DType::F32, COUNT)?;
    for turn in 0..2 {
        if me == turn {
            pp.send(mine.view(), peer)?.wait(OP)?;
        } else {
            pp.recv(got.view_mut(), peer)?.wait(OP)?;
        }
    }
    let what = format!("recv on '{}' from stage {peer}", pp.spec().name);
    check(&what, &cx.download(got.as_ref())?, &values(members[peer], COUNT, None, salt), DType::F32, None)?;
    Ok(())
}

/// Wait until every rank of `ranks` has signalled `key-<rank>`.
fn await_all(cx: &RankCtx, key: &str, ranks: &[usize]) -> CaseResult {
    ranks.iter().try_for_each(|r| cx.await_signal(&format!("{key}-{r}")))
}

/// This rank dies: it aborts and drops `comms`, says so under `key`, and takes no further
/// part in them.
fn die(cx: &RankCtx, comms: Vec<Communicator>, key: &str) -> CaseResult {
    for c in &comms {
        cx.block_on(c.abort())?;
    }
    drop(comms);
    cx.signal(key)
}

/// What a survivor's next operation on a group with a dead member is.
#[derive(Debug, Clone, Copy)]
enum Probe {
    AllReduce,
    /// A receive from this group rank.
    RecvFrom(usize),
}

/// A survivor's next operation on `old`, which has lost a member, ends in an error
/// (`PeerFailed`, `Aborted` or `Timeout`, naming the group) within a bound: 10 s where the
/// backend detects peer failure, a 2 s wait otherwise (plus the operation timeout where a
/// call may block). Then `old` is aborted, as recovery does. `issued`: a key signalled once
/// the operation is enqueued (for a peer that dies while it is in flight).
fn next_op_fails(cx: &RankCtx, old: &Communicator, probe: Probe, issued: Option<&str>) -> CaseResult {
    let caps = old.capabilities();
    let (wait, bound) = match (caps.detects_peer_failure, caps.first_call_may_block) {
        (true, _) => (Duration::from_secs(10), Duration::from_secs(10)),
        (false, blocks) => (Duration::from_secs(2), Duration::from_secs(5) + if blocks { OP } else { Duration::ZERO }),
    };
    let mut b = cx.upload(DType::F32, &values(cx.rank, COUNT, None, 99))?;
    let t = Instant::now();
    let enqueued = match probe {
        Probe::AllReduce => old.all_reduce(None, b.view_mut(), ReduceOp::Sum),
        Probe::RecvFrom(p) => old.recv(b.view_mut(), p),
    };
    if let Some(key) = issued {
        cx.signal(key)?;
    }
    let r = match enqueued {
        Ok(mut w) => {
            let r = w.wait(wait);
            // Aborted before the pending operation is dropped (a drop waits for it).
            cx.block_on(old.abort())?;
            r
        }
        Err(e) => Err(e),
    };
    let took = t.elapsed();
    let group = &old.spec().name;
    match r {
        Err(e @ (Error::PeerFailed { .. } | Error::Aborted { .. } | Error::Timeout { .. })) => {
            ensure!(e.to_string().contains(group.as_str()), "the error does not name group '{group}': {e}");
        }
        Err(e) => {
            return Err(CaseError(format!(
                "{probe:?} on '{group}': expected PeerFailed, Aborted or Timeout, got {} error: {e}",
                e.kind()
            )))
        }
        Ok(()) => return Err(CaseError(format!("{probe:?} on '{group}' succeeded without its dead member"))),
    }
    ensure!(took < bound, "{probe:?} on '{group}' took {took:?} to fail (bound {bound:?})");
    cx.block_on(old.abort())?;
    Ok(())
}

/// `survivors_rebuild_past_a_dead_rank` (and with `grow`, `grow_back`): every rank reduces on
/// `world@e0`; the last rank dies (while the survivors' next all_reduce is in flight, or,
/// growing back, between operations); the survivors' all_reduce fails, they abort `world@e0`
/// and connect `world@e1` among themselves, which reduces correctly. Growing back, the dead
/// rank then returns as a replacement and everyone connects `world@e2`.
fn rebuild(cx: &RankCtx, grow: bool) -> CaseResult {
    let all: Vec<usize> = (0..cx.size).collect();
    let victim = cx.size - 1;
    let survivors = &all[..victim];
    let e0 = connect(cx, "world", 0, &all, Role::World)?;
    reduce_checked(cx, &e0, &all, 0)?;
    cx.signal(&format!("e0-{}", cx.rank))?;
    if cx.rank == victim {
        match grow {
            // Dies between operations, once every rank finished the first.
            true => await_all(cx, "e0", &all)?,
            // Dies while the survivors' next operation is in flight.
            false => await_all(cx, "issued", survivors)?,
        }
        die(cx, vec![e0], "dead")?;
        if !grow {
            return Ok(());
        }
        // The replacement arrives once the survivors run without it.
        await_all(cx, "e1", survivors)?;
    } else {
        let issued = format!("issued-{}", cx.rank);
        match grow {
            true => {
                cx.await_signal("dead")?;
                next_op_fails(cx, &e0, Probe::AllReduce, None)?;
            }
            false => next_op_fails(cx, &e0, Probe::AllReduce, Some(&issued))?,
        }
        drop(e0);
        let e1 = connect(cx, "world", 1, survivors, Role::World)?;
        reduce_checked(cx, &e1, survivors, 1)?;
        cx.signal(&format!("e1-{}", cx.rank))?;
        cx.block_on(e1.shutdown())?;
        if !grow {
            return Ok(());
        }
    }
    let e2 = connect(cx, "world", 2, &all, Role::World)?;
    reduce_checked(cx, &e2, &all, 2)?;
    cx.block_on(e2.shutdown())?;
    Ok(())
}

/// Two pipeline stages of `dp` data-parallel replicas each: world rank `stage * dp + replica`.
#[derive(Debug, Clone, Copy)]
struct Grid {
    dp: usize,
}

impl Grid {
    fn stage(&self, r: usize) -> usize {
        r / self.dp
    }
    fn replica(&self, r: usize) -> usize {
        r % self.dp
    }
    /// The data group of `stage` over the replicas in service.
    fn data(&self, stage: usize, replicas: &[usize]) -> Vec<usize> {
        replicas.iter().map(|j| stage * self.dp + j).collect()
    }
    /// The pipeline group of `replica`: its stage 0, then its stage 1.
    fn pipe(&self, replica: usize) -> Vec<usize> {
        vec![replica, self.dp + replica]
    }

    /// This rank's data and pipeline groups at `epoch` with `replicas` in service, each
    /// checked; `None` for a rank whose replica is out of service.
    fn connect(
        &self,
        cx: &RankCtx,
        epoch: usize,
        replicas: &[usize],
    ) -> Result<Option<(Communicator, Communicator)>, CaseError> {
        let (s, j) = (self.stage(cx.rank), self.replica(cx.rank));
        if !replicas.contains(&j) {
            return Ok(None);
        }
        // Every rank connects its data group first: those are disjoint, and so are the
        // pipeline groups after them, so no connect waits on a rank inside another.
        let data = self.data(s, replicas);
        let dp = connect(cx, &format!("dp-stage{s}"), epoch, &data, Role::Data)?;
        let pipe = self.pipe(j);
        let pp = connect(cx, &format!("pp-replica{j}"), epoch, &pipe, Role::Pipeline)?;
        reduce_checked(cx, &dp, &data, 10 + epoch)?;
        pipe_checked(cx, &pp, &pipe, 20 + epoch)?;
        Ok(Some((dp, pp)))
    }
}

/// Data and pipeline groups (2 stages x 2 or 4 replicas) at `e0`; the last rank (stage 1 of
/// the last replica) dies between steps. Its data group's survivors and its pipeline
/// partner see their next operation fail; everyone aborts every group of `e0`. At `e1` the
/// broken replica is out of service (its stage-0 rank waits as a spare) and the others'
/// groups are rebuilt among them; at `e2` the replacement is back and the full grid is
/// rebuilt. Every group is checked at every epoch.
fn sub_groups(cx: &RankCtx) -> CaseResult {
    let g = Grid { dp: cx.size / 2 };
    let all: Vec<usize> = (0..cx.size).collect();
    let replicas: Vec<usize> = (0..g.dp).collect();
    let victim = cx.size - 1;
    let (dp, pp) = g.connect(cx, 0, &replicas)?.ok_or("no groups at e0")?;
    cx.signal(&format!("e0-{}", cx.rank))?;
    if cx.rank == victim {
        await_all(cx, "e0", &all)?;
        die(cx, vec![dp, pp], "dead")?;
        await_all(cx, "e1", &all[..victim])?;
    } else {
        cx.await_signal("dead")?;
        if g.stage(cx.rank) == g.stage(victim) {
            next_op_fails(cx, &dp, Probe::AllReduce, None)?;
        }
        if g.replica(cx.rank) == g.replica(victim) {
            next_op_fails(cx, &pp, Probe::RecvFrom(1), None)?;
        }
        for c in [&dp, &pp] {
            cx.block_on(c.abort())?;
        }
        drop((dp, pp));
        let e1 = g.connect(cx, 1, &replicas[..g.dp - 1])?;
        cx.signal(&format!("e1-{}", cx.rank))?;
        if let Some((dp, pp)) = e1 {
            cx.block_on(dp.shutdown())?;
            cx.block_on(pp.shutdown())?;
        }
    }
    let (dp, pp) = g.connect(cx, 2, &replicas)?.ok_or("no groups at e2")?;
    cx.block_on(dp.shutdown())?;
    cx.block_on(pp.shutdown())?;
    Ok(())
}

/// Ten cycles of: reduce on the world of epoch 2k; rank `k % n` dies; the survivors abort it
/// and connect epoch 2k+1 among themselves, reduce and shut it down; the dead rank returns
/// and everyone connects epoch 2k+2. Every reduction is checked.
fn repeated_cycles(cx: &RankCtx) -> CaseResult {
    let (n, me) = (cx.size, cx.rank);
    let all: Vec<usize> = (0..n).collect();
    let mut world = connect(cx, "world", 0, &all, Role::World)?;
    for k in 0..CYCLES {
        let victim = k % n;
        let survivors: Vec<usize> = all.iter().copied().filter(|&r| r != victim).collect();
        reduce_checked(cx, &world, &all, 3 * k)?;
        cx.signal(&format!("c{k}-reduced-{me}"))?;
        if me == victim {
            await_all(cx, &format!("c{k}-reduced"), &all)?;
            die(cx, vec![world], &format!("c{k}-dead"))?;
            await_all(cx, &format!("c{k}-shrunk"), &survivors)?;
        } else {
            cx.await_signal(&format!("c{k}-dead"))?;
            cx.block_on(world.abort())?;
            drop(world);
            let shrunk = connect(cx, "world", 2 * k + 1, &survivors, Role::World)?;
            reduce_checked(cx, &shrunk, &survivors, 3 * k + 1)?;
            cx.block_on(shrunk.shutdown())?;
            drop(shrunk);
            cx.signal(&format!("c{k}-shrunk-{me}"))?;
        }
        world = connect(cx, "world", 2 * k + 2, &all, Role::World)?;
    }
    reduce_checked(cx, &world, &all, 3 * CYCLES)?;
    cx.block_on(world.shutdown())?;
    Ok(())
}

/// Every rank aborts its own communicator of `refuse@e0`: each later call returns at once
/// with `Aborted` naming the group (an operation, a barrier, health), never a hang; a
/// second abort and a shutdown after it are harmless.
fn old_refuses(cx: &RankCtx) -> CaseResult {
    let all: Vec<usize> = (0..cx.size).collect();
    let comm = connect(cx, "refuse", 0, &all, Role::World)?;
    reduce_checked(cx, &comm, &all, 0)?;
    // No rank aborts while a peer is still inside the check.
    cx.signal(&format!("checked-{}", cx.rank))?;
    await_all(cx, "checked", &all)?;
    cx.block_on(comm.abort())?;
    let group = comm.spec().name.clone();
    let expect_aborted = |what: &str, r: anyccl_core::Result<()>, t: Instant| -> CaseResult {
        match r {
            Err(Error::Aborted { group: g, .. }) if g == group => {}
            Err(e) => {
                return Err(CaseError(format!(
                    "{what} after abort: expected Aborted naming '{group}', got {} error: {e}",
                    e.kind()
                )))
            }
            Ok(()) => return Err(CaseError(format!("{what} after abort succeeded"))),
        }
        ensure!(t.elapsed() < Duration::from_secs(2), "{what} after abort took {:?}", t.elapsed());
        Ok(())
    };
    let mut b = cx.upload(DType::F32, &values(cx.rank, COUNT, None, 1))?;
    let t = Instant::now();
    let r = comm.all_reduce(None, b.view_mut(), ReduceOp::Sum).and_then(|mut w| w.wait(Duration::from_secs(1)));
    expect_aborted("all_reduce", r, t)?;
    let t = Instant::now();
    expect_aborted("barrier", comm.barrier().and_then(|mut w| w.wait(Duration::from_secs(1))), t)?;
    let t = Instant::now();
    expect_aborted("health", cx.block_on(comm.health()), t)?;
    let t = Instant::now();
    cx.block_on(comm.abort())?;
    let shut = cx.block_on(comm.shutdown());
    ensure!(matches!(shut, Ok(()) | Err(Error::Aborted { .. })), "shutdown after abort: {shut:?}");
    ensure!(t.elapsed() < Duration::from_secs(2), "a second abort and a shutdown took {:?}", t.elapsed());
    Ok(())
}

/// Process mode: rank 1 really dies (its process aborts) once every rank finished a first
/// all_reduce on `world@e0`; the survivors' next all_reduce fails, and `world@e1` among
/// them reduces correctly.
fn killed_process(cx: &RankCtx) -> CaseResult {
    let all: Vec<usize> = (0..cx.size).collect();
    let survivors: Vec<usize> = all.iter().copied().filter(|&r| r != 1).collect();
    let e0 = connect(cx, "world", 0, &all, Role::World)?;
    reduce_checked(cx, &e0, &all, 0)?;
    cx.signal(&format!("e0-{}", cx.rank))?;
    if cx.rank == 1 {
        await_all(cx, "e0", &all)?;
        std::process::abort();
    }
    next_op_fails(cx, &e0, Probe::AllReduce, None)?;
    drop(e0);
    let e1 = connect(cx, "world", 1, &survivors, Role::World)?;
    reduce_checked(cx, &e1, &survivors, 1)?;
    cx.block_on(e1.shutdown())?;
    Ok(())
}

/// Process mode, a failure during a rebuild: `world@e1` lists rank 1 first (its group rank
/// 0, the one that starts the connect and publishes what the others need), and rank 1's
/// process dies 300 ms into its connect; the others arrive after it is gone. Every other rank's
/// connect fails within its deadline (3 s, plus 5 s) with an error naming `world@e1`; a
/// second failure starts a new epoch: `world@e2` among the rest reduces correctly.
fn dies_during_connect(cx: &RankCtx) -> CaseResult {
    let all: Vec<usize> = (0..cx.size).collect();
    let e0 = connect(cx, "world", 0, &all, Role::World)?;
    reduce_checked(cx, &e0, &all, 0)?;
    cx.signal(&format!("e0-{}", cx.rank))?;
    await_all(cx, "e0", &all)?;
    // The job rebuilds (as after an earlier failure): everyone leaves e0.
    cx.block_on(e0.abort())?;
    drop(e0);
    let mut e1: Vec<usize> = vec![1, 0];
    e1.extend(2..cx.size);
    let limit = Duration::from_secs(3);
    if cx.rank == 1 {
        // Said first: the others start their connect only once this process is gone.
        cx.signal("dying")?;
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            std::process::abort();
        });
        let r = connect_within(cx, "world", 1, &e1, Role::World, cx.timeout);
        return Err(CaseError(format!("rank 1 outlived its connect: {:?}", r.map(|_| ()))));
    }
    cx.await_signal("dying")?;
    std::thread::sleep(Duration::from_secs(1));
    let t = Instant::now();
    let r = connect_within(cx, "world", 1, &e1, Role::World, limit);
    let took = t.elapsed();
    match r {
        Err(e) => ensure!(e.to_string().contains("world@e1"), "the connect's error does not name 'world@e1': {e}"),
        Ok(_) => return Err("world@e1 connected without rank 1".into()),
    }
    ensure!(took < limit + Duration::from_secs(5), "the failed connect took {took:?}");
    let rest: Vec<usize> = all.iter().copied().filter(|&r| r != 1).collect();
    let e2 = connect(cx, "world", 2, &rest, Role::World)?;
    reduce_checked(cx, &e2, &rest, 2)?;
    cx.block_on(e2.shutdown())?;
    Ok(())
}

/// A namespace connected twice (a recovery that rebuilds the same epoch again) gives two
/// separate communicators: operations on both at once each reduce correctly, and aborting
/// the first leaves the second working.
fn connected_twice(cx: &RankCtx) -> CaseResult {
    let all: Vec<usize> = (0..cx.size).collect();
    let first = connect(cx, "world", 1, &all, Role::World)?;
    let second = connect(cx, "world", 1, &all, Role::World)?;
    let mut a = cx.upload(DType::F32, &values(cx.rank, COUNT, None, 1))?;
    let mut b = cx.upload(DType::F32, &values(cx.rank, COUNT, None, 2))?;
    // Both in flight at once, waited in the other order.
    let mut wa = first.all_reduce(None, a.view_mut(), ReduceOp::Sum)?;
    let mut wb = second.all_reduce(None, b.view_mut(), ReduceOp::Sum)?;
    wb.wait(OP)?;
    wa.wait(OP)?;
    drop((wa, wb));
    for (buf, salt) in [(&a, 1), (&b, 2)] {
        let want: Vec<f64> = (0..COUNT).map(|i| all.iter().map(|&r| value(r, i, None, salt)).sum()).collect();
        check(&format!("world@e1, connect with salt {salt}"), &cx.download(buf.as_ref())?, &want, DType::F32, None)?;
    }
    cx.signal(&format!("both-{}", cx.rank))?;
    await_all(cx, "both", &all)?;
    cx.block_on(first.abort())?;
    drop(first);
    reduce_checked(cx, &second, &all, 3)?;
    cx.block_on(second.shutdown())?;
    Ok(())
}

/// Register the rebuild cases.
pub fn register(v: &mut Vec<Case>) {
    let w = &[2, 3, 4, 5, 8];
    v.push(Case::new("rebuild", "survivors_rebuild_past_a_dead_rank", w, |cx| rebuild(cx, false)));
    v.push(Case::new("rebuild", "grow_back", w, |cx| rebuild(cx, true)));
    v.push(Case::new("rebuild", "sub_groups_rebuilt", &[4, 8], sub_groups));
    v.push(Case::new("rebuild", "repeated_cycles", &[2, 3, 4], repeated_cycles));
    v.push(Case::new("rebuild", "old_communicator_refuses_after_abort", &[1, 2, 3], old_refuses));
    v.push(
        Case::new("rebuild", "survivors_rebuild_past_a_killed_process", &[2, 3, 4], killed_process).processes(Some(1)),
    );
    v.push(
        Case::new("rebuild", "rank_dies_during_next_epoch_connect", &[2, 3, 4], dies_during_connect).processes(Some(1)),
    );
    v.push(Case::new("rebuild", "epoch_namespace_connected_twice", &[2, 3, 4], connected_twice));
}
