//! The split's agreement on members: every rank of the parent publishes its color and key,
//! and each rank with a color takes the ranks of its color, ordered by key, as its new
//! communicator.

use super::*;

impl CpuComm {
    /// The members of color `color` as `(key, rank)`, ordered by key (then rank), from what
    /// every rank published under `base` (`color key`, or `-` for none).
    ///
    /// # Errors
    /// `Timeout` naming the rank that never entered the split by `deadline`; the store's error.
    pub(super) async fn split_members(&self, base: &str, color: u32, deadline: Instant) -> Result<Vec<(u32, usize)>> {
        let mut members = Vec::new();
        for r in 0..self.info.size {
            let v = match self.store.wait(&format!("{base}/{r}"), deadline).await {
                Ok(v) => v,
                Err(Error::Timeout { after, .. }) => {
                    return Err(self.mesh.ctx.timeout("split", after, format!("rank {r} never entered the split")))
                }
                Err(e) => return Err(e),
            };
            let v = String::from_utf8_lossy(&v).to_string();
            let mut it = v.split(' ');
            if let (Some(c), Some(kk)) =
                (it.next().and_then(|x| x.parse::<u32>().ok()), it.next().and_then(|x| x.parse::<u32>().ok()))
            {
                if c == color {
                    members.push((kk, r));
                }
            }
        }
        members.sort();
        Ok(members)
    }
}
