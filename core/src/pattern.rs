//! Deterministic data for checking collectives: each rank computes every expected output by
//! itself (the conformance suite and the benchmark use it).
//!
//! Values are small integers (1..=4, or 1..=2 for products) so sums and products are exact
//! in every dtype whatever order a backend reduces in; only `Avg` on floats is compared
//! with a tolerance, since backends may scale before summing.

use crate::{bf16, f16, DType, ReduceOp};

/// Inputs repeat with this period in the element index: `value(r, i + PERIOD, ..)` equals
/// `value(r, i, ..)`, so a checker can tabulate every expected output once.
pub const PERIOD: usize = 4;

/// Input element `i` of `rank` for reduce op `op` (`salt` varies inputs between buffers).
pub fn value(rank: usize, i: usize, op: Option<ReduceOp>, salt: usize) -> f64 {
    match op {
        Some(ReduceOp::Prod) => ((rank + i + salt) % 2 + 1) as f64,
        _ => ((rank * 3 + i * 7 + salt) % 4 + 1) as f64,
    }
}

/// `count` input elements of `rank`.
pub fn values(rank: usize, count: usize, op: Option<ReduceOp>, salt: usize) -> Vec<f64> {
    (0..count).map(|i| value(rank, i, op, salt)).collect()
}

/// `v` as it is stored in `dtype` (integers wrap, as the backends' arithmetic does).
pub fn round_trip(v: f64, dtype: DType) -> f64 {
    let i = v as i64;
    match dtype {
        DType::I8 => i as i8 as f64,
        DType::U8 => i as u8 as f64,
        DType::I32 => i as i32 as f64,
        DType::U32 => i as u32 as f64,
        DType::I64 => i as f64,
        DType::U64 => i as u64 as f64,
        DType::F16 => f16::from_f64(v).to_f64(),
        DType::BF16 => bf16::from_f64(v).to_f64(),
        DType::F32 => v as f32 as f64,
        DType::F64 => v,
    }
}

/// Values as bytes of `dtype`.
pub fn encode(vals: &[f64], dtype: DType) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    for &v in vals {
        let i = v as i64;
        match dtype {
            DType::I8 => out.extend_from_slice(&(i as i8).to_le_bytes()),
            DType::U8 => out.extend_from_slice(&(i as u8).to_le_bytes()),
            DType::I32 => out.extend_from_slice(&(i as i32).to_le_bytes()),
            DType::U32 => out.extend_from_slice(&(i as u32).to_le_bytes()),
            DType::I64 => out.extend_from_slice(&i.to_le_bytes()),
            DType::U64 => out.extend_from_slice(&(i as u64).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f64(v).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f64(v).to_le_bytes()),
            DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
        }
    }
    out
}

/// Bytes of `dtype` as values.
pub fn decode(bytes: &[u8], dtype: DType) -> Vec<f64> {
    bytes.chunks_exact(dtype.size()).map(|b| decode_one(b, dtype)).collect()
}

/// One element's bytes (`dtype.size()` of them) as a value.
pub fn decode_one(b: &[u8], dtype: DType) -> f64 {
    match dtype {
        DType::I8 => i8::from_le_bytes([b[0]]) as f64,
        DType::U8 => b[0] as f64,
        DType::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::I64 => i64::from_le_bytes(b.try_into().unwrap_or_default()) as f64,
        DType::U64 => u64::from_le_bytes(b.try_into().unwrap_or_default()) as f64,
        DType::F16 => f16::from_le_bytes([b[0], b[1]]).to_f64(),
        DType::BF16 => bf16::from_le_bytes([b[0], b[1]]).to_f64(),
        DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::F64 => f64::from_le_bytes(b.try_into().unwrap_or_default()),
    }
}

/// Element `i` of the reduction over `n` ranks' inputs, as stored in `dtype`.
pub fn reduced(n: usize, i: usize, dtype: DType, op: ReduceOp, salt: usize) -> f64 {
    let vals = (0..n).map(|r| value(r, i, Some(op), salt));
    let v = match op {
        ReduceOp::Sum | ReduceOp::Avg => vals.sum::<f64>(),
        ReduceOp::Prod => vals.product::<f64>(),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
    };
    let v = round_trip(v, dtype);
    if op != ReduceOp::Avg {
        return v;
    }
    match dtype {
        DType::F64 => v / n as f64,
        DType::F32 | DType::F16 | DType::BF16 => round_trip(((v as f32) / n as f32) as f64, dtype),
        _ => ((v as i64) / n as i64) as f64,
    }
}

/// Relative tolerance of a result: exact, except averages of floats (backends may scale
/// before summing).
pub fn tolerance(dtype: DType, op: Option<ReduceOp>) -> f64 {
    match (op, dtype) {
        (Some(ReduceOp::Avg), DType::F16 | DType::BF16) => 1e-2,
        (Some(ReduceOp::Avg), DType::F32) => 1e-6,
        (Some(ReduceOp::Avg), DType::F64) => 1e-12,
        _ => 0.0,
    }
}

/// Whether `got` equals `want` within the relative tolerance `tol`.
pub fn close(got: f64, want: f64, tol: f64) -> bool {
    if tol == 0.0 {
        got == want
    } else {
        (got - want).abs() <= tol * want.abs().max(1.0)
    }
}

/// Compare `got` with `want`; `Err` names the first differing element.
pub fn check(what: &str, got: &[f64], want: &[f64], dtype: DType, op: Option<ReduceOp>) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} elements, expected {}", got.len(), want.len()));
    }
    let tol = tolerance(dtype, op);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if !close(*g, *w, tol) {
            return Err(format!("{what}: element {i} is {g}, expected {w} ({dtype})"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_repeat_with_the_period_and_round_trips_match_the_encoding() {
        for op in [None, Some(ReduceOp::Sum), Some(ReduceOp::Prod), Some(ReduceOp::Max)] {
            for r in 0..8 {
                for i in 0..64 {
                    assert_eq!(value(r, i + PERIOD, op, 3), value(r, i, op, 3));
                }
            }
        }
        for d in DType::ALL {
            for v in [0.0, 1.0, 4.0, 255.0, 256.0, -1.0, 1e6, 0.1] {
                assert_eq!(round_trip(v, d).to_bits(), decode(&encode(&[v], d), d)[0].to_bits(), "{d} {v}");
            }
        }
    }
}
