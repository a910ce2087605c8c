//! What rebuild cycles leave behind, counted: `anyccl-cycles --check` for five cycles, one of
//! each way a cycle ends (shutdown, abort, a peer's death, the drop alone, a rank that never
//! arrives), on the CPU backend with 4 ranks and on the HCCL stand-in with 8. Mappings,
//! descriptors, threads and device memory are counts, not timings, so they are asserted to
//! come back to the first cycle's; resident memory is only reported. `--sleep`: five sleep
//! and wake cycles of one communicator, asleep holding no mapping and no device memory.
use std::process::{Command, ExitCode};

/// Held and after figures of one column of a row (`held->after`).
fn pair(cell: &str) -> Option<(u64, u64)> {
    let (h, a) = cell.split_once("->")?;
    Some((h.parse().ok()?, a.parse().ok()?))
}

fn cycles(backend: &str, ranks: usize, sleep: bool) -> Result<(), String> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_anyccl-cycles"));
    cmd.args(["--backend", backend, "--ranks", &ranks.to_string(), "--cycles", "5", "--check"]);
    if sleep {
        cmd.arg("--sleep");
    }
    if backend == "hccl" {
        cmd.env("ANYCCL_HCCL_LIBRARY_DIR", anyccl_hccl_standin::library_dir());
    }
    let out = cmd.output().map_err(|e| format!("cannot run anyccl-cycles: {e}"))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        return Err(format!("anyccl-cycles exited with {}:\n{text}", out.status));
    }
    if !text.contains("every count came back: nothing left behind") {
        return Err(format!("no verdict:\n{text}"));
    }
    if sleep
        && !text.contains("# asleep, every cycle: no mapping more than before the connect, no device memory in use")
    {
        return Err(format!("no verdict on what sleep held:\n{text}"));
    }
    // Rows: cycle, end, rss, memfd, fds, threads, device (each `held->after`).
    let rows: Vec<Vec<&str>> = text
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|c| c.first().is_some_and(|c| c.parse::<usize>().is_ok()))
        .collect();
    if rows.len() != 5 {
        return Err(format!("{} rows, expected 5:\n{text}", rows.len()));
    }
    // The first cycle ends with its communicators live: what they held must show, or the
    // columns measure nothing.
    let first = &rows[0];
    let col = |i: usize| first.get(i).and_then(|c| pair(c)).ok_or_else(|| format!("row {first:?} unreadable"));
    let (memfd, fds, threads) = (col(3)?, col(4)?, col(5)?);
    if fds.0 <= fds.1 || threads.0 <= threads.1 {
        return Err(format!("live communicators held no descriptors or threads: {first:?}"));
    }
    match backend {
        "cpu" if memfd.0 == 0 => Err(format!("the CPU backend's live communicators held no memfd mappings: {first:?}")),
        "hccl" if col(6)?.0 == 0 => Err(format!("the stand-in's live communicators held no device memory: {first:?}")),
        _ => Ok(()),
    }
}

fn main() -> ExitCode {
    let args = libtest_mimic::Arguments::from_args();
    let trials = vec![
        libtest_mimic::Trial::test("cpu::rebuild::cycles_leave_nothing_behind[w=4]", || Ok(cycles("cpu", 4, false)?)),
        libtest_mimic::Trial::test("hccl::rebuild::cycles_leave_nothing_behind[w=8]", || Ok(cycles("hccl", 8, false)?)),
        libtest_mimic::Trial::test("cpu::sleep::cycles_hold_nothing_asleep[w=4]", || Ok(cycles("cpu", 4, true)?)),
        libtest_mimic::Trial::test("hccl::sleep::cycles_hold_nothing_asleep[w=8]", || Ok(cycles("hccl", 8, true)?)),
    ];
    libtest_mimic::run(&args, trials).exit_code()
}
