//! TCP store limits against hostile clients, scaled down (settings) to run in seconds: a
//! flood of silent connections must not keep a real rank out, and partial frames from
//! authenticated clients must not make the server hold more than its byte budget.

use anyccl_core::{Store, TcpStore, TcpStoreOptions, TcpStoreServer};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The cases measure time and memory: one at a time, each on a runtime of its own.
fn one_at_a_time(case: impl std::future::Future<Output = ()>) {
    static ONE: Mutex<()> = Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(case);
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_be_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

/// A hello of protocol version 2 with `token`.
fn hello(token: &str) -> Vec<u8> {
    let mut b = vec![1u8, 0, 0, 0, 2];
    b.extend_from_slice(&(token.len() as u32).to_be_bytes());
    b.extend_from_slice(token.as_bytes());
    frame(&b)
}

/// Connections that connect and say nothing, `n` of them, each reopened as soon as the
/// server closes it, until `stop`; how many were opened in all.
fn flood(addr: SocketAddr, n: usize, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut socks: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        let mut opened = 0;
        while !stop.load(Ordering::Relaxed) {
            for s in socks.iter_mut() {
                let closed = match s {
                    None => true,
                    Some(t) => match t.read(&mut [0u8; 1]) {
                        Ok(0) => true,
                        Ok(_) => false,
                        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                    },
                };
                if closed {
                    *s = TcpStream::connect(addr).ok().filter(|t| t.set_nonblocking(true).is_ok());
                    opened += 1;
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        opened
    })
}

/// Silent connections, reopened as the server drops them and twice as many as the server
/// lets await their hello, do not keep a real rank out: each connect gets in within a
/// second, and a client that sends its hello once without retrying is answered, alone or
/// with as many others as half the queue at once.
#[test]
fn tcp_store_lets_a_rank_in_under_a_flood_of_silent_connections() {
    one_at_a_time(flooded());
}

async fn flooded() {
    const PENDING: usize = 20;
    let opts = TcpStoreOptions {
        token: Some("tok".into()),
        max_pending: PENDING,
        hello_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let srv = TcpStoreServer::start(([127, 0, 0, 1], 0).into(), opts.clone()).expect("start server");
    let addr = srv.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let flooder = flood(addr, 2 * PENDING, stop.clone());
    // The flood is on (the queue of connections awaiting hello is full and churning) before
    // the first rank comes.
    let t = Instant::now();
    while srv.stats().hellos_evicted == 0 && t.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let client_opts = TcpStoreOptions { connect_timeout: Duration::from_secs(10), ..opts };
    let mut took = Vec::new();
    for i in 0..5 {
        let t = Instant::now();
        let st = TcpStore::connect(addr.to_string(), client_opts.clone()).await.expect("connect under the flood");
        took.push(t.elapsed());
        st.set(&format!("k{i}"), b"v").await.expect("set");
        assert_eq!(st.get(&format!("k{i}")).await.expect("get"), Some(b"v".to_vec()));
    }
    let once = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(&hello("tok"))?;
        let mut answer = [0u8; 5];
        s.read_exact(&mut answer).map(|_| answer)
    })
    .await
    .expect("join");
    // Half as many such clients as the queue holds, all at once: each is answered.
    let burst = tokio::task::spawn_blocking(move || {
        let once = move || -> std::io::Result<[u8; 5]> {
            let mut s = TcpStream::connect(addr)?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            s.write_all(&hello("tok"))?;
            let mut answer = [0u8; 5];
            s.read_exact(&mut answer).map(|_| answer)
        };
        let all: Vec<_> = (0..PENDING / 2).map(|_| std::thread::spawn(once)).collect();
        all.into_iter().map(|t| t.join().expect("client thread")).collect::<Vec<_>>()
    })
    .await
    .expect("join");
    stop.store(true, Ordering::Relaxed);
    let opened = tokio::task::spawn_blocking(move || flooder.join().expect("flooder")).await.expect("join");
    let stats = srv.stats();
    println!("under a flood of {opened} silent connections: ranks got in after {took:?}; {stats:?}");
    assert!(matches!(once, Ok([0, 0, 0, 1, 0])), "a client that does not retry was not answered: {once:?}");
    let unanswered: Vec<_> = burst.iter().filter(|a| !matches!(a, Ok([0, 0, 0, 1, 0]))).collect();
    assert!(unanswered.is_empty(), "of {} clients saying hello at once, not answered: {unanswered:?}", PENDING / 2);
    assert!(stats.hellos_evicted > 0, "the flood never filled the queue of connections awaiting hello: {stats:?}");
    for (i, t) in took.iter().enumerate() {
        assert!(*t < Duration::from_secs(1), "rank {i} took {t:?} to get in under the flood");
    }
}

/// The peak resident memory of this process, in KiB.
fn resident_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim().parse().ok()))
        .unwrap_or(0)
}

/// 64 authenticated clients each send 7/8 of a frame of almost 1 MiB and stop: with a
/// 1 MiB budget the server reads one such frame at a time (the others' bytes stay in the
/// kernel, their clients held back), still answers a rank's small requests at once, and
/// holds nothing once they leave.
#[test]
fn tcp_store_caps_what_partial_frames_hold() {
    one_at_a_time(partial_frames());
}

async fn partial_frames() {
    const CAP: usize = 1 << 20;
    const CLIENTS: usize = 64;
    let opts = TcpStoreOptions {
        token: Some("tok".into()),
        max_frame: CAP,
        max_buffered: CAP,
        connect_timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let srv = TcpStoreServer::start(([127, 0, 0, 1], 0).into(), opts.clone()).expect("start server");
    let addr = srv.local_addr();
    let st = TcpStore::connect(addr.to_string(), opts.clone()).await.expect("connect");
    st.set("warm", b"1").await.expect("set");
    let before = resident_kib();
    let socks = tokio::task::spawn_blocking(move || {
        (0..CLIENTS)
            .map(|_| {
                let mut s = TcpStream::connect(addr).expect("connect");
                s.write_all(&hello("tok")).expect("hello");
                s.read_exact(&mut [0u8; 5]).expect("hello answer");
                // set: op 2, a key, and a value that makes the frame CAP - 1 bytes long
                let n = CAP - 1;
                let mut head = (n as u32).to_be_bytes().to_vec();
                head.extend_from_slice(&[2, 0, 0, 0, 1, b'k']);
                head.extend_from_slice(&((n - 10) as u32).to_be_bytes());
                s.write_all(&head).expect("frame head");
                s.write_all(&vec![7u8; n * 7 / 8]).expect("part of the frame");
                s
            })
            .collect::<Vec<_>>()
    })
    .await
    .expect("join");
    // Time for the server to read what it will.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let grown = resident_kib().saturating_sub(before);
    let t = Instant::now();
    st.set("small", b"x").await.expect("a small request while the budget is held");
    assert_eq!(st.get("small").await.expect("get"), Some(b"x".to_vec()));
    let small = t.elapsed();
    let held = srv.stats();
    drop(socks);
    let t = Instant::now();
    while srv.stats().buffered > 0 && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = srv.stats();
    println!(
        "{CLIENTS} partial frames of {} KiB: this process grew by {} MiB; a small set and get took {small:?}; {held:?}",
        CAP >> 10,
        grown >> 10
    );
    assert!(grown < 16 << 10, "the server grew by {} MiB for {CLIENTS} partial frames", grown >> 10);
    assert!(
        held.buffered_peak <= CAP + (64 << 10),
        "held {} bytes at once, over the {CAP}-byte cap",
        held.buffered_peak
    );
    assert!(small < Duration::from_secs(1), "a small request took {small:?} while large frames waited");
    assert_eq!(after.buffered, 0, "bytes still held after the clients left: {after:?}");
}
