//! Pointwise scheduler, with vectorized caches of the full-size inputs and of the outputs,
//! and everything inlined. Two shapes of iteration space:
//!
//! - 1-D: every tensor as one flat space `[ceilDiv(N, u*t*v) (BIDx), 1 (Unswitch), u (Unroll),
//!   t (TIDx), v]`.
//! - 2-D, when some operand is broadcast (a bias, a per-row scale): outer axes merged into
//!   rows, the innermost axis kept apart, `[ceilDiv(R, u) (BIDy), 1 (Unswitch), u (Unroll),
//!   ceilDiv(C, t*v) (BIDx), t (TIDx), v]`. A broadcast operand is then indexed by the row or
//!   the column directly, instead of by a per-element `flat % C` (an integer division).

use crate::bail;
use crate::error::Result;
use crate::ir::{ExprId, Fusion, IterType, Op, Operand, ParallelType, TvId};
use crate::sched::auto::{broadcast_input, tensor_sizes, Ctx, Heuristic, Params};

/// Merge all loop axes of `t` into one, then split it as `[rest, u, threads, v]`.
pub fn flatten_and_split(f: &mut Fusion, t: TvId, v: i64, threads: i64, unroll: i64) -> Result<()> {
    while f.tvs[t].loop_domain.len() > 1 {
        f.merge(t, 0, 1)?;
    }
    f.split(t, 0, v, true)?;
    f.split(t, 0, threads, true)?;
    if unroll > 1 {
        f.split(t, 0, unroll, true)?;
    }
    // An extent-1 Unswitch loop around the tile: full tiles run without bound checks.
    f.split(t, 0, 1, true)?;
    Ok(())
}

/// True when `v` elements of `t` make one access of at most 16 bytes: a wider element type
/// than the width was chosen for (an int64 index beside float data) loads element by element.
fn fits_vector(f: &Fusion, t: TvId, v: i64) -> bool {
    f.tvs[t].dtype.size_bytes() as i64 * v <= 16
}

/// Compute output `o` in a register copy that its store and its readers in the kernel
/// share. Read back from memory instead, an output that is also an operand (Adam's `v`, read
/// by the parameter update) runs in a loop nest of its own after its store, and two such
/// outputs read across each other's chains (`v2 = v + g`, `m2 = m + v2`, `g / m2`) need
/// each other's nests open at once, which no order of the nests gives.
fn store_from_register(f: &mut Fusion, o: TvId) -> Result<()> {
    let readers = f.tvs[o].uses.clone();
    let c = f.cache_before(o)?;
    for u in readers {
        f.redirect_use(u, o, c);
    }
    Ok(())
}

/// True when `t` has no broadcast axes and the rank of the fusion's outputs.
fn full_size(f: &Fusion, t: TvId, rank: usize) -> bool {
    let l = f.no_reduction_logical(t);
    l.len() == rank && l.iter().all(|&id| f.ids[id].iter_type == IterType::Iteration)
}

/// The fusion's permute and its permutation when it has exactly one and that one keeps
/// the last axis in place (`[B, S, H] -> [S, B, H]`): a copy whose rows stay contiguous,
/// which the pointwise schedule covers by iterating every tensor in the output's order.
///
/// An output stored in another order than its logical one (`add_output(..., stride_order)`,
/// `set_allocation_domain`) counts in that order: `[B, S, H, D] -> [B, H, S, D]` stored as
/// `[B, S, H, D]` (a permuted view, as torch's `transpose` gives) is a plain copy.
pub fn kept_last_permute(f: &Fusion) -> Option<(ExprId, Vec<usize>)> {
    kept_last_permute_at(f, None)
}

/// `kept_last_permute` at the sizes of `cx` where given: an axis of size one there holds
/// no data either (`[N, 1, 1] -> [N, 1, 1]` swapping runtime ones is a copy at those sizes).
pub fn kept_last_permute_at(f: &Fusion, cx: Option<&Ctx>) -> Option<(ExprId, Vec<usize>)> {
    let found = single_permute(f);
    // Size-one (broadcast) axes hold no data: only the order of the others matters, so
    // `[N, 1] -> [1, N]` is a copy too.
    let (e, perm) = found?;
    let x = f.exprs[e].inputs[0].tensor()?;
    let l = f.no_reduction_logical(x);
    let sizes = match cx {
        Some(cx) => Some(super::tensor_sizes(f, cx, x).ok()?),
        None => None,
    };
    let data = |a: &usize| {
        f.ids[l[*a]].iter_type != IterType::Broadcast && sizes.as_ref().is_none_or(|s| s.get(*a) != Some(&1))
    };
    let last_in = (0..l.len()).rev().find(data);
    let stored = stored_through(&output_order(f).ok()?, &perm)?;
    let last_out = stored.iter().rev().find(|a| data(a)).copied();
    (last_in == last_out).then_some((e, perm))
}

/// The permute's input axes in the outputs' stored order: stored axis `i` is input axis
/// `perm[stored[i]]` (`perm` itself when the outputs are stored in logical order). None
/// where the outputs' order has another rank than the permute (a broadcast after it adds
/// axes): their stored order then says nothing about the permute's axes.
fn stored_through(stored: &Option<Vec<usize>>, perm: &[usize]) -> Option<Vec<usize>> {
    match stored {
        None => Some(perm.to_vec()),
        Some(o) if o.len() == perm.len() => Some(o.iter().map(|&i| perm[i]).collect()),
        Some(_) => None,
    }
}

/// The storage order of the fusion's outputs when it is not their logical order: the
/// logical axis each allocation axis is (`[0, 2, 1, 3]`: the second and third swapped);
/// None when every output is stored in logical order. Outputs stored in different orders
/// are refused (one iteration order serves them all).
pub fn output_order(f: &Fusion) -> Result<Option<Vec<usize>>> {
    let order_of = |o: TvId| -> Option<Vec<usize>> {
        let logical = f.no_reduction_logical(o);
        let order: Vec<usize> = f.tvs[o]
            .maybe_allocation()
            .iter()
            .filter(|&&id| f.ids[id].iter_type != IterType::Reduction)
            .filter_map(|id| logical.iter().position(|l| l == id))
            .collect();
        let identity = order.iter().enumerate().all(|(i, &a)| i == a);
        (order.len() == logical.len() && !identity).then_some(order)
    };
    let mut orders = f.outputs.iter().map(|&o| (o, order_of(o)));
    let Some((_, first)) = orders.next() else { return Ok(None) };
    for (o, order) in orders {
        if order != first {
            bail!(
                "{} is stored in another order than the other outputs; one pointwise kernel iterates in one order",
                f.tv_name(o)
            );
        }
    }
    Ok(first)
}

/// Schedule a fusion without reductions, and without permutes other than one that keeps
/// the last axis (`kept_last_permute`).
pub fn schedule(f: &mut Fusion, cx: &Ctx) -> Result<Heuristic> {
    schedule_with(f, cx, false)
}

/// The only permute of `f`, whatever axes it moves.
pub fn single_permute(f: &Fusion) -> Option<(ExprId, Vec<usize>)> {
    let mut found = None;
    for e in f.topo_exprs() {
        if let Op::Permute { perm } = &f.exprs[e].op {
            if found.is_some() {
                return None;
            }
            found = Some((e, perm.clone()));
        }
    }
    found
}

/// Schedule a fusion with one permute that moves the last axis as an element-wise copy in
/// the output's order, without vectors: the reads are strided. The fallback for permutes
/// the tiled transpose does not take (its tiles would span a size-one axis).
pub fn schedule_strided_permute(f: &mut Fusion, cx: &Ctx) -> Result<Heuristic> {
    let mut h = schedule_with(f, cx, true)?;
    if let Params::Pointwise { vector, threads, unroll } = h.params {
        h.params = Params::StridedPermute { vector, threads, unroll };
    }
    Ok(h)
}

fn schedule_with(f: &mut Fusion, cx: &Ctx, any_permute: bool) -> Result<Heuristic> {
    let extents = &cx.extents[..];
    let out = f.outputs[0];
    let rank = f.no_reduction_logical(out).len();
    let sizes = tensor_sizes(f, cx, out)?;
    // One iteration space for every tensor: the outputs share a shape, and every computed
    // tensor has their rank (an index computed for a gather runs in a kernel of its own).
    // Outputs of several shapes computed from disjoint tensors run side by side.
    for &o in &f.outputs {
        let s = tensor_sizes(f, cx, o)?;
        if s != sizes {
            if !any_permute && single_permute(f).is_none() {
                return horizontal(f, cx);
            }
            bail!(
                "outputs {} {:?} and {} {:?} differ in shape; a pointwise kernel writes one shape",
                f.tv_name(out),
                sizes,
                f.tv_name(o),
                s
            );
        }
    }
    // Outputs of equal sizes whose sizes are unrelated symbols (`neg(x)` beside `neg(y)`,
    // `x` and `y` sized independently) flatten to spaces no loop maps to each other: side
    // by side, as outputs of different sizes, where they share no computed tensor.
    let extents_of =
        |f: &Fusion, o: TvId| f.no_reduction_logical(o).iter().map(|&id| f.ids[id].extent).collect::<Vec<_>>();
    let unrelated = f.outputs.iter().any(|&o| extents_of(f, o) != extents_of(f, out));
    if unrelated && !any_permute && single_permute(f).is_none() {
        let mut g = f.clone();
        if let Ok(h) = horizontal_by(&mut g, cx, true) {
            *f = g;
            return Ok(h);
        }
    }
    for e in f.topo_exprs() {
        let t = f.exprs[e].output;
        if f.no_reduction_logical(t).len() != rank {
            bail!("{}: rank {} differs from the outputs' rank {rank}", f.tv_name(t), f.no_reduction_logical(t).len());
        }
    }
    if rank == 0 {
        // A single value: one thread computes it.
        for e in f.topo_exprs() {
            let t = f.exprs[e].output;
            if !f.is_output(t) {
                f.inline_at(t, -1)?;
            }
        }
        return Ok(Heuristic::new(Params::Scalar));
    }
    let numel: i64 = sizes.iter().product();
    let permute = if any_permute { single_permute(f) } else { kept_last_permute_at(f, Some(cx)) };
    // A permute that keeps the last axis only at these sizes (it moves axes of size one)
    // is indexed through the input's symbolic strides: no vectors across it.
    let sized_only = !any_permute && permute.is_some() && kept_last_permute(f).is_none();
    // Every tensor iterates in the order the outputs are stored in, so the stores are
    // contiguous; the innermost stored axis carries the vectors.
    let stored = output_order(f)?;
    // The vector width: 16 bytes of the widest tensor that is accessed with vectors
    // (an int64 index tensor read once per row does not narrow it).
    let vectorized = |f: &Fusion, x: TvId| {
        let indexed = f.tvs[x].uses.iter().any(|&e| f.exprs[e].indexed_tensor() == Some(x));
        full_size(f, x, rank) && !indexed && (!f.is_input(x) || super::dense(f, x))
    };
    // Element sizes of the tensors read or written with vectors.
    let vector_bytes: Vec<i64> = f
        .inputs
        .iter()
        .filter_map(|o| o.tensor())
        .filter(|&x| !f.tvs[x].uses.is_empty())
        .chain(f.outputs.iter().copied())
        .filter(|&x| vectorized(f, x))
        .map(|x| f.tvs[x].dtype.size_bytes() as i64)
        .collect();
    let widest = vector_bytes.iter().copied().max().unwrap_or(4);
    let mut v = (16 / widest).clamp(1, 8);
    // Across a permute the flat order is not the memory order of the tensors before it: a
    // vector must stay within one row of the kept last axis.
    let innermost = stored.as_ref().map_or(rank - 1, |o| o[rank - 1]);
    if any_permute || sized_only || (permute.is_some() && sizes[innermost] % v != 0) {
        v = 1;
    }
    // Outputs stored with another innermost axis than their last: the tensors of the
    // logical order are read across their rows (no vectors), unless the permute before the
    // outputs brings their rows back (checked by `kept_last_permute`).
    if stored.is_some() && innermost != rank - 1 && permute.is_none() {
        v = 1;
    }
    let threads = 128;
    // One vector per thread for 4-byte types, two for 2-byte types when there are many
    // more vectors than the GPU runs at once (measured on the H200, 16384x4096: fp32 127.3 us
    // unrolled by 1, 129.7 by 2, 131.7 by 4; bf16 69.0 us by 2, 74.3 by 1).
    let mut unroll = if v >= 8 && numel / (v * threads) >= 2 * cx.device.sm_count * 16 { 2 } else { 1 };
    // The loads of every vectorized tensor go out before the math that reads them, so each
    // holds `v * unroll` elements in registers at once. Past about 192 registers of them the
    // kernel spills (a sum of 64 fp32 inputs in 4-wide vectors holds 256; 48 inputs, 192,
    // do not spill): a wide fusion gets narrower vectors instead.
    // Reads of inputs through a remap (a slice, a cat's part, a pad) go out before the math
    // too, one per remap: an unrolled scan written as slices of a cat reads its input once
    // per part and step (`t (t + 1) / 2` remaps at `t` steps; 4-wide, 16 steps spilled 6.6 KB).
    let remapped_bytes: i64 = f
        .topo_exprs()
        .into_iter()
        .filter(|&e| matches!(f.exprs[e].op, Op::Remap { .. }))
        .filter(|&e| f.exprs[e].input_tvs().any(|x| f.is_input(x)))
        .map(|e| f.tvs[f.exprs[e].output].dtype.size_bytes() as i64)
        .sum();
    let held_bytes: i64 = vector_bytes.iter().sum::<i64>() + remapped_bytes;
    while held_bytes * v * unroll / 4 > 192 && (unroll > 1 || v > 1) {
        if unroll > 1 {
            unroll = 1;
        } else {
            v /= 2;
        }
    }

    // Vectorized read caches for full-size inputs read element-wise (not through indices).
    let mut vec_tensors = Vec::new();
    for op in f.inputs.clone() {
        let Operand::Tensor(x) = op else { continue };
        let indexed =
            f.tvs[x].uses.iter().any(|&e| op.tensor().is_some() && f.exprs[e].indexed_tensor() == op.tensor());
        if full_size(f, x, rank) && super::dense(f, x) && !f.tvs[x].uses.is_empty() && !indexed {
            let c = f.cache_after(x)?;
            // Inputs are read once, yet L2 evict_last on their loads makes L2 give up the
            // output's dirty lines first, which the H200 measurably prefers (16384x4096:
            // fp32 chain 125.2 -> 124.1 us, bias + GELU 126.5 -> 124.9, bf16 64.4 -> 63.6).
            // The lines stay in L2 after the kernel (DEVELOPERS.md, "L2 evict_last").
            if v > 1 && fits_vector(f, c, v) && super::evict_last_inputs() {
                f.set_evict_last(c)?;
            }
            vec_tensors.push(c);
        }
    }
    for o in f.outputs.clone() {
        if f.tvs[o].definition.is_some() && full_size(f, o, rank) {
            store_from_register(f, o)?;
            vec_tensors.push(o);
        }
    }
    let order = f.topo_exprs();
    let tensors: Vec<TvId> = order.iter().map(|&e| f.exprs[e].output).collect();
    // Tensors before the permute iterate in the output's axis order.
    let mut upstream: Vec<TvId> = Vec::new();
    let mut orient: Vec<(i64, i64)> = Vec::new();
    if let Some((pe, perm)) = &permute {
        let src = f.exprs[*pe].inputs[0].tensor().expect("a permute reads a tensor");
        upstream = super::computed_closure(f, &[src]);
        for &t in &upstream {
            let elsewhere = f.tvs[t].uses.iter().any(|&e| e != *pe && !upstream.contains(&f.exprs[e].output));
            if elsewhere || f.is_output(t) {
                bail!(
                    "{}: read both before and after the permute {}; not covered by the automatic schedule: schedule it by hand",
                    f.tv_name(t),
                    f.tv_name(f.exprs[*pe].output)
                );
            }
        }
        let Some(through) = stored_through(&stored, perm) else {
            bail!(
                "{}: an output of another rank than the permute is stored in another order; not covered by one pointwise kernel",
                f.tv_name(f.exprs[*pe].output)
            );
        };
        orient = super::moves_to(&through);
    }
    let downstream_orient: Vec<(i64, i64)> = stored.as_ref().map(|o| super::moves_to(o)).unwrap_or_default();
    let oriented = |f: &mut Fusion, t: TvId| -> Result<()> {
        if upstream.contains(&t) {
            f.reorder(t, &orient)?;
        } else if !downstream_orient.is_empty() {
            f.reorder(t, &downstream_orient)?;
        }
        Ok(())
    };
    // Rows gathered from a table (index_select along an outer axis) are contiguous along
    // the last axis: they load with vectors like a cache of the table would.
    for &t in &tensors {
        let Some(def) = f.tvs[t].definition else { continue };
        if let (Op::IndexSelect { dim }, Some(Operand::Tensor(table))) = (&f.exprs[def].op, f.exprs[def].inputs.first())
        {
            let table_rank = f.tvs[*table].logical.len();
            if f.is_input(*table)
                && super::dense(f, *table)
                && *dim + 1 < table_rank
                && full_size(f, t, rank)
                && !vec_tensors.contains(&t)
            {
                vec_tensors.push(t);
                // As for the caches above (index_select of 16384 rows: 127.6 -> 125.3 us).
                if v > 1 && super::evict_last_inputs() {
                    f.set_evict_last(t)?;
                }
            }
        }
        // A remap that moves along its input's last axis with its own (a slice, pad or cat
        // of rows, a reshape that keeps the last axis) reads consecutive elements: it loads
        // with vectors where its position and guard allow (`lower::vectorize`).
        if let (Op::Remap { index, .. }, Some(Operand::Tensor(table))) = (&f.exprs[def].op, f.exprs[def].inputs.first())
        {
            let last = crate::ir::Symbol::OutAxis(rank.saturating_sub(1) as u32);
            let coeff = |v: crate::ir::ValId| crate::lower::predicate::linear_coeff(&f.scalars, v, last);
            let unit = index
                .split_last()
                .is_some_and(|(&p, rest)| coeff(p) == Some(1) && rest.iter().all(|&q| coeff(q) == Some(0)));
            if unit
                && f.is_input(*table)
                && super::dense(f, *table)
                && full_size(f, t, rank)
                && !vec_tensors.contains(&t)
            {
                vec_tensors.push(t);
                // Not where other loads read the same input: RoPE's rotate_half reads each
                // line of q three times (q, and the two halves its cat swaps), and with the
                // hint on the two remaps' loads the kernel is slower (H200, [4, 2048, 32,
                // 128] fp32: 72.4 us with it, 70.2 us on the cache's load alone).
                if v > 1 && super::evict_last_inputs() && f.tvs[*table].uses.len() == 1 {
                    f.set_evict_last(t)?;
                }
            }
        }
    }
    // The 2-D schedule tiles rows of the last axis: outputs stored with another innermost
    // axis take the flat one (their rows, in stored order, are what it merges).
    let two_d = if innermost == rank - 1 { two_d_extents(f, cx, out, rank, &tensors)? } else { None };
    if let Some((rows, cols)) = two_d {
        let t2 = (((cols + v - 1) / v + 31) / 32 * 32).clamp(32, 128);
        // Rows per block beside the row's threads, so a block has 128 threads: an SM holds
        // at most 32 blocks, which would leave it half empty with 32-thread blocks.
        let ty = 128 / t2;
        // Two rows per thread at most (bias + GELU, 16384x4096 fp32 on the H200: 129.6 us
        // with two, 132.3 with four, 134.2 with eight).
        let u2 = if rows / (2 * ty) >= 2 * cx.device.sm_count { 2 } else { 1 };
        let row_tiles = (rows + u2 * ty - 1) / (u2 * ty);
        let col_tiles = (cols + t2 * v - 1) / (t2 * v);
        // Row tiles on gridDim.y while they fit it, else on gridDim.x (no such limit) with
        // the column tiles on y.
        let grid = if row_tiles <= MAX_GRID_Y {
            Some((ParallelType::BIDy, ParallelType::BIDx))
        } else if col_tiles <= MAX_GRID_Y {
            Some((ParallelType::BIDx, ParallelType::BIDy))
        } else {
            None
        };
        if let Some((row_grid, col_grid)) = grid {
            // The row length becomes a constant of the kernel: row offsets are then known
            // multiples of the vector width (no run-time alignment checks or scalar fallback
            // paths) and the column bound folds. Only on this path: the heuristic below
            // records it, and plans are shared between sizes with equal heuristics.
            // So are the last extents of the inputs read with vectors (a [B, S, H*D] input
            // viewed as [B, S, H, D]): they are the row strides that decide whether each
            // vector is aligned. Only those: a per-row input's length is the row count,
            // which must not become part of the plan.
            let mut lasts = vec![*f.tvs[out].logical.last().expect("rank >= 2")];
            for &t in &vec_tensors {
                let read = f.tvs[t].definition.and_then(|d| f.exprs[d].inputs.first().and_then(|o| o.tensor()));
                let Some(x) = read.filter(|&x| f.is_input(x)) else { continue };
                if let Some(&id) = f.tvs[x].logical.last() {
                    if f.ids[id].iter_type == IterType::Iteration && !lasts.contains(&id) {
                        lasts.push(id);
                    }
                }
            }
            let specialized = crate::sched::auto::specialize_extents(f, &lasts, extents);
            for &t in &tensors {
                let n = f.tvs[t].loop_domain.len();
                oriented(f, t)?;
                for _ in 0..n.saturating_sub(2) {
                    f.merge(t, 0, 1)?;
                }
                f.split(t, 1, v, true)?;
                f.split(t, 1, t2, true)?;
                f.split(t, 0, ty, true)?;
                f.split(t, 0, u2, true)?;
                f.split(t, 0, 1, true)?;
                // [row tiles, 1 (Unswitch), u (Unroll), ty (TIDy), col tiles, t (TIDx), v]
                f.parallelize(t, 0, row_grid)?;
                f.parallelize(t, 1, ParallelType::Unswitch)?;
                if u2 > 1 {
                    f.parallelize(t, 2, ParallelType::Unroll)?;
                }
                if ty > 1 {
                    f.parallelize(t, 3, ParallelType::TIDy)?;
                }
                f.parallelize(t, 4, col_grid)?;
                f.parallelize(t, 5, ParallelType::TIDx)?;
                if (vec_tensors.contains(&t) || vector_bias(f, t, v)) && v > 1 && fits_vector(f, t, v) {
                    f.parallelize(t, 6, ParallelType::Vectorize)?;
                }
            }
            // Consumers before producers: a broadcast read by two consumers, one of which
            // keeps the broadcast for ops that concretize it later, sees both run the
            // concretized loops (`Fusion::check_inline`).
            for &t in tensors.iter().rev() {
                if !f.is_output(t) {
                    // A broadcast operand (bias) gets its own vector loop: one 16-byte load.
                    let pos = if vector_bias(f, t, v) { 6 } else { -1 };
                    f.inline_at(t, pos)?;
                }
            }
            let rows_on_x = i64::from(row_grid == ParallelType::BIDx);
            let params = Params::Pointwise2d { vector: v, threads: t2, unroll: u2, rows_per_block: ty, rows_on_x };
            return Ok(Heuristic { params, specialized });
        }
    }
    // In the flat space a gather's vector shares one index, which a computed index (a
    // broadcast chain, `canonical::broadcast_computed_indices`) cannot supply from a loop
    // of its own: such gathers load element by element.
    let computed_gathers: Vec<TvId> = vec_tensors
        .iter()
        .copied()
        .filter(|&t| {
            f.tvs[t]
                .definition
                .is_some_and(|def| f.exprs[def].index_tensor().is_some_and(|i| f.tvs[i].definition.is_some()))
        })
        .collect();
    for &t in &computed_gathers {
        f.tvs[t].evict_last_load = false;
    }
    vec_tensors.retain(|t| !computed_gathers.contains(t));
    for &t in &tensors {
        oriented(f, t)?;
        flatten_and_split(f, t, v, threads, unroll)?;
        let (b, u, th, vv) = if unroll > 1 { (0, Some(2), 3, 4) } else { (0, None, 2, 3) };
        f.parallelize(t, b, ParallelType::BIDx)?;
        f.parallelize(t, 1, ParallelType::Unswitch)?;
        if let Some(u) = u {
            f.parallelize(t, u, ParallelType::Unroll)?;
        }
        f.parallelize(t, th, ParallelType::TIDx)?;
        if vec_tensors.contains(&t) && v > 1 && fits_vector(f, t, v) {
            f.parallelize(t, vv, ParallelType::Vectorize)?;
        }
    }
    // Each inlines as deep as its consumers allow; consumers first, as above.
    for &t in tensors.iter().rev() {
        if !f.is_output(t) {
            f.inline_at(t, -1)?;
        }
    }
    Ok(Heuristic::new(Params::Pointwise { vector: v, threads, unroll }))
}

/// Outputs of different shapes whose computations share no computed tensor (a weight's
/// and a bias's update, a tensor and an unrelated vector): each shape class gets its own
/// flat `[blocks (BIDx), 1 (Unswitch), t (TIDx), v]` space in one kernel. The classes'
/// block counts differ; each class's blocks past its own count are predicated off.
fn horizontal(f: &mut Fusion, cx: &Ctx) -> Result<Heuristic> {
    horizontal_by(f, cx, false)
}

/// [`horizontal`], with outputs of equal sizes but different size symbols in classes of
/// their own where `by_symbols`.
fn horizontal_by(f: &mut Fusion, cx: &Ctx, by_symbols: bool) -> Result<Heuristic> {
    let mut classes: Vec<(Vec<i64>, Vec<TvId>)> = Vec::new();
    let mut keys: Vec<Vec<crate::ir::ValId>> = Vec::new();
    for &o in &f.outputs {
        let s = tensor_sizes(f, cx, o)?;
        let key: Vec<crate::ir::ValId> = if by_symbols {
            f.no_reduction_logical(o).iter().map(|&id| f.ids[id].extent).collect()
        } else {
            Vec::new()
        };
        match classes.iter_mut().zip(&keys).find(|((cs, _), k)| *cs == s && **k == key) {
            Some(((_, outs), _)) => outs.push(o),
            None => {
                classes.push((s, vec![o]));
                keys.push(key);
            }
        }
    }
    // The computed tensors of each class; one shared by two classes would need both
    // iteration spaces.
    let mut owner: Vec<(TvId, usize)> = Vec::new();
    let mut owner_of: rustc_hash::FxHashMap<TvId, usize> = rustc_hash::FxHashMap::default();
    for (k, (_, outs)) in classes.iter().enumerate() {
        for t in super::computed_closure(f, outs) {
            if let Some(&j) = owner_of.get(&t) {
                bail!(
                    "{}: outputs {} and {} differ in shape and both are computed from it; a pointwise kernel writes one shape",
                    f.tv_name(t),
                    f.tv_name(classes[j].1[0]),
                    f.tv_name(outs[0])
                );
            }
            owner.push((t, k));
            owner_of.insert(t, k);
        }
    }
    let threads = 128;
    let mut widest_v = 1;
    for (k, (sizes, outs)) in classes.iter().enumerate() {
        let rank = sizes.len();
        let mine: Vec<TvId> = owner.iter().filter(|(_, j)| *j == k).map(|(t, _)| *t).collect();
        let mine_set: rustc_hash::FxHashSet<TvId> = mine.iter().copied().collect();
        if let Some(&t) = mine.iter().find(|&&t| f.no_reduction_logical(t).len() != rank) {
            bail!("{}: rank {} differs from its outputs' rank {rank}", f.tv_name(t), f.no_reduction_logical(t).len());
        }
        // Inputs read only by this class, at its full size, load through vector caches.
        let only_here = |f: &Fusion, x: TvId| {
            !f.tvs[x].uses.is_empty() && f.tvs[x].uses.iter().all(|&e| mine_set.contains(&f.exprs[e].output))
        };
        let gathered = |f: &Fusion, x: TvId| f.tvs[x].uses.iter().any(|&e| f.exprs[e].op.is_gather());
        let inputs: Vec<TvId> = f
            .inputs
            .iter()
            .filter_map(|o| o.tensor())
            .filter(|&x| only_here(f, x) && full_size(f, x, rank) && super::dense(f, x) && !gathered(f, x))
            .collect();
        let widest = inputs
            .iter()
            .chain(outs.iter().filter(|&&o| full_size(f, o, rank)))
            .map(|&x| f.tvs[x].dtype.size_bytes())
            .max()
            .unwrap_or(4) as i64;
        let v = if rank == 0 { 1 } else { (16 / widest).clamp(1, 8) };
        widest_v = widest_v.max(v);
        let mut vec_tensors = Vec::new();
        for x in inputs {
            let c = f.cache_after(x)?;
            if v > 1 && fits_vector(f, c, v) && super::evict_last_inputs() {
                f.set_evict_last(c)?;
            }
            vec_tensors.push(c);
        }
        for &o in outs {
            if f.tvs[o].definition.is_some() && full_size(f, o, rank) {
                store_from_register(f, o)?;
                vec_tensors.push(o);
            }
        }
        // Dependency order, caches included.
        let mine_now: rustc_hash::FxHashSet<TvId> = super::computed_closure(f, outs).into_iter().collect();
        let tensors: Vec<TvId> =
            f.topo_exprs().into_iter().map(|e| f.exprs[e].output).filter(|t| mine_now.contains(t)).collect();
        for &t in &tensors {
            if rank > 0 {
                flatten_and_split(f, t, v, threads, 1)?;
                f.parallelize(t, 0, ParallelType::BIDx)?;
                f.parallelize(t, 1, ParallelType::Unswitch)?;
                f.parallelize(t, 2, ParallelType::TIDx)?;
                if vec_tensors.contains(&t) && v > 1 && fits_vector(f, t, v) {
                    f.parallelize(t, 3, ParallelType::Vectorize)?;
                }
            }
        }
        for &t in &tensors {
            if !f.is_output(t) {
                f.inline_at(t, -1)?;
            }
        }
    }
    Ok(Heuristic::new(Params::Pointwise { vector: widest_v, threads, unroll: 1 }))
}

/// Largest gridDim.y (and z) a launch may have.
const MAX_GRID_Y: i64 = 65535;

/// `(rows, cols)` of the 2-D iteration space when some tensor is broadcast, the output has
/// at least two axes and a row is wide enough to fill a warp with vectors; else None.
fn two_d_extents(f: &Fusion, cx: &Ctx, out: TvId, rank: usize, tensors: &[TvId]) -> Result<Option<(i64, i64)>> {
    if rank < 2 {
        return Ok(None);
    }
    let broadcast = f.inputs.iter().filter_map(|o| o.tensor()).chain(tensors.iter().copied()).any(|t| {
        let l = f.no_reduction_logical(t);
        !l.is_empty() && !full_size(f, t, rank)
    });
    if !broadcast {
        return Ok(None);
    }
    let sizes = tensor_sizes(f, cx, out)?;
    let cols = *sizes.last().unwrap_or(&1);
    let rows: i64 = sizes[..sizes.len() - 1].iter().product();
    Ok((cols >= 64 && rows >= 2).then_some((rows, cols)))
}

/// True when `t` broadcasts a fusion input along the rows and not along its last axis:
/// it can be read with vectors along that axis, in a loop of its own.
/// A [`bias_operand`] whose `v` elements fit one 16-byte access (a Double one beside
/// 4-byte tensors does not).
fn vector_bias(f: &Fusion, t: TvId, v: i64) -> bool {
    v > 1 && v * f.tvs[t].dtype.size_bytes() as i64 <= 16 && bias_operand(f, t)
}

fn bias_operand(f: &Fusion, t: TvId) -> bool {
    let l = &f.tvs[t].logical;
    if !broadcast_input(f, t) || !l.last().is_some_and(|&id| f.ids[id].iter_type == IterType::Iteration) {
        return false;
    }
    // Broadcast along the rows only (a bias), or along some of them (RoPE's cos and sin
    // [S, D] over [B, H, S, D]): then the row loops it shares run a space it has only part
    // of, and it is indexed through its element-wise consumers
    // (`validate::partial_inlining`). H200, RoPE [4, 2048, 32, 128] fp32: 78.0 -> 72.0 us.
    l[..l.len() - 1].iter().all(|&id| f.ids[id].iter_type == IterType::Broadcast)
        || f.tvs[t]
            .uses
            .iter()
            .all(|&e| matches!(f.exprs[e].op, Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_) | Op::Set))
}
