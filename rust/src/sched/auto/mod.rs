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
//! - `transpose`: a 2-D permute staged through 64x64 Shared tiles.

pub mod normalization;
pub mod pointwise;
pub mod reduction;
pub mod transpose;

use crate::bail;
use crate::error::Result;
use crate::ir::{Fusion, Op, TvId};

/// Streaming multiprocessors of the target (H100/H200): sizes grids.
pub const SM_COUNT: i64 = 132;

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

/// Concrete sizes of every logical axis of every tensor, from the input sizes.
pub fn tensor_sizes(f: &Fusion, inputs: &[Vec<i64>], tv: TvId) -> Result<Vec<i64>> {
    let env = |s: crate::ir::Symbol| match s {
        crate::ir::Symbol::Extent(n) => {
            let (src, axis) = *f.extent_sources.get(n as usize)?;
            let pos = f.inputs.iter().filter_map(|o| o.tensor()).position(|t| t == src)?;
            inputs.get(pos)?.get(axis).copied()
        }
        _ => None,
    };
    f.tvs[tv].logical.iter().map(|&id| f.scalars.eval(f.ids[id].extent, &env)).collect()
}

/// Schedule `f` in place for inputs of the given sizes.
pub fn schedule(f: &mut Fusion, inputs: &[Vec<i64>]) -> Result<Heuristic> {
    if f.manually_scheduled {
        bail!("the fusion is already scheduled by hand; automatic scheduling only applies to unscheduled fusions");
    }
    let exprs = f.topo_exprs();
    let reductions: Vec<_> = exprs.iter().copied().filter(|&e| matches!(f.exprs[e].op, Op::Reduction { .. })).collect();
    let permutes = exprs.iter().filter(|&&e| matches!(f.exprs[e].op, Op::Permute { .. })).count();
    let h = if reductions.is_empty() && permutes == 0 {
        pointwise::schedule(f, inputs)?
    } else if permutes == 0 && normalization::is_normalization(f, &reductions) {
        normalization::schedule(f, inputs, &reductions)?
    } else if reductions.len() == 1 && permutes == 0 {
        reduction::schedule(f, inputs, reductions[0])?
    } else if reductions.is_empty() && permutes == 1 && exprs.len() == 1 {
        transpose::schedule(f, inputs)?
    } else {
        bail!(
            "no automatic schedule covers this fusion ({} reductions, {} permutes among {} ops); schedule it by hand or split it with segment_after",
            reductions.len(),
            permutes,
            exprs.len()
        );
    };
    Ok(h)
}
