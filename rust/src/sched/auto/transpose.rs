//! Transpose scheduler: `out = permute(x, [1, 0])` through 64x64 Shared tiles, reading
//! rows of `x` and writing rows of `out` with 16-byte vectors (the transposed-Shared
//! allocation patch makes the tile `[64, 64]`, rows padded by one bank). With more axes the
//! tiles span x's last axis and the output's last axis; the others (`B` in `[B, S, H] ->
//! [B, H, S]` or `[H, B, S]`) make a batch of such transposes on BIDz. Pointwise ops
//! before the permute run on the tile's input side in the input's order (their full-size
//! inputs loaded through vectorized caches), ops after it on the output side.

use crate::bail;
use crate::error::Result;
use crate::ir::{Fusion, IterType, MemoryType, Op, Operand, ParallelType, TvId};
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
    let Some(src) = f.exprs[e].inputs[0].tensor() else {
        bail!("{}: the permute reads no tensor", f.tv_name(f.exprs[e].output));
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
    // Ops before the permute (a prologue: a bias, an activation) run on the input side of
    // the Shared tile, in the input's order; ops after it (an epilogue: a scale, a cast, a
    // bias) on the output side, in the output's order. Each side reads its own inputs.
    // The prologue: the permute's input and the computed tensors it is made from.
    let mut prologue = super::computed_closure(f, &[src]);
    let mut epilogue: Vec<TvId> = Vec::new();
    for &d in order.iter().filter(|&&d| d != e) {
        let t = f.exprs[d].output;
        if prologue.contains(&t) {
            continue;
        }
        if let Some(p) = f.exprs[d].input_tvs().find(|r| prologue.contains(r) || (*r == src)) {
            bail!(
                "{}: it reads {} both before and after the transpose; the tile holds one orientation",
                f.tv_name(t),
                f.tv_name(p)
            );
        }
        epilogue.push(t);
    }
    // Keep the prologue in dependency order.
    prologue = order.iter().map(|&d| f.exprs[d].output).filter(|t| prologue.contains(t)).collect();
    if let Some(&t) =
        prologue.iter().find(|&&t| t != src && !f.consumers(t).iter().all(|c| prologue.contains(c) || *c == staged))
    {
        bail!("{}: a tensor before the transpose is also an output or read after it", f.tv_name(t));
    }
    for &t in &epilogue {
        if f.no_reduction_logical(t).len() != perm.len() {
            bail!("{}: an op after a transpose must keep the output's rank", f.tv_name(t));
        }
    }
    if let Some(t) = super::misaligned(f, cx, &f.tvs[src].logical.clone(), &prologue) {
        bail!("{}: its axes do not line up with the permute's input {}", f.tv_name(t), f.tv_name(src));
    }
    // Inputs read before the permute with every element (the permute's input itself, or
    // the operands of its prologue): loaded through vectorized register caches in the
    // input's order. Inputs read on both sides would need both orientations.
    let mut loaded: Vec<TvId> = Vec::new();
    for op in f.inputs.clone() {
        let Operand::Tensor(i) = op else { continue };
        let uses = f.tvs[i].uses.clone();
        let before = uses.iter().filter(|&&u| u == e || prologue.contains(&f.exprs[u].output)).count();
        if before == 0 {
            continue;
        }
        if before != uses.len() {
            bail!("{}: it is read both before and after the transpose", f.tv_name(i));
        }
        if super::full_size_input(f, i, perm.len()) || i == src {
            loaded.push(i);
        }
    }
    let n = perm.len();
    if n < 2 || perm[n - 1] == n - 1 {
        bail!("{}: not a transpose (the last axis stays in place): {perm:?}", f.tv_name(out));
    }
    // A tile spanning a size-one axis would have its threads write one element each.
    let xl = f.no_reduction_logical(src);
    if xl.len() != n
        || f.ids[xl[n - 1]].iter_type == IterType::Broadcast
        || f.ids[xl[perm[n - 1]]].iter_type == IterType::Broadcast
    {
        bail!("{}: a tile would span a size-one axis of {}", f.tv_name(out), f.tv_name(src));
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
    // The same for a runtime size of one (a permute of `[N, 1, 1]` swapping its ones moves no
    // element): one valid element per 64x64 tile, where the pointwise schedule copies rows.
    if sizes[qa] == 1 || sizes[n - 1] == 1 {
        bail!("{}: a tile would span an axis of size one at these sizes", f.tv_name(out));
    }
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
    let sides = loaded.iter().chain(&prologue).chain([&src, &staged, &out]);
    let widest = sides.map(|&t| f.tvs[t].dtype.size_bytes()).max().unwrap_or(4) as i64;
    // A strided input is read element by element.
    let v = if loaded.iter().all(|&x| super::dense(f, x)) { (16 / widest).clamp(1, 4) } else { 1 };
    // 64x64 tiles with 256 threads, each moving four vectors: more bytes in flight per
    // thread than 32x32 tiles (the tile fits a 16.6 KB padded Shared buffer).
    let (tile, threads) = (64, 256);
    // The Shared tile: the permute's result itself when ops follow it, else a copy of the
    // output before its store.
    let s = if out == staged { f.cache_before(out)? } else { staged };
    f.set_memory_type(s, MemoryType::Shared)?;
    // With an epilogue, its last op computes into registers and the output stores them
    // as a vector copy (as the pointwise schedule's outputs do).
    if out != staged {
        epilogue.push(f.cache_before(out)?);
    }
    // Producer side: the same tile, walked along x's rows, read with 16-byte vectors into
    // registers (the caches `ls`), computed on by the prologue, and scattered into the
    // Shared tile from there.
    let mut ls = Vec::new();
    for &x in &loaded {
        let l = f.cache_after(x)?;
        // As in pointwise.rs: 8192x8192 fp32 129.9 -> 128.1 us on the H200.
        if v > 1 && super::evict_last_inputs() {
            f.set_evict_last(l)?;
        }
        ls.push(l);
    }
    // All three to [batch (BIDz),] [J/64 (BIDy), I/64 (BIDx), rows (serial), threads (TIDx),
    // v]: `out` walks the output's rows; `s` is in the output's axis order (j, i) but walks
    // x's rows, and `l` is in x's order (i, j).
    let out_side: &[(i64, i64)] = &[(1, 2)];
    let mut orders: Vec<Oriented> = Vec::new();
    if out == staged {
        orders.push((out, out_side, &canon_out));
    }
    let in_side: &[(i64, i64)] = &[(2, 0), (0, 1), (1, 2)];
    orders.extend(ls.iter().chain(&prologue).map(|&t| (t, in_side, canon_x.as_slice())));
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
    for &l in &ls {
        if v > 1 {
            f.parallelize(l, at(4), ParallelType::Vectorize)?;
        }
        f.inline_at(l, at(4))?;
    }
    for &t in &prologue {
        f.inline_at(t, -1)?;
    }
    f.inline_at(s, at(2))?;
    for &t in &epilogue {
        if t != s && !f.is_output(t) {
            f.inline_at(t, -1)?;
        }
    }
    Ok(Heuristic::new(Params::Transpose { tile, threads, vector: v }))
}
