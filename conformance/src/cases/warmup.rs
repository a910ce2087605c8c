//! The warmup, driven through the fault-injecting wrapper: agreement, all-or-nothing,
//! idempotent generations, excluded cross-engine groups, every group size and pipeline
//! length. Runs on every backend (forced on CPU platforms).

use crate::ensure;
use crate::fault::{Fault, Faulty};
use crate::harness::{CaseError, CaseResult, RankCtx};
use anyccl_core::{Communicator, Error, GroupRegistry, GroupSpec, Role};
use anyccl_warmup::{
    plan_from_recording, warmup, warmup_plans, warmup_saved, MemSource, PlanFile, PlanIdentity, Report, Session, Sizes,
    StepRecorder, Target, WarmupConfig,
};
use std::time::{Duration, Instant};

fn config(timeout: Duration) -> WarmupConfig {
    WarmupConfig {
        enabled: true,
        force: true,
        timeout,
        sizes: Sizes { small_bytes: Some(1 << 10), large_bytes: Some(64 << 10), ..Sizes::default() },
        ..WarmupConfig::default()
    }
}

/// The world communicator seen as group `name` with `role`, behind a fault injector.
fn as_group(cx: &RankCtx, name: &str, role: Role, fault: Fault) -> Result<Communicator, CaseError> {
    let f = Faulty::new(cx.comm.collective().clone(), fault);
    let spec = GroupSpec::new(name, (0..cx.size).collect(), "conformance", role);
    Ok(Communicator::with_recorder(f, spec, cx.comm.config().clone(), cx.comm.flight_recorder().clone())?)
}

fn session<'a>(cx: &'a RankCtx, generation: u64) -> Session<'a> {
    Session {
        store: cx.store.as_ref(),
        job: "conformance",
        generation,
        rank: cx.rank,
        world_size: cx.size,
        members: None,
        platform: cx.platform.as_ref(),
    }
}

fn ops_of(r: &Report) -> Vec<String> {
    r.steps.iter().map(|s| format!("{}:{}", s.group, s.op)).collect()
}

/// A data group of any size (including 3, 5, 6, 7) gets all_reduce and
/// reduce_scatter/all_gather at both sizes; a group of one is excluded.
fn data_group(cx: &RankCtx) -> CaseResult {
    let g = as_group(cx, "dp", Role::Data, Fault::None)?;
    let r = cx.block_on(warmup(&session(cx, 1), &[Target::new(&g)], &config(Duration::from_secs(30))))?;
    if cx.size == 1 {
        ensure!(r.steps.is_empty() && r.excluded.len() == 1, "a group of one should be excluded: {r:?}");
        ensure!(g.issued() == 0, "{} collectives issued on a group of one", g.issued());
        return Ok(());
    }
    let ops = ops_of(&r);
    for want in ["dp:all_reduce", "dp:reduce_scatter", "dp:all_gather"] {
        ensure!(ops.iter().filter(|o| *o == want).count() == 2, "expected {want} at two sizes, got {ops:?}");
    }
    ensure!(g.issued() == 6, "expected 6 collectives, {} issued", g.issued());
    // Memory is the communicator's own count exactly where the backend claims to keep one.
    let counts = g.capabilities().memory_stats;
    ensure!(
        g.memory_held().is_some() == counts,
        "capabilities say memory_stats={counts} but memory_held() is {:?}",
        g.memory_held()
    );
    let want = if counts { MemSource::Communicator } else { MemSource::FreeMemory };
    ensure!(r.steps.iter().all(|s| s.mem_source == want), "expected memory from {want:?}: {:?}", r.steps);
    Ok(())
}

/// A pipeline of n stages: every adjacent pair in both directions, unbatched and batched.
fn pipeline(cx: &RankCtx) -> CaseResult {
    let g = as_group(cx, "pp", Role::Pipeline, Fault::None)?;
    let r = cx.block_on(warmup(&session(cx, 1), &[Target::new(&g)], &config(Duration::from_secs(30))))?;
    let n = cx.size;
    let neighbours = usize::from(cx.rank > 0) + usize::from(cx.rank + 1 < n);
    // per size: unbatched send+recv per neighbour, one batch per neighbour; no broadcast
    let want = 2 * (2 * neighbours + neighbours) as u64;
    ensure!(g.issued() == want, "stage {} of {n}: {} operations issued, expected {want}", cx.rank, g.issued());
    ensure!(ops_of(&r).iter().any(|o| o == "pp:send/recv batched"), "no batched step: {:?}", ops_of(&r));
    ensure!(!ops_of(&r).iter().any(|o| o == "pp:broadcast"), "a broadcast on the pipeline group: {:?}", ops_of(&r));
    Ok(())
}

/// An expert group dispatches tokens: all_to_all is warmed (a data group never gets one).
fn expert(cx: &RankCtx) -> CaseResult {
    let ep = as_group(cx, "ep", Role::Expert, Fault::None)?;
    let dp = as_group(cx, "dp", Role::Data, Fault::None)?;
    let r =
        cx.block_on(warmup(&session(cx, 1), &[Target::new(&ep), Target::new(&dp)], &config(Duration::from_secs(30))))?;
    let ops = ops_of(&r);
    ensure!(ops.iter().filter(|o| *o == "ep:all_to_all").count() == 2, "no all_to_all on the expert group: {ops:?}");
    ensure!(!ops.iter().any(|o| o == "dp:all_to_all"), "all_to_all on the data group: {ops:?}");
    ensure!(!ops.iter().any(|o| o == "ep:all_reduce"), "all_reduce on the expert group: {ops:?}");
    Ok(())
}

/// Rank 0 plans other sizes: every rank gets InvalidArgument and no collective is issued.
fn plan_mismatch(cx: &RankCtx) -> CaseResult {
    let g = as_group(cx, "dp", Role::Data, Fault::None)?;
    let mut cfg = config(Duration::from_secs(10));
    if cx.rank == 0 {
        cfg.sizes.large_bytes = Some(128 << 10);
    }
    let r = cx.block_on(warmup(&session(cx, 1), &[Target::new(&g)], &cfg));
    ensure!(matches!(r, Err(Error::InvalidArgument { arg: "plan", .. })), "expected a plan mismatch error, got {r:?}");
    ensure!(g.issued() == 0, "{} collectives issued despite the mismatch", g.issued());
    Ok(())
}

/// Rank 1 fails its second collective: every rank errors, and every rank's communicator is
/// aborted (no silent fallback to lazy connection).
fn probe_fails(cx: &RankCtx) -> CaseResult {
    let fault = if cx.rank == 1 { Fault::FailAt(1) } else { Fault::None };
    let g = as_group(cx, "dp", Role::Data, fault)?;
    let r = cx.block_on(warmup(&session(cx, 1), &[Target::new(&g)], &config(Duration::from_secs(20))));
    ensure!(r.is_err(), "rank {}: warmup succeeded although rank 1 failed", cx.rank);
    let h = cx.block_on(g.health());
    ensure!(h.is_err(), "rank {}: communicator still healthy after a failed warmup", cx.rank);
    Ok(())
}

/// Rank 1 hangs in its second collective: every rank returns Timeout within the deadline
/// plus 5 s.
fn rank_hangs(cx: &RankCtx) -> CaseResult {
    let fault = if cx.rank == 1 { Fault::HangAt(1) } else { Fault::None };
    let g = as_group(cx, "dp", Role::Data, fault)?;
    let t = Instant::now();
    let deadline = Duration::from_secs(3);
    // Rank 0 starts late, so the hung rank's deadline comes first and its abort closes the
    // connections rank 0 waits on: rank 0 must still report the warmup's timeout, not a peer
    // failure (a skew CI's loaded machine produced by chance).
    if cx.rank == 0 {
        std::thread::sleep(Duration::from_millis(500));
    }
    let r = cx.block_on(warmup(&session(cx, 1), &[Target::new(&g)], &config(deadline)));
    let took = t.elapsed();
    ensure!(matches!(r, Err(Error::Timeout { .. })), "rank {}: expected Timeout, got {r:?}", cx.rank);
    ensure!(took < deadline + Duration::from_secs(5), "rank {}: returned after {took:?}", cx.rank);
    Ok(())
}

/// A second call with the same generation replays the outcome and issues no collective; the
/// keys of old generations leave the store.
fn repeated_generation(cx: &RankCtx) -> CaseResult {
    let g = as_group(cx, "dp", Role::Data, Fault::None)?;
    let cfg = config(Duration::from_secs(20));
    let first = cx.block_on(warmup(&session(cx, 7), &[Target::new(&g)], &cfg))?;
    let issued = g.issued();
    let again = cx.block_on(warmup(&session(cx, 7), &[Target::new(&g)], &cfg))?;
    ensure!(g.issued() == issued, "the repeated generation issued {} collectives", g.issued() - issued);
    let shape =
        |r: &Report| r.steps.iter().map(|s| (s.group.clone(), s.op.clone(), s.bytes, s.mem_delta)).collect::<Vec<_>>();
    ensure!(again.replayed && shape(&again) == shape(&first), "the repeat did not return the recorded outcome");
    let next = cx.block_on(warmup(&session(cx, 8), &[Target::new(&g)], &cfg))?;
    ensure!(!next.replayed && g.issued() > issued, "a new generation should run again");
    // Each generation's first member removes the keys of the generation two before it: the
    // store does not grow with the generations.
    for generation in [9, 10] {
        cx.block_on(warmup(&session(cx, generation), &[Target::new(&g)], &cfg))?;
    }
    let held = |generation: u64| -> Result<bool, CaseError> {
        let key = format!("warmup/conformance/{generation}/final/{}", cx.rank);
        Ok(cx.block_on(cx.store.get(&key))?.is_some())
    };
    // The first member removes them after the verdict, which the others may read before.
    let since = std::time::Instant::now();
    loop {
        let kept: Vec<bool> = [7, 8, 9, 10].into_iter().map(held).collect::<Result<_, _>>()?;
        if kept == [false, false, true, true] {
            break;
        }
        ensure!(since.elapsed() < Duration::from_secs(5), "outcome keys of generations 7, 8, 9, 10 present: {kept:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Recovery in place: the last rank has left; the others connect a new group among
/// themselves under the next epoch's namespace and warm it as that epoch's members (a new
/// generation), without the rank that left ever calling; the group then reduces correctly.
/// A member list that leaves this rank out is refused before anything is published.
fn rebuilt_among_members(cx: &RankCtx) -> CaseResult {
    let survivors: Vec<usize> = (0..cx.size - 1).collect();
    let mut alone = session(cx, 3);
    alone.members = Some(&survivors);
    if cx.rank == cx.size - 1 {
        let refused = cx.block_on(warmup(&alone, &[], &config(Duration::from_secs(5))));
        let ok = matches!(&refused, Err(Error::InvalidArgument { arg, .. }) if *arg == "session.members");
        ensure!(ok, "a rank outside its members should be refused naming session.members: {refused:?}");
        return Ok(());
    }
    let spec = GroupSpec::new("dp@e1", survivors.clone(), "conformance", Role::Data);
    let dev = cx.platform.device();
    let cfg = cx.comm.config().clone();
    let g = cx.block_on(Communicator::connect(cx.backend.as_ref(), spec, cx.rank, cx.store.clone(), dev, cfg))?;
    let r = cx.block_on(warmup(&alone, &[Target::new(&g)], &config(Duration::from_secs(30))))?;
    if survivors.len() > 1 {
        ensure!(!r.steps.is_empty() && g.issued() > 0, "the rebuilt group was not warmed: {r:?}");
    }
    ensure!(r.generation == 3 && !r.replayed, "expected a first run of generation 3: {r:?}");
    let send = cx.upload(anyccl_core::DType::F32, &[(cx.rank + 1) as f64; 8])?;
    let mut recv = cx.zeros(anyccl_core::DType::F32, 8)?;
    cx.wait(g.all_reduce(Some(send.view()), recv.view_mut(), anyccl_core::ReduceOp::Sum)?)?;
    let want = (1..=survivors.len()).sum::<usize>() as f64;
    let got = cx.download(recv.as_ref())?;
    ensure!(got.iter().all(|v| *v == want), "the rebuilt group reduced to {got:?}, expected {want}");
    cx.block_on(g.shutdown())?;
    Ok(())
}

/// A registry holding a cross-engine group: targets are chosen by owner and role, the
/// cross-engine group is never touched even when passed in, and the warmup completes.
fn cross_engine(cx: &RankCtx) -> CaseResult {
    let dp = as_group(cx, "dp", Role::Data, Fault::None)?;
    let xe = as_group(cx, "weight-sync", Role::CrossEngine, Fault::None)?;
    let registry = GroupRegistry::new();
    registry.register(dp.spec().clone());
    registry.register(xe.spec().clone());
    let chosen = registry.filter("conformance", &[Role::Data, Role::Tensor, Role::Pipeline, Role::Expert]);
    ensure!(chosen.iter().all(|g| g.role != Role::CrossEngine), "the registry filter returned a cross-engine group");
    // Even a caller that passes it by mistake does not get it warmed.
    let r =
        cx.block_on(warmup(&session(cx, 1), &[Target::new(&dp), Target::new(&xe)], &config(Duration::from_secs(20))))?;
    ensure!(xe.issued() == 0, "{} operations issued on the cross-engine group", xe.issued());
    ensure!(r.excluded.iter().any(|(g, _)| g == "weight-sync"), "the report does not say the group was excluded");
    Ok(())
}

/// A recorded step (point-to-point with neighbours plus an all_reduce) becomes a plan the
/// members merge and replay.
fn recorded(cx: &RankCtx) -> CaseResult {
    let pp = as_group(cx, "pp", Role::Pipeline, Fault::None)?;
    let (n, me) = (cx.size, cx.rank);
    pp.start_recording();
    let a = cx.upload(anyccl_core::DType::BF16, &vec![1.0; 4096])?;
    let mut b = cx.zeros(anyccl_core::DType::BF16, 4096)?;
    if me + 1 < n {
        let ops = vec![anyccl_core::P2POp::Send(a.view(), me + 1), anyccl_core::P2POp::Recv(b.view_mut(), me + 1)];
        cx.wait(pp.p2p_group(ops)?)?;
    }
    if me > 0 {
        let ops = vec![anyccl_core::P2POp::Recv(b.view_mut(), me - 1), anyccl_core::P2POp::Send(a.view(), me - 1)];
        cx.wait(pp.p2p_group(ops)?)?;
    }
    cx.wait(pp.all_reduce(None, b.view_mut(), anyccl_core::ReduceOp::Sum)?)?;
    let rec = pp.take_recording();
    let plan = plan_from_recording(&pp, &rec, false).ok_or("no plan")?;
    let before = pp.issued();
    let r = cx.block_on(warmup_plans(&session(cx, 1), vec![(&pp, plan)], &config(Duration::from_secs(20))))?;
    ensure!(r.steps.iter().any(|s| s.op == "send/recv batched"), "the replay has no batched step: {:?}", ops_of(&r));
    ensure!(pp.issued() > before, "the replay issued nothing");
    Ok(())
}

/// A step on a data group (an all_reduce of 3000 f32) and a pipeline group (a batch with
/// each neighbour), recorded and merged across the members, as a saved plan of step 10.
fn record_step(cx: &RankCtx, dp: &Communicator, pp: &Communicator) -> Result<PlanFile, CaseError> {
    let (n, me) = (cx.size, cx.rank);
    let rec = StepRecorder::start(&[dp, pp], cx.platform.as_ref());
    let mut g = cx.zeros(anyccl_core::DType::F32, 3000)?;
    cx.wait(dp.all_reduce(None, g.view_mut(), anyccl_core::ReduceOp::Sum)?)?;
    let a = cx.upload(anyccl_core::DType::F32, &vec![1.0; 512])?;
    let mut b = cx.zeros(anyccl_core::DType::F32, 512)?;
    for peer in [me.checked_sub(1), (me + 1 < n).then_some(me + 1)].into_iter().flatten() {
        let ops = vec![anyccl_core::P2POp::Send(a.view(), peer), anyccl_core::P2POp::Recv(b.view_mut(), peer)];
        cx.wait(pp.p2p_group(ops)?)?;
    }
    let recorded = cx.block_on(rec.finish(&session(cx, 1), Duration::from_secs(20)))?;
    Ok(PlanFile { identity: identity(cx), plans: recorded.plans, cold_step: recorded.cost, path: None })
}

fn identity(cx: &RankCtx) -> PlanIdentity {
    PlanIdentity { job: "conformance".into(), step: 10, rank: cx.rank, world_size: cx.size, layout: "dp pp".into() }
}

/// The warmup of generation 2 on `dp` and `pp` from `saved`, within `secs`.
fn warm_saved(
    cx: &RankCtx,
    dp: &Communicator,
    pp: &Communicator,
    saved: &Result<PlanFile, String>,
    secs: u64,
) -> anyccl_core::Result<Report> {
    let targets = [Target::new(dp), Target::new(pp)];
    cx.block_on(warmup_saved(&session(cx, 2), &targets, saved, &config(Duration::from_secs(secs))))
}

/// The plan saved with a checkpoint is what recovery warms: the recorded operations and
/// sizes, merged across members (each rank saw only its own neighbours), and nothing of the
/// role plans; the report names the source and carries the cold step's cost.
fn saved_replay(cx: &RankCtx) -> CaseResult {
    let dp = as_group(cx, "dp", Role::Data, Fault::None)?;
    let pp = as_group(cx, "pp", Role::Pipeline, Fault::None)?;
    let saved = record_step(cx, &dp, &pp)?;
    let pp_plan = saved.plans.iter().find(|p| p.group == "pp").ok_or("no pipeline plan recorded")?;
    let pairs: Vec<(usize, usize)> = (0..cx.size - 1).map(|i| (i, i + 1)).collect();
    ensure!(
        pp_plan.steps.len() == 1 && pp_plan.steps[0].pairs == pairs && pp_plan.steps[0].count == 512,
        "the merged pipeline plan should be one batch of 512 over every neighbour pair: {:?}",
        pp_plan.steps
    );
    let (dp0, pp0) = (dp.issued(), pp.issued());
    let saved = Ok(saved);
    let r = warm_saved(cx, &dp, &pp, &saved, 20)?;
    let ops = ops_of(&r);
    ensure!(ops == ["dp:all_reduce", "pp:send/recv batched"], "expected the recorded step only, got {ops:?}");
    ensure!(r.steps[0].bytes == 3000 * 4, "all_reduce of {} bytes, the step's was 12000", r.steps[0].bytes);
    let neighbours = u64::from(cx.rank > 0) + u64::from(cx.rank + 1 < cx.size);
    ensure!(dp.issued() - dp0 == 1, "{} operations on the data group, expected 1", dp.issued() - dp0);
    ensure!(pp.issued() - pp0 == neighbours, "{} on the pipeline group, expected {neighbours}", pp.issued() - pp0);
    ensure!(
        r.sources.len() == 2 && r.sources.iter().all(|(_, s)| s.starts_with("recorded with the checkpoint of step 10")),
        "sources: {:?}",
        r.sources
    );
    ensure!(
        r.cold_step == saved.as_ref().ok().and_then(|f| f.cold_step.clone()),
        "the report lost the cold step's cost"
    );
    Ok(())
}

/// One rank's plan file is missing: every member of every group falls back to the role
/// plans together (recovery is never blocked), and the report names the file and the rank.
fn saved_fallback(cx: &RankCtx) -> CaseResult {
    let dp = as_group(cx, "dp", Role::Data, Fault::None)?;
    let pp = as_group(cx, "pp", Role::Pipeline, Fault::None)?;
    let saved = record_step(cx, &dp, &pp)?;
    let gone = "warmup plan file /ckpt/step000010/warmup-plan-rank1.json: missing or unreadable".to_string();
    let saved = if cx.rank == 1 { Err(gone.clone()) } else { Ok(saved) };
    let r = warm_saved(cx, &dp, &pp, &saved, 20)?;
    let ops = ops_of(&r);
    ensure!(ops.iter().filter(|o| *o == "dp:reduce_scatter").count() == 2, "not the data role plan: {ops:?}");
    ensure!(ops.iter().any(|o| o == "pp:send/recv"), "not the pipeline role plan: {ops:?}");
    for (g, why) in &r.sources {
        ensure!(
            why.starts_with("role plan") && why.contains("group rank 1") && why.contains(&gone),
            "group {g}: the fallback does not say why: {why}"
        );
    }
    Ok(())
}

/// Rank 0's saved plan differs from the others': every rank refuses before any device work.
fn saved_differ(cx: &RankCtx) -> CaseResult {
    let dp = as_group(cx, "dp", Role::Data, Fault::None)?;
    let pp = as_group(cx, "pp", Role::Pipeline, Fault::None)?;
    let mut saved = record_step(cx, &dp, &pp)?;
    if cx.rank == 0 {
        for p in saved.plans.iter_mut().filter(|p| p.group == "dp") {
            p.steps.iter_mut().for_each(|s| s.count *= 2);
        }
    }
    let (dp0, pp0) = (dp.issued(), pp.issued());
    let r = warm_saved(cx, &dp, &pp, &Ok(saved), 10);
    ensure!(matches!(r, Err(Error::InvalidArgument { arg: "plan", .. })), "expected a plan mismatch, got {r:?}");
    ensure!(dp.issued() == dp0 && pp.issued() == pp0, "operations issued despite the mismatch");
    Ok(())
}

/// Free memory below the recorded need: every rank refuses before any collective.
fn memory_refusal(cx: &RankCtx) -> CaseResult {
    let g = as_group(cx, "dp", Role::Data, Fault::None)?;
    let mut cfg = config(Duration::from_secs(10));
    cfg.memory_need = Some(u64::MAX / 4);
    let r = cx.block_on(warmup(&session(cx, 1), &[Target::new(&g)], &cfg));
    ensure!(matches!(r, Err(Error::InvalidArgument { .. })), "expected a refusal, got {r:?}");
    ensure!(g.issued() == 0, "{} collectives issued despite the refusal", g.issued());
    Ok(())
}

/// Register the warmup cases.
pub fn register(v: &mut Vec<crate::registry::Case>) {
    use crate::registry::Case;
    v.push(Case::new("warmup", "data_group_any_size", &[1, 2, 3, 4, 5, 6, 7, 8], data_group));
    v.push(
        Case::new("warmup", "pipeline_stages", &[2, 3, 4], pipeline)
            .needs(|c, _| (!c.p2p_group).then(|| "no batched point-to-point".into())),
    );
    v.push(Case::new("warmup", "expert_all_to_all", &[2, 3, 5], expert));
    v.push(Case::new("warmup", "plan_mismatch_errors_everywhere", &[2, 3], plan_mismatch));
    v.push(Case::new("warmup", "probe_failure_aborts_everywhere", &[2, 3, 4], probe_fails));
    v.push(Case::new("warmup", "hung_rank_times_out_everywhere", &[2, 3], rank_hangs));
    v.push(Case::new("warmup", "repeated_generation_issues_nothing", &[2, 3], repeated_generation));
    v.push(Case::new("warmup", "rebuilt_group_warmed_among_its_members", &[2, 3, 4, 8], rebuilt_among_members));
    v.push(Case::new("warmup", "cross_engine_group_never_touched", &[2, 3, 4], cross_engine));
    v.push(Case::new("warmup", "recorded_plan_replay", &[2, 3, 4], recorded));
    v.push(Case::new("warmup", "memory_precheck_refuses", &[2], memory_refusal));
    let batched = |c: &anyccl_core::Capabilities, _: usize| (!c.p2p_group).then(|| "no batched point-to-point".into());
    v.push(Case::new("warmup", "saved_plan_replays_the_recorded_step", &[2, 3, 4], saved_replay).needs(batched));
    v.push(Case::new("warmup", "saved_plan_missing_on_one_rank_falls_back", &[2, 3], saved_fallback).needs(batched));
    v.push(Case::new("warmup", "saved_plans_that_differ_refuse", &[2, 3], saved_differ).needs(batched));
}
