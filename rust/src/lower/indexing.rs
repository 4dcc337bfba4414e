//! Indexing and predicates.
//! Consumes: the loop nest with allocations and the AllocationInfo table. Produces: for
//! every expr and init, the element offset of each tensor access (through the
//! transforms to the allocation ids, times their strides), the index-tensor reads of
//! gathers, and a predicate. Guarantees: an access whose predicate holds is inside its
//! allocation; out-of-range elements of non-divisible splits and idle threads are
//! predicated off.

use std::cell::RefCell;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::analysis::loop_graph::LoopGraph;
use crate::bail_internal;
use crate::error::Result;
use crate::ir::mapping::logical_pairs;
use crate::ir::scalar::{ScalarOp, Val};
use crate::ir::{
    ExprId, Fusion, IterDomainId, IterType, MemoryType, Op, Operand, ParallelType, Symbol, Transform, TvId, ValId,
};
use crate::kernel::{AccessIndex, AllocationInfo, Gather, Node};

/// An enclosing loop as indexing sees it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Enclosing {
    group: Option<usize>,
    /// The loop runs a broadcast axis (its own, whatever its group promotes to).
    broadcast: bool,
    init_axis: Option<usize>,
    index: ValId,
    extent: ValId,
    parallel: ParallelType,
}

/// A `consumer_indices` question: the tensor, whether loops may be missing, the loops.
type IndicesKey = (TvId, bool, Vec<Enclosing>);

struct Ctx<'a> {
    lg: &'a LoopGraph,
    allocs: &'a FxHashMap<TvId, AllocationInfo>,
    /// Parallel types whose loops need `index < extent` (`ParallelExtents::ragged`).
    ragged: Vec<ParallelType>,
    /// Thread/block parallel types the kernel launches with.
    used: Vec<ParallelType>,
    next_gather: u32,
    /// Per tensor, the grid reductions it is computed from (`analysis::parallel::grid_waits`),
    /// and the dimensions each of those combines.
    waits: FxHashMap<TvId, Vec<TvId>>,
    grid_dims: FxHashMap<TvId, Vec<ParallelType>>,
    /// Partly inlined tensors indexed through their consumer (`validate::through_consumer`).
    partial: FxHashSet<TvId>,
    /// `consumer_indices` per (tensor, partial, enclosing loops). A chain of n inlined
    /// element-wise ops indexes each tensor through every consumer after it: without the
    /// memo that was n^2 index computations per chain, each walking the chain again
    /// (`broadcast_concretized`), and a 2000-op chain took minutes to lower.
    indices: RefCell<FxHashMap<IndicesKey, FxHashMap<IterDomainId, ValId>>>,
    /// `broadcast_concretized` per tensor.
    concretized: RefCell<FxHashMap<TvId, bool>>,
    /// `reference_bounds` per (chain end, enclosing loops).
    bounds: RefCell<FxHashMap<(TvId, Vec<Enclosing>), ValId>>,
    /// `chain_end` per tensor.
    chain_ends: RefCell<FxHashMap<TvId, Option<TvId>>>,
}

/// Fill `AccessIndex` into every Expr and Init node of `body`.
pub fn run(
    f: &mut Fusion,
    lg: &LoopGraph,
    exact: &crate::analysis::id_graph::IdGraph,
    allocs: &FxHashMap<TvId, AllocationInfo>,
    order: &[crate::ir::ExprId],
    body: &mut [Node],
) -> Result<()> {
    let extents = crate::lower::launch::ParallelExtents::of(f, body);
    let used = extents.0.keys().copied().collect();
    let ragged = extents.0.keys().copied().filter(|&p| extents.ragged(f, p)).collect();
    let waits = crate::analysis::parallel::grid_waits(f, lg, order);
    let grid_dims =
        waits.values().flatten().map(|&t| (t, crate::analysis::parallel::grid_reduced_dims(f, lg, t))).collect();
    let partial = crate::lower::validate::through_consumer(f, lg, exact);
    let mut ctx = Ctx {
        lg,
        allocs,
        ragged,
        used,
        next_gather: 0,
        waits,
        grid_dims,
        partial,
        indices: RefCell::default(),
        concretized: RefCell::default(),
        bounds: RefCell::default(),
        chain_ends: RefCell::default(),
    };
    let mut stack = Vec::new();
    walk(f, &mut ctx, body, &mut stack)
}

fn walk(f: &mut Fusion, ctx: &mut Ctx, body: &mut [Node], stack: &mut Vec<Enclosing>) -> Result<()> {
    for n in body.iter_mut() {
        match n {
            Node::Loop(l) => {
                stack.push(Enclosing {
                    group: l.group,
                    broadcast: f.ids[l.id].iter_type == IterType::Broadcast,
                    init_axis: l.init_axis,
                    index: l.index,
                    extent: l.extent,
                    parallel: l.parallel,
                });
                walk(f, ctx, &mut l.body, stack)?;
                stack.pop();
            }
            Node::Expr { expr, index } => *index = Some(index_expr(f, ctx, *expr, stack)?),
            Node::Init { tv, index, .. } => *index = Some(index_init(f, ctx, *tv, stack)?),
            _ => {}
        }
    }
    Ok(())
}

/// Index of each promoted loop id of the enclosing loops.
fn group_indices(ctx: &Ctx, stack: &[Enclosing]) -> FxHashMap<IterDomainId, ValId> {
    let mut m = FxHashMap::default();
    for l in stack {
        if let Some(g) = l.group {
            m.insert(ctx.lg.groups[g].promoted, l.index);
        }
    }
    m
}

/// Indices of all of `tv`'s ids from its loop-id indices, walking transforms backward.
fn backward(f: &mut Fusion, tv: TvId, idx: &mut FxHashMap<IterDomainId, ValId>) {
    for t in f.transforms_of(tv).into_iter().rev() {
        match f.transforms[t] {
            Transform::Split { input, outer, inner, .. } => {
                if let (Some(&o), Some(&i)) = (idx.get(&outer), idx.get(&inner)) {
                    let ie = f.ids[inner].extent;
                    let m = f.scalars.mul(o, ie);
                    let v = f.scalars.add(m, i);
                    idx.insert(input, v);
                }
            }
            Transform::Merge { outer, inner, out } => {
                if let Some(&o) = idx.get(&out) {
                    let ie = f.ids[inner].extent;
                    let a = f.scalars.div(o, ie);
                    let b = f.scalars.rem(o, ie);
                    idx.insert(outer, a);
                    idx.insert(inner, b);
                }
            }
        }
    }
}

/// Indices of `tv`'s derived ids from its logical-id indices, walking transforms forward.
fn forward(f: &mut Fusion, tv: TvId, idx: &mut FxHashMap<IterDomainId, ValId>) {
    for t in f.transforms_of(tv) {
        match f.transforms[t] {
            Transform::Split { input, outer, inner, .. } => {
                if let Some(&v) = idx.get(&input) {
                    let ie = f.ids[inner].extent;
                    let a = f.scalars.div(v, ie);
                    let b = f.scalars.rem(v, ie);
                    idx.entry(outer).or_insert(a);
                    idx.entry(inner).or_insert(b);
                }
            }
            Transform::Merge { outer, inner, out } => {
                if let (Some(&o), Some(&i)) = (idx.get(&outer), idx.get(&inner)) {
                    let ie = f.ids[inner].extent;
                    let m = f.scalars.mul(o, ie);
                    let v = f.scalars.add(m, i);
                    idx.entry(out).or_insert(v);
                }
            }
        }
    }
}

/// Linear offset of `tv` given indices of its ids (or of promoted ids of enclosing loops).
fn offset(
    f: &mut Fusion,
    ctx: &Ctx,
    tv: TvId,
    idx: &FxHashMap<IterDomainId, ValId>,
    groups: &FxHashMap<IterDomainId, ValId>,
) -> Result<ValId> {
    offset_via(f, ctx, tv, idx, groups, None)
}

/// [`offset`] of operand `pos` of `e`, read at its consumer's indices `cidx`: axes the
/// consumer merges are also joined where they lie contiguously (see [`contiguous_merges`]).
fn offset_via(
    f: &mut Fusion,
    ctx: &Ctx,
    tv: TvId,
    idx: &FxHashMap<IterDomainId, ValId>,
    groups: &FxHashMap<IterDomainId, ValId>,
    via: Option<(ExprId, usize, &FxHashMap<IterDomainId, ValId>)>,
) -> Result<ValId> {
    let Some(info) = ctx.allocs.get(&tv) else {
        bail_internal!("{} has no allocation info", f.tv_name(tv));
    };
    let mut entries: Vec<Entry> = Vec::with_capacity(info.ids.len());
    for ((&id, &own), &stride) in info.ids.iter().zip(&info.own_ids).zip(&info.strides) {
        let Some(&i) = idx.get(&own).or_else(|| idx.get(&id)).or_else(|| groups.get(&id)) else {
            bail_internal!("no index for allocation id {} of {}", f.id_label(id), f.tv_name(tv));
        };
        entries.push(Entry { id: own, extent: f.ids[own].extent, index: i, stride });
    }
    let own = merges_of(f, tv);
    contiguous_merges(f, &mut entries, &own, idx);
    if let Some((e, pos, cidx)) = via {
        // The operand's axes as the consumer's: where the operand is read at the consumer's
        // index of an axis (not a gathered, remapped or broadcast position).
        let pairs: FxHashMap<IterDomainId, IterDomainId> = logical_pairs(f, e, pos).into_iter().collect();
        for en in entries.iter_mut() {
            if let Some(&cid) = pairs.get(&en.id) {
                if cidx.get(&cid) == Some(&en.index) {
                    en.id = cid;
                }
            }
        }
        let theirs = merges_of(f, f.exprs[e].output);
        contiguous_merges(f, &mut entries, &theirs, cidx);
    }
    let mut acc = f.scalars.int(0);
    for en in entries {
        let term = f.scalars.mul(en.index, en.stride);
        acc = f.scalars.add(acc, term);
    }
    Ok(acc)
}

/// One term of an offset: the id it indexes, its extent, its index and stride.
struct Entry {
    id: IterDomainId,
    extent: ValId,
    index: ValId,
    stride: ValId,
}

/// The merges among `tv`'s transforms, as (outer, inner, out).
fn merges_of(f: &Fusion, tv: TvId) -> Vec<(IterDomainId, IterDomainId, IterDomainId)> {
    f.transforms_of(tv)
        .into_iter()
        .filter_map(|t| match f.transforms[t] {
            Transform::Merge { outer, inner, out } => Some((outer, inner, out)),
            Transform::Split { .. } => None,
        })
        .collect()
}

/// Join adjacent terms of an offset whose ids one of `merges` joins, where they lie
/// contiguously in memory (the outer stride is the inner extent times the inner stride),
/// into one term: the merged index (from `idx`) times the inner stride.
/// `(m / n) * (n * s) + (m % n) * s` is `m * s` for every `m`, and the single term keeps a
/// row merged from several contiguous axes (GroupNorm's `[C/G, H, W]`) affine in the loop
/// indices, so it can be vectorized or copied in bulk.
fn contiguous_merges(
    f: &mut Fusion,
    entries: &mut Vec<Entry>,
    merges: &[(IterDomainId, IterDomainId, IterDomainId)],
    idx: &FxHashMap<IterDomainId, ValId>,
) {
    'again: loop {
        for k in 0..entries.len().saturating_sub(1) {
            let (a, b) = (entries[k].id, entries[k + 1].id);
            let Some(&(_, _, out)) = merges.iter().find(|&&(o, i, _)| o == a && i == b) else { continue };
            let Some(&m) = idx.get(&out) else { continue };
            let joined = f.scalars.mul(entries[k + 1].stride, entries[k + 1].extent);
            if !same_product(&f.scalars, joined, entries[k].stride) {
                continue;
            }
            let stride = entries[k + 1].stride;
            let extent = f.ids[out].extent;
            entries.splice(k..k + 2, [Entry { id: out, extent, index: m, stride }]);
            continue 'again;
        }
        return;
    }
}

/// True when `a` and `b` are provably the same product: equal constants, or the same
/// factors in any order (a stride built as `W * H` against a merged extent `H * W`).
fn same_product(sc: &crate::ir::Scalars, a: ValId, b: ValId) -> bool {
    fn factors(sc: &crate::ir::Scalars, v: ValId, out: &mut Vec<ValId>, constant: &mut i64) -> bool {
        match sc.get(v) {
            Val::Binary(ScalarOp::Mul, x, y) => factors(sc, x, out, constant) && factors(sc, y, out, constant),
            Val::Int(c) => match constant.checked_mul(c) {
                Some(p) => {
                    *constant = p;
                    true
                }
                None => false,
            },
            _ => {
                out.push(v);
                true
            }
        }
    }
    if a == b {
        return true;
    }
    let (mut fa, mut fb, mut ca, mut cb) = (Vec::new(), Vec::new(), 1i64, 1i64);
    if !factors(sc, a, &mut fa, &mut ca) || !factors(sc, b, &mut fb, &mut cb) {
        return false;
    }
    fa.sort_unstable();
    fb.sort_unstable();
    ca == cb && fa == fb
}

/// True when splitting `input` by `factor` leaves no partial last part (both constants).
fn divisible(f: &Fusion, input: IterDomainId, factor: ValId) -> bool {
    matches!((f.scalars.as_int(f.ids[input].extent), f.scalars.as_int(factor)), (Some(e), Some(k)) if k > 0 && e % k == 0)
}

/// True when the split chain below logical id `l` may produce indices past its extent.
fn needs_bound(f: &Fusion, l: IterDomainId) -> bool {
    let mut stack = vec![l];
    while let Some(id) = stack.pop() {
        let Some(t) = f.ids[id].use_ else { continue };
        match f.transforms[t] {
            Transform::Split { input, factor, outer, inner, .. } => {
                if !divisible(f, input, factor) {
                    return true;
                }
                stack.push(outer);
                stack.push(inner);
            }
            Transform::Merge { out, .. } => stack.push(out),
        }
    }
    false
}

/// True when the bounds `split_bounds` puts on the inputs of non-divisible splits below
/// `id` already keep `id`'s index below its extent, so its own bound would be redundant: a
/// divisible split's input is in range when both parts are, a merge's inner part is a
/// remainder (always in range) and its outer part is in range when the merge's output is,
/// and a loop id is in range by its loop. (A row split evenly over a cluster and unevenly
/// over its threads' steps then checks each element once, not twice.)
fn implied_bound(
    f: &Fusion,
    tv: TvId,
    id: IterDomainId,
    idx: &FxHashMap<IterDomainId, ValId>,
    skip_reductions: bool,
) -> bool {
    let Some(t) = f.ids[id].use_ else { return true };
    match f.transforms[t] {
        Transform::Split { input, factor, outer, inner, .. } => {
            if divisible(f, input, factor) {
                return implied_bound(f, tv, outer, idx, skip_reductions)
                    && implied_bound(f, tv, inner, idx, skip_reductions);
            }
            // Bounded by `split_bounds` itself (which leaves logical ids to `predicate`).
            let it = f.ids[input].iter_type;
            !f.tvs[tv].logical.contains(&input)
                && it != IterType::Broadcast
                && !(skip_reductions && it == IterType::Reduction)
                && idx.contains_key(&input)
        }
        Transform::Merge { inner, out, .. } => id == inner || implied_bound(f, tv, out, idx, skip_reductions),
    }
}

/// Bounds on `tv`'s logical ids and idle-thread guards of the enclosing loops.
fn predicate(
    f: &mut Fusion,
    ctx: &Ctx,
    tv: TvId,
    idx: &FxHashMap<IterDomainId, ValId>,
    stack: &[Enclosing],
    skip_reductions: bool,
) -> ValId {
    let mut pred = f.scalars.boolean(true);
    for l in f.tvs[tv].logical.clone() {
        let it = f.ids[l].iter_type;
        if it == IterType::Broadcast
            || (skip_reductions && it == IterType::Reduction)
            || !needs_bound(f, l)
            || implied_bound(f, tv, l, idx, skip_reductions)
        {
            continue;
        }
        if let Some(&i) = idx.get(&l) {
            let e = f.ids[l].extent;
            let c = f.scalars.lt(i, e);
            pred = f.scalars.binary(ScalarOp::And, pred, c);
        }
    }
    let overrun = split_bounds(f, ctx, tv, idx, skip_reductions);
    pred = f.scalars.binary(ScalarOp::And, pred, overrun);
    for l in stack {
        // Reduced where the loop runs a reduction, or where `tv` reduces the axis it runs
        // in it (a loop shared with readers of the result, promoted to their iteration
        // axis): a Local result of a block reduction is held by every thread after the
        // all-reduce, so its store is not guarded by that dimension's extent.
        let reduced = l.group.is_some_and(|g| {
            f.ids[ctx.lg.groups[g].promoted].iter_type == IterType::Reduction
                || (ctx.lg.has(tv)
                    && f.tvs[tv]
                        .loop_domain
                        .iter()
                        .enumerate()
                        .any(|(a, &id)| f.ids[id].iter_type == IterType::Reduction && ctx.lg.group(tv, a) == g))
        });
        if skip_reductions && reduced {
            continue;
        }
        // A broadcast loop (extent one) on a thread or block dimension: every thread or block
        // computes the one element of an on-chip tensor for itself (its readers run that
        // dimension over a larger axis and read it there); only a Global write is made once.
        // So does a loop of one iteration over a size-one axis for a Local tensor (a row of a
        // `[1, N]` input whose row sum a wider padded row reads on every thread); its reads
        // stay under the bounds of its logical indices.
        let broadcast = l.broadcast
            || l.group.is_some_and(|g| f.ids[ctx.lg.groups[g].promoted].iter_type == IterType::Broadcast)
            || (f.scalars.as_int(l.extent) == Some(1)
                && l.group.is_some_and(|g| only_size_one(f, ctx.lg.groups[g].promoted))
                && !reduced
                && f.tvs[tv].memory == MemoryType::Local
                && !f.tvs[tv].logical.iter().any(|&id| f.ids[id].iter_type == IterType::Reduction));
        if broadcast && f.tvs[tv].memory != crate::ir::MemoryType::Global {
            continue;
        }
        if ctx.ragged.contains(&l.parallel) && !one_local_value(f, tv) {
            let c = f.scalars.lt(l.index, l.extent);
            pred = f.scalars.binary(ScalarOp::And, pred, c);
        }
    }
    pred
}

/// Bounds on the inputs of `tv`'s non-divisible splits of non-logical ids: the outer part
/// of such a split can overrun into indices that alias a different valid element.
fn split_bounds(
    f: &mut Fusion,
    ctx: &Ctx,
    tv: TvId,
    idx: &FxHashMap<IterDomainId, ValId>,
    skip_reductions: bool,
) -> ValId {
    let mut pred = f.scalars.boolean(true);
    for t in f.transforms_of(tv) {
        if let Transform::Split { input, factor, .. } = f.transforms[t] {
            if f.tvs[tv].logical.contains(&input) {
                continue;
            }
            let it = f.ids[input].iter_type;
            if it == IterType::Broadcast || (skip_reductions && it == IterType::Reduction) {
                continue;
            }
            // A Local tensor indexed through its consumer: its id made from a broadcast counts
            // the broadcast as one element, but the loops that run it are the consumer's,
            // over the consumer's size (a fill `[1, 1, 2, 1]` merged with its reader's
            // size-one axis split by 64). A bound in its own
            // extents would leave elements the consumer reads unwritten; the consumer's
            // overrun bounds (`reference_bounds`) apply instead.
            if f.tvs[tv].memory == crate::ir::MemoryType::Local
                && from_broadcast(f, input)
                && chain_end(f, ctx, tv).is_some()
            {
                continue;
            }
            if let (false, Some(&i)) = (divisible(f, input, factor), idx.get(&input)) {
                let e = f.ids[input].extent;
                let c = f.scalars.lt(i, e);
                pred = f.scalars.binary(ScalarOp::And, pred, c);
            }
        }
    }
    pred
}

/// True when `id` is made from a broadcast id by splits and merges.
fn from_broadcast(f: &Fusion, id: IterDomainId) -> bool {
    f.id_derived_from_any(id, |i| f.ids[i].iter_type == IterType::Broadcast)
}

/// `pred && extra`, leaving out the conjuncts of `extra` that `pred` already has or implies.
fn and_new(sc: &mut crate::ir::Scalars, pred: ValId, extra: ValId) -> ValId {
    let mut have = Vec::new();
    crate::lower::predicate::conjuncts(sc, pred, &mut have);
    let mut add = Vec::new();
    crate::lower::predicate::conjuncts(sc, extra, &mut add);
    let new: Vec<ValId> =
        add.into_iter().filter(|c| !have.contains(c) && !implied_outer_bound(sc, &have, *c)).collect();
    new.into_iter().fold(pred, |p, c| sc.binary(ScalarOp::And, p, c))
}

/// True when `c` is `x / a / ... / b < n` and `have` holds `x < a * ... * b * n` (factors in
/// any order): the outermost index of a merged space is in range wherever the merged
/// position is (`x` is a non-negative position, the factors extents). A reduction over
/// `[C, H, W]` with `C` fixed at 3 read each element under `r / W / H < 3` beside
/// `r < H * 3 * W`, on every one of its unrolled loads.
fn implied_outer_bound(sc: &crate::ir::Scalars, have: &[ValId], c: ValId) -> bool {
    use crate::ir::scalar::Val;
    let Val::Binary(ScalarOp::Lt, mut x, n) = sc.get(c) else { return false };
    let mut factors = vec![n];
    while let Val::Binary(ScalarOp::Div, y, d) = sc.get(x) {
        factors.push(d);
        x = y;
    }
    if factors.len() < 2 {
        return false;
    }
    // Factors as (sorted leaves, product of constants).
    fn flatten(sc: &crate::ir::Scalars, v: ValId, leaves: &mut Vec<ValId>, k: &mut Option<i64>) {
        match (sc.get(v), sc.as_int(v)) {
            (_, Some(c)) => *k = k.and_then(|k| k.checked_mul(c)),
            (Val::Binary(ScalarOp::Mul, p, q), _) => {
                flatten(sc, p, leaves, k);
                flatten(sc, q, leaves, k);
            }
            _ => leaves.push(v),
        }
    }
    let key = |vs: &[ValId]| {
        let (mut leaves, mut k) = (Vec::new(), Some(1));
        for &v in vs {
            flatten(sc, v, &mut leaves, &mut k);
        }
        leaves.sort_unstable();
        (leaves, k)
    };
    let want = key(&factors);
    if want.1.is_none_or(|k| k <= 0) {
        return false;
    }
    have.iter().any(|&h| matches!(sc.get(h), Val::Binary(ScalarOp::Lt, hx, p) if hx == x && key(&[p]) == want))
}

/// True when `id` is made from size-one axes only (a loop over it runs one iteration at
/// every launch); not the outer part of a split of a larger axis, whose single iteration
/// is one of several blocks' or threads' parts of it.
fn only_size_one(f: &Fusion, id: IterDomainId) -> bool {
    match f.ids[id].definition {
        None => f.scalars.as_int(f.ids[id].extent) == Some(1),
        Some(t) => f.transforms[t].inputs().iter().all(|&i| only_size_one(f, i)),
    }
}

/// True when `tv` is a Local mask, fill, iota or random tensor: it reads no memory, so it
/// may be computed at any position of its loops.
fn local_source(f: &Fusion, tv: TvId) -> bool {
    f.tvs[tv].memory == MemoryType::Local && f.tvs[tv].definition.is_some_and(|d| f.exprs[d].op.is_source())
}

/// True when `tv` is a Local tensor of one element (every logical axis a broadcast): it
/// holds the same value at every position of the loops that run it, so it is computed
/// wherever any of its readers runs, not only where the consumer it is indexed through
/// does. Readers whose extents differ along a shared loop (`x[:30] + m` beside
/// `x + m.expand(31)`, `m` a `[1]` max) each find it computed at their own positions; its
/// reads (index 0 of its operands) are in bounds at every position.
fn one_local_value(f: &Fusion, tv: TvId) -> bool {
    // (A reduction's result is not: idle threads must not add to it.)
    f.tvs[tv].memory == MemoryType::Local
        && f.tvs[tv].logical.iter().all(|&id| f.ids[id].iter_type == IterType::Broadcast)
}

/// The overrun bounds of the consumer whose loops run `tv`'s expr when `tv` is indexed
/// through it (`inlined_reference`, along a chain of such consumers): `tv`'s indices come
/// from the consumer's logical indices, which stay in range where the consumer's split
/// loops overrun, so `tv` would be computed (or stored) at an aliasing element.
fn reference_bounds(f: &mut Fusion, ctx: &Ctx, tv: TvId, stack: &[Enclosing]) -> Result<ValId> {
    if one_local_value(f, tv) {
        return Ok(f.scalars.boolean(true));
    }
    let Some(d) = chain_end(f, ctx, tv) else { return Ok(f.scalars.boolean(true)) };
    let key = (d, stack.to_vec());
    if let Some(&v) = ctx.bounds.borrow().get(&key) {
        return Ok(v);
    }
    let didx = consumer_indices(f, ctx, d, stack, true)?;
    let v = split_bounds(f, ctx, d, &didx, false);
    ctx.bounds.borrow_mut().insert(key, v);
    Ok(v)
}

/// Bounds on the logical indices of `c`, the output of `e`, where `e` reads Global memory
/// and `c`'s chain of inlined consumers ends at a Local tensor run in loops of its own
/// (partly inlined: its readers sit in different loops). Those loops are not the ones `e`
/// runs in, so that tensor's overrun bounds (`reference_bounds`) miss `e`'s innermost
/// positions, and past the end of a merged broadcast space `e` would read past its
/// inputs. The logical indices are in range wherever an element is needed. None otherwise.
fn own_logical_bounds(
    f: &mut Fusion,
    ctx: &Ctx,
    e: ExprId,
    c: TvId,
    cidx: &FxHashMap<IterDomainId, ValId>,
) -> Option<ValId> {
    let d = chain_end(f, ctx, c)?;
    let t = &f.tvs[d];
    if t.memory != crate::ir::MemoryType::Local || t.inline_pos >= t.loop_domain.len() {
        return None;
    }
    if !f.exprs[e].input_tvs().any(|p| f.tvs[p].memory == crate::ir::MemoryType::Global) {
        return None;
    }
    let mut bound = f.scalars.boolean(true);
    for l in f.no_reduction_logical(c) {
        if f.ids[l].iter_type == IterType::Broadcast {
            continue;
        }
        if let Some(&i) = cidx.get(&l) {
            let lt = f.scalars.lt(i, f.ids[l].extent);
            bound = and_new(&mut f.scalars, bound, lt);
        }
    }
    Some(bound)
}

/// The last consumer along `tv`'s chain of `inlined_reference`s (the first one that has no
/// reference of its own), or `None` when `tv` has none. Each tensor walked remembers its
/// answer, so a chain is walked once however many of its tensors ask.
fn chain_end(f: &Fusion, ctx: &Ctx, tv: TvId) -> Option<TvId> {
    let mut path = Vec::new();
    let mut t = tv;
    // The end for every tensor on `path`: the end of the tensor the walk stopped at, or
    // that tensor itself where it has no reference.
    let mut end = None;
    for _ in 0..=f.tvs.len() {
        if let Some(&hit) = ctx.chain_ends.borrow().get(&t) {
            end = Some(hit.unwrap_or(t));
            break;
        }
        match inlined_reference(f, ctx.lg, &ctx.partial, t) {
            Some((e, _)) => {
                path.push(t);
                t = f.exprs[e].output;
            }
            None => {
                ctx.chain_ends.borrow_mut().insert(t, None);
                end = Some(t);
                break;
            }
        }
    }
    let mut memo = ctx.chain_ends.borrow_mut();
    for p in path {
        memo.insert(p, end);
    }
    memo.get(&tv).copied().flatten()
}

/// The consumer that a fully inlined `tv` is indexed through: its loops are all shared
/// with that consumer, whose (possibly broadcast-concretized) iteration space they run.
/// A partly inlined `tv` whose shared loops run a broadcast its consumer concretizes is
/// indexed the same way (`partial`: `validate::through_consumer`), its private loops
/// standing in for the consumer's axes at the same positions.
fn inlined_reference(f: &Fusion, lg: &LoopGraph, partial: &FxHashSet<TvId>, tv: TvId) -> Option<(ExprId, usize)> {
    let t = &f.tvs[tv];
    if t.inline_pos == 0 || (t.inline_pos < t.loop_domain.len() && !partial.contains(&tv)) {
        return None;
    }
    // (a use whose output no fusion output needs is not in the kernel)
    let e = *t.uses.iter().find(|&&e| lg.has(f.exprs[e].output))?;
    let pos = f.exprs[e].inputs.iter().position(|o| *o == Operand::Tensor(tv))?;
    // A gather's table is read at data-dependent rows, and a rank-1 index maps to one axis
    // only; an index of the output's rank (`canonical::broadcast_computed_indices`) is read
    // like an element-wise operand.
    if f.exprs[e].op.is_gather()
        && (f.exprs[e].op.indexed_input() == Some(pos) || f.no_reduction_logical(tv).len() == 1)
    {
        return None;
    }
    Some((e, pos))
}

/// The logical ids of operand `pos` that squeeze `e` removes: their only position is 0
/// (a computed size checked to be one before the kernel runs, `lower::size_constraints`).
fn squeezed(f: &Fusion, e: ExprId, pos: usize) -> Vec<IterDomainId> {
    match (&f.exprs[e].op, f.exprs[e].inputs.get(pos).and_then(|o| o.tensor())) {
        (Op::Squeeze { removed }, Some(x)) => {
            f.no_reduction_logical(x).iter().zip(removed).filter(|(_, &r)| r).map(|(&id, _)| id).collect()
        }
        _ => Vec::new(),
    }
}

/// True when a broadcast axis of `tv` meets an iteration axis along its chain of fully
/// inlined consumers: its loops then run the consumer's larger extent, not its own.
fn broadcast_concretized(f: &Fusion, ctx: &Ctx, tv: TvId) -> bool {
    // Whether the link from `t` to its inlined consumer concretizes a broadcast of `t`;
    // the answer for `tv` is whether any link of its chain does. Each tensor walked
    // remembers its own answer, so a chain is walked once however many of its tensors ask.
    let link = |e: ExprId, pos: usize| {
        logical_pairs(f, e, pos).into_iter().any(|(pid, cid)| {
            // A reduction of a broadcast axis is size one too: it concretizes nothing.
            let one = f.scalars.as_int(f.ids[cid].extent) == Some(1);
            f.ids[pid].iter_type == IterType::Broadcast && f.ids[cid].iter_type != IterType::Broadcast && !one
        })
    };
    let mut path = Vec::new();
    let mut t = tv;
    let mut answer = false;
    for _ in 0..=f.tvs.len() {
        if let Some(&hit) = ctx.concretized.borrow().get(&t) {
            answer = hit;
            break;
        }
        let Some((e, pos)) = inlined_reference(f, ctx.lg, &ctx.partial, t) else { break };
        path.push((t, link(e, pos)));
        t = f.exprs[e].output;
    }
    let mut memo = ctx.concretized.borrow_mut();
    for &(p, own) in path.iter().rev() {
        answer = answer || own;
        memo.insert(p, answer);
    }
    if path.is_empty() {
        memo.insert(tv, answer);
    }
    answer
}

/// Indices of `tv`'s ids at the loops of `stack`. With `partial`, loops of `tv` that do
/// not enclose the stack are left out (and so is every id computed from them) instead of
/// being an error: a fully inlined producer asks its consumer, whose loops right of the
/// producer's position (a new broadcast axis) do not enclose the producer's expr.
fn consumer_indices(
    f: &mut Fusion,
    ctx: &Ctx,
    tv: TvId,
    stack: &[Enclosing],
    partial: bool,
) -> Result<FxHashMap<IterDomainId, ValId>> {
    let key = (tv, partial, stack.to_vec());
    if let Some(hit) = ctx.indices.borrow().get(&key) {
        return Ok(hit.clone());
    }
    let idx = consumer_indices_uncached(f, ctx, tv, stack, partial)?;
    ctx.indices.borrow_mut().insert(key, idx.clone());
    Ok(idx)
}

fn consumer_indices_uncached(
    f: &mut Fusion,
    ctx: &Ctx,
    tv: TvId,
    stack: &[Enclosing],
    partial: bool,
) -> Result<FxHashMap<IterDomainId, ValId>> {
    if let Some((e, pos)) = inlined_reference(f, ctx.lg, &ctx.partial, tv) {
        // Index through the consumer's logical indices, exactly as the consumer reads tv;
        // tv's own extents may be smaller where it has broadcasts the consumer concretizes.
        // Where the consumer's indices do not cover tv's logical ids, tv's own loops do.
        let d = f.exprs[e].output;
        let inlined_at = f.tvs[tv].inline_pos;
        let didx = if inlined_at < f.tvs[tv].loop_domain.len() {
            // tv's private loops enclose its expr, not the consumer's: they stand in for the
            // consumer's loops at the same positions.
            let mut mirrored: Vec<Enclosing> = stack.to_vec();
            for a in inlined_at..f.tvs[tv].loop_domain.len() {
                let mine = ctx.lg.group(tv, a);
                let Some(l) = stack.iter().rev().find(|l| l.group == Some(mine)) else { continue };
                if a < f.tvs[d].loop_domain.len() {
                    mirrored.push(Enclosing { group: Some(ctx.lg.group(d, a)), ..*l });
                }
            }
            consumer_indices(f, ctx, d, &mirrored, true)?
        } else {
            consumer_indices(f, ctx, d, stack, true)?
        };
        let mut idx: FxHashMap<IterDomainId, ValId> = FxHashMap::default();
        for (pid, cid) in logical_pairs(f, e, pos) {
            if let Some(&v) = didx.get(&cid) {
                idx.insert(pid, v);
            }
        }
        let zero = f.scalars.int(0);
        for pid in f.tvs[tv].logical.clone() {
            if f.ids[pid].iter_type == IterType::Broadcast {
                idx.insert(pid, zero);
            }
        }
        for pid in squeezed(f, e, pos) {
            idx.insert(pid, zero);
        }
        if f.tvs[tv].logical.iter().all(|l| idx.contains_key(l)) {
            // Where every loop runs tv's own extent (no broadcast concretized), the ids
            // between logical and loop take their indices from the loops too: rebuilt from
            // logical indices instead, a merge with a broadcast outer wraps its inner index
            // (`% extent`), and the bound of an overrunning thread would be lost.
            let mut from_loops: FxHashMap<IterDomainId, ValId> = FxHashMap::default();
            let mut own = !broadcast_concretized(f, ctx, tv);
            for (a, &id) in f.tvs[tv].loop_domain.clone().iter().enumerate() {
                let g = ctx.lg.group(tv, a);
                if let Some(l) = stack.iter().rev().find(|l| l.group == Some(g)) {
                    // A loop axis that is itself a logical id keeps the consumer's index:
                    // its loop may run a space the consumer concretized (neg(b) under a
                    // merge of a broadcast with b's axis runs the merged loop).
                    if !f.tvs[tv].logical.contains(&id) {
                        idx.insert(id, l.index);
                    }
                    from_loops.insert(id, l.index);
                } else {
                    own = false;
                }
            }
            if own {
                backward(f, tv, &mut from_loops);
                let logical = f.tvs[tv].logical.clone();
                for (id, v) in from_loops {
                    if !logical.contains(&id) {
                        idx.entry(id).or_insert(v);
                    }
                }
            }
            forward(f, tv, &mut idx);
            return Ok(idx);
        }
    }
    let mut idx = FxHashMap::default();
    let ld = f.tvs[tv].loop_domain.clone();
    for (a, &id) in ld.iter().enumerate() {
        let g = ctx.lg.group(tv, a);
        let Some(l) = stack.iter().rev().find(|l| l.group == Some(g)) else {
            if partial {
                continue;
            }
            bail_internal!("{} axis {a}: its loop does not enclose the expression", f.tv_name(tv));
        };
        idx.insert(id, l.index);
    }
    backward(f, tv, &mut idx);
    Ok(idx)
}

fn index_expr(f: &mut Fusion, ctx: &mut Ctx, e: ExprId, stack: &[Enclosing]) -> Result<AccessIndex> {
    let c = f.exprs[e].output;
    let groups = group_indices(ctx, stack);
    let cidx = consumer_indices(f, ctx, c, stack, false)?;
    let out = offset(f, ctx, c, &cidx, &groups)?;
    let mut inputs = Vec::new();
    let mut gathers = Vec::new();
    let mut guard = None;
    let operands = f.exprs[e].inputs.clone();
    for (pos, op) in operands.iter().enumerate() {
        let Operand::Tensor(p) = *op else {
            inputs.push(None);
            continue;
        };
        let fully = f.tvs[p].inline_pos >= f.tvs[p].loop_domain.len();
        if fully
            && f.exprs[e].op.indexed_input() != Some(pos)
            && inlined_reference(f, ctx.lg, &ctx.partial, p).is_some_and(|(r, _)| r == e)
        {
            // A fully inlined producer was written under these very loops, at the indices
            // its reference consumer (this expr) gave it: read it at the same ones. (Its
            // loop axes that are logical ids take the consumer's logical index, not the
            // loop's, where the loop runs a merge with a broadcast the consumer concretizes.)
            let pidx = consumer_indices(f, ctx, p, stack, false)?;
            inputs.push(Some(offset(f, ctx, p, &pidx, &groups)?));
            continue;
        }
        let mut pidx = from_consumer(f, e, pos, &cidx);
        let zero = f.scalars.int(0);
        for pid in f.tvs[p].logical.clone() {
            if f.ids[pid].iter_type != IterType::Iteration {
                pidx.insert(pid, zero);
            }
        }
        for pid in squeezed(f, e, pos) {
            pidx.insert(pid, zero);
        }
        if let (Op::IndexSelect { dim }, 0) = (&f.exprs[e].op, pos) {
            // The selected position is the index tensor's value at the consumer's `dim` index.
            let idx_tv = operands[1].tensor().expect("index_select takes a tensor index");
            let sel = f.no_reduction_logical(p)[*dim];
            let at = index_operand(f, ctx, e, 1, idx_tv, &cidx, &groups, stack)?;
            let element = logical_position(f, e, 1, idx_tv, &cidx);
            let id = ctx.next_gather;
            ctx.next_gather += 1;
            gathers.push(Gather { id, index_tv: idx_tv, at, table: p, extent: f.ids[sel].extent, element });
            let g = f.scalars.symbol(Symbol::Gathered(id));
            pidx.insert(sel, g);
        }
        if let (Op::Remap { index, valid, .. }, 0) = (f.exprs[e].op.clone(), pos) {
            // The input's positions are the remap's expressions at the output's indices.
            let at = remap_positions(f, c, &cidx, &index, valid)?;
            for (&pid, &v) in f.no_reduction_logical(p).iter().zip(&at.0) {
                if f.ids[pid].iter_type == IterType::Iteration {
                    pidx.insert(pid, v);
                }
            }
            guard = at.1;
        }
        if ctx.partial.contains(&p) {
            // A tensor indexed through its consumer wrote its private axes at the consumer's
            // loop positions: they are read at this consumer's loops, not at positions its
            // own transforms derive from the logical indices (which differ where those
            // axes split a merge with a broadcast: `[b, N]` flattened and split by 4).
            for a in f.tvs[p].inline_pos..f.tvs[p].loop_domain.len().min(f.tvs[c].loop_domain.len()) {
                let g = ctx.lg.group(c, a);
                if let Some(l) = stack.iter().rev().find(|l| l.group == Some(g)) {
                    pidx.insert(f.tvs[p].loop_domain[a], l.index);
                }
            }
        }
        bind_enclosing(f, ctx, p, stack, &mut pidx);
        forward(f, p, &mut pidx);
        inputs.push(Some(offset_via(f, ctx, p, &pidx, &groups, Some((e, pos, &cidx)))?));
    }
    let mut pred = predicate(f, ctx, c, &cidx, stack, false);
    let mut write_pred = predicate(f, ctx, c, &cidx, stack, true);
    // A Local source (a mask, a fill, an iota) reads no memory: computed at every position
    // of its loops, it holds a value for each of its readers, also for one that runs those
    // loops over more positions than the consumer it is indexed through (a pad's column
    // mask read by a `cat` of the padded rows and by their sum, in one flattened loop).
    let overrun = if local_source(f, c) { f.scalars.boolean(true) } else { reference_bounds(f, ctx, c, stack)? };
    pred = and_new(&mut f.scalars, pred, overrun);
    write_pred = and_new(&mut f.scalars, write_pred, overrun);
    if let Some(bound) = own_logical_bounds(f, ctx, e, c, &cidx) {
        pred = and_new(&mut f.scalars, pred, bound);
        write_pred = and_new(&mut f.scalars, write_pred, bound);
    }
    for p in operands.iter().filter_map(|o| o.tensor()) {
        // A fully inlined producer indexed through another consumer was computed under
        // that consumer's overrun bounds only: where they fail it holds nothing, so this
        // reader of the same loops (a `[1, 1]` output beside the `[N, M]` one that
        // concretizes it) reads it under them too.
        let fully = f.tvs[p].inline_pos >= f.tvs[p].loop_domain.len();
        if fully && !local_source(f, p) && inlined_reference(f, ctx.lg, &ctx.partial, p).is_some_and(|(r, _)| r != e) {
            let theirs = reference_bounds(f, ctx, p, stack)?;
            pred = and_new(&mut f.scalars, pred, theirs);
            write_pred = and_new(&mut f.scalars, write_pred, theirs);
        }
    }
    if matches!(f.exprs[e].op, Op::Reduction { .. }) {
        // Reducing a broadcast axis reduces its one element. When the reduction's loop
        // runs the extent of the axis it is broadcast against (a loop shared with a
        // consumer), only its first iteration may contribute.
        let zero = f.scalars.int(0);
        for (pid, cid) in logical_pairs(f, e, 0) {
            if f.ids[cid].iter_type == IterType::Reduction && f.ids[pid].iter_type == IterType::Broadcast {
                if let Some(&i) = cidx.get(&cid) {
                    let first = f.scalars.binary(ScalarOp::Eq, i, zero);
                    pred = f.scalars.binary(ScalarOp::And, pred, first);
                }
            }
        }
        // A loop over a kept broadcast axis inside the reduction's first reduced loop (a
        // size-one axis split by a factor, or shared with a reader that expands it) runs
        // after the one init of the result (`placement::init_position` re-inits only in
        // the loops outside the reduced ones): each of its iterations would add the input to
        // the one element again, so only its first contributes.
        // (A loop on a thread or block dimension runs each iteration in its own thread or
        // block, which holds its own copy of a Local result: each computes the whole of it.)
        let ld = f.tvs[c].loop_domain.clone();
        let first_reduced = ld.iter().position(|&id| f.ids[id].iter_type == IterType::Reduction);
        for (a, &id) in ld.iter().enumerate().skip(first_reduced.map_or(ld.len(), |r| r + 1)) {
            let parallel = ctx.lg.groups[ctx.lg.group(c, a)].parallel;
            if f.ids[id].iter_type == IterType::Broadcast && !parallel.is_thread_or_block() {
                if let Some(&i) = cidx.get(&id) {
                    let first = f.scalars.binary(ScalarOp::Eq, i, zero);
                    pred = f.scalars.binary(ScalarOp::And, pred, first);
                }
            }
        }
    }
    // A Global/Shared tensor that does not use a launched thread or block dimension is
    // computed redundantly along it: only index 0 of that dimension writes (of a block
    // dimension, every block writes its own Shared copy, as nvFuser does). Its broadcast
    // loop axes do not partition its elements either: the threads along one would all
    // store the same element (`analysis::parallel::runs_on`).
    // Ops on a grid reduction's result run where it is held; along the dimensions the
    // reduction combined, that one thread is the only writer.
    let waits = ctx.waits.get(&c).cloned().unwrap_or_default();
    let mut held_along: Vec<ParallelType> = Vec::new();
    for &g in &waits {
        let done = f.scalars.symbol(Symbol::GridDone(g));
        pred = f.scalars.binary(ScalarOp::And, pred, done);
        write_pred = f.scalars.binary(ScalarOp::And, write_pred, done);
        held_along.extend(ctx.grid_dims.get(&g).cloned().unwrap_or_default());
    }
    if f.tvs[c].memory != MemoryType::Local {
        let zero = f.scalars.int(0);
        for &p in &ctx.used {
            // (Shared memory is the block's own: every block writes its copy.)
            if !held_along.contains(&p)
                && !crate::analysis::parallel::is_partitioned_across(f.tvs[c].memory, p)
                && !crate::analysis::parallel::runs_on(f, ctx.lg, c, p)
            {
                let i = f.scalars.symbol(Symbol::ParallelIndex(p));
                let first = f.scalars.binary(ScalarOp::Eq, i, zero);
                pred = f.scalars.binary(ScalarOp::And, pred, first);
                write_pred = f.scalars.binary(ScalarOp::And, write_pred, first);
            }
        }
    }
    if let Op::Mask { valid } = f.exprs[e].op {
        guard = remap_positions(f, c, &cidx, &[], Some(valid))?.1;
    }
    let element = if f.exprs[e].op.reads_position() {
        // Schedule-independent: from the logical indices, not the loops or the layout.
        let mut lin = f.scalars.int(0);
        for (id, i) in logical_indices(f, c, &cidx)? {
            let scaled = f.scalars.binary(ScalarOp::Mul, lin, f.ids[id].extent);
            lin = f.scalars.binary(ScalarOp::Add, scaled, i);
        }
        Some(lin)
    } else {
        guard
    };
    // Offsets are dereferenced only where their predicate holds: a remainder or quotient of an
    // index the predicate bounds by the same divisor is the index itself, or zero.
    let read_bounds = lt_bounds(&f.scalars, pred);
    let inputs = inputs.into_iter().map(|o| o.map(|v| within_bounds(&mut f.scalars, v, &read_bounds))).collect();
    let write_bounds: Vec<(ValId, ValId)> =
        lt_bounds(&f.scalars, write_pred).into_iter().filter(|b| read_bounds.contains(b)).collect();
    let out = within_bounds(&mut f.scalars, out, &write_bounds);
    Ok(AccessIndex { out, inputs, predicate: pred, write_predicate: write_pred, gathers, element })
}

/// The `(a, b)` of each conjunct `a < b` of `pred` with `a` non-negative and `b` positive.
fn lt_bounds(sc: &crate::ir::Scalars, pred: ValId) -> Vec<(ValId, ValId)> {
    let mut parts = Vec::new();
    crate::lower::predicate::conjuncts(sc, pred, &mut parts);
    parts
        .into_iter()
        .filter_map(|c| match sc.get(c) {
            Val::Binary(ScalarOp::Lt, a, b) if sc.range(a).0 >= 0 && sc.range(b).0 > 0 => Some((a, b)),
            _ => None,
        })
        .collect()
}

/// `v` with `a % b` read as `a` and `a / b` as 0 for each `(a, b)` of `bounds` (`0 <= a < b`
/// holds wherever `v` is used): the remainders a producer's split takes of an index that a
/// non-divisible split already bounds, which cost a 64-bit division per access.
fn within_bounds(sc: &mut crate::ir::Scalars, v: ValId, bounds: &[(ValId, ValId)]) -> ValId {
    if bounds.is_empty() {
        return v;
    }
    fn go(
        sc: &mut crate::ir::Scalars,
        v: ValId,
        bounds: &[(ValId, ValId)],
        memo: &mut FxHashMap<ValId, ValId>,
    ) -> ValId {
        if let Some(&r) = memo.get(&v) {
            return r;
        }
        let r = match sc.get(v) {
            Val::Binary(op, a, b) => {
                if matches!(op, ScalarOp::Mod | ScalarOp::Div) && bounds.contains(&(a, b)) {
                    if op == ScalarOp::Mod {
                        go(sc, a, bounds, memo)
                    } else {
                        sc.int(0)
                    }
                } else {
                    let (na, nb) = (go(sc, a, bounds, memo), go(sc, b, bounds, memo));
                    if (na, nb) == (a, b) {
                        v
                    } else {
                        sc.binary(op, na, nb)
                    }
                }
            }
            _ => v,
        };
        memo.insert(v, r);
        r
    }
    go(sc, v, bounds, &mut FxHashMap::default())
}

/// The index of each logical axis of `c` (reductions left out, 0 on broadcast axes).
fn logical_indices(
    f: &mut Fusion,
    c: TvId,
    cidx: &FxHashMap<IterDomainId, ValId>,
) -> Result<Vec<(IterDomainId, ValId)>> {
    let mut out = Vec::new();
    for id in f.no_reduction_logical(c) {
        let i = if f.ids[id].iter_type == IterType::Broadcast {
            f.scalars.int(0)
        } else {
            match cidx.get(&id) {
                Some(&i) => i,
                None => bail_internal!("{}: no index for its logical axis {}", f.tv_name(c), f.id_label(id)),
            }
        };
        out.push((id, i));
    }
    Ok(out)
}

/// A remap's input positions (`index`) and guard (`valid`) with each output position
/// `Symbol::OutAxis(k)` replaced by the consumer `c`'s index along its logical axis `k`.
fn remap_positions(
    f: &mut Fusion,
    c: TvId,
    cidx: &FxHashMap<IterDomainId, ValId>,
    index: &[ValId],
    valid: Option<ValId>,
) -> Result<(Vec<ValId>, Option<ValId>)> {
    let mut at: Vec<ValId> = index.to_vec();
    let mut guard = valid;
    for (k, (_, i)) in logical_indices(f, c, cidx)?.into_iter().enumerate() {
        let sym = Symbol::OutAxis(k as u32);
        for v in at.iter_mut() {
            *v = f.scalars.substitute(*v, sym, i);
        }
        if let Some(g) = guard.as_mut() {
            *g = f.scalars.substitute(*g, sym, i);
        }
    }
    Ok((at, guard))
}

#[allow(clippy::too_many_arguments)]
fn index_operand(
    f: &mut Fusion,
    ctx: &Ctx,
    e: ExprId,
    pos: usize,
    p: TvId,
    cidx: &FxHashMap<IterDomainId, ValId>,
    groups: &FxHashMap<IterDomainId, ValId>,
    stack: &[Enclosing],
) -> Result<ValId> {
    let mut pidx = from_consumer(f, e, pos, cidx);
    let zero = f.scalars.int(0);
    for pid in f.tvs[p].logical.clone() {
        if f.ids[pid].iter_type != IterType::Iteration {
            pidx.insert(pid, zero);
        }
    }
    bind_enclosing(f, ctx, p, stack, &mut pidx);
    forward(f, p, &mut pidx);
    offset(f, ctx, p, &pidx, groups)
}

/// Row-major position, in operand `pos`'s logical shape, of the element that expr `e` reads
/// at consumer indices `cidx` (broadcast and unmapped axes at 0).
fn logical_position(f: &mut Fusion, e: ExprId, pos: usize, p: TvId, cidx: &FxHashMap<IterDomainId, ValId>) -> ValId {
    let pidx = from_consumer(f, e, pos, cidx);
    let mut flat = f.scalars.int(0);
    for id in f.no_reduction_logical(p) {
        let (extent, iter) = (f.ids[id].extent, f.ids[id].iter_type);
        let i = if iter == IterType::Iteration { pidx.get(&id).copied() } else { None };
        let scaled = f.scalars.mul(flat, extent);
        flat = match i {
            Some(i) => f.scalars.add(scaled, i),
            None => scaled,
        };
    }
    flat
}

/// Indices of operand `pos`'s logical ids, taken from the consumer ids they map to.
fn from_consumer(
    f: &Fusion,
    e: ExprId,
    pos: usize,
    cidx: &FxHashMap<IterDomainId, ValId>,
) -> FxHashMap<IterDomainId, ValId> {
    logical_pairs(f, e, pos).into_iter().filter_map(|(pid, cid)| cidx.get(&cid).map(|&v| (pid, v))).collect()
}

/// Loop ids of `p` shared with the enclosing loops use the loop index itself.
fn bind_enclosing(f: &Fusion, ctx: &Ctx, p: TvId, stack: &[Enclosing], pidx: &mut FxHashMap<IterDomainId, ValId>) {
    let t = &f.tvs[p];
    for (a, &id) in t.loop_domain.iter().enumerate().take(t.inline_pos) {
        let g = ctx.lg.group(p, a);
        if let Some(l) = stack.iter().rev().find(|l| l.group == Some(g)) {
            pidx.insert(id, l.index);
        }
    }
}

fn index_init(f: &mut Fusion, ctx: &mut Ctx, tv: TvId, stack: &[Enclosing]) -> Result<AccessIndex> {
    let groups = group_indices(ctx, stack);
    let mut idx = FxHashMap::default();
    let zero = f.scalars.int(0);
    let ld = f.tvs[tv].loop_domain.clone();
    for (a, &id) in ld.iter().enumerate() {
        let g = ctx.lg.group(tv, a);
        let v = stack
            .iter()
            .rev()
            .find(|l| l.init_axis == Some(a) || (l.init_axis.is_none() && l.group == Some(g)))
            .map(|l| l.index)
            .unwrap_or(zero);
        idx.insert(id, v);
    }
    backward(f, tv, &mut idx);
    let out = offset(f, ctx, tv, &idx, &groups)?;
    let mut pred = predicate(f, ctx, tv, &idx, stack, true);
    // One writer per element: Global/Shared inits are done by index 0 of every launched
    // dimension the tensor is not indexed by (its reduced dimensions included), so no
    // block can re-initialize an output another block already reduced into. A block
    // dimension does not partition Global memory but does partition Shared: every block
    // initializes its own Shared copy, as every block computes it (index_expr).
    if f.tvs[tv].memory != MemoryType::Local {
        let memory = f.tvs[tv].memory;
        // Broadcast axes partition nothing either (as in index_expr).
        let own: Vec<ParallelType> = (0..ld.len())
            .filter(|&a| f.ids[ld[a]].iter_type != IterType::Reduction)
            .filter(|&a| f.ids[ld[a]].iter_type != IterType::Broadcast)
            .map(|a| ctx.lg.groups[ctx.lg.group(tv, a)].parallel)
            .collect();
        for &p in &ctx.used {
            if !own.contains(&p) && !crate::analysis::parallel::is_partitioned_across(memory, p) {
                let i = f.scalars.symbol(Symbol::ParallelIndex(p));
                let first = f.scalars.binary(ScalarOp::Eq, i, zero);
                pred = f.scalars.binary(ScalarOp::And, pred, first);
            }
        }
    }
    Ok(AccessIndex {
        out,
        inputs: Vec::new(),
        predicate: pred,
        write_predicate: pred,
        gathers: Vec::new(),
        element: None,
    })
}
