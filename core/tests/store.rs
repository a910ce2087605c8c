//! TCP store: concurrency, authentication and frame limits, against a real server on
//! loopback.

use anyccl_core::{Error, MemoryStore, Store, TcpStore, TcpStoreOptions, TcpStoreServer};
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn server(token: Option<&str>) -> TcpStoreServer {
    let opts = TcpStoreOptions { token: token.map(str::to_string), ..Default::default() };
    TcpStoreServer::start(([127, 0, 0, 1], 0).into(), opts).expect("start server")
}

fn client_opts(token: Option<&str>) -> TcpStoreOptions {
    TcpStoreOptions { token: token.map(str::to_string), connect_timeout: Duration::from_secs(5), ..Default::default() }
}

async fn mixed_ops(st: Arc<dyn Store>, id: usize, ops: usize) -> anyccl_core::Result<()> {
    for i in 0..ops {
        let key = format!("c{id}/k{}", i % 97);
        match i % 6 {
            0 => st.set(&key, format!("{i}").as_bytes()).await?,
            1 => {
                let v = st.get(&format!("c{id}/k{}", (i - 1) % 97)).await?;
                assert_eq!(v, Some(format!("{}", i - 1).into_bytes()), "client {id} op {i}");
            }
            2 => {
                st.add("shared/counter", 1).await?;
            }
            3 => {
                let cur = st.get(&key).await?;
                let out = st.compare_set(&key, cur.as_deref(), b"cas").await?;
                assert!(out.swapped, "client {id} op {i}: cas on own key failed");
            }
            4 => {
                let v = st.wait(&format!("c{id}/k{}", (i - 1) % 97), Instant::now() + Duration::from_secs(5)).await?;
                assert_eq!(v, b"cas");
            }
            _ => {
                st.delete(&format!("c{id}/k{}", (i - 2) % 97)).await?;
            }
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_store_four_clients_ten_thousand_mixed_ops_each() {
    let srv = server(Some("s3cret"));
    let addr = srv.local_addr().to_string();
    let t = Instant::now();
    let mut tasks = Vec::new();
    for id in 0..4 {
        let st: Arc<dyn Store> =
            Arc::new(TcpStore::connect(addr.clone(), client_opts(Some("s3cret"))).await.expect("connect"));
        tasks.push(tokio::spawn(mixed_ops(st, id, 10_000)));
    }
    for t in tasks {
        t.await.expect("task").expect("ops");
    }
    let st = TcpStore::connect(addr, client_opts(Some("s3cret"))).await.expect("connect");
    let n = st.add("shared/counter", 0).await.expect("read counter");
    let per_client = (0..10_000).filter(|i| i % 6 == 2).count() as i64;
    assert_eq!(n, 4 * per_client);
    println!("40000 mixed operations from 4 clients in {:?}", t.elapsed());
}

#[tokio::test]
async fn tcp_store_refuses_a_wrong_token() {
    let srv = server(Some("right"));
    let addr = srv.local_addr().to_string();
    match TcpStore::connect(addr.clone(), client_opts(Some("wrong"))).await {
        Err(Error::Store { msg, .. }) => assert!(msg.contains("authentication failed"), "{msg}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    match TcpStore::connect(addr.clone(), client_opts(None)).await {
        Err(Error::Store { msg, .. }) => assert!(msg.contains("authentication failed"), "{msg}"),
        other => panic!("expected a refusal without a token, got {other:?}"),
    }
    TcpStore::connect(addr, client_opts(Some("right"))).await.expect("the right token is accepted");
}

/// A frame header announcing 1 GiB is refused at once: the server closes the connection
/// instead of waiting for (or allocating) the gigabyte, and keeps serving others.
#[tokio::test]
async fn tcp_store_refuses_a_one_gib_frame_header() {
    let srv = server(None);
    let addr = srv.local_addr();
    let t = Instant::now();
    let verdict = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        s.write_all(&(1u32 << 30).to_be_bytes()).expect("header");
        let _ = s.write_all(&[1, 0, 0, 0, 1]);
        let mut buf = [0u8; 16];
        s.read(&mut buf)
    })
    .await
    .expect("join");
    match verdict {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("expected the server to close the connection, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(3), "refusal took {:?}", t.elapsed());
    let st = TcpStore::connect(addr.to_string(), client_opts(None)).await.expect("server still serves");
    st.set("k", b"v").await.expect("set after a bad client");
}

/// Frames on the wire, for clients that misbehave.
fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_be_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Before a client has authenticated, the server reads no frame larger than a hello: a
/// connection announcing 1 MiB (well under the 64 MiB limit for authenticated clients) is
/// closed at once, so unauthenticated connections cannot make it reserve memory.
#[tokio::test]
async fn tcp_store_reads_no_large_frame_before_authentication() {
    let srv = server(Some("tok"));
    let addr = srv.local_addr();
    let t = Instant::now();
    let verdicts = tokio::task::spawn_blocking(move || {
        let mut socks: Vec<std::net::TcpStream> = (0..16)
            .map(|_| {
                let mut s = std::net::TcpStream::connect(addr).expect("connect");
                s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
                s.write_all(&(1u32 << 20).to_be_bytes()).expect("header");
                s
            })
            .collect();
        socks.iter_mut().map(|s| s.read(&mut [0u8; 8]).map_err(|e| e.kind())).collect::<Vec<_>>()
    })
    .await
    .expect("join");
    for v in verdicts {
        assert!(
            matches!(v, Ok(0) | Err(std::io::ErrorKind::ConnectionReset)),
            "expected the connection closed, got {v:?}"
        );
    }
    assert!(t.elapsed() < Duration::from_secs(3), "closing took {:?}", t.elapsed());
    let st = TcpStore::connect(addr.to_string(), client_opts(Some("tok"))).await.expect("server still serves");
    st.set("k", b"v").await.expect("set");
}

/// Connections that never say hello are bounded: past the limit the oldest of them is
/// closed to make room, so a newcomer that says hello is served at once.
#[tokio::test]
async fn tcp_store_bounds_connections_that_never_authenticate() {
    let srv = server(Some("tok"));
    let addr = srv.local_addr();
    let (oldest, newcomer) = tokio::task::spawn_blocking(move || {
        let idle: Vec<std::net::TcpStream> =
            (0..256).map(|_| std::net::TcpStream::connect(addr).expect("connect")).collect();
        std::thread::sleep(Duration::from_millis(300));
        let mut extra = std::net::TcpStream::connect(addr).expect("connect");
        extra.set_read_timeout(Some(Duration::from_secs(3))).expect("timeout");
        let mut hello = vec![1u8, 0, 0, 0, 2, 0, 0, 0, 3];
        hello.extend_from_slice(b"tok");
        extra.write_all(&frame(&hello)).expect("hello");
        let mut answer = [0u8; 5];
        let newcomer = extra.read_exact(&mut answer).map(|_| answer).map_err(|e| e.kind());
        let mut first = &idle[0];
        first.set_read_timeout(Some(Duration::from_secs(3))).expect("timeout");
        let oldest = first.read(&mut [0u8; 8]).map_err(|e| e.kind());
        (oldest, newcomer)
    })
    .await
    .expect("join");
    assert_eq!(newcomer, Ok([0, 0, 0, 1, 0]), "the 257th connection, which said hello, was not served");
    assert!(
        matches!(oldest, Ok(0) | Err(std::io::ErrorKind::ConnectionReset)),
        "the oldest silent connection was kept past the limit: {oldest:?}"
    );
    assert!(srv.stats().hellos_evicted >= 1, "{:?}", srv.stats());
    let st = TcpStore::connect(addr.to_string(), client_opts(Some("tok"))).await.expect("serves");
    st.set("k", b"v").await.expect("set");
}

/// A client that asks for a long wait and hangs up frees its connection on the server at
/// once, not when the wait would have ended.
#[tokio::test]
async fn tcp_store_frees_a_wait_whose_client_hung_up() {
    let srv = server(None);
    let addr = srv.local_addr();
    let st = TcpStore::connect(addr.to_string(), client_opts(None)).await.expect("connect");
    st.set("warm", b"1").await.expect("set");
    let before = open_fds();
    tokio::task::spawn_blocking(move || {
        for _ in 0..8 {
            let mut s = std::net::TcpStream::connect(addr).expect("connect");
            s.write_all(&frame(&[1, 0, 0, 0, 1, 0, 0, 0, 0])).expect("hello");
            s.read_exact(&mut [0u8; 5]).expect("hello answer");
            // wait: op 4, key "never" (u32 length + bytes), timeout 600 s in ms
            let mut w = vec![4u8, 0, 0, 0, 5];
            w.extend_from_slice(b"never");
            w.extend_from_slice(&600_000u64.to_be_bytes());
            s.write_all(&frame(&w)).expect("wait");
        }
    })
    .await
    .expect("join");
    let t = Instant::now();
    while open_fds() > before && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(open_fds() <= before, "{} descriptors still open after the clients hung up", open_fds() - before);
    assert!(t.elapsed() < Duration::from_secs(2), "freeing took {:?}", t.elapsed());
    assert_eq!(st.get("warm").await.expect("get"), Some(b"1".to_vec()));
}

/// Garbage after a valid hello closes that connection only.
#[tokio::test]
async fn tcp_store_survives_malformed_frames() {
    let srv = server(None);
    let addr = srv.local_addr();
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        // hello: op 1, version 1, empty token
        let hello = [1u8, 0, 0, 0, 1, 0, 0, 0, 0];
        s.write_all(&(hello.len() as u32).to_be_bytes()).expect("len");
        s.write_all(&hello).expect("hello");
        let mut ok = [0u8; 5];
        s.read_exact(&mut ok).expect("hello answer");
        s.write_all(&3u32.to_be_bytes()).expect("len");
        s.write_all(&[99, 1, 2]).expect("garbage");
        let mut buf = [0u8; 8];
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)), "connection should be closed");
    })
    .await
    .expect("join");
    let st = TcpStore::connect(addr.to_string(), client_opts(None)).await.expect("server still serves");
    st.set("k", b"v").await.expect("set");
    assert_eq!(st.get("k").await.expect("get"), Some(b"v".to_vec()));
}

#[tokio::test]
async fn store_wait_times_out_and_wakes() {
    for st in [Arc::new(MemoryStore::new()) as Arc<dyn Store>, {
        let srv = Box::leak(Box::new(server(None)));
        Arc::new(TcpStore::connect(srv.local_addr().to_string(), client_opts(None)).await.expect("connect"))
    }] {
        let t = Instant::now();
        let r = st.wait("never", Instant::now() + Duration::from_millis(200)).await;
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert!(t.elapsed() >= Duration::from_millis(190) && t.elapsed() < Duration::from_secs(3));
        let st2 = st.clone();
        let setter = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            st2.set("later", b"x").await
        });
        let v = st.wait("later", Instant::now() + Duration::from_secs(5)).await.expect("wake");
        assert_eq!(v, b"x");
        setter.await.expect("join").expect("set");
        assert!(st.delete("later").await.expect("delete"));
        assert!(!st.delete("later").await.expect("delete again"));
        let cas = st.compare_set("c", None, b"1").await.expect("cas");
        assert!(cas.swapped);
        let cas = st.compare_set("c", None, b"2").await.expect("cas");
        assert!(!cas.swapped && cas.current == Some(b"1".to_vec()));
    }
}

#[tokio::test]
async fn connect_generations_follow_rank_zero() {
    use anyccl_core::{abandon_generation, connect_generation, joined_generation};
    let st = MemoryStore::new();
    let soon = || Instant::now() + Duration::from_millis(200);
    // A rank that arrives before rank 0 ever started waits, then times out naming itself.
    let e = connect_generation(&st, "g", 1, "world", soon()).await.unwrap_err();
    assert!(matches!(e, Error::Timeout { rank: 1, ref group, .. } if group == "world"), "{e:?}");
    // First connect: both in generation 1.
    assert_eq!(connect_generation(&st, "g", 0, "world", soon()).await.unwrap(), 1);
    assert_eq!(connect_generation(&st, "g", 1, "world", soon()).await.unwrap(), 1);
    joined_generation(&st, "g", 1, 1).await.unwrap();
    // Rank 0 tries alone and gives up, then tries again: rank 1 skips the abandoned one.
    assert_eq!(connect_generation(&st, "g", 0, "world", soon()).await.unwrap(), 2);
    abandon_generation(&st, "g", 0, 2).await.unwrap();
    let later = tokio::spawn({
        let st = st.clone();
        async move { connect_generation(&st, "g", 1, "world", Instant::now() + Duration::from_secs(5)).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(connect_generation(&st, "g", 0, "world", soon()).await.unwrap(), 3);
    assert_eq!(later.await.unwrap().unwrap(), 3);
    // Rank 1 retrying alone (it never joined 3) still lands on rank 0's newest.
    assert_eq!(connect_generation(&st, "g", 1, "world", soon()).await.unwrap(), 3);
}

/// A store barrier names the ranks that never arrived when its deadline passes.
#[tokio::test]
async fn store_barrier_names_the_ranks_that_never_arrive() {
    let st = MemoryStore::new();
    let t = Instant::now();
    let (a, b) = tokio::join!(
        anyccl_core::store_barrier(&st, "ckpt/5", 0, 4, Instant::now() + Duration::from_millis(300)),
        anyccl_core::store_barrier(&st, "ckpt/5", 2, 4, Instant::now() + Duration::from_millis(300)),
    );
    for r in [a, b] {
        match r {
            Err(Error::Timeout { detail, .. }) => assert!(detail.contains("[1, 3]"), "{detail}"),
            other => panic!("expected a timeout naming ranks 1 and 3, got {other:?}"),
        }
    }
    assert!(t.elapsed() < Duration::from_secs(2), "took {:?}", t.elapsed());
}

/// `wait_many` returns the keys present, those set while it waits, and `None` for those
/// still absent at the deadline; with the deadline passed it only reads.
#[tokio::test]
async fn store_wait_many_gathers_present_late_and_absent_keys() {
    let srv = server(None);
    let tcp: Arc<dyn Store> =
        Arc::new(TcpStore::connect(srv.local_addr().to_string(), client_opts(None)).await.expect("connect"));
    for st in [Arc::new(MemoryStore::new()) as Arc<dyn Store>, tcp] {
        st.set("a", b"1").await.expect("set");
        let st2 = st.clone();
        let setter = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            st2.set("b", b"2").await
        });
        let keys: Vec<String> = ["a", "b", "c"].iter().map(|k| k.to_string()).collect();
        let t = Instant::now();
        // "b" is set 50 ms in; the deadline leaves a loaded machine seconds for it.
        let got = st.wait_many(&keys, Instant::now() + Duration::from_secs(2)).await.expect("wait_many");
        assert_eq!(got, vec![Some(b"1".to_vec()), Some(b"2".to_vec()), None]);
        assert!(
            t.elapsed() >= Duration::from_millis(1990) && t.elapsed() < Duration::from_secs(5),
            "{:?}",
            t.elapsed()
        );
        setter.await.expect("join").expect("set");
        let t = Instant::now();
        let got = st.wait_many(&keys, Instant::now()).await.expect("read");
        assert_eq!(got, vec![Some(b"1".to_vec()), Some(b"2".to_vec()), None]);
        assert!(t.elapsed() < Duration::from_secs(1), "a read with the deadline passed took {:?}", t.elapsed());
        assert_eq!(st.wait_many(&[], Instant::now()).await.expect("no keys"), Vec::<Option<Vec<u8>>>::new());
    }
}

/// Two thousand clients connected at once, each waiting on its own key: every write wakes
/// its own waiter, every client gets its value, and the server holds no wait afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_store_serves_two_thousand_waiting_clients() {
    const N: usize = 2000;
    let srv = server(Some("t"));
    let addr = srv.local_addr().to_string();
    let t = Instant::now();
    let mut connecting = tokio::task::JoinSet::new();
    for i in 0..N {
        let addr = addr.clone();
        connecting.spawn(async move {
            let o = TcpStoreOptions { connect_timeout: Duration::from_secs(60), ..client_opts(Some("t")) };
            (i, TcpStore::connect(addr, o).await.expect("connect"))
        });
    }
    let mut clients = Vec::new();
    while let Some(c) = connecting.join_next().await {
        clients.push(c.expect("join"));
    }
    let connected = t.elapsed();
    let mut waiting = tokio::task::JoinSet::new();
    for (i, c) in clients {
        waiting.spawn(async move {
            let v = c.wait(&format!("k/{i}"), Instant::now() + Duration::from_secs(60)).await.expect("wait");
            assert_eq!(v, i.to_string().into_bytes(), "client {i} got another key's value");
            // One more, which times out: its registration must go too.
            let r = c.wait(&format!("never/{i}"), Instant::now() + Duration::from_millis(100)).await;
            assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
            c
        });
    }
    let t = Instant::now();
    while srv.stats().waiting < N && t.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(srv.stats().waiting, N, "not every client is waiting");
    let writer = TcpStore::connect(addr, client_opts(Some("t"))).await.expect("connect");
    let t = Instant::now();
    for i in 0..N {
        writer.set(&format!("k/{i}"), i.to_string().as_bytes()).await.expect("set");
    }
    let mut kept = Vec::new();
    while let Some(c) = waiting.join_next().await {
        kept.push(c.expect("a client's wait"));
    }
    let woken = t.elapsed();
    let stats = srv.stats();
    assert_eq!(stats.waiting, 0, "waits left on the server: {stats:?}");
    assert!(stats.connections_peak > N, "{stats:?}");
    println!("{N} clients connected in {connected:?}; {N} writes woke their waiters in {woken:?}; {stats:?}");
}
