//! The operations: each HCCL call validated, then queued on its stream as a task that talks
//! to the hub.

use super::*;

#[derive(Clone, Copy)]
pub(crate) struct Ptr(pub(crate) *mut u8);
// SAFETY-equivalent: the caller keeps the memory valid until the stream passed the task
// (every replay's task, for a recorded one).
unsafe impl Send for Ptr {}
// SAFETY-equivalent: only the address is shared; which threads touch the memory (a
// stream's worker, or several streams' workers running replays of one capture) is the
// program's to order, as on a device.
unsafe impl Sync for Ptr {}

/// Checks every data-plane call makes before it links or enqueues.
pub(crate) unsafe fn prologue<'a>(
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

/// Put `task` (run against the communicator with its sequence number) on the stream, or
/// into the stream's capture. `numbered`: a collective, whose every issue takes the
/// communicator's next sequence number.
pub(crate) fn enqueue(
    s: &StreamObj,
    cm: Arc<Comm>,
    numbered: bool,
    task: impl Fn(&Comm, u64) -> Result<(), (i32, String)> + Send + Sync + 'static,
) -> i32 {
    let numbered = numbered.then(|| cm.clone());
    let run: Run = Arc::new(move |seq| {
        if cm.async_err.load(Ordering::Acquire) != SUCCESS {
            return;
        }
        if cm.suspended.load(Ordering::Acquire) {
            cm.fail(E_SUSPENDING, "communicator suspended");
            return;
        }
        if let Err((code, msg)) = task(&cm, seq) {
            cm.fail(code, &msg);
        }
    });
    let ok = s.put(Node { numbered, run });
    if ok {
        SUCCESS
    } else {
        E_INTERNAL
    }
}

/// A collective round trip on the data connection: send `data`, get this rank's output.
pub(crate) fn collective(cm: &Comm, seq: u64, head: [u64; 5], data: &[u8]) -> Result<Vec<u8>, (i32, String)> {
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
pub(crate) unsafe fn coll(
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
    let (sp, rp) = (Ptr(send as *mut u8), Ptr(recv as *mut u8));
    let (n, rank, name) = (cm.n, cm.rank, name.to_string());
    enqueue(s, comm_arc(c), true, move |cm, seq| {
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
pub(crate) unsafe fn all_to_all(
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
    let (sp, rp) = (Ptr(send as *mut u8), Ptr(recv as *mut u8));
    let name = name.to_string();
    enqueue(s, comm_arc(c), true, move |cm, seq| {
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
pub(crate) fn link_pairs(cm: &Comm, peers: &[u32]) -> i32 {
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

pub(crate) fn send_now(cm: &Comm, to: u32, data: &[u8]) -> Result<(), (i32, String)> {
    let mut body = to.to_le_bytes().to_vec();
    body.extend_from_slice(data);
    let mut s = cm.data.lock().unwrap_or_else(|e| e.into_inner());
    call(&mut s, SEND, &body, cm.exec).map(|_| ())
}

pub(crate) unsafe fn recv_now(cm: &Comm, from: u32, dst: Ptr, bytes: usize) -> Result<(), (i32, String)> {
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
pub(crate) unsafe fn p2p_prologue<'a>(
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
    enqueue(s, comm_arc(c), false, move |cm, _| {
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
    enqueue(s, comm_arc(c), false, move |cm, _| recv_now(cm, src, p, bytes))
}

/// `HcclSendRecvItem`: 32 bytes on LP64.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Item {
    pub(crate) kind: u32,
    pub(crate) buf: *mut c_void,
    pub(crate) count: u64,
    pub(crate) dtype: u32,
    pub(crate) remote: u32,
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
    enqueue(s, comm_arc(c), false, move |cm, _| {
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
