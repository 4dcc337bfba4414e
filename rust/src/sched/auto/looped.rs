//! Looped normalization scheduler: the normalizations that the register-persistent one
//! cannot hold (rows longer than a block's registers) and those over leading or
//! interleaved axes (softmax over the first axis, BatchNorm over (0, 2, 3) of NCHW). One
//! block per row, or per tile of columns; each reduction is a loop over the row, and each
//! pass reads its inputs again (from L2 while the rows in flight fit there) instead of
//! keeping the row on chip, as Inductor's looped reductions do.
//!
//! - inner (the last axis is reduced): loop domains permuted so that the kept axes lead,
//!   then `[rows (BIDx), ceilDiv(K, u*t*v) (serial), 1 (Unswitch), u (Unroll), t (TIDx), v]`
//!   (no Unswitch level where the row merges axes not adjacent in memory),
//!   vectorized input caches and output stores;
//! - outer (the last axis is kept): the reduced axes lead, then
//!   `[cols/tx (BIDx), tx (TIDx), ceilDiv(R, u*ty) (serial), u (Unroll), ty (TIDy)]`,
//!   coalesced along the kept last axis; a row of at most `MOST_HELD` values per thread is
//!   held in registers instead, `[cols/tx (BIDx), tx (TIDx), held, ceilDiv(R, held) (TIDy)]`,
//!   each full-size input cached once at the thread column and read there by every pass.
//!
//! A tensor read by two passes would need the whole row stored. Instead each reader gets
//! its own copy of the element-wise chain that computes it, back to the inputs, the
//! reductions and the per-row values: arithmetic is cheap next to a row's memory traffic.

use crate::bail;
use crate::error::Result;
use crate::ir::{ExprId, Fusion, IterType, Op, Operand, ParallelType, TvId};
use crate::sched::auto::{canonical, normalization, tensor_sizes, Ctx, Heuristic, Params};

fn merge_range(f: &mut Fusion, t: TvId, start: usize, count: usize) -> Result<()> {
    for _ in 1..count {
        f.merge(t, start as i64, start as i64 + 1)?;
    }
    Ok(())
}

/// Give every pass that reads a row tensor its own copy of it, so that each tensor is
/// computed in the pass that reads it. Reductions and the tensors `shared` accepts (per-row
/// values, one per block) stay single: every pass reads them. Readers that lead to the same
/// reductions and outputs share one copy: they run in one loop nest anyway, and a copy per
/// reader would unfold a chain that reads each value twice (`x = x + h * (tanh(x) - x)`,
/// Newton steps) into a tree, 3^k copies after k steps.
pub(super) fn recompute_per_reader(f: &mut Fusion, shared: &dyn Fn(&Fusion, TvId) -> bool) -> Result<()> {
    // Readers first: a copy adds readers to its producers, which come later in this order.
    for e in f.topo_exprs().into_iter().rev() {
        let t = f.exprs[e].output;
        if matches!(f.exprs[e].op, Op::Reduction { .. }) || shared(f, t) {
            continue;
        }
        // The readers, grouped by the reductions and outputs they lead to.
        let mut groups: Vec<(Vec<TvId>, Vec<ExprId>)> = Vec::new();
        for u in f.tvs[t].uses.clone() {
            let key = sinks(f, f.exprs[u].output);
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, us)) => us.push(u),
                None => groups.push((key, vec![u])),
            }
        }
        // An output is stored by its own loop nest; every group of readers then takes a copy.
        let first = usize::from(!f.is_output(t));
        if groups.len() > first && matches!(f.exprs[e].op, Op::Permute { .. }) {
            bail!("{}: read by several passes over the row, and not recomputed per pass", f.tv_name(t));
        }
        for (_, us) in groups.iter().skip(first) {
            let c = canonical::recompute(f, t)?;
            for &u in us {
                f.redirect_use(u, t, c);
            }
        }
    }
    Ok(())
}

/// The reductions and fusion outputs that `t` flows into (itself included), sorted.
fn sinks(f: &Fusion, t: TvId) -> Vec<TvId> {
    let mut out = Vec::new();
    let mut seen = rustc_hash::FxHashSet::default();
    let mut stack = vec![t];
    while let Some(x) = stack.pop() {
        if !seen.insert(x) {
            continue;
        }
        let reduced = f.tvs[x].definition.is_some_and(|d| matches!(f.exprs[d].op, Op::Reduction { .. }));
        if reduced || f.is_output(x) {
            out.push(x);
        }
        if !reduced {
            stack.extend(f.tvs[x].uses.iter().map(|&u| f.exprs[u].output));
        }
    }
    out.sort_unstable();
    out
}

/// Schedule a normalization as loops over each row (see the module docs).
pub fn schedule(f: &mut Fusion, cx: &Ctx, reductions: &[ExprId]) -> Result<Heuristic> {
    let (reductions, totals) = super::split_totals(f, reductions);
    let totals: Vec<TvId> = totals.iter().map(|&e| f.exprs[e].output).collect();
    let post = super::after_totals(f, &totals);
    if !totals.is_empty() && !is_red_last(f, reductions[0]) {
        bail!(
            "{}: a total over column tiles needs the rows on the blocks; it needs a kernel of its own",
            f.tv_name(totals[0])
        );
    }
    let r0 = f.exprs[reductions[0]].output;
    let logical = f.tvs[r0].logical.clone();
    let n = logical.len();
    let is_red = normalization::reduced_pattern(f, &reductions)?;
    let (red_axes, kept_axes): (Vec<usize>, Vec<usize>) = (0..n).partition(|&a| is_red[a]);
    let k = red_axes.len();
    if k == n {
        bail!(
            "{}: every axis is reduced; a normalization by a total needs it in every block, which one kernel does not have",
            f.tv_name(r0)
        );
    }
    let inner = is_red[n - 1];
    let perm: Vec<usize> = if inner { [kept_axes.clone(), red_axes] } else { [red_axes, kept_axes.clone()] }.concat();
    let permuted = perm.iter().enumerate().any(|(i, &a)| i != a);
    let sizes = tensor_sizes(f, cx, r0)?;
    let row: i64 = (0..n).filter(|&a| is_red[a]).map(|a| sizes[a]).product();
    let cols: i64 = kept_axes.iter().map(|&a| sizes[a]).product();

    // Over trailing axes, a gathered `[rows, 1]` value is one per row too; over leading axes
    // the per-row tensors are the kept axes alone (the others are permuted, these are not).
    let per_row = |f: &Fusion, t: TvId| {
        if inner {
            super::row_value(f, t, &is_red)
        } else {
            f.tvs[t].logical.len() == n - k
                && f.tvs[t].logical.iter().all(|&id| f.ids[id].iter_type != IterType::Reduction)
        }
    };
    let row_tensors = |f: &Fusion| -> Vec<TvId> {
        f.topo_exprs().iter().map(|&e| f.exprs[e].output).filter(|t| !totals.contains(t) && !post.contains(t)).collect()
    };
    let tensors = row_tensors(f);
    let (rows, full_rank): (Vec<TvId>, Vec<TvId>) = tensors.iter().partition(|&&t| f.tvs[t].logical.len() == n - k);
    normalization::check_aligned(f, cx, r0, &rows, &full_rank)?;

    let widest = normalization::widest_moved(f, n);
    let v = if inner && sizes[n - 1] % (16 / widest) == 0 { 16 / widest } else { 1 };
    // Over leading or middle axes, a row short enough for `MOST_HELD` values per thread on
    // `512 / tx` thread rows stays in registers (LayerNorm2d's channels, a softmax over the
    // classes of NCHW): each full-size input is read once, where every pass of the looped
    // schedule read it again.
    let outer_tx = pow2(cols.clamp(1, 32));
    let held = (row + 512 / outer_tx - 1) / (512 / outer_tx);
    let persistent = !inner && totals.is_empty() && held <= MOST_HELD && !outer_rows_looped();
    let mut cached = Vec::new();
    let mut outs = Vec::new();
    if persistent {
        for op in f.inputs.clone() {
            let Operand::Tensor(x) = op else { continue };
            if super::full_size_input(f, x, n) && f.cache_after_plain_reads(x)?.is_some() {
                cached.push(x);
            }
        }
    }
    if v > 1 {
        for op in f.inputs.clone() {
            let Operand::Tensor(x) = op else { continue };
            // A gather's table (a remap's source) is read at the positions it picks, not
            // along the row loops: only the element-wise readers share the vectorized cache.
            if super::full_size_input(f, x, n) && f.cache_after_plain_reads(x)?.is_some() {
                cached.push(x);
            }
        }
        for o in f.outputs.clone() {
            if f.no_reduction_logical(o).len() == n && f.tvs[o].logical.len() == n {
                f.cache_before(o)?;
                outs.push(o);
            }
        }
    }
    let is_cache = |f: &Fusion, t: TvId| {
        f.tvs[t].definition.is_some_and(|d| {
            matches!(f.exprs[d].op, Op::Set) && f.exprs[d].inputs[0].tensor().is_some_and(|x| cached.contains(&x))
        })
    };
    // The copies of a cache are caches too: each pass loads its own vectors. A row held in
    // registers is one cache that every pass reads.
    recompute_per_reader(f, &|f: &Fusion, t: TvId| {
        per_row(f, t) || post.contains(&t) || (persistent && is_cache(f, t))
    })?;
    // A weight: an input broadcast along every kept axis, the same for every row, loaded in
    // its own vector loop.
    let weight = |f: &Fusion, t: TvId| super::row_weight(f, t, &kept_axes);

    let (tx, ty) = if inner {
        let tx = pow2(((row + v - 1) / v).clamp(32, 512));
        // Wave quantization: rows that two 512-thread blocks per SM cannot hold in one wave
        // but four 256-thread blocks can (at up to 64 registers each) run as one wave of
        // the smaller blocks rather than a full wave and a tail of a few SMs (GroupNorm's
        // 512 groups on 132 SMs).
        let sms = cx.device.sm_count;
        let tx = if tx == 512 && cols > 2 * sms && cols <= 4 * sms { 256 } else { tx };
        (tx, 1)
    } else if persistent {
        (outer_tx, (row + held - 1) / held)
    } else {
        let tx = pow2(cols.clamp(1, 32));
        (tx, pow2(row.clamp(1, 512 / tx)).min(512 / tx))
    };
    // Steps each thread has in flight at once: independent loads hide DRAM latency.
    let steps = if inner { (row + tx * v - 1) / (tx * v) } else { (row + ty - 1) / ty };
    // Fewer where a merged row of axes that are not adjacent in memory needs a division per
    // index (NCHW BatchNorm spilled registers at four).
    let most = if !inner {
        8
    } else if permuted {
        2
    } else {
        4
    };
    // Without tiles, codegen unrolls constant loops of up to 16 steps completely, so the
    // serial loop keeps more than 16: a complete unroll of both would hold every step's loads
    // in registers.
    let u = if inner && !permuted {
        // Unswitched tiles, as in the inner reduction schedule (codegen keeps a loop over
        // tiles rolled).
        super::tile_steps(steps)
    } else {
        [8, 4, 2, 1].into_iter().find(|&u| u <= most && steps > 16 * u).unwrap_or(1)
    };
    let tensors = row_tensors(f);
    for &t in &tensors {
        if per_row(f, t) {
            merge_range(f, t, 0, n - k)?;
            if !inner {
                f.split(t, 0, tx, true)?;
                f.parallelize(t, 1, ParallelType::TIDx)?;
            }
            f.parallelize(t, 0, ParallelType::BIDx)?;
            continue;
        }
        normalization::check_rank(f, t, n)?;
        if permuted {
            f.reorder(t, &super::moves_to(&perm))?;
        }
        if inner {
            merge_range(f, t, 0, n - k)?;
            merge_range(f, t, 1, k)?;
            if v > 1 {
                f.split(t, 1, v, true)?;
            }
            f.split(t, 1, tx, true)?; // [rows, serial, tx, v]
            f.split(t, 1, u, true)?; // [rows, serial, u, tx, v]
                                     // Rows of contiguous axes: full tiles run without per-element bounds checks
                                     // (`[rows, serial, 1 (Unswitch), u, tx, v]`). A row merged from axes that are not
                                     // adjacent in memory keeps `[rows, serial, u, tx, v]`: its tiles did not unswitch,
                                     // and the extra loop level doubled NCHW BatchNorm's time (148.7 -> 323.8 us, H200).
            let tile = i64::from(!permuted);
            if !permuted {
                f.split(t, 1, 1, true)?;
                f.parallelize(t, 2, ParallelType::Unswitch)?;
            }
            f.parallelize(t, 0, ParallelType::BIDx)?;
            if u > 1 {
                f.parallelize(t, 2 + tile, ParallelType::Unroll)?;
            }
            f.parallelize(t, 3 + tile, ParallelType::TIDx)?;
            let vectorized = outs.contains(&t) || is_cache(f, t) || (!permuted && weight(f, t));
            if v > 1 && vectorized {
                f.parallelize(t, 4 + tile, ParallelType::Vectorize)?;
            }
        } else if persistent {
            merge_range(f, t, 0, k)?;
            merge_range(f, t, 1, n - k)?;
            f.split(t, 1, tx, true)?; // [R, cols/tx, tx]
            f.split(t, 0, held, false)?; // [held, ceilDiv(R, held), cols/tx, tx]
            f.reorder(t, &[(2, 0), (3, 1), (0, 2), (1, 3)])?; // [cols/tx, tx, held, R/held]
            f.parallelize(t, 0, ParallelType::BIDx)?;
            f.parallelize(t, 1, ParallelType::TIDx)?;
            f.parallelize(t, 3, ParallelType::TIDy)?;
        } else {
            merge_range(f, t, 0, k)?;
            merge_range(f, t, 1, n - k)?;
            f.split(t, 1, tx, true)?; // [R, cols/tx, tx]
            f.split(t, 0, ty, true)?; // [R/ty, ty, cols/tx, tx]
            f.split(t, 0, u, true)?; // [R/(ty u), u, ty, cols/tx, tx]
            f.reorder(t, &[(3, 0), (4, 1)])?; // [cols/tx, tx, serial, u, ty]
            f.parallelize(t, 0, ParallelType::BIDx)?;
            f.parallelize(t, 1, ParallelType::TIDx)?;
            if u > 1 {
                f.parallelize(t, 3, ParallelType::Unroll)?;
            }
            f.parallelize(t, 4, ParallelType::TIDy)?;
        }
    }
    // Totals first: the per-row values they read are inlined into their loops.
    super::schedule_totals(f, cx, &totals, &post, cols)?;
    let is_reduction =
        |f: &Fusion, t: TvId| matches!(f.tvs[t].definition.map(|e| &f.exprs[e].op), Some(Op::Reduction { .. }));
    // A row's results live in the row's loops: the block (inner) or the thread column (outer).
    let row_pos = if inner { 1 } else { 2 };
    for &t in &tensors {
        if f.is_output(t) {
            continue;
        }
        let pos = if is_reduction(f, t) || per_row(f, t) || (persistent && is_cache(f, t)) {
            row_pos
        } else if inner && !permuted && v > 1 && (is_cache(f, t) || weight(f, t)) {
            // A tile's loads in a loop of their own, ahead of its math (as in the inner
            // reduction schedule), so that all of them are in flight together.
            3
        } else if v > 1 && is_cache(f, t) {
            4 // its own vector loop inside the thread's step
        } else {
            -1
        };
        f.inline_at(t, pos)?;
    }
    if persistent {
        return Ok(Heuristic::new(Params::LoopedNormalization {
            outer: 2,
            unroll: held,
            vector: 1,
            threads_x: tx,
            threads_y: 0,
        }));
    }
    Ok(Heuristic::new(Params::LoopedNormalization {
        outer: i64::from(!inner),
        unroll: u,
        vector: v,
        threads_x: tx,
        threads_y: ty,
    }))
}

/// Most values of a row one thread holds in registers over leading or middle axes.
const MOST_HELD: i64 = 16;

/// `KILN_OUTER_ROWS_LOOPED=1` (`true`, `on`, `yes`): rows over leading or middle axes are
/// read again by every pass even where they fit in registers (to measure one against the
/// other). Read once per process, so that cached plans never mix the two.
fn outer_rows_looped() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| super::env_switch("KILN_OUTER_ROWS_LOOPED") == Some(true))
}

/// True when reduction expr `e` reduces the last axis (an inner normalization).
fn is_red_last(f: &Fusion, e: ExprId) -> bool {
    let l = &f.tvs[f.exprs[e].output].logical;
    l.last().is_some_and(|&id| f.ids[id].iter_type == IterType::Reduction)
}

/// The smallest power of two at least `x` (and at least one).
fn pow2(x: i64) -> i64 {
    (x.max(1) as u64).next_power_of_two() as i64
}
