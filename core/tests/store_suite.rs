//! The store contract, one set of cases run against every store: in memory, the TCP store
//! (a real server on loopback) and etcd (the cluster at `ANYCCL_ETCD_ENDPOINTS`, which
//! `.ci/run` starts; without it those cases show as ignored, with the reason).
//! Named `<store>::store::<case>`.

use anyccl_core::{store_barrier, Error, EtcdStore, MemoryStore, Store, TcpStore, TcpStoreOptions, TcpStoreServer};
use libtest_mimic::{Arguments, Failed, Trial};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

type Outcome = Result<(), Failed>;
type Case = fn(Fixture) -> Pin<Box<dyn Future<Output = Outcome>>>;

/// One store under test; `client()` is a new client of it (for memory, the same store).
struct Fixture {
    kind: &'static str,
    memory: MemoryStore,
    server: Option<TcpStoreServer>,
    etcd: Option<(String, String)>,
}

impl Fixture {
    fn new(kind: &'static str) -> Result<Fixture, String> {
        let mut f = Fixture { kind, memory: MemoryStore::new(), server: None, etcd: None };
        match kind {
            "memory" => {}
            "tcp" => {
                let opts = TcpStoreOptions { token: Some("suite".into()), ..Default::default() };
                f.server = Some(TcpStoreServer::start(([127, 0, 0, 1], 0).into(), opts).map_err(|e| e.to_string())?);
            }
            _ => {
                let ep = std::env::var("ANYCCL_ETCD_ENDPOINTS")
                    .ok()
                    .filter(|e| !e.is_empty())
                    .ok_or("no etcd cluster: set ANYCCL_ETCD_ENDPOINTS (bash .ci/run starts one)")?;
                // A prefix of its own per case: etcd keeps keys across runs.
                f.etcd = Some((ep, format!("anyccl-test/{:016x}", rand_u64())));
            }
        }
        Ok(f)
    }

    async fn client(&self) -> Result<Arc<dyn Store>, Failed> {
        Ok(match self.kind {
            "memory" => Arc::new(self.memory.clone()),
            "tcp" => {
                let addr = self.server.as_ref().ok_or("no server")?.local_addr().to_string();
                let opts = TcpStoreOptions {
                    token: Some("suite".into()),
                    connect_timeout: Duration::from_secs(10),
                    ..Default::default()
                };
                Arc::new(TcpStore::connect(addr, opts).await.map_err(|e| e.to_string())?)
            }
            _ => {
                let (ep, prefix) = self.etcd.as_ref().ok_or("no etcd")?;
                Arc::new(EtcdStore::connect(ep, prefix, Duration::from_secs(10)).await.map_err(|e| e.to_string())?)
            }
        })
    }
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Outcome {
    if ok {
        Ok(())
    } else {
        Err(what().into())
    }
}

fn e(err: Error) -> Failed {
    err.to_string().into()
}

fn soon(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
}

async fn basics(f: Fixture) -> Outcome {
    let st = f.client().await?;
    check(st.get("a").await.map_err(e)?.is_none(), || "a fresh key exists".into())?;
    st.set("a", b"1").await.map_err(e)?;
    st.set("a", b"2").await.map_err(e)?;
    check(st.get("a").await.map_err(e)? == Some(b"2".to_vec()), || "set does not replace".into())?;
    // Binary values and keys with slashes survive.
    let bin: Vec<u8> = (0..=255u8).collect();
    st.set("dir/sub/bin", &bin).await.map_err(e)?;
    check(st.get("dir/sub/bin").await.map_err(e)? == Some(bin.clone()), || "binary value changed".into())?;
    check(st.add("n", 5).await.map_err(e)? == 5, || "add on an absent key".into())?;
    check(st.add("n", -7).await.map_err(e)? == -2, || "add of a negative delta".into())?;
    check(st.add("n", 0).await.map_err(e)? == -2, || "add of zero reads".into())?;
    let r = st.add("dir/sub/bin", 1).await;
    check(r.is_err(), || format!("add on a non-integer value: {r:?}"))?;
    let c = st.compare_set("c", None, b"x").await.map_err(e)?;
    check(c.swapped && c.current == Some(b"x".to_vec()), || format!("cas on an absent key: {c:?}"))?;
    let c = st.compare_set("c", None, b"y").await.map_err(e)?;
    check(!c.swapped && c.current == Some(b"x".to_vec()), || format!("cas expecting absence: {c:?}"))?;
    let c = st.compare_set("c", Some(b"x"), b"z").await.map_err(e)?;
    check(c.swapped && c.current == Some(b"z".to_vec()), || format!("cas on the expected value: {c:?}"))?;
    let c = st.compare_set("none", Some(b"x"), b"z").await.map_err(e)?;
    check(!c.swapped && c.current.is_none(), || format!("cas expecting a value of an absent key: {c:?}"))?;
    check(st.delete("c").await.map_err(e)?, || "delete of a present key".into())?;
    check(!st.delete("c").await.map_err(e)?, || "delete of an absent key".into())?;
    check(st.get("c").await.map_err(e)?.is_none(), || "deleted key still there".into())
}

/// `delete_prefix` removes the keys under the prefix and no other (a key that only shares
/// the prefix's characters up to a shorter name stays), says how many, and refuses an empty
/// prefix.
async fn delete_prefix_removes_only_the_prefix(f: Fixture) -> Outcome {
    let st = f.client().await?;
    for k in ["trim/e1/a", "trim/e1/b/c", "trim/e10/a", "trim/e2/a", "trim/e1"] {
        st.set(k, b"v").await.map_err(e)?;
    }
    let n = st.delete_prefix("trim/e1/").await.map_err(e)?;
    check(n == 2, || format!("deleted {n} keys under trim/e1/, expected 2"))?;
    for (k, kept) in
        [("trim/e1/a", false), ("trim/e1/b/c", false), ("trim/e10/a", true), ("trim/e2/a", true), ("trim/e1", true)]
    {
        let there = st.get(k).await.map_err(e)?.is_some();
        check(there == kept, || format!("after delete_prefix(trim/e1/): {k} present {there}, expected {kept}"))?;
    }
    let n = st.delete_prefix("trim/none/").await.map_err(e)?;
    check(n == 0, || format!("deleted {n} keys under an absent prefix"))?;
    let r = st.delete_prefix("").await;
    check(matches!(r, Err(Error::InvalidArgument { .. })), || format!("an empty prefix: {r:?}"))?;
    check(st.get("trim/e2/a").await.map_err(e)?.is_some(), || "an empty prefix deleted keys".into())
}

async fn wait_times_out_and_wakes(f: Fixture) -> Outcome {
    let st = f.client().await?;
    let t = Instant::now();
    let r = st.wait("never", soon(300)).await;
    check(matches!(r, Err(Error::Timeout { .. })), || format!("wait on an absent key: {r:?}"))?;
    check(t.elapsed() >= Duration::from_millis(290) && t.elapsed() < Duration::from_secs(3), || {
        format!("timed out after {:?}", t.elapsed())
    })?;
    let writer = f.client().await?;
    let setter = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        writer.set("later", b"x").await
    });
    let t = Instant::now();
    let v = st.wait("later", soon(10_000)).await.map_err(e)?;
    check(v == b"x", || "wrong value".into())?;
    check(t.elapsed() < Duration::from_secs(3), || format!("woken after {:?}", t.elapsed()))?;
    setter.await.map_err(|e| e.to_string())?.map_err(e)?;
    // A present key returns at once, even with the deadline passed.
    check(st.wait("later", Instant::now()).await.map_err(e)? == b"x", || "wait on a present key".into())
}

async fn wait_many(f: Fixture) -> Outcome {
    let st = f.client().await?;
    st.set("a", b"1").await.map_err(e)?;
    let writer = f.client().await?;
    let setter = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        writer.set("b", b"2").await
    });
    let keys: Vec<String> = ["a", "b", "c"].iter().map(|k| k.to_string()).collect();
    let t = Instant::now();
    // "b" is set 100 ms in; the deadline leaves a loaded machine seconds for it.
    let got = st.wait_many(&keys, soon(2500)).await.map_err(e)?;
    check(got == vec![Some(b"1".to_vec()), Some(b"2".to_vec()), None], || format!("{got:?}"))?;
    check(t.elapsed() >= Duration::from_millis(2490) && t.elapsed() < Duration::from_secs(6), || {
        format!("returned after {:?}", t.elapsed())
    })?;
    setter.await.map_err(|e| e.to_string())?.map_err(e)?;
    let t = Instant::now();
    let got = st.wait_many(&keys, Instant::now()).await.map_err(e)?;
    check(got == vec![Some(b"1".to_vec()), Some(b"2".to_vec()), None], || format!("{got:?}"))?;
    check(t.elapsed() < Duration::from_secs(2), || format!("a read past the deadline took {:?}", t.elapsed()))?;
    check(st.wait_many(&[], Instant::now()).await.map_err(e)?.is_empty(), || "no keys".into())
}

async fn concurrent_adds_count_exactly(f: Fixture) -> Outcome {
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let st = f.client().await?;
        tasks.push(tokio::spawn(async move {
            for _ in 0..25 {
                st.add("count", 1).await?;
            }
            Ok::<_, Error>(())
        }));
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())?.map_err(e)?;
    }
    let n = f.client().await?.add("count", 0).await.map_err(e)?;
    check(n == 200, || format!("8 x 25 concurrent adds gave {n}"))
}

async fn one_compare_set_wins(f: Fixture) -> Outcome {
    let mut tasks = Vec::new();
    for i in 0..16u8 {
        let st = f.client().await?;
        tasks.push(tokio::spawn(async move { st.compare_set("leader", None, &[i]).await }));
    }
    let mut winners = Vec::new();
    let mut seen = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        let o = t.await.map_err(|e| e.to_string())?.map_err(e)?;
        if o.swapped {
            winners.push(i);
        }
        seen.push(o.current);
    }
    check(winners.len() == 1, || format!("{} compare_set calls won: {winners:?}", winners.len()))?;
    let w = Some(vec![winners[0] as u8]);
    check(seen.iter().all(|s| *s == w), || format!("callers saw different values: {seen:?}"))
}

async fn barrier_names_the_missing(f: Fixture) -> Outcome {
    let (a, b) = (f.client().await?, f.client().await?);
    let (ra, rb) = tokio::join!(
        // Long enough that rank 2's mark is in before rank 0's deadline on a loaded machine.
        store_barrier(a.as_ref(), "b1", 0, 3, soon(3000)),
        store_barrier(b.as_ref(), "b1", 2, 3, soon(3000))
    );
    for r in [ra, rb] {
        match r {
            Err(Error::Timeout { detail, .. }) if detail.contains("[1]") => {}
            other => return Err(format!("expected a timeout naming rank 1, got {other:?}").into()),
        }
    }
    let c = f.client().await?;
    let (ra, rb, rc) = tokio::join!(
        store_barrier(a.as_ref(), "b2", 0, 3, soon(5000)),
        store_barrier(b.as_ref(), "b2", 1, 3, soon(5000)),
        store_barrier(c.as_ref(), "b2", 2, 3, soon(5000)),
    );
    ra.map_err(e)?;
    rb.map_err(e)?;
    rc.map_err(e)
}

async fn barrier_of_many_ranks(f: Fixture) -> Outcome {
    const N: usize = 64;
    let mut tasks = Vec::new();
    for r in 0..N {
        let st = f.client().await?;
        tasks.push(tokio::spawn(async move { store_barrier(st.as_ref(), "many", r, N, soon(20_000)).await }));
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())?.map_err(e)?;
    }
    let st = f.client().await?;
    let r = store_barrier(st.as_ref(), "many", N, N, soon(100)).await;
    check(matches!(r, Err(Error::InvalidArgument { arg: "rank", .. })), || format!("rank {N} of {N}: {r:?}"))
}

async fn mixed_clients(f: Fixture) -> Outcome {
    let mut tasks = Vec::new();
    for id in 0..4 {
        let st = f.client().await?;
        tasks.push(tokio::spawn(async move {
            for i in 0..150usize {
                let key = format!("c{id}/k{}", i % 13);
                match i % 5 {
                    0 => st.set(&key, i.to_string().as_bytes()).await?,
                    1 => {
                        let v = st.get(&format!("c{id}/k{}", (i - 1) % 13)).await?;
                        if v != Some((i - 1).to_string().into_bytes()) {
                            return Err(Error::store_fatal(format!("client {id} op {i}: read {v:?}")));
                        }
                    }
                    2 => {
                        st.add("shared", 1).await?;
                    }
                    3 => {
                        let v = st.wait(&format!("c{id}/k{}", (i - 3) % 13), soon(5000)).await?;
                        if v != (i - 3).to_string().into_bytes() {
                            return Err(Error::store_fatal(format!("client {id} op {i}: waited {v:?}")));
                        }
                    }
                    _ => {
                        st.delete(&format!("c{id}/k{}", (i - 4) % 13)).await?;
                    }
                }
            }
            Ok(())
        }));
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())?.map_err(e)?;
    }
    let n = f.client().await?.add("shared", 0).await.map_err(e)?;
    check(n == 4 * 30, || format!("shared counter {n}, expected 120"))
}

fn main() -> std::process::ExitCode {
    let args = Arguments::from_args();
    let cases: Vec<(&str, Case)> = vec![
        ("basics", |f| Box::pin(basics(f))),
        ("delete_prefix_removes_only_the_prefix", |f| Box::pin(delete_prefix_removes_only_the_prefix(f))),
        ("wait_times_out_and_wakes", |f| Box::pin(wait_times_out_and_wakes(f))),
        ("wait_many_gathers_present_late_and_absent_keys", |f| Box::pin(wait_many(f))),
        ("concurrent_adds_count_exactly", |f| Box::pin(concurrent_adds_count_exactly(f))),
        ("one_compare_set_wins", |f| Box::pin(one_compare_set_wins(f))),
        ("barrier_names_the_missing", |f| Box::pin(barrier_names_the_missing(f))),
        ("barrier_of_many_ranks", |f| Box::pin(barrier_of_many_ranks(f))),
        ("mixed_clients", |f| Box::pin(mixed_clients(f))),
    ];
    let mut trials = Vec::new();
    for kind in ["memory", "tcp", "etcd"] {
        for (name, case) in &cases {
            let name = format!("{kind}::store::{name}");
            let case = *case;
            let trial = match Fixture::new(kind) {
                Err(why) if kind == "etcd" => {
                    Trial::test(name, || Ok(())).with_ignored_flag(true).with_kind(format!("ignored: {why}"))
                }
                _ => Trial::test(name, move || {
                    let f = Fixture::new(kind).map_err(Failed::from)?;
                    let rt = tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(2)
                        .enable_all()
                        .build()
                        .map_err(|e| e.to_string())?;
                    rt.block_on(async move {
                        tokio::time::timeout(Duration::from_secs(60), case(f))
                            .await
                            .map_err(|_| Failed::from("the case took more than 60 s"))?
                    })
                }),
            };
            trials.push(trial);
        }
    }
    libtest_mimic::run(&args, trials).exit_code()
}
