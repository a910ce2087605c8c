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
