//! The element-wise op table: each unary and binary op is defined once here, with its
//! Python name, docstring, dtype class, CUDA spelling and the interpreter's semantics.
//! The enums, name lookup, the Python `fd.ops` methods (`_core.elementwise_ops`), the
//! interpreter's dispatch and codegen's calls are all generated from these entries, so
//! adding an op is one entry here (plus a `kiln::` overload in runtime.cuh when the op is
//! not a CUDA math-library call).
//!
//! Float semantics are written once for both widths: each `float(a)` expression is
//! expanded for f32 and for f64 (half and bfloat16 compute in f32 and round on store).
//! Integer results wrap as C does; an op whose `int`/`bool` entry is `None` does not
//! accept that operand kind (integers then compute in float or are refused, per class).

/// How a unary op types its result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnaryClass {
    /// Exact in the operand's own type, on its bits (half and bfloat16 included).
    Exact,
    /// The result keeps the operand's type; half and bfloat16 compute in float (floor,
    /// sign: exact once rounded back).
    KeepType,
    /// Math on floats: integers and bool compute in the default float type, as PyTorch.
    Float,
    /// A test on the value: the result is Bool.
    Predicate,
    /// Logic on the operand's truth (nonzero): the result is Bool.
    Logical,
}

/// How a binary op types its result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryClass {
    /// The promoted operand type.
    Promote,
    /// The promoted type, or the default float type when that is an integer or bool.
    Float,
    /// A comparison: the result is Bool, computed in the promoted type.
    Compare,
    /// Logic on the operands' truth (nonzero): the result is Bool.
    Logical,
}

/// How codegen spells an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cuda {
    /// `kiln::<name>(...)`, overloaded per type in runtime.cuh.
    Runtime,
    /// A CUDA math-library function, by name for float and for double (the op computes
    /// in one of the two: half and bfloat16 compute in float).
    Libm(&'static str, &'static str),
}

/// Float functions the interpreter needs beyond `std`, for f32 and f64 alike.
pub trait Real: Copy + PartialOrd + From<i8> + std::ops::Add<Output = Self> + std::ops::Rem<Output = Self> {
    /// The error function.
    fn erf_(self) -> Self;
    /// The complementary error function.
    fn erfc_(self) -> Self;
    /// The inverse error function.
    fn erfinv_(self) -> Self;
    /// The inverse complementary error function.
    fn erfcinv_(self) -> Self;
    /// log |gamma(x)|.
    fn lgamma_(self) -> Self;
    /// The next representable value after `self` toward `to`.
    fn nextafter_(self, to: Self) -> Self;
    /// The inverse hyperbolic cosine (libm's: std's `acosh` loses digits near 1, about 16
    /// ulp of float32 at acosh(1.0005)).
    fn acosh_(self) -> Self;
    /// The inverse hyperbolic sine (libm's: std's overflows to inf past about 1.8e19 of
    /// float32, where asinh(3e38) is 89.3).
    fn asinh_(self) -> Self;
    /// The inverse hyperbolic tangent (libm's: std's is 6 ulp off near 1 in float32).
    fn atanh_(self) -> Self;
}

impl Real for f32 {
    fn acosh_(self) -> f32 {
        // Below 1 (negative inputs included, which libm maps to finite values) it is NaN.
        if self < 1.0 {
            f32::NAN
        } else {
            libm::acoshf(self)
        }
    }
    fn asinh_(self) -> f32 {
        libm::asinhf(self)
    }
    fn atanh_(self) -> f32 {
        libm::atanhf(self)
    }
    fn erf_(self) -> f32 {
        libm::erff(self)
    }
    fn erfc_(self) -> f32 {
        libm::erfcf(self)
    }
    fn erfinv_(self) -> f32 {
        erfinv(f64::from(self)) as f32
    }
    fn erfcinv_(self) -> f32 {
        erfcinv(f64::from(self)) as f32
    }
    fn lgamma_(self) -> f32 {
        libm::lgammaf(self)
    }
    fn nextafter_(self, to: f32) -> f32 {
        libm::nextafterf(self, to)
    }
}

impl Real for f64 {
    fn acosh_(self) -> f64 {
        if self < 1.0 {
            f64::NAN
        } else {
            libm::acosh(self)
        }
    }
    fn asinh_(self) -> f64 {
        libm::asinh(self)
    }
    fn atanh_(self) -> f64 {
        libm::atanh(self)
    }
    fn erf_(self) -> f64 {
        libm::erf(self)
    }
    fn erfc_(self) -> f64 {
        libm::erfc(self)
    }
    fn erfinv_(self) -> f64 {
        erfinv(self)
    }
    fn erfcinv_(self) -> f64 {
        erfcinv(self)
    }
    fn lgamma_(self) -> f64 {
        libm::lgamma(self)
    }
    fn nextafter_(self, to: f64) -> f64 {
        libm::nextafter(self, to)
    }
}

/// erf's derivative at `x`: 2/sqrt(pi) * exp(-x^2).
fn erf_slope(x: f64) -> f64 {
    std::f64::consts::FRAC_2_SQRT_PI * (-x * x).exp()
}

/// The inverse error function in f64: Giles' single-precision approximation refined by
/// Newton steps on erf (each step doubles the correct digits).
fn erfinv(y: f64) -> f64 {
    if y.is_nan() || y.abs() > 1.0 {
        return f64::NAN;
    }
    if y.abs() == 1.0 {
        return y * f64::INFINITY;
    }
    let mut w = -((1.0 - y) * (1.0 + y)).ln();
    let p = if w < 5.0 {
        w -= 2.5;
        [
            3.43273939e-07,
            -3.5233877e-06,
            -4.39150654e-06,
            0.00021858087,
            -0.00125372503,
            -0.00417768164,
            0.246640727,
            1.50140941,
        ]
        .iter()
        .fold(2.81022636e-08, |p, c| c + p * w)
    } else {
        w = w.sqrt() - 3.0;
        [
            0.000100950558,
            0.00134934322,
            -0.00367342844,
            0.00573950773,
            -0.0076224613,
            0.00943887047,
            1.00167406,
            2.83297682,
        ]
        .iter()
        .fold(-0.000200214257, |p, c| c + p * w)
    };
    let mut x = p * y;
    for _ in 0..3 {
        let slope = erf_slope(x);
        if slope == 0.0 {
            break;
        }
        x -= (libm::erf(x) - y) / slope;
    }
    x
}

/// The inverse complementary error function in f64: erfinv(1 - y) as the first guess
/// where that is accurate, Newton steps on erfc toward the tails.
fn erfcinv(y: f64) -> f64 {
    if y.is_nan() || !(0.0..=2.0).contains(&y) {
        return f64::NAN;
    }
    if y == 0.0 {
        return f64::INFINITY;
    }
    if y == 2.0 {
        return f64::NEG_INFINITY;
    }
    // For small y, 1 - y rounds away the digits that matter: start from the tail's
    // asymptote sqrt(-ln y) instead.
    let mut x = if (1e-3..=2.0 - 1e-3).contains(&y) {
        erfinv(1.0 - y)
    } else if y < 1.0 {
        (-y.ln()).sqrt()
    } else {
        -(-(2.0 - y).ln()).sqrt()
    };
    for _ in 0..60 {
        let slope = erf_slope(x);
        if slope == 0.0 {
            break;
        }
        let step = (libm::erfc(x) - y) / slope;
        x += step;
        if step.abs() <= 1e-17 * x.abs() {
            break;
        }
    }
    x
}

/// `max(x, 0)` with NaN kept (the comparison is false for NaN).
fn relu<T: Real>(a: T) -> T {
    let zero = T::from(0);
    if a <= zero {
        zero
    } else {
        a
    }
}

/// 1 or 0 as a float: a predicate's float form.
fn truth<T: From<i8>>(b: bool) -> T {
    T::from(i8::from(b))
}

/// -1, 0 or 1 by the sign of `a`; 0 for ±0 and NaN (as torch.sign).
fn sign<T: Real>(a: T) -> T {
    let zero = T::from(0);
    T::from(i8::from(zero < a) - i8::from(a < zero))
}

/// Python's float `%`: the remainder takes the divisor's sign.
fn remainder<T: Real>(a: T, b: T) -> T {
    let zero = T::from(0);
    let m = a % b;
    if m != zero && ((b < zero) != (m < zero)) {
        m + b
    } else {
        m
    }
}

/// C's truncating integer division, wrapping (i64::MIN / -1), with 0 for a zero divisor.
fn idiv(a: i64, b: i64) -> i64 {
    if b == 0 {
        0
    } else {
        a.wrapping_div(b)
    }
}

/// C's integer `%` (the dividend's sign), with 0 for a zero divisor.
fn irem(a: i64, b: i64) -> i64 {
    if b == 0 {
        0
    } else {
        a.wrapping_rem(b)
    }
}

/// Python's integer `%` (the divisor's sign), with 0 for a zero divisor.
fn iremainder(a: i64, b: i64) -> i64 {
    let m = irem(a, b);
    if m != 0 && ((b < 0) != (m < 0)) {
        m.wrapping_add(b)
    } else {
        m
    }
}

/// `a << b` in 64 bits: 0 once `b` is negative or reaches the width. (An int32 shift
/// computes here in 64 bits; its low 32 bits are the int32 result, shifts of 32..63
/// included, so one form serves both widths.)
fn shl(a: i64, b: i64) -> i64 {
    if (0..64).contains(&b) {
        a << b
    } else {
        0
    }
}

/// Arithmetic `a >> b` in 64 bits: the sign fills once `b` is negative or reaches the
/// width (the same for an int32 value held sign-extended).
fn shr(a: i64, b: i64) -> i64 {
    let s = if (0..64).contains(&b) { b as u32 } else { 63 };
    a >> s
}

/// gcd(|a|, |b|), wrapping for i64::MIN; gcd(0, 0) = 0.
fn gcd(a: i64, b: i64) -> i64 {
    let (mut a, mut b) = (a.unsigned_abs(), b.unsigned_abs());
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a as i64
}

/// Integer power by squaring, wrapping; negative exponents follow torch: 1 for base 1,
/// ±1 for base -1, 0 otherwise.
pub fn ipow(mut a: i64, mut b: i64) -> i64 {
    if b < 0 {
        return match a {
            1 => 1,
            -1 => {
                if b & 1 == 1 {
                    -1
                } else {
                    1
                }
            }
            _ => 0,
        };
    }
    let mut r: i64 = 1;
    while b != 0 {
        if b & 1 == 1 {
            r = r.wrapping_mul(a);
        }
        b >>= 1;
        a = a.wrapping_mul(a);
    }
    r
}

/// `maximum`/`minimum` of two floats: NaN propagates (torch.maximum).
fn pick_nan<T: Copy + PartialOrd>(a: T, b: T, take_a: bool) -> T {
    #[allow(clippy::eq_op)]
    let (a_nan, b_nan) = (a != a, b != b);
    if a_nan {
        a
    } else if b_nan || !take_a {
        b
    } else {
        a
    }
}

use crate::ir::DataType;

macro_rules! unary_ops {
    ($(
        $(#[doc = $doc:literal])+
        $var:ident = $name:literal, $class:ident, $cuda:expr,
        float($fa:ident) => $fe:expr,
        int($ia:ident) => $ie:expr,
        bool($ba:ident) => $be:expr;
    )+) => {
        /// Element-wise unary math.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum UnaryOp {
            $( $(#[doc = $doc])+ $var, )+
        }

        #[allow(unused_variables)]
        impl UnaryOp {
            /// Every unary op, in table order.
            pub const ALL: &'static [UnaryOp] = &[$(UnaryOp::$var),+];

            /// The name the Python API and the dumps use.
            pub fn name(self) -> &'static str {
                match self { $(UnaryOp::$var => $name,)+ }
            }

            /// One-line description (the Python docstring).
            pub fn doc(self) -> &'static str {
                match self { $(UnaryOp::$var => concat!($($doc),+).trim_ascii(),)+ }
            }

            /// How the result is typed.
            pub fn class(self) -> UnaryClass {
                match self { $(UnaryOp::$var => UnaryClass::$class,)+ }
            }

            /// How codegen spells the op.
            pub fn cuda(self) -> Cuda {
                match self { $(UnaryOp::$var => $cuda,)+ }
            }

            /// The op on an f32, `None` where the op has no float form (a predicate's
            /// result is 1 or 0, as its integer and bool forms give true as 1).
            pub fn eval_f32(self, x: f32) -> Option<f32> {
                match self { $(UnaryOp::$var => { let $fa = x; $fe })+ }
            }

            /// The op on an f64, `None` where the op has no float form.
            pub fn eval_f64(self, x: f64) -> Option<f64> {
                match self { $(UnaryOp::$var => { let $fa = x; $fe })+ }
            }

            /// The op on an integer, `None` where the op has no integer form.
            pub fn eval_int(self, x: i64) -> Option<i64> {
                match self { $(UnaryOp::$var => { let $ia = x; $ie })+ }
            }

            /// The op on a bool, `None` where the op has no bool form.
            pub fn eval_bool(self, x: bool) -> Option<bool> {
                match self { $(UnaryOp::$var => { let $ba = x; $be })+ }
            }
        }
    };
}

macro_rules! binary_ops {
    (
        arith { $(
            $(#[doc = $doc:literal])+
            $var:ident = $name:literal, $class:ident, $cuda:expr,
            float($fa:ident, $fb:ident) => $fe:expr,
            int($ia:ident, $ib:ident) => $ie:expr,
            bool($ba:ident, $bb:ident) => $be:expr;
        )+ }
        compare { $(
            $(#[doc = $cdoc:literal])+
            $cvar:ident = $cname:literal, ($ca:ident, $cb:ident) => $ce:expr;
        )+ }
    ) => {
        /// Element-wise binary math.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum BinaryOp {
            $( $(#[doc = $doc])+ $var, )+
            $( $(#[doc = $cdoc])+ $cvar, )+
        }

        #[allow(unused_variables)]
        impl BinaryOp {
            /// Every binary op, in table order.
            pub const ALL: &'static [BinaryOp] = &[$(BinaryOp::$var,)+ $(BinaryOp::$cvar,)+];

            /// The name the Python API and the dumps use.
            pub fn name(self) -> &'static str {
                match self { $(BinaryOp::$var => $name,)+ $(BinaryOp::$cvar => $cname,)+ }
            }

            /// One-line description (the Python docstring).
            pub fn doc(self) -> &'static str {
                match self {
                    $(BinaryOp::$var => concat!($($doc),+).trim_ascii(),)+
                    $(BinaryOp::$cvar => concat!($($cdoc),+).trim_ascii(),)+
                }
            }

            /// How the result is typed.
            pub fn class(self) -> BinaryClass {
                match self {
                    $(BinaryOp::$var => BinaryClass::$class,)+
                    $(BinaryOp::$cvar => BinaryClass::Compare,)+
                }
            }

            /// How codegen spells the op.
            pub fn cuda(self) -> Cuda {
                match self { $(BinaryOp::$var => $cuda,)+ $(BinaryOp::$cvar => Cuda::Runtime,)+ }
            }

            /// An arithmetic op on two f32, `None` for a comparison or an op with no
            /// float form.
            pub fn eval_f32(self, a: f32, b: f32) -> Option<f32> {
                match self {
                    $(BinaryOp::$var => { let ($fa, $fb) = (a, b); $fe })+
                    _ => None,
                }
            }

            /// An arithmetic op on two f64, `None` for a comparison or an op with no
            /// float form.
            pub fn eval_f64(self, a: f64, b: f64) -> Option<f64> {
                match self {
                    $(BinaryOp::$var => { let ($fa, $fb) = (a, b); $fe })+
                    _ => None,
                }
            }

            /// An arithmetic op on two integers, `None` where it has no integer form.
            pub fn eval_int(self, a: i64, b: i64) -> Option<i64> {
                match self {
                    $(BinaryOp::$var => { let ($ia, $ib) = (a, b); $ie })+
                    _ => None,
                }
            }

            /// An arithmetic op on two bools, `None` where it has no bool form.
            pub fn eval_bool(self, a: bool, b: bool) -> Option<bool> {
                match self {
                    $(BinaryOp::$var => { let ($ba, $bb) = (a, b); $be })+
                    _ => None,
                }
            }

            /// A comparison of two values of one type (`None` for arithmetic).
            pub fn compare<T: PartialOrd>(self, a: T, b: T) -> Option<bool> {
                match self {
                    $(BinaryOp::$cvar => { let ($ca, $cb) = (a, b); Some($ce) })+
                    _ => None,
                }
            }
        }
    };
}

unary_ops! {
    /// |x|.
    Abs = "abs", Exact, Cuda::Runtime,
        float(a) => Some(a.abs()), int(a) => Some(a.wrapping_abs()), bool(a) => Some(a);
    /// -x.
    Neg = "neg", Exact, Cuda::Runtime,
        float(a) => Some(-a), int(a) => Some(a.wrapping_neg()), bool(a) => None;
    /// max(x, 0).
    Relu = "relu", Exact, Cuda::Runtime,
        float(a) => Some(relu(a)), int(a) => Some(a.max(0)), bool(a) => Some(a);
    /// e**x.
    Exp = "exp", Float, Cuda::Runtime,
        float(a) => Some(a.exp()), int(a) => None, bool(a) => None;
    /// 2**x.
    Exp2 = "exp2", Float, Cuda::Libm("exp2f", "exp2"),
        float(a) => Some(a.exp2()), int(a) => None, bool(a) => None;
    /// e**x - 1, accurate near 0.
    Expm1 = "expm1", Float, Cuda::Libm("expm1f", "expm1"),
        float(a) => Some(a.exp_m1()), int(a) => None, bool(a) => None;
    /// Natural log.
    Log = "log", Float, Cuda::Runtime,
        float(a) => Some(a.ln()), int(a) => None, bool(a) => None;
    /// Log base 2.
    Log2 = "log2", Float, Cuda::Libm("log2f", "log2"),
        float(a) => Some(a.log2()), int(a) => None, bool(a) => None;
    /// Log base 10.
    Log10 = "log10", Float, Cuda::Libm("log10f", "log10"),
        float(a) => Some(a.log10()), int(a) => None, bool(a) => None;
    /// log(1 + x), accurate near 0.
    Log1p = "log1p", Float, Cuda::Libm("log1pf", "log1p"),
        float(a) => Some(a.ln_1p()), int(a) => None, bool(a) => None;
    /// Square root.
    Sqrt = "sqrt", Float, Cuda::Runtime,
        float(a) => Some(a.sqrt()), int(a) => None, bool(a) => None;
    /// 1 / sqrt(x).
    Rsqrt = "rsqrt", Float, Cuda::Runtime,
        float(a) => Some(1.0 / a.sqrt()), int(a) => None, bool(a) => None;
    /// 1 / x.
    Reciprocal = "reciprocal", Float, Cuda::Runtime,
        float(a) => Some(1.0 / a), int(a) => None, bool(a) => None;
    /// Sine.
    Sin = "sin", Float, Cuda::Runtime,
        float(a) => Some(a.sin()), int(a) => None, bool(a) => None;
    /// Cosine.
    Cos = "cos", Float, Cuda::Runtime,
        float(a) => Some(a.cos()), int(a) => None, bool(a) => None;
    /// Tangent.
    Tan = "tan", Float, Cuda::Libm("tanf", "tan"),
        float(a) => Some(a.tan()), int(a) => None, bool(a) => None;
    /// Arcsine.
    Asin = "asin", Float, Cuda::Libm("asinf", "asin"),
        float(a) => Some(a.asin()), int(a) => None, bool(a) => None;
    /// Arccosine.
    Acos = "acos", Float, Cuda::Libm("acosf", "acos"),
        float(a) => Some(a.acos()), int(a) => None, bool(a) => None;
    /// Arctangent.
    Atan = "atan", Float, Cuda::Libm("atanf", "atan"),
        float(a) => Some(a.atan()), int(a) => None, bool(a) => None;
    /// Hyperbolic sine.
    Sinh = "sinh", Float, Cuda::Libm("sinhf", "sinh"),
        float(a) => Some(a.sinh()), int(a) => None, bool(a) => None;
    /// Hyperbolic cosine.
    Cosh = "cosh", Float, Cuda::Libm("coshf", "cosh"),
        float(a) => Some(a.cosh()), int(a) => None, bool(a) => None;
    /// Hyperbolic tangent.
    Tanh = "tanh", Float, Cuda::Runtime,
        float(a) => Some(a.tanh()), int(a) => None, bool(a) => None;
    /// Inverse hyperbolic sine.
    Asinh = "asinh", Float, Cuda::Libm("asinhf", "asinh"),
        float(a) => Some(a.asinh_()), int(a) => None, bool(a) => None;
    /// Inverse hyperbolic cosine.
    Acosh = "acosh", Float, Cuda::Libm("acoshf", "acosh"),
        float(a) => Some(a.acosh_()), int(a) => None, bool(a) => None;
    /// Inverse hyperbolic tangent.
    Atanh = "atanh", Float, Cuda::Libm("atanhf", "atanh"),
        float(a) => Some(a.atanh_()), int(a) => None, bool(a) => None;
    /// 1 / (1 + e**-x).
    Sigmoid = "sigmoid", Float, Cuda::Runtime,
        float(a) => Some(1.0 / (1.0 + (-a).exp())), int(a) => None, bool(a) => None;
    /// The error function.
    Erf = "erf", Float, Cuda::Libm("erff", "erf"),
        float(a) => Some(a.erf_()), int(a) => None, bool(a) => None;
    /// The complementary error function, 1 - erf(x).
    Erfc = "erfc", Float, Cuda::Libm("erfcf", "erfc"),
        float(a) => Some(a.erfc_()), int(a) => None, bool(a) => None;
    /// The inverse of erf.
    Erfinv = "erfinv", Float, Cuda::Libm("erfinvf", "erfinv"),
        float(a) => Some(a.erfinv_()), int(a) => None, bool(a) => None;
    /// The inverse of erfc.
    Erfcinv = "erfcinv", Float, Cuda::Libm("erfcinvf", "erfcinv"),
        float(a) => Some(a.erfcinv_()), int(a) => None, bool(a) => None;
    /// log(|gamma(x)|).
    Lgamma = "lgamma", Float, Cuda::Libm("lgammaf", "lgamma"),
        float(a) => Some(a.lgamma_()), int(a) => None, bool(a) => None;
    /// Largest integer <= x (integers unchanged).
    Floor = "floor", KeepType, Cuda::Runtime,
        float(a) => Some(a.floor()), int(a) => Some(a), bool(a) => Some(a);
    /// Smallest integer >= x (integers unchanged).
    Ceil = "ceil", KeepType, Cuda::Runtime,
        float(a) => Some(a.ceil()), int(a) => Some(a), bool(a) => Some(a);
    /// Nearest integer, halves to even (as torch.round; integers unchanged).
    Round = "round", KeepType, Cuda::Runtime,
        float(a) => Some(a.round_ties_even()), int(a) => Some(a), bool(a) => Some(a);
    /// x rounded toward zero (integers unchanged).
    Trunc = "trunc", KeepType, Cuda::Runtime,
        float(a) => Some(a.trunc()), int(a) => Some(a), bool(a) => Some(a);
    /// x - trunc(x).
    Frac = "frac", KeepType, Cuda::Runtime,
        float(a) => Some(a - a.trunc()), int(a) => None, bool(a) => None;
    /// -1, 0 or 1 by the sign of x (0 for NaN).
    Sign = "sign", KeepType, Cuda::Runtime,
        float(a) => Some(sign(a)), int(a) => Some(a.signum()), bool(a) => Some(a);
    /// True where the sign bit is set (-0.0 included).
    Signbit = "signbit", Predicate, Cuda::Runtime,
        float(a) => Some(truth(a.is_sign_negative())), int(a) => Some(i64::from(a < 0)), bool(a) => Some(false);
    /// True where x is NaN.
    Isnan = "isnan", Predicate, Cuda::Runtime,
        float(a) => Some(truth(a.is_nan())), int(a) => Some(0), bool(a) => Some(false);
    /// True where x is +inf or -inf.
    Isinf = "isinf", Predicate, Cuda::Runtime,
        float(a) => Some(truth(a.is_infinite())), int(a) => Some(0), bool(a) => Some(false);
    /// True where x is neither infinite nor NaN.
    Isfinite = "isfinite", Predicate, Cuda::Runtime,
        float(a) => Some(truth(a.is_finite())), int(a) => Some(1), bool(a) => Some(true);
    /// True where x is +inf.
    Isposinf = "isposinf", Predicate, Cuda::Runtime,
        float(a) => Some(truth(a.is_infinite() && a > 0.0)), int(a) => Some(0), bool(a) => Some(false);
    /// True where x is -inf.
    Isneginf = "isneginf", Predicate, Cuda::Runtime,
        float(a) => Some(truth(a.is_infinite() && a < 0.0)), int(a) => Some(0), bool(a) => Some(false);
    /// Logical not: true where x is zero (or false).
    LogicalNot = "logical_not", Logical, Cuda::Runtime,
        float(a) => None, int(a) => None, bool(a) => Some(!a);
    /// Bitwise not (logical not for bool).
    BitwiseNot = "bitwise_not", Exact, Cuda::Runtime,
        float(a) => None, int(a) => Some(!a), bool(a) => Some(!a);
}

binary_ops! {
    arith {
        /// a + b.
        Add = "add", Promote, Cuda::Runtime,
            float(a, b) => Some(a + b), int(a, b) => Some(a.wrapping_add(b)), bool(a, b) => Some(a | b);
        /// a - b (not of two bools: PyTorch and NumPy refuse it, pointing to xor).
        Sub = "sub", Promote, Cuda::Runtime,
            float(a, b) => Some(a - b), int(a, b) => Some(a.wrapping_sub(b)), bool(a, b) => None;
        /// a * b.
        Mul = "mul", Promote, Cuda::Runtime,
            float(a, b) => Some(a * b), int(a, b) => Some(a.wrapping_mul(b)), bool(a, b) => Some(a & b);
        /// a / b: true division of floats, truncating division of integers (as nvFuser's
        /// div; an integer divided by 0 gives 0).
        Div = "div", Promote, Cuda::Runtime,
            float(a, b) => Some(a / b), int(a, b) => Some(idiv(a, b)), bool(a, b) => Some(a);
        /// a / b, true division: integers and bool divide as floats (torch.div).
        Truediv = "truediv", Float, Cuda::Runtime,
            float(a, b) => Some(a / b), int(a, b) => None, bool(a, b) => None;
        /// a ** b.
        Pow = "pow", Promote, Cuda::Runtime,
            float(a, b) => Some(a.powf(b)), int(a, b) => Some(ipow(a, b)), bool(a, b) => Some(!b || a);
        /// Element-wise max (NaN propagates).
        Maximum = "maximum", Promote, Cuda::Runtime,
            float(a, b) => Some(pick_nan(a, b, a > b)), int(a, b) => Some(a.max(b)), bool(a, b) => Some(a | b);
        /// Element-wise min (NaN propagates).
        Minimum = "minimum", Promote, Cuda::Runtime,
            float(a, b) => Some(pick_nan(a, b, a < b)), int(a, b) => Some(a.min(b)), bool(a, b) => Some(a & b);
        /// Remainder of truncating division, the sign of a (C fmod; integer % 0 gives 0).
        Fmod = "fmod", Promote, Cuda::Runtime,
            float(a, b) => Some(a % b), int(a, b) => Some(irem(a, b)), bool(a, b) => None;
        /// Remainder of floor division, the sign of b (Python's %; integer % 0 gives 0).
        Remainder = "remainder", Promote, Cuda::Runtime,
            float(a, b) => Some(remainder(a, b)), int(a, b) => Some(iremainder(a, b)), bool(a, b) => None;
        /// The angle of the point (b, a): atan(a / b) in the right quadrant.
        Atan2 = "atan2", Float, Cuda::Libm("atan2f", "atan2"),
            float(a, b) => Some(a.atan2(b)), int(a, b) => None, bool(a, b) => None;
        /// The next float after a toward b.
        Nextafter = "nextafter", Promote, Cuda::Libm("nextafterf", "nextafter"),
            float(a, b) => Some(a.nextafter_(b)), int(a, b) => None, bool(a, b) => None;
        /// Bitwise and of integers (logical and of bools).
        BitwiseAnd = "bitwise_and", Promote, Cuda::Runtime,
            float(a, b) => None, int(a, b) => Some(a & b), bool(a, b) => Some(a & b);
        /// Bitwise or of integers (logical or of bools).
        BitwiseOr = "bitwise_or", Promote, Cuda::Runtime,
            float(a, b) => None, int(a, b) => Some(a | b), bool(a, b) => Some(a | b);
        /// Bitwise xor of integers (logical xor of bools).
        BitwiseXor = "bitwise_xor", Promote, Cuda::Runtime,
            float(a, b) => None, int(a, b) => Some(a ^ b), bool(a, b) => Some(a ^ b);
        /// a shifted left by b bits (0 once b reaches the width or is negative).
        BitwiseLeftShift = "bitwise_left_shift", Promote, Cuda::Runtime,
            float(a, b) => None, int(a, b) => Some(shl(a, b)), bool(a, b) => None;
        /// a shifted right by b bits, arithmetically (the sign fills once b reaches the
        /// width or is negative).
        BitwiseRightShift = "bitwise_right_shift", Promote, Cuda::Runtime,
            float(a, b) => None, int(a, b) => Some(shr(a, b)), bool(a, b) => None;
        /// Greatest common divisor of |a| and |b| (gcd(0, 0) = 0).
        Gcd = "gcd", Promote, Cuda::Runtime,
            float(a, b) => None, int(a, b) => Some(gcd(a, b)), bool(a, b) => None;
        /// True where both are nonzero.
        LogicalAnd = "logical_and", Logical, Cuda::Runtime,
            float(a, b) => None, int(a, b) => None, bool(a, b) => Some(a && b);
        /// True where either is nonzero.
        LogicalOr = "logical_or", Logical, Cuda::Runtime,
            float(a, b) => None, int(a, b) => None, bool(a, b) => Some(a || b);
        /// True where exactly one is nonzero.
        LogicalXor = "logical_xor", Logical, Cuda::Runtime,
            float(a, b) => None, int(a, b) => None, bool(a, b) => Some(a != b);
    }
    compare {
        /// a == b.
        Eq = "eq", (a, b) => a == b;
        /// a != b.
        Ne = "ne", (a, b) => a != b;
        /// a < b.
        Lt = "lt", (a, b) => a < b;
        /// a <= b.
        Le = "le", (a, b) => a <= b;
        /// a > b.
        Gt = "gt", (a, b) => a > b;
        /// a >= b.
        Ge = "ge", (a, b) => a >= b;
    }
}

impl UnaryOp {
    /// The op spelled `name` in the Python API.
    pub fn from_name(name: &str) -> Option<UnaryOp> {
        UnaryOp::ALL.iter().copied().find(|u| u.name() == name)
    }

    /// The type the op computes in, for an operand of type `operand` and a result of
    /// type `out` (codegen and the interpreter agree on it).
    pub fn compute_dtype(self, operand: DataType, out: DataType) -> DataType {
        match self.class() {
            // Exact ops work on the operand's bits: no round trip through float.
            UnaryClass::Exact => operand,
            UnaryClass::KeepType | UnaryClass::Float => out.compute_dtype(),
            UnaryClass::Predicate => operand.compute_dtype(),
            UnaryClass::Logical => DataType::Bool,
        }
    }
}

impl BinaryOp {
    /// The op spelled `name` in the Python API.
    pub fn from_name(name: &str) -> Option<BinaryOp> {
        BinaryOp::ALL.iter().copied().find(|b| b.name() == name)
    }

    /// True for `eq` … `ge`.
    pub fn is_comparison(self) -> bool {
        self.class() == BinaryClass::Compare
    }

    /// The type the op computes in, for operands promoting to `promoted` and a result of
    /// type `out` (codegen and the interpreter agree on it).
    pub fn compute_dtype(self, promoted: DataType, out: DataType) -> DataType {
        match self.class() {
            BinaryClass::Compare => promoted,
            BinaryClass::Promote | BinaryClass::Float => out.compute_dtype(),
            BinaryClass::Logical => DataType::Bool,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_round_trip() {
        for &u in UnaryOp::ALL {
            assert_eq!(UnaryOp::from_name(u.name()), Some(u));
            assert!(!u.doc().is_empty());
        }
        for &b in BinaryOp::ALL {
            assert_eq!(BinaryOp::from_name(b.name()), Some(b));
            assert!(BinaryOp::from_name(b.name()).is_some());
            assert!(UnaryOp::from_name(b.name()).is_none(), "{} is both unary and binary", b.name());
        }
    }

    #[test]
    fn maximum_propagates_nan_either_side() {
        let m = BinaryOp::Maximum;
        assert!(m.eval_f32(f32::NAN, 1.0).unwrap().is_nan());
        assert!(m.eval_f32(1.0, f32::NAN).unwrap().is_nan());
        assert_eq!(m.eval_f64(2.0, 1.0), Some(2.0));
        assert_eq!(BinaryOp::Minimum.eval_f64(2.0, 1.0), Some(1.0));
    }

    #[test]
    fn integer_forms_follow_c_and_torch() {
        assert_eq!(UnaryOp::Abs.eval_int(i64::MIN), Some(i64::MIN));
        assert_eq!(UnaryOp::Exp.eval_int(1), None);
        assert_eq!(BinaryOp::Pow.eval_int(-1, -3), Some(-1));
        assert_eq!(BinaryOp::Pow.eval_int(3, 4), Some(81));
        assert_eq!(BinaryOp::Lt.compare(1, 2), Some(true));
        assert_eq!(BinaryOp::Add.compare(1, 2), None);
    }
}
