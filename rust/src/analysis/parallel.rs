//! Which parallel types partition or are shared across each memory type.
//!
//! *Partitioned*: each thread/block owns a private copy, so an id with that parallel
//! type needs no room in the allocation (Local vs TID/BID, Shared vs BID).
//! *Shared across*: all threads/blocks see the same buffer, so an id with that parallel
//! type must be allocated even left of the inline position (Shared vs TID, Global vs
//! TID/BID).

use crate::analysis::id_graph::IdGraph;
use crate::analysis::loop_graph::LoopGraph;
use crate::ir::{ExprId, Fusion, IterDomainId, IterType, MemoryType, ParallelType, TvId};

/// True when memory of type `mem` is private per `pt` index.
pub fn is_partitioned_across(mem: MemoryType, pt: ParallelType) -> bool {
    match mem {
        MemoryType::Local => pt.is_thread_or_block(),
        MemoryType::Shared => pt.is_block(),
        MemoryType::Global => false,
    }
}

/// True when memory of type `mem` is visible to every `pt` index.
pub fn is_shared_across(mem: MemoryType, pt: ParallelType) -> bool {
    match mem {
        MemoryType::Local => false,
        MemoryType::Shared => pt.is_thread(),
        MemoryType::Global => pt.is_thread_or_block(),
    }
}

/// Thread and block dimensions of a kernel, in launch order.
pub const DIMS: [ParallelType; 6] = [
    ParallelType::BIDx,
    ParallelType::BIDy,
    ParallelType::BIDz,
    ParallelType::TIDx,
    ParallelType::TIDy,
    ParallelType::TIDz,
];

/// The thread and block dimensions some loop of the kernel runs on.
pub fn used_dims(lg: &LoopGraph) -> Vec<ParallelType> {
    DIMS.into_iter().filter(|&p| lg.groups.iter().any(|g| g.parallel == p)).collect()
}

/// The loop axis of `tv` whose loop runs on `pt` and whose index selects the element `tv`
/// writes. A broadcast axis of Shared or Global memory selects nothing: every index along
/// it would store the same element, so index 0 stores it (as for a dimension the tensor
/// does not use at all). Reduced axes are left out: a block reduction leaves its result in
/// every thread of a Local tensor and stores it once to Shared or Global memory.
pub fn writer_axis(f: &Fusion, lg: &LoopGraph, tv: TvId, pt: ParallelType) -> Option<usize> {
    let t = &f.tvs[tv];
    (0..t.loop_domain.len()).find(|&a| {
        let id = &f.ids[t.loop_domain[a]];
        lg.groups[lg.group(tv, a)].parallel == pt
            && id.iter_type != IterType::Reduction
            && !(t.memory != MemoryType::Local && id.iter_type == IterType::Broadcast)
    })
}

/// True when the expr defining `tv` runs on every index of `pt` (not only on index 0):
/// some loop axis of it runs on `pt`, other than a broadcast axis of Shared or Global memory.
pub fn runs_on(f: &Fusion, lg: &LoopGraph, tv: TvId, pt: ParallelType) -> bool {
    let t = &f.tvs[tv];
    (0..t.loop_domain.len()).any(|a| {
        lg.groups[lg.group(tv, a)].parallel == pt
            && !(t.memory != MemoryType::Local && f.ids[t.loop_domain[a]].iter_type == IterType::Broadcast)
    })
}

/// The loop axis of `tv` (any kind) whose loop runs on `pt`.
pub fn parallel_axis(lg: &LoopGraph, f: &Fusion, tv: TvId, pt: ParallelType) -> Option<usize> {
    (0..f.tvs[tv].loop_domain.len()).find(|&a| lg.groups[lg.group(tv, a)].parallel == pt)
}

/// The thread and block dimensions that the reduction defining `tv` combines (empty for
/// other exprs), in launch order: the parallel types of its reduced axes, and for a grid
/// reduction also the thread dimensions of the kernel that `tv` does not run on. Those
/// threads hold copies of one value, of which only index 0's enters (indexing guards a Global tensor to index 0
/// along a dimension it does not use), so each block contributes one partial instead of one
/// per thread. Codegen, the interpreter and the work buffers' sizes all read this.
pub fn reduced_dims(f: &Fusion, lg: &LoopGraph, tv: TvId) -> Vec<ParallelType> {
    let Some(d) = f.tvs[tv].definition else { return Vec::new() };
    if !matches!(f.exprs[d].op, crate::ir::Op::Reduction { .. }) {
        return Vec::new();
    }
    let t = &f.tvs[tv];
    let axes: Vec<ParallelType> = (0..t.loop_domain.len())
        .filter(|&a| f.ids[t.loop_domain[a]].iter_type == IterType::Reduction)
        .map(|a| lg.groups[lg.group(tv, a)].parallel)
        .filter(|p| p.is_thread_or_block())
        .collect();
    // A reduction over the clusters' block dimension alone is a block reduction that
    // spans the cluster: every block holds its result, as every thread holds a block's.
    let grid = axes.iter().any(|&p| f.is_grid_dim(p));
    let used = used_dims(lg);
    DIMS.into_iter()
        .filter(|&p| axes.contains(&p) || (grid && p.is_thread() && used.contains(&p) && !runs_on(f, lg, tv, p)))
        .collect()
}

/// The dimensions of [`reduced_dims`] when one of them is a block dimension (a grid
/// reduction); empty otherwise. Only the threads that `Symbol::GridDone(tv)` names hold its
/// result.
pub fn grid_reduced_dims(f: &Fusion, lg: &LoopGraph, tv: TvId) -> Vec<ParallelType> {
    let dims = reduced_dims(f, lg, tv);
    if dims.iter().any(|&p| f.is_grid_dim(p)) {
        dims
    } else {
        Vec::new()
    }
}

/// For every computed tensor, the grid reductions of the kernel whose results it waits for:
/// its expr runs only where `Symbol::GridDone` of each holds (the one thread per output
/// element that has the finished result), in the same kernel. Of several grid reductions
/// over the same dimensions, only the last one in the kernel's expr `order` is listed.
pub fn grid_waits(f: &Fusion, lg: &LoopGraph, order: &[ExprId]) -> rustc_hash::FxHashMap<TvId, Vec<TvId>> {
    let mut waits: rustc_hash::FxHashMap<TvId, Vec<TvId>> = rustc_hash::FxHashMap::default();
    for e in f.topo_exprs() {
        let mut w: Vec<TvId> = Vec::new();
        for t in f.exprs[e].input_tvs() {
            let direct = (!grid_reduced_dims(f, lg, t).is_empty()).then_some(t);
            for g in direct.into_iter().chain(waits.get(&t).cloned().unwrap_or_default()) {
                if !w.contains(&g) {
                    w.push(g);
                }
            }
        }
        // Grid reductions over the same dimensions run one after another in every block: the
        // block that finishes the last of them has arrived at it after writing each earlier
        // result (its protocol fences before the arrival), so that block sees them all.
        if w.len() > 1 {
            let dims = grid_reduced_dims(f, lg, w[0]);
            if w.iter().all(|&g| grid_reduced_dims(f, lg, g) == dims) {
                let at = |g: TvId| f.tvs[g].definition.and_then(|d| order.iter().position(|&x| x == d));
                if let Some(&last) = w.iter().max_by_key(|&&g| at(g)) {
                    w = vec![last];
                }
            }
        }
        if !w.is_empty() {
            waits.insert(f.exprs[e].output, w);
        }
    }
    waits
}

/// A thread or block dimension along which a consumer reads elements of its producer that
/// another thread or block of that dimension wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrossRead {
    pub pt: ParallelType,
    /// The producer's loop axis on `pt` (None: the producer is written by index 0 of `pt`).
    pub producer_axis: Option<usize>,
    /// The consumer's loop axis on `pt` (None: every index of `pt` runs the consumer).
    pub consumer_axis: Option<usize>,
}

/// True when loop id `id` is `root` or computed from it by splits and merges.
fn derives_from(f: &Fusion, id: crate::ir::IterDomainId, root: crate::ir::IterDomainId) -> bool {
    f.id_derived_from_any(id, |i| i == root)
}

/// The dimensions along which expr `e` reads its producer `p` from other threads or blocks.
///
/// Along a dimension `pt` the read stays in the writing thread when the producer shares the
/// `pt` loop with the consumer (inlined past it), when both run `pt` over exactly mapped ids
/// (each index reads the element it wrote), or when the producer is Local and does not use
/// `pt` or uses it only over a broadcast (each index computed its own copy; so is a Shared producer along a block dimension). A Shared or Global producer that does not use `pt` is otherwise written by
/// index 0 of it, which only a consumer restricted to index 0 (one that does not use `pt`
/// either and is not private along it) reads back without crossing.
pub fn cross_reads(f: &Fusion, lg: &LoopGraph, exact: &IdGraph, p: TvId, e: ExprId) -> Vec<CrossRead> {
    let c = f.exprs[e].output;
    let (pt_, ct) = (&f.tvs[p], &f.tvs[c]);
    let mut out = Vec::new();
    if f.is_input(p) || pt_.definition.is_none() {
        return out;
    }
    // The table of a gather is read along its selected axis at positions the index data
    // picks: an axis of the table computed from that one is read by whichever thread the
    // index names, whatever the loops map.
    // A remap reads every axis of its input at computed positions.
    let gathered: Vec<IterDomainId> = match (&f.exprs[e].op, f.exprs[e].inputs.first()) {
        (crate::ir::Op::IndexSelect { dim }, Some(&crate::ir::Operand::Tensor(t))) if t == p => {
            f.no_reduction_logical(p).get(*dim).copied().into_iter().collect()
        }
        (crate::ir::Op::Remap { .. }, Some(&crate::ir::Operand::Tensor(t))) if t == p => f.no_reduction_logical(p),
        _ => Vec::new(),
    };
    // Along the dimensions a grid reduction combines, one thread holds each result, and the
    // consumer runs there (`grid_waits`) unless it spreads over that dimension itself.
    let grid = grid_reduced_dims(f, lg, p);
    for pt in used_dims(lg) {
        let pa = writer_axis(f, lg, p, pt);
        let ca = parallel_axis(lg, f, c, pt);
        if grid.contains(&pt) {
            if ca.is_some() {
                out.push(CrossRead { pt, producer_axis: None, consumer_axis: ca });
            }
            continue;
        }
        let crosses = match pa {
            Some(a) if a < pt_.inline_pos => false,
            Some(a) if gathered.iter().any(|&sel| derives_from(f, pt_.loop_domain[a], sel)) => true,
            // A Local broadcast axis on `pt`: its loop is not bounded (a broadcast has no
            // elements to guard), so every index of `pt` computes the one element in its own
            // registers (a keepdim row sum parallelized like the row it divides, read by a
            // consumer on `pt` or by one that every index of `pt` runs).
            Some(a)
                if pt_.memory == MemoryType::Local && f.ids[pt_.loop_domain[a]].iter_type == IterType::Broadcast =>
            {
                false
            }
            Some(a) => match ca {
                // Shared and Global memory are addressed by element: an axis merged from a
                // broadcast and an iteration axis stores the broadcast's copies at their
                // own offsets, while a consumer reads the one copy its logical index names,
                // which another thread may have stored.
                Some(b) => {
                    let id = pt_.loop_domain[a];
                    let mixed = pt_.memory != MemoryType::Local
                        && f.ids[id].iter_type != IterType::Broadcast
                        && crate::analysis::loop_graph::depends_on_broadcast(f, id);
                    mixed || !exact.same(lg.promoted(p, a), lg.promoted(c, b))
                }
                None => true,
            },
            // Memory private along `pt` (registers; a block's Shared memory along a block
            // dimension) holds each index's own copy.
            None if is_partitioned_across(pt_.memory, pt) => false,
            // A consumer whose `pt` loop has one iteration, bounded, runs on index 0 of `pt`
            // only, the index that wrote. (A Local broadcast loop is not bounded: every
            // index runs it, see `indexing::predicate`.)
            None if ca.is_some_and(|b| {
                let id = &f.ids[lg.promoted(c, b)];
                f.scalars.is_const(id.extent, 1)
                    && (id.iter_type != IterType::Broadcast || ct.memory == MemoryType::Global)
            }) =>
            {
                false
            }
            // Only index 0 of `pt` runs a Global (or, along a thread dimension, Shared)
            // consumer that does not use `pt`.
            None => is_partitioned_across(ct.memory, pt) || runs_on(f, lg, c, pt),
        };
        if crosses {
            out.push(CrossRead { pt, producer_axis: pa, consumer_axis: ca });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use MemoryType::*;
    use ParallelType::*;

    #[test]
    fn memory_parallel_tables() {
        assert!(is_partitioned_across(Local, TIDx) && is_partitioned_across(Local, BIDy));
        assert!(is_partitioned_across(Shared, BIDx) && !is_partitioned_across(Shared, TIDx));
        assert!(!is_partitioned_across(Global, BIDx));
        assert!(is_shared_across(Shared, TIDz) && !is_shared_across(Shared, BIDx));
        assert!(!is_shared_across(Local, TIDx));
        assert!(is_shared_across(Global, BIDx));
        for m in [Local, Shared, Global] {
            for p in [Serial, Unroll, Unswitch, Vectorize] {
                assert!(!is_partitioned_across(m, p) && !is_shared_across(m, p));
            }
        }
    }
}
