//! Malformed `ANYCCL_CPU_*` settings, in a process of their own (they are set through the
//! environment, one case at a time): each fails the connect on every rank with an error
//! naming the variable, its value and the rank, instead of being taken for the default.

mod common;

use anyccl_core::{Error, MemoryStore, Store};
use libtest_mimic::{Arguments, Failed, Trial};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;
use std::time::Duration;

const RANKS: usize = 2;

/// Connect `RANKS` ranks (threads) with `var` set to `value`: every rank must fail with
/// `InvalidArgument` naming the variable, the value and its rank.
fn refused(var: &'static str, value: OsString) -> Result<(), Failed> {
    std::env::set_var(var, &value);
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let ranks: Vec<_> = (0..RANKS)
        .map(|r| {
            let store = store.clone();
            std::thread::spawn(move || common::connect(store, r, RANKS, "settings", Duration::from_secs(5)))
        })
        .collect();
    let outcomes: Vec<_> = ranks.into_iter().map(|h| h.join()).collect();
    std::env::remove_var(var);
    let named = format!("{var}={value:?}");
    for (r, outcome) in outcomes.into_iter().enumerate() {
        let outcome = outcome.map_err(|_| format!("rank {r} panicked"))?;
        let e = match outcome {
            Ok(_) => return Err(format!("{named}: rank {r} connected: the value was taken").into()),
            Err(e) => e,
        };
        let text = e.to_string();
        if !matches!(e, Error::InvalidArgument { .. }) || !text.contains(&named) || !text.contains(&format!("rank {r}"))
        {
            return Err(format!("{named}: rank {r} failed without naming the variable and its rank: {text}").into());
        }
        if r == 0 {
            println!("    {text}");
        }
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let mut args = Arguments::from_args();
    // The cases set the process's environment: one at a time.
    args.test_threads = Some(1);
    let not_utf8 = || OsStr::from_bytes(b"64\xffK").to_os_string();
    let cases: Vec<(&str, &'static str, OsString)> = vec![
        ("handoff_us_garbage", "ANYCCL_CPU_HANDOFF_US", "garbage".into()),
        ("handoff_us_1e30", "ANYCCL_CPU_HANDOFF_US", "1e30".into()),
        ("handoff_us_negative", "ANYCCL_CPU_HANDOFF_US", "-5".into()),
        ("handoff_us_nan", "ANYCCL_CPU_HANDOFF_US", "nan".into()),
        ("handoff_us_above_a_second", "ANYCCL_CPU_HANDOFF_US", "1000001".into()),
        ("eager_us_garbage", "ANYCCL_CPU_EAGER_US", "soon".into()),
        ("eager_us_negative", "ANYCCL_CPU_EAGER_US", "-1".into()),
        ("eager_us_above_a_millisecond", "ANYCCL_CPU_EAGER_US", "1001".into()),
        ("eager_us_not_utf8", "ANYCCL_CPU_EAGER_US", not_utf8()),
        ("spin_us_1e30", "ANYCCL_CPU_SPIN_US", "1e30".into()),
        ("links_not_utf8", "ANYCCL_CPU_LINKS", not_utf8()),
        ("by_ref_min_not_utf8", "ANYCCL_CPU_BY_REF_MIN", not_utf8()),
        ("host_not_utf8", "ANYCCL_CPU_HOST", not_utf8()),
        ("pair_piece_below_4k", "ANYCCL_CPU_PAIR_PIECE", "1K".into()),
        ("all_gather_direct_max_garbage", "ANYCCL_CPU_ALLGATHER_DIRECT_MAX", "small".into()),
        ("max_queued_bytes_garbage", "ANYCCL_CPU_MAX_QUEUED_BYTES", "lots".into()),
    ];
    let trials = cases
        .into_iter()
        .map(|(case, var, value)| Trial::test(format!("cpu::settings::{case}[w={RANKS}]"), move || refused(var, value)))
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}
