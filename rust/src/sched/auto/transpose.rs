//! Transpose scheduler: `out = permute(x, [1, 0])` through 64x64 Shared tiles, reading
//! rows of `x` and writing rows of `out` with 16-byte vectors (the transposed-Shared
//! allocation patch makes the tile `[64, 64]`, rows padded by one bank). Leading axes that
//! the permute keeps (`[B, S, H] -> [B, H, S]`) make a batch of such transposes on BIDz.

use crate::bail;
use crate::error::Result;
use crate::ir::{Fusion, MemoryType, Op, ParallelType, TvId};
use crate::sched::auto::{tensor_sizes, Heuristic};

/// Largest gridDim.z a launch may have.
const MAX_GRID_Z: i64 = 65535;

/// Schedule a fusion that is a single permute swapping the last two axes (a batch of 2-D
/// transposes when there are leading axes: they merge into one, on BIDz).
pub fn schedule(f: &mut Fusion, extents: &[i64]) -> Result<Heuristic> {
    let e = f.topo_exprs()[0];
    if f.exprs[e].inputs[0].tensor().is_none() {
        bail!("the transpose reads no tensor");
    }
    let out = f.exprs[e].output;
    let perm = match &f.exprs[e].op {
        Op::Permute { perm } => perm.clone(),
        _ => bail!("{}: not a permute", f.tv_name(out)),
    };
    let n = perm.len();
    let last_two = n >= 2
        && perm[..n - 2].iter().enumerate().all(|(i, &p)| p == i)
        && perm[n - 2] == n - 1
        && perm[n - 1] == n - 2;
    if !last_two {
        bail!(
            "{}: only permutes that swap the last two axes (or keep the last axis in place) are scheduled automatically, got {perm:?}",
            f.tv_name(out)
        );
    }
    // Batch axes: merged into one loop on BIDz.
    let o = usize::from(n > 2);
    let batch: i64 = tensor_sizes(f, extents, out)?[..n - 2].iter().product();
    if batch > MAX_GRID_Z {
        bail!(
            "{}: a batch of {batch} transposes exceeds gridDim.z ({MAX_GRID_Z}); schedule it by hand",
            f.tv_name(out)
        );
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
    // All three to [batch (BIDz),] [J/64 (BIDy), I/64 (BIDx), rows (serial), threads (TIDx),
    // v]: `out` walks the output's rows; `s` is in the output's axis order (j, i) but walks
    // x's rows, and `l` is in x's order (i, j).
    let orders: [(TvId, &[(i64, i64)]); 3] =
        [(out, &[(1, 2)]), (l, &[(2, 0), (0, 1), (1, 2)]), (s, &[(1, 3), (3, 2), (2, 1)])];
    let at = |a: i64| a + o as i64;
    for (t, order) in orders {
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
    Ok(Heuristic { kind: "transpose", params: vec![tile, threads, v] })
}
