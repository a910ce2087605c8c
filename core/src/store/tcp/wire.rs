//! The wire: every frame is a 4-byte big-endian length and a body. A length is checked
//! against a limit before anything is allocated, and a body's buffer grows with what
//! arrives, so a peer that announces a large frame and sends nothing holds no memory. The
//! first frame of a connection is a hello carrying the protocol version and the shared token.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// 2 added multi-key waits (`wait_many`); the server still serves clients of 1, which
/// never send one.
pub(super) const PROTOCOL_VERSION: u32 = 2;
pub(super) const OLDEST_VERSION: u32 = 1;
/// Largest hello (version and token): nothing larger is read before a client authenticates.
pub(super) const MAX_HELLO_FRAME: usize = 4 << 10;
/// Bytes a frame's buffer grows by at first as its body arrives: a declared length reserves
/// nothing.
pub(super) const READ_CHUNK: usize = 64 << 10;

#[derive(Debug)]
pub(super) enum Request {
    Hello { version: u32, token: Vec<u8> },
    Set { key: String, value: Vec<u8> },
    Get { key: String },
    Wait { key: String, timeout_ms: u64 },
    Add { key: String, delta: i64 },
    Cas { key: String, expected: Option<Vec<u8>>, new: Vec<u8> },
    Delete { key: String },
    DeletePrefix { prefix: String },
    WaitMany { keys: Vec<String>, timeout_ms: u64 },
}

#[derive(Debug)]
pub(super) enum Response {
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
    pub(super) fn encode(&self) -> Vec<u8> {
        match self {
            Request::Hello { version, token } => Enc::default().u8(1).u32(*version).bytes(token),
            Request::Set { key, value } => Enc::default().u8(2).bytes(key.as_bytes()).bytes(value),
            Request::Get { key } => Enc::default().u8(3).bytes(key.as_bytes()),
            Request::Wait { key, timeout_ms } => Enc::default().u8(4).bytes(key.as_bytes()).u64(*timeout_ms),
            Request::Add { key, delta } => Enc::default().u8(5).bytes(key.as_bytes()).u64(*delta as u64),
            Request::Cas { key, expected, new } => Enc::default().u8(6).bytes(key.as_bytes()).opt(expected).bytes(new),
            Request::Delete { key } => Enc::default().u8(7).bytes(key.as_bytes()),
            Request::DeletePrefix { prefix } => Enc::default().u8(9).bytes(prefix.as_bytes()),
            Request::WaitMany { keys, timeout_ms } => keys
                .iter()
                .fold(Enc::default().u8(8).u32(keys.len() as u32), |e, k| e.bytes(k.as_bytes()))
                .u64(*timeout_ms),
        }
        .0
    }
    pub(super) fn decode(b: &[u8]) -> Option<Request> {
        let mut d = Dec(b);
        let r = match d.u8()? {
            1 => Request::Hello { version: d.u32()?, token: d.bytes()? },
            2 => Request::Set { key: d.string()?, value: d.bytes()? },
            3 => Request::Get { key: d.string()? },
            4 => Request::Wait { key: d.string()?, timeout_ms: d.u64()? },
            5 => Request::Add { key: d.string()?, delta: d.u64()? as i64 },
            6 => Request::Cas { key: d.string()?, expected: d.opt()?, new: d.bytes()? },
            7 => Request::Delete { key: d.string()? },
            9 => Request::DeletePrefix { prefix: d.string()? },
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
    pub(super) fn encode(&self) -> Vec<u8> {
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
    pub(super) fn decode(b: &[u8]) -> Option<Response> {
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

/// A frame's length, or `None` when the peer closed the connection before sending one.
pub(super) async fn read_len(s: &mut TcpStream, max: usize) -> std::io::Result<Option<usize>> {
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
    Ok(Some(n))
}

/// A frame's body of `n` bytes. Its buffer grows with what arrives (doubling from
/// `READ_CHUNK`, never past `n`), so it holds at most twice what the peer sent.
pub(super) async fn read_body(s: &mut TcpStream, n: usize) -> std::io::Result<Vec<u8>> {
    let mut body = Vec::new();
    while body.len() < n {
        if body.len() == body.capacity() {
            let more = body.capacity().max(READ_CHUNK).min(n - body.len());
            body.try_reserve_exact(more).map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::OutOfMemory, format!("no memory for a frame of {n} bytes"))
            })?;
        }
        let room = (body.capacity() - body.len()).min(n - body.len());
        if (&mut *s).take(room as u64).read_buf(&mut body).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(body)
}

/// A whole frame of at most `max` bytes, or `None` when the peer closed the connection
/// before it began.
pub(super) async fn read_frame(s: &mut TcpStream, max: usize) -> std::io::Result<Option<Vec<u8>>> {
    match read_len(s, max).await? {
        None => Ok(None),
        Some(n) => read_body(s, n).await.map(Some),
    }
}

pub(super) async fn write_frame(s: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let len = (body.len() as u32).to_be_bytes();
    if body.len() > READ_CHUNK {
        // A large body is not copied behind its length.
        s.write_all(&len).await?;
        return s.write_all(body).await;
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&len);
    buf.extend_from_slice(body);
    s.write_all(&buf).await
}
