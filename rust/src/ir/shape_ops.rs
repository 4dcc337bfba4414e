//! Shape ops built on [`Op::Remap`]: reshape, slice, pad and cat read their input at
//! positions computed from the output's positions, so one remap (a chain of them composes
//! into one) reads a fusion input directly, in the kernel of its consumers. Pad and cat
//! choose between their sources with masks of `iota` positions, which fuse like any
//! element-wise operand. triu and take_along_axis are here too: they select by position.

use smallvec::smallvec;

use crate::error::Result;
use crate::ir::scalar::ScalarOp;
use crate::ir::{DataType, Fusion, IterType, MemoryType, Op, Operand, Symbol, TvId, ValId};
use crate::{bail, bail_type};

/// A runtime condition on sizes and scalars that the definition needs (reshape's element
/// counts, cat's kept axes, select's index); `host::bind` checks each before anything runs.
#[derive(Clone, Debug)]
pub struct SizeCheck {
    /// Must evaluate to true (nonzero).
    pub holds: ValId,
    /// The values the message shows when it fails.
    pub values: Vec<ValId>,
    /// What must hold, naming the tensors and axes (`"reshape of T0 ..."`).
    pub what: String,
}

/// Offset that moves a remap's own output symbols out of the way while composing.
const SHIFT: u32 = 1 << 20;

impl Fusion {
    /// `x` read at `index[j]` along input axis `j` (expressions of `Symbol::OutAxis(k)`)
    /// where `valid` holds, 0 elsewhere; the output has `extents`. A remap of a remap reads
    /// the first one's input through both maps.
    pub fn remap(
        &mut self,
        x: TvId,
        name: &'static str,
        extents: &[ValId],
        index: Vec<ValId>,
        valid: Option<ValId>,
    ) -> Result<TvId> {
        let rank = self.no_reduction_logical(x).len();
        if index.len() != rank {
            crate::bail_internal!("{name}: {} positions for {} axes of {}", index.len(), rank, self.tv_name(x));
        }
        let (mut src, mut index, mut valid) = (x, index, valid);
        if let Some(d) = self.tvs[x].definition {
            if let (Op::Remap { index: inner, valid: inner_valid, .. }, Some(y)) =
                (self.exprs[d].op.clone(), self.exprs[d].inputs.first().and_then(|o| o.tensor()))
            {
                let composed: Vec<ValId> = inner.iter().map(|&v| self.compose(v, &index)).collect();
                if let Some(iv) = inner_valid {
                    let iv = self.compose(iv, &index);
                    valid = Some(match valid {
                        Some(v) => self.scalars.binary(ScalarOp::And, v, iv),
                        None => iv,
                    });
                }
                (src, index) = (y, composed);
            }
        }
        let mut logical = Vec::with_capacity(extents.len());
        for &e in extents {
            let it = if self.scalars.as_int(e) == Some(1) { IterType::Broadcast } else { IterType::Iteration };
            logical.push(self.new_id(e, it));
        }
        let dt = self.tvs[src].dtype;
        let out = self.new_tv(dt, MemoryType::Local, logical);
        if valid.is_some_and(|v| self.scalars.as_int(v) == Some(1)) {
            valid = None;
        }
        self.add_expr(Op::Remap { name, index, valid }, smallvec![Operand::Tensor(src)], out);
        Ok(out)
    }

    /// `v` (an expression of a remap's output positions) at the positions `outer` gives
    /// for them.
    pub(crate) fn compose(&mut self, v: ValId, outer: &[ValId]) -> ValId {
        let mut r = v;
        for k in 0..outer.len() as u32 {
            let tmp = self.scalars.symbol(Symbol::OutAxis(k + SHIFT));
            r = self.scalars.substitute(r, Symbol::OutAxis(k), tmp);
        }
        for (k, &by) in outer.iter().enumerate() {
            r = self.scalars.substitute(r, Symbol::OutAxis(k as u32 + SHIFT), by);
        }
        r
    }

    /// Refuse a position or size that is not an integer scalar.
    fn integer_scalars(&self, what: &str, vals: impl IntoIterator<Item = ValId>) -> Result<()> {
        for v in vals {
            let dt = self.scalars.dtype(v, &self.scalar_input_dtypes);
            if !dt.is_integer() {
                bail_type!(
                    "{what}: {} has dtype {dt}; positions and sizes must be Int scalars",
                    self.scalars.render(v)
                );
            }
        }
        Ok(())
    }

    /// Check `a == b` when the inputs are bound.
    fn require_equal(&mut self, a: ValId, b: ValId, what: String) {
        let holds = self.scalars.binary(ScalarOp::Eq, a, b);
        self.size_checks.push(SizeCheck { holds, values: vec![a, b], what });
    }

    /// `x` at position `index` of axis `dim`, that axis removed (nvFuser's select).
    pub fn select(&mut self, x: TvId, dim: i64, index: ValId) -> Result<TvId> {
        let ins = self.extents_of(x);
        let rank = ins.len();
        let d = self.normalize_dims("select", x, &[dim], rank)?[0];
        if !self.scalars.dtype(index, &self.scalar_input_dtypes).is_integer() {
            bail_type!("select: the index {} is not an integer", self.scalars.render(index));
        }
        let given = index;
        let index = self.wrap_index(index, ins[d]);
        let zero = self.scalars.int(0);
        let low = self.scalars.binary(ScalarOp::Le, zero, index);
        let high = self.scalars.lt(index, ins[d]);
        let holds = self.scalars.binary(ScalarOp::And, low, high);
        match self.scalars.as_int(holds) {
            Some(0) => bail!(
                "select: index {} is out of range for axis {d} of {} (size {}); expected an index in [-size, size)",
                self.scalars.render(given),
                self.tv_name(x),
                self.scalars.render(ins[d])
            ),
            Some(_) => {}
            None => {
                let what = format!("select: the index must lie in [-size, size) of axis {d} of {}", self.tv_name(x));
                self.size_checks.push(SizeCheck { holds, values: vec![given, ins[d]], what });
            }
        }
        let mut extents = Vec::with_capacity(rank - 1);
        let mut at = Vec::with_capacity(rank);
        for (a, &n) in ins.iter().enumerate() {
            if a == d {
                at.push(index);
            } else {
                at.push(self.out_axis(extents.len()));
                extents.push(n);
            }
        }
        self.remap(x, "select", &extents, at, None)
    }

    fn out_axis(&mut self, k: usize) -> ValId {
        self.scalars.symbol(Symbol::OutAxis(k as u32))
    }

    /// Extents of `x`'s axes (without reduced ones).
    /// The sizes of `x`'s axes (reduced axes left out).
    pub(crate) fn extents_of(&self, x: TvId) -> Vec<ValId> {
        self.no_reduction_logical(x).iter().map(|&id| self.ids[id].extent).collect()
    }

    /// Requires `x`'s sizes to be `sizes` (what `op` was told `x`'s shape is, as nvFuser's
    /// `reshape(x, original_shape, new_shape)` is): refused now where both are known, else
    /// checked before a kernel runs.
    /// A `None` size (-1) is not checked.
    pub fn require_shape(&mut self, x: TvId, sizes: &[Option<ValId>], op: &str) -> Result<()> {
        let ins = self.extents_of(x);
        let told = sizes
            .iter()
            .map(|v| v.map_or_else(|| "-1".into(), |v| self.scalars.render(v)))
            .collect::<Vec<_>>()
            .join(", ");
        if ins.len() != sizes.len() {
            bail!("{op}: [{told}] has {} entries but {} has rank {}", sizes.len(), self.tv_name(x), ins.len());
        }
        for (axis, (&have, want)) in ins.iter().zip(sizes).enumerate() {
            let Some(want) = *want else { continue };
            match (self.scalars.as_int(have), self.scalars.as_int(want)) {
                (Some(a), Some(b)) if a != b => bail!(
                    "{op}: [{told}] gives axis {axis} of {} size {b}, but that axis has size {a}",
                    self.tv_name(x)
                ),
                (Some(_), Some(_)) => {}
                _ if have == want => {}
                _ => {
                    let what = format!("{op}: [{told}] must be the shape of {}, axis {axis} differs", self.tv_name(x));
                    self.require_equal(have, want, what);
                }
            }
        }
        Ok(())
    }

    /// `x` with the same elements in row-major order and the shape `shape` (`None`: the
    /// one size inferred from the others).
    pub fn reshape(&mut self, x: TvId, shape: &[Option<ValId>]) -> Result<TvId> {
        self.integer_scalars("reshape", shape.iter().flatten().copied())?;
        for (k, s) in shape.iter().enumerate() {
            if let Some(n) = s.and_then(|v| self.scalars.as_int(v)) {
                if n < 0 {
                    bail!(
                        "reshape of {}: size {n} at position {k} is negative; expected a size >= 0 or -1",
                        self.tv_name(x)
                    );
                }
            }
        }
        let ins = self.extents_of(x);
        let inferred: Vec<usize> = (0..shape.len()).filter(|&k| shape[k].is_none()).collect();
        if inferred.len() > 1 {
            bail!("reshape of {}: only one size may be -1, got {} of them", self.tv_name(x), inferred.len());
        }
        let mut outs: Vec<ValId> = Vec::with_capacity(shape.len());
        if let Some(&k) = inferred.first() {
            // numel / (the known sizes), with the factors both sides share cancelled, so
            // `[B, S, H*D] -> [B, S, -1, D]` infers `H*D / D` rather than a quotient of
            // two products.
            let mut num: Vec<ValId> = ins.clone();
            let mut den: Vec<ValId> = Vec::new();
            for s in shape.iter().flatten() {
                match num.iter().position(|n| n == s) {
                    Some(p) => {
                        num.remove(p);
                    }
                    None => den.push(*s),
                }
            }
            let (n, d) = (self.scalars.product(num), self.scalars.product(den));
            if self.scalars.as_int(d).is_none_or(|v| v == 0) {
                // numel / 0 is no size: NumPy and torch refuse the -1 then too.
                let zero = self.scalars.int(0);
                let holds = self.scalars.lt(zero, d);
                let what = format!(
                    "reshape of {} to [{}]: -1 at position {k} cannot be inferred when the other sizes multiply to 0",
                    self.tv_name(x),
                    shape
                        .iter()
                        .map(|s| s.map_or_else(|| "-1".to_string(), |v| self.scalars.render(v)))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                self.size_checks.push(SizeCheck { holds, values: vec![d], what });
            }
            let size = self.scalars.div(n, d);
            for (j, s) in shape.iter().enumerate() {
                outs.push(if j == k { size } else { s.expect("only one inferred size") });
            }
        } else {
            outs = shape.iter().map(|s| s.expect("no inferred size")).collect();
        }
        let (numel_in, numel_out) = (self.scalars.product(ins.clone()), self.scalars.product(outs.clone()));
        if let (Some(a), Some(b)) = (self.scalars.as_int(numel_in), self.scalars.as_int(numel_out)) {
            if a != b {
                bail!(
                    "reshape of {}: it has {a} elements but the shape [{}] has {b}",
                    self.tv_name(x),
                    outs.iter().map(|&v| self.scalars.render(v)).collect::<Vec<_>>().join(", ")
                );
            }
        } else if numel_in != numel_out {
            let what = format!(
                "reshape of {} (shape [{}]) to [{}]: the element counts must agree",
                self.tv_name(x),
                ins.iter().map(|&v| self.scalars.render(v)).collect::<Vec<_>>().join(", "),
                outs.iter().map(|&v| self.scalars.render(v)).collect::<Vec<_>>().join(", ")
            );
            self.require_equal(numel_in, numel_out, what);
        }
        let index = self.reshape_index(&ins, &outs);
        self.remap(x, "reshape", &outs, index, None)
    }

    /// Input positions of a row-major reshape from `ins` to `outs`. Runs of axes whose
    /// sizes multiply to the same value are mapped run by run (a kept axis is its own
    /// position, a split axis `o1 * D + o2`), so most reshapes need no division at all.
    /// Runs are matched from both ends; what is left between them is one run, whose sizes
    /// multiply to the same value because the whole reshape's do (a symbolic `[5, n, 6]` to
    /// `[5, 3, 4, 6]` reads `o1 * 4 + o2` along `n` and `o3` along the 6).
    pub(crate) fn reshape_index(&mut self, ins: &[ValId], outs: &[ValId]) -> Vec<ValId> {
        let runs = self.reshape_runs(ins, outs);
        let mut index: Vec<ValId> = Vec::with_capacity(ins.len());
        let (mut i, mut j) = (0usize, 0usize);
        for (a, b) in runs {
            // Row-major position within the run of output axes, then its digits in the
            // run of input axes.
            let mut lin = self.scalars.int(0);
            for (k, &m) in outs.iter().enumerate().skip(j).take(b) {
                let o = self.out_axis(k);
                let scaled = self.scalars.mul(lin, m);
                lin = self.scalars.add(scaled, o);
            }
            for m in i..i + a {
                let inner = self.scalars.product(ins[m + 1..i + a].iter().copied());
                let inner = self.at_least_one(inner);
                let q = self.scalars.div(lin, inner);
                let digit = if m == i {
                    q
                } else {
                    let e = self.at_least_one(ins[m]);
                    self.scalars.rem(q, e)
                };
                index.push(digit);
            }
            (i, j) = (i + a, j + b);
        }
        index
    }

    /// The runs of [`Fusion::reshape_index`], in order: (input axes, output axes) of each.
    pub(crate) fn reshape_runs(&mut self, ins: &[ValId], outs: &[ValId]) -> Vec<(usize, usize)> {
        let (mut i, mut j) = (0usize, 0usize);
        let mut front: Vec<(usize, usize)> = Vec::new();
        while i < ins.len() || j < outs.len() {
            let Some((a, b)) = self.next_run(ins, outs, (i, ins.len()), (j, outs.len()), false) else { break };
            front.push((a, b));
            (i, j) = (i + a, j + b);
        }
        let (mut ie, mut je) = (ins.len(), outs.len());
        let mut back: Vec<(usize, usize)> = Vec::new();
        while ie > i || je > j {
            let Some((a, b)) = self.next_run(ins, outs, (i, ie), (j, je), true) else { break };
            back.push((a, b));
            (ie, je) = (ie - a, je - b);
        }
        let middle = (ie > i || je > j).then_some((ie - i, je - j));
        front.into_iter().chain(middle).chain(back.into_iter().rev()).collect()
    }

    /// `v` where it is at least one, else one: a divisor of position arithmetic. An extent
    /// is zero only in an empty tensor, where nothing is read, and a zero divisor would
    /// fault the index arithmetic of lanes that read nothing.
    fn at_least_one(&mut self, v: ValId) -> ValId {
        if self.scalars.range(v).0 >= 1 {
            return v;
        }
        let one = self.scalars.int(1);
        self.scalars.max(v, one)
    }

    /// The shortest run of `a` input axes and `b` output axes at the start of the ranges
    /// `ins[i.0..i.1]` and `outs[j.0..j.1]` (at their end with `from_end`) whose sizes have
    /// equal products; None when there is none short of the whole ranges.
    fn next_run(
        &mut self,
        ins: &[ValId],
        outs: &[ValId],
        i: (usize, usize),
        j: (usize, usize),
        from_end: bool,
    ) -> Option<(usize, usize)> {
        let (ra, rb) = (i.1 - i.0, j.1 - j.0);
        for total in 1..ra + rb {
            for a in 0..=total.min(ra) {
                let b = total - a;
                if b > rb {
                    continue;
                }
                let (si, sj) = if from_end { (i.1 - a, j.1 - b) } else { (i.0, j.0) };
                let p = self.scalars.product(ins[si..si + a].iter().copied());
                let q = self.scalars.product(outs[sj..sj + b].iter().copied());
                let equal =
                    p == q || matches!((self.scalars.as_int(p), self.scalars.as_int(q)), (Some(x), Some(y)) if x == y);
                if equal {
                    return Some((a, b));
                }
            }
        }
        None
    }

    /// Index `i` of an axis of `n` elements counted from the end where it is negative
    /// (`i + n`), as Python and PyTorch index; a runtime `i` whose sign is known only when
    /// the inputs are bound wraps by arithmetic (`i + n * [i < 0]`, the bracket as
    /// `-max(min(i, 0), -1)`, which no 64-bit `i` overflows).
    /// An index computed from sizes alone (`size(x, 1) - 1`) is taken as it is: it is checked
    /// to be in range when the inputs are bound, and its size arithmetic stays simple (a
    /// width-one slice of a runtime size is still seen to have one element).
    fn wrap_index(&mut self, i: ValId, n: ValId) -> ValId {
        match self.scalars.as_int(i) {
            Some(v) if v >= 0 => i,
            Some(_) => self.scalars.add(n, i),
            None if !self.holds_scalar_input(i) => i,
            None => {
                let (zero, minus_one) = (self.scalars.int(0), self.scalars.int(-1));
                let low = self.scalars.min(i, zero);
                let low = self.scalars.max(low, minus_one);
                let neg = self.scalars.sub(zero, low);
                let shift = self.scalars.mul(n, neg);
                self.scalars.add(i, shift)
            }
        }
    }

    /// True when `v` reads a runtime scalar input of the fusion (a user's index), not only
    /// sizes and constants.
    fn holds_scalar_input(&self, v: ValId) -> bool {
        let mut syms = rustc_hash::FxHashSet::default();
        crate::lower::predicate::symbols(&self.scalars, v, &mut syms);
        syms.iter().any(|s| matches!(s, Symbol::ScalarInput(_)))
    }

    /// `x[start:end:step]` on every axis; `end` past the size is clamped to it (`None`:
    /// the size), negative `start` and `end` count from the end, and `start` past `end`
    /// gives an empty axis.
    pub fn slice(&mut self, x: TvId, start: &[ValId], end: &[Option<ValId>], step: &[i64]) -> Result<TvId> {
        let ins = self.extents_of(x);
        let rank = ins.len();
        if start.len() != rank || end.len() != rank || step.len() != rank {
            bail!(
                "slice: {} has rank {rank}; start_indices, end_indices and strides need one entry per axis (got {}, {}, {})",
                self.tv_name(x),
                start.len(),
                end.len(),
                step.len()
            );
        }
        self.integer_scalars("slice", start.iter().chain(end.iter().flatten()).copied())?;
        let mut extents = Vec::with_capacity(rank);
        let mut index = Vec::with_capacity(rank);
        for a in 0..rank {
            if step[a] < 1 {
                bail!("slice: axis {a} of {} has stride {}; expected an int >= 1", self.tv_name(x), step[a]);
            }
            let n = ins[a];
            // Negative starts and ends count from the end, and clamp at 0 past the start
            // (Python's and PyTorch's slices, nvFuser's since it normalizes them).
            let zero = self.scalars.int(0);
            let sized = |sc: &Self, v: ValId| sc.scalars.as_int(v).is_none() && !sc.holds_scalar_input(v);
            for (v, what) in [(Some(start[a]), "start"), (end[a], "end")] {
                if let Some(v) = v.filter(|&v| sized(self, v)) {
                    let holds = self.scalars.binary(ScalarOp::Le, zero, v);
                    let what = format!("slice of {}: the {what} of axis {a} must be >= 0", self.tv_name(x));
                    self.size_checks.push(SizeCheck { holds, values: vec![v], what });
                }
            }
            let first = if self.scalars.as_int(start[a]).is_some_and(|v| v >= 0) || sized(self, start[a]) {
                start[a]
            } else {
                let w = self.wrap_index(start[a], n);
                self.scalars.max(w, zero)
            };
            let hi = match end[a] {
                Some(e) if self.scalars.as_int(e).is_some_and(|v| v >= 0) || sized(self, e) => self.scalars.min(e, n),
                Some(e) => {
                    let w = self.wrap_index(e, n);
                    let w = self.scalars.max(w, zero);
                    self.scalars.min(w, n)
                }
                None => n,
            };
            let lo = if self.scalars.as_int(first) == Some(0) { first } else { self.scalars.min(first, hi) };
            // A step past 2^40 takes one element of any axis that fits in memory, as 2^40
            // does; the clamp keeps the size arithmetic (len + step - 1) inside 64 bits.
            let st = self.scalars.int(step[a].min(1 << 40));
            let span = self.scalars.sub(hi, lo);
            extents.push(self.scalars.ceil_div(span, st));
            let o = self.out_axis(a);
            let moved = self.scalars.mul(o, st);
            index.push(self.scalars.add(lo, moved));
        }
        let whole = (0..rank).all(|a| extents[a] == ins[a] && step[a] == 1 && self.scalars.as_int(start[a]) == Some(0));
        if whole {
            return self.set(x);
        }
        self.remap(x, "slice", &extents, index, None)
    }

    /// `x` widened by `widths[a] = (before, after)` positions on axis `a` (negative widths
    /// crop), the new positions holding `value`.
    pub fn pad(&mut self, x: TvId, widths: &[(ValId, ValId)], value: Operand) -> Result<TvId> {
        let ins = self.extents_of(x);
        let rank = ins.len();
        if widths.len() != rank {
            crate::bail_internal!("pad: {} widths for rank {rank}", widths.len());
        }
        self.integer_scalars("pad", widths.iter().flat_map(|&(a, b)| [a, b]))?;
        let mut extents = Vec::with_capacity(rank);
        let mut index = Vec::with_capacity(rank);
        let mut valid = self.scalars.boolean(true);
        let mut padded = Vec::new();
        for a in 0..rank {
            let (lo, hi) = widths[a];
            let n = ins[a];
            let grown = self.scalars.add(n, lo);
            let ext = self.scalars.add(grown, hi);
            extents.push(ext);
            let o = self.out_axis(a);
            index.push(self.scalars.sub(o, lo));
            if self.scalars.as_int(lo) == Some(0) && self.scalars.as_int(hi) == Some(0) {
                continue;
            }
            if let Some(e) = self.scalars.as_int(ext) {
                if e < 0 {
                    bail!(
                        "pad: axis {a} of {} would have size {e}; the widths crop more than the axis holds",
                        self.tv_name(x)
                    );
                }
            }
            // A negative width crops: both crops together may take at most the axis
            // (torch.nn.functional.pad), not more with the other width growing it again
            // (`[-5, 6]` of 4 elements is an error, not five fill values).
            let nonneg = |sc: &crate::ir::Scalars, w: ValId| sc.as_int(w).is_some_and(|w| w >= 0);
            let consts = (self.scalars.as_int(lo), self.scalars.as_int(hi), self.scalars.as_int(n));
            if let (Some(l), Some(h), Some(m)) = consts {
                // Widths near the 64-bit limits: checked exactly, before any size overflows.
                let (l, h, m) = (i128::from(l), i128::from(h), i128::from(m));
                let crop = (-l).max(0) + (-h).max(0);
                if crop > m {
                    bail!(
                        "pad: axis {a} of {}: the negative widths crop {crop} elements, more than the {m} the axis holds",
                        self.tv_name(x)
                    );
                }
                if m + l + h > i128::from(i64::MAX) {
                    bail!(
                        "pad: axis {a} of {} would have {} elements, more than 64-bit sizes hold",
                        self.tv_name(x),
                        m + l + h
                    );
                }
            } else if !nonneg(&self.scalars, lo) || !nonneg(&self.scalars, hi) {
                // A constant width's crop is taken exactly (`0 - i64::MIN` does not fold).
                let mut crop_of = |w: ValId| -> Result<ValId> {
                    let zero = self.scalars.int(0);
                    match self.scalars.as_int(w) {
                        Some(c) if c >= 0 => Ok(zero),
                        Some(c) => match c.checked_neg() {
                            Some(n) => Ok(self.scalars.int(n)),
                            None => bail!(
                                "pad: axis {a} of {}: a width of {c} crops more elements than any axis holds",
                                self.tv_name(x)
                            ),
                        },
                        None => {
                            let neg = self.scalars.sub(zero, w);
                            Ok(self.scalars.max(neg, zero))
                        }
                    }
                };
                let (clo, chi) = (crop_of(lo)?, crop_of(hi)?);
                if let (Some(p), Some(q)) = (self.scalars.as_int(clo), self.scalars.as_int(chi)) {
                    if p.checked_add(q).is_none() {
                        bail!(
                            "pad: axis {a} of {}: the negative widths crop more elements than any axis holds",
                            self.tv_name(x)
                        );
                    }
                }
                let crop = self.scalars.add(clo, chi);
                let holds = self.scalars.binary(ScalarOp::Le, crop, n);
                let what = format!(
                    "pad: axis {a} of {}: the negative widths crop more elements than the axis holds",
                    self.tv_name(x)
                );
                self.size_checks.push(SizeCheck { holds, values: vec![crop, n], what });
            }
            // Inside the input: lo <= o < lo + n.
            let from = self.scalars.binary(ScalarOp::Le, lo, o);
            let to = self.scalars.lt(o, grown);
            let both = self.scalars.binary(ScalarOp::And, from, to);
            valid = self.scalars.binary(ScalarOp::And, valid, both);
            padded.push(a);
        }
        let read = self.remap(x, "pad", &extents, index, Some(valid))?;
        if padded.is_empty() {
            return Ok(read);
        }
        // The mask varies along the padded axes only.
        let mut mask_extents = vec![self.scalars.int(1); rank];
        for &a in &padded {
            mask_extents[a] = extents[a];
        }
        let mask = self.mask(&mask_extents, valid)?;
        let dt = self.tvs[x].dtype;
        self.check_scalar_fits("pad", value, dt)?;
        let filled = self.where_(Operand::Tensor(mask), Operand::Tensor(read), value)?;
        if self.tvs[filled].dtype != dt {
            return self.cast(Operand::Tensor(filled), dt);
        }
        Ok(filled)
    }

    /// A Bool tensor of `extents`, true where `valid` (of its positions) holds.
    pub fn mask(&mut self, extents: &[ValId], valid: ValId) -> Result<TvId> {
        self.source("mask", extents, Op::Mask { valid }, DataType::Bool)
    }

    /// `xs` joined along `dim`; the other axes must have equal sizes.
    pub fn cat(&mut self, xs: &[TvId], dim: i64) -> Result<TvId> {
        let Some(&first) = xs.first() else { bail!("cat: expected at least one tensor") };
        // Parts of different dtypes join in their common type, as torch.cat promotes them.
        let dt =
            xs.iter().map(|&x| self.tvs[x].dtype).fold(self.tvs[first].dtype, crate::ir::dtype::promote_tensor_types);
        let rank = self.no_reduction_logical(first).len();
        let dim = self.normalize_dims("cat", first, &[dim], rank)?[0];
        let base = self.extents_of(first);
        for &x in &xs[1..] {
            let e = self.extents_of(x);
            if e.len() != rank {
                bail!(
                    "cat: {} has rank {} but {} has rank {rank}; expected one rank",
                    self.tv_name(x),
                    e.len(),
                    self.tv_name(first)
                );
            }
            for a in (0..rank).filter(|&a| a != dim) {
                let (p, q) = (base[a], e[a]);
                match (self.scalars.as_int(p), self.scalars.as_int(q)) {
                    (Some(u), Some(v)) if u != v => bail!(
                        "cat: axis {a} of {} has size {v} but axis {a} of {} has {u}; only axis {dim} may differ",
                        self.tv_name(x),
                        self.tv_name(first)
                    ),
                    _ if p != q => {
                        let what = format!(
                            "cat along axis {dim}: axis {a} of {} must have the size of axis {a} of {}",
                            self.tv_name(x),
                            self.tv_name(first)
                        );
                        self.require_equal(p, q, what);
                    }
                    _ => {}
                }
            }
        }
        let mut joined = Vec::with_capacity(xs.len());
        for &x in xs {
            joined.push(if self.tvs[x].dtype == dt { x } else { self.cast(Operand::Tensor(x), dt)? });
        }
        let xs = joined.as_slice();
        if xs.len() == 1 {
            return self.set(first);
        }
        // Offsets of each part along `dim`.
        let mut offsets = vec![self.scalars.int(0)];
        for &x in xs {
            let n = self.extents_of(x)[dim];
            let last = *offsets.last().expect("non-empty");
            offsets.push(self.scalars.add(last, n));
        }
        let total = offsets[xs.len()];
        let mut extents = base.clone();
        extents[dim] = total;
        let o = self.out_axis(dim);
        let mut parts = Vec::with_capacity(xs.len());
        for (i, &x) in xs.iter().enumerate() {
            let mut index: Vec<ValId> = (0..rank).map(|k| self.out_axis(k)).collect();
            index[dim] = self.scalars.sub(o, offsets[i]);
            let from = self.scalars.binary(ScalarOp::Le, offsets[i], o);
            let to = self.scalars.lt(o, offsets[i + 1]);
            let valid = self.scalars.binary(ScalarOp::And, from, to);
            parts.push(self.remap(x, "cat", &extents, index, Some(valid))?);
        }
        // Each position takes the part whose range holds it, the last part by default.
        let mut mask_extents = vec![self.scalars.int(1); rank];
        mask_extents[dim] = total;
        let mut out = parts[xs.len() - 1];
        for i in (0..xs.len() - 1).rev() {
            let before = self.scalars.lt(o, offsets[i + 1]);
            let m = self.mask(&mask_extents, before)?;
            out = self.where_(Operand::Tensor(m), Operand::Tensor(parts[i]), Operand::Tensor(out))?;
        }
        Ok(out)
    }

    /// The elements of `x` on and above diagonal `diagonal` of its last two axes; 0 below.
    pub fn triu(&mut self, x: TvId, diagonal: i64) -> Result<TvId> {
        let ext = self.extents_of(x);
        let rank = ext.len();
        if rank < 2 {
            bail!("triu: {} has rank {rank}; expected at least 2", self.tv_name(x));
        }
        // col - row >= diagonal, as row + diagonal <= col (no negative intermediate).
        let mut mask_extents = vec![self.scalars.int(1); rank];
        mask_extents[rank - 2] = ext[rank - 2];
        mask_extents[rank - 1] = ext[rank - 1];
        let (row, col) = (self.out_axis(rank - 2), self.out_axis(rank - 1));
        // Past +-2^62 every diagonal keeps (or drops) the same elements of any tensor that
        // fits in memory; clamping keeps row + diagonal from overflowing 64 bits.
        let d = self.scalars.int(diagonal.clamp(-(1 << 62), 1 << 62));
        let shifted = self.scalars.add(row, d);
        let valid = self.scalars.binary(ScalarOp::Le, shifted, col);
        let keep = self.mask(&mask_extents, valid)?;
        let zero = self.scalars.int(0);
        let dt = self.tvs[x].dtype;
        let kept = self.where_(Operand::Tensor(keep), Operand::Tensor(x), Operand::Scalar(zero))?;
        if self.tvs[kept].dtype != dt {
            return self.cast(Operand::Tensor(kept), dt);
        }
        Ok(kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn positions(f: &Fusion, t: TvId) -> (Vec<String>, Option<String>) {
        let d = f.tvs[t].definition.expect("defined");
        let Op::Remap { index, valid, .. } = &f.exprs[d].op else { panic!("not a remap") };
        (index.iter().map(|&v| f.scalars.render(v)).collect(), valid.map(|v| f.scalars.render(v)))
    }

    #[test]
    fn reshape_maps_runs_of_axes_without_division() {
        let mut f = Fusion::new();
        let x = f.define_tensor(&[-1, -1, 256], DataType::Float, None).unwrap();
        let (b, s) = (f.ids[f.tvs[x].logical[0]].extent, f.ids[f.tvs[x].logical[1]].extent);
        let (h, d) = (f.scalars.int(4), f.scalars.int(64));
        let y = f.reshape(x, &[Some(b), Some(s), Some(h), Some(d)]).unwrap();
        assert_eq!(positions(&f, y).0, ["o0", "o1", "o2 * 64 + o3"]);
        // Merging back composes into the identity on x.
        let m = f.scalars.int(256);
        let z = f.reshape(y, &[Some(b), Some(s), Some(m)]).unwrap();
        assert_eq!(positions(&f, z).0, ["o0", "o1", "o2"]);
        assert_eq!(f.exprs[f.tvs[z].definition.unwrap()].inputs[0], Operand::Tensor(x));
    }

    #[test]
    fn reshape_matches_runs_from_both_ends() {
        let mut f = Fusion::new();
        let x = f.define_tensor(&[5, -1, 6], DataType::Float, None).unwrap();
        let sizes: Vec<_> = [5, 3, 4, 6].iter().map(|&n| Some(f.scalars.int(n))).collect();
        let y = f.reshape(x, &sizes).unwrap();
        // The runtime size in the middle is the run between the matched ends.
        assert_eq!(positions(&f, y).0, ["o0", "o1 * 4 + o2", "o3"]);
        // Ends that only the sizes at hand match leave one run, divided.
        let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
        let sizes: Vec<_> = [3, 7, 33].iter().map(|&n| Some(f.scalars.int(n))).collect();
        let y = f.reshape(x, &sizes).unwrap();
        assert_eq!(
            positions(&f, y).0,
            ["((o0 * 7 + o1) * 33 + o2) / max(i2, 1)", "((o0 * 7 + o1) * 33 + o2) % max(i2, 1)"]
        );
    }

    #[test]
    fn reshape_infers_a_size_and_refactors_through_division() {
        let mut f = Fusion::new();
        let x = f.define_tensor(&[6, 10], DataType::Float, None).unwrap();
        let four = f.scalars.int(4);
        let y = f.reshape(x, &[Some(four), None]).unwrap();
        let ext: Vec<_> = f.tvs[y].logical.iter().map(|&id| f.scalars.render(f.ids[id].extent)).collect();
        assert_eq!(ext, ["4", "15"]);
        assert_eq!(positions(&f, y).0, ["(o0 * 15 + o1) / 10", "(o0 * 15 + o1) % 10"]);
        let five = f.scalars.int(5);
        assert!(f.reshape(x, &[Some(five), Some(five)]).unwrap_err().to_string().contains("60 elements"));
    }

    #[test]
    fn pad_guards_and_slices_compose() {
        let mut f = Fusion::new();
        let x = f.define_tensor(&[-1], DataType::Float, None).unwrap();
        let (two, one) = (f.scalars.int(2), f.scalars.int(1));
        let s = f.slice(x, &[two], &[None], &[3]).unwrap();
        assert_eq!(positions(&f, s), (vec!["min(i0, 2) + o0 * 3".to_string()], None));
        let (nine, o0) = (f.scalars.int(9), f.scalars.symbol(Symbol::OutAxis(0)));
        let p = f.remap(s, "pad", &[nine], vec![o0], None).unwrap();
        // A remap of a remap reads the first one's input.
        assert_eq!(f.exprs[f.tvs[p].definition.unwrap()].inputs[0], Operand::Tensor(x));
        let half = f.scalars.float(0.5);
        let padded = f.pad(x, &[(one, two)], Operand::Scalar(half)).unwrap();
        let d = f.tvs[padded].definition.unwrap();
        assert!(matches!(f.exprs[d].op, Op::Where));
        let read = f.exprs[d].inputs[1].tensor().unwrap();
        assert_eq!(positions(&f, read), (vec!["o0 - 1".to_string()], Some("1 <= o0 && o0 < i0 + 1".to_string())));
    }
}
