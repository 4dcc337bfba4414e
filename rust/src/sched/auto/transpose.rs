//! Transpose scheduler: `out = permute(x, [1, 0])` through 64x64 Shared tiles, reading
//! rows of `x` and writing rows of `out` with 16-byte vectors (the transposed-Shared
//! allocation patch makes the tile `[64, 64]`, rows padded by one bank).

use crate::bail;
use crate::error::Result;
use crate::ir::{Fusion, MemoryType, Op, ParallelType, TvId};
use crate::sched::auto::Heuristic;

/// Schedule a fusion that is a single 2-D permute.
pub fn schedule(f: &mut Fusion, _extents: &[i64]) -> Result<Heuristic> {
    let e = f.topo_exprs()[0];
    if f.exprs[e].inputs[0].tensor().is_none() {
        bail!("the transpose reads no tensor");
    }
    let out = f.exprs[e].output;
    if !matches!(&f.exprs[e].op, Op::Permute { perm } if perm == &[1, 0]) {
        bail!("{}: only 2-D transposes are scheduled automatically", f.tv_name(out));
    }
    let v = (16 / f.tvs[out].dtype.size_bytes() as i64).clamp(1, 4);
    // 64x64 tiles with 256 threads, each moving four vectors: more bytes in flight per
    // thread than 32x32 tiles (the tile fits a 16.6 KB padded Shared buffer).
    let (tile, threads) = (64, 256);
    let s = f.cache_before(out)?;
    f.set_memory_type(s, MemoryType::Shared)?;
    // Producer side: the same tile, walked along x's rows, read with 16-byte vectors into
    // registers (`l`) and scattered into the Shared tile from there.
    let x = f.exprs[e].inputs[0].tensor().expect("a permute reads a tensor");
    let l = f.cache_after(x)?;
    // As in pointwise.rs: 8192x8192 fp32 129.9 -> 128.1 us on the H200.
    if v > 1 && super::evict_last_inputs() {
        f.set_evict_last(l)?;
    }
    // All three to [J/64 (BIDy), I/64 (BIDx), rows (serial), threads (TIDx), v]: `out` walks
    // the output's rows; `s` is in the output's axis order (j, i) but walks x's rows, and `l`
    // is in x's order (i, j).
    let orders: [(TvId, &[(i64, i64)]); 3] =
        [(out, &[(1, 2)]), (l, &[(2, 0), (0, 1), (1, 2)]), (s, &[(1, 3), (3, 2), (2, 1)])];
    for (t, order) in orders {
        f.split(t, 0, tile, true)?;
        f.split(t, 2, tile, true)?;
        f.reorder(t, order)?;
        f.merge(t, 2, 3)?;
        f.split(t, 2, v, true)?;
        f.split(t, 2, threads, true)?;
        f.parallelize(t, 0, ParallelType::BIDy)?;
        f.parallelize(t, 1, ParallelType::BIDx)?;
        f.parallelize(t, 3, ParallelType::TIDx)?;
    }
    f.parallelize(out, 4, ParallelType::Vectorize)?;
    if v > 1 {
        f.parallelize(l, 4, ParallelType::Vectorize)?;
    }
    f.inline_at(l, 4)?;
    f.inline_at(s, 2)?;
    Ok(Heuristic { kind: "transpose", params: vec![tile, threads, v] })
}
