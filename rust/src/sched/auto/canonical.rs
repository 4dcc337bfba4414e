//! Canonical form of a fusion for the automatic schedulers, and the topology they refuse.
//!
//! - **Broadcasts sink towards the inputs and reductions.** `broadcast(op(a, b))` becomes
//!   `op(broadcast(a), broadcast(b))` for element-wise ops, until every broadcast reads a
//!   fusion input, a reduction or an op that cannot move (gather, permute, full). Users
//!   write `mean = sum(x) * (1/N)` or `rstd = rsqrt(var + eps)` on the reduced tensor, or
//!   cast a weight before broadcasting it; in canonical form those ops run on the full
//!   shape, so every tensor of a normalization or pointwise kernel has the kernel's rank
//!   and shares its loops. The moved op is recomputed per element: element-wise math costs
//!   nothing next to the memory traffic of these kernels. The original op stays where
//!   something else (an output) reads it. Fills, masks, iotas and random numbers are made
//!   at the broadcast's rank instead (size-one new axes keep every element's position).
//!   A value of the whole tensor computed from totals (rank 0) that several ops read stays
//!   where it is, computed once where the totals are finished: copied into each reader it
//!   would grow with readers times its chain (a gradient clip's coefficient over k
//!   tensors).
//! - **Nested reductions merge.** `sum(sum(x, [1]), [0])` (a per-row loss averaged over
//!   the rows) becomes `sum(x, [0, 1])` when nothing else reads the inner result: one
//!   reduction the schedulers cover in one kernel instead of two. Sums reassociate (the
//!   order of a reduction is unspecified anyway); max and min are exact.
//! - **Reductions read through broadcasts.** A reduction over every axis a broadcast added
//!   (`x.mean()` of a keepdim statistic) reduces the broadcast's source instead.
//! - **Partial reductions are reused.** `sum(y, [0, 1])` beside `sum(y, [1])` becomes the
//!   sum of the row sums: one pass over `y`, and the total a grid reduction of the rows in
//!   the row reduction's kernel.
//! - **Reductions of broadcasts take their readers' size beside a sibling.** Masked mean
//!   pooling, `sum(x * m[:, :, None], 1) / sum(m[:, :, None], 1)`, reduces the broadcast mask
//!   to `[B, 1]`, which the division reads along `x`'s `D`. Where every reader (through
//!   element-wise ops such as a clamp) gives such kept size-one axes one size and a sibling
//!   reduction of the same axes iterates there (`sum(x * m, 1)` over `[B, S, D]`), the mask's
//!   reduction reads the mask expanded to that size: the same loops as its sibling, so one
//!   kernel computes both instead of one per iteration space. Without such a sibling the
//!   expansion would multiply the reduction's work, so it is not made; nor where the
//!   size-one result is itself an output.
//! - **A sum of `exp(x - max(x))` becomes `exp(logsumexp(x) - max(x))`.** The log-sum-exp
//!   reduction keeps a running maximum, so it reads `x` beside the max instead of after it:
//!   where a row is too long to keep on chip, one pass over the row computes both
//!   (`lower::fuse_loops` merges the sibling loops) instead of a pass for the max and a
//!   second for the sum (softmax, log-softmax, logsumexp and cross-entropy over a
//!   vocabulary). Only for rows longer than a register-persistent schedule holds
//!   (`ROW_ON_CHIP_BYTES`), and for rows the plan streams from memory anyway (the segmenter
//!   plans again with them where a `looped_normalization` kernel took a shorter row): on
//!   chip, the row is read once anyway.
//! - **Per-row terms leave masked sums.** `sum(where(c, a - broadcast(r), 0))` over the
//!   axes `r` is constant along becomes `sum(where(c, a, 0)) - r * sum(where(c, 1, 0))`
//!   (and `+`, and `r - a`) where `r` comes from a reduction: exact in real arithmetic, and
//!   the sum then no longer waits for `r`, so one pass over the row computes both
//!   (cross-entropy's `sum(where(onehot, x - max, 0))` beside the max and the log-sum-exp).
//!   Masked sums only: an unmasked `sum(a - r)` could cancel badly. Long rows only, as
//!   above.
//! - **Gathers read inputs.** `take_along_axis(f(a, b), idx, d)` (and `index_select`) of an
//!   element-wise `f` becomes `f(take_along_axis(a, idx, d), ...)`, operands that are
//!   broadcast along `d` (a per-row max or log-sum-exp) read as they are: the gathered
//!   elements are computed from the inputs where they are picked, instead of the whole
//!   tensor being computed and stored first (cross-entropy's
//!   `take_along_axis(log_softmax(x), labels)` reads one logit per row beside the row's
//!   statistics). An operand broadcast along other axes (a bias over the vocabulary,
//!   `log_softmax(x + bias)`) is gathered from a copy of its broadcast, which reads the
//!   bias's row as a table. Where every operand is broadcast along `d`, the gather stays:
//!   it gives the result the index's length and checks the index.
//! - **Reductions skip size-one broadcast axes.** Reducing an axis of extent one changes
//!   nothing, so `sum(t, [0, 1])` of a `[B, 1]` tensor is `sum(squeeze(t), [0])`: a total
//!   over the rows that the row schedule computes in its kernel (the mean of a gathered
//!   `[B, 1]` log-probability), not a reduction over other axes than the rows'.
//! - **Squeezes sink towards the inputs.** `squeeze(op(a, b))` becomes
//!   `op(squeeze(a), squeeze(b))` for element-wise ops, and a squeeze of a permute the
//!   permute of the squeezed source, until a squeeze reads an input (a view of its buffer,
//!   `view_input_reshapes`), a remap (`squeeze_remaps`: a one-wide slice read at its
//!   column), a broadcast or a reduction. A lower-rank tensor between full-rank ones was a
//!   kernel of its own: `relu(x[:, k:k+1]).squeeze(1)` took two, box coordinates as
//!   one-wide column slices against their transposes five. A slice of a runtime size is
//!   one wide only for sizes above its start; `Fusion::squeeze` records that check, and the
//!   host makes it when the inputs are bound.
//! - **A squeeze of a broadcast is its source** when it removes exactly the axes the
//!   broadcast added (`x.max(-1, keepdim=True)` squeezed back): the per-row value is then
//!   read as such, not through a full-rank tensor a row schedule spreads over threads.
//! - **Element-wise readers read through expands.** `broadcast_in_dim(w, [B, 1, N], [2])`
//!   with a fixed `B` selects the broadcast under an all-true mask of that shape, so the
//!   expanded axis is an iteration axis of size `B`. An element-wise reader whose other
//!   operand has an iteration axis there (`x * w` with `x` of `[B, S, N]`) gets its size
//!   from that operand (the input contract still checks it is `B`) and reads the broadcast
//!   instead: otherwise a row schedule that merges `B` with `S` of size one runs the
//!   expand's `[B, 1]` rows in the loop of `x`'s `[B, S]` rows, which are the same rows
//!   only while `S` is one, and refuses. An expand that gives no axis a new size (fixed
//!   sizes of symbolic axes, as traced models write `broadcast_in_dim(labels, [B, 1], [0])`)
//!   only names sizes: every reader reads its source, a gather's index too.
//! - **Remaps take their reader's rank.** A broadcast of a slice, pad, cat or reshape is the
//!   remap at the broadcast's rank (`x + wpe[:S]` over the batch), and a squeeze of one is
//!   the remap at the squeezed rank (a QKV split into heads): the remap reads its input in
//!   the output's loops, where a lower-rank remap kept apart was a kernel of its own.
//! - **Permuted regions closed by the inverse permute drop both permutes**
//!   (`cancel_permutes`): timm's LayerNorm2d, `permute(layer_norm(permute(x, [0, 2, 3,
//!   1])), [0, 3, 1, 2])`, is the normalization over `x`'s axis 1, its weights broadcast in
//!   `x`'s order: one kernel instead of two transposes around it.
//! - **A broadcast of a broadcast is one broadcast** of the source, and a broadcast that
//!   puts back exactly the size-one axes a squeeze removed is the squeezed tensor: no
//!   lower-rank tensor is left between a source and its full-rank readers.
//! - **Gathers take their reader's rank.** A broadcast of a gather from an input table
//!   (`x + wpe[pos]` over the batch, `x * w[labels][:, None]`) is the gather of the table
//!   broadcast the same way, with the index at the new rank (size one off the gathered
//!   axis); a reshape that splits the gathered axis (ATen's embedding,
//!   `index_select(w, ids.reshape(-1), 0).view(B, S, H)`) is the gather at the reshape's
//!   rank, its index reshaped, the table broadcast along the new axes before the gathered
//!   one (whose sizes the output takes from the index, as NumPy's take_along_axis
//!   broadcasts). The broadcast table is the input's buffer at another shape
//!   (`view_gather_tables`): the rows are gathered in the output's loops instead of stored
//!   whole by a kernel of their own first. A table that is a prefix slice of an input
//!   (`logits[:, :-1]`), or a broadcast of an input that is not row-major, is read through the
//!   input's own strides instead (`view_strided_gather_tables`).
//! - **Empty outputs are fills** (`empty_outputs_to_full`): nothing computes them, so what
//!   they were computed from is neither allocated nor looped over.
//! - **Mapped extents share one symbol.** Axes the definition aligns (a running mean `[C]`
//!   added to a statistic over x's `C` axis) have sizes the input contract checks equal at
//!   run time (`host::bind`); giving them one extent symbol lets their loops be one loop.
//!   Computed extents of one class (slices of one padded axis) take its cheapest spelling:
//!   one bounds check and one index division per axis in the kernel, not one per slice.
//! - **Computed gather indices take the output's rank.** `index_select(t, ids + 1, 0)` reads
//!   a rank-1 index computed in the kernel; broadcast to `[K, 1, ...]` (size one off the
//!   selected axis) and sunk like any broadcast, its chain runs in the output's loops, one
//!   index per output row, instead of in a kernel of its own.
//! - **Self-mapping.** When one tensor is broadcast into two different positions of the
//!   same tensor (`bcast(a, [0, 1]) - bcast(a, [0, 2])`), two axes of the result map to
//!   each other through `a`: no single loop nest computes `a` once for both. Where `a` is
//!   an input (a pairwise distance of `x` with itself, a packed-sequence mask
//!   `doc[:, :, None] == doc[:, None, :]`, `x - x.T`), each broadcast or permute of it reads
//!   a view of its buffer with axes of its own (`view_self_mapped_inputs`). Otherwise
//!   schedulers refuse such a group, so the segmenter gives the two reads of `a` separate
//!   kernels.
//! - **Private broadcasts.** A tensor with broadcast axes that one reader concretizes (reads
//!   along a larger axis) while another reader, or the fusion's output, keeps them, would
//!   run in loops that mean different elements to its readers: a loop index over the
//!   concretized iteration space is not an index into the broadcast one. Each concretizing
//!   reader gets its own copy of the element-wise chain that builds the tensor (up to
//!   tensors without broadcast axes, reductions and inputs); the copies cost arithmetic
//!   only. So do readers that concretize the axes to sizes that differ (Mamba's
//!   `exp(dt)[..., None]` times `A[D, N]` and times `B[B, 1, N]`).

use rustc_hash::{FxHashMap, FxHashSet};

use crate::analysis::id_graph::IdGraph;
use crate::error::Result;
use crate::ir::mapping::logical_pairs;
use crate::ir::scalar::{ScalarOp, Val};
use crate::ir::{
    BinaryOp, DataType, ExprId, Fusion, IterDomainId, IterType, Op, Operand, ReductionOp, Symbol, TvId, UnaryOp, ValId,
    LSE_FLOOR,
};

/// Rewrite `f` (unscheduled) into canonical form; semantics are unchanged.
pub fn sink_broadcasts(f: &mut Fusion) -> Result<()> {
    // Each rewrite moves one broadcast one op closer to the inputs, so this terminates.
    'again: loop {
        for e in f.topo_exprs() {
            let Op::Broadcast { is_new } = f.exprs[e].op.clone() else { continue };
            let Some(x) = f.exprs[e].inputs[0].tensor() else { continue };
            let Some(d) = f.tvs[x].definition else { continue };
            let op = f.exprs[d].op.clone();
            // A source (fill, position mask, iota, random numbers) is made at the
            // broadcast's rank instead, its new axes of size one, so it shares the
            // consumer's loops (`broadcast(iota(V))` for a one-hot `labels == iota`). Iota
            // and random numbers are functions of the row-major position, which size-one
            // new axes keep: every element keeps its value.
            if op.is_source() {
                let old = f.exprs[e].output;
                let extents = broadcast_extents(f, old, &is_new);
                let moved = match op {
                    Op::Full { value } => f.full(&extents, Operand::Scalar(value), f.tvs[x].dtype)?,
                    Op::Mask { valid } => {
                        let at = kept_positions(f, &is_new);
                        let v = f.compose(valid, &at);
                        f.mask(&extents, v)?
                    }
                    _ => f.source("broadcast source", &extents, op, f.tvs[x].dtype)?,
                };
                replace_tensor(f, old, moved);
                f.tvs[x].uses.retain(|&u| u != e);
                continue 'again;
            }
            // A slice, pad or reshape (a remap: positions of its input) is made at the
            // broadcast's rank instead, reading the same positions: `x + wpe[:S]` broadcast
            // over the batch reads `wpe` in the output's loops, where a rank-2 slice kept
            // apart needed a kernel (and a Global copy) of its own.
            if let Op::Remap { name, index, valid } = &op {
                let Some(y) = f.exprs[d].inputs[0].tensor() else { continue };
                let old = f.exprs[e].output;
                let extents = broadcast_extents(f, old, &is_new);
                let at = kept_positions(f, &is_new);
                let index: Vec<_> = index.iter().map(|&v| f.compose(v, &at)).collect();
                let valid = valid.map(|v| f.compose(v, &at));
                let moved = f.remap(y, name, &extents, index, valid)?;
                replace_tensor(f, old, moved);
                f.tvs[x].uses.retain(|&u| u != e);
                continue 'again;
            }
            // A broadcast of a broadcast is one broadcast of the source (a bias broadcast
            // to [B, L, D] that a later broadcast takes to [B, L, D, N]): kept, the inner one
            // is a tensor of a lower rank between the source and the readers.
            if let Op::Broadcast { is_new: inner } = &op {
                let Some(y) = f.exprs[d].inputs[0].tensor() else { continue };
                let mut kept = inner.iter();
                let combined: Vec<bool> = is_new.iter().map(|&n| n || *kept.next().unwrap_or(&true)).collect();
                let old = f.exprs[e].output;
                let moved = f.broadcast(y, combined)?;
                replace_tensor(f, old, moved);
                f.tvs[x].uses.retain(|&u| u != e);
                continue 'again;
            }
            // A broadcast that puts back exactly the size-one axes a squeeze removed is the
            // squeezed tensor (a keepdim max or sum over a static size-one axis, which
            // `reduce_broadcast_axes` made a squeeze): left as it is, a rank-lower tensor
            // between two full-rank ones is a kernel of its own.
            if let Op::Squeeze { removed } = &op {
                let Some(y) = f.exprs[d].inputs[0].tensor() else { continue };
                let yl = f.no_reduction_logical(y);
                let size_one = |a: usize| f.ids[yl[a]].iter_type == IterType::Broadcast;
                if *removed == is_new && yl.len() == removed.len() && (0..yl.len()).all(|a| !removed[a] || size_one(a))
                {
                    let old = f.exprs[e].output;
                    replace_tensor(f, old, y);
                    f.tvs[x].uses.retain(|&u| u != e);
                    continue 'again;
                }
                continue;
            }
            // A gather from an input's table is made at the broadcast's rank: the table
            // broadcast the same way (read as a view of the input, `view_gather_tables`)
            // and the index at the new rank, size one off the gathered axis. `x +
            // wpe[pos]` over the batch, or `x * w[labels][:, None]`, then gather in the
            // output's loops, where the gathered rows were a kernel (and a Global copy)
            // of their own.
            if let Op::IndexSelect { dim } = op {
                let (Some(t), Some(idx)) = (f.exprs[d].inputs[0].tensor(), f.exprs[d].inputs[1].tensor()) else {
                    continue;
                };
                if !viewable_input(f, t) {
                    continue;
                }
                let old = f.exprs[e].output;
                let Some(at) = (0..is_new.len()).filter(|&a| !is_new[a]).nth(dim) else { continue };
                let table = f.broadcast(t, is_new.clone())?;
                f.note_stand_in(table, t);
                let rank_one_index = f.no_reduction_logical(idx).len() == 1;
                let index = if rank_one_index {
                    f.broadcast(idx, (0..is_new.len()).map(|a| a != at).collect())?
                } else {
                    f.broadcast(idx, is_new.clone())?
                };
                f.note_stand_in(index, idx);
                let moved = f.take_along_axis(table, index, at as i64)?;
                replace_tensor(f, old, moved);
                f.tvs[x].uses.retain(|&u| u != e);
                continue 'again;
            }
            if !op.is_elementwise() {
                continue;
            }
            if shared_total(f, x) {
                continue;
            }
            // Scalars only (`cast(S)` of a runtime size, ranked with size-one axes where a
            // tensor reads it): made at the broadcast's rank, every axis size one, as a
            // source is. Through the op, the broadcast would read a rank-0 tensor: a kernel
            // of its own.
            let xl = f.no_reduction_logical(x);
            if f.exprs[d].input_tvs().next().is_none()
                && xl.iter().all(|&id| f.ids[id].iter_type == IterType::Broadcast)
            {
                let one = f.scalars.int(1);
                let logical = (0..is_new.len()).map(|_| f.new_id(one, IterType::Broadcast)).collect();
                let moved = f.new_tv(f.tvs[x].dtype, crate::ir::MemoryType::Local, logical);
                let inputs = f.exprs[d].inputs.clone();
                f.add_expr(op, inputs, moved);
                let old = f.exprs[e].output;
                replace_tensor(f, old, moved);
                f.tvs[x].uses.retain(|&u| u != e);
                continue 'again;
            }
            let mut operands = Vec::new();
            let rank = f.no_reduction_logical(x).len();
            for o in f.exprs[d].inputs.clone() {
                operands.push(match o {
                    // A rank-0 operand of a ranked op (`iota(S) - cast(S)`) is one value for
                    // every element: every axis of the broadcast is new to it.
                    Operand::Tensor(t) if rank > 0 && f.no_reduction_logical(t).is_empty() => {
                        Operand::Tensor(f.broadcast(t, vec![true; is_new.len()])?)
                    }
                    Operand::Tensor(t) => Operand::Tensor(f.broadcast(t, is_new.clone())?),
                    s => s,
                });
            }
            let moved = replay(f, op, &operands, f.tvs[x].dtype)?;
            let old = f.exprs[e].output;
            replace_tensor(f, old, moved);
            f.tvs[x].uses.retain(|&u| u != e);
            continue 'again;
        }
        return Ok(());
    }
}

/// The extents of broadcast output `old` with its new axes at size one: the shape a source
/// or remap takes when it is made at the broadcast's rank.
fn broadcast_extents(f: &mut Fusion, old: TvId, is_new: &[bool]) -> Vec<ValId> {
    let one = f.scalars.int(1);
    f.no_reduction_logical(old).iter().zip(is_new).map(|(&id, &n)| if n { one } else { f.ids[id].extent }).collect()
}

/// The output positions of a broadcast's kept axes: source axis k is output axis kept[k],
/// for composing the source's position expressions at the broadcast's rank.
fn kept_positions(f: &mut Fusion, is_new: &[bool]) -> Vec<ValId> {
    (0..is_new.len()).filter(|&a| !is_new[a]).map(|a| f.scalars.symbol(crate::ir::Symbol::OutAxis(a as u32))).collect()
}

/// True when `x` is a value of a whole tensor computed from totals (rank 0, downstream of
/// a reduction) that several ops read: it is computed once where the totals are finished
/// (in the block that finishes them), not copied into every reader's broadcast. Copies
/// would grow with readers times the chain's length: a gradient clip over k tensors
/// copied its k-term sum of squares into each of its k scaled outputs (k^2 ops to
/// schedule, and k adds per element of every output).
fn shared_total(f: &Fusion, x: TvId) -> bool {
    f.no_reduction_logical(x).is_empty() && f.tvs[x].uses.len() >= 2 && computed_from_a_reduction(f, x)
}

/// The source of an expand, `where(full(true), a, a)` (how `broadcast_in_dim` to a fixed
/// shape gives `a`'s size-one axes their asked sizes), else None.
fn expand_source(f: &Fusion, t: TvId) -> Option<TvId> {
    let e = f.tvs[t].definition?;
    let ins = &f.exprs[e].inputs;
    if f.exprs[e].op != Op::Where || ins[1] != ins[2] {
        return None;
    }
    let mask = ins[0].tensor()?;
    let Op::Full { value } = f.exprs[f.tvs[mask].definition?].op else { return None };
    (f.scalars.get(value) == Val::Bool(true)).then_some(())?;
    ins[1].tensor()
}

/// Element-wise readers of an expand read its source where another operand gives every
/// expanded axis its size (see the module docs).
pub fn read_through_expands(f: &mut Fusion) -> Result<()> {
    for t in f.tvs.keys().collect::<Vec<_>>() {
        let Some(src) = expand_source(f, t) else { continue };
        let (te, se) = (f.no_reduction_logical(t), f.no_reduction_logical(src));
        if te.len() != se.len() {
            continue;
        }
        let bcast = |f: &Fusion, id| f.ids[id].iter_type == IterType::Broadcast;
        let expanded: Vec<usize> = (0..te.len()).filter(|&a| bcast(f, se[a]) && !bcast(f, te[a])).collect();
        // An expand that gives no axis a new size only names sizes (a fixed 9 for an input
        // size the input contract checks is 9): every reader, a gather's index too, reads the
        // source. Kept, it is a computed tensor where its source is an input's broadcast.
        let names_only = expanded.is_empty() && !f.is_output(t);
        for u in f.tvs[t].uses.clone() {
            if !names_only && (!f.exprs[u].op.is_elementwise() || matches!(f.exprs[u].op, Op::Set)) {
                continue;
            }
            let others: Vec<TvId> = f.exprs[u].inputs.iter().filter_map(|o| o.tensor()).filter(|&o| o != t).collect();
            let sized = expanded.iter().all(|&a| {
                others.iter().any(|&o| {
                    let l = f.no_reduction_logical(o);
                    l.len() == te.len() && !bcast(f, l[a])
                })
            });
            if !sized && !names_only {
                continue;
            }
            for o in f.exprs[u].inputs.iter_mut() {
                if *o == Operand::Tensor(t) {
                    *o = Operand::Tensor(src);
                }
            }
            f.tvs[t].uses.retain(|&x| x != u);
            if !f.tvs[src].uses.contains(&u) {
                f.tvs[src].uses.push(u);
            }
        }
    }
    Ok(())
}

/// `pow(x, c)` of a floating `x` by a constant `c` in {2, 3, 4} becomes multiplications
/// (`x * x * x`): `powf` costs tens of instructions and special cases per element, enough
/// to make an element-wise kernel compute-bound (GPT-2's `pow(h, 3.0)` in its GELU); the
/// products are at least as accurate (one to two roundings against powf's 8 ulp). A power
/// of 0.5 or -0.5 is `sqrt` or `rsqrt`, as PyTorch computes a scalar power of a tensor:
/// `x ** 0.5` of -inf is NaN there (powf gives +inf), and the root is correctly rounded.
pub fn expand_small_powers(f: &mut Fusion) -> Result<()> {
    for e in f.topo_exprs() {
        let Op::Binary(crate::ir::BinaryOp::Pow) = f.exprs[e].op else { continue };
        let (Some(x), Operand::Scalar(c)) = (f.exprs[e].inputs[0].tensor(), f.exprs[e].inputs[1]) else { continue };
        let k = match f.scalars.get(c) {
            crate::ir::scalar::Val::Float(b) => f64::from_bits(b),
            crate::ir::scalar::Val::Int(i) => i as f64,
            _ => continue,
        };
        let out = f.exprs[e].output;
        if !f.tvs[x].dtype.is_float()
            || f.tvs[out].dtype != f.tvs[x].dtype
            || !matches!(k, 0.5 | -0.5 | 2.0 | 3.0 | 4.0)
        {
            continue;
        }
        if k.abs() == 0.5 {
            let root = if k > 0.0 { UnaryOp::Sqrt } else { UnaryOp::Rsqrt };
            let moved = f.unary(root, Operand::Tensor(x))?;
            replace_tensor(f, out, moved);
            f.tvs[x].uses.retain(|&u| u != e);
            continue;
        }
        let mul = crate::ir::BinaryOp::Mul;
        let sq = f.binary(mul, Operand::Tensor(x), Operand::Tensor(x))?;
        let moved = match k as i64 {
            2 => sq,
            3 => f.binary(mul, Operand::Tensor(sq), Operand::Tensor(x))?,
            _ => f.binary(mul, Operand::Tensor(sq), Operand::Tensor(sq))?,
        };
        replace_tensor(f, out, moved);
        f.tvs[x].uses.retain(|&u| u != e);
    }
    Ok(())
}

/// Move every remap (slice, pad, cat, reshape) to the fusion inputs and reductions it reads
/// through element-wise ops, broadcasts, squeezes, permutes, masks and fills:
/// `slice(neg(x))` becomes `neg(slice(x))`, which reads `x` in the consumer's kernel instead
/// of a Global copy of `neg(x)`. The moved ops run at the remapped positions (recomputed
/// where something else reads them too); where a remap's guard fails, its value was
/// unspecified before and stays so.
pub fn sink_remaps(f: &mut Fusion) -> Result<()> {
    sink_remaps_at(f, None).map(|_| ())
}

/// [`sink_remaps`] for the sizes at hand (`values`, of the symbolic extents `i{n}`): a
/// remap of a `where` whose condition is a mask (a `cat`'s parts, a padded region) that
/// the remapped positions decide reads the branch taken alone, and a remap that reads its
/// tensor unchanged is dropped. `slice(cat([a, b, c], 1), [0, 1], [None, 2])` is then `b`
/// itself, not a `where` over every part, each part recomputed at the slice's positions
/// (chained, as an unrolled recurrence that splits and joins its state every step does,
/// that recomputation grows with every step). Where only the sizes at hand decide a
/// branch (parts of runtime sizes), their extents are returned: the plan holds for them
/// alone.
pub fn sink_remaps_at(f: &mut Fusion, values: Option<&[i64]>) -> Result<Vec<(u32, i64)>> {
    let mut pins: Vec<(u32, i64)> = Vec::new();
    // Moving a remap through a tensor that something else reads too recomputes its op, and
    // chained stencils (shifted slices of shifted slices of computed tensors: repeated
    // pooling, unrolled finite differences) multiply the recomputed ops at every level,
    // k^depth of them. Past this many new exprs such remaps stay where they are: the tensor
    // they read is computed once, in a kernel of its own.
    let limit = f.exprs.len() + f.topo_exprs().len() + 256;
    // The same remap of the same tensor (a slice of a recurrence's state taken again one
    // step later, through the step's update) is moved once: later ones read the first's
    // result. `replaced` follows a result that was itself moved on.
    let mut memo: FxHashMap<RemapKey, TvId> = FxHashMap::default();
    let mut replaced: FxHashMap<TvId, TvId> = FxHashMap::default();
    'again: loop {
        for e in f.topo_exprs() {
            let Op::Remap { name, index, valid } = f.exprs[e].op.clone() else { continue };
            let Some(x) = f.exprs[e].inputs[0].tensor() else { continue };
            let out = f.exprs[e].output;
            let extents: Vec<_> = f.no_reduction_logical(out).iter().map(|&id| f.ids[id].extent).collect();
            let key: RemapKey = (x, index.clone(), valid, extents.clone());
            let moved = if let Some(&m) = memo.get(&key) {
                let mut m = m;
                while let Some(&n) = replaced.get(&m) {
                    m = n;
                }
                if m == out {
                    continue;
                }
                m
            } else if reads_unchanged(f, x, out, &index, valid, values, &mut pins) {
                x
            } else if let Some(t) = as_expand(f, x, &index, valid, &extents, values, &mut pins)? {
                t
            } else {
                let Some(d) = f.tvs[x].definition else { continue };
                if let Some(t) = branch_taken(f, d, &index, &extents, valid, values, &mut pins) {
                    let at = broadcast_axes_at_zero(f, t, &index);
                    f.remap(t, name, &extents, at, valid)?
                } else if f.tvs[x].uses.len() > 1 && f.exprs.len() > limit {
                    continue;
                } else {
                    match move_through(f, e, d, x, name, &index, valid, &extents)? {
                        Some(t) => t,
                        None => continue,
                    }
                }
            };
            replace_tensor(f, out, moved);
            f.tvs[x].uses.retain(|&u| u != e);
            replaced.insert(out, moved);
            memo.insert(key, moved);
            continue 'again;
        }
        pins.sort_unstable();
        pins.dedup();
        return Ok(pins);
    }
}

/// A remap's source, positions, guard and extents: what it reads, as a memo key.
type RemapKey = (TvId, Vec<ValId>, Option<ValId>, Vec<ValId>);

/// Remap `e` (`name`) of `x`, defined by `d`, at positions `index`, guarded by `valid`, to
/// `extents`, moved through `d` to what `d` reads; None where `d` is an op it does not
/// move through.
#[allow(clippy::too_many_arguments)]
fn move_through(
    f: &mut Fusion,
    e: ExprId,
    d: ExprId,
    x: TvId,
    name: &'static str,
    index: &[ValId],
    valid: Option<ValId>,
    extents: &[ValId],
) -> Result<Option<TvId>> {
    let xl = f.no_reduction_logical(x);
    let op = f.exprs[d].op.clone();
    let operands = f.exprs[d].inputs.clone();
    let moved = match op {
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_) | Op::Set if !xl.is_empty() => {
            let mut moved_operands = Vec::with_capacity(operands.len());
            for o in operands {
                moved_operands.push(match o {
                    Operand::Tensor(t) if !f.no_reduction_logical(t).is_empty() => {
                        let at = broadcast_axes_at_zero(f, t, index);
                        Operand::Tensor(f.remap(t, name, extents, at, valid)?)
                    }
                    o => o,
                });
            }
            let v = replay(f, op, &moved_operands, f.tvs[x].dtype)?;
            if f.no_reduction_logical(v).is_empty() && !extents.is_empty() {
                // Math on scalars alone (`pow(sigma_max, 1 / rho)` broadcast, then
                // padded) replays as a 0-d tensor: expanded to the remap's shape
                // (`where(true, v, v)`), it keeps its place in its readers' loops.
                let yes = f.scalars.boolean(true);
                let all = f.full(extents, Operand::Scalar(yes), DataType::Bool)?;
                f.where_(Operand::Tensor(all), Operand::Tensor(v), Operand::Tensor(v))?
            } else {
                v
            }
        }
        Op::Broadcast { is_new } => {
            let y = operands[0].tensor().expect("broadcast reads a tensor");
            let at: Vec<_> = index.iter().zip(&is_new).filter(|(_, &n)| !n).map(|(&v, _)| v).collect();
            f.remap(y, name, extents, at, valid)?
        }
        Op::Squeeze { removed } => {
            let y = operands[0].tensor().expect("squeeze reads a tensor");
            let zero = f.scalars.int(0);
            let mut kept = index.iter().copied();
            let at: Vec<_> = removed.iter().map(|&r| if r { zero } else { kept.next().unwrap_or(zero) }).collect();
            f.remap(y, name, extents, at, valid)?
        }
        Op::Permute { perm } => {
            let y = operands[0].tensor().expect("permute reads a tensor");
            let mut at = index.to_vec();
            for (i, &src) in perm.iter().enumerate() {
                at[src] = index[i];
            }
            f.remap(y, name, extents, at, valid)?
        }
        Op::Full { value } => f.full(extents, Operand::Scalar(value), f.tvs[x].dtype)?,
        // An iota or random numbers are functions of the row-major position, which a
        // reshape keeps: made at the new shape, each element keeps its value.
        Op::Iota { .. } | Op::Random { .. } if pure_reshape(f, e) => {
            f.source("reshaped source", extents, op, f.tvs[x].dtype)?
        }
        Op::Iota { start, step } => match remapped_iota(f, x, start, step, index, extents)? {
            Some(t) => t,
            None => match indexed_iota(f, x, start, step, index, extents)? {
                Some(t) => t,
                None => return Ok(None),
            },
        },
        Op::Mask { valid: m } => {
            let at = f.compose(m, index);
            f.mask(extents, at)?
        }
        Op::IndexSelect { dim } => match reshaped_gather(f, e, d, dim, index, extents)? {
            Some(t) => t,
            None => return Ok(None),
        },
        _ => return Ok(None),
    };
    Ok(Some(moved))
}

/// Whether condition `cond` on the positions of a tensor of `extents` (`OutAxis(k)` in
/// `[0, extents[k])`) holds at every position (`Some(true)`) or at none (`Some(false)`).
/// Decided by bounds alone where they tell (sizes unknown); else from the sizes at hand
/// (`values`), whose symbols that `cond` or `extents` read then go to `pins`.
fn decide_everywhere(
    f: &Fusion,
    cond: ValId,
    extents: &[ValId],
    given: Option<ValId>,
    values: Option<&[i64]>,
    pins: &mut Vec<(u32, i64)>,
) -> Option<bool> {
    let sc = &f.scalars;
    let attempt = |sizes: &dyn Fn(Symbol) -> Option<(i64, i64)>| -> Option<bool> {
        let mut axes = Vec::with_capacity(extents.len());
        for &e in extents {
            let (_, hi) = sc.interval(e, sizes)?;
            axes.push((0, if hi == i64::MAX { hi } else { (hi - 1).max(0) }));
        }
        if let Some(g) = given {
            narrow_to(sc, g, sizes, &mut axes);
        }
        let env = |s: Symbol| match s {
            Symbol::OutAxis(k) => axes.get(k as usize).copied(),
            s => sizes(s),
        };
        match sc.interval(cond, &env)? {
            (1, 1) => Some(true),
            (0, 0) => Some(false),
            _ => None,
        }
    };
    let unknown = |s: Symbol| matches!(s, Symbol::Extent(_)).then_some((0, i64::MAX));
    if let Some(b) = attempt(&unknown) {
        return Some(b);
    }
    let values = values?;
    let at_hand = |s: Symbol| match s {
        Symbol::Extent(n) => values.get(n as usize).map(|&v| (v, v)),
        _ => None,
    };
    let b = attempt(&at_hand)?;
    let mut syms = FxHashSet::default();
    for &v in std::iter::once(&cond).chain(extents).chain(&given) {
        crate::lower::predicate::symbols(sc, v, &mut syms);
    }
    for s in syms {
        if let Symbol::Extent(n) = s {
            pins.push((n, values[n as usize]));
        }
    }
    Some(b)
}

/// Narrow the bounds `axes` of the positions (`OutAxis(k)`) to where `given` holds, by its
/// conjuncts that bound one position against sizes: `lo <= o + c`, `o + c < hi` (the guard
/// of a cat's part or of a pad). An empty range means no position satisfies `given`.
fn narrow_to(
    sc: &crate::ir::Scalars,
    given: ValId,
    sizes: &dyn Fn(Symbol) -> Option<(i64, i64)>,
    axes: &mut [(i64, i64)],
) {
    // `o + c` as (k, c).
    let position = |v: ValId| -> Option<(usize, i64)> {
        match sc.get(v) {
            Val::Symbol(Symbol::OutAxis(k)) => Some((k as usize, 0)),
            Val::Binary(op @ (ScalarOp::Add | ScalarOp::Sub), a, b) => {
                let Val::Symbol(Symbol::OutAxis(k)) = sc.get(a) else { return None };
                let c = sc.as_int(b)?;
                Some((k as usize, if op == ScalarOp::Add { c } else { c.checked_neg()? }))
            }
            _ => None,
        }
    };
    match sc.get(given) {
        Val::Binary(ScalarOp::And, a, b) => {
            narrow_to(sc, a, sizes, axes);
            narrow_to(sc, b, sizes, axes);
        }
        Val::Binary(op @ (ScalarOp::Le | ScalarOp::Lt), l, r) => {
            let strict = i64::from(op == ScalarOp::Lt);
            if let (Some((k, c)), Some((_, hi))) = (position(l), sc.interval(r, sizes)) {
                // o + c <= hi - strict
                if let Some(a) = axes.get_mut(k) {
                    if hi != i64::MAX {
                        a.1 = a.1.min(hi.saturating_sub(strict).saturating_sub(c));
                    }
                }
            } else if let (Some((lo, _)), Some((k, c))) = (sc.interval(l, sizes), position(r)) {
                // lo + strict <= o + c
                if let Some(a) = axes.get_mut(k) {
                    a.0 = a.0.max(lo.saturating_add(strict).saturating_sub(c));
                }
            }
        }
        _ => {}
    }
}

/// Whether `out`, a remap of `x` at positions `index` (guarded by `valid`), reads `x`
/// unchanged: every axis at its own position, every position valid, the sizes and kinds
/// (broadcast or not) of `x`'s axes. (A one-element slice of an input of one element is a
/// broadcast its readers expand; the input's axis is not.)
fn reads_unchanged(
    f: &mut Fusion,
    x: TvId,
    out: TvId,
    index: &[ValId],
    valid: Option<ValId>,
    values: Option<&[i64]>,
    pins: &mut Vec<(u32, i64)>,
) -> bool {
    let (xl, ol) = (f.no_reduction_logical(x), f.no_reduction_logical(out));
    if xl.len() != ol.len() || index.len() != ol.len() {
        return false;
    }
    if xl
        .iter()
        .zip(&ol)
        .any(|(&a, &b)| (f.ids[a].iter_type == IterType::Broadcast) != (f.ids[b].iter_type == IterType::Broadcast))
    {
        return false;
    }
    let own: Vec<ValId> = xl.iter().map(|&id| f.ids[id].extent).collect();
    let extents: Vec<ValId> = ol.iter().map(|&id| f.ids[id].extent).collect();
    // The sizes as spelled: a slice's computed size (`min(1, i0)`, which a squeeze may take
    // as one) does not become an input's own size, even where the two agree at hand.
    if own != extents {
        return false;
    }
    let extents = extents.as_slice();
    for (k, &at) in index.iter().enumerate() {
        if f.scalars.get(at) != Val::Symbol(Symbol::OutAxis(k as u32)) {
            return false;
        }
    }
    let mut found = Vec::new();
    if let Some(c) = valid {
        if decide_everywhere(f, c, extents, None, values, &mut found) != Some(true) {
            return false;
        }
    }
    pins.extend(found);
    true
}

/// A remap of `x` at positions `index` (guarded by `valid`) to `extents` that reads each
/// axis of `x` either unchanged or, where `x` has size one, at position 0 wherever `valid`
/// holds: `x` expanded to `extents` (`where(true, x, x)`, which element-wise readers see
/// through), not a remap to move through `x`'s definition. A `cat`'s part of size one
/// (`cat([dx, dy, dz], 1)` of `[B, 1]` columns) then reads that part as computed once, where
/// moving the remap would recompute all that the part reads, at the cat's positions (in a
/// recurrence, every step's history again per part: exponential in the steps). None
/// where any axis is read otherwise (then `reads_unchanged` or moving applies).
fn as_expand(
    f: &mut Fusion,
    x: TvId,
    index: &[ValId],
    valid: Option<ValId>,
    extents: &[ValId],
    values: Option<&[i64]>,
    pins: &mut Vec<(u32, i64)>,
) -> Result<Option<TvId>> {
    let xl = f.no_reduction_logical(x);
    if xl.len() != extents.len() || index.len() != extents.len() || extents.is_empty() {
        return Ok(None);
    }
    let zero = f.scalars.int(0);
    let mut found = Vec::new();
    let mut expanded = false;
    for k in 0..xl.len() {
        let own = f.ids[xl[k]].extent;
        // (the remap's axis is a broadcast exactly where its size is the constant one)
        let kinds_match = (f.ids[xl[k]].iter_type == IterType::Broadcast) == (f.scalars.as_int(extents[k]) == Some(1));
        if f.scalars.get(index[k]) == Val::Symbol(Symbol::OutAxis(k as u32)) && kinds_match && own == extents[k] {
            continue;
        }
        if f.ids[xl[k]].iter_type != IterType::Broadcast || f.scalars.as_int(own) != Some(1) {
            return Ok(None);
        }
        let at_zero = f.scalars.binary(ScalarOp::Eq, index[k], zero);
        if decide_everywhere(f, at_zero, extents, valid, values, &mut found) != Some(true) {
            return Ok(None);
        }
        expanded = true;
    }
    if !expanded {
        return Ok(None);
    }
    pins.extend(found);
    let yes = f.scalars.boolean(true);
    let all = f.full(extents, Operand::Scalar(yes), DataType::Bool)?;
    Ok(Some(f.where_(Operand::Tensor(all), Operand::Tensor(x), Operand::Tensor(x))?))
}

/// The branch `where` expr `d` takes at every position of a remap of its output (at
/// positions `index`, to `extents`) where the remap's guard `valid` holds, where its
/// condition is a mask those positions decide (elsewhere the remap's value is unspecified):
/// the tensor of that branch, of the `where`'s dtype and rank. None otherwise.
fn branch_taken(
    f: &mut Fusion,
    d: ExprId,
    index: &[ValId],
    extents: &[ValId],
    valid: Option<ValId>,
    values: Option<&[i64]>,
    pins: &mut Vec<(u32, i64)>,
) -> Option<TvId> {
    if !matches!(f.exprs[d].op, Op::Where) {
        return None;
    }
    let m = f.exprs[d].inputs[0].tensor()?;
    let Op::Mask { valid: cond } = f.exprs[f.tvs[m].definition?].op else { return None };
    let at = broadcast_axes_at_zero(f, m, index);
    let cond = f.compose(cond, &at);
    let mut found = Vec::new();
    let taken = decide_everywhere(f, cond, extents, valid, values, &mut found)?;
    let t = f.exprs[d].inputs[if taken { 1 } else { 2 }].tensor()?;
    let x = f.exprs[d].output;
    if f.tvs[t].dtype != f.tvs[x].dtype || f.no_reduction_logical(t).len() != index.len() {
        return None;
    }
    pins.extend(found);
    Some(t)
}

/// A slice, pad or cat of an iota `x` that varies along one axis, where that axis is read
/// at an affine function `a * o + b` of one output position `o`: the iota itself, made
/// along that output axis with the start and step moved by `b` and scaled by `a`, size one
/// along the others. `cat([x + arange(W), x], 1)`, `arange(S)[1:]` or `F.pad(linspace(..),
/// (0, 1))` then share their consumer's loops; a remap would read a Global copy of the iota.
/// Integer iotas keep their values exactly; a float iota with `b != 0` or `a != 1` is left
/// to `indexed_iota`, which computes its position before its value. Positions past a pad's or cat's guard took an
/// unspecified value before and take the iota's now. None where the positions are
/// anything else or the iota is boolean.
fn remapped_iota(
    f: &mut Fusion,
    x: TvId,
    start: ValId,
    step: ValId,
    index: &[ValId],
    extents: &[ValId],
) -> Result<Option<TvId>> {
    let dtype = f.tvs[x].dtype;
    if !numeric_iota(dtype) {
        return Ok(None);
    }
    let xl = f.no_reduction_logical(x);
    let varying: Vec<usize> = (0..xl.len()).filter(|&a| f.ids[xl[a]].iter_type != IterType::Broadcast).collect();
    let j = match varying[..] {
        // One element: its value wherever the remap reads it.
        [] => return Ok(Some(f.full(extents, Operand::Scalar(start), dtype)?)),
        [j] => j,
        _ => return Ok(None),
    };
    let Some(&at) = index.get(j) else { return Ok(None) };
    let mut syms = FxHashSet::default();
    crate::lower::predicate::symbols(&f.scalars, at, &mut syms);
    let axes: Vec<u32> = syms.iter().filter_map(|s| if let Symbol::OutAxis(k) = s { Some(*k) } else { None }).collect();
    let [k] = axes[..] else { return Ok(None) };
    let o = Symbol::OutAxis(k);
    let Some((a, b)) = affine_in(f, at, o) else { return Ok(None) };
    let k = k as usize;
    let one = f.scalars.int(1);
    let shape: Vec<ValId> = (0..extents.len()).map(|i| if i == k { extents[i] } else { one }).collect();
    let (start2, step2) = if dtype.is_integer() {
        let sb = f.scalars.mul(step, b);
        (f.scalars.add(start, sb), f.scalars.mul(step, a))
    } else if f.scalars.is_const(a, 1) && f.scalars.is_const(b, 0) {
        (start, step)
    } else {
        // A float start moved by `b * step` rounds differently from the iota's own
        // `start + i * step` (an `arange(0.5, -0.5, -0.1)` padded by 42 read 4.7 - 0.1 * 47
        // as -2.6e-7 for -7.5e-9): `indexed_iota` computes the position first, exactly.
        return Ok(None);
    };
    let made = f.source("remapped iota", &shape, Op::Iota { start: start2, step: step2 }, dtype)?;
    Ok(Some(expanded_to(f, made, &shape, extents)?))
}

/// `made` (of `shape`, size one where it does not vary) expanded to the remap's `extents`
/// (`where(true, v, v)`, which `read_through_expands` lets element-wise readers see
/// through), so readers keep the shapes they had; `made` itself where the shapes agree.
fn expanded_to(f: &mut Fusion, made: TvId, shape: &[ValId], extents: &[ValId]) -> Result<TvId> {
    if shape == extents {
        return Ok(made);
    }
    let yes = f.scalars.boolean(true);
    let all = f.full(extents, Operand::Scalar(yes), DataType::Bool)?;
    f.where_(Operand::Tensor(all), Operand::Tensor(made), Operand::Tensor(made))
}

/// An iota `x` read at positions `index` that are not affine in one output position (the
/// `o / 2` of `arange(n)[:, None].expand(n, 2).reshape(2 * n)`, torch's `repeat_interleave`
/// of an `arange`, or a reshape mixing several iota axes): its row-major position at
/// `index`, computed element-wise from an int64 iota per output axis, scaled by the step
/// and moved by the start (in the compute type, as the iota computes its value), so the
/// iota shares its consumer's loops instead of being stored whole for a remap to read.
/// None for a boolean iota or an index with an op that has no element-wise form.
fn indexed_iota(
    f: &mut Fusion,
    x: TvId,
    start: ValId,
    step: ValId,
    index: &[ValId],
    extents: &[ValId],
) -> Result<Option<TvId>> {
    let dtype = f.tvs[x].dtype;
    if !numeric_iota(dtype) {
        return Ok(None);
    }
    let xl = f.no_reduction_logical(x);
    if index.len() != xl.len() {
        return Ok(None);
    }
    let mut lin = f.scalars.int(0);
    for (a, &id) in xl.iter().enumerate() {
        if f.ids[id].iter_type == IterType::Broadcast {
            continue;
        }
        let scaled = f.scalars.mul(lin, f.ids[id].extent);
        lin = f.scalars.add(scaled, index[a]);
    }
    let mut memo = FxHashMap::default();
    let Some(pos) = index_values(f, lin, extents, &mut memo)? else { return Ok(None) };
    let Operand::Tensor(pos) = pos else {
        // Positions free of the output's: one element, wherever the remap reads it.
        return Ok(None);
    };
    let made = if dtype.is_integer() {
        let scaled = f.binary(BinaryOp::Mul, Operand::Tensor(pos), Operand::Scalar(step))?;
        let v = f.binary(BinaryOp::Add, Operand::Tensor(scaled), Operand::Scalar(start))?;
        if f.tvs[v].dtype == dtype {
            v
        } else {
            f.cast(Operand::Tensor(v), dtype)?
        }
    } else {
        let cd = dtype.compute_dtype();
        let p = f.cast(Operand::Tensor(pos), cd)?;
        let scaled = f.binary(BinaryOp::Mul, Operand::Tensor(p), Operand::Scalar(step))?;
        let v = f.binary(BinaryOp::Add, Operand::Scalar(start), Operand::Tensor(scaled))?;
        if f.tvs[v].dtype == dtype {
            v
        } else {
            f.cast(Operand::Tensor(v), dtype)?
        }
    };
    Ok(Some(made))
}

/// Scalar expression `v` of output positions as element-wise int64 math over a tensor of
/// `extents`: each `OutAxis(k)` an iota along axis `k` expanded to `extents`, every other
/// leaf a scalar (an `Operand::Scalar` where the whole of `v` is one). None where `v` holds
/// an op with no element-wise form (a comparison).
fn index_values(
    f: &mut Fusion,
    v: ValId,
    extents: &[ValId],
    memo: &mut FxHashMap<ValId, Operand>,
) -> Result<Option<Operand>> {
    if let Some(&o) = memo.get(&v) {
        return Ok(Some(o));
    }
    let out = match f.scalars.get(v) {
        Val::Symbol(Symbol::OutAxis(k)) => {
            let k = k as usize;
            if k >= extents.len() {
                return Ok(None);
            }
            let one = f.scalars.int(1);
            let zero = f.scalars.int(0);
            let shape: Vec<ValId> = (0..extents.len()).map(|i| if i == k { extents[i] } else { one }).collect();
            let made = f.source("index iota", &shape, Op::Iota { start: zero, step: one }, DataType::Int)?;
            Operand::Tensor(expanded_to(f, made, &shape, extents)?)
        }
        Val::Binary(op, l, r) => {
            let (Some(a), Some(b)) = (index_values(f, l, extents, memo)?, index_values(f, r, extents, memo)?) else {
                return Ok(None);
            };
            if matches!((a, b), (Operand::Scalar(_), Operand::Scalar(_))) {
                Operand::Scalar(v)
            } else {
                // Positions are non-negative: truncating division and remainder are the
                // scalar arithmetic's floor ones.
                let bop = match op {
                    ScalarOp::Add => BinaryOp::Add,
                    ScalarOp::Sub => BinaryOp::Sub,
                    ScalarOp::Mul => BinaryOp::Mul,
                    ScalarOp::Div => BinaryOp::Div,
                    ScalarOp::Mod => BinaryOp::Fmod,
                    ScalarOp::Min => BinaryOp::Minimum,
                    ScalarOp::Max => BinaryOp::Maximum,
                    ScalarOp::CeilDiv => {
                        let one = f.scalars.int(1);
                        let bm1 = match b {
                            Operand::Scalar(bv) => Operand::Scalar(f.scalars.sub(bv, one)),
                            Operand::Tensor(bt) => {
                                Operand::Tensor(f.binary(BinaryOp::Sub, Operand::Tensor(bt), Operand::Scalar(one))?)
                            }
                        };
                        let num = f.binary(BinaryOp::Add, a, bm1)?;
                        let q = f.binary(BinaryOp::Div, Operand::Tensor(num), b)?;
                        memo.insert(v, Operand::Tensor(q));
                        return Ok(Some(Operand::Tensor(q)));
                    }
                    ScalarOp::Lt | ScalarOp::Le | ScalarOp::Eq | ScalarOp::And => return Ok(None),
                };
                Operand::Tensor(f.binary(bop, a, b)?)
            }
        }
        _ => {
            let mut syms = FxHashSet::default();
            crate::lower::predicate::symbols(&f.scalars, v, &mut syms);
            if syms.iter().any(|s| matches!(s, Symbol::OutAxis(_))) {
                return Ok(None);
            }
            Operand::Scalar(v)
        }
    };
    memo.insert(v, out);
    Ok(Some(out))
}

/// Whether an iota of `dtype` can be moved by arithmetic on its positions (not a boolean one).
fn numeric_iota(dtype: DataType) -> bool {
    (dtype.is_integer() || dtype.is_float()) && dtype != DataType::Bool
}

/// `(a, b)` with `v = a * sym + b`, where neither holds `sym`; None where `v` is not affine
/// in `sym` (a product of two terms that hold it, a division, a min).
fn affine_in(f: &mut Fusion, v: ValId, sym: Symbol) -> Option<(ValId, ValId)> {
    let zero = f.scalars.int(0);
    let one = f.scalars.int(1);
    match f.scalars.get(v) {
        Val::Symbol(s) if s == sym => Some((one, zero)),
        Val::Int(_) | Val::Symbol(_) => Some((zero, v)),
        Val::Binary(op @ (ScalarOp::Add | ScalarOp::Sub), l, r) => {
            let (a1, b1) = affine_in(f, l, sym)?;
            let (a2, b2) = affine_in(f, r, sym)?;
            Some(if op == ScalarOp::Add {
                (f.scalars.add(a1, a2), f.scalars.add(b1, b2))
            } else {
                (f.scalars.sub(a1, a2), f.scalars.sub(b1, b2))
            })
        }
        Val::Binary(ScalarOp::Mul, l, r) => {
            let (a1, b1) = affine_in(f, l, sym)?;
            let (a2, b2) = affine_in(f, r, sym)?;
            match (f.scalars.is_const(a1, 0), f.scalars.is_const(a2, 0)) {
                (true, _) => Some((f.scalars.mul(b1, a2), f.scalars.mul(b1, b2))),
                (_, true) => Some((f.scalars.mul(a1, b2), f.scalars.mul(b1, b2))),
                _ => None,
            }
        }
        _ => {
            // Anything else must not hold `sym` at all.
            let mut syms = FxHashSet::default();
            crate::lower::predicate::symbols(&f.scalars, v, &mut syms);
            (!syms.contains(&sym)).then_some((zero, v))
        }
    }
}

/// `reshape(gather(t, idx, dim))`, remap `e` of gather `d`, where the reshape splits the
/// gathered axis into k axes and keeps every other axis, as one gather at the reshape's
/// rank from an input table `t`: the index reshaped to the k axes (size one elsewhere, or
/// read at the reshape's positions where it has the gather's rank) and the table broadcast
/// along the first k - 1 of them, whose sizes the output then takes from the index. ATen's
/// embedding, `index_select(w, ids.reshape(-1), 0).view(B, S, H)`, is then one gather in the
/// output's loops instead of a gather stored whole for a reshape to read. None where the
/// reshape is anything else or the table is not an input read as a view.
fn reshaped_gather(
    f: &mut Fusion,
    e: ExprId,
    d: ExprId,
    dim: usize,
    index: &[ValId],
    extents: &[ValId],
) -> Result<Option<TvId>> {
    let (Some(t), Some(idx)) = (f.exprs[d].inputs[0].tensor(), f.exprs[d].inputs[1].tensor()) else {
        return Ok(None);
    };
    let (r, r2) = (index.len(), extents.len());
    // A table that is not row-major is viewed through its strides (`view_strided_gather_tables`).
    if !(viewable_input(f, t) || strided_viewable(f, t)) || r2 < r || !pure_reshape(f, e) {
        return Ok(None);
    }
    let k = r2 - r + 1;
    let split = dim..dim + k;
    // The reshape's output axis of each kept gather axis.
    let kept = |j: usize| if j < dim { j } else { j + k - 1 };
    let gathered = f.extents_of(f.exprs[d].output);
    for j in (0..r).filter(|&j| j != dim) {
        // (An axis of size one on both sides is read at 0, whichever run it fell in.)
        let ones = [gathered[j], extents[kept(j)], index[j]].map(|v| f.scalars.as_int(v));
        if index[j] != f.scalars.symbol(Symbol::OutAxis(kept(j) as u32)) && ones != [Some(1), Some(1), Some(0)] {
            return Ok(None);
        }
    }
    let others: FxHashSet<Symbol> = (0..r2).filter(|a| !split.contains(a)).map(|a| Symbol::OutAxis(a as u32)).collect();
    if crate::lower::predicate::mentions(&f.scalars, index[dim], &others) {
        return Ok(None);
    }
    let one = f.scalars.int(1);
    let il = f.no_reduction_logical(idx);
    let (ext, at): (Vec<ValId>, Vec<ValId>) = if il.len() == 1 {
        ((0..r2).map(|a| if split.contains(&a) { extents[a] } else { one }).collect(), vec![index[dim]])
    } else {
        let bcast: Vec<bool> = il.iter().map(|&id| f.ids[id].iter_type == IterType::Broadcast).collect();
        if bcast[dim] {
            return Ok(None);
        }
        // The gather axis each output axis comes from.
        let source = |a: usize| {
            if a < dim {
                a
            } else if a < dim + k {
                dim
            } else {
                a + 1 - k
            }
        };
        (
            (0..r2).map(|a| if bcast[source(a)] { one } else { extents[a] }).collect(),
            broadcast_axes_at_zero(f, idx, index),
        )
    };
    let new_index = f.remap(idx, "reshape", &ext, at, None)?;
    f.note_stand_in(new_index, idx);
    let last = dim + k - 1;
    let table = f.broadcast(t, (0..r2).map(|a| a >= dim && a < last).collect())?;
    f.note_stand_in(table, t);
    Ok(Some(f.take_along_axis(table, new_index, last as i64)?))
}

/// Compute a permuted region in its source's axis order where a permute back closes it:
/// `permute(f(permute(x, p)), p^-1)` for element-wise ops and reductions `f` (timm's
/// LayerNorm2d: NCHW to NHWC, a LayerNorm over C, back to NCHW) is `f` over `x` itself, its
/// reductions over the axes `p` names, its broadcast operands (a weight over C) broadcast
/// in `x`'s order. Two permutes are two transposing kernels around the rest; without them
/// the schedulers see a reduction over a middle axis (one kernel). Regions that reach an
/// output or an op other than these, or whose reductions would reorder the kept axes, stay
/// as written.
pub fn cancel_permutes(f: &mut Fusion) -> Result<()> {
    'again: loop {
        for e in f.topo_exprs() {
            let Op::Permute { perm } = f.exprs[e].op.clone() else { continue };
            let Some(x) = f.exprs[e].inputs[0].tensor() else { continue };
            let start = f.exprs[e].output;
            let Some(plan) = permuted_region(f, start, &perm) else { continue };
            // Region tensors in `x`'s order; reductions keep their outputs' order.
            let mut moved: FxHashMap<TvId, TvId> = FxHashMap::default();
            moved.insert(start, x);
            for &d in &plan.exprs {
                let out = f.exprs[d].output;
                let mut operands = Vec::new();
                for o in f.exprs[d].inputs.clone() {
                    operands.push(match o {
                        Operand::Tensor(t) if moved.contains_key(&t) => Operand::Tensor(moved[&t]),
                        Operand::Tensor(t) => {
                            let Some(relaid) = relaid_broadcast(f, t, &perm)? else {
                                crate::bail_internal!("cancel_permutes: operand {} checked above", f.tv_name(t))
                            };
                            Operand::Tensor(relaid)
                        }
                        s => s,
                    });
                }
                match f.exprs[d].op.clone() {
                    Op::Reduction { .. } => {
                        // (A region tensor has no reduced axes: the reduction's axis `i` is its.)
                        let src = operands[0].tensor().expect("a reduction reads a tensor");
                        let r = reduce_in_source_order(f, d, src, &perm);
                        replace_tensor(f, out, r);
                    }
                    op => {
                        let r = replay(f, op, &operands, f.tvs[out].dtype)?;
                        moved.insert(out, r);
                    }
                }
            }
            for &c in &plan.closers {
                let (inp, out) = (f.exprs[c].inputs[0].tensor().expect("a permute reads a tensor"), f.exprs[c].output);
                replace_tensor(f, out, moved[&inp]);
            }
            drop_dead_uses(f);
            continue 'again;
        }
        return Ok(());
    }
}

/// Reduction `d` of a tensor in the permuted order, made over `src`, the same tensor in its
/// source's order: the reduced axes are the ones `perm` names, the kept ones in `src`'s order.
fn reduce_in_source_order(f: &mut Fusion, d: ExprId, src: TvId, perm: &[usize]) -> TvId {
    let Op::Reduction { op, init } = f.exprs[d].op.clone() else { unreachable!("called on a reduction") };
    let axes: Vec<usize> = reduced_axes(f, d).into_iter().map(|i| perm[i]).collect();
    let mut logical = Vec::new();
    for (a, id) in f.no_reduction_logical(src).into_iter().enumerate() {
        let src_id = f.ids[id].clone();
        let it = if axes.contains(&a) { IterType::Reduction } else { src_id.iter_type };
        logical.push(f.new_id(src_id.extent, it));
    }
    let r = f.new_tv(f.tvs[f.exprs[d].output].dtype, crate::ir::MemoryType::Local, logical);
    f.add_expr(Op::Reduction { op, init }, smallvec::smallvec![Operand::Tensor(src)], r);
    r
}

/// What `cancel_permutes` rewrites for the permute whose output is `start`: the region's
/// element-wise ops and reductions in order, and the permutes that close it.
struct PermutedRegion {
    exprs: Vec<ExprId>,
    closers: Vec<ExprId>,
}

fn permuted_region(f: &Fusion, start: TvId, perm: &[usize]) -> Option<PermutedRegion> {
    let rank = perm.len();
    let mut inside: FxHashSet<TvId> = FxHashSet::default();
    inside.insert(start);
    let (mut exprs, mut closers) = (Vec::new(), Vec::new());
    for d in f.topo_exprs() {
        let ins: Vec<TvId> = f.exprs[d].input_tvs().collect();
        if !ins.iter().any(|t| inside.contains(t)) {
            continue;
        }
        let out = f.exprs[d].output;
        match &f.exprs[d].op {
            Op::Permute { perm: q } if q.iter().enumerate().all(|(i, &a)| perm[a] == i) => closers.push(d),
            op if op.is_elementwise() => {
                for &t in ins.iter().filter(|t| !inside.contains(t)) {
                    if !relaid_ok(f, t, perm) {
                        return None;
                    }
                }
                if f.no_reduction_logical(out).len() != rank {
                    return None;
                }
                inside.insert(out);
                exprs.push(d);
            }
            Op::Reduction { .. } => {
                // The kept axes must stay in order in `x`'s numbering: the reduction's result
                // is then the same tensor either way.
                let reduced = reduced_axes(f, d);
                let kept: Vec<usize> = (0..rank).filter(|i| !reduced.contains(i)).map(|i| perm[i]).collect();
                if kept.windows(2).any(|w| w[0] > w[1]) || f.is_output(out) {
                    return None;
                }
                exprs.push(d);
            }
            _ => return None,
        }
    }
    let escapes = inside.iter().any(|&t| f.is_output(t));
    (!closers.is_empty() && !escapes).then_some(PermutedRegion { exprs, closers })
}

/// True when operand `t` of a permuted region (in the permuted order) has a form in the
/// source's order: a broadcast whose kept axes stay in order (a weight over one axis), or a
/// tensor of rank 0.
fn relaid_ok(f: &Fusion, t: TvId, perm: &[usize]) -> bool {
    if f.no_reduction_logical(t).is_empty() {
        return true;
    }
    let Some(d) = f.tvs[t].definition else { return false };
    let Op::Broadcast { is_new } = &f.exprs[d].op else { return false };
    if is_new.len() != perm.len() {
        return false;
    }
    let kept: Vec<usize> = (0..perm.len()).filter(|&i| !is_new[i]).map(|i| perm[i]).collect();
    !kept.windows(2).any(|w| w[0] > w[1])
}

/// Operand `t` of a permuted region in the source's order (see `relaid_ok`); None where it
/// has no such form.
fn relaid_broadcast(f: &mut Fusion, t: TvId, perm: &[usize]) -> Result<Option<TvId>> {
    if !relaid_ok(f, t, perm) {
        return Ok(None);
    }
    if f.no_reduction_logical(t).is_empty() {
        return Ok(Some(t));
    }
    let d = f.tvs[t].definition.expect("checked by relaid_ok");
    let (Op::Broadcast { is_new }, Some(src)) = (f.exprs[d].op.clone(), f.exprs[d].inputs[0].tensor()) else {
        return Ok(None);
    };
    let mut relaid = vec![true; perm.len()];
    for (i, &n) in is_new.iter().enumerate() {
        relaid[perm[i]] = n;
    }
    Ok(Some(f.broadcast(src, relaid)?))
}

/// Compute what a permute leads to in its source's axis order, and store the outputs it
/// reaches permuted (`Fusion::stored_outputs`: the host hands back the same row-major array
/// of the permuted shape), in fusions with reductions, which no scheduler of reductions
/// takes with a permute inside. QK-norm written either way is then one normalization:
/// Qwen3's `rmsnorm(q.view(B, S, H, D)).transpose(1, 2)` writes each normalized row of D at
/// its `[b, h, s]` place, and Gemma3's `rmsnorm(q.view(B, S, H, D).transpose(1, 2))` reads
/// `q` as it lies; each was a transposing kernel beside the normalization, with the
/// permuted or normalized tensor stored whole in Global between them. The permute's
/// readers and everything computed from them (element-wise ops, reductions of full-rank
/// tensors, broadcasts of their results, permutes back) move to the source's order, their
/// broadcast operands laid out in it. Only permutes that keep the last axis with data last
/// are moved: rows stay contiguous in memory, where storing a tensor whose last axis moves
/// would write every element at a stride (a transpose kernel writes whole tiles).
pub fn store_output_permutes(f: &mut Fusion) -> Result<()> {
    if !f.topo_exprs().iter().any(|&e| matches!(f.exprs[e].op, Op::Reduction { .. })) {
        return Ok(());
    }
    'again: loop {
        for e in f.topo_exprs() {
            let Op::Permute { perm } = f.exprs[e].op.clone() else { continue };
            let Some(x) = f.exprs[e].inputs[0].tensor() else { continue };
            let start = f.exprs[e].output;
            let identity = perm.iter().enumerate().all(|(i, &a)| i == a);
            if identity {
                continue;
            }
            let Some(cone) = permuted_cone(f, start, &perm) else { continue };
            // A permute that moves the last axis stores every element at a stride. That
            // costs little where the tensor is a reduction's result (one element per
            // reduced row) and stays one: `x.sum(-1).transpose(0, 1)` as one kernel.
            let small_cone = || {
                reduced_result(f, x)
                    && cone.exprs.iter().all(|&d| !matches!(f.exprs[d].op, Op::Broadcast { .. } | Op::Reduction { .. }))
            };
            if !keeps_last_data_axis(f, x, &perm) && !small_cone() {
                continue;
            }
            let mut moved: FxHashMap<TvId, TvId> = FxHashMap::default();
            moved.insert(start, x);
            let mut closers = Vec::new();
            for &d in &cone.exprs {
                let out = f.exprs[d].output;
                let r = match f.exprs[d].op.clone() {
                    Op::Permute { .. } => {
                        closers.push(d);
                        continue;
                    }
                    Op::Reduction { .. } => {
                        let src = moved[&f.exprs[d].inputs[0].tensor().expect("a reduction reads a tensor")];
                        reduce_in_source_order(f, d, src, &perm)
                    }
                    Op::Broadcast { is_new } => {
                        let src = moved[&f.exprs[d].inputs[0].tensor().expect("a broadcast reads a tensor")];
                        let mut relaid = vec![false; perm.len()];
                        for (i, &n) in is_new.iter().enumerate() {
                            relaid[perm[i]] = n;
                        }
                        f.broadcast(src, relaid)?
                    }
                    op => {
                        let mut operands = Vec::new();
                        for o in f.exprs[d].inputs.clone() {
                            operands.push(match o {
                                Operand::Tensor(t) if moved.contains_key(&t) => Operand::Tensor(moved[&t]),
                                Operand::Tensor(t) => {
                                    let Some(relaid) = relaid_broadcast(f, t, &perm)? else {
                                        crate::bail_internal!(
                                            "store_output_permutes: operand {} checked above",
                                            f.tv_name(t)
                                        )
                                    };
                                    Operand::Tensor(relaid)
                                }
                                s => s,
                            });
                        }
                        replay(f, op, &operands, f.tvs[out].dtype)?
                    }
                };
                moved.insert(out, r);
            }
            for (t, axes) in cone.outputs {
                let new = f.set(moved[&t])?;
                // The stored order: `t`'s axes (positions in the permuted order, ascending)
                // as the source's axes they are, found among `new`'s (the source's order).
                let logical = f.no_reduction_logical(new);
                let mut in_source: Vec<usize> = axes.iter().map(|&a| perm[a]).collect();
                in_source.sort_unstable();
                let alloc: Vec<_> = axes
                    .iter()
                    .map(|&a| logical[in_source.iter().position(|&s| s == perm[a]).expect("an axis of t")])
                    .collect();
                let contiguity =
                    alloc.iter().map(|&id| (f.ids[id].iter_type != IterType::Broadcast).then_some(true)).collect();
                f.tvs[new].allocation = Some(alloc);
                f.tvs[new].contiguity = contiguity;
                f.tvs[new].memory = crate::ir::MemoryType::Global;
                f.note_stand_in(new, t);
                for o in f.outputs.iter_mut() {
                    if *o == t {
                        *o = new;
                    }
                }
                f.stored_outputs.push(new);
            }
            for c in closers {
                let (inp, out) = (f.exprs[c].inputs[0].tensor().expect("a permute reads a tensor"), f.exprs[c].output);
                replace_tensor(f, out, moved[&inp]);
            }
            drop_dead_uses(f);
            continue 'again;
        }
        return Ok(());
    }
}

/// True when `x` is a reduction's result or computed element-wise from such results (and
/// tensors of rank 0): it holds one element per reduced row, of at least 8 elements where
/// the reduced sizes are constants (a sum over 2 elements stored at a stride would write
/// half the input's bytes scattered).
fn reduced_result(f: &Fusion, x: TvId) -> bool {
    let Some(d) = f.tvs[x].definition else { return false };
    match &f.exprs[d].op {
        Op::Reduction { .. } => {
            let logical = &f.tvs[x].logical;
            let sizes: Option<Vec<i64>> =
                reduced_axes(f, d).into_iter().map(|a| f.scalars.as_int(f.ids[logical[a]].extent)).collect();
            sizes.is_none_or(|s| s.iter().product::<i64>() >= 8)
        }
        op if op.is_elementwise() => {
            f.exprs[d].input_tvs().all(|t| f.no_reduction_logical(t).is_empty() || reduced_result(f, t))
        }
        _ => false,
    }
}

/// True when `perm` keeps the last axis of `x` that holds data (not a broadcast) last among
/// those that do: the permuted tensor's rows are `x`'s rows.
fn keeps_last_data_axis(f: &Fusion, x: TvId, perm: &[usize]) -> bool {
    let l = f.no_reduction_logical(x);
    let data = |a: usize| f.ids[l[a]].iter_type != IterType::Broadcast;
    let last_in = (0..l.len()).rev().find(|&a| data(a));
    let last_out = perm.iter().rev().copied().find(|&a| data(a));
    l.len() == perm.len() && last_in.is_some() && last_in == last_out
}

/// What `store_output_permutes` moves for the permute whose output is `start`: every expr
/// computed from it in topological order, and the outputs among their tensors with their
/// axes (positions in the permuted order).
struct PermutedCone {
    exprs: Vec<ExprId>,
    outputs: Vec<(TvId, Vec<usize>)>,
}

/// The cone of `start` (see `store_output_permutes`), where each of its exprs has a form in
/// the source's order, and each output in it is a plain one (not aliased, viewed, stored or
/// laid out already). Each tensor of the cone is tracked by its axes as positions in the
/// permuted order: all of them, or those a reduction kept.
fn permuted_cone(f: &Fusion, start: TvId, perm: &[usize]) -> Option<PermutedCone> {
    let rank = perm.len();
    let all: Vec<usize> = (0..rank).collect();
    let mut axes: FxHashMap<TvId, Vec<usize>> = FxHashMap::default();
    axes.insert(start, all.clone());
    let mut exprs = Vec::new();
    for d in f.topo_exprs() {
        let ins: Vec<TvId> = f.exprs[d].input_tvs().collect();
        if !ins.iter().any(|t| axes.contains_key(t)) {
            continue;
        }
        let x = ins[0];
        let out = f.exprs[d].output;
        let out_axes = match &f.exprs[d].op {
            Op::Permute { perm: q } if q.iter().enumerate().all(|(i, &a)| perm[a] == i) && axes[&x] == all => {
                exprs.push(d);
                continue;
            }
            Op::Reduction { .. } if axes[&x] == all => {
                let reduced = reduced_axes(f, d);
                all.iter().copied().filter(|a| !reduced.contains(a)).collect()
            }
            Op::Broadcast { is_new } if is_new.len() == rank => {
                let kept: Vec<usize> = (0..rank).filter(|&i| !is_new[i]).collect();
                if kept != axes[&x] {
                    return None;
                }
                all.clone()
            }
            op if op.is_elementwise() => {
                let mut seen: Option<&Vec<usize>> = None;
                for &t in &ins {
                    match axes.get(&t) {
                        Some(a) if seen.is_some_and(|s| s != a) => return None,
                        Some(a) => seen = Some(a),
                        None if f.no_reduction_logical(t).is_empty() => {}
                        None if relaid_ok(f, t, perm) => {}
                        None => return None,
                    }
                }
                let a = seen.expect("a cone operand").clone();
                if f.no_reduction_logical(out).len() != a.len()
                    || (a != all && ins.iter().any(|t| !axes.contains_key(t) && !f.no_reduction_logical(*t).is_empty()))
                {
                    return None;
                }
                a
            }
            _ => return None,
        };
        axes.insert(out, out_axes);
        exprs.push(d);
    }
    let plain = |t: TvId| {
        !f.aliases.iter().any(|&(o, _)| o == t)
            && !f.output_views.iter().any(|(o, _)| *o == t)
            && !f.stored_outputs.contains(&t)
            && f.tvs[t].allocation.is_none()
    };
    let mut outputs: Vec<(TvId, Vec<usize>)> = Vec::new();
    for &t in std::iter::once(&start).chain(exprs.iter().map(|d| &f.exprs[*d].output)) {
        if !f.is_output(t) || outputs.iter().any(|(o, _)| *o == t) || !axes.contains_key(&t) {
            continue;
        }
        if !plain(t) {
            return None;
        }
        outputs.push((t, axes[&t].clone()));
    }
    Some(PermutedCone { exprs, outputs })
}

/// Give a reshape to fixed sizes the input sizes at hand where only they resolve its runs
/// of axes (fewer positions divided out of a run's): `[n, h]` viewed as `[3, 7, 33]` matches no run by its symbols (`h` may or may
/// not be 33), so every position is divided out of the row-major one, and a gather or a
/// vector load read through it stays a kernel of its own. With the sizes of this call as
/// constants (`n` 21, `h` 33) the runs are `[21] -> [3, 7]` and `[33] -> [33]`. Returns the
/// pinned extents for the plan's key: other sizes plan again (with fixed output sizes the
/// input sizes rarely change). Reshapes whose runs the symbols resolve keep them.
pub fn concretize_reshapes(f: &mut Fusion, cx: &super::Ctx) -> Result<Vec<(u32, i64)>> {
    let mut pinned: Vec<(u32, i64)> = Vec::new();
    let mut reshapes: Vec<ExprId> = Vec::new();
    for e in f.topo_exprs() {
        if matches!(f.exprs[e].op, Op::Remap { name: "reshape", valid: None, .. }) && pure_reshape(f, e) {
            reshapes.push(e);
        }
    }
    for &e in &reshapes {
        let Some(x) = f.exprs[e].inputs[0].tensor() else { continue };
        let out = f.exprs[e].output;
        let (ins, outs) = (f.extents_of(x), f.extents_of(out));
        let fixed = |f: &Fusion, v: &[ValId]| v.iter().filter(|&&e| f.scalars.as_int(e).is_some()).count();
        // Only where the user fixed some of the new sizes: a reshape of runtime sizes to
        // runtime sizes keeps one plan for every size.
        if fixed(f, &outs) == 0 || fixed(f, &ins) == ins.len() {
            continue;
        }
        let at_hand = |f: &mut Fusion, t: TvId| -> Result<Vec<ValId>> {
            Ok(super::tensor_sizes(f, cx, t)?.into_iter().map(|v| f.scalars.int(v)).collect())
        };
        let (vi, vo) = (at_hand(f, x)?, at_hand(f, out)?);
        // Input axes whose positions are divided out of a run's (a run of one input axis
        // reads it as the run's row-major position, with no division).
        let divided = |runs: Vec<(usize, usize)>| runs.iter().filter(|r| r.0 >= 2).map(|r| r.0).sum::<usize>();
        if divided(f.reshape_runs(&vi, &vo)) >= divided(f.reshape_runs(&ins, &outs)) {
            continue;
        }
        let mut syms = FxHashSet::default();
        for &v in ins.iter().chain(&outs) {
            crate::lower::predicate::symbols(&f.scalars, v, &mut syms);
        }
        let mut key: Vec<(u32, i64)> = syms
            .into_iter()
            .filter_map(|s| match s {
                Symbol::Extent(n) => cx.extents.get(n as usize).map(|&v| (n, v)),
                _ => None,
            })
            .collect();
        key.sort_unstable();
        f.specialize_extents(&key);
        pinned.extend(key);
    }
    if pinned.is_empty() {
        return Ok(pinned);
    }
    // Every reshape's positions from its sizes as they are now (pinned constants included),
    // so that each is still recognised as a plain reshape, and the runs the constants
    // resolve are used.
    for &e in &reshapes {
        let Some(x) = f.exprs[e].inputs[0].tensor() else { continue };
        let (ins, outs) = (f.extents_of(x), f.extents_of(f.exprs[e].output));
        let index = f.reshape_index(&ins, &outs);
        f.exprs[e].op = Op::Remap { name: "reshape", index, valid: None };
    }
    pinned.sort_unstable();
    pinned.dedup();
    Ok(pinned)
}

/// Read a row-major reshape of a fusion input as a view of the input's buffer
/// (`Fusion::input_views`) where the arrays are bound row-major (the layout the plan was
/// specialised on, which binding enforces): row-major, the reshape moves no element, so
/// the reshaped tensor is the input's memory at the new shape. Its readers then index it
/// as a plain tensor, with vector loads, instead of recomputing the input's position
/// through the reshape's divisions for every element (GroupNorm's
/// `x.view(N, G, C/G, H, W)`, a flattened `[B*S, H]` view).
pub fn view_input_reshapes(f: &mut Fusion) {
    for e in f.topo_exprs() {
        let Some(x) = f.exprs[e].inputs.first().and_then(|o| o.tensor()) else { continue };
        let out = f.exprs[e].output;
        let moves_nothing = pure_reshape(f, e) || squeezes_ones(f, e);
        if !viewable_input(f, x) || f.is_output(out) || !moves_nothing || !same_element_count(f, x, out) {
            continue;
        }
        make_view(f, e, x);
    }
}

/// True when `x` is a fusion input bound row-major that no output aliases: a row-major
/// reshape of it (a broadcast's new size-one axes included) is its buffer at another shape.
fn viewable_input(f: &Fusion, x: TvId) -> bool {
    let t = &f.tvs[x];
    let row_major = t.allocation.is_none()
        && t.declared_contiguity
        && t.logical.iter().zip(&t.contiguity).all(|(&id, c)| match f.ids[id].iter_type {
            IterType::Broadcast => f.scalars.as_int(f.ids[id].extent) == Some(1),
            IterType::Reduction => true,
            _ => *c == Some(true),
        });
    row_major && f.is_input(x) && !f.aliases.iter().any(|&(_, i)| i == x)
}

/// Make the output of `e` (which reads input `x` at another shape, row-major) a view of
/// `x`'s buffer (`Fusion::input_views`).
fn make_view(f: &mut Fusion, e: ExprId, x: TvId) {
    let out = f.exprs[e].output;
    f.tvs[x].uses.retain(|&u| u != e);
    let o = &mut f.tvs[out];
    o.definition = None;
    o.memory = crate::ir::MemoryType::Global;
    f.input_views.push((out, x));
}

/// A gather whose table is a broadcast of an input (made by `sink_broadcasts` and
/// `sink_remaps` moving a broadcast or reshape of the gather's result to its table) reads
/// the input's buffer at the broadcast's shape: its new axes have size one, so the
/// row-major buffer is the same. Kept a computed tensor, the table would be stored whole in
/// a kernel of its own before the gather could read it.
pub fn view_gather_tables(f: &mut Fusion) {
    for e in f.topo_exprs() {
        if !matches!(f.exprs[e].op, Op::IndexSelect { .. }) {
            continue;
        }
        let Some(table) = f.exprs[e].inputs[0].tensor() else { continue };
        let Some(d) = f.tvs[table].definition.filter(|&d| matches!(f.exprs[d].op, Op::Broadcast { .. })) else {
            continue;
        };
        let Some(x) = f.exprs[d].inputs[0].tensor() else { continue };
        if only_a_table(f, table) && viewable_input(f, x) {
            make_view(f, d, x);
        }
    }
}

/// A gather whose table is a prefix slice of an input (HF's causal-LM loss picks each label's
/// logit from `logits[:, :-1]`), or a broadcast of an input that `view_gather_tables` cannot
/// view row-major (a transposed weight), reads the input's buffer through the input's own
/// strides (`Fusion::strided_views`): a slice from index 0 keeps every element's address, a
/// new size-one axis adds none. Kept a computed tensor, the whole table was copied by a
/// kernel of its own before the gather picked one element per row.
pub fn view_strided_gather_tables(f: &mut Fusion) -> Result<()> {
    for e in f.topo_exprs() {
        if !matches!(f.exprs[e].op, Op::IndexSelect { .. }) {
            continue;
        }
        let Some(table) = f.exprs[e].inputs[0].tensor() else { continue };
        let Some(d) = f.tvs[table].definition else { continue };
        let Some(x) = f.exprs[d].inputs.first().and_then(|o| o.tensor()) else { continue };
        if !strided_viewable(f, x) {
            continue;
        }
        let rank = f.no_reduction_logical(table).len();
        let axes: Vec<Option<usize>> = match &f.exprs[d].op {
            Op::Broadcast { is_new } => {
                let mut next = 0;
                is_new
                    .iter()
                    .map(|&new| {
                        (!new).then(|| {
                            next += 1;
                            next - 1
                        })
                    })
                    .collect()
            }
            Op::Remap { index, valid: None, .. }
                if index.len() == rank
                    && f.no_reduction_logical(x).len() == rank
                    && (0..rank).all(|j| index[j] == f.scalars.symbol(Symbol::OutAxis(j as u32))) =>
            {
                (0..rank).map(Some).collect()
            }
            _ => continue,
        };
        // Read elsewhere too (the slice's log-sum-exp): the gather gets a copy of its own to view.
        let (view, d) = if only_a_table(f, table) {
            (table, d)
        } else {
            let c = recompute(f, table)?;
            f.redirect_use(e, table, c);
            (c, f.tvs[c].definition.expect("a recomputed tensor has a definition"))
        };
        make_view(f, d, x);
        f.strided_views.push((view, axes));
    }
    Ok(())
}

/// Read each permute of a fusion input that keeps the input's last axis last (size-one
/// axes aside), or that is read only under broadcasts adding a last axis, as a view of the
/// input's buffer through its strides (`Fusion::strided_views`): view axis `i` is input
/// axis `perm[i]`. The element next to each one along the last axis is still the next in
/// memory (or each element serves a row), so the reads stay coalesced, and the kernel has
/// no permute left. True when one was viewed.
pub fn view_input_permutes(f: &mut Fusion) -> bool {
    let mut any = false;
    for e in f.topo_exprs() {
        let Op::Permute { perm } = f.exprs[e].op.clone() else { continue };
        let Some(x) = f.exprs[e].inputs[0].tensor() else { continue };
        let out = f.exprs[e].output;
        if !strided_viewable(f, x) || f.is_output(out) {
            continue;
        }
        // Read only under a new last axis (`x.T[..., None] * y`): each element read serves
        // a whole row of the broadcast, so a strided read costs one load per row.
        let under_new_rows = |f: &Fusion| {
            f.tvs[out]
                .uses
                .iter()
                .all(|&u| matches!(&f.exprs[u].op, Op::Broadcast { is_new } if is_new.last() == Some(&true)))
        };
        if !keeps_last_data_axis(f, x, &perm) && !under_new_rows(f) {
            continue;
        }
        make_view(f, e, x);
        f.strided_views.push((out, perm.iter().map(|&a| Some(a)).collect()));
        any = true;
    }
    any
}

/// True when `table` is read only as gathers' table, and is not an output: a view of an
/// input's buffer can stand in for it.
fn only_a_table(f: &Fusion, table: TvId) -> bool {
    !f.is_output(table)
        && f.tvs[table]
            .uses
            .iter()
            .all(|&u| matches!(f.exprs[u].op, Op::IndexSelect { .. }) && f.exprs[u].inputs[0] == Operand::Tensor(table))
}

/// True when `x` is a fusion input that no output aliases: a view of it may read its buffer
/// through its strides (`Fusion::strided_views`), whatever its layout.
fn strided_viewable(f: &Fusion, x: TvId) -> bool {
    f.is_input(x) && !f.aliases.iter().any(|&(_, i)| i == x)
}

/// True when `a` and `b` provably hold as many elements: the products agree as constants or
/// as one interned expression, or binding checks them equal (the reshape's own size check).
/// A remap composed from a reshape and a reduction's broadcast can have the reshape's
/// positions but read only part of its input.
fn same_element_count(f: &mut Fusion, a: TvId, b: TvId) -> bool {
    let count = |f: &mut Fusion, t: TvId| {
        let ext: Vec<ValId> = f.no_reduction_logical(t).iter().map(|&id| f.ids[id].extent).collect();
        f.scalars.product(ext)
    };
    let (na, nb) = (count(f, a), count(f, b));
    if na == nb {
        return true;
    }
    if let (Some(x), Some(y)) = (f.scalars.as_int(na), f.scalars.as_int(nb)) {
        return x == y;
    }
    let eq = f.scalars.binary(crate::ir::scalar::ScalarOp::Eq, na, nb);
    f.size_checks.iter().any(|c| c.holds == eq)
}

/// True when `t` is stored row-major (no allocation domain, or its logical order): the
/// host may hand it back as a view of another row-major shape. An output stored in a
/// `stride_order` of its own is not.
fn stored_row_major(f: &Fusion, t: TvId) -> bool {
    f.tvs[t].allocation.as_ref().is_none_or(|a| {
        let logical = f.no_reduction_logical(t);
        a.iter().filter(|&&id| f.ids[id].iter_type != IterType::Reduction).eq(logical.iter())
    })
}

/// Compute an output that reshapes a tensor computed from a reduction (GroupNorm's
/// `reshape(normalize(reshape(x, [N, G, C/G, H, W])), [N, C, H, W]) * w + b`) at the
/// reshape's source shape, and let the host hand it back reshaped (`Fusion::output_views`:
/// row-major, the same elements). The element-wise ops between the reshape and the output
/// move to the source's shape (their other operands reshaped to it, which `sink_remaps`
/// then reads from the inputs). Otherwise the reshape, a remap, would read the normalized
/// tensor whole from memory: a kernel for the statistics and a second pass over `x`.
pub fn hoist_output_reshapes(f: &mut Fusion) -> Result<()> {
    for k in 0..f.outputs.len() {
        let o = f.outputs[k];
        if f.aliases.iter().any(|&(out, _)| out == o) || f.output_views.iter().any(|(t, _)| *t == o) {
            continue;
        }
        // The element-wise ops between one reshape and the output (a DAG: `y * sigmoid(y)`
        // reads the reshaped value twice), each tensor read only inside it.
        let Some((region, r)) = reshape_region(f, o) else { continue };
        let Some(y) = f.exprs[r].inputs[0].tensor() else { continue };
        let rt = f.exprs[r].output;
        // Every tensor of the region must hold the reshape's elements: an element-wise op
        // that broadcasts the reshaped tensor against a larger operand has no source-shape
        // form.
        if !pure_reshape(f, r) || !same_element_count(f, y, rt) {
            continue;
        }
        if region.iter().any(|&d| !same_element_count(f, rt, f.exprs[d].output)) || !same_element_count(f, rt, o) {
            continue;
        }
        if !after_reduction(f, y) || f.is_output(y) || (rt != o && f.is_output(rt)) || !stored_row_major(f, o) {
            continue;
        }
        let shape: Vec<ValId> = f.no_reduction_logical(y).iter().map(|&id| f.ids[id].extent).collect();
        let view: Vec<ValId> = f.no_reduction_logical(o).iter().map(|&id| f.ids[id].extent).collect();
        // Positions in the defined shape of each position in the source's.
        let rt_shape: Vec<ValId> = f.no_reduction_logical(rt).iter().map(|&id| f.ids[id].extent).collect();
        let index = f.reshape_index(&rt_shape, &shape);
        let mut moved: FxHashMap<TvId, TvId> = FxHashMap::default();
        moved.insert(rt, y);
        for &d in &region {
            let mut operands = Vec::new();
            for op in f.exprs[d].inputs.clone() {
                operands.push(match op {
                    Operand::Tensor(x) if moved.contains_key(&x) => Operand::Tensor(moved[&x]),
                    Operand::Tensor(x) => {
                        let at = broadcast_axes_at_zero(f, x, &index);
                        Operand::Tensor(f.remap(x, "reshape", &shape, at, None)?)
                    }
                    s => s,
                });
            }
            let next = replay(f, f.exprs[d].op.clone(), &operands, f.tvs[f.exprs[d].output].dtype)?;
            moved.insert(f.exprs[d].output, next);
        }
        let cur = moved[&o];
        f.outputs[k] = cur;
        f.tvs[cur].memory = crate::ir::MemoryType::Global;
        f.output_views.push((cur, view));
    }
    drop_dead_uses(f);
    Ok(())
}

/// The element-wise exprs (in topological order) between output `o` and the one reshape of a
/// computed tensor that they lead to, and that reshape, where every tensor they make (but
/// `o`) and the reshape's result are read only inside the region and are not outputs.
fn reshape_region(f: &Fusion, o: TvId) -> Option<(Vec<ExprId>, ExprId)> {
    let mut region: FxHashSet<ExprId> = FxHashSet::default();
    let mut reshape: Option<ExprId> = None;
    let mut seen: FxHashSet<TvId> = FxHashSet::default();
    let mut stack = vec![o];
    while let Some(t) = stack.pop() {
        if !seen.insert(t) {
            continue;
        }
        let d = f.tvs[t].definition?;
        match &f.exprs[d].op {
            Op::Remap { name: "reshape", valid: None, .. } => {
                if reshape.is_some_and(|r| r != d) {
                    return None;
                }
                reshape = Some(d);
            }
            op if op.is_elementwise() => {
                region.insert(d);
                stack.extend(f.exprs[d].inputs.iter().filter_map(|x| x.tensor()).filter(|&x| leads_to_reshape(f, x)));
            }
            _ => return None,
        }
    }
    let r = reshape?;
    let inside = |t: TvId| t == o || (!f.is_output(t) && f.tvs[t].uses.iter().all(|u| region.contains(u)));
    if !inside(f.exprs[r].output) || region.iter().any(|&d| !inside(f.exprs[d].output)) {
        return None;
    }
    Some((f.topo_exprs().into_iter().filter(|e| region.contains(e)).collect(), r))
}

/// `index` (positions along `t`'s axes) with `t`'s size-one broadcast axes read at 0:
/// they are broadcast against the other operands, whatever the position.
fn broadcast_axes_at_zero(f: &mut Fusion, t: TvId, index: &[ValId]) -> Vec<ValId> {
    let zero = f.scalars.int(0);
    f.no_reduction_logical(t)
        .iter()
        .zip(index)
        .map(|(&id, &v)| if f.ids[id].iter_type == IterType::Broadcast { zero } else { v })
        .collect()
}

/// True when remap `e` is a row-major reshape and nothing else: the definition composes a
/// slice or a pad with a reshape into one remap named `reshape`, whose positions then differ
/// from a plain reshape's (the scalar arena interns expressions: equal positions are equal
/// ids).
fn pure_reshape(f: &mut Fusion, e: ExprId) -> bool {
    let Op::Remap { name: "reshape", index, valid: None } = f.exprs[e].op.clone() else { return false };
    let Some(x) = f.exprs[e].inputs[0].tensor() else { return false };
    let ins: Vec<ValId> = f.no_reduction_logical(x).iter().map(|&id| f.ids[id].extent).collect();
    let out = f.exprs[e].output;
    let outs: Vec<ValId> = f.no_reduction_logical(out).iter().map(|&id| f.ids[id].extent).collect();
    // A remap of a broadcast source (`iota(5)` under a [5, 4] mask, sunk from a reshape of
    // the mask) reads fewer elements than it writes: not a reshape of its positions.
    same_element_count(f, x, out) && f.reshape_index(&ins, &outs) == index
}

/// An input read into two positions of one tensor (`doc[:, :, None] == doc[:, None, :]`, a
/// pairwise distance of `x` with itself) gives that tensor two axes that map to each other,
/// which no loop nest computes once for both (`self_mapping`). Each broadcast or permute of
/// such an input after the first reads a view of the input's buffer instead
/// (`Fusion::input_views`): the same elements, with axes of their own, read again from the
/// cache, where the shared input cost a kernel and a Global intermediate of the pairs.
pub fn view_self_mapped_inputs(f: &mut Fusion) {
    let Some(mut found) = self_mapping(f) else { return };
    for x in f.inputs.iter().filter_map(|o| o.tensor()).collect::<Vec<_>>() {
        // Every broadcast or permute reads a view, but for one where nothing else reads `x`.
        let mut placing: Vec<ExprId> = f.tvs[x]
            .uses
            .iter()
            .copied()
            .filter(|&u| matches!(f.exprs[u].op, Op::Broadcast { .. } | Op::Permute { .. }))
            .collect();
        if !placing.is_empty() && placing.len() == f.tvs[x].uses.len() {
            placing.remove(0);
        }
        if placing.is_empty() || !viewable_input(f, x) || f.is_output(x) {
            continue;
        }
        let mut g = f.clone();
        for &u in &placing {
            let axes: Vec<_> = g.tvs[x].logical.iter().map(|&id| (g.ids[id].extent, g.ids[id].iter_type)).collect();
            let logical: Vec<_> = axes.into_iter().map(|(extent, it)| g.new_id(extent, it)).collect();
            let v = g.new_tv(g.tvs[x].dtype, crate::ir::MemoryType::Global, logical);
            g.tvs[v].contiguity = g.tvs[x].contiguity.clone();
            g.tvs[v].declared_contiguity = g.tvs[x].declared_contiguity;
            g.redirect_use(u, x, v);
            g.input_views.push((v, x));
        }
        let after = self_mapping(&g);
        if after != Some(found) {
            *f = g;
            match after {
                Some(next) => found = next,
                None => return,
            }
        }
    }
}

/// Compute the outputs a squeeze of size-one axes leads to (through element-wise ops) at the
/// unsqueezed shape, and let the host hand them back viewed (`Fusion::output_views`:
/// row-major, the same elements). This is where `sink_squeezes` stops short: at a gather
/// (`-log(probs.gather(1, labels[:, None]).squeeze(1)) * w`, the pick of an NLL loss) the
/// squeeze and what follows it were a kernel of their own, reading the gathered column back
/// from Global, since one pointwise kernel iterates one rank. The other operands of the
/// moved ops get the size-one axes back by a broadcast. Values computed from a reduction
/// keep their squeeze (their schedules place the reduced axes themselves).
pub fn view_output_squeezes(f: &mut Fusion) -> Result<()> {
    'again: loop {
        for e in f.topo_exprs() {
            let Op::Squeeze { removed } = f.exprs[e].op.clone() else { continue };
            let Some(t) = f.exprs[e].inputs[0].tensor() else { continue };
            if !squeezes_ones(f, e) || f.tvs[t].definition.is_none() || computed_from_a_reduction(f, t) {
                continue;
            }
            let start = f.exprs[e].output;
            let Some((cone, outputs)) = squeezed_cone(f, start) else { continue };
            if !outputs.iter().all(|&o| stored_row_major(f, o)) {
                continue;
            }
            let mut moved: FxHashMap<TvId, TvId> = FxHashMap::default();
            moved.insert(start, t);
            for &d in &cone {
                let mut operands = Vec::new();
                for o in f.exprs[d].inputs.clone() {
                    operands.push(match o {
                        Operand::Tensor(x) if moved.contains_key(&x) => Operand::Tensor(moved[&x]),
                        Operand::Tensor(x) if f.no_reduction_logical(x).is_empty() => o,
                        Operand::Tensor(x) => Operand::Tensor(f.broadcast(x, removed.clone())?),
                        s => s,
                    });
                }
                let r = replay(f, f.exprs[d].op.clone(), &operands, f.tvs[f.exprs[d].output].dtype)?;
                moved.insert(f.exprs[d].output, r);
            }
            for o in outputs {
                let shape: Vec<ValId> = f.no_reduction_logical(o).iter().map(|&id| f.ids[id].extent).collect();
                let new = f.set(moved[&o])?;
                f.note_stand_in(new, o);
                for out in f.outputs.iter_mut() {
                    if *out == o {
                        *out = new;
                    }
                }
                f.tvs[new].memory = crate::ir::MemoryType::Global;
                f.output_views.push((new, shape));
            }
            drop_dead_uses(f);
            continue 'again;
        }
        return Ok(());
    }
}

/// The element-wise exprs (in topological order) computed from squeeze result `start`, and
/// the outputs among `start` and their results, where every reader of those tensors is one
/// of the exprs, every other operand has `start`'s rank or none, and each output is a plain
/// one (not aliased, viewed, stored or laid out already).
fn squeezed_cone(f: &Fusion, start: TvId) -> Option<(Vec<ExprId>, Vec<TvId>)> {
    let rank = f.no_reduction_logical(start).len();
    let mut inside: FxHashSet<TvId> = FxHashSet::default();
    inside.insert(start);
    let mut cone = Vec::new();
    for d in f.topo_exprs() {
        let ins: Vec<TvId> = f.exprs[d].input_tvs().collect();
        if !ins.iter().any(|t| inside.contains(t)) {
            continue;
        }
        let out = f.exprs[d].output;
        if !f.exprs[d].op.is_elementwise() || f.no_reduction_logical(out).len() != rank {
            return None;
        }
        if ins.iter().any(|&x| {
            !inside.contains(&x)
                && !matches!(f.no_reduction_logical(x).len(), 0)
                && f.no_reduction_logical(x).len() != rank
        }) {
            return None;
        }
        inside.insert(out);
        cone.push(d);
    }
    let plain = |t: TvId| {
        !f.aliases.iter().any(|&(a, _)| a == t)
            && !f.output_views.iter().any(|(v, _)| *v == t)
            && !f.stored_outputs.contains(&t)
            && f.tvs[t].allocation.is_none()
    };
    let mut outputs: Vec<TvId> = Vec::new();
    for t in std::iter::once(start).chain(cone.iter().map(|&d| f.exprs[d].output)) {
        if f.is_output(t) && !outputs.contains(&t) {
            if !plain(t) {
                return None;
            }
            outputs.push(t);
        }
    }
    (!outputs.is_empty()).then_some((cone, outputs))
}

/// True when `e` squeezes axes of constant size one: a row-major reshape.
fn squeezes_ones(f: &Fusion, e: ExprId) -> bool {
    let Op::Squeeze { removed } = &f.exprs[e].op else { return false };
    let Some(x) = f.exprs[e].inputs[0].tensor() else { return false };
    let xl = f.no_reduction_logical(x);
    xl.len() == removed.len()
        && removed.iter().zip(&xl).all(|(&gone, &id)| !gone || f.scalars.as_int(f.ids[id].extent) == Some(1))
}

/// True when `x` is a reshape of a tensor computed in the fusion, or an element-wise op
/// whose operands lead to one.
fn leads_to_reshape(f: &Fusion, x: TvId) -> bool {
    // A DAG walk with a visited set: a chain that reads each value twice would otherwise
    // be walked as a tree, 2^k paths after k steps.
    let mut seen = FxHashSet::default();
    let mut stack = vec![x];
    while let Some(t) = stack.pop() {
        if !seen.insert(t) {
            continue;
        }
        let Some(d) = f.tvs[t].definition else { continue };
        match &f.exprs[d].op {
            Op::Remap { name: "reshape", valid: None, .. }
                if f.exprs[d].inputs[0].tensor().is_some_and(|y| f.tvs[y].definition.is_some()) =>
            {
                return true;
            }
            op if op.is_elementwise() => stack.extend(f.exprs[d].inputs.iter().filter_map(|o| o.tensor())),
            _ => {}
        }
    }
    false
}

/// Merge a reduction of a reduction's result into one reduction of the inner input over
/// the axes of both, where the combiner and dtype agree and nothing else (no output, no
/// other op) reads the inner result; semantics are unchanged up to reassociation.
pub fn merge_nested_reductions(f: &mut Fusion) -> Result<()> {
    'again: loop {
        for e in f.topo_exprs() {
            let Op::Reduction { op, .. } = f.exprs[e].op else { continue };
            let Some(inner) = f.exprs[e].inputs[0].tensor() else { continue };
            let Some(d) = f.tvs[inner].definition else { continue };
            let Op::Reduction { op: inner_op, .. } = f.exprs[d].op else { continue };
            let Some(x) = f.exprs[d].inputs[0].tensor() else { continue };
            let live_uses = f.tvs[inner].uses.iter().filter(|&&u| u == e).count();
            if inner_op != op
                || f.tvs[inner].dtype != f.tvs[f.exprs[e].output].dtype
                || f.tvs[inner].dtype != f.tvs[x].dtype
                || f.is_output(inner)
                || live_uses != 1
                || f.tvs[inner].uses.len() != 1
                || computed_from_a_reduction(f, x)
            {
                continue;
            }
            // Axes of `x` that either reduction reduces: the inner one's in place, the outer
            // one's through the inner result's kept axes.
            let inner_l = f.tvs[inner].logical.clone();
            let kept: Vec<usize> =
                (0..inner_l.len()).filter(|&a| f.ids[inner_l[a]].iter_type != IterType::Reduction).collect();
            let outer_l = f.tvs[f.exprs[e].output].logical.clone();
            if outer_l.len() != kept.len() {
                continue;
            }
            let mut dims: Vec<i64> = (0..inner_l.len())
                .filter(|&a| f.ids[inner_l[a]].iter_type == IterType::Reduction)
                .map(|a| a as i64)
                .collect();
            for (k, &a) in kept.iter().enumerate() {
                if f.ids[outer_l[k]].iter_type == IterType::Reduction {
                    dims.push(a as i64);
                }
            }
            dims.sort_unstable();
            let dtype = f.tvs[x].dtype;
            let merged = f.reduction(op, x, &dims, false, Some(dtype))?;
            let old = f.exprs[e].output;
            replace_tensor(f, old, merged);
            f.tvs[inner].uses.retain(|&u| u != e);
            f.tvs[x].uses.retain(|&u| u != d);
            continue 'again;
        }
        return Ok(());
    }
}

/// A reduction over axes `D` of a tensor computed from a reduction over fewer of the same
/// positions `R` (a log-softmax over axis 1, then summed over axes 0 and 1: KL divergence
/// with `batchmean`, a label-smoothed loss) becomes a reduction over `R`, then over the
/// rest: the row schedule then computes the row sums beside its own and takes their sum as
/// a total, where one reduction over `D` was a second class of reduction (a second kernel
/// reading the row tensor back from Global). Also where another reduction reduces `R` (the
/// trailing axes) of a tensor of the same shape computed from the same inputs
/// (`sibling_row_axes`). Sums, maxima and minima only (their order of combination is free).
pub fn split_reductions_of_rows(f: &mut Fusion) -> Result<()> {
    'again: loop {
        for e in f.topo_exprs() {
            let Op::Reduction { op, .. } = f.exprs[e].op else { continue };
            if !matches!(op, ReductionOp::Sum | ReductionOp::Max | ReductionOp::Min) {
                continue;
            }
            let Some(x) = f.exprs[e].inputs[0].tensor() else { continue };
            let rank = f.no_reduction_logical(x).len();
            let outer = reduced_axes(f, e);
            if outer.len() < 2 || f.tvs[f.exprs[e].output].logical.len() != rank {
                continue;
            }
            let Some(rows) = upstream_row_axes(f, x, rank, &outer).or_else(|| sibling_row_axes(f, e, x, &outer)) else {
                continue;
            };
            let dtype = f.tvs[f.exprs[e].output].dtype;
            let inner = f.reduction(op, x, &rows.iter().map(|&a| a as i64).collect::<Vec<_>>(), false, Some(dtype))?;
            let kept: Vec<usize> = (0..rank).filter(|a| !rows.contains(a)).collect();
            let rest: Vec<i64> =
                kept.iter().enumerate().filter(|(_, a)| outer.contains(a)).map(|(i, _)| i as i64).collect();
            let total = f.reduction(op, inner, &rest, false, Some(dtype))?;
            let old = f.exprs[e].output;
            replace_tensor(f, old, total);
            f.tvs[x].uses.retain(|&u| u != e);
            continue 'again;
        }
        return Ok(());
    }
}

/// The axes an upstream reduction of a tensor of rank `rank` reduces, where they are some but
/// not all of `outer` (the first such reduction found above `t`).
fn upstream_row_axes(f: &Fusion, t: TvId, rank: usize, outer: &[usize]) -> Option<Vec<usize>> {
    let mut stack = vec![t];
    let mut seen: FxHashSet<TvId> = FxHashSet::default();
    while let Some(x) = stack.pop() {
        if !seen.insert(x) {
            continue;
        }
        let Some(d) = f.tvs[x].definition else { continue };
        if matches!(f.exprs[d].op, Op::Reduction { .. }) {
            let input_rank = f.exprs[d].inputs[0].tensor().map_or(0, |i| f.no_reduction_logical(i).len());
            let r = reduced_axes(f, d);
            if input_rank == rank && !r.is_empty() && r.len() < outer.len() && r.iter().all(|a| outer.contains(a)) {
                return Some(r);
            }
        }
        stack.extend(f.exprs[d].input_tvs());
    }
    None
}

/// The axes another reduction reduces (some but not all of `outer`) of a tensor of `x`'s
/// shape computed from the same inputs: `loss.mean()` beside `loss.sum(-1)`, `mask.all()`
/// beside `mask.sum(-1)`. Split into rows and a total, the full reduction joins the rows'
/// schedule as a total; kept whole, it was a second class of reduction and a second kernel
/// reading the inputs again.
fn sibling_row_axes(f: &Fusion, e: ExprId, x: TvId, outer: &[usize]) -> Option<Vec<usize>> {
    let extents = |t: TvId| -> Vec<ValId> { f.no_reduction_logical(t).iter().map(|&id| f.ids[id].extent).collect() };
    let shape = extents(x);
    // The fusion inputs `t` is computed from.
    let inputs = |t: TvId| -> FxHashSet<TvId> {
        let closure = super::computed_closure(f, &[t]);
        closure.iter().flat_map(|&c| f.producers(c)).chain([t]).filter(|&p| f.tvs[p].definition.is_none()).collect()
    };
    let mine = inputs(x);
    for d in f.topo_exprs() {
        if d == e || !matches!(f.exprs[d].op, Op::Reduction { .. }) {
            continue;
        }
        let Some(y) = f.exprs[d].inputs[0].tensor() else { continue };
        let r = reduced_axes(f, d);
        // A sibling of the same tensor is reused whole (`reuse_partial_reductions`: the
        // total sums the rows' results).
        if y == x
            || extents(y) != shape
            || r.is_empty()
            || r.len() >= outer.len()
            || !r.iter().all(|a| outer.contains(a))
        {
            continue;
        }
        // Rows only (the innermost axes): a total split over a column reduction's axes would
        // add a column pass, not join one.
        if r.iter().enumerate().any(|(i, &a)| a != shape.len() - r.len() + i) {
            continue;
        }
        if !inputs(y).is_disjoint(&mine) {
            return Some(r);
        }
    }
    None
}

/// True when `t` is computed from a reduction's result. Such a tensor belongs to a row
/// schedule (a log-softmax's picked value, summed per row and then over the rows): the sum
/// of its row sums is a total of that schedule, where one reduction over both axes would be
/// a second class of reduction beside the rows' (a kernel of its own, reading the row
/// tensor back from Global).
fn computed_from_a_reduction(f: &Fusion, t: TvId) -> bool {
    let mut stack = vec![t];
    let mut seen: FxHashSet<TvId> = FxHashSet::default();
    while let Some(x) = stack.pop() {
        if !seen.insert(x) {
            continue;
        }
        let Some(d) = f.tvs[x].definition else { continue };
        if matches!(f.exprs[d].op, Op::Reduction { .. }) {
            return true;
        }
        stack.extend(f.exprs[d].input_tvs());
    }
    false
}

/// Replace `sum(exp(x - broadcast(max(x))))` over the same axes by
/// `exp(logsumexp(x) - max(x))` (float and double; see the module docs) where `long_row`
/// holds for the sum: rows a register-persistent schedule holds are read once anyway, and
/// there a running maximum costs more arithmetic than the second reduction it saves.
/// Other readers of `exp(x - max)` (the softmax's output) keep it.
pub fn online_logsumexp(f: &mut Fusion, long_row: &dyn Fn(&Fusion, ExprId) -> bool) -> Result<()> {
    'again: loop {
        for e in f.topo_exprs() {
            let Some((x, m)) = sum_of_shifted_exp(f, e) else { continue };
            // A double row has no wider type to keep `log(n)` beside its maximum in: its
            // `x - lse` would lose the maximum's ulp (2e-12 relative at logits near 1e4),
            // where `x - max` is exact. It keeps the written form, a pass per reduction.
            if !long_row(f, e) || f.tvs[x].dtype == DataType::Double {
                continue;
            }
            let s = f.exprs[e].output;
            let dims: Vec<i64> = reduced_axes(f, e).into_iter().map(|a| a as i64).collect();
            // A float row's log-sum-exp is kept in double: `x - lse` must keep log(n) next to
            // a maximum of any size (a masked row of -1e9 has lse = -1e9 + log(n), which float
            // rounds to -1e9, and its softmax would sum to n), and every merge of partial
            // results would add an ulp of |lse|. The elements still accumulate in float.
            let wide = (f.tvs[x].dtype.compute_dtype() == DataType::Float).then_some(DataType::Double);
            // Raised to the floor (see `crate::ir::LSE_FLOOR`) inside the reduction, which checks it per
            // block of elements rather than per element.
            let lse = f.reduction(ReductionOp::LogSumExpFloored, x, &dims, false, wide)?;
            let mc = above_lse_floor(f, m)?;
            let diff = f.binary(BinaryOp::Sub, Operand::Tensor(lse), Operand::Tensor(mc))?;
            let diff = cast_to(f, diff, f.tvs[s].dtype)?;
            let sum = f.unary(UnaryOp::Exp, Operand::Tensor(diff))?;
            replace_tensor(f, s, sum);
            if let Some(ex) = f.exprs[e].inputs[0].tensor() {
                f.tvs[ex].uses.retain(|&u| u != e);
                drop_the_maximum(f, ex, sum, x, lse)?;
            }
            drop_dead_uses(f);
            continue 'again;
        }
        return Ok(());
    }
}

/// `max(t, -LSE_FLOOR)` where `t` is not -inf (see `crate::ir::LSE_FLOOR`; -inf terms stay zero and a row
/// of them stays NaN, as PyTorch gives).
fn above_lse_floor(f: &mut Fusion, t: TvId) -> Result<TvId> {
    let floor = Operand::Scalar(f.scalars.float(-LSE_FLOOR));
    let raised = f.binary(BinaryOp::Maximum, Operand::Tensor(t), floor)?;
    let neg_inf = f.unary(UnaryOp::Isneginf, Operand::Tensor(t))?;
    let r = f.where_(Operand::Tensor(neg_inf), Operand::Tensor(t), Operand::Tensor(raised))?;
    cast_to(f, r, f.tvs[t].dtype)
}

/// With `s = sum(ex)`, `ex = exp(d)`, `d = x - broadcast(max(x))`, and `lse` the floored
/// log-sum-exp of `x` (see `crate::ir::LSE_FLOOR`; `s` is now computed from it): the softmax's quotient
/// `exp(d) / broadcast(s)` becomes `exp(x -
/// broadcast(lse))` and the log-softmax's difference `d - broadcast(log(s))` becomes `x -
/// broadcast(lse)`. Both are exact in real arithmetic, and where nothing else reads the
/// maximum its reduction goes: a row that is split over a cluster or streamed pays a
/// cluster barrier or a pass over memory for each reduction.
fn drop_the_maximum(f: &mut Fusion, ex: TvId, s: TvId, x: TvId, lse: TvId) -> Result<()> {
    let Some(d) = f.tvs[ex].definition.and_then(|de| f.exprs[de].inputs[0].tensor()) else { return Ok(()) };
    // Every reader of `broadcast(s)`, `log(broadcast(s))` or `broadcast(log(s))`: (reader,
    // broadcast flags, through a log).
    fn readers(
        f: &Fusion,
        v: TvId,
        is_new: Option<&Vec<bool>>,
        logged: bool,
        out: &mut Vec<(ExprId, Vec<bool>, bool)>,
    ) {
        for &u in &f.tvs[v].uses {
            let next = f.exprs[u].output;
            match (&f.exprs[u].op, is_new) {
                (Op::Broadcast { is_new }, None) => readers(f, next, Some(is_new), logged, out),
                (Op::Unary(UnaryOp::Log), _) if !logged => readers(f, next, is_new, true, out),
                (_, Some(b)) => out.push((u, b.clone(), logged)),
                _ => {}
            }
        }
    }
    let mut all = Vec::new();
    readers(f, s, None, false, &mut all);
    // (reader, broadcast flags, whether `exp` follows the difference).
    let mut found: Vec<(ExprId, Vec<bool>, bool)> = Vec::new();
    for (r, is_new, logged) in all {
        let (op, first) = (&f.exprs[r].op, &f.exprs[r].inputs[0]);
        if !logged && *op == Op::Binary(BinaryOp::Div) && *first == Operand::Tensor(ex) {
            found.push((r, is_new, true));
        } else if logged && *op == Op::Binary(BinaryOp::Sub) && *first == Operand::Tensor(d) {
            found.push((r, is_new, false));
        }
    }
    let mut xc = None;
    for (r, is_new, exp) in found {
        let old = f.exprs[r].output;
        if f.tvs[old].dtype != f.tvs[x].dtype || f.tvs[old].logical.len() != f.tvs[x].logical.len() {
            continue;
        }
        // `x - lse` as `(x - hi) - lo`, the double lse split into two of the row's floats
        // (hi its rounding, lo the rest, such as the log(n) that float loses next to a large
        // maximum): two float subtractions per element. A row with +inf (or only -inf, or a
        // NaN) has a non-finite lse, whose lo (inf - inf) is NaN: the whole row is NaN, as
        // `x - max` makes it in the written form.
        let ct = f.tvs[x].dtype.compute_dtype();
        // A row with nothing above the floor (its lse within log(n) <= 22 of it) subtracts from
        // the raised values, so that its equal masked values share the row; any other row
        // from its own values, so that a log-softmax keeps a masked value's size.
        let near = Operand::Scalar(f.scalars.float(-LSE_FLOOR + 23.0));
        let at_floor = f.binary(BinaryOp::Lt, Operand::Tensor(lse), near)?;
        let at_floor = f.broadcast(at_floor, is_new.clone())?;
        let xc = match xc {
            Some(t) => t,
            None => *xc.insert(above_lse_floor(f, x)?),
        };
        let terms = f.where_(Operand::Tensor(at_floor), Operand::Tensor(xc), Operand::Tensor(x))?;
        let terms = cast_to(f, terms, f.tvs[x].dtype)?;
        let hi = cast_to(f, lse, ct)?;
        let lo = if f.tvs[lse].dtype == ct {
            None
        } else {
            let back = f.cast(Operand::Tensor(hi), f.tvs[lse].dtype)?;
            let rest = f.binary(BinaryOp::Sub, Operand::Tensor(lse), Operand::Tensor(back))?;
            Some(f.cast(Operand::Tensor(rest), ct)?)
        };
        let b = f.broadcast(hi, is_new.clone())?;
        let mut new = f.binary(BinaryOp::Sub, Operand::Tensor(terms), Operand::Tensor(b))?;
        if let Some(lo) = lo {
            let b = f.broadcast(lo, is_new)?;
            new = f.binary(BinaryOp::Sub, Operand::Tensor(new), Operand::Tensor(b))?;
        }
        new = cast_to(f, new, ct)?;
        if exp {
            new = f.unary(UnaryOp::Exp, Operand::Tensor(new))?;
        }
        let new = cast_to(f, new, f.tvs[old].dtype)?;
        replace_tensor(f, old, new);
        for i in f.exprs[r].inputs.clone() {
            if let Operand::Tensor(t) = i {
                f.tvs[t].uses.retain(|&u| u != r);
            }
        }
    }
    Ok(())
}

/// `t` converted to `dtype` (itself when it has that type).
fn cast_to(f: &mut Fusion, t: TvId, dtype: DataType) -> Result<TvId> {
    if f.tvs[t].dtype == dtype {
        Ok(t)
    } else {
        f.cast(Operand::Tensor(t), dtype)
    }
}

/// Move gathers through element-wise ops towards the inputs (see the module docs).
pub fn sink_gathers(f: &mut Fusion) -> Result<()> {
    let mut changed = false;
    'again: loop {
        'next: for e in f.topo_exprs() {
            let Op::IndexSelect { dim } = f.exprs[e].op else { continue };
            let (Some(y), Some(idx)) = (f.exprs[e].inputs[0].tensor(), f.exprs[e].index_tensor()) else { continue };
            let Some(d) = f.tvs[y].definition else { continue };
            if let Some(v) = gathered_iota(f, e, dim, y, idx)? {
                let old = f.exprs[e].output;
                replace_tensor(f, old, v);
                f.tvs[y].uses.retain(|&u| u != e);
                f.tvs[idx].uses.retain(|&u| u != e);
                changed = true;
                continue 'again;
            }
            if !matches!(f.exprs[d].op, Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_)) {
                continue;
            }
            let rank = f.tvs[y].logical.len();
            // The index's own rank: a reduction's result (an argmax, a sum of a mask) keeps
            // its reduced axes in `logical`.
            let full_index = f.no_reduction_logical(idx).len() == rank;
            let bcast = |f: &Fusion, t: TvId, a: usize| f.ids[f.tvs[t].logical[a]].iter_type == IterType::Broadcast;
            // Each operand: read as it is when broadcast along `dim` (a per-row statistic),
            // gathered otherwise: a full operand, or one broadcast along other axes (a bias
            // over the vocabulary, `log_softmax(x + bias)`), whose gather reads its one row
            // for every row of the index.
            let mut plan = Vec::new();
            for o in f.exprs[d].inputs.clone() {
                let Operand::Tensor(t) = o else {
                    plan.push((o, false));
                    continue;
                };
                if f.tvs[t].logical.len() != rank || f.no_reduction_logical(t).len() != rank {
                    continue 'next;
                }
                let along = bcast(f, t, dim);
                let elsewhere = (0..rank).any(|a| a != dim && bcast(f, t, a));
                if elsewhere && (along || rank < 2 || !full_index) {
                    continue 'next;
                }
                plan.push((o, !along));
            }
            // With no operand left to gather, the result would lose the index's extent along
            // `dim` (and the index its bounds check): the gather stays.
            if !plan.iter().any(|&(o, gather)| gather && o.tensor().is_some()) {
                continue 'next;
            }
            let mut operands: smallvec::SmallVec<[Operand; 3]> = smallvec::SmallVec::new();
            for (o, gather) in plan {
                let Operand::Tensor(t) = o else {
                    operands.push(o);
                    continue;
                };
                if !gather {
                    operands.push(o);
                    continue;
                }
                // A broadcast operand (the bias) is gathered from a copy of its own: the
                // gather then reads the input's row as a table (`view_gather_tables`), while
                // the full rows keep reading the broadcast in their loops.
                let is_broadcast = f.tvs[t].definition.is_some_and(|b| matches!(f.exprs[b].op, Op::Broadcast { .. }));
                let t = if is_broadcast { recompute(f, t)? } else { t };
                let picked = if full_index && rank > 1 {
                    f.take_along_axis(t, idx, dim as i64)?
                } else {
                    f.index_select(t, idx, dim as i64)?
                };
                operands.push(Operand::Tensor(picked));
            }
            let old = f.exprs[e].output;
            let logical: Vec<_> = f.tvs[old]
                .logical
                .clone()
                .into_iter()
                .map(|id| f.new_id(f.ids[id].extent, f.ids[id].iter_type))
                .collect();
            let new = f.new_tv(f.tvs[y].dtype, crate::ir::MemoryType::Local, logical);
            f.add_expr(f.exprs[d].op.clone(), operands, new);
            replace_tensor(f, old, new);
            f.tvs[y].uses.retain(|&u| u != e);
            f.tvs[idx].uses.retain(|&u| u != e);
            changed = true;
            continue 'again;
        }
        break;
    }
    if changed {
        drop_dead_uses(f);
    }
    Ok(())
}

/// `take_along_axis(broadcast(iota), idx, dim)` with the iota along `dim`: the value at
/// position `idx` of `start + i * step`, computed from the index (`start + idx * step`) instead
/// of a gather from an iota stored whole. The column ids of a one-hot or diagonal mask
/// (`iota(N)[None, :] == iota(N)[:, None]`) picked at each row's label are the labels. Only
/// where another gather of the same index along the same extent stays, which checks the
/// index's range as this gather did; only integer iotas, whose arithmetic is exact.
fn gathered_iota(f: &mut Fusion, e: ExprId, dim: usize, y: TvId, idx: TvId) -> Result<Option<TvId>> {
    let Some(d) = f.tvs[y].definition else { return Ok(None) };
    let Op::Broadcast { is_new } = f.exprs[d].op.clone() else { return Ok(None) };
    let Some(z) = f.exprs[d].inputs[0].tensor() else { return Ok(None) };
    let Some(zd) = f.tvs[z].definition else { return Ok(None) };
    let Op::Iota { start, step } = f.exprs[zd].op else { return Ok(None) };
    let dtype = f.tvs[z].dtype;
    let rank = f.tvs[y].logical.len();
    let along_dim = (0..rank).all(|a| is_new.get(a).is_some_and(|&n| n == (a != dim)));
    if !dtype.is_integer() || dtype == DataType::Bool || !along_dim || f.no_reduction_logical(idx).len() != rank {
        return Ok(None);
    }
    let extent = f.ids[f.tvs[y].logical[dim]].extent;
    let checked = f.tvs[idx].uses.iter().any(|&u| {
        u != e
            && matches!(f.exprs[u].op, Op::IndexSelect { dim: k } if k == dim)
            && f.exprs[u].index_tensor() == Some(idx)
            && f.exprs[u]
                .indexed_tensor()
                .is_some_and(|t| f.no_reduction_logical(t).get(dim).is_some_and(|&id| f.ids[id].extent == extent))
    });
    if !checked {
        return Ok(None);
    }
    let idx_t = if f.tvs[idx].dtype == dtype { idx } else { f.cast(Operand::Tensor(idx), dtype)? };
    let scaled = f.binary(BinaryOp::Mul, Operand::Tensor(idx_t), Operand::Scalar(step))?;
    let v = f.binary(BinaryOp::Add, Operand::Tensor(scaled), Operand::Scalar(start))?;
    Ok(Some(if f.tvs[v].dtype == dtype { v } else { f.cast(Operand::Tensor(v), dtype)? }))
}

/// Reduce the squeezed tensor where a reduction covers size-one broadcast axes (see the
/// module docs).
pub fn reduce_broadcast_axes(f: &mut Fusion) -> Result<()> {
    let mut changed = false;
    for e in f.topo_exprs() {
        let Op::Reduction { op, .. } = f.exprs[e].op else { continue };
        let Some(t) = f.exprs[e].inputs[0].tensor() else { continue };
        let out = f.exprs[e].output;
        let reduced = reduced_axes(f, e);
        let l = f.tvs[t].logical.clone();
        if l.len() != f.tvs[out].logical.len() || f.no_reduction_logical(t).len() != l.len() {
            continue;
        }
        let size_one =
            |a: usize| f.ids[l[a]].iter_type == IterType::Broadcast && f.scalars.as_int(f.ids[l[a]].extent) == Some(1);
        let drop: Vec<usize> = reduced.iter().copied().filter(|&a| size_one(a)).collect();
        if drop.is_empty() || f.tvs[t].dtype != f.tvs[out].dtype {
            continue;
        }
        let sq = f.squeeze(t, &drop.iter().map(|&a| a as i64).collect::<Vec<_>>())?;
        // The remaining reduced axes, numbered among the squeezed tensor's axes.
        let dims: Vec<i64> = reduced
            .iter()
            .filter(|a| !drop.contains(a))
            .map(|&a| (a - drop.iter().filter(|&&d| d < a).count()) as i64)
            .collect();
        // Only where what is left is a total (or nothing): a partial reduction that keeps
        // axes is a normalization's statistic, whose kernel holds the unsqueezed tensor
        // beside it (GroupNorm's [N, G, C/G = 1, H, W], a batch of one), and a squeezed
        // copy would not line up with it.
        if !dims.is_empty() && dims.len() != l.len() - drop.len() {
            continue;
        }
        let new = if dims.is_empty() { sq } else { f.reduction(op, sq, &dims, false, Some(f.tvs[out].dtype))? };
        replace_tensor(f, out, new);
        f.tvs[t].uses.retain(|&u| u != e);
        changed = true;
    }
    if changed {
        drop_dead_uses(f);
    }
    Ok(())
}

/// A squeeze of an element-wise op is the op of its squeezed operands (see the module
/// docs), until every squeeze reads an input, a remap, a broadcast or a reduction.
pub fn sink_squeezes(f: &mut Fusion) -> Result<()> {
    // Each rewrite moves one squeeze one op closer to the inputs, so this terminates.
    'again: loop {
        for e in f.topo_exprs() {
            let Op::Squeeze { removed } = f.exprs[e].op.clone() else { continue };
            let Some(x) = f.exprs[e].inputs[0].tensor() else { continue };
            let Some(d) = f.tvs[x].definition else { continue };
            let op = f.exprs[d].op.clone();
            let xl = f.no_reduction_logical(x);
            // Values computed from a reduction (a keepdim statistic squeezed for an output)
            // stay: `squeeze_broadcasts` reads the statistic itself, where a sunk squeeze
            // would leave lower-rank copies of its scalar factors beside the rows.
            if xl.len() != removed.len() || computed_from_a_reduction(f, x) {
                continue;
            }
            // A squeeze of a permute is a permute of the squeezed source (of none, where
            // one axis is left): the boxes of `x[:, k:k+1]` against `y[:, k:k+1].T`.
            if let Op::Permute { perm } = &op {
                let Some(y) = f.exprs[d].inputs[0].tensor() else { continue };
                let mut gone = vec![false; perm.len()];
                for (i, &src) in perm.iter().enumerate() {
                    gone[src] = removed[i];
                }
                let dims: Vec<i64> = (0..gone.len()).filter(|&a| gone[a]).map(|a| a as i64).collect();
                let sq = squeezed(f, y, &gone, &dims)?;
                // The kept source axes, renumbered in the squeezed tensor's order.
                let rank_of = |a: usize| (0..a).filter(|&b| !gone[b]).count() as i64;
                let kept: Vec<i64> =
                    perm.iter().zip(&removed).filter(|(_, &r)| !r).map(|(&src, _)| rank_of(src)).collect();
                let moved =
                    if kept.iter().enumerate().all(|(i, &k)| k == i as i64) { sq } else { f.permute(sq, &kept)? };
                let old = f.exprs[e].output;
                replace_tensor(f, old, moved);
                f.tvs[x].uses.retain(|&u| u != e);
                continue 'again;
            }
            if !op.is_elementwise() {
                continue;
            }
            // Every operand's removed axis must be one wherever the squeezed one is: a
            // broadcast, a constant one, or the same (checked) size.
            let fits = |f: &Fusion, t: TvId| {
                let tl = f.no_reduction_logical(t);
                tl.is_empty()
                    || (tl.len() == xl.len()
                        && removed.iter().zip(tl.iter().zip(&xl)).all(|(&gone, (&a, &b))| {
                            let id = &f.ids[a];
                            !gone
                                || id.iter_type == IterType::Broadcast
                                || f.scalars.as_int(id.extent) == Some(1)
                                || id.extent == f.ids[b].extent
                        }))
            };
            if !f.exprs[d].input_tvs().all(|t| fits(f, t)) {
                continue;
            }
            let dims: Vec<i64> = (0..removed.len()).filter(|&a| removed[a]).map(|a| a as i64).collect();
            let mut operands = Vec::new();
            for o in f.exprs[d].inputs.clone() {
                operands.push(match o {
                    Operand::Tensor(t) if !f.no_reduction_logical(t).is_empty() => {
                        Operand::Tensor(squeezed(f, t, &removed, &dims)?)
                    }
                    o => o,
                });
            }
            let old = f.exprs[e].output;
            let moved = replay(f, op, &operands, f.tvs[old].dtype)?;
            replace_tensor(f, old, moved);
            f.tvs[x].uses.retain(|&u| u != e);
            continue 'again;
        }
        return Ok(());
    }
}

/// `t` squeezed along `removed`: an existing squeeze of `t` that removes the same axes is
/// reused, so a value read twice (`a * a`, or two branches of one chain) is squeezed, and
/// its chain sunk, once rather than once per path.
fn squeezed(f: &mut Fusion, t: TvId, removed: &[bool], dims: &[i64]) -> Result<TvId> {
    for &u in &f.tvs[t].uses {
        if matches!(&f.exprs[u].op, Op::Squeeze { removed: r } if r == removed) {
            return Ok(f.exprs[u].output);
        }
    }
    f.squeeze(t, dims)
}

/// Read the source of a broadcast where a squeeze removes exactly its new axes (see the
/// module docs).
pub fn squeeze_broadcasts(f: &mut Fusion) -> Result<()> {
    let mut changed = false;
    for e in f.topo_exprs() {
        let Op::Squeeze { removed } = &f.exprs[e].op else { continue };
        let Some(b) = f.exprs[e].inputs[0].tensor() else { continue };
        let Some(d) = f.tvs[b].definition else { continue };
        let Op::Broadcast { is_new } = &f.exprs[d].op else { continue };
        let Some(src) = f.exprs[d].inputs[0].tensor() else { continue };
        let out = f.exprs[e].output;
        if is_new != removed || f.tvs[src].dtype != f.tvs[out].dtype {
            continue;
        }
        // Reductions keep their reduced axes in the logical domain; the squeeze's result has none.
        if f.no_reduction_logical(src).len() != f.tvs[out].logical.len() {
            continue;
        }
        replace_tensor(f, out, src);
        f.tvs[b].uses.retain(|&u| u != e);
        changed = true;
    }
    if changed {
        drop_dead_uses(f);
    }
    Ok(())
}

/// A squeeze of a remap (slice, reshape, pad) is the remap at the squeezed rank, its removed
/// axes at position 0: `squeeze(slice(permute(reshape(qkv))), [0])` reads `qkv` in its
/// output's loops, where the rank-5 slice was a kernel (and a Global copy) of its own.
pub fn squeeze_remaps(f: &mut Fusion) -> Result<()> {
    let mut changed = false;
    for e in f.topo_exprs() {
        let Op::Squeeze { removed } = f.exprs[e].op.clone() else { continue };
        let Some(r) = f.exprs[e].inputs[0].tensor() else { continue };
        let Some(d) = f.tvs[r].definition else { continue };
        let Op::Remap { name, index, valid } = f.exprs[d].op.clone() else { continue };
        let Some(y) = f.exprs[d].inputs[0].tensor() else { continue };
        let out = f.exprs[e].output;
        let rl = f.no_reduction_logical(r);
        if f.tvs[y].dtype != f.tvs[out].dtype || removed.len() != rl.len() {
            continue;
        }
        // A computed size that must be one (`x[:, k:k+1]`) is checked when the inputs are
        // bound (`Fusion::squeeze` records it), so reading index 0 is exact; an axis known
        // to be one needs no check. One that may also be zero where its broadcast is empty
        // reads index 0 only where it is one: nothing reads the value elsewhere.
        let one = f.scalars.int(1);
        let mut checked = true;
        let mut guards = Vec::new();
        for (&gone, &id) in removed.iter().zip(&rl) {
            let ext = f.ids[id].extent;
            if gone && f.scalars.as_int(ext) != Some(1) {
                match f.squeezed_extent_check(ext) {
                    Some(true) => {}
                    Some(false) => guards.push(f.scalars.binary(crate::ir::scalar::ScalarOp::Le, one, ext)),
                    None => checked = false,
                }
            }
        }
        if !checked {
            continue;
        }
        let zero = f.scalars.int(0);
        let mut next = 0u32;
        let at: Vec<ValId> = removed
            .iter()
            .map(|&gone| {
                if gone {
                    zero
                } else {
                    next += 1;
                    f.scalars.symbol(crate::ir::Symbol::OutAxis(next - 1))
                }
            })
            .collect();
        let index: Vec<_> = index.iter().map(|&v| f.compose(v, &at)).collect();
        let mut valid = valid.map(|v| f.compose(v, &at));
        for g in guards {
            valid = Some(match valid {
                Some(v) => f.scalars.binary(crate::ir::scalar::ScalarOp::And, v, g),
                None => g,
            });
        }
        let extents: Vec<_> = f.no_reduction_logical(out).iter().map(|&id| f.ids[id].extent).collect();
        let moved = f.remap(y, name, &extents, index, valid)?;
        replace_tensor(f, out, moved);
        f.tvs[r].uses.retain(|&u| u != e);
        changed = true;
    }
    if changed {
        drop_dead_uses(f);
    }
    Ok(())
}

/// The longest row, in bytes of its reduction's input, that one block keeps on chip, where a
/// running maximum costs more arithmetic than the second reduction it saves. Longer rows
/// are split over a cluster's blocks (`shared::cluster_size`: bf16 beyond 32k columns, whose
/// float row is 128 KiB) or streamed from memory, and each reduction costs a cluster barrier
/// or a pass over the row.
pub const ROW_ON_CHIP_BYTES: i64 = 128 * 1024;

/// Take per-row terms out of masked sums (see the module docs) where `long_row` holds for
/// the sum.
pub fn hoist_row_terms(f: &mut Fusion, long_row: &dyn Fn(&Fusion, ExprId) -> bool) -> Result<()> {
    'again: loop {
        for e in f.topo_exprs() {
            let Some(m) = masked_row_term(f, e) else { continue };
            if !long_row(f, e) {
                continue;
            }
            let dims: Vec<i64> = reduced_axes(f, e).into_iter().map(|a| a as i64).collect();
            let dt = f.tvs[f.exprs[e].output].dtype;
            // The count runs over the masked tensor's shape, not the condition's: a mask that
            // is a broadcast along a reduced axis (`triu` of a 3-D tensor reduced over its
            // batch) counts every row of that axis, not one.
            let shape: Vec<ValId> = f.no_reduction_logical(m.masked).iter().map(|&id| f.ids[id].extent).collect();
            let unit = f.scalars.float(1.0);
            let one = Operand::Tensor(f.full(&shape, Operand::Scalar(unit), DataType::Float)?);
            let zero = Operand::Scalar(f.scalars.float(0.0));
            let (kept, ind) = if m.value_first {
                (f.where_(m.cond, Operand::Tensor(m.a), m.zero)?, f.where_(m.cond, one, zero)?)
            } else {
                (f.where_(m.cond, m.zero, Operand::Tensor(m.a))?, f.where_(m.cond, zero, one)?)
            };
            let ind = if f.tvs[ind].dtype == dt { ind } else { f.cast(Operand::Tensor(ind), dt)? };
            let sum_a = f.reduction(ReductionOp::Sum, kept, &dims, false, Some(dt))?;
            let count = f.reduction(ReductionOp::Sum, ind, &dims, false, Some(dt))?;
            let term = f.binary(BinaryOp::Mul, Operand::Tensor(m.r), Operand::Tensor(count))?;
            let (p, q, op) = match m.shape {
                RowTerm::Minus => (sum_a, term, BinaryOp::Sub),
                RowTerm::Plus => (sum_a, term, BinaryOp::Add),
                RowTerm::From => (term, sum_a, BinaryOp::Sub),
            };
            let new = f.binary(op, Operand::Tensor(p), Operand::Tensor(q))?;
            let old = f.exprs[e].output;
            replace_tensor(f, old, new);
            f.tvs[m.masked].uses.retain(|&u| u != e);
            drop_dead_uses(f);
            continue 'again;
        }
        return Ok(());
    }
}

/// `(x, r)` when reduction `e` is a sum of `(x - broadcast(r))^2` (as `d * d`), the
/// broadcast adding exactly the reduced axes, `r` computed from a reduction (the mean), all
/// in one float dtype.
fn centered_squares(f: &Fusion, e: ExprId) -> Option<(TvId, TvId)> {
    let Op::Reduction { op: ReductionOp::Sum, .. } = f.exprs[e].op else { return None };
    let dt = f.tvs[f.exprs[e].output].dtype;
    // Float sums are accumulated in double, which makes the rewrite more accurate than a
    // float two-pass variance. Double has no wider type: its sums are shifted by the row's
    // first element instead (`S2 - r * (2 * S1 - n * r)` of unshifted double sums loses what
    // a double two-pass keeps: var_mean's statistics of a mean of 1e4 with a standard
    // deviation of 1e-2 came out 1e-3 off).
    if dt != DataType::Float && dt != DataType::Double {
        return None;
    }
    let sq = f.exprs[e].inputs[0].tensor()?;
    let m = f.tvs[sq].definition?;
    if f.exprs[m].op != Op::Binary(BinaryOp::Mul) || f.exprs[m].inputs[0] != f.exprs[m].inputs[1] {
        return None;
    }
    let d = f.exprs[m].inputs[0].tensor()?;
    let s = f.tvs[d].definition?;
    if f.exprs[s].op != Op::Binary(BinaryOp::Sub) {
        return None;
    }
    let (x, b) = (f.exprs[s].inputs[0].tensor()?, f.exprs[s].inputs[1].tensor()?);
    let bd = f.tvs[b].definition?;
    let Op::Broadcast { is_new } = &f.exprs[bd].op else { return None };
    let r = f.exprs[bd].inputs[0].tensor()?;
    let red = reduced_axes(f, e);
    let exact = is_new.len() == f.tvs[f.exprs[e].output].logical.len()
        && is_new.iter().enumerate().all(|(a, &new)| new == red.contains(&a));
    let same = [sq, d, x, r].iter().all(|&t| f.tvs[t].dtype == dt);
    (exact && same && after_reduction(f, r)).then_some((x, r))
}

/// Compute a sum of squared deviations from a per-row value `r` (BatchNorm's and
/// LayerNorm's variance, `sum((x - mean)^2)`) as `S2 - r * (2 * S1 - n * r)` from the
/// sums `S1 = sum(x)` and `S2 = sum(x * x)` accumulated in double, where `long_row` holds
/// for the sum. The sums no longer wait for the mean, so a row too long to keep on chip is
/// read once for its statistics instead of twice (the input at most twice in all). Double
/// accumulation keeps the cancellation error near `2^-53 * mean^2 / var` of the variance,
/// below a float two-pass variance's, whose float mean is already off by `2^-24 * mean`.
/// A double sum (var_mean's) has no wider type to accumulate in: its sums are of `x - k`,
/// `k` the row's first element (the shifted-data algorithm), which bounds the cancellation
/// by `2^-53 * (mean - k)^2 / var`, a few units for any element of the row; the formula is
/// stationary in `r`, so the reference value's own rounding enters squared. A variance that
/// rounds below zero is zero.
pub fn expand_centered_squares(f: &mut Fusion, long_row: &dyn Fn(&Fusion, ExprId) -> bool) -> Result<()> {
    'again: loop {
        for e in f.topo_exprs() {
            let Some((x, r)) = centered_squares(f, e) else { continue };
            if !long_row(f, e) {
                continue;
            }
            // The shift of a double sum is read per row: rows along x's innermost axis only
            // (a column reduction keeps its two passes; its schedule would hold each
            // thread's whole column in registers to read the shifted copy twice).
            let inner =
                f.no_reduction_logical(x).len().checked_sub(1).is_some_and(|last| reduced_axes(f, e).contains(&last));
            if f.tvs[f.exprs[e].output].dtype == DataType::Double && !inner {
                continue;
            }
            let out = f.exprs[e].output;
            let dt = f.tvs[out].dtype;
            let red = reduced_axes(f, e);
            let dims: Vec<i64> = red.iter().map(|&a| a as i64).collect();
            let mut n = f.scalars.int(1);
            for &a in &red {
                let ext = f.ids[f.tvs[out].logical[a]].extent;
                n = f.scalars.mul(n, ext);
            }
            let wide = |f: &mut Fusion, t: TvId| -> Result<TvId> {
                if f.tvs[t].dtype == DataType::Double {
                    Ok(t)
                } else {
                    f.cast(Operand::Tensor(t), DataType::Double)
                }
            };
            let zero = Operand::Scalar(f.scalars.float(0.0));
            let xd = wide(f, x)?;
            let q = if dt == DataType::Double {
                // Sums of `d = x - k`, `k` the row's first element (read beside each element,
                // at the input's rank, so every schedule of a row reduction covers it):
                // `sum((x - r)^2) = S2 - S1^2 / n` for any shift, and its cancellation scales
                // with `(mean - k)^2 / var`, a few units for any element of the row.
                let k = first_of_row(f, xd, &red)?;
                let d = f.binary(BinaryOp::Sub, Operand::Tensor(xd), Operand::Tensor(k))?;
                let dd = f.binary(BinaryOp::Mul, Operand::Tensor(d), Operand::Tensor(d))?;
                let s2 = f.reduction(ReductionOp::Sum, dd, &dims, false, None)?;
                let s1 = f.reduction(ReductionOp::Sum, d, &dims, false, None)?;
                let sq = f.binary(BinaryOp::Mul, Operand::Tensor(s1), Operand::Tensor(s1))?;
                let mean_sq = f.binary(BinaryOp::Div, Operand::Tensor(sq), Operand::Scalar(n))?;
                f.binary(BinaryOp::Sub, Operand::Tensor(s2), Operand::Tensor(mean_sq))?
            } else {
                let rd = wide(f, r)?;
                let xx = f.binary(BinaryOp::Mul, Operand::Tensor(xd), Operand::Tensor(xd))?;
                let s2 = f.reduction(ReductionOp::Sum, xx, &dims, false, None)?;
                let s1 = f.reduction(ReductionOp::Sum, xd, &dims, false, None)?;
                // S2 - r * (2 * S1 - n * r)
                let two = Operand::Scalar(f.scalars.float(2.0));
                let twice = f.binary(BinaryOp::Mul, Operand::Tensor(s1), two)?;
                let nr = f.binary(BinaryOp::Mul, Operand::Tensor(rd), Operand::Scalar(n))?;
                let inner = f.binary(BinaryOp::Sub, Operand::Tensor(twice), Operand::Tensor(nr))?;
                let cross = f.binary(BinaryOp::Mul, Operand::Tensor(rd), Operand::Tensor(inner))?;
                f.binary(BinaryOp::Sub, Operand::Tensor(s2), Operand::Tensor(cross))?
            };
            let q = f.binary(BinaryOp::Maximum, Operand::Tensor(q), zero)?;
            let q = if dt == DataType::Double { q } else { f.cast(Operand::Tensor(q), dt)? };
            replace_tensor(f, out, q);
            let sq = f.exprs[e].inputs[0].tensor();
            if let Some(sq) = sq {
                f.tvs[sq].uses.retain(|&u| u != e);
            }
            drop_dead_uses(f);
            continue 'again;
        }
        return Ok(());
    }
}

/// `x` with each element replaced by the first element of its row (position 0 along the
/// `red` axes): read from the fusion's inputs once `sink_remaps` moves it there.
fn first_of_row(f: &mut Fusion, x: TvId, red: &[usize]) -> Result<TvId> {
    let zero = f.scalars.int(0);
    let logical = f.no_reduction_logical(x);
    let extents: Vec<ValId> = logical.iter().map(|&id| f.ids[id].extent).collect();
    let index: Vec<ValId> = (0..logical.len())
        .map(|a| {
            if red.contains(&a) || f.ids[logical[a]].iter_type == IterType::Broadcast {
                zero
            } else {
                f.scalars.symbol(crate::ir::Symbol::OutAxis(a as u32))
            }
        })
        .collect();
    f.remap(x, "slice", &extents, index, None)
}

/// Forget the uses by exprs that no output depends on any more (a rewrite left them): the
/// schedulers count a tensor's readers, and a dead one would keep a tensor from being
/// inlined into its live readers.
pub(crate) fn drop_dead_uses(f: &mut Fusion) {
    let live: FxHashSet<ExprId> = f.topo_exprs().into_iter().collect();
    let tvs: Vec<TvId> = f.tvs.keys().collect();
    for t in tvs {
        f.tvs[t].uses.retain(|u| live.contains(u));
    }
}

/// How a per-row term `r` enters the masked value: `a - r`, `a + r` (or `r + a`), `r - a`.
#[derive(Clone, Copy)]
enum RowTerm {
    Minus,
    Plus,
    From,
}

/// A sum of `where(cond, a (op) broadcast(r), zero)` (or with the branches swapped).
struct MaskedRowTerm {
    masked: TvId,
    cond: Operand,
    zero: Operand,
    value_first: bool,
    a: TvId,
    r: TvId,
    shape: RowTerm,
}

fn masked_row_term(f: &Fusion, e: ExprId) -> Option<MaskedRowTerm> {
    let Op::Reduction { op: ReductionOp::Sum, .. } = f.exprs[e].op else { return None };
    let dt = f.tvs[f.exprs[e].output].dtype;
    if !matches!(dt, DataType::Float | DataType::Double) {
        return None;
    }
    let masked = f.exprs[e].inputs[0].tensor()?;
    let w = f.tvs[masked].definition?;
    if f.exprs[w].op != Op::Where || f.tvs[masked].dtype != dt {
        return None;
    }
    let ins = &f.exprs[w].inputs;
    let is_zero = |o: &Operand| {
        matches!(o, Operand::Scalar(v) if matches!(f.scalars.get(*v), Val::Float(b) if f64::from_bits(b) == 0.0)
            || f.scalars.as_int(*v) == Some(0))
    };
    let (value, zero, value_first) = match (ins[1], ins[2]) {
        (Operand::Tensor(v), z) if is_zero(&z) => (v, z, true),
        (z, Operand::Tensor(v)) if is_zero(&z) => (v, z, false),
        _ => return None,
    };
    let d = f.tvs[value].definition?;
    let Op::Binary(op @ (BinaryOp::Sub | BinaryOp::Add)) = f.exprs[d].op else { return None };
    let (p, q) = (f.exprs[d].inputs[0].tensor()?, f.exprs[d].inputs[1].tensor()?);
    let red = reduced_axes(f, e);
    let rank = f.tvs[f.exprs[e].output].logical.len();
    // `t` = broadcast(r) adding exactly the reduced axes, r computed from a reduction.
    let row_term = |t: TvId| -> Option<TvId> {
        let b = f.tvs[t].definition?;
        let Op::Broadcast { is_new } = &f.exprs[b].op else { return None };
        let r = f.exprs[b].inputs[0].tensor()?;
        let exact = is_new.len() == rank && is_new.iter().enumerate().all(|(a, &new)| new == red.contains(&a));
        (exact && f.tvs[r].dtype == dt && after_reduction(f, r)).then_some(r)
    };
    let (a, r, shape) = if let Some(r) = row_term(q) {
        (p, r, if op == BinaryOp::Sub { RowTerm::Minus } else { RowTerm::Plus })
    } else if let Some(r) = row_term(p) {
        (q, r, if op == BinaryOp::Sub { RowTerm::From } else { RowTerm::Plus })
    } else {
        return None;
    };
    (f.tvs[a].dtype == dt && f.tvs[value].dtype == dt).then_some(MaskedRowTerm {
        masked,
        cond: ins[0],
        zero,
        value_first,
        a,
        r,
        shape,
    })
}

/// True when `t` is computed from the result of a reduction.
fn after_reduction(f: &Fusion, t: TvId) -> bool {
    let mut stack = vec![t];
    let mut seen: FxHashSet<TvId> = FxHashSet::default();
    while let Some(t) = stack.pop() {
        let Some(d) = f.tvs[t].definition else { continue };
        if !seen.insert(t) {
            continue;
        }
        if matches!(f.exprs[d].op, Op::Reduction { .. }) {
            return true;
        }
        stack.extend(f.exprs[d].inputs.iter().filter_map(|o| o.tensor()));
    }
    false
}

/// `(x, max(x))` when reduction `e` is `sum(exp(x - broadcast(max(x))))`, the max and the sum
/// over the same axes, the broadcast adding exactly those, all in one float dtype.
fn sum_of_shifted_exp(f: &Fusion, e: ExprId) -> Option<(TvId, TvId)> {
    let def = |t: TvId| f.tvs[t].definition;
    let Op::Reduction { op: ReductionOp::Sum, .. } = f.exprs[e].op else { return None };
    let dt = f.tvs[f.exprs[e].output].dtype;
    let ex = f.exprs[e].inputs[0].tensor()?;
    let d_ex = def(ex)?;
    let u = match f.exprs[d_ex].op {
        Op::Unary(UnaryOp::Exp) => f.exprs[d_ex].inputs[0].tensor()?,
        _ => return None,
    };
    let d_u = def(u)?;
    if f.exprs[d_u].op != Op::Binary(BinaryOp::Sub) {
        return None;
    }
    let (x, b) = (f.exprs[d_u].inputs[0].tensor()?, f.exprs[d_u].inputs[1].tensor()?);
    let d_b = def(b)?;
    let Op::Broadcast { is_new } = &f.exprs[d_b].op else { return None };
    let m = f.exprs[d_b].inputs[0].tensor()?;
    let d_m = def(m)?;
    let Op::Reduction { op: ReductionOp::Max, .. } = f.exprs[d_m].op else { return None };
    let red = reduced_axes(f, e);
    let same_axes = reduced_axes(f, d_m) == red
        && is_new.len() == f.tvs[f.exprs[e].output].logical.len()
        && is_new.iter().enumerate().all(|(a, &new)| new == red.contains(&a));
    let float = matches!(dt, DataType::Float | DataType::Double);
    let same_dtype = [ex, u, x, m].iter().all(|&t| f.tvs[t].dtype == dt);
    (f.exprs[d_m].inputs[0] == Operand::Tensor(x) && same_axes && float && same_dtype).then_some((x, m))
}

/// Reduce the source of a broadcast instead of the broadcast, where the reduction covers
/// every axis the broadcast added (`x.mean()` of a keepdim statistic `[R, 1]`): a size-one
/// axis adds its one element, so the result is the same, and the reduction then reads a
/// per-row value that the row schedule totals in its kernel. Reducing only the new axes
/// leaves the source itself.
pub fn reduce_through_broadcasts(f: &mut Fusion) -> Result<()> {
    'again: loop {
        for e in f.topo_exprs() {
            let Op::Reduction { op, .. } = f.exprs[e].op else { continue };
            let Some(b) = f.exprs[e].inputs[0].tensor() else { continue };
            let Some(d) = f.tvs[b].definition else { continue };
            let Op::Broadcast { is_new } = f.exprs[d].op.clone() else { continue };
            let Some(src) = f.exprs[d].inputs[0].tensor() else { continue };
            let reduced = reduced_axes(f, e);
            let out = f.exprs[e].output;
            if !is_new.iter().enumerate().all(|(a, &new)| !new || reduced.contains(&a))
                || f.tvs[out].dtype != f.tvs[src].dtype
            {
                continue;
            }
            // The other reduced axes, numbered among the source's axes.
            let old: Vec<usize> = (0..is_new.len()).filter(|&a| !is_new[a]).collect();
            let dims: Vec<i64> =
                old.iter().enumerate().filter(|(_, a)| reduced.contains(a)).map(|(i, _)| i as i64).collect();
            let replacement = if dims.is_empty() { f.set(src)? } else { f.reduction(op, src, &dims, false, None)? };
            replace_tensor(f, out, replacement);
            f.tvs[b].uses.retain(|&u| u != e);
            continue 'again;
        }
        return Ok(());
    }
}

/// Compute a reduction that keeps size-one broadcast axes at the size its readers give them
/// (see the module docs), where a sibling reduction of the same axes iterates there.
pub fn widen_broadcast_reductions(f: &mut Fusion) -> Result<()> {
    let mut changed = false;
    // Each reduction is widened once: one whose readers are not all moved to the widened
    // copy stays in the fusion, and widening it again would never end.
    let mut widened: FxHashSet<ExprId> = FxHashSet::default();
    'again: loop {
        let reductions: Vec<ExprId> =
            f.topo_exprs().into_iter().filter(|&e| matches!(f.exprs[e].op, Op::Reduction { .. })).collect();
        for &e in &reductions {
            if widened.contains(&e) {
                continue;
            }
            let Op::Reduction { op, .. } = f.exprs[e].op else { continue };
            let Some(t) = f.exprs[e].inputs[0].tensor() else { continue };
            let out = f.exprs[e].output;
            let tl = f.tvs[t].logical.clone();
            let ol = f.tvs[out].logical.clone();
            if f.is_output(out) || tl.len() != ol.len() || f.no_reduction_logical(t).len() != tl.len() {
                continue;
            }
            let red = reduced_axes(f, e);
            let kept: Vec<usize> = (0..tl.len())
                .filter(|a| {
                    !red.contains(a)
                        && f.ids[tl[*a]].iter_type == IterType::Broadcast
                        && f.scalars.as_int(f.ids[tl[*a]].extent) == Some(1)
                })
                .collect();
            if kept.is_empty() {
                continue;
            }
            let mut sizes: FxHashMap<IterDomainId, ValId> = FxHashMap::default();
            let tracked: Vec<IterDomainId> = kept.iter().map(|&a| ol[a]).collect();
            let Some(()) = readers_concretize(f, out, &tracked, &mut sizes, 0) else { continue };
            let Some(wide) = kept.iter().map(|&a| sizes.get(&ol[a]).copied()).collect::<Option<Vec<ValId>>>() else {
                continue;
            };
            // A sibling that already iterates at these sizes: the widened reduction costs no
            // more than it, and shares its loops.
            let sibling = reductions.iter().any(|&s| {
                let Some(u) = f.exprs[s].inputs[0].tensor() else { return false };
                let ul = f.no_reduction_logical(u);
                s != e
                    && reduced_axes(f, s) == red
                    && ul.len() == tl.len()
                    && kept
                        .iter()
                        .zip(&wide)
                        .all(|(&a, &n)| f.ids[ul[a]].iter_type == IterType::Iteration && f.ids[ul[a]].extent == n)
            });
            if !sibling {
                continue;
            }
            let mut shape: Vec<ValId> = tl.iter().map(|&id| f.ids[id].extent).collect();
            for (&a, &n) in kept.iter().zip(&wide) {
                shape[a] = n;
            }
            let yes = f.scalars.boolean(true);
            let mask = f.full(&shape, Operand::Scalar(yes), DataType::Bool)?;
            let expanded = f.where_(Operand::Tensor(mask), Operand::Tensor(t), Operand::Tensor(t))?;
            let dims: Vec<i64> = red.iter().map(|&a| a as i64).collect();
            let new = f.reduction(op, expanded, &dims, false, Some(f.tvs[out].dtype))?;
            f.tvs[t].uses.retain(|&u| u != e);
            widen_readers(f, out, new, &tracked)?;
            widened.insert(e);
            if let Some(d) = f.tvs[new].definition {
                widened.insert(d);
            }
            changed = true;
            continue 'again;
        }
        if changed {
            drop_dead_uses(f);
        }
        return Ok(());
    }
}

/// Records in `sizes` the size every reader of `t` gives the broadcast axes `tracked` of
/// `t`, following element-wise ops and broadcasts that keep them broadcast; None where a
/// reader keeps one into an output, a reduction or another op, or readers disagree.
fn readers_concretize(
    f: &Fusion,
    t: TvId,
    tracked: &[IterDomainId],
    sizes: &mut FxHashMap<IterDomainId, ValId>,
    depth: usize,
) -> Option<()> {
    if depth > 64 || f.tvs[t].uses.is_empty() {
        return None;
    }
    for &u in &f.tvs[t].uses {
        let op = &f.exprs[u].op;
        if !(op.is_elementwise() || matches!(op, Op::Broadcast { .. })) {
            return None;
        }
        let mut further = Vec::new();
        for (p, c) in pairs_reading(f, u, t) {
            if !tracked.contains(&p) {
                continue;
            }
            if f.ids[c].iter_type == IterType::Broadcast {
                further.push((p, c));
            } else if *sizes.entry(p).or_insert(f.ids[c].extent) != f.ids[c].extent {
                return None;
            }
        }
        if further.is_empty() {
            continue;
        }
        let o = f.exprs[u].output;
        if f.is_output(o) {
            return None;
        }
        // The readers of `o` size these axes for the roots they came from.
        let ids: Vec<IterDomainId> = further.iter().map(|&(_, c)| c).collect();
        let mut inner = FxHashMap::default();
        readers_concretize(f, o, &ids, &mut inner, depth + 1)?;
        for (root, c) in further {
            let n = *inner.get(&c)?;
            if *sizes.entry(root).or_insert(n) != n {
                return None;
            }
        }
    }
    Some(())
}

/// (axis of `t`, axis of `u`'s result) for every operand of `u` that reads `t`.
fn pairs_reading(f: &Fusion, u: ExprId, t: TvId) -> Vec<(IterDomainId, IterDomainId)> {
    (0..f.exprs[u].inputs.len())
        .filter(|&pos| f.exprs[u].inputs[pos] == Operand::Tensor(t))
        .flat_map(|pos| logical_pairs(f, u, pos))
        .collect()
}

/// Replace `old` by `new`, which iterates where `old` has the broadcast axes `tracked`,
/// replaying the readers that kept them broadcast so that their results iterate there too.
fn widen_readers(f: &mut Fusion, old: TvId, new: TvId, tracked: &[IterDomainId]) -> Result<()> {
    for u in f.tvs[old].uses.clone() {
        let further: Vec<IterDomainId> = pairs_reading(f, u, old)
            .into_iter()
            .filter(|&(p, c)| tracked.contains(&p) && f.ids[c].iter_type == IterType::Broadcast)
            .map(|(_, c)| c)
            .collect();
        if further.is_empty() {
            continue;
        }
        let operands: Vec<Operand> = f.exprs[u]
            .inputs
            .iter()
            .map(|&o| if o == Operand::Tensor(old) { Operand::Tensor(new) } else { o })
            .collect();
        let replayed = replay(f, f.exprs[u].op.clone(), &operands, f.tvs[f.exprs[u].output].dtype)?;
        widen_readers(f, f.exprs[u].output, replayed, &further)?;
    }
    replace_tensor(f, old, new);
    Ok(())
}

/// The axes of its input that reduction expr `e` reduces.
fn reduced_axes(f: &Fusion, e: ExprId) -> Vec<usize> {
    let out = &f.tvs[f.exprs[e].output].logical;
    (0..out.len()).filter(|&a| f.ids[out[a]].iter_type == IterType::Reduction).collect()
}

/// Compute a reduction from a sibling that reduces a subset of its axes of the same tensor
/// with the same combiner: `sum(y, [0, 1])` beside `sum(y, [1])` becomes a sum over the
/// rows of the row sums. It reads the small result instead of the input again, and a
/// schedule of the row reduction takes the total as a grid reduction of its rows.
pub fn reuse_partial_reductions(f: &mut Fusion) -> Result<()> {
    'again: loop {
        let reductions: Vec<ExprId> =
            f.topo_exprs().into_iter().filter(|&e| matches!(f.exprs[e].op, Op::Reduction { .. })).collect();
        for &b in &reductions {
            for &a in &reductions {
                let (Op::Reduction { op: op_a, .. }, Op::Reduction { op: op_b, .. }) = (&f.exprs[a].op, &f.exprs[b].op)
                else {
                    continue;
                };
                let (ra, rb) = (reduced_axes(f, a), reduced_axes(f, b));
                let (oa, ob) = (f.exprs[a].output, f.exprs[b].output);
                if a == b
                    || op_a != op_b
                    || f.exprs[a].inputs[0] != f.exprs[b].inputs[0]
                    || f.tvs[oa].dtype != f.tvs[ob].dtype
                    || ra.len() >= rb.len()
                    || !ra.iter().all(|x| rb.contains(x))
                {
                    continue;
                }
                // B's other axes, numbered among A's kept axes.
                let rank = f.tvs[oa].logical.len();
                let kept: Vec<usize> = (0..rank).filter(|x| !ra.contains(x)).collect();
                let dims: Vec<i64> =
                    kept.iter().enumerate().filter(|(_, x)| rb.contains(x)).map(|(i, _)| i as i64).collect();
                let op = *op_b;
                let dtype = f.tvs[ob].dtype;
                let total = f.reduction(op, oa, &dims, false, Some(dtype))?;
                let x = f.exprs[b].inputs[0].tensor().expect("a reduction reads a tensor");
                replace_tensor(f, ob, total);
                f.tvs[x].uses.retain(|&u| u != b);
                continue 'again;
            }
        }
        return Ok(());
    }
}

/// Give every exactly mapped class of iteration axes one extent, so that loops over axes
/// the definition aligns have one extent: the class's constant size where an axis has one
/// (a `full` or `broadcast_in_dim` of a fixed shape aligned with an input; the input must
/// then have that size, which binding checks), else its smallest input extent symbol.
pub fn unify_mapped_extents(f: &mut Fusion) {
    use crate::ir::scalar::Val;
    use crate::ir::Symbol;
    #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    enum Rep {
        Constant(i64),
        Symbol(u32),
    }
    loop {
        let graph = IdGraph::exact(f);
        let extent_of = |f: &Fusion, id| {
            if f.ids[id].iter_type == IterType::Broadcast {
                return None;
            }
            match f.scalars.get(f.ids[id].extent) {
                Val::Symbol(Symbol::Extent(n)) => Some(Rep::Symbol(n)),
                Val::Int(c) => Some(Rep::Constant(c)),
                _ => None,
            }
        };
        let mut rep: FxHashMap<crate::ir::IterDomainId, Rep> = FxHashMap::default();
        for id in f.ids.keys() {
            if let Some(n) = extent_of(f, id) {
                let m = rep.entry(graph.find(id)).or_insert(n);
                *m = (*m).min(n);
            }
        }
        let sub = f.ids.keys().find_map(|id| match (extent_of(f, id)?, rep[&graph.find(id)]) {
            (Rep::Symbol(n), m) if m != Rep::Symbol(n) => Some((n, m)),
            _ => None,
        });
        let Some((n, m)) = sub else { break };
        let target = match m {
            Rep::Constant(c) => f.scalars.int(c),
            Rep::Symbol(m) => f.scalars.symbol(Symbol::Extent(m)),
        };
        let ids: Vec<_> = f.ids.keys().collect();
        for id in ids {
            let e = f.ids[id].extent;
            f.ids[id].extent = f.scalars.substitute(e, Symbol::Extent(n), target);
        }
    }
    // Computed extents: slices of one padded axis aligned by an element-wise op have
    // extents `min(i1, 24)` and `min(i1 + 1, 24)`, equal whenever the inputs bind (binding
    // checks every pair of sizes the definition aligns). Spelled differently, each tensor
    // would get its own bounds check and its own index division in the kernel, which
    // multiplies its code (and its compile time) by the number of slices. Each class takes
    // its cheapest spelling.
    let graph = IdGraph::exact(f);
    let mut best: FxHashMap<crate::ir::IterDomainId, (usize, ValId)> = FxHashMap::default();
    for id in f.ids.keys() {
        if f.ids[id].iter_type == IterType::Broadcast {
            continue;
        }
        let e = f.ids[id].extent;
        let key = (expr_size(&f.scalars, e), e);
        let b = best.entry(graph.find(id)).or_insert(key);
        if key < *b {
            *b = key;
        }
    }
    let ids: Vec<_> = f.ids.keys().collect();
    for id in ids {
        if f.ids[id].iter_type != IterType::Broadcast {
            f.ids[id].extent = best[&graph.find(id)].1;
        }
    }
}

/// The number of nodes of scalar expression `v` (shared subexpressions counted each time).
fn expr_size(sc: &crate::ir::Scalars, v: ValId) -> usize {
    match sc.get(v) {
        crate::ir::scalar::Val::Binary(_, a, b) => 1 + expr_size(sc, a) + expr_size(sc, b),
        _ => 1,
    }
}

/// Give every computed rank-1 gather index of a higher-rank gather the output's rank, size
/// one off the selected axis (the broadcast then sinks through its element-wise chain; a
/// 0-d index is broadcast to size one everywhere).
pub fn broadcast_computed_indices(f: &mut Fusion) -> Result<()> {
    for e in f.topo_exprs() {
        let Op::IndexSelect { dim } = f.exprs[e].op else { continue };
        let Some(index) = f.exprs[e].inputs[1].tensor() else { continue };
        let rank = f.no_reduction_logical(f.exprs[e].output).len();
        if f.tvs[index].definition.is_none() || f.no_reduction_logical(index).len() != 1 || rank < 2 {
            continue;
        }
        // A 0-d index that `index_select` gave its one axis is broadcast from the 0-d tensor
        // itself (what `sink_broadcasts` would compose the two broadcasts into).
        let scalar_source = f.tvs[index]
            .definition
            .filter(|&d| matches!(f.exprs[d].op, Op::Broadcast { .. }))
            .and_then(|d| f.exprs[d].inputs[0].tensor())
            .filter(|&s| f.no_reduction_logical(s).is_empty());
        let b = match scalar_source {
            Some(s) => f.broadcast(s, vec![true; rank])?,
            None => f.broadcast(index, (0..rank).map(|a| a != dim).collect())?,
        };
        f.note_stand_in(b, index);
        f.exprs[e].inputs[1] = Operand::Tensor(b);
        f.tvs[index].uses.retain(|&u| u != e);
        if !f.tvs[b].uses.contains(&e) {
            f.tvs[b].uses.push(e);
        }
    }
    Ok(())
}

/// Replace each reduction over an axis that has no elements for the inputs at hand by a
/// `full` of its identity (a sum over an empty axis is 0 everywhere): the kernels as written
/// for empty tensors would otherwise loop over the input's other, non-empty axes for
/// nothing (a sum of a [2^26, 0] array took a second).
pub fn empty_reductions_to_identity(f: &mut Fusion, cx: &super::Ctx) -> Result<()> {
    for e in f.topo_exprs() {
        let Op::Reduction { init, .. } = f.exprs[e].op else { continue };
        let Some(x) = f.exprs[e].inputs[0].tensor() else { continue };
        let Ok(sizes) = super::tensor_sizes(f, cx, x) else { continue };
        if !reduced_axes(f, e).iter().any(|&a| sizes.get(a) == Some(&0)) {
            continue;
        }
        let out = f.exprs[e].output;
        let shape: Vec<_> = f.tvs[out]
            .logical
            .iter()
            .filter(|&&id| f.ids[id].iter_type != IterType::Reduction)
            .map(|&id| f.ids[id].extent)
            .collect();
        let filled = f.full(&shape, Operand::Scalar(init), f.tvs[out].dtype)?;
        f.tvs[x].uses.retain(|&u| u != e);
        replace_tensor(f, out, filled);
    }
    drop_dead_uses(f);
    Ok(())
}

/// Replace each output with no elements for the inputs at hand by a `full` of its shape:
/// nothing need be computed for it, and what it was computed from (a broadcast's expanding
/// mask, an intermediate of 2^40 elements) need not be allocated. In-place outputs keep
/// their definition (their alias names them).
pub fn empty_outputs_to_full(f: &mut Fusion, cx: &super::Ctx) -> Result<()> {
    for o in f.outputs.clone() {
        if f.tvs[o].definition.is_none() || f.aliases.iter().any(|&(out, _)| out == o) {
            continue;
        }
        if !super::holds_nothing(f, cx, o) {
            continue;
        }
        let shape: Vec<_> = f.no_reduction_logical(o).iter().map(|&id| f.ids[id].extent).collect();
        let zero = f.scalars.int(0);
        let filled = f.full(&shape, Operand::Scalar(zero), f.tvs[o].dtype)?;
        if let Some(d) = f.tvs[o].definition {
            for t in f.exprs[d].input_tvs() {
                f.tvs[t].uses.retain(|&u| u != d);
            }
        }
        replace_tensor(f, o, filled);
    }
    drop_dead_uses(f);
    Ok(())
}

/// Make every reader of `old` read `new` instead (outputs and marks included).
fn replace_tensor(f: &mut Fusion, old: TvId, new: TvId) {
    f.note_stand_in(new, old);
    let uses = std::mem::take(&mut f.tvs[old].uses);
    for &u in &uses {
        for o in f.exprs[u].inputs.iter_mut() {
            if *o == Operand::Tensor(old) {
                *o = Operand::Tensor(new);
            }
        }
        if !f.tvs[new].uses.contains(&u) {
            f.tvs[new].uses.push(u);
        }
    }
    // An output that becomes a fusion input (`squeeze(broadcast(x))`) or a view of one (a sum
    // over the size-one axis of a reshaped input) is still written: by a copy, as
    // `add_output(x)` is. So is one that becomes another output (a permute and its inverse of
    // an output): each output is a buffer of its own, which the host hands back.
    let computed = f.tvs[new].definition.is_some();
    let out_new = if f.is_output(old) && (!computed || f.is_output(new)) {
        match f.set(new) {
            Ok(c) => c,
            Err(_) => new,
        }
    } else {
        new
    };
    for o in f.outputs.iter_mut() {
        if *o == old {
            *o = out_new;
        }
    }
    for (o, _) in f.output_views.iter_mut() {
        if *o == old {
            *o = out_new;
        }
    }
    // An output keeps the order it is stored in: kiln's own (`stored_outputs`) or the
    // user's `stride_order`.
    let ordered = f.stored_outputs.contains(&old) || (f.is_output(out_new) && f.tvs[old].allocation.is_some());
    if ordered && out_new != old {
        carry_storage(f, old, out_new);
    }
    let views = f.input_views.iter_mut().map(|(v, _)| v).chain(f.strided_views.iter_mut().map(|(v, _)| v));
    for v in views {
        if *v == old {
            *v = new;
        }
    }
    if f.is_output(out_new) {
        f.tvs[out_new].memory = crate::ir::MemoryType::Global;
    }
    for t in f.segment_after.iter_mut() {
        if *t == old {
            *t = new;
        }
    }
}

/// Give `new`, which replaces output `old`, `old`'s storage order (a later rewrite
/// that recomputes the output keeps where the host reads it).
fn carry_storage(f: &mut Fusion, old: TvId, new: TvId) {
    let (lo, ln) = (f.no_reduction_logical(old), f.no_reduction_logical(new));
    let layout: Option<Vec<usize>> = f.tvs[old]
        .maybe_allocation()
        .iter()
        .filter(|&&id| f.ids[id].iter_type != IterType::Reduction)
        .map(|id| lo.iter().position(|l| l == id))
        .collect();
    if let Some(layout) = layout.filter(|l| l.len() == ln.len() && lo.len() == ln.len()) {
        let alloc: Vec<_> = layout.iter().map(|&a| ln[a]).collect();
        f.tvs[new].contiguity =
            alloc.iter().map(|&id| (f.ids[id].iter_type != IterType::Broadcast).then_some(true)).collect();
        f.tvs[new].allocation = Some(alloc);
    }
    for s in f.stored_outputs.iter_mut() {
        if *s == old {
            *s = new;
        }
    }
}

/// The first tensor with two axes that map to each other (see the module docs), as
/// `(tensor, axis, axis)`.
pub fn self_mapping(f: &Fusion) -> Option<(TvId, usize, usize)> {
    let g = IdGraph::exact(f);
    let mut tvs: FxHashSet<TvId> = FxHashSet::default();
    for e in f.topo_exprs() {
        tvs.insert(f.exprs[e].output);
        tvs.extend(f.exprs[e].input_tvs());
    }
    let mut tvs: Vec<TvId> = tvs.into_iter().collect();
    tvs.sort();
    for t in tvs {
        let l = &f.tvs[t].logical;
        for i in 0..l.len() {
            if f.ids[l[i]].iter_type == IterType::Broadcast {
                continue;
            }
            for j in i + 1..l.len() {
                if f.ids[l[j]].iter_type != IterType::Broadcast && g.same(l[i], l[j]) {
                    return Some((t, i, j));
                }
            }
        }
    }
    None
}

/// Give every output that other threads of the kernel may read back a register copy that
/// they read instead (`cache_before`, then the readers moved to the cache). One thread
/// stores each element of an output; a reader in another thread would race with that
/// store: a reduction's result (stored once per row, read by the whole row's block), a
/// tensor with size-one axes (stored by the first thread along them), a tensor with fewer
/// axes than the kernel iterates (every thread along the others computes it, the first
/// stores it: a per-row value after a block reduction), anything read through a
/// broadcast or a gather (a row max that is both an output and the softmax's shift).
/// Element-wise readers of a full-size output run in the thread that stored the element.
pub fn reread_outputs(f: &mut Fusion) -> Result<()> {
    let dense =
        |f: &Fusion, t: TvId| f.tvs[t].logical.iter().filter(|&&id| f.ids[id].iter_type == IterType::Iteration).count();
    let widest = f.tvs.keys().map(|t| dense(f, t)).max().unwrap_or(0);
    for o in f.outputs.clone() {
        let readers: Vec<_> = f.tvs[o].uses.clone();
        if readers.is_empty() || f.tvs[o].definition.is_none() {
            continue;
        }
        let reduced =
            f.tvs[o].logical.iter().any(|&id| matches!(f.ids[id].iter_type, IterType::Reduction | IterType::Broadcast));
        let broadcast = readers
            .iter()
            .any(|&u| matches!(f.exprs[u].op, Op::Broadcast { .. }) || f.exprs[u].indexed_tensor() == Some(o));
        if !reduced && !broadcast && dense(f, o) == widest {
            continue;
        }
        let c = f.cache_before(o)?;
        for u in readers {
            f.redirect_use(u, o, c);
        }
    }
    Ok(())
}

fn has_broadcast(f: &Fusion, t: TvId) -> bool {
    f.tvs[t].logical.iter().any(|&id| f.ids[id].iter_type == IterType::Broadcast)
}

/// True when expr `u` reads a broadcast axis of `t` along a larger axis, directly or
/// through readers of its own broadcast result.
fn concretizes(f: &Fusion, u: ExprId, t: TvId, depth: usize) -> bool {
    let direct = f.exprs[u].inputs.iter().enumerate().any(|(pos, o)| {
        *o == Operand::Tensor(t)
            && logical_pairs(f, u, pos).into_iter().any(|(p, c)| {
                f.ids[p].iter_type == IterType::Broadcast
                    && f.ids[c].iter_type != IterType::Broadcast
                    && f.scalars.as_int(f.ids[c].extent) != Some(1)
            })
    });
    let out = f.exprs[u].output;
    direct
        || (depth < 64
            && !matches!(f.exprs[u].op, Op::Reduction { .. })
            && has_broadcast(f, out)
            && f.tvs[out].uses.iter().any(|&v| concretizes(f, v, out, depth + 1)))
}

/// The sizes reader `u` gives the broadcast axes of `t` it reads directly (empty where it
/// concretizes them further down its chain).
fn concretized_extents(f: &Fusion, u: ExprId, t: TvId) -> Vec<ValId> {
    let mut out = Vec::new();
    for (pos, o) in f.exprs[u].inputs.iter().enumerate() {
        if *o != Operand::Tensor(t) {
            continue;
        }
        for (p, c) in logical_pairs(f, u, pos) {
            if f.ids[p].iter_type == IterType::Broadcast && f.ids[c].iter_type != IterType::Broadcast {
                out.push(f.ids[c].extent);
            }
        }
    }
    out
}

/// A copy of the element-wise chain that defines `t`, down to tensors without broadcast
/// axes, reductions, inputs and ops that do not move (see `sink_broadcasts`).
fn clone_chain(f: &mut Fusion, t: TvId, memo: &mut FxHashMap<TvId, TvId>) -> Result<TvId> {
    if let Some(&c) = memo.get(&t) {
        return Ok(c);
    }
    let Some(d) = f.tvs[t].definition else { return Ok(t) };
    let op = f.exprs[d].op.clone();
    if !has_broadcast(f, t) || !(op.is_elementwise() || matches!(op, Op::Broadcast { .. })) {
        return Ok(t);
    }
    let mut operands = Vec::new();
    for o in f.exprs[d].inputs.clone() {
        operands.push(match o {
            Operand::Tensor(x) => Operand::Tensor(clone_chain(f, x, memo)?),
            s => s,
        });
    }
    let c = replay(f, op, &operands, f.tvs[t].dtype)?;
    memo.insert(t, c);
    Ok(c)
}

/// A new tensor of `dtype` computed by `op` from `operands`, as the op's builder makes it
/// (element-wise ops, broadcasts, squeezes, permutes, copies and gathers; the others are not
/// replayed).
/// `dtype` is that of the tensor whose definition is replayed: a 0-d operand (`sqrt(s)` of a
/// Double scalar beside a Float tensor) takes no part in type promotion, but once it is
/// remade at its readers' rank (moved through a remap or a squeeze) the builder would
/// promote to it.
pub(crate) fn replay(f: &mut Fusion, op: Op, operands: &[Operand], dtype: DataType) -> Result<TvId> {
    let elementwise = op.is_elementwise();
    let out = replay_promoted(f, op, operands)?;
    if elementwise && f.tvs[out].dtype != dtype {
        f.tvs[out].dtype = dtype;
    }
    Ok(out)
}

fn replay_promoted(f: &mut Fusion, op: Op, operands: &[Operand]) -> Result<TvId> {
    let tensor =
        |i: usize| operands[i].tensor().ok_or_else(|| crate::error::KilnError::internal("replay: a scalar operand"));
    Ok(match op {
        Op::Unary(u) => f.unary(u, operands[0])?,
        Op::Binary(b) => f.binary(b, operands[0], operands[1])?,
        Op::Where => f.where_(operands[0], operands[1], operands[2])?,
        Op::Cast(dt) => f.cast(operands[0], dt)?,
        Op::Broadcast { is_new } => f.broadcast(tensor(0)?, is_new)?,
        Op::Set => f.set(tensor(0)?)?,
        Op::IndexSelect { dim } if f.no_reduction_logical(tensor(1)?).len() == 1 => {
            f.index_select(tensor(0)?, tensor(1)?, dim as i64)?
        }
        Op::IndexSelect { dim } => f.take_along_axis(tensor(0)?, tensor(1)?, dim as i64)?,
        Op::Squeeze { removed } => {
            let dims: Vec<i64> = (0..removed.len()).filter(|&a| removed[a]).map(|a| a as i64).collect();
            f.squeeze(tensor(0)?, &dims)?
        }
        Op::Permute { perm } => {
            let dims: Vec<i64> = perm.iter().map(|&a| a as i64).collect();
            f.permute(tensor(0)?, &dims)?
        }
        Op::Remap { .. }
        | Op::Mask { .. }
        | Op::Reduction { .. }
        | Op::Full { .. }
        | Op::Iota { .. }
        | Op::Random { .. } => {
            crate::bail_internal!("replay: {op:?} is not replayed")
        }
    })
}

/// A second copy of the expr that defines `t`, reading the same operands (recomputation).
pub(crate) fn recompute(f: &mut Fusion, t: TvId) -> Result<TvId> {
    let c = recompute_expr(f, t)?;
    f.note_stand_in(c, t);
    Ok(c)
}

fn recompute_expr(f: &mut Fusion, t: TvId) -> Result<TvId> {
    let Some(d) = f.tvs[t].definition else { crate::bail_internal!("recompute: {} is an input", f.tv_name(t)) };
    let (op, operands) = (f.exprs[d].op.clone(), f.exprs[d].inputs.clone());
    if op.is_source() {
        // Deterministic by element position (random numbers too): a copy has the same values.
        let shape: Vec<_> = f.tvs[t].logical.iter().map(|&id| f.ids[id].extent).collect();
        return f.source("recompute", &shape, op, f.tvs[t].dtype);
    }
    if let (Op::Remap { name, index, valid }, Some(x)) = (&op, operands.first().and_then(|o| o.tensor())) {
        let extents: Vec<_> = f.no_reduction_logical(t).iter().map(|&id| f.ids[id].extent).collect();
        return f.remap(x, name, &extents, index.clone(), *valid);
    }
    replay_as(f, t, op, &operands)
}

/// [`replay`] of `t`'s definition `op` on `operands`, at `t`'s rank: math on scalars alone
/// made at a rank (`log(float(x.size(-1)))` beside `x`, a broadcast scalar's sum) would
/// replay as a 0-d tensor that no loop of `t`'s readers computes.
fn replay_as(f: &mut Fusion, t: TvId, op: Op, operands: &[Operand]) -> Result<TvId> {
    if !f.tvs[t].logical.is_empty() && op.is_elementwise() && operands.iter().all(|o| o.tensor().is_none()) {
        let logical: Vec<_> =
            f.tvs[t].logical.clone().into_iter().map(|id| f.new_id(f.ids[id].extent, f.ids[id].iter_type)).collect();
        let out = f.new_tv(f.tvs[t].dtype, crate::ir::MemoryType::Local, logical);
        f.add_expr(op, operands.iter().copied().collect(), out);
        return Ok(out);
    }
    replay(f, op, operands, f.tvs[t].dtype)
}

/// Give each reader that concretizes a shared broadcast its own copy (see the module docs).
pub fn private_broadcasts(f: &mut Fusion) -> Result<()> {
    for e in f.topo_exprs() {
        let t = f.exprs[e].output;
        if !has_broadcast(f, t) || matches!(f.exprs[e].op, Op::Reduction { .. }) {
            continue;
        }
        let uses = f.tvs[t].uses.clone();
        let (conc, keep): (Vec<ExprId>, Vec<ExprId>) = uses.iter().partition(|&&u| concretizes(f, u, t, 0));
        if conc.is_empty() {
            continue;
        }
        // Readers that all concretize alike share `t`; readers that give its broadcast axes
        // different sizes (Mamba's `exp(dt)[..., None]` times `A[D, N]` and times
        // `B[B, 1, N]`: two unrelated `N`) need it in loops of their own too.
        let conc = if keep.is_empty() && !f.is_output(t) {
            let sizes: Vec<Vec<ValId>> = conc.iter().map(|&u| concretized_extents(f, u, t)).collect();
            let first = sizes.iter().find(|s| !s.is_empty()).cloned().unwrap_or_default();
            let apart: Vec<ExprId> =
                conc.iter().zip(&sizes).filter(|(_, s)| !s.is_empty() && **s != first).map(|(&u, _)| u).collect();
            if apart.is_empty() {
                continue;
            }
            apart
        } else {
            conc
        };
        for u in conc {
            let mut memo = FxHashMap::default();
            let c = clone_chain(f, t, &mut memo)?;
            f.redirect_use(u, t, c);
        }
    }
    Ok(())
}

/// True when `t` is computed from fusion inputs by element-wise ops, broadcasts, squeezes
/// and copies alone (nothing reduced, gathered or generated on the way), in at most
/// `PROLOGUE_EXPRS` exprs: cheap to compute again wherever it is read.
fn pure_prologue(f: &Fusion, t: TvId) -> bool {
    let closure = super::computed_closure(f, &[t]);
    closure.len() <= PROLOGUE_EXPRS
        && closure.iter().all(|&c| {
            f.tvs[c].definition.is_some_and(|d| {
                let op = &f.exprs[d].op;
                op.is_elementwise() || matches!(op, Op::Broadcast { .. } | Op::Squeeze { .. })
            })
        })
}

/// Longest element-wise chain `recompute_prologues` copies for one reader.
const PROLOGUE_EXPRS: usize = 16;

/// A copy of the element-wise chain that defines `t`, down to the fusion inputs.
fn clone_prologue(f: &mut Fusion, t: TvId, memo: &mut FxHashMap<TvId, TvId>) -> Result<TvId> {
    if let Some(&c) = memo.get(&t) {
        return Ok(c);
    }
    let Some(d) = f.tvs[t].definition else { return Ok(t) };
    let op = f.exprs[d].op.clone();
    let mut operands = Vec::new();
    for o in f.exprs[d].inputs.clone() {
        operands.push(match o {
            Operand::Tensor(x) => Operand::Tensor(clone_prologue(f, x, memo)?),
            s => s,
        });
    }
    let c = replay_as(f, t, op, &operands)?;
    memo.insert(t, c);
    Ok(c)
}

/// Give every reader of an element-wise tensor computed from the fusion inputs alone its
/// own copy of that computation (nvFuser's segmenter does the same for its inputs'
/// casts and broadcasts). A fusion that needs several kernels, such as LayerNorm's backward
/// (row sums for `dx`, column sums for `dw` and `db`, all of `xhat = (x - mean) * rstd`),
/// then lets each kernel compute `xhat` from `x` instead of one kernel writing it to Global
/// memory for the next to read back. The segmenter keeps the copies only where the kernels
/// move fewer bytes with them. Returns whether anything was copied.
pub fn recompute_prologues(f: &mut Fusion) -> Result<bool> {
    let mut changed = false;
    for e in f.topo_exprs() {
        let t = f.exprs[e].output;
        let uses = f.tvs[t].uses.clone();
        if uses.len() < 2 || !pure_prologue(f, t) {
            continue;
        }
        for &u in &uses[1..] {
            let mut memo = FxHashMap::default();
            let c = clone_prologue(f, t, &mut memo)?;
            f.redirect_use(u, t, c);
            changed = true;
        }
    }
    Ok(changed)
}
