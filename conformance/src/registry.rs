//! The case registry: every case with the world sizes it runs at, what it needs from the
//! backend, and how its ranks run.

use crate::harness::{CaseResult, RankCtx};
use anyccl_core::Capabilities;
use std::sync::Arc;

/// How a case's ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// As threads of the test process.
    Threads,
    /// As child processes; rank `dies` (if any) is expected to die.
    Processes {
        /// The rank that kills itself.
        dies: Option<usize>,
    },
}

/// The body of a case, run on every rank.
pub type CaseFn = Arc<dyn Fn(&RankCtx) -> CaseResult + Send + Sync>;
/// Why a backend cannot run a case at a world size (`None`: it can).
pub type Needs = Arc<dyn Fn(&Capabilities, usize) -> Option<String> + Send + Sync>;

/// One conformance case.
#[derive(Clone)]
pub struct Case {
    /// Group of cases (`all_reduce`, `p2p`, `errors`, ...).
    pub group: &'static str,
    /// Name within the group.
    pub name: String,
    /// World sizes it runs at (filtered by the runner's list).
    pub worlds: Vec<usize>,
    /// Capability check.
    pub needs: Needs,
    /// Threads or processes.
    pub mode: Mode,
    /// The body.
    pub run: CaseFn,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Case({})", self.full_name())
    }
}

impl Case {
    /// A thread-mode case with no needs.
    pub fn new(
        group: &'static str,
        name: impl Into<String>,
        worlds: &[usize],
        run: impl Fn(&RankCtx) -> CaseResult + Send + Sync + 'static,
    ) -> Self {
        Case {
            group,
            name: name.into(),
            worlds: worlds.to_vec(),
            needs: Arc::new(|_, _| None),
            mode: Mode::Threads,
            run: Arc::new(run),
        }
    }

    /// Add a capability check.
    pub fn needs(mut self, f: impl Fn(&Capabilities, usize) -> Option<String> + Send + Sync + 'static) -> Self {
        self.needs = Arc::new(f);
        self
    }

    /// Run as processes.
    pub fn processes(mut self, dies: Option<usize>) -> Self {
        self.mode = Mode::Processes { dies };
        self
    }

    /// `group::name`.
    pub fn full_name(&self) -> String {
        format!("{}::{}", self.group, self.name)
    }

    /// `backend::group::name[w=N]`.
    pub fn test_name(&self, backend: &str, w: usize) -> String {
        format!("{backend}::{}::{}[w={w}]", self.group, self.name)
    }
}

/// World sizes every case is tried at unless it says otherwise.
pub const DEFAULT_WORLDS: &[usize] = &[1, 2, 3, 4, 5, 8];

/// Every registered case.
pub fn all_cases() -> Vec<Case> {
    let mut v = Vec::new();
    crate::cases::collectives::register(&mut v);
    crate::cases::p2p::register(&mut v);
    crate::cases::groups::register(&mut v);
    crate::cases::errors::register(&mut v);
    crate::cases::lifecycle::register(&mut v);
    crate::cases::warmup::register(&mut v);
    crate::cases::register::register(&mut v);
    crate::cases::window::register(&mut v);
    crate::cases::streams::register(&mut v);
    v
}
