//! The wire format, the hub that the root rank's process runs (members, links, collectives
//! and point-to-point matched there), and the folds of contributions on the hub.

use super::*;

pub(crate) fn write_frame(s: &mut TcpStream, ty: u8, body: &[u8]) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(body.len() + 5);
    b.extend_from_slice(&(body.len() as u32).to_le_bytes());
    b.push(ty);
    b.extend_from_slice(body);
    s.write_all(&b)
}

pub(crate) fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut h = [0u8; 5];
    s.read_exact(&mut h)?;
    let n = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
    let mut body = vec![0u8; n];
    s.read_exact(&mut body)?;
    Ok((h[4], body))
}

pub(crate) const HELLO: u8 = 1;
pub(crate) const LINK: u8 = 2;
pub(crate) const COLL: u8 = 3;
pub(crate) const SEND: u8 = 4;
pub(crate) const RECV: u8 = 5;
pub(crate) const SUB: u8 = 6;
pub(crate) const BYE: u8 = 7;
pub(crate) const OK: u8 = 10;
pub(crate) const ERR: u8 = 11;

pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]])).unwrap_or(0)
}

pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        a.copy_from_slice(s);
    }
    u64::from_le_bytes(a)
}

pub(crate) fn err_body(code: i32, msg: &str) -> Vec<u8> {
    let mut b = code.to_le_bytes().to_vec();
    b.extend_from_slice(msg.as_bytes());
    b
}

// ---------------------------------------------------------------- the hub

/// One contribution to a collective: its header (for the consistency check) and data.
pub(crate) struct Contrib {
    pub(crate) head: [u64; 5],
    pub(crate) data: Vec<u8>,
}

pub(crate) type Conn = Arc<Mutex<TcpStream>>;

#[derive(Default)]
pub(crate) struct HubState {
    pub(crate) n: u32,
    pub(crate) ctrl: HashMap<u32, Conn>,
    pub(crate) data: HashMap<u32, Conn>,
    pub(crate) ready: bool,
    pub(crate) links: HashMap<String, Vec<u32>>,
    pub(crate) colls: HashMap<u64, Vec<Option<Contrib>>>,
    pub(crate) mail: HashMap<(u32, u32), VecDeque<Vec<u8>>>,
    pub(crate) recv_wait: HashMap<(u32, u32), Conn>,
    pub(crate) subs: HashMap<u64, String>,
    pub(crate) broken: Option<String>,
    pub(crate) gone: HashSet<u32>,
    /// Connections accepted and still served.
    pub(crate) open: u32,
}

pub(crate) struct Hub {
    pub(crate) st: Mutex<HubState>,
}

pub(crate) fn reply(c: &Conn, ty: u8, body: &[u8]) {
    let _ = write_frame(&mut c.lock().unwrap_or_else(|e| e.into_inner()), ty, body);
}

/// Start a hub; its address.
pub(crate) fn start_hub(host: &str) -> std::io::Result<String> {
    let l = TcpListener::bind((host, 0))?;
    let addr = l.local_addr()?.to_string();
    let hub = Arc::new(Hub { st: Mutex::new(HubState::default()) });
    let limit = link_timeout(None);
    std::thread::Builder::new().name("standin-hub".into()).spawn(move || {
        l.set_nonblocking(true).ok();
        let started = Instant::now();
        let mut accepted = 0u32;
        loop {
            let (want, deserted) = {
                let st = hub.st.lock().unwrap_or_else(|e| e.into_inner());
                let want = if st.n > 0 { 2 * st.n } else { u32::MAX };
                // Every rank that joined left before the rest came (their init timed out):
                // nobody is left to finish this communicator.
                (want, accepted > 0 && st.open == 0 && !st.ready)
            };
            if accepted >= want || deserted || started.elapsed() > limit {
                return;
            }
            match l.accept() {
                Ok((s, _)) => {
                    accepted += 1;
                    hub.st.lock().unwrap_or_else(|e| e.into_inner()).open += 1;
                    s.set_nonblocking(false).ok();
                    s.set_nodelay(true).ok();
                    let h = hub.clone();
                    let served = std::thread::Builder::new().name("standin-hub-conn".into()).spawn(move || serve(h, s));
                    if served.is_err() {
                        hub.st.lock().unwrap_or_else(|e| e.into_inner()).open -= 1;
                    }
                }
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    })?;
    Ok(addr)
}

pub(crate) fn serve(hub: Arc<Hub>, s: TcpStream) {
    let Ok(w) = s.try_clone() else {
        hub.st.lock().unwrap_or_else(|e| e.into_inner()).open -= 1;
        return;
    };
    let conn: Conn = Arc::new(Mutex::new(w));
    let mut r = s;
    let mut me: Option<u32> = None;
    loop {
        let (ty, body) = match read_frame(&mut r) {
            Ok(f) => f,
            Err(_) => {
                let mut st = hub.st.lock().unwrap_or_else(|e| e.into_inner());
                st.open -= 1;
                if let Some(rank) = me {
                    if !st.ready {
                        // A rank that left before every rank joined has not joined: its
                        // connection is dropped here, not kept until the hub ends.
                        let st = &mut *st;
                        for m in [&mut st.ctrl, &mut st.data] {
                            if m.get(&rank).is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                                m.remove(&rank);
                            }
                        }
                    } else if !st.gone.contains(&rank) {
                        break_hub(&mut st, format!("rank {rank} disconnected without destroying its communicator"));
                    }
                }
                return;
            }
        };
        let mut st = hub.st.lock().unwrap_or_else(|e| e.into_inner());
        match ty {
            HELLO => {
                let (rank, n, chan) = (u32_at(&body, 0), u32_at(&body, 4), u32_at(&body, 8));
                if st.n == 0 {
                    st.n = n;
                }
                if n != st.n || rank >= n {
                    reply(
                        &conn,
                        ERR,
                        &err_body(E_PARA, &format!("rank {rank} of {n} joined a communicator of {}", st.n)),
                    );
                    continue;
                }
                me = Some(rank);
                if chan == 0 {
                    st.ctrl.insert(rank, conn.clone());
                } else {
                    st.data.insert(rank, conn.clone());
                }
                if st.ctrl.len() as u32 == st.n && st.data.len() as u32 == st.n && !st.ready {
                    st.ready = true;
                    for c in st.ctrl.values() {
                        reply(c, OK, &[]);
                    }
                }
            }
            LINK => {
                let parts = u32_at(&body, 0) as usize;
                let key = String::from_utf8_lossy(&body[4..]).to_string();
                if let Some(b) = &st.broken {
                    reply(&conn, ERR, &err_body(E_REMOTE, b));
                    continue;
                }
                let Some(rank) = me else { continue };
                let w = st.links.entry(key.clone()).or_default();
                w.push(rank);
                if w.len() >= parts {
                    let ranks = st.links.remove(&key).unwrap_or_default();
                    for r in ranks {
                        if let Some(c) = st.ctrl.get(&r) {
                            reply(c, OK, &[]);
                        }
                    }
                }
            }
            SUB => {
                let id = u64_at(&body, 0);
                let addr = match st.subs.get(&id) {
                    Some(a) => Ok(a.clone()),
                    None => {
                        let host = conn.lock().ok().and_then(|c| c.local_addr().ok()).map(|a| a.ip().to_string());
                        start_hub(&host.unwrap_or_else(|| "127.0.0.1".into())).inspect(|a| {
                            st.subs.insert(id, a.clone());
                        })
                    }
                };
                match addr {
                    Ok(a) => reply(&conn, OK, a.as_bytes()),
                    Err(e) => reply(&conn, ERR, &err_body(E_TCP_CONNECT, &e.to_string())),
                }
            }
            COLL => {
                let Some(rank) = me else { continue };
                if let Some(b) = st.broken.clone() {
                    reply(&conn, ERR, &err_body(E_REMOTE, &b));
                    continue;
                }
                let head =
                    [u64_at(&body, 0), u64_at(&body, 8), u64_at(&body, 16), u64_at(&body, 24), u64_at(&body, 32)];
                let n = st.n as usize;
                let seq = u64_at(&body, 40);
                let slots = st.colls.entry(seq).or_insert_with(|| (0..n).map(|_| None).collect());
                slots[rank as usize] = Some(Contrib { head, data: body[48..].to_vec() });
                if slots.iter().all(Option::is_some) {
                    let all: Vec<Contrib> = st.colls.remove(&seq).unwrap_or_default().into_iter().flatten().collect();
                    let outs = compute(&all);
                    for (r, out) in outs.into_iter().enumerate() {
                        if let Some(c) = st.data.get(&(r as u32)) {
                            match &out {
                                Ok(b) => reply(c, OK, b),
                                Err(m) => reply(c, ERR, &err_body(E_PARA, m)),
                            }
                        }
                    }
                }
            }
            SEND => {
                let Some(rank) = me else { continue };
                if let Some(b) = st.broken.clone() {
                    reply(&conn, ERR, &err_body(E_REMOTE, &b));
                    continue;
                }
                let to = u32_at(&body, 0);
                let payload = body[4..].to_vec();
                if let Some(c) = st.recv_wait.remove(&(rank, to)) {
                    reply(&c, OK, &payload);
                } else {
                    st.mail.entry((rank, to)).or_default().push_back(payload);
                }
                reply(&conn, OK, &[]);
            }
            RECV => {
                let Some(rank) = me else { continue };
                if let Some(b) = st.broken.clone() {
                    reply(&conn, ERR, &err_body(E_REMOTE, &b));
                    continue;
                }
                let from = u32_at(&body, 0);
                match st.mail.get_mut(&(from, rank)).and_then(VecDeque::pop_front) {
                    Some(m) => reply(&conn, OK, &m),
                    None => {
                        st.recv_wait.insert((from, rank), conn.clone());
                    }
                }
            }
            BYE => {
                if let Some(rank) = me {
                    st.gone.insert(rank);
                }
            }
            _ => {}
        }
    }
}

pub(crate) fn break_hub(st: &mut HubState, why: String) {
    if st.broken.is_some() {
        return;
    }
    let body = err_body(E_REMOTE, &why);
    st.broken = Some(why);
    for (_, ranks) in st.links.drain() {
        for r in ranks {
            if let Some(c) = st.ctrl.get(&r) {
                reply(c, ERR, &body);
            }
        }
    }
    for (_, slots) in st.colls.drain() {
        for (r, s) in slots.iter().enumerate() {
            if s.is_some() {
                if let Some(c) = st.data.get(&(r as u32)) {
                    reply(c, ERR, &body);
                }
            }
        }
    }
    for (_, c) in st.recv_wait.drain() {
        reply(&c, ERR, &body);
    }
}

// ---------------------------------------------------------------- collectives on the hub

// Contribution header: [kind, dtype, redop, root, count]
pub(crate) const K_ALL_REDUCE: u64 = 0;
pub(crate) const K_REDUCE: u64 = 1;
pub(crate) const K_BROADCAST: u64 = 2;
pub(crate) const K_ALL_GATHER: u64 = 3;
pub(crate) const K_REDUCE_SCATTER: u64 = 4;
pub(crate) const K_ALL_TO_ALL: u64 = 5;
pub(crate) const K_BARRIER: u64 = 6;

pub(crate) fn kind_name(k: u64) -> &'static str {
    ["AllReduce", "Reduce", "Broadcast", "AllGather", "ReduceScatter", "AlltoAll", "Barrier"]
        .get(k as usize)
        .copied()
        .unwrap_or("?")
}

pub(crate) fn dtype_size(d: u32) -> Option<usize> {
    Some(match d {
        0 | 7 => 1,
        1 | 3 | 8 | 11 => 2,
        2 | 4 | 9 => 4,
        5 | 6 | 10 => 8,
        _ => return None,
    })
}

pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let (s, e, m) = ((h >> 15) as u32, ((h >> 10) & 0x1f) as u32, (h & 0x3ff) as u32);
    let bits = match (e, m) {
        (0, 0) => s << 31,
        (0, _) => {
            let mut e = 127 - 15 + 1;
            let mut m = m;
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            (s << 31) | ((e as u32) << 23) | ((m & 0x3ff) << 13)
        }
        (31, 0) => (s << 31) | 0x7f80_0000,
        (31, _) => (s << 31) | 0x7fc0_0000 | (m << 13),
        _ => (s << 31) | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

pub(crate) fn f32_to_f16(f: f32) -> u16 {
    let x = f.to_bits();
    let s = ((x >> 16) & 0x8000) as u16;
    let e = ((x >> 23) & 0xff) as i32;
    let m = x & 0x7f_ffff;
    if e == 255 {
        return s | 0x7c00 | if m != 0 { 0x200 } else { 0 };
    }
    let e2 = e - 127 + 15;
    if e2 >= 31 {
        return s | 0x7c00;
    }
    if e2 <= 0 {
        if e2 < -10 {
            return s;
        }
        let m = m | 0x80_0000;
        let shift = (14 - e2) as u32;
        let half = 1u32 << (shift - 1);
        let mut r = m >> shift;
        let rem = m & ((1 << shift) - 1);
        if rem > half || (rem == half && r & 1 == 1) {
            r += 1;
        }
        return s | r as u16;
    }
    let mut r = ((e2 as u32) << 10) | (m >> 13);
    let rem = m & 0x1fff;
    if rem > 0x1000 || (rem == 0x1000 && r & 1 == 1) {
        r += 1;
    }
    s | r as u16
}

pub(crate) fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

pub(crate) fn f32_to_bf16(f: f32) -> u16 {
    let x = f.to_bits();
    if f.is_nan() {
        return ((x >> 16) | 0x40) as u16;
    }
    let r = x + 0x7fff + ((x >> 16) & 1);
    (r >> 16) as u16
}

macro_rules! fold_int {
    ($t:ty, $acc:expr, $x:expr, $op:expr) => {{
        let sz = std::mem::size_of::<$t>();
        for (a, b) in $acc.chunks_exact_mut(sz).zip($x.chunks_exact(sz)) {
            let u = <$t>::from_le_bytes(a.try_into().expect("chunk"));
            let v = <$t>::from_le_bytes(b.try_into().expect("chunk"));
            let w = match $op {
                0 => u.wrapping_add(v),
                1 => u.wrapping_mul(v),
                2 => u.max(v),
                _ => u.min(v),
            };
            a.copy_from_slice(&w.to_le_bytes());
        }
    }};
}

macro_rules! fold_float {
    ($t:ty, $acc:expr, $x:expr, $op:expr) => {{
        let sz = std::mem::size_of::<$t>();
        for (a, b) in $acc.chunks_exact_mut(sz).zip($x.chunks_exact(sz)) {
            let u = <$t>::from_le_bytes(a.try_into().expect("chunk"));
            let v = <$t>::from_le_bytes(b.try_into().expect("chunk"));
            let w = match $op {
                0 => u + v,
                1 => u * v,
                2 => u.max(v),
                _ => u.min(v),
            };
            a.copy_from_slice(&w.to_le_bytes());
        }
    }};
}

pub(crate) fn fold16(acc: &mut [u8], x: &[u8], op: u64, to: fn(u16) -> f32, from: fn(f32) -> u16) {
    for (a, b) in acc.chunks_exact_mut(2).zip(x.chunks_exact(2)) {
        let u = to(u16::from_le_bytes([a[0], a[1]]));
        let v = to(u16::from_le_bytes([b[0], b[1]]));
        let w = match op {
            0 => u + v,
            1 => u * v,
            2 => u.max(v),
            _ => u.min(v),
        };
        a.copy_from_slice(&from(w).to_le_bytes());
    }
}

/// `acc op= x`, element-wise, in HCCL data type `d`.
pub(crate) fn fold(acc: &mut [u8], x: &[u8], d: u32, op: u64) {
    match d {
        0 => fold_int!(i8, acc, x, op),
        1 => fold_int!(i16, acc, x, op),
        2 => fold_int!(i32, acc, x, op),
        3 => fold16(acc, x, op, f16_to_f32, f32_to_f16),
        4 => fold_float!(f32, acc, x, op),
        5 => fold_int!(i64, acc, x, op),
        6 => fold_int!(u64, acc, x, op),
        7 => fold_int!(u8, acc, x, op),
        8 => fold_int!(u16, acc, x, op),
        9 => fold_int!(u32, acc, x, op),
        10 => fold_float!(f64, acc, x, op),
        _ => fold16(acc, x, op, bf16_to_f32, f32_to_bf16),
    }
}

/// Every rank's output of one collective, from every rank's contribution (rank order).
pub(crate) fn compute(all: &[Contrib]) -> Vec<Result<Vec<u8>, String>> {
    let n = all.len();
    let h = all[0].head;
    if let Some((r, c)) = all.iter().enumerate().find(|(_, c)| c.head != h) {
        let msg = format!(
            "parameters differ between ranks: rank 0 issued {} (dtype {}, op {}, root {}, count {}), rank {r} issued {} (dtype {}, op {}, root {}, count {})",
            kind_name(h[0]), h[1], h[2], h[3], h[4], kind_name(c.head[0]), c.head[1], c.head[2], c.head[3], c.head[4]
        );
        return vec![Err(msg); n];
    }
    let (kind, dt, op, root) = (h[0], h[1] as u32, h[2], h[3] as usize);
    let reduce = || {
        let mut acc = all[0].data.clone();
        for c in &all[1..] {
            fold(&mut acc, &c.data, dt, op);
        }
        acc
    };
    match kind {
        K_ALL_REDUCE => vec![Ok(reduce()); n],
        K_REDUCE => {
            let r = reduce();
            (0..n).map(|i| Ok(if i == root { r.clone() } else { Vec::new() })).collect()
        }
        K_BROADCAST => vec![Ok(all[root.min(n - 1)].data.clone()); n],
        K_ALL_GATHER => vec![Ok(all.iter().flat_map(|c| c.data.iter().copied()).collect()); n],
        K_REDUCE_SCATTER => {
            let r = reduce();
            let per = r.len() / n;
            (0..n).map(|i| Ok(r[i * per..(i + 1) * per].to_vec())).collect()
        }
        K_ALL_TO_ALL => {
            // Each contribution: n u64 byte lengths, then the pieces for ranks 0..n.
            let pieces: Vec<Vec<&[u8]>> = all
                .iter()
                .map(|c| {
                    let mut off = 8 * n;
                    (0..n)
                        .map(|j| {
                            let len = u64_at(&c.data, 8 * j) as usize;
                            let p = c.data.get(off..off + len).unwrap_or(&[]);
                            off += len;
                            p
                        })
                        .collect()
                })
                .collect();
            (0..n)
                .map(|j| {
                    let mut out: Vec<u8> = (0..n).flat_map(|i| (pieces[i][j].len() as u64).to_le_bytes()).collect();
                    for p in &pieces {
                        out.extend_from_slice(p[j]);
                    }
                    Ok(out)
                })
                .collect()
        }
        _ => vec![Ok(Vec::new()); n],
    }
}
