//! Reduction scheduler for fusions with one reduction (plus pointwise ops before it
//! and after it).
//!
//! - inner (reduced axes last): one block per output row:
//!   `[rows (BIDx), ceilDiv(K, u*t*v) (serial), 1 (Unswitch), u (Unroll), t (TIDx), v]`,
//!   vectorized input caches, full tiles without bounds checks; each thread accumulates
//!   serially, one block reduction at the end.
//! - outer (reduced axes first): `[g (BIDy), s (serial), u (Unroll), 4 (TIDy), cols/t (BIDx),
//!   t (TIDx)]`, coalesced along the kept axis, u rows in flight per thread; a grid reduction
//!   over BIDy sized to one full wave of blocks when few column tiles would leave the GPU idle.
//! - full: `[g (BIDx), s (serial), u (Unroll), t (TIDx), v]` with a grid reduction, g one
//!   wave of blocks (a divisor of the work when there is one).
//! - reduced axes between kept ones: the loop domains are permuted first (reduced axes
//!   trailing when the last axis is reduced, else leading), then inner or outer as above.

use crate::bail;
use crate::error::Result;
use crate::ir::{ExprId, Fusion, IterType, Op, Operand, ParallelType, TvId};
use crate::sched::auto::{canonical, tensor_sizes, Ctx, Heuristic, Params};
use rustc_hash::{FxHashMap, FxHashSet};

fn merge_range(f: &mut Fusion, t: TvId, start: usize, count: usize) -> Result<()> {
    for _ in 1..count {
        f.merge(t, start as i64, start as i64 + 1)?;
    }
    Ok(())
}

/// True when `t` has the reduction's rank and size one (broadcast) at every reduced axis
/// (`red_at`): one value per row.
fn size_one_where_reduced(f: &Fusion, t: TvId, red_at: &[bool]) -> bool {
    let l = f.no_reduction_logical(t);
    l.len() == red_at.len()
        && l.iter().zip(red_at).all(|(&id, &red)| !red || f.ids[id].iter_type == IterType::Broadcast)
}

/// The computed tensors other than `r` that do not depend on `r` (its producers, and
/// outputs computed from the same inputs beside it: scheduled like its input) and those
/// that do (ops on its result), each in dependency order. `late`: tensors scheduled after
/// both (totals of the rows and what they compute); neither list holds them.
fn by_dependence(f: &Fusion, rs: &[TvId], late: &[TvId]) -> (Vec<TvId>, Vec<TvId>) {
    let (mut before, mut after) = (Vec::new(), Vec::new());
    let order = f.topo_exprs();
    let skipped: FxHashSet<TvId> = rs.iter().chain(late).copied().collect();
    // Tensors that a reduction or a tensor after one reaches (for membership tests).
    let mut later: FxHashSet<TvId> = rs.iter().copied().collect();
    for &e in &order {
        let o = f.exprs[e].output;
        if skipped.contains(&o) {
            continue;
        }
        if f.exprs[e].input_tvs().any(|t| later.contains(&t)) {
            after.push(o);
            later.insert(o);
        } else {
            before.push(o);
        }
    }
    let late_set: FxHashSet<TvId> = late.iter().copied().collect();
    // A tensor of lower rank than the reduction's input that only ops after the reduction
    // (or the totals) read runs in their space: a running statistic's
    // `(1 - momentum) * running_mean`, cross-entropy's per-row `label != ignore_index`
    // (also when another kernel reads it: it is then stored per row).
    let rank = rs.first().map_or(0, |&r| f.tvs[r].logical.len());
    let reduced = |x: TvId| f.tvs[x].definition.is_some_and(|d| matches!(f.exprs[d].op, Op::Reduction { .. }));
    // Per-row shaped: a lower rank, or size one (broadcast) at every reduced axis (a value
    // gathered at a per-row index, `take_along_axis(x, labels[:, None], 1)`).
    let red_at: Vec<bool> = rs.first().map_or(Vec::new(), |&r| {
        f.tvs[r].logical.iter().map(|&id| f.ids[id].iter_type == IterType::Reduction).collect()
    });
    let per_row = |t: TvId| {
        f.no_reduction_logical(t).len() < rank || (red_at.iter().any(|&r| r) && size_one_where_reduced(f, t, &red_at))
    };
    for i in (0..before.len()).rev() {
        let t = before[i];
        let consumers = f.consumers(t);
        if !reduced(t)
            && f.producers(t).iter().all(|&p| !reduced(p))
            && per_row(t)
            && (f.is_output(t) || !consumers.is_empty())
            && consumers.iter().all(|c| (later.contains(c) && !rs.contains(c)) || late_set.contains(c))
        {
            before.remove(i);
            after.push(t);
            later.insert(t);
        }
    }
    let at: FxHashMap<TvId, usize> = order.iter().enumerate().map(|(i, &e)| (f.exprs[e].output, i)).collect();
    after.sort_by_key(|t| at.get(t).copied());
    (before, after)
}

/// A source of size one along every reduced axis (a row id, `iota(R)[:, None]`) that both the
/// rows and the ops after the reduction read gets a copy for the latter, made in their loops:
/// one tensor cannot run in both the rows' split loops and the per-row loop (NT-Xent's
/// diagonal mask, read again at each row's label).
fn copy_per_row_sources(f: &mut Fusion, rs: &[TvId], late: &[TvId]) -> Result<()> {
    let (before, after) = by_dependence(f, rs, late);
    let Some(&r) = rs.first() else { return Ok(()) };
    let red_at: Vec<bool> = f.tvs[r].logical.iter().map(|&id| f.ids[id].iter_type == IterType::Reduction).collect();
    for p in before {
        let source = f.tvs[p].definition.is_some_and(|d| f.exprs[d].op.is_source());
        if !source || !size_one_where_reduced(f, p, &red_at) || f.is_output(p) {
            continue;
        }
        let later: Vec<ExprId> =
            f.tvs[p].uses.iter().copied().filter(|&u| after.contains(&f.exprs[u].output)).collect();
        if later.is_empty() || later.len() == f.tvs[p].uses.len() {
            continue;
        }
        let c = canonical::recompute(f, p)?;
        for u in later {
            f.redirect_use(u, p, c);
        }
    }
    Ok(())
}

/// Schedule a fusion whose reductions are the exprs `reds`: one, or siblings that reduce
/// the same axes of tensors of one shape and do not read each other (a sum and a count
/// side by side), which share every loop.
pub fn schedule(f: &mut Fusion, cx: &Ctx, reds: &[ExprId]) -> Result<Heuristic> {
    let (reds, totals) = super::split_totals(f, reds);
    let totals: Vec<TvId> = totals.iter().map(|&e| f.exprs[e].output).collect();
    let post = super::after_totals(f, &totals);
    let rs: Vec<TvId> = reds.iter().map(|&e| f.exprs[e].output).collect();
    let everything =
        |f: &Fusion, o: TvId| f.tvs[o].logical.iter().all(|&id| f.ids[id].iter_type == IterType::Reduction);
    if rs.iter().all(|&o| everything(f, o)) {
        return full(f, cx, &rs);
    }
    let r = rs[0];
    let logical = f.tvs[r].logical.clone();
    let n = logical.len();
    let mut is_red: Vec<bool> = logical.iter().map(|&id| f.ids[id].iter_type == IterType::Reduction).collect();
    for &o in &rs[1..] {
        let same = f.tvs[o].logical.len() == n
            && f.tvs[o].logical.iter().map(|&id| f.ids[id].iter_type == IterType::Reduction).eq(is_red.iter().copied());
        if !same {
            bail!(
                "{}: it reduces other axes than {}; sibling reductions must reduce the same ones",
                f.tv_name(o),
                f.tv_name(r)
            );
        }
    }
    let mut sizes = tensor_sizes(f, cx, r)?;
    let k = is_red.iter().filter(|&&b| b).count();
    // Reduced axes between kept ones ([B, R, I] summed over R): permute the loop domains so
    // that they are trailing when the last axis is reduced (an inner reduction, vectors
    // along that last axis) and leading otherwise (an outer reduction, threads along the
    // kept last axis). Memory keeps its layout; only the loops change order.
    let mut perm: Option<Vec<usize>> = None;
    let contiguous = is_red.iter().skip(n - k).all(|&b| b) || is_red.iter().take(k).all(|&b| b);
    if !contiguous {
        let (reduced, kept): (Vec<usize>, Vec<usize>) = (0..n).partition(|&a| is_red[a]);
        let p: Vec<usize> = if is_red[n - 1] { [kept, reduced].concat() } else { [reduced, kept].concat() };
        is_red = p.iter().map(|&a| is_red[a]).collect();
        sizes = p.iter().map(|&a| sizes[a]).collect();
        perm = Some(p);
    }
    let permute = |f: &mut Fusion, x: TvId| -> Result<()> {
        match &perm {
            Some(p) => f.reorder(x, &super::moves_to(p)),
            None => Ok(()),
        }
    };
    let inner = is_red.iter().skip(n - k).all(|&b| b);
    let outer = is_red.iter().take(k).all(|&b| b);
    let red_size: i64 = sizes.iter().zip(&is_red).filter(|(_, &b)| b).map(|(s, _)| *s).product();
    let keep_size: i64 = sizes.iter().zip(&is_red).filter(|(_, &b)| !b).map(|(s, _)| *s).product();

    // Tensors before the reduction (same rank as its input) and after it; totals of the
    // rows and what they compute are placed last.
    let late: Vec<TvId> = totals.iter().chain(&post).copied().collect();
    copy_per_row_sources(f, &rs, &late)?;
    let (before, after) = by_dependence(f, &rs, &late);
    if !totals.is_empty() && !inner {
        bail!(
            "{}: a total needs the rows on the blocks (an inner reduction); it needs a kernel of its own",
            f.tv_name(totals[0])
        );
    }
    if let Some(o) = read_by_a_reduction(f, &rs) {
        bail!("{}: a reduction reads it; reductions of reductions need a kernel each", f.tv_name(o));
    }
    let reduced_at: Vec<bool> = logical.iter().map(|&id| f.ids[id].iter_type == IterType::Reduction).collect();
    let checked: Vec<TvId> = before.iter().chain(&rs[1..]).copied().collect();
    if let Some(t) = super::misaligned(f, cx, &logical, &checked) {
        bail!(
            "{}: its axes do not line up with those of the reduction {}'s input; it needs a kernel of its own",
            f.tv_name(t),
            f.tv_name(r)
        );
    }
    for &t in &after {
        // Consumers of the result must not read unreduced values again (that is a
        // normalization, which needs a persistent schedule or segmentation); kept-rank
        // inputs (a bias per output element) are fine.
        // A gather's table is read at the picked elements only, not along the row.
        // An input of size one along every reduced axis (a per-row value the rows also
        // read) is one value per row, not the unreduced input.
        let table = f.tvs[t].definition.and_then(|d| f.exprs[d].indexed_tensor());
        let reads_before = f
            .producers(t)
            .iter()
            .filter(|&&p| Some(p) != table && !(f.is_input(p) && size_one_where_reduced(f, p, &reduced_at)))
            .any(|p| (before.contains(p) || f.is_input(*p)) && f.no_reduction_logical(*p).len() == n);
        if reads_before {
            bail!(
                "{} combines the reduction {} with its unreduced input (a normalization such as softmax); no automatic schedule covers it yet: schedule it by hand or segment it with segment_after",
                f.tv_name(t),
                f.tv_name(r)
            );
        }
    }
    // Ops after the reduction see its result as kept axes only, or with size-one axes
    // where the reduced ones were (keepdim, a broadcast back to the input's rank). A kept
    // axis may be size one too: a constant of every row (`1 / N` as a tensor).
    let kept_shape =
        |f: &Fusion, t: TvId| f.no_reduction_logical(t).len() == n - k || size_one_where_reduced(f, t, &reduced_at);
    if after.iter().any(|&t| !kept_shape(f, t)) {
        bail!(
            "{}: keepdim/broadcast after the reduction is not covered by the automatic reduction schedule",
            f.tv_name(r)
        );
    }
    let kept: Vec<_> = f.no_reduction_logical(r);
    let (narrow, wide): (Vec<TvId>, Vec<TvId>) = after.iter().partition(|&&t| f.tvs[t].logical.len() == n - k);
    if let Some(t) = super::misaligned(f, cx, &kept, &narrow).or_else(|| super::misaligned(f, cx, &logical, &wide)) {
        bail!(
            "{}: its axes do not line up with the kept axes of the reduction {}; it needs a kernel of its own",
            f.tv_name(t),
            f.tv_name(r)
        );
    }

    if inner {
        // Vector loads along the reduced axes, one block per kept row: of the full-size
        // inputs, which stream, and of inputs broadcast along the kept axes (a weight, or
        // cross-entropy's int64 column index beside the float logits), which every row
        // reads again from L1 or L2. One width for both keeps each warp's loads to whole
        // sectors: element by element, the column index's loads strided by the logits'
        // vectors kept L1 84% busy with DRAM at 44% (H200, cross-entropy over 32000).
        let streamed: Vec<TvId> = f
            .inputs
            .iter()
            .filter_map(|op| op.tensor())
            .filter(|&x| {
                // Read element by element somewhere (cross-entropy's logits, also gathered at
                // the label): those reads stream through the vectorized cache, the gather
                // keeps reading the input at the positions it picks.
                super::full_size_input(f, x, n) && f.tvs[x].uses.iter().any(|&e| f.exprs[e].indexed_tensor() != Some(x))
            })
            .collect();
        let kept_axes: Vec<usize> = (0..n).filter(|&a| !is_red[a]).collect();
        // Vectors along the reduced axes: those must be the input's own.
        let row_weight = |f: &Fusion, t: TvId| {
            perm.is_none()
                && super::row_weight(f, t, &kept_axes)
                && f.tvs[t].logical.len() == n
                && f.tvs[t]
                    .logical
                    .iter()
                    .zip(&is_red)
                    .all(|(&id, &red)| !red || f.ids[id].iter_type != IterType::Broadcast)
        };
        let weight_bytes =
            f.tvs.keys().filter(|&t| row_weight(f, t)).map(|t| f.tvs[t].dtype.size_bytes()).max().unwrap_or(1) as i64;
        let stream_bytes = streamed.iter().map(|&x| f.tvs[x].dtype.size_bytes()).max().unwrap_or(4) as i64;
        let widest = stream_bytes.max(weight_bytes);
        // After a permutation the merged reduced axes are contiguous in memory only along
        // the last one.
        let along = if perm.is_some() { sizes[n - 1] } else { red_size };
        let v = if along % (16 / widest) == 0 { 16 / widest } else { 1 };
        // About two vectors per thread before the block reduction (measured on the H200,
        // 16384x4096 fp32, same runs: 62.6 us with two, 63.1 with four; 63.8 with eight and
        // 63.3 with sixteen against 62.4 with four).
        let t = ((red_size / v / 2).max(32) as u64).next_power_of_two().min(512) as i64;
        // Steps each thread has in flight at once over a long row: independent loads hide
        // DRAM latency. Four: eight steps of float logits beside an int64 column index took
        // 92 registers, one block of 512 threads per SM. The tile of `u` steps is
        // unswitched: every full tile runs without per-element bounds checks, which
        // otherwise cost more instructions than the math of a cross-entropy row and keep the
        // loads of the steps from being issued together.
        let steps = (red_size + t * v - 1) / (t * v);
        let u = super::tile_steps(steps);
        let mut caches = Vec::new();
        let mut cached = Vec::new();
        for x in streamed {
            if let Some(c) = f.cache_after_plain_reads(x)? {
                caches.push(c);
                cached.push(x);
            }
        }
        // A tensor read by several ops (an input read by a max, a log-sum-exp and a masked
        // sum) would be computed in a loop nest of its own and held per thread for the whole
        // row; each reader gets its own copy instead, computed in its reduction's loop
        // (`lower::fuse_loops` merges those loops, and the second load hits L1).
        let pre = by_dependence(f, &rs, &late).0;
        let several = pre.iter().any(|&t| f.tvs[t].uses.len() > 1 && !f.is_output(t));
        if several {
            super::looped::recompute_per_reader(f, &|_: &Fusion, t: TvId| !pre.contains(&t))?;
            caches = f
                .topo_exprs()
                .into_iter()
                .filter(|&e| {
                    matches!(f.exprs[e].op, Op::Set)
                        && f.exprs[e].inputs[0].tensor().is_some_and(|x| cached.contains(&x))
                })
                .map(|e| f.exprs[e].output)
                .collect();
        } else if v > 1 {
            // Read once: keep the stream out of L1 (measured on the H200, 16384x4096 fp32
            // row sum: 62.3 us against 62.7 with allocating loads, same run).
            for &c in &caches {
                f.set_streaming_load(c)?;
            }
        }
        let pre = by_dependence(f, &rs, &late).0;
        for &x in pre.iter().chain(&rs) {
            permute(f, x)?;
            merge_range(f, x, 0, n - k)?;
            merge_range(f, x, 1, k)?;
            f.split(x, 1, v, true)?;
            f.split(x, 1, t, true)?;
            f.split(x, 1, u, true)?; // [rows, serial, u, t, v]
            f.split(x, 1, 1, true)?; // [rows, serial, 1, u, t, v]
            f.parallelize(x, 0, ParallelType::BIDx)?;
            f.parallelize(x, 2, ParallelType::Unswitch)?;
            if u > 1 {
                f.parallelize(x, 3, ParallelType::Unroll)?;
            }
            f.parallelize(x, 4, ParallelType::TIDx)?;
            if (caches.contains(&x) || row_weight(f, x)) && v > 1 {
                f.parallelize(x, 5, ParallelType::Vectorize)?;
            }
        }
        schedule_after(f, &after, n - k)?;
        for &x in &pre {
            f.inline_at(x, -1)?;
        }
        // A tile's loads in a loop of their own, ahead of its math: ptxas otherwise
        // interleaves some of them with the math of the first steps, and their latency is
        // paid inside the tile (H200, cross-entropy over 32000: 796 us against 726 with all
        // of a tile's loads issued together).
        if u > 1 {
            for &x in &pre {
                if caches.contains(&x) || (row_weight(f, x) && v > 1) {
                    f.inline_at(x, 3)?;
                }
            }
        }
        // Totals before inlining: the per-row values they read are inlined into their loops.
        super::schedule_totals(f, cx, &totals, &post, keep_size)?;
        inline_into_after(f, &rs, &after)?;
        return Ok(Heuristic::new(Params::InnerReduction { vector: v, threads: t, unroll: u }));
    }
    if outer {
        // As for rows: a tensor several reductions read would be computed in a loop nest of
        // its own and held per thread for its whole share of the columns (BatchNorm's
        // `sum(x)` beside `sum(x * x)`: an array of 8256 floats per thread over 33000 rows,
        // minutes of NVRTC and local memory); each reader computes its own copy instead.
        let pre = by_dependence(f, &rs, &late).0;
        if pre.iter().any(|&t| f.tvs[t].uses.len() > 1 && !f.is_output(t)) {
            super::looped::recompute_per_reader(f, &|_: &Fusion, t: TvId| !pre.contains(&t))?;
        }
        let before = by_dependence(f, &rs, &late).0;
        let t = if keep_size >= 128 { 128 } else { (keep_size.max(32) as u64).next_power_of_two() as i64 };
        // Rows reduced side by side in a block; fewer when there are fewer rows (a sum over
        // one device's slice of a data-parallel gradient, one row): idle rows of threads
        // would cut the block's bandwidth by as much.
        let ty = (red_size.max(1) as u64).next_power_of_two().min(4) as i64;
        // Rows each thread has in flight at once: independent loads hide DRAM latency.
        let u = if red_size >= 64 * ty { 8 } else { 1 };
        let col_blocks = (keep_size + t - 1) / t;
        // Split the reduced axis across a grid so that the blocks make one full wave (a
        // partial second wave would leave most SMs idle at the end). Ops after the
        // reduction then run where the grid reduction finishes (`Symbol::GridDone`); with
        // sibling reductions they would need two grid results in one thread, which two
        // grid reductions do not guarantee, so those keep one block per column tile.
        let wave = cx.device.sm_count * (2048 / (t * ty)).max(1);
        let g = if (after.is_empty() || rs.len() == 1) && col_blocks < wave {
            (wave / col_blocks).clamp(1, (red_size + ty * u - 1) / (ty * u)).min(1024)
        } else {
            1
        };
        if g > 1 && !after.is_empty() {
            super::grid_results_in_global(f, &rs)?;
        }
        let s = ((red_size + g * ty * u - 1) / (g * ty * u)).max(1);
        for &x in before.iter().chain(&rs) {
            permute(f, x)?;
            merge_range(f, x, 0, k)?;
            merge_range(f, x, 1, n - k)?;
            f.split(x, 1, t, true)?; // [R, cols/t, t]
            f.split(x, 0, ty, true)?; // [R/ty, ty, cols/t, t]
            f.split(x, 0, u, true)?; // [R/(ty u), u, ty, cols/t, t]
            f.split(x, 0, s, true)?; // [g, s, u, ty, cols/t, t]
            if g > 1 {
                f.parallelize(x, 0, ParallelType::BIDy)?;
            }
            if u > 1 {
                f.parallelize(x, 2, ParallelType::Unroll)?;
            }
            f.parallelize(x, 3, ParallelType::TIDy)?;
            f.parallelize(x, 4, ParallelType::BIDx)?;
            f.parallelize(x, 5, ParallelType::TIDx)?;
            // Column tile outermost: [cols/t, t, g, s, u, ty], so ops after the reduction
            // can share its column loops.
            f.reorder(x, &[(4, 0), (5, 1)])?;
        }
        for &x in &after {
            broadcasts_last(f, x)?;
            merge_range(f, x, 0, f.tvs[x].loop_domain.len())?;
            f.split(x, 0, t, true)?;
            f.parallelize(x, 0, ParallelType::BIDx)?;
            f.parallelize(x, 1, ParallelType::TIDx)?;
        }
        for &x in &before {
            f.inline_at(x, -1)?;
        }
        if !after.is_empty() {
            // A reduction that is only an output (a masked max beside a masked mean) has no
            // loops to join: it is stored where it completes.
            let joined: Vec<TvId> = rs.iter().copied().filter(|&x| !f.tvs[x].uses.is_empty()).collect();
            for x in joined {
                f.inline_at(x, 2)?;
            }
        }
        for &x in &after {
            if !f.is_output(x) {
                f.inline_at(x, -1)?;
            }
        }
        return Ok(Heuristic::new(Params::OuterReduction { threads: t, rows: ty, grid: g, serial: s, unroll: u }));
    }
    bail!("internal: {}: the reduced axes are neither leading nor trailing after the permutation", f.tv_name(r))
}

/// Move the size-one axes of a keepdim-shaped tensor behind the kept ones, so that merging
/// them keeps the kept axes' bounds: a merge whose outer axis is a broadcast rebuilds the
/// inner index modulo its extent, and an overrunning thread would alias element 0.
fn broadcasts_last(f: &mut Fusion, x: TvId) -> Result<()> {
    let ld = f.tvs[x].loop_domain.clone();
    let (kept, bcast): (Vec<usize>, Vec<usize>) =
        (0..ld.len()).partition(|&a| f.ids[ld[a]].iter_type != IterType::Broadcast);
    if bcast.is_empty() || kept.is_empty() {
        return Ok(());
    }
    let perm: Vec<usize> = kept.into_iter().chain(bcast).collect();
    f.reorder(x, &super::moves_to(&perm))
}

/// Post-reduction tensors: `[rows]` on BIDx, their size-one axes (keepdim shapes) kept as
/// loops of their own. Merged into the row axis, a value gathered at a per-row index
/// (`[rows, 1]`) would not map onto its squeezed reader's row axis, nor would the index
/// computed for it (`where(label != ignore, label, 0)` broadcast) onto the gather's; a
/// tensor read both by a gather's index and by a row total (the count of valid labels)
/// needs one form for both.
fn schedule_after(f: &mut Fusion, after: &[TvId], rank: usize) -> Result<()> {
    for &x in after {
        broadcasts_last(f, x)?;
        let merged = if rank > 0 { rank } else { f.tvs[x].loop_domain.len() };
        merge_range(f, x, 0, merged)?;
        f.parallelize(x, 0, ParallelType::BIDx)?;
    }
    Ok(())
}

fn inline_into_after(f: &mut Fusion, rs: &[TvId], after: &[TvId]) -> Result<()> {
    if !after.is_empty() {
        // A reduction that is only an output (a row max beside a row mean) has no loops to
        // join: it is stored where it completes.
        let joined: Vec<TvId> = rs.iter().copied().filter(|&r| !f.tvs[r].uses.is_empty()).collect();
        for r in joined {
            f.inline_at(r, 1)?;
        }
    }
    for &x in after {
        if !f.is_output(x) {
            f.inline_at(x, -1)?;
        }
    }
    Ok(())
}

/// The first of `rs` (in their order) that another of `rs` is computed from, if any.
fn read_by_a_reduction(f: &Fusion, rs: &[TvId]) -> Option<TvId> {
    // Per tensor, the reductions of `rs` it is computed from (itself included).
    let mut from: FxHashMap<TvId, Vec<TvId>> = rs.iter().map(|&r| (r, vec![r])).collect();
    let mut read = FxHashSet::default();
    for e in f.topo_exprs() {
        let o = f.exprs[e].output;
        let mut srcs: Vec<TvId> = f.exprs[e].input_tvs().filter_map(|t| from.get(&t)).flatten().copied().collect();
        if srcs.is_empty() {
            continue;
        }
        srcs.sort_unstable();
        srcs.dedup();
        if rs.contains(&o) {
            read.extend(srcs.iter().copied());
        }
        from.entry(o).or_default().extend(srcs);
    }
    rs.iter().copied().find(|r| read.contains(r))
}

/// Give each of the full reductions `rs` its own copy of an element-wise tensor that leads
/// to several of them (a masked mean's `cast(mask)`, summed itself and multiplied into the
/// loss): each reduction runs its own loop nest, and one copy shared by two nests was held
/// whole by every thread between them (256 registers a thread at 16384 x 4096) or could not
/// be placed at all. A tensor that is an output, or also leads to an output, stays one.
fn copies_per_reduction(f: &mut Fusion, rs: &[TvId]) -> Result<()> {
    // Readers first: a copy adds readers to its producers, which come later in this order.
    for e in f.topo_exprs().into_iter().rev() {
        let t = f.exprs[e].output;
        if rs.contains(&t) || f.is_output(t) || !f.exprs[e].op.is_elementwise() {
            continue;
        }
        // The reductions of `rs` each reader leads to; None where it also reaches an output.
        let mut groups: Vec<(Option<TvId>, Vec<ExprId>)> = Vec::new();
        for u in f.tvs[t].uses.clone() {
            let reached = reduction_reached(f, rs, f.exprs[u].output);
            match groups.iter_mut().find(|(k, _)| *k == reached) {
                Some((_, us)) => us.push(u),
                None => groups.push((reached, vec![u])),
            }
        }
        if groups.len() < 2 || groups.iter().any(|(k, _)| k.is_none()) {
            continue;
        }
        for (_, us) in groups.iter().skip(1) {
            let c = canonical::recompute(f, t)?;
            for &u in us {
                f.redirect_use(u, t, c);
            }
        }
    }
    Ok(())
}

/// The one reduction of `rs` that `t` flows into (itself included), or None where it flows
/// into several, into none, or into an output that is not one of them.
fn reduction_reached(f: &Fusion, rs: &[TvId], t: TvId) -> Option<TvId> {
    let mut found: Option<TvId> = None;
    let mut stack = vec![t];
    let mut seen = FxHashSet::default();
    while let Some(x) = stack.pop() {
        if !seen.insert(x) {
            continue;
        }
        if rs.contains(&x) {
            if found.is_some_and(|r| r != x) {
                return None;
            }
            found = Some(x);
            continue;
        }
        if f.is_output(x) {
            return None;
        }
        stack.extend(f.tvs[x].uses.iter().map(|&u| f.exprs[u].output));
    }
    found
}

/// Everything reduced: a grid of blocks each summing a strided share, one loop nest per
/// reduction (several totals of tensors of different shapes share the grid: the squares of
/// a weight's and a bias's gradients summed into one norm).
fn full(f: &mut Fusion, cx: &Ctx, rs: &[TvId]) -> Result<Heuristic> {
    copies_per_reduction(f, rs)?;
    let (before, after) = by_dependence(f, rs, &[]);
    if let Some(o) = read_by_a_reduction(f, rs) {
        bail!("{}: a reduction reads it; reductions of reductions need a kernel each", f.tv_name(o));
    }
    if let Some(&t) = after.iter().find(|&&t| !f.no_reduction_logical(t).is_empty()) {
        bail!(
            "{}: reads a total, which only the block that finishes it has; it needs a kernel of its own",
            f.tv_name(t)
        );
    }
    // Each tensor before the reductions runs in the loops of the reduction it flows into, else
    // of the first one it lines up with.
    let mut groups: Vec<Vec<TvId>> = vec![Vec::new(); rs.len()];
    let graph = crate::analysis::id_graph::IdGraph::permissive(f);
    for &t in &before {
        let aligned = |r: TvId| super::misaligned_in(&graph, f, cx, &f.tvs[r].logical, &[t]).is_none();
        // The nest of the one reduction it flows into, where it lines up with it.
        let own = reduction_reached(f, rs, t).filter(|&r| aligned(r)).and_then(|r| rs.iter().position(|&x| x == r));
        let Some(i) = own.or_else(|| rs.iter().position(|&r| aligned(r))) else {
            bail!(
                "{}: its axes do not line up with those of any reduction's input; it needs a kernel of its own",
                f.tv_name(t)
            );
        };
        groups[i].push(t);
    }
    let t = 512;
    let widest = f.tvs.values().map(|t| t.dtype.size_bytes()).max().unwrap_or(4) as i64;
    let totals: Vec<i64> = rs.iter().map(|&r| Ok(tensor_sizes(f, cx, r)?.iter().product())).collect::<Result<_>>()?;
    let vector = |total: i64| if total % (16 / widest) == 0 { 16 / widest } else { 1 };
    // Vectors of the whole block, per reduction; the grid is sized by the largest.
    let rows = |total: i64| (total + t * vector(total) - 1) / (t * vector(total));
    let most = totals.iter().map(|&n| rows(n)).max().unwrap_or(1);
    // Blocks: one full wave (four 512-thread blocks per SM), preferring a count that divides
    // the work evenly so no block runs a partial last step.
    let wave = 4 * cx.device.sm_count;
    let g = (2 * cx.device.sm_count..=wave).rev().find(|&g| most % g == 0).unwrap_or(most.clamp(1, wave));
    let mut params = Vec::new();
    for (i, &r) in rs.iter().enumerate() {
        let n = f.tvs[r].loop_domain.len();
        let v = vector(totals[i]);
        let s = ((rows(totals[i]) + g - 1) / g).max(1);
        // Steps each thread has in flight at once: independent loads hide DRAM latency.
        let u = [4, 2].into_iter().find(|&u| s % u == 0).unwrap_or(1);
        let s = s / u;
        params.push((v, s, u));
        // Vectorized read caches of the full-size inputs this reduction reads.
        let mut caches = Vec::new();
        let reads: Vec<TvId> = groups[i].iter().chain([&r]).flat_map(|&x| f.producers(x)).collect();
        for op in f.inputs.clone() {
            let Operand::Tensor(x) = op else { continue };
            if v > 1 && reads.contains(&x) && super::full_size_input(f, x, n) && !f.tvs[x].uses.is_empty() {
                // Only this nest's readers: another reduction's nest loads its own vectors.
                // A remap or gather reads its input at positions it computes, from memory
                // (`x[1:].sum()`): it keeps reading the input.
                let members: Vec<TvId> = groups[i].iter().chain([&r]).copied().collect();
                let mine: Vec<ExprId> = f.tvs[x]
                    .uses
                    .iter()
                    .copied()
                    .filter(|&u| members.contains(&f.exprs[u].output) && f.exprs[u].indexed_tensor() != Some(x))
                    .collect();
                if mine.is_empty() {
                    continue;
                }
                let c = f.cache_after_uses(x, mine)?;
                // Read once, like the inner case (full sum: 64.8 us against 65.3).
                f.set_streaming_load(c)?;
                caches.push(c);
                groups[i].push(c);
            }
        }
        for &x in groups[i].iter().chain([&r]) {
            merge_range(f, x, 0, n)?;
            f.split(x, 0, v, true)?; // [N/v, v]
            f.split(x, 0, t, true)?; // [N/(t v), t, v]
            f.split(x, 0, u, true)?; // [N/(t v u), u, t, v]
            f.split(x, 0, s, true)?; // [g, s, u, t, v]
            f.parallelize(x, 0, ParallelType::BIDx)?;
            if u > 1 {
                f.parallelize(x, 2, ParallelType::Unroll)?;
            }
            f.parallelize(x, 3, ParallelType::TIDx)?;
            if caches.contains(&x) {
                f.parallelize(x, 4, ParallelType::Vectorize)?;
            }
        }
        for &x in &groups[i] {
            f.inline_at(x, -1)?;
        }
    }
    // Ops on the totals (a mean's scale, a norm's square root and clip coefficient) run in
    // the thread that finishes the last grid reduction, which reads the totals back from
    // Global.
    if !after.is_empty() {
        super::grid_results_in_global(f, rs)?;
        for &x in &after {
            if !f.is_output(x) {
                f.inline_at(x, -1)?;
            }
        }
    }
    let (vector, serial, unroll) = params[0];
    Ok(Heuristic::new(Params::FullReduction {
        threads: t,
        vector,
        grid: g,
        serial,
        unroll,
        others: params[1..].iter().flat_map(|&(v, s, u)| [v, s, u]).collect(),
    }))
}
