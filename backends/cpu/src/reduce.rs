//! Element-wise reduction kernels over byte buffers.
//!
//! Buffers are viewed in place as typed slices when aligned (the common case: they come
//! from the allocator and chunk offsets are multiples of the element size); otherwise
//! the elements are copied to an aligned scratch first. Integers wrap on overflow;
//! 16-bit floats compute in f32 and round once per step, a block at a time. Every kernel is
//! a plain loop over slices that the compiler vectorizes.

use anyccl_core::{bf16, f16, DType, ReduceOp};
use bytemuck::Pod;

/// The operands of one reduction.
enum Operands<'a> {
    /// `acc = acc op other`.
    InPlace { acc: &'a mut [u8], other: &'a [u8] },
    /// `dst = a op b`: one pass over the three buffers, where copying `a` into `dst` first
    /// would be a second.
    To { dst: &'a mut [u8], a: &'a [u8], b: &'a [u8] },
}

/// Whether `b` can be viewed in place as a slice of `T`.
fn fits<T: Pod>(b: &[u8]) -> bool {
    bytemuck::try_cast_slice::<u8, T>(b).is_ok()
}

fn zip_with<T: Pod>(ops: Operands<'_>, f: impl Fn(T, T) -> T) {
    match ops {
        Operands::To { dst, a, b } if fits::<T>(dst) && fits::<T>(a) && fits::<T>(b) => {
            let (d, a, b) = (bytemuck::cast_slice_mut::<u8, T>(dst), bytemuck::cast_slice(a), bytemuck::cast_slice(b));
            for ((x, y), z) in d.iter_mut().zip(a).zip(b) {
                *x = f(*y, *z);
            }
        }
        Operands::To { dst, a, b } => {
            dst.copy_from_slice(a);
            zip_with::<T>(Operands::InPlace { acc: dst, other: b }, f)
        }
        Operands::InPlace { acc, other } if fits::<T>(acc) && fits::<T>(other) => {
            for (x, y) in bytemuck::cast_slice_mut::<u8, T>(acc).iter_mut().zip(bytemuck::cast_slice(other)) {
                *x = f(*x, *y);
            }
        }
        Operands::InPlace { acc, other } => {
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
    ($t:ty, $ops:expr, $op:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => zip_with::<$t>($ops, |a, b| a.wrapping_add(b)),
            ReduceOp::Prod => zip_with::<$t>($ops, |a, b| a.wrapping_mul(b)),
            ReduceOp::Min => zip_with::<$t>($ops, |a, b| a.min(b)),
            ReduceOp::Max => zip_with::<$t>($ops, |a, b| a.max(b)),
        }
    };
}

macro_rules! float_op {
    ($t:ty, $ops:expr, $op:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => zip_with::<$t>($ops, |a, b| a + b),
            ReduceOp::Prod => zip_with::<$t>($ops, |a, b| a * b),
            ReduceOp::Min => zip_with::<$t>($ops, |a, b| if b < a { b } else { a }),
            ReduceOp::Max => zip_with::<$t>($ops, |a, b| if b > a { b } else { a }),
        }
    };
}

/// 16-bit floats reduce in blocks: both operands widened to f32 in a block on the stack (F16C
/// where the processor has it, through `half`'s slice conversions; bf16 by a shift), the op
/// applied by a loop the compiler vectorizes, and the result rounded back once. The results
/// are those of widening, computing and rounding each element alone.
const BLOCK: usize = 512;

trait Half: Pod {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Half for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src);
    }
}

impl Half for bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            // Round to nearest even; a NaN stays a (quiet) NaN.
            let x = s.to_bits();
            let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
            let nan = (x & 0x7fff_ffff) > 0x7f80_0000;
            *d = bf16::from_bits(if nan { ((x >> 16) as u16) | 0x0040 } else { rounded });
        }
    }
}

fn half_zip<T: Half>(ops: Operands<'_>, f: impl Fn(f32, f32) -> f32 + Copy) {
    // `dst = a op b`, or, without `a`, `dst = dst op b`.
    let block = |d: &mut [T], a: Option<&[T]>, b: &[T]| {
        let (mut x, mut y) = ([0f32; BLOCK], [0f32; BLOCK]);
        for (i, (cd, cb)) in d.chunks_mut(BLOCK).zip(b.chunks(BLOCK)).enumerate() {
            let k = cd.len();
            T::widen(a.map_or(&*cd, |a| &a[i * BLOCK..i * BLOCK + k]), &mut x[..k]);
            T::widen(cb, &mut y[..k]);
            for (p, q) in x[..k].iter_mut().zip(&y[..k]) {
                *p = f(*p, *q);
            }
            T::narrow(&x[..k], cd);
        }
    };
    match ops {
        Operands::To { dst, a, b } if fits::<T>(dst) && fits::<T>(a) && fits::<T>(b) => {
            block(bytemuck::cast_slice_mut(dst), Some(bytemuck::cast_slice(a)), bytemuck::cast_slice(b))
        }
        Operands::To { dst, a, b } => {
            dst.copy_from_slice(a);
            half_zip::<T>(Operands::InPlace { acc: dst, other: b }, f)
        }
        Operands::InPlace { acc, other } if fits::<T>(acc) && fits::<T>(other) => {
            block(bytemuck::cast_slice_mut(acc), None, bytemuck::cast_slice(other))
        }
        Operands::InPlace { acc, other } => {
            let mut a: Vec<T> = bytemuck::pod_collect_to_vec(acc);
            let b: Vec<T> = bytemuck::pod_collect_to_vec(other);
            block(&mut a, None, &b);
            acc.copy_from_slice(bytemuck::cast_slice(&a));
        }
    }
}

macro_rules! half_op {
    ($t:ty, $ops:expr, $op:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => half_zip::<$t>($ops, |a, b| a + b),
            ReduceOp::Prod => half_zip::<$t>($ops, |a, b| a * b),
            ReduceOp::Min => half_zip::<$t>($ops, |a, b| if b < a { b } else { a }),
            ReduceOp::Max => half_zip::<$t>($ops, |a, b| if b > a { b } else { a }),
        }
    };
}

/// `acc[i] = acc[i] op other[i]` (for `Avg`, the sum; call [`finish_avg`] once at the end).
pub(crate) fn reduce_into(acc: &mut [u8], other: &[u8], dtype: DType, op: ReduceOp) {
    debug_assert_eq!(acc.len(), other.len());
    reduce(Operands::InPlace { acc, other }, dtype, op)
}

/// `dst[i] = a[i] op b[i]`, in one pass: the bits of copying `a` into `dst` and then
/// [`reduce_into`]`(dst, b)`.
pub(crate) fn reduce_to(dst: &mut [u8], a: &[u8], b: &[u8], dtype: DType, op: ReduceOp) {
    debug_assert!(dst.len() == a.len() && a.len() == b.len());
    reduce(Operands::To { dst, a, b }, dtype, op)
}

fn reduce(ops: Operands<'_>, dtype: DType, op: ReduceOp) {
    match dtype {
        DType::I8 => int_op!(i8, ops, op),
        DType::U8 => int_op!(u8, ops, op),
        DType::I32 => int_op!(i32, ops, op),
        DType::U32 => int_op!(u32, ops, op),
        DType::I64 => int_op!(i64, ops, op),
        DType::U64 => int_op!(u64, ops, op),
        DType::F32 => float_op!(f32, ops, op),
        DType::F64 => float_op!(f64, ops, op),
        DType::F16 => half_op!(f16, ops, op),
        DType::BF16 => half_op!(bf16, ops, op),
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

    /// The blocked 16-bit kernels give exactly what widening, computing and rounding each
    /// element alone gives (the definition the rest of the backend and the tests use).
    #[test]
    fn half_blocks_match_per_element() {
        let vals: Vec<f32> = (0..2000).map(|i| ((i * 7919) % 4001) as f32 * 0.37 - 700.0).collect();
        let other: Vec<f32> = (0..2000).map(|i| ((i * 104_729) % 3001) as f32 * -0.21 + 5.0).collect();
        for op in ReduceOp::ALL {
            let a: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
            let b: Vec<bf16> = other.iter().map(|&v| bf16::from_f32(v)).collect();
            let mut got: Vec<u8> = bytemuck::cast_slice(&a).to_vec();
            reduce_into(&mut got, bytemuck::cast_slice(&b), DType::BF16, op);
            let f = |x: f32, y: f32| match op {
                ReduceOp::Sum | ReduceOp::Avg => x + y,
                ReduceOp::Prod => x * y,
                ReduceOp::Min => x.min(y),
                ReduceOp::Max => x.max(y),
            };
            let want: Vec<bf16> = a.iter().zip(&b).map(|(x, y)| bf16::from_f32(f(x.to_f32(), y.to_f32()))).collect();
            assert_eq!(bytemuck::pod_collect_to_vec::<u8, bf16>(&got), want, "bf16 {op:?}");
            let a: Vec<f16> = vals.iter().map(|&v| f16::from_f32(v)).collect();
            let b: Vec<f16> = other.iter().map(|&v| f16::from_f32(v)).collect();
            let mut got: Vec<u8> = bytemuck::cast_slice(&a).to_vec();
            reduce_into(&mut got, bytemuck::cast_slice(&b), DType::F16, op);
            let want: Vec<f16> = a.iter().zip(&b).map(|(x, y)| f16::from_f32(f(x.to_f32(), y.to_f32()))).collect();
            assert_eq!(bytemuck::pod_collect_to_vec::<u8, f16>(&got), want, "f16 {op:?}");
        }
        // Rounding ties, overflow and NaN in bf16.
        for bits in [0x3f80_8000u32, 0x3f81_8000, 0x7f7f_ffff, 0x7fc0_0001, 0xff80_0001, 0x0000_8000] {
            let x = f32::from_bits(bits);
            let mut got = [bf16::ZERO];
            <bf16 as Half>::narrow(&[x], &mut got);
            let want = bf16::from_f32(x);
            assert!(got[0].to_bits() == want.to_bits() || (got[0].is_nan() && want.is_nan()), "{bits:#x}");
        }
    }

    /// `reduce_to(dst, a, b)` gives the bits of copying `a` into `dst` and reducing `b` into
    /// it, for every type and op, aligned and not (the unaligned path copies).
    #[test]
    fn reduce_to_matches_copy_then_reduce() {
        let bytes =
            |seed: u32| -> Vec<u8> { (0..1031u32).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) as u8).collect() };
        let (a, b) = (bytes(0x5a), bytes(0xc3));
        for dtype in DType::ALL {
            for op in ReduceOp::ALL {
                for off in [0, 1] {
                    let n = (1024 / dtype.size()) * dtype.size();
                    let (a, b) = (&a[off..off + n], &b[off..off + n]);
                    let mut want = a.to_vec();
                    reduce_into(&mut want, b, dtype, op);
                    let mut got = vec![0u8; n + 1];
                    reduce_to(&mut got[off..off + n], a, b, dtype, op);
                    assert_eq!(&got[off..off + n], &want[..], "{dtype:?} {op:?} offset {off}");
                }
            }
        }
    }

    #[test]
    fn avg_truncates_integers() {
        let mut v: Vec<u8> = bytemuck::cast_slice(&[7i32, -7]).to_vec();
        finish_avg(&mut v, DType::I32, 2);
        assert_eq!(bytemuck::pod_collect_to_vec::<u8, i32>(&v), vec![3, -3]);
    }
}
