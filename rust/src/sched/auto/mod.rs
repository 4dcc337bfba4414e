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
//! - `shared`: normalizations whose rows do not fit in registers, the row's inputs held in
//!   Shared memory across the reductions.
//! - `transpose`: a 2-D permute staged through 64x64 Shared tiles (a permute that keeps
//!   the last axis in place is a pointwise copy in the output's axis order).

pub mod canonical;
pub mod looped;
pub mod normalization;
pub mod partials;
pub mod pointwise;
pub mod reduction;
pub mod registry;
pub mod shared;
pub mod transpose;

pub use registry::{Ctx, DeviceProps, Refusal, Scheduler, REGISTRY};

use crate::bail;
use crate::error::{KilnError, Result};
use crate::ir::{ExprId, Fusion, IterDomainId, IterType, Op, ParallelType, Symbol, TvId};

/// Whether the automatic schedules load inputs with the L2 evict_last hint
/// (`Fusion::set_evict_last`): yes unless `KILN_L2_EVICT_LAST` is `0`, `false`, `off` or
/// `no`. The hinted kernel is faster, but the lines it leaves in L2 slow down the next
/// kernel that relies on L2 (DEVELOPERS.md). Read once per process, so that plans cached
/// under one setting never serve the other.
pub fn evict_last_inputs() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| env_switch("KILN_L2_EVICT_LAST") != Some(false))
}

/// An on/off environment switch: Some(true) for `1`, `true`, `on`, `yes`, Some(false) for
/// `0`, `false`, `off`, `no` (any case, spaces trimmed), None when unset or anything else.
pub(crate) fn env_switch(name: &str) -> Option<bool> {
    std::env::var(name).ok().and_then(|v| match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    })
}

/// Rows split over thread-block clusters (sm_90+). Unset: rows too long for two blocks' Shared
/// memory per SM are split over a cluster in the Shared-persistent normalization
/// (`shared::cluster_size`). `KILN_CLUSTER_ROWS=1` (`true`, `on`, `yes`) also splits rows longer
/// than four vectors per thread of a 512-thread block in the register-persistent normalization
/// (`normalization::cluster_size`); `0` splits no row. Read once per process.
pub fn clustered_rows() -> Option<bool> {
    static ON: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    *ON.get_or_init(|| env_switch("KILN_CLUSTER_ROWS"))
}

/// How a row part split over a cluster reaches Shared memory: unset or `KILN_BULK_ROWS=1`,
/// one bulk copy (`cp.async.bulk`) per block; `0`, every thread copies its own vectors.
/// Read once per process.
pub fn bulk_rows() -> Option<bool> {
    static ON: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    *ON.get_or_init(|| env_switch("KILN_BULK_ROWS"))
}

/// Where normalization rows that both the register-persistent and the Shared-persistent
/// schedules can hold go: `KILN_ROWS_IN_SHARED=1` (`true`, `on`, `yes`) sends every such row
/// to Shared memory, `0` (`false`, `off`, `no`) keeps each in registers whenever they hold
/// it, unset picks per row (see `normalization::schedule`). For comparing the two; read once
/// per process, like [`evict_last_inputs`].
pub fn rows_in_shared() -> Option<bool> {
    static ON: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    *ON.get_or_init(|| env_switch("KILN_ROWS_IN_SHARED"))
}

/// `reorder` moves that put old loop axis `perm[i]` at position `i`.
pub(crate) fn moves_to(perm: &[usize]) -> Vec<(i64, i64)> {
    perm.iter().enumerate().map(|(to, &from)| (from as i64, to as i64)).collect()
}

/// What one scheduler decided: typed, hashable, part of every plan key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Params {
    /// A fusion without exprs.
    Empty,
    /// A single element: one thread computes it.
    Scalar,
    /// Element-wise over the flattened output: `[blocks, unswitch, unroll, threads, vector]`.
    Pointwise { vector: i64, threads: i64, unroll: i64 },
    /// Element-wise over `[rows, cols]` with a broadcast operand loaded once per vector:
    /// `[rows/(unroll*rows_per_block) (BIDy), unroll, rows_per_block (TIDy),
    /// cols/(threads*vector) (BIDx), threads, vector]`, the two grid axes swapped when
    /// `rows_on_x` is 1 (more row tiles than gridDim.y holds).
    Pointwise2d { vector: i64, threads: i64, unroll: i64, rows_per_block: i64, rows_on_x: i64 },
    /// A permute that moves the last axis, copied element-wise in the output's order.
    StridedPermute { vector: i64, threads: i64, unroll: i64 },
    /// One block per kept row; each thread accumulates `vector`-wide loads serially.
    InnerReduction { vector: i64, threads: i64, unroll: i64 },
    /// Threads along the kept last axis, `rows` thread rows (TIDy), `grid` blocks along the
    /// reduced axes (a grid reduction when above one), `serial` steps of `unroll` rows.
    OuterReduction { threads: i64, rows: i64, grid: i64, serial: i64, unroll: i64 },
    /// Everything into one value: `grid` blocks of `threads`, `serial` steps of `unroll`
    /// vectors of `vector`, then a grid reduction; `others` holds `[vector, serial, unroll]`
    /// of each further reduction (of another shape) sharing the grid.
    FullReduction { threads: i64, vector: i64, grid: i64, serial: i64, unroll: i64, others: Vec<i64> },
    /// The row kept in registers, `per_thread` vectors of `vector` per thread: one block
    /// per row, or one warp per row and `rows_per_block` rows per block (TIDy), or with
    /// `cluster` above one, a cluster of that many blocks per row (BIDy), each holding its
    /// part, the row's reductions combined through distributed Shared memory.
    Normalization { vector: i64, per_thread: i64, rows_per_block: i64, cluster: i64 },
    /// The row's full-size inputs copied once into Shared memory, `threads` per block,
    /// `per_thread` vectors of `vector` each; every pass reads the copy. With `cluster` above
    /// one, a cluster of that many blocks per row (BIDy), each copying its part.
    SharedNormalization { vector: i64, per_thread: i64, threads: i64, cluster: i64 },
    /// Row reductions and column partials of `[G, S, N]` tensors (`partials`): one block per
    /// group (BIDx), a serial loop over its rows, each row as `[T (TIDx), per_thread, vector]`.
    ColumnPartials { vector: i64, per_thread: i64 },
    /// One block per row (`outer` 0: `threads_x` threads of `vector`-wide steps) or per
    /// tile of `threads_x` columns (`outer` 1: `threads_y` thread rows), each pass a loop
    /// over the row that reads its inputs again, `unroll` steps in flight; or (`outer` 2)
    /// per tile of `threads_x` columns with each thread holding `unroll` values of the row
    /// in registers on `ceilDiv(R, unroll)` thread rows (`threads_y` 0).
    LoopedNormalization { outer: i64, unroll: i64, vector: i64, threads_x: i64, threads_y: i64 },
    /// Shared-memory tiles of `tile` x `tile`, `threads` per block, `vector`-wide accesses.
    Transpose { tile: i64, threads: i64, vector: i64 },
    /// Several kernels: each group's expr ids and the heuristic it got.
    Segmented(Vec<(Vec<u32>, Heuristic)>),
    /// Some tensor has no elements: the fusion as written (serial loops, one thread per
    /// kernel), whose kernels with nothing to write are not launched and whose
    /// reductions over empty axes write their identities.
    ZeroSize,
}

/// A scheduler's decisions plus the extents it made constants of the kernel (`(n, value)`
/// for extent `i{n}`): the plan-cache key of one kernel (or host program).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Heuristic {
    pub params: Params,
    pub specialized: Vec<(u32, i64)>,
}

impl Heuristic {
    /// A heuristic with no specialized extents.
    pub fn new(params: Params) -> Self {
        Self { params, specialized: Vec::new() }
    }

    /// Name of the schedule, as printed in dumps (`pointwise`, `inner_reduction`, ...).
    pub fn kind(&self) -> &'static str {
        match self.params {
            Params::Empty => "empty",
            Params::ZeroSize => "zero_size",
            Params::Scalar | Params::Pointwise { .. } | Params::Pointwise2d { .. } => "pointwise",
            Params::StridedPermute { .. } => "strided_permute",
            Params::InnerReduction { .. } => "inner_reduction",
            Params::OuterReduction { .. } => "outer_reduction",
            Params::FullReduction { .. } => "full_reduction",
            Params::Normalization { .. } => "normalization",
            Params::SharedNormalization { .. } => "shared_normalization",
            Params::LoopedNormalization { .. } => "looped_normalization",
            Params::ColumnPartials { .. } => "column_partials",
            Params::Transpose { .. } => "transpose",
            Params::Segmented(_) => "segmented",
        }
    }

    /// The parameters as integers (the Python side's plan key and dumps): the scheduler's
    /// values in declaration order, then `-1 - n, value` per specialized extent.
    pub fn values(&self) -> Vec<i64> {
        let mut v = match &self.params {
            Params::Empty | Params::ZeroSize => Vec::new(),
            Params::Scalar => vec![0],
            Params::Pointwise { vector, threads, unroll } => vec![*vector, *threads, *unroll, 1],
            Params::Pointwise2d { vector, threads, unroll, rows_per_block, rows_on_x } => {
                vec![*vector, *threads, *unroll, 2, *rows_per_block, *rows_on_x]
            }
            Params::StridedPermute { vector, threads, unroll } => vec![*vector, *threads, *unroll, 1],
            Params::InnerReduction { vector, threads, unroll } => vec![*vector, *threads, *unroll],
            Params::OuterReduction { threads, rows, grid, serial, unroll } => {
                vec![*threads, *rows, *grid, *serial, *unroll]
            }
            Params::FullReduction { threads, vector, grid, serial, unroll, others } => {
                [vec![*threads, *vector, *grid, *serial, *unroll], others.clone()].concat()
            }
            Params::Normalization { vector, per_thread, rows_per_block, cluster } => {
                vec![*vector, *per_thread, *rows_per_block, *cluster]
            }
            Params::SharedNormalization { vector, per_thread, threads, cluster } => {
                vec![*vector, *per_thread, *threads, *cluster]
            }
            Params::ColumnPartials { vector, per_thread } => vec![*vector, *per_thread],
            Params::LoopedNormalization { outer, unroll, vector, threads_x, threads_y } => {
                vec![*outer, *unroll, *vector, *threads_x, *threads_y]
            }
            Params::Transpose { tile, threads, vector } => vec![*tile, *threads, *vector],
            Params::Segmented(groups) => {
                let mut out = Vec::new();
                for (exprs, h) in groups {
                    let inner = h.values();
                    out.push(registry::kind_index(h.kind()));
                    out.push(exprs.len() as i64);
                    out.extend(exprs.iter().map(|&e| e as i64));
                    out.push(inner.len() as i64);
                    out.extend(inner);
                }
                out
            }
        };
        for &(n, value) in &self.specialized {
            v.extend([-1 - n as i64, value]);
        }
        v
    }

    /// `pointwise[4, 128, 1, 1]`-style description.
    pub fn describe(&self) -> String {
        format!("{}{:?}", self.kind(), self.values())
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

/// True when `tv` holds no element for the inputs at hand (a reduction's reduced axes
/// aside: a sum over an empty axis has its other axes' elements).
pub fn holds_nothing(f: &Fusion, cx: &Ctx, tv: TvId) -> bool {
    let env = |s: Symbol| match s {
        Symbol::Extent(n) => cx.extents.get(n as usize).copied(),
        Symbol::ScalarInput(n) => cx.scalars.get(n as usize).copied().flatten(),
        _ => None,
    };
    f.no_reduction_logical(tv).iter().any(|&id| f.scalars.eval(f.ids[id].extent, &env).is_ok_and(|n| n == 0))
}

/// Concrete sizes of every logical axis of `tv` for the inputs at hand.
pub fn tensor_sizes(f: &Fusion, cx: &Ctx, tv: TvId) -> Result<Vec<i64>> {
    let env = |s: Symbol| match s {
        Symbol::Extent(n) => cx.extents.get(n as usize).copied(),
        Symbol::ScalarInput(n) => cx.scalars.get(n as usize).copied().flatten(),
        _ => None,
    };
    f.tvs[tv].logical.iter().map(|&id| f.scalars.eval(f.ids[id].extent, &env)).collect()
}

/// True when some tensor of `f` has no elements for the inputs at hand.
pub fn has_empty_tensor(f: &Fusion, cx: &Ctx) -> bool {
    f.tvs.keys().any(|tv| tensor_sizes(f, cx, tv).is_ok_and(|s| s.contains(&0)))
}

/// The runtime scalar inputs `s{n}` that some tensor's shape reads (a `full` of a runtime
/// size): plans depend on their values.
pub fn shape_scalars(f: &Fusion) -> Vec<u32> {
    let seen = std::cell::RefCell::new(Vec::new());
    let env = |s: Symbol| match s {
        Symbol::ScalarInput(n) => {
            if !seen.borrow().contains(&n) {
                seen.borrow_mut().push(n);
            }
            Some(1)
        }
        _ => Some(1),
    };
    for t in f.tvs.values() {
        for &id in &t.logical {
            let _ = f.scalars.eval(f.ids[id].extent, &env);
        }
    }
    let mut v = seen.into_inner();
    v.sort_unstable();
    v
}

/// Schedule `f` in place for inputs of the given sizes on the default target: the first
/// scheduler of the registry that covers the whole fusion, else an error listing the
/// refusals.
pub fn schedule(f: &mut Fusion, inputs: &[Vec<i64>]) -> Result<Heuristic> {
    let cx = Ctx { extents: extent_values(f, inputs)?, scalars: Vec::new(), device: DeviceProps::default() };
    match registry::schedule_fusion(f, &cx)? {
        Ok(p) => Ok(p.heuristic),
        Err(refusals) => Err(refused(&refusals)),
    }
}

/// The error for a fusion no scheduler covers as one kernel.
pub fn refused(refusals: &[Refusal]) -> KilnError {
    let why: Vec<String> = refusals.iter().map(|r| r.to_string()).collect();
    KilnError::value(format!("no automatic schedule covers this fusion as one kernel ({})", why.join("; ")))
}

/// `roots` and the computed tensors they are made from (fusion inputs excluded), in no
/// particular order: what a scheduler places on one side of a permute or in one class of
/// outputs.
pub(crate) fn computed_closure(f: &Fusion, roots: &[TvId]) -> Vec<TvId> {
    let mut seen: Vec<TvId> = Vec::new();
    let mut known: rustc_hash::FxHashSet<TvId> = rustc_hash::FxHashSet::default();
    let mut stack = roots.to_vec();
    while let Some(t) = stack.pop() {
        if let Some(d) = f.tvs[t].definition {
            if known.insert(t) {
                seen.push(t);
                stack.extend(f.exprs[d].input_tvs());
            }
        }
    }
    seen
}

/// Put the reduction results `rs` that are not outputs in Global memory: ops after a grid
/// reduction read its result back in the thread that finishes it.
pub(crate) fn grid_results_in_global(f: &mut Fusion, rs: &[TvId]) -> Result<()> {
    for &x in rs {
        if !f.is_output(x) {
            f.set_memory_type(x, crate::ir::MemoryType::Global)?;
        }
    }
    Ok(())
}

/// The tensors computed from `roots` (roots excluded), in dependency order.
pub(crate) fn downstream(f: &Fusion, roots: &[TvId]) -> Vec<TvId> {
    let mut out: Vec<TvId> = Vec::new();
    for e in f.topo_exprs() {
        if f.exprs[e].input_tvs().any(|t| roots.contains(&t) || out.contains(&t)) {
            out.push(f.exprs[e].output);
        }
    }
    out
}

/// What is computed from the totals of a row schedule (`downstream` of them), with the
/// values of scalars alone that only those read (`total / cast(S)` of a runtime size): they
/// run where the totals finish, as the rest of it does.
pub(crate) fn after_totals(f: &Fusion, totals: &[TvId]) -> Vec<TvId> {
    let mut post = downstream(f, totals);
    if post.is_empty() {
        return post;
    }
    let from_scalars = |f: &Fusion, t: TvId, post: &[TvId]| {
        f.tvs[t].definition.is_some_and(|d| f.exprs[d].input_tvs().all(|i| post.contains(&i)))
            && f.no_reduction_logical(t).is_empty()
            && !f.tvs[t].uses.is_empty()
            && f.tvs[t].uses.iter().all(|&u| post.contains(&f.exprs[u].output))
    };
    let order = f.topo_exprs();
    // Readers first, so a chain of such values joins from its reader back.
    loop {
        let found = order
            .iter()
            .rev()
            .map(|&e| f.exprs[e].output)
            .find(|&t| !post.contains(&t) && !totals.contains(&t) && from_scalars(f, t, &post));
        let Some(t) = found else { break };
        post.push(t);
    }
    // In dependency order, as `downstream` gives it.
    let at: rustc_hash::FxHashMap<TvId, usize> =
        order.iter().enumerate().map(|(i, &e)| (f.exprs[e].output, i)).collect();
    post.sort_by_key(|t| at.get(t).copied().unwrap_or(0));
    post
}

/// The reductions of `reds` that a row schedule runs as totals of its rows, and the others.
/// A total reduces every axis of a per-row value (a tensor of the kept axes of the widest
/// reductions: a loss averaged over the rows, the sum of the row sums, a count of the valid
/// rows): each block adds its row's value in a grid reduction over the blocks, and ops on
/// the totals (rank 0) run where the last one finishes.
pub(crate) fn split_totals(f: &Fusion, reds: &[ExprId]) -> (Vec<ExprId>, Vec<ExprId>) {
    let input_rank = |e: ExprId| f.exprs[e].inputs[0].tensor().map_or(0, |x| f.no_reduction_logical(x).len());
    let widest = reds.iter().map(|&e| input_rank(e)).max().unwrap_or(0);
    let kept =
        reds.iter().find(|&&e| input_rank(e) == widest).map_or(0, |&e| f.no_reduction_logical(f.exprs[e].output).len());
    reds.iter().partition(|&&e| {
        let out = f.exprs[e].output;
        !(kept > 0
            && input_rank(e) == kept
            && f.tvs[out].logical.iter().all(|&id| f.ids[id].iter_type == IterType::Reduction))
    })
}

/// Schedule the totals of a row schedule whose `rows` run on BIDx (see [`split_totals`]):
/// each a grid reduction over the rows' blocks; `post` (what is computed from them, rank 0)
/// runs in the thread that finishes the last one. Refuses totals read by anything of a
/// higher rank (that needs the total in every block), and totals over more than four waves
/// of rows: every block then waits on the grid reduction's semaphore before it exits, which
/// costs more than a second small kernel (H200, `benches/families.py`: cross-entropy over
/// 8192 x 32000, 770.8 us in one kernel against 582.8 us in two; 16384 row sums and their
/// total, 230.0 against 210.3).
pub(crate) fn schedule_totals(f: &mut Fusion, cx: &Ctx, totals: &[TvId], post: &[TvId], rows: i64) -> Result<()> {
    if !totals.is_empty() && rows > 4 * cx.device.sm_count {
        bail!(
            "{}: a total of {rows} rows in the row kernel would hold every block at its semaphore; it takes a kernel of its own",
            f.tv_name(totals[0])
        );
    }
    if let Some(&t) = post.iter().find(|&&t| !f.no_reduction_logical(t).is_empty()) {
        bail!(
            "{}: reads a total of the rows, which only the block that finishes it has; it needs a kernel of its own",
            f.tv_name(t)
        );
    }
    for &t in totals {
        let n = f.tvs[t].loop_domain.len();
        for _ in 1..n {
            f.merge(t, 0, 1)?;
        }
        f.parallelize(t, 0, ParallelType::BIDx)?;
    }
    if !post.is_empty() {
        grid_results_in_global(f, totals)?;
        for &t in post {
            if !f.is_output(t) {
                f.inline_at(t, -1)?;
            }
        }
    }
    Ok(())
}

/// Steps per unswitched tile of a row `steps` vector steps long: four from eight steps (their
/// loads issued together hide DRAM latency), else all of them, at most four.
pub(crate) fn tile_steps(steps: i64) -> i64 {
    if steps >= 8 {
        4
    } else {
        steps.clamp(1, 4)
    }
}

/// True when `t` holds one value per row of a row schedule reducing the axes `is_red`:
/// the kept axes alone (a reduction's result), or every axis with a size-one broadcast at
/// each reduced one where a gather computes it (the label's logit that cross-entropy picks,
/// `[rows, 1]`) or a broadcast read only by such values (the labels it picks at). Those are
/// computed once per row; other `[rows, 1]` values (a `keepdim` statistic and the math on
/// it) stay inlined into their element-wise readers.
pub(crate) fn row_value(f: &Fusion, t: TvId, is_red: &[bool]) -> bool {
    let l = &f.tvs[t].logical;
    if l.iter().any(|&id| f.ids[id].iter_type == IterType::Reduction) {
        return false;
    }
    let kept = is_red.iter().filter(|&&r| !r).count();
    if l.len() == kept {
        return kept > 0;
    }
    l.len() == is_red.len()
        && kept > 0
        && is_red.iter().zip(l).all(|(&r, &id)| !r || f.ids[id].iter_type == IterType::Broadcast)
        && f.tvs[t].definition.is_some_and(|e| {
            f.exprs[e].indexed_tensor().is_some()
                || (matches!(f.exprs[e].op, Op::Broadcast { .. })
                    && !f.tvs[t].uses.is_empty()
                    && f.tvs[t].uses.iter().all(|&u| row_value(f, f.exprs[u].output, is_red)))
        })
}

/// A weight of a row schedule: an input broadcast along every kept axis (`kept`) and along
/// none of the row's, the same for every row, loaded with the rows' vectors. A weight that
/// is also broadcast inside the row (GroupNorm(1)'s per-channel `w[c]` over a `C*H*W` row)
/// repeats along the merged row axis, so its vectors would not line up with the row's.
pub(crate) fn row_weight(f: &Fusion, t: TvId, kept: &[usize]) -> bool {
    let l = &f.tvs[t].logical;
    broadcast_input(f, t)
        && kept.iter().all(|&a| l.get(a).is_some_and(|&id| f.ids[id].iter_type == IterType::Broadcast))
        && (0..l.len()).filter(|a| !kept.contains(a)).all(|a| f.ids[l[a]].iter_type == IterType::Iteration)
}

/// True when `t` is a broadcast of a fusion input that varies by row but has every axis of
/// `row` (an attention mask [B, S] over scores [B, H, S, S]): it can load a row in vectors.
pub(crate) fn row_spanning_broadcast(f: &Fusion, t: TvId, row: std::ops::Range<usize>) -> bool {
    broadcast_input(f, t)
        && row
            .into_iter()
            .all(|a| f.tvs[t].logical.get(a).is_some_and(|&id| f.ids[id].iter_type == IterType::Iteration))
}

/// True when `t` is a broadcast of a fusion input (a weight or bias read by every row).
fn broadcast_input(f: &Fusion, t: TvId) -> bool {
    let Some(def) = f.tvs[t].definition else { return false };
    matches!(f.exprs[def].op, Op::Broadcast { .. }) && f.exprs[def].inputs[0].tensor().is_some_and(|x| f.is_input(x))
}

/// Make the reduced extents of `reductions` (and every extent mapped to them) constants
/// of the kernel. Bounds checks of a thread's share of a row then fold away at compile
/// time: without this, a row of 4096 floats spends more instructions on predicates than
/// on data. Returns `(n, value)` pairs for the heuristic's cache key, since the kernel
/// now only runs on inputs of these sizes.
/// The first of `tensors` whose logical axes do not line up with `reference`, position
/// by position: another rank, or an iteration axis that is neither the reference's axis at
/// that place (in the broadcast-permissive id graph) nor of the same size for the inputs at
/// hand. Schedulers replay one loop structure positionally on every tensor, so such a
/// tensor (an output computed from unrelated inputs of another shape, a broadcast that
/// lands on other axes) would be iterated by the wrong loops. Unmapped axes of equal size
/// are fine: each tensor indexes with its own extents (two sums over `[B]` rows that a
/// kernel boundary separated from each other's definitions).
pub(crate) fn misaligned(f: &Fusion, cx: &Ctx, reference: &[IterDomainId], tensors: &[TvId]) -> Option<TvId> {
    misaligned_in(&crate::analysis::id_graph::IdGraph::permissive(f), f, cx, reference, tensors)
}

/// `misaligned` with the fusion's permissive id graph built once by the caller (who asks
/// for many tensors and references).
pub(crate) fn misaligned_in(
    graph: &crate::analysis::id_graph::IdGraph,
    f: &Fusion,
    cx: &Ctx,
    reference: &[IterDomainId],
    tensors: &[TvId],
) -> Option<TvId> {
    let env = |s: Symbol| match s {
        Symbol::Extent(n) => cx.extents.get(n as usize).copied(),
        Symbol::ScalarInput(n) => cx.scalars.get(n as usize).copied().flatten(),
        _ => None,
    };
    let size = |id: IterDomainId| f.scalars.eval(f.ids[id].extent, &env).ok();
    tensors.iter().copied().find(|&t| {
        let l = &f.tvs[t].logical;
        l.len() != reference.len()
            || l.iter().zip(reference).any(|(&id, &r)| {
                f.ids[id].iter_type != IterType::Broadcast
                    && !graph.same(id, r)
                    && (size(id).is_none() || size(id) != size(r))
            })
    })
}

/// True when input `x` has `n` axes and none of them a broadcast that another tensor runs:
/// a full-size input that a scheduler may cache and vectorize along the reference's loops.
/// An input with a size-one broadcast axis where the fusion's tensors are larger (a keepdim
/// statistic) covers fewer elements than those loops and is read in place instead.
pub(crate) fn full_size_input(f: &Fusion, x: TvId, n: usize) -> bool {
    let l = f.no_reduction_logical(x);
    if l.len() != n || !dense(f, x) {
        return false;
    }
    // A size-one axis counts where every tensor of the fusion's rank keeps it size one and
    // none reduces it (a batch of one, `define_tensor([1, S, H])`): the input is then as large
    // as the others. Where some tensor runs or reduces that axis, the input is broadcast along
    // it.
    let kept_one = |i: usize| {
        i + 1 < n
            && f.tvs.keys().all(|t| {
                let tl = &f.tvs[t].logical;
                let kept = f.no_reduction_logical(t).len();
                (tl.len() != n && kept != n) || tl.get(i).is_some_and(|&id| f.ids[id].iter_type == IterType::Broadcast)
            })
    };
    l.iter().enumerate().all(|(i, &id)| f.ids[id].iter_type != IterType::Broadcast || kept_one(i))
}

/// True when `x` is stored densely in logical order (every stored axis contiguous): a
/// vector of consecutive logical elements is one of consecutive addresses. A strided
/// input (a slice, a transposed or expanded array) is read element by element.
pub(crate) fn dense(f: &Fusion, x: TvId) -> bool {
    let t = &f.tvs[x];
    t.allocation.is_none() && t.contiguity.iter().all(|&c| c != Some(false))
}

pub(crate) fn specialize_reduced_extents(f: &mut Fusion, reductions: &[ExprId], extents: &[i64]) -> Vec<(u32, i64)> {
    let mut reduced = Vec::new();
    for &e in reductions {
        let r = f.exprs[e].output;
        reduced.extend(f.tvs[r].logical.iter().copied().filter(|&id| f.ids[id].iter_type == IterType::Reduction));
    }
    specialize_extents(f, &reduced, extents)
}

/// Make the extents of `ids` (and of every id exactly mapped to one of them) constants of
/// the kernel; returns `(n, value)` pairs for the heuristic's cache key.
pub(crate) fn specialize_extents(f: &mut Fusion, ids: &[IterDomainId], extents: &[i64]) -> Vec<(u32, i64)> {
    let graph = crate::analysis::id_graph::IdGraph::exact(f);
    let roots: rustc_hash::FxHashSet<IterDomainId> = ids.iter().map(|&r| graph.find(r)).collect();
    let mut syms: Vec<u32> = Vec::new();
    for id in f.ids.keys() {
        if !roots.contains(&graph.find(id)) {
            continue;
        }
        if let crate::ir::scalar::Val::Symbol(Symbol::Extent(n)) = f.scalars.get(f.ids[id].extent) {
            if (n as usize) < extents.len() {
                syms.push(n);
            }
        }
    }
    syms.sort_unstable();
    syms.dedup();
    let key: Vec<(u32, i64)> = syms.into_iter().map(|n| (n, extents[n as usize])).collect();
    f.specialize_extents(&key);
    key
}

/// Clear the L2 load hints a schedule set on tensors whose loads did not end up vectorized
/// (the hints belong to vector loads): an operand order or a permute that leaves a cache
/// unvectorized costs the hint, not the schedule.
pub fn drop_unvectorized_hints(f: &mut Fusion) {
    for t in f.tvs.keys().collect::<Vec<_>>() {
        let vectorized = f.tvs[t].loop_domain.iter().any(|&id| f.ids[id].parallel == ParallelType::Vectorize);
        if !vectorized {
            f.tvs[t].evict_last_load = false;
            f.tvs[t].streaming_load = false;
        }
    }
}

/// Lower inline positions until every tensor computed once serves all its consumers from
/// one loop: past its inline position, a tensor that is inlined somewhere runs its own
/// loops, closed before its consumer goes on (the loop nests of tensors that are not
/// inlined at all merge where they map). When two consumers run axis `a` in such loops of
/// their own (one feeds a vectorized output copy, the other a second output), no single
/// placement of the producer is inside both, so it stops before `a`. Where the loops it
/// would then share run a larger space than its own axes (a broadcast bias flattened to
/// its own size, read by two outputs of the full size), its private loops would not walk
/// its consumers' elements: it is computed again for each consumer instead, a copy with its
/// schedule inlined as deep as it was. Consumers are settled first, so their loops are
/// known.
pub(crate) fn settle_inlining(f: &mut Fusion) -> Result<()> {
    // The inlined tensor whose own loop `t`'s axis `a` runs in; None for the merged nests.
    fn owner(f: &Fusion, t: TvId, a: usize) -> Option<TvId> {
        let mut t = t;
        loop {
            let pos = f.tvs[t].inline_pos;
            if pos == 0 {
                return None;
            }
            if pos <= a {
                return Some(t);
            }
            match f.consumers(t).first() {
                Some(&c) if a < f.tvs[c].loop_domain.len() => t = c,
                _ => return Some(t),
            }
        }
    }
    let order = f.topo_exprs();
    for &e in order.iter().rev() {
        let t = f.exprs[e].output;
        let consumers = f.consumers(t);
        if consumers.len() < 2 {
            continue;
        }
        // Thread and block axes are not loops: every tensor shares them.
        let p = f.tvs[t].inline_pos;
        let split = (0..p).find(|&a| {
            let id = f.tvs[t].loop_domain[a];
            if f.ids[id].parallel.is_thread_or_block() {
                return false;
            }
            let owners: Vec<Option<TvId>> = consumers.iter().map(|&c| owner(f, c, a)).collect();
            owners.iter().any(|&o| o != owners[0])
        });
        if let Some(a) = split {
            if shares_larger_loops(f, t, &consumers, a) {
                for &c in &consumers[1..] {
                    let copy = recompute_scheduled(f, t)?;
                    for u in f.tvs[t].uses.clone() {
                        if f.exprs[u].output == c {
                            f.redirect_use(u, t, copy);
                        }
                    }
                }
            } else {
                f.tvs[t].inline_pos = a;
            }
        }
    }
    Ok(())
}

/// True when one of `t`'s loop axes before `a` (the loops it would share once inlined at
/// `a`) has another extent than a consumer's axis there: a broadcast flattened to its own
/// size runs inside the loops of the concretized space.
fn shares_larger_loops(f: &Fusion, t: TvId, consumers: &[TvId], a: usize) -> bool {
    let ld = &f.tvs[t].loop_domain;
    consumers.iter().any(|&c| {
        let cd = &f.tvs[c].loop_domain;
        (0..a).any(|b| b < cd.len() && f.ids[ld[b]].extent != f.ids[cd[b]].extent)
    })
}

/// A copy of scheduled tensor `t` (its expr reading the same operands) with `t`'s loop
/// transforms, parallelization, memory and inline position.
fn recompute_scheduled(f: &mut Fusion, t: TvId) -> Result<TvId> {
    let copy = canonical::recompute(f, t)?;
    let mut map: rustc_hash::FxHashMap<IterDomainId, IterDomainId> =
        f.tvs[t].logical.iter().copied().zip(f.tvs[copy].logical.iter().copied()).collect();
    let loop_domain = crate::sched::replay::replay_onto(f, t, &mut map);
    if loop_domain.len() != f.tvs[t].loop_domain.len() {
        crate::bail_internal!("recompute_scheduled: {} replays onto {} loop axes", f.tv_name(t), loop_domain.len());
    }
    f.tvs[copy].loop_domain = loop_domain;
    f.tvs[copy].inline_pos = f.tvs[t].inline_pos;
    f.tvs[copy].memory = f.tvs[t].memory;
    Ok(copy)
}
