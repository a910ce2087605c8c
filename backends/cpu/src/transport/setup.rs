//! Building a communicator's mesh: every rank publishes its address, host and cache in the
//! store, connects to the lower ranks and accepts the higher ones over TCP, and, with the
//! ranks of its host, maps the shared-memory segments that carry their messages.

use super::by_ref::by_ref_sizes;
use super::local::ShmLink;
use super::*;

fn hello(ns: &str, rank: usize, size: usize) -> [u8; 24] {
    let mut b = [0u8; 24];
    b[..8].copy_from_slice(&MAGIC.to_le_bytes());
    b[8..16].copy_from_slice(&anyccl_core::stable_hash(ns.bytes()).to_le_bytes());
    b[16..20].copy_from_slice(&(rank as u32).to_le_bytes());
    b[20..24].copy_from_slice(&(size as u32).to_le_bytes());
    b
}

/// The connect's timeout while `what`, after waiting since `started` for the ranks `missing`.
fn timeout(ctx: &Ctx, what: &str, missing: &[usize], started: Instant) -> Error {
    ctx.timeout("connect", started.elapsed(), format!("{what}: ranks {missing:?} never arrived"))
}

impl Mesh {
    /// Build the mesh: publish this rank's listening address under `ns`, connect to lower
    /// ranks, accept higher ranks. Every rank of the communicator calls this.
    #[allow(clippy::too_many_arguments)] // the connect's identity, deadlines and links
    pub(crate) async fn connect(
        store: &dyn Store,
        ns: &str,
        label: &str,
        rank: usize,
        size: usize,
        deadline: Instant,
        op_timeout: Duration,
        links: Option<Links>,
    ) -> Result<Mesh> {
        let started = Instant::now();
        let ctx = Ctx::new("cpu", rank, label);
        let inbox_limit = crate::settings::max_inbox_bytes(&ctx)?;
        let host = crate::settings::host(&ctx)?;
        let links = match links {
            Some(l) => l,
            None => Links::from_env(&ctx)?,
        };
        let listener = tokio::net::TcpListener::bind((host.as_str(), 0))
            .await
            .map_err(|e| Error::unavailable("cpu", format!("cannot listen on {host}: {e} (set ANYCCL_CPU_HOST)")))?;
        let me = listener.local_addr().map_err(|e| Error::unavailable("cpu", e.to_string()))?;
        let split = if let Links::Hosts(k) = links { Some(k) } else { None };
        let host_of_me = if links == Links::Tcp { "-".to_string() } else { shm::host_id(rank, split) };
        let l3 = crate::cache::L3::this_host();
        let (my_step, my_l3) = (crate::cache::L3::step(l3), crate::cache::L3::tag(l3));
        let my_cpus = crate::cache::allowed_cpus().unwrap_or_else(|| "-".into());
        store
            .set(&format!("{ns}/addr/{rank}"), format!("{me} {host_of_me} {my_step} {my_l3} {my_cpus}").as_bytes())
            .await?;
        // Every rank's address, host, whole-buffer step, L3 and CPUs, in one request.
        let keys: Vec<String> = (0..size).map(|r| format!("{ns}/addr/{r}")).collect();
        let got = store.wait_many(&keys, deadline).await?;
        let missing: Vec<usize> = got.iter().enumerate().filter(|(_, v)| v.is_none()).map(|(r, _)| r).collect();
        if !missing.is_empty() {
            return Err(timeout(&ctx, "waiting for addresses", &missing, started));
        }
        let mut addrs = Vec::with_capacity(size);
        let mut hosts = Vec::with_capacity(size);
        let mut steps = Vec::with_capacity(size);
        let mut l3s = Vec::with_capacity(size);
        let mut cpus = Vec::with_capacity(size);
        for (r, v) in got.into_iter().enumerate() {
            let v = String::from_utf8_lossy(&v.unwrap_or_default()).into_owned();
            let mut it = v.split(' ');
            let malformed = || Error::store_fatal(format!("malformed address under '{}'", keys[r]));
            let a: SocketAddr = it.next().and_then(|a| a.parse().ok()).ok_or_else(malformed)?;
            let h = it.next().ok_or_else(malformed)?;
            let s: usize = it.next().and_then(|s| s.parse().ok()).ok_or_else(malformed)?;
            let l = it.next().ok_or_else(malformed)?;
            let c = it.next().ok_or_else(malformed)?;
            addrs.push(a);
            hosts.push(h.to_string());
            steps.push(s);
            l3s.push(l.to_string());
            cpus.push(c.to_string());
        }
        // The group's step: the smallest, and none from a host whose ranks run under several
        // L3s (ranks pinned to cores of different sockets each see their own L3 as shared).
        let one_l3 = crate::cache::one_l3(&hosts, &l3s);
        let step = steps.iter().zip(&one_l3).map(|(&s, &one)| if one { s } else { 0 }).min().unwrap_or(0);
        let ring_streaming = !one_l3[rank] || crate::cache::L3::ring_streaming(l3);
        let locals: Vec<usize> =
            if host_of_me == "-" { vec![rank] } else { (0..size).filter(|&r| hosts[r] == host_of_me).collect() };
        let crowded = crate::cache::crowded(locals.iter().map(|&r| cpus[r].as_str()), crate::cache::quota(&my_cpus));
        let crowded_anywhere = crate::cache::any_host_crowded(&hosts, &cpus);
        let shm = if locals.len() > 1 {
            shm_links(store, ns, &ctx, size, &locals, Shape { ring_streaming, crowded }, deadline, started).await?
        } else {
            (0..size).map(|_| None).collect()
        };

        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        // Connect to every lower rank.
        // `peer` is a rank: it names errors, not only a slot of `streams`.
        #[allow(clippy::needless_range_loop)]
        for peer in 0..rank {
            let addr = addrs[peer];
            let mut s = loop {
                match tokio::time::timeout_at(deadline.into(), tokio::net::TcpStream::connect(addr)).await {
                    Err(_) => return Err(timeout(&ctx, "connecting", &[peer], started)),
                    Ok(Ok(s)) => break s,
                    Ok(Err(e)) if Instant::now() < deadline => {
                        tracing::debug!("connect to rank {peer} at {addr}: {e}; retrying");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Ok(Err(e)) => {
                        return Err(ctx
                            .peer_failed(Some(peer), format!("cannot connect to {addr}: {e}"))
                            .with_source(e))
                    }
                }
            };
            use tokio::io::AsyncWriteExt;
            s.write_all(&hello(ns, rank, size))
                .await
                .map_err(|e| ctx.peer_failed(Some(peer), format!("hello to {addr} failed: {e}")).with_source(e))?;
            streams[peer] = Some(into_std(s, &ctx, op_timeout)?);
        }
        // Accept every higher rank.
        let ns_hash = anyccl_core::stable_hash(ns.bytes());
        let mut pending: Vec<usize> = (rank + 1..size).collect();
        while !pending.is_empty() {
            let (mut s, from) = match tokio::time::timeout_at(deadline.into(), listener.accept()).await {
                Err(_) => return Err(timeout(&ctx, "accepting connections", &pending, started)),
                Ok(Err(e)) => {
                    tracing::warn!("accept failed: {e}");
                    continue;
                }
                Ok(Ok(x)) => x,
            };
            use tokio::io::AsyncReadExt;
            let mut h = [0u8; 24];
            let got = tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut h)).await;
            if !matches!(got, Ok(Ok(_))) {
                tracing::warn!("connection from {from} sent no hello; dropped");
                continue;
            }
            let magic = u64::from_le_bytes(h[..8].try_into().unwrap_or_default());
            let nsh = u64::from_le_bytes(h[8..16].try_into().unwrap_or_default());
            let peer = u32::from_le_bytes(h[16..20].try_into().unwrap_or_default()) as usize;
            let psize = u32::from_le_bytes(h[20..24].try_into().unwrap_or_default()) as usize;
            if magic != MAGIC || nsh != ns_hash || psize != size || !pending.contains(&peer) {
                tracing::warn!("connection from {from} is not an expected peer of '{label}'; dropped");
                continue;
            }
            pending.retain(|&p| p != peer);
            streams[peer] = Some(into_std(s, &ctx, op_timeout)?);
        }

        let mailbox = Arc::new(Mailbox::new(size, inbox_limit));
        let mut writers = Vec::with_capacity(size);
        let mut ctl = Vec::with_capacity(size);
        let mut readers = Vec::new();
        for (peer, s) in streams.into_iter().enumerate() {
            match s {
                None => {
                    writers.push(None);
                    ctl.push(None);
                }
                Some(s) => {
                    let clone = || s.try_clone().map_err(|e| Error::unavailable("cpu", format!("socket clone: {e}")));
                    let r = clone()?;
                    ctl.push(Some(clone()?));
                    let mb = mailbox.clone();
                    let h = std::thread::Builder::new()
                        .name(format!("anyccl-cpu-rx{rank}<{peer}"))
                        .spawn(move || read_loop(r, peer, mb))
                        .map_err(|e| Error::unavailable("cpu", format!("cannot start reader thread: {e}")))?;
                    readers.push(h);
                    writers.push(Some(Mutex::new(s)));
                }
            }
        }
        let by_ref_sizes = by_ref_sizes(&ctx, crowded)?;
        Ok(Mesh {
            ctx,
            rank,
            size,
            label: label.into(),
            links,
            op_timeout,
            step,
            crowded_anywhere,
            writers,
            ctl,
            shm,
            by_ref_sizes,
            scratch: Mutex::new(Vec::new()),
            bufs: crate::bufs::Pool::new(inbox_limit),
            mailbox,
            readers: Mutex::new(readers),
        })
    }
}

fn into_std(s: tokio::net::TcpStream, ctx: &Ctx, op_timeout: Duration) -> Result<TcpStream> {
    let s = s.into_std().map_err(|e| Error::unavailable("cpu", format!("socket: {e}")))?;
    // A zero timeout means "none" to the socket layer: keep at least a millisecond.
    let send_timeout = op_timeout.max(Duration::from_millis(1));
    s.set_nonblocking(false)
        .and_then(|_| s.set_nodelay(true))
        .and_then(|_| s.set_write_timeout(Some(send_timeout)))
        .map_err(|e| ctx.peer_failed(None, format!("socket setup: {e}")).with_source(e))?;
    Ok(s)
}

/// What the ranks of a host told each other that shapes its links.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    /// Whether large messages go into the rings with streaming stores by default (not where
    /// the host's ranks run under one large L3: [`crate::cache::L3::ring_streaming`]).
    pub(super) ring_streaming: bool,
    /// Whether the host's ranks outnumber the CPUs they may run on together
    /// ([`crate::cache::crowded`]).
    pub(super) crowded: bool,
}

/// Create this rank's segment, learn the segments of the other ranks of its host through
/// the store, and map them: a link to each.
#[allow(clippy::too_many_arguments)] // the connect's identity and deadline
pub(super) async fn shm_links(
    store: &dyn Store,
    ns: &str,
    ctx: &Ctx,
    size: usize,
    locals: &[usize],
    shape: Shape,
    deadline: Instant,
    started: Instant,
) -> Result<Vec<Option<ShmLink>>> {
    let (rank, label) = (ctx.rank, ctx.group.as_str());
    let fail = |what: String| {
        Error::unavailable(
            "cpu",
            format!(
                "rank {rank} of '{label}': shared memory with the ranks {locals:?} of its host: {what} (set \
                 ANYCCL_CPU_LINKS=tcp to use TCP between them)"
            ),
        )
    };
    let layout = shm::Layout { locals: locals.len(), ring: crate::settings::ring_bytes(locals.len(), ctx)? };
    let own = Arc::new(shm::Segment::create(layout.segment_bytes()).map_err(fail)?);
    shm::init_rings(&own, layout);
    let fd = own.fd().unwrap_or(-1);
    store
        .set(
            &format!("{ns}/seg/{rank}"),
            format!("{} {fd} {} {}", std::process::id(), layout.ring, own.addr()).as_bytes(),
        )
        .await?;
    let keys: Vec<String> = locals.iter().map(|r| format!("{ns}/seg/{r}")).collect();
    let got = store.wait_many(&keys, deadline).await?;
    let missing: Vec<usize> = locals.iter().zip(&got).filter(|(_, v)| v.is_none()).map(|(r, _)| *r).collect();
    if !missing.is_empty() {
        return Err(timeout(ctx, "waiting for shared-memory segments", &missing, started));
    }
    // Every local peer maps this rank's segment before any connect returns: a rank that
    // finished early and dropped its communicator would close its descriptor before a slower
    // peer opened it through `/proc`. A rank that cannot map says why, so the others fail at
    // once instead of at the deadline.
    let mapped = map_peers(ctx, &own, layout, locals, got, shape, size, ns, &fail);
    let mine = match &mapped {
        Ok(_) => "ok".to_string(),
        Err(e) => format!("! {e}"),
    };
    store.set(&format!("{ns}/mapped/{rank}"), mine.as_bytes()).await?;
    let links = mapped?;
    let keys: Vec<String> = locals.iter().map(|r| format!("{ns}/mapped/{r}")).collect();
    let got = store.wait_many(&keys, deadline).await?;
    let missing: Vec<usize> = locals.iter().zip(&got).filter(|(_, v)| v.is_none()).map(|(r, _)| *r).collect();
    if !missing.is_empty() {
        return Err(timeout(ctx, "waiting for the peers to map the shared-memory segments", &missing, started));
    }
    for (peer, v) in locals.iter().zip(got.iter().flatten()) {
        if let Some(why) = String::from_utf8_lossy(v).strip_prefix("! ") {
            return Err(fail(format!("rank {peer} could not map the segments: {why}")));
        }
    }
    tracing::debug!(
        backend = "cpu",
        group = label,
        rank,
        locals = locals.len(),
        ring_bytes = layout.ring,
        segment_bytes = layout.segment_bytes(),
        host_bytes = layout.segment_bytes() * locals.len(),
        "shared memory connected: {} bytes in this rank's segment, {} on the host",
        layout.segment_bytes(),
        layout.segment_bytes() * locals.len()
    );
    Ok(links)
}

/// Map every local peer's segment (as `got` from the store names them) and make the links.
#[allow(clippy::too_many_arguments)] // One step of the connect: every argument is a part of it.
fn map_peers(
    ctx: &Ctx,
    own: &Arc<shm::Segment>,
    layout: shm::Layout,
    locals: &[usize],
    got: Vec<Option<Vec<u8>>>,
    shape: Shape,
    size: usize,
    ns: &str,
    fail: &dyn Fn(String) -> Error,
) -> Result<Vec<Option<ShmLink>>> {
    let (rank, label) = (ctx.rank, ctx.group.as_str());
    let patience = shm::Patience::for_host(shape.crowded, ctx)?;
    let stream_min = crate::settings::ring_stream_min(shape.ring_streaming, ctx)?;
    let me_local = locals.iter().position(|&r| r == rank).unwrap_or(0);
    let mut links: Vec<Option<ShmLink>> = (0..size).map(|_| None).collect();
    for (i, (&peer, v)) in locals.iter().zip(got).enumerate() {
        if peer == rank {
            continue;
        }
        let v = String::from_utf8_lossy(&v.unwrap_or_default()).into_owned();
        let mut it = v.split(' ').map(|x| x.parse::<i64>().ok());
        let (Some(Some(pid)), Some(Some(fd)), Some(Some(ring)), Some(Some(addr))) =
            (it.next(), it.next(), it.next(), it.next())
        else {
            return Err(Error::store_fatal(format!("malformed segment under '{ns}/seg/{peer}'")));
        };
        if ring as usize != layout.ring {
            return Err(ctx.invalid(
                "connect",
                "environment",
                format!(
                    "rank {peer} uses rings of {ring} bytes, this rank {} (ANYCCL_CPU_SHM_RING_BYTES differs)",
                    layout.ring
                ),
            ));
        }
        let seg = shm::Segment::open(pid as u32, fd as i32, layout.segment_bytes())
            .map_err(|e| fail(format!("rank {peer}: {e}")))?;
        let (tx, rx) = shm::link(own, &Arc::new(seg), layout, me_local, i, patience, stream_min);
        // May this process read the peer's memory? (Not where a security module forbids
        // it.) The peer reads the answer before its first large message to this rank.
        let mut probe = [0u8; 8];
        let readable = shm::read_remote(pid as i32, addr as usize, &mut probe);
        if let Err(e) = &readable {
            tracing::debug!("rank {rank} of '{label}': large messages from rank {peer} go through the ring: {e}");
        }
        rx.allow_by_ref(readable.is_ok());
        links[peer] = Some(ShmLink::new(tx, rx, pid as i32));
    }
    Ok(links)
}
