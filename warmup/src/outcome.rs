//! The outcome of a generation, all or nothing: every rank reports, one verdict is stored
//! and every rank adopts it; the first failure is put on record so that ranks still waiting
//! on an operation stop at once and report its cause.

use crate::session::{ctx, decode, encode, waited, Session};
use anyccl_core::{Error, Result};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// `failed`: the first failure of the generation (the error kind, and which rank said what);
/// ranks waiting on an operation stop when they see it.
#[derive(Debug, Serialize, Deserialize)]
struct Failure {
    kind: String,
    who: String,
}

/// `outcome/<rank>` (`Ok` or `Failed`) and `verdict`, the first outcome of the whole
/// generation stored, which every rank adopts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum Outcome {
    Ok,
    Failed(String),
    Timeout(String),
}

/// This rank's part of the outcome (the last step of a run): the generation's verdict.
/// Each rank reports (one request) and waits for the verdict (one); the first member tallies the
/// reports in one multi-key wait, unless a failure stored the verdict first. Should it
/// never decide (dead or stopped), one rank claims the naming at the deadline and stores
/// which ranks never reported.
pub(crate) async fn outcome(s: &Session<'_>, exec: &Result<()>, deadline: Instant) -> Outcome {
    let key = s.key("verdict");
    let key = key.as_str();
    let read = |v: Vec<u8>| decode(key, &v).unwrap_or_else(|e| Outcome::Failed(e.to_string()));
    let cas = |v: Outcome| async move {
        match s.store.compare_set(key, None, &encode(&v)).await {
            Ok(o) => o.current.and_then(|c| decode(key, &c).ok()).unwrap_or(v),
            Err(_) => v,
        }
    };
    let mine = match exec {
        Ok(()) => Outcome::Ok,
        Err(e) => Outcome::Failed(format!("rank {} failed: {e}", s.rank)),
    };
    let reported = s.store.set(&s.key(&format!("outcome/{}", s.rank)), &encode(&mine)).await;
    if let Outcome::Failed(_) = &mine {
        // No need to hear from anyone else: the generation has failed.
        return cas(mine).await;
    }
    if let Err(e) = reported {
        return cas(Outcome::Failed(format!("rank {} could not report its outcome: {e}", s.rank))).await;
    }
    // Every rank's report key: read by rank 0, or by the namer, only.
    let ranks = s.ranks();
    let reports = || ranks.iter().map(|r| s.key(&format!("outcome/{r}"))).collect::<Vec<String>>();
    let outcome_deadline = deadline.max(Instant::now()) + Duration::from_secs(1);
    if ranks.first() == Some(&s.rank) {
        let keys = reports();
        tokio::select! {
            Ok(v) = s.store.wait(key, outcome_deadline) => return read(v),
            all = s.store.wait_many(&keys, outcome_deadline) => if let Ok(all) = all {
                return cas(tally(&ranks, &keys, &all)).await;
            },
        }
    }
    let grace = Duration::from_secs(1);
    if let Ok(v) = s.store.wait(key, outcome_deadline + grace).await {
        return read(v);
    }
    // No verdict: the first member never decided. One rank names the ranks that never reported.
    let namer = s.store.compare_set(&s.key("outcome/namer"), None, s.rank.to_string().as_bytes()).await;
    if namer.is_ok_and(|n| n.swapped) {
        let keys = reports();
        let local = match s.store.wait_many(&keys, Instant::now()).await {
            Ok(all) => tally(&ranks, &keys, &all),
            Err(e) => {
                Outcome::Timeout(format!("the first member decided nothing and the reports cannot be read ({e})"))
            }
        };
        return cas(local).await;
    }
    match s.store.wait(key, Instant::now() + grace).await {
        Ok(v) => read(v),
        Err(_) => cas(Outcome::Timeout("ranks never reported (and no rank named them in time)".into())).await,
    }
}

/// After a generation's verdict, its first member removes the keys of the generation before
/// the one before it: every rank of this generation reported, so each is done with the
/// earlier ones (a retried call replays only the generation it repeats, the last one kept).
/// The generations seen are kept under `warmup/<job>/generations` as "previous last". A
/// failure to remove costs nothing but the space.
pub(crate) async fn trim_generations(s: &Session<'_>) {
    if s.ranks().first() != Some(&s.rank) {
        return;
    }
    let key = format!("warmup/{}/generations", s.job);
    let seen = match s.store.get(&key).await {
        Ok(v) => v.map(|v| String::from_utf8_lossy(&v).into_owned()).unwrap_or_default(),
        Err(_) => return,
    };
    let mut it = seen.split_whitespace().map(|g| g.parse::<u64>().ok());
    let (prev, last) = (it.next().flatten(), it.next().flatten());
    if last == Some(s.generation) || prev == Some(s.generation) {
        return;
    }
    let last = last.map_or_else(|| "-".to_string(), |g| g.to_string());
    if s.store.set(&key, format!("{last} {}", s.generation).as_bytes()).await.is_err() {
        return;
    }
    if let Some(p) = prev {
        if let Err(e) = s.store.delete_prefix(&format!("warmup/{}/{p}/", s.job)).await {
            tracing::debug!("warmup {}: keys of generation {p} left in the store: {e}", s.job);
        }
    }
}

/// The verdict the reports `all` (of `keys`, one per rank of `ranks`) give.
fn tally(ranks: &[usize], keys: &[String], all: &[Option<Vec<u8>>]) -> Outcome {
    let mut silent = Vec::new();
    let mut failed = Vec::new();
    for (i, v) in all.iter().enumerate() {
        match v.as_deref().map(|v| decode::<Outcome>(&keys[i], v)) {
            None | Some(Err(_)) => silent.push(ranks[i]),
            Some(Ok(Outcome::Ok)) => {}
            Some(Ok(Outcome::Failed(why) | Outcome::Timeout(why))) => failed.push(why),
        }
    }
    if !failed.is_empty() {
        Outcome::Failed(failed.join("; "))
    } else if silent.is_empty() {
        Outcome::Ok
    } else {
        Outcome::Timeout(format!("ranks {} never reported", ranks_text(&silent)))
    }
}

/// Ranks as a list, shortened past 32 of them.
fn ranks_text(r: &[usize]) -> String {
    if r.len() <= 32 {
        format!("{r:?}")
    } else {
        format!("{:?} and {} more", &r[..32], r.len() - 32)
    }
}

/// Record this rank's failure `e` for the generation, unless a failure is on record already
/// (the first one is the cause).
pub(crate) async fn publish_failure(s: &Session<'_>, e: &Error) {
    let v = Failure { kind: e.kind().into(), who: format!("rank {}: {e}", s.rank) };
    let _ = s.store.compare_set(&s.key("failed"), None, &encode(&v)).await;
}

/// The generation's recorded failure as this rank's error, if another rank published one.
pub(crate) async fn failure_on_record(s: &Session<'_>, what: &str, group: &str, rank: usize) -> Result<Option<Error>> {
    let key = s.key("failed");
    let Some(f) = s.store.get(&key).await? else { return Ok(None) };
    let Failure { kind, who } = decode(&key, &f)?;
    let detail = format!("warmup failed on {who}");
    // A rank that timed out means the warmup as a whole ran out of time.
    Ok(Some(if kind == "Timeout" {
        warmup_timeout(what, rank, group, detail)
    } else {
        ctx(rank, group).peer_failed(None, detail)
    }))
}

pub(crate) fn warmup_timeout(what: &str, rank: usize, group: &str, detail: String) -> Error {
    ctx(rank, group).timeout(format!("warmup {what}"), waited(), detail)
}
