//! Shared-persistent normalization: the normalizations over trailing axes whose rows the
//! register-persistent scheduler cannot hold (long rows, several full-size inputs, wide
//! types), up to what a block's Shared memory holds, or a cluster's (`cluster_size`). One
//! block per row, or a cluster of blocks each holding its part; each full-size input of the
//! row is copied once into Shared memory and every pass over the row reads it from there, so
//! the input crosses DRAM once whatever the row's length (the looped scheduler reads it once
//! per pass).
//!
//! Every `[rows, K]` tensor becomes `[rows (BIDx), T (TIDx), p, v]` as in `normalization`
//! (`[rows (BIDx), C (BIDy), T (TIDx), p, v]` in a cluster): thread `t` owns vectors `t, t +
//! T, ...` of the row (of its block's part). The Shared copy `s` of an input is computed at
//! the row level (the part's, in a cluster) with those loops, vectorized, so each thread
//! reads back only what it wrote and no barrier separates the copy from the passes; in a
//! cluster it is one bulk copy of the part instead, which every thread waits for. Each
//! pass reads `s` through its own Local vector copy (16-byte Shared loads, not one element
//! at a time) and recomputes its element-wise chain from there: nothing but the row's
//! inputs is kept across a reduction, so registers stay free for loads in flight.

use crate::bail;
use crate::error::Result;
use crate::ir::{ExprId, Fusion, MemoryType, Op, Operand, ParallelType, TvId};
use crate::sched::auto::{looped, normalization, tensor_sizes, Ctx, Heuristic, Params};
use crate::sched::MAX_CLUSTER;

/// Threads a streaming multiprocessor runs at once (every kiln target since sm_70).
const THREADS_PER_SM: i64 = 2048;

/// Bytes of Shared memory a block needs beside its row copies: the block reductions'
/// workspace (one double per thread) and the runtime's reserve.
fn workspace_bytes(threads: i64) -> i64 {
    threads * 8 + 1024
}

/// The inputs whose rows this schedule copies into Shared memory: every dense full-size one.
fn held_inputs(f: &Fusion, n: usize) -> Vec<TvId> {
    f.inputs
        .iter()
        .filter_map(|o| match o {
            Operand::Tensor(x) if super::full_size_input(f, *x, n) => Some(*x),
            _ => None,
        })
        .collect()
}

fn row_copy_bytes(f: &Fusion, held: &[TvId], row: i64) -> i64 {
    held.iter().map(|&x| row * f.tvs[x].dtype.size_bytes() as i64).sum()
}

/// Blocks an SM runs at once when each holds `row_bytes` of row copies.
fn blocks_per_sm(cx: &Ctx, row_bytes: i64) -> i64 {
    cx.device.shared_per_block / (row_bytes + workspace_bytes(128))
}

/// Blocks per row: 1 where two blocks' row copies fit in an SM; beyond that, on sm_90+ and
/// without a total over the rows, the smallest cluster (at most `MAX_CLUSTER`) whose blocks'
/// parts of the row take at most `CLUSTER_PART_BYTES`, or the largest that leaves two blocks
/// per SM, each part a whole number of vectors; 1 where none does (the looped schedule then
/// streams the row). Each block holds its part for its whole life, so an SM streams as many
/// parts at once as its Shared memory holds: three of 64 KiB keep it busy where one block
/// per SM would copy, reduce and write in turn.
fn cluster_size(f: &Fusion, cx: &Ctx, held: &[TvId], row: i64, v: i64, no_totals: bool) -> i64 {
    let whole = row_copy_bytes(f, held, row);
    if v == 1
        || blocks_per_sm(cx, whole) >= 2
        || !no_totals
        || cx.device.arch < 90
        || super::clustered_rows() == Some(false)
    {
        return 1;
    }
    let sizes: Vec<i64> = (1..=MAX_CLUSTER.trailing_zeros())
        .map(|b| 1i64 << b)
        .filter(|&c| row % (c * v) == 0 && blocks_per_sm(cx, whole / c) >= 2)
        .collect();
    sizes.iter().copied().find(|&c| whole / c <= CLUSTER_PART_BYTES).or_else(|| sizes.last().copied()).unwrap_or(1)
}

/// Threads per block that keep an SM's loads in flight when each block holds `row_bytes`.
fn thread_target(cx: &Ctx, row_bytes: i64) -> i64 {
    (THREADS_PER_SM / blocks_per_sm(cx, row_bytes).max(1)).clamp(128, cx.device.max_threads_per_block.min(1024))
}

/// Bytes of row copies per block that a cluster's split aims at (see `cluster_size`).
const CLUSTER_PART_BYTES: i64 = 64 * 1024;

/// Threads per block where a bulk copy fills the row's part: they issue no loads, so more
/// of them would only add warps to every block reduction.
const BULK_THREADS: i64 = 256;

/// Whether this schedule would place rows of `row` elements of the rank-`n` fusion `f`
/// with at least two blocks per SM (the register-persistent schedule asks, see there).
pub(super) fn fits_twice(f: &Fusion, cx: &Ctx, n: usize, row: i64) -> bool {
    let held = held_inputs(f, n);
    !held.is_empty() && blocks_per_sm(cx, row_copy_bytes(f, &held, row)) >= 2
}

/// Threads per block and vectors per thread for a row of `vectors`, about `target` threads.
/// A whole number of warps that divides the row where one exists near the target: a
/// thread's last steps are then never out of bounds, and the unrolled copy issues all its
/// loads before its first store (predicated steps issued them one at a time: bf16 softmax
/// over 8192 columns, 293 threads of seven steps, 0.39 of copy against 0.86 at 4096
/// columns with four whole steps, H200).
fn threads_and_steps(vectors: i64, target: i64) -> (i64, i64) {
    let whole = (1..=32)
        .map(|w| 32 * w)
        .filter(|&t| vectors % t == 0 && t >= target / 2 && t <= 2 * target)
        .min_by_key(|&t| (t - target).abs());
    match whole {
        Some(t) => (t, vectors / t),
        None => {
            let t = target.min(32 * ((vectors + 31) / 32));
            let p = (vectors + t - 1) / t;
            ((vectors + p - 1) / p, p)
        }
    }
}

/// Schedule a normalization over the trailing axes with its rows in Shared memory.
pub fn schedule(f: &mut Fusion, cx: &Ctx, reductions: &[ExprId]) -> Result<Heuristic> {
    let (reductions, totals) = super::split_totals(f, reductions);
    let totals: Vec<TvId> = totals.iter().map(|&e| f.exprs[e].output).collect();
    let post = super::after_totals(f, &totals);
    let r0 = f.exprs[reductions[0]].output;
    let n = f.tvs[r0].logical.len();
    let is_red = normalization::reduced_pattern(f, &reductions)?;
    let k = is_red.iter().filter(|&&b| b).count();
    if n < 2 || k == n || !is_red.iter().skip(n - k).all(|&b| b) {
        bail!("{}: only normalizations over the trailing axes keep their rows in Shared memory", f.tv_name(r0));
    }
    let sizes = tensor_sizes(f, cx, r0)?;
    let row: i64 = sizes[n - k..].iter().product();
    let widest = normalization::widest_moved(f, n);
    let v = if row % (16 / widest) == 0 { 16 / widest } else { 1 };

    let per_row = |f: &Fusion, t: TvId| super::row_value(f, t, &is_red);
    let row_tensors = |f: &Fusion| -> Vec<TvId> {
        f.topo_exprs().iter().map(|&e| f.exprs[e].output).filter(|t| !totals.contains(t) && !post.contains(t)).collect()
    };
    let tensors = row_tensors(f);
    let (rows, full_rank): (Vec<TvId>, Vec<TvId>) = tensors.iter().partition(|&&t| f.tvs[t].logical.len() == n - k);
    normalization::check_aligned(f, cx, r0, &rows, &full_rank)?;

    let held = held_inputs(f, n);
    if held.is_empty() {
        bail!("{}: no full-size input to keep in Shared memory; the row is computed, not read", f.tv_name(r0));
    }
    let cluster = cluster_size(f, cx, &held, row, v, totals.is_empty());
    // Each block's part of the row (the whole row without a cluster).
    let part = row / cluster;
    let vectors = (part + v - 1) / v;
    let row_bytes = row_copy_bytes(f, &held, part);
    // Threads: enough per SM to keep loads in flight once Shared memory caps the blocks an
    // SM runs. One block per SM would copy, reduce and write each row in turn with nothing
    // to overlap (H200, bf16 softmax over 65536 columns: 0.61 of copy, where the looped
    // schedule streams it at 0.67): such rows are left to the looped schedule.
    let blocks_per_sm = blocks_per_sm(cx, row_bytes);
    if blocks_per_sm < 2 {
        bail!(
            "{}: rows of {row_bytes} bytes of input leave room for one block per SM in Shared memory; streamed instead",
            f.tv_name(r0)
        );
    }
    // A part split over a cluster arrives by one bulk copy per block (see `bulk_rows`): a
    // multiple of 16 bytes from a 16-byte aligned address (an input the host found aligned;
    // any other address would make the bulk copy one thread's element loop).
    let whole_bytes = held.iter().all(|&x| (part * f.tvs[x].dtype.size_bytes() as i64) % 16 == 0);
    let bulk = cluster > 1 && whole_bytes && f.aligned_bases && super::bulk_rows() != Some(false);
    let target = if bulk { BULK_THREADS } else { thread_target(cx, row_bytes) };
    let (threads, p) = threads_and_steps(vectors, target);
    let smem = row_bytes + workspace_bytes(threads);
    if smem > cx.device.shared_per_block {
        bail!(
            "{}: rows of {row} elements need {row_bytes} bytes of Shared memory for {} input(s), more than the {} a block may use next to its reductions",
            f.tv_name(r0),
            held.len(),
            cx.device.shared_per_block - workspace_bytes(threads)
        );
    }

    if cluster > 1 {
        f.set_cluster(ParallelType::BIDy, cluster as u32)?;
    }
    // Loop positions: the row's threads (TIDx), then each thread's vectors and their lanes.
    let base = 1 + usize::from(cluster > 1) as i64;
    let mut copies = Vec::new();
    let mut locals = Vec::new();
    for &x in &held {
        if let Some(s) = f.cache_after_plain_reads(x)? {
            f.set_memory_type(s, MemoryType::Shared)?;
            copies.push(s);
            if v > 1 {
                locals.push(f.cache_after(s)?);
            }
        }
    }
    let mut outs = Vec::new();
    for o in f.outputs.clone() {
        if f.no_reduction_logical(o).len() == n && f.tvs[o].logical.len() == n {
            f.cache_before(o)?;
            outs.push(o);
        }
    }
    // Each pass computes its own chain from the row copies: a copy of a Local vector copy
    // is one too, reading the same Shared row.
    looped::recompute_per_reader(f, &|f: &Fusion, t: TvId| per_row(f, t) || post.contains(&t) || copies.contains(&t))?;
    let is_local = |f: &Fusion, t: TvId| {
        f.tvs[t].definition.is_some_and(|d| {
            matches!(f.exprs[d].op, Op::Set) && f.exprs[d].inputs[0].tensor().is_some_and(|s| copies.contains(&s))
        })
    };
    let kept_axes: Vec<usize> = (0..n - k).collect();
    let weight = |f: &Fusion, t: TvId| super::row_weight(f, t, &kept_axes);

    let tensors = row_tensors(f);
    for &t in &tensors {
        if per_row(f, t) {
            for _ in 1..(n - k) {
                f.merge(t, 0, 1)?;
            }
            f.parallelize(t, 0, ParallelType::BIDx)?;
            continue;
        }
        normalization::check_rank(f, t, n)?;
        normalization::rows_and_row(f, t, k)?;
        if bulk && copies.contains(&t) {
            // `[rows, C, K/C]`: one bulk copy of the block's part, issued by one thread.
            f.split(t, 1, cluster, false)?;
            f.parallelize(t, 1, ParallelType::BIDy)?;
            f.parallelize(t, 0, ParallelType::BIDx)?;
            f.parallelize(t, base, ParallelType::Bulk)?;
            continue;
        }
        // With a cluster, `[rows, C, K/C]`: block C of the cluster holds part C of the row.
        if cluster > 1 {
            f.split(t, 1, cluster, false)?;
            f.parallelize(t, 1, ParallelType::BIDy)?;
        }
        f.split(t, base, v, true)?; // [rows, K/v, v]
        f.split(t, base, p, false)?; // [rows, p, T, v]
        f.reorder(t, &[(base + 1, base)])?; // [rows, T, p, v]
        f.parallelize(t, 0, ParallelType::BIDx)?;
        f.parallelize(t, base, ParallelType::TIDx)?;
        if v > 1 && (copies.contains(&t) || is_local(f, t) || outs.contains(&t) || weight(f, t)) {
            f.parallelize(t, base + 2, ParallelType::Vectorize)?;
        }
    }
    super::schedule_totals(f, cx, &totals, &post, sizes[..n - k].iter().product())?;
    for &t in &tensors {
        if f.is_output(t) {
            continue;
        }
        let reduction = matches!(f.tvs[t].definition.map(|e| &f.exprs[e].op), Some(Op::Reduction { .. }));
        let pos = if reduction || per_row(f, t) {
            1 // once per row, read by every pass
        } else if copies.contains(&t) {
            base - 1 + i64::from(bulk) // once per block's part of the row
        } else if v > 1 && (is_local(f, t) || weight(f, t)) {
            base + 2 // 16 bytes at once, in the pass's own vector loop
        } else {
            -1
        };
        f.inline_at(t, pos)?;
    }
    Ok(Heuristic::new(Params::SharedNormalization { vector: v, per_thread: p, threads, cluster }))
}
