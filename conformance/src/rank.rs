//! One rank's view of a running case ([`RankCtx`]: its communicator, device, store and
//! helpers to move values and signal peers), and what a case returns on it.

use crate::pattern;
use anyccl_core::{Backend, CommConfig, Communicator, DType, DeviceMemory, GroupSpec, Platform, Role, Store, Work};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why a case failed on one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaseError(pub String);

impl From<anyccl_core::Error> for CaseError {
    fn from(e: anyccl_core::Error) -> Self {
        CaseError(format!("{} error: {e}", e.kind()))
    }
}
impl From<String> for CaseError {
    fn from(s: String) -> Self {
        CaseError(s)
    }
}
impl From<&str> for CaseError {
    fn from(s: &str) -> Self {
        CaseError(s.to_string())
    }
}

/// What a case returns on one rank.
pub type CaseResult = Result<(), CaseError>;

/// Fail the case with a formatted message unless `cond` holds.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($arg:tt)*) => {
        if !$cond {
            return Err($crate::CaseError(format!($($arg)*)));
        }
    };
}

/// One rank's view of a running case.
#[derive(Debug)]
pub struct RankCtx {
    /// The world communicator (group `world`).
    pub comm: Communicator,
    /// The rank's device layer.
    pub platform: Arc<dyn Platform>,
    /// The rendezvous store shared by all ranks of the case.
    pub store: Arc<dyn Store>,
    /// The backend under test.
    pub backend: Arc<dyn Backend>,
    /// This rank.
    pub rank: usize,
    /// World size.
    pub size: usize,
    /// How long one wait may take.
    pub timeout: Duration,
    pub(crate) rt: tokio::runtime::Runtime,
}

impl RankCtx {
    /// Run a future to completion on this rank's runtime.
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// A device buffer holding `vals` as `dtype`.
    ///
    /// # Errors
    /// Allocation or copy failures.
    pub fn upload(&self, dtype: DType, vals: &[f64]) -> Result<Box<dyn DeviceMemory>, CaseError> {
        let mut m = self.platform.alloc(dtype, vals.len())?;
        self.platform.copy_from_host(m.as_mut(), &pattern::encode(vals, dtype))?;
        Ok(m)
    }

    /// A zero-filled device buffer.
    ///
    /// # Errors
    /// Allocation failures.
    pub fn zeros(&self, dtype: DType, count: usize) -> Result<Box<dyn DeviceMemory>, CaseError> {
        Ok(self.platform.alloc(dtype, count)?)
    }

    /// A device buffer's contents as values.
    ///
    /// # Errors
    /// Copy failures.
    pub fn download(&self, m: &dyn DeviceMemory) -> Result<Vec<f64>, CaseError> {
        self.platform.synchronize()?;
        let mut bytes = vec![0u8; m.count() * m.dtype().size()];
        self.platform.copy_to_host(m, &mut bytes)?;
        Ok(pattern::decode(&bytes, m.dtype()))
    }

    /// Wait for `w` with the case's timeout.
    ///
    /// # Errors
    /// The operation's failure.
    pub fn wait(&self, mut w: Work<'_>) -> CaseResult {
        w.wait(self.timeout)?;
        Ok(())
    }

    /// Connect group `name` of every rank (owner `conformance`) with `role` and `config`.
    ///
    /// # Errors
    /// The connect's.
    pub fn connect_all(&self, name: &str, role: Role, config: CommConfig) -> anyccl_core::Result<Communicator> {
        let spec = GroupSpec::new(name, (0..self.size).collect(), "conformance", role);
        let device = self.platform.device();
        self.block_on(Communicator::connect(self.backend.as_ref(), spec, self.rank, self.store.clone(), device, config))
    }

    /// Tell the other ranks `key` happened (through the store).
    ///
    /// # Errors
    /// Store failures.
    pub fn signal(&self, key: &str) -> CaseResult {
        self.block_on(self.store.set(&format!("case/{key}"), b"1"))?;
        Ok(())
    }

    /// Whether some rank has signalled `key` by now (no waiting).
    ///
    /// # Errors
    /// Store failures.
    pub fn signalled(&self, key: &str) -> Result<bool, CaseError> {
        Ok(self.block_on(self.store.get(&format!("case/{key}")))?.is_some())
    }

    /// After a passing body: wait (at most 5 s) until every rank's body but `dead`'s (a rank
    /// the case kills) has passed, so no rank tears its communicator down while a peer's last
    /// operation is still finishing (NCCL over sockets reports that as a remote error on the
    /// peer).
    pub(crate) fn finish_together(&self, dead: Option<usize>) {
        let deadline = Instant::now() + Duration::from_secs(5);
        // The barrier is among the living: this rank's place among them.
        let index = self.rank - usize::from(dead.is_some_and(|d| d < self.rank));
        let ranks = self.size - usize::from(dead.is_some());
        // A rank that never arrives failed: its own error reports the case.
        let _ = self.block_on(anyccl_core::store_barrier(self.store.as_ref(), "case/finished", index, ranks, deadline));
    }

    /// Wait until some rank signalled `key`.
    ///
    /// # Errors
    /// `Timeout` after the case's timeout.
    pub fn await_signal(&self, key: &str) -> CaseResult {
        self.block_on(self.store.wait(&format!("case/{key}"), Instant::now() + self.timeout))?;
        Ok(())
    }
}
