//! The client: a pool of authenticated connections, one request at a time on each.

use super::options::TcpStoreOptions;
use super::wire::{read_frame, write_frame, Request, Response, PROTOCOL_VERSION};
use crate::error::{Error, Recovery, Result};
use crate::store::{wait_timeout, CasOutcome, Store};
use async_trait::async_trait;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

/// How long a client waits for the answer to its hello.
const HELLO_ANSWER: Duration = Duration::from_secs(10);

/// A client of a [`super::TcpStoreServer`]. Requests from concurrent tasks use separate
/// pooled connections, so a long `wait` never holds up another request.
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
            let failed = match tokio::time::timeout_at(deadline.into(), TcpStream::connect(&self.addr)).await {
                Err(_) => Error::store("no connection in time"),
                Ok(Ok(mut s)) => {
                    let _ = s.set_nodelay(true);
                    let token = self.opts.token.clone().unwrap_or_default().into_bytes();
                    let hello = Request::Hello { version: PROTOCOL_VERSION, token };
                    match self.exchange(&mut s, &hello, Instant::now() + HELLO_ANSWER).await {
                        Ok(Response::Ok) => return Ok(s),
                        Ok(Response::Err(m)) => {
                            return Err(Error::store_fatal(format!(
                                "store at {} refused the connection: {m}",
                                self.addr
                            )))
                        }
                        Ok(r) => return Err(Error::store_fatal(format!("unexpected hello answer {r:?}"))),
                        Err(e) if e.recovery() == Recovery::Fatal => return Err(e),
                        Err(e) => e,
                    }
                }
                Ok(Err(e)) => Error::store(e.to_string()).with_source(e),
            };
            if Instant::now() + pause > deadline {
                let why = match &failed {
                    Error::Store { msg, .. } => msg.clone(),
                    other => other.to_string(),
                };
                return Err(Error::store(format!(
                    "cannot reach the store at {} within {:?}: {why}",
                    self.addr, self.opts.connect_timeout
                ))
                .with_source(failed));
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
            Ok(Err(e)) => Err(Error::store(format!("store connection to {} failed: {e}", self.addr)).with_source(e)),
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
    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        if prefix.is_empty() {
            return Err(crate::store::empty_prefix());
        }
        match self.call(Request::DeletePrefix { prefix: prefix.into() }, self.std_deadline()).await? {
            Response::Int(n) => Ok(n.max(0) as u64),
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
