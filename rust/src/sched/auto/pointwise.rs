//! Pointwise scheduler: every tensor as one flat iteration space
//! `[ceilDiv(N, u*t*v) (BIDx), 1 (Unswitch), u (Unroll), t (TIDx), v]`, with vectorized caches of the
//! full-size inputs and of the outputs, and everything inlined.

use crate::error::Result;
use crate::ir::{Fusion, IterType, Op, Operand, ParallelType, TvId};
use crate::sched::auto::{tensor_sizes, Heuristic, SM_COUNT};

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

/// True when `t` has no broadcast axes and the rank of the fusion's outputs.
fn full_size(f: &Fusion, t: TvId, rank: usize) -> bool {
    let l = f.no_reduction_logical(t);
    l.len() == rank && l.iter().all(|&id| f.ids[id].iter_type == IterType::Iteration)
}

/// Schedule a fusion without reductions or permutes.
pub fn schedule(f: &mut Fusion, extents: &[i64]) -> Result<Heuristic> {
    let out = f.outputs[0];
    let rank = f.no_reduction_logical(out).len();
    let numel: i64 = tensor_sizes(f, extents, out)?.iter().product();
    let widest = f.tvs.values().map(|t| t.dtype.size_bytes()).max().unwrap_or(4) as i64;
    let v = (16 / widest).clamp(1, 8);
    let threads = 128;
    // Unroll when there are many more vectors than the GPU runs at once.
    let unroll = if numel / (v * threads) >= 8 * SM_COUNT * 16 {
        4
    } else if numel / (v * threads) >= 2 * SM_COUNT * 16 {
        2
    } else {
        1
    };

    // Vectorized read caches for full-size inputs read element-wise (not through indices).
    let mut vec_tensors = Vec::new();
    for op in f.inputs.clone() {
        let Operand::Tensor(x) = op else { continue };
        let indexed = f.tvs[x]
            .uses
            .iter()
            .any(|&e| matches!(f.exprs[e].op, Op::IndexSelect { .. }) && f.exprs[e].inputs[0] == op);
        if full_size(f, x, rank) && !f.tvs[x].uses.is_empty() && !indexed {
            vec_tensors.push(f.cache_after(x)?);
        }
    }
    for o in f.outputs.clone() {
        if f.tvs[o].definition.is_some() && full_size(f, o, rank) {
            f.cache_before(o)?;
            vec_tensors.push(o);
        }
    }
    let order = f.topo_exprs();
    let tensors: Vec<TvId> = order.iter().map(|&e| f.exprs[e].output).collect();
    for &t in &tensors {
        flatten_and_split(f, t, v, threads, unroll)?;
        let (b, u, th, vv) = if unroll > 1 { (0, Some(2), 3, 4) } else { (0, None, 2, 3) };
        f.parallelize(t, b, ParallelType::BIDx)?;
        f.parallelize(t, 1, ParallelType::Unswitch)?;
        if let Some(u) = u {
            f.parallelize(t, u, ParallelType::Unroll)?;
        }
        f.parallelize(t, th, ParallelType::TIDx)?;
        if vec_tensors.contains(&t) && v > 1 {
            f.parallelize(t, vv, ParallelType::Vectorize)?;
        }
    }
    // Producers before consumers: each inlines as deep as its consumers allow.
    for &t in &tensors {
        if !f.is_output(t) {
            f.inline_at(t, -1)?;
        }
    }
    Ok(Heuristic { kind: "pointwise", params: vec![v, threads, unroll] })
}
