//! Normalization scheduler (softmax, layernorm: reductions whose results are broadcast
//! back onto their inputs): one block per row, each thread keeping `p*v` elements of
//! the row in registers across all reductions, so the input is read once.
//!
//! Every `[rows, K]` tensor becomes `[rows (BIDx), ceilDiv(K/v, p) (TIDx), p, v]`, so a
//! thread's `p` vectors are `t`, `t + T`, ... (coalesced). Tensors read by a reduction
//! and again after it stay in registers (inlined at 2); weights broadcast over rows load
//! one vector at a time (inlined at 3, vectorized); the rest inline fully.

use crate::sched::MAX_CLUSTER;
use rustc_hash::FxHashMap;

use crate::bail;
use crate::error::Result;
use crate::ir::{ExprId, Fusion, IterType, Op, Operand, ParallelType, TvId};
use crate::sched::auto::{tensor_sizes, Ctx, Heuristic, Params};

/// Refuses a tensor of another rank than the normalization's `n`: the row schedules replay
/// one loop structure on every tensor of the row.
pub(super) fn check_rank(f: &Fusion, t: TvId, n: usize) -> Result<()> {
    if f.tvs[t].logical.len() != n {
        bail!(
            "{}: rank differs from the normalization's rank {n}; not covered by the automatic schedule",
            f.tv_name(t)
        );
    }
    Ok(())
}

/// Merge the leading axes into rows and the trailing `k` axes into one.
pub(super) fn rows_and_row(f: &mut Fusion, t: TvId, k: usize) -> Result<()> {
    let n = f.tvs[t].loop_domain.len();
    for _ in 1..(n - k) {
        f.merge(t, 0, 1)?;
    }
    for _ in 1..k {
        f.merge(t, 1, 2)?;
    }
    Ok(())
}

/// True when an op on a reduction's result also reads unreduced values: a full-rank
/// tensor that does not depend on the reduction (computed before it, or a fusion input).
/// That covers softmax and layernorm (the reduction's own input) and RMSNorm
/// (`x * rsqrt(mean(x * x))`: x, not the reduced `x * x`). Ops beside the reduction that
/// only share its input (a second output `x * 2`) do not make a normalization. Several
/// reductions of the same axes where one reads another's result (a row's max, then the
/// sum of `exp(x - max)`) are one too: one block per row computes them all. Independent
/// sums of the same axes (a weight's and a bias's gradient) are a multi-output reduction,
/// which the reduction scheduler splits across blocks.
pub fn is_normalization(f: &Fusion, reductions: &[ExprId]) -> bool {
    let reduced = |e: ExprId| -> Vec<bool> {
        let out = f.exprs[e].output;
        f.tvs[out].logical.iter().map(|&id| f.ids[id].iter_type == IterType::Reduction).collect()
    };
    let chained = || {
        let outs: Vec<TvId> = reductions.iter().map(|&e| f.exprs[e].output).collect();
        let after = super::downstream(f, &outs);
        reductions.iter().any(|&e| after.contains(&f.exprs[e].output))
    };
    if reductions.len() > 1 && reductions.iter().all(|&e| reduced(e) == reduced(reductions[0])) && chained() {
        return true;
    }
    let order = f.topo_exprs();
    reductions.iter().any(|&r| {
        let out = f.exprs[r].output;
        let rank = f.tvs[out].logical.len();
        // Axes the reduction's own input has as size-one broadcasts (a batch of one,
        // `reshape(x, [1, G, C/G, H, W])`): the unreduced tensor may have them too.
        let input_broadcast: Vec<bool> = f.exprs[r].inputs[0].tensor().map_or_else(Vec::new, |x| {
            f.tvs[x].logical.iter().map(|&id| f.ids[id].iter_type == IterType::Broadcast).collect()
        });
        let full = |t: TvId| {
            f.tvs[t]
                .logical
                .iter()
                .enumerate()
                .all(|(a, &id)| f.ids[id].iter_type != IterType::Broadcast || input_broadcast.get(a) == Some(&true))
        };
        let mut dependent = vec![out];
        order.iter().any(|&e| {
            let ex = &f.exprs[e];
            if !ex.input_tvs().any(|t| dependent.contains(&t)) {
                return false;
            }
            dependent.push(ex.output);
            ex.input_tvs().any(|t| !dependent.contains(&t) && f.no_reduction_logical(t).len() == rank && full(t))
        })
    })
}

/// Which axes the normalization's reductions reduce (`true` at a reduced axis); refuses
/// reductions that do not all reduce the same ones.
pub(super) fn reduced_pattern(f: &Fusion, reductions: &[ExprId]) -> Result<Vec<bool>> {
    let pattern = |e: ExprId| -> Vec<bool> {
        f.tvs[f.exprs[e].output].logical.iter().map(|&id| f.ids[id].iter_type == IterType::Reduction).collect()
    };
    let first = pattern(reductions[0]);
    if let Some(&e) = reductions.iter().find(|&&e| pattern(e) != first) {
        bail!(
            "{}: every reduction of a normalization must reduce the same axes as {}",
            f.tv_name(f.exprs[e].output),
            f.tv_name(f.exprs[reductions[0]].output)
        );
    }
    Ok(first)
}

/// Refuses a per-row tensor (`rows`) or a row tensor (`full_rank`) whose axes do not line up
/// with the kept axes or all axes of the reduction `r0`: the schedule replays one loop
/// structure positionally.
pub(super) fn check_aligned(f: &Fusion, cx: &Ctx, r0: TvId, rows: &[TvId], full_rank: &[TvId]) -> Result<()> {
    let logical = &f.tvs[r0].logical;
    let kept = f.no_reduction_logical(r0);
    if let Some(t) = super::misaligned(f, cx, logical, full_rank).or_else(|| super::misaligned(f, cx, &kept, rows)) {
        bail!(
            "{}: its axes do not line up with the normalization's ({} has rank {}); it needs a kernel of its own",
            f.tv_name(t),
            f.tv_name(r0),
            logical.len()
        );
    }
    Ok(())
}

/// Schedule a normalization over the trailing axes.
pub fn schedule(f: &mut Fusion, cx: &Ctx, reductions: &[ExprId]) -> Result<Heuristic> {
    let (reductions, totals) = super::split_totals(f, reductions);
    let totals: Vec<TvId> = totals.iter().map(|&e| f.exprs[e].output).collect();
    let post = super::after_totals(f, &totals);
    let r0 = f.exprs[reductions[0]].output;
    let logical = f.tvs[r0].logical.clone();
    let n = logical.len();
    let is_red = reduced_pattern(f, &reductions)?;
    let k = is_red.iter().filter(|&&b| b).count();
    if n < 2 || !is_red.iter().skip(n - k).all(|&b| b) {
        bail!("{}: only normalizations over the trailing axes are scheduled automatically", f.tv_name(r0));
    }
    if super::rows_in_shared() == Some(true) {
        bail!("{}: KILN_ROWS_IN_SHARED asks for the rows in Shared memory", f.tv_name(r0));
    }
    let sizes = tensor_sizes(f, cx, r0)?;
    let row: i64 = sizes[n - k..].iter().product();
    let widest = widest_moved(f, n);
    let v = if row % (16 / widest) == 0 { 16 / widest } else { 1 };
    let cluster = cluster_size(cx, totals.is_empty(), row, v);
    // Each block's part of the row (the whole row without a cluster).
    let part = row / cluster;
    // Vectors per thread: enough that a row fits in at most 512 threads (measured faster
    // on the H200 than 128 threads with longer per-thread loops).
    let mut p = ((part / v + 511) / 512).clamp(1, 16);
    if (part / v + p - 1) / p > 1024 {
        bail!("rows of {row} elements are too long for a register-persistent normalization (at most {} here); segment the fusion with segment_after", 16 * 1024 * v * cluster);
    }
    // Rows of 64 to 128 vectors: one warp per row, `rows_per_block` rows per block (TIDy).
    // Its reductions are warp shuffles with no block barrier, where a block per row waits at
    // barriers for a few microseconds of loads (H200, BERT attention probabilities
    // [32, 16, 512, 512] fp32: 446 -> 378 us). At 256 vectors a warp's eight loads per
    // thread lose to a block of 256 threads (LayerNorm over 1024 columns: 63.4 -> 78.3 us).
    let rows_total: i64 = sizes[..n - k].iter().product();
    let rows_per_block = if cluster == 1
        && totals.is_empty()
        && (64..=128).contains(&(row / v))
        && rows_total >= 64 * cx.device.sm_count
    {
        p = (row / v + 31) / 32;
        4
    } else {
        1
    };
    // One vector per thread (rows of 256 to 512 vectors) or eight and more: the registers
    // let too few loads be in flight per SM, where rows copied into Shared memory keep every
    // resident row's loads in flight. H200, bf16, fraction of a copy (registers / Shared):
    // softmax 0.78 / 0.86 at 4096 columns and 0.78 / 0.89 at 32768; RMSNorm 0.88 / 0.99 and
    // 0.89 / 0.92; cross-entropy 0.44 / 0.66 and 0.54 / 0.63. At two to four vectors per
    // thread the registers are as fast or faster (softmax over 16384: 0.95 / 0.92).
    //
    // At one vector per thread, only where one input is read along the row: the Shared
    // schedule re-reads every row input from Shared memory in every pass. H200, [16384, 4096]
    // half, Shared / registers: LayerNorm (one input) 69.4 / 79.0 us, RMSNorm 67.0 / 71.2,
    // but the pre-LN residual LayerNorm (`h = x + residual` written and normalized: two
    // inputs, four passes) 141.7 / 125.2 (`python3 benches/families.py --only ...`, with
    // `KILN_ROWS_IN_SHARED=0` for the registers).
    let vectors = row / v;
    let row_inputs =
        f.inputs.iter().filter(|op| matches!(op, Operand::Tensor(x) if super::full_size_input(f, *x, n))).count();
    if super::rows_in_shared() != Some(false)
        && cluster == 1
        && rows_per_block == 1
        && ((p == 1 && vectors >= 256 && row_inputs <= 1) || p >= 8)
        && super::shared::fits_twice(f, cx, n, row)
    {
        bail!(
            "{}: rows of {row} elements keep more loads in flight in Shared memory than with {p} vector(s) per thread in registers",
            f.tv_name(r0)
        );
    }
    let shift = usize::from(rows_per_block > 1);
    // Loop positions: the row's threads (TIDx), then the values each thread holds.
    let base = (1 + shift + usize::from(cluster > 1)) as i64;
    if cluster > 1 {
        f.set_cluster(ParallelType::BIDy, cluster as u32)?;
    }
    // Every full-rank tensor takes part; narrower inputs (weights) are read in place.
    let mut caches = Vec::new();
    for op in f.inputs.clone() {
        let Operand::Tensor(x) = op else { continue };
        // A gather's table (a remap's source) is read at the positions it picks, not along the
        // row loops: only the element-wise readers share the vectorized cache.
        if !super::full_size_input(f, x, n) {
            continue;
        }
        if let Some(c) = f.cache_after_plain_reads(x)? {
            // L2 keeps the input ahead of the output being written (see pointwise.rs):
            // layernorm 16384x4096 fp32 on the H200 127.9 -> 124.4 us, softmax 127.5 -> 126.0.
            if v > 1 && super::evict_last_inputs() {
                f.set_evict_last(c)?;
            }
            caches.push(c);
        }
    }
    let mut outs = Vec::new();
    for o in f.outputs.clone() {
        if f.no_reduction_logical(o).len() == n && f.tvs[o].logical.len() == n {
            f.cache_before(o)?;
            outs.push(o);
        }
    }
    let order = f.topo_exprs();
    let tensors: Vec<TvId> =
        order.iter().map(|&e| f.exprs[e].output).filter(|t| !totals.contains(t) && !post.contains(t)).collect();
    // Per-row values computed from the reductions (a mean or rstd that is also an output):
    // `[rows (BIDx)]`, inlined into the row's loop like the reductions themselves.
    // A weight: an input broadcast along every row axis, the same for every row, or one that
    // varies by row but spans the whole row (an additive mask [B, S] over scores
    // [B, H, S, S]). It loads in its own vector loop (the mask was read element-wise: 16
    // scalar loads a thread where 4 vectors do).
    let kept_axes: Vec<usize> = (0..n - k).collect();
    let weight =
        |f: &Fusion, t: TvId| super::row_weight(f, t, &kept_axes) || super::row_spanning_broadcast(f, t, n - k..n);
    let per_row = |f: &Fusion, t: TvId| super::row_value(f, t, &is_red);
    let (rows, full_rank): (Vec<TvId>, Vec<TvId>) = tensors.iter().partition(|&&t| f.tvs[t].logical.len() == n - k);
    check_aligned(f, cx, r0, &rows, &full_rank)?;
    for &t in &tensors {
        if per_row(f, t) {
            for _ in 1..(n - k) {
                f.merge(t, 0, 1)?;
            }
            if rows_per_block > 1 {
                f.split(t, 0, rows_per_block, true)?; // [rows/R, R]
                f.parallelize(t, 1, ParallelType::TIDy)?;
            }
            f.parallelize(t, 0, ParallelType::BIDx)?;
            continue;
        }
        check_rank(f, t, n)?;
        rows_and_row(f, t, k)?;
        // With a cluster, `[rows, C, K/C]`: block C of the cluster holds part C of the row.
        let a = if cluster > 1 {
            f.split(t, 1, cluster, false)?;
            f.parallelize(t, 1, ParallelType::BIDy)?;
            2
        } else {
            1
        };
        f.split(t, a, v, true)?; // [rows, K/v, v]
        if rows_per_block > 1 {
            // A whole warp per row (its lanes a power of two for the shuffles).
            f.split(t, a, 32, true)?; // [rows, ceilDiv(K/v, 32), 32, v]
        } else {
            f.split(t, a, p, false)?; // [rows, p, ceilDiv(K/v, p), v]
        }
        f.reorder(t, &[(a + 1, a)])?; // [rows, T, p, v]
        if rows_per_block > 1 {
            f.split(t, 0, rows_per_block, true)?; // [rows/R, R, T, p, v]
            f.parallelize(t, 1, ParallelType::TIDy)?;
        }
        f.parallelize(t, 0, ParallelType::BIDx)?;
        f.parallelize(t, base, ParallelType::TIDx)?;
        if v > 1 && (caches.contains(&t) || outs.contains(&t) || weight(f, t)) {
            f.parallelize(t, base + 2, ParallelType::Vectorize)?;
        }
    }
    // Totals first: the per-row values they read are inlined into their loops.
    super::schedule_totals(f, cx, &totals, &post, sizes[..n - k].iter().product())?;
    let is_reduction =
        |f: &Fusion, t: TvId| matches!(f.tvs[t].definition.map(|e| &f.exprs[e].op), Some(Op::Reduction { .. }));
    for &t in &tensors {
        if f.is_output(t) {
            continue;
        }
        let pos = if is_reduction(f, t) || per_row(f, t) {
            1 + shift as i64 // the row's result, shared by every thread of the row
        } else if v > 1 && weight(f, t) {
            base + 2 // a weight broadcast over rows: its own vector loop, so it loads 16 bytes at once
        } else if f.consumers(t).len() > 1 {
            // Read on both sides of a reduction (or by two chains): keep it in registers
            // and let each consumer run its own loops over it.
            base + 1
        } else {
            -1
        };
        f.inline_at(t, pos)?;
    }
    // Registers: every tensor kept across a reduction holds `p * v` values (in float) per
    // thread, on top of roughly 32 for indices and the reductions. A block needing more
    // than the device's registers per block fails to launch, so such rows are refused
    // (the segmenter then streams them through separate kernels).
    // A kept tensor occupies its registers from its definition to its last reader; what
    // is live across a reduction (the block waits there with every row value it still
    // needs) is the most a thread holds at once.
    let order = f.topo_exprs();
    let at: FxHashMap<TvId, usize> = order.iter().enumerate().map(|(i, &e)| (f.exprs[e].output, i)).collect();
    let held: Vec<TvId> = tensors.iter().copied().filter(|&t| f.tvs[t].inline_pos as i64 == base + 1).collect();
    let last_use = |t: TvId| f.tvs[t].uses.iter().filter_map(|u| at.get(&f.exprs[*u].output)).max().copied();
    let kept = order
        .iter()
        .enumerate()
        .filter(|(_, &e)| matches!(f.exprs[e].op, Op::Reduction { .. }))
        .map(|(i, _)| held.iter().filter(|&&t| at[&t] < i && last_use(t).is_some_and(|l| l > i)).count())
        .max()
        .unwrap_or(0)
        .max(held.len().min(1)) as i64;
    let threads = (part / v + p - 1) / p * rows_per_block;
    // A weight along the row loads its `p` vectors ahead of their use in the last pass: about
    // half a row tensor more (NVRTC for sm_90, softmax * w over rows of 40000: 128 registers
    // at 625 threads where `kept * p * v + 32` said 96, and the block did not launch).
    let row_weight = tensors.iter().any(|&t| f.tvs[t].inline_pos as i64 == base + 2);
    let regs = kept.max(1) * p * v + 32 + if row_weight { p * v / 2 } else { 0 };
    if regs > 255 || threads * regs > cx.device.registers_per_block {
        bail!(
            "{}: {kept} row tensors of {row} elements kept in registers need about {regs} registers per thread for {threads} threads, more than the {} of a block",
            f.tv_name(r0),
            cx.device.registers_per_block
        );
    }
    Ok(Heuristic::new(Params::Normalization { vector: v, per_thread: p, rows_per_block, cluster }))
}

/// Blocks per row: 1, or with `KILN_CLUSTER_ROWS=1` on sm_90+ for rows longer than four
/// vectors per thread of 512 threads, the smallest cluster whose blocks' parts are at most
/// that long (the largest, `MAX_CLUSTER`, for longer rows), each part a whole number of
/// vectors. Registers hold each part; the row's reductions combine the cluster's blocks
/// through distributed Shared memory. A total over the rows (`totals`) keeps one block per
/// row. Not the default: on the H200 it lost to the Shared and looped schedules at every
/// length (bf16 softmax, fraction of a copy, 32k / 65k / 131k / 262k columns: 0.667 / 0.588 /
/// 0.378 / 0.349 in clusters, against 0.877 / 0.67 / 0.66 / 0.66 without; DEVELOPERS.md).
fn cluster_size(cx: &Ctx, no_totals: bool, row: i64, v: i64) -> i64 {
    if !no_totals || cx.device.arch < 90 || super::clustered_rows() != Some(true) {
        return 1;
    }
    let vectors = row / v;
    let most = 4 * 512;
    if vectors <= most {
        return 1;
    }
    let sizes: Vec<i64> =
        (1..=MAX_CLUSTER.trailing_zeros()).map(|b| 1i64 << b).filter(|&c| row % (c * v) == 0).collect();
    sizes.iter().copied().find(|&c| vectors / c <= most).or_else(|| sizes.last().copied()).unwrap_or(1)
}

/// Bytes per element of the widest tensor a row schedule of rank `n` may move with vectors:
/// full-size inputs, broadcast inputs (weights among them) and full-rank outputs. Values
/// in registers do not narrow the vectors: a half softmax computed in float loads and
/// stores eight halves at once.
pub(super) fn widest_moved(f: &Fusion, n: usize) -> i64 {
    let inputs = f.inputs.iter().filter_map(|o| o.tensor()).filter(|&x| {
        // Read only at gathered positions (a table), an input does not move with the vectors;
        // one also read element by element (cross-entropy's logits) does.
        let table = f.tvs[x].uses.iter().all(|&e| f.exprs[e].indexed_tensor() == Some(x));
        // A broadcast along the row (a weight) moves with the row's vectors; one constant
        // along the last axis (cross-entropy's labels, one per row) does not.
        let along_last = |e: ExprId| {
            f.tvs[f.exprs[e].output].logical.last().is_some_and(|&id| f.ids[id].iter_type != IterType::Broadcast)
        };
        let broadcast = f.tvs[x].uses.iter().any(|&e| matches!(f.exprs[e].op, Op::Broadcast { .. }) && along_last(e));
        !f.tvs[x].uses.is_empty() && !table && (super::full_size_input(f, x, n) || broadcast)
    });
    // Likewise an output of one value per row (cross-entropy's loss, LayerNorm's mean kept as
    // `[M, 1]`) is written once per row, not with the row's vectors.
    let outputs = f.outputs.iter().copied().filter(|&o| {
        let l = &f.tvs[o].logical;
        l.len() == n && l.last().is_some_and(|&id| f.ids[id].iter_type == IterType::Iteration)
    });
    inputs.chain(outputs).map(|t| f.tvs[t].dtype.size_bytes() as i64).max().unwrap_or(4)
}
