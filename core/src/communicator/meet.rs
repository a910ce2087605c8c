//! Members meeting through the store before a collective step: each publishes a value, one
//! multi-key wait reads the others', and one verdict, stored once, is what every member acts
//! on. Window registration compares sizes through it; sleep and wake agree that every member
//! sleeps or wakes.

use crate::error::Result;
use std::time::Instant;

/// How a ready member's value is published (a refusal is `! why`).
const READY: &str = "ok ";

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

/// Words a refusal for members' values that are not all the same, given every member's
/// value by rank.
pub(super) type Differ = dyn Fn(&[(usize, String)]) -> String + Sync;

/// What a member brings to a meeting: ready with `value` (which must be the same on every
/// member), or a refusal saying why not.
#[derive(Clone, Copy)]
pub(super) enum Offer<'a> {
    /// Ready; `differ` words the refusal when the members' values are not all the same
    /// (given every member's, by rank).
    Ready { value: &'a str, differ: &'a Differ },
    /// Not ready: why.
    Refuse(&'a str),
}

impl<'a> Offer<'a> {
    /// Ready with nothing to compare, or the refusal.
    pub(super) fn ready_unless(refusal: Option<&'a str>) -> Offer<'a> {
        match refusal {
            Some(why) => Offer::Refuse(why),
            None => Offer::Ready { value: "", differ: &|_| String::new() },
        }
    }
}

/// Every member publishes under `{prefix}/r{rank}` its offer, and one verdict is stored under
/// `{prefix}/verdict` by the first member that can decide: a refusing member at once, a
/// member that read every other's value (refused when one refused or the values differ), or
/// one whose wait ran out at `deadline`. Every member adopts the stored verdict, so all act
/// alike even when one saw everyone ready and another timed out, and a member arriving after
/// the verdict adopts it at once. A failed meeting's prefix keeps its verdict: the next try
/// meets under another.
///
/// # Errors
/// The store's.
pub(super) async fn decide(
    store: &dyn crate::Store,
    prefix: &str,
    (rank, size): (usize, usize),
    step: &str,
    offer: Offer<'_>,
    deadline: Instant,
) -> Result<Verdict> {
    let key = format!("{prefix}/verdict");
    let (mine, refusal) = match offer {
        Offer::Ready { value, .. } => (format!("{READY}{value}"), None),
        Offer::Refuse(why) => (format!("! {why}"), Some(why)),
    };
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
            let offered = |v: &str| v.strip_prefix(READY).unwrap_or(v).to_string();
            let mut values = vec![(rank, offered(&mine))];
            for (r, v) in others.iter().zip(&theirs) {
                match v.as_deref().map(String::from_utf8_lossy) {
                    None => absent.push(*r),
                    Some(v) => match v.strip_prefix("! ") {
                        Some(why) => problems.push(format!("rank {r}: {why}")),
                        None => values.push((*r, offered(&v))),
                    },
                }
            }
            values.sort();
            if !problems.is_empty() {
                format!("R{}", problems.join("; "))
            } else if !absent.is_empty() {
                format!("M ranks {absent:?} of the group never called {step}")
            } else if let Some(differ) = match offer {
                Offer::Ready { differ, .. } if values.iter().any(|(_, v)| *v != values[0].1) => Some(differ),
                _ => None,
            } {
                format!("R{}", differ(&values))
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
