//! Transpose scheduler: `out = permute(x, [1, 0])` through 64x64 Shared tiles, reading
//! rows of `x` and writing rows of `out` with 16-byte vectors (the transposed-Shared
//! allocation patch makes the tile `[64, 64]`, rows padded by one bank).

use crate::bail;
use crate::error::Result;
use crate::ir::{Fusion, MemoryType, Op, ParallelType};
use crate::sched::auto::Heuristic;

/// Schedule a fusion that is a single 2-D permute.
pub fn schedule(f: &mut Fusion, _extents: &[i64]) -> Result<Heuristic> {
    let e = f.topo_exprs()[0];
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
    // Consumer: [J/64 (BIDy), I/64 (BIDx), rows (serial), threads (TIDx), v (Vectorize)].
    f.split(out, 0, tile, true)?;
    f.split(out, 2, tile, true)?;
    f.reorder(out, &[(1, 2)])?;
    f.merge(out, 2, 3)?;
    f.split(out, 2, v, true)?;
    f.split(out, 2, threads, true)?;
    f.parallelize(out, 0, ParallelType::BIDy)?;
    f.parallelize(out, 1, ParallelType::BIDx)?;
    f.parallelize(out, 3, ParallelType::TIDx)?;
    f.parallelize(out, 4, ParallelType::Vectorize)?;
    // Producer: the same tile, walked along x's rows.
    f.split(s, 0, tile, true)?;
    f.split(s, 2, tile, true)?;
    f.reorder(s, &[(1, 3), (3, 2)])?;
    f.merge(s, 2, 3)?;
    f.split(s, 2, v, true)?;
    f.split(s, 2, threads, true)?;
    f.parallelize(s, 0, ParallelType::BIDy)?;
    f.parallelize(s, 1, ParallelType::BIDx)?;
    f.parallelize(s, 3, ParallelType::TIDx)?;
    f.inline_at(s, 2)?;
    Ok(Heuristic { kind: "transpose", params: vec![tile, threads, v] })
}
