//! The membership protocol among processes simulated as tasks of one runtime over one
//! in-memory store: a member "killed" is dropped (its liveness record stops), "stopped" is
//! one whose record stops while it keeps its handle.

use crate::{Member, Membership, MembershipConfig, View};
use anyccl_core::Store;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod cases;
mod trim;

fn cfg() -> MembershipConfig {
    MembershipConfig {
        beat: Duration::from_millis(20),
        stale_after: Duration::from_millis(300),
        agree_timeout: Duration::from_secs(5),
        ..MembershipConfig::default()
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().expect("runtime")
}

/// `n` members of a fresh job, all at epoch 0.
async fn start(store: &Arc<dyn Store>, n: usize, cfg: &MembershipConfig) -> Vec<Membership> {
    let joins: Vec<_> = (0..n).map(|r| tokio::spawn(Membership::join(store.clone(), r, n, cfg.clone()))).collect();
    let mut out = Vec::new();
    for j in joins {
        out.push(j.await.expect("task").expect("join"));
    }
    out
}

/// `n` members of a fresh job on a store of their own, all at epoch 0.
async fn fresh(n: usize, cfg: &MembershipConfig) -> (Arc<dyn Store>, Vec<Membership>) {
    let store: Arc<dyn Store> = Arc::new(anyccl_core::MemoryStore::new());
    let ms = start(&store, n, cfg).await;
    (store, ms)
}

/// Every member in `ms` agrees (each once it hears of the proposal, as a training loop
/// would); their views.
async fn agree_all(ms: Vec<Membership>) -> (Vec<Membership>, Vec<anyccl_core::Result<View>>) {
    let tasks: Vec<_> = ms
        .into_iter()
        .map(|m| {
            tokio::spawn(async move {
                let t = Instant::now();
                while m.proposed().is_none() && t.elapsed() < Duration::from_secs(10) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let v = m.agree("a peer failed").await;
                (m, v)
            })
        })
        .collect();
    let mut ms = Vec::new();
    let mut vs = Vec::new();
    for t in tasks {
        let (m, v) = t.await.expect("task");
        ms.push(m);
        vs.push(v);
    }
    (ms, vs)
}

/// The view that admits `joiner`, from the members' views `vs` of the epoch they agreed on:
/// that epoch when it admits it; otherwise (a process died or was replaced meanwhile, so the
/// epoch is a failure, which admits no joiner) the next, which the joiner proposes and the
/// members agree on once they hear it. Every member holds the same view at each epoch.
async fn admitted(ms: Vec<Membership>, vs: Vec<anyccl_core::Result<View>>, joiner: Member) -> View {
    let vs: Vec<View> = vs.into_iter().map(|v| v.expect("agreed")).collect();
    assert!(vs.iter().all(|v| *v == vs[0]), "one decision on every member: {vs:?}");
    if vs[0].member(joiner.rank).is_some() {
        return vs[0].clone();
    }
    assert!(vs[0].left.contains(&joiner.rank), "the joiner's rank is left out of {:?}", vs[0]);
    let (_ms, vs) = agree_all(ms).await;
    let vs: Vec<View> = vs.into_iter().map(|v| v.expect("the joiner's epoch")).collect();
    assert!(vs.iter().all(|v| *v == vs[0]), "one decision on every member: {vs:?}");
    assert_eq!(vs[0].member(joiner.rank), Some(joiner), "{:?}", vs[0]);
    vs[0].clone()
}

fn ranks(v: &View) -> Vec<usize> {
    v.ranks()
}
