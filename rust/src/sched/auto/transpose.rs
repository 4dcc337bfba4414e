//! Transpose scheduler: `out = permute(x, [1, 0])` through 64x64 Shared tiles, reading
//! rows of `x` and writing rows of `out` with 16-byte vectors (the transposed-Shared
//! allocation patch makes the tile `[64, 64]`, rows padded by one bank). With more axes the
//! tiles span x's last axis and the output's last axis; the others (`B` in `[B, S, H] ->
//! [B, H, S]` or `[H, B, S]`) make a batch of such transposes on BIDz.

use crate::bail;
use crate::error::Result;
use crate::ir::{Fusion, IterType, MemoryType, Op, ParallelType, TvId};
use crate::sched::auto::{tensor_sizes, Ctx, Heuristic, Params};

/// A tensor of the transpose, its reorder within the 2-D tile frame, and the axis order
/// that brings it into that frame (batch axes first).
type Oriented<'a> = (TvId, &'a [(i64, i64)], &'a [usize]);

/// Largest gridDim.y and gridDim.z a launch may have.
const MAX_GRID_Z: i64 = 65535;

/// Schedule a fusion that is a single permute moving the last axis: a 2-D transpose of x's
/// last axis and the output's last axis, batched over the other axes (merged into one loop
/// on BIDz).
pub fn schedule(f: &mut Fusion, cx: &Ctx) -> Result<Heuristic> {
    let order = f.topo_exprs();
    let Some(&e) = order.iter().find(|&&e| matches!(f.exprs[e].op, Op::Permute { .. })) else {
        bail!("the transpose schedule needs a permute");
    };
    let Some(x) = f.exprs[e].inputs[0].tensor().filter(|&x| f.is_input(x)) else {
        bail!("{}: the transpose schedule reads a fusion input directly (ops before the permute are not covered; segment them off)", f.tv_name(f.exprs[e].output));
    };
    let staged = f.exprs[e].output;
    if f.outputs.len() != 1 {
        bail!("{}: a transpose with ops after it is scheduled for a single output", f.tv_name(staged));
    }
    let out = f.outputs[0];
    let perm = match &f.exprs[e].op {
        Op::Permute { perm } => perm.clone(),
        _ => bail!("{}: not a permute", f.tv_name(out)),
    };
    // Ops after the permute (an epilogue: a scale, a cast, a bias) run on the output side of
    // the Shared tile, in the output's order; so do broadcasts of other inputs they read.
    let epilogue: Vec<TvId> = order.iter().filter(|&&d| d != e).map(|&d| f.exprs[d].output).collect();
    for &t in &epilogue {
        if f.no_reduction_logical(t).len() != perm.len() {
            bail!("{}: an op after a transpose must keep the output's rank", f.tv_name(t));
        }
    }
    let n = perm.len();
    if n < 2 || perm[n - 1] == n - 1 {
        bail!("{}: not a transpose (the last axis stays in place): {perm:?}", f.tv_name(out));
    }
    // A tile spanning a size-one axis would have its threads write one element each.
    let xl = f.no_reduction_logical(x);
    if f.ids[xl[n - 1]].iter_type == IterType::Broadcast || f.ids[xl[perm[n - 1]]].iter_type == IterType::Broadcast {
        bail!("{}: a tile would span a size-one axis of {}", f.tv_name(out), f.tv_name(x));
    }
    // The two axes the tiles span: x's last axis (`a`, at output position `qa`) and the
    // output's last axis (x's axis `perm[n - 1]`). Every other axis is a batch axis, taken in
    // the output's order on both sides so that the merged batch loops match.
    let qa = perm.iter().position(|&p| p == n - 1).expect("a permutation holds every axis");
    let batch_pos: Vec<usize> = (0..n - 1).filter(|&q| q != qa).collect();
    let canon_out: Vec<usize> = batch_pos.iter().copied().chain([qa, n - 1]).collect();
    let canon_x: Vec<usize> = batch_pos.iter().map(|&q| perm[q]).chain([perm[n - 1], n - 1]).collect();
    // Batch axes: merged into one loop on BIDz.
    let o = usize::from(n > 2);
    let sizes = tensor_sizes(f, cx, out)?;
    let batch: i64 = batch_pos.iter().map(|&q| sizes[q]).product();
    // Tiles along x's last axis run on BIDy, whose grid dimension is limited too.
    let tiles_y = (sizes[qa] + 63) / 64;
    if tiles_y > MAX_GRID_Z {
        bail!(
            "{}: {tiles_y} tiles along its axis {qa} exceed gridDim.y ({MAX_GRID_Z}); schedule it by hand",
            f.tv_name(out)
        );
    }
    if batch > MAX_GRID_Z {
        bail!(
            "{}: a batch of {batch} transposes exceeds gridDim.z ({MAX_GRID_Z}); schedule it by hand",
            f.tv_name(out)
        );
    }
    let widest = [x, staged, out].iter().map(|&t| f.tvs[t].dtype.size_bytes()).max().unwrap_or(4) as i64;
    // A strided input is read element by element.
    let v = if super::dense(f, x) { (16 / widest).clamp(1, 4) } else { 1 };
    // 64x64 tiles with 256 threads, each moving four vectors: more bytes in flight per
    // thread than 32x32 tiles (the tile fits a 16.6 KB padded Shared buffer).
    let (tile, threads) = (64, 256);
    // The Shared tile: the permute's result itself when ops follow it, else a copy of the
    // output before its store.
    let s = if out == staged { f.cache_before(out)? } else { staged };
    f.set_memory_type(s, MemoryType::Shared)?;
    // Producer side: the same tile, walked along x's rows, read with 16-byte vectors into
    // registers (`l`) and scattered into the Shared tile from there.
    let l = f.cache_after(x)?;
    // As in pointwise.rs: 8192x8192 fp32 129.9 -> 128.1 us on the H200.
    if v > 1 && super::evict_last_inputs() {
        f.set_evict_last(l)?;
    }
    // All three to [batch (BIDz),] [J/64 (BIDy), I/64 (BIDx), rows (serial), threads (TIDx),
    // v]: `out` walks the output's rows; `s` is in the output's axis order (j, i) but walks
    // x's rows, and `l` is in x's order (i, j).
    let out_side: &[(i64, i64)] = &[(1, 2)];
    let mut orders: Vec<Oriented> = Vec::new();
    if out == staged {
        orders.push((out, out_side, &canon_out));
    }
    orders.push((l, &[(2, 0), (0, 1), (1, 2)], &canon_x));
    orders.push((s, &[(1, 3), (3, 2), (2, 1)], &canon_out));
    orders.extend(epilogue.iter().filter(|&&t| t != s).map(|&t| (t, out_side, canon_out.as_slice())));
    let at = |a: i64| a + o as i64;
    for (t, order, canon) in orders {
        if canon.iter().enumerate().any(|(i, &p)| i != p) {
            f.reorder(t, &super::moves_to(canon))?;
        }
        for _ in 1..n.saturating_sub(2) {
            f.merge(t, 0, 1)?;
        }
        f.split(t, at(0), tile, true)?;
        f.split(t, at(2), tile, true)?;
        let shifted: Vec<(i64, i64)> = order.iter().map(|&(a, b)| (at(a), at(b))).collect();
        f.reorder(t, &shifted)?;
        f.merge(t, at(2), at(3))?;
        f.split(t, at(2), v, true)?;
        f.split(t, at(2), threads, true)?;
        if o == 1 {
            f.parallelize(t, 0, ParallelType::BIDz)?;
        }
        f.parallelize(t, at(0), ParallelType::BIDy)?;
        f.parallelize(t, at(1), ParallelType::BIDx)?;
        f.parallelize(t, at(3), ParallelType::TIDx)?;
    }
    f.parallelize(out, at(4), ParallelType::Vectorize)?;
    if v > 1 {
        f.parallelize(l, at(4), ParallelType::Vectorize)?;
    }
    f.inline_at(l, at(4))?;
    f.inline_at(s, at(2))?;
    for &t in &epilogue {
        if t != s && !f.is_output(t) {
            f.inline_at(t, -1)?;
        }
    }
    Ok(Heuristic::new(Params::Transpose { tile, threads, vector: v }))
}
