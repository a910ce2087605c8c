//! The store does not grow with a job's epochs: what a decided epoch removes.

use super::{cfg, rt, start};
use crate::MembershipConfig;
use anyccl_core::{MemoryStore, Store};
use std::sync::Arc;
use std::time::Duration;

/// The store does not grow with the epochs: once an epoch is decided, the arrivals at the one
/// before are removed, and every key of the epoch 16 before.
#[test]
fn membership_old_epochs_leave_the_store() {
    rt().block_on(async {
        let memory = MemoryStore::new();
        let store: Arc<dyn Store> = Arc::new(memory.clone());
        // Nobody is gone here: a liveness limit of 3 s, so that a liveness thread starved
        // beside the other cases of this binary never leaves a member out.
        let c =
            MembershipConfig { stale_after: Duration::from_secs(3), agree_timeout: Duration::from_secs(10), ..cfg() };
        let mut ms = start(&store, 4, &c).await;
        let mut sizes = Vec::new();
        for _ in 0..40 {
            // Agreed at once by every member (no proposal to wait for, as `agree_all` does).
            let tasks: Vec<_> =
                ms.into_iter().map(|m| tokio::spawn(async move { (m.agree("cycle").await, m) })).collect();
            ms = Vec::new();
            for t in tasks {
                let (v, m) = t.await.expect("task");
                v.expect("agreed");
                ms.push(m);
            }
            sizes.push(memory.size().0);
        }
        let at = |e: u64, what: &str| format!("{}/epoch/{e}/{what}", c.prefix.trim_end_matches('/'));
        let has = |k: String| {
            let store = store.clone();
            async move { store.get(&k).await.expect("get").is_some() }
        };
        assert!(has(at(40, "decision")).await && has(at(40, "arrived/0")).await, "the last epoch's keys are gone");
        assert!(has(at(39, "decision")).await, "the decision before the last is gone");
        assert!(!has(at(39, "arrived/0")).await, "the arrivals at the epoch before the last are kept");
        assert!(!has(at(24, "decision")).await && has(at(25, "decision")).await, "decisions kept: {sizes:?}");
        assert!(sizes[39] <= sizes[19] + 1, "keys grow with the epochs: {sizes:?}");
    });
}
