//! A sendrecv's message of 64 KiB or more goes by reference: its sender waits until the
//! receiver has copied it. A receiver that is waiting on another rank meanwhile copies it to
//! its inbox once that wait has lasted a millisecond, so ranks whose sends and receives form
//! a cycle never wait on each other for good, whether the receiver waits over shared memory
//! or over TCP.

use anyccl_core::{Backend, Buf, BufMut, CommConfig, Communicator, GroupSpec, MemoryStore, P2POp, Store};
use anyccl_cpu::{CpuLinks, Links};
use libtest_mimic::{Arguments, Failed, Trial};
use std::sync::Arc;
use std::time::{Duration, Instant};

const X: usize = 1 << 20;
const W: usize = 6;

fn connect(store: Arc<dyn Store>, rank: usize, links: Links) -> Result<Communicator, String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let cpu = CpuLinks(links);
    let config = CommConfig { op_timeout: Duration::from_secs(10), ..CommConfig::default() };
    let device = cpu.platform(0).map_err(|e| e.to_string())?.device();
    rt.block_on(Communicator::connect(&cpu, GroupSpec::world(W, "by-ref-cycle"), rank, store, device, config))
        .map_err(|e| e.to_string())
}

fn wait(w: anyccl_core::Result<anyccl_core::Work<'_>>, what: &str) -> Result<(), String> {
    w.and_then(|mut w| w.wait(Duration::from_secs(20))).map_err(|e| format!("{what}: {e}"))
}

/// Ranks 0 (`a`), 2 (`b`) and 4 (`c`) share a host under `hosts:2`; rank 1 (`d`) does not.
/// `a` sends `b` 1 MiB in a sendrecv (by reference: it waits for `b`'s copy) and receives
/// from `c`, then sends `d` a few bytes; `b` first waits for `d`, which waits for `a`. Only
/// `b` copying `a`'s message while it waits for `d` lets `a` go on.
fn cycle(links: Links) -> Result<(), Failed> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let handles: Vec<_> = (0..W)
        .map(|r| {
            let s = store.clone();
            std::thread::spawn(move || -> Result<Duration, String> {
                let c = connect(s, r, links).map_err(|e| format!("rank {r}: connect: {e}"))?;
                let t = Instant::now();
                let x: Vec<u8> = (0..X).map(|i| (i % 251) as u8).collect();
                match r {
                    0 => {
                        let mut y = vec![0u8; X];
                        let ops = vec![P2POp::Send(Buf::host(&x), 2), P2POp::Recv(BufMut::host(&mut y), 4)];
                        wait(c.p2p_group(ops), "sendrecv")?;
                        if y.iter().any(|&v| v != 4) {
                            return Err("rank 0: wrong bytes from rank 4".into());
                        }
                        wait(c.send(Buf::host(&[7u8; 8][..]), 1), "send to 1")?;
                    }
                    1 => {
                        let mut z = [0u8; 8];
                        wait(c.recv(BufMut::host(&mut z[..]), 0), "recv from 0")?;
                        wait(c.send(Buf::host(&z[..]), 2), "send to 2")?;
                    }
                    2 => {
                        let mut w = [0u8; 8];
                        wait(c.recv(BufMut::host(&mut w[..]), 1), "recv from 1")?;
                        let mut got = vec![0u8; X];
                        wait(c.recv(BufMut::host(&mut got), 0), "recv from 0")?;
                        if w != [7u8; 8] || got != x {
                            return Err("rank 2: wrong bytes".into());
                        }
                    }
                    4 => wait(c.send(Buf::host(&vec![4u8; X]), 0), "send to 0")?,
                    _ => {}
                }
                let took = t.elapsed();
                wait(c.barrier(), "barrier")?;
                Ok(took)
            })
        })
        .collect();
    let mut errs = Vec::new();
    let mut took = Duration::ZERO;
    for (r, h) in handles.into_iter().enumerate() {
        match h.join() {
            Ok(Ok(t)) => took = took.max(t),
            Ok(Err(e)) => errs.push(format!("rank {r}: {e}")),
            Err(_) => errs.push(format!("rank {r} panicked")),
        }
    }
    if !errs.is_empty() {
        return Err(errs.join("; ").into());
    }
    println!("    the cycle took {took:.2?}");
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args = Arguments::from_args();
    let trials = vec![
        Trial::test("cpu::by_ref::cycle_over_shared_memory[w=6]", || cycle(Links::Auto)),
        Trial::test("cpu::by_ref::cycle_across_hosts[w=6]", || cycle(Links::Hosts(2))),
    ];
    libtest_mimic::run(&args, trials).exit_code()
}
