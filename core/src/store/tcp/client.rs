//! The TCP store: a small framed protocol, a server on its own thread, a pooled client.
//!
//! Every frame is a 4-byte big-endian length and a body. The length is checked against a
//! limit before anything is allocated; a malformed or oversized frame closes that
//! connection only. The first frame of a connection is a hello carrying the protocol
//! version and the shared token, compared in constant time.

use super::{wait_timeout, CasOutcome, KvCore, Store};
use crate::error::{Error, Recovery, Result};
use async_trait::async_trait;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest frame accepted by default (64 MiB).
pub const DEFAULT_MAX_FRAME: usize = 64 << 20;
/// 2 added multi-key waits (`wait_many`); the server still serves clients of 1, which
/// never send one.
const PROTOCOL_VERSION: u32 = 2;
const OLDEST_VERSION: u32 = 1;
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest hello (version and token): nothing larger is read before a client authenticates.
const MAX_HELLO_FRAME: usize = 4 << 10;
/// Connections that have not authenticated yet, at most; the server closes any more at once,
/// so idle or slow connections cannot exhaust its memory or descriptors.
const MAX_PENDING_HELLOS: usize = 256;
/// Bytes a frame's buffer grows by as its body arrives: a declared length reserves nothing.
const READ_CHUNK: usize = 64 << 10;
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

/// Settings shared by [`TcpStoreServer`] and [`TcpStore`].
#[derive(Debug, Clone)]
pub struct TcpStoreOptions {
    /// Shared secret; when the server has one, clients must present the same.
    pub token: Option<String>,
    /// Largest frame either side accepts.
    pub max_frame: usize,
    /// How long a client keeps trying to reach the server.
    pub connect_timeout: Duration,
    /// How long a client waits for the answer to a request (other than `wait`).
    pub request_timeout: Duration,
}

impl Default for TcpStoreOptions {
    fn default() -> Self {
        TcpStoreOptions {
            token: None,
            max_frame: DEFAULT_MAX_FRAME,
            connect_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(60),
        }
    }
}

impl TcpStoreOptions {
    /// Defaults with the token from `ANYCCL_STORE_TOKEN` when set, and `ANYCCL_INIT_TIMEOUT_S`
    /// (when set) bounding how long a client keeps trying to reach the server.
    ///
    /// # Errors
    /// `InvalidArgument` naming a malformed variable.
    pub fn from_env() -> Result<Self> {
        let mut o = TcpStoreOptions {
            token: std::env::var("ANYCCL_STORE_TOKEN").ok().filter(|t| !t.is_empty()),
            ..Default::default()
        };
        if let Some(d) = crate::env_secs("ANYCCL_INIT_TIMEOUT_S")? {
            o.connect_timeout = d;
        }
        Ok(o)
    }
}

#[derive(Debug)]
enum Request {
    Hello { version: u32, token: Vec<u8> },
    Set { key: String, value: Vec<u8> },
    Get { key: String },
    Wait { key: String, timeout_ms: u64 },
    Add { key: String, delta: i64 },
    Cas { key: String, expected: Option<Vec<u8>>, new: Vec<u8> },
    Delete { key: String },
    WaitMany { keys: Vec<String>, timeout_ms: u64 },
}

#[derive(Debug)]
enum Response {
    Ok,
    Found(Vec<u8>),
    NotFound,
    TimedOut,
    Int(i64),
    Bool(bool),
    Cas { swapped: bool, current: Option<Vec<u8>> },
    Many(Vec<Option<Vec<u8>>>),
    Err(String),
}

#[derive(Default)]
struct Enc(Vec<u8>);
impl Enc {
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn bytes(self, b: &[u8]) -> Self {
        let mut s = self.u32(b.len() as u32);
        s.0.extend_from_slice(b);
        s
    }
    fn opt(self, b: &Option<Vec<u8>>) -> Self {
        match b {
            None => self.u8(0),
            Some(b) => self.u8(1).bytes(b),
        }
    }
}

struct Dec<'a>(&'a [u8]);
impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| u32::from_be_bytes(b.try_into().unwrap_or_default()))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|b| u64::from_be_bytes(b.try_into().unwrap_or_default()))
    }
    fn bytes(&mut self) -> Option<Vec<u8>> {
        let n = self.u32()? as usize;
        self.take(n).map(|b| b.to_vec())
    }
    fn string(&mut self) -> Option<String> {
        String::from_utf8(self.bytes()?).ok()
    }
    fn opt(&mut self) -> Option<Option<Vec<u8>>> {
        match self.u8()? {
            0 => Some(None),
            1 => Some(Some(self.bytes()?)),
            _ => None,
        }
    }
    fn end(&self) -> Option<()> {
        self.0.is_empty().then_some(())
    }
}

impl Request {
    fn encode(&self) -> Vec<u8> {
        match self {
            Request::Hello { version, token } => Enc::default().u8(1).u32(*version).bytes(token),
            Request::Set { key, value } => Enc::default().u8(2).bytes(key.as_bytes()).bytes(value),
            Request::Get { key } => Enc::default().u8(3).bytes(key.as_bytes()),
            Request::Wait { key, timeout_ms } => Enc::default().u8(4).bytes(key.as_bytes()).u64(*timeout_ms),
            Request::Add { key, delta } => Enc::default().u8(5).bytes(key.as_bytes()).u64(*delta as u64),
            Request::Cas { key, expected, new } => Enc::default().u8(6).bytes(key.as_bytes()).opt(expected).bytes(new),
            Request::Delete { key } => Enc::default().u8(7).bytes(key.as_bytes()),
            Request::WaitMany { keys, timeout_ms } => keys
                .iter()
                .fold(Enc::default().u8(8).u32(keys.len() as u32), |e, k| e.bytes(k.as_bytes()))
                .u64(*timeout_ms),
        }
        .0
    }
    fn decode(b: &[u8]) -> Option<Request> {
        let mut d = Dec(b);
        let r = match d.u8()? {
            1 => Request::Hello { version: d.u32()?, token: d.bytes()? },
            2 => Request::Set { key: d.string()?, value: d.bytes()? },
            3 => Request::Get { key: d.string()? },
            4 => Request::Wait { key: d.string()?, timeout_ms: d.u64()? },
            5 => Request::Add { key: d.string()?, delta: d.u64()? as i64 },
            6 => Request::Cas { key: d.string()?, expected: d.opt()?, new: d.bytes()? },
            7 => Request::Delete { key: d.string()? },
            8 => {
                // Each key takes at least its 4-byte length: a count the frame cannot hold
                // reserves nothing.
                let n = d.u32()? as usize;
                if n > d.0.len() / 4 {
                    return None;
                }
                let keys = (0..n).map(|_| d.string()).collect::<Option<Vec<_>>>()?;
                Request::WaitMany { keys, timeout_ms: d.u64()? }
            }
            _ => return None,
        };
        d.end()?;
        Some(r)
    }
}

impl Response {
    fn encode(&self) -> Vec<u8> {
        match self {
            Response::Ok => Enc::default().u8(0),
            Response::Found(v) => Enc::default().u8(1).bytes(v),
            Response::NotFound => Enc::default().u8(2),
            Response::TimedOut => Enc::default().u8(3),
            Response::Int(i) => Enc::default().u8(4).u64(*i as u64),
            Response::Bool(b) => Enc::default().u8(5).u8(*b as u8),
            Response::Cas { swapped, current } => Enc::default().u8(6).u8(*swapped as u8).opt(current),
            Response::Many(vs) => vs.iter().fold(Enc::default().u8(7).u32(vs.len() as u32), |e, v| e.opt(v)),
            Response::Err(m) => Enc::default().u8(255).bytes(m.as_bytes()),
        }
        .0
    }
    fn decode(b: &[u8]) -> Option<Response> {
        let mut d = Dec(b);
        let r = match d.u8()? {
            0 => Response::Ok,
            1 => Response::Found(d.bytes()?),
            2 => Response::NotFound,
            3 => Response::TimedOut,
            4 => Response::Int(d.u64()? as i64),
            5 => Response::Bool(d.u8()? != 0),
            6 => Response::Cas { swapped: d.u8()? != 0, current: d.opt()? },
            7 => {
                let n = d.u32()? as usize;
                if n > d.0.len() {
                    return None;
                }
                Response::Many((0..n).map(|_| d.opt()).collect::<Option<Vec<_>>>()?)
            }
            255 => Response::Err(d.string()?),
            _ => return None,
        };
        d.end()?;
        Some(r)
    }
}

async fn read_frame(s: &mut TcpStream, max: usize) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match s.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let n = u32::from_be_bytes(len) as usize;
    if n > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {n} bytes exceeds the {max}-byte limit"),
        ));
    }
    // Grow with what arrives, so a peer that declares a large frame and sends nothing holds
    // no memory.
    let mut body = Vec::with_capacity(n.min(READ_CHUNK));
    (&mut *s).take(n as u64).read_to_end(&mut body).await?;
    if body.len() != n {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some(body))
}

async fn write_frame(s: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(body);
    s.write_all(&buf).await
}

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

/// A TCP store server running on its own thread until dropped.
#[derive(Debug)]
pub struct TcpStoreServer {
    addr: SocketAddr,
    stats: Arc<Stats>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
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
        let listener = std::net::TcpListener::bind(bind)
            .map_err(|e| Error::store_fatal(format!("cannot bind store server on {bind}: {e}")))?;
        let addr = listener.local_addr().map_err(|e| Error::store_fatal(e.to_string()))?;
        listener.set_nonblocking(true).map_err(|e| Error::store_fatal(e.to_string()))?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let stats = Arc::new(Stats::default());
        let counts = stats.clone();
        let thread = std::thread::Builder::new()
            .name(format!("anyccl-store-{}", addr.port()))
            .spawn(move || serve(listener, opts, stopped, counts))
            .map_err(|e| Error::store_fatal(format!("cannot start store thread: {e}")))?;
        Ok(TcpStoreServer { addr, stats, stop: Some(stop), thread: Some(thread) })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// What it has served so far.
    pub fn stats(&self) -> StoreStats {
        let s = &self.stats;
        StoreStats {
            connections: s.connections.load(Ordering::Acquire),
            connections_peak: s.peak.load(Ordering::Acquire),
            requests: s.requests.load(Ordering::Acquire),
            waiting: s.waiting.load(Ordering::Acquire),
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

fn serve(
    listener: std::net::TcpListener,
    opts: TcpStoreOptions,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
    stats: Arc<Stats>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("store server cannot start a runtime: {e}");
            return;
        }
    };
    rt.block_on(async move {
        let listener = match tokio::net::TcpListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("store server listener: {e}");
                return;
            }
        };
        let core = Arc::new(KvCore::default());
        let opts = Arc::new(opts);
        let pending = Arc::new(AtomicUsize::new(0));
        loop {
            tokio::select! {
                _ = &mut stopped => break,
                acc = listener.accept() => match acc {
                    Ok((s, peer)) => {
                        if pending.fetch_add(1, Ordering::AcqRel) >= MAX_PENDING_HELLOS {
                            pending.fetch_sub(1, Ordering::AcqRel);
                            tracing::warn!("store: {MAX_PENDING_HELLOS} connections await authentication; closed {peer}");
                            continue;
                        }
                        let _ = s.set_nodelay(true);
                        let (core, opts, stats) = (core.clone(), opts.clone(), stats.clone());
                        let hello = Pending(pending.clone());
                        tokio::spawn(async move {
                            let open = Held::new(&stats.connections);
                            stats.peak.fetch_max(stats.connections.load(Ordering::Acquire), Ordering::AcqRel);
                            let served = serve_conn(s, &core, &opts, hello, &stats).await;
                            drop(open);
                            if let Err(e) = served {
                                tracing::debug!("store connection from {peer} closed: {e}");
                            }
                        });
                    }
                    Err(e) => {
                        tracing::warn!("store accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
        }
    });
}

/// One connection counted as awaiting authentication until dropped.
struct Pending(Arc<AtomicUsize>);
impl Drop for Pending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
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

async fn serve_conn(
    mut s: TcpStream,
    core: &KvCore,
    opts: &TcpStoreOptions,
    pending: Pending,
    stats: &Stats,
) -> std::result::Result<(), String> {
    let hello = tokio::time::timeout(HELLO_TIMEOUT, read_frame(&mut s, MAX_HELLO_FRAME.min(opts.max_frame)))
        .await
        .map_err(|_| "no hello within 10 s".to_string())?
        .map_err(|e| e.to_string())?
        .ok_or("closed before hello")?;
    match Request::decode(&hello) {
        Some(Request::Hello { version, token }) => {
            if !(OLDEST_VERSION..=PROTOCOL_VERSION).contains(&version) {
                let msg = format!(
                    "protocol version {version} not supported (server speaks {OLDEST_VERSION} to {PROTOCOL_VERSION})"
                );
                let _ = write_frame(&mut s, &Response::Err(msg.clone()).encode()).await;
                return Err(msg);
            }
            if let Some(t) = &opts.token {
                if !constant_time_eq::constant_time_eq(t.as_bytes(), &token) {
                    let msg = "authentication failed: wrong store token".to_string();
                    let _ = write_frame(&mut s, &Response::Err(msg.clone()).encode()).await;
                    return Err(msg);
                }
            }
            write_frame(&mut s, &Response::Ok.encode()).await.map_err(|e| e.to_string())?;
        }
        _ => return Err("first frame is not a hello".into()),
    }
    drop(pending);
    loop {
        let Some(frame) = read_frame(&mut s, opts.max_frame).await.map_err(|e| e.to_string())? else {
            return Ok(());
        };
        let req = Request::decode(&frame).ok_or("malformed request")?;
        let waiting = matches!(req, Request::Wait { .. } | Request::WaitMany { .. }).then(|| Held::new(&stats.waiting));
        let resp = match req {
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
            Request::Wait { key, timeout_ms } => {
                match until_hung_up(&s, core.wait(&key, wait_end(timeout_ms))).await? {
                    Ok(Some(v)) => Response::Found(v),
                    Ok(None) => Response::TimedOut,
                    Err(e) => Response::Err(e.to_string()),
                }
            }
            Request::WaitMany { keys, timeout_ms } => {
                match until_hung_up(&s, core.wait_many(&keys, wait_end(timeout_ms))).await? {
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
        };
        drop(waiting);
        stats.requests.fetch_add(1, Ordering::Relaxed);
        write_frame(&mut s, &resp.encode()).await.map_err(|e| e.to_string())?;
    }
}

/// A client of a [`TcpStoreServer`]. Requests from concurrent tasks use separate pooled
/// connections, so a long `wait` never holds up another request.
#[derive(Debug)]
pub struct TcpStore {
    addr: String,
    opts: TcpStoreOptions,
    /// Idle connections, each with the thread that opened it: a connection is reused only
    /// on that thread, since its socket belongs to the I/O driver of the runtime that thread
    /// runs (another runtime's thread may block while that driver is not running).
    pool: Mutex<Vec<(std::thread::ThreadId, TcpStream)>>,
}

impl TcpStore {
    /// Connect to the server at `addr` (`host:port`), retrying until `opts.connect_timeout`.
    ///
    /// # Errors
    /// `Store` when the server cannot be reached in time or refuses the token.
    pub async fn connect(addr: impl Into<String>, opts: TcpStoreOptions) -> Result<Self> {
        let st = TcpStore { addr: addr.into(), opts, pool: Mutex::new(Vec::new()) };
        let c = st.open().await?;
        st.give_back(c);
        Ok(st)
    }

    /// A new authenticated connection. Failures to reach the server, or a server that closes
    /// the connection before answering the hello (it is busy with connections that have
    /// not authenticated), are retried until `opts.connect_timeout`; a refusal is final.
    async fn open(&self) -> Result<TcpStream> {
        let deadline = crate::deadline_in(self.opts.connect_timeout);
        let mut pause = Duration::from_millis(10);
        loop {
            // Name resolution happens inside connect and may itself hang: bounded too.
            let err = match tokio::time::timeout_at(deadline.into(), TcpStream::connect(&self.addr)).await {
                Err(_) => "no connection in time".to_string(),
                Ok(Ok(mut s)) => {
                    let _ = s.set_nodelay(true);
                    let token = self.opts.token.clone().unwrap_or_default().into_bytes();
                    let hello = Request::Hello { version: PROTOCOL_VERSION, token };
                    match self.exchange(&mut s, &hello, Instant::now() + HELLO_TIMEOUT).await {
                        Ok(Response::Ok) => return Ok(s),
                        Ok(Response::Err(m)) => {
                            return Err(Error::store_fatal(format!(
                                "store at {} refused the connection: {m}",
                                self.addr
                            )))
                        }
                        Ok(r) => return Err(Error::store_fatal(format!("unexpected hello answer {r:?}"))),
                        Err(e) if e.recovery() == Recovery::Fatal => return Err(e),
                        Err(e) => e.to_string(),
                    }
                }
                Ok(Err(e)) => e.to_string(),
            };
            if Instant::now() + pause > deadline {
                return Err(Error::store(format!(
                    "cannot reach the store at {} within {:?}: {err}",
                    self.addr, self.opts.connect_timeout
                )));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    fn give_back(&self, s: TcpStream) {
        if let Ok(mut p) = self.pool.lock() {
            p.push((std::thread::current().id(), s));
        }
    }

    async fn exchange(&self, s: &mut TcpStream, req: &Request, deadline: Instant) -> Result<Response> {
        let io = async {
            write_frame(s, &req.encode()).await?;
            read_frame(s, self.opts.max_frame).await
        };
        match tokio::time::timeout_at(deadline.into(), io).await {
            Err(_) => Err(Error::store(format!("no answer from the store at {} in time", self.addr))),
            Ok(Err(e)) => Err(Error::store(format!("store connection to {} failed: {e}", self.addr))),
            Ok(Ok(None)) => Err(Error::store(format!("store at {} closed the connection", self.addr))),
            Ok(Ok(Some(b))) => Response::decode(&b)
                .ok_or_else(|| Error::store_fatal(format!("malformed answer from the store at {}", self.addr))),
        }
    }

    async fn call(&self, req: Request, deadline: Instant) -> Result<Response> {
        let me = std::thread::current().id();
        let pooled = self.pool.lock().ok().and_then(|mut p| {
            let i = p.iter().rposition(|(t, _)| *t == me)?;
            Some(p.swap_remove(i).1)
        });
        let mut s = match pooled {
            Some(s) => s,
            None => self.open().await?,
        };
        let r = self.exchange(&mut s, &req, deadline).await?;
        self.give_back(s);
        if let Response::Err(m) = r {
            return Err(Error::store_fatal(format!("store at {}: {m}", self.addr)));
        }
        Ok(r)
    }

    fn std_deadline(&self) -> Instant {
        crate::deadline_in(self.opts.request_timeout)
    }
}

fn unexpected(r: Response) -> Error {
    Error::store_fatal(format!("unexpected store answer {r:?}"))
}

#[async_trait]
impl Store for TcpStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        match self.call(Request::Set { key: key.into(), value: value.to_vec() }, self.std_deadline()).await? {
            Response::Ok => Ok(()),
            r => Err(unexpected(r)),
        }
    }
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match self.call(Request::Get { key: key.into() }, self.std_deadline()).await? {
            Response::Found(v) => Ok(Some(v)),
            Response::NotFound => Ok(None),
            r => Err(unexpected(r)),
        }
    }
    async fn wait(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        let started = Instant::now();
        let timeout_ms = deadline.saturating_duration_since(started).as_millis() as u64;
        let req = Request::Wait { key: key.into(), timeout_ms };
        match self.call(req, deadline.checked_add(Duration::from_secs(5)).unwrap_or(deadline)).await? {
            Response::Found(v) => Ok(v),
            Response::TimedOut => Err(wait_timeout(key, started)),
            r => Err(unexpected(r)),
        }
    }
    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        match self.call(Request::Add { key: key.into(), delta }, self.std_deadline()).await? {
            Response::Int(v) => Ok(v),
            r => Err(unexpected(r)),
        }
    }
    async fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
        let req = Request::Cas { key: key.into(), expected: expected.map(|e| e.to_vec()), new: new.to_vec() };
        match self.call(req, self.std_deadline()).await? {
            Response::Cas { swapped, current } => Ok(CasOutcome { swapped, current }),
            r => Err(unexpected(r)),
        }
    }
    async fn delete(&self, key: &str) -> Result<bool> {
        match self.call(Request::Delete { key: key.into() }, self.std_deadline()).await? {
            Response::Bool(b) => Ok(b),
            r => Err(unexpected(r)),
        }
    }
    async fn wait_many(&self, keys: &[String], deadline: Instant) -> Result<Vec<Option<Vec<u8>>>> {
        let timeout_ms = deadline.saturating_duration_since(Instant::now()).as_millis() as u64;
        let req = Request::WaitMany { keys: keys.to_vec(), timeout_ms };
        // The answer may be large: allow its transfer past the deadline as for other requests.
        let answer_by = deadline.max(self.std_deadline());
        match self.call(req, answer_by.checked_add(Duration::from_secs(5)).unwrap_or(answer_by)).await? {
            Response::Many(vs) if vs.len() == keys.len() => Ok(vs),
            r => Err(unexpected(r)),
        }
    }
}
