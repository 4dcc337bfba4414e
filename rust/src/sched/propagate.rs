//! Schedule propagation for manual schedules. A computed tensor the user never touched
//! (Local, not inlined, its loop domain still its logical domain, nothing parallelized)
//! whose consumer runs on threads or blocks takes that consumer's transforms and thread
//! and block parallelization and is inlined into it as deep as valid, as nvFuser's
//! `TransformPropagator` followed by `inlineMost` would do. Left alone, every thread would
//! compute the whole tensor in registers (a symbolic-size Local array that codegen cannot
//! emit, and redundant work the interpreter runs thread by thread). Consumers are done
//! first, so a chain of untouched producers follows a scheduled output. A tensor keeps its
//! own (untouched) schedule where the propagated one would leave a parallel axis outside
//! its inline position that some consumer does not run on the same dimension, since other
//! threads would then read it. A tensor that a reduction and other readers both read stops
//! before the reduction's first serial reduced loop (`before_serial_reduction`): softmax's
//! `exp(x)` with only the output on blocks. Where that would leave a Local buffer of a
//! runtime size (or of more than 128 bytes per thread, which spills), an element-wise tensor
//! is computed again by each reader instead. A tensor
//! whose `inline_at(-1)` was asked while a consumer was untouched gets its deepest position
//! here, once that consumer has its schedule.

use rustc_hash::FxHashMap;

use crate::ir::mapping::{logical_pairs, producer_to_consumer};
use crate::ir::{ExprId, Fusion, IterDomainId, IterType, MemoryType, ParallelType, Transform, TvId};

/// True when `tv` looks the way a definition leaves a computed tensor (lowering gives it its
/// consumer's schedule).
pub fn untouched(f: &Fusion, tv: TvId) -> bool {
    let t = &f.tvs[tv];
    t.definition.is_some()
        && !f.is_input(tv)
        && !f.is_output(tv)
        && t.memory == MemoryType::Local
        && t.inline_pos == 0
        && !t.inline_pinned
        && t.allocation.is_none()
        && t.circular_buffer.is_none()
        && t.loop_domain == t.logical
        && t.loop_domain.iter().all(|&id| f.ids[id].parallel == ParallelType::Serial)
}

/// The first use of `tv` whose output runs on a thread or block dimension.
fn reference(f: &Fusion, tv: TvId) -> Option<(ExprId, usize, TvId)> {
    f.tvs[tv].uses.iter().find_map(|&e| {
        let c = f.exprs[e].output;
        let parallel = f.tvs[c].loop_domain.iter().any(|&id| f.ids[id].parallel.is_thread_or_block());
        let pos = f.exprs[e].inputs.iter().position(|o| o.tensor() == Some(tv))?;
        parallel.then_some((e, pos, c))
    })
}

/// Replay `c`'s transforms onto `tv` through the ids expr `e` aligns; false when a
/// primitive refused (the caller restores the fusion).
fn replay_from_consumer(f: &mut Fusion, tv: TvId, e: ExprId, pos: usize, c: TvId) -> bool {
    // consumer id -> producer id
    let mut map: FxHashMap<IterDomainId, IterDomainId> =
        logical_pairs(f, e, pos).into_iter().map(|(p, cid)| (cid, p)).collect();
    let fresh_broadcast = |f: &Fusion, map: &FxHashMap<IterDomainId, IterDomainId>, id: IterDomainId| {
        f.ids[id].iter_type == IterType::Broadcast && f.ids[id].definition.is_none() && !map.contains_key(&id)
    };
    for t in f.transforms_of(c) {
        match f.transforms[t].clone() {
            Transform::Split { input, factor, inner_split, outer, inner } => {
                let (Some(&d), Some(factor)) = (map.get(&input), f.scalars.as_int(factor)) else { continue };
                let Some(a) = f.loop_position(tv, d) else { continue };
                if f.split(tv, a as i64, factor, inner_split).is_err() {
                    return false;
                }
                let ld = &f.tvs[tv].loop_domain;
                let (no, ni) = (ld[a], ld[a + 1]);
                map.insert(outer, no);
                map.insert(inner, ni);
            }
            Transform::Merge { outer, inner, out } => match (map.get(&outer).copied(), map.get(&inner).copied()) {
                (Some(o), Some(i)) => {
                    let (Some(a), Some(b)) = (f.loop_position(tv, o), f.loop_position(tv, i)) else { continue };
                    let before = f.tvs[tv].loop_domain.clone();
                    if f.merge(tv, a as i64, b as i64).is_err() {
                        return false;
                    }
                    if let Some(&n) = f.tvs[tv].loop_domain.iter().find(|x| !before.contains(x)) {
                        map.insert(out, n);
                    }
                }
                // A merge with a broadcast the producer does not have iterates the
                // producer's id (broadcast forwarding, as `producer_to_consumer` maps it).
                (Some(o), None) if fresh_broadcast(f, &map, inner) => {
                    map.insert(out, o);
                }
                (None, Some(i)) if fresh_broadcast(f, &map, outer) => {
                    map.insert(out, i);
                }
                _ => {}
            },
        }
    }
    // The consumer's loop order first, then the producer's own leftover axes.
    let mut order: Vec<IterDomainId> = Vec::new();
    for &cid in &f.tvs[c].loop_domain {
        if let Some(&d) = map.get(&cid) {
            if f.loop_position(tv, d).is_some() && !order.contains(&d) {
                order.push(d);
                let p = f.ids[cid].parallel;
                if p.is_thread_or_block() || p == ParallelType::Unroll {
                    f.ids[d].parallel = p;
                }
            }
        }
    }
    for &d in &f.tvs[tv].loop_domain.clone() {
        if !order.contains(&d) {
            order.push(d);
        }
    }
    f.tvs[tv].loop_domain = order;
    true
}

/// Propagate consumers' schedules to the untouched tensors of the manually scheduled `f`.
pub fn untouched_producers(f: &mut Fusion) {
    if !f.manually_scheduled {
        return;
    }
    for e in f.topo_exprs().into_iter().rev() {
        let tv = f.exprs[e].output;
        if f.tvs[tv].inline_deepest && !untouched(f, tv) {
            // Its consumers have their schedules now (they come first in this order).
            f.tvs[tv].inline_pos = f.max_inline_pos(tv);
            continue;
        }
        if !untouched(f, tv) {
            continue;
        }
        match propagate(f, tv) {
            Placed::Buffered if recomputable(f, tv) => {
                // Stopped before a serial reduced loop, `tv` would be a Local buffer of the
                // whole symbolic row (var_mean's double cast of x with only the outputs
                // scheduled), which no register array holds. An element-wise value is cheap
                // to compute again: each reader gets its own copy, inlined into it fully.
                let mut copies = vec![tv];
                for u in f.tvs[tv].uses.clone().into_iter().skip(1) {
                    let Ok(c) = crate::sched::auto::canonical::recompute(f, tv) else { break };
                    f.redirect_use(u, tv, c);
                    copies.push(c);
                }
                for t in copies {
                    propagate(f, t);
                }
            }
            _ => {}
        }
    }
}

/// What [`propagate`] did with an untouched tensor.
enum Placed {
    /// Took its consumer's schedule and an inline position.
    Inlined,
    /// Left as it was: no consumer on threads or blocks, a refused replay, or a position
    /// that would leave a parallel axis outside.
    Kept,
    /// Left as it was: stopped before a reduction's serial loop, it would need a Local
    /// buffer of a size only known at run time (or of more than 128 bytes).
    Buffered,
}

/// Give untouched `tv` its first parallel consumer's schedule and inline it as deep as valid.
fn propagate(f: &mut Fusion, tv: TvId) -> Placed {
    let Some((use_, pos, c)) = reference(f, tv) else { return Placed::Kept };
    let saved = f.clone();
    // A producer already inlined into `tv` (a copy inlined at the position the propagated
    // schedule will match) would pin `tv`'s axes: its position waits for the replay, and
    // lowering checks it against the result.
    let producers = f.producers(tv);
    let held: Vec<(TvId, usize)> = producers.iter().map(|&p| (p, f.tvs[p].inline_pos)).collect();
    for &p in &producers {
        f.tvs[p].inline_pos = 0;
    }
    let replayed = replay_from_consumer(f, tv, use_, pos, c);
    for &(p, pos) in &held {
        f.tvs[p].inline_pos = pos;
    }
    if !replayed {
        *f = saved;
        return Placed::Kept;
    }
    let deepest = f.deepest_inline_within(tv, usize::MAX);
    let p = f.max_inline_pos(tv);
    f.tvs[tv].inline_pos = p;
    let t = &f.tvs[tv];
    let outside =
        t.loop_domain.iter().skip(p).any(|&id| f.ids[id].parallel.is_thread_or_block()) && !own_threads(f, tv, p);
    // The sizes of the axes a Local buffer of `tv` would hold per thread (None: runtime).
    let held: Vec<Option<i64>> = t
        .loop_domain
        .iter()
        .skip(p)
        .filter(|&&id| !f.ids[id].parallel.is_thread_or_block() && f.ids[id].iter_type != IterType::Broadcast)
        .map(|&id| f.scalars.as_int(f.ids[id].extent))
        .collect();
    let symbolic = held.iter().any(Option::is_none);
    // A constant buffer of more than 128 bytes per thread (var_mean's double cast of a
    // 128-wide row: 256 registers) spills; an element-wise value is computed again instead.
    let elements = held.iter().flatten().fold(1i64, |a, &n| a.saturating_mul(n));
    let large = elements.saturating_mul(t.dtype.size_bytes() as i64) > 128 && recomputable(f, tv);
    if p < deepest && (symbolic || large) && !outside {
        *f = saved;
        return Placed::Buffered;
    }
    if p == 0 || outside {
        *f = saved;
        return Placed::Kept;
    }
    Placed::Inlined
}

/// True when every thread or block axis of `tv` past position `p` is an iteration axis that
/// each consumer runs on the same dimension: every element is then read by the thread that
/// wrote it, which Local memory allows (layernorm's `x - mean`, kept across the variance's
/// serial loop, on the threads of its readers).
fn own_threads(f: &Fusion, tv: TvId, p: usize) -> bool {
    let parallel: Vec<IterDomainId> =
        f.tvs[tv].loop_domain.iter().skip(p).copied().filter(|&id| f.ids[id].parallel.is_thread_or_block()).collect();
    let plain = |id: IterDomainId| {
        f.ids[id].iter_type == IterType::Iteration && !crate::analysis::loop_graph::depends_on_broadcast(f, id)
    };
    parallel.iter().all(|&id| plain(id))
        && f.tvs[tv].uses.iter().all(|&e| {
            f.exprs[e].inputs.iter().enumerate().filter(|(_, o)| o.tensor() == Some(tv)).all(|(i, _)| {
                let map = producer_to_consumer(f, e, i);
                parallel.iter().all(|id| map.get(id).is_some_and(|&c| f.ids[c].parallel == f.ids[*id].parallel))
            })
        })
}

/// True when `tv` is an element-wise value of several readers, cheap to compute once per reader.
fn recomputable(f: &Fusion, tv: TvId) -> bool {
    f.tvs[tv].uses.len() > 1 && f.tvs[tv].definition.is_some_and(|d| f.exprs[d].op.is_elementwise())
}

/// Where `tv` is reduced by one reader (directly or through element-wise ops) and read by
/// others that also read the reduction's result (softmax's `exp(x)`, read by its sum and by
/// the difference after it), the position of the reduction's first serial reduced loop:
/// inlined past it, `tv`'s loop there would be the reduction's and its other readers',
/// which read the reduction's result before the loop completes it. (Reduced axes on threads
/// or blocks complete in a block or grid reduction first; two reductions of `tv` and
/// nothing reading their results share the loop.) Otherwise no limit.
pub(crate) fn before_serial_reduction(f: &Fusion, tv: TvId) -> usize {
    let uses = &f.tvs[tv].uses;
    if uses.len() < 2 {
        return usize::MAX;
    }
    // The exprs reached through element-wise ops (layernorm's `sum(xm * xm)` of the
    // centered `xm`, which the output reads too), and the reductions among them.
    let mut reached = Vec::new();
    let mut reductions = Vec::new();
    let mut stack: Vec<ExprId> = uses.clone();
    let mut seen = rustc_hash::FxHashSet::default();
    while let Some(u) = stack.pop() {
        if !seen.insert(u) {
            continue;
        }
        match &f.exprs[u].op {
            crate::ir::Op::Reduction { .. } => reductions.push(u),
            op if op.is_elementwise() => {
                reached.push(u);
                stack.extend(f.tvs[f.exprs[u].output].uses.iter().copied());
            }
            _ => reached.push(u),
        }
    }
    let mut cap = usize::MAX;
    for u in reductions {
        let r = f.exprs[u].output;
        // Everything computed from the reduction's result.
        let mut after: rustc_hash::FxHashSet<TvId> = rustc_hash::FxHashSet::default();
        let mut todo = vec![r];
        while let Some(t) = todo.pop() {
            if after.insert(t) {
                todo.extend(f.tvs[t].uses.iter().map(|&e| f.exprs[e].output));
            }
        }
        if !reached.iter().any(|&e| f.exprs[e].input_tvs().any(|t| after.contains(&t))) {
            continue;
        }
        let serial_reduced = f.tvs[r]
            .loop_domain
            .iter()
            .position(|&id| f.ids[id].iter_type == IterType::Reduction && !f.ids[id].parallel.is_thread_or_block());
        if let Some(a) = serial_reduced {
            cap = cap.min(a);
        }
    }
    cap
}

/// `f` as lowering sees it: a copy with [`untouched_producers`] applied.
pub fn completed(f: &Fusion) -> Fusion {
    let mut g = f.clone();
    untouched_producers(&mut g);
    g
}
