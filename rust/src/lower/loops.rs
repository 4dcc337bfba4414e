//! Loop nest generation.
//! Consumes: a validated fusion and its loop graph. Produces: the expression order and
//! a nest of ForLoops (one per loop group) with each expr placed inside the loops of
//! its output's loop domain. Guarantees: a producer inlined at position k sits inside
//! the same first k loops as its consumers, and precedes them.

use rustc_hash::{FxHashMap, FxHashSet};

use crate::analysis::loop_graph::LoopGraph;
use crate::bail;
use crate::error::Result;
use crate::ir::{ExprId, Fusion, IterType, ParallelType, Symbol, TvId};
use crate::kernel::{ForLoop, Node};

/// Expressions in an order that keeps inlined producers next to their consumers. With
/// `defer_stores`, the stores of register accumulators (see [`accumulator_store`]) come
/// after every other expr, in output order.
pub fn expr_order(f: &Fusion, defer_stores: bool) -> Vec<ExprId> {
    expr_order_with(f, defer_stores, false)
}

/// [`expr_order`], placing before its siblings anything upstream that is shallower than the
/// deepest of them where `deep` (the order the loop pass falls back to).
pub fn expr_order_with(f: &Fusion, defer_stores: bool, deep: bool) -> Vec<ExprId> {
    let mut order = Vec::new();
    let mut done: FxHashSet<ExprId> = FxHashSet::default();
    // Outputs computed from a grid reduction last: a grid reduction waits for every block,
    // so the ops on its result come after all of the block's other work (placed first, a
    // loss averaged over the rows would close the row loop that a per-row output needs).
    let mut outputs = f.outputs.clone();
    // Outputs whose loops are one nest (a producer is inlined into both) are placed next to
    // each other: an output of another nest between them (outputs of unrelated shapes side
    // by side) would close the nest before the second one runs in it.
    let nest = output_nests(f);
    outputs.sort_by_cached_key(|&o| (after_grid_reduction(f, o), nest[&o]));
    // An accumulator reduced across a serial loop that other outputs also run (the column
    // partials of a block's rows, summed while the rows are normalized) is stored once that
    // loop is over: placed right after the accumulation, its store would close the loop
    // before the next accumulator's reduction, which needs it open.
    let deferred: Vec<TvId> =
        if defer_stores { outputs.iter().copied().filter(|&o| accumulator_store(f, o)).collect() } else { Vec::new() };
    for &out in &outputs {
        if deferred.contains(&out) {
            let Some(e) = f.tvs[out].definition else { continue };
            for p in f.exprs[e].input_tvs() {
                visit(f, p, deep, &mut done, &mut order);
            }
        } else {
            visit(f, out, deep, &mut done, &mut order);
        }
    }
    for out in deferred {
        visit(f, out, deep, &mut done, &mut order);
    }
    order
}

/// Per output, the position among the outputs of the first output that shares a loop
/// nest with it: two outputs share one where a producer is inlined into both (loops are
/// one only through inlining).
fn output_nests(f: &Fusion) -> FxHashMap<TvId, usize> {
    let mut owner: FxHashMap<TvId, usize> = FxHashMap::default();
    let mut nest: FxHashMap<TvId, usize> = FxHashMap::default();
    for (k, &o) in f.outputs.iter().enumerate() {
        let mut found: Option<usize> = None;
        let mut visited: Vec<TvId> = Vec::new();
        let mut stack: Vec<TvId> = f.tvs[o].definition.map(|e| f.exprs[e].input_tvs().collect()).unwrap_or_default();
        let mut seen: FxHashSet<TvId> = FxHashSet::default();
        while let Some(t) = stack.pop() {
            if f.tvs[t].inline_pos == 0 || !seen.insert(t) {
                continue;
            }
            if let Some(&j) = owner.get(&t) {
                found = Some(found.map_or(j, |i: usize| i.min(j)));
                continue;
            }
            visited.push(t);
            if let Some(e) = f.tvs[t].definition {
                stack.extend(f.exprs[e].input_tvs());
            }
        }
        let mine = nest.get(&o).copied().unwrap_or(k).min(found.unwrap_or(k));
        for t in visited {
            owner.insert(t, mine);
        }
        nest.entry(o).or_insert(mine);
    }
    nest
}

/// True when output `tv` is a copy of a reduction that is not inlined into it: a register
/// accumulator whose reduction runs in loops of its own, stored after them.
pub fn accumulator_store(f: &Fusion, tv: TvId) -> bool {
    let Some(e) = f.tvs[tv].definition else { return false };
    if !matches!(f.exprs[e].op, crate::ir::Op::Set) {
        return false;
    }
    f.exprs[e].input_tvs().all(|p| {
        f.tvs[p].inline_pos == 0
            && !f.is_output(p)
            && f.tvs[p].definition.is_some_and(|d| matches!(f.exprs[d].op, crate::ir::Op::Reduction { .. }))
    })
}

/// True when `tv` is, or is computed from, a reduction over a block-parallel axis.
fn after_grid_reduction(f: &Fusion, tv: TvId) -> bool {
    let mut stack = vec![tv];
    let mut seen: FxHashSet<TvId> = FxHashSet::default();
    while let Some(t) = stack.pop() {
        if !seen.insert(t) {
            continue;
        }
        let Some(e) = f.tvs[t].definition else { continue };
        let grid = matches!(f.exprs[e].op, crate::ir::Op::Reduction { .. })
            && f.tvs[t]
                .loop_domain
                .iter()
                .any(|&id| f.ids[id].iter_type == crate::ir::IterType::Reduction && f.is_grid_dim(f.ids[id].parallel));
        if grid {
            return true;
        }
        stack.extend(f.exprs[e].input_tvs());
    }
    false
}

fn visit(f: &Fusion, tv: TvId, deep: bool, done: &mut FxHashSet<ExprId>, order: &mut Vec<ExprId>) {
    let Some(e) = f.tvs[tv].definition else {
        return;
    };
    if done.contains(&e) {
        return;
    }
    done.insert(e);
    // Producers not inlined here go first, then inlined ones from shallowest to deepest,
    // so nothing lands between an inlined producer and its consumer. Anything further up
    // that is shallower than every direct producer (a reduction feeding one of several
    // operands) goes before all of them: placed later, it would close loops that a
    // sibling operand opened and the consumer still needs. With `deep`, so does anything
    // shallower than the deepest direct producer (a vectorized copy of an input, in a loop
    // of its own, under one operand of a `where` whose mask is inlined deeper).
    let mut producers: Vec<TvId> = f.exprs[e].input_tvs().collect();
    // Only siblings can be split apart this way: a single producer needs no look-ahead
    // (which keeps the common chain linear instead of quadratic).
    if producers.len() > 1 {
        let positions = producers.iter().map(|&p| f.tvs[p].inline_pos);
        let floor = if deep { positions.max() } else { positions.min() }.unwrap_or(0);
        for u in shallower_pending(f, &producers, floor, done) {
            visit(f, u, deep, done, order);
        }
    }
    producers.sort_by_key(|&p| f.tvs[p].inline_pos);
    for p in producers {
        visit(f, p, deep, done, order);
    }
    order.push(e);
}

/// Tensors upstream of `from` (not themselves) whose exprs are not placed yet and whose
/// inline position is below `floor` or zero, shallowest first.
fn shallower_pending(f: &Fusion, from: &[TvId], floor: usize, done: &FxHashSet<ExprId>) -> Vec<TvId> {
    let mut found = Vec::new();
    let mut seen: FxHashSet<TvId> = FxHashSet::default();
    let mut stack: Vec<TvId> = Vec::new();
    for &p in from {
        if let Some(e) = f.tvs[p].definition {
            stack.extend(f.exprs[e].input_tvs());
        }
    }
    while let Some(t) = stack.pop() {
        let Some(e) = f.tvs[t].definition else { continue };
        if done.contains(&e) || !seen.insert(t) {
            continue;
        }
        // A tensor that is not inlined closes its own nest: placed between two siblings that
        // share an inlined producer's loops, it would close theirs.
        if f.tvs[t].inline_pos < floor || f.tvs[t].inline_pos == 0 {
            found.push(t);
        }
        stack.extend(f.exprs[e].input_tvs());
    }
    found.sort_by_key(|&t| f.tvs[t].inline_pos);
    found
}

/// Rank of each tensor in producer-before-consumer order (inputs first).
pub fn tensor_order(f: &Fusion, order: &[ExprId]) -> FxHashMap<TvId, usize> {
    let mut rank = FxHashMap::default();
    for op in &f.inputs {
        if let Some(t) = op.tensor() {
            rank.insert(t, 0);
        }
    }
    for (i, &e) in order.iter().enumerate() {
        rank.insert(f.exprs[e].output, i + 1);
        for t in f.exprs[e].input_tvs() {
            rank.entry(t).or_insert(0);
        }
    }
    rank
}

/// Build the loop nest of `order`; loop variables are added to `f.scalars`.
pub fn run(f: &mut Fusion, lg: &LoopGraph, order: &[ExprId]) -> Result<(Vec<Node>, u32)> {
    let mut body: Vec<Node> = Vec::new();
    let mut opened: FxHashSet<usize> = FxHashSet::default();
    let mut next_index = 0u32;
    let paths: Vec<Vec<usize>> = order
        .iter()
        .map(|&e| {
            let out = f.exprs[e].output;
            (0..f.tvs[out].loop_domain.len()).map(|a| lg.group(out, a)).collect()
        })
        .collect();
    // The last expr (by position in `order`) whose loops include each group.
    let mut last_need: FxHashMap<usize, usize> = FxHashMap::default();
    for (i, p) in paths.iter().enumerate() {
        for &g in p {
            last_need.insert(g, i);
        }
    }
    for (i, &e) in order.iter().enumerate() {
        let out = f.exprs[e].output;
        let path = &paths[i];
        let mut cur = &mut body;
        let mut k = 0;
        while k < path.len() {
            let reuse = matches!(cur.last(), Some(Node::Loop(l)) if l.group == Some(path[k]));
            if !reuse {
                break;
            }
            let Some(Node::Loop(l)) = cur.last_mut() else { unreachable!("checked above") };
            cur = &mut l.body;
            k += 1;
        }
        if k == path.len() {
            // An expr outside a thread-parallel loop that later exprs still need (a per-row
            // value between two block reductions of the same row) goes inside it rather
            // than closing it: a thread loop runs once per thread, so each thread computes
            // the value redundantly (one of them stores it), and the loop stays open.
            loop {
                let descend = matches!(cur.last(), Some(Node::Loop(l))
                    if l.parallel.is_thread_or_block() && l.group.and_then(|g| last_need.get(&g)).is_some_and(|&j| j > i));
                if !descend {
                    break;
                }
                let Some(Node::Loop(l)) = cur.last_mut() else { unreachable!("checked above") };
                cur = &mut l.body;
            }
        }
        for &g in path[k..].iter() {
            if !opened.insert(g) {
                let (tv, axis) = lg.groups[g].members[0];
                if std::env::var("KDBG").is_ok() {
                    eprintln!(
                        "{}\nORDER {:?}",
                        f.math_string(),
                        order.iter().map(|&e| f.tv_name(f.exprs[e].output)).collect::<Vec<_>>()
                    );
                }
                bail!(
                    "cannot place {}: its loop axis {} is shared with {} axis {axis}, but that loop was already closed by other computation; inline {} and its producers consistently",
                    f.tv_name(out),
                    path.iter().position(|&x| x == g).unwrap_or(0),
                    f.tv_name(tv),
                    f.tv_name(out)
                );
            }
            let info = &lg.groups[g];
            // A serial loop over a broadcast axis that nothing concretizes (a split of a
            // size-one axis leaves a broadcast inner axis of the factor's extent) runs once:
            // every pass would compute the same element again, and a reduction inside it
            // would add its row once per pass.
            let trivial = f.ids[info.promoted].iter_type == IterType::Broadcast
                && matches!(info.parallel, ParallelType::Serial | ParallelType::Unroll | ParallelType::Unswitch);
            let extent = if trivial { f.scalars.int(1) } else { f.ids[info.promoted].extent };
            let index = if info.parallel.is_thread_or_block() {
                f.scalars.symbol(Symbol::ParallelIndex(info.parallel))
            } else {
                next_index += 1;
                let sym = Symbol::LoopIndex(next_index - 1);
                if let Some(c) = f.scalars.as_int(extent) {
                    f.scalars.set_bound(sym, c);
                }
                f.scalars.symbol(sym)
            };
            cur.push(Node::Loop(ForLoop {
                group: Some(g),
                id: info.promoted,
                index,
                extent,
                parallel: info.parallel,
                init_axis: None,
                pipeline: None,
                body: Vec::new(),
            }));
            let Some(Node::Loop(l)) = cur.last_mut() else { unreachable!("just pushed") };
            cur = &mut l.body;
        }
        cur.push(Node::Expr { expr: e, index: None });
    }
    // A parallel type all of whose loops share one extent, launched with exactly that many
    // threads or blocks: its index is below it.
    let extents = crate::lower::launch::ParallelExtents::of(f, &body);
    for (&p, (v, _)) in &extents.0 {
        if let [e] = v.as_slice() {
            if !extents.ragged(f, p) {
                f.scalars.set_symbolic_bound(Symbol::ParallelIndex(p), *e);
            }
        }
    }
    // Thread and block indices stay below the largest extent of their loops.
    let mut widest: FxHashMap<crate::ir::ParallelType, Option<i64>> = FxHashMap::default();
    for g in &lg.groups {
        if g.parallel.is_thread_or_block() {
            let c = f.scalars.as_int(f.ids[g.promoted].extent);
            let e = widest.entry(g.parallel).or_insert(Some(0));
            *e = e.zip(c).map(|(a, b)| a.max(b));
        }
    }
    for (p, w) in widest {
        if let Some(w) = w {
            f.scalars.set_bound(Symbol::ParallelIndex(p), w);
        }
    }
    Ok((body, next_index))
}
