//! Symbolic scalars: a hash-consed DAG of constants, named scalars and integer
//! arithmetic. Every builder call simplifies, so extents stay readable
//! (`ceilDiv(i0, 128)`, never `ceilDiv(i0 * 1 + 0, 128)`).

use cranelift_entity::{entity_impl, PrimaryMap};
use rustc_hash::FxHashMap;
use std::fmt::Write as _;

use crate::error::{KilnError, Result};
use crate::ir::dtype::{DataType, ParallelType};
use crate::ir::TvId;

/// Id of a scalar value in a [`Scalars`] arena.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValId(u32);
entity_impl!(ValId, "v");

/// Named leaves of the scalar DAG: values known only at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Symbol {
    /// A symbolic extent of an input tensor, printed `i{n}`.
    Extent(u32),
    /// A runtime stride of a tensor's allocation axis, printed `T3.stride[1]`.
    Stride(TvId, u32),
    /// A runtime scalar input of the fusion, printed `s{n}`.
    ScalarInput(u32),
    /// A loop index of the kernel, printed `i{n}` in kernel IR as `idx{n}`.
    LoopIndex(u32),
    /// threadIdx/blockIdx of a parallel type.
    ParallelIndex(ParallelType),
    /// blockDim/gridDim of a parallel type.
    ParallelDim(ParallelType),
    /// A value read from an index tensor (index_select), printed `g{n}`.
    Gathered(u32),
    /// True in the threads that hold the finished result of the grid reduction of this
    /// tensor (the last block to arrive, index 0 of the reduced thread dimensions), printed
    /// `done(T{n})`. Ops on that result in the same kernel run there.
    GridDone(TvId),
    /// The position along output axis `k` of the remap whose expressions hold it, printed
    /// `o{k}`; indexing replaces it by the output's index, so no kernel contains it.
    OutAxis(u32),
}

/// Integer binary operators of the scalar DAG.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScalarOp {
    Add,
    Sub,
    Mul,
    /// Floor division of non-negative integers.
    Div,
    Mod,
    CeilDiv,
    Min,
    Max,
    Lt,
    Le,
    Eq,
    And,
}

impl ScalarOp {
    fn is_commutative(self) -> bool {
        matches!(self, ScalarOp::Add | ScalarOp::Mul | ScalarOp::Min | ScalarOp::Max | ScalarOp::Eq | ScalarOp::And)
    }
    fn infix(self) -> Option<&'static str> {
        Some(match self {
            ScalarOp::Add => "+",
            ScalarOp::Sub => "-",
            ScalarOp::Mul => "*",
            ScalarOp::Div => "/",
            ScalarOp::Mod => "%",
            ScalarOp::Lt => "<",
            ScalarOp::Le => "<=",
            ScalarOp::Eq => "==",
            ScalarOp::And => "&&",
            _ => return None,
        })
    }
    fn precedence(self) -> u8 {
        match self {
            ScalarOp::Mul | ScalarOp::Div | ScalarOp::Mod => 5,
            ScalarOp::Add | ScalarOp::Sub => 4,
            ScalarOp::Lt | ScalarOp::Le => 3,
            ScalarOp::Eq => 2,
            ScalarOp::And => 1,
            _ => 9,
        }
    }
    /// The op on concrete integers as the generated C computes it: `/` and `%` truncate
    /// toward zero, `ceilDiv(a, b)` is `(a + b - 1) / b`. `None` on overflow or a zero
    /// divisor. The simplifier, the interpreter ([`ScalarOp::apply_wrapping`]) and codegen
    /// share this one definition.
    pub fn apply(self, a: i64, b: i64) -> Option<i64> {
        self.eval(a, b, false)
    }

    /// [`ScalarOp::apply`] with two's-complement wrapping on overflow (a 64-bit register);
    /// `None` only for a zero divisor.
    pub fn apply_wrapping(self, a: i64, b: i64) -> Option<i64> {
        self.eval(a, b, true)
    }

    fn eval(self, a: i64, b: i64, wrap: bool) -> Option<i64> {
        let pick = |checked: Option<i64>, wrapped: i64| if wrap { Some(wrapped) } else { checked };
        Some(match self {
            ScalarOp::Add => pick(a.checked_add(b), a.wrapping_add(b))?,
            ScalarOp::Sub => pick(a.checked_sub(b), a.wrapping_sub(b))?,
            ScalarOp::Mul => pick(a.checked_mul(b), a.wrapping_mul(b))?,
            ScalarOp::Div | ScalarOp::Mod | ScalarOp::CeilDiv if b == 0 => return None,
            ScalarOp::Div => pick(a.checked_div(b), a.wrapping_div(b))?,
            ScalarOp::Mod => pick(a.checked_rem(b), a.wrapping_rem(b))?,
            ScalarOp::CeilDiv => {
                let n = pick(a.checked_add(b).and_then(|s| s.checked_sub(1)), a.wrapping_add(b).wrapping_sub(1))?;
                pick(n.checked_div(b), n.wrapping_div(b))?
            }
            ScalarOp::Min => a.min(b),
            ScalarOp::Max => a.max(b),
            ScalarOp::Lt => (a < b) as i64,
            ScalarOp::Le => (a <= b) as i64,
            ScalarOp::Eq => (a == b) as i64,
            ScalarOp::And => (a != 0 && b != 0) as i64,
        })
    }
}

/// Longest text [`Scalars::render`] prints of one expression (then `…`).
const RENDER_CHARS: usize = 20_000;

/// A node of the scalar DAG.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Val {
    Int(i64),
    /// A float constant, stored as its bit pattern so nodes can be hash-consed.
    Float(u64),
    Bool(bool),
    Symbol(Symbol),
    Binary(ScalarOp, ValId, ValId),
}

/// Arena of scalar values with hash-consing and simplification.
#[derive(Clone, Debug, Default)]
pub struct Scalars {
    nodes: PrimaryMap<ValId, Val>,
    dedup: FxHashMap<Val, ValId>,
    /// Exclusive upper bounds of symbols known to lie in `[0, bound)` (loop indices).
    bounds: FxHashMap<Symbol, i64>,
    /// Symbolic exclusive upper bounds (a block index below its grid extent).
    sym_bounds: FxHashMap<Symbol, ValId>,
    /// Memo of `range` (nodes never change; cleared when a bound is set). Without it the
    /// simplifier re-walks shared subexpressions of index DAGs over and over.
    ranges: RangeMemo,
}

/// `range` results; a Mutex (uncontended) because Python-visible objects must be Sync.
/// A clone starts empty: the memo is only a cache.
#[derive(Debug, Default)]
struct RangeMemo(std::sync::Mutex<FxHashMap<ValId, (i64, Option<i64>)>>);

impl Clone for RangeMemo {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl RangeMemo {
    fn get(&self, v: ValId) -> Option<(i64, Option<i64>)> {
        self.0.lock().ok().and_then(|m| m.get(&v).copied())
    }

    fn put(&self, v: ValId, r: (i64, Option<i64>)) {
        if let Ok(mut m) = self.0.lock() {
            m.insert(v, r);
        }
    }

    fn clear(&mut self) {
        if let Ok(m) = self.0.get_mut() {
            m.clear();
        }
    }
}

impl Scalars {
    /// An empty arena.
    pub fn new() -> Self {
        Self::default()
    }

    /// The node behind an id.
    pub fn get(&self, v: ValId) -> Val {
        self.nodes[v]
    }

    /// Number of distinct nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when no node was built yet.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    fn intern(&mut self, val: Val) -> ValId {
        if let Some(&id) = self.dedup.get(&val) {
            return id;
        }
        let id = self.nodes.push(val);
        self.dedup.insert(val, id);
        id
    }

    /// An integer constant.
    pub fn int(&mut self, v: i64) -> ValId {
        self.intern(Val::Int(v))
    }
    /// A float constant.
    pub fn float(&mut self, v: f64) -> ValId {
        self.intern(Val::Float(v.to_bits()))
    }
    /// A bool constant.
    pub fn boolean(&mut self, v: bool) -> ValId {
        self.intern(Val::Bool(v))
    }
    /// A named runtime value.
    pub fn symbol(&mut self, s: Symbol) -> ValId {
        self.intern(Val::Symbol(s))
    }

    /// The id of symbol `s` if it was ever built (lookup only, no insertion).
    pub fn symbol_id(&self, s: Symbol) -> Option<ValId> {
        self.dedup.get(&Val::Symbol(s)).copied()
    }

    /// The integer constant behind `v`, if it is one.
    pub fn as_int(&self, v: ValId) -> Option<i64> {
        match self.nodes[v] {
            Val::Int(i) => Some(i),
            Val::Bool(b) => Some(b as i64),
            _ => None,
        }
    }

    /// True when `v` is the integer constant `c`.
    pub fn is_const(&self, v: ValId, c: i64) -> bool {
        self.as_int(v) == Some(c)
    }

    /// The dtype of a scalar node as seen by type promotion.
    pub fn dtype(&self, v: ValId, scalar_inputs: &[DataType]) -> DataType {
        match self.nodes[v] {
            Val::Int(_) => DataType::Int,
            Val::Float(_) => DataType::Double,
            Val::Bool(_) => DataType::Bool,
            Val::Symbol(Symbol::ScalarInput(i)) => scalar_inputs.get(i as usize).copied().unwrap_or(DataType::Double),
            Val::Symbol(_) => DataType::Int,
            Val::Binary(op, a, _) => match op {
                ScalarOp::Lt | ScalarOp::Le | ScalarOp::Eq | ScalarOp::And => DataType::Bool,
                _ => self.dtype(a, scalar_inputs),
            },
        }
    }

    /// Build `a op b`, simplified.
    pub fn binary(&mut self, op: ScalarOp, a: ValId, b: ValId) -> ValId {
        if let Some(v) = self.simplify(op, a, b) {
            return v;
        }
        // Commutative ops: constants on the right, and `i1 * i0` is the node `i0 * i1`
        // if that one exists (the first spelling wins, so dumps keep a natural order).
        let (a, b) =
            if op.is_commutative() && self.as_int(a).is_some() && self.as_int(b).is_none() { (b, a) } else { (a, b) };
        if op.is_commutative() {
            if let Some(&v) = self.dedup.get(&Val::Binary(op, b, a)) {
                return v;
            }
        }
        self.intern(Val::Binary(op, a, b))
    }

    /// Declare that `sym` lies in `[0, bound)` for a symbolic `bound`.
    pub fn set_symbolic_bound(&mut self, sym: Symbol, bound: ValId) {
        self.sym_bounds.insert(sym, bound);
    }

    /// Declare that `sym` lies in `[0, bound)` (a loop index of constant extent).
    pub fn set_bound(&mut self, sym: Symbol, bound: i64) {
        self.bounds.insert(sym, bound);
        self.ranges.clear();
    }

    /// Inclusive range of an integer expression, assuming symbols are non-negative.
    /// `None` as the upper end means unbounded.
    pub fn range(&self, v: ValId) -> (i64, Option<i64>) {
        if let Some(r) = self.ranges.get(v) {
            return r;
        }
        let r = self.range_uncached(v);
        self.ranges.put(v, r);
        r
    }

    fn range_uncached(&self, v: ValId) -> (i64, Option<i64>) {
        match self.nodes[v] {
            Val::Int(i) => (i, Some(i)),
            Val::Bool(b) => (b as i64, Some(b as i64)),
            Val::Float(_) => (i64::MIN, None),
            // A runtime scalar input may be negative; sizes, strides and indices are not.
            Val::Symbol(Symbol::ScalarInput(_)) => (i64::MIN, None),
            Val::Symbol(s) => (0, self.bounds.get(&s).map(|b| b - 1)),
            Val::Binary(op, a, b) => {
                if let Some(r) = self.slice_length_range(op, a, b) {
                    return r;
                }
                let ((al, ah), (bl, bh)) = (self.range(a), self.range(b));
                if al < 0 || bl < 0 {
                    return (i64::MIN, None);
                }
                match op {
                    ScalarOp::Add => (al.saturating_add(bl), ah.zip(bh).map(|(x, y)| x.saturating_add(y))),
                    ScalarOp::Mul => (al.saturating_mul(bl), ah.zip(bh).map(|(x, y)| x.saturating_mul(y))),
                    ScalarOp::Div if bl > 0 => (al / bh.unwrap_or(i64::MAX).max(1), ah.map(|x| x / bl)),
                    // A position divided by an extent: non-negative wherever it is defined
                    // (an extent of 0 leaves nothing to index), at most the dividend.
                    ScalarOp::Div => (0, ah),
                    ScalarOp::CeilDiv if bl > 0 => (0, ah.map(|x| x / bl + i64::from(x % bl != 0))),
                    ScalarOp::Mod if bl > 0 => {
                        (0, Some(bh.map_or(ah.unwrap_or(i64::MAX), |m| m - 1).min(ah.unwrap_or(i64::MAX))))
                    }
                    ScalarOp::Min => (
                        al.min(bl),
                        match (ah, bh) {
                            (Some(x), Some(y)) => Some(x.min(y)),
                            (x, y) => x.or(y),
                        },
                    ),
                    ScalarOp::Max => (al.max(bl), ah.zip(bh).map(|(x, y)| x.max(y))),
                    ScalarOp::Sub => (bh.map_or(i64::MIN, |h| al.saturating_sub(h)), ah.map(|h| h.saturating_sub(bl))),
                    ScalarOp::Lt | ScalarOp::Le | ScalarOp::Eq | ScalarOp::And => (0, Some(1)),
                    _ => (i64::MIN, None),
                }
            }
        }
    }

    /// The range of `a - min(a, c)` (a slice's length after a clamped start): `max(a - c,
    /// 0)`, and `k` where `c` is `a - k` (a start counted from the end).
    fn slice_length_range(&self, op: ScalarOp, a: ValId, b: ValId) -> Option<(i64, Option<i64>)> {
        let (ScalarOp::Sub, Val::Binary(ScalarOp::Min, x, y)) = (op, self.nodes[b]) else { return None };
        let c = if x == a {
            y
        } else if y == a {
            x
        } else {
            return None;
        };
        if let Val::Binary(ScalarOp::Sub, ca, k) = self.nodes[c] {
            let (kl, kh) = self.range(k);
            if ca == a && kl >= 0 {
                return Some((kl, kh));
            }
        }
        let ((al, ah), cl) = (self.range(a), self.range(c).0);
        (al >= 0 && cl > i64::MIN).then(|| (0, ah.map(|h| h.saturating_sub(cl).max(0))))
    }

    fn simplify(&mut self, op: ScalarOp, a: ValId, b: ValId) -> Option<ValId> {
        use ScalarOp::*;
        if let Some(v) = self.simplify_structure(op, a, b) {
            return Some(v);
        }
        let (ca, cb) = (self.as_int(a), self.as_int(b));
        if let (Some(x), Some(y)) = (ca, cb) {
            if let Some(r) = op.apply(x, y) {
                return Some(match op {
                    Lt | Le | Eq | And => self.boolean(r != 0),
                    _ => self.int(r),
                });
            }
            return None;
        }
        // Put a lone constant on the right for the identity rules below.
        let (a, b, cb) = if op.is_commutative() && ca.is_some() { (b, a, ca) } else { (a, b, cb) };
        match (op, cb) {
            (Add | Sub, Some(0)) | (Mul | Div | CeilDiv, Some(1)) => return Some(a),
            (Mul, Some(0)) => return Some(self.int(0)),
            (Mod, Some(1)) => return Some(self.int(0)),
            (And, Some(0)) => return Some(self.boolean(false)),
            (And, Some(_)) if matches!(self.nodes[b], Val::Bool(_)) => return Some(a),
            _ => {}
        }
        if a == b {
            match op {
                Sub => return Some(self.int(0)),
                Min | Max => return Some(a),
                Eq | Le => return Some(self.boolean(true)),
                Lt => return Some(self.boolean(false)),
                _ => {}
            }
        }
        // Two offsets of one value: min(x - 1, x) == x - 1, max(x + 2, x) == x + 2 and
        // (x + c1) - (x + c2) == c1 - c2. A slice of a cat of slices (a stencil's padded
        // row, sliced again) spelled its length as `x - min(x - 1, x)`, growing with each
        // level of the stencil.
        if matches!(op, Min | Max | Sub) {
            let offset = |s: &Self, v: ValId| match s.nodes[v] {
                Val::Binary(Add, x, c) => s.as_int(c).map_or((v, 0), |c| (x, c)),
                Val::Binary(Sub, x, c) => s.as_int(c).and_then(i64::checked_neg).map_or((v, 0), |c| (x, c)),
                _ => (v, 0),
            };
            let ((x, c1), (y, c2)) = (offset(self, a), offset(self, b));
            if x == y && self.as_int(x).is_none() {
                match op {
                    Min => return Some(if c1 <= c2 { a } else { b }),
                    Max => return Some(if c1 >= c2 { a } else { b }),
                    _ => {
                        if let Some(d) = c1.checked_sub(c2) {
                            return Some(self.int(d));
                        }
                    }
                }
            }
        }
        // Re-associate constants: (x op c1) op c2 -> x op (c1 op c2), unless c1 op c2
        // overflows (the expression then stays as written, and evaluating it reports the
        // overflow instead of a wrapped size).
        if let (Some(c2), Val::Binary(inner, x, c1)) = (cb, self.nodes[a]) {
            if let Some(c1) = self.as_int(c1) {
                let (sum, diff, prod) = (c1.checked_add(c2), c1.checked_sub(c2), c1.checked_mul(c2));
                match (op, inner) {
                    (Add, Add) if sum.is_some() => return Some(self.binary_with_const(Add, x, sum?)),
                    (Sub, Add) if diff.is_some() => return Some(self.binary_with_const(Add, x, diff?)),
                    // (x - c1) + c2 and (x - c1) - c2, spelled with one constant (the
                    // start of a slice at `n - 2 + 1` is `n - 1`).
                    (Add, Sub) => {
                        if let Some(d) = c1.checked_sub(c2) {
                            return Some(if d >= 0 {
                                self.binary_with_const(Sub, x, d)
                            } else {
                                self.binary_with_const(Add, x, d.checked_neg()?)
                            });
                        }
                    }
                    (Sub, Sub) if sum.is_some() => return Some(self.binary_with_const(Sub, x, sum?)),
                    (Mul, Mul) if prod.is_some() => return Some(self.binary_with_const(Mul, x, prod?)),
                    // ceil(ceil(x / a) / b) == ceil(x / (a * b)) for positive a, b.
                    (CeilDiv, CeilDiv) if c1 > 0 && c2 > 0 && prod.is_some() => {
                        return Some(self.binary_with_const(CeilDiv, x, prod?))
                    }
                    (Div, Div) if c1 > 0 && c2 > 0 && prod.is_some() => {
                        return Some(self.binary_with_const(Div, x, prod?))
                    }
                    // (x * c1) / c2 when c2 divides c1: merge-then-split of the same factor.
                    (CeilDiv | Div, Mul) if c2 > 0 && c1 % c2 == 0 => {
                        return Some(self.binary_with_const(Mul, x, c1 / c2))
                    }
                    (Mod, Mul) if c2 > 0 && c1 % c2 == 0 => return Some(self.int(0)),
                    _ => {}
                }
            }
        }
        // a - min(a, b) == max(a, b) - b: a slice's length after its clamped start, spelled
        // with `a` once. Sliced again, the length of a slice is the next `a`; spelled
        // twice, each slice doubled the expression (and every walk over it).
        if op == Sub {
            if let Val::Binary(Min, p, q) = self.nodes[b] {
                let other = if p == a {
                    Some(q)
                } else if q == a {
                    Some(p)
                } else {
                    None
                };
                if let Some(c) = other.filter(|&c| self.as_int(c).is_some_and(|c| c >= 0)) {
                    let m = self.max(a, c);
                    return Some(self.sub(m, c));
                }
            }
        }
        // Like terms: x + x == x * 2 and x * c1 + x * c2 == x * (c1 + c2). A cat of n parts of
        // one runtime size has the extent n * p, not a sum of n copies of p that every index
        // and bounds check of the kernel would spell out again.
        if op == Add {
            let term = |s: &Self, v: ValId| match s.nodes[v] {
                Val::Binary(Mul, x, c) => s.as_int(c).map_or((v, 1), |c| (x, c)),
                _ => (v, 1),
            };
            let ((x, c1), (y, c2)) = (term(self, a), term(self, b));
            if x == y && self.as_int(x).is_none() {
                if let Some(c) = c1.checked_add(c2) {
                    return Some(self.binary_with_const(Mul, x, c));
                }
            }
        }
        // min(x + c1, c2) + d == min(x + (c1 + d), c2 + d) (and max, and - d): the extent of a
        // slice of a padded axis, `min(i + 2, 26) - 2`, is `min(i, 24)`, the same value as its
        // siblings' extents, so that their index math is shared instead of repeated.
        if let (Some(k), Add | Sub, Val::Binary(mm @ (Min | Max), p, q)) = (cb, op, self.nodes[a]) {
            let d = if op == Add { Some(k) } else { k.checked_neg() };
            let (p, q) = if self.as_int(p).is_some() { (q, p) } else { (p, q) };
            if let (Some(d), Some(c2), Val::Binary(Add, x, c1)) = (d, self.as_int(q), self.nodes[p]) {
                if let (Some(c1), Some(c2d)) = (self.as_int(c1), c2.checked_add(d)) {
                    // (A negative c1 + d would lose the range of x's lower bound.)
                    if let Some(c1d) = c1.checked_add(d).filter(|&c| c >= 0) {
                        let xp = self.binary_with_const(Add, x, c1d);
                        let qd = self.int(c2d);
                        return Some(self.binary(mm, xp, qd));
                    }
                }
            }
        }
        None
    }

    /// Rules that need the shape of the operands: div/mod identities and ranges.
    fn simplify_structure(&mut self, op: ScalarOp, a: ValId, b: ValId) -> Option<ValId> {
        use ScalarOp::*;
        // A loop index of an extent-1 loop is always 0.
        let zero_range = |s: &Self, v: ValId| matches!(s.nodes[v], Val::Symbol(_)) && s.range(v) == (0, Some(0));
        match op {
            Add | Sub if zero_range(self, b) => return Some(a),
            Add if zero_range(self, a) => return Some(b),
            Mul if zero_range(self, a) || zero_range(self, b) => return Some(self.int(0)),
            _ => {}
        }
        match op {
            Add => {
                // (x / y) * y + x % y == x, whatever the operand order.
                for (p, q) in [(a, b), (b, a)] {
                    let (Val::Binary(Mul, m1, m2), Val::Binary(Mod, x2, y2)) = (self.nodes[p], self.nodes[q]) else {
                        continue;
                    };
                    for (d, y1) in [(m1, m2), (m2, m1)] {
                        if let Val::Binary(Div, x1, y0) = self.nodes[d] {
                            if x1 == x2 && y0 == y1 && y1 == y2 {
                                return Some(x1);
                            }
                        }
                    }
                }
                // (x / y) * (y * s) + (x % y) * s == x * s: the offset of a merged index in a
                // row-major tensor with an inner stride s (rows of [B, H, S, 512] at row r:
                // r * 512, not three divisions of r).
                for (p, q) in [(a, b), (b, a)] {
                    let (Val::Binary(Mul, m1, m2), Val::Binary(Mul, n1, n2)) = (self.nodes[p], self.nodes[q]) else {
                        continue;
                    };
                    for (d, big) in [(m1, m2), (m2, m1)] {
                        let Val::Binary(Div, x, y) = self.nodes[d] else { continue };
                        for (r, s) in [(n1, n2), (n2, n1)] {
                            if self.nodes[r] != Val::Binary(Mod, x, y) {
                                continue;
                            }
                            if matches!(self.nodes[big], Val::Binary(Mul, u, v) if (u, v) == (y, s) || (u, v) == (s, y))
                            {
                                return Some(self.mul(x, s));
                            }
                        }
                    }
                }
            }
            Mod | Div if self.as_int(b).is_none() => {
                // (x * y + r) / y == x and (x * y + r) % y == r when r is an index known
                // to be below y (a thread index below its block extent).
                if let Val::Binary(Add, l, r) = self.nodes[a] {
                    for (m, rest) in [(l, r), (r, l)] {
                        let Val::Binary(Mul, m1, m2) = self.nodes[m] else { continue };
                        let x = if m2 == b {
                            m1
                        } else if m1 == b {
                            m2
                        } else {
                            continue;
                        };
                        let below =
                            matches!(self.nodes[rest], Val::Symbol(sym) if self.sym_bounds.get(&sym) == Some(&b));
                        if below {
                            return Some(if op == Div { x } else { rest });
                        }
                    }
                }
                if let Val::Symbol(sym) = self.nodes[a] {
                    if self.sym_bounds.get(&sym) == Some(&b) {
                        return Some(if op == Div { self.int(0) } else { a });
                    }
                }
            }
            Mod | Div => {
                let c = self.as_int(b)?;
                if c <= 0 {
                    return None;
                }
                let (lo, hi) = self.range(a);
                if lo >= 0 && hi.is_some_and(|h| h < c) {
                    return Some(if op == Mod { a } else { self.int(0) });
                }
                // (x * k + r) % (k * m) == (x % m) * k + r and (x * k + r) / (k * m) == x / m
                // when 0 <= r < k: a vector lane inside a wider tile.
                if let Val::Binary(Add, l, r) = self.nodes[a] {
                    for (mp, rest) in [(l, r), (r, l)] {
                        let Val::Binary(Mul, x, kk) = self.nodes[mp] else { continue };
                        let Some(k) = self.as_int(kk) else { continue };
                        let (rl, rh) = self.range(rest);
                        if k > 1 && c % k == 0 && c > k && rl >= 0 && rh.is_some_and(|h| h < k) && self.range(x).0 >= 0
                        {
                            let m = self.int(c / k);
                            return Some(if op == Mod {
                                let xm = self.rem(x, m);
                                let scaled = self.mul(xm, kk);
                                self.add(scaled, rest)
                            } else {
                                self.div(x, m)
                            });
                        }
                    }
                }
                // (m + y) % c == y % c and (m + y) / c == m / c + y / c when m is a known
                // multiple of c and both terms are non-negative (a flattened index plus a lane).
                if let Val::Binary(Add, l, r) = self.nodes[a] {
                    for (m, rest) in [(l, r), (r, l)] {
                        let km = self.known_multiple(m);
                        if km != 0 && km % c == 0 && self.range(m).0 >= 0 && self.range(rest).0 >= 0 {
                            let part = self.binary(op, rest, b);
                            return Some(if op == Mod {
                                part
                            } else {
                                let q = self.binary(Div, m, b);
                                self.add(q, part)
                            });
                        }
                    }
                }
                // (x * c + y) % c == y % c and (x * c + y) / c == x + y / c (non-negative terms).
                if let Val::Binary(Add, l, r) = self.nodes[a] {
                    for (m, rest) in [(l, r), (r, l)] {
                        if let Val::Binary(Mul, x, k) = self.nodes[m] {
                            if self.as_int(k) == Some(c) && self.range(rest).0 >= 0 && self.range(x).0 >= 0 {
                                let part = self.binary(op, rest, b);
                                return Some(if op == Mod { part } else { self.add(x, part) });
                            }
                        }
                    }
                }
            }
            // min(a, b) is a and max(a, b) is b when a's largest value is at most b's smallest
            // (a slice's `min(i2 - min(i2, 2), 0)` is the constant 0, an empty axis, not one
            // that may be a broadcast).
            Min | Max => {
                let ((al, ah), (bl, bh)) = (self.range(a), self.range(b));
                let (lo, hi) = if ah.is_some_and(|h| h <= bl) {
                    (a, b)
                } else if bh.is_some_and(|h| h <= al) {
                    (b, a)
                } else {
                    return None;
                };
                return Some(if op == Min { lo } else { hi });
            }
            // a <= b whenever a's largest value is at most b's smallest.
            Le => {
                let ((al, ah), (bl, _)) = (self.range(a), self.range(b));
                if al >= 0 && bl >= 0 && ah.is_some_and(|h| h <= bl) {
                    return Some(self.boolean(true));
                }
            }
            Lt => {
                if let Val::Symbol(sym) = self.nodes[a] {
                    if self.sym_bounds.get(&sym) == Some(&b) {
                        return Some(self.boolean(true));
                    }
                }
                // x % y < y always holds for y > 0.
                if let Val::Binary(Mod, _, y) = self.nodes[a] {
                    if y == b {
                        return Some(self.boolean(true));
                    }
                }
                // x / k < ceilDiv(n, k) when x < n: the tile of an index below n (a split's
                // bounds check of a position that is already in range).
                if let (Val::Binary(Div, x, k1), Val::Binary(CeilDiv, n, k2)) = (self.nodes[a], self.nodes[b]) {
                    let same_k = k1 == k2 || (self.as_int(k1).is_some() && self.as_int(k1) == self.as_int(k2));
                    // (Indices are non-negative: a remainder of one lies in [0, n).)
                    let below = match self.nodes[x] {
                        Val::Binary(Mod, i, y) => y == n && self.range(i).0 >= 0,
                        Val::Symbol(sym) => self.sym_bounds.get(&sym) == Some(&n),
                        _ => false,
                    };
                    if same_k && below && self.as_int(k1).is_some_and(|k| k > 0) {
                        return Some(self.boolean(true));
                    }
                }
                let ((al, ah), (bl, _)) = (self.range(a), self.range(b));
                if al >= 0 && ah.is_some_and(|h| h < bl) {
                    return Some(self.boolean(true));
                }
                // (A range below `b` never holds.)
                let bh = self.range(b).1;
                if bh.is_some_and(|h| al >= h && bl >= 0) {
                    return Some(self.boolean(false));
                }
                // x / y < z  <=>  x < y * z for non-negative x and positive y: no division.
                if let Val::Binary(Div, x, y) = self.nodes[a] {
                    if self.range(x).0 >= 0 && self.range(b).0 >= 0 {
                        let yz = self.mul(y, b);
                        return Some(self.binary(Lt, x, yz));
                    }
                }
            }
            _ => {}
        }
        None
    }

    /// A positive integer that `v` is known to be a multiple of (0 when `v` is zero).
    pub fn known_multiple(&self, v: ValId) -> i64 {
        fn gcd(a: i64, b: i64) -> i64 {
            if b == 0 {
                a.abs()
            } else {
                gcd(b, a % b)
            }
        }
        match self.nodes[v] {
            Val::Int(c) => c.abs(),
            Val::Binary(ScalarOp::Add | ScalarOp::Sub, a, b) => gcd(self.known_multiple(a), self.known_multiple(b)),
            Val::Binary(ScalarOp::Mul, a, b) => self.known_multiple(a).saturating_mul(self.known_multiple(b)),
            _ => 1,
        }
    }

    fn binary_with_const(&mut self, op: ScalarOp, x: ValId, c: i64) -> ValId {
        let c = self.int(c);
        self.binary(op, x, c)
    }

    /// `a + b`, simplified.
    pub fn add(&mut self, a: ValId, b: ValId) -> ValId {
        self.binary(ScalarOp::Add, a, b)
    }
    /// `a - b`, simplified.
    pub fn sub(&mut self, a: ValId, b: ValId) -> ValId {
        self.binary(ScalarOp::Sub, a, b)
    }
    /// `a * b`, simplified.
    pub fn mul(&mut self, a: ValId, b: ValId) -> ValId {
        self.binary(ScalarOp::Mul, a, b)
    }
    /// `a / b` (floor), simplified.
    pub fn div(&mut self, a: ValId, b: ValId) -> ValId {
        self.binary(ScalarOp::Div, a, b)
    }
    /// `a % b`, simplified.
    pub fn rem(&mut self, a: ValId, b: ValId) -> ValId {
        self.binary(ScalarOp::Mod, a, b)
    }
    /// `ceilDiv(a, b)`, simplified.
    pub fn ceil_div(&mut self, a: ValId, b: ValId) -> ValId {
        self.binary(ScalarOp::CeilDiv, a, b)
    }
    /// `min(a, b)`, simplified.
    pub fn min(&mut self, a: ValId, b: ValId) -> ValId {
        self.binary(ScalarOp::Min, a, b)
    }
    /// `max(a, b)`, simplified.
    pub fn max(&mut self, a: ValId, b: ValId) -> ValId {
        self.binary(ScalarOp::Max, a, b)
    }
    /// `a < b`, simplified.
    pub fn lt(&mut self, a: ValId, b: ValId) -> ValId {
        self.binary(ScalarOp::Lt, a, b)
    }
    /// Product of a list of values (1 for an empty list).
    pub fn product(&mut self, vals: impl IntoIterator<Item = ValId>) -> ValId {
        let one = self.int(1);
        vals.into_iter().fold(one, |acc, v| self.mul(acc, v))
    }

    /// `v` with every occurrence of `sym` replaced by `by`, simplified.
    pub fn substitute(&mut self, v: ValId, sym: Symbol, by: ValId) -> ValId {
        let mut memo: FxHashMap<ValId, ValId> = FxHashMap::default();
        self.substitute_memo(v, sym, by, &mut memo)
    }

    /// `v` with each symbol of `by` replaced by its value there, simplified; `memo` carries
    /// the rewritten nodes from one call to the next (many values, one substitution).
    pub fn substitute_all(
        &mut self,
        v: ValId,
        by: &FxHashMap<Symbol, ValId>,
        memo: &mut FxHashMap<ValId, ValId>,
    ) -> ValId {
        if let Some(&r) = memo.get(&v) {
            return r;
        }
        let r = match self.nodes[v] {
            Val::Symbol(s) => by.get(&s).copied().unwrap_or(v),
            Val::Binary(op, a, b) => {
                let (na, nb) = (self.substitute_all(a, by, memo), self.substitute_all(b, by, memo));
                if na == a && nb == b {
                    v
                } else {
                    self.binary(op, na, nb)
                }
            }
            _ => v,
        };
        memo.insert(v, r);
        r
    }

    fn substitute_memo(&mut self, v: ValId, sym: Symbol, by: ValId, memo: &mut FxHashMap<ValId, ValId>) -> ValId {
        if let Some(&r) = memo.get(&v) {
            return r;
        }
        let r = match self.nodes[v] {
            Val::Symbol(s) if s == sym => by,
            Val::Binary(op, a, b) => {
                let (na, nb) = (self.substitute_memo(a, sym, by, memo), self.substitute_memo(b, sym, by, memo));
                if na == a && nb == b {
                    v
                } else {
                    self.binary(op, na, nb)
                }
            }
            _ => v,
        };
        memo.insert(v, r);
        r
    }

    /// Inclusive bounds of the integer or boolean expression `v` when each symbol lies in
    /// the bounds `env` gives it (`i64::MAX` as an upper bound: unbounded); None where a
    /// symbol has none or an op's result cannot be bounded (a division by a range holding
    /// zero, a float). A comparison that holds (fails) everywhere is `(1, 1)` (`(0, 0)`).
    pub fn interval(&self, v: ValId, env: &dyn Fn(Symbol) -> Option<(i64, i64)>) -> Option<(i64, i64)> {
        let mut memo = FxHashMap::default();
        self.interval_memo(v, env, &mut memo)
    }

    fn interval_memo(
        &self,
        v: ValId,
        env: &dyn Fn(Symbol) -> Option<(i64, i64)>,
        memo: &mut FxHashMap<ValId, Option<(i64, i64)>>,
    ) -> Option<(i64, i64)> {
        if let Some(&r) = memo.get(&v) {
            return r;
        }
        let r = match self.nodes[v] {
            Val::Int(i) => Some((i, i)),
            Val::Bool(b) => Some((b as i64, b as i64)),
            Val::Float(_) => None,
            Val::Symbol(s) => env(s),
            Val::Binary(op, a, b) => {
                let x = self.interval_memo(a, env, memo);
                let y = self.interval_memo(b, env, memo);
                x.zip(y).and_then(|(x, y)| bounds_of(op, x, y))
            }
        };
        memo.insert(v, r);
        r
    }

    /// Evaluate `v` given values for its symbols.
    pub fn eval(&self, v: ValId, env: &dyn Fn(Symbol) -> Option<i64>) -> Result<i64> {
        // Most expressions are small trees, evaluated fastest without a memo. A DAG that
        // shares its nodes (a size sliced again and again) is a tree exponential in its
        // depth: past this many visits each node is evaluated once.
        let mut budget = 4096u32;
        match self.eval_within(v, env, &mut budget) {
            Some(r) => r,
            None => self.eval_memo(v, env, &mut FxHashMap::default()),
        }
    }

    /// [`Scalars::eval`] as a tree walk, or None once it has visited `budget` nodes.
    fn eval_within(&self, v: ValId, env: &dyn Fn(Symbol) -> Option<i64>, budget: &mut u32) -> Option<Result<i64>> {
        *budget = budget.checked_sub(1)?;
        Some(match self.nodes[v] {
            Val::Binary(op, a, b) => {
                let x = match self.eval_within(a, env, budget)? {
                    Ok(x) => x,
                    e => return Some(e),
                };
                let y = match self.eval_within(b, env, budget)? {
                    Ok(y) => y,
                    e => return Some(e),
                };
                self.apply_or_explain(v, op, x, y)
            }
            _ => self.eval_leaf(v, env),
        })
    }

    /// [`Scalars::eval`] with each node evaluated once.
    fn eval_memo(
        &self,
        v: ValId,
        env: &dyn Fn(Symbol) -> Option<i64>,
        memo: &mut FxHashMap<ValId, i64>,
    ) -> Result<i64> {
        if let Some(&r) = memo.get(&v) {
            return Ok(r);
        }
        let r = match self.nodes[v] {
            Val::Binary(op, a, b) => {
                let (x, y) = (self.eval_memo(a, env, memo)?, self.eval_memo(b, env, memo)?);
                self.apply_or_explain(v, op, x, y)?
            }
            _ => self.eval_leaf(v, env)?,
        };
        memo.insert(v, r);
        Ok(r)
    }

    fn eval_leaf(&self, v: ValId, env: &dyn Fn(Symbol) -> Option<i64>) -> Result<i64> {
        match self.nodes[v] {
            Val::Int(i) => Ok(i),
            Val::Bool(b) => Ok(b as i64),
            Val::Float(bits) => Ok(f64::from_bits(bits) as i64),
            Val::Symbol(s) => env(s).ok_or_else(|| KilnError::value(format!("no value bound for {}", self.render(v)))),
            Val::Binary(..) => crate::bail_internal!("eval_leaf of a binary node"),
        }
    }

    fn apply_or_explain(&self, v: ValId, op: ScalarOp, x: i64, y: i64) -> Result<i64> {
        op.apply(x, y).ok_or_else(|| {
            let why = if y == 0 && matches!(op, ScalarOp::Div | ScalarOp::Mod | ScalarOp::CeilDiv) {
                "divide by zero"
            } else {
                "overflow 64 bits"
            };
            KilnError::value(format!("cannot evaluate {}: {x} and {y} {why}", self.render(v)))
        })
    }

    /// Render `v` as readable text (`ceilDiv(i0, 128)`, `i1 * 4`).
    pub fn render(&self, v: ValId) -> String {
        let mut out = String::new();
        self.render_into(v, 0, &mut out);
        out
    }

    fn render_into(&self, v: ValId, parent_prec: u8, out: &mut String) {
        // A DAG that shares its nodes prints as a tree, exponential in its depth (a size
        // sliced again and again): the text stops here, every open operand left at once.
        if out.len() > RENDER_CHARS {
            if !out.ends_with('…') {
                out.push('…');
            }
            return;
        }
        match self.nodes[v] {
            Val::Int(i) => {
                let _ = write!(out, "{i}");
            }
            Val::Float(bits) => {
                let _ = write!(out, "{:?}", f64::from_bits(bits));
            }
            Val::Bool(b) => {
                let _ = write!(out, "{b}");
            }
            Val::Symbol(s) => render_symbol(s, out),
            Val::Binary(op, a, b) => match op.infix() {
                Some(sym) => {
                    let prec = op.precedence();
                    let paren = prec < parent_prec;
                    if paren {
                        out.push('(');
                    }
                    self.render_into(a, prec, out);
                    let _ = write!(out, " {sym} ");
                    // Right operand binds tighter so `a - (b - c)` keeps its parentheses.
                    self.render_into(b, prec + 1, out);
                    if paren {
                        out.push(')');
                    }
                }
                None => {
                    let name = match op {
                        ScalarOp::CeilDiv => "ceilDiv",
                        ScalarOp::Min => "min",
                        _ => "max",
                    };
                    let _ = write!(out, "{name}(");
                    self.render_into(a, 0, out);
                    out.push_str(", ");
                    self.render_into(b, 0, out);
                    out.push(')');
                }
            },
        }
    }
}

/// Bounds of `x op y` for operands within bounds `x` and `y` (see [`Scalars::interval`]).
fn bounds_of(op: ScalarOp, (xl, xh): (i64, i64), (yl, yh): (i64, i64)) -> Option<(i64, i64)> {
    use ScalarOp::*;
    let truth = |always: bool, never: bool| {
        Some(if always {
            (1, 1)
        } else if never {
            (0, 0)
        } else {
            (0, 1)
        })
    };
    match op {
        Add => Some((xl.saturating_add(yl), xh.saturating_add(yh))),
        Sub => Some((xl.saturating_sub(yh), xh.saturating_sub(yl))),
        Mul => {
            let p = [xl.saturating_mul(yl), xl.saturating_mul(yh), xh.saturating_mul(yl), xh.saturating_mul(yh)];
            Some((*p.iter().min()?, *p.iter().max()?))
        }
        // Sizes and positions: non-negative over positive divisors only.
        Div if xl >= 0 && yl > 0 => Some((xl / yh, xh / yl)),
        CeilDiv if xl >= 0 && yl > 0 => Some((xl / yh + i64::from(xl % yh != 0), xh / yl + i64::from(xh % yl != 0))),
        Mod if xl >= 0 && yl > 0 => Some(if xh < yl { (xl, xh) } else { (0, yh - 1) }),
        Min => Some((xl.min(yl), xh.min(yh))),
        Max => Some((xl.max(yl), xh.max(yh))),
        Lt => truth(xh < yl, xl >= yh),
        Le => truth(xh <= yl, xl > yh),
        Eq => truth(xl == xh && yl == yh && xl == yl, xh < yl || yh < xl),
        And => truth(xl >= 1 && yl >= 1, xh <= 0 || yh <= 0),
        _ => None,
    }
}

/// Text of a symbol as it appears in dumps and generated code.
pub fn render_symbol(s: Symbol, out: &mut String) {
    let _ = match s {
        Symbol::Extent(n) => write!(out, "i{n}"),
        Symbol::Stride(tv, axis) => write!(out, "T{}.stride[{axis}]", tv.as_u32()),
        Symbol::ScalarInput(n) => write!(out, "s{n}"),
        Symbol::LoopIndex(n) => write!(out, "idx{n}"),
        Symbol::ParallelIndex(p) => write!(out, "{}", parallel_index_name(p)),
        Symbol::ParallelDim(p) => write!(out, "{}", parallel_dim_name(p)),
        Symbol::Gathered(n) => write!(out, "g{n}"),
        Symbol::GridDone(tv) => write!(out, "done(T{})", tv.as_u32()),
        Symbol::OutAxis(k) => write!(out, "o{k}"),
    };
}

/// CUDA name of the index of a thread/block parallel type.
pub fn parallel_index_name(p: ParallelType) -> &'static str {
    match p {
        ParallelType::BIDx => "blockIdx.x",
        ParallelType::BIDy => "blockIdx.y",
        ParallelType::BIDz => "blockIdx.z",
        ParallelType::TIDx => "threadIdx.x",
        ParallelType::TIDy => "threadIdx.y",
        ParallelType::TIDz => "threadIdx.z",
        _ => "0",
    }
}

/// CUDA name of the extent of a thread/block parallel type.
pub fn parallel_dim_name(p: ParallelType) -> &'static str {
    match p {
        ParallelType::BIDx => "gridDim.x",
        ParallelType::BIDy => "gridDim.y",
        ParallelType::BIDz => "gridDim.z",
        ParallelType::TIDx => "blockDim.x",
        ParallelType::TIDy => "blockDim.y",
        ParallelType::TIDz => "blockDim.z",
        _ => "1",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_ops_truncate_like_c() {
        // The generated C's `/` and `%` truncate toward zero; folding and the interpreter agree.
        assert_eq!(ScalarOp::Div.apply(-7, 2), Some(-3));
        assert_eq!(ScalarOp::Mod.apply(-7, 2), Some(-1));
        assert_eq!(ScalarOp::Mod.apply(7, -2), Some(1));
        assert_eq!(ScalarOp::CeilDiv.apply(7, 2), Some(4));
        assert_eq!(ScalarOp::Div.apply(1, 0), None);
        assert_eq!(ScalarOp::Add.apply(i64::MAX, 1), None);
        assert_eq!(ScalarOp::Add.apply_wrapping(i64::MAX, 1), Some(i64::MIN));
        assert_eq!(ScalarOp::Div.apply_wrapping(i64::MIN, -1), Some(i64::MIN));
        let mut s = Scalars::new();
        let (a, b) = (s.int(-7), s.int(2));
        let q = s.binary(ScalarOp::Div, a, b);
        assert_eq!(s.as_int(q), Some(-3));
    }

    #[test]
    fn constants_fold_and_dedup() {
        let mut s = Scalars::new();
        let a = s.int(6);
        let b = s.int(4);
        let c = s.ceil_div(a, b);
        assert_eq!(s.as_int(c), Some(2));
        let d = s.mul(a, b);
        assert_eq!(s.as_int(d), Some(24));
        assert_eq!(s.int(24), d, "constants are hash-consed");
    }

    #[test]
    fn identities_simplify() {
        let mut s = Scalars::new();
        let x = s.symbol(Symbol::Extent(0));
        let one = s.int(1);
        let zero = s.int(0);
        assert_eq!(s.mul(x, one), x);
        assert_eq!(s.mul(one, x), x);
        assert_eq!(s.add(x, zero), x);
        assert_eq!(s.add(zero, x), x);
        assert_eq!(s.sub(x, zero), x);
        assert_eq!(s.ceil_div(x, one), x);
        let m0 = s.mul(x, zero);
        assert!(s.is_const(m0, 0));
        let d = s.sub(x, x);
        assert!(s.is_const(d, 0));
    }

    #[test]
    fn intervals_bound_every_value_the_symbols_can_take() {
        // A cat's guard on position o (in [0, 2]) of a part at offset n (in [1, 3]):
        // checked against every value of o and n by evaluation.
        let mut s = Scalars::new();
        let o = s.symbol(Symbol::OutAxis(0));
        let n = s.symbol(Symbol::Extent(0));
        let one = s.int(1);
        let shifted = s.add(o, one);
        let lt = s.lt(shifted, n);
        let le = s.binary(ScalarOp::Le, n, o);
        let both = s.binary(ScalarOp::And, lt, le);
        let prod = s.mul(o, n);
        let low = s.min(prod, n);
        let diff = s.sub(low, o);
        let q = s.div(prod, n);
        let env = |sym: Symbol| match sym {
            Symbol::OutAxis(_) => Some((0, 2)),
            _ => Some((1, 3)),
        };
        for v in [lt, le, both, prod, low, diff, q] {
            let (lo, hi) = s.interval(v, &env).expect("bounded");
            for a in 0..=2 {
                for b in 1..=3 {
                    let x = s.eval(v, &|sym| Some(if matches!(sym, Symbol::OutAxis(_)) { a } else { b })).unwrap();
                    assert!(lo <= x && x <= hi, "{} = {x} outside [{lo}, {hi}]", s.render(v));
                }
            }
        }
        // Decided where the bounds tell: o + 1 < n + 3 always holds, n + 3 <= o never does.
        let three = s.int(3);
        let n3 = s.add(n, three);
        let always = s.lt(shifted, n3);
        let never = s.binary(ScalarOp::Le, n3, o);
        assert_eq!(s.interval(always, &env), Some((1, 1)));
        assert_eq!(s.interval(never, &env), Some((0, 0)));
        // A symbol without bounds leaves the expression unbounded.
        assert_eq!(s.interval(lt, &|_| None), None);
    }

    #[test]
    fn constants_move_into_min_and_max() {
        let mut s = Scalars::new();
        let x = s.symbol(Symbol::Extent(0));
        let two = s.int(2);
        let xp2 = s.add(x, two);
        let c26 = s.int(26);
        let m = s.min(xp2, c26);
        let sliced = s.sub(m, two);
        let c24 = s.int(24);
        assert_eq!(sliced, s.min(x, c24), "min(x + 2, 26) - 2 is min(x, 24)");
        let c5 = s.int(5);
        let mx = s.max(c26, xp2);
        let up = s.add(mx, c5);
        assert_eq!(s.render(up), "max(x0 + 7, 31)".replace("x0", &s.render(x)));
        // A constant that would leave x with a negative offset stays outside.
        let three = s.int(3);
        let down = s.sub(m, three);
        assert_eq!(s.range(down), (-1, Some(23)));
        for v in 0..40 {
            let env = |_: Symbol| Some(v);
            assert_eq!(s.eval(sliced, &env).unwrap(), v.min(24));
            assert_eq!(s.eval(up, &env).unwrap(), (v + 2).max(26) + 5);
            assert_eq!(s.eval(down, &env).unwrap(), (v + 2).min(26) - 3);
        }
    }

    #[test]
    fn split_bound_of_an_index_already_in_range_is_true() {
        // (b % n) / k < ceilDiv(n, k): the bounds check of a split of a position below n.
        let mut s = Scalars::new();
        let b = s.symbol(Symbol::Extent(1));
        let n = s.symbol(Symbol::Extent(0));
        let four = s.int(4);
        let r = s.rem(b, n);
        let q = s.div(r, four);
        let e = s.ceil_div(n, four);
        let c = s.lt(q, e);
        assert!(matches!(s.get(c), Val::Bool(true)), "{}", s.render(c));
        // Not for another divisor, nor for an index that may reach n.
        let eight = s.int(8);
        let e8 = s.ceil_div(n, eight);
        let c8 = s.lt(q, e8);
        assert!(!matches!(s.get(c8), Val::Bool(true)));
        let q2 = s.div(b, four);
        let c2 = s.lt(q2, e);
        assert!(!matches!(s.get(c2), Val::Bool(true)));
    }

    #[test]
    fn constants_reassociate() {
        let mut s = Scalars::new();
        let x = s.symbol(Symbol::Extent(0));
        let four = s.int(4);
        let eight = s.int(8);
        let a = s.mul(x, four);
        let b = s.mul(a, eight);
        assert_eq!(s.render(b), "i0 * 32");
        let c1 = s.ceil_div(x, four);
        let c2 = s.ceil_div(c1, eight);
        assert_eq!(s.render(c2), "ceilDiv(i0, 32)");
        // merge(i0, 4) split by 4 gives back i0.
        assert_eq!(s.ceil_div(a, four), x);
        assert_eq!(s.mul(four, x), a, "commutative ops are canonicalised");
    }

    #[test]
    fn offsets_of_one_value_compare_by_their_constants() {
        let mut s = Scalars::new();
        let x = s.symbol(Symbol::Extent(0));
        let (one, two) = (s.int(1), s.int(2));
        let xm1 = s.sub(x, one);
        let xp2 = s.add(x, two);
        assert_eq!(s.min(xm1, x), xm1, "min(x - 1, x) == x - 1");
        assert_eq!(s.max(x, xp2), xp2, "max(x, x + 2) == x + 2");
        let m = s.min(xm1, x);
        let len = s.sub(x, m);
        assert_eq!(s.as_int(len), Some(1), "x - min(x - 1, x) == 1");
        let d = s.sub(xm1, xp2);
        assert_eq!(s.as_int(d), Some(-3), "(x - 1) - (x + 2) == -3");
        let xm2 = s.sub(x, two);
        assert_eq!(s.add(xm2, one), xm1, "(x - 2) + 1 == x - 1");
        let xm3 = s.sub(xm1, two);
        assert_eq!(s.render(xm3), "i0 - 3", "(x - 1) - 2 == x - 3");
    }

    #[test]
    fn render_uses_parentheses_only_when_needed() {
        let mut s = Scalars::new();
        let x = s.symbol(Symbol::Extent(0));
        let y = s.symbol(Symbol::Extent(1));
        let z = s.symbol(Symbol::Extent(2));
        let sum = s.add(x, y);
        let prod = s.mul(sum, z);
        assert_eq!(s.render(prod), "(i0 + i1) * i2");
        let p2 = s.mul(x, y);
        let sum2 = s.add(p2, z);
        assert_eq!(s.render(sum2), "i0 * i1 + i2");
        let d = s.sub(y, z);
        let d2 = s.sub(x, d);
        assert_eq!(s.render(d2), "i0 - (i1 - i2)");
    }

    #[test]
    fn div_mod_identities_and_ranges() {
        let mut s = Scalars::new();
        let x = s.symbol(Symbol::Extent(0));
        let n = s.symbol(Symbol::Extent(1));
        let q = s.div(x, n);
        let qn = s.mul(q, n);
        let r = s.rem(x, n);
        assert_eq!(s.add(qn, r), x, "(x / n) * n + x % n == x");
        let v = Symbol::LoopIndex(0);
        s.set_bound(v, 4);
        let vi = s.symbol(v);
        let four = s.int(4);
        let x4 = s.mul(x, four);
        let m = s.add(x4, vi);
        assert_eq!(s.rem(m, four), vi, "(x * 4 + v) % 4 == v for v < 4");
        assert_eq!(s.div(m, four), x, "(x * 4 + v) / 4 == x for v < 4");
        let lt = s.lt(r, n);
        assert_eq!(s.as_int(lt), Some(1), "x % n < n");
        let d = s.div(m, n);
        let c = s.lt(d, x);
        assert_eq!(s.render(c), "i0 * 4 + idx0 < i1 * i0");
    }

    #[test]
    fn merged_row_offsets_fold_through_strides() {
        // Row r of a row-major [B, H, S, 512] at strides (H * S * 512, S * 512, 512): the
        // indices (r / S) / H, (r / S) % H and r % S give back r * 512.
        let mut s = Scalars::new();
        let r = s.symbol(Symbol::LoopIndex(0));
        let (h, sl) = (s.symbol(Symbol::Extent(1)), s.symbol(Symbol::Extent(2)));
        let c = s.int(512);
        let s2 = c;
        let s1 = s.mul(sl, s2);
        let s0 = s.mul(s1, h);
        let q = s.div(r, sl);
        let (b, hh, ss) = (s.div(q, h), s.rem(q, h), s.rem(r, sl));
        let terms = [s.mul(b, s0), s.mul(hh, s1), s.mul(ss, s2)];
        let off = terms.into_iter().fold(s.int(0), |acc, t| s.add(acc, t));
        let want = s.mul(r, c);
        assert_eq!(off, want, "{}", s.render(off));
        // Other strides do not fold: a padded row (stride 520 per S row) keeps its divisions.
        let pad = s.int(520);
        let p1 = s.mul(sl, pad);
        let t0 = s.mul(hh, p1);
        let t1 = s.mul(ss, c);
        let off = s.add(t0, t1);
        assert!(s.render(off).contains('%'), "{}", s.render(off));
    }

    #[test]
    fn vector_lanes_inside_wider_tiles() {
        let mut s = Scalars::new();
        let t = s.symbol(Symbol::Extent(0));
        let v = Symbol::LoopIndex(0);
        s.set_bound(v, 4);
        let vi = s.symbol(v);
        let four = s.int(4);
        let tile = s.int(32);
        let t4 = s.mul(t, four);
        let m = s.add(t4, vi);
        let r = s.rem(m, tile);
        assert_eq!(s.render(r), "i0 % 8 * 4 + idx0");
        let d = s.div(m, tile);
        assert_eq!(s.render(d), "i0 / 8");
        // Checked by evaluation for every lane and a few t.
        for tv in 0..20 {
            for lane in 0..4 {
                let env = |sym: Symbol| match sym {
                    Symbol::Extent(0) => Some(tv),
                    Symbol::LoopIndex(0) => Some(lane),
                    _ => None,
                };
                let full = tv * 4 + lane;
                assert_eq!(s.eval(r, &env).unwrap(), full % 32);
                assert_eq!(s.eval(d, &env).unwrap(), full / 32);
            }
        }
    }

    /// A random integer expression over three sizes, as a plain tree.
    #[derive(Clone)]
    enum Tree {
        Leaf(i64),
        Sym(u32),
        Node(ScalarOp, Box<Tree>, Box<Tree>),
    }

    /// Its value at `env` by the ops' C semantics alone, or None where an operand of a
    /// division leaves the non-negative values index math uses, or the value overflows.
    fn naive(t: &Tree, env: &[i64; 3]) -> Option<i64> {
        match t {
            Tree::Leaf(c) => Some(*c),
            Tree::Sym(n) => Some(env[*n as usize]),
            Tree::Node(op, a, b) => {
                let (x, y) = (naive(a, env)?, naive(b, env)?);
                if matches!(op, ScalarOp::Div | ScalarOp::Mod | ScalarOp::CeilDiv) && (x < 0 || y <= 0) {
                    return None;
                }
                op.apply(x, y).filter(|r| r.abs() < 1 << 40)
            }
        }
    }

    fn build(s: &mut Scalars, t: &Tree) -> ValId {
        match t {
            Tree::Leaf(c) => s.int(*c),
            Tree::Sym(n) => s.symbol(Symbol::Extent(*n)),
            Tree::Node(op, a, b) => {
                let (x, y) = (build(s, a), build(s, b));
                s.binary(*op, x, y)
            }
        }
    }

    #[test]
    fn simplification_keeps_the_value_of_random_index_expressions() {
        // Every rewrite `binary` applies (like terms, re-association, div/mod identities,
        // ranges) must keep the value wherever the unsimplified expression is defined.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let ops = [
            ScalarOp::Add,
            ScalarOp::Sub,
            ScalarOp::Mul,
            ScalarOp::Div,
            ScalarOp::Mod,
            ScalarOp::CeilDiv,
            ScalarOp::Min,
            ScalarOp::Max,
        ];
        fn gen(next: &mut dyn FnMut(u64) -> u64, ops: &[ScalarOp], depth: u32, pool: &mut Vec<Tree>) -> Tree {
            // Reuse an earlier subtree now and then: like terms and shared operands are
            // what the rewrites look for.
            if !pool.is_empty() && next(4) == 0 {
                return pool[next(pool.len() as u64) as usize].clone();
            }
            let t = if depth == 0 || next(3) == 0 {
                if next(2) == 0 {
                    Tree::Leaf(next(9) as i64 - 2)
                } else {
                    Tree::Sym(next(3) as u32)
                }
            } else {
                let op = ops[next(ops.len() as u64) as usize];
                let a = gen(next, ops, depth - 1, pool);
                let b = gen(next, ops, depth - 1, pool);
                Tree::Node(op, Box::new(a), Box::new(b))
            };
            pool.push(t.clone());
            t
        }
        let mut checked = 0;
        for _ in 0..4000 {
            let mut pool = Vec::new();
            let t = gen(&mut next, &ops, 5, &mut pool);
            let mut s = Scalars::new();
            let v = build(&mut s, &t);
            for _ in 0..6 {
                let env = [next(9) as i64, next(40) as i64, next(300) as i64];
                let Some(want) = naive(&t, &env) else { continue };
                let got = s.eval(v, &|sym| match sym {
                    Symbol::Extent(n) => Some(env[n as usize]),
                    _ => None,
                });
                assert_eq!(got.ok(), Some(want), "{} at {env:?}", s.render(v));
                checked += 1;
            }
        }
        assert!(checked > 5000, "only {checked} defined samples");
    }

    #[test]
    fn eval_binds_symbols() {
        let mut s = Scalars::new();
        let x = s.symbol(Symbol::Extent(0));
        let k = s.int(128);
        let c = s.ceil_div(x, k);
        let env = |sym: Symbol| match sym {
            Symbol::Extent(0) => Some(1000),
            _ => None,
        };
        assert_eq!(s.eval(c, &env).unwrap(), 8);
        let y = s.symbol(Symbol::Extent(1));
        assert!(s.eval(y, &env).is_err());
        let zero = s.int(0);
        let bad = s.binary(ScalarOp::CeilDiv, x, zero);
        assert!(s.eval(bad, &env).is_err(), "division by zero is an error, not a panic");
    }
}
