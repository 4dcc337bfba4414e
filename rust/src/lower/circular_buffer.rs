//! Circular buffering (rule 9 of seed 000).
//! Consumes: the nest after sibling loop fusion, with each circular-buffered Shared copy's
//! `Allocate` already holding `stages` buffers (the allocation pass prepends the stage
//! dimension; the tensor's `AllocationInfo` keeps one buffer's layout for indexing).
//! Produces: each pipelined loop split in three — a prologue loading the first `prefetch`
//! iterations, the main loop loading iteration `i + prefetch` before computing iteration
//! `i`, and an epilogue computing the last `prefetch` iterations — with every access of
//! the tensor moved to its stage (`(iteration % stages) * buffer size`), and the barriers
//! its reads by other threads need.
//! Guarantees: a stage is overwritten only after every thread finished reading it (a
//! barrier separates them: the next iteration's read barrier when `prefetch < stages - 1`,
//! else one at the end of the iteration), and read only after a barrier that follows its
//! load. `syncs` leaves these tensors to this pass.

use crate::analysis::id_graph::IdGraph;
use crate::analysis::loop_graph::{LoopGraph, LoopGroup};
use crate::analysis::parallel::cross_reads;
use crate::error::Result;
use crate::ir::scalar::{ScalarOp, Val};
use crate::ir::{CircularBuffer, ExprId, Fusion, IterType, MemoryType, Op, Operand, ParallelType, Symbol, TvId, ValId};
use crate::kernel::{AllocTarget, ForLoop, Node, PipelinePart, SyncKind};
use crate::{bail, bail_internal};

/// The loop axis of `tv` whose loop is pipelined: the innermost serial, non-broadcast axis
/// left of its inline position (axes between it and the inline position run on threads or
/// blocks, so one iteration of that loop loads one buffer).
pub fn pipelined_axis(f: &Fusion, lg: &LoopGraph, tv: TvId) -> Option<usize> {
    let t = &f.tvs[tv];
    (0..t.inline_pos.min(t.loop_domain.len())).rev().find(|&a| {
        let g = &lg.groups[lg.group(tv, a)];
        let id = &f.ids[g.promoted];
        g.parallel == ParallelType::Serial
            && id.iter_type != IterType::Broadcast
            && f.scalars.as_int(id.extent) != Some(1)
    })
}

/// The schedule rules of circular buffering, each error naming the tensor and what to
/// change: a Shared copy of a fusion input, inlined inside a serial loop that all its
/// readers share, with one set of options per pipelined loop.
pub fn check(f: &Fusion, lg: &LoopGraph) -> Result<()> {
    let mut loops: Vec<(LoopGroup, TvId, CircularBuffer)> = Vec::new();
    for tv in f.tvs.keys() {
        let Some(cb) = f.tvs[tv].circular_buffer else { continue };
        if !lg.has(tv) || f.tvs[tv].definition.is_none() {
            continue;
        }
        let t = &f.tvs[tv];
        let name = f.tv_name(tv);
        let what = format!("circular_buffer {name} ({} stages, prefetch {})", cb.stages, cb.prefetch);
        if t.memory != MemoryType::Shared {
            bail!(
                "{what}: {name} is in {} memory; only a Shared copy is circular-buffered (call {name}.set_memory_type(MemoryType.Shared))",
                t.memory.enum_name()
            );
        }
        let Some(e) = t.definition else { continue };
        let src = match (&f.exprs[e].op, f.exprs[e].inputs.first()) {
            (Op::Set, Some(Operand::Tensor(s))) => *s,
            _ => bail!(
                "{what}: {name} is defined by `{}`; only a copy of a fusion input (x.cache_after()) is circular-buffered",
                f.expr_short(&f.exprs[e])
            ),
        };
        if !f.is_input(src) {
            bail!(
                "{what}: {name} copies {}, which the kernel computes; only a copy of a fusion input can be loaded ahead of its use",
                f.tv_name(src)
            );
        }
        let Some(axis) = pipelined_axis(f, lg, tv) else {
            let outer: Vec<String> =
                (0..t.inline_pos.min(t.loop_domain.len())).map(|a| f.id_label(lg.promoted(tv, a))).collect();
            bail!(
                "{what}: no serial loop to pipeline: {name} is inlined at position {} and its outer loops [{}] all run on threads or blocks (or have one iteration); inline {name} inside a serial loop with inline_at",
                t.inline_pos,
                outer.join(", ")
            );
        };
        let g = lg.group(tv, axis);
        for &u in &t.uses {
            let c = f.exprs[u].output;
            let inside = (0..f.tvs[c].loop_domain.len()).any(|b| lg.group(c, b) == g);
            if !inside {
                bail!(
                    "{what}: its reader {} runs outside the pipelined loop ({name} axis {axis}, {}); inline {} at least up to that loop so each buffer is read in the iteration that loaded it",
                    f.tv_name(c),
                    f.id_label(lg.promoted(tv, axis)),
                    f.tv_name(c)
                );
            }
        }
        if let Some(&(_, other, ocb)) = loops.iter().find(|(og, _, _)| *og == g) {
            if ocb != cb {
                bail!(
                    "{what}: {} is pipelined in the same loop with {} stages and prefetch {}; tensors of one loop share their options",
                    f.tv_name(other),
                    ocb.stages,
                    ocb.prefetch
                );
            }
        }
        loops.push((g, tv, cb));
    }
    Ok(())
}

/// The circular-buffered tensors of the kernel, grouped by their pipelined loop.
fn pipelines(f: &Fusion, lg: &LoopGraph) -> Vec<(LoopGroup, CircularBuffer, Vec<TvId>)> {
    let mut out: Vec<(LoopGroup, CircularBuffer, Vec<TvId>)> = Vec::new();
    for tv in f.tvs.keys() {
        let Some(cb) = f.tvs[tv].circular_buffer else { continue };
        if !lg.has(tv) || f.tvs[tv].definition.is_none() {
            continue;
        }
        let Some(axis) = pipelined_axis(f, lg, tv) else { continue };
        let g = lg.group(tv, axis);
        match out.iter_mut().find(|p| p.0 == g) {
            Some(p) => p.2.push(tv),
            None => out.push((g, cb, vec![tv])),
        }
    }
    out
}

/// True when `tv` is circular-buffered in this kernel (`syncs` leaves its barriers here).
pub fn is_pipelined(f: &Fusion, tv: TvId) -> bool {
    f.tvs[tv].circular_buffer.is_some() && f.tvs[tv].memory == MemoryType::Shared
}

fn contains_def(f: &Fusion, n: &Node, tvs: &[TvId]) -> bool {
    match n {
        Node::Expr { expr, .. } => tvs.contains(&f.exprs[*expr].output),
        _ => n.bodies().iter().any(|b| b.iter().any(|c| contains_def(f, c, tvs))),
    }
}

/// Path (child positions through loop bodies) of the loop of `group` holding a definition
/// of `tvs`.
fn find_loop(f: &Fusion, body: &[Node], group: LoopGroup, tvs: &[TvId], path: &mut Vec<usize>) -> bool {
    for (i, n) in body.iter().enumerate() {
        if let Node::Loop(l) = n {
            if !contains_def(f, n, tvs) {
                continue;
            }
            path.push(i);
            if l.group == Some(group) || find_loop(f, &l.body, group, tvs, path) {
                return true;
            }
            path.pop();
        }
    }
    false
}

fn list_at<'a>(body: &'a mut Vec<Node>, path: &[usize]) -> &'a mut Vec<Node> {
    let mut cur = body;
    for &i in path {
        let Node::Loop(l) = &mut cur[i] else { unreachable!("paths go through loops") };
        cur = &mut l.body;
    }
    cur
}

/// Add `write` to the offsets that write `tv` and `read` to those that read it.
fn offset_accesses(f: &mut Fusion, n: &mut Node, tv: TvId, write: Option<ValId>, read: Option<ValId>) {
    let reads_of = |f: &Fusion, e: ExprId| -> Vec<usize> {
        f.exprs[e].inputs.iter().enumerate().filter(|(_, o)| **o == Operand::Tensor(tv)).map(|(k, _)| k).collect()
    };
    let (expr, ix) = match n {
        Node::Expr { expr, index: Some(ix) } => (*expr, ix),
        Node::Accumulate { acc, index: ix } | Node::ReduceAccumulator { acc, index: ix, .. } => (acc.expr, ix),
        _ => {
            for b in n.bodies_mut() {
                for c in b.iter_mut() {
                    offset_accesses(f, c, tv, write, read);
                }
            }
            return;
        }
    };
    if let Some(w) = write.filter(|_| f.exprs[expr].output == tv) {
        ix.out = f.scalars.add(ix.out, w);
    }
    if let Some(r) = read {
        for k in reads_of(f, expr) {
            if let Some(v) = ix.inputs.get_mut(k).and_then(|v| v.as_mut()) {
                *v = f.scalars.add(*v, r);
            }
        }
        for g in ix.gathers.iter_mut().filter(|g| g.index_tv == tv) {
            g.at = f.scalars.add(g.at, r);
        }
    }
}

/// AND `cond` into the guard of every statement in `n`.
fn guard(f: &mut Fusion, n: &mut Node, cond: ValId) {
    match n {
        Node::Expr { index: Some(ix), .. } | Node::Init { index: Some(ix), .. } => {
            ix.predicate = f.scalars.binary(ScalarOp::And, ix.predicate, cond);
            ix.write_predicate = f.scalars.binary(ScalarOp::And, ix.write_predicate, cond);
        }
        _ => {
            for b in n.bodies_mut() {
                for c in b.iter_mut() {
                    guard(f, c, cond);
                }
            }
        }
    }
}

/// `nodes` with the pipelined loop's index `sym` replaced by `at`, the accesses of each
/// tensor moved to the stage of iteration `at` (writes when `writes`, else reads).
fn at_iteration(
    f: &mut Fusion,
    nodes: &[Node],
    sym: Symbol,
    at: ValId,
    tvs: &[(TvId, ValId)],
    stages: i64,
    writes: bool,
) -> Vec<Node> {
    let s = f.scalars.int(stages);
    let stage = f.scalars.binary(ScalarOp::Mod, at, s);
    let mut out = nodes.to_vec();
    for n in out.iter_mut() {
        n.map_vals(&mut |v| f.scalars.substitute(v, sym, at));
        for &(tv, size) in tvs {
            let off = f.scalars.mul(stage, size);
            let (w, r) = if writes { (Some(off), None) } else { (None, Some(off)) };
            offset_accesses(f, n, tv, w, r);
        }
    }
    out
}

fn fresh_index(f: &mut Fusion, next_index: &mut u32, bound: Option<i64>) -> ValId {
    let sym = Symbol::LoopIndex(*next_index);
    *next_index += 1;
    if let Some(b) = bound {
        f.scalars.set_bound(sym, b);
    }
    f.scalars.symbol(sym)
}

/// Pipeline every circular-buffered loop of `body`.
pub fn run(f: &mut Fusion, lg: &LoopGraph, exact: &IdGraph, body: &mut Vec<Node>, next_index: &mut u32) -> Result<()> {
    for (group, cb, tvs) in pipelines(f, lg) {
        let stages = i64::from(cb.stages);
        let prefetch = i64::from(cb.prefetch);
        // One buffer's elements per tensor: the Allocate's shape after its stage dimension.
        let mut sized: Vec<(TvId, ValId)> = Vec::new();
        for &tv in &tvs {
            let alloc = body.iter().find_map(|n| match n {
                Node::Alloc(a) if a.target == AllocTarget::Tensor(tv) => Some(a.shape.clone()),
                _ => None,
            });
            let Some(shape) = alloc.filter(|s| s.len() >= 2 && f.scalars.as_int(s[0]) == Some(stages)) else {
                bail_internal!(
                    "circular buffer {}: no Allocate with {stages} stages at the top of the kernel",
                    f.tv_name(tv)
                );
            };
            let size = f.scalars.product(shape[1..].iter().copied());
            sized.push((tv, size));
        }
        // Barriers only where some reader reads what other threads loaded.
        let cross = tvs.iter().any(|&tv| {
            f.tvs[tv].uses.iter().any(|&e| cross_reads(f, lg, exact, tv, e).iter().any(|x| x.pt.is_thread()))
        });
        let mut path = Vec::new();
        if !find_loop(f, body, group, &tvs, &mut path) {
            bail_internal!("circular buffer {}: its pipelined loop is not in the kernel", f.tv_name(tvs[0]));
        }
        let (outer, at) = path.split_at(path.len() - 1);
        let at = at[0];
        // A serial loop around the pipeline runs it again: its prologue must wait for the
        // last reads of the previous run.
        let mut in_serial = false;
        {
            let mut cur: &[Node] = body;
            for &i in outer {
                let Node::Loop(l) = &cur[i] else { unreachable!("paths go through loops") };
                in_serial |= !l.parallel.is_thread_or_block();
                cur = &l.body;
            }
        }
        let Node::Loop(l) = list_at(body, outer).remove(at) else { unreachable!("found a loop") };
        let Val::Symbol(sym) = f.scalars.get(l.index) else {
            bail_internal!("circular buffer {}: the pipelined loop has no loop index", f.tv_name(tvs[0]));
        };
        let (loads, rest): (Vec<Node>, Vec<Node>) = l.body.iter().cloned().partition(|n| contains_def(f, n, &tvs));
        let n = l.extent;
        let d = f.scalars.int(prefetch);
        let zero = f.scalars.int(0);
        let n_const = f.scalars.as_int(n);

        // Prologue: iterations 0 .. prefetch load their stages (those past the end do not).
        let p = fresh_index(f, next_index, Some(prefetch));
        let mut pro = at_iteration(f, &loads, sym, p, &sized, stages, true);
        if n_const.is_none_or(|c| c < prefetch) {
            let inside = f.scalars.lt(p, n);
            for node in pro.iter_mut() {
                guard(f, node, inside);
            }
        }
        // Main: iteration i loads i + prefetch, then computes i.
        let diff = f.scalars.sub(n, d);
        let main_extent = f.scalars.max(diff, zero);
        if let Some(c) = n_const.map(|c| c - prefetch).filter(|&c| c >= 1) {
            f.scalars.set_bound(sym, c);
        }
        let ahead = f.scalars.add(l.index, d);
        let mut main = at_iteration(f, &loads, sym, ahead, &sized, stages, true);
        if cross {
            main.push(Node::Sync(SyncKind::Raw));
        }
        main.extend(at_iteration(f, &rest, sym, l.index, &sized, stages, false));
        if cross && prefetch == stages - 1 {
            // The next iteration loads into the stage this one read.
            main.push(Node::Sync(SyncKind::War));
        }
        // Epilogue: the last iterations compute what is already loaded.
        let epi_extent = f.scalars.min(d, n);
        let e = fresh_index(f, next_index, f.scalars.as_int(epi_extent));
        let from = f.scalars.add(e, main_extent);
        let epi = at_iteration(f, &rest, sym, from, &sized, stages, false);

        let mut nodes = Vec::new();
        if cross && in_serial {
            nodes.push(Node::Sync(SyncKind::War));
        }
        let group = l.group;
        let mk = |part, index, extent, body| {
            Node::Loop(ForLoop {
                group,
                id: l.id,
                index,
                extent,
                parallel: ParallelType::Serial,
                init_axis: None,
                pipeline: Some(part),
                body,
            })
        };
        nodes.push(mk(PipelinePart::Prologue, p, d, pro));
        nodes.push(mk(PipelinePart::Main, l.index, main_extent, main));
        if cross {
            // When the main loop runs no iteration, the prologue's loads are read next.
            nodes.push(Node::Sync(SyncKind::Raw));
        }
        nodes.push(mk(PipelinePart::Epilogue, e, epi_extent, epi));
        let list = list_at(body, outer);
        for (k, node) in nodes.into_iter().enumerate() {
            list.insert(at + k, node);
        }
    }
    Ok(())
}
