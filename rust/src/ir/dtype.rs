//! Data types, memory types, parallel types and iteration types, plus PyTorch-style
//! type promotion.

use std::fmt;

use crate::error::{KilnError, Result};

macro_rules! dtypes {
    ($(
        $(#[doc = $doc:literal])*
        $var:ident: enum $enum_name:literal, short $short:literal, numpy $numpy:literal,
            c $c:literal, $bytes:literal bytes, $cat:ident;
    )+) => {
        /// Element type of a tensor or scalar. Within a category the declaration order is
        /// the width order promotion uses.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum DataType {
            $( $(#[doc = $doc])* $var, )+
        }

        impl DataType {
            /// All data types, narrowest first within each category.
            pub const ALL: [DataType; [$(DataType::$var),+].len()] = [$(DataType::$var),+];

            /// The promotion category of this type.
            pub fn category(self) -> Category {
                match self { $(DataType::$var => Category::$cat,)+ }
            }

            /// Size of one element in bytes.
            pub fn size_bytes(self) -> usize {
                match self { $(DataType::$var => $bytes,)+ }
            }

            /// Short name used in dumps (`float`, `half`, `int64`, ...).
            pub fn short_name(self) -> &'static str {
                match self { $(DataType::$var => $short,)+ }
            }

            /// The Python enum member name (`Float`, `Int32`, ...).
            pub fn enum_name(self) -> &'static str {
                match self { $(DataType::$var => $enum_name,)+ }
            }

            /// The NumPy / torch dtype name (`float32`, `int64`, `bfloat16`, ...).
            pub fn numpy_name(self) -> &'static str {
                match self { $(DataType::$var => $numpy,)+ }
            }

            /// The CUDA C type (runtime.cuh defines the conversions between them).
            pub fn c_type(self) -> &'static str {
                match self { $(DataType::$var => $c,)+ }
            }
        }
    };
}

// The dtype table: adding a dtype is a row here, its storage and rounding in
// interp/values.rs, its NumPy conversion in python/interp.rs, its CUDA type's
// conversions in runtime.cuh and its Python enum member in kiln/enums.py.
dtypes! {
    Bool: enum "Bool", short "bool", numpy "bool", c "bool", 1 bytes, Bool;
    Int32: enum "Int32", short "int32", numpy "int32", c "int", 4 bytes, Integer;
    Int: enum "Int", short "int64", numpy "int64", c "int64_t", 8 bytes, Integer;
    Half: enum "Half", short "half", numpy "float16", c "__half", 2 bytes, Floating;
    BFloat16: enum "BFloat16", short "bfloat16", numpy "bfloat16", c "__nv_bfloat16", 2 bytes, Floating;
    Float: enum "Float", short "float", numpy "float32", c "float", 4 bytes, Floating;
    Double: enum "Double", short "double", numpy "float64", c "double", 8 bytes, Floating;
}

/// Promotion category: PyTorch promotes across categories before widths.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Category {
    Bool,
    Integer,
    Floating,
}

impl DataType {
    /// True for floating-point types.
    pub fn is_float(self) -> bool {
        self.category() == Category::Floating
    }

    /// The type arithmetic producing this type is computed in: half and bfloat16 compute
    /// in float (one rounding per stored value, as the hardware has no cheaper path).
    pub fn compute_dtype(self) -> DataType {
        if self.is_float() && self.size_bytes() < DataType::Float.size_bytes() {
            DataType::Float
        } else {
            self
        }
    }

    /// True for integer types (not bool).
    pub fn is_integer(self) -> bool {
        self.category() == Category::Integer
    }

    /// Parse a NumPy / torch dtype name (`torch.` prefix allowed).
    pub fn from_numpy_name(name: &str) -> Option<Self> {
        let name = name.strip_prefix("torch.").unwrap_or(name);
        DataType::ALL.into_iter().find(|d| d.numpy_name() == name)
    }

    /// Parse the Python enum member name.
    pub fn from_enum_name(name: &str) -> Option<Self> {
        DataType::ALL.into_iter().find(|d| d.enum_name() == name)
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.short_name())
    }
}

/// A Python scalar as a per-call kernel argument sees it.
pub enum HostNumber {
    Bool(bool),
    /// An int that fits in 64 bits, or None for a larger one.
    Int(Option<i64>),
    Float(f64),
}

impl DataType {
    /// The bytes (host byte order, `size_bytes` of them used) of `v` as a kernel parameter
    /// of this type, converted exactly as NumPy casts a Python scalar to it (an int or float
    /// out of an integer type's range, or NaN to an integer, is an error as in NumPy).
    /// `to_f64` is only called for ints, whose float value Python computes (correctly
    /// rounded; an error for ints beyond a double's range, like NumPy's).
    pub fn param_bytes(self, v: HostNumber, to_f64: impl FnOnce() -> Result<f64>) -> Result<[u8; 8]> {
        let float = match v {
            HostNumber::Bool(b) => f64::from(u8::from(b)),
            HostNumber::Int(_) if self.is_float() => to_f64()?,
            HostNumber::Int(_) => 0.0,
            HostNumber::Float(x) => x,
        };
        let mut out = [0u8; 8];
        let n = self.size_bytes();
        match self.category() {
            Category::Bool => {
                out[0] = u8::from(match v {
                    HostNumber::Bool(b) => b,
                    HostNumber::Int(i) => i != Some(0), // an int beyond 64 bits is nonzero
                    HostNumber::Float(x) => x != 0.0,   // NaN is true, as in NumPy
                })
            }
            Category::Integer => {
                // NumPy converts a float to an integer type by truncation toward zero, and
                // refuses NaN, infinities and values outside the type.
                let i = match v {
                    HostNumber::Bool(b) => Some(i64::from(b)),
                    HostNumber::Int(i) => i,
                    HostNumber::Float(x) if x.is_nan() => {
                        return Err(KilnError::value("cannot convert float NaN to integer"))
                    }
                    // -2**63 <= trunc(x) < 2**63 is exactly the range `as` converts losslessly.
                    HostNumber::Float(x) => {
                        Some(x.trunc()).filter(|t| *t >= i64::MIN as f64 && *t < -(i64::MIN as f64)).map(|t| t as i64)
                    }
                };
                let bits = 8 * n as u32;
                let (lo, hi) = (i64::MIN >> (64 - bits), i64::MAX >> (64 - bits));
                let i = i
                    .filter(|i| (lo..=hi).contains(i))
                    .ok_or_else(|| KilnError::value(format!("the value does not fit in {}", self.numpy_name())))?;
                // Little or big endian alike: the low `n` bytes of the native representation
                // of a value in range are the narrow type's native bytes.
                let b = i.to_ne_bytes();
                if cfg!(target_endian = "little") {
                    out[..n].copy_from_slice(&b[..n]);
                } else {
                    out[..n].copy_from_slice(&b[8 - n..]);
                }
            }
            Category::Floating => match self {
                DataType::Double => out.copy_from_slice(&float.to_ne_bytes()),
                DataType::Float => out[..4].copy_from_slice(&(float as f32).to_ne_bytes()),
                DataType::Half => out[..2].copy_from_slice(&f64_to_f16_bits(float).to_ne_bytes()),
                // Through float32 first, as NumPy without a bfloat16 type converts.
                _ => out[..2].copy_from_slice(&half::bf16::from_f32(float as f32).to_bits().to_ne_bytes()),
            },
        }
        Ok(out)
    }
}

/// Promote two tensor dtypes (PyTorch `promote_types`).
pub fn promote_tensor_types(a: DataType, b: DataType) -> DataType {
    use DataType::*;
    if a == b {
        return a;
    }
    match (a.category(), b.category()) {
        (ca, cb) if ca != cb => {
            if ca > cb {
                a
            } else {
                b
            }
        }
        _ => match (a, b) {
            // Neither half type can hold the other: PyTorch widens to float.
            (Half, BFloat16) | (BFloat16, Half) => Float,
            _ => a.max(b),
        },
    }
}

/// An operand's dtype for promotion: tensors dominate scalars of the same category.
#[derive(Clone, Copy, Debug)]
pub struct PromotionOperand {
    pub dtype: DataType,
    pub is_tensor: bool,
    /// A 0-d tensor beside ranked ones (with `is_tensor` false): PyTorch's middle tier,
    /// which lifts the category with its own dtype where a Python number gives the default.
    pub zero_dim: bool,
}

/// Result dtype of an arithmetic op over tensors and scalars (PyTorch `result_type`).
pub fn promote(operands: &[PromotionOperand]) -> DataType {
    let ranked = operands.iter().filter(|o| o.is_tensor).map(|o| o.dtype).reduce(promote_tensor_types);
    let zero_dim = operands.iter().filter(|o| o.zero_dim).map(|o| o.dtype).reduce(promote_tensor_types);
    let tensor_type = match (ranked, zero_dim) {
        (Some(t), Some(z)) if z.category() > t.category() => Some(z),
        (Some(t), _) => Some(t),
        (None, z) => z,
    };
    let scalar_type =
        operands.iter().filter(|o| !o.is_tensor && !o.zero_dim).map(|o| o.dtype).reduce(promote_tensor_types);
    match (tensor_type, scalar_type) {
        (Some(t), None) => t,
        (None, Some(s)) => s,
        (None, None) => DataType::Float,
        (Some(t), Some(s)) => {
            if s.category() > t.category() {
                // A scalar only lifts the category; its width is the default of that category.
                match s.category() {
                    Category::Floating => DataType::Float,
                    Category::Integer => DataType::Int,
                    Category::Bool => DataType::Bool,
                }
            } else {
                t
            }
        }
    }
}

/// Where a tensor lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryType {
    Global,
    Shared,
    Local,
}

impl MemoryType {
    /// One-letter tag used in tensor names in dumps (`T3_l_float`).
    pub fn tag(self) -> &'static str {
        match self {
            MemoryType::Global => "g",
            MemoryType::Shared => "s",
            MemoryType::Local => "l",
        }
    }
    /// The Python enum member name.
    pub fn enum_name(self) -> &'static str {
        match self {
            MemoryType::Global => "Global",
            MemoryType::Shared => "Shared",
            MemoryType::Local => "Local",
        }
    }
    /// Parse the Python enum member name.
    pub fn from_enum_name(name: &str) -> Option<Self> {
        [MemoryType::Global, MemoryType::Shared, MemoryType::Local].into_iter().find(|m| m.enum_name() == name)
    }
}

/// How a loop is mapped onto the hardware.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParallelType {
    Serial,
    BIDx,
    BIDy,
    BIDz,
    TIDx,
    TIDy,
    TIDz,
    Vectorize,
    Unroll,
    Unswitch,
    /// The axis is copied by one bulk (TMA) copy, not a loop.
    Bulk,
}

impl ParallelType {
    /// Every parallel type, in a stable order.
    pub const ALL: [ParallelType; 11] = [
        ParallelType::Serial,
        ParallelType::BIDx,
        ParallelType::BIDy,
        ParallelType::BIDz,
        ParallelType::TIDx,
        ParallelType::TIDy,
        ParallelType::TIDz,
        ParallelType::Vectorize,
        ParallelType::Unroll,
        ParallelType::Unswitch,
        ParallelType::Bulk,
    ];
    /// True for threadIdx.{x,y,z}.
    pub fn is_thread(self) -> bool {
        matches!(self, ParallelType::TIDx | ParallelType::TIDy | ParallelType::TIDz)
    }
    /// True for blockIdx.{x,y,z}.
    pub fn is_block(self) -> bool {
        matches!(self, ParallelType::BIDx | ParallelType::BIDy | ParallelType::BIDz)
    }
    /// True for thread or block parallel types (a hardware dimension).
    pub fn is_thread_or_block(self) -> bool {
        self.is_thread() || self.is_block()
    }
    /// Types that may appear at most once in a tensor's loop domain.
    pub fn is_unique_per_tensor(self) -> bool {
        self.is_thread_or_block() || matches!(self, ParallelType::Vectorize | ParallelType::Bulk)
    }
    /// The Python enum member name.
    pub fn enum_name(self) -> &'static str {
        match self {
            ParallelType::Serial => "Serial",
            ParallelType::BIDx => "BIDx",
            ParallelType::BIDy => "BIDy",
            ParallelType::BIDz => "BIDz",
            ParallelType::TIDx => "TIDx",
            ParallelType::TIDy => "TIDy",
            ParallelType::TIDz => "TIDz",
            ParallelType::Vectorize => "Vectorize",
            ParallelType::Unroll => "Unroll",
            ParallelType::Unswitch => "Unswitch",
            ParallelType::Bulk => "Bulk",
        }
    }

    /// Parse the Python enum member name.
    pub fn from_enum_name(name: &str) -> Option<Self> {
        ParallelType::ALL.into_iter().find(|p| p.enum_name() == name)
    }
    /// Short tag used in id names in dumps (`iS`, `iblockIdx.x`, `iV`).
    pub fn tag(self) -> &'static str {
        match self {
            ParallelType::Serial => "S",
            ParallelType::BIDx => "blockIdx.x",
            ParallelType::BIDy => "blockIdx.y",
            ParallelType::BIDz => "blockIdx.z",
            ParallelType::TIDx => "threadIdx.x",
            ParallelType::TIDy => "threadIdx.y",
            ParallelType::TIDz => "threadIdx.z",
            ParallelType::Vectorize => "V",
            ParallelType::Unroll => "UR",
            ParallelType::Unswitch => "US",
            ParallelType::Bulk => "B",
        }
    }
}

/// What kind of iteration an IterDomain represents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IterType {
    Iteration,
    Reduction,
    Broadcast,
}

impl IterType {
    /// One-letter tag used in dumps.
    pub fn tag(self) -> &'static str {
        match self {
            IterType::Iteration => "i",
            IterType::Reduction => "r",
            IterType::Broadcast => "b",
        }
    }
}

/// IEEE binary16 bits of `v`, rounded to nearest even straight from the double, as the
/// GPU's `__double2half` and NumPy's `np.float16(v)` do. (`half::f16::from_f64` goes through
/// f32 and rounds twice: 76 of 4 million random doubles come out one unit off.)
pub fn f64_to_f16_bits(v: f64) -> u16 {
    f64_to_narrow_bits(v, 5, 10)
}

/// bfloat16 bits of `v`, rounded to nearest even straight from the double, as the GPU's
/// `__double2bfloat16` does (`half::bf16::from_f64` rounds twice, like `f16::from_f64`).
pub fn f64_to_bf16_bits(v: f64) -> u16 {
    f64_to_narrow_bits(v, 8, 7)
}

/// Bits of `v` rounded to nearest even into a binary float of `eb` exponent and `mb`
/// mantissa bits, subnormals and overflow to infinity included. NaN keeps its top payload
/// bits (NumPy: `inf + (man >> (52 - mb))`, kept a NaN when the payload shifted out).
fn f64_to_narrow_bits(v: f64, eb: u32, mb: u32) -> u16 {
    let b = v.to_bits();
    let sign = ((b >> 63) as u16) << (eb + mb);
    let exp = ((b >> 52) & 0x7FF) as i32;
    let man = b & ((1u64 << 52) - 1);
    let inf = (((1u32 << eb) - 1) << mb) as u16;
    if exp == 0x7FF {
        if man == 0 {
            return sign | inf;
        }
        let r = inf + (man >> (52 - mb)) as u16;
        return sign | if r == inf { r + 1 } else { r };
    }
    if exp == 0 {
        return sign; // zero, or a double subnormal: far below the narrow type's range
    }
    let bias = (1i32 << (eb - 1)) - 1;
    let (e, emin) = (exp - 1023, 1 - bias);
    if e > bias {
        return sign | inf;
    }
    // value = sig * 2^(e-52); one unit of the result is 2^(max(e, emin) - mb).
    let sig = (1u64 << 52) | man;
    let shift = (52 - mb as i32 + e.max(emin) - e) as u32;
    if shift >= 64 {
        return sign; // below a quarter of the smallest subnormal
    }
    let (mut q, rem, half) = (sig >> shift, sig & ((1u64 << shift) - 1), 1u64 << (shift - 1));
    if rem > half || (rem == half && q & 1 == 1) {
        q += 1;
    }
    // Normal: the implicit bit in q carries into the exponent field (also on rounding up
    // to the next binade, or to infinity); subnormal: q is the field itself.
    let bits = if e >= emin { (((e - emin) as u64) << mb) + q } else { q };
    sign | bits.min(u64::from(inf)) as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use DataType::*;

    fn t(d: DataType) -> PromotionOperand {
        PromotionOperand { dtype: d, is_tensor: true, zero_dim: false }
    }
    fn s(d: DataType) -> PromotionOperand {
        PromotionOperand { dtype: d, is_tensor: false, zero_dim: false }
    }
    fn z(d: DataType) -> PromotionOperand {
        PromotionOperand { dtype: d, is_tensor: false, zero_dim: true }
    }

    #[test]
    fn zero_dim_tensors_lift_the_category_with_their_own_dtype() {
        assert_eq!(promote(&[t(Int32), z(Double)]), Double);
        assert_eq!(promote(&[t(Bool), z(Int32)]), Int32);
        assert_eq!(promote(&[t(Int32), z(Half)]), Half);
        // Within the category the ranked operand's dtype stands.
        assert_eq!(promote(&[t(Half), z(Double)]), Half);
        assert_eq!(promote(&[t(Int32), z(Int)]), Int32);
        // A Python number above both categories still gives its category's default.
        assert_eq!(promote(&[t(Bool), z(Int32), s(Double)]), Float);
        assert_eq!(promote(&[z(Int32), s(Int)]), Int32);
    }

    #[test]
    fn tensor_promotion_follows_pytorch() {
        assert_eq!(promote(&[t(Half), t(BFloat16)]), Float);
        assert_eq!(promote(&[t(Int32), t(Int)]), Int);
        assert_eq!(promote(&[t(Bool), t(Int32)]), Int32);
        assert_eq!(promote(&[t(Int), t(Half)]), Half);
        assert_eq!(promote(&[t(Float), t(Double)]), Double);
    }

    #[test]
    fn narrow_floats_round_once_from_the_double() {
        // Cases where rounding through f32 first gives another result (NumPy's and the
        // GPU's single rounding verified against exact rational rounding).
        assert_eq!(f64_to_f16_bits(-9.127807567677662e-2), 0xadd7);
        assert_eq!(f64_to_f16_bits(5.449295232317457e-3), 0x1d95);
        assert_eq!(f64_to_bf16_bits(-2.008164953925238e-08), 0xb2ad);
        assert_eq!(f64_to_bf16_bits(7.551434749136491e+29), 0x7119);
        assert_eq!(f64_to_f16_bits(65504.0), 0x7bff);
        assert_eq!(f64_to_f16_bits(65520.0), 0x7c00);
        assert_eq!(f64_to_f16_bits(-0.0), 0x8000);
        assert_eq!(f64_to_f16_bits(5.960464477539063e-8), 0x0001);
        assert_eq!(f64_to_bf16_bits(1.0), 0x3f80);
        assert_eq!(f64_to_bf16_bits(f64::INFINITY), 0x7f80);
        assert_eq!(f64_to_bf16_bits(3.4e38), 0x7f80);
        for i in 0..=0x7bffu16 {
            let v = half::f16::from_bits(i).to_f64();
            assert_eq!(f64_to_f16_bits(v), i, "{v}");
        }
        for i in 0..0x7f80u16 {
            let v = half::bf16::from_bits(i).to_f64();
            assert_eq!(f64_to_bf16_bits(v), i, "{v}");
        }
    }

    #[test]
    fn scalars_only_lift_the_category() {
        assert_eq!(promote(&[t(Half), s(Double)]), Half);
        assert_eq!(promote(&[t(Int32), s(Double)]), Float);
        assert_eq!(promote(&[t(Int32), s(Int)]), Int32);
        assert_eq!(promote(&[t(Bool), s(Int)]), Int);
        assert_eq!(promote(&[t(Float), s(Bool)]), Float);
    }
}
