//! Schedule validation before lowering.
//! Consumes: a scheduled fusion (and, for the checks that need them, its id and loop
//! graphs). Produces: nothing. Guarantees: every tensor has at least one output, a
//! vectorized axis is innermost, inline positions are valid, every read stays in the thread
//! or block that wrote the element or crosses through memory a block sync can order, cache
//! hints sit on vectorized tensors, and features this build cannot lower are rejected by
//! name.

use crate::analysis::id_graph::IdGraph;
use crate::analysis::loop_graph::LoopGraph;
use crate::analysis::parallel::{cross_reads, CrossRead};
use crate::bail;
use crate::error::Result;
use crate::ir::{Fusion, IterType, MemoryType, ParallelType, TvId};
use rustc_hash::FxHashSet;

/// A partly inlined tensor may not share loops that iterate a broadcast its consumer
/// concretizes: its private loops would cover only its own (size-one) extent of that
/// space. Fully inlined tensors are indexed through their consumer instead, and so are
/// partly inlined ones whose private axes are their consumers' (`through_consumer`).
pub fn partial_inlining(f: &Fusion, lg: &LoopGraph, exact: &IdGraph) -> Result<()> {
    for (tv, t) in f.tvs.iter() {
        // A Shared or Global buffer is laid out by its loops: one that runs a concretized
        // space would be written at one layout and read at another (or by threads of a
        // loop it does not partition). Only registers are indexed through their consumer.
        if t.memory != MemoryType::Local && f.tvs[tv].definition.is_some() {
            if let Some(a) = concretized_axis_before(f, lg, exact, tv, t.inline_pos) {
                bail!(
                    "{} is in {:?} memory but inlined at position {}, where axis {a} ({}) runs the concretized loop {}: its buffer would be laid out by that loop; keep it in Local memory or inline it at {a}",
                    f.tv_name(tv),
                    t.memory,
                    t.inline_pos,
                    f.id_label(t.loop_domain[a]),
                    f.id_label(lg.promoted(tv, a))
                );
            }
        }
        // A tensor with its own buffer is written at its own loop indices, so it cannot run
        // in loops that a producer inlined into it shares with another consumer that
        // concretizes them: e.g. `b` inlined fully into `b + x` (concretized) and `sin(b)`
        // (keeps the broadcast) puts `sin(b)` in the concretized loops, where its loop
        // indices no longer name its own elements.
        if let Some((a, p)) = loops_concretized_by_producer(f, lg, exact, tv) {
            bail!(
                "{}: its axis {a} ({}) shares the loop {} with {}, which is inlined into it at position {} and into a consumer that concretizes a broadcast there; {} keeps its own buffer and would be written at the wrong elements; inline {} at position {a} at most, or inline {} fully into its consumer",
                f.tv_name(tv),
                f.id_label(t.loop_domain[a]),
                f.id_label(lg.promoted(tv, a)),
                f.tv_name(p),
                f.tvs[p].inline_pos,
                f.tv_name(tv),
                f.tv_name(p),
                f.tv_name(tv)
            );
        }
        if let Some(a) = concretized_shared_axis(f, lg, exact, tv) {
            if !private_axes_mirror_consumer(f, lg, exact, tv) {
                bail!(
                    "{}: inlined at position {} but axis {a} ({}) runs the concretized loop {}; inline it fully (inline_at(-1)) or at {a}",
                    f.tv_name(tv),
                    t.inline_pos,
                    f.id_label(t.loop_domain[a]),
                    f.id_label(lg.promoted(tv, a))
                );
            }
        }
    }
    Ok(())
}

/// The first shared loop axis of a partly inlined `tv` whose loop runs a larger space than
/// its own axis: promoted to a consumer's id that is neither exactly mapped to it nor of the
/// same extent, and not a broadcast (running one of those once per iteration of the
/// concretized loop only repeats it).
fn concretized_shared_axis(f: &Fusion, lg: &LoopGraph, exact: &IdGraph, tv: TvId) -> Option<usize> {
    let t = &f.tvs[tv];
    // (tensors no output depends on are not in the kernel)
    if t.inline_pos >= t.loop_domain.len() {
        return None;
    }
    concretized_axis_before(f, lg, exact, tv, t.inline_pos)
}

/// The first of `tv`'s loop axes before `pos` whose loop runs a larger space than the axis:
/// promoted to a consumer's id that is neither exactly mapped to it nor of the same extent,
/// and not a broadcast.
fn concretized_axis_before(f: &Fusion, lg: &LoopGraph, exact: &IdGraph, tv: TvId, pos: usize) -> Option<usize> {
    let t = &f.tvs[tv];
    if t.uses.is_empty() {
        return None;
    }
    concretized_axis_in(f, lg, exact, tv, pos)
}

/// `concretized_axis_before` for any tensor in the kernel, outputs included.
fn concretized_axis_in(f: &Fusion, lg: &LoopGraph, exact: &IdGraph, tv: TvId, pos: usize) -> Option<usize> {
    let t = &f.tvs[tv];
    if pos == 0 || !lg.has(tv) {
        return None;
    }
    let pos = pos.min(t.loop_domain.len());
    (0..pos).find(|&a| {
        let own = t.loop_domain[a];
        let promoted = lg.promoted(tv, a);
        // Equal extents do not make the same loop when the axis splits merges of different
        // sizes: an outer split by 7 of [M, 1] merged and of [M, N] merged both run 7
        // chunks, of different elements.
        promoted != own
            && f.ids[own].iter_type != IterType::Broadcast
            && !exact.same(own, promoted)
            && (f.ids[own].extent != f.ids[promoted].extent
                || (crate::analysis::loop_graph::depends_on_broadcast(f, own)
                    && f.ids[split_source(f, own)].extent != f.ids[split_source(f, promoted)].extent))
    })
}

/// The first loop axis of `tv`, right of its own inline position, that a producer inlined
/// into it shares and whose loop runs a concretized space (with that producer). Tensors
/// indexed through their consumer (fully inlined, or `through_consumer`) are exempt.
fn loops_concretized_by_producer(f: &Fusion, lg: &LoopGraph, exact: &IdGraph, tv: TvId) -> Option<(usize, TvId)> {
    let t = &f.tvs[tv];
    t.definition?;
    if t.inline_pos >= t.loop_domain.len() || !lg.has(tv) || t.uses.is_empty() && !f.is_output(tv) {
        return None;
    }
    if concretized_shared_axis(f, lg, exact, tv).is_some() {
        // partly inlined through its consumer, or refused by the check after this one
        return None;
    }
    let (p, depth) = f
        .producers(tv)
        .into_iter()
        .filter(|&p| f.tvs[p].definition.is_some() && lg.has(p))
        .map(|p| (p, f.tvs[p].inline_pos.min(t.loop_domain.len())))
        .max_by_key(|&(_, d)| d)?;
    if depth <= t.inline_pos {
        return None;
    }
    let a = concretized_axis_in(f, lg, exact, tv, depth)?;
    (a >= t.inline_pos).then_some((a, p))
}

/// The id that `id` was split from, through any number of splits (itself when it was not
/// made by a split).
fn split_source(f: &Fusion, id: crate::ir::IterDomainId) -> crate::ir::IterDomainId {
    let mut id = id;
    while let Some(t) = f.ids[id].definition {
        match f.transforms[t] {
            crate::ir::Transform::Split { input, .. } => id = input,
            _ => break,
        }
    }
    id
}

/// Partly inlined tensors that are indexed through their consumer, as fully inlined ones
/// are: a shared loop runs a space they have only part of, and their private loops stand
/// in for their consumers' axes at the same positions.
pub fn through_consumer(f: &Fusion, lg: &LoopGraph, exact: &IdGraph) -> FxHashSet<TvId> {
    f.tvs
        .keys()
        .filter(|&tv| {
            concretized_shared_axis(f, lg, exact, tv).is_some() && private_axes_mirror_consumer(f, lg, exact, tv)
        })
        .collect()
}

/// True when every consumer of `tv` in the kernel has `tv`'s private loop axes (those
/// right of its inline position) at the same positions, exactly mapped: `tv` is then indexed
/// through its consumer (`indexing::inlined_reference`), its private loops standing in for
/// the consumer's, so a shared loop may run a space its consumer concretizes.
fn private_axes_mirror_consumer(f: &Fusion, lg: &LoopGraph, exact: &IdGraph, tv: TvId) -> bool {
    let t = &f.tvs[tv];
    let pos = t.inline_pos;
    let consumers: Vec<TvId> = t.uses.iter().map(|&e| f.exprs[e].output).filter(|&c| lg.has(c)).collect();
    !consumers.is_empty()
        && consumers.iter().all(|&c| {
            let cd = &f.tvs[c].loop_domain;
            cd.len() == t.loop_domain.len()
                && f.tvs[c].definition.is_some_and(|e| !f.exprs[e].op.is_gather())
                && (pos..cd.len()).all(|a| exact.same(t.loop_domain[a], cd[a]))
        })
}

/// Every read of a tensor computed in the kernel stays in the thread or block that wrote
/// the element, or crosses threads through memory that a block sync can order: Local
/// memory is private to a thread, Shared memory to a block, and blocks never synchronize.
/// A Shared or Global producer read by other threads needs a `__syncthreads()` between the
/// write and the read, placed in the loops the two share; a thread loop shorter than its
/// dimension would leave threads out of it (a divergent barrier), so that is refused too.
pub fn parallel_reads(f: &Fusion, lg: &LoopGraph, exact: &IdGraph) -> Result<()> {
    for e in f.topo_exprs() {
        let c = f.exprs[e].output;
        for p in f.exprs[e].input_tvs().collect::<Vec<_>>() {
            for x in cross_reads(f, lg, exact, p, e) {
                let t = &f.tvs[p];
                let mem = t.memory;
                let across = if x.pt.is_block() { "block" } else { "thread" };
                let how = describe(f, lg, p, c, x);
                let syncable = mem != MemoryType::Local && x.pt.is_thread();
                if !syncable {
                    let fix = match (mem, x.pt.is_block()) {
                        (MemoryType::Local, false) => "; place it in Shared memory, or ",
                        _ => "; ",
                    };
                    bail!(
                        "{how}: its consumer {} would read it from another {across}, which {} memory cannot share{fix}parallelize both on exactly mapped axes, or inline {} past that axis",
                        f.tv_name(c),
                        mem.enum_name(),
                        f.tv_name(p)
                    );
                }
                // The loops the write and the read share: those `p` is inlined in, and those an
                // untouched tensor inlined into both makes one loop.
                let consumer_groups: Vec<usize> = (0..f.tvs[c].loop_domain.len()).map(|b| lg.group(c, b)).collect();
                for a in 0..t.loop_domain.len() {
                    if a >= t.inline_pos && !consumer_groups.contains(&lg.group(p, a)) {
                        continue;
                    }
                    let q = lg.groups[lg.group(p, a)].parallel;
                    if q.is_thread() && thread_extents(f, lg, q) > 1 {
                        bail!(
                            "{how}: its consumer {} reads it from other threads, which needs a block sync inside the {} loop of axis {a} ({}) that {} shares with it, but {} loops of different extents leave some threads out of that loop; inline {} before axis {a}, or give every {} loop one extent",
                            f.tv_name(c),
                            q.enum_name(),
                            f.id_label(t.loop_domain[a]),
                            f.tv_name(p),
                            q.enum_name(),
                            f.tv_name(p),
                            q.enum_name()
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

/// A tensor runs each thread or block dimension in at most one of its loops. An inlined
/// axis takes the parallel type of the loop it shares, so a producer parallelized on TIDx
/// inlined into a consumer's serial loop puts the consumer on TIDx there; a second TIDx
/// axis of its own would then nest two loops over one `threadIdx.x`.
pub fn unique_parallel_dims(f: &Fusion, lg: &LoopGraph) -> Result<()> {
    for e in f.topo_exprs() {
        let tv = f.exprs[e].output;
        let t = &f.tvs[tv];
        for b in 0..t.loop_domain.len() {
            let q = lg.groups[lg.group(tv, b)].parallel;
            if !q.is_thread_or_block() {
                continue;
            }
            if let Some(a) = (0..b).find(|&a| lg.groups[lg.group(tv, a)].parallel == q) {
                let why = |x: usize| {
                    if f.ids[t.loop_domain[x]].parallel == q {
                        String::new()
                    } else {
                        let (o, oa) = lg.groups[lg.group(tv, x)]
                            .members
                            .iter()
                            .copied()
                            .find(|&(m, ma)| f.ids[f.tvs[m].loop_domain[ma]].parallel == q)
                            .unwrap_or((tv, x));
                        format!(" (the loop it shares with {} axis {oa})", f.tv_name(o))
                    }
                };
                bail!(
                    "{}: axes {a} ({}){} and {b} ({}){} both run on {}; a tensor can use each thread or block dimension once: parallelize one of them differently, or change the inline positions",
                    f.tv_name(tv),
                    f.id_label(t.loop_domain[a]),
                    why(a),
                    f.id_label(t.loop_domain[b]),
                    why(b),
                    q.enum_name()
                );
            }
        }
    }
    Ok(())
}

/// A reduction's consumer may not share a serial loop over one of its reduced axes: inside
/// it the reduction has not completed (a producer inlined into both the reduction and an
/// elementwise consumer of the same input makes their loops one; a broadcast of the result
/// inlined into that consumer would then read partial sums). Thread and block loops are
/// fine: a block reduction is complete when its statement ends.
pub fn reduction_consumers(f: &Fusion, lg: &LoopGraph, order: &[crate::ir::ExprId]) -> Result<()> {
    // Ops on a grid reduction's result run only in the threads that hold it: a reduction
    // there would combine values the other threads do not have.
    for (t, waits) in crate::analysis::parallel::grid_waits(f, lg, order) {
        // Each grid reduction finishes in whichever block arrives last: two over different
        // dimensions need not finish in the same one, so no thread may hold both results.
        if waits.len() > 1 {
            bail!(
                "{} combines the results of the grid reductions {} and {}, which reduce over different dimensions and may finish in different blocks; give it a kernel of its own",
                f.tv_name(t),
                f.tv_name(waits[0]),
                f.tv_name(waits[1])
            );
        }
        // Only one thread of the block that finishes a grid reduction holds its result
        // (index 0 of each thread dimension the reduction combined or does not run on): a
        // tensor computed from it (through copies too) that runs over one of those block or
        // thread dimensions would leave every other block's or thread's part unwritten.
        for &g in &waits {
            let dims = crate::analysis::parallel::grid_reduced_dims(f, lg, g);
            let spread = |a: usize| {
                let group = &lg.groups[lg.group(t, a)];
                dims.contains(&group.parallel)
                    && (f.is_grid_dim(group.parallel) || !f.scalars.is_const(f.ids[group.promoted].extent, 1))
            };
            if let Some(a) = (0..f.tvs[t].loop_domain.len()).find(|&a| spread(a)) {
                let pt = lg.groups[lg.group(t, a)].parallel;
                let holder = if f.is_grid_dim(pt) {
                    "only the block that finishes it"
                } else {
                    "only one thread of the block that finishes it"
                };
                bail!(
                    "{} is computed from the grid reduction {} but runs {} over its axis {a} ({}), which that reduction combined: {holder} holds the result; give {} a kernel of its own",
                    f.tv_name(t),
                    f.tv_name(g),
                    pt.enum_name(),
                    f.id_label(f.tvs[t].loop_domain[a]),
                    f.tv_name(t)
                );
            }
        }
        let Some(d) = f.tvs[t].definition else { continue };
        if matches!(f.exprs[d].op, crate::ir::Op::Reduction { .. }) {
            bail!(
                "{} reduces values computed from the grid reduction {} in the same kernel, where only one block holds that result; give it a kernel of its own",
                f.tv_name(t),
                f.tv_name(waits[0])
            );
        }
    }
    for e in f.topo_exprs() {
        let c = f.exprs[e].output;
        for r in f.exprs[e].input_tvs().collect::<Vec<_>>() {
            if f.is_input(r) {
                continue;
            }
            let t = &f.tvs[r];
            for (a, &id) in t.loop_domain.iter().enumerate() {
                let g = lg.group(r, a);
                if f.ids[id].iter_type != IterType::Reduction || lg.groups[g].parallel.is_thread_or_block() {
                    continue;
                }
                if let Some(b) = (0..f.tvs[c].loop_domain.len()).find(|&b| lg.group(c, b) == g) {
                    bail!(
                        "{} reads the reduction {} inside the loop of its reduced axis {a} ({}): its axis {b} ({}) shares that loop, where the reduction has not completed; inline {} and the tensors sharing that loop at a position before it",
                        f.tv_name(c),
                        f.tv_name(r),
                        f.id_label(id),
                        f.id_label(f.tvs[c].loop_domain[b]),
                        f.tv_name(c)
                    );
                }
            }
        }
    }
    Ok(())
}

/// Distinct extents of the loops on thread dimension `q`.
fn thread_extents(f: &Fusion, lg: &LoopGraph, q: ParallelType) -> usize {
    let mut v: Vec<crate::ir::ValId> = Vec::new();
    for g in lg.groups.iter().filter(|g| g.parallel == q) {
        let e = f.ids[g.promoted].extent;
        if !v.contains(&e) {
            v.push(e);
        }
    }
    v.len()
}

/// How producer `p` is written along `x.pt` and how its consumer `c` runs it, as text.
fn describe(f: &Fusion, lg: &LoopGraph, p: TvId, c: TvId, x: CrossRead) -> String {
    let t = &f.tvs[p];
    let (pn, cn, mem, pt) = (f.tv_name(p), f.tv_name(c), t.memory.enum_name(), x.pt.enum_name());
    let consumer = match x.consumer_axis {
        Some(b) => format!("{cn} runs {pt} over its axis {b} ({})", f.id_label(lg.promoted(c, b))),
        None => format!("{cn} runs that space without {pt}"),
    };
    match x.producer_axis {
        Some(a) => format!(
            "{pn} is in {mem} memory but its axis {a} ({}) is parallelized on {pt} outside its inline position {} and {consumer}, not on an exactly mapped axis",
            f.id_label(t.loop_domain[a]),
            t.inline_pos
        ),
        None => format!(
            "{pn} is in {mem} memory and none of its axes partitions it on {pt}, so index 0 of {pt} writes it, but {consumer}"
        ),
    }
}

/// Check `f` can be lowered.
pub fn run(f: &Fusion) -> Result<()> {
    if f.outputs.is_empty() {
        bail!("the fusion has no outputs; call fd.add_output(t)");
    }
    for e in f.topo_exprs() {
        let tv = f.exprs[e].output;
        let t = &f.tvs[tv];
        let name = f.tv_name(tv);
        let n = t.loop_domain.len();
        for (a, &id) in t.loop_domain.iter().enumerate() {
            if f.ids[id].parallel == ParallelType::Vectorize && a + 1 != n {
                bail!("{name}: axis {a} is vectorized but is not the innermost axis ({})", n - 1);
            }
        }
        if t.inline_pos > 0 {
            f.check_inline(tv, t.inline_pos)?;
        }
        // The cache hints are properties of vector loads (`kiln::loadVec*`): on a tensor
        // without a vectorized axis they would change nothing, silently.
        let vectorized = t.loop_domain.iter().any(|&id| f.ids[id].parallel == ParallelType::Vectorize);
        for (set, what) in [(t.streaming_load, "set_streaming_load"), (t.evict_last_load, "set_evict_last")] {
            if set && !vectorized {
                bail!("{name}: {what} applies to vectorized loads, but no axis of {name} is vectorized; parallelize its innermost axis with Vectorize or leave the hint out");
            }
        }
    }
    Ok(())
}
