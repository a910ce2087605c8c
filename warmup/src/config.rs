//! Warmup settings: the config struct and its `ANYCCL_WARMUP*` environment overrides.

use crate::plan::Sizes;
use anyccl_core::{env_parse_at, parse_flag, parse_secs, Ctx, Result, MAX_TIMEOUT};
use std::time::Duration;

/// Warmup settings, with `ANYCCL_WARMUP*` overrides.
#[derive(Debug, Clone)]
pub struct WarmupConfig {
    /// Run at all (`ANYCCL_WARMUP=1|0`; default off: the caller opts in).
    pub enabled: bool,
    /// Run even where the backend connects every transport at init (the CPU backend;
    /// tests).
    pub force: bool,
    /// Deadline for the whole warmup, agreement to outcome (`ANYCCL_WARMUP_TIMEOUT_S`, 300).
    pub timeout: Duration,
    /// Probe sizes and dtype.
    pub sizes: Sizes,
    /// Device memory a recorded report says the plan needs; the warmup refuses to start
    /// below this plus `memory_margin`.
    pub memory_need: Option<u64>,
    /// Head room over `memory_need` (`ANYCCL_WARMUP_MARGIN_MIB`, default 256 MiB).
    pub memory_margin: u64,
}

impl Default for WarmupConfig {
    fn default() -> Self {
        WarmupConfig {
            enabled: false,
            force: false,
            timeout: Duration::from_secs(300),
            sizes: Sizes::default(),
            memory_need: None,
            memory_margin: 256 << 20,
        }
    }
}

impl WarmupConfig {
    /// `default` with the environment's overrides: `ANYCCL_WARMUP` (`0` or `1`),
    /// `ANYCCL_WARMUP_TIMEOUT_S` (seconds) and `ANYCCL_WARMUP_MARGIN_MIB` (a whole number of
    /// MiB), each read through core's checked parser.
    ///
    /// # Errors
    /// `InvalidArgument` naming the variable, its value and this process's rank when one is
    /// set to anything else: a value that does not parse never leaves a setting at its default.
    pub fn from_env(default: WarmupConfig) -> Result<Self> {
        const OP: &str = "WarmupConfig::from_env";
        let cx = Ctx::process("warmup");
        let mut c = default;
        if let Some(on) = env_parse_at(&cx, OP, "ANYCCL_WARMUP", "0 or 1", parse_flag)? {
            c.enabled = on;
        }
        let secs = format!("a number of seconds above 0 and at most {}", MAX_TIMEOUT.as_secs());
        if let Some(t) = env_parse_at(&cx, OP, "ANYCCL_WARMUP_TIMEOUT_S", &secs, parse_secs)? {
            c.timeout = t;
        }
        let mib = |s: &str| s.parse::<u64>().ok().and_then(|m| m.checked_mul(1 << 20));
        if let Some(m) = env_parse_at(&cx, OP, "ANYCCL_WARMUP_MARGIN_MIB", "a whole number of MiB", mib)? {
            c.memory_margin = m;
        }
        Ok(c)
    }
}
