//! Unswitching and loop-invariant bounds checks.
//! Consumes: the indexed nest with register accumulators. Produces: `If` nodes.
//! Guarantees:
//! - An Unswitch loop whose bounds checks (`index < extent`, monotone in the loop indices
//!   under it) all hold at the largest indices becomes `if (they hold there) { the loop
//!   without them } else { the checked loop }`: full tiles run unpredicated.
//! - A serial loop whose statements all repeat a bounds check that no loop inside changes
//!   (a column bound inside a loop over rows) and that emits no barrier becomes
//!   `if (check) { the loop without it }`: per-statement checks compile to a branch around
//!   every load, which keeps the loads of an unrolled loop from being issued together.
//!   Statements that only fill Local tensors allocated inside the loop need not repeat the
//!   check (skipping the loop skips their readers too).
//!
//! Statements inside a `then` arm no longer test what its condition established.

use rustc_hash::{FxHashMap, FxHashSet};

use crate::analysis::loop_graph::LoopGraph;
use crate::error::Result;
use crate::ir::scalar::{ScalarOp, Val};
use crate::ir::{Fusion, IterType, MemoryType, Op, ParallelType, Scalars, Symbol, TvId, ValId};
use crate::kernel::{AllocTarget, Allocate, ForLoop, IfKind, IfThenElse, Node};
use crate::lower::predicate::{and_all, assume, conjuncts, mentions, mentions_per_statement, monotone, without};

/// Rewrite the loops of `body` that can be unswitched or have invariant bounds checks.
pub fn run(f: &mut Fusion, lg: &LoopGraph, body: &mut [Node]) -> Result<()> {
    rewrite(f, lg, body, &mut Vec::new());
    Ok(())
}

/// `assumed`: the conditions of the `then` arms around `nodes` (for conditions only; the
/// statements' predicates no longer hold them).
fn rewrite(f: &mut Fusion, lg: &LoopGraph, nodes: &mut [Node], assumed: &mut Vec<ValId>) {
    for n in nodes.iter_mut() {
        if let Node::Loop(l) = n {
            let made = if l.parallel == ParallelType::Unswitch { unswitch(f, lg, l, assumed) } else { None };
            let made = made.or_else(|| {
                let vector_copy = crate::lower::vectorize::is_vector_copy(f, l);
                (!l.parallel.is_thread_or_block() && !vector_copy)
                    .then(|| invariant_bounds(f, lg, l, assumed))
                    .flatten()
            });
            if let Some(made) = made {
                *n = made;
            }
        }
        match n {
            Node::If(i) => {
                let mut parts = Vec::new();
                conjuncts(&f.scalars, i.cond, &mut parts);
                let before = assumed.len();
                assumed.extend(parts);
                rewrite(f, lg, &mut i.then, assumed);
                assumed.truncate(before);
                rewrite(f, lg, &mut i.otherwise, assumed);
            }
            Node::Loop(l) => rewrite(f, lg, &mut l.body, assumed),
            _ => {}
        }
    }
}

/// The unswitched form of `l`, or `None` when no bounds check can be hoisted.
fn unswitch(f: &mut Fusion, lg: &LoopGraph, l: &ForLoop, assumed: &[ValId]) -> Option<Node> {
    let barrier_inside = !only_local_statements(f, lg, &l.body);
    let sc = &mut f.scalars;
    let mut loops: Vec<(Symbol, ValId)> = Vec::new();
    let mut preds: Vec<ValId> = Vec::new();
    collect(sc, std::slice::from_ref(&Node::Loop(l.clone())), &mut loops, &mut preds);
    let syms: FxHashSet<Symbol> = loops.iter().map(|&(s, _)| s).collect();
    let mut hoist: Vec<ValId> = Vec::new();
    for p in preds {
        let mut parts = Vec::new();
        conjuncts(sc, p, &mut parts);
        for c in parts {
            if hoist.contains(&c) {
                continue;
            }
            if let Val::Binary(ScalarOp::Lt, a, b) = sc.get(c) {
                if mentions(sc, a, &syms) && !mentions(sc, b, &syms) && monotone(sc, a) {
                    hoist.push(c);
                }
            }
        }
    }
    if hoist.is_empty() || loops.iter().any(|&(_, e)| mentions(sc, e, &syms)) {
        return None;
    }
    // The fast path's condition: each hoisted bound at the largest indices.
    // No extent mentions a loop index (checked above), so the indices are replaced at
    // once, with one memo over every bound: the bounds share most of their terms.
    let mut last_of = FxHashMap::default();
    for &(s, e) in &loops {
        let one = sc.int(1);
        last_of.insert(s, sc.sub(e, one));
    }
    let mut memo = FxHashMap::default();
    let at_last: Vec<ValId> = hoist.iter().map(|&c| sc.substitute_all(c, &last_of, &mut memo)).collect();
    let cond = and_all(sc, at_last);
    let cond = without(sc, cond, assumed);
    // A condition that differs between the threads of a block would send some of them down
    // the other arm, past a barrier or block reduction the rest wait at: that loop stays
    // as it is, its statements checked one by one.
    let threads: FxHashSet<Symbol> =
        [ParallelType::TIDx, ParallelType::TIDy, ParallelType::TIDz].into_iter().map(Symbol::ParallelIndex).collect();
    if barrier_inside && mentions(sc, cond, &threads) {
        return None;
    }
    // Likewise across blocks: a grid reduction is one synchronization of every block, so
    // blocks must not reach it from two arms.
    let blocks: FxHashSet<Symbol> =
        [ParallelType::BIDx, ParallelType::BIDy, ParallelType::BIDz].into_iter().map(Symbol::ParallelIndex).collect();
    if grid_reduction_inside(f, lg, &l.body) && mentions(&f.scalars, cond, &blocks) {
        return None;
    }
    let sc = &mut f.scalars;
    let mut plain = l.clone();
    plain.parallel = ParallelType::Serial;
    let mut fast = vec![Node::Loop(plain.clone())];
    assume(sc, &mut fast, &hoist);
    Some(Node::If(IfThenElse { cond, kind: IfKind::Unswitch, then: fast, otherwise: vec![Node::Loop(plain)] }))
}

/// `l` inside a test of the bounds checks all its statements share and no loop inside
/// changes, or `None` when there are none or `l` holds a barrier (which every thread must
/// reach).
fn invariant_bounds(f: &mut Fusion, lg: &LoopGraph, l: &ForLoop, assumed: &[ValId]) -> Option<Node> {
    if !only_local_statements(f, lg, &l.body) {
        return None;
    }
    // Statements that only fill a Local tensor allocated inside the loop need not share
    // the check: skipping the whole loop skips their readers too (the row statistics a
    // column-sum loop loads for each row, unchecked, beside the checked column reads).
    let mut private = FxHashSet::default();
    local_allocations(&l.body, &mut private);
    let mut preds = Vec::new();
    statement_predicates(f, &l.body, &private, &mut preds);
    let sc = &mut f.scalars;
    let mut loops: Vec<(Symbol, ValId)> = Vec::new();
    if let Val::Symbol(s) = sc.get(l.index) {
        loops.push((s, l.extent));
    }
    collect(sc, &l.body, &mut loops, &mut Vec::new());
    let inner: FxHashSet<Symbol> = loops.iter().map(|&(s, _)| s).collect();
    let mut common: Option<Vec<ValId>> = None;
    for p in preds {
        let mut parts = Vec::new();
        conjuncts(sc, p, &mut parts);
        parts.retain(|c| !assumed.contains(c));
        common = Some(match common {
            None => parts,
            Some(prev) => prev.into_iter().filter(|c| parts.contains(c)).collect(),
        });
    }
    let hoist: Vec<ValId> = common
        .unwrap_or_default()
        .into_iter()
        .filter(|&c| !mentions(sc, c, &inner) && !mentions_per_statement(sc, c))
        .collect();
    if hoist.is_empty() {
        return None;
    }
    let cond = and_all(sc, hoist.iter().copied());
    let mut inside = vec![Node::Loop(l.clone())];
    assume(sc, &mut inside, &hoist);
    Some(Node::If(IfThenElse { cond, kind: IfKind::InvariantBounds, then: inside, otherwise: Vec::new() }))
}

/// True when `body` holds only loops, Local allocations and statements that emit no
/// barrier (no syncs, inits, or block and grid reductions).
/// True when `body` holds a reduction across blocks (a reduced axis on BIDx, BIDy or BIDz).
fn grid_reduction_inside(f: &Fusion, lg: &LoopGraph, body: &[Node]) -> bool {
    body.iter().any(|n| match n {
        Node::Loop(l) => grid_reduction_inside(f, lg, &l.body),
        Node::If(i) => grid_reduction_inside(f, lg, &i.then) || grid_reduction_inside(f, lg, &i.otherwise),
        Node::Expr { expr, .. } | Node::ReduceAccumulator { acc: crate::kernel::Accumulator { expr, .. }, .. } => {
            let e = &f.exprs[*expr];
            matches!(e.op, Op::Reduction { .. })
                && f.tvs[e.output].loop_domain.iter().enumerate().any(|(a, &id)| {
                    f.ids[id].iter_type == IterType::Reduction && lg.groups[lg.group(e.output, a)].parallel.is_block()
                })
        }
        _ => false,
    })
}

fn only_local_statements(f: &Fusion, lg: &LoopGraph, body: &[Node]) -> bool {
    body.iter().all(|n| match n {
        Node::Loop(l) => only_local_statements(f, lg, &l.body),
        Node::If(i) => only_local_statements(f, lg, &i.then) && only_local_statements(f, lg, &i.otherwise),
        Node::Alloc(a) => a.memory == MemoryType::Local,
        Node::Expr { expr, .. } => {
            let e = &f.exprs[*expr];
            let block_reduce = matches!(e.op, Op::Reduction { .. })
                && f.tvs[e.output].loop_domain.iter().enumerate().any(|(a, &id)| {
                    f.ids[id].iter_type == IterType::Reduction
                        && lg.groups[lg.group(e.output, a)].parallel.is_thread_or_block()
                });
            !block_reduce
        }
        Node::Accumulate { .. } | Node::AccumulatorInit(_) | Node::Vector(_) => true,
        Node::Init { .. }
        | Node::Sync(_)
        | Node::ReduceAccumulator { .. }
        | Node::Barrier(_)
        | Node::BulkLoad(_)
        | Node::CpAsync(_)
        | Node::TensorMemory(_) => false,
    })
}

/// The predicates of the statements in `body` (what each checks before it runs), but for
/// those that write a tensor of `private`.
fn statement_predicates(f: &Fusion, body: &[Node], private: &FxHashSet<TvId>, out: &mut Vec<ValId>) {
    for n in body {
        match n {
            Node::Expr { expr, index: Some(ix) } if !private.contains(&f.exprs[*expr].output) => out.push(ix.predicate),
            Node::Accumulate { index: ix, .. } => out.push(ix.predicate),
            _ => {}
        }
        for b in n.bodies() {
            statement_predicates(f, b, private, out);
        }
    }
}

/// The Local tensors allocated in `body`.
fn local_allocations(body: &[Node], out: &mut FxHashSet<TvId>) {
    for n in body {
        if let Node::Alloc(Allocate { target: AllocTarget::Tensor(t), memory: MemoryType::Local, .. }) = n {
            out.insert(*t);
        }
        for b in n.bodies() {
            local_allocations(b, out);
        }
    }
}

/// Serial loop-index symbols (with extents) and predicates of the statements in `nodes`.
fn collect(sc: &Scalars, nodes: &[Node], loops: &mut Vec<(Symbol, ValId)>, preds: &mut Vec<ValId>) {
    for n in nodes {
        if let Node::Loop(l) = n {
            if !l.parallel.is_thread_or_block() {
                if let Val::Symbol(s) = sc.get(l.index) {
                    loops.push((s, l.extent));
                }
            }
        }
        if let Some(ix) = n.access_index() {
            preds.push(ix.predicate);
            preds.push(ix.write_predicate);
        }
        for b in n.bodies() {
            collect(sc, b, loops, preds);
        }
    }
}
