//! The process's environment, read one way: the launcher's rank and size for errors raised
//! before a communicator exists, and one checked parser through which every variable the
//! project reads goes, so a value that does not parse is an error naming the variable, its
//! value, what was expected and the rank (and the group where there is one), never a silent
//! default.

use crate::error::{Ctx, Error, Result};
use std::time::Duration;

/// The longest timeout a variable may set (one year): every wait has a deadline that the
/// clock can represent.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

/// The first of `names` that is set to a non-empty value, with its name. A value that is not
/// UTF-8 counts as unset here: the checked readers below refuse it.
pub(crate) fn first_var(names: &[&str]) -> Option<(String, String)> {
    names.iter().find_map(|n| std::env::var(n).ok().filter(|v| !v.is_empty()).map(|v| (n.to_string(), v)))
}

/// This process's rank as the launcher's variables give it, for errors raised before
/// [`crate::LaunchEnv::from_env`] has run or when it failed (0 when unknown).
pub fn env_rank() -> usize {
    first_var(&["ANYCCL_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"])
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Ranks in the job as the launcher's variables give it (1 when unknown).
pub fn env_world_size() -> usize {
    first_var(&["ANYCCL_WORLD_SIZE", "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(1)
}

/// This machine's name, for errors and dumps that say where a process runs ("" when unknown).
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default()
}

impl Ctx {
    /// The context of this process for `tool` (a backend, a tool, start-up code) before it
    /// has a group: the rank from the launcher's variables, no group.
    pub fn process(tool: &'static str) -> Ctx {
        Ctx::new(tool, env_rank(), "")
    }
}

/// The raw value of `name`: `Ok(None)` when unset or empty.
///
/// # Errors
/// `InvalidArgument` when the value is not UTF-8.
fn raw(ctx: &Ctx, op: &'static str, name: &str) -> Result<Option<String>> {
    match std::env::var(name) {
        Ok(v) if v.is_empty() => Ok(None),
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => {
            Err(ctx.invalid(op, "environment", format!("{name}={v:?} is not UTF-8")))
        }
    }
}

/// The variable `name` parsed by `parse`, in `ctx`'s rank and group and for `op`: `Ok(None)`
/// when it is unset or empty. `parse` sees the value with spaces around it trimmed.
///
/// # Errors
/// `InvalidArgument` naming the variable, its value, `expected`, the rank and the group
/// when the value is not UTF-8 or `parse` refuses it.
pub fn env_parse_at<T>(
    ctx: &Ctx,
    op: &'static str,
    name: &str,
    expected: &str,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Result<Option<T>> {
    let Some(v) = raw(ctx, op, name)? else { return Ok(None) };
    match parse(v.trim()) {
        Some(t) => Ok(Some(t)),
        None => Err(ctx.invalid(op, "environment", format!("{name}={v:?} is not {expected}"))),
    }
}

/// [`env_parse_at`] for this process (the launcher's rank, no group).
///
/// # Errors
/// As [`env_parse_at`].
pub fn env_parse<T>(name: &str, expected: &str, parse: impl FnOnce(&str) -> Option<T>) -> Result<Option<T>> {
    env_parse_at(&Ctx::process("anyccl"), "settings", name, expected, parse)
}

/// A switch: `0` or `1`; `None` when unset.
///
/// # Errors
/// `InvalidArgument` naming the variable and the rank for any other value.
pub fn env_flag(name: &str) -> Result<Option<bool>> {
    env_parse(name, "0 or 1", parse_flag)
}

/// `0` or `1` as a switch.
pub fn parse_flag(s: &str) -> Option<bool> {
    match s {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    }
}

/// A positive number of seconds, at most [`MAX_TIMEOUT`]; `None` when unset.
///
/// # Errors
/// `InvalidArgument` naming the variable and the rank for anything else.
pub fn env_secs(name: &str) -> Result<Option<Duration>> {
    let expected = format!("a number of seconds above 0 and at most {}", MAX_TIMEOUT.as_secs());
    env_parse(name, &expected, parse_secs)
}

/// A positive number of seconds, at most [`MAX_TIMEOUT`] (`nan`, `inf` and `0` are not).
pub fn parse_secs(s: &str) -> Option<Duration> {
    s.parse::<f64>().ok().filter(|s| *s > 0.0 && *s <= MAX_TIMEOUT.as_secs_f64()).map(Duration::from_secs_f64)
}

/// A byte count as [`parse_bytes`] reads it; `None` when unset.
///
/// # Errors
/// `InvalidArgument` naming the variable and the rank when malformed.
pub fn env_bytes(name: &str) -> Result<Option<usize>> {
    env_parse(name, "a byte count (a whole number with an optional K, M or G)", parse_bytes)
}

/// Any text; `None` when unset or empty.
///
/// # Errors
/// `InvalidArgument` naming the variable and the rank when it is not UTF-8.
pub fn env_string(name: &str) -> Result<Option<String>> {
    env_parse(name, "text", |s| Some(s.to_string()))
}

/// One of `choices`; `None` when unset.
///
/// # Errors
/// `InvalidArgument` naming the variable, the choices and the rank for anything else.
pub fn env_choice(name: &str, choices: &[&'static str]) -> Result<Option<&'static str>> {
    env_parse(name, &format!("one of {}", choices.join(", ")), |s| choices.iter().copied().find(|c| *c == s))
}

/// Bytes written as a whole number with an optional binary suffix: `K`, `M`, `G` (or
/// `KiB`, `MiB`, `GiB`), either case, as the tools' size flags and the backends' byte
/// settings take them. `None` when malformed or too large.
pub fn parse_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let n: usize = s[..digits].parse().ok()?;
    let shift = match s[digits..].to_ascii_lowercase().as_str() {
        "" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        _ => return None,
    };
    n.checked_mul(1 << shift)
}

/// An error for a variable read elsewhere whose value `value` is not `expected`, in the
/// same words as the checked readers'.
pub fn bad_env(ctx: &Ctx, op: &'static str, name: &str, value: &str, expected: &str) -> Error {
    ctx.invalid(op, "environment", format!("{name}={value:?} is not {expected}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_settings_take_binary_suffixes() {
        assert_eq!(parse_bytes("65536"), Some(65536));
        assert_eq!(parse_bytes(" 64K "), Some(64 << 10));
        assert_eq!(parse_bytes("16m"), Some(16 << 20));
        assert_eq!(parse_bytes("1GiB"), Some(1 << 30));
        for bad in ["", "K", "1.5M", "-1", "12 M", "4T", "99999999999999999999G"] {
            assert_eq!(parse_bytes(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn seconds_refuse_nan_infinity_zero_and_negatives() {
        for bad in ["nan", "inf", "-5", "0", "1e30", "x", ""] {
            assert_eq!(parse_secs(bad), None, "{bad:?}");
        }
        assert_eq!(parse_secs("1.5"), Some(Duration::from_millis(1500)));
    }

    #[test]
    fn a_refused_value_names_the_variable_the_value_the_rank_and_the_group() {
        let ctx = Ctx::new("cpu", 2, "dp");
        // A variable no test sets, so the read is from this process's real environment.
        let e = bad_env(&ctx, "connect", "ANYCCL_X", "garbage", "a number");
        let t = e.to_string();
        for want in ["ANYCCL_X", "\"garbage\"", "a number", "rank 2", "'dp'"] {
            assert!(t.contains(want), "{want} missing from {t}");
        }
        assert_eq!(env_parse_at(&ctx, "connect", "ANYCCL_TEST_SURELY_UNSET_VARIABLE", "x", |_| Some(1)).unwrap(), None);
    }
}
