//! The server: one thread with its own runtime, a task per connection. A connection first
//! waits in the queue of those owing their hello ([`Hellos`]), then serves one request at a
//! time, each frame taking room under the server's byte budget ([`Budget`]) before its body
//! is read.

use super::limits::{Budget, HelloSlot, Hellos};
use super::options::TcpStoreOptions;
use super::wire::{
    read_body, read_frame, read_len, write_frame, Request, Response, MAX_HELLO_FRAME, OLDEST_VERSION, PROTOCOL_VERSION,
};
use crate::error::{Error, Result};
use crate::store::KvCore;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// Connections the kernel queues before the server accepts them: a launcher's 4096 ranks
/// may connect at once (the kernel caps it at `net.core.somaxconn`).
const BACKLOG: u32 = 4096;
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

/// What a [`TcpStoreServer`] has served so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Connections open now (authenticated or not).
    pub connections: usize,
    /// The most open at once.
    pub connections_peak: usize,
    /// Requests answered (hellos excluded).
    pub requests: u64,
    /// Waits (`wait`, `wait_many`) in progress now.
    pub waiting: usize,
    /// Bytes held now in frames being read and answers being written.
    pub buffered: usize,
    /// The most bytes held at once in frames and answers.
    pub buffered_peak: usize,
    /// Connections closed before their hello to make room for newer ones.
    pub hellos_evicted: u64,
}

#[derive(Debug, Default)]
struct Stats {
    connections: AtomicUsize,
    peak: AtomicUsize,
    requests: AtomicU64,
    waiting: AtomicUsize,
}

/// One count held while this value lives.
struct Held<'a>(&'a AtomicUsize);
impl<'a> Held<'a> {
    fn new(c: &'a AtomicUsize) -> Self {
        c.fetch_add(1, Ordering::AcqRel);
        Held(c)
    }
}
impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What every connection of one server shares.
#[derive(Debug)]
struct Shared {
    core: KvCore,
    opts: TcpStoreOptions,
    stats: Stats,
    hellos: Arc<Hellos>,
    budget: Budget,
}

/// A TCP store server running on its own thread until dropped.
#[derive(Debug)]
pub struct TcpStoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A listener on `bind` with a backlog for a whole launch (the standard library's is 128).
fn listen(bind: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if bind.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    // As the standard library's listeners do: a restarted server rebinds its port at once.
    socket.set_reuseaddr(true)?;
    socket.bind(bind)?;
    socket.listen(BACKLOG)
}

impl TcpStoreServer {
    /// Bind `bind` (use `127.0.0.1:0` for a free loopback port) and serve until dropped.
    ///
    /// # Examples
    /// ```
    /// use anyccl_core::{Store, TcpStore, TcpStoreOptions, TcpStoreServer};
    /// use std::time::{Duration, Instant};
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt").block_on(async {
    /// let opts = TcpStoreOptions { token: Some("s3cret".into()), ..Default::default() };
    /// let server = TcpStoreServer::start(([127, 0, 0, 1], 0).into(), opts.clone())?;
    /// let client = TcpStore::connect(server.local_addr().to_string(), opts).await?;
    /// client.set("ready", b"1").await?;
    /// assert_eq!(client.wait("ready", Instant::now() + Duration::from_secs(5)).await?, b"1");
    /// assert_eq!(client.add("count", 2).await?, 2);
    /// # Ok::<(), anyccl_core::Error>(()) }).expect("store");
    /// ```
    ///
    /// # Errors
    /// `Store` when the address cannot be bound or the thread cannot start.
    pub fn start(bind: SocketAddr, opts: TcpStoreOptions) -> Result<Self> {
        let failed = |what: String, e: std::io::Error| Error::store_fatal(format!("{what}: {e}")).with_source(e);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| failed("cannot start the store server's runtime".into(), e))?;
        let listener = {
            let _in_runtime = rt.enter();
            listen(bind).map_err(|e| failed(format!("cannot bind store server on {bind}"), e))?
        };
        let addr = listener.local_addr().map_err(|e| failed(format!("store server on {bind}"), e))?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let shared = Arc::new(Shared {
            core: KvCore::default(),
            hellos: Arc::new(Hellos::new(opts.max_pending)),
            budget: Budget::new(opts.max_buffered),
            stats: Stats::default(),
            opts,
        });
        let serving = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("anyccl-store-{}", addr.port()))
            .spawn(move || rt.block_on(serve(listener, serving, stopped)))
            .map_err(|e| failed("cannot start store thread".into(), e))?;
        Ok(TcpStoreServer { addr, shared, stop: Some(stop), thread: Some(thread) })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// What it has served so far.
    pub fn stats(&self) -> StoreStats {
        let s = &self.shared.stats;
        StoreStats {
            connections: s.connections.load(Ordering::Acquire),
            connections_peak: s.peak.load(Ordering::Acquire),
            requests: s.requests.load(Ordering::Acquire),
            waiting: s.waiting.load(Ordering::Acquire),
            buffered: self.shared.budget.held(),
            buffered_peak: self.shared.budget.peak.load(Ordering::Relaxed),
            hellos_evicted: self.shared.hellos.evicted(),
        }
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn serve(listener: TcpListener, shared: Arc<Shared>, mut stopped: tokio::sync::oneshot::Receiver<()>) {
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            acc = listener.accept() => match acc {
                Ok((s, peer)) => {
                    let _ = s.set_nodelay(true);
                    let slot = shared.hellos.admit();
                    let shared = shared.clone();
                    tokio::spawn(async move {
                        let stats = &shared.stats;
                        let open = Held::new(&stats.connections);
                        stats.peak.fetch_max(stats.connections.load(Ordering::Acquire), Ordering::AcqRel);
                        let served = serve_conn(s, &shared, slot).await;
                        drop(open);
                        if let Err(e) = served {
                            tracing::debug!("store connection from {peer} closed: {e}");
                        }
                    });
                    // The new connection reads before the next is accepted: a client whose
                    // hello came with its connection leaves the hello queue before a burst of
                    // newer connections could push it out.
                    tokio::task::yield_now().await;
                }
                Err(e) => {
                    tracing::warn!("store accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }
}

/// Resolves when the client of a connection that owes no request hangs up (or sends one
/// anyway, which this protocol does not allow during a wait).
async fn hung_up(s: &TcpStream) -> String {
    let mut b = [0u8; 1];
    match s.peek(&mut b).await {
        Ok(0) => "client hung up during a wait".into(),
        Ok(_) => "client sent a request during a wait".into(),
        Err(e) => format!("connection failed during a wait: {e}"),
    }
}

/// When a wait of `timeout_ms` ends.
fn wait_end(timeout_ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(timeout_ms).min(MAX_WAIT)
}

/// `wait`'s result, or why the connection ended first (its client hung up).
async fn until_hung_up<T>(s: &TcpStream, wait: impl std::future::Future<Output = T>) -> std::result::Result<T, String> {
    tokio::select! {
        r = wait => Ok(r),
        why = hung_up(s) => Err(why),
    }
}

/// Read and check the hello, within `hello_timeout`, unless the connection is closed first
/// to make room for newer ones. A connection told to close whose client has already sent
/// bytes (the task had not got to them) stays, as one that has spoken.
async fn hello(s: &mut TcpStream, sh: &Shared, slot: &HelloSlot) -> std::result::Result<(), String> {
    const EVICTED: &str = "closed before its hello, to make room for newer connections";
    let opts = &sh.opts;
    let late = || format!("no hello within {:?}", opts.hello_timeout);
    let end = tokio::time::Instant::now() + opts.hello_timeout;
    let newcomer = slot.newcomer.clone();
    let mut first = [0u8];
    // Until the first bytes: a connection is "spoken" only once bytes are in its socket, and
    // an eviction is checked against what the socket holds.
    loop {
        tokio::select! {
            _ = newcomer.evicted() => {
                let mut b = [std::mem::MaybeUninit::<u8>::uninit()];
                let waiting = socket2::SockRef::from(&*s).peek(&mut b).is_ok_and(|n| n > 0);
                if !(waiting && slot.requeue_spoken()) {
                    return Err(EVICTED.into());
                }
            }
            // Not `readable`, which may report a socket ready with nothing in it.
            r = s.peek(&mut first) => match r {
                Ok(0) => return Err("closed before hello".into()),
                Ok(_) => break,
                Err(e) => return Err(e.to_string()),
            },
            _ = tokio::time::sleep_until(end) => return Err(late()),
        }
    }
    newcomer.spoke();
    let frame = {
        let read = tokio::time::timeout_at(end, read_frame(s, MAX_HELLO_FRAME.min(opts.max_frame)));
        tokio::pin!(read);
        loop {
            tokio::select! {
                _ = newcomer.evicted() => if !slot.requeue_spoken() {
                    return Err(EVICTED.into());
                },
                r = &mut read => break r.map_err(|_| late())?.map_err(|e| e.to_string())?.ok_or("closed before hello")?,
            }
        }
    };
    let Some(Request::Hello { version, token }) = Request::decode(&frame) else {
        return Err("first frame is not a hello".into());
    };
    let refused = if !(OLDEST_VERSION..=PROTOCOL_VERSION).contains(&version) {
        Some(format!("protocol version {version} not supported (server speaks {OLDEST_VERSION} to {PROTOCOL_VERSION})"))
    } else if opts.token.as_ref().is_some_and(|t| !constant_time_eq::constant_time_eq(t.as_bytes(), &token)) {
        Some("authentication failed: wrong store token".to_string())
    } else {
        None
    };
    if let Some(msg) = refused {
        let _ = write_frame(s, &Response::Err(msg.clone()).encode()).await;
        return Err(msg);
    }
    write_frame(s, &Response::Ok.encode()).await.map_err(|e| e.to_string())
}

/// The answer to one request.
async fn answer(s: &TcpStream, core: &KvCore, req: Request) -> std::result::Result<Response, String> {
    Ok(match req {
        Request::Hello { .. } => Response::Err("hello sent twice".into()),
        Request::Set { key, value } => {
            core.set(&key, &value).map(|_| Response::Ok).unwrap_or_else(|e| Response::Err(e.to_string()))
        }
        Request::Get { key } => match core.get(&key) {
            Ok(Some(v)) => Response::Found(v),
            Ok(None) => Response::NotFound,
            Err(e) => Response::Err(e.to_string()),
        },
        // A client that gives up on its wait frees the connection at once.
        Request::Wait { key, timeout_ms } => match until_hung_up(s, core.wait(&key, wait_end(timeout_ms))).await? {
            Ok(Some(v)) => Response::Found(v),
            Ok(None) => Response::TimedOut,
            Err(e) => Response::Err(e.to_string()),
        },
        Request::WaitMany { keys, timeout_ms } => {
            match until_hung_up(s, core.wait_many(&keys, wait_end(timeout_ms))).await? {
                Ok(vs) => Response::Many(vs),
                Err(e) => Response::Err(e.to_string()),
            }
        }
        Request::Add { key, delta } => {
            core.add(&key, delta).map(Response::Int).unwrap_or_else(|e| Response::Err(e.to_string()))
        }
        Request::Cas { key, expected, new } => match core.compare_set(&key, expected.as_deref(), &new) {
            Ok(o) => Response::Cas { swapped: o.swapped, current: o.current },
            Err(e) => Response::Err(e.to_string()),
        },
        Request::Delete { key } => {
            core.delete(&key).map(Response::Bool).unwrap_or_else(|e| Response::Err(e.to_string()))
        }
        Request::DeletePrefix { prefix } => core
            .delete_prefix(&prefix)
            .map(|n| Response::Int(n as i64))
            .unwrap_or_else(|e| Response::Err(e.to_string())),
    })
}

async fn serve_conn(mut s: TcpStream, sh: &Shared, slot: HelloSlot) -> std::result::Result<(), String> {
    hello(&mut s, sh, &slot).await?;
    drop(slot);
    let opts = &sh.opts;
    loop {
        let Some(n) = read_len(&mut s, opts.max_frame).await.map_err(|e| e.to_string())? else {
            return Ok(());
        };
        // Room first, then the body: a frame that waits holds nothing but its socket, whose
        // client the kernel then holds back.
        let until = crate::deadline_in(opts.request_timeout);
        let held = sh.budget.take(n, until).await.ok_or_else(|| {
            format!(
                "no room for a frame of {n} bytes within {:?} ({} bytes held by all connections, limit {})",
                opts.request_timeout,
                sh.budget.held(),
                opts.max_buffered
            )
        })?;
        let frame = tokio::time::timeout_at(until.into(), read_body(&mut s, n))
            .await
            .map_err(|_| format!("the rest of a frame of {n} bytes did not come within {:?}", opts.request_timeout))?
            .map_err(|e| e.to_string())?;
        let req = Request::decode(&frame).ok_or("malformed request")?;
        drop(frame);
        let waits = matches!(req, Request::Wait { .. } | Request::WaitMany { .. });
        let waiting = waits.then(|| Held::new(&sh.stats.waiting));
        // A wait may last long: its frame's room goes back before it starts.
        let held = (!waits).then_some(held);
        let resp = answer(&s, &sh.core, req).await?;
        drop((waiting, held));
        sh.stats.requests.fetch_add(1, Ordering::Relaxed);
        let mut body = resp.encode();
        drop(resp);
        if body.len() > opts.max_frame {
            let msg = format!("the answer of {} bytes exceeds the {}-byte frame limit", body.len(), opts.max_frame);
            body = Response::Err(msg).encode();
        }
        // An answer is built already: it counts while it is written, without waiting.
        let held = sh.budget.force(body.len());
        tokio::time::timeout_at(crate::deadline_in(opts.request_timeout).into(), write_frame(&mut s, &body))
            .await
            .map_err(|_| format!("the client did not take its answer within {:?}", opts.request_timeout))?
            .map_err(|e| e.to_string())?;
        drop(held);
    }
}
