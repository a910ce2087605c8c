//! The HCCL and ACL stand-in (built by build.rs as `libhccl.so`; see lib.rs for what it
//! models). Standard library only. "Device memory" is host memory counted against a pool,
//! reserved as address space that costs host memory only where it is written (`acl.rs`).
//! Here: return codes, error injection and communicators (init, split, destroy, queries);
//! by API family in `standin/`: ACL (`acl.rs`), graph capture (`graph.rs`), the hub that
//! moves the data (`hub.rs`), the operations (`ops.rs`) and buffer registration
//! (`register.rs`).
#![allow(non_snake_case, clippy::missing_safety_doc)]

#[path = "standin/acl.rs"]
mod acl;
#[path = "standin/graph.rs"]
mod graph;
#[path = "standin/hub.rs"]
mod hub;
#[path = "standin/ops.rs"]
mod ops;
#[path = "standin/register.rs"]
mod register;

use acl::*;
use graph::*;
use hub::*;
use ops::*;

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
