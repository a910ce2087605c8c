//! What the children report and the parent makes of it: the per-phase figures, the table,
//! and whether the run ended as it must.

use crate::args::{block, Args, Layout};
use crate::backend::Fault;
use crate::counting::{PhaseFigures, PHASES};
use anyccl_examples::outln;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// One rank's end.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RankEnd {
    pub(crate) rank: usize,
    pub(crate) ok: bool,
    pub(crate) kind: String,
    /// The error (first 300 characters).
    pub(crate) msg: String,
    /// From the start signal to the warmup's return.
    pub(crate) ms: f64,
    /// Store requests answered (`--store-bench`).
    #[serde(default)]
    pub(crate) ops: u64,
    /// `--repeat`: what the second call of the generation did (`replayed`, or why not).
    #[serde(default)]
    pub(crate) repeat: String,
}

/// What a child reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ChildReport {
    pub(crate) child: usize,
    pub(crate) connect_ms: f64,
    pub(crate) ranks: Vec<RankEnd>,
    pub(crate) phases: Vec<(String, PhaseFigures)>,
    /// The longest time any rank spent between its agreement and its outcome.
    pub(crate) execute_ms: f64,
}

pub(crate) fn summarize(
    a: &Args,
    layout: &Layout,
    reports: &[ChildReport],
    clients_ms: f64,
    wall: Duration,
) -> serde_json::Value {
    let n = a.ranks as f64;
    let mut phases = serde_json::Map::new();
    let mut total = 0u64;
    let mut keys_total = 0u64;
    let mut polls = 0u64;
    for (i, name) in PHASES.iter().enumerate() {
        let figs: Vec<&PhaseFigures> = reports.iter().map(|r| &r.phases[i].1).collect();
        let ops: u64 = figs.iter().map(|f| f.ops).sum();
        let keys: u64 = figs.iter().map(|f| f.keys).sum();
        let first = figs.iter().map(|f| f.first_ns).min().unwrap_or(u64::MAX);
        let last = figs.iter().map(|f| f.last_ns).max().unwrap_or(0);
        let wall_ms = if ops == 0 || last < first { 0.0 } else { (last - first) as f64 / 1e6 };
        if *name == "poll" {
            polls = ops;
        } else {
            total += ops;
            keys_total += keys;
        }
        phases.insert(
            name.to_string(),
            serde_json::json!({ "ops": ops, "per_rank": ops as f64 / n, "keys": keys, "wall_ms": round(wall_ms) }),
        );
    }
    let mut ms: Vec<f64> = reports.iter().flat_map(|r| r.ranks.iter().map(|e| e.ms)).collect();
    ms.sort_by(f64::total_cmp);
    let pick = |q: f64| ms.get(((ms.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0);
    let ok = reports.iter().flat_map(|r| &r.ranks).filter(|e| e.ok).count();
    let reported = reports.iter().map(|r| r.ranks.len()).sum::<usize>();
    serde_json::json!({
        "ranks": a.ranks,
        "layout": layout.describe(),
        "procs": a.procs,
        "store": if a.store == "tcp" { "tcp" } else { "etcd" },
        "store_ops_total": total,
        "store_ops_per_rank": round(total as f64 / n),
        "store_keys_total": keys_total,
        "polls": polls,
        "phases": phases,
        "execute_ms_max": round(reports.iter().map(|r| r.execute_ms).fold(0.0, f64::max)),
        "warmup_ms": { "min": round(pick(0.0)), "median": round(pick(0.5)), "max": round(pick(1.0)) },
        "wall_ms": round(wall.as_secs_f64() * 1e3),
        "clients_connect_ms": round(clients_ms),
        "ranks_ok": ok,
        "ranks_failed": reported - ok,
        "ranks_unreported": a.ranks - reported,
    })
}

pub(crate) fn round(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

pub(crate) fn print_table(s: &serde_json::Value) {
    outln!(
        "# anyccl-sim: {} ranks, layout {}, {} processes, store {}",
        s["ranks"],
        s["layout"],
        s["procs"],
        s["store"]
    );
    outln!(
        "# clients connected in {} ms; warmup call min/median/max {}/{}/{} ms",
        s["clients_connect_ms"],
        s["warmup_ms"]["min"],
        s["warmup_ms"]["median"],
        s["warmup_ms"]["max"]
    );
    outln!("# {:>8} {:>12} {:>10} {:>12} {:>10}", "phase", "store ops", "per rank", "keys", "wall ms");
    for name in PHASES {
        let p = &s["phases"][name];
        outln!("  {:>8} {:>12} {:>10} {:>12} {:>10}", name, p["ops"], p["per_rank"], p["keys"], p["wall_ms"]);
    }
    outln!("  {:>8} {:>12} {:>10}", "total", s["store_ops_total"], s["store_ops_per_rank"]);
    outln!(
        "# execution (slowest rank, agreement to outcome): {} ms; ranks ok {}, failed {}, unreported {}",
        s["execute_ms_max"],
        s["ranks_ok"],
        s["ranks_failed"],
        s["ranks_unreported"]
    );
}

/// Whether the run ended as it must: every rank ok without a fault; with one, every rank
/// that did not die returned an error within the deadline + 5 s.
pub(crate) fn judge(
    a: &Args,
    fault: Fault,
    at: usize,
    reports: &[ChildReport],
    died: &[(usize, String)],
) -> Result<String, String> {
    let ends: Vec<&RankEnd> = reports.iter().flat_map(|r| &r.ranks).collect();
    let bound = (a.timeout + 5) as f64 * 1e3;
    let dead_child =
        (fault == Fault::Die).then(|| (0..a.procs).find(|&k| block(k, a.procs, a.ranks).contains(&at))).flatten();
    let expect_reported = match dead_child {
        Some(k) => a.ranks - block(k, a.procs, a.ranks).len(),
        None => a.ranks,
    };
    if ends.len() != expect_reported {
        return Err(format!(
            "{} ranks reported, {expect_reported} expected (processes that ended badly: {died:?})",
            ends.len()
        ));
    }
    if let Some(k) = dead_child {
        if !died.iter().any(|(d, _)| *d == k) {
            return Err(format!("child {k} (rank {at}) was to die but exited normally"));
        }
    } else if !died.is_empty() {
        return Err(format!("processes ended badly: {died:?}"));
    }
    if a.repeat {
        let bad: Vec<_> = ends
            .iter()
            .filter(|e| e.repeat != "replayed")
            .take(3)
            .map(|e| format!("rank {}: {}", e.rank, e.repeat))
            .collect();
        if !bad.is_empty() {
            return Err(format!("the repeated generation did not replay: {}", bad.join(" | ")));
        }
    }
    let slowest = ends.iter().map(|e| e.ms).fold(0.0, f64::max);
    if fault == Fault::None {
        let bad: Vec<_> =
            ends.iter().filter(|e| !e.ok).take(3).map(|e| format!("rank {}: {}", e.rank, e.msg)).collect();
        return if bad.is_empty() {
            Ok(format!("all {} ranks warmed; slowest returned after {slowest:.0} ms", ends.len()))
        } else {
            Err(format!("ranks failed without a fault: {}", bad.join(" | ")))
        };
    }
    let ok: Vec<usize> = ends.iter().filter(|e| e.ok).map(|e| e.rank).take(5).collect();
    if !ok.is_empty() {
        return Err(format!("ranks {ok:?}... returned Ok although rank {at} had a fault"));
    }
    let late: Vec<_> =
        ends.iter().filter(|e| e.ms > bound).take(3).map(|e| format!("rank {} after {:.0} ms", e.rank, e.ms)).collect();
    if !late.is_empty() {
        return Err(format!("ranks returned later than the deadline + 5 s: {}", late.join(", ")));
    }
    let mut kinds: Vec<String> = ends.iter().map(|e| e.kind.clone()).collect();
    kinds.sort();
    kinds.dedup();
    let sample = ends.iter().find(|e| e.rank != at).map(|e| format!("rank {}: {}", e.rank, e.msg)).unwrap_or_default();
    Ok(format!(
        "every one of the {} ranks returned an error ({}) within {slowest:.0} ms (bound {bound:.0} ms); e.g. {sample}",
        ends.len(),
        kinds.join(", ")
    ))
}
