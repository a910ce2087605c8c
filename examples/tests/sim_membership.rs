//! The membership at small scale, by simulation (`anyccl-sim --fault kill-rank:R`): every
//! simulated rank a member over the store, one rank killed, the survivors' agreement and a
//! replacement's admission, as anyccl-sim checks them (every survivor holds one view without
//! the killed rank; every member then one view with the replacement), with the store
//! requests per rank held below constants. Times are printed, not asserted, beyond sanity
//! bounds.

use libtest_mimic::{Arguments, Failed, Trial};
use std::process::Command;
use std::time::{Duration, Instant};

type Outcome = Result<(), Failed>;

fn check(cond: bool, msg: impl FnOnce() -> String) -> Outcome {
    if cond {
        Ok(())
    } else {
        Err(msg().into())
    }
}

/// Requests of one agreement per rank (the members' own: proposing, arriving, looking for
/// the decision and the leader, three requests a look, one look a second while they wait;
/// the leader's gathering), beats apart. Measured: 5 to 7.5 at 64 to 4,096 ranks, 10.7 at
/// most (an agreement that waited longer); the kill of a run whose replacement also pushes
/// out a live rank (`--fault kill-rank:5 --rejoin=7`, 64 ranks) 5.3-11.4 in six runs on a
/// quiet machine and 12.1 and 12.3 in two CI runs on a loaded one, its survivors hearing of
/// the kill within 1.1 ms of each other. Still far below what requests that grew with the
/// ranks would make (64 and more a rank here).
const AGREEMENT_OPS_PER_RANK: f64 = 16.0;
/// The same when the leader died before deciding: the others wait out its liveness limit
/// (3 s, three more looks) before one takes over. Measured: 16.2.
const LEADER_LOST_AGREEMENT_OPS_PER_RANK: f64 = 24.0;
/// Requests of one more look a member makes while it waits for an agreement (three a look,
/// one look a second): an agreement on a kill also waits for the survivors that heard of it
/// last, so each second between the first and the last to hear adds one look to those that
/// heard first (a CI run on a loaded machine: heard at 4.0-5.0 s, 12.1 requests a rank).
const LOOK_OPS_PER_RANK: f64 = 3.0;
/// Liveness requests per member a second at a 1 s beat: two a beat (a renewal, one read of
/// the proposal and the watched member's record), a third while a proposal is pending.
/// Measured: 2.1 to 2.8.
const BEAT_OPS_PER_MEMBER_S: f64 = 3.5;
/// Every request from the kill to every survivor's view, beats included (about five
/// seconds of them). Measured: 17 to 26.
const KILL_OPS_PER_RANK: f64 = 40.0;
/// Requests a rank a second while waiting longer than those five seconds (a loaded machine
/// hears of a dead leader later: CI once took 8 s and 40.5 requests): its beats and one look
/// of three requests a second for the decision, none of which grows with the ranks.
const LATE_OPS_PER_RANK_S: f64 = BEAT_OPS_PER_MEMBER_S + 3.0;

/// `anyccl-sim --json` with `args`: its figures, once its own check passed.
fn simulate(args: &[&str]) -> Result<serde_json::Value, Failed> {
    simulate_with(args, &[])
}

/// [`simulate`] with `env` set for the simulation.
fn simulate_with(args: &[&str], env: &[(&str, &str)]) -> Result<serde_json::Value, Failed> {
    let t = Instant::now();
    // A 1 s beat: the constants below count requests at that beat (the default, the
    // library's 250 ms, makes four times the liveness requests a second).
    let out = Command::new(env!("CARGO_BIN_EXE_anyccl-sim"))
        .args(args)
        .args(["--beat-ms", "1000", "--json"])
        .envs(env.iter().copied())
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let j: serde_json::Value = serde_json::from_str(text.trim()).map_err(|e| {
        format!("anyccl-sim {args:?} printed no figures ({e}):\n{text}\n{}", String::from_utf8_lossy(&out.stderr))
    })?;
    check(out.status.success() && j["fault"]["passed"] == true, || {
        format!("anyccl-sim {args:?}: {}", j["fault"]["check"])
    })?;
    check(t.elapsed() < Duration::from_secs(120), || format!("anyccl-sim {args:?} took {:?}", t.elapsed()))?;
    let e = &j["events"];
    eprintln!(
        "anyccl-sim {args:?}: kill to every survivor's view {} ms ({} requests a rank, {} of the agreement); \
         replacement admitted in {} ms",
        e["kill"]["ms"], e["kill"]["store_ops_per_rank"], e["kill"]["agreement_ops_per_rank"], e["join"]["admitted_ms"]
    );
    Ok(j)
}

fn figure(j: &serde_json::Value, event: &str, what: &str) -> f64 {
    j["events"][event][what].as_f64().unwrap_or(f64::NAN)
}

/// The store requests of each agreement and of the beats stay below constants per rank
/// (`leader_lost`: the killed rank may have led the start's agreement).
fn requests_below_constants(j: &serde_json::Value, leader_lost: bool) -> Outcome {
    for event in ["start", "kill", "join"].into_iter().filter(|e| !j["events"][e].is_null()) {
        let ops = figure(j, event, "agreement_ops_per_rank");
        let base =
            if leader_lost && event != "join" { LEADER_LOST_AGREEMENT_OPS_PER_RANK } else { AGREEMENT_OPS_PER_RANK };
        // (Only a kill has its hearing's spread; elsewhere it is not a number: no more looks.)
        let spread_s = (figure(j, event, "heard_last_ms") - figure(j, event, "heard_first_ms")) / 1000.0;
        let most = base + if spread_s.is_finite() { LOOK_OPS_PER_RANK * spread_s.max(0.0).round() } else { 0.0 };
        check(ops <= most, || format!("{event}: {ops} agreement requests a rank (at most {most}): {j}"))?;
    }
    let kill = figure(j, "kill", "store_ops_per_rank");
    let late_s = (figure(j, "kill", "ms") / 1000.0 - 5.0).max(0.0);
    let most = KILL_OPS_PER_RANK + LATE_OPS_PER_RANK_S * late_s;
    check(kill <= most, || {
        format!("{kill} requests a rank from the kill to the survivors' view (at most {most:.1}): {j}")
    })?;
    let beat = j["beat_ops_per_member_s"].as_f64().unwrap_or(f64::NAN);
    check(beat > 0.0 && beat <= BEAT_OPS_PER_MEMBER_S, || format!("{beat} liveness requests a member a second: {j}"))
}

fn one_rank_killed_survivors_agree_and_its_replacement_is_admitted() -> Outcome {
    let j = simulate(&["--ranks", "256", "--procs", "2", "--fault", "kill-rank:37", "--rejoin", "--timeout", "30"])?;
    check(j["events"]["kill"]["members"] == 255 && j["events"]["kill"]["survivors_agreed"] == 255, || {
        format!("the survivors' view: {}", j["events"]["kill"])
    })?;
    check(j["events"]["join"]["members"] == 256 && j["events"]["join"]["incarnation"] == 2, || {
        format!("the replacement's view: {}", j["events"]["join"])
    })?;
    requests_below_constants(&j, false)
}

/// Rank 0 killed during the job's start (right after it arrives at epoch 0 and tries to
/// take the lead or sees another rank lead; who leads is a race, so it is killed as the
/// leader in some runs only), then replaced.
fn rank_0_killed_at_the_start_survivors_agree() -> Outcome {
    let args = ["--ranks", "64", "--procs", "2", "--fault", "kill-rank:0@start", "--rejoin", "--timeout", "30"];
    let j = simulate(&args)?;
    check(j["events"]["kill"]["members"] == 63, || format!("the survivors' view: {}", j["events"]["kill"]))?;
    requests_below_constants(&j, true)
}

/// Rank 0 killed by the answer that also ends its join (its first look finds epoch 0
/// decided, by another leader, with itself a member): the kill wins, and the survivors agree
/// on an epoch without it. The race happened in about one run in eight (the join, done in
/// the same poll, kept the rank alive and the run failed at the stage's limit); the sim's
/// `ANYCCL_SIM_LATE_FIRST_LOOK` forces it in every run.
fn rank_0_killed_as_its_join_ends_survivors_agree() -> Outcome {
    let args = ["--ranks", "64", "--procs", "2", "--fault", "kill-rank:0@start", "--rejoin", "--timeout", "30"];
    let j = simulate_with(&args, &[("ANYCCL_SIM_LATE_FIRST_LOOK", "1")])?;
    check(j["events"]["kill"]["members"] == 63, || format!("the survivors' view: {}", j["events"]["kill"]))?;
    requests_below_constants(&j, true)
}

/// A replacement started for rank 7, which was never killed (a launcher that thought it
/// dead): it is admitted, and the process it replaces is told it is out (anyccl-sim checks
/// both).
fn a_replacement_for_a_live_rank_replaces_it() -> Outcome {
    let args = ["--ranks", "64", "--procs", "2", "--fault", "kill-rank:5", "--rejoin=7", "--timeout", "30"];
    let j = simulate(&args)?;
    check(j["events"]["join"]["members"] == 63, || format!("the replacement's view: {}", j["events"]["join"]))?;
    requests_below_constants(&j, false)
}

/// A kill or a replacement outside the ranks, or a replacement without a kill: a usage error
/// (exit code 2) naming the flag, before anything starts.
fn usage_errors_name_the_flag() -> Outcome {
    let cases: [(&[&str], &str); 4] = [
        (&["--fault", "kill-rank:64"], "--fault \"kill-rank:64\": rank 64 is outside the 64 ranks"),
        (&["--fault", "kill-rank:3@later"], "\"later\" is not start or steady"),
        (&["--fault", "kill-rank:3", "--rejoin=64"], "--rejoin=64: rank 64 is outside the 64 ranks"),
        (&["--rejoin"], "--rejoin: a replacement joins after --fault kill-rank:R"),
    ];
    for (args, want) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_anyccl-sim"))
            .args(["--ranks", "64", "--procs", "2"])
            .args(args)
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        check(out.status.code() == Some(2) && err.contains(want), || {
            format!("{args:?}: exit {:?}, expected 2 and {want:?}:\n{err}", out.status.code())
        })?;
    }
    Ok(())
}

fn main() {
    let t = |name: &str, f: fn() -> Outcome| Trial::test(name, f);
    let trials = vec![
        t(
            "sim::membership::one_rank_killed_survivors_agree_and_its_replacement_is_admitted[w=256]",
            one_rank_killed_survivors_agree_and_its_replacement_is_admitted,
        ),
        t(
            "sim::membership::rank_0_killed_at_the_start_survivors_agree[w=64]",
            rank_0_killed_at_the_start_survivors_agree,
        ),
        t(
            "sim::membership::rank_0_killed_as_its_join_ends_survivors_agree[w=64]",
            rank_0_killed_as_its_join_ends_survivors_agree,
        ),
        t(
            "sim::membership::a_replacement_for_a_live_rank_replaces_it[w=64]",
            a_replacement_for_a_live_rank_replaces_it,
        ),
        t("sim::membership::usage_errors_name_the_flag[w=64]", usage_errors_name_the_flag),
    ];
    libtest_mimic::run(&Arguments::from_args(), trials).exit();
}
