//! The protocol's cases: failures, replacements, stopped members, leaders replaced.

use super::{admitted, agree_all, cfg, fresh, ranks, rt, start};
use crate::{LivenessDriver, Member, Membership, MembershipConfig, View};
use anyccl_core::{MemoryStore, Store};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest a case waits for a step of another task to show in the store (it goes on
/// as soon as it does): long, so that a loaded host slows a case rather than failing it.
const SETTLE: Duration = Duration::from_secs(30);

/// Look at `key` every 2 ms until `done` holds for what the store has there (or
/// [`SETTLE`] passed: the case's own checks then fail).
async fn settle(store: &Arc<dyn Store>, key: &str, done: impl Fn(Option<&[u8]>) -> bool) {
    let t = Instant::now();
    while !done(store.get(key).await.expect("get").as_deref()) && t.elapsed() < SETTLE {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[test]
fn membership_start_agrees_on_every_rank_at_epoch_0() {
    rt().block_on(async {
        let (_, ms) = fresh(4, &cfg()).await;
        for m in &ms {
            let v = m.view();
            assert_eq!((v.epoch, ranks(&v)), (0, vec![0, 1, 2, 3]));
            assert!(v.members.iter().all(|m| m.incarnation == 1));
        }
    });
}

#[test]
fn membership_a_killed_member_is_left_out_on_its_stale_record() {
    rt().block_on(async {
        let (_, mut ms) = fresh(4, &cfg()).await;
        let t = Instant::now();
        drop(ms.remove(2));
        let (_ms, vs) = agree_all(ms).await;
        for v in &vs {
            let v = v.as_ref().expect("agreed");
            assert_eq!((v.epoch, ranks(v), v.left.clone()), (1, vec![0, 1, 3], vec![2]));
            assert!(v.reason.contains("rank 2 (incarnation 1) is gone"), "{}", v.reason);
        }
        // The liveness limit plus a few beats, not the agreement timeout.
        assert!(t.elapsed() < Duration::from_secs(3), "took {:?}", t.elapsed());
    });
}

#[test]
fn membership_a_replacement_joins_with_a_new_incarnation() {
    rt().block_on(async {
        let c = cfg();
        let (store, mut ms) = fresh(3, &c).await;
        drop(ms.remove(1));
        let (ms, vs) = agree_all(ms).await;
        assert!(vs.iter().all(|v| v.as_ref().is_ok_and(|v| ranks(v) == vec![0, 2])));
        // The replacement proposes the next epoch; the survivors hear of it and agree.
        let joiner = tokio::spawn(Membership::join(store.clone(), 1, 3, c.clone()));
        let (_ms, vs) = agree_all(ms).await;
        let joiner = joiner.await.expect("task").expect("admitted");
        let want = vec![
            Member { rank: 0, incarnation: 1 },
            Member { rank: 1, incarnation: 2 },
            Member { rank: 2, incarnation: 1 },
        ];
        assert_eq!(joiner.view().members, want);
        assert_eq!(joiner.view().epoch, 2);
        for v in vs {
            let v = v.expect("agreed");
            assert_eq!((v.epoch, v.members.clone(), v.joined.clone()), (2, want.clone(), vec![1]));
        }
    });
}

/// A process that died before it joined is reported gone by the launcher that saw it exit,
/// by the incarnation the launcher gave it; its replacement takes the next incarnation (not
/// the number the dead process never took, which the report marks gone) and is admitted.
#[test]
fn membership_a_replacement_of_a_process_that_never_joined_is_admitted() {
    rt().block_on(async {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let c = cfg();
        let first = tokio::spawn(Membership::join(store.clone(), 0, 2, c.clone()));
        let why = "rank 1 (pid 7, incarnation 1) exited with code 1, seen by anyccl-run";
        Membership::report_gone(store.as_ref(), &c, 1, Some(1), why).await.expect("report");
        let m0 = first.await.expect("task").expect("joined");
        assert_eq!(ranks(&m0.view()), vec![0]);
        let joiner = tokio::spawn(Membership::join(store.clone(), 1, 2, c.clone()));
        let (_ms, vs) = agree_all(vec![m0]).await;
        let joiner = joiner.await.expect("task").expect("admitted");
        assert_eq!(joiner.me(), Member { rank: 1, incarnation: 2 });
        assert_eq!(ranks(vs[0].as_ref().expect("agreed")), vec![0, 1]);
    });
}

#[test]
fn membership_a_failure_is_heard_as_one_and_a_join_is_not() {
    rt().block_on(async {
        let c = cfg();
        let (store, mut ms) = fresh(3, &c).await;
        let heard: Arc<std::sync::Mutex<Vec<crate::Proposal>>> = Arc::default();
        for m in &ms {
            let h = heard.clone();
            m.on_proposal(move |p| h.lock().expect("lock").push(p.clone()));
        }
        // A member saw an error of its own: every member hears a failure, nobody is left
        // out on that alone.
        let failing = ms.remove(2);
        let t = tokio::spawn(async move { (failing.fail("connection to rank 1 closed").await, failing) });
        let (mut ms, vs) = agree_all(ms).await;
        let (v2, failing) = t.await.expect("task");
        ms.push(failing);
        for v in vs.iter().chain([&v2]) {
            assert_eq!(v.as_ref().map(ranks).expect("agreed"), vec![0, 1, 2]);
        }
        assert!(heard.lock().expect("lock").iter().any(|p| p.epoch == 1 && p.failure), "{heard:?}");
        // A launcher reports rank 1 gone: a failure. Its replacement's epoch is not one.
        drop(ms.remove(1));
        Membership::report_gone(store.as_ref(), &c, 1, Some(1), "exited on signal 9").await.expect("report");
        let (ms, vs) = agree_all(ms).await;
        assert!(vs.iter().all(|v| v.as_ref().is_ok_and(|v| ranks(v) == vec![0, 2])));
        heard.lock().expect("lock").clear();
        let joiner = tokio::spawn(Membership::join(store.clone(), 1, 3, c.clone()));
        let t0 = Instant::now();
        while ms[0].proposed().is_none() && t0.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let p = ms[0].proposed().expect("the join is heard");
        assert_eq!((p.epoch, p.failure), (3, false), "{p:?}");
        let (_ms, vs) = agree_all(ms).await;
        joiner.await.expect("task").expect("admitted");
        assert!(vs.iter().all(|v| v.as_ref().is_ok_and(|v| ranks(v) == vec![0, 1, 2])));
        assert!(heard.lock().expect("lock").iter().all(|p| !p.failure), "{heard:?}");
    });
}

#[test]
fn membership_a_second_failure_during_the_agreement_is_decided_on_the_same_evidence() {
    rt().block_on(async {
        let (_, mut ms) = fresh(5, &cfg()).await;
        drop(ms.remove(4));
        // Rank 1 hears of the proposal and dies before it arrives.
        let doomed = ms.remove(1);
        let t = Instant::now();
        while doomed.proposed().is_none() && t.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(doomed);
        let (_ms, vs) = agree_all(ms).await;
        let first = vs[0].as_ref().expect("agreed").clone();
        assert_eq!((first.epoch, ranks(&first)), (1, vec![0, 2, 3]));
        assert!(vs.iter().all(|v| v.as_ref().ok() == Some(&first)), "every member the same view");
    });
}

#[test]
fn membership_a_stopped_member_is_excluded_and_told_so_when_it_resumes() {
    rt().block_on(async {
        let (_, mut ms) = fresh(3, &cfg()).await;
        // Stopped (SIGSTOP): its record is not renewed and it takes no part; it lives on.
        let stopped = ms.remove(1);
        stopped.shared.paused.store(true, std::sync::atomic::Ordering::Release);
        let (_ms, vs) = agree_all(ms).await;
        assert!(vs.iter().all(|v| v.as_ref().is_ok_and(|v| ranks(v) == vec![0, 2])));
        // It resumes and takes part in the agreement it missed: it is not a member.
        stopped.shared.paused.store(false, std::sync::atomic::Ordering::Release);
        let e = stopped.agree("resumed").await.unwrap_err();
        assert!(e.to_string().contains("rank 1 (incarnation 1) is not a member of epoch 1"), "{e}");
        // It must start again as a new process, and stops beating meanwhile.
        assert_eq!(e.recovery(), anyccl_core::Recovery::Fatal);
        assert!(stopped.shared.stop.load(std::sync::atomic::Ordering::Acquire));
    });
}

#[test]
fn membership_a_stopped_members_gone_record_is_read_by_one_who_is_not_a_member() {
    rt().block_on(async {
        let c = cfg();
        let (store, mut ms) = fresh(3, &c).await;
        let of = |rank, incarnation| Member { rank, incarnation };
        let asked = [of(0, 1), of(1, 1), of(1, 2), of(2, 1)];
        let none = Membership::gone_records(store.as_ref(), &c, &asked).await.expect("read");
        assert_eq!(none, vec![None; 4]);
        let stopped = ms.remove(1);
        stopped.shared.paused.store(true, std::sync::atomic::Ordering::Release);
        let (_ms, vs) = agree_all(ms).await;
        assert!(vs.iter().all(|v| v.as_ref().is_ok_and(|v| ranks(v) == vec![0, 2])));
        // Rank 1's first process, and only it, is recorded gone, by the member watching it.
        let got = Membership::gone_records(store.as_ref(), &c, &asked).await.expect("read");
        let text = got[1].as_deref().unwrap_or_default();
        assert!(text.starts_with("rank 1 (incarnation 1) is gone: no liveness record of rank 1"), "{text}");
        assert!(text.ends_with("seen by rank 0"), "{text}");
        assert_eq!((&got[0], &got[2], &got[3]), (&None, &None, &None));
        // A launcher that kills it now and reports it (as for any exit) keeps the record and
        // proposes nothing: the epoch that left it out is agreed already.
        Membership::report_gone(store.as_ref(), &c, 1, Some(1), "killed, seen by anyccl-run").await.expect("report");
        let after = Membership::gone_records(store.as_ref(), &c, &[of(1, 1)]).await.expect("read");
        assert_eq!(after[0].as_deref(), Some(text));
        let keys = crate::keys::Keys::new(&c.prefix);
        assert_eq!(store.get(&keys.proposed(2)).await.expect("read"), None, "a needless epoch was proposed");
    });
}

/// Two neighbours stopped at once: the second's watcher is the first, stopped too, so only
/// the leader sees the second's record go stale; it records it gone with the decision, so
/// that a launcher watching the records replaces both.
#[test]
fn membership_every_member_left_out_on_evidence_is_recorded_gone() {
    rt().block_on(async {
        let c = cfg();
        let (store, mut ms) = fresh(4, &c).await;
        let stopped = [ms.remove(2), ms.remove(1)];
        for s in &stopped {
            s.shared.paused.store(true, std::sync::atomic::Ordering::Release);
        }
        let (_ms, vs) = agree_all(ms).await;
        assert!(vs.iter().all(|v| v.as_ref().is_ok_and(|v| ranks(v) == vec![0, 3])), "{vs:?}");
        let of = |rank| Member { rank, incarnation: 1 };
        let got = Membership::gone_records(store.as_ref(), &c, &[of(1), of(2)]).await.expect("read");
        let (one, two) = (got[0].as_deref().unwrap_or_default(), got[1].as_deref().unwrap_or_default());
        assert!(one.starts_with("rank 1 (incarnation 1) is gone: no liveness record of rank 1"), "{one}");
        assert!(two.starts_with("rank 2 (incarnation 1) is gone: no liveness record of rank 2"), "{two}");
        assert!(two.contains("leading epoch 1"), "rank 2's record is the leader's: {two}");
    });
}

#[test]
fn membership_a_member_that_beats_but_never_arrives_fails_everyone_the_same_way() {
    rt().block_on(async {
        let c = MembershipConfig { agree_timeout: Duration::from_millis(800), ..cfg() };
        let (_, mut ms) = fresh(3, &c).await;
        let absent = ms.remove(0); // keeps beating, never calls agree
        let t = Instant::now();
        let tasks: Vec<_> = ms.into_iter().map(|m| tokio::spawn(async move { (m.agree("test").await, m) })).collect();
        let mut errs = Vec::new();
        let mut back = Vec::new();
        for task in tasks {
            let (r, m) = task.await.expect("task");
            back.push(m);
            let e = r.expect_err("cannot agree").to_string();
            // The decision's words, after the rank that reports them.
            errs.push(e.split_once("'membership': ").map(|x| x.1.to_string()).unwrap_or(e));
        }
        assert_eq!(errs[0], errs[1], "the same error on every member");
        assert!(errs[0].contains("ranks [0] are alive") && errs[0].contains("epoch 1"), "{}", errs[0]);
        assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
        // The failed epoch is behind them: once the absent member is gone, the next
        // agreement is a new epoch and succeeds without it.
        drop(absent);
        let tasks: Vec<_> =
            back.into_iter().map(|m| tokio::spawn(async move { (m.agree("again").await, m) })).collect();
        for task in tasks {
            let (r, _m) = task.await.expect("task");
            let v = r.expect("a new epoch, without the absent member");
            assert_eq!((v.epoch, ranks(&v)), (2, vec![1, 2]));
        }
    });
}

/// The leader of an epoch is killed and its rank restarted at once: the new process renews
/// the rank's liveness record, so the dead leader never goes stale; it is replaced on the
/// evidence of the newer process (not after the agreement timeout), and the new process is
/// admitted. Where: at epoch 1 when the leader decides before the dead process's watcher
/// sees the newer record; otherwise the watcher marks epoch 1 a failure (a process died),
/// which admits no joiner, and the joiner is admitted at epoch 2, which the members take
/// when they hear it proposed. Both are the protocol; which one a run takes is timing (a
/// loaded machine takes the second about one run in five).
#[test]
fn membership_a_leader_killed_and_restarted_at_once_is_replaced() {
    rt().block_on(async {
        let c = MembershipConfig { agree_timeout: Duration::from_secs(20), ..cfg() };
        let (store, mut ms) = fresh(4, &c).await;
        let m3 = ms.remove(3);
        store.compare_set(&format!("{}/epoch/1/proposed", c.prefix), None, b"test").await.unwrap();
        store.compare_set(&format!("{}/epoch/1/leader", c.prefix), None, b"3 1").await.unwrap();
        drop(m3);
        let t = Instant::now();
        let joiner = tokio::spawn(Membership::join(store.clone(), 3, 4, c.clone()));
        let (ms, vs) = agree_all(ms).await;
        let admitted = admitted(ms, vs, Member { rank: 3, incarnation: 2 }).await;
        let joiner = joiner.await.expect("task").expect("the restarted rank is admitted");
        assert_eq!(joiner.view(), admitted);
        let gone = Membership::gone_records(store.as_ref(), &c, &[Member { rank: 3, incarnation: 1 }]).await;
        let gone = gone.expect("read").remove(0).unwrap_or_default();
        assert!(gone.contains("a newer process of rank 3"), "left out on evidence: {gone}");
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}: waited for the agreement timeout", t.elapsed());
    });
}

#[test]
fn membership_the_leader_dying_mid_agreement_is_replaced() {
    rt().block_on(async {
        let c = cfg();
        let (store, mut ms) = fresh(4, &c).await;
        drop(ms.remove(3));
        // Rank 0 takes the lead of epoch 1 by hand and dies before deciding.
        let keys_leader = format!("{}/epoch/1/leader", c.prefix);
        let m0 = ms.remove(0);
        store.compare_set(&keys_leader, None, format!("0 {}", m0.me().incarnation).as_bytes()).await.unwrap();
        store.set(&format!("{}/epoch/1/arrived/0", c.prefix), b"1").await.unwrap();
        drop(m0);
        let (_ms, vs) = agree_all(ms).await;
        for v in &vs {
            let v = v.as_ref().expect("agreed past the dead leader");
            assert_eq!(ranks(v), vec![1, 2], "{v:?}");
        }
    });
}

/// A decided view costs the store about two bytes a rank (every member reads it, so a list
/// of members would cost the job O(N²) bytes at thirty a member), and reads back the same.
#[test]
fn membership_a_decided_view_is_stored_in_about_two_bytes_a_rank_and_reads_back_the_same() {
    let n = 4096;
    let members: Vec<Member> = (0..n).filter(|&r| r != 1234).map(|r| Member { rank: r, incarnation: 1 }).collect();
    let v = View { epoch: 7, members, left: vec![1234], joined: vec![], reason: "rank 1234 is gone".into() };
    for d in [crate::view::Decision::View(v.clone()), crate::view::Decision::Failed("no decision".into())] {
        let bytes = serde_json::to_vec(&d).expect("encode");
        assert_eq!(crate::agree::decode(7, &bytes).expect("decode"), d);
        assert!(bytes.len() < 2 * n + 200, "{} bytes for {n} ranks", bytes.len());
    }
    // A replacement's incarnation and a last rank that left keep their places.
    let members = vec![Member { rank: 0, incarnation: 3 }, Member { rank: 2, incarnation: 1 }];
    let v = View { epoch: 1, members, left: vec![1, 3], joined: vec![0], reason: String::new() };
    let d = crate::view::Decision::View(v);
    assert_eq!(crate::agree::decode(1, &serde_json::to_vec(&d).expect("encode")).expect("decode"), d);
}

/// The leader waits only for members without evidence of being gone: with a member reported
/// gone, the survivors' agreement ends at their last arrival, not a beat later.
#[test]
fn membership_the_leader_decides_without_waiting_a_beat_for_a_member_known_gone() {
    let beat = Duration::from_secs(1);
    let c = MembershipConfig { beat, stale_after: beat * 3, agree_timeout: beat * 10, ..cfg() };
    rt().block_on(async {
        let (store, mut ms) = fresh(4, &c).await;
        drop(ms.remove(3));
        Membership::report_gone(store.as_ref(), &c, 3, Some(1), "exited on signal 9").await.expect("report");
        let t = Instant::now();
        let tasks: Vec<_> = ms.into_iter().map(|m| tokio::spawn(async move { (m.agree("test").await, m) })).collect();
        let mut back = Vec::new();
        for task in tasks {
            back.push(task.await.expect("task"));
        }
        // Timed before the members are dropped (each drop waits for its liveness thread).
        let took = t.elapsed();
        for (v, _m) in &back {
            assert_eq!(ranks(v.as_ref().expect("agreed")), vec![0, 1, 2]);
        }
        assert!(took < beat / 2, "the agreement took {took:?}: it waited for the gone member");
    });
}

/// A replacement started for a rank whose process still runs (the launcher thought it dead)
/// is admitted, and the old process is told it is out, even when the old process arrives
/// at the epoch after the replacement and keeps renewing its rank's liveness record. The
/// replacement is admitted at epoch 1, or at epoch 2 when the old process's watcher saw the
/// newer record first and marked epoch 1 a failure (timing: see `admitted`).
#[test]
fn membership_a_replacement_for_a_live_member_is_admitted_though_the_old_one_arrives_after_it() {
    rt().block_on(async {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        // Nobody is gone: at 300 ms a starved liveness thread once left rank 2 out in CI.
        let c =
            MembershipConfig { stale_after: Duration::from_secs(3), agree_timeout: Duration::from_secs(10), ..cfg() };
        let mut ms = start(&store, 3, &c).await;
        let old = ms.remove(2);
        let joiner = tokio::spawn(Membership::join(store.clone(), 2, 3, c.clone()));
        let arrived = crate::keys::Keys::new(&c.prefix).arrived(1, 2);
        settle(&store, &arrived, |v| v == Some(b"2")).await;
        // The old process arrives after its replacement.
        let old = tokio::spawn(async move { (old.agree("the old process arrives").await, old) });
        let (ms, vs) = agree_all(ms).await;
        let admitted = admitted(ms, vs, Member { rank: 2, incarnation: 2 }).await;
        let joiner = joiner.await.expect("task").expect("the replacement is admitted");
        assert_eq!(joiner.view(), admitted);
        let (r, _old) = old.await.expect("task");
        let e = r.expect_err("the old process is out").to_string();
        assert!(e.contains("rank 2 (incarnation 1) is not a member"), "{e}");
    });
}

/// Once a replacement renews its rank's liveness record, the old process (which still runs)
/// stops renewing it: readers see only the newer incarnation's record, so they cannot take it
/// for unrenewed when their reads fall between the old process's writes.
#[test]
fn membership_an_old_process_stops_renewing_its_rank_record_once_its_replacement_does() {
    rt().block_on(async {
        let c = cfg();
        let (store, ms) = fresh(2, &c).await;
        let joiner = tokio::spawn(Membership::join(store.clone(), 1, 2, c.clone()));
        let alive = crate::keys::Keys::new(&c.prefix).alive(1);
        let incarnation = |r: Option<Vec<u8>>| r.as_deref().and_then(crate::liveness::record_incarnation);
        settle(&store, &alive, |v| v.and_then(crate::liveness::record_incarnation) == Some(2)).await;
        // Ten beats of the old process (still running, beating every 20 ms).
        let mut seen = Vec::new();
        for _ in 0..100 {
            seen.push(incarnation(store.get(&alive).await.expect("get")));
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(seen.iter().all(|i| *i == Some(2)), "the record named {seen:?}");
        assert!(ms[1].beats() > 0);
        joiner.abort();
    });
}

/// Wait (up to 5 s) until `driver` counts `n` members: an aborted member's task is dropped
/// on the driver's thread at its next turn.
async fn counted(driver: &LivenessDriver, n: usize) -> usize {
    let t = Instant::now();
    while driver.members() != n && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    driver.members()
}

/// Members that share one liveness driver (one thread for all) start, leave a killed member
/// out on its stale record and admit its replacement, as members with threads of their own
/// do; the driver counts the members beating on it.
#[test]
fn membership_members_sharing_a_liveness_driver_agree_as_members_with_threads_of_their_own() {
    let driver = LivenessDriver::start().expect("driver");
    let c = MembershipConfig { liveness_driver: Some(driver.clone()), ..cfg() };
    rt().block_on(async {
        let (store, mut ms) = fresh(4, &c).await;
        assert_eq!(driver.members(), 4);
        drop(ms.remove(2));
        assert_eq!(counted(&driver, 3).await, 3);
        let (ms, vs) = agree_all(ms).await;
        for v in &vs {
            let v = v.as_ref().expect("agreed");
            assert_eq!((v.epoch, ranks(v), v.left.clone()), (1, vec![0, 1, 3], vec![2]));
        }
        let joiner = tokio::spawn(Membership::join(store.clone(), 2, 4, c.clone()));
        let (ms, vs) = agree_all(ms).await;
        let joiner = joiner.await.expect("task").expect("admitted");
        assert_eq!(joiner.view().member(2), Some(Member { rank: 2, incarnation: 2 }));
        assert!(vs.iter().all(|v| v.as_ref().is_ok_and(|v| v.epoch == 2 && ranks(v) == vec![0, 1, 2, 3])));
        assert_eq!(driver.members(), 4);
        assert!(ms.iter().all(|m| m.beats() > 0));
    });
}

/// A member on a shared driver stops beating when dropped without waiting for a beat (its
/// task is aborted; a member with a thread of its own waits for that thread, up to a beat),
/// and the driver's thread ends with its last member and clone.
#[test]
fn membership_a_member_on_a_liveness_driver_stops_at_once_and_the_driver_ends_with_its_last_clone() {
    let driver = LivenessDriver::start().expect("driver");
    let beat = Duration::from_secs(2);
    let c = MembershipConfig {
        beat,
        stale_after: beat * 3,
        agree_timeout: beat * 5,
        liveness_driver: Some(driver.clone()),
        ..cfg()
    };
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    rt().block_on(async {
        let m = Membership::join(store.clone(), 0, 1, c.clone()).await.expect("join");
        let alive = crate::keys::Keys::new(&c.prefix).alive(0);
        let t = Instant::now();
        drop(m);
        assert!(t.elapsed() < beat / 2, "the drop waited {:?}", t.elapsed());
        assert_eq!(counted(&driver, 0).await, 0);
        let before = store.get(&alive).await.expect("get");
        tokio::time::sleep(beat + beat / 4).await;
        assert_eq!(store.get(&alive).await.expect("get"), before, "renewed after the drop");
    });
    drop(c);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(driver);
        let _ = tx.send(());
    });
    assert!(rx.recv_timeout(Duration::from_secs(5)).is_ok(), "the driver's thread did not end");
}

/// Rank 0 takes the lead of the job's first agreement (epoch 0), having arrived and beaten
/// once, and dies before deciding: the others replace it on its stale record and start the
/// job without it.
#[test]
fn membership_the_leader_of_epoch_0_dying_before_it_decides_is_replaced_and_left_out() {
    rt().block_on(async {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let c = cfg();
        let keys = crate::keys::Keys::new(&c.prefix);
        // Rank 0's process, as far as it got: its incarnation, one beat, its arrival, the lead.
        store.add(&keys.incarnation(0), 1).await.unwrap();
        store.set(&keys.alive(0), b"1 1").await.unwrap();
        store.compare_set(&keys.proposed(0), None, b"the job starts").await.unwrap();
        store.set(&keys.arrived(0, 0), b"1").await.unwrap();
        store.compare_set(&keys.leader(0), None, b"0 1").await.unwrap();
        let t = Instant::now();
        let joins: Vec<_> = (1..4).map(|r| tokio::spawn(Membership::join(store.clone(), r, 4, c.clone()))).collect();
        for j in joins {
            let m = j.await.expect("task").expect("the job starts without rank 0");
            assert_eq!((m.view().epoch, ranks(&m.view())), (0, vec![1, 2, 3]));
        }
        // About the liveness limit (the new leader knows the record stale from its looks
        // while it waited), not the agreement timeout.
        assert!(t.elapsed() < Duration::from_secs(3), "took {:?}", t.elapsed());
    });
}

#[test]
fn membership_refuses_a_rank_outside_the_world_and_settings_that_cannot_work() {
    rt().block_on(async {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let e = Membership::join(store.clone(), 4, 4, cfg()).await.unwrap_err().to_string();
        assert!(e.contains("rank 4 is not below the world size 4"), "{e}");
        let bad = MembershipConfig { stale_after: Duration::from_millis(30), ..cfg() };
        let e = Membership::join(store, 0, 4, bad).await.unwrap_err().to_string();
        assert!(e.contains("not above two beats"), "{e}");
    });
}

/// A store that counts its requests, and apart those whose key (or first key) is an epoch's.
#[derive(Debug, Default)]
struct Counting {
    inner: MemoryStore,
    epoch_requests: std::sync::atomic::AtomicU64,
    requests: std::sync::atomic::AtomicU64,
}

impl Counting {
    fn note(&self, key: &str) {
        self.requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if key.contains("/epoch/") {
            self.epoch_requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

#[anyccl_core::async_trait]
impl Store for Counting {
    async fn set(&self, key: &str, value: &[u8]) -> anyccl_core::Result<()> {
        self.note(key);
        self.inner.set(key, value).await
    }
    async fn get(&self, key: &str) -> anyccl_core::Result<Option<Vec<u8>>> {
        self.note(key);
        self.inner.get(key).await
    }
    async fn wait(&self, key: &str, deadline: Instant) -> anyccl_core::Result<Vec<u8>> {
        self.note(key);
        self.inner.wait(key, deadline).await
    }
    async fn add(&self, key: &str, delta: i64) -> anyccl_core::Result<i64> {
        self.note(key);
        self.inner.add(key, delta).await
    }
    async fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        new: &[u8],
    ) -> anyccl_core::Result<anyccl_core::CasOutcome> {
        self.note(key);
        self.inner.compare_set(key, expected, new).await
    }
    async fn delete(&self, key: &str) -> anyccl_core::Result<bool> {
        self.note(key);
        self.inner.delete(key).await
    }
    async fn wait_many(&self, keys: &[String], deadline: Instant) -> anyccl_core::Result<Vec<Option<Vec<u8>>>> {
        self.note(keys.first().map(String::as_str).unwrap_or(""));
        self.inner.wait_many(keys, deadline).await
    }
}

/// The requests of one agreement grow with the members, not with their square.
#[test]
fn membership_an_agreement_costs_the_store_o_n_requests() {
    let per_member = |n: usize| {
        rt().block_on(async {
            let counting = Arc::new(Counting::default());
            let store: Arc<dyn Store> = counting.clone();
            let ms = start(&store, n, &cfg()).await;
            let before = counting.epoch_requests.load(std::sync::atomic::Ordering::Relaxed);
            let tasks: Vec<_> =
                ms.into_iter().map(|m| tokio::spawn(async move { (m.agree("count").await, m) })).collect();
            for t in tasks {
                t.await.expect("task").0.expect("agreed");
            }
            let used = counting.epoch_requests.load(std::sync::atomic::Ordering::Relaxed) - before;
            used as f64 / n as f64
        })
    };
    let (small, large) = (per_member(8), per_member(32));
    eprintln!("store requests per member in one agreement: {small:.1} at 8 members, {large:.1} at 32");
    // Each member proposes, arrives and reads the decision, plus a few looks while it
    // waits; the leader's gathering is one multi-key request a beat. A protocol in which
    // every member reads every other's record would need 32 or more a member at 32.
    assert!(large < 32.0, "requests per member: {small:.1} at 8, {large:.1} at 32");
}

/// Between agreements a member costs the store two requests a beat: its renewal, and one read
/// of both the next epoch's proposal and its watched member's record.
#[test]
fn membership_a_beat_costs_the_store_two_requests() {
    rt().block_on(async {
        let counting = Arc::new(Counting::default());
        let store: Arc<dyn Store> = counting.clone();
        let ms = start(&store, 3, &cfg()).await;
        let total = |ms: &[Membership]| ms.iter().map(Membership::beats).sum::<u64>();
        let (beats, requests) = (total(&ms), counting.requests.load(std::sync::atomic::Ordering::Relaxed));
        tokio::time::sleep(Duration::from_secs(1)).await;
        let beats = total(&ms) - beats;
        let requests = counting.requests.load(std::sync::atomic::Ordering::Relaxed) - requests;
        let per_beat = requests as f64 / beats as f64;
        assert!(beats > 30 && (1.9..=2.1).contains(&per_beat), "{requests} requests in {beats} beats");
    });
}

/// A failure epoch admits no joiner, though one waits (it may still be starting its device):
/// the survivors go on first; the joiner is admitted at the next epoch, which it proposes.
#[test]
fn membership_a_failure_epoch_admits_no_joiner_the_next_epoch_does() {
    rt().block_on(async {
        let c = cfg();
        let (store, mut ms) = fresh(3, &c).await;
        drop(ms.remove(2));
        Membership::report_gone(store.as_ref(), &c, 2, Some(1), "the launcher saw rank 2 exit").await.expect("report");
        let joiner = tokio::spawn(Membership::join(store.clone(), 2, 3, c.clone()));
        let joining = crate::keys::Keys::new(&c.prefix).joining(2);
        settle(&store, &joining, |v| v.is_some()).await;
        let (ms, vs) = agree_all(ms).await;
        for v in vs {
            let v = v.expect("agreed");
            assert_eq!((v.epoch, ranks(&v), v.left.clone(), v.joined.clone()), (1, vec![0, 1], vec![2], vec![]));
        }
        let (_ms, vs) = agree_all(ms).await;
        let joiner = joiner.await.expect("task").expect("admitted at the next epoch");
        assert_eq!((joiner.view().epoch, joiner.view().joined.clone()), (2, vec![2]));
        vs.into_iter().for_each(|v| assert_eq!(v.expect("agreed").members, joiner.view().members));
    });
}

/// A process replaced by a joiner of its rank is recorded gone by the leader that admits the
/// joiner, as every process left out on evidence is, also where no watcher saw it (every
/// member's beat is held here, so only the leader can write the record).
#[test]
fn membership_a_process_replaced_by_a_joiner_is_recorded_gone_by_the_leader() {
    rt().block_on(async {
        let c =
            MembershipConfig { stale_after: Duration::from_secs(20), agree_timeout: Duration::from_secs(30), ..cfg() };
        let (store, ms) = fresh(3, &c).await;
        for m in &ms {
            m.shared.paused.store(true, std::sync::atomic::Ordering::Release);
        }
        let joiner = tokio::spawn(Membership::join(store.clone(), 2, 3, c.clone()));
        let joining = crate::keys::Keys::new(&c.prefix).joining(2);
        settle(&store, &joining, |v| v.is_some()).await;
        let mut ms = ms.into_iter();
        let (m0, m1, _old) = (ms.next().expect("rank 0"), ms.next().expect("rank 1"), ms.next());
        let (a, b) = tokio::join!(m0.agree("a replacement joins"), m1.agree("a replacement joins"));
        let joiner = joiner.await.expect("task").expect("admitted");
        for v in [a.expect("rank 0 agreed"), b.expect("rank 1 agreed")] {
            assert_eq!(
                (v.epoch, v.member(2), v.joined.clone()),
                (1, Some(Member { rank: 2, incarnation: 2 }), vec![2])
            );
            assert_eq!(v, joiner.view());
        }
        let gone = Membership::gone_records(store.as_ref(), &c, &[Member { rank: 2, incarnation: 1 }]).await;
        let gone = gone.expect("read").remove(0).unwrap_or_default();
        assert!(
            gone.starts_with("rank 2 (incarnation 1) is gone: a newer process of rank 2 (incarnation 2) joins"),
            "{gone}"
        );
    });
}
