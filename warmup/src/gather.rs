//! Group agreement through a leader, at a store cost linear in the group's size: every
//! member publishes its value under `{topic}/{rank}`; the group's leader (group rank 0)
//! gathers them all with one multi-key wait, decides, and publishes one verdict under
//! `{topic}/verdict`, which every member reads. A rank calls [`publish`] for all its groups,
//! then [`lead`] for those it leads, then [`verdict`]: no leader waits on anything but its
//! members' values, so ranks in several groups cannot wait on each other in a cycle.

use crate::run::{decode, encode, Session};
use anyccl_core::{Communicator, Error, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::time::{Duration, Instant};

/// How long a member waits for its leader's verdict past the deadline: a leader whose
/// member never published decides at the deadline itself.
const VERDICT_GRACE: Duration = Duration::from_secs(1);

/// Where `comm`'s group agrees on `topic`: by the group's name and members, since two
/// groups may share a name (one "tp" per replica).
pub(crate) fn topic_key(s: &Session<'_>, topic: &str, comm: &Communicator) -> String {
    let spec = comm.spec();
    s.key(&format!("{topic}/{}-{:016x}", spec.name, spec.id()))
}

/// Publish this member's value.
///
/// # Errors
/// Store errors.
pub(crate) async fn publish<T: Serialize>(s: &Session<'_>, topic: &str, comm: &Communicator, mine: &T) -> Result<()> {
    s.store.set(&format!("{}/{}", topic_key(s, topic, comm), comm.rank()), &encode(mine)).await
}

/// The leader's part: gather every member's value (`None` for members that published none
/// by `deadline`), decide, publish the verdict. Members call nothing here.
///
/// # Errors
/// Store errors; a member's value that cannot be read.
pub(crate) async fn lead<T: DeserializeOwned, V: Serialize>(
    s: &Session<'_>,
    topic: &str,
    comm: &Communicator,
    deadline: Instant,
    decide: impl FnOnce(Vec<Option<T>>) -> V,
) -> Result<()> {
    if comm.rank() != 0 {
        return Ok(());
    }
    let base = topic_key(s, topic, comm);
    let keys: Vec<String> = (0..comm.size()).map(|r| format!("{base}/{r}")).collect();
    let values = s.store.wait_many(&keys, deadline).await?;
    let mut theirs = Vec::with_capacity(values.len());
    for (k, v) in keys.iter().zip(values) {
        theirs.push(match v {
            Some(v) => Some(decode::<T>(k, &v)?),
            None => None,
        });
    }
    s.store.set(&format!("{base}/verdict"), &encode(&decide(theirs))).await
}

/// The verdict of `comm`'s group on `topic`.
///
/// # Errors
/// `Timeout` naming the leader when it published none by the deadline (plus a grace
/// second); store errors.
pub(crate) async fn verdict<V: DeserializeOwned>(
    s: &Session<'_>,
    topic: &str,
    comm: &Communicator,
    what: &str,
    deadline: Instant,
) -> Result<V> {
    let key = format!("{}/verdict", topic_key(s, topic, comm));
    match s.store.wait(&key, deadline + VERDICT_GRACE).await {
        Ok(v) => decode(&key, &v),
        Err(Error::Timeout { .. }) => Err(Error::Timeout {
            op: what.into(),
            rank: comm.rank(),
            group: comm.spec().name.clone(),
            after: crate::run::waited(),
            detail: format!(
                "the group's leader (group rank 0, rank {} of the job) published no verdict",
                comm.spec().ranks.first().copied().unwrap_or(0)
            ),
            source: None,
        }),
        Err(e) => Err(e),
    }
}

/// Group ranks whose value is missing.
pub(crate) fn missing<T>(theirs: &[Option<T>]) -> Vec<usize> {
    theirs.iter().enumerate().filter(|(_, v)| v.is_none()).map(|(r, _)| r).collect()
}
