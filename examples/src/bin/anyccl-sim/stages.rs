//! The parent's side of `--fault kill-rank`: it drives the stages (see `members`), then
//! makes the figures of what the children report (time from each event to every rank
//! holding the agreed view, the store requests in between) and checks the views.

use crate::args::{Args, Kill, KillAt};
use crate::members::{process_figures, MemberReport, RankLog, Seen, BUCKET_NS};
use crate::report::round;
use anyccl_examples::outln;
use std::io::Write;
use std::process::ChildStdin;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

const STAGES: [&str; 3] = ["joined", "agreed", "admitted"];

/// Drive the children through the stages: wait for `joined`, send `kill` (`@steady`), wait
/// for `agreed`, then with `--rejoin` send `rejoin` and wait for `admitted`; `end` at last
/// (also when a stage is missed). Report lines that arrive meanwhile go to `lines`, children
/// that end to `ended`. The stage missed, if one was.
pub(crate) fn drive(
    a: &Args,
    kill: Kill,
    rx: &Receiver<(usize, Option<String>)>,
    inputs: &mut [Option<ChildStdin>],
    ended: &mut [bool],
    lines: &mut Vec<String>,
) -> Option<String> {
    let mut said = vec![vec![false; a.procs]; STAGES.len()];
    let limit = Duration::from_secs(a.timeout) + Duration::from_millis(a.stale_ms) + Duration::from_secs(10);
    let mut send = |line: &str| {
        for i in inputs.iter_mut().flatten() {
            let _ = writeln!(i, "{line}");
            let _ = i.flush();
        }
    };
    let mut wait = |stage: usize| -> Option<String> {
        let t = Instant::now();
        while !said[stage].iter().all(|s| *s) {
            match rx.recv_timeout(limit.saturating_sub(t.elapsed())) {
                Ok((k, Some(l))) => match STAGES.iter().position(|s| *s == l) {
                    Some(i) => said[i][k] = true,
                    None => lines.push(l),
                },
                Ok((k, None)) => {
                    ended[k] = true;
                    return Some(format!("child {k} ended before its ranks were {}", STAGES[stage]));
                }
                Err(_) => {
                    let late: Vec<usize> = (0..said[stage].len()).filter(|&k| !said[stage][k]).collect();
                    return Some(format!("children {late:?} not {} within {limit:?}", STAGES[stage]));
                }
            }
        }
        None
    };
    let missed = wait(0)
        .or_else(|| {
            if kill.at == KillAt::Steady {
                send("kill");
            }
            wait(1)
        })
        .or_else(|| {
            kill.rejoin?;
            send("rejoin");
            wait(2)
        });
    send("end");
    missed
}

/// Requests in the buckets from `from` to `to` (wall ns), summed over the children:
/// (liveness threads', the rest).
fn window(reports: &[MemberReport], from: u64, to: u64) -> (u64, u64) {
    let (lo, hi) = (from / BUCKET_NS, to / BUCKET_NS);
    reports
        .iter()
        .flat_map(|r| &r.timeline)
        .filter(|(b, _, _)| (lo..=hi).contains(b))
        .fold((0, 0), |(x, y), (_, b, o)| (x + b, y + o))
}

fn ms(from: u64, to: u64) -> f64 {
    round(to.saturating_sub(from) as f64 / 1e6)
}

/// One event's row: from `from` to `to`, the store requests between, per rank.
fn row(a: &Args, reports: &[MemberReport], epoch: u64, from: u64, to: u64) -> serde_json::Value {
    let (beat, other) = window(reports, from, to);
    let n = a.ranks as f64;
    serde_json::json!({
        "epoch": epoch,
        "ms": ms(from, to),
        "store_ops": beat + other,
        "store_ops_per_rank": round((beat + other) as f64 / n),
        "agreement_ops": other,
        "agreement_ops_per_rank": round(other as f64 / n),
        "beat_ops": beat,
    })
}

/// The figures of a run; the verdict apart (see [`judge`]).
pub(crate) fn summarize(a: &Args, kill: Kill, reports: &[MemberReport], go_ns: u64) -> serde_json::Value {
    let logs: Vec<&RankLog> = reports.iter().flat_map(|r| &r.ranks).collect();
    let firsts = || logs.iter().copied().filter(|l| !l.replacement);
    let survivors = || firsts().filter(|l| l.rank != kill.rank);
    let mut m = serde_json::Map::new();
    let started: Vec<&Seen> = firsts().filter_map(|l| l.views.first()).collect();
    if let Some(last) = started.iter().map(|v| v.ns).max() {
        m.insert("start".into(), row(a, reports, started[0].epoch, go_ns, last));
    }
    let killed_ns = logs.iter().find_map(|l| l.killed_ns.filter(|_| l.rank == kill.rank && !l.replacement));
    if let Some(k) = killed_ns {
        let without: Vec<&Seen> =
            survivors().filter_map(|l| l.views.iter().find(|v| v.killed.is_none() && v.ns >= k)).collect();
        let heard: Vec<u64> =
            survivors().filter_map(|l| l.heard.iter().find(|h| h.2 && h.1 >= k).map(|h| h.1)).collect();
        if let Some(v) = without.iter().max_by_key(|v| v.ns) {
            let mut r = row(a, reports, v.epoch, k, v.ns);
            r["members"] = v.members.into();
            r["survivors_agreed"] = without.len().into();
            let mut at: Vec<u64> = without.iter().map(|v| v.ns).collect();
            at.sort_unstable();
            r["agreed_first_ms"] = at.first().map_or(serde_json::Value::Null, |&f| ms(k, f).into());
            r["agreed_median_ms"] = at.get(at.len() / 2).map_or(serde_json::Value::Null, |&f| ms(k, f).into());
            r["heard_first_ms"] = heard.iter().min().map_or(serde_json::Value::Null, |&h| ms(k, h).into());
            r["heard_last_ms"] = heard.iter().max().map_or(serde_json::Value::Null, |&h| ms(k, h).into());
            m.insert("kill".into(), r);
        }
    }
    if let Some(rep) = logs.iter().find(|l| l.replacement) {
        if let Some(own) = rep.views.first() {
            let inc = Some(rep.incarnation);
            let admitted: Vec<u64> = firsts()
                .filter_map(|l| l.views.iter().find(|v| v.rejoined == inc).map(|v| v.ns))
                .chain([own.ns])
                .collect();
            let last = admitted.iter().copied().max().unwrap_or(own.ns);
            let mut r = row(a, reports, own.epoch, rep.started_ns, last);
            r["admitted_ms"] = ms(rep.started_ns, own.ns).into();
            r["agreed_first_ms"] =
                admitted.iter().min().map_or(serde_json::Value::Null, |&f| ms(rep.started_ns, f).into());
            r["incarnation"] = rep.incarnation.into();
            r["members"] = own.members.into();
            m.insert("join".into(), r);
        }
    }
    let buckets: Vec<u64> = reports.iter().flat_map(|r| r.timeline.iter().map(|t| t.0)).collect();
    let span_s = match (buckets.iter().min(), buckets.iter().max()) {
        (Some(lo), Some(hi)) => ((hi - lo + 1) * BUCKET_NS) as f64 / 1e9,
        _ => 0.0,
    };
    let (beats, others) = window(reports, 0, u64::MAX);
    let per_s = if span_s > 0.0 { beats as f64 / a.ranks as f64 / span_s } else { 0.0 };
    let (parent_kib, _) = process_figures();
    serde_json::json!({
        "ranks": a.ranks,
        "procs": a.procs,
        "store": if a.store == "tcp" { "tcp" } else { "etcd" },
        "liveness": a.liveness,
        "beat_ms": a.beat_ms,
        "stale_ms": a.stale_ms,
        "kill": { "rank": kill.rank, "at": format!("{:?}", kill.at).to_lowercase(), "rejoin": kill.rejoin },
        "store_ops_total": beats + others,
        "store_ops_per_rank": round((beats + others) as f64 / a.ranks as f64),
        "beat_ops_per_member_s": (per_s * 100.0).round() / 100.0,
        "events": m,
        "rss_peak_mib": {
            "parent": round(parent_kib as f64 / 1024.0),
            "children": reports.iter().map(|r| round(r.rss_peak_kib as f64 / 1024.0)).collect::<Vec<_>>(),
        },
        "threads": reports.iter().map(|r| r.threads).collect::<Vec<_>>(),
        "connect_ms_max": round(reports.iter().map(|r| r.connect_ms).fold(0.0, f64::max)),
    })
}

pub(crate) fn print_table(s: &serde_json::Value, kill: Kill) {
    outln!(
        "# anyccl-sim membership: {} ranks, {} processes, store {}, liveness {} (beat {} ms, stale after {} ms)",
        s["ranks"],
        s["procs"],
        s["store"].as_str().unwrap_or(""),
        s["liveness"].as_str().unwrap_or(""),
        s["beat_ms"],
        s["stale_ms"]
    );
    outln!(
        "# {:>34} {:>6} {:>9} {:>10} {:>9} {:>10} {:>9} {:>10}",
        "from the event to every rank's view",
        "epoch",
        "ms",
        "store ops",
        "per rank",
        "agreement",
        "per rank",
        "beat ops"
    );
    let r = kill.rejoin.unwrap_or(kill.rank);
    let names = [
        ("start", "start: every rank at epoch 0".to_string()),
        ("kill", format!("rank {} killed: survivors agreed", kill.rank)),
        ("join", format!("rank {r} replaced: all admitted")),
    ];
    for (key, name) in names {
        let e = &s["events"][key];
        if e.is_null() {
            continue;
        }
        let c = |k: &str| e[k].to_string();
        outln!(
            "  {:>34} {:>6} {:>9} {:>10} {:>9} {:>10} {:>9} {:>10}",
            name,
            c("epoch"),
            c("ms"),
            c("store_ops"),
            c("store_ops_per_rank"),
            c("agreement_ops"),
            c("agreement_ops_per_rank"),
            c("beat_ops")
        );
    }
    let k = &s["events"]["kill"];
    if !k.is_null() && k["heard_first_ms"].is_null() {
        outln!("# no proposal was needed: the job's start left the killed rank out");
    } else if !k.is_null() {
        outln!(
            "# the survivors heard of the failure {}-{} ms after the kill; the first held the new view after {} ms, \
             the median after {} ms",
            k["heard_first_ms"],
            k["heard_last_ms"],
            k["agreed_first_ms"],
            k["agreed_median_ms"]
        );
    }
    let j = &s["events"]["join"];
    if !j.is_null() {
        outln!(
            "# the replacement (incarnation {}) was admitted {} ms after it started; the first member held the view after {} ms",
            j["incarnation"], j["admitted_ms"], j["agreed_first_ms"]
        );
    }
    outln!(
        "# liveness {} store requests per member a second; {} in all ({} per rank); peak RSS parent {} MiB, children {} MiB; threads {}",
        s["beat_ops_per_member_s"],
        s["store_ops_total"],
        s["store_ops_per_rank"],
        s["rss_peak_mib"]["parent"],
        s["rss_peak_mib"]["children"],
        s["threads"]
    );
}

/// Whether the run ended as it must: every survivor holds one view without the killed
/// rank; with `--rejoin`, every member then holds one view with the replacement, and a
/// process it replaced that still ran was told it is out.
pub(crate) fn judge(
    a: &Args,
    kill: Kill,
    reports: &[MemberReport],
    died: &[(usize, String)],
    missed: Option<&str>,
) -> Result<String, String> {
    if let Some(m) = missed {
        return Err(format!("a stage was missed: {m}"));
    }
    if !died.is_empty() {
        return Err(format!("processes ended badly: {died:?}"));
    }
    let logs: Vec<&RankLog> = reports.iter().flat_map(|r| &r.ranks).collect();
    let firsts: Vec<&RankLog> = logs.iter().copied().filter(|l| !l.replacement).collect();
    if firsts.len() != a.ranks {
        return Err(format!("{} ranks reported, {} expected", firsts.len(), a.ranks));
    }
    let victim = firsts.iter().find(|l| l.rank == kill.rank).ok_or("the killed rank did not report")?;
    if victim.killed_ns.is_none() {
        return Err(format!("rank {} was never killed", kill.rank));
    }
    let survivors: Vec<&RankLog> = firsts.iter().copied().filter(|l| l.rank != kill.rank).collect();
    let view_without = |l: &RankLog| l.views.iter().find(|v| v.killed.is_none()).cloned();
    let mut agreed = Vec::new();
    for l in &survivors {
        match view_without(l) {
            Some(v) => agreed.push((v.epoch, v.digest, v.members)),
            None => return Err(format!("rank {} holds no view without rank {}: {:?}", l.rank, kill.rank, l.errors)),
        }
    }
    agreed.sort_unstable();
    agreed.dedup();
    if agreed.len() != 1 || agreed[0].2 != a.ranks - 1 {
        return Err(format!("the survivors hold different views or miss members: (epoch, digest, members) {agreed:?}"));
    }
    let mut said = format!(
        "all {} survivors hold epoch {} without rank {} ({} members)",
        survivors.len(),
        agreed[0].0,
        kill.rank,
        agreed[0].2
    );
    if victim.killed_leading {
        said += &format!("; rank {} was killed as the leader of epoch 0", kill.rank);
    }
    let Some(j) = kill.rejoin else { return Ok(said) };
    let rep = logs.iter().find(|l| l.replacement).ok_or("the replacement did not report")?;
    let own = match rep.views.first() {
        Some(v) if v.rejoined == Some(rep.incarnation) && rep.incarnation > 1 => v.clone(),
        _ => return Err(format!("the replacement of rank {j} was not admitted: {:?}", rep.errors)),
    };
    let want = if j == kill.rank { a.ranks } else { a.ranks - 1 };
    if own.members != want {
        return Err(format!("the replacement's view has {} members, {want} expected", own.members));
    }
    for l in &survivors {
        if l.rank == j {
            // A process that still ran when its replacement came: told it is out.
            if !(l.out && l.errors.iter().any(|e| e.contains("is not a member"))) {
                return Err(format!("rank {j} (incarnation 1) was replaced but not told it is out: {:?}", l.errors));
            }
            continue;
        }
        if !l
            .views
            .iter()
            .any(|v| v.rejoined == Some(rep.incarnation) && (v.epoch, v.digest) == (own.epoch, own.digest))
        {
            return Err(format!(
                "rank {} does not hold the replacement's view (epoch {}): {:?}",
                l.rank, own.epoch, l.errors
            ));
        }
    }
    said += &format!(
        "; rank {j}'s replacement (incarnation {}) admitted at epoch {}, held by every member{}",
        rep.incarnation,
        own.epoch,
        if j == kill.rank { "" } else { "; the process it replaced was told it is out" }
    );
    Ok(said)
}
