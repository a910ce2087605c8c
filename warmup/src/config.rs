//! Warmup settings: the config struct and its `ANYCCL_WARMUP*` environment overrides.

use crate::plan::Sizes;
use anyccl_core::{Error, Result};
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
    /// `default` with the environment's overrides.
    ///
    /// # Errors
    /// `InvalidArgument` naming the variable when one is malformed.
    pub fn from_env(default: WarmupConfig) -> Result<Self> {
        let mut c = default;
        if let Ok(v) = std::env::var("ANYCCL_WARMUP") {
            c.enabled = matches!(v.as_str(), "1" | "true" | "on" | "yes");
        }
        if let Some(t) = anyccl_core::env_secs("ANYCCL_WARMUP_TIMEOUT_S")? {
            c.timeout = t;
        }
        if let Ok(v) = std::env::var("ANYCCL_WARMUP_MARGIN_MIB") {
            let m = v.parse::<u64>().ok().filter(|m| m.leading_zeros() >= 20).ok_or_else(|| {
                err("WarmupConfig::from_env", 0, "", format!("ANYCCL_WARMUP_MARGIN_MIB={v:?} is not a number of MiB"))
            })?;
            c.memory_margin = m << 20;
        }
        Ok(c)
    }
}

fn err(op: &'static str, rank: usize, group: &str, msg: String) -> Error {
    Error::InvalidArgument { op, arg: "plan", rank, group: group.into(), msg }
}
