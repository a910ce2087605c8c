//! What the CPU backend's own test programs share: a rank's communicator on an in-process
//! store.

use anyccl_core::{Backend, CommConfig, Communicator, Error, GroupSpec, MemoryStore, Store};
use std::sync::Arc;
use std::time::Duration;

/// Rank `rank` of a world of `size` named `name`, with operation timeout `op_timeout`.
pub fn connect(
    store: Arc<dyn Store>,
    rank: usize,
    size: usize,
    name: &str,
    op_timeout: Duration,
) -> Result<Communicator, Error> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::unavailable("test", e.to_string()))?;
    let config = CommConfig { op_timeout, ..CommConfig::default() };
    let cpu = anyccl_cpu::Cpu;
    rt.block_on(Communicator::connect(
        &cpu,
        GroupSpec::world(size, name),
        rank,
        store,
        cpu.platform(0)?.device(),
        config,
    ))
}

/// Run `f(rank, comm)` on two ranks (threads of this process), each connected with a 10 s
/// operation timeout: the ranks' errors, joined.
#[allow(dead_code)] // not every test program runs two ranks
pub fn two_ranks(
    name: &str,
    f: impl Fn(usize, &Communicator) -> Result<(), String> + Send + Sync + 'static,
) -> Result<(), libtest_mimic::Failed> {
    ranks(2, name, f)
}

/// Run `f(rank, comm)` on `n` ranks (threads of this process), each connected with a 10 s
/// operation timeout: the ranks' errors, joined.
#[allow(dead_code)] // not every test program runs ranks
pub fn ranks(
    n: usize,
    name: &str,
    f: impl Fn(usize, &Communicator) -> Result<(), String> + Send + Sync + 'static,
) -> Result<(), libtest_mimic::Failed> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (s, f, name) = (store.clone(), f.clone(), name.to_string());
            std::thread::spawn(move || -> Result<(), String> {
                let c = connect(s, r, n, &name, Duration::from_secs(10)).map_err(|e| format!("rank {r}: {e}"))?;
                f(r, &c).map_err(|e| format!("rank {r}: {e}"))
            })
        })
        .collect();
    let mut errs = Vec::new();
    for h in handles {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => errs.push(e),
            Err(_) => errs.push("a rank panicked".into()),
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.join("; ").into())
    }
}

/// How long a test's wait for one operation lasts (longer than the ranks' 10 s operation
/// timeout, so a wait runs its job itself).
#[allow(dead_code)] // not every test program waits this way
pub const T: std::time::Duration = std::time::Duration::from_secs(20);

/// Rank `rank`'s `n` floats for round `round`, distinct across ranks and rounds.
#[allow(dead_code)]
pub fn input(rank: usize, n: usize, round: usize) -> Vec<f32> {
    (0..n).map(|i| (rank * 1000 + i + round) as f32).collect()
}

/// Wait up to [`T`] for an issued operation; its error as text.
#[allow(dead_code)]
pub fn wait(w: anyccl_core::Result<anyccl_core::Work<'_>>) -> Result<(), String> {
    w.and_then(|mut w| w.wait(T)).map_err(|e| e.to_string())
}

/// Call `*call` (counted up here) of `n` ranks: every rank arrives before any leaves, and they
/// leave together, within the time one look at a shared counter takes (a sleeping barrier
/// would wake one of them tens of microseconds later, past the eager look).
#[allow(dead_code)]
pub fn meet(arrived: &std::sync::atomic::AtomicUsize, call: &mut usize, n: usize) {
    use std::sync::atomic::Ordering;
    *call += 1;
    arrived.fetch_add(1, Ordering::SeqCst);
    while arrived.load(Ordering::SeqCst) < n * *call {
        std::hint::spin_loop();
        std::thread::yield_now();
    }
}
