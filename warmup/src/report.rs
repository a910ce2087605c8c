//! The warmup report: per group and step, the op, bytes, time and device-memory delta.

use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// One step on one group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    /// Group name.
    pub group: String,
    /// Group role.
    pub role: String,
    /// Operation.
    pub op: String,
    /// Bytes of this rank's input.
    pub bytes: usize,
    /// Wall time of the step, microseconds.
    pub time_us: f64,
    /// Device memory the step left allocated, with the step's own buffers already released:
    /// what connecting took. Counted as `mem_source` says.
    pub mem_delta: i64,
    /// Where `mem_delta` comes from.
    pub mem_source: MemSource,
}

/// How a step's memory was counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemSource {
    /// The communicator's own count of the device memory it holds (e.g. `ncclCommMemStats`),
    /// after minus before: exact for that group.
    Communicator,
    /// The device's free memory, before minus after: includes anything else this process
    /// (or, on a shared device, another one) allocated or freed meanwhile.
    FreeMemory,
}

impl MemSource {
    /// How it counts, in words.
    pub fn describe(self) -> &'static str {
        match self {
            MemSource::Communicator => "the communicators' own count of the device memory they hold",
            MemSource::FreeMemory => "the device's free memory before and after each step",
        }
    }
}

/// Device memory one step took while connecting, per group and in all.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepCost {
    /// Per group: bytes the step left allocated on that group's communicator (present only
    /// where the communicator keeps a count of its own).
    pub groups: Vec<(String, i64)>,
    /// Bytes in all.
    pub total: i64,
    /// How `total` was counted.
    pub source: MemSource,
}

/// What a warmup did on this rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Job name.
    pub job: String,
    /// Generation.
    pub generation: u64,
    /// This rank (in the job).
    pub rank: usize,
    /// Why nothing ran, when it was skipped.
    pub skipped: Option<String>,
    /// True when this is the recorded outcome of an earlier call of the same generation.
    pub replayed: bool,
    /// Groups excluded from the plan, with the reason.
    pub excluded: Vec<(String, String)>,
    /// Where each group's plan came from (role plan, recorded with a checkpoint, or given by
    /// the caller; a fallback says why).
    pub sources: Vec<(String, String)>,
    /// What the step this warmup protects took when it connected lazily, when known (a saved
    /// plan's recorded cold step, or the caller's measurement): the table gives the ratio.
    pub cold_step: Option<StepCost>,
    /// Steps run.
    pub steps: Vec<StepReport>,
}

impl Report {
    pub(crate) fn new(job: &str, generation: u64, rank: usize) -> Self {
        Report {
            job: job.into(),
            generation,
            rank,
            skipped: None,
            replayed: false,
            excluded: vec![],
            sources: vec![],
            cold_step: None,
            steps: vec![],
        }
    }

    /// Total time of all steps, microseconds.
    pub fn total_time_us(&self) -> f64 {
        self.steps.iter().map(|s| s.time_us).sum()
    }

    /// Total device memory the steps left allocated, bytes.
    pub fn total_mem(&self) -> i64 {
        self.steps.iter().map(|s| s.mem_delta).sum()
    }

    /// Device memory the steps left allocated, per group, in the order the groups ran.
    pub fn mem_per_group(&self) -> Vec<(String, i64)> {
        let mut out: Vec<(String, i64)> = Vec::new();
        for st in &self.steps {
            match out.last_mut() {
                Some((g, m)) if *g == st.group => *m += st.mem_delta,
                _ => out.push((st.group.clone(), st.mem_delta)),
            }
        }
        out
    }

    /// Memory warmed over the cold step's (`cold_step`), when that is known and not zero.
    pub fn cold_ratio(&self) -> Option<f64> {
        let cold = self.cold_step.as_ref()?.total;
        (cold > 0).then(|| self.total_mem() as f64 / cold as f64)
    }

    /// A human-readable table.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "warmup of job '{}' generation {} on rank {}", self.job, self.generation, self.rank);
        if let Some(why) = &self.skipped {
            let _ = writeln!(s, "  skipped: {why}");
            return s;
        }
        if self.replayed {
            let _ = writeln!(s, "  (recorded outcome of an earlier call; no collective issued)");
        }
        for (g, why) in &self.excluded {
            let _ = writeln!(s, "  excluded group '{g}': {why}");
        }
        let _ = writeln!(
            s,
            "  {:<16} {:<13} {:<18} {:>12} {:>11} {:>12}",
            "group", "role", "op", "bytes", "time (ms)", "memory (MiB)"
        );
        for st in &self.steps {
            let _ = writeln!(
                s,
                "  {:<16} {:<13} {:<18} {:>12} {:>11.2} {:>12.1}",
                st.group,
                st.role,
                st.op,
                st.bytes,
                st.time_us / 1e3,
                st.mem_delta as f64 / (1 << 20) as f64
            );
        }
        let mib = |b: i64| b as f64 / (1 << 20) as f64;
        for (g, m) in self.mem_per_group() {
            let _ =
                writeln!(s, "  {:<16} {:<13} {:<18} {:>12} {:>11} {:>12.1}", g, "", "(group total)", "", "", mib(m));
        }
        let _ = writeln!(
            s,
            "  {:<16} {:<13} {:<18} {:>12} {:>11.2} {:>12.1}",
            "total",
            "",
            "",
            "",
            self.total_time_us() / 1e3,
            self.total_mem() as f64 / (1 << 20) as f64
        );
        let mut sources: Vec<MemSource> = Vec::new();
        for st in &self.steps {
            if !sources.contains(&st.mem_source) {
                sources.push(st.mem_source);
            }
        }
        if !sources.is_empty() {
            let how: Vec<&str> = sources.iter().map(|m| m.describe()).collect();
            let _ = writeln!(s, "  memory: from {}", how.join(", and for some steps "));
        }
        if let Some(cold) = &self.cold_step {
            match self.cold_ratio() {
                Some(r) => {
                    let _ = writeln!(
                        s,
                        "  warmed {:.1} MiB = {r:.3}x the {:.1} MiB the step took cold (counted from {})",
                        mib(self.total_mem()),
                        mib(cold.total),
                        cold.source.describe()
                    );
                }
                None => {
                    let _ = writeln!(s, "  warmed {:.1} MiB; the step took nothing cold", mib(self.total_mem()));
                }
            }
        }
        for (g, why) in &self.sources {
            let _ = writeln!(s, "  plan of '{g}': {why}");
        }
        s
    }

    /// The report as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}
