//! The HCCL and ACL stand-in (built by build.rs as `libhccl.so`; see lib.rs for what it
//! models). Standard library only. "Device memory" is host memory counted against a pool.
#![allow(non_snake_case, clippy::missing_safety_doc)]

#[path = "standin/register.rs"]
mod register;

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::{c_char, c_void, CStr, CString};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------- codes

const ACL_SUCCESS: i32 = 0;
const ACL_ERROR_INVALID_PARAM: i32 = 100000;
const ACL_ERROR_REPEAT_INITIALIZE: i32 = 100002;
const ACL_ERROR_RT_CONTEXT_NULL: i32 = 107002;
const ACL_ERROR_RT_MEMORY_ALLOCATION: i32 = 207001;

const SUCCESS: i32 = 0;
const E_PARA: i32 = 1;
const E_PTR: i32 = 2;
const E_INTERNAL: i32 = 4;
const E_NOT_SUPPORT: i32 = 5;
const E_TIMEOUT: i32 = 9;
const E_TCP_CONNECT: i32 = 11;
const E_REMOTE: i32 = 21;
const E_SUSPENDING: i32 = 22;
const E_OOM: i32 = 24;

const ROOT_INFO_BYTES: usize = 4108;
const MAGIC: &[u8; 16] = b"anyccl-standin\0\0";
const CONFIG_MAGIC: u32 = 0xf0f0_f0f0;
const NOT_SET: u32 = 0xffff_ffff;

thread_local! {
    static DEVICE: Cell<i32> = const { Cell::new(-1) };
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(msg: String) {
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(msg.replace('\0', " ")).unwrap_or_default());
}

fn env_u64(name: &str, default: u64) -> u64 {
    let Ok(v) = std::env::var(name) else { return default };
    let v = v.trim();
    let (num, mult) = match v.chars().last() {
        Some('K' | 'k') => (&v[..v.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&v[..v.len() - 1], 1 << 20),
        Some('G' | 'g') => (&v[..v.len() - 1], 1 << 30),
        _ => (v, 1),
    };
    num.parse::<u64>().map(|n| n * mult).unwrap_or(default)
}

// ---------------------------------------------------------------- injection

struct Injection {
    call: String,
    code: i32,
    rank: i64,
    times: u32,
}

fn injections() -> &'static Mutex<Vec<Injection>> {
    static I: OnceLock<Mutex<Vec<Injection>>> = OnceLock::new();
    I.get_or_init(|| {
        let mut v = Vec::new();
        if let Ok(spec) = std::env::var("ANYCCL_STANDIN_INJECT") {
            for item in spec.split(',').filter(|s| !s.trim().is_empty()) {
                let f: Vec<&str> = item.trim().split(':').collect();
                let code = f.get(1).and_then(|c| c.parse().ok()).unwrap_or(E_INTERNAL);
                let rank = f.get(2).and_then(|c| c.parse().ok()).unwrap_or(-1);
                let times = f.get(3).and_then(|c| c.parse().ok()).unwrap_or(1);
                v.push(Injection { call: f[0].to_string(), code, rank, times });
            }
        }
        Mutex::new(v)
    })
}

/// An injected code for `call` on `rank`, used up once.
fn injected(call: &str, rank: i64) -> Option<i32> {
    let mut l = injections().lock().unwrap_or_else(|p| p.into_inner());
    let i = l.iter().position(|i| i.call == call && (i.rank < 0 || i.rank == rank) && i.times > 0)?;
    l[i].times -= 1;
    let code = l[i].code;
    if l[i].times == 0 {
        l.remove(i);
    }
    set_error(format!("{call}: error {code} injected by the stand-in"));
    Some(code)
}

/// Make the next `times` calls of `call` on communicator rank `rank` (-1: any) return `code`.
/// `HcclGetCommAsyncError` reports the code as the communicator's asynchronous error.
#[no_mangle]
pub unsafe extern "C" fn anyccl_standin_inject(call: *const c_char, code: i32, rank: i32, times: u32) -> i32 {
    if call.is_null() {
        return E_PTR;
    }
    let call = CStr::from_ptr(call).to_string_lossy().into_owned();
    injections().lock().unwrap_or_else(|p| p.into_inner()).push(Injection { call, code, rank: rank as i64, times });
    SUCCESS
}

// ---------------------------------------------------------------- device memory

struct Pool {
    used: u64,
}

fn capacity() -> u64 {
    env_u64("ANYCCL_STANDIN_DEVICE_MEMORY", 64 << 30)
}

fn device_count() -> u32 {
    env_u64("ANYCCL_STANDIN_DEVICES", 8) as u32
}

fn pools() -> &'static Mutex<HashMap<i32, Pool>> {
    static P: OnceLock<Mutex<HashMap<i32, Pool>>> = OnceLock::new();
    P.get_or_init(Default::default)
}

fn take(dev: i32, bytes: u64) -> bool {
    let mut p = pools().lock().unwrap_or_else(|e| e.into_inner());
    let pool = p.entry(dev).or_insert(Pool { used: 0 });
    if pool.used + bytes > capacity() {
        return false;
    }
    pool.used += bytes;
    true
}

fn give(dev: i32, bytes: u64) {
    let mut p = pools().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(pool) = p.get_mut(&dev) {
        pool.used = pool.used.saturating_sub(bytes);
    }
}

fn allocs() -> &'static Mutex<HashMap<usize, (usize, i32)>> {
    static A: OnceLock<Mutex<HashMap<usize, (usize, i32)>>> = OnceLock::new();
    A.get_or_init(Default::default)
}

fn current() -> Option<i32> {
    let d = DEVICE.with(|d| d.get());
    (d >= 0).then_some(d)
}

// ---------------------------------------------------------------- ACL

#[no_mangle]
pub extern "C" fn aclInit(_config: *const c_char) -> i32 {
    static DONE: AtomicBool = AtomicBool::new(false);
    if DONE.swap(true, Ordering::AcqRel) {
        ACL_ERROR_REPEAT_INITIALIZE
    } else {
        ACL_SUCCESS
    }
}

#[no_mangle]
pub extern "C" fn aclFinalize() -> i32 {
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclrtSetDevice(id: i32) -> i32 {
    if id < 0 || id as u32 >= device_count() {
        set_error(format!("aclrtSetDevice: device {id} does not exist ({} devices)", device_count()));
        return ACL_ERROR_INVALID_PARAM;
    }
    DEVICE.with(|d| d.set(id));
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclrtResetDevice(_id: i32) -> i32 {
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclrtGetDevice(id: *mut i32) -> i32 {
    match current() {
        Some(d) if !id.is_null() => {
            *id = d;
            ACL_SUCCESS
        }
        _ => ACL_ERROR_RT_CONTEXT_NULL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn aclrtGetDeviceCount(count: *mut u32) -> i32 {
    if count.is_null() {
        return ACL_ERROR_INVALID_PARAM;
    }
    *count = device_count();
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclrtMalloc(ptr: *mut *mut c_void, size: usize, _policy: i32) -> i32 {
    let Some(dev) = current() else { return ACL_ERROR_RT_CONTEXT_NULL };
    if ptr.is_null() {
        return ACL_ERROR_INVALID_PARAM;
    }
    if !take(dev, size as u64) {
        set_error(format!("aclrtMalloc: {size} bytes do not fit in device {dev}'s free memory"));
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    let layout = std::alloc::Layout::from_size_align(size.max(1), 64).expect("layout");
    let p = std::alloc::alloc_zeroed(layout);
    if p.is_null() {
        give(dev, size as u64);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    allocs().lock().unwrap_or_else(|e| e.into_inner()).insert(p as usize, (size, dev));
    *ptr = p as *mut c_void;
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclrtFree(ptr: *mut c_void) -> i32 {
    let Some((size, dev)) = allocs().lock().unwrap_or_else(|e| e.into_inner()).remove(&(ptr as usize)) else {
        return ACL_ERROR_INVALID_PARAM;
    };
    std::alloc::dealloc(ptr as *mut u8, std::alloc::Layout::from_size_align(size.max(1), 64).expect("layout"));
    give(dev, size as u64);
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclrtMemcpy(
    dst: *mut c_void,
    max: usize,
    src: *const c_void,
    count: usize,
    _kind: i32,
) -> i32 {
    if count > max || (count > 0 && (dst.is_null() || src.is_null())) {
        return ACL_ERROR_INVALID_PARAM;
    }
    std::ptr::copy(src as *const u8, dst as *mut u8, count);
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclrtMemcpyAsync(
    dst: *mut c_void,
    max: usize,
    src: *const c_void,
    count: usize,
    _kind: i32,
    stream: *mut c_void,
) -> i32 {
    if count > max || (count > 0 && (dst.is_null() || src.is_null())) {
        return ACL_ERROR_INVALID_PARAM;
    }
    let Some(s) = stream_ref(stream) else { return ACL_ERROR_INVALID_PARAM };
    let (d, sp) = (Ptr(dst as *mut u8), Ptr(src as *mut u8));
    if s.submit(Box::new(move || {
        let (d, sp) = (d, sp);
        std::ptr::copy(sp.0, d.0, count)
    })) {
        ACL_SUCCESS
    } else {
        ACL_ERROR_INVALID_PARAM
    }
}

#[no_mangle]
pub unsafe extern "C" fn aclrtMemset(dst: *mut c_void, max: usize, value: i32, count: usize) -> i32 {
    if count > max || (count > 0 && dst.is_null()) {
        return ACL_ERROR_INVALID_PARAM;
    }
    std::ptr::write_bytes(dst as *mut u8, value as u8, count);
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclrtGetMemInfo(_attr: i32, free: *mut usize, total: *mut usize) -> i32 {
    let Some(dev) = current() else { return ACL_ERROR_RT_CONTEXT_NULL };
    if free.is_null() || total.is_null() {
        return ACL_ERROR_INVALID_PARAM;
    }
    let used = pools().lock().unwrap_or_else(|e| e.into_inner()).get(&dev).map(|p| p.used).unwrap_or(0);
    *total = capacity() as usize;
    *free = capacity().saturating_sub(used) as usize;
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclGetRecentErrMsg() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

// ---------------------------------------------------------------- streams and events

type Task = Box<dyn FnOnce() + Send>;

struct Progress {
    done: Mutex<u64>,
    cv: Condvar,
}

struct StreamObj {
    tx: Mutex<Option<mpsc::Sender<(u64, Task)>>>,
    submitted: AtomicU64,
    progress: Arc<Progress>,
}

impl StreamObj {
    fn submit(&self, t: Task) -> bool {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = tx.as_ref() else { return false };
        let seq = self.submitted.fetch_add(1, Ordering::AcqRel) + 1;
        tx.send((seq, t)).is_ok()
    }
}

#[no_mangle]
pub unsafe extern "C" fn aclrtCreateStream(stream: *mut *mut c_void) -> i32 {
    if current().is_none() {
        return ACL_ERROR_RT_CONTEXT_NULL;
    }
    if stream.is_null() {
        return ACL_ERROR_INVALID_PARAM;
    }
    let (tx, rx) = mpsc::channel::<(u64, Task)>();
    let progress = Arc::new(Progress { done: Mutex::new(0), cv: Condvar::new() });
    let p2 = progress.clone();
    let spawned = std::thread::Builder::new().name("standin-stream".into()).spawn(move || {
        for (seq, t) in rx {
            t();
            *p2.done.lock().unwrap_or_else(|e| e.into_inner()) = seq;
            p2.cv.notify_all();
        }
    });
    if spawned.is_err() {
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    let s = Box::new(StreamObj { tx: Mutex::new(Some(tx)), submitted: AtomicU64::new(0), progress });
    *stream = Box::into_raw(s) as *mut c_void;
    ACL_SUCCESS
}

unsafe fn stream_ref<'a>(s: *mut c_void) -> Option<&'a StreamObj> {
    (s as *const StreamObj).as_ref()
}

fn wait_done(s: &StreamObj, target: u64, timeout: Option<Duration>) -> bool {
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut d = s.progress.done.lock().unwrap_or_else(|e| e.into_inner());
    while *d < target {
        match deadline {
            None => d = s.progress.cv.wait(d).unwrap_or_else(|e| e.into_inner()),
            Some(dl) => {
                let now = Instant::now();
                if now >= dl {
                    return false;
                }
                d = s.progress.cv.wait_timeout(d, dl - now).unwrap_or_else(|e| e.into_inner()).0;
            }
        }
    }
    true
}

#[no_mangle]
pub unsafe extern "C" fn aclrtDestroyStream(stream: *mut c_void) -> i32 {
    let Some(s) = stream_ref(stream) else { return ACL_ERROR_INVALID_PARAM };
    wait_done(s, s.submitted.load(Ordering::Acquire), None);
    drop(s.tx.lock().unwrap_or_else(|e| e.into_inner()).take());
    drop(Box::from_raw(stream as *mut StreamObj));
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclrtSynchronizeStream(stream: *mut c_void) -> i32 {
    let Some(s) = stream_ref(stream) else { return ACL_ERROR_INVALID_PARAM };
    wait_done(s, s.submitted.load(Ordering::Acquire), None);
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclrtSynchronizeStreamWithTimeout(stream: *mut c_void, timeout_ms: i32) -> i32 {
    let Some(s) = stream_ref(stream) else { return ACL_ERROR_INVALID_PARAM };
    let t = (timeout_ms >= 0).then(|| Duration::from_millis(timeout_ms as u64));
    if wait_done(s, s.submitted.load(Ordering::Acquire), t) {
        ACL_SUCCESS
    } else {
        507000 + 46 // ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
    }
}

struct EventObj {
    at: Mutex<Option<(Arc<Progress>, u64)>>,
}

#[no_mangle]
pub unsafe extern "C" fn aclrtCreateEvent(event: *mut *mut c_void) -> i32 {
    if event.is_null() {
        return ACL_ERROR_INVALID_PARAM;
    }
    *event = Box::into_raw(Box::new(EventObj { at: Mutex::new(None) })) as *mut c_void;
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclrtDestroyEvent(event: *mut c_void) -> i32 {
    if event.is_null() {
        return ACL_ERROR_INVALID_PARAM;
    }
    drop(Box::from_raw(event as *mut EventObj));
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclrtRecordEvent(event: *mut c_void, stream: *mut c_void) -> i32 {
    let (Some(e), Some(s)) = ((event as *const EventObj).as_ref(), stream_ref(stream)) else {
        return ACL_ERROR_INVALID_PARAM;
    };
    *e.at.lock().unwrap_or_else(|p| p.into_inner()) = Some((s.progress.clone(), s.submitted.load(Ordering::Acquire)));
    ACL_SUCCESS
}

/// `status`: 0 not ready, 1 complete (`aclrtEventRecordedStatus`).
#[no_mangle]
pub unsafe extern "C" fn aclrtQueryEventStatus(event: *mut c_void, status: *mut i32) -> i32 {
    let Some(e) = (event as *const EventObj).as_ref() else { return ACL_ERROR_INVALID_PARAM };
    if status.is_null() {
        return ACL_ERROR_INVALID_PARAM;
    }
    let done = match &*e.at.lock().unwrap_or_else(|p| p.into_inner()) {
        None => true,
        Some((p, target)) => *p.done.lock().unwrap_or_else(|e| e.into_inner()) >= *target,
    };
    *status = done as i32;
    ACL_SUCCESS
}

// ---------------------------------------------------------------- wire

fn write_frame(s: &mut TcpStream, ty: u8, body: &[u8]) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(body.len() + 5);
    b.extend_from_slice(&(body.len() as u32).to_le_bytes());
    b.push(ty);
    b.extend_from_slice(body);
    s.write_all(&b)
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut h = [0u8; 5];
    s.read_exact(&mut h)?;
    let n = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
    let mut body = vec![0u8; n];
    s.read_exact(&mut body)?;
    Ok((h[4], body))
}

const HELLO: u8 = 1;
const LINK: u8 = 2;
const COLL: u8 = 3;
const SEND: u8 = 4;
const RECV: u8 = 5;
const SUB: u8 = 6;
const BYE: u8 = 7;
const OK: u8 = 10;
const ERR: u8 = 11;

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]])).unwrap_or(0)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        a.copy_from_slice(s);
    }
    u64::from_le_bytes(a)
}

fn err_body(code: i32, msg: &str) -> Vec<u8> {
    let mut b = code.to_le_bytes().to_vec();
    b.extend_from_slice(msg.as_bytes());
    b
}

// ---------------------------------------------------------------- the hub

/// One contribution to a collective: its header (for the consistency check) and data.
struct Contrib {
    head: [u64; 5],
    data: Vec<u8>,
}

type Conn = Arc<Mutex<TcpStream>>;

#[derive(Default)]
struct HubState {
    n: u32,
    ctrl: HashMap<u32, Conn>,
    data: HashMap<u32, Conn>,
    ready: bool,
    links: HashMap<String, Vec<u32>>,
    colls: HashMap<u64, Vec<Option<Contrib>>>,
    mail: HashMap<(u32, u32), VecDeque<Vec<u8>>>,
    recv_wait: HashMap<(u32, u32), Conn>,
    subs: HashMap<u64, String>,
    broken: Option<String>,
    gone: HashSet<u32>,
}

struct Hub {
    st: Mutex<HubState>,
}

fn reply(c: &Conn, ty: u8, body: &[u8]) {
    let _ = write_frame(&mut c.lock().unwrap_or_else(|e| e.into_inner()), ty, body);
}

/// Start a hub; its address.
fn start_hub(host: &str) -> std::io::Result<String> {
    let l = TcpListener::bind((host, 0))?;
    let addr = l.local_addr()?.to_string();
    let hub = Arc::new(Hub { st: Mutex::new(HubState::default()) });
    let limit = link_timeout(None);
    std::thread::Builder::new().name("standin-hub".into()).spawn(move || {
        l.set_nonblocking(true).ok();
        let started = Instant::now();
        let mut accepted = 0u32;
        loop {
            let want = {
                let st = hub.st.lock().unwrap_or_else(|e| e.into_inner());
                if st.n > 0 {
                    2 * st.n
                } else {
                    u32::MAX
                }
            };
            if accepted >= want || started.elapsed() > limit {
                return;
            }
            match l.accept() {
                Ok((s, _)) => {
                    accepted += 1;
                    s.set_nonblocking(false).ok();
                    s.set_nodelay(true).ok();
                    let h = hub.clone();
                    let _ = std::thread::Builder::new().name("standin-hub-conn".into()).spawn(move || serve(h, s));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    })?;
    Ok(addr)
}

fn serve(hub: Arc<Hub>, s: TcpStream) {
    let Ok(w) = s.try_clone() else { return };
    let conn: Conn = Arc::new(Mutex::new(w));
    let mut r = s;
    let mut me: Option<u32> = None;
    loop {
        let (ty, body) = match read_frame(&mut r) {
            Ok(f) => f,
            Err(_) => {
                if let Some(rank) = me {
                    let mut st = hub.st.lock().unwrap_or_else(|e| e.into_inner());
                    if !st.gone.contains(&rank) {
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

fn break_hub(st: &mut HubState, why: String) {
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
const K_ALL_REDUCE: u64 = 0;
const K_REDUCE: u64 = 1;
const K_BROADCAST: u64 = 2;
const K_ALL_GATHER: u64 = 3;
const K_REDUCE_SCATTER: u64 = 4;
const K_ALL_TO_ALL: u64 = 5;
const K_BARRIER: u64 = 6;

fn kind_name(k: u64) -> &'static str {
    ["AllReduce", "Reduce", "Broadcast", "AllGather", "ReduceScatter", "AlltoAll", "Barrier"]
        .get(k as usize)
        .copied()
        .unwrap_or("?")
}

fn dtype_size(d: u32) -> Option<usize> {
    Some(match d {
        0 | 7 => 1,
        1 | 3 | 8 | 11 => 2,
        2 | 4 | 9 => 4,
        5 | 6 | 10 => 8,
        _ => return None,
    })
}

fn f16_to_f32(h: u16) -> f32 {
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

fn f32_to_f16(f: f32) -> u16 {
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

fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

fn f32_to_bf16(f: f32) -> u16 {
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

fn fold16(acc: &mut [u8], x: &[u8], op: u64, to: fn(u16) -> f32, from: fn(f32) -> u16) {
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
fn fold(acc: &mut [u8], x: &[u8], d: u32, op: u64) {
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
fn compute(all: &[Contrib]) -> Vec<Result<Vec<u8>, String>> {
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

// ---------------------------------------------------------------- communicators

fn link_timeout(exec: Option<Duration>) -> Duration {
    let connect = Duration::from_secs(env_u64("HCCL_CONNECT_TIMEOUT", 120));
    exec.map_or(connect, |e| e.min(connect))
}

struct Comm {
    rank: u32,
    n: u32,
    device: i32,
    buff_bytes: u64,
    exec: Duration,
    exec_set: bool,
    ctrl: Mutex<TcpStream>,
    data: Mutex<TcpStream>,
    /// A second handle of the data connection: destroy shuts it down under a stream task
    /// that waits on it, which then fails.
    data_shut: TcpStream,
    hub: String,
    links: Mutex<HashSet<String>>,
    reserved: AtomicU64,
    async_err: AtomicI32,
    suspended: AtomicBool,
    seq: AtomicU64,
    /// Registered device ranges (`HcclCommRegister`).
    regs: Mutex<register::Registry>,
}

impl Comm {
    /// A request on the control connection, waiting up to `t` for the answer.
    fn ctrl_call(&self, ty: u8, body: &[u8], t: Duration) -> Result<Vec<u8>, (i32, String)> {
        let mut s = self.ctrl.lock().unwrap_or_else(|e| e.into_inner());
        call(&mut s, ty, body, t)
    }

    /// Set up the links `key` stands for, the first time: 2 x the buffer from the pool,
    /// then wait for `parts` members to arrive.
    fn link(&self, key: &str, parts: u32) -> i32 {
        if self.links.lock().unwrap_or_else(|e| e.into_inner()).contains(key) {
            return SUCCESS;
        }
        let need = 2 * self.buff_bytes;
        if !take(self.device, need) {
            set_error(format!(
                "EI0011: Failed to allocate {need} bytes of NPU memory for the links of {key} on rank {} (device {})",
                self.rank, self.device
            ));
            return E_OOM;
        }
        let t = link_timeout(self.exec_set.then_some(self.exec));
        let mut body = parts.to_le_bytes().to_vec();
        body.extend_from_slice(key.as_bytes());
        match self.ctrl_call(LINK, &body, t) {
            Ok(_) => {
                self.reserved.fetch_add(need, Ordering::AcqRel);
                self.links.lock().unwrap_or_else(|e| e.into_inner()).insert(key.to_string());
                SUCCESS
            }
            Err((code, msg)) => {
                give(self.device, need);
                set_error(format!("link set-up of {key} on rank {}: {msg}", self.rank));
                code
            }
        }
    }

    fn fail(&self, code: i32, msg: &str) {
        if self.async_err.compare_exchange(SUCCESS, code, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            set_error(msg.to_string());
        }
    }
}

fn call(s: &mut TcpStream, ty: u8, body: &[u8], t: Duration) -> Result<Vec<u8>, (i32, String)> {
    write_frame(s, ty, body).map_err(|e| (E_REMOTE, format!("hub unreachable: {e}")))?;
    s.set_read_timeout(Some(t.max(Duration::from_millis(1)))).ok();
    match read_frame(s) {
        Ok((OK, b)) => Ok(b),
        Ok((_, b)) => Err((u32_at(&b, 0) as i32, String::from_utf8_lossy(b.get(4..).unwrap_or(&[])).to_string())),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            Err((E_TIMEOUT, format!("no answer within {t:?}")))
        }
        Err(e) => Err((E_REMOTE, format!("connection to the hub lost: {e}"))),
    }
}

/// `HcclCommConfig` fields the stand-in reads: buffer size (MB), exec timeout (s).
unsafe fn read_config(cfg: *const u8) -> Result<(Option<u32>, Option<i32>), String> {
    if cfg.is_null() {
        return Ok((None, None));
    }
    let size = std::ptr::read_unaligned(cfg as *const usize);
    let magic = std::ptr::read_unaligned(cfg.add(8) as *const u32);
    if magic != CONFIG_MAGIC || size < 320 {
        return Err(format!("config not initialised by HcclCommConfigInit (size {size}, magic {magic:#x})"));
    }
    let buff = std::ptr::read_unaligned(cfg.add(24) as *const u32);
    let exec = std::ptr::read_unaligned(cfg.add(316) as *const i32);
    Ok(((buff != NOT_SET).then_some(buff), (exec != NOT_SET as i32 && exec > 0).then_some(exec)))
}

unsafe fn init(n: u32, root: *const u8, rank: u32, cfg: *const u8, out: *mut *mut c_void) -> i32 {
    if let Some(c) = injected("HcclCommInitRootInfoConfig", rank as i64) {
        return c;
    }
    if root.is_null() || out.is_null() {
        return E_PTR;
    }
    let Some(device) = current() else {
        set_error("HcclCommInitRootInfoConfig: no device set on this thread (aclrtSetDevice)".into());
        return E_PARA;
    };
    if n == 0 || rank >= n {
        set_error(format!("HcclCommInitRootInfoConfig: rank {rank} of {n}"));
        return E_PARA;
    }
    let info = std::slice::from_raw_parts(root, ROOT_INFO_BYTES);
    if &info[..16] != MAGIC {
        set_error("HcclCommInitRootInfoConfig: root info not made by HcclGetRootInfo".into());
        return E_PARA;
    }
    let addr = String::from_utf8_lossy(&info[16..80]).trim_end_matches('\0').to_string();
    let (buff_mb, exec) = match read_config(cfg) {
        Ok(v) => v,
        Err(m) => {
            set_error(m);
            return E_PARA;
        }
    };
    let buff_mb = buff_mb.unwrap_or_else(|| env_u64("HCCL_BUFFSIZE", 200) as u32);
    let exec_set = exec.is_some();
    let exec = Duration::from_secs(exec.map(|e| e as u64).unwrap_or_else(|| env_u64("HCCL_EXEC_TIMEOUT", 1836)));
    let t = link_timeout(exec_set.then_some(exec));
    let connect = |chan: u32| -> Result<TcpStream, (i32, String)> {
        let started = Instant::now();
        let mut s = loop {
            match TcpStream::connect(&addr) {
                Ok(s) => break s,
                Err(e) if started.elapsed() > t => return Err((E_TCP_CONNECT, format!("cannot reach {addr}: {e}"))),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        s.set_nodelay(true).ok();
        let mut hello = rank.to_le_bytes().to_vec();
        hello.extend_from_slice(&n.to_le_bytes());
        hello.extend_from_slice(&chan.to_le_bytes());
        write_frame(&mut s, HELLO, &hello).map_err(|e| (E_TCP_CONNECT, e.to_string()))?;
        Ok(s)
    };
    let made = connect(0).and_then(|c| Ok((c, connect(1)?)));
    let (mut ctrl, data) = match made {
        Ok(v) => v,
        Err((code, m)) => {
            set_error(m);
            return code;
        }
    };
    // The hub answers on the control connection once every rank joined on both.
    ctrl.set_read_timeout(Some(t)).ok();
    match read_frame(&mut ctrl) {
        Ok((OK, _)) => {}
        Ok((_, b)) => {
            set_error(String::from_utf8_lossy(b.get(4..).unwrap_or(&[])).to_string());
            return u32_at(&b, 0) as i32;
        }
        Err(e) => {
            set_error(format!("HcclCommInitRootInfoConfig: not every rank joined within {t:?}: {e}"));
            return E_TIMEOUT;
        }
    }
    let data_shut = match data.try_clone() {
        Ok(d) => d,
        Err(e) => {
            set_error(format!("HcclCommInitRootInfoConfig: {e}"));
            return E_INTERNAL;
        }
    };
    let comm = Arc::new(Comm {
        data_shut,
        rank,
        n,
        device,
        buff_bytes: buff_mb as u64 * (1 << 20),
        exec,
        exec_set,
        ctrl: Mutex::new(ctrl),
        data: Mutex::new(data),
        hub: addr,
        links: Mutex::new(HashSet::new()),
        reserved: AtomicU64::new(0),
        async_err: AtomicI32::new(SUCCESS),
        suspended: AtomicBool::new(false),
        seq: AtomicU64::new(0),
        regs: Mutex::new(register::Registry::default()),
    });
    *out = Arc::into_raw(comm) as *mut c_void;
    SUCCESS
}

unsafe fn comm<'a>(c: *mut c_void) -> Option<&'a Comm> {
    (c as *const Comm).as_ref()
}

/// `comm` as an owned handle for a stream task.
unsafe fn comm_arc(c: *mut c_void) -> Arc<Comm> {
    Arc::increment_strong_count(c as *const Comm);
    Arc::from_raw(c as *const Comm)
}

#[no_mangle]
pub unsafe extern "C" fn HcclGetRootInfo(root: *mut u8) -> i32 {
    if let Some(c) = injected("HcclGetRootInfo", -1) {
        return c;
    }
    if root.is_null() {
        return E_PTR;
    }
    let host = std::env::var("ANYCCL_STANDIN_HOST").unwrap_or_else(|_| "127.0.0.1".into());
    let addr = match start_hub(&host) {
        Ok(a) => a,
        Err(e) => {
            set_error(format!("HcclGetRootInfo: cannot listen on {host}: {e}"));
            return E_TCP_CONNECT;
        }
    };
    let info = std::slice::from_raw_parts_mut(root, ROOT_INFO_BYTES);
    info.fill(0);
    info[..16].copy_from_slice(MAGIC);
    let a = addr.as_bytes();
    info[16..16 + a.len().min(64)].copy_from_slice(&a[..a.len().min(64)]);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn HcclCommInitRootInfo(n: u32, root: *const u8, rank: u32, out: *mut *mut c_void) -> i32 {
    init(n, root, rank, std::ptr::null(), out)
}

#[no_mangle]
pub unsafe extern "C" fn HcclCommInitRootInfoConfig(
    n: u32,
    root: *const u8,
    rank: u32,
    cfg: *const u8,
    out: *mut *mut c_void,
) -> i32 {
    init(n, root, rank, cfg, out)
}

#[no_mangle]
pub unsafe extern "C" fn HcclCreateSubCommConfig(
    parent: *mut *mut c_void,
    n: u32,
    ranks: *const u32,
    id: u64,
    sub_rank: u32,
    cfg: *const u8,
    out: *mut *mut c_void,
) -> i32 {
    if parent.is_null() || ranks.is_null() || out.is_null() {
        return E_PTR;
    }
    let Some(p) = comm(*parent) else { return E_PTR };
    if let Some(c) = injected("HcclCreateSubCommConfig", p.rank as i64) {
        return c;
    }
    if std::env::var("ANYCCL_STANDIN_NO_SUBCOMM").is_ok_and(|v| v == "1") {
        set_error("HcclCreateSubCommConfig: not supported by this library (ANYCCL_STANDIN_NO_SUBCOMM=1)".into());
        return E_NOT_SUPPORT;
    }
    let members = std::slice::from_raw_parts(ranks, n as usize);
    if sub_rank >= n || members.get(sub_rank as usize) != Some(&p.rank) || members.iter().any(|&r| r >= p.n) {
        set_error(format!("HcclCreateSubCommConfig: rank {} is not member {sub_rank} of {members:?}", p.rank));
        return E_PARA;
    }
    let addr = match p.ctrl_call(SUB, &id.to_le_bytes(), link_timeout(None)) {
        Ok(a) => a,
        Err((code, m)) => {
            set_error(m);
            return code;
        }
    };
    let mut root = vec![0u8; ROOT_INFO_BYTES];
    root[..16].copy_from_slice(MAGIC);
    root[16..16 + addr.len().min(64)].copy_from_slice(&addr[..addr.len().min(64)]);
    init(n, root.as_ptr(), sub_rank, cfg, out)
}

#[no_mangle]
pub unsafe extern "C" fn HcclCommDestroy(c: *mut c_void) -> i32 {
    let Some(cm) = comm(c) else { return E_PTR };
    if let Some(code) = injected("HcclCommDestroy", cm.rank as i64) {
        return code;
    }
    for s in [&cm.ctrl, &cm.data] {
        if let Ok(mut s) = s.try_lock() {
            let _ = write_frame(&mut s, BYE, &[]);
            let _ = s.shutdown(std::net::Shutdown::Both);
        } else {
            // A stream task is using the connection: closing it makes that task fail.
            cm.suspended.store(true, Ordering::Release);
        }
    }
    let _ = cm.data_shut.shutdown(std::net::Shutdown::Both);
    give(cm.device, cm.reserved.swap(0, Ordering::AcqRel));
    cm.regs.lock().unwrap_or_else(|e| e.into_inner()).clear();
    drop(Arc::from_raw(c as *const Comm));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn HcclCommSuspend(c: *mut c_void) -> i32 {
    let Some(cm) = comm(c) else { return E_PTR };
    cm.suspended.store(true, Ordering::Release);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn HcclCommResume(c: *mut c_void) -> i32 {
    let Some(cm) = comm(c) else { return E_PTR };
    cm.suspended.store(false, Ordering::Release);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn HcclGetRankSize(c: *mut c_void, n: *mut u32) -> i32 {
    match (comm(c), n.is_null()) {
        (Some(cm), false) => {
            *n = cm.n;
            SUCCESS
        }
        _ => E_PTR,
    }
}

#[no_mangle]
pub unsafe extern "C" fn HcclGetRankId(c: *mut c_void, r: *mut u32) -> i32 {
    match (comm(c), r.is_null()) {
        (Some(cm), false) => {
            *r = cm.rank;
            SUCCESS
        }
        _ => E_PTR,
    }
}

#[no_mangle]
pub unsafe extern "C" fn HcclGetCommAsyncError(c: *mut c_void, e: *mut i32) -> i32 {
    let Some(cm) = comm(c) else { return E_PTR };
    if e.is_null() {
        return E_PTR;
    }
    if let Some(code) = injected("HcclGetCommAsyncError", cm.rank as i64) {
        cm.fail(code, "asynchronous error injected by the stand-in");
    }
    *e = cm.async_err.load(Ordering::Acquire);
    SUCCESS
}

#[no_mangle]
pub extern "C" fn HcclGetErrorString(code: i32) -> *const c_char {
    let s: &'static [u8] = match code {
        0 => b"success\0",
        1 => b"parameter error\0",
        2 => b"empty pointer\0",
        3 => b"memory error\0",
        4 => b"internal error\0",
        5 => b"not support feature\0",
        6 => b"not found specific resource\0",
        7 => b"resource unavailable\0",
        8 => b"call system interface error\0",
        9 => b"timeout\0",
        10 => b"open file fail\0",
        11 => b"tcp connect fail\0",
        12 => b"roce connect fail\0",
        13 => b"tcp transfer fail\0",
        14 => b"roce transfer fail\0",
        15 => b"call runtime api fail\0",
        16 => b"call driver api fail\0",
        17 => b"call profiling api fail\0",
        18 => b"call cce api fail\0",
        19 => b"call network api fail\0",
        20 => b"try again\0",
        21 => b"error cqe\0",
        22 => b"error communicator suspending\0",
        23 => b"retry constraint\0",
        24 => b"out of memory\0",
        _ => b"unknown error\0",
    };
    s.as_ptr() as *const c_char
}

#[no_mangle]
pub extern "C" fn HcclGetCommConfigCapability() -> u32 {
    12
}

#[no_mangle]
pub extern "C" fn HcclGroupStart() -> i32 {
    SUCCESS
}

#[no_mangle]
pub extern "C" fn HcclGroupEnd() -> i32 {
    SUCCESS
}

// ---------------------------------------------------------------- operations

#[derive(Clone, Copy)]
struct Ptr(*mut u8);
// SAFETY-equivalent: the caller keeps the memory valid until the stream passed the task.
unsafe impl Send for Ptr {}

/// Checks every data-plane call makes before it links or enqueues.
unsafe fn prologue<'a>(
    call_name: &str,
    c: *mut c_void,
    stream: *mut c_void,
    dtype: u32,
) -> Result<(&'a Comm, &'a StreamObj), i32> {
    let Some(cm) = comm(c) else { return Err(E_PTR) };
    if let Some(code) = injected(call_name, cm.rank as i64) {
        return Err(code);
    }
    let Some(s) = stream_ref(stream) else {
        set_error(format!("{call_name}: null stream"));
        return Err(E_PTR);
    };
    if dtype_size(dtype).is_none() {
        set_error(format!("{call_name}: data type {dtype} is not supported"));
        return Err(E_NOT_SUPPORT);
    }
    if cm.suspended.load(Ordering::Acquire) {
        return Err(E_SUSPENDING);
    }
    let e = cm.async_err.load(Ordering::Acquire);
    if e != SUCCESS {
        return Err(e);
    }
    Ok((cm, s))
}

/// Put `task` (run against the communicator) on the stream.
fn enqueue(
    s: &StreamObj,
    cm: Arc<Comm>,
    task: impl FnOnce(&Comm) -> Result<(), (i32, String)> + Send + 'static,
) -> i32 {
    let ok = s.submit(Box::new(move || {
        if cm.async_err.load(Ordering::Acquire) != SUCCESS {
            return;
        }
        if cm.suspended.load(Ordering::Acquire) {
            cm.fail(E_SUSPENDING, "communicator suspended");
            return;
        }
        if let Err((code, msg)) = task(&cm) {
            cm.fail(code, &msg);
        }
    }));
    if ok {
        SUCCESS
    } else {
        E_INTERNAL
    }
}

/// A collective round trip on the data connection: send `data`, get this rank's output.
fn collective(cm: &Comm, seq: u64, head: [u64; 5], data: &[u8]) -> Result<Vec<u8>, (i32, String)> {
    let mut body = Vec::with_capacity(48 + data.len());
    for h in head {
        body.extend_from_slice(&h.to_le_bytes());
    }
    body.extend_from_slice(&seq.to_le_bytes());
    body.extend_from_slice(data);
    let mut s = cm.data.lock().unwrap_or_else(|e| e.into_inner());
    call(&mut s, COLL, &body, cm.exec)
}

#[allow(clippy::too_many_arguments)]
unsafe fn coll(
    name: &str,
    kind: u64,
    send: *const c_void,
    recv: *mut c_void,
    in_bytes: usize,
    out_bytes: usize,
    dtype: u32,
    op: u32,
    root: u32,
    count: u64,
    c: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    let (cm, s) = match prologue(name, c, stream, dtype) {
        Ok(v) => v,
        Err(e) => return e,
    };
    if kind != K_BROADCAST && kind != K_BARRIER && op > 3 {
        set_error(format!("{name}: reduce op {op} is not supported"));
        return E_PARA;
    }
    if (kind == K_REDUCE || kind == K_BROADCAST) && root >= cm.n {
        set_error(format!("{name}: root {root} of {} ranks", cm.n));
        return E_PARA;
    }
    if (in_bytes > 0 && send.is_null()) || (out_bytes > 0 && recv.is_null()) {
        return E_PTR;
    }
    let r = cm.link(name, cm.n);
    if r != SUCCESS {
        return r;
    }
    let seq = cm.seq.fetch_add(1, Ordering::AcqRel);
    let (sp, rp) = (Ptr(send as *mut u8), Ptr(recv as *mut u8));
    let (n, rank, name) = (cm.n, cm.rank, name.to_string());
    enqueue(s, comm_arc(c), move |cm| {
        let (sp, rp) = (sp, rp);
        // Broadcast: only the root's data matters.
        let input = if kind == K_BROADCAST && rank != root || in_bytes == 0 {
            Vec::new()
        } else {
            std::slice::from_raw_parts(sp.0, in_bytes).to_vec()
        };
        let out = collective(cm, seq, [kind, dtype as u64, op as u64, root as u64, count], &input)?;
        let write = !(kind == K_REDUCE && rank != root) && kind != K_BARRIER;
        if write {
            if out.len() != out_bytes {
                return Err((
                    E_PARA,
                    format!("{name}: {} bytes arrived for a {out_bytes}-byte output ({n} ranks)", out.len()),
                ));
            }
            std::ptr::copy(out.as_ptr(), rp.0, out_bytes);
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn HcclAllReduce(
    send: *mut c_void,
    recv: *mut c_void,
    count: u64,
    dtype: u32,
    op: u32,
    c: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    let b = count as usize * dtype_size(dtype).unwrap_or(0);
    coll("HcclAllReduce", K_ALL_REDUCE, send, recv, b, b, dtype, op, 0, count, c, stream)
}

#[no_mangle]
pub unsafe extern "C" fn HcclReduce(
    send: *mut c_void,
    recv: *mut c_void,
    count: u64,
    dtype: u32,
    op: u32,
    root: u32,
    c: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    let b = count as usize * dtype_size(dtype).unwrap_or(0);
    coll("HcclReduce", K_REDUCE, send, recv, b, b, dtype, op, root, count, c, stream)
}

#[no_mangle]
pub unsafe extern "C" fn HcclBroadcast(
    buf: *mut c_void,
    count: u64,
    dtype: u32,
    root: u32,
    c: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    let b = count as usize * dtype_size(dtype).unwrap_or(0);
    coll("HcclBroadcast", K_BROADCAST, buf, buf, b, b, dtype, 0, root, count, c, stream)
}

#[no_mangle]
pub unsafe extern "C" fn HcclAllGather(
    send: *mut c_void,
    recv: *mut c_void,
    count: u64,
    dtype: u32,
    c: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    let n = comm(c).map(|cm| cm.n as usize).unwrap_or(0);
    let b = count as usize * dtype_size(dtype).unwrap_or(0);
    coll("HcclAllGather", K_ALL_GATHER, send, recv, b, b * n, dtype, 0, 0, count, c, stream)
}

#[no_mangle]
pub unsafe extern "C" fn HcclReduceScatter(
    send: *mut c_void,
    recv: *mut c_void,
    count: u64,
    dtype: u32,
    op: u32,
    c: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    let n = comm(c).map(|cm| cm.n as usize).unwrap_or(0);
    let b = count as usize * dtype_size(dtype).unwrap_or(0);
    coll("HcclReduceScatter", K_REDUCE_SCATTER, send, recv, b * n, b, dtype, op, 0, count, c, stream)
}

#[no_mangle]
pub unsafe extern "C" fn HcclBarrier(c: *mut c_void, stream: *mut c_void) -> i32 {
    coll("HcclBarrier", K_BARRIER, std::ptr::null(), std::ptr::null_mut(), 0, 0, 4, 0, 0, 0, c, stream)
}

#[allow(clippy::too_many_arguments)]
unsafe fn all_to_all(
    name: &str,
    send: *const c_void,
    sc: Vec<u64>,
    sd: Vec<u64>,
    st: u32,
    recv: *const c_void,
    rc: Vec<u64>,
    rd: Vec<u64>,
    rt: u32,
    c: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    let (cm, s) = match prologue(name, c, stream, st) {
        Ok(v) => v,
        Err(e) => return e,
    };
    if st != rt {
        set_error(format!("{name}: send type {st} differs from receive type {rt}"));
        return E_PARA;
    }
    let r = cm.link("HcclAlltoAll", cm.n);
    if r != SUCCESS {
        return r;
    }
    let es = dtype_size(st).unwrap_or(1);
    let seq = cm.seq.fetch_add(1, Ordering::AcqRel);
    let (sp, rp) = (Ptr(send as *mut u8), Ptr(recv as *mut u8));
    let name = name.to_string();
    enqueue(s, comm_arc(c), move |cm| {
        let (sp, rp) = (sp, rp);
        let n = cm.n as usize;
        let mut data: Vec<u8> = sc.iter().flat_map(|&c| (c * es as u64).to_le_bytes()).collect();
        for j in 0..n {
            let p = std::slice::from_raw_parts(sp.0.add(sd[j] as usize * es), sc[j] as usize * es);
            data.extend_from_slice(p);
        }
        let out = collective(cm, seq, [K_ALL_TO_ALL, st as u64, 0, 0, 0], &data)?;
        let mut off = 8 * n;
        for i in 0..n {
            let len = u64_at(&out, 8 * i) as usize;
            if len != rc[i] as usize * es {
                return Err((E_PARA, format!("{name}: rank {i} sent {len} bytes, {} expected", rc[i] as usize * es)));
            }
            std::ptr::copy(out.as_ptr().add(off), rp.0.add(rd[i] as usize * es), len);
            off += len;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn HcclAlltoAll(
    send: *const c_void,
    send_count: u64,
    st: u32,
    recv: *const c_void,
    recv_count: u64,
    rt: u32,
    c: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    let n = comm(c).map(|cm| cm.n as u64).unwrap_or(0);
    let (sc, rc) = (vec![send_count; n as usize], vec![recv_count; n as usize]);
    let sd = (0..n).map(|j| j * send_count).collect();
    let rd = (0..n).map(|j| j * recv_count).collect();
    all_to_all("HcclAlltoAll", send, sc, sd, st, recv, rc, rd, rt, c, stream)
}

#[no_mangle]
pub unsafe extern "C" fn HcclAlltoAllV(
    send: *const c_void,
    send_counts: *const c_void,
    sdispls: *const c_void,
    st: u32,
    recv: *const c_void,
    recv_counts: *const c_void,
    rdispls: *const c_void,
    rt: u32,
    c: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    let Some(cm) = comm(c) else { return E_PTR };
    if [send_counts, sdispls, recv_counts, rdispls].iter().any(|p| p.is_null()) {
        return E_PTR;
    }
    let n = cm.n as usize;
    let v = |p: *const c_void| std::slice::from_raw_parts(p as *const u64, n).to_vec();
    all_to_all("HcclAlltoAllV", send, v(send_counts), v(sdispls), st, recv, v(recv_counts), v(rdispls), rt, c, stream)
}

/// Link the pairs of `peers`, in one global order (no cycle of waits).
fn link_pairs(cm: &Comm, peers: &[u32]) -> i32 {
    let mut keys: Vec<(u32, u32)> = peers.iter().map(|&p| (cm.rank.min(p), cm.rank.max(p))).collect();
    keys.sort();
    keys.dedup();
    for (a, b) in keys {
        let r = cm.link(&format!("p2p {a}-{b}"), if a == b { 1 } else { 2 });
        if r != SUCCESS {
            return r;
        }
    }
    SUCCESS
}

fn send_now(cm: &Comm, to: u32, data: &[u8]) -> Result<(), (i32, String)> {
    let mut body = to.to_le_bytes().to_vec();
    body.extend_from_slice(data);
    let mut s = cm.data.lock().unwrap_or_else(|e| e.into_inner());
    call(&mut s, SEND, &body, cm.exec).map(|_| ())
}

unsafe fn recv_now(cm: &Comm, from: u32, dst: Ptr, bytes: usize) -> Result<(), (i32, String)> {
    let got = {
        let mut s = cm.data.lock().unwrap_or_else(|e| e.into_inner());
        call(&mut s, RECV, &from.to_le_bytes(), cm.exec)?
    };
    if got.len() != bytes {
        return Err((
            E_PARA,
            format!("rank {from} sent {} bytes, the receive on rank {} expects {bytes}", got.len(), cm.rank),
        ));
    }
    std::ptr::copy(got.as_ptr(), dst.0, bytes);
    Ok(())
}

/// The checks and the link set-up of a single send or receive with `peer`.
unsafe fn p2p_prologue<'a>(
    name: &str,
    c: *mut c_void,
    stream: *mut c_void,
    dtype: u32,
    peer: u32,
) -> Result<(&'a Comm, &'a StreamObj), i32> {
    let (cm, s) = prologue(name, c, stream, dtype)?;
    if peer >= cm.n {
        set_error(format!("{name}: peer {peer} of {} ranks", cm.n));
        return Err(E_PARA);
    }
    match link_pairs(cm, &[peer]) {
        SUCCESS => Ok((cm, s)),
        r => Err(r),
    }
}

#[no_mangle]
pub unsafe extern "C" fn HcclSend(
    buf: *mut c_void,
    count: u64,
    dtype: u32,
    dest: u32,
    c: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    let (_, s) = match p2p_prologue("HcclSend", c, stream, dtype, dest) {
        Ok(v) => v,
        Err(e) => return e,
    };
    let (p, bytes) = (Ptr(buf as *mut u8), count as usize * dtype_size(dtype).unwrap_or(0));
    enqueue(s, comm_arc(c), move |cm| {
        let p = p;
        send_now(cm, dest, std::slice::from_raw_parts(p.0, bytes))
    })
}

#[no_mangle]
pub unsafe extern "C" fn HcclRecv(
    buf: *mut c_void,
    count: u64,
    dtype: u32,
    src: u32,
    c: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    let (_, s) = match p2p_prologue("HcclRecv", c, stream, dtype, src) {
        Ok(v) => v,
        Err(e) => return e,
    };
    let (p, bytes) = (Ptr(buf as *mut u8), count as usize * dtype_size(dtype).unwrap_or(0));
    enqueue(s, comm_arc(c), move |cm| recv_now(cm, src, p, bytes))
}

/// `HcclSendRecvItem`: 32 bytes on LP64.
#[repr(C)]
#[derive(Clone, Copy)]
struct Item {
    kind: u32,
    buf: *mut c_void,
    count: u64,
    dtype: u32,
    remote: u32,
}

#[no_mangle]
pub unsafe extern "C" fn HcclBatchSendRecv(items: *mut c_void, n: u32, c: *mut c_void, stream: *mut c_void) -> i32 {
    const _: () = assert!(std::mem::size_of::<Item>() == 32);
    let (cm, s) = match prologue("HcclBatchSendRecv", c, stream, 4) {
        Ok(v) => v,
        Err(e) => return e,
    };
    if items.is_null() && n > 0 {
        return E_PTR;
    }
    let list: Vec<Item> = std::slice::from_raw_parts(items as *const Item, n as usize).to_vec();
    if let Some(bad) = list.iter().find(|i| i.remote >= cm.n || i.kind > 1 || dtype_size(i.dtype).is_none()) {
        set_error(format!(
            "HcclBatchSendRecv: item to rank {} (type {}, dtype {}) is invalid",
            bad.remote, bad.kind, bad.dtype
        ));
        return E_PARA;
    }
    let peers: Vec<u32> = list.iter().map(|i| i.remote).collect();
    let r = link_pairs(cm, &peers);
    if r != SUCCESS {
        return r;
    }
    let list: Vec<(u32, Ptr, usize, u32)> = list
        .iter()
        .map(|i| (i.kind, Ptr(i.buf as *mut u8), i.count as usize * dtype_size(i.dtype).unwrap_or(0), i.remote))
        .collect();
    enqueue(s, comm_arc(c), move |cm| {
        // Sends first (the hub queues them), then receives: no order of items can deadlock.
        for &(kind, p, bytes, peer) in &list {
            if kind == 0 {
                send_now(cm, peer, std::slice::from_raw_parts(p.0, bytes))?;
            }
        }
        for &(kind, p, bytes, peer) in &list {
            if kind == 1 {
                recv_now(cm, peer, p, bytes)?;
            }
        }
        Ok(())
    })
}

/// The hub's address of a communicator (diagnostics).
#[no_mangle]
pub unsafe extern "C" fn anyccl_standin_hub(c: *mut c_void, out: *mut c_char, len: usize) -> i32 {
    let Some(cm) = comm(c) else { return E_PTR };
    let b = cm.hub.as_bytes();
    if out.is_null() || len <= b.len() {
        return E_PARA;
    }
    std::ptr::copy_nonoverlapping(b.as_ptr(), out as *mut u8, b.len());
    *out.add(b.len()) = 0;
    SUCCESS
}
