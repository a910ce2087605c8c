//! ACL: device memory counted against a pool per device, the current device per thread,
//! copies, and streams that run their tasks in order on a worker thread, with events.

use super::*;

pub(crate) struct Pool {
    pub(crate) used: u64,
}

pub(crate) fn capacity() -> u64 {
    env_u64("ANYCCL_STANDIN_DEVICE_MEMORY", 64 << 30)
}

pub(crate) fn device_count() -> u32 {
    env_u64("ANYCCL_STANDIN_DEVICES", 8) as u32
}

pub(crate) fn pools() -> &'static Mutex<HashMap<i32, Pool>> {
    static P: OnceLock<Mutex<HashMap<i32, Pool>>> = OnceLock::new();
    P.get_or_init(Default::default)
}

pub(crate) fn take(dev: i32, bytes: u64) -> bool {
    let mut p = pools().lock().unwrap_or_else(|e| e.into_inner());
    let pool = p.entry(dev).or_insert(Pool { used: 0 });
    if pool.used + bytes > capacity() {
        return false;
    }
    pool.used += bytes;
    true
}

pub(crate) fn give(dev: i32, bytes: u64) {
    let mut p = pools().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(pool) = p.get_mut(&dev) {
        pool.used = pool.used.saturating_sub(bytes);
    }
}

pub(crate) fn allocs() -> &'static Mutex<HashMap<usize, (usize, i32)>> {
    static A: OnceLock<Mutex<HashMap<usize, (usize, i32)>>> = OnceLock::new();
    A.get_or_init(Default::default)
}

// Device memory is host memory that costs only what is written: a private anonymous
// mapping without swap reservation, never touched here (the kernel hands out zeroed pages
// at the first write, and reads of untouched pages share the zero page). A pool of 64 GiB
// per device is then address space, not resident memory.
extern "C" {
    fn mmap(addr: *mut c_void, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut c_void;
    fn munmap(addr: *mut c_void, len: usize) -> i32;
    fn madvise(addr: *mut c_void, len: usize, advice: i32) -> i32;
    fn sysconf(name: i32) -> i64;
}

const MADV_DONTNEED: i32 = 4;
const SC_PAGESIZE: i32 = 30;
const PROT_READ: i32 = 0x1;
const PROT_WRITE: i32 = 0x2;
const MAP_PRIVATE: i32 = 0x02;
#[cfg(not(any(target_arch = "mips", target_arch = "mips64")))]
const MAP_ANONYMOUS: i32 = 0x20;
#[cfg(any(target_arch = "mips", target_arch = "mips64"))]
const MAP_ANONYMOUS: i32 = 0x800;
#[cfg(not(any(
    target_arch = "mips",
    target_arch = "mips64",
    target_arch = "powerpc",
    target_arch = "powerpc64",
    target_arch = "sparc64"
)))]
const MAP_NORESERVE: i32 = 0x4000;
#[cfg(any(target_arch = "mips", target_arch = "mips64"))]
const MAP_NORESERVE: i32 = 0x400;
#[cfg(any(target_arch = "powerpc", target_arch = "powerpc64", target_arch = "sparc64"))]
const MAP_NORESERVE: i32 = 0x40;

/// `bytes` (at least one) of zeroed, page-aligned memory, reserved and not touched.
pub(crate) fn reserve(bytes: usize) -> Option<*mut u8> {
    let flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    // SAFETY: a new anonymous mapping at an address the kernel picks: nothing else is
    // affected.
    let p = unsafe { mmap(std::ptr::null_mut(), bytes.max(1), PROT_READ | PROT_WRITE, flags, -1, 0) };
    // MAP_FAILED is (void *)-1.
    (p as isize != -1 && !p.is_null()).then_some(p as *mut u8)
}

/// Unmap what [`reserve`] gave for `bytes`.
///
/// # Safety
/// `p` came from `reserve(bytes)` and is not used again.
pub(crate) unsafe fn release(p: *mut u8, bytes: usize) {
    // SAFETY: per the caller, the whole mapping, unmapped once.
    let _ = unsafe { munmap(p as *mut c_void, bytes.max(1)) };
}

/// Zero `count` bytes at `dst` (`aclrtMemset` to 0, which the backend does on every
/// allocation, as ACL's memory is not zeroed): inside an allocation, its whole pages go back
/// to the kernel (`MADV_DONTNEED`: a private anonymous page reads as zero again and costs
/// nothing until written) and only the ragged ends are written; elsewhere every byte is.
///
/// # Safety
/// `dst` addresses `count` writable bytes.
pub(crate) unsafe fn zero(dst: *mut u8, count: usize) {
    let (start, end) = (dst as usize, dst as usize + count);
    // SAFETY: a plain query.
    let page = usize::try_from(unsafe { sysconf(SC_PAGESIZE) }).unwrap_or(0).max(1);
    let (first, last) = (start.next_multiple_of(page), end / page * page);
    let ours = allocs()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|(&base, &(size, _))| start >= base && end <= base + size);
    if ours && first < last {
        // SAFETY: whole pages of one of our private anonymous mappings (`reserve`): they
        // read as zero after this; the caller owns the bytes.
        if unsafe { madvise(first as *mut c_void, last - first, MADV_DONTNEED) } == 0 {
            // SAFETY: the ends, inside `[dst, dst + count)`.
            unsafe {
                std::ptr::write_bytes(dst, 0, first - start);
                std::ptr::write_bytes(last as *mut u8, 0, end - last);
            }
            return;
        }
    }
    // SAFETY: per the caller.
    unsafe { std::ptr::write_bytes(dst, 0, count) };
}

pub(crate) fn current() -> Option<i32> {
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
    let Some(p) = reserve(size) else {
        give(dev, size as u64);
        set_error(format!("aclrtMalloc: cannot reserve {size} bytes of address space for device {dev}"));
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    };
    allocs().lock().unwrap_or_else(|e| e.into_inner()).insert(p as usize, (size, dev));
    *ptr = p as *mut c_void;
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclrtFree(ptr: *mut c_void) -> i32 {
    let Some((size, dev)) = allocs().lock().unwrap_or_else(|e| e.into_inner()).remove(&(ptr as usize)) else {
        return ACL_ERROR_INVALID_PARAM;
    };
    release(ptr as *mut u8, size);
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
    let run: Run = Arc::new(move |_| {
        let (d, sp) = (d, sp);
        std::ptr::copy(sp.0, d.0, count)
    });
    if s.put(Node { numbered: None, run }) {
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
    if value as u8 == 0 {
        zero(dst as *mut u8, count);
    } else {
        std::ptr::write_bytes(dst as *mut u8, value as u8, count);
    }
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

pub(crate) type Task = Box<dyn FnOnce() + Send>;

pub(crate) struct Progress {
    pub(crate) done: Mutex<u64>,
    pub(crate) cv: Condvar,
}

pub(crate) struct StreamObj {
    pub(crate) tx: Mutex<Option<mpsc::Sender<(u64, Task)>>>,
    pub(crate) submitted: AtomicU64,
    pub(crate) progress: Arc<Progress>,
    /// The capture this stream is in (`graph.rs`); an ended one no longer counts.
    pub(crate) capture: Mutex<Option<Arc<Capture>>>,
}

impl StreamObj {
    /// Run `t` once, in order (the worker's queue).
    pub(crate) fn submit(&self, t: Task) -> bool {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = tx.as_ref() else { return false };
        let seq = self.submitted.fetch_add(1, Ordering::AcqRel) + 1;
        tx.send((seq, t)).is_ok()
    }

    /// The stream's identity within a capture.
    pub(crate) fn key(&self) -> usize {
        self as *const StreamObj as usize
    }

    /// The capture under way on this stream, if any.
    pub(crate) fn capturing(&self) -> Option<Arc<Capture>> {
        let mut c = self.capture.lock().unwrap_or_else(|e| e.into_inner());
        if c.as_ref().is_some_and(|c| c.ended()) {
            *c = None;
        }
        c.clone()
    }

    /// Put a task on the stream: recorded while it captures, else run once.
    pub(crate) fn put(&self, node: Node) -> bool {
        match self.capturing() {
            Some(cap) => match cap.record(self.key(), node) {
                Ok(()) => true,
                // The capture ended since: the task runs as if put after the end.
                Err(node) => node.issue(self),
            },
            None => node.issue(self),
        }
    }

    /// `Err` (the capture invalidated) when the stream captures: a host wait for it would
    /// never end, since its work is recorded, not run.
    pub(crate) fn refuse_host_wait(&self, call: &str) -> Result<(), i32> {
        match self.capturing() {
            Some(cap) => {
                let why = format!("{call} on a capturing stream");
                set_error(format!("{call}: the stream is capturing a graph (the capture is invalidated)"));
                cap.invalidate(why);
                Err(ACL_ERROR_INVALID_PARAM)
            }
            None => Ok(()),
        }
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
    let s = Box::new(StreamObj {
        tx: Mutex::new(Some(tx)),
        submitted: AtomicU64::new(0),
        progress,
        capture: Mutex::new(None),
    });
    *stream = Box::into_raw(s) as *mut c_void;
    ACL_SUCCESS
}

pub(crate) unsafe fn stream_ref<'a>(s: *mut c_void) -> Option<&'a StreamObj> {
    (s as *const StreamObj).as_ref()
}

pub(crate) fn wait_done(s: &StreamObj, target: u64, timeout: Option<Duration>) -> bool {
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
    if let Err(code) = s.refuse_host_wait("aclrtSynchronizeStream") {
        return code;
    }
    wait_done(s, s.submitted.load(Ordering::Acquire), None);
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclrtSynchronizeStreamWithTimeout(stream: *mut c_void, timeout_ms: i32) -> i32 {
    let Some(s) = stream_ref(stream) else { return ACL_ERROR_INVALID_PARAM };
    if let Err(code) = s.refuse_host_wait("aclrtSynchronizeStreamWithTimeout") {
        return code;
    }
    let t = (timeout_ms >= 0).then(|| Duration::from_millis(timeout_ms as u64));
    if wait_done(s, s.submitted.load(Ordering::Acquire), t) {
        ACL_SUCCESS
    } else {
        507000 + 46 // ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
    }
}

/// Where an event was last recorded.
#[derive(Clone)]
pub(crate) enum Recorded {
    /// Behind the stream's first `.1` tasks.
    Run(Arc<Progress>, u64),
    /// In a capture, behind the first `pos` tasks stream `stream` recorded there.
    Captured { cap: Arc<Capture>, stream: usize, pos: u64 },
}

pub(crate) struct EventObj {
    pub(crate) at: Mutex<Option<Recorded>>,
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
    RECORDS.fetch_add(1, Ordering::Relaxed);
    let at = match s.capturing() {
        Some(cap) => Recorded::Captured { pos: cap.position(s.key()), cap, stream: s.key() },
        None => Recorded::Run(s.progress.clone(), s.submitted.load(Ordering::Acquire)),
    };
    *e.at.lock().unwrap_or_else(|p| p.into_inner()) = Some(at);
    ACL_SUCCESS
}

/// Events recorded so far in this process (`aclrtRecordEvent` calls that recorded).
static RECORDS: AtomicU64 = AtomicU64::new(0);

/// Test hook: the number of events recorded in this process so far, so a test can count
/// what a run of operations costs the host.
#[no_mangle]
pub extern "C" fn anyccl_standin_events_recorded() -> u64 {
    RECORDS.load(Ordering::Relaxed)
}

/// The stream waits (without blocking the caller) for the work before the event's last
/// record at the time of this call; an event never recorded holds nothing back. An event
/// recorded in a capture brings a stream that is not capturing into it (a fork), and joins
/// the recording stream's work so far into the waiter's (a join); a capturing stream may
/// not wait for work outside its capture.
#[no_mangle]
pub unsafe extern "C" fn aclrtStreamWaitEvent(stream: *mut c_void, event: *mut c_void) -> i32 {
    let (Some(s), Some(e)) = (stream_ref(stream), (event as *const EventObj).as_ref()) else {
        return ACL_ERROR_INVALID_PARAM;
    };
    let Some(at) = e.at.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
        return ACL_SUCCESS;
    };
    let mine = s.capturing();
    match at {
        Recorded::Captured { cap, stream: from, pos } => {
            if cap.ended() {
                set_error("aclrtStreamWaitEvent: the event was recorded in a capture that has ended".into());
                return ACL_ERROR_INVALID_PARAM;
            }
            match mine {
                Some(m) if !Arc::ptr_eq(&m, &cap) => {
                    set_error("aclrtStreamWaitEvent: the event belongs to another capture".into());
                    cap.invalidate("a stream of another capture waited for its event".into());
                    return ACL_ERROR_INVALID_PARAM;
                }
                Some(_) => {}
                None => {
                    cap.add(s.key());
                    *s.capture.lock().unwrap_or_else(|p| p.into_inner()) = Some(cap.clone());
                }
            }
            cap.join(from, pos);
            ACL_SUCCESS
        }
        Recorded::Run(progress, target) => {
            if let Some(m) = mine {
                set_error("aclrtStreamWaitEvent: a capturing stream waits for work outside the capture".into());
                m.invalidate("a wait for an event recorded outside the capture".into());
                return ACL_ERROR_INVALID_PARAM;
            }
            let waited = s.submit(Box::new(move || {
                let mut d = progress.done.lock().unwrap_or_else(|e| e.into_inner());
                while *d < target {
                    d = progress.cv.wait(d).unwrap_or_else(|e| e.into_inner());
                }
            }));
            if waited {
                ACL_SUCCESS
            } else {
                ACL_ERROR_INVALID_PARAM
            }
        }
    }
}

/// Test hook: the stream's next task sleeps `ms` milliseconds (an engine's long kernel).
#[no_mangle]
pub unsafe extern "C" fn anyccl_standin_stream_sleep(stream: *mut c_void, ms: u32) -> i32 {
    let Some(s) = stream_ref(stream) else { return ACL_ERROR_INVALID_PARAM };
    let run: Run = Arc::new(move |_| std::thread::sleep(Duration::from_millis(u64::from(ms))));
    if s.put(Node { numbered: None, run }) {
        ACL_SUCCESS
    } else {
        ACL_ERROR_INVALID_PARAM
    }
}

/// `status`: 0 complete, 1 not ready (`aclrtStreamStatus`): whether every task submitted to
/// the stream so far has run. A capturing stream refuses it (and its capture is invalidated),
/// as a host wait there is.
#[no_mangle]
pub unsafe extern "C" fn aclrtStreamQuery(stream: *mut c_void, status: *mut i32) -> i32 {
    let Some(s) = stream_ref(stream) else { return ACL_ERROR_INVALID_PARAM };
    if status.is_null() {
        return ACL_ERROR_INVALID_PARAM;
    }
    if let Err(code) = s.refuse_host_wait("aclrtStreamQuery") {
        return code;
    }
    // Submitted first: done at least that far means every task submitted before the call ran.
    let submitted = s.submitted.load(Ordering::Acquire);
    let done = *s.progress.done.lock().unwrap_or_else(|e| e.into_inner()) >= submitted;
    *status = if done { 0 } else { 1 };
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
        Some(Recorded::Run(p, target)) => *p.done.lock().unwrap_or_else(|e| e.into_inner()) >= *target,
        Some(Recorded::Captured { .. }) => {
            set_error("aclrtQueryEventStatus: the event was recorded in a capture (it marks no run)".into());
            return ACL_ERROR_INVALID_PARAM;
        }
    };
    *status = done as i32;
    ACL_SUCCESS
}
