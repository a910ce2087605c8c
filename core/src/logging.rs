//! The logging set-up programs use: a stderr subscriber filtered by `ANYCCL_LOG`.

use crate::env::{bad_env, env_string};
use crate::error::{Ctx, Result};

/// Log to stderr, filtered by `ANYCCL_LOG` (`warn`, or `anyccl_nccl=debug,info`: a level,
/// or target=level directives), else at `default` and above. For programs: it installs the
/// process's global subscriber when none is installed yet.
///
/// # Errors
/// `InvalidArgument` naming `ANYCCL_LOG`, its value and the rank when it is not a list of
/// such directives (a level is one of `off`, `error`, `warn`, `info`, `debug`, `trace`; a
/// target is a module path such as `anyccl_cpu::transport`); nothing is installed then.
pub fn init_logging(default: tracing::Level) -> Result<()> {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::prelude::*;
    let filter = match env_string("ANYCCL_LOG")? {
        None => Targets::new().with_default(LevelFilter::from_level(default)),
        Some(v) => parse_filter(&v).ok_or_else(|| {
            let expected = "a level (off, error, warn, info, debug, trace) or target=level directives, comma-separated";
            bad_env(&Ctx::process("anyccl"), "init_logging", "ANYCCL_LOG", &v, expected)
        })?,
    };
    let _ = tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(filter)
        .try_init();
    Ok(())
}

/// `v` as a filter, when every directive is a level or `target=level` with a module path
/// for target: the subscriber's own parser takes any word as a target to log at every
/// level, so `[[[` would silently log nothing.
fn parse_filter(v: &str) -> Option<tracing_subscriber::filter::Targets> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    let level = |s: &str| LEVELS.contains(&s.trim().to_ascii_lowercase().as_str());
    let target = |s: &str| {
        let s = s.trim();
        !s.is_empty()
            && s.split("::")
                .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'))
    };
    let directives: Vec<&str> = v.split(',').map(str::trim).filter(|d| !d.is_empty()).collect();
    let ok = directives.iter().all(|d| match d.split_once('=') {
        Some((t, l)) => target(t) && level(l),
        None => level(d),
    });
    if !ok || directives.is_empty() {
        return None;
    }
    v.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::parse_filter;

    #[test]
    fn filters_are_levels_or_target_level_directives() {
        for good in ["warn", "anyccl_nccl=debug,info", " INFO ", "anyccl_cpu::transport=trace", "off"] {
            assert!(parse_filter(good).is_some(), "{good:?}");
        }
        for bad in ["[[[", "loud", "anyccl=loud", "=info", "a b=info", ",", "anyccl::=info"] {
            assert!(parse_filter(bad).is_none(), "{bad:?}");
        }
    }
}
