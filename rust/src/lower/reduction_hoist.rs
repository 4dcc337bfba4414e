//! Reduction hoisting.
//! Consumes: the indexed, synchronized nest. Produces: register accumulators
//! (`AccumulatorInit`, `Accumulate`, `ReduceAccumulator` nodes).
//! Guarantees: a reduction across threads or blocks that sits inside serial loops over
//! its own reduction axes accumulates in a per-thread register through those loops and
//! runs its block/grid reduction once, after the outermost of them (what an rfactor
//! would do). A reduction across blocks that cannot be hoisted is an error, because the
//! parallel grid protocol must run once per output element.

use rustc_hash::FxHashSet;

use crate::analysis::loop_graph::LoopGraph;
use crate::bail;
use crate::error::Result;
use crate::ir::scalar::Val;
use crate::ir::{ExprId, Fusion, IterType, Op, Symbol, TvId, ValId};
use crate::kernel::{AccessIndex, Accumulator, Node};

struct Frame {
    path: Vec<usize>,
    group: Option<usize>,
    is_parallel: bool,
    index: ValId,
}

/// A hoistable reduction found in the nest: the path of its outermost hoisted loop.
struct Hoist {
    path: Vec<usize>,
    expr: ExprId,
    complete: bool,
}

/// Rewrite every hoistable reduction of `body` into a register accumulator: an
/// `AccumulatorInit` before its outermost hoisted loop, `Accumulate` in place of the
/// reduction inside it, a `ReduceAccumulator` after it (and no init statements for a
/// complete one, whose reduction stores every element).
pub fn run(f: &Fusion, lg: &LoopGraph, body: &mut Vec<Node>) -> Result<()> {
    let mut found: Vec<Hoist> = Vec::new();
    let mut stack: Vec<Frame> = Vec::new();
    walk(f, lg, body, &mut Vec::new(), &mut stack, &mut found)?;
    // Deepest and latest first: inserting around one loop moves no path still to come.
    found.sort_by(|a, b| b.path.cmp(&a.path));
    let mut next_id = 0u32;
    let mut stored_whole: FxHashSet<TvId> = FxHashSet::default();
    let mut i = 0;
    while i < found.len() {
        let path = found[i].path.clone();
        // In the order the walk found them (the sort is stable): program order.
        let group: Vec<&Hoist> = found[i..].iter().take_while(|h| h.path == path).collect();
        i += group.len();
        let (&at, parent) = path.split_last().expect("a hoist path names a loop");
        let list = scope_mut(body, parent)?;
        let mut before = Vec::new();
        let mut after = Vec::new();
        for h in group {
            let acc = Accumulator { id: next_id, expr: h.expr };
            next_id += 1;
            let Some(index) = accumulate_in(&mut list[at], &acc) else {
                crate::bail_internal!("hoisted reduction of {} is not in its loop", f.tv_name(f.exprs[h.expr].output))
            };
            if h.complete {
                stored_whole.insert(f.exprs[h.expr].output);
            }
            // After the loops only the output's offset and the write guard are defined.
            let index = AccessIndex {
                out: index.out,
                inputs: vec![None; index.inputs.len()],
                predicate: index.write_predicate,
                write_predicate: index.write_predicate,
                gathers: Vec::new(),
                element: None,
            };
            before.push(Node::AccumulatorInit(acc.clone()));
            after.push(Node::ReduceAccumulator { acc, index, complete: h.complete, grouped: false });
        }
        let n_before = before.len();
        list.splice(at + 1..at + 1, after);
        list.splice(at..at, before);
        debug_assert!(matches!(list[at + n_before], Node::Loop(_)));
    }
    if !stored_whole.is_empty() {
        drop_inits(body, &stored_whole);
    }
    Ok(())
}

/// The node list at `path` (indices of loops from the top).
fn scope_mut<'a>(body: &'a mut Vec<Node>, path: &[usize]) -> Result<&'a mut Vec<Node>> {
    let mut cur = body;
    for &i in path {
        let Some(Node::Loop(l)) = cur.get_mut(i) else { crate::bail_internal!("hoist path is not a loop") };
        cur = &mut l.body;
    }
    Ok(cur)
}

/// Replace the reduction `acc.expr` under `n` by an `Accumulate` into `acc`; its index.
fn accumulate_in(n: &mut Node, acc: &Accumulator) -> Option<AccessIndex> {
    match n {
        Node::Expr { expr, index: Some(ix) } if *expr == acc.expr => {
            let ix = ix.clone();
            *n = Node::Accumulate { acc: acc.clone(), index: ix.clone() };
            Some(ix)
        }
        _ => n.bodies_mut().into_iter().find_map(|b| b.iter_mut().find_map(|c| accumulate_in(c, acc))),
    }
}

/// Remove the init statements of `tvs` and the loops that held nothing else.
fn drop_inits(body: &mut Vec<Node>, tvs: &FxHashSet<TvId>) {
    body.retain_mut(|n| match n {
        Node::Init { tv, .. } => !tvs.contains(tv),
        Node::Loop(l) if !l.body.is_empty() => {
            drop_inits(&mut l.body, tvs);
            !l.body.is_empty()
        }
        _ => true,
    });
}

fn walk(
    f: &Fusion,
    lg: &LoopGraph,
    body: &[Node],
    path: &mut Vec<usize>,
    stack: &mut Vec<Frame>,
    found: &mut Vec<Hoist>,
) -> Result<()> {
    for (i, n) in body.iter().enumerate() {
        path.push(i);
        match n {
            Node::Loop(l) => {
                stack.push(Frame {
                    path: path.clone(),
                    group: l.group,
                    is_parallel: l.parallel.is_thread_or_block(),
                    index: l.index,
                });
                walk(f, lg, &l.body, path, stack, found)?;
                stack.pop();
            }
            Node::Expr { expr, index: Some(ix) } => {
                if let Op::Reduction { .. } = f.exprs[*expr].op {
                    consider(f, lg, *expr, ix, stack, found)?;
                }
            }
            _ => {}
        }
        path.pop();
    }
    Ok(())
}

fn consider(
    f: &Fusion,
    lg: &LoopGraph,
    e: ExprId,
    ix: &crate::kernel::AccessIndex,
    stack: &[Frame],
    found: &mut Vec<Hoist>,
) -> Result<()> {
    let c = f.exprs[e].output;
    let ld = &f.tvs[c].loop_domain;
    let reduced: Vec<_> = (0..ld.len())
        .filter(|&a| f.ids[ld[a]].iter_type == IterType::Reduction)
        .map(|a| lg.groups[lg.group(c, a)].parallel)
        .collect();
    let is_grid = reduced.iter().any(|&p| f.is_grid_dim(p));
    if f.hand_schedule && f.tvs[c].serial_grid_reduction && !is_grid {
        bail!(
            "{}.set_serial_grid_reduction(): {} reduces across no blocks (its reduced axes run on {}); a serial grid reduction needs a reduced axis on BIDx, BIDy or BIDz",
            f.tv_name(c),
            f.tv_name(c),
            if reduced.is_empty() {
                "no thread or block dimension".to_string()
            } else {
                reduced.iter().map(|p| format!("{p:?}")).collect::<Vec<_>>().join(", ")
            }
        );
    }
    if !reduced.iter().any(|p| p.is_thread_or_block()) {
        return Ok(());
    }
    let own_groups: FxHashSet<usize> =
        (0..ld.len()).filter(|&a| f.ids[ld[a]].iter_type == IterType::Reduction).map(|a| lg.group(c, a)).collect();
    // Walk outward over loops that are this reduction's axes or thread/block loops.
    let mut hoist: Option<usize> = None;
    let mut serial_reduction_loops = 0;
    for (k, fr) in stack.iter().enumerate().rev() {
        let own_reduction = fr.group.is_some_and(|g| own_groups.contains(&g));
        if fr.is_parallel {
            continue;
        }
        if own_reduction {
            hoist = Some(k);
            serial_reduction_loops += 1;
            continue;
        }
        break;
    }
    // The parallel grid protocol reuses its work buffer: it must run once per output
    // element, so no serial loop may repeat the call.
    let call_depth = hoist.unwrap_or(stack.len());
    if is_grid && !f.tvs[c].serial_grid_reduction {
        if let Some(fr) = stack[..call_depth].iter().rev().find(|fr| !fr.is_parallel) {
            let label = fr.group.map(|g| f.id_label(lg.groups[g].promoted)).unwrap_or_default();
            bail!(
                "{}: its reduction across blocks would run once per iteration of the serial loop {label}; parallelize that axis (TIDx/TIDy/BIDy) or move it inside the reduction's serial loops, or call {}.set_serial_grid_reduction()",
                f.tv_name(c),
                f.tv_name(c)
            );
        }
    }
    let Some(k) = hoist else { return Ok(()) };
    // The write after the loops may only use indices that are still defined there.
    let inner: FxHashSet<Symbol> = stack[k..]
        .iter()
        .filter(|fr| !fr.is_parallel)
        .filter_map(|fr| if let Val::Symbol(s) = f.scalars.get(fr.index) { Some(s) } else { None })
        .collect();
    let mut used = FxHashSet::default();
    crate::lower::predicate::symbols(&f.scalars, ix.out, &mut used);
    crate::lower::predicate::symbols(&f.scalars, ix.write_predicate, &mut used);
    if used.iter().any(|s| inner.contains(s)) {
        if is_grid && !f.tvs[c].serial_grid_reduction {
            bail!(
                "{}: its reduction across blocks sits inside {serial_reduction_loops} serial reduction loop(s) that cannot be hoisted; parallelize them (e.g. TIDy) or call {}.set_serial_grid_reduction()",
                f.tv_name(c),
                f.tv_name(c)
            );
        }
        return Ok(());
    }
    // A serial loop over the reduction's own axes further out (beyond a kept axis) runs
    // the hoisted reduction once per iteration: each result is a partial one.
    let complete = !stack[..k].iter().any(|fr| !fr.is_parallel && fr.group.is_some_and(|g| own_groups.contains(&g)));
    found.push(Hoist { path: stack[k].path.clone(), expr: e, complete });
    Ok(())
}
