//! Builders for tensor ops: each checks its operands, infers the output's shape and
//! dtype (PyTorch promotion), creates fresh output ids and records the expr.

use rustc_hash::{FxHashMap, FxHashSet};
use smallvec::{smallvec, SmallVec};

use crate::error::Result;
use crate::ir::dtype::{promote, Category, PromotionOperand};
use crate::ir::scalar::{ScalarOp, Scalars, Val};
use crate::ir::{
    BinaryClass, BinaryOp, DataType, Fusion, IterDomainId, IterType, MemoryType, Op, Operand, RandomDist, ReductionOp,
    Symbol, TvId, UnaryClass, UnaryOp, ValId,
};
use crate::{bail, bail_type};

impl Fusion {
    /// Declare a tensor input: `-1` symbolic, `1` broadcast, `n > 1` static size.
    pub fn define_tensor(
        &mut self,
        shape: &[i64],
        dtype: DataType,
        contiguity: Option<&[Option<bool>]>,
    ) -> Result<TvId> {
        let name = format!("T{}", self.tvs.len());
        if let Some(c) = contiguity {
            if c.len() != shape.len() {
                bail!(
                    "define_tensor {name}: contiguity has {} entries but the shape has rank {}",
                    c.len(),
                    shape.len()
                );
            }
        }
        let mut logical = Vec::with_capacity(shape.len());
        for (axis, &s) in shape.iter().enumerate() {
            let id = match s {
                -1 => {
                    let e = self.new_extent_symbol();
                    // The tensor is created below with the next id.
                    let tv_next = TvId::from_u32(self.tvs.len() as u32);
                    self.extent_sources.push((tv_next, axis));
                    self.new_id(e, IterType::Iteration)
                }
                1 => {
                    let e = self.scalars.int(1);
                    self.new_id(e, IterType::Broadcast)
                }
                n if n >= 0 => {
                    let e = self.scalars.int(n);
                    self.new_id(e, IterType::Iteration)
                }
                n => bail!("define_tensor {name}: axis {axis} has size {n}; expected -1 (symbolic), 1 (broadcast) or a size >= 0"),
            };
            logical.push(id);
        }
        let tv = self.new_tv(dtype, MemoryType::Global, logical);
        if let Some(c) = contiguity {
            for (axis, (&flag, &id)) in c.iter().zip(&self.tvs[tv].logical).enumerate() {
                let is_bcast = self.ids[id].iter_type == IterType::Broadcast;
                match (is_bcast, flag) {
                    (true, Some(_)) => {
                        bail!("define_tensor {name}: axis {axis} is a broadcast (size 1) and takes contiguity None, got {flag:?}")
                    }
                    (false, None) => {
                        bail!("define_tensor {name}: axis {axis} is not a broadcast and needs contiguity True or False, got None")
                    }
                    _ => {}
                }
            }
            self.tvs[tv].contiguity = c.to_vec();
            self.tvs[tv].declared_contiguity = true;
        }
        self.inputs.push(Operand::Tensor(tv));
        Ok(tv)
    }

    /// Declare a runtime scalar input `s{n}`.
    pub fn define_scalar_input(&mut self, dtype: DataType) -> ValId {
        let n = self.scalar_input_dtypes.len() as u32;
        self.scalar_input_dtypes.push(dtype);
        let v = self.scalars.symbol(Symbol::ScalarInput(n));
        self.inputs.push(Operand::Scalar(v));
        v
    }

    /// Mark `out` as an output written into input `inp`'s buffer (in place).
    pub fn add_output_alias(&mut self, out: TvId, inp: TvId) -> Result<()> {
        let (on, iname) = (self.tv_name(out), self.tv_name(inp));
        if !self.is_input(inp) {
            bail!("add_output: alias_input {iname} is not a fusion input; only an input's buffer can be reused");
        }
        if let Some(&(other, _)) = self.aliases.iter().find(|(_, i)| *i == inp) {
            bail!(
                "add_output: {on} and {} both alias input {iname}; an input's buffer can take one output",
                self.tv_name(other)
            );
        }
        if out == inp {
            bail!("add_output: {on} aliasing itself does nothing; pass it without alias_input for a copy");
        }
        let (od, id) = (self.tvs[out].dtype, self.tvs[inp].dtype);
        if od != id {
            bail_type!("add_output: {on} has dtype {od} but alias_input {iname} has dtype {id}; cast it first");
        }
        let (olog, ilog) = (self.no_reduction_logical(out), self.no_reduction_logical(inp));
        if olog.len() != ilog.len() {
            bail!("add_output: {on} has rank {} but alias_input {iname} has rank {}", olog.len(), ilog.len());
        }
        for (axis, (&o, &i)) in olog.iter().zip(&ilog).enumerate() {
            let (oe, ie) = (self.ids[o].extent, self.ids[i].extent);
            let (on_, ie_) = (self.scalars.as_int(oe), self.scalars.as_int(ie));
            if oe != ie && on_.is_some() && ie_.is_some() && on_ != ie_ {
                bail!(
                    "add_output: axis {axis} of {on} has size {} but alias_input {iname} has size {}",
                    self.scalars.render(oe),
                    self.scalars.render(ie)
                );
            }
        }
        self.add_output(out)?;
        let stored = *self.outputs.last().expect("add_output pushed it");
        self.aliases.push((stored, inp));
        Ok(())
    }

    /// Mark a tensor as a fusion output.
    pub fn add_output(&mut self, tv: TvId) -> Result<()> {
        let copies_it = |f: &Fusion, o: TvId| {
            f.tvs[o].definition.is_some_and(|e| {
                matches!(f.exprs[e].op, Op::Set) && f.exprs[e].inputs.first() == Some(&Operand::Tensor(tv))
            })
        };
        // An input given back as an output, or a tensor given as an output again, is
        // returned as a fresh copy (outputs are always new arrays, whatever path runs the
        // fusion; nvFuser returns the same tensor twice).
        let again =
            self.outputs.contains(&tv) || (self.is_input(tv) && self.outputs.iter().any(|&o| copies_it(self, o)));
        let tv = if self.is_input(tv) || again { self.set(tv)? } else { tv };
        self.outputs.push(tv);
        // Outputs are handed back to the caller, so they always live in Global memory.
        self.tvs[tv].memory = MemoryType::Global;
        Ok(())
    }

    fn operand_dtype(&self, o: Operand) -> PromotionOperand {
        match o {
            Operand::Tensor(t) => PromotionOperand { dtype: self.tvs[t].dtype, is_tensor: true, zero_dim: false },
            Operand::Scalar(v) => PromotionOperand {
                dtype: self.scalars.dtype(v, &self.scalar_input_dtypes),
                is_tensor: false,
                zero_dim: false,
            },
        }
    }

    /// `t`, a 0-d tensor computed from scalars alone (`1 - beta`), recomputed with `rank`
    /// size-one axes: like `full`, it then fuses into the kernel that reads it instead of
    /// being a kernel of its own. None when `t` reads a tensor (a reduction's result).
    /// Iterative: a chain of 100000 scalar ops overflowed the stack when this recursed.
    fn rerank_scalar_math(&mut self, t: TvId, rank: usize) -> Option<TvId> {
        let order = self.scalar_math_order(t)?;
        let one = self.scalars.int(1);
        let mut new: FxHashMap<TvId, TvId> = FxHashMap::default();
        for old in order {
            let e = self.tvs[old].definition?;
            let (op, inputs) = (self.exprs[e].op.clone(), self.exprs[e].inputs.clone());
            let new_inputs: SmallVec<[Operand; 3]> = inputs
                .iter()
                .map(|&o| match o {
                    Operand::Tensor(i) => Operand::Tensor(new[&i]),
                    Operand::Scalar(_) => o,
                })
                .collect();
            let logical = (0..rank).map(|_| self.new_id(one, IterType::Broadcast)).collect();
            let out = self.new_tv(self.tvs[old].dtype, MemoryType::Local, logical);
            self.add_expr(op, new_inputs, out);
            new.insert(old, out);
        }
        new.get(&t).copied()
    }

    /// The 0-d tensors `t` is computed from by element-wise ops from scalars alone, each after
    /// its inputs (`t` last), or None where one of them reads anything else.
    fn scalar_math_order(&self, t: TvId) -> Option<Vec<TvId>> {
        let math = |x: TvId| {
            self.tvs[x].definition.is_some_and(|e| {
                matches!(self.exprs[e].op, Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_) | Op::Full { .. })
            }) && self.no_reduction_logical(x).is_empty()
                && self.tvs[x].logical.is_empty()
        };
        let mut order = Vec::new();
        let mut done: FxHashSet<TvId> = FxHashSet::default();
        // (tensor, whether its inputs are already on the stack)
        let mut stack = vec![(t, false)];
        while let Some((x, expanded)) = stack.pop() {
            if done.contains(&x) {
                continue;
            }
            if expanded {
                done.insert(x);
                order.push(x);
                continue;
            }
            if !math(x) {
                return None;
            }
            stack.push((x, true));
            let e = self.tvs[x].definition?;
            // Reversed, so the first input's chain comes first, as a recursion takes them.
            for o in self.exprs[e].inputs.iter().rev() {
                if let Operand::Tensor(i) = *o {
                    if !done.contains(&i) {
                        stack.push((i, false));
                    }
                }
            }
        }
        Some(order)
    }

    /// Operands as promotion sees them: a 0-d tensor beside ranked tensors ranks with the
    /// scalars (PyTorch: dimensioned tensors take precedence over zero-dim ones).
    fn promotion_operands(&self, operands: &[Operand]) -> SmallVec<[PromotionOperand; 3]> {
        let ranked = operands.iter().filter_map(|o| o.tensor()).any(|t| !self.no_reduction_logical(t).is_empty());
        operands
            .iter()
            .map(|&o| {
                let mut p = self.operand_dtype(o);
                if let Operand::Tensor(t) = o {
                    p.is_tensor = !ranked || !self.no_reduction_logical(t).is_empty();
                    p.zero_dim = !p.is_tensor;
                }
                p
            })
            .collect()
    }

    /// A scalar operand of `op` that `dt` (the type it is converted to) cannot hold: a
    /// constant integer outside Int32's range, or an infinite or NaN float, for an integer
    /// type, is refused here; a runtime Int meeting Int32 is checked when the inputs are
    /// bound. NumPy and PyTorch refuse these too; a silent wrap would change the answer.
    pub(crate) fn check_scalar_fits(&mut self, op: &str, o: Operand, dt: DataType) -> Result<()> {
        let Operand::Scalar(v) = o else { return Ok(()) };
        let runtime_int = self.scalars.dtype(v, &self.scalar_input_dtypes) == DataType::Int
            && !matches!(self.scalars.get(v), crate::ir::scalar::Val::Int(_));
        if dt == DataType::Int32 && runtime_int {
            // A runtime Int that meets Int32 must fit it too, checked when the inputs are
            // bound (a cast would wrap it: x == 2**32 + 1 would hold for x == 1).
            let lo = self.scalars.int(i64::from(i32::MIN));
            let hi = self.scalars.int(i64::from(i32::MAX));
            let above = self.scalars.binary(ScalarOp::Le, lo, v);
            let below = self.scalars.binary(ScalarOp::Le, v, hi);
            let holds = self.scalars.binary(ScalarOp::And, above, below);
            let what = format!(
                "{op}: the Int scalar {} meets Int32 and must fit it; cast the tensor to Int (int64) first",
                self.scalars.render(v)
            );
            self.size_checks.push(crate::ir::shape_ops::SizeCheck { holds, values: vec![v], what });
        }
        match self.scalars.get(v) {
            crate::ir::scalar::Val::Int(n) if dt == DataType::Int32 && i32::try_from(n).is_err() => bail!(
                "{op}: the constant {n} does not fit Int32, the dtype it meets; cast the tensor to Int (int64) first"
            ),
            crate::ir::scalar::Val::Float(bits) if dt.is_integer() && !f64::from_bits(bits).is_finite() => {
                bail!("{op}: the constant {} has no {dt} value", f64::from_bits(bits))
            }
            _ => Ok(()),
        }
    }

    fn describe(&self, o: Operand) -> String {
        match o {
            Operand::Tensor(t) => self.tv_name(t),
            Operand::Scalar(v) => format!("scalar {}", self.scalars.render(v)),
        }
    }

    /// Output logical ids of an element-wise op over `operands` (same rank, broadcast-compatible).
    fn pointwise_domain(&mut self, op_name: &str, operands: &[Operand]) -> Result<Vec<IterDomainId>> {
        let tensors: Vec<TvId> = operands.iter().filter_map(|o| o.tensor()).collect();
        let Some(&first) = tensors.first() else {
            // Scalars only: a 0-d tensor.
            return Ok(Vec::new());
        };
        let doms: Vec<Vec<IterDomainId>> = tensors.iter().map(|&t| self.no_reduction_logical(t)).collect();
        let rank = doms[0].len();
        for (t, d) in tensors.iter().zip(&doms) {
            if d.len() != rank {
                bail!(
                    "{op_name}: {} has rank {} but {} has rank {}; operands must have the same rank (use broadcast_in_dim to add axes)",
                    self.tv_name(first),
                    rank,
                    self.tv_name(*t),
                    d.len()
                );
            }
        }
        let mut out = Vec::with_capacity(rank);
        for axis in 0..rank {
            // The first non-broadcast operand axis decides the extent.
            let mut chosen: Option<(TvId, IterDomainId)> = None;
            for (&t, d) in tensors.iter().zip(&doms) {
                let id = d[axis];
                if self.ids[id].iter_type == IterType::Broadcast {
                    continue;
                }
                match chosen {
                    None => chosen = Some((t, id)),
                    Some((t0, id0)) => {
                        let (e0, e1) =
                            (self.scalars.as_int(self.ids[id0].extent), self.scalars.as_int(self.ids[id].extent));
                        if let (Some(a), Some(b)) = (e0, e1) {
                            if a != b {
                                bail!(
                                    "{op_name}: axis {axis} has size {a} in {} but size {b} in {}; sizes must match or one must be a broadcast",
                                    self.tv_name(t0),
                                    self.tv_name(t)
                                );
                            }
                        }
                        // A constant size wins over a runtime one, whichever operand comes
                        // first (the two are checked equal at run time): `w * h` and `h * w`
                        // then have one shape, and rewrites that compare shapes see it.
                        if e0.is_none() && e1.is_some() {
                            chosen = Some((t, id));
                        }
                        // Of two runtime sizes, an input's own size wins over a computed one,
                        // then the earlier one: the choice does not depend on the operand
                        // order either (`w * x` read `x` through another size's reshape,
                        // which then did not look like a reshape of `x`).
                        if e0.is_none() && e1.is_none() {
                            let (v0, v1) = (self.ids[id0].extent, self.ids[id].extent);
                            let plain = |v| matches!(self.scalars.get(v), crate::ir::scalar::Val::Symbol(_));
                            if (plain(v1), std::cmp::Reverse(v1)) > (plain(v0), std::cmp::Reverse(v0)) {
                                chosen = Some((t, id));
                            }
                        }
                    }
                }
            }
            let id = match chosen {
                Some((_, id)) => {
                    let e = self.ids[id].extent;
                    self.new_id(e, IterType::Iteration)
                }
                None => {
                    let one = self.scalars.int(1);
                    self.new_id(one, IterType::Broadcast)
                }
            };
            out.push(id);
        }
        Ok(out)
    }

    fn pointwise(
        &mut self,
        op_name: &str,
        op: Op,
        mut operands: SmallVec<[Operand; 3]>,
        dtype: DataType,
    ) -> Result<TvId> {
        // A 0-d tensor among ranked ones broadcasts to their rank, as in PyTorch.
        let rank = operands.iter().filter_map(|o| o.tensor()).map(|t| self.no_reduction_logical(t).len()).max();
        if let Some(rank @ 1..) = rank {
            for o in operands.iter_mut() {
                if let Operand::Tensor(t) = *o {
                    if self.no_reduction_logical(t).is_empty() {
                        let b = match self.rerank_scalar_math(t, rank) {
                            Some(b) => b,
                            None => self.broadcast(t, vec![true; rank])?,
                        };
                        *o = Operand::Tensor(b);
                    }
                }
            }
        }
        self.broadcast_computed_ones(&mut operands)?;
        let logical = self.pointwise_domain(op_name, &operands)?;
        let out = self.new_tv(dtype, MemoryType::Local, logical);
        self.add_expr(op, operands, out);
        Ok(out)
    }

    /// True when axis `id` is computed with a size of at most one that is not known
    /// (`x[:, :1]` or `x[:, k:k+1]` of a runtime size): PyTorch broadcasts it when it is one.
    fn computed_single(&self, id: IterDomainId) -> bool {
        let d = &self.ids[id];
        d.iter_type == IterType::Iteration
            && !matches!(self.scalars.get(d.extent), crate::ir::scalar::Val::Symbol(_))
            && self.scalars.as_int(d.extent).is_none()
            && self.scalars.range(d.extent).1.is_some_and(|hi| hi <= 1)
    }

    /// `t` with its axes `axes` (computed sizes of at most one) made broadcasts: squeezed
    /// (checked to be one when the inputs are bound) and broadcast back.
    fn single_axes_as_broadcasts(&mut self, t: TvId, axes: &[(usize, ValId)]) -> Result<TvId> {
        let rank = self.no_reduction_logical(t).len();
        let dims: Vec<i64> = axes.iter().map(|&(a, _)| a as i64).collect();
        let squeezed = self.squeeze_against(t, &dims, axes)?;
        self.broadcast(squeezed, (0..rank).map(|a| axes.iter().any(|&(b, _)| a == b)).collect())
    }

    /// Element-wise operands of one rank: an axis of a computed size of at most one meets
    /// an axis of a size other than 0 or 1 as a broadcast (`x - x[:, -1:]`), as PyTorch
    /// broadcasts it.
    fn broadcast_computed_ones(&mut self, operands: &mut [Operand]) -> Result<()> {
        let tensors: Vec<TvId> = operands.iter().filter_map(|o| o.tensor()).collect();
        if tensors.len() < 2 {
            return Ok(());
        }
        let doms: Vec<Vec<IterDomainId>> = tensors.iter().map(|&t| self.no_reduction_logical(t)).collect();
        let Some(rank) = doms.first().map(|d| d.len()) else { return Ok(()) };
        if doms.iter().any(|d| d.len() != rank) {
            return Ok(());
        }
        for (o, mine) in operands.iter_mut().filter(|o| o.tensor().is_some()).zip(&doms) {
            let Operand::Tensor(t) = *o else { continue };
            let axes: Vec<(usize, ValId)> = (0..rank)
                .filter(|&a| self.computed_single(mine[a]))
                .filter_map(|a| {
                    doms.iter()
                        .find(|d| {
                            let other = &self.ids[d[a]];
                            other.iter_type == IterType::Iteration
                                && !self.computed_single(d[a])
                                // Against a constant 0 both readings give no elements; an
                                // equal-size pair keeps a 0 that a squeeze would refuse.
                                && self.scalars.as_int(other.extent).is_none_or(|n| n > 1)
                        })
                        .map(|d| (a, self.ids[d[a]].extent))
                })
                .collect();
            if !axes.is_empty() {
                *o = Operand::Tensor(self.single_axes_as_broadcasts(t, &axes)?);
            }
        }
        Ok(())
    }

    /// An element-wise unary op.
    pub fn unary(&mut self, op: UnaryOp, x: Operand) -> Result<TvId> {
        let name = op.name();
        let dt = self.operand_dtype(x).dtype;
        // The type the op computes in must have a form in the table (no bitwise_not of
        // a float, no frac of an integer).
        let defined = |cd: DataType| match cd.category() {
            Category::Bool => op.eval_bool(false).is_some(),
            Category::Integer => op.eval_int(0).is_some(),
            Category::Floating => op.eval_f64(0.5).is_some(),
        };
        let out_dt = match op.class() {
            UnaryClass::Exact | UnaryClass::KeepType => dt,
            // Transcendentals of integers compute in the default float type, as PyTorch does.
            UnaryClass::Float if dt.is_float() => dt,
            UnaryClass::Float => DataType::Float,
            UnaryClass::Predicate | UnaryClass::Logical => DataType::Bool,
        };
        if !defined(op.compute_dtype(dt, out_dt)) {
            bail_type!("{name}: {} has dtype {dt}; {name} is not defined for it", self.describe(x));
        }
        self.pointwise(name, Op::Unary(op), smallvec![x], out_dt)
    }

    /// An element-wise binary op.
    pub fn binary(&mut self, op: BinaryOp, a: Operand, b: Operand) -> Result<TvId> {
        let promoted = promote(&self.promotion_operands(&[a, b]));
        // PyTorch converts tensor operands to a half or bfloat16 common type before the op
        // (an Int32 70000 becomes inf, 2049 becomes 2048) and then computes in float; a
        // direct conversion to float would skip that rounding. (Python numbers are not
        // rounded first, as in PyTorch's CUDA kernels.)
        let (a, b) = if matches!(promoted, DataType::Half | DataType::BFloat16) {
            let mut round = |o: Operand| -> Result<Operand> {
                match o {
                    Operand::Tensor(t) if self.tvs[t].dtype != promoted => Ok(Operand::Tensor(self.cast(o, promoted)?)),
                    o => Ok(o),
                }
            };
            (round(a)?, round(b)?)
        } else if op.is_comparison() {
            // A comparison is made in the promoted type: a 0-d tensor takes part as a scalar
            // (an Int 0-d beside Int32 values is compared as Int32, a Double 0-d beside Float
            // values as Float), as the arithmetic ops read it and PyTorch compares.
            let mut to_promoted = |o: Operand| -> Result<Operand> {
                match o {
                    Operand::Tensor(t) if self.tvs[t].dtype != promoted => Ok(Operand::Tensor(self.cast(o, promoted)?)),
                    o => Ok(o),
                }
            };
            (to_promoted(a)?, to_promoted(b)?)
        } else {
            (a, b)
        };
        if op == BinaryOp::Nextafter && matches!(promoted, DataType::Half | DataType::BFloat16) {
            return self.narrow_nextafter(a, b, promoted);
        }
        let out_dt = match op.class() {
            BinaryClass::Compare | BinaryClass::Logical => DataType::Bool,
            BinaryClass::Float if !promoted.is_float() => DataType::Float,
            BinaryClass::Float | BinaryClass::Promote => promoted,
        };
        let cd = op.compute_dtype(promoted, out_dt);
        for o in [a, b] {
            self.check_scalar_fits(op.name(), o, promoted)?;
        }
        let defined = op.is_comparison()
            || match cd.category() {
                Category::Bool => op.eval_bool(false, false).is_some(),
                Category::Integer => op.eval_int(0, 1).is_some(),
                Category::Floating => op.eval_f64(0.5, 1.0).is_some(),
            };
        if !defined {
            bail_type!(
                "{}: {} and {} promote to {promoted}; {} is not defined for it",
                op.name(),
                self.describe(a),
                self.describe(b),
                op.name()
            );
        }
        self.pointwise(op.name(), Op::Binary(op), smallvec![a, b], out_dt)
    }

    /// `nextafter(a, b)` for half or bfloat16 operands: the neighbour of `a` in `dt`, not in
    /// float, which is where the op computes (a float step would round back to `a`).
    fn narrow_nextafter(&mut self, a: Operand, b: Operand, dt: DataType) -> Result<TvId> {
        // One float step in b's direction, scaled by the mantissa bits `dt` lacks, is one
        // step of `dt` (exactly: both formats halve their step below a power of two). Below
        // `dt`'s smallest normal the step stays at its subnormal spacing, and from an
        // infinity the neighbour is `dt`'s largest finite value.
        let (scale, tiny, largest) = match dt {
            DataType::Half => (2f64.powi(13), 2f64.powi(-24), 65504.0),
            _ => (2f64.powi(16), 2f64.powi(-133), 3.389_531_389_251_535_5e38),
        };
        let wide = |f: &mut Self, o: Operand| -> Result<Operand> {
            Ok(match o {
                Operand::Tensor(_) => Operand::Tensor(f.cast(o, DataType::Float)?),
                o => o,
            })
        };
        let (af, bf) = (wide(self, a)?, wide(self, b)?);
        let t = Operand::Tensor;
        let scale = Operand::Scalar(self.scalars.float(scale));
        let tiny = Operand::Scalar(self.scalars.float(tiny));
        let largest = Operand::Scalar(self.scalars.float(largest));
        let next = self.binary(BinaryOp::Nextafter, af, bf)?;
        let d = self.binary(BinaryOp::Sub, t(next), af)?;
        let mag = self.unary(UnaryOp::Abs, t(d))?;
        let mag = self.binary(BinaryOp::Mul, t(mag), scale)?;
        let mag = self.binary(BinaryOp::Maximum, t(mag), tiny)?;
        let dir = self.unary(UnaryOp::Sign, t(d))?;
        let step = self.binary(BinaryOp::Mul, t(dir), t(mag))?;
        let finite = self.binary(BinaryOp::Add, af, t(step))?;
        // A step to zero keeps a's sign (nextafter(-tiny, 1) is -0).
        let zero = Operand::Scalar(self.scalars.float(0.0));
        let at_zero = self.binary(BinaryOp::Eq, t(finite), zero)?;
        let signed_zero = self.binary(BinaryOp::Mul, af, zero)?;
        let finite = self.where_(t(at_zero), t(signed_zero), t(finite))?;
        // From +-inf toward anything but itself or NaN: +-largest.
        let a_inf = self.unary(UnaryOp::Isinf, af)?;
        let moves = self.binary(BinaryOp::Ne, af, bf)?;
        let b_nan = self.unary(UnaryOp::Isnan, bf)?;
        let b_num = self.unary(UnaryOp::LogicalNot, t(b_nan))?;
        let from_inf = self.binary(BinaryOp::LogicalAnd, t(a_inf), t(moves))?;
        let from_inf = self.binary(BinaryOp::LogicalAnd, t(from_inf), t(b_num))?;
        let a_sign = self.unary(UnaryOp::Sign, af)?;
        let edge = self.binary(BinaryOp::Mul, t(a_sign), largest)?;
        let r = self.where_(t(from_inf), t(edge), t(finite))?;
        // Equal operands give b (nextafter(0, -0) is -0).
        let same = self.binary(BinaryOp::Eq, af, bf)?;
        let r = self.where_(t(same), bf, t(r))?;
        self.cast(t(r), dt)
    }

    /// A unary op on any operand: a constant scalar folds to a constant, another scalar
    /// gives a 0-d tensor, a tensor the op's tensor.
    pub fn unary_value(&mut self, op: UnaryOp, x: Operand) -> Result<Operand> {
        if let Some(v) = self.fold(|sc, vals| fold_unary(op, sc, vals[0]), &[x]) {
            return Ok(Operand::Scalar(v));
        }
        if let Operand::Scalar(v) = x {
            // Shape arithmetic on Int scalars stays a scalar (`-size`, `abs(a - b)`).
            if self.scalars.dtype(v, &self.scalar_input_dtypes) == DataType::Int {
                let zero = self.scalars.int(0);
                match op {
                    UnaryOp::Neg => return Ok(Operand::Scalar(self.scalars.binary(ScalarOp::Sub, zero, v))),
                    UnaryOp::Abs => {
                        let neg = self.scalars.binary(ScalarOp::Sub, zero, v);
                        return Ok(Operand::Scalar(self.scalars.binary(ScalarOp::Max, v, neg)));
                    }
                    _ => {}
                }
            }
        }
        Ok(Operand::Tensor(self.unary(op, x)?))
    }

    /// A binary op on any operands: constants fold, integer index arithmetic on scalars
    /// (`size(t, 0) * 2`) stays a scalar usable in shapes, other scalar-only math gives a
    /// 0-d tensor.
    pub fn binary_value(&mut self, op: BinaryOp, a: Operand, b: Operand) -> Result<Operand> {
        // Integer constants fold exactly or not at all: a wrapped product or a quotient by
        // zero would become a size or a value without a word (the same arithmetic on a
        // runtime Int is an error when the inputs are bound).
        if let (Operand::Scalar(x), Operand::Scalar(y)) = (a, b) {
            if let (Val::Int(x), Val::Int(y)) = (self.scalars.get(x), self.scalars.get(y)) {
                let exact = match op {
                    BinaryOp::Add => x.checked_add(y).is_some(),
                    BinaryOp::Sub => x.checked_sub(y).is_some(),
                    BinaryOp::Mul => x.checked_mul(y).is_some(),
                    _ => true,
                };
                let by_zero = y == 0 && matches!(op, BinaryOp::Div | BinaryOp::Fmod | BinaryOp::Remainder);
                if !exact {
                    bail!("{}: {x} and {y} give a result outside the Int (int64) range", op.name());
                }
                if by_zero {
                    bail!("{}: the integer constant {x} divided by zero", op.name());
                }
            }
        }
        if let Some(v) = self.fold(|sc, vals| fold_binary(op, sc, vals[0], vals[1]), &[a, b]) {
            return Ok(Operand::Scalar(v));
        }
        if let (Operand::Scalar(x), Operand::Scalar(y)) = (a, b) {
            let ints = [x, y].iter().all(|&v| self.scalars.dtype(v, &self.scalar_input_dtypes) == DataType::Int);
            let index_op = match op {
                BinaryOp::Add => Some(ScalarOp::Add),
                BinaryOp::Sub => Some(ScalarOp::Sub),
                BinaryOp::Mul => Some(ScalarOp::Mul),
                // Truncating, as `div` of integers (shape arithmetic divides sizes >= 0).
                BinaryOp::Div => Some(ScalarOp::Div),
                BinaryOp::Maximum => Some(ScalarOp::Max),
                BinaryOp::Minimum => Some(ScalarOp::Min),
                // Truncating, as `fmod` of integers.
                BinaryOp::Fmod => Some(ScalarOp::Mod),
                _ => None,
            };
            if let (true, Some(sop)) = (ints, index_op) {
                return Ok(Operand::Scalar(self.scalars.binary(sop, x, y)));
            }
            if ints && op == BinaryOp::Remainder {
                // The sign of `y`, as Python's `%`: `((x % y) + y) % y` of truncating
                // remainders (the padding `(8 - s % 8) % 8` a model computes from a size).
                let r = self.scalars.binary(ScalarOp::Mod, x, y);
                let r = self.scalars.binary(ScalarOp::Add, r, y);
                return Ok(Operand::Scalar(self.scalars.binary(ScalarOp::Mod, r, y)));
            }
        }
        Ok(Operand::Tensor(self.binary(op, a, b)?))
    }

    /// `f` over the constant values of `operands`, when all are constant scalars.
    fn fold(&mut self, f: impl FnOnce(&mut Scalars, &[Val]) -> Option<ValId>, operands: &[Operand]) -> Option<ValId> {
        let vals: Option<SmallVec<[Val; 2]>> = operands
            .iter()
            .map(|o| match o {
                Operand::Scalar(v) => match self.scalars.get(*v) {
                    c @ (Val::Int(_) | Val::Float(_) | Val::Bool(_)) => Some(c),
                    _ => None,
                },
                Operand::Tensor(_) => None,
            })
            .collect();
        f(&mut self.scalars, &vals?)
    }

    /// `where(cond, a, b)`.
    pub fn where_(&mut self, cond: Operand, a: Operand, b: Operand) -> Result<TvId> {
        let cd = self.operand_dtype(cond).dtype;
        if cd != DataType::Bool {
            bail_type!("where: condition {} has dtype {cd}; expected Bool", self.describe(cond));
        }
        let ps = self.promotion_operands(&[a, b]);
        let (pa, pb) = (ps[0], ps[1]);
        let out_dt = if pa.is_tensor || pb.is_tensor {
            promote(&[pa, pb])
        } else {
            // Two numbers: PyTorch's default dtype of their category (a Python float
            // gives float32, not double).
            match promote(&[pa, pb]) {
                d if d.is_float() => DataType::Float,
                DataType::Bool => DataType::Bool,
                _ => DataType::Int,
            }
        };
        for o in [a, b] {
            self.check_scalar_fits("where", o, out_dt)?;
        }
        self.pointwise("where", Op::Where, smallvec![cond, a, b], out_dt)
    }

    /// Convert a tensor to `dtype`.
    pub fn cast(&mut self, x: Operand, dtype: DataType) -> Result<TvId> {
        self.pointwise("cast", Op::Cast(dtype), smallvec![x], dtype)
    }

    /// A copy of a tensor (used by caches and `set`).
    pub fn set(&mut self, x: TvId) -> Result<TvId> {
        let dt = self.tvs[x].dtype;
        self.pointwise("set", Op::Set, smallvec![Operand::Tensor(x)], dt)
    }

    /// Normalize reduction/permute dims against a rank; names the tensor on error.
    pub(crate) fn normalize_dims(&self, op_name: &str, tv: TvId, dims: &[i64], rank: usize) -> Result<Vec<usize>> {
        let mut out = Vec::with_capacity(dims.len());
        for &d in dims {
            let n = rank as i64;
            let a = if d < 0 { d + n } else { d };
            if a < 0 || a >= n {
                bail!(
                    "{op_name}: {}: axis {d} is out of range for rank {rank} (valid: {} to {})",
                    self.tv_name(tv),
                    -n,
                    n - 1
                );
            }
            if out.contains(&(a as usize)) {
                bail!("{op_name}: {}: axis {a} is listed twice", self.tv_name(tv));
            }
            out.push(a as usize);
        }
        Ok(out)
    }

    /// Reduce `x` over `dims` with `op`; `keepdim` keeps size-one axes there.
    pub fn reduction(
        &mut self,
        op: ReductionOp,
        x: TvId,
        dims: &[i64],
        keepdim: bool,
        dtype: Option<DataType>,
    ) -> Result<TvId> {
        let name = reduction_name(op);
        let inp = self.no_reduction_logical(x);
        if dims.is_empty() && !inp.is_empty() {
            bail!("{name}: {}: no axes to reduce; pass dims=[...]", self.tv_name(x));
        }
        let dims = self.normalize_dims(name, x, dims, inp.len())?;
        let in_dt = self.tvs[x].dtype;
        let out_dt = dtype.unwrap_or(match op {
            ReductionOp::Sum | ReductionOp::Prod if !in_dt.is_float() => DataType::Int,
            _ => in_dt,
        });
        if inp.is_empty() {
            // Every axis of a 0-d tensor is no axis: the reduction of its one value is that
            // value (`torch.tensor(2.).sum()`), in the result's dtype.
            if op.is_log_sum_exp() && !(in_dt.is_float() && out_dt.is_float()) {
                bail!("{name}: {}: needs a floating-point tensor, got {}", self.tv_name(x), in_dt.enum_name());
            }
            return if out_dt == in_dt { self.set(x) } else { self.cast(Operand::Tensor(x), out_dt) };
        }
        if op.is_log_sum_exp() && !(in_dt.is_float() && out_dt.is_float()) {
            bail!(
                "{name}: {}: needs a floating-point tensor and result, got {} -> {}",
                self.tv_name(x),
                in_dt.enum_name(),
                out_dt.enum_name()
            );
        }
        // A half or bfloat16 sum (or product, or log-sum-exp) accumulates in float and rounds
        // once at the end (as PyTorch does): rounding every partial result loses digits fast.
        let widened = matches!(op, ReductionOp::Sum | ReductionOp::Prod) || op.is_log_sum_exp();
        if widened && matches!(out_dt, DataType::Half | DataType::BFloat16) {
            let wide = self.cast(Operand::Tensor(x), DataType::Float)?;
            let r = self.reduction(op, wide, &dims.iter().map(|&d| d as i64).collect::<Vec<_>>(), keepdim, None)?;
            return self.cast(Operand::Tensor(r), out_dt);
        }
        let mut logical = Vec::with_capacity(inp.len());
        for (axis, &id) in inp.iter().enumerate() {
            let src = self.ids[id].clone();
            let it = if dims.contains(&axis) { IterType::Reduction } else { src.iter_type };
            logical.push(self.new_id(src.extent, it));
        }
        let init = match (op, out_dt.is_float()) {
            (ReductionOp::Max, _) if out_dt == DataType::Bool => self.scalars.boolean(false),
            (ReductionOp::Min, _) if out_dt == DataType::Bool => self.scalars.boolean(true),
            (ReductionOp::Sum, true) => self.scalars.float(0.0),
            (ReductionOp::Sum, false) => self.scalars.int(0),
            (ReductionOp::Prod, true) => self.scalars.float(1.0),
            (ReductionOp::Prod, false) => self.scalars.int(1),
            (ReductionOp::Max, true) => self.scalars.float(f64::NEG_INFINITY),
            (ReductionOp::Max, false) => {
                self.scalars.int(if out_dt == DataType::Int32 { i32::MIN as i64 } else { i64::MIN })
            }
            (ReductionOp::Min, true) => self.scalars.float(f64::INFINITY),
            (ReductionOp::LogSumExp | ReductionOp::LogSumExpFloored, _) => self.scalars.float(f64::NEG_INFINITY),
            (ReductionOp::Min, false) => {
                self.scalars.int(if out_dt == DataType::Int32 { i32::MAX as i64 } else { i64::MAX })
            }
        };
        let out = self.new_tv(out_dt, MemoryType::Local, logical);
        self.add_expr(Op::Reduction { op, init }, smallvec![Operand::Tensor(x)], out);
        if !keepdim {
            return Ok(out);
        }
        let rank = inp.len();
        let is_new: Vec<bool> = (0..rank).map(|a| dims.contains(&a)).collect();
        self.broadcast(out, is_new)
    }

    /// Insert new broadcast axes where `is_new` is true.
    pub fn broadcast(&mut self, x: TvId, is_new: Vec<bool>) -> Result<TvId> {
        let inp = self.no_reduction_logical(x);
        let n_old = is_new.iter().filter(|&&b| !b).count();
        if n_old != inp.len() {
            crate::bail_internal!("broadcast of {}: {} kept axes for rank {}", self.tv_name(x), n_old, inp.len());
        }
        let mut it = inp.into_iter();
        let mut logical = Vec::with_capacity(is_new.len());
        for &new in &is_new {
            let id = if new {
                let one = self.scalars.int(1);
                self.new_id(one, IterType::Broadcast)
            } else {
                let src = self.ids[it.next().expect("counted above")].clone();
                self.new_id(src.extent, src.iter_type)
            };
            logical.push(id);
        }
        let dt = self.tvs[x].dtype;
        let out = self.new_tv(dt, MemoryType::Local, logical);
        self.add_expr(Op::Broadcast { is_new }, smallvec![Operand::Tensor(x)], out);
        Ok(out)
    }

    /// nvFuser's `broadcast_in_dim`: input axis `i` becomes output axis `broadcast_dims[i]`.
    pub fn broadcast_in_dim(&mut self, x: TvId, shape: &[i64], broadcast_dims: &[i64]) -> Result<TvId> {
        let name = self.tv_name(x);
        let inp = self.no_reduction_logical(x);
        if broadcast_dims.len() != inp.len() {
            bail!(
                "broadcast_in_dim: {name} has rank {} but broadcast_dims has {} entries; expected one output axis per input axis",
                inp.len(),
                broadcast_dims.len()
            );
        }
        let out_rank = shape.len();
        // An axis of a computed size of at most one (`x[:, :1]` of a runtime size) asked for
        // another size is expanded, as PyTorch's expand does (checked to be one at run time).
        if broadcast_dims.len() == inp.len() {
            let axes: Vec<(usize, ValId)> = (0..inp.len())
                .filter(|&i| {
                    let d = broadcast_dims[i];
                    d >= 0
                        && (d as usize) < out_rank
                        && shape[d as usize] >= 0
                        && shape[d as usize] != 1
                        && self.computed_single(inp[i])
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|i| (i, self.scalars.int(shape[broadcast_dims[i] as usize])))
                .collect();
            if !axes.is_empty() {
                let b = self.single_axes_as_broadcasts(x, &axes)?;
                return self.broadcast_in_dim(b, shape, broadcast_dims);
            }
        }
        let mut is_new = vec![true; out_rank];
        let mut prev: i64 = -1;
        for (i, &d) in broadcast_dims.iter().enumerate() {
            if d < 0 || d as usize >= out_rank {
                bail!("broadcast_in_dim: {name} axis {i} maps to output axis {d}, out of range for output rank {out_rank}");
            }
            if d <= prev {
                bail!("broadcast_in_dim: {name}: broadcast_dims must be strictly increasing, got {broadcast_dims:?}");
            }
            prev = d;
            let s = shape[d as usize];
            if s < -1 {
                bail!("broadcast_in_dim: output axis {d} has size {s}; expected -1 or a size >= 0");
            }
            let id = inp[i];
            let in_iter = self.ids[id].iter_type;
            if let Some(e) = self.scalars.as_int(self.ids[id].extent) {
                if in_iter != IterType::Broadcast && s >= 0 && s != e {
                    bail!("broadcast_in_dim: {name} axis {i} has size {e} but output axis {d} asks for size {s}");
                }
            }
            is_new[d as usize] = false;
        }
        for (d, &s) in shape.iter().enumerate() {
            if is_new[d] && s < -1 {
                bail!("broadcast_in_dim: output axis {d} has size {s}; expected -1 or a size >= 0");
            }
        }
        let t = if is_new.iter().all(|&n| !n) {
            // Nothing to add: a copy keeps the op graph simple for the schedulers.
            self.set(x)?
        } else {
            self.broadcast(x, is_new)?
        };
        // Sizes asked for are sizes of the result (broadcast *and expand*, as nvFuser and
        // NumPy's broadcast_to): a size-one axis asked to be n is expanded to n, and an
        // input axis of symbolic size asked to be n must be n when the fusion runs. Both
        // come from selecting `t` under an all-true mask of the asked shape, whose axes
        // align with `t`'s like any element-wise operand's (-1 entries stay broadcasts).
        let logical = self.no_reduction_logical(t);
        let expands = shape.iter().zip(&logical).any(|(&s, &id)| {
            let d = &self.ids[id];
            s >= 0 && (d.iter_type == IterType::Broadcast && s != 1 || self.scalars.as_int(d.extent).is_none())
        });
        if !expands {
            return Ok(t);
        }
        let dims: Vec<ValId> = shape.iter().map(|&s| self.scalars.int(if s < 0 { 1 } else { s })).collect();
        let yes = self.scalars.boolean(true);
        let mask = self.full(&dims, Operand::Scalar(yes), DataType::Bool)?;
        // A size of one asked of an axis that is not a broadcast pins that axis to one:
        // the mask's axis iterates (a `full` of size one would broadcast and pin nothing).
        let mask_ids = self.tvs[mask].logical.clone();
        for ((&s, &id), &m) in shape.iter().zip(&logical).zip(&mask_ids) {
            if s == 1 && self.ids[id].iter_type != IterType::Broadcast {
                self.ids[m].iter_type = IterType::Iteration;
            }
        }
        self.where_(Operand::Tensor(mask), Operand::Tensor(t), Operand::Tensor(t))
    }

    /// Reorder axes: output axis `i` is input axis `dims[i]`.
    pub fn permute(&mut self, x: TvId, dims: &[i64]) -> Result<TvId> {
        let inp = self.no_reduction_logical(x);
        if dims.len() != inp.len() {
            bail!(
                "permute: {} has rank {} but dims {dims:?} has {} entries; expected a permutation of 0..{}",
                self.tv_name(x),
                inp.len(),
                dims.len(),
                inp.len()
            );
        }
        let perm = self.normalize_dims("permute", x, dims, inp.len())?;
        let mut logical = Vec::with_capacity(perm.len());
        for &p in &perm {
            let src = self.ids[inp[p]].clone();
            logical.push(self.new_id(src.extent, src.iter_type));
        }
        let dt = self.tvs[x].dtype;
        let out = self.new_tv(dt, MemoryType::Local, logical);
        self.add_expr(Op::Permute { perm }, smallvec![Operand::Tensor(x)], out);
        Ok(out)
    }

    /// `x` without its axes `dims`, each of which must have size one.
    pub fn squeeze(&mut self, x: TvId, dims: &[i64]) -> Result<TvId> {
        self.squeeze_against(x, dims, &[])
    }

    /// `squeeze`, where a squeezed axis `d` listed in `against` with an extent `e` may also
    /// have size zero when `e` is zero: it is broadcast to an axis of extent `e` after, so no
    /// element of it is read (`x[:1] + x` of an empty `x` is empty, as in NumPy).
    fn squeeze_against(&mut self, x: TvId, dims: &[i64], against: &[(usize, ValId)]) -> Result<TvId> {
        let inp = self.no_reduction_logical(x);
        let mut removed = vec![false; inp.len()];
        for d in self.normalize_dims("squeeze", x, dims, inp.len())? {
            let id = &self.ids[inp[d]];
            // A runtime size that can be one (an input's `-1` axis, or `x[:, k:k+1]` of a
            // runtime size, `min(n, k + 1) - min(n, k)`, as Thunder writes `x[:, k]`) is taken,
            // and checked to be one before a kernel runs (`lower::size_constraints`), as
            // nvFuser checks a squeezed symbolic axis when it concretizes the fusion.
            let may_be_one = self.scalars.as_int(id.extent).is_none() && self.scalars.range(id.extent).0 <= 1;
            if id.iter_type != IterType::Broadcast && self.scalars.as_int(id.extent) != Some(1) && !may_be_one {
                bail!(
                    "squeeze: axis {d} of {} has size {}; only size-one axes can be squeezed",
                    self.tv_name(x),
                    self.scalars.render(id.extent)
                );
            }
            removed[d] = true;
        }
        for (d, &id) in inp.iter().enumerate() {
            let extent = self.ids[id].extent;
            if !removed[d] || self.ids[id].iter_type == IterType::Broadcast || self.scalars.as_int(extent).is_some() {
                continue;
            }
            // A computed size is checked when the inputs are bound, before any kernel, so
            // that rewrites reading the squeezed tensor's source at index 0
            // (`canonical::squeeze_remaps`) keep the check.
            let one = self.scalars.int(1);
            let (holds, what, values) = match against.iter().find(|&&(a, _)| a == d) {
                Some(&(_, other)) => {
                    let holds = self.one_or_both_empty(extent, other);
                    let what = format!(
                        "axis {d} of {} must have size one to broadcast against size {}, or both be empty",
                        self.tv_name(x),
                        self.scalars.render(other)
                    );
                    (holds, what, vec![extent, other])
                }
                None => {
                    let holds = self.scalars.binary(ScalarOp::Eq, extent, one);
                    (holds, format!("squeeze: axis {d} of {} must have size one", self.tv_name(x)), vec![extent])
                }
            };
            if !self.size_checks.iter().any(|c| c.holds == holds) {
                self.size_checks.push(crate::ir::shape_ops::SizeCheck { holds, values, what });
            }
        }
        let mut logical = Vec::new();
        for (&id, &r) in inp.iter().zip(&removed) {
            if !r {
                let src = self.ids[id].clone();
                logical.push(self.new_id(src.extent, src.iter_type));
            }
        }
        let dt = self.tvs[x].dtype;
        let out = self.new_tv(dt, MemoryType::Local, logical);
        self.add_expr(Op::Squeeze { removed }, smallvec![Operand::Tensor(x)], out);
        Ok(out)
    }

    /// "`extent` is one, or zero against an `other` of zero": `1 <= extent + (other == 0)`
    /// for an extent of at most one.
    fn one_or_both_empty(&mut self, extent: ValId, other: ValId) -> ValId {
        let (zero, one) = (self.scalars.int(0), self.scalars.int(1));
        let empty = self.scalars.binary(ScalarOp::Eq, other, zero);
        let sum = self.scalars.binary(ScalarOp::Add, extent, empty);
        self.scalars.binary(ScalarOp::Le, one, sum)
    }

    /// How binding checks a squeezed axis of a computed `extent`: `Some(true)` when it must be
    /// one, `Some(false)` when it may also be zero because it is only broadcast against
    /// empty axes then (`squeeze_against`), `None` when nothing checks it.
    pub fn squeezed_extent_check(&mut self, extent: ValId) -> Option<bool> {
        let one = self.scalars.int(1);
        let eq = self.scalars.binary(ScalarOp::Eq, extent, one);
        if self.size_checks.iter().any(|c| c.holds == eq) {
            return Some(true);
        }
        let others: Vec<(ValId, ValId)> = self
            .size_checks
            .iter()
            .filter_map(|c| match c.values[..] {
                [e, other] if e == extent => Some((c.holds, other)),
                _ => None,
            })
            .collect();
        others.into_iter().any(|(holds, other)| self.one_or_both_empty(extent, other) == holds).then_some(false)
    }

    /// Select slices of `x` along `dim` at the positions in the 1-D integer `index`.
    pub fn index_select(&mut self, x: TvId, index: TvId, dim: i64) -> Result<TvId> {
        let idx = self.no_reduction_logical(index);
        let idt = self.tvs[index].dtype;
        if !idt.is_integer() {
            bail_type!("index_select: index {} has dtype {idt}; expected Int or Int32", self.tv_name(index));
        }
        if idx.len() != 1 {
            bail!("index_select: index {} has rank {}; expected rank 1", self.tv_name(index), idx.len());
        }
        self.gather_along(x, index, dim, "index_select")
    }

    /// `out[..., i, ...] = x[..., index[..., i, ...], ...]` along `dim`: `index` has `x`'s
    /// rank and, off `dim`, `x`'s sizes, or either has size one (broadcast) where the other
    /// does not and the output takes the other's size (NumPy's take_along_axis).
    pub fn take_along_axis(&mut self, x: TvId, index: TvId, dim: i64) -> Result<TvId> {
        let inp = self.no_reduction_logical(x);
        let idx = self.no_reduction_logical(index);
        let idt = self.tvs[index].dtype;
        if !idt.is_integer() {
            bail_type!("take_along_axis: index {} has dtype {idt}; expected Int or Int32", self.tv_name(index));
        }
        if idx.len() != inp.len() {
            bail!(
                "take_along_axis: index {} has rank {} but {} has rank {}; expected the same rank",
                self.tv_name(index),
                idx.len(),
                self.tv_name(x),
                inp.len()
            );
        }
        let d = self.normalize_dims("take_along_axis", x, &[dim], inp.len())?[0];
        for (a, (&i, &t)) in idx.iter().zip(&inp).enumerate() {
            let (ie, te) = (self.ids[i].extent, self.ids[t].extent);
            // Either side may be broadcast (size one) off `dim`: the output takes the other's
            // size there, as NumPy's take_along_axis broadcasts.
            if a == d || self.ids[i].iter_type == IterType::Broadcast || self.ids[t].iter_type == IterType::Broadcast {
                continue;
            }
            if let (Some(u), Some(v)) = (self.scalars.as_int(ie), self.scalars.as_int(te)) {
                if u != v {
                    bail!(
                        "take_along_axis: axis {a} of index {} has size {u} but axis {a} of {} has {v}; off axis {d} they must agree (or the index has size one)",
                        self.tv_name(index),
                        self.tv_name(x)
                    );
                }
            }
        }
        self.gather_along(x, index, dim, "take_along_axis")
    }

    fn gather_along(&mut self, x: TvId, index: TvId, dim: i64, what: &str) -> Result<TvId> {
        let inp = self.no_reduction_logical(x);
        let idx = self.no_reduction_logical(index);
        let dim = self.normalize_dims(what, x, &[dim], inp.len())?[0];
        let sel = if idx.len() == 1 { idx[0] } else { idx[dim] };
        let full_rank_index = idx.len() == inp.len();
        let bcast = |f: &Self, id: IterDomainId| f.ids[id].iter_type == IterType::Broadcast;
        let mut logical = Vec::with_capacity(inp.len());
        for (axis, &id) in inp.iter().enumerate() {
            let src = if axis == dim {
                self.ids[sel].clone()
            } else if full_rank_index && bcast(self, id) && !bcast(self, idx[axis]) {
                // A table broadcast along an axis the index is not: the output varies with the
                // index there (an embedding's rows gathered for a [B, S] batch of ids).
                self.ids[idx[axis]].clone()
            } else {
                self.ids[id].clone()
            };
            logical.push(self.new_id(src.extent, src.iter_type));
        }
        let dt = self.tvs[x].dtype;
        let out = self.new_tv(dt, MemoryType::Local, logical);
        self.add_expr(Op::IndexSelect { dim }, smallvec![Operand::Tensor(x), Operand::Tensor(index)], out);
        Ok(out)
    }

    /// A tensor of `shape` (static sizes or scalar extents) filled with `value`.
    pub fn full(&mut self, shape: &[ValId], value: Operand, dtype: DataType) -> Result<TvId> {
        let Operand::Scalar(v) = value else {
            bail_type!("full: the fill value must be a scalar, got {}", self.describe(value));
        };
        self.check_scalar_fits("full", value, dtype)?;
        // Half and bfloat16 values are computed in float between the places they are stored
        // or cast, but a fill value is a value of the tensor's dtype (torch.full(..., 0.001,
        // dtype=half) holds 0.0010004): a constant is rounded here, a runtime scalar by a cast.
        if matches!(dtype, DataType::Half | DataType::BFloat16) {
            let constant = match self.scalars.get(v) {
                Val::Float(bits) => Some(f64::from_bits(bits)),
                Val::Int(i) => Some(i as f64),
                _ => None,
            };
            let Some(x) = constant else {
                let t = self.source("full", shape, Op::Full { value: v }, DataType::Float)?;
                return self.cast(Operand::Tensor(t), dtype);
            };
            let rounded = if dtype == DataType::Half {
                half::f16::from_f64(x).to_f64()
            } else {
                half::bf16::from_f64(x).to_f64()
            };
            let r = self.scalars.float(rounded);
            return self.source("full", shape, Op::Full { value: r }, dtype);
        }
        self.source("full", shape, Op::Full { value: v }, dtype)
    }

    /// `[start, start + step, ...]`, `length` elements of `dtype` (nvFuser's `iota`).
    pub fn iota(&mut self, length: ValId, start: Operand, step: Operand, dtype: DataType) -> Result<TvId> {
        let (Operand::Scalar(start), Operand::Scalar(step)) = (start, step) else {
            bail_type!("iota: start and step must be scalars");
        };
        if dtype == DataType::Bool {
            bail_type!("iota: dtype Bool has no arithmetic sequence; expected an integer or floating type");
        }
        if dtype.is_integer() {
            // An integer sequence steps by integers: a fractional step would be cut to an
            // integer before the first element (0.5 gave zeros).
            for (what, v) in [("start", start), ("step", step)] {
                let dt = self.scalars.dtype(v, &self.scalar_input_dtypes);
                let integral = match self.scalars.get(v) {
                    Val::Float(bits) => f64::from_bits(bits).fract() == 0.0,
                    _ => !dt.is_float(),
                };
                if !integral {
                    bail_type!(
                        "iota: {what} {} is not an integer; an {} iota needs integer start and step (use a floating dtype)",
                        self.scalars.render(v),
                        dtype.enum_name()
                    );
                }
            }
        }
        if matches!(dtype, DataType::Half | DataType::BFloat16) {
            // Each element is a value of the narrow dtype (torch.arange(..., dtype=half)), as
            // a narrow `full` holds: computed in float, rounded once.
            let t = self.source("iota", &[length], Op::Iota { start, step }, DataType::Float)?;
            return self.cast(Operand::Tensor(t), dtype);
        }
        self.source("iota", &[length], Op::Iota { start, step }, dtype)
    }

    /// Random numbers of `shape`: uniform in `[a, b)` or normal with mean `a` and
    /// standard deviation `b`, reproducible from `seed` and `offset`.
    #[allow(clippy::too_many_arguments)]
    pub fn random(
        &mut self,
        dist: RandomDist,
        shape: &[ValId],
        a: Operand,
        b: Operand,
        seed: Operand,
        offset: Operand,
        dtype: DataType,
    ) -> Result<TvId> {
        let name = match dist {
            RandomDist::Uniform => "uniform",
            RandomDist::Normal => "normal",
        };
        let (Operand::Scalar(a), Operand::Scalar(b), Operand::Scalar(seed), Operand::Scalar(offset)) =
            (a, b, seed, offset)
        else {
            bail_type!("{name}: the distribution's parameters, rng_seed and rng_offset must be scalars");
        };
        if !dtype.is_float() {
            bail_type!("{name}: dtype {dtype} is not a floating type");
        }
        for (what, v) in [("rng_seed", seed), ("rng_offset", offset)] {
            let dt = self.scalars.dtype(v, &self.scalar_input_dtypes);
            if !dt.is_integer() {
                bail_type!("{name}: {what} has dtype {dt}; expected Int");
            }
        }
        self.source(name, shape, Op::Random { dist, a, b, seed, offset }, dtype)
    }

    /// A tensor of `shape` made by the source op `op` (no tensor operands).
    pub(crate) fn source(&mut self, name: &str, shape: &[ValId], op: Op, dtype: DataType) -> Result<TvId> {
        let mut logical = Vec::with_capacity(shape.len());
        let mut count = Some(1i64);
        for &e in shape {
            if let Some(n) = self.scalars.as_int(e) {
                count = count.and_then(|c| c.checked_mul(n.max(0)));
            }
        }
        if count.is_none() {
            let dims: Vec<String> = shape.iter().map(|&e| self.scalars.render(e)).collect();
            bail!("{name}: shape [{}] has more than 2^63 elements", dims.join(", "));
        }
        for (axis, &e) in shape.iter().enumerate() {
            let dt = self.scalars.dtype(e, &self.scalar_input_dtypes);
            if !dt.is_integer() || dt == DataType::Bool {
                bail_type!(
                    "{name}: the size of axis {axis} ({}) has dtype {dt}; sizes must be Int scalars",
                    self.scalars.render(e)
                );
            }
            let it = match self.scalars.as_int(e) {
                Some(1) => IterType::Broadcast,
                Some(n) if n < 0 => bail!("{name}: axis {axis} has size {n}; expected a size >= 0"),
                _ => IterType::Iteration,
            };
            logical.push(self.new_id(e, it));
        }
        let out = self.new_tv(dtype, MemoryType::Local, logical);
        self.add_expr(op, smallvec![], out);
        Ok(out)
    }
}

/// Name of a reduction op as the Python API spells it.
pub fn reduction_name(op: ReductionOp) -> &'static str {
    match op {
        ReductionOp::Sum => "sum",
        ReductionOp::Max => "max",
        ReductionOp::Prod => "prod",
        ReductionOp::Min => "min",
        ReductionOp::LogSumExp => "logsumexp",
        ReductionOp::LogSumExpFloored => "logsumexp_floored",
    }
}

/// A constant as the op table's forms see it.
#[derive(Clone, Copy)]
enum Num {
    B(bool),
    I(i64),
    F(f64),
}

fn num(v: Val) -> Option<Num> {
    Some(match v {
        Val::Bool(b) => Num::B(b),
        Val::Int(i) => Num::I(i),
        Val::Float(bits) => Num::F(f64::from_bits(bits)),
        _ => return None,
    })
}

fn as_f64(n: Num) -> f64 {
    match n {
        Num::B(b) => f64::from(u8::from(b)),
        Num::I(i) => i as f64,
        Num::F(x) => x,
    }
}

fn as_i64(n: Num) -> i64 {
    match n {
        Num::B(b) => i64::from(b),
        Num::I(i) => i,
        Num::F(x) => x as i64,
    }
}

fn as_bool(n: Num) -> bool {
    match n {
        Num::B(b) => b,
        Num::I(i) => i != 0,
        Num::F(x) => x != 0.0,
    }
}

/// The constant `n` converted to `dt`'s category, interned.
fn constant(sc: &mut Scalars, n: Num, dt: DataType) -> ValId {
    match dt.category() {
        Category::Bool => sc.boolean(as_bool(n)),
        Category::Integer => sc.int(as_i64(n)),
        Category::Floating => sc.float(as_f64(n)),
    }
}

/// The category scalars of these constants promote to (Python's number tower).
fn promoted(ns: &[Num]) -> DataType {
    if ns.iter().any(|n| matches!(n, Num::F(_))) {
        DataType::Double
    } else if ns.iter().any(|n| matches!(n, Num::I(_))) {
        DataType::Int
    } else {
        DataType::Bool
    }
}

/// `op` of a constant, computed in double / int64 / bool as the operand promotes; None
/// when the op has no form there (the tensor path then reports it).
fn fold_unary(op: UnaryOp, sc: &mut Scalars, v: Val) -> Option<ValId> {
    let n = num(v)?;
    let dt = promoted(&[n]);
    let cd = match op.class() {
        UnaryClass::Float => DataType::Double,
        UnaryClass::Logical => DataType::Bool,
        _ => dt,
    };
    let r = match cd.category() {
        Category::Bool => Num::B(op.eval_bool(as_bool(n))?),
        Category::Integer => Num::I(op.eval_int(as_i64(n))?),
        Category::Floating => Num::F(op.eval_f64(as_f64(n))?),
    };
    let out = match op.class() {
        UnaryClass::Predicate | UnaryClass::Logical => DataType::Bool,
        _ => cd,
    };
    Some(constant(sc, r, out))
}

/// `op` of two constants (see [`fold_unary`]).
fn fold_binary(op: BinaryOp, sc: &mut Scalars, a: Val, b: Val) -> Option<ValId> {
    let (x, y) = (num(a)?, num(b)?);
    let p = promoted(&[x, y]);
    let cd = match op.class() {
        BinaryClass::Float if !p.is_float() => DataType::Double,
        BinaryClass::Logical => DataType::Bool,
        _ => p,
    };
    if op.is_comparison() {
        let r = match cd.category() {
            Category::Bool => op.compare(as_bool(x), as_bool(y))?,
            Category::Integer => op.compare(as_i64(x), as_i64(y))?,
            Category::Floating => op.compare(as_f64(x), as_f64(y))?,
        };
        return Some(sc.boolean(r));
    }
    let r = match cd.category() {
        Category::Bool => Num::B(op.eval_bool(as_bool(x), as_bool(y))?),
        Category::Integer => Num::I(op.eval_int(as_i64(x), as_i64(y))?),
        Category::Floating => Num::F(op.eval_f64(as_f64(x), as_f64(y))?),
    };
    let out = if op.class() == BinaryClass::Logical { DataType::Bool } else { cd };
    Some(constant(sc, r, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 0-d tensor computed from scalars through a long chain is recomputed at the rank of
    /// the tensor it meets, one copy per link, without recursing (the test thread's stack
    /// is 2 MiB: a recursion over the chain overflowed it).
    #[test]
    fn long_scalar_math_chains_rerank_without_recursion() {
        let mut f = Fusion::new();
        let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
        let s = f.define_scalar_input(DataType::Float);
        let mut t = f.full(&[], Operand::Scalar(s), DataType::Float).unwrap();
        let n = 50_000;
        for _ in 0..n {
            let c = f.scalars.float(1.5);
            t = f.binary(BinaryOp::Add, Operand::Tensor(t), Operand::Scalar(c)).unwrap();
        }
        let before = f.tvs.len();
        let y = f.binary(BinaryOp::Add, Operand::Tensor(x), Operand::Tensor(t)).unwrap();
        // The chain (n adds and the full) recomputed with two size-one axes, then the add.
        assert_eq!(f.tvs.len() - before, n + 2);
        let Some(e) = f.tvs[y].definition else { panic!("y has no definition") };
        let Some(r) = f.exprs[e].inputs[1].tensor() else { panic!("the chain is not a tensor operand") };
        assert_eq!(f.tvs[r].logical.len(), 2);
    }
}
