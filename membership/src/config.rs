//! The membership's settings, with their environment overrides.

use crate::driver::LivenessDriver;
use anyccl_core::{env_parse, env_secs, Result};
use std::time::Duration;

/// How a member beats, when a silent one counts as gone, and how long an agreement may take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MembershipConfig {
    /// Store prefix of the job's membership records.
    pub prefix: String,
    /// How often a member's liveness record is renewed and its watched peer's read
    /// (`ANYCCL_LIVENESS_BEAT_MS`, default 250). Each beat costs the store two requests a
    /// member: at 4,096 members a 250 ms beat is about 33k requests a second, which
    /// saturates one TCP store thread on a 2-core machine (anyccl-sim: 10 s from a kill to
    /// the survivors' view, against 5 s at a 1 s beat); lengthen it for large jobs.
    pub beat: Duration,
    /// A liveness record not renewed for this long is evidence that its process is gone
    /// (killed, stopped, or its machine lost) (`ANYCCL_LIVENESS_S`, default 3).
    pub stale_after: Duration,
    /// The longest an agreement may take before every member gets the same error
    /// (`ANYCCL_AGREE_TIMEOUT_S`, default 120): it ends sooner on evidence, and waits this
    /// long only for a member that is alive but never arrives (blocked inside a library
    /// that cannot be stopped).
    pub agree_timeout: Duration,
    /// Beat on this driver's thread, shared with the process's other members, instead of a
    /// thread of the member's own (`None`, the default: what a process with one member
    /// wants). Not read from the environment.
    pub liveness_driver: Option<LivenessDriver>,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        MembershipConfig {
            prefix: "anyccl/membership".into(),
            beat: Duration::from_millis(250),
            stale_after: Duration::from_secs(3),
            agree_timeout: Duration::from_secs(120),
            liveness_driver: None,
        }
    }
}

impl MembershipConfig {
    /// Defaults with the environment's overrides.
    ///
    /// # Errors
    /// `InvalidArgument` naming a malformed variable, or a liveness limit not above two
    /// beats (a record renewed once a beat would read as stale between two renewals).
    pub fn from_env() -> Result<Self> {
        let mut c = MembershipConfig::default();
        if let Some(ms) = env_parse("ANYCCL_LIVENESS_BEAT_MS", "a whole number of milliseconds from 1 to 60000", |v| {
            v.parse::<u64>().ok().filter(|m| (1..=60_000).contains(m))
        })? {
            c.beat = Duration::from_millis(ms);
        }
        if let Some(d) = env_secs("ANYCCL_LIVENESS_S")? {
            c.stale_after = d;
        }
        if let Some(d) = env_secs("ANYCCL_AGREE_TIMEOUT_S")? {
            c.agree_timeout = d;
        }
        c.check()
            .map_err(|msg| anyccl_core::Ctx::process("membership").invalid("MembershipConfig", "environment", msg))?;
        Ok(c)
    }

    /// Whether the settings can work together.
    ///
    /// # Errors
    /// A message naming the settings.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.beat.is_zero() {
            return Err("the liveness beat (ANYCCL_LIVENESS_BEAT_MS) is 0".into());
        }
        if self.stale_after <= self.beat * 2 {
            return Err(format!(
                "the liveness limit {:?} (ANYCCL_LIVENESS_S) is not above two beats of {:?} (ANYCCL_LIVENESS_BEAT_MS)",
                self.stale_after, self.beat
            ));
        }
        if self.agree_timeout <= self.stale_after {
            return Err(format!(
                "the agreement timeout {:?} (ANYCCL_AGREE_TIMEOUT_S) is not above the liveness limit {:?}",
                self.agree_timeout, self.stale_after
            ));
        }
        Ok(())
    }
}
