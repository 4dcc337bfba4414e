//! Typed storage and lane-vectorised element math with the CUDA runtime's dtype rules:
//! half/bf16 compute in f32 and round on store, integers wrap, float→int casts
//! truncate and saturate (NaN → 0), float→bool is `x != 0` (NaN → true), maximum and
//! minimum propagate NaN.

use half::{bf16, f16};

use crate::bail_internal;
use crate::error::Result;
use crate::ir::{BinaryOp, DataType, ReductionOp, UnaryOp};

/// Typed element storage of one buffer.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    Bool(Vec<bool>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// A scalar value: a runtime scalar input or a constant of the scalar DAG.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScalarValue {
    Bool(bool),
    Int(i64),
    Float(f64),
}

impl ScalarValue {
    /// The value as an integer (floats truncate), for index arithmetic.
    pub fn as_i64(self) -> i64 {
        match self {
            ScalarValue::Bool(b) => b as i64,
            ScalarValue::Int(i) => i,
            ScalarValue::Float(f) => f as i64,
        }
    }
}

impl Data {
    /// Zero-filled storage of `n` elements.
    /// `zeros`, or an error naming `what` where the memory cannot be had (a failed allocation
    /// would abort the process).
    pub fn try_zeros(dtype: DataType, n: usize, what: &str) -> crate::Result<Data> {
        fn filled<T: Clone>(v: T, n: usize, what: &str) -> crate::Result<Vec<T>> {
            let mut out = Vec::new();
            out.try_reserve_exact(n).map_err(|_| {
                crate::KilnError::value(format!(
                    "{what}: the CPU interpreter cannot allocate {n} elements (out of memory; run it on a GPU)"
                ))
            })?;
            out.resize(n, v);
            Ok(out)
        }
        Ok(match dtype {
            DataType::Bool => Data::Bool(filled(false, n, what)?),
            DataType::Int32 => Data::I32(filled(0, n, what)?),
            DataType::Int => Data::I64(filled(0, n, what)?),
            DataType::Half => Data::F16(filled(f16::ZERO, n, what)?),
            DataType::BFloat16 => Data::BF16(filled(bf16::ZERO, n, what)?),
            DataType::Float => Data::F32(filled(0.0, n, what)?),
            DataType::Double => Data::F64(filled(0.0, n, what)?),
        })
    }

    /// `n` zeros of `dtype`.
    pub fn zeros(dtype: DataType, n: usize) -> Data {
        match dtype {
            DataType::Bool => Data::Bool(vec![false; n]),
            DataType::Int32 => Data::I32(vec![0; n]),
            DataType::Int => Data::I64(vec![0; n]),
            DataType::Half => Data::F16(vec![f16::ZERO; n]),
            DataType::BFloat16 => Data::BF16(vec![bf16::ZERO; n]),
            DataType::Float => Data::F32(vec![0.0; n]),
            DataType::Double => Data::F64(vec![0.0; n]),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Data::Bool(v) => v.len(),
            Data::I32(v) => v.len(),
            Data::I64(v) => v.len(),
            Data::F16(v) => v.len(),
            Data::BF16(v) => v.len(),
            Data::F32(v) => v.len(),
            Data::F64(v) => v.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element dtype.
    pub fn dtype(&self) -> DataType {
        match self {
            Data::Bool(_) => DataType::Bool,
            Data::I32(_) => DataType::Int32,
            Data::I64(_) => DataType::Int,
            Data::F16(_) => DataType::Half,
            Data::BF16(_) => DataType::BFloat16,
            Data::F32(_) => DataType::Float,
            Data::F64(_) => DataType::Double,
        }
    }

    /// Read the elements at `idx` (checked by the caller) in the compute type.
    pub fn gather(&self, idx: &[usize]) -> Col {
        match self {
            Data::Bool(v) => Col::B(idx.iter().map(|&i| v[i]).collect()),
            Data::I32(v) => Col::I(idx.iter().map(|&i| v[i] as i64).collect()),
            Data::I64(v) => Col::I(idx.iter().map(|&i| v[i]).collect()),
            Data::F16(v) => Col::F32(idx.iter().map(|&i| v[i].to_f32()).collect()),
            Data::BF16(v) => Col::F32(idx.iter().map(|&i| v[i].to_f32()).collect()),
            Data::F32(v) => Col::F32(idx.iter().map(|&i| v[i]).collect()),
            Data::F64(v) => Col::F64(idx.iter().map(|&i| v[i]).collect()),
        }
    }

    /// Write `col` (already converted to this dtype) at `idx` (checked by the caller).
    pub fn scatter(&mut self, idx: &[usize], col: &Col) -> Result<()> {
        match (self, col) {
            (Data::Bool(v), Col::B(c)) => idx.iter().zip(c).for_each(|(&i, &x)| v[i] = x),
            (Data::I32(v), Col::I(c)) => idx.iter().zip(c).for_each(|(&i, &x)| v[i] = x as i32),
            (Data::I64(v), Col::I(c)) => idx.iter().zip(c).for_each(|(&i, &x)| v[i] = x),
            (Data::F16(v), Col::F32(c)) => idx.iter().zip(c).for_each(|(&i, &x)| v[i] = f16::from_f32(x)),
            (Data::BF16(v), Col::F32(c)) => idx.iter().zip(c).for_each(|(&i, &x)| v[i] = bf16::from_f32(x)),
            (Data::F32(v), Col::F32(c)) => idx.iter().zip(c).for_each(|(&i, &x)| v[i] = x),
            (Data::F64(v), Col::F64(c)) => idx.iter().zip(c).for_each(|(&i, &x)| v[i] = x),
            (d, c) => bail_internal!("interpreter: storing {} values into a {} buffer", c.kind(), d.dtype()),
        }
        Ok(())
    }

    /// Element `i` as a scalar (for semaphores and index tensors).
    pub fn get(&self, i: usize) -> ScalarValue {
        match self {
            Data::Bool(v) => ScalarValue::Bool(v[i]),
            Data::I32(v) => ScalarValue::Int(v[i] as i64),
            Data::I64(v) => ScalarValue::Int(v[i]),
            Data::F16(v) => ScalarValue::Float(v[i].to_f64()),
            Data::BF16(v) => ScalarValue::Float(v[i].to_f64()),
            Data::F32(v) => ScalarValue::Float(v[i] as f64),
            Data::F64(v) => ScalarValue::Float(v[i]),
        }
    }
}

/// Values of one operand for a list of lanes, in the compute type of their dtype:
/// f32 for Float/Half/BFloat16, f64 for Double, i64 for Int/Int32, bool for Bool.
#[derive(Clone, Debug, PartialEq)]
pub enum Col {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I(Vec<i64>),
    B(Vec<bool>),
}

macro_rules! map_col {
    ($col:expr, $x:ident => $f32:expr, $f64:expr, $int:expr, $b:expr) => {
        match $col {
            Col::F32(v) => v.iter().map(|&$x| $f32).collect(),
            Col::F64(v) => v.iter().map(|&$x| $f64).collect(),
            Col::I(v) => v.iter().map(|&$x| $int).collect(),
            Col::B(v) => v.iter().map(|&$x| $b).collect(),
        }
    };
}

impl Col {
    /// Number of lanes.
    pub fn len(&self) -> usize {
        match self {
            Col::F32(v) => v.len(),
            Col::F64(v) => v.len(),
            Col::I(v) => v.len(),
            Col::B(v) => v.len(),
        }
    }

    /// True when there are no lanes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn kind(&self) -> &'static str {
        match self {
            Col::F32(_) => "f32",
            Col::F64(_) => "f64",
            Col::I(_) => "int",
            Col::B(_) => "bool",
        }
    }

    /// `n` copies of a scalar, typed as `dtype`.
    pub fn splat(v: ScalarValue, dtype: DataType, n: usize) -> Col {
        let c = match v {
            ScalarValue::Bool(b) => Col::B(vec![b; n]),
            ScalarValue::Int(i) => Col::I(vec![i; n]),
            ScalarValue::Float(f) => Col::F64(vec![f; n]),
        };
        c.convert(dtype)
    }

    /// Lanes `sel` of this column.
    pub fn select(&self, sel: &[usize]) -> Col {
        match self {
            Col::F32(v) => Col::F32(sel.iter().map(|&i| v[i]).collect()),
            Col::F64(v) => Col::F64(sel.iter().map(|&i| v[i]).collect()),
            Col::I(v) => Col::I(sel.iter().map(|&i| v[i]).collect()),
            Col::B(v) => Col::B(sel.iter().map(|&i| v[i]).collect()),
        }
    }

    /// Overwrite lanes `pos` with the lanes of `src` (same kind).
    pub fn place(&mut self, pos: &[usize], src: &Col) -> Result<()> {
        match (self, src) {
            (Col::F32(d), Col::F32(s)) => pos.iter().zip(s).for_each(|(&p, &x)| d[p] = x),
            (Col::F64(d), Col::F64(s)) => pos.iter().zip(s).for_each(|(&p, &x)| d[p] = x),
            (Col::I(d), Col::I(s)) => pos.iter().zip(s).for_each(|(&p, &x)| d[p] = x),
            (Col::B(d), Col::B(s)) => pos.iter().zip(s).for_each(|(&p, &x)| d[p] = x),
            (d, s) => bail_internal!("interpreter: placing {} lanes into a {} column", s.kind(), d.kind()),
        }
        Ok(())
    }

    /// The lanes as integers (index tensors).
    pub fn to_i64(&self) -> Vec<i64> {
        match self {
            Col::F32(v) => v.iter().map(|&x| x as i64).collect(),
            Col::F64(v) => v.iter().map(|&x| x as i64).collect(),
            Col::I(v) => v.clone(),
            Col::B(v) => v.iter().map(|&x| x as i64).collect(),
        }
    }

    /// Cast to `dtype` (`kiln::cast<To>(From)`): the result holds values representable
    /// in `dtype`, in its compute type.
    pub fn convert(self, dtype: DataType) -> Col {
        use DataType::*;
        match dtype {
            Float => match self {
                Col::F32(v) => Col::F32(v),
                c => Col::F32(map_col!(&c, x => x, x as f32, x as f32, x as u8 as f32)),
            },
            Half => Col::F32(map_col!(&self,
                x => f16::from_f32(x).to_f32(),
                f16::from_bits(crate::ir::dtype::f64_to_f16_bits(x)).to_f32(),
                f16::from_bits(crate::ir::dtype::f64_to_f16_bits(x as f64)).to_f32(),
                x as u8 as f32)),
            BFloat16 => Col::F32(map_col!(&self,
                x => bf16::from_f32(x).to_f32(),
                bf16::from_bits(crate::ir::dtype::f64_to_bf16_bits(x)).to_f32(),
                bf16::from_bits(crate::ir::dtype::f64_to_bf16_bits(x as f64)).to_f32(),
                x as u8 as f32)),
            Double => match self {
                Col::F64(v) => Col::F64(v),
                c => Col::F64(map_col!(&c, x => x as f64, x, x as f64, x as u8 as f64)),
            },
            Int32 => Col::I(map_col!(&self,
                x => x as i32 as i64, x as i32 as i64, x as i32 as i64, x as i64)),
            Int => match self {
                Col::I(v) => Col::I(v),
                c => Col::I(map_col!(&c, x => x as i64, x as i64, x, x as i64)),
            },
            Bool => match self {
                Col::B(v) => Col::B(v),
                c => Col::B(map_col!(&c, x => x != 0.0, x != 0.0, x != 0, x)),
            },
        }
    }
}

/// Unary math on a column already converted to the compute dtype `dt`; the result is
/// rounded to `dt`.
pub fn unary(op: UnaryOp, x: Col, dt: DataType) -> Result<Col> {
    let missing = |kind: &str| crate::error::KilnError::internal(format!("interpreter: {op:?} of a {kind} column"));
    let r = match x {
        Col::F32(v) => {
            Col::F32(v.into_iter().map(|a| op.eval_f32(a).ok_or_else(|| missing("f32"))).collect::<Result<_>>()?)
        }
        Col::F64(v) => {
            Col::F64(v.into_iter().map(|a| op.eval_f64(a).ok_or_else(|| missing("f64"))).collect::<Result<_>>()?)
        }
        Col::I(v) => {
            Col::I(v.into_iter().map(|a| op.eval_int(a).ok_or_else(|| missing("integer"))).collect::<Result<_>>()?)
        }
        Col::B(v) => {
            Col::B(v.into_iter().map(|a| op.eval_bool(a).ok_or_else(|| missing("bool"))).collect::<Result<_>>()?)
        }
    };
    Ok(r.convert(dt))
}

macro_rules! zip_map {
    ($a:expr, $b:expr, |$x:ident, $y:ident| $e:expr) => {
        $a.iter().zip($b.iter()).map(|(&$x, &$y)| $e).collect::<Option<_>>()
    };
}

/// Arithmetic (not a comparison) on two columns converted to `dt`; rounded to `dt`.
pub fn arith(op: BinaryOp, a: Col, b: Col, dt: DataType) -> Result<Col> {
    let (ka, kb) = (a.kind(), b.kind());
    let r = match (a, b) {
        (Col::F32(a), Col::F32(b)) => zip_map!(a, b, |x, y| op.eval_f32(x, y)).map(Col::F32),
        (Col::F64(a), Col::F64(b)) => zip_map!(a, b, |x, y| op.eval_f64(x, y)).map(Col::F64),
        (Col::I(a), Col::I(b)) => zip_map!(a, b, |x, y| op.eval_int(x, y)).map(Col::I),
        (Col::B(a), Col::B(b)) => zip_map!(a, b, |x, y| op.eval_bool(x, y)).map(Col::B),
        _ => None,
    };
    match r {
        Some(r) => Ok(r.convert(dt)),
        None => bail_internal!("interpreter: {op:?} of {ka} and {kb} columns"),
    }
}

/// Comparisons on two columns converted to a common dtype.
pub fn compare(op: BinaryOp, a: Col, b: Col) -> Result<Col> {
    let (ka, kb) = (a.kind(), b.kind());
    let r = match (a, b) {
        (Col::F32(a), Col::F32(b)) => zip_map!(a, b, |x, y| op.compare(x, y)),
        (Col::F64(a), Col::F64(b)) => zip_map!(a, b, |x, y| op.compare(x, y)),
        (Col::I(a), Col::I(b)) => zip_map!(a, b, |x, y| op.compare(x, y)),
        (Col::B(a), Col::B(b)) => zip_map!(a, b, |x, y| op.compare(x, y)),
        _ => None,
    };
    match r {
        Some(r) => Ok(Col::B(r)),
        None => bail_internal!("interpreter: {op:?} of {ka} and {kb} columns"),
    }
}

/// The values of a position-dependent source op (iota, random numbers) at the logical
/// positions `pos`, in dtype `dt` (computed in its compute dtype, as codegen does).
pub fn positional(
    op: &crate::ir::Op,
    pos: &[i64],
    scalar: impl Fn(crate::ir::ValId) -> Result<ScalarValue>,
    dt: DataType,
) -> Result<Col> {
    use crate::ir::random::{block, draw_f32, draw_f64};
    use crate::ir::Op;
    let cd = dt.compute_dtype();
    let f64_of = |v: ScalarValue| match v {
        ScalarValue::Bool(b) => f64::from(u8::from(b)),
        ScalarValue::Int(i) => i as f64,
        ScalarValue::Float(x) => x,
    };
    let col = match *op {
        Op::Iota { start, step } => {
            let (s0, st) = (scalar(start)?, scalar(step)?);
            match cd {
                DataType::Float => {
                    let (s0, st) = (f64_of(s0) as f32, f64_of(st) as f32);
                    Col::F32(pos.iter().map(|&i| (i as f32).mul_add(st, s0)).collect())
                }
                DataType::Double => {
                    let (s0, st) = (f64_of(s0), f64_of(st));
                    Col::F64(pos.iter().map(|&i| (i as f64).mul_add(st, s0)).collect())
                }
                _ => {
                    let (s0, st) = (s0.as_i64(), st.as_i64());
                    Col::I(pos.iter().map(|&i| s0.wrapping_add(i.wrapping_mul(st))).collect())
                }
            }
        }
        Op::Random { dist, a, b, seed, offset } => {
            let (a, b) = (f64_of(scalar(a)?), f64_of(scalar(b)?));
            let (seed, offset) = (scalar(seed)?.as_i64(), scalar(offset)?.as_i64());
            // Bounds in the type the draw computes in, as the GPU compares them.
            let below = |v: f64, a: f64, b: f64| match dist {
                crate::ir::RandomDist::Uniform => crate::ir::random::uniform_below(v, a, b, dt),
                crate::ir::RandomDist::Normal => v,
            };
            if cd == DataType::Double {
                Col::F64(pos.iter().map(|&i| below(draw_f64(dist, a, b, block(seed, offset, i)), a, b)).collect())
            } else {
                let (af, bf) = (a as f32, b as f32);
                let draw = |i: i64| {
                    below(f64::from(draw_f32(dist, af, bf, block(seed, offset, i))), f64::from(af), f64::from(bf))
                        as f32
                };
                Col::F32(pos.iter().map(|&i| draw(i)).collect())
            }
        }
        _ => bail_internal!("interpreter: {op:?} does not depend on positions"),
    };
    Ok(col.convert(dt))
}

/// `where(c, a, b)` on columns converted to the output dtype.
pub fn select(c: &Col, a: Col, b: Col) -> Result<Col> {
    let Col::B(c) = c else {
        bail_internal!("interpreter: where condition is not bool");
    };
    Ok(match (a, b) {
        (Col::F32(a), Col::F32(b)) => Col::F32((0..c.len()).map(|i| if c[i] { a[i] } else { b[i] }).collect()),
        (Col::F64(a), Col::F64(b)) => Col::F64((0..c.len()).map(|i| if c[i] { a[i] } else { b[i] }).collect()),
        (Col::I(a), Col::I(b)) => Col::I((0..c.len()).map(|i| if c[i] { a[i] } else { b[i] }).collect()),
        (Col::B(a), Col::B(b)) => Col::B((0..c.len()).map(|i| if c[i] { a[i] } else { b[i] }).collect()),
        (a, b) => bail_internal!("interpreter: where of {} and {} columns", a.kind(), b.kind()),
    })
}

/// The reduction combiner `op(a, b)` in dtype `dt`.
pub fn combine(op: ReductionOp, a: Col, b: Col, dt: DataType) -> Result<Col> {
    let bop = match op {
        ReductionOp::Sum => BinaryOp::Add,
        ReductionOp::Max => BinaryOp::Maximum,
        ReductionOp::Prod => BinaryOp::Mul,
        ReductionOp::Min => BinaryOp::Minimum,
        ReductionOp::LogSumExpFloored => {
            // Raising a partial result (at or above the floor, or -inf) leaves it as it is.
            let raise = |c: Col| -> Result<Col> {
                Ok(match c.convert(dt) {
                    Col::F32(v) => Col::F32(v.iter().map(|&x| crate::ir::lse_raise(x as f64) as f32).collect()),
                    Col::F64(v) => Col::F64(v.iter().map(|&x| crate::ir::lse_raise(x)).collect()),
                    c => bail_internal!("interpreter: logsumexp of a {} column", c.kind()),
                })
            };
            return combine(ReductionOp::LogSumExp, raise(a)?, raise(b)?, dt);
        }
        ReductionOp::LogSumExp => {
            return Ok(match (a.convert(dt), b.convert(dt)) {
                (Col::F32(a), Col::F32(b)) => {
                    Col::F32(a.iter().zip(&b).map(|(&x, &y)| log_add_exp(x as f64, y as f64) as f32).collect())
                }
                (Col::F64(a), Col::F64(b)) => Col::F64(a.iter().zip(&b).map(|(&x, &y)| log_add_exp(x, y)).collect()),
                (a, _) => bail_internal!("interpreter: logsumexp of a {} column", a.kind()),
            });
        }
    };
    arith(bop, a, b, dt)
}

/// `log(exp(a) + exp(b))` without overflow; infinities and NaN as `torch.logsumexp` gives them.
fn log_add_exp(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        return f64::NAN;
    }
    let (hi, lo) = if a >= b { (a, b) } else { (b, a) };
    if hi.is_infinite() {
        return hi;
    }
    hi + (lo - hi).exp().ln_1p()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn casts_follow_the_runtime() {
        let c = Col::F32(vec![f32::NAN, 3.7, -3.7, 1e20]);
        assert_eq!(c.clone().convert(DataType::Int32), Col::I(vec![0, 3, -3, i32::MAX as i64]));
        assert_eq!(c.convert(DataType::Bool), Col::B(vec![true, true, true, true]));
        let h = Col::F32(vec![0.1]).convert(DataType::Half);
        assert_eq!(h, Col::F32(vec![f16::from_f32(0.1).to_f32()]));
        let i = Col::I(vec![1 << 31]).convert(DataType::Int32);
        assert_eq!(i, Col::I(vec![i32::MIN as i64]));
    }

    #[test]
    fn maximum_propagates_nan_and_ipow_follows_torch() {
        let r = arith(BinaryOp::Maximum, Col::F32(vec![f32::NAN, 1.0]), Col::F32(vec![1.0, f32::NAN]), DataType::Float)
            .unwrap();
        let Col::F32(v) = r else { panic!() };
        assert!(v[0].is_nan() && v[1].is_nan());
        assert_eq!(crate::ir::op_table::ipow(2, 10), 1024);
        assert_eq!(crate::ir::op_table::ipow(-1, -3), -1);
        assert_eq!(crate::ir::op_table::ipow(5, -1), 0);
    }

    #[test]
    fn half_arithmetic_rounds_on_store() {
        let a = Col::F32(vec![1.0]);
        let b = Col::F32(vec![f16::from_f32(0.0001).to_f32()]);
        let r = arith(BinaryOp::Add, a, b, DataType::Half).unwrap();
        assert_eq!(r, Col::F32(vec![1.0]));
    }
}
