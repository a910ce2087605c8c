//! What a simulation needs from this machine, checked before any process starts: the store
//! in this process holds one connection per simulated rank, and every child one store client
//! per rank of its own, so the open-file limit and the loopback port range bound the rank
//! count. A run that does not fit is refused at once, saying what to change (it used to
//! start, then fail after the clients' 120 s connect timeout).

use crate::args::Args;
use anyccl_examples::machine;

/// Descriptors a process needs beside its connections: standard streams, the runtime, the
/// listener, a child's pipes, files the libraries open.
const SLACK: u64 = 64;

/// Open files the run needs in this process (`tcp`: the store's connections and the
/// children's pipes) and in each child (its store clients); children inherit this
/// process's limit, so the larger counts.
pub(crate) fn descriptors(a: &Args) -> u64 {
    let (ranks, procs) = (a.ranks as u64, a.procs as u64);
    // `--fault kill-rank`: each member's liveness requests come from another thread, whose
    // connections its client keeps apart (a second connection per rank); a member with a
    // liveness thread of its own also holds that thread's runtime (its epoll and wake-up
    // descriptors).
    let (conns, own) = match (a.fault.starts_with("kill-rank"), a.liveness == "own") {
        (false, _) => (1, 0),
        (true, false) => (2, 0),
        (true, true) => (2, 2),
    };
    let child = ranks.div_ceil(procs.max(1)) * (conns + own) + SLACK;
    let parent = if a.store == "tcp" { conns * ranks + 3 * procs + SLACK } else { 3 * procs + SLACK };
    parent.max(child)
}

/// Refuse a run this machine cannot hold, saying everything that stands in its way at once;
/// raise the open-file soft limit up to the hard limit where that makes it fit.
///
/// # Errors
/// A message naming the flags, what the run needs, what the machine allows and what to change.
pub(crate) fn check(a: &Args) -> Result<(), String> {
    let mut short = Vec::new();
    let need = descriptors(a);
    if let Some((soft, hard)) = machine::raise_open_file_limit(need) {
        if soft < need {
            short.push(format!(
                "it needs about {need} open files in one process (one store connection per rank{}), and this \
                 process may open {soft} (open-file limit, hard limit {hard}): raise the limit (`ulimit -n {need}`, \
                 or the hard limit in /etc/security/limits.conf)",
                if a.store == "tcp" { ", all in this process's store" } else { " in a child" },
            ));
        }
    }
    if a.store == "tcp" {
        // Every client connects from 127.0.0.1 to the one store address: each takes a port of
        // the local range, so the range bounds the clients.
        if let Some((lo, hi)) = machine::local_port_range() {
            let ports = u64::from(hi - lo) + 1;
            let clients = a.ranks as u64 * if a.fault.starts_with("kill-rank") { 2 } else { 1 };
            if clients > ports {
                short.push(format!(
                    "every rank's store client connects from 127.0.0.1 to the one store address, and the local \
                     port range ({lo}-{hi}, net.ipv4.ip_local_port_range) gives {ports} such connections at most \
                     ({clients} wanted): widen it (e.g. `sysctl net.ipv4.ip_local_port_range=\"1024 65535\"`)"
                ));
            }
        }
    }
    if short.is_empty() {
        return Ok(());
    }
    Err(format!(
        "--ranks {} over --procs {}: this machine cannot hold the run: {}; or simulate fewer ranks",
        a.ranks,
        a.procs,
        short.join("; and ")
    ))
}
