//! A store on an etcd cluster, for jobs whose rendezvous outgrows one store host (as
//! torchrun offers etcd): etcd's v3 API through the JSON gateway every etcd server serves
//! on its client port (HTTP/1.1, keys and values in base64), so no gRPC stack or code
//! generator is needed to build it. Every key lives under a prefix, one per job.
//!
//! - `wait` reads the key, then watches it from the revision read, so a write between the
//!   two is never missed; the watch ends at the deadline.
//! - `compare_set` and `add` are transactions (`add` retries on a concurrent write).
//! - Each request goes to the first endpoint that answers; an unreachable one is skipped.
//! - Keys outlive the job (etcd keeps them): remove a finished job's with
//!   `etcdctl del --prefix <prefix>/`.

use super::{wait_timeout, CasOutcome, Store};
use crate::error::{Ctx, Error, Recovery, Result};
use async_trait::async_trait;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Largest answer read (a response's body).
const MAX_BODY: usize = 64 << 20;
/// How long a request (other than a wait) may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How many times `add` retries a transaction that lost to a concurrent write.
const ADD_ATTEMPTS: usize = 1000;

/// A [`Store`] on etcd.
#[derive(Debug, Clone)]
pub struct EtcdStore {
    endpoints: Vec<String>,
    prefix: String,
}

impl EtcdStore {
    /// Connect to the etcd cluster at `endpoints` (comma-separated `host:port`, with or
    /// without `http://`), keeping every key under `prefix/`; checks that one endpoint
    /// answers within `timeout`.
    ///
    /// # Errors
    /// `InvalidArgument` for an empty endpoint list, an `https://` endpoint (TLS is not
    /// supported) or an empty prefix; `Store` when no endpoint answers in time.
    pub async fn connect(endpoints: &str, prefix: &str, timeout: Duration) -> Result<Self> {
        let ctx = Ctx::process("etcd");
        let bad = |msg: String| ctx.invalid("EtcdStore::connect", "endpoints", msg);
        let mut list = Vec::new();
        for e in endpoints.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            if e.starts_with("https://") {
                return Err(bad(format!("{e}: TLS endpoints are not supported; use the cluster's plain client URL")));
            }
            let hp = e.trim_start_matches("http://").trim_end_matches('/');
            if !hp.contains(':') || hp.contains('/') {
                return Err(bad(format!("{e:?} is not host:port")));
            }
            list.push(hp.to_string());
        }
        if list.is_empty() {
            return Err(bad(format!("no etcd endpoint in {endpoints:?}")));
        }
        let prefix = prefix.trim_end_matches('/');
        if prefix.is_empty() {
            return Err(ctx.invalid(
                "EtcdStore::connect",
                "prefix",
                "an empty prefix would mix this job's keys with every other's",
            ));
        }
        let st = EtcdStore { endpoints: list, prefix: prefix.to_string() };
        let deadline = crate::deadline_in(timeout);
        let mut pause = Duration::from_millis(50);
        loop {
            match st.call("/v3/kv/range", json!({ "key": b64(b"anyccl/probe"), "count_only": true }), deadline).await {
                Ok(_) => return Ok(st),
                Err(e) if Instant::now() + pause >= deadline || e.recovery() == Recovery::Fatal => return Err(e),
                Err(_) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    fn k(&self, key: &str) -> String {
        format!("{}/{key}", self.prefix)
    }

    /// Send `body` to `path` on the first endpoint that accepts a connection; the answer's
    /// JSON.
    async fn call(&self, path: &str, body: Value, deadline: Instant) -> Result<Value> {
        let mut last = String::new();
        let mut cause = None;
        for ep in &self.endpoints {
            let mut r = match tokio::time::timeout_at(deadline.into(), self.open(ep, path, &body)).await {
                Err(_) => {
                    last = format!("{ep}: no connection in time");
                    continue;
                }
                Ok(Err(e)) => {
                    last = format!("{ep}: {e}");
                    cause = Some(e);
                    continue;
                }
                Ok(Ok(r)) => r,
            };
            return match tokio::time::timeout_at(deadline.into(), read_body(&mut r)).await {
                Err(_) => Err(Error::store(format!("etcd at {ep}: no answer to {path} in time"))),
                Ok(Err(e)) => Err(Error::store(format!("etcd at {ep}: {path}: {e}")).with_source(e)),
                Ok(Ok(b)) => serde_json::from_slice(&b).map_err(|e| {
                    Error::store_fatal(format!("etcd at {ep}: {path}: unreadable answer: {e}")).with_source(e)
                }),
            };
        }
        let e = Error::store(format!("cannot reach etcd ({last})"));
        Err(match cause {
            Some(c) => e.with_source(c),
            None => e,
        })
    }

    /// Connect, send the request, read the answer's head: the stream, positioned at the
    /// body.
    async fn open(&self, ep: &str, path: &str, body: &Value) -> std::io::Result<Answer> {
        let mut s = TcpStream::connect(ep).await?;
        let _ = s.set_nodelay(true);
        let body = body.to_string();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {ep}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await?;
        s.write_all(body.as_bytes()).await?;
        let mut r = BufReader::new(s);
        let mut line = String::new();
        r.read_line(&mut line).await?;
        let status: u16 = line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let (mut chunked, mut length) = (false, None);
        loop {
            line.clear();
            if r.read_line(&mut line).await? == 0 || line.len() > 64 << 10 {
                return Err(std::io::Error::other("malformed HTTP answer head"));
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((name, value)) = l.split_once(':') {
                let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
                if name == "transfer-encoding" && value.eq_ignore_ascii_case("chunked") {
                    chunked = true;
                } else if name == "content-length" {
                    length = value.parse::<usize>().ok();
                }
            }
        }
        let mut a = Answer { r, chunked, length };
        if status != 200 {
            let b = read_body(&mut a).await.unwrap_or_default();
            let msg = serde_json::from_slice::<Value>(&b)
                .ok()
                .and_then(|v| v.get("message").or(v.get("error")).and_then(Value::as_str).map(str::to_string))
                .unwrap_or_else(|| String::from_utf8_lossy(&b).chars().take(200).collect());
            return Err(std::io::Error::other(format!("HTTP {status}: {msg}")));
        }
        Ok(a)
    }

    /// The value under `key` (full key) and the store's revision when read.
    async fn range(&self, key: &str, deadline: Instant) -> Result<(Option<Kv>, i64)> {
        let (kvs, rev) = self.read(json!({ "key": b64(key.as_bytes()) }), deadline).await?;
        Ok((kvs.into_iter().next(), rev))
    }

    /// Watch `key` (with `range_end`, every key in `[key, range_end)`) from revision
    /// `from`, giving each write to `on_put` until it returns true (then `true`), the
    /// deadline passes or etcd cancels the watch (`false`; the caller reads again).
    async fn watch(
        &self,
        key: &[u8],
        range_end: Option<&[u8]>,
        from: i64,
        deadline: Instant,
        mut on_put: impl FnMut(Kv) -> bool,
    ) -> Result<bool> {
        let mut req = json!({ "key": b64(key), "start_revision": from.to_string() });
        if let Some(end) = range_end {
            req["range_end"] = Value::String(b64(end));
        }
        let body = json!({ "create_request": req });
        let mut last = String::new();
        let mut cause = None;
        for ep in &self.endpoints {
            let mut a = match tokio::time::timeout_at(deadline.into(), self.open(ep, "/v3/watch", &body)).await {
                Err(_) => return Ok(false),
                Ok(Err(e)) => {
                    last = format!("{ep}: {e}");
                    cause = Some(e);
                    continue;
                }
                Ok(Ok(a)) => a,
            };
            let mut pending: Vec<u8> = Vec::new();
            loop {
                let piece = match tokio::time::timeout_at(deadline.into(), a.next_piece()).await {
                    Err(_) => return Ok(false),
                    Ok(Err(e)) => return Err(Error::store(format!("etcd at {ep}: watch: {e}")).with_source(e)),
                    Ok(Ok(None)) => return Ok(false),
                    Ok(Ok(Some(p))) => p,
                };
                pending.extend_from_slice(&piece);
                if pending.len() > MAX_BODY {
                    return Err(Error::store_fatal(format!("etcd at {ep}: watch message over {MAX_BODY} bytes")));
                }
                let mut it = serde_json::Deserializer::from_slice(&pending).into_iter::<Value>();
                let mut used = 0;
                while let Some(Ok(msg)) = it.next() {
                    let res = msg.get("result").cloned().unwrap_or(msg);
                    if res.get("canceled").and_then(Value::as_bool) == Some(true) {
                        return Ok(false);
                    }
                    for ev in res.get("events").and_then(Value::as_array).into_iter().flatten() {
                        let is_put = ev.get("type").and_then(Value::as_str).is_none_or(|t| t == "PUT");
                        if let (true, Some(kv)) = (is_put, ev.get("kv")) {
                            if on_put(Kv::from(kv)) {
                                return Ok(true);
                            }
                        }
                    }
                    used = it.byte_offset();
                }
                pending.drain(..used);
            }
        }
        let e = Error::store(format!("cannot reach etcd to watch ({last})"));
        Err(match cause {
            Some(c) => e.with_source(c),
            None => e,
        })
    }

    /// Every key in `[key, end)` with the store's revision when read.
    async fn range_prefix(&self, key: &[u8], end: &[u8], deadline: Instant) -> Result<(Vec<Kv>, i64)> {
        self.read(json!({ "key": b64(key), "range_end": b64(end) }), deadline).await
    }

    /// A range request's key-values and the store's revision when read.
    async fn read(&self, request: Value, deadline: Instant) -> Result<(Vec<Kv>, i64)> {
        let v = self.call("/v3/kv/range", request, deadline).await?;
        let rev = v.pointer("/header/revision").and_then(num).unwrap_or(0);
        let kvs = v.get("kvs").and_then(Value::as_array).map(|a| a.iter().map(Kv::from).collect()).unwrap_or_default();
        Ok((kvs, rev))
    }

    /// Put `new` under `key` (full key) if the compare holds; the outcome with the value
    /// after it.
    async fn txn(&self, key: &str, compare: Value, new: &[u8], deadline: Instant) -> Result<CasOutcome> {
        let k = b64(key.as_bytes());
        let body = json!({
            "compare": [compare],
            "success": [{ "request_put": { "key": k, "value": b64(new) } }],
            "failure": [{ "request_range": { "key": k } }],
        });
        let v = self.call("/v3/kv/txn", body, deadline).await?;
        if v.get("succeeded").and_then(Value::as_bool) == Some(true) {
            return Ok(CasOutcome { swapped: true, current: Some(new.to_vec()) });
        }
        let current = v.pointer("/responses/0/response_range/kvs/0").map(|kv| Kv::from(kv).value);
        Ok(CasOutcome { swapped: false, current })
    }
}

/// One key-value of an answer.
struct Kv {
    key: Vec<u8>,
    value: Vec<u8>,
    mod_revision: i64,
}

impl From<&Value> for Kv {
    fn from(v: &Value) -> Kv {
        let bytes = |f: &str| v.get(f).and_then(Value::as_str).and_then(unb64).unwrap_or_default();
        Kv { key: bytes("key"), value: bytes("value"), mod_revision: v.get("mod_revision").and_then(num).unwrap_or(0) }
    }
}

/// An answer being read: chunked or of a known length, or until the connection closes.
struct Answer {
    r: BufReader<TcpStream>,
    chunked: bool,
    length: Option<usize>,
}

impl Answer {
    /// The next piece of the body; `None` at its end.
    async fn next_piece(&mut self) -> std::io::Result<Option<Vec<u8>>> {
        if !self.chunked {
            let mut b = Vec::new();
            match self.length.take() {
                Some(0) => return Ok(None),
                Some(n) if n > MAX_BODY => return Err(std::io::Error::other(format!("answer of {n} bytes"))),
                Some(n) => {
                    b.resize(n, 0);
                    self.r.read_exact(&mut b).await?;
                    self.length = Some(0);
                }
                None => {
                    (&mut self.r).take(MAX_BODY as u64 + 1).read_to_end(&mut b).await?;
                    self.length = Some(0);
                }
            }
            return Ok(Some(b));
        }
        let mut line = String::new();
        self.r.read_line(&mut line).await?;
        let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
            .map_err(|_| std::io::Error::other(format!("bad chunk size {line:?}")))?;
        if size > MAX_BODY {
            return Err(std::io::Error::other(format!("chunk of {size} bytes")));
        }
        let mut b = vec![0u8; size + 2];
        self.r.read_exact(&mut b).await?;
        b.truncate(size);
        Ok(if size == 0 { None } else { Some(b) })
    }
}

async fn read_body(a: &mut Answer) -> std::io::Result<Vec<u8>> {
    let mut body = Vec::new();
    while let Some(p) = a.next_piece().await? {
        body.extend_from_slice(&p);
        if body.len() > MAX_BODY {
            return Err(std::io::Error::other(format!("answer over {MAX_BODY} bytes")));
        }
    }
    Ok(body)
}

/// The integer `add` keeps under `key`.
fn integer(key: &str, kv: &Kv) -> Result<i64> {
    std::str::from_utf8(&kv.value)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .ok_or_else(|| Error::store_fatal(format!("add: value under '{key}' is not an integer")))
}

/// The longest prefix the keys share (every key has at least the store's prefix and `/`).
fn common_prefix(keys: &[String]) -> &[u8] {
    let Some(first) = keys.first() else { return b"" };
    let mut n = first.len();
    for k in &keys[1..] {
        n = n.min(first.bytes().zip(k.bytes()).take_while(|(a, b)| a == b).count());
    }
    &first.as_bytes()[..n]
}

/// The end of the range of keys starting with `prefix` (etcd's `range_end`).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Only 0xff bytes (or none): every key from the prefix on.
    vec![0]
}

fn num(v: &Value) -> Option<i64> {
    v.as_i64().or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn b64(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let n =
            (u32::from(c[0]) << 16) | (u32::from(*c.get(1).unwrap_or(&0)) << 8) | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn unb64(s: &str) -> Option<Vec<u8>> {
    let s = s.trim_end_matches('=');
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for c in s.bytes() {
        let v = B64.iter().position(|&b| b == c)? as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

#[async_trait]
impl Store for EtcdStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let body = json!({ "key": b64(self.k(key).as_bytes()), "value": b64(value) });
        self.call("/v3/kv/put", body, crate::deadline_in(REQUEST_TIMEOUT)).await.map(|_| ())
    }
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.range(&self.k(key), crate::deadline_in(REQUEST_TIMEOUT)).await?.0.map(|kv| kv.value))
    }
    async fn wait(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        let started = Instant::now();
        let full = self.k(key);
        loop {
            let (kv, rev) = self.range(&full, deadline.max(crate::deadline_in(REQUEST_TIMEOUT))).await?;
            if let Some(kv) = kv {
                return Ok(kv.value);
            }
            if Instant::now() >= deadline {
                return Err(wait_timeout(key, started));
            }
            let mut got = None;
            let want = full.as_bytes();
            self.watch(want, None, rev + 1, deadline, |kv| {
                let done = kv.key == want;
                if done {
                    got = Some(kv.value);
                }
                done
            })
            .await?;
            if let Some(v) = got {
                return Ok(v);
            }
        }
    }
    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let full = self.k(key);
        let deadline = crate::deadline_in(REQUEST_TIMEOUT);
        if delta == 0 {
            let (kv, _) = self.range(&full, deadline).await?;
            return kv.map_or(Ok(0), |kv| integer(key, &kv));
        }
        for _ in 0..ADD_ATTEMPTS {
            let (kv, _) = self.range(&full, deadline).await?;
            let (cur, compare) = match &kv {
                None => (
                    0,
                    json!({ "key": b64(full.as_bytes()), "target": "CREATE", "result": "EQUAL", "create_revision": "0" }),
                ),
                Some(kv) => {
                    let cur = integer(key, kv)?;
                    let c = json!({ "key": b64(full.as_bytes()), "target": "MOD", "result": "EQUAL", "mod_revision": kv.mod_revision.to_string() });
                    (cur, c)
                }
            };
            let new = cur.wrapping_add(delta);
            if self.txn(&full, compare, new.to_string().as_bytes(), deadline).await?.swapped {
                return Ok(new);
            }
        }
        Err(Error::store(format!("add on '{key}' lost to concurrent writes {ADD_ATTEMPTS} times")))
    }
    async fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
        let full = self.k(key);
        let k = b64(full.as_bytes());
        let compare = match expected {
            None => json!({ "key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0" }),
            Some(e) => json!({ "key": k, "target": "VALUE", "result": "EQUAL", "value": b64(e) }),
        };
        self.txn(&full, compare, new, crate::deadline_in(REQUEST_TIMEOUT)).await
    }
    /// Many keys in two requests however many they are: one range read over their common
    /// prefix, then one watch of it for those still absent.
    async fn wait_many(&self, keys: &[String], deadline: Instant) -> Result<Vec<Option<Vec<u8>>>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let full: Vec<String> = keys.iter().map(|k| self.k(k)).collect();
        let mut out: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
        let mut index: std::collections::HashMap<&[u8], Vec<usize>> = std::collections::HashMap::new();
        for (i, k) in full.iter().enumerate() {
            index.entry(k.as_bytes()).or_default().push(i);
        }
        let mut absent = keys.len();
        let mut fill = |out: &mut Vec<Option<Vec<u8>>>, kv: Kv| {
            for &i in index.get(kv.key.as_slice()).into_iter().flatten() {
                if out[i].is_none() {
                    absent -= 1;
                }
                out[i] = Some(kv.value.clone());
            }
            absent == 0
        };
        let prefix = common_prefix(&full);
        let end = prefix_end(prefix);
        loop {
            let (kvs, rev) = self.range_prefix(prefix, &end, deadline.max(crate::deadline_in(REQUEST_TIMEOUT))).await?;
            let mut done = false;
            for kv in kvs {
                done = fill(&mut out, kv);
            }
            if done || Instant::now() >= deadline {
                return Ok(out);
            }
            let done = self.watch(prefix, Some(&end), rev + 1, deadline, |kv| fill(&mut out, kv)).await?;
            if done || Instant::now() >= deadline {
                return Ok(out);
            }
        }
    }
    async fn delete(&self, key: &str) -> Result<bool> {
        let v = self
            .call(
                "/v3/kv/deleterange",
                json!({ "key": b64(self.k(key).as_bytes()) }),
                crate::deadline_in(REQUEST_TIMEOUT),
            )
            .await?;
        Ok(v.get("deleted").and_then(num).unwrap_or(0) > 0)
    }
    async fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        if prefix.is_empty() {
            return Err(super::empty_prefix());
        }
        let key = self.k(prefix).into_bytes();
        let end = prefix_end(&key);
        let v = self
            .call(
                "/v3/kv/deleterange",
                json!({ "key": b64(&key), "range_end": b64(&end) }),
                crate::deadline_in(REQUEST_TIMEOUT),
            )
            .await?;
        Ok(v.get("deleted").and_then(num).unwrap_or(0).max(0) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::{b64, unb64};

    #[test]
    fn base64_round_trips() {
        for n in 0..40usize {
            let data: Vec<u8> = (0..n).map(|i| (i * 37 + 11) as u8).collect();
            assert_eq!(unb64(&b64(&data)).as_deref(), Some(&data[..]), "length {n}");
        }
        assert_eq!(b64(b"foo"), "Zm9v");
        assert_eq!(b64(b"fo"), "Zm8=");
        assert_eq!(unb64("YmFy").as_deref(), Some(&b"bar"[..]));
        assert_eq!(unb64("!!"), None);
    }
}
