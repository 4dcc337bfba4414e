//! Automatic schedulers: pick a schedule for an unscheduled fusion from its shape and
//! the concrete input sizes. Each scheduler works on a copy of the user's fusion.
//!
//! - `pointwise`: merge all axes, split into [blocks, unroll, threads, vector], cache
//!   full-size inputs and outputs for 16-byte accesses, inline everything.
//! - `reduction`: one reduction, inner (last axes), outer (first axes) or full: block
//!   reductions with per-thread serial accumulation, grid reductions when one block
//!   per output would leave the GPU idle.
//! - `normalization`: reductions broadcast back onto their input (softmax, layernorm):
//!   one block per row with the row held in registers across the reductions.
//! - `transpose`: a 2-D permute staged through 64x64 Shared tiles (a permute that keeps
//!   the last axis in place is a pointwise copy in the output's axis order).

pub mod normalization;
pub mod pointwise;
pub mod reduction;
pub mod transpose;

use crate::bail;
use crate::error::{KilnError, Result};
use crate::ir::{ExprId, Fusion, IterDomainId, IterType, Op, Symbol, TvId};

/// Streaming multiprocessors of the target (H100/H200): sizes grids.
pub const SM_COUNT: i64 = 132;

/// Whether the automatic schedules load inputs with the L2 evict_last hint
/// (`Fusion::set_evict_last`): yes unless `KILN_L2_EVICT_LAST` is `0`, `false`, `off` or
/// `no`. The hinted kernel is faster, but the lines it leaves in L2 slow down the next
/// kernel that relies on L2 (DEVELOPERS.md). Read once per process, so that plans cached
/// under one setting never serve the other.
pub fn evict_last_inputs() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("KILN_L2_EVICT_LAST")
            .map(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "false" | "off" | "no"))
            .unwrap_or(true)
    })
}

/// `reorder` moves that put old loop axis `perm[i]` at position `i`.
pub(crate) fn moves_to(perm: &[usize]) -> Vec<(i64, i64)> {
    perm.iter().enumerate().map(|(to, &from)| (from as i64, to as i64)).collect()
}

/// What the scheduler decided, as a cache key and a readable description.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Heuristic {
    pub kind: &'static str,
    pub params: Vec<i64>,
}

impl Heuristic {
    /// `pointwise(v=4, t=128, u=2)`-style description.
    pub fn describe(&self) -> String {
        format!("{}{:?}", self.kind, self.params)
    }
}

/// Values of the symbolic extents `i{n}` of `f` for concrete fusion-input sizes.
pub fn extent_values(f: &Fusion, inputs: &[Vec<i64>]) -> Result<Vec<i64>> {
    let tensor_inputs: Vec<TvId> = f.inputs.iter().filter_map(|o| o.tensor()).collect();
    let mut out = Vec::with_capacity(f.extent_sources.len());
    for &(src, axis) in &f.extent_sources {
        let pos = tensor_inputs.iter().position(|&t| t == src);
        let Some(v) = pos.and_then(|p| inputs.get(p)).and_then(|s| s.get(axis)) else {
            bail!("{}: no size given for axis {axis}", f.tv_name(src));
        };
        out.push(*v);
    }
    Ok(out)
}

/// Concrete sizes of every logical axis of `tv`, from the extent values.
pub fn tensor_sizes(f: &Fusion, extents: &[i64], tv: TvId) -> Result<Vec<i64>> {
    let env = |s: crate::ir::Symbol| match s {
        crate::ir::Symbol::Extent(n) => extents.get(n as usize).copied(),
        _ => None,
    };
    f.tvs[tv].logical.iter().map(|&id| f.scalars.eval(f.ids[id].extent, &env)).collect()
}

/// Schedule `f` in place for inputs of the given sizes.
pub fn schedule(f: &mut Fusion, inputs: &[Vec<i64>]) -> Result<Heuristic> {
    let extents = extent_values(f, inputs)?;
    schedule_with_extents(f, &extents)
}

/// A host program for `f` (unscheduled) and inputs of the given sizes: one kernel when a
/// scheduler covers the whole fusion, else the segmenter's fallback: a kernel boundary
/// after every reduction and permute, at most one of them per kernel, each segment
/// scheduled on its own. `aligned_bases`: every input starts 16-byte aligned (see
/// `Fusion::aligned_bases`); the host keys its plans on it.
pub fn auto_program(
    f: &Fusion,
    inputs: &[Vec<i64>],
    aligned_bases: bool,
) -> Result<(crate::host::ir::HostProgram, Heuristic)> {
    let extents = extent_values(f, inputs)?;
    let mut whole = f.clone();
    whole.aligned_bases = aligned_bases;
    let first = match schedule_with_extents(&mut whole, &extents) {
        Ok(h) => return Ok((crate::host::lower::lower_program(&whole)?, h)),
        Err(e) => e,
    };
    let mut g = f.clone();
    g.segment_each_boundary = true;
    g.aligned_bases = aligned_bases;
    let mut marked = 0;
    let order = g.topo_exprs();
    for (i, &e) in order.iter().enumerate() {
        let t = g.exprs[e].output;
        let boundary = matches!(g.exprs[e].op, Op::Reduction { .. } | Op::Permute { .. });
        if boundary && i + 1 < order.len() {
            g.mark_segment_after(t)?;
            marked += 1;
        }
        // The transpose schedule reads a fusion input: ops before a permute end a segment.
        if let (Op::Permute { .. }, Some(src)) = (&g.exprs[e].op, g.exprs[e].inputs[0].tensor()) {
            if g.tvs[src].definition.is_some() && !g.segment_after.contains(&src) {
                g.mark_segment_after(src)?;
                marked += 1;
            }
        }
    }
    if marked == 0 {
        return Err(first);
    }
    let kernels = crate::host::segment::segments(&g).map(|s| s.len()).unwrap_or(marked + 1);
    let mut parts: Vec<Heuristic> = Vec::new();
    let program = crate::host::lower::lower_program_with(&g, &mut |_, seg: &mut Fusion| {
        parts.push(schedule_with_extents(seg, &extents)?);
        Ok(())
    })
    .map_err(|e| {
        KilnError::value(format!(
            "{}; segmenting it into {} kernels did not help either: {}",
            first.message, kernels, e.message
        ))
    })?;
    let mut params = Vec::new();
    for h in &parts {
        params.push(KINDS.iter().position(|&k| k == h.kind).unwrap_or(KINDS.len()) as i64);
        params.push(h.params.len() as i64);
        params.extend(&h.params);
    }
    Ok((program, Heuristic { kind: "segmented", params }))
}

/// True when `t` is a broadcast of a fusion input (a weight or bias read by every row).
fn broadcast_input(f: &Fusion, t: TvId) -> bool {
    let Some(def) = f.tvs[t].definition else { return false };
    matches!(f.exprs[def].op, Op::Broadcast { .. }) && f.exprs[def].inputs[0].tensor().is_some_and(|x| f.is_input(x))
}

/// Scheduler kinds, numbered for the segmented heuristic's cache key.
const KINDS: [&str; 6] =
    ["pointwise", "inner_reduction", "outer_reduction", "full_reduction", "normalization", "transpose"];

/// Schedule `f` in place for the given extent values.
pub fn schedule_with_extents(f: &mut Fusion, inputs: &[i64]) -> Result<Heuristic> {
    if f.manually_scheduled {
        bail!("the fusion is already scheduled by hand; automatic scheduling only applies to unscheduled fusions");
    }
    let exprs = f.topo_exprs();
    let reductions: Vec<_> = exprs.iter().copied().filter(|&e| matches!(f.exprs[e].op, Op::Reduction { .. })).collect();
    let permutes = exprs.iter().filter(|&&e| matches!(f.exprs[e].op, Op::Permute { .. })).count();
    let specialized = if permutes == 0 { specialize_reduced_extents(f, &reductions, inputs) } else { Vec::new() };
    let mut h = if reductions.is_empty() && (permutes == 0 || pointwise::kept_last_permute(f).is_some()) {
        pointwise::schedule(f, inputs)?
    } else if permutes == 0 && normalization::is_normalization(f, &reductions) {
        normalization::schedule(f, inputs, &reductions)?
    } else if reductions.len() == 1 && permutes == 0 {
        reduction::schedule(f, inputs, reductions[0])?
    } else if reductions.is_empty() && permutes == 1 {
        transpose::schedule(f, inputs)?
    } else {
        bail!(
            "no automatic schedule covers this fusion ({} reductions, {} permutes among {} ops); schedule it by hand or split it with segment_after",
            reductions.len(),
            permutes,
            exprs.len()
        );
    };
    h.params.extend(specialized);
    Ok(h)
}

/// Make the reduced extents of `reductions` (and every extent mapped to them) constants
/// of the kernel. Bounds checks of a thread's share of a row then fold away at compile
/// time: without this, a row of 4096 floats spends more instructions on predicates than
/// on data. Returns `(n, value)` pairs for the heuristic's cache key, since the kernel
/// now only runs on inputs of these sizes.
fn specialize_reduced_extents(f: &mut Fusion, reductions: &[ExprId], extents: &[i64]) -> Vec<i64> {
    let mut reduced = Vec::new();
    for &e in reductions {
        let r = f.exprs[e].output;
        reduced.extend(f.tvs[r].logical.iter().copied().filter(|&id| f.ids[id].iter_type == IterType::Reduction));
    }
    specialize_extents(f, &reduced, extents)
}

/// Make the extents of `ids` (and of every id exactly mapped to one of them) constants of
/// the kernel; returns `(n, value)` pairs for the heuristic's cache key.
pub(crate) fn specialize_extents(f: &mut Fusion, ids: &[IterDomainId], extents: &[i64]) -> Vec<i64> {
    let graph = crate::analysis::id_graph::IdGraph::exact(f);
    let mut syms: Vec<u32> = Vec::new();
    for id in f.ids.keys() {
        if !ids.iter().any(|&r| graph.same(r, id)) {
            continue;
        }
        if let crate::ir::scalar::Val::Symbol(Symbol::Extent(n)) = f.scalars.get(f.ids[id].extent) {
            if !syms.contains(&n) && (n as usize) < extents.len() {
                syms.push(n);
            }
        }
    }
    syms.sort_unstable();
    let mut key = Vec::new();
    for n in syms {
        f.specialize_extent(n, extents[n as usize]);
        key.extend([-1 - n as i64, extents[n as usize]]);
    }
    key
}
