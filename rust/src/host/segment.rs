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
    let mut producer_seg: FxHashMap<TvId, usize> = FxHashMap::default();
    for &(e, l) in &expr_level {
        let s = seg_of_level[&l];
        exprs[s].push(e);
        producer_seg.insert(f.exprs[e].output, s);
    }
    let fusion_inputs: Vec<TvId> = f.inputs.iter().filter_map(|o| o.tensor()).collect();
    let mut out = Vec::with_capacity(n);
    for (s, seg_exprs) in exprs.into_iter().enumerate() {
        let in_seg: FxHashSet<ExprId> = seg_exprs.iter().copied().collect();
        let mut reads: FxHashSet<TvId> = FxHashSet::default();
        for &e in &seg_exprs {
            reads.extend(f.exprs[e].input_tvs());
        }
        let mut inputs: Vec<TvId> = fusion_inputs.iter().copied().filter(|t| reads.contains(t)).collect();
        let mut crossing_in: Vec<TvId> =
            reads.iter().copied().filter(|t| producer_seg.get(t).is_some_and(|&p| p != s)).collect();
        crossing_in.sort();
        inputs.extend(crossing_in);
        let mut outputs: Vec<TvId> = f.outputs.iter().copied().filter(|t| producer_seg.get(t) == Some(&s)).collect();
        let mut crossing_out: Vec<TvId> = seg_exprs
            .iter()
            .map(|&e| f.exprs[e].output)
            .filter(|&t| {
                !outputs.contains(&t) && f.tvs[t].uses.iter().any(|u| !in_seg.contains(u) && order.contains(u))
            })
            .collect();
        crossing_out.sort();
        for &t in &crossing_out {
            if let Some(a) = &f.tvs[t].allocation {
                if a != &f.tvs[t].logical {
                    bail!("{}: crosses from segment {s} to a later one but has a set allocation domain; intermediates are laid out in logical order", f.tv_name(t));
                }
            }
        }
        outputs.extend(crossing_out);
        if outputs.is_empty() {
            bail!("segment {s} produces no output; check the segment_after marks");
        }
        out.push(Segment { exprs: seg_exprs, inputs, outputs });
    }
    Ok(out)
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
            t.definition = None;
            t.inline_pos = 0;
            t.root = None;
            t.allocation = None;
            t.memory = MemoryType::Global;
            t.serial_grid_reduction = false;
            let old: Vec<_> = f.no_reduction_logical(tv);
            let mut logical = Vec::with_capacity(old.len());
            let mut contiguity = Vec::with_capacity(old.len());
            for id in old {
                let (extent, it) = (f.ids[id].extent, f.ids[id].iter_type);
                let fresh = g.new_id(extent, it);
                logical.push(fresh);
                contiguity.push((it != IterType::Broadcast).then_some(true));
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
