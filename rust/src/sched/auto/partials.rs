//! Column partials: a fusion with row reductions and column reductions of the same
//! `[M, N]` tensors (LayerNorm backward: `dx` needs row sums, `dw` and `db` are column
//! sums) is rewritten so that one kernel reads each input once. Every tensor's row axis
//! `M` becomes `[G, S]` (inputs are viewed so, outputs handed back as `[M, ...]`), and each
//! column reduction becomes a reduction over `S` (the partials `[G, N]`, which the
//! `partials` scheduler's kernel accumulates in registers across a block's `S`
//! rows next to the row reductions) followed by one over `G` (a small second kernel).

use rustc_hash::FxHashMap;

/// Whether the automatic path tries the rewrite: unless `KILN_COLUMN_PARTIALS` is `0`,
/// `false`, `off` or `no`. Read once per process, so plans cached under one setting never
/// serve the other.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| super::env_switch("KILN_COLUMN_PARTIALS") != Some(false))
}

use crate::error::Result;
use crate::ir::{ExprId, Fusion, IterType, Op, Operand, ReductionOp, TvId, ValId};
use crate::sched::auto::{tensor_sizes, Ctx};

/// What an axis of the fusion is: the rows `M` (or its `G` and `S` after the rewrite), the
/// columns `N`, or a broadcast.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Axis {
    Row,
    Col,
    /// A broadcast axis where the rows are (it becomes two, `[G, S]`).
    BRow,
    /// A broadcast axis where the columns are, or of a lower-rank tensor.
    Bcast,
}

impl Axis {
    /// Whether the rewrite makes this axis two (`[G, S]`).
    fn is_row(self) -> bool {
        matches!(self, Axis::Row | Axis::BRow)
    }
}

/// Labels of every tensor's axes (its logical ids without reductions), from the rank-2
/// tensors outward; None when some tensor has no label, or an op other than element-wise,
/// broadcast or reduction is present.
fn labels(f: &Fusion) -> Option<FxHashMap<TvId, Vec<Axis>>> {
    let order = f.topo_exprs();
    let mut lab: FxHashMap<TvId, Vec<Axis>> = FxHashMap::default();
    for t in f.tvs.keys() {
        let kept = f.no_reduction_logical(t);
        if kept.len() == 2 && (f.tvs[t].definition.is_some() || f.is_input(t)) {
            let l = kept
                .iter()
                .enumerate()
                .map(|(i, &id)| match (f.ids[id].iter_type == IterType::Broadcast, i) {
                    (true, 0) => Axis::BRow,
                    (true, _) => Axis::Bcast,
                    (false, 0) => Axis::Row,
                    (false, _) => Axis::Col,
                })
                .collect();
            lab.insert(t, l);
        }
    }
    // Propagate through ops until nothing changes.
    for _ in 0..4 * (order.len() + 1) {
        let mut changed = false;
        for &e in &order {
            let ex = &f.exprs[e];
            let out = ex.output;
            match &ex.op {
                Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_) | Op::Set => {
                    for x in ex.input_tvs() {
                        for (a, b) in [(x, out), (out, x)] {
                            if let (Some(l), None) = (lab.get(&a).cloned(), lab.get(&b)) {
                                if f.no_reduction_logical(b).len() == l.len() {
                                    lab.insert(b, l);
                                    changed = true;
                                }
                            }
                        }
                    }
                }
                Op::Broadcast { is_new } => {
                    let x = ex.input_tvs().next()?;
                    if let (Some(l), None) = (lab.get(&out).cloned(), lab.get(&x)) {
                        let kept: Vec<Axis> = l.iter().zip(is_new).filter(|(_, &n)| !n).map(|(&a, _)| a).collect();
                        lab.insert(x, kept);
                        changed = true;
                    }
                }
                Op::Reduction { .. } => {
                    let x = ex.input_tvs().next()?;
                    if let (Some(l), None) = (lab.get(&x).cloned(), lab.get(&out)) {
                        let kept: Vec<Axis> = f.tvs[out]
                            .logical
                            .iter()
                            .zip(&l)
                            .filter(|(&id, _)| f.ids[id].iter_type != IterType::Reduction)
                            .map(|(_, &a)| a)
                            .collect();
                        lab.insert(out, kept);
                        changed = true;
                    }
                }
                // A constant (broadcast_in_dim's runtime shape): labeled by its readers.
                Op::Full { .. } => {}
                _ => return None,
            }
        }
        if !changed {
            break;
        }
    }
    for &e in &order {
        let ex = &f.exprs[e];
        if !lab.contains_key(&ex.output) || ex.input_tvs().any(|x| !lab.contains_key(&x)) {
            return None;
        }
    }
    Some(lab)
}

/// The reduction `e`'s reduced axes, as labels of its input.
fn reduced(f: &Fusion, lab: &FxHashMap<TvId, Vec<Axis>>, e: ExprId) -> Option<Vec<Axis>> {
    let out = f.exprs[e].output;
    let l = lab.get(&f.exprs[e].input_tvs().next()?)?;
    Some(
        f.tvs[out]
            .logical
            .iter()
            .zip(l)
            .filter(|(&id, _)| f.ids[id].iter_type == IterType::Reduction)
            .map(|(_, &a)| a)
            .collect(),
    )
}

/// `g` rewritten with `S` rows per group, or None when it is not a fusion of row and column
/// reductions this rewrite covers.
pub fn column_partials(g: &Fusion, cx: &Ctx) -> Result<Option<Fusion>> {
    if !g.aliases.is_empty() || !g.output_views.is_empty() || !g.input_views.is_empty() || !g.segment_after.is_empty() {
        return Ok(None);
    }
    let Some(lab) = labels(g) else { return Ok(None) };
    let order = g.topo_exprs();
    let mut rows = 0;
    let mut cols = 0;
    for &e in &order {
        let Op::Reduction { op, .. } = g.exprs[e].op else { continue };
        let Some(r) = reduced(g, &lab, e) else { return Ok(None) };
        match r.as_slice() {
            [Axis::Col] => rows += 1,
            [Axis::Row] if matches!(op, ReductionOp::Sum | ReductionOp::Max | ReductionOp::Min) => cols += 1,
            _ => return Ok(None),
        }
        // Column reductions of `[M, N]` tensors only (a total over the rows of a per-row value
        // is not split).
        let input = g.exprs[e].input_tvs().next().expect("a reduction reads a tensor");
        if r == [Axis::Row] && lab.get(&input).is_some_and(|l| l.len() != 2) {
            return Ok(None);
        }
    }
    if rows == 0 || cols == 0 {
        return Ok(None);
    }
    // Column results go to outputs only (through element-wise ops of the columns).
    for &e in &order {
        if let Op::Reduction { .. } = g.exprs[e].op {
            if reduced(g, &lab, e).as_deref() == Some(&[Axis::Row][..]) {
                let after = crate::sched::auto::downstream(g, &[g.exprs[e].output]);
                if after.iter().any(|t| lab.get(t).is_some_and(|l| l.contains(&Axis::Row))) {
                    return Ok(None);
                }
            }
        }
    }
    // The sizes: M rows of N columns, S rows per block, G blocks in whole waves.
    let Some(t2) = g.tvs.keys().find(|&t| lab.get(&t).is_some_and(|l| l == &[Axis::Row, Axis::Col])) else {
        return Ok(None);
    };
    let sizes = tensor_sizes(g, cx, t2)?;
    let m = sizes[0];
    let Some(s) = [16i64, 32, 8].into_iter().find(|&s| m % s == 0 && m / s >= 2 * cx.device.sm_count) else {
        return Ok(None);
    };
    let mut f = g.clone();
    let row_ext = f.ids[f.tvs[t2].logical[0]].extent;
    let gv = f.scalars.int(m / s);
    let sv = f.scalars.int(s);
    let mut map: FxHashMap<TvId, TvId> = FxHashMap::default();
    // Inputs with a row axis: viewed as [G, S, ...] (a reshape that view_input_reshapes makes
    // a view of the input's buffer).
    for op in g.inputs.clone() {
        let Operand::Tensor(x) = op else { continue };
        let Some(l) = lab.get(&x) else { continue };
        if l.iter().any(|&a| matches!(a, Axis::Bcast | Axis::BRow)) {
            return Ok(None);
        }
        if !l.contains(&Axis::Row) {
            continue;
        }
        let mut shape: Vec<Option<ValId>> = Vec::new();
        for (&a, &id) in l.iter().zip(&f.no_reduction_logical(x)) {
            match a {
                Axis::Row => shape.extend([Some(gv), Some(sv)]),
                _ => shape.push(Some(f.ids[id].extent)),
            }
        }
        let v = f.reshape(x, &shape)?;
        map.insert(x, v);
    }
    let operand = |map: &FxHashMap<TvId, TvId>, o: Operand| match o {
        Operand::Tensor(t) => Operand::Tensor(map.get(&t).copied().unwrap_or(t)),
        s => s,
    };
    for &e in &order {
        let ex = g.exprs[e].clone();
        let out = ex.output;
        let l = &lab[&out];
        let has_rows = |l: &[Axis]| l.iter().any(|a| a.is_row());
        if !has_rows(l) && !ex.input_tvs().any(|x| lab.get(&x).is_some_and(|l| has_rows(l))) {
            continue; // columns only (a weight's cast): unchanged
        }
        let ops: Vec<Operand> = ex.inputs.iter().map(|&o| operand(&map, o)).collect();
        let new = match &ex.op {
            Op::Broadcast { is_new } => {
                let mut flags = Vec::new();
                for (&a, &n) in l.iter().zip(is_new) {
                    flags.extend(if a.is_row() { vec![n, n] } else { vec![n] });
                }
                let x = ops[0].tensor().expect("a broadcast reads a tensor");
                f.broadcast(x, flags)?
            }
            Op::Reduction { op, .. } => {
                let x = ops[0].tensor().expect("a reduction reads a tensor");
                let dt = Some(g.tvs[out].dtype);
                let axes = reduced(g, &lab, e).unwrap_or_default();
                // Reduced positions in the new input: a row axis is two ([G, S]).
                let input_lab = &lab[&ex.input_tvs().next().expect("input")];
                let mut pos = 0i64;
                let mut dims = Vec::new();
                for &a in input_lab {
                    let is_reduced = axes.contains(&a);
                    if a.is_row() {
                        if is_reduced {
                            dims.push(pos + 1);
                        }
                        pos += 2;
                    } else {
                        if is_reduced {
                            dims.push(pos);
                        }
                        pos += 1;
                    }
                }
                if axes == [Axis::Row] {
                    // Partials over each block's S rows, then their total over G.
                    let p = f.reduction(*op, x, &dims, false, dt)?;
                    f.reduction(*op, p, &[dims[0] - 1], false, dt)?
                } else {
                    f.reduction(*op, x, &dims, false, dt)?
                }
            }
            Op::Full { value } => {
                let mut shape = Vec::new();
                for (&a, &id) in l.iter().zip(&g.no_reduction_logical(out)) {
                    match a {
                        Axis::Row => shape.extend([gv, sv]),
                        Axis::BRow => {
                            let one = f.scalars.int(1);
                            shape.extend([one, one]);
                        }
                        _ => shape.push(g.ids[id].extent),
                    }
                }
                f.full(&shape, Operand::Scalar(*value), g.tvs[out].dtype)?
            }
            _ => crate::sched::auto::canonical::replay(&mut f, ex.op.clone(), &ops, g.tvs[out].dtype)?,
        };
        map.insert(out, new);
    }
    // Outputs: the new tensors, reshaped back where they have rows.
    let outs = g.outputs.clone();
    f.outputs.clear();
    for o in outs {
        let n = map.get(&o).copied().unwrap_or(o);
        let l = &lab[&o];
        if l.contains(&Axis::BRow) {
            return Ok(None);
        }
        let o2 = if l.contains(&Axis::Row) {
            let shape: Vec<Option<ValId>> = g
                .no_reduction_logical(o)
                .iter()
                .zip(l)
                .map(|(&id, &a)| Some(if a == Axis::Row { row_ext } else { g.ids[id].extent }))
                .collect();
            f.reshape(n, &shape)?
        } else {
            n
        };
        f.add_output(o2)?;
        f.note_stand_in(o2, o);
    }
    // Drop what the old exprs computed: nothing reads it now.
    crate::sched::auto::canonical::drop_dead_uses(&mut f);
    Ok(Some(f))
}

/// The reductions of a partials kernel, `(rows, partials)`: over the last axis of `[G, S, N]`
/// tensors, and over the middle one; None for any other shape of fusion.
pub fn kernel_reductions(f: &Fusion) -> Option<(Vec<ExprId>, Vec<ExprId>)> {
    let (mut rows, mut parts) = (Vec::new(), Vec::new());
    for e in f.topo_exprs() {
        match &f.exprs[e].op {
            Op::Reduction { .. } => {
                let out = f.exprs[e].output;
                let pattern: Vec<bool> =
                    f.tvs[out].logical.iter().map(|&id| f.ids[id].iter_type == IterType::Reduction).collect();
                match pattern.as_slice() {
                    [false, false, true] => rows.push(e),
                    [false, true, false] => parts.push(e),
                    _ => return None,
                }
            }
            Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_) | Op::Set | Op::Broadcast { .. } => {}
            _ => return None,
        }
    }
    (!rows.is_empty() && !parts.is_empty()).then_some((rows, parts))
}

/// Schedule a partials kernel: one block per group of `S` rows (BIDx), a serial loop over
/// the rows, each row in registers across its row reductions as the normalization
/// schedule keeps it (`[T (TIDx), p, v]`), and each thread's columns of the partials
/// accumulated across the loop.
pub fn schedule(f: &mut Fusion, cx: &Ctx) -> Result<crate::sched::auto::Heuristic> {
    use crate::ir::ParallelType;
    let Some((rows, parts)) = kernel_reductions(f) else {
        crate::bail!("not a kernel of row reductions and column partials");
    };
    let r0 = f.exprs[rows[0]].output;
    let sizes = tensor_sizes(f, cx, r0)?;
    let n = sizes[2];
    // One block per group: fewer groups than a wave of blocks leave SMs idle, where a kernel
    // per class of reductions spreads each over the whole GPU.
    if sizes[0] < cx.device.sm_count {
        crate::bail!(
            "{}: {} groups of rows are fewer than the {} SMs; the partials schedule runs one block per group",
            f.tv_name(r0),
            sizes[0],
            cx.device.sm_count
        );
    }
    let widest = crate::sched::auto::normalization::widest_moved(f, 3);
    let v = if n % (16 / widest) == 0 { 16 / widest } else { 1 };
    // A thread holds p * v elements of each input, in two register stages, beside the
    // row's intermediates and its partials: 8 where the row allows (at least a warp), on at
    // most 512 threads. Small blocks let more of them share an SM (H200, LayerNorm backward,
    // us against 4 per thread on more threads: [16384, 2048] on 256 threads 122.0 against
    // 166.8 on 512; [16384, 1024] on 128 threads 67.8 against 76.9 on 256; [8192, 8192] on
    // 1024 threads 431.7 against 315.2 with two kernels).
    let vectors = (n + v - 1) / v;
    let p = (8 / v).min(vectors / 32).max(1);
    let threads = (vectors + p - 1) / p;
    if p * v > 8 || threads > 512 {
        crate::bail!(
            "rows of {n} elements are too long for the partials schedule (it holds at most 8 per thread on 512 threads)"
        );
    }
    // Rank-2 tensors must be per-row values `[G, S]`: the partials' stored copies are the
    // only `[G, N]` ones, made below.
    for t in f.tvs.keys().collect::<Vec<_>>() {
        if f.tvs[t].definition.is_none() || parts.iter().any(|&e| f.exprs[e].output == t) {
            continue;
        }
        let l = f.tvs[t].logical.len();
        if l != 3 && !(l == 2 && f.no_reduction_logical(t).len() == 2) {
            crate::bail!("{}: rank {l} does not fit the partials schedule", f.tv_name(t));
        }
    }
    let mut caches = Vec::new();
    for op in f.inputs.clone() {
        let Operand::Tensor(x) = op else { continue };
        if !crate::sched::auto::full_size_input(f, x, 3) {
            continue;
        }
        // No evict_last hint: this kernel reads each input once.
        if let Some(c) = f.cache_after_plain_reads(x)? {
            caches.push(c);
        }
    }
    let mut outs = Vec::new();
    for o in f.outputs.clone() {
        if f.tvs[o].logical.len() == 3 && f.no_reduction_logical(o).len() == 3 {
            f.cache_before(o)?;
            outs.push(o);
        }
    }
    // Each partial accumulates in registers across the block's rows (a Local copy that is
    // not inlined, so its loop over the rows is the one the row outputs run) and is stored
    // once after the last row.
    let mut part_outs = Vec::new();
    for &e in &parts {
        let o = f.exprs[e].output;
        f.cache_before(o)?;
        part_outs.push(o);
    }
    let split_row = |f: &mut Fusion, t: TvId, axis: i64| -> Result<()> {
        f.split(t, axis, v, true)?; // [.., N/v, v]
        f.split(t, axis, p, false)?; // [.., p, N/v/p, v]
        f.reorder(t, &[(axis + 1, axis)])?; // [.., T, p, v]
        f.parallelize(t, 0, ParallelType::BIDx)?;
        f.parallelize(t, axis, ParallelType::TIDx)
    };
    let order = f.topo_exprs();
    let tensors: Vec<TvId> = order.iter().map(|&e| f.exprs[e].output).collect();
    // A row's value (`[G, S]`, or broadcast along the row as `[G, S, 1]`): computed once per
    // row, read by the row's threads.
    let per_row = |f: &Fusion, t: TvId| {
        let l = &f.tvs[t].logical;
        l.len() == 2 || (l.len() == 3 && f.ids[l[2]].iter_type == IterType::Broadcast)
    };
    for &t in &tensors {
        if part_outs.contains(&t) {
            split_row(f, t, 1)?; // [G, T, p, v]
            if v > 1 {
                f.parallelize(t, 3, ParallelType::Vectorize)?;
            }
        } else if !per_row(f, t) {
            split_row(f, t, 2)?; // [G, S, T, p, v]
            let weight = crate::sched::auto::row_weight(f, t, &[0, 1]);
            if v > 1 && (caches.contains(&t) || outs.contains(&t) || weight) {
                f.parallelize(t, 4, ParallelType::Vectorize)?;
            }
        } else {
            f.parallelize(t, 0, ParallelType::BIDx)?; // [G, S]
        }
    }
    for &t in &tensors {
        if f.is_output(t) {
            continue;
        }
        let is_row_reduction = rows.iter().any(|&e| f.exprs[e].output == t);
        let is_partial = part_outs.iter().any(|&o| f.producers(o).contains(&t));
        let pos = if is_partial {
            0
        } else if caches.contains(&t) {
            // Every input's row is loaded at the top of the row's iteration, so the loads of
            // one row are in flight together (and circular-buffered below).
            2
        } else if is_row_reduction || per_row(f, t) {
            2 // a row's value, shared by the row's threads
        } else if v > 1 && crate::sched::auto::row_weight(f, t, &[0, 1]) {
            4 // a weight: its own vector loop
        } else if f.consumers(t).len() > 1 {
            2 // kept in registers across the row's reductions
        } else {
            -1
        };
        f.inline_at(t, pos)?;
    }
    // The next row's loads are issued before this row's block reductions: two register
    // stages (three measured slower on H200 LayerNorm backward, 297.6 against 242.5 us).
    for &c in &caches {
        f.circular_buffer(c, 2, Some(1))?;
    }
    Ok(crate::sched::auto::Heuristic::new(crate::sched::auto::Params::ColumnPartials { vector: v, per_thread: p }))
}
