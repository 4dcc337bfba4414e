//! Reduction hoisting.
//! Consumes: the indexed, synchronized nest. Produces: `ForLoop::hoisted` entries.
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
use crate::ir::{ExprId, Fusion, IterType, Op, Symbol, ValId};
use crate::kernel::{Hoisted, Node};

struct Frame {
    path: Vec<usize>,
    group: Option<usize>,
    is_parallel: bool,
    index: ValId,
}

fn symbols(f: &Fusion, v: ValId, out: &mut FxHashSet<Symbol>) {
    match f.scalars.get(v) {
        Val::Symbol(s) => {
            out.insert(s);
        }
        Val::Binary(_, a, b) => {
            symbols(f, a, out);
            symbols(f, b, out);
        }
        _ => {}
    }
}

/// Find and record hoistable reductions in `body`.
pub fn run(f: &Fusion, lg: &LoopGraph, body: &mut [Node]) -> Result<()> {
    let mut found: Vec<(Vec<usize>, Hoisted)> = Vec::new();
    let mut stack: Vec<Frame> = Vec::new();
    walk(f, lg, body, &mut Vec::new(), &mut stack, &mut found)?;
    for (path, h) in found {
        let mut cur: &mut [Node] = body;
        let mut target = None;
        for (k, &i) in path.iter().enumerate() {
            let Node::Loop(l) = &mut cur[i] else { crate::bail_internal!("hoist path is not a loop") };
            if k + 1 == path.len() {
                target = Some(l);
                break;
            }
            cur = &mut l.body;
        }
        if let Some(l) = target {
            l.hoisted.push(h);
        }
    }
    Ok(())
}

fn walk(
    f: &Fusion,
    lg: &LoopGraph,
    body: &[Node],
    path: &mut Vec<usize>,
    stack: &mut Vec<Frame>,
    found: &mut Vec<(Vec<usize>, Hoisted)>,
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
    found: &mut Vec<(Vec<usize>, Hoisted)>,
) -> Result<()> {
    let c = f.exprs[e].output;
    let ld = &f.tvs[c].loop_domain;
    let reduced: Vec<_> = (0..ld.len())
        .filter(|&a| f.ids[ld[a]].iter_type == IterType::Reduction)
        .map(|a| lg.groups[lg.group(c, a)].parallel)
        .collect();
    if !reduced.iter().any(|p| p.is_thread_or_block()) {
        return Ok(());
    }
    let is_grid = reduced.iter().any(|p| p.is_block());
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
    symbols(f, ix.out, &mut used);
    symbols(f, ix.write_predicate, &mut used);
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
    found.push((stack[k].path.clone(), Hoisted { expr: e, complete }));
    Ok(())
}
