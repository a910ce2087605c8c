//! Members meeting through the store before a collective step: each publishes a value, one
//! multi-key wait reads the others'. Window registration compares sizes through it, sleep
//! agrees that every member sleeps.

use crate::error::{Ctx, Result};
use std::time::Instant;

/// Publish `mine` under `{prefix}/r{rank}` and read every other member's, in one multi-key
/// wait until `deadline`: their values, by rank (this rank left out).
///
/// # Errors
/// A `Timeout` in `op` whose text `missing` writes from the ranks that never published;
/// the store's.
pub(super) async fn publish_and_read(
    store: &dyn crate::Store,
    prefix: &str,
    ctx: &Ctx,
    (rank, size): (usize, usize),
    (op, mine): (&str, &str),
    deadline: Instant,
    missing: impl FnOnce(&[usize]) -> String,
) -> Result<Vec<(usize, String)>> {
    let started = Instant::now();
    store.set(&format!("{prefix}/r{rank}"), mine.as_bytes()).await?;
    let others: Vec<usize> = (0..size).filter(|&r| r != rank).collect();
    // One request where the store allows, rather than one per member.
    let keys: Vec<String> = others.iter().map(|r| format!("{prefix}/r{r}")).collect();
    let theirs = store.wait_many(&keys, deadline).await?;
    let absent: Vec<usize> = others.iter().zip(&theirs).filter(|(_, v)| v.is_none()).map(|(&r, _)| r).collect();
    if !absent.is_empty() {
        return Err(ctx.timeout(op, started.elapsed(), missing(&absent)));
    }
    Ok(others
        .into_iter()
        .zip(theirs.into_iter().flatten())
        .map(|(r, v)| (r, String::from_utf8_lossy(&v).into_owned()))
        .collect())
}

/// How a meeting that [`decide`] held ended: the same on every member that took part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Every member was ready.
    Go,
    /// Members refused or failed: who and why.
    Refused(String),
    /// Members never came by the deadline (the text names them).
    Missing(String),
}

/// Every member publishes under `{prefix}/r{rank}` that it is ready (`refusal` `None`) or
/// why not, and one verdict is stored under `{prefix}/verdict` by the first member that can
/// decide: a refusing member at once, a member that read every other's value, or one whose
/// wait ran out at `deadline`. Every member adopts the stored verdict, so all act alike even
/// when one saw everyone ready and another timed out, and a member arriving after the
/// verdict adopts it at once. A failed meeting's prefix keeps its verdict: the next try
/// meets under another.
///
/// # Errors
/// The store's.
pub(super) async fn decide(
    store: &dyn crate::Store,
    prefix: &str,
    (rank, size): (usize, usize),
    step: &str,
    refusal: Option<&str>,
    deadline: Instant,
) -> Result<Verdict> {
    let key = format!("{prefix}/verdict");
    let mine = refusal.map_or_else(|| "ok".to_string(), |why| format!("! {why}"));
    store.set(&format!("{prefix}/r{rank}"), mine.as_bytes()).await?;
    let proposal = match refusal {
        Some(why) => format!("R rank {rank}: {why}"),
        None => {
            let others: Vec<usize> = (0..size).filter(|&r| r != rank).collect();
            let keys: Vec<String> = others.iter().map(|r| format!("{prefix}/r{r}")).collect();
            // A verdict stored meanwhile (a member refused) ends the wait at once.
            let theirs = tokio::select! {
                v = store.wait(&key, deadline) => match v {
                    Ok(v) => return Ok(parse(&v)),
                    Err(_) => store.wait_many(&keys, Instant::now()).await?,
                },
                all = store.wait_many(&keys, deadline) => all?,
            };
            let mut absent = Vec::new();
            let mut problems = Vec::new();
            for (r, v) in others.iter().zip(&theirs) {
                match v.as_deref().map(String::from_utf8_lossy) {
                    None => absent.push(*r),
                    Some(v) => {
                        if let Some(why) = v.strip_prefix("! ") {
                            problems.push(format!("rank {r}: {why}"));
                        }
                    }
                }
            }
            if !problems.is_empty() {
                format!("R{}", problems.join("; "))
            } else if !absent.is_empty() {
                format!("M ranks {absent:?} of the group never called {step}")
            } else {
                "G".to_string()
            }
        }
    };
    let cas = store.compare_set(&key, None, proposal.as_bytes()).await?;
    Ok(parse(cas.current.as_deref().unwrap_or(proposal.as_bytes())))
}

fn parse(v: &[u8]) -> Verdict {
    let v = String::from_utf8_lossy(v);
    let rest = || v.get(1..).unwrap_or_default().trim_start().to_string();
    match v.get(..1) {
        Some("G") => Verdict::Go,
        Some("M") => Verdict::Missing(rest()),
        Some("R") => Verdict::Refused(rest()),
        _ => Verdict::Refused(format!("an unreadable verdict in the store: {v:?}")),
    }
}
