//! The model every rank trains: dense tanh layers per pipeline stage, seeded so that every
//! run of the same flags starts from the same parameters and reads the same batches.

/// splitmix64: a seeded stream of uniform floats in [-1, 1).
struct Rng(u64);
impl Rng {
    fn new(parts: &[u64]) -> Self {
        let mut r = Rng(0x9E37_79B9_7F4A_7C15);
        for p in parts {
            r.0 ^= p.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            r.next();
        }
        r
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// One stage: `layers` dense tanh layers of width `h`; parameters flat (W row-major, then b).
pub(crate) struct Stage {
    h: usize,
    layers: usize,
    pub(crate) params: Vec<f32>,
}

impl Stage {
    /// Parameters of `layers` layers of width `h`; `None` where the count overflows.
    pub(crate) fn param_count(h: usize, layers: usize) -> Option<usize> {
        h.checked_mul(h)?.checked_add(h)?.checked_mul(layers)
    }

    /// A stage's seeded parameters.
    ///
    /// # Errors
    /// The parameters do not fit in memory: the allocation is fallible, never an abort.
    pub(crate) fn new(h: usize, layers: usize, seed: u64, stage: usize) -> Result<Self, String> {
        let count = Self::param_count(h, layers).ok_or("the parameter count overflows")?;
        let mut params = Vec::new();
        params
            .try_reserve_exact(count)
            .map_err(|e| format!("cannot allocate {count} parameters ({} bytes): {e}", count.saturating_mul(4)))?;
        for l in 0..layers {
            let mut r = Rng::new(&[seed, stage as u64, l as u64]);
            let scale = 1.0 / (h as f32).sqrt();
            params.extend((0..h * h).map(|_| r.uniform() * scale));
            params.extend((0..h).map(|_| r.uniform() * 0.1));
        }
        Ok(Stage { h, layers, params })
    }
    fn layer(&self, l: usize) -> (&[f32], &[f32]) {
        let per = self.h * self.h + self.h;
        let p = &self.params[l * per..(l + 1) * per];
        p.split_at(self.h * self.h)
    }
    /// Activations of every layer (input first).
    pub(crate) fn forward(&self, x: &[f32], rows: usize) -> Vec<Vec<f32>> {
        let h = self.h;
        let mut acts = vec![x.to_vec()];
        for l in 0..self.layers {
            let (w, b) = self.layer(l);
            let a = acts.last().map(|v| v.as_slice()).unwrap_or(&[]);
            let mut y = vec![0f32; rows * h];
            for r in 0..rows {
                for o in 0..h {
                    let mut s = b[o];
                    for i in 0..h {
                        s += w[o * h + i] * a[r * h + i];
                    }
                    y[r * h + o] = s.tanh();
                }
            }
            acts.push(y);
        }
        acts
    }
    /// Given d(loss)/d(output), the gradient of the parameters and of the input.
    pub(crate) fn backward(&self, acts: &[Vec<f32>], dout: &[f32], rows: usize) -> (Vec<f32>, Vec<f32>) {
        let h = self.h;
        let per = h * h + h;
        let mut grads = vec![0f32; self.params.len()];
        let mut da = dout.to_vec();
        for l in (0..self.layers).rev() {
            let (w, _) = self.layer(l);
            let (a_in, a_out) = (&acts[l], &acts[l + 1]);
            let dz: Vec<f32> = da.iter().zip(a_out).map(|(d, y)| d * (1.0 - y * y)).collect();
            let g = &mut grads[l * per..(l + 1) * per];
            for r in 0..rows {
                for o in 0..h {
                    let d = dz[r * h + o];
                    for i in 0..h {
                        g[o * h + i] += d * a_in[r * h + i];
                    }
                    g[h * h + o] += d;
                }
            }
            let mut dx = vec![0f32; rows * h];
            for r in 0..rows {
                for i in 0..h {
                    let mut s = 0f32;
                    for o in 0..h {
                        s += dz[r * h + o] * w[o * h + i];
                    }
                    dx[r * h + i] = s;
                }
            }
            da = dx;
        }
        (grads, da)
    }
}

pub(crate) fn batch(seed: u64, step: u64, replica: usize, rows: usize, h: usize) -> Vec<f32> {
    let mut r = Rng::new(&[seed, 7, step, replica as u64]);
    (0..rows * h).map(|_| r.uniform()).collect()
}
