//! A sendrecv's message of 64 KiB or more goes by reference: its sender waits until the
//! receiver has copied it; a message larger than the ring waits for room. A receiver that is
//! waiting on another rank meanwhile copies what such a waiting sender sent it to its inbox
//! once that wait has lasted a millisecond, so ranks whose sends and receives form a cycle
//! never wait on each other for good, whether the receiver waits over shared memory or over
//! TCP (a wait for its own send's copy waits a millisecond and that copy's time at 2 GB/s
//! first, and meanwhile leaves such messages where they are). A by-reference message whose
//! sender's operation failed is never delivered from a buffer the sender reused.

use anyccl_core::{Backend, Buf, BufMut, CommConfig, Communicator, GroupSpec, MemoryStore, P2POp, Store};
use anyccl_cpu::{CpuLinks, Links};
use libtest_mimic::{Arguments, Failed, Trial};
use std::sync::Arc;
use std::time::{Duration, Instant};

const X: usize = 1 << 20;
const W: usize = 6;

fn connect_n(store: Arc<dyn Store>, rank: usize, n: usize, links: Links, name: &str) -> Result<Communicator, String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let cpu = CpuLinks(links);
    let config = CommConfig { op_timeout: Duration::from_secs(10), ..CommConfig::default() };
    let device = cpu.platform(0).map_err(|e| e.to_string())?.device();
    rt.block_on(Communicator::connect(&cpu, GroupSpec::world(n, name), rank, store, device, config))
        .map_err(|e| e.to_string())
}

fn wait(w: anyccl_core::Result<anyccl_core::Work<'_>>, what: &str) -> Result<(), String> {
    w.and_then(|mut w| w.wait(Duration::from_secs(20))).map_err(|e| format!("{what}: {e}"))
}

/// Ranks 0 (`a`), 2 (`b`) and 4 (`c`) share a host under `hosts:2`; rank 1 (`d`) does not.
/// `a` sends `b` 1 MiB in a sendrecv (by reference: it waits for `b`'s copy) and receives
/// from `c`, or (`large`) sends `b` alone 8 MiB, twice the ring (it waits for room), then
/// sends `d` a few bytes; `b` first waits for `d`, which waits for `a`. Only `b` copying
/// `a`'s message while it waits for `d` lets `a` go on.
fn cycle(links: Links, large: bool) -> Result<(), Failed> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let handles: Vec<_> = (0..W)
        .map(|r| {
            let s = store.clone();
            std::thread::spawn(move || -> Result<Duration, String> {
                let c = connect_n(s, r, W, links, "by-ref-cycle").map_err(|e| format!("rank {r}: connect: {e}"))?;
                let t = Instant::now();
                let n = if large { 8 * X } else { X };
                let x: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
                match r {
                    0 if large => {
                        wait(c.send(Buf::host(&x), 2), "send to 2")?;
                        wait(c.send(Buf::host(&[7u8; 8][..]), 1), "send to 1")?;
                    }
                    0 => {
                        let mut y = vec![0u8; X];
                        let mut mine = x.clone();
                        let ops = vec![P2POp::Send(Buf::host(&mine), 2), P2POp::Recv(BufMut::host(&mut y), 4)];
                        wait(c.p2p_group(ops), "sendrecv")?;
                        // The send is complete: its buffer is the caller's again.
                        mine.fill(0);
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
                        let mut got = vec![0u8; n];
                        wait(c.recv(BufMut::host(&mut got), 0), "recv from 0")?;
                        if w != [7u8; 8] || got != x {
                            return Err("rank 2: wrong bytes".into());
                        }
                    }
                    4 if !large => wait(c.send(Buf::host(&vec![4u8; X]), 0), "send to 0")?,
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

/// Rank 0's sendrecv sends rank 1 1 MiB by reference and fails on its receive half (rank
/// 2 sends 8 bytes, not 1 MiB); rank 0 then reuses its buffer and keeps it until rank 1,
/// which receives only after that, has finished. Rank 1 must fail, saying that the message
/// was withdrawn, and never deliver the reused buffer's bytes.
fn withdrawn_on_failure() -> Result<(), Failed> {
    const N: usize = 3;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let x: Arc<Vec<u8>> = Arc::new((0..X).map(|i| (i % 251) as u8 | 1).collect());
    // Ranks 0 and 1 meet twice: once rank 0 has reused its buffer, and once rank 1 is done.
    let meet = Arc::new(std::sync::Barrier::new(2));
    let handles: Vec<_> = (0..N)
        .map(|r| {
            let (s, x, meet) = (store.clone(), x.clone(), meet.clone());
            std::thread::spawn(move || -> Result<String, String> {
                let c = connect_n(s, r, N, Links::Auto, "by-ref-withdrawn").map_err(|e| format!("connect: {e}"))?;
                match r {
                    0 => {
                        let mut mine = x.to_vec();
                        let mut y = vec![0u8; X];
                        let ops = vec![P2POp::Send(Buf::host(&mine), 1), P2POp::Recv(BufMut::host(&mut y), 2)];
                        let got = wait(c.p2p_group(ops), "sendrecv");
                        mine.fill(0);
                        meet.wait();
                        // Kept (reused, not freed) while rank 1 copies.
                        meet.wait();
                        drop(mine);
                        match got {
                            Err(e) => Ok(format!("sendrecv failed as it should: {e}")),
                            Ok(()) => Err("a sendrecv receiving 8 bytes into 1 MiB succeeded".into()),
                        }
                    }
                    1 => {
                        meet.wait();
                        let mut got = vec![0u8; X];
                        let r = wait(c.recv(BufMut::host(&mut got), 0), "recv from 0");
                        meet.wait();
                        match r {
                            Err(e) if e.contains("withdrew") => Ok(format!("failed: {e}")),
                            Err(e) => Err(format!("failed, but not for the withdrawn message: {e}")),
                            Ok(()) if got[..] == x[..] => Err("received bytes its sender had withdrawn".into()),
                            Ok(()) => Err("received a buffer that its sender had reused".into()),
                        }
                    }
                    _ => wait(c.send(Buf::host(&[2u8; 8][..]), 0), "send to 0").map(|()| "sent".into()),
                }
            })
        })
        .collect();
    let mut errs = Vec::new();
    for (r, h) in handles.into_iter().enumerate() {
        match h.join() {
            Ok(Ok(what)) if r == 1 => println!("    rank 1 {what}"),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => errs.push(format!("rank {r}: {e}")),
            Err(_) => errs.push(format!("rank {r} panicked")),
        }
    }
    match errs.is_empty() {
        true => Ok(()),
        false => Err(errs.join("; ").into()),
    }
}

/// Three ranks of one host, each running `body(rank, communicator, word)` on its own thread
/// after connecting as group `name`; `word` lets rank 0 tell rank 2 when to go on (rank 0
/// sends it, rank 2 waits for it up to 30 s). Every rank's error, named by rank.
fn three_with_word(
    name: &'static str,
    body: fn(usize, &Communicator, &Word) -> Result<(), String>,
) -> Result<(), Failed> {
    const N: usize = 3;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (mut tx, mut rx) = (Some(tx), Some(rx));
    let handles: Vec<_> = (0..N)
        .map(|r| {
            let s = store.clone();
            let word = Word { tx: if r == 0 { tx.take() } else { None }, rx: if r == 2 { rx.take() } else { None } };
            std::thread::spawn(move || -> Result<(), String> {
                let c = connect_n(s, r, N, Links::Auto, name).map_err(|e| format!("connect: {e}"))?;
                body(r, &c, &word)?;
                wait(c.barrier(), "barrier")
            })
        })
        .collect();
    let errs: Vec<String> = handles
        .into_iter()
        .enumerate()
        .filter_map(|(r, h)| match h.join() {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("rank {r}: {e}")),
            Err(_) => Some(format!("rank {r} panicked")),
        })
        .collect();
    match errs.is_empty() {
        true => Ok(()),
        false => Err(errs.join("; ").into()),
    }
}

/// Rank 0's word to rank 2 (see [`three_with_word`]).
struct Word {
    tx: Option<std::sync::mpsc::Sender<()>>,
    rx: Option<std::sync::mpsc::Receiver<()>>,
}

impl Word {
    fn say(&self) {
        if let Some(t) = &self.tx {
            let _ = t.send(());
        }
    }
    fn hear(&self) -> Result<(), String> {
        match &self.rx {
            Some(r) => r.recv_timeout(Duration::from_secs(30)).map_err(|e| format!("rank 0's word: {e}")),
            None => Ok(()),
        }
    }
}

const BIG: usize = 32 << 20;

/// Rank 1 sends rank 2 32 MiB by reference and waits for rank 2's copy, which comes only
/// once rank 0 says so; meanwhile rank 0 sends rank 1 32 MiB by reference. Rank 1's wait
/// must leave rank 0's message where it is (the receive that takes it copies it once), not
/// copy it to its inbox at once (twice in all): rank 0's send stays incomplete for the 10 ms
/// it is watched, inside the 17.8 ms (a millisecond and the copy's time at 2 GB/s) after
/// which such a wait serves a sender. Two rounds, so that a copy to the inbox, if made,
/// finds its buffer allocated (about 3 ms here). Every message arrives whole.
fn wait_leaves_lent_message() -> Result<(), Failed> {
    three_with_word("by-ref-left", |r, c, word| {
        let x: Vec<u8> = (0..BIG).map(|i| (i % 251) as u8 ^ r as u8).collect();
        let mut got = vec![0u8; BIG];
        // The links 0 -> 1 -> 2 in use before anything is watched.
        let mut b = [r as u8; 8];
        if r < 2 {
            wait(c.send(Buf::host(&b[..]), r + 1), "first send")?;
        }
        if r > 0 {
            wait(c.recv(BufMut::host(&mut b[..]), r - 1), "first recv")?;
        }
        for round in 0..2 {
            wait(c.barrier(), "barrier")?;
            match r {
                0 => {
                    let mut w = c.send(Buf::host(&x), 1).map_err(|e| format!("send to 1: {e}"))?;
                    let t = Instant::now();
                    let mut early = false;
                    while t.elapsed() < Duration::from_millis(10) {
                        early |= w.is_completed().map_err(|e| format!("send to 1: {e}"))?;
                        std::thread::sleep(Duration::from_micros(100));
                    }
                    word.say();
                    w.wait(Duration::from_secs(20)).map_err(|e| format!("send to 1: {e}"))?;
                    if early {
                        return Err(format!(
                            "round {round}: rank 1 copied this rank's message while it waited for rank 2's copy of \
                             its own (to its inbox: twice in all)"
                        ));
                    }
                }
                1 => {
                    let send = c.send(Buf::host(&x), 2);
                    let recv = c.recv(BufMut::host(&mut got), 0);
                    wait(send, "send to 2")?;
                    wait(recv, "recv from 0")?;
                    if got.iter().enumerate().any(|(i, &v)| v != (i % 251) as u8) {
                        return Err(format!("round {round}: wrong bytes from rank 0"));
                    }
                }
                _ => {
                    word.hear()?;
                    wait(c.recv(BufMut::host(&mut got), 1), "recv from 1")?;
                    if got.iter().enumerate().any(|(i, &v)| v != (i % 251) as u8 ^ 1) {
                        return Err(format!("round {round}: wrong bytes from rank 1"));
                    }
                }
            }
        }
        Ok(())
    })
}

/// Rank 1 sends rank 2 32 MiB by reference and waits for rank 2's copy (which comes only once
/// rank 0 says so), then runs a sendrecv with rank 0; rank 0 runs that sendrecv at once, its
/// 1 MiB by reference. Rank 0's message reaches rank 1 while rank 1 waits, and is left at its
/// address; rank 1's sendrecv then copies it before writing its own. Both halves arrive whole.
fn exchange_takes_left_message() -> Result<(), Failed> {
    three_with_word("by-ref-exchange", |r, c, word| {
        let part = |p: usize| -> Vec<u8> { (0..X).map(|i| (i % 251) as u8 ^ (p as u8 + 1)).collect() };
        let mine = part(r);
        wait(c.barrier(), "barrier")?;
        match r {
            0 => {
                let mut got = vec![0u8; X];
                let ops = vec![P2POp::Send(Buf::host(&mine), 1), P2POp::Recv(BufMut::host(&mut got), 1)];
                let w = c.p2p_group(ops);
                std::thread::sleep(Duration::from_millis(10));
                word.say();
                wait(w, "sendrecv with 1")?;
                if got != part(1) {
                    return Err("wrong bytes from rank 1".into());
                }
            }
            1 => {
                let big = vec![7u8; BIG];
                let send = c.send(Buf::host(&big), 2);
                let mut got = vec![0u8; X];
                let ops = vec![P2POp::Send(Buf::host(&mine), 0), P2POp::Recv(BufMut::host(&mut got), 0)];
                let pair = c.p2p_group(ops);
                wait(send, "send to 2")?;
                wait(pair, "sendrecv with 0")?;
                if got != part(0) {
                    return Err("wrong bytes from rank 0".into());
                }
            }
            _ => {
                word.hear()?;
                let mut got = vec![0u8; BIG];
                wait(c.recv(BufMut::host(&mut got), 1), "recv from 1")?;
                if got.iter().any(|&v| v != 7) {
                    return Err("wrong bytes from rank 1".into());
                }
            }
        }
        Ok(())
    })
}

fn main() -> std::process::ExitCode {
    // The cases need the default sizes (a sendrecv's message by reference from 64 KiB, rings
    // of 4 MiB): removed before any thread starts, since every connect reads them.
    std::env::remove_var("ANYCCL_CPU_BY_REF_MIN");
    std::env::remove_var("ANYCCL_CPU_SHM_RING_BYTES");
    let args = Arguments::from_args();
    let trials = vec![
        Trial::test("cpu::by_ref::cycle_over_shared_memory[w=6]", || cycle(Links::Auto, false)),
        Trial::test("cpu::by_ref::cycle_across_hosts[w=6]", || cycle(Links::Hosts(2), false)),
        Trial::test("cpu::by_ref::large_send_cycle_over_shared_memory[w=6]", || cycle(Links::Auto, true)),
        Trial::test("cpu::by_ref::large_send_cycle_across_hosts[w=6]", || cycle(Links::Hosts(2), true)),
        Trial::test("cpu::by_ref::withdrawn_on_failure[w=3]", withdrawn_on_failure),
        Trial::test("cpu::by_ref::wait_leaves_lent_message[w=3]", wait_leaves_lent_message),
        Trial::test("cpu::by_ref::exchange_takes_left_message[w=3]", exchange_takes_left_message),
    ];
    libtest_mimic::run(&args, trials).exit_code()
}
