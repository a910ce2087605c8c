//! The training rank's communication: its tensors go through device buffers, as a real
//! engine's do, for the data group's gradient average and the pipeline's sends and receives.

use anyccl::{Communicator, DType, DeviceMemory, Platform, ReduceOp, Result};
use std::time::Duration;

/// Host data through device buffers: how a real engine's tensors meet the communicator.
pub(crate) struct Dev<'a> {
    pub(crate) p: &'a dyn Platform,
    pub(crate) timeout: Duration,
}

impl Dev<'_> {
    fn upload(&self, data: &[f32]) -> Result<Box<dyn DeviceMemory>> {
        let mut m = self.p.alloc(DType::F32, data.len())?;
        self.p.copy_from_host(m.as_mut(), &le_bytes(data))?;
        Ok(m)
    }
    fn download(&self, m: &dyn DeviceMemory, out: &mut [f32]) -> Result<()> {
        self.p.synchronize()?;
        let mut bytes = vec![0u8; out.len() * 4];
        self.p.copy_to_host(m, &mut bytes)?;
        for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        Ok(())
    }
    pub(crate) fn all_reduce_avg(&self, c: &Communicator, data: &mut [f32]) -> Result<()> {
        if c.size() == 1 {
            return Ok(());
        }
        let mut m = self.upload(data)?;
        // A library without an average (HCCL) sums; the mean is then taken here.
        let avg = c.capabilities().supports_reduce_op(ReduceOp::Avg);
        let op = if avg { ReduceOp::Avg } else { ReduceOp::Sum };
        c.all_reduce(None, m.view_mut(), op)?.wait(self.timeout)?;
        self.download(m.as_ref(), data)?;
        if !avg {
            let n = c.size() as f32;
            data.iter_mut().for_each(|x| *x /= n);
        }
        Ok(())
    }
    /// `data` from group rank `root` to every member of `c`, in place.
    pub(crate) fn broadcast(&self, c: &Communicator, data: &mut [f32], root: usize) -> Result<()> {
        if c.size() == 1 {
            return Ok(());
        }
        let mut m = self.upload(data)?;
        c.broadcast(None, m.view_mut(), root)?.wait(self.timeout)?;
        self.download(m.as_ref(), data)
    }
    pub(crate) fn send(&self, c: &Communicator, data: &[f32], peer: usize) -> Result<()> {
        let m = self.upload(data)?;
        let mut w = c.send(m.view(), peer)?;
        w.wait(self.timeout)?;
        drop(w);
        Ok(())
    }
    pub(crate) fn recv(&self, c: &Communicator, out: &mut [f32], peer: usize) -> Result<()> {
        let mut m = self.p.alloc(DType::F32, out.len())?;
        c.recv(m.view_mut(), peer)?.wait(self.timeout)?;
        self.download(m.as_ref(), out)
    }
}

fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
