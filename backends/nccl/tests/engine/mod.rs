//! The conformance suite's engine stream on CUDA: anyccl-nccl's `EngineStream`, a stream of
//! the engine's own with a spin kernel (an engine's long compute) and a fill kernel (an
//! engine's kernel writing a buffer), and its graphs.

use anyccl_conformance::cases::streams::Engine;
use anyccl_conformance::CaseError;
use anyccl_core::{DType, DeviceMemory, Platform, StreamRef};
use anyccl_nccl::{EngineStream, Graph};
use std::sync::Arc;
use std::time::Duration;

/// An engine stream on `platform`'s device.
pub fn open(platform: &Arc<dyn Platform>) -> Result<Box<dyn Engine>, CaseError> {
    Ok(Box::new(CudaEngine { graphs: Vec::new(), stream: EngineStream::new(platform.device())?, held: Vec::new() }))
}

/// Dropped in field order after `Drop::drop` waited for the stream: the graphs, then the
/// stream, then the buffers its kernels wrote.
struct CudaEngine {
    graphs: Vec<Graph>,
    stream: EngineStream,
    held: Vec<Arc<dyn DeviceMemory>>,
}

impl Engine for CudaEngine {
    fn stream(&self) -> StreamRef<'_> {
        self.stream.stream_ref()
    }
    fn delay(&mut self, d: Duration) -> Result<(), CaseError> {
        Ok(self.stream.spin_us(d.as_secs_f64() * 1e6)?)
    }
    fn fill_f32(&mut self, dst: &Arc<dyn DeviceMemory>, value: f32) -> Result<(), CaseError> {
        if dst.dtype() != DType::F32 {
            return Err(CaseError(format!("fill_f32 on a buffer of {}", dst.dtype())));
        }
        let ptr = dst.view().ptr() as *mut std::ffi::c_void;
        // SAFETY: `dst` holds `count` f32s of this device and is kept in `held` until the
        // stream has been waited for (Drop).
        unsafe { self.stream.fill_f32(ptr, dst.count(), value) }?;
        self.held.push(dst.clone());
        Ok(())
    }
    fn begin_capture(&mut self) -> Result<(), CaseError> {
        Ok(self.stream.begin_capture()?)
    }
    fn end_capture(&mut self) -> Result<usize, CaseError> {
        self.graphs.push(self.stream.end_capture()?);
        Ok(self.graphs.len() - 1)
    }
    fn replay(&mut self, graph: usize) -> Result<(), CaseError> {
        let g = self.graphs.get(graph).ok_or_else(|| CaseError(format!("no graph {graph}")))?;
        Ok(self.stream.replay(g)?)
    }
    fn synchronize(&mut self, timeout: Duration) -> Result<(), CaseError> {
        Ok(self.stream.synchronize(timeout)?)
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        if let Err(e) = self.stream.synchronize(Duration::from_secs(30)) {
            // The kernels may still write the buffers: leave them allocated.
            eprintln!("engine stream: {e}; its buffers are leaked");
            std::mem::forget(std::mem::take(&mut self.held));
        }
    }
}
