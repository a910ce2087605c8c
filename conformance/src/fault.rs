//! Fault injection: a `Collective` wrapper that fails or hangs a chosen operation and counts
//! what is issued through it, so timeout, abort and warmup-failure cases run without GPUs.

use anyccl_core::{
    async_trait, AllToAllSplits, Buf, BufMut, Capabilities, Collective, CommInfo, P2POp, Recovery, ReduceOp, Result,
    Work, WorkImpl,
};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Nothing: only count.
    None,
    /// Data-plane operation number `k` (from 0) fails at enqueue.
    FailAt(u64),
    /// Data-plane operation number `k` never completes (until the communicator is aborted).
    HangAt(u64),
}

/// A `Collective` that forwards to `inner`, counting and injecting faults.
#[derive(Debug)]
pub struct Faulty {
    inner: Arc<dyn Collective>,
    fault: Fault,
    /// Operations that reached the wrapper, numbering them for `Fault::FailAt`/`HangAt`.
    issued: AtomicU64,
    aborted: Arc<AtomicBool>,
}

impl Faulty {
    /// Wrap `inner`.
    pub fn new(inner: Arc<dyn Collective>, fault: Fault) -> Arc<Faulty> {
        Arc::new(Faulty { inner, fault, issued: AtomicU64::new(0), aborted: Arc::new(AtomicBool::new(false)) })
    }
    /// Number the operation, then inject its fault or forward it (`call`).
    fn gate<'a>(&'a self, op: &'static str, call: impl FnOnce() -> Result<Work<'a>>) -> Result<Work<'a>> {
        let k = self.issued.fetch_add(1, Ordering::Relaxed);
        match self.fault {
            Fault::FailAt(f) if f == k => {
                let ctx = anyccl_core::Ctx::new("fault", self.inner.info().rank, "");
                Err(ctx.backend_error(op, -99, format!("injected failure of operation #{k}"), Recovery::Rebuild))
            }
            Fault::HangAt(h) if h == k => {
                Ok(Work::new(Hang { aborted: self.aborted.clone(), rank: self.inner.info().rank }))
            }
            _ => call(),
        }
    }
}

struct Hang {
    aborted: Arc<AtomicBool>,
    rank: usize,
}

impl WorkImpl for Hang {
    fn poll(&mut self) -> Result<bool> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(anyccl_core::Ctx::new("fault", self.rank, "").aborted("aborted while hung (injected)"));
        }
        Ok(false)
    }
    fn wait_for(&mut self, timeout: Duration) -> Result<bool> {
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if self.poll()? {
                return Ok(true);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        self.poll()
    }
    fn drain(&mut self) {}
}

#[deny(clippy::missing_trait_methods)]
#[async_trait]
impl Collective for Faulty {
    fn info(&self) -> &CommInfo {
        self.inner.info()
    }
    fn capabilities(&self) -> &Capabilities {
        self.inner.capabilities()
    }
    fn memory_held(&self) -> Option<u64> {
        self.inner.memory_held()
    }
    fn path(&self, op: &str, bytes: usize) -> Option<String> {
        self.inner.path(op, bytes)
    }
    fn register(&self, buf: Buf<'_>) -> Result<Option<anyccl_core::RegHandle>> {
        self.inner.register(buf)
    }
    fn deregister(&self, handle: anyccl_core::RegHandle) -> Result<()> {
        self.inner.deregister(handle)
    }
    async fn register_window(
        &self,
        buf: Buf<'_>,
        refusal: Option<&str>,
        deadline: std::time::Instant,
    ) -> Result<Option<anyccl_core::RegHandle>> {
        self.inner.register_window(buf, refusal, deadline).await
    }
    fn deregister_window(&self, handle: anyccl_core::RegHandle) -> Result<()> {
        self.inner.deregister_window(handle)
    }
    fn wait_stream(&self, stream: anyccl_core::StreamRef<'_>) -> Result<()> {
        self.inner.wait_stream(stream)
    }
    fn signal_stream(&self, stream: anyccl_core::StreamRef<'_>) -> Result<()> {
        self.inner.signal_stream(stream)
    }
    fn enqueue(&self, op: anyccl_core::GraphOp) -> Result<()> {
        self.inner.enqueue(op)
    }
    fn capture(&self, stream: anyccl_core::StreamRef<'_>, op: anyccl_core::GraphOp) -> Result<()> {
        self.inner.capture(stream, op)
    }
    fn all_reduce<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        self.gate("all_reduce", || self.inner.all_reduce(send, recv, op))
    }
    fn reduce<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp, root: usize) -> Result<Work<'a>> {
        self.gate("reduce", || self.inner.reduce(send, recv, op, root))
    }
    fn broadcast<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, root: usize) -> Result<Work<'a>> {
        self.gate("broadcast", || self.inner.broadcast(send, recv, root))
    }
    fn all_gather<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>) -> Result<Work<'a>> {
        self.gate("all_gather", || self.inner.all_gather(send, recv))
    }
    fn reduce_scatter<'a>(&'a self, send: Option<Buf<'a>>, recv: BufMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        self.gate("reduce_scatter", || self.inner.reduce_scatter(send, recv, op))
    }
    fn all_to_all<'a>(&'a self, send: Buf<'a>, recv: BufMut<'a>, splits: Option<&AllToAllSplits>) -> Result<Work<'a>> {
        self.gate("all_to_all", || self.inner.all_to_all(send, recv, splits))
    }
    fn send<'a>(&'a self, buf: Buf<'a>, peer: usize) -> Result<Work<'a>> {
        self.gate("send", || self.inner.send(buf, peer))
    }
    fn recv<'a>(&'a self, buf: BufMut<'a>, peer: usize) -> Result<Work<'a>> {
        self.gate("recv", || self.inner.recv(buf, peer))
    }
    fn p2p_group<'a>(&'a self, ops: Vec<P2POp<'a>>) -> Result<Work<'a>> {
        self.gate("p2p_group", || self.inner.p2p_group(ops))
    }
    fn barrier(&self) -> Result<Work<'_>> {
        self.gate("barrier", || self.inner.barrier())
    }
    async fn health(&self, deadline: Instant) -> Result<()> {
        self.inner.health(deadline).await
    }
    async fn abort(&self, deadline: Instant) -> Result<()> {
        self.aborted.store(true, Ordering::Release);
        self.inner.abort(deadline).await
    }
    async fn split(
        &self,
        color: Option<u32>,
        key: u32,
        name: &str,
        deadline: Instant,
    ) -> Result<Option<Arc<dyn Collective>>> {
        self.inner.split(color, key, name, deadline).await
    }
    async fn shutdown(&self, deadline: Instant) -> Result<()> {
        self.inner.shutdown(deadline).await
    }
}
