//! Element-wise reduction kernels over byte buffers.
//!
//! Buffers are viewed in place as typed slices when aligned (the common case: they come
//! from the allocator and chunk offsets are multiples of the element size); otherwise
//! the elements are copied to an aligned scratch first. Integers wrap on overflow;
//! 16-bit floats compute in f32 and round once per step.

use anyccl_core::{bf16, f16, DType, ReduceOp};
use bytemuck::Pod;

fn zip_with<T: Pod>(acc: &mut [u8], other: &[u8], f: impl Fn(T, T) -> T) {
    match (bytemuck::try_cast_slice_mut::<u8, T>(acc), bytemuck::try_cast_slice::<u8, T>(other)) {
        (Ok(a), Ok(b)) => {
            for (x, y) in a.iter_mut().zip(b) {
                *x = f(*x, *y);
            }
        }
        _ => {
            let mut a: Vec<T> = bytemuck::pod_collect_to_vec(acc);
            let b: Vec<T> = bytemuck::pod_collect_to_vec(other);
            for (x, y) in a.iter_mut().zip(&b) {
                *x = f(*x, *y);
            }
            acc.copy_from_slice(bytemuck::cast_slice(&a));
        }
    }
}

fn map<T: Pod>(buf: &mut [u8], f: impl Fn(T) -> T) {
    match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        Ok(a) => a.iter_mut().for_each(|x| *x = f(*x)),
        Err(_) => {
            let mut a: Vec<T> = bytemuck::pod_collect_to_vec(buf);
            a.iter_mut().for_each(|x| *x = f(*x));
            buf.copy_from_slice(bytemuck::cast_slice(&a));
        }
    }
}

macro_rules! int_op {
    ($t:ty, $acc:expr, $other:expr, $op:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => zip_with::<$t>($acc, $other, |a, b| a.wrapping_add(b)),
            ReduceOp::Prod => zip_with::<$t>($acc, $other, |a, b| a.wrapping_mul(b)),
            ReduceOp::Min => zip_with::<$t>($acc, $other, |a, b| a.min(b)),
            ReduceOp::Max => zip_with::<$t>($acc, $other, |a, b| a.max(b)),
        }
    };
}

macro_rules! float_op {
    ($t:ty, $acc:expr, $other:expr, $op:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => zip_with::<$t>($acc, $other, |a, b| a + b),
            ReduceOp::Prod => zip_with::<$t>($acc, $other, |a, b| a * b),
            ReduceOp::Min => zip_with::<$t>($acc, $other, |a, b| if b < a { b } else { a }),
            ReduceOp::Max => zip_with::<$t>($acc, $other, |a, b| if b > a { b } else { a }),
        }
    };
}

macro_rules! half_op {
    ($t:ty, $acc:expr, $other:expr, $op:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => {
                zip_with::<$t>($acc, $other, |a, b| <$t>::from_f32(a.to_f32() + b.to_f32()))
            }
            ReduceOp::Prod => zip_with::<$t>($acc, $other, |a, b| <$t>::from_f32(a.to_f32() * b.to_f32())),
            ReduceOp::Min => zip_with::<$t>($acc, $other, |a, b| if b.to_f32() < a.to_f32() { b } else { a }),
            ReduceOp::Max => zip_with::<$t>($acc, $other, |a, b| if b.to_f32() > a.to_f32() { b } else { a }),
        }
    };
}

/// `acc[i] = acc[i] op other[i]` (for `Avg`, the sum; call [`finish_avg`] once at the end).
pub(crate) fn reduce_into(acc: &mut [u8], other: &[u8], dtype: DType, op: ReduceOp) {
    debug_assert_eq!(acc.len(), other.len());
    match dtype {
        DType::I8 => int_op!(i8, acc, other, op),
        DType::U8 => int_op!(u8, acc, other, op),
        DType::I32 => int_op!(i32, acc, other, op),
        DType::U32 => int_op!(u32, acc, other, op),
        DType::I64 => int_op!(i64, acc, other, op),
        DType::U64 => int_op!(u64, acc, other, op),
        DType::F32 => float_op!(f32, acc, other, op),
        DType::F64 => float_op!(f64, acc, other, op),
        DType::F16 => half_op!(f16, acc, other, op),
        DType::BF16 => half_op!(bf16, acc, other, op),
    }
}

/// Divide a summed buffer by `n` (integers truncate; 16-bit floats divide in f32).
pub(crate) fn finish_avg(buf: &mut [u8], dtype: DType, n: usize) {
    match dtype {
        DType::I8 => map::<i8>(buf, |x| x / n as i8),
        DType::U8 => map::<u8>(buf, |x| x / n as u8),
        DType::I32 => map::<i32>(buf, |x| x / n as i32),
        DType::U32 => map::<u32>(buf, |x| x / n as u32),
        DType::I64 => map::<i64>(buf, |x| x / n as i64),
        DType::U64 => map::<u64>(buf, |x| x / n as u64),
        DType::F32 => map::<f32>(buf, |x| x / n as f32),
        DType::F64 => map::<f64>(buf, |x| x / n as f64),
        DType::F16 => map::<f16>(buf, |x| f16::from_f32(x.to_f32() / n as f32)),
        DType::BF16 => map::<bf16>(buf, |x| bf16::from_f32(x.to_f32() / n as f32)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_unaligned_f32() {
        let a: Vec<f32> = vec![1.0, 2.0, 3.0];
        let b: Vec<f32> = vec![10.0, 20.0, 30.0];
        let mut abytes = [0u8; 13];
        abytes[1..].copy_from_slice(bytemuck::cast_slice(&a));
        let mut bbytes = [0u8; 13];
        bbytes[1..].copy_from_slice(bytemuck::cast_slice(&b));
        reduce_into(&mut abytes[1..], &bbytes[1..], DType::F32, ReduceOp::Sum);
        let r: Vec<f32> = bytemuck::pod_collect_to_vec(&abytes[1..]);
        assert_eq!(r, vec![11.0, 22.0, 33.0]);
    }

    #[test]
    fn avg_truncates_integers() {
        let mut v: Vec<u8> = bytemuck::cast_slice(&[7i32, -7]).to_vec();
        finish_avg(&mut v, DType::I32, 2);
        assert_eq!(bytemuck::pod_collect_to_vec::<u8, i32>(&v), vec![3, -3]);
    }
}
