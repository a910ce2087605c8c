//! The logging set-up programs use: a stderr subscriber filtered by `ANYCCL_LOG`.

/// Log to stderr, filtered by `ANYCCL_LOG` (`warn`, or `anyccl_nccl=debug,info`: a level,
/// or target=level directives), else at `default` and above. A malformed `ANYCCL_LOG` is
/// reported and the default used. For programs: it installs the process's global
/// subscriber when none is installed yet.
pub fn init_logging(default: tracing::Level) {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::prelude::*;
    let fallback = Targets::new().with_default(LevelFilter::from_level(default));
    let filter = match std::env::var("ANYCCL_LOG") {
        Err(_) => fallback,
        Ok(v) => v.parse::<Targets>().unwrap_or_else(|e| {
            eprintln!("ANYCCL_LOG={v:?} is not a log filter ({e}); logging at {default} and above");
            fallback
        }),
    };
    let _ = tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(filter)
        .try_init();
}
