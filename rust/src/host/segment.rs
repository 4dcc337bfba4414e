//! Segmentation: split a fusion into segments (one kernel each) from a partition of its
//! exprs. The user (or, later, a scheduler) marks tensors with `segment_after`; every
//! expr lands in the earliest segment after all marked tensors it depends on. Tensors
//! produced in one segment and read in a later one become Global intermediates of the
//! host program: outputs of the producing segment, inputs of the consuming ones.

use rustc_hash::{FxHashMap, FxHashSet};

use crate::bail;
use crate::error::Result;
use crate::ir::scalar::Val;
use crate::ir::{ExprId, Fusion, IterType, MemoryType, Op, Operand, Symbol, TvId};

/// One segment: its exprs (dependency order), tensor inputs and outputs.
#[derive(Clone, Debug)]
pub struct Segment {
    pub exprs: Vec<ExprId>,
    /// Tensor inputs in kernel parameter order: fusion inputs first, then intermediates.
    pub inputs: Vec<TvId>,
    /// Outputs in kernel parameter order: fusion outputs first, then intermediates.
    pub outputs: Vec<TvId>,
}

impl Fusion {
    /// Start a new segment after the definition of `tv` (`fd.segment_after(t)`).
    pub fn mark_segment_after(&mut self, tv: TvId) -> Result<()> {
        let name = self.tv_name(tv);
        if self.tvs[tv].definition.is_none() {
            bail!("segment_after {name}: {name} is a fusion input; only computed tensors can end a segment");
        }
        if let Some(a) = &self.tvs[tv].allocation {
            if a != &self.tvs[tv].logical {
                bail!("segment_after {name}: {name} has a set allocation domain; a tensor crossing segments must be laid out in logical order");
            }
        }
        if !self.segment_after.contains(&tv) {
            self.segment_after.push(tv);
        }
        Ok(())
    }
}

/// Partition `f` into segments (a single segment when nothing is marked).
pub fn segments(f: &Fusion) -> Result<Vec<Segment>> {
    let order = f.topo_exprs();
    // Level of each tensor: the segment it is produced in (inputs: 0).
    let mut level: FxHashMap<TvId, usize> = FxHashMap::default();
    let mut expr_level: Vec<(ExprId, usize)> = Vec::with_capacity(order.len());
    let boundary = |e: ExprId| matches!(f.exprs[e].op, Op::Reduction { .. } | Op::Permute { .. });
    let mut boundary_levels: FxHashSet<usize> = FxHashSet::default();
    let mut top = 0;
    for &e in &order {
        let mut l = 0;
        for t in f.exprs[e].input_tvs() {
            let bump = usize::from(f.segment_after.contains(&t));
            l = l.max(level.get(&t).copied().unwrap_or(0) + bump);
        }
        if f.segment_each_boundary && boundary(e) {
            // A level that already holds a reduction or permute: open a new one after all.
            if !boundary_levels.insert(l) {
                l = top + 1;
                boundary_levels.insert(l);
            }
        }
        top = top.max(l);
        level.insert(f.exprs[e].output, l);
        expr_level.push((e, l));
    }
    let mut levels: Vec<usize> = expr_level.iter().map(|&(_, l)| l).collect();
    levels.sort_unstable();
    levels.dedup();
    let seg_of_level: FxHashMap<usize, usize> = levels.iter().enumerate().map(|(i, &l)| (l, i)).collect();
    let n = levels.len().max(1);
    let mut exprs: Vec<Vec<ExprId>> = vec![Vec::new(); n];
    for &(e, l) in &expr_level {
        exprs[seg_of_level[&l]].push(e);
    }
    segments_from_groups(f, &exprs)
}

/// Segments of `f` from a partition of its live exprs into groups, listed so that every
/// group comes after the groups it reads from (each group's exprs in dependency order).
pub fn segments_from_groups(f: &Fusion, groups: &[Vec<ExprId>]) -> Result<Vec<Segment>> {
    let order = f.topo_exprs();
    let mut out = Vec::with_capacity(groups.len());
    for (s, g) in groups.iter().enumerate() {
        let seg = segment_of(f, g, &order)?;
        if seg.outputs.is_empty() {
            bail!("segment {s} produces no output; check the segment_after marks");
        }
        out.push(seg);
    }
    Ok(out)
}

/// The segment of one group of exprs (dependency order) of `f`: it reads the fusion inputs
/// and the tensors computed outside the group, and writes the fusion outputs it computes
/// and the tensors that live exprs outside the group read. `order`: `f.topo_exprs()`.
pub fn segment_of(f: &Fusion, group: &[ExprId], order: &[ExprId]) -> Result<Segment> {
    let in_seg: FxHashSet<ExprId> = group.iter().copied().collect();
    let live: FxHashSet<ExprId> = order.iter().copied().collect();
    let mut reads: FxHashSet<TvId> = FxHashSet::default();
    for &e in group {
        reads.extend(f.exprs[e].input_tvs());
    }
    // A size the group reads as a value (`cast(size(x, 0))`, a `full` of x's shape) but no
    // tensor it reads carries: the fusion input that defines it comes along for its sizes.
    let mut syms = FxHashSet::default();
    for &e in group {
        let ex = &f.exprs[e];
        for o in &ex.inputs {
            if let Operand::Scalar(v) = *o {
                crate::lower::predicate::symbols(&f.scalars, v, &mut syms);
            }
        }
        for &id in &f.tvs[ex.output].logical {
            crate::lower::predicate::symbols(&f.scalars, f.ids[id].extent, &mut syms);
        }
        // Positions of remaps and masks, the scalars an op holds (`full(shape, x.size(0))`,
        // an iota starting at a size), and the sizes of what the group receives (a slice
        // of a slice has the extent `min(i0, 2) - 1`, which only x carries).
        for v in ex.op.position_exprs().into_iter().chain(ex.op.scalars()) {
            crate::lower::predicate::symbols(&f.scalars, v, &mut syms);
        }
        for t in ex.input_tvs() {
            for &id in &f.tvs[t].logical {
                crate::lower::predicate::symbols(&f.scalars, f.ids[id].extent, &mut syms);
            }
        }
    }
    for s in syms {
        let Symbol::Extent(n) = s else { continue };
        // Only a tensor the segment receives carries a size into it.
        let carried = reads.iter().any(|&t| {
            f.tvs[t].definition.is_none_or(|d| !in_seg.contains(&d))
                && f.no_reduction_logical(t).iter().any(|&id| f.scalars.get(f.ids[id].extent) == Val::Symbol(s))
        });
        if let (false, Some(&(src, _))) = (carried, f.extent_sources.get(n as usize)) {
            reads.insert(src);
        }
    }
    let mut inputs: Vec<TvId> = f.inputs.iter().filter_map(|o| o.tensor()).filter(|t| reads.contains(t)).collect();
    // Computed in another segment, or an input read at another shape (`Fusion::input_views`).
    let mut crossing_in: Vec<TvId> = reads
        .iter()
        .copied()
        .filter(|&t| f.tvs[t].definition.map_or(!f.is_input(t), |d| !in_seg.contains(&d)))
        .collect();
    crossing_in.sort();
    inputs.extend(crossing_in);
    let produced = |t: TvId| f.tvs[t].definition.is_some_and(|d| in_seg.contains(&d));
    let mut outputs: Vec<TvId> = Vec::new();
    for &t in &f.outputs {
        if produced(t) && !outputs.contains(&t) {
            outputs.push(t);
        }
    }
    let mut crossing_out: Vec<TvId> = group
        .iter()
        .map(|&e| f.exprs[e].output)
        .filter(|&t| !outputs.contains(&t) && f.tvs[t].uses.iter().any(|u| !in_seg.contains(u) && live.contains(u)))
        .collect();
    crossing_out.sort();
    for &t in &crossing_out {
        if let Some(a) = &f.tvs[t].allocation {
            if a != &f.tvs[t].logical {
                bail!("{}: crosses into another segment but has a set allocation domain; intermediates are laid out in logical order", f.tv_name(t));
            }
        }
    }
    outputs.extend(crossing_out);
    Ok(Segment { exprs: group.to_vec(), inputs, outputs })
}

/// A copy of `f` whose inputs and outputs are `seg`'s, ready for `lower::lower`.
/// TvIds stay those of `f`; intermediates read by the segment lose their definition
/// and get fresh logical ids (same extents, reductions dropped), like a `define_tensor`.
pub fn segment_fusion(f: &Fusion, seg: &Segment) -> Fusion {
    let mut g = f.clone();
    let in_seg: FxHashSet<ExprId> = seg.exprs.iter().copied().collect();
    let produced: FxHashSet<TvId> = seg.exprs.iter().map(|&e| f.exprs[e].output).collect();
    let inputs: FxHashSet<TvId> = seg.inputs.iter().copied().collect();
    let tvs: Vec<TvId> = g.tvs.keys().collect();
    for tv in tvs {
        let t = &mut g.tvs[tv];
        t.uses.retain(|u| in_seg.contains(u));
        if inputs.contains(&tv) && !f.is_input(tv) {
            // An intermediate read here: a plain Global input in logical order.
            let from = f.reshaped_from(tv);
            if from != tv {
                g.cut_from.insert(tv, from);
            }
            let t = &mut g.tvs[tv];
            t.definition = None;
            t.inline_pos = 0;
            t.root = None;
            t.allocation = None;
            t.memory = MemoryType::Global;
            t.serial_grid_reduction = false;
            let old: Vec<_> = f.no_reduction_logical(tv);
            // An output stored in another order than its logical one (`stride_order`) is
            // read here through its strides.
            // A strided view of an input (`Fusion::strided_views`) too: every axis takes
            // the input's stride.
            let permuted = crate::host::bind::stored_permuted(f, tv).is_some() || f.strided_view_axes(tv).is_some();
            let mut logical = Vec::with_capacity(old.len());
            let mut contiguity = Vec::with_capacity(old.len());
            for id in old {
                let (extent, it) = (f.ids[id].extent, f.ids[id].iter_type);
                let fresh = g.new_id(extent, it);
                logical.push(fresh);
                contiguity.push((it != IterType::Broadcast).then_some(!permuted));
            }
            let t = &mut g.tvs[tv];
            t.loop_domain = logical.clone();
            t.logical = logical;
            t.contiguity = contiguity;
        } else if !produced.contains(&tv) && !inputs.contains(&tv) {
            t.definition = None;
            t.inline_pos = 0;
        } else if produced.contains(&tv) && seg.outputs.contains(&tv) {
            t.memory = MemoryType::Global;
            if t.uses.is_empty() {
                t.inline_pos = 0;
            }
        }
    }
    let scalar_inputs: Vec<Operand> = f.inputs.iter().copied().filter(|o| matches!(o, Operand::Scalar(_))).collect();
    g.inputs = seg.inputs.iter().map(|&t| Operand::Tensor(t)).collect();
    g.inputs.extend(scalar_inputs);
    g.outputs = seg.outputs.clone();
    g.segment_after.clear();
    // Each symbolic extent comes from a segment input where one carries it, so the
    // kernel can also be planned on its own (the executor's path).
    let mut sources = g.extent_sources.clone();
    for (n, src) in sources.iter_mut().enumerate() {
        if seg.inputs.contains(&src.0) {
            continue;
        }
        'find: for &t in &seg.inputs {
            for (axis, id) in g.no_reduction_logical(t).into_iter().enumerate() {
                if g.scalars.get(g.ids[id].extent) == Val::Symbol(Symbol::Extent(n as u32)) {
                    *src = (t, axis);
                    break 'find;
                }
            }
        }
    }
    g.extent_sources = sources;
    g
}
