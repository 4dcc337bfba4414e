//! Circular buffering (rule 9 of seed 000).
//! Consumes: the nest after sibling loop fusion, with each circular-buffered Shared copy's
//! `Allocate` already holding `stages` buffers (the allocation pass prepends the stage
//! dimension; the tensor's `AllocationInfo` keeps one buffer's layout for indexing).
//! Produces: each pipelined loop split in three — a prologue loading the first `prefetch`
//! iterations, the main loop loading iteration `i + prefetch` before computing iteration
//! `i`, and an epilogue computing the last `prefetch` iterations — with every access of
//! the tensor moved to its stage (`(iteration % stages) * buffer size`), and the barriers
//! its reads by other threads need.
//! A circular-buffered Local copy is the same pipeline in registers: each thread loads its
//! own elements of iteration `i + prefetch` into their stage before computing iteration
//! `i`, and reads only what it loaded, so no barrier or asynchronous copy orders them (a
//! load stalls only the first instruction that reads its register).
//! Copies with a `Bulk` axis become one bulk (TMA) copy per buffer, issued by the block's
//! first thread and ordered by mbarriers instead of block barriers (seed 000, rule 9): a
//! pipelined loop gets `mbar[0:stages]` (read-after-write: a stage's bytes landed) and
//! `mbar[stages:2*stages]` (write-after-read: every thread finished reading a stage),
//! initialised in a stage-depth loop before the prologue and invalidated in one after the
//! epilogue; a bulk copy outside a pipeline gets one barrier, initialised before the copy
//! and invalidated after its wait.
//! Guarantees: a stage is overwritten only after every thread finished reading it (a
//! barrier separates them: the next iteration's read barrier when `prefetch < stages - 1`,
//! else one at the end of the iteration; with bulk copies, the issuing thread's wait on the
//! stage's write-after-read mbarrier), and read only after a barrier (or the read-after-write
//! mbarrier's wait) that follows its load. `syncs` leaves these tensors to this pass.

use crate::analysis::id_graph::IdGraph;
use crate::analysis::loop_graph::{LoopGraph, LoopGroup};
use crate::analysis::parallel::cross_reads;
use crate::error::Result;
use crate::ir::scalar::{ScalarOp, Val};
use crate::ir::{CircularBuffer, ExprId, Fusion, IterType, MemoryType, Op, Operand, ParallelType, Symbol, TvId, ValId};
use crate::kernel::{
    AllocTarget, BarrierArray, BarrierOp, BarrierRef, BulkLoad, CpAsyncOp, ForLoop, KernelSummary, Node, PipelinePart,
    SyncKind,
};
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

/// Clear the circular buffering of each copy whose loops left of its inline position hold
/// no serial loop of more than one iteration but do hold a serial one of exactly one (a
/// constant size, such as the outer part of a split by the whole extent): a one-iteration
/// pipeline has nothing to overlap, and with runtime sizes the same schedule runs its
/// pipeline once. The copy stays a plain Shared (or Local) one.
pub fn drop_single_iteration(f: &mut Fusion, lg: &LoopGraph) {
    let single: Vec<TvId> = f
        .tvs
        .keys()
        .filter(|&tv| {
            let t = &f.tvs[tv];
            t.circular_buffer.is_some()
                && t.definition.is_some()
                && lg.has(tv)
                && pipelined_axis(f, lg, tv).is_none()
                && (0..t.inline_pos.min(t.loop_domain.len())).any(|a| {
                    let g = &lg.groups[lg.group(tv, a)];
                    let id = &f.ids[g.promoted];
                    g.parallel == ParallelType::Serial
                        && id.iter_type != IterType::Broadcast
                        && f.scalars.as_int(id.extent) == Some(1)
                })
        })
        .collect();
    for tv in single {
        f.tvs[tv].circular_buffer = None;
    }
}

/// The schedule rules of circular buffering, each error naming the tensor and what to
/// change: a Shared (or Local) copy of a fusion input, inlined inside a serial loop that all its
/// readers share, with one set of options per pipelined loop.
pub fn check(f: &Fusion, lg: &LoopGraph) -> Result<()> {
    check_bulk(f, lg)?;
    let mut loops: Vec<(LoopGroup, TvId, CircularBuffer)> = Vec::new();
    for tv in f.tvs.keys() {
        let Some(cb) = f.tvs[tv].circular_buffer else { continue };
        if f.tvs[tv].definition.is_none() {
            continue;
        }
        let t = &f.tvs[tv];
        let name = f.tv_name(tv);
        let what = format!("circular_buffer {name} ({} stages, prefetch {})", cb.stages, cb.prefetch);
        if t.memory == MemoryType::Global {
            bail!(
                "{what}: {name} is in Global memory; only a Shared copy (or a Local one, loaded ahead into registers) is circular-buffered (call {name}.set_memory_type(MemoryType.Shared))"
            );
        }
        if t.memory == MemoryType::Local && bulk_axis(f, tv).is_some() {
            bail!("{what}: {name} is in Local memory; a Bulk copy lands in Shared memory");
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
        let axis = if lg.has(tv) { pipelined_axis(f, lg, tv) } else { None };
        let Some(axis) = axis else {
            let outer: Vec<String> = if lg.has(tv) {
                (0..t.inline_pos.min(t.loop_domain.len())).map(|a| f.id_label(lg.promoted(tv, a))).collect()
            } else {
                Vec::new()
            };
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
        if let Some(&(_, other, _)) = loops
            .iter()
            .find(|(og, o, _)| *og == g && (f.tvs[*o].memory == MemoryType::Local) != (t.memory == MemoryType::Local))
        {
            bail!(
                "{what}: {} is pipelined in the same loop in {} memory; the tensors of one loop are all Shared or all Local",
                f.tv_name(other),
                f.tvs[other].memory.enum_name()
            );
        }
        if let Some(&(_, other, ocb)) = loops.iter().find(|(og, _, _)| *og == g) {
            if bulk_axis(f, other).is_some() != bulk_axis(f, tv).is_some() {
                bail!(
                    "{what}: {} is pipelined in the same loop and {} a Bulk copy; the tensors of one loop are all bulk copies or none",
                    f.tv_name(other),
                    if bulk_axis(f, other).is_some() { "is" } else { "is not" }
                );
            }
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

/// The loop axis of `tv` that its copy moves in bulk (`ParallelType::Bulk`), if any.
pub fn bulk_axis(f: &Fusion, tv: TvId) -> Option<usize> {
    f.tvs[tv].loop_domain.iter().position(|&id| f.ids[id].parallel == ParallelType::Bulk)
}

/// The rules of a Bulk copy: a Shared copy of a fusion input whose Bulk axis is its only
/// axis right of the inline position that takes room (one contiguous run per copy), and
/// that no thread dimension partitions (one thread issues the copy for the block).
fn check_bulk(f: &Fusion, lg: &LoopGraph) -> Result<()> {
    for tv in f.tvs.keys() {
        let Some(axis) = bulk_axis(f, tv) else { continue };
        if !lg.has(tv) || f.tvs[tv].definition.is_none() {
            continue;
        }
        let t = &f.tvs[tv];
        let name = f.tv_name(tv);
        let what = format!("{name} axis {axis} (Bulk)");
        if t.memory != MemoryType::Shared {
            bail!(
                "{what}: {name} is in {} memory; a bulk copy lands in Shared memory (call {name}.set_memory_type(MemoryType.Shared))",
                t.memory.enum_name()
            );
        }
        let Some(e) = t.definition else { continue };
        match (&f.exprs[e].op, f.exprs[e].inputs.first()) {
            (Op::Set, Some(Operand::Tensor(src))) if f.is_input(*src) => {}
            _ => bail!(
                "{what}: {name} is defined by `{}`; only a copy of a fusion input (x.cache_after()) is a bulk copy",
                f.expr_short(&f.exprs[e])
            ),
        }
        if axis < t.inline_pos {
            bail!(
                "{what}: the Bulk axis is inside {name}'s inline position {}; a bulk copy moves {name}'s own axes (inline {name} at most at {axis})",
                t.inline_pos
            );
        }
        for (a, &id) in t.loop_domain.iter().enumerate() {
            let pt = if a < t.inline_pos { lg.groups[lg.group(tv, a)].parallel } else { f.ids[id].parallel };
            if pt.is_thread() {
                bail!(
                    "{what}: {name} axis {a} runs on {}; one thread issues a bulk copy for the whole block, so no thread dimension may partition {name}",
                    pt.enum_name()
                );
            }
            let takes_room =
                f.ids[id].iter_type != IterType::Broadcast && f.scalars.as_int(f.ids[id].extent) != Some(1);
            if a >= t.inline_pos && a != axis && takes_room {
                bail!(
                    "{what}: {name} axis {a} ({}) is also right of its inline position {}; a bulk copy moves one contiguous run (a box of several axes needs a tensor map, which kiln does not build): inline {name} up to its Bulk axis",
                    f.id_label(id),
                    t.inline_pos
                );
            }
        }
    }
    Ok(())
}

/// The mbarrier arrays the kernel's bulk copies need (allocated by the allocation pass):
/// `2 * stages` per pipelined loop of bulk copies (read-after-write, then write-after-read),
/// one per bulk copy outside a pipeline.
pub fn barrier_arrays(f: &Fusion, lg: &LoopGraph) -> Vec<BarrierArray> {
    let mut out: Vec<BarrierArray> = Vec::new();
    for (_, cb, tvs) in pipelines(f, lg) {
        if tvs.iter().any(|&tv| bulk_axis(f, tv).is_some()) {
            out.push(BarrierArray { size: 2 * i64::from(cb.stages), tvs });
        }
    }
    for tv in f.tvs.keys() {
        let piped = out.iter().any(|b| b.tvs.contains(&tv));
        if !piped && bulk_axis(f, tv).is_some() && lg.has(tv) && f.tvs[tv].definition.is_some() {
            out.push(BarrierArray { size: 1, tvs: vec![tv] });
        }
    }
    out
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

/// True when this pass orders `tv`'s accesses (a circular-buffered or bulk-copied Shared
/// tensor): `syncs` leaves its barriers here.
pub fn is_pipelined(f: &Fusion, tv: TvId) -> bool {
    f.tvs[tv].memory == MemoryType::Shared && (f.tvs[tv].circular_buffer.is_some() || bulk_axis(f, tv).is_some())
}

fn contains_def(f: &Fusion, n: &Node, tvs: &[TvId]) -> bool {
    match n {
        Node::Expr { expr, .. } => tvs.contains(&f.exprs[*expr].output),
        _ => n.bodies().iter().any(|b| b.iter().any(|c| contains_def(f, c, tvs))),
    }
}

/// True when `n` holds a statement that reads one of `tvs`.
fn reads_any(f: &Fusion, n: &Node, tvs: &[TvId]) -> bool {
    let reads = |e: ExprId| f.exprs[e].input_tvs().any(|t| tvs.contains(&t));
    match n {
        Node::Expr { expr, .. } => reads(*expr),
        Node::Accumulate { acc, .. } | Node::ReduceAccumulator { acc, .. } => reads(acc.expr),
        _ => n.bodies().iter().any(|b| b.iter().any(|c| reads_any(f, c, tvs))),
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
    if let Node::BulkLoad(b) = n {
        if let Some(w) = write.filter(|_| f.exprs[b.expr].output == tv) {
            b.dst = f.scalars.add(b.dst, w);
        }
        return;
    }
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
        Node::BulkLoad(b) => b.guard = f.scalars.binary(ScalarOp::And, b.guard, cond),
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

/// The conjuncts of a predicate.
fn and_terms(f: &Fusion, v: ValId, out: &mut Vec<ValId>) {
    match f.scalars.get(v) {
        Val::Binary(ScalarOp::And, a, b) => {
            and_terms(f, a, out);
            and_terms(f, b, out);
        }
        _ => out.push(v),
    }
}

/// The bulk copy a Bulk loop stands for: its first element's offsets, and how many of its
/// elements are in range (the loop's guard must bound a prefix of the run: terms `x + b <
/// n` in the Bulk index `b`; the others guard the whole copy).
fn bulk_copy(f: &mut Fusion, l: &ForLoop, bar: BarrierRef) -> Result<BulkLoad> {
    let [Node::Expr { expr, index: Some(ix) }] = l.body.as_slice() else {
        bail_internal!("a Bulk loop holds more than its copy");
    };
    let (expr, ix) = (*expr, ix.clone());
    let out = f.exprs[expr].output;
    let name = f.tv_name(out);
    let input = f.exprs[expr].inputs[0].tensor().map_or_else(String::new, |t| f.tv_name(t));
    let (Val::Symbol(sym), Some(width)) = (f.scalars.get(l.index), f.scalars.as_int(l.extent)) else {
        bail_internal!("the Bulk loop of {name} has no index or no constant extent");
    };
    let Some(src) = ix.inputs.first().copied().flatten() else {
        bail_internal!("the bulk copy of {name} reads no tensor");
    };
    let _ = width;
    let zero = f.scalars.int(0);
    // Each offset moves by one element per step of the Bulk index: its value at index 0,
    // and whether it is that plus the index.
    let affine = |f: &mut Fusion, v: ValId| -> (ValId, bool) {
        (f.scalars.substitute(v, sym, zero), coefficient(f, v, sym) == Some(1))
    };
    let (src0, src_ok) = affine(f, src);
    if !src_ok {
        bail!(
            "{name} axis {} (Bulk): a bulk copy moves one contiguous run of {input}, but the Bulk axis does not walk {input}'s elements one by one (offset {}); make it the inner part of {input}'s innermost contiguous axis",
            f.tvs[out].loop_domain.len() - 1,
            f.scalars.render(src)
        );
    }
    let (dst0, dst_ok) = affine(f, ix.out);
    if !dst_ok {
        bail_internal!("the Shared layout of {name} is not contiguous along its Bulk axis");
    }
    let mut guard = f.scalars.boolean(true);
    let mut count = l.extent;
    let mut terms = Vec::new();
    and_terms(f, ix.predicate, &mut terms);
    for term in terms {
        if f.scalars.substitute(term, sym, zero) == term {
            guard = f.scalars.binary(ScalarOp::And, guard, term);
            continue;
        }
        let bound = match f.scalars.get(term) {
            Val::Binary(ScalarOp::Lt, lhs, rhs) => Some((lhs, rhs, 0)),
            Val::Binary(ScalarOp::Le, lhs, rhs) => Some((lhs, rhs, 1)),
            _ => None,
        };
        let mut k = None;
        if let Some((lhs, rhs, plus)) = bound {
            let (lhs0, ok) = affine(f, lhs);
            if ok && f.scalars.substitute(rhs, sym, zero) == rhs {
                let p = f.scalars.int(plus);
                let end = f.scalars.add(rhs, p);
                k = Some(f.scalars.sub(end, lhs0));
            }
        }
        let Some(k) = k else {
            bail!(
                "{name} axis {} (Bulk): a bulk copy moves a contiguous run, but its elements are guarded by `{}`, which does not bound a prefix of the run",
                f.tvs[out].loop_domain.len() - 1,
                f.scalars.render(term)
            );
        };
        count = f.scalars.min(count, k);
    }
    let elems = f.scalars.max(count, zero);
    // Only the block's first thread issues the copy: its thread indices are zero.
    let mut vals = [dst0, src0, elems, guard];
    for pt in [ParallelType::TIDx, ParallelType::TIDy, ParallelType::TIDz] {
        for v in vals.iter_mut() {
            *v = f.scalars.substitute(*v, Symbol::ParallelIndex(pt), zero);
        }
    }
    let [dst, src, elems, guard] = vals;
    Ok(BulkLoad { expr, dst, src, elems, guard, bar, reuse: None })
}

/// The constant `c` with `v = c * sym + (terms free of sym)`, if `v` has that form.
fn coefficient(f: &Fusion, v: ValId, sym: Symbol) -> Option<i64> {
    match f.scalars.get(v) {
        Val::Symbol(s) if s == sym => Some(1),
        Val::Binary(op, a, b) => {
            let (ca, cb) = (coefficient(f, a, sym), coefficient(f, b, sym));
            match op {
                ScalarOp::Add => Some(ca? + cb?),
                ScalarOp::Sub => Some(ca? - cb?),
                ScalarOp::Mul => match (f.scalars.as_int(a), f.scalars.as_int(b)) {
                    (_, Some(k)) => Some(ca? * k),
                    (Some(k), _) => Some(cb? * k),
                    // A product of two non-constant terms is affine only when neither holds sym.
                    _ => (ca? == 0 && cb? == 0).then_some(0),
                },
                _ => (ca? == 0 && cb? == 0).then_some(0),
            }
        }
        _ => Some(0),
    }
}

/// Replace each Bulk loop in `nodes` by its bulk copy on `bar`; the number of copies.
fn to_bulk(f: &mut Fusion, nodes: &mut [Node], bar: BarrierRef) -> Result<usize> {
    let mut copies = 0;
    for n in nodes.iter_mut() {
        let copy = match n {
            Node::Loop(l) if l.parallel == ParallelType::Bulk => Some(bulk_copy(f, l, bar)?),
            _ => None,
        };
        match copy {
            Some(b) => {
                *n = Node::BulkLoad(Box::new(b));
                copies += 1;
            }
            None => {
                for b in n.bodies_mut() {
                    copies += to_bulk(f, b, bar)?;
                }
            }
        }
    }
    Ok(copies)
}

/// Point every bulk copy in `nodes` at barrier `bar`, waiting on `reuse` first.
fn bind_barriers(nodes: &mut [Node], bar: BarrierRef, reuse: Option<(BarrierRef, ValId, ValId)>) {
    for n in nodes.iter_mut() {
        if let Node::BulkLoad(b) = n {
            b.bar = bar;
            b.reuse = reuse;
        }
        for b in n.bodies_mut() {
            bind_barriers(b, bar, reuse);
        }
    }
}

/// A serial loop lowering adds on its own (barrier init and inval).
fn plain_loop(l: &ForLoop, index: ValId, extent: ValId, body: Vec<Node>) -> Node {
    Node::Loop(ForLoop {
        group: None,
        id: l.id,
        index,
        extent,
        parallel: ParallelType::Serial,
        init_axis: None,
        pipeline: None,
        body,
    })
}

fn fresh_index(f: &mut Fusion, next_index: &mut u32, bound: Option<i64>) -> ValId {
    let sym = Symbol::LoopIndex(*next_index);
    *next_index += 1;
    if let Some(b) = bound {
        f.scalars.set_bound(sym, b);
    }
    f.scalars.symbol(sym)
}

/// Pipeline every circular-buffered loop of `body`, and turn Bulk loops into bulk copies.
pub fn run(
    f: &mut Fusion,
    lg: &LoopGraph,
    exact: &IdGraph,
    summary: &mut KernelSummary,
    body: &mut Vec<Node>,
    next_index: &mut u32,
) -> Result<()> {
    let array_of = |tv: TvId| summary.barriers.iter().position(|b| b.tvs.contains(&tv)).map(|i| i as u32);
    for (group, cb, tvs) in pipelines(f, lg) {
        let array = array_of(tvs[0]);
        let registers = f.tvs[tvs[0]].memory == MemoryType::Local;
        if array.is_none() && !registers {
            // Plain copies of a pipeline load asynchronously (cp.async), in one group per
            // iteration.
            summary.async_copies.extend(tvs.iter().copied());
        }
        pipeline(f, lg, exact, body, next_index, group, cb, &tvs, array, registers)?;
    }
    for (i, b) in summary.barriers.iter().enumerate() {
        if b.size == 1 {
            single_bulk_copy(f, body, b.tvs[0], i as u32)?;
        }
    }
    Ok(())
}

/// A bulk copy outside a pipeline: one barrier, initialised at the top of the kernel and
/// invalidated at its end (seed 000: initialised before the load, invalidated after it).
/// Each run of the copy completes one phase, so a wait's parity is the number of runs
/// before it (the enclosing serial loops' iterations, linearised) modulo two; a barrier
/// before the copy lets slow readers of the last run finish (write-after-read).
fn single_bulk_copy(f: &mut Fusion, body: &mut Vec<Node>, tv: TvId, array: u32) -> Result<()> {
    // Path to the Bulk loop holding tv's copy, and the serial loops around it.
    fn find(f: &Fusion, nodes: &[Node], tv: TvId, path: &mut Vec<usize>, serial: &mut Vec<(ValId, ValId)>) -> bool {
        for (i, n) in nodes.iter().enumerate() {
            let Node::Loop(l) = n else { continue };
            if !contains_def(f, n, &[tv]) {
                continue;
            }
            path.push(i);
            if l.parallel == ParallelType::Bulk {
                return true;
            }
            let real = !l.parallel.is_thread_or_block();
            if real {
                serial.push((l.index, l.extent));
            }
            if find(f, &l.body, tv, path, serial) {
                return true;
            }
            if real {
                serial.pop();
            }
            path.pop();
        }
        false
    }
    let (mut path, mut serial) = (Vec::new(), Vec::new());
    if !find(f, body, tv, &mut path, &mut serial) {
        bail_internal!("the Bulk loop of {} is not in the kernel", f.tv_name(tv));
    }
    let (outer, at) = path.split_at(path.len() - 1);
    let at = at[0];
    let zero = f.scalars.int(0);
    let bar = BarrierRef { array, index: zero };
    let mut runs = zero;
    for &(index, extent) in &serial {
        let scaled = f.scalars.mul(runs, extent);
        runs = f.scalars.add(scaled, index);
    }
    let two = f.scalars.int(2);
    let parity = f.scalars.binary(ScalarOp::Mod, runs, two);
    let list = list_at(body, outer);
    let mut copy = vec![list.remove(at)];
    to_bulk(f, &mut copy, bar)?;
    let mut nodes = Vec::new();
    if !serial.is_empty() {
        nodes.push(Node::Sync(SyncKind::War));
    }
    nodes.extend(copy);
    nodes.push(Node::Barrier(BarrierOp::Wait { bar, parity }));
    let list = list_at(body, outer);
    for (k, n) in nodes.into_iter().enumerate() {
        list.insert(at + k, n);
    }
    let one = f.scalars.int(1);
    let top = body.iter().take_while(|n| matches!(n, Node::Alloc(_))).count();
    body.insert(top, Node::Barrier(BarrierOp::Init { bar, arrivals: one }));
    body.insert(top + 1, Node::Sync(SyncKind::Raw));
    body.push(Node::Sync(SyncKind::Raw));
    body.push(Node::Barrier(BarrierOp::Inval { bar }));
    Ok(())
}

/// Split the loop of `group` into prologue, main and epilogue for `tvs`: with block
/// barriers, or with the mbarriers of array `array` where the loads are bulk copies.
#[allow(clippy::too_many_arguments)]
fn pipeline(
    f: &mut Fusion,
    lg: &LoopGraph,
    exact: &IdGraph,
    body: &mut Vec<Node>,
    next_index: &mut u32,
    group: LoopGroup,
    cb: CircularBuffer,
    tvs: &[TvId],
    array: Option<u32>,
    registers: bool,
) -> Result<()> {
    let stages = i64::from(cb.stages);
    let prefetch = i64::from(cb.prefetch);
    // One buffer's elements per tensor: the Allocate's shape after its stage dimension.
    let mut sized: Vec<(TvId, ValId)> = Vec::new();
    for &tv in tvs {
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
    // Block barriers only where some reader reads what other threads loaded; bulk copies
    // are written by the copy engine, so every reader waits on its mbarrier.
    let cross = array.is_none()
        && !registers
        && tvs.iter().any(|&tv| {
            f.tvs[tv].uses.iter().any(|&e| cross_reads(f, lg, exact, tv, e).iter().any(|x| x.pt.is_thread()))
        });
    let mut path = Vec::new();
    if !find_loop(f, body, group, tvs, &mut path) {
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
    let Node::Loop(mut l) = list_at(body, outer).remove(at) else { unreachable!("found a loop") };
    let Val::Symbol(sym) = f.scalars.get(l.index) else {
        bail_internal!("circular buffer {}: the pipelined loop has no loop index", f.tv_name(tvs[0]));
    };
    // Loops between the pipelined loop and the copy that its readers share (block loops, and
    // loops of one iteration) run once per iteration of the pipelined loop: the pipeline
    // moves inside them, so that the copies and their readers are separate children.
    let mut wrappers: Vec<ForLoop> = Vec::new();
    loop {
        let both = |n: &Node| contains_def(f, n, tvs) && reads_any(f, n, tvs);
        let Some(k) = l.body.iter().position(both) else { break };
        // A serial loop of one iteration is its body at index 0.
        if let Node::Loop(w) = &l.body[k] {
            if !w.parallel.is_thread_or_block() && f.scalars.as_int(w.extent) == Some(1) {
                let Node::Loop(w) = l.body.remove(k) else { unreachable!("matched a loop") };
                let zero = f.scalars.int(0);
                let mut inner = w.body;
                if let Val::Symbol(ws) = f.scalars.get(w.index) {
                    for n in inner.iter_mut() {
                        n.map_vals(&mut |v| f.scalars.substitute(v, ws, zero));
                    }
                }
                for (j, n) in inner.into_iter().enumerate() {
                    l.body.insert(k + j, n);
                }
                continue;
            }
        }
        let [Node::Loop(w)] = l.body.as_slice() else { break };
        let movable = w.parallel.is_block();
        if !movable {
            let what = if w.parallel.is_thread() {
                format!("runs on {}", w.parallel.enum_name())
            } else {
                "is a serial loop".to_string()
            };
            bail!(
                "circular_buffer {}: its copy and its readers share loop {} inside the pipelined loop {}, and that loop {what}; the loops between the pipelined loop and the copy may only run on blocks or have one iteration (inline {} one loop deeper, or pipeline that loop)",
                f.tv_name(tvs[0]),
                f.id_label(w.id),
                f.id_label(l.id),
                f.tv_name(tvs[0])
            );
        }
        let Some(Node::Loop(mut w)) = l.body.pop() else { unreachable!("matched a loop") };
        l.body = std::mem::take(&mut w.body);
        wrappers.push(w);
    }
    let (mut loads, rest): (Vec<Node>, Vec<Node>) = l.body.iter().cloned().partition(|n| contains_def(f, n, tvs));
    if let Some(n) = loads.iter().find(|n| reads_any(f, n, tvs)) {
        let label = match n {
            Node::Loop(w) => format!("loop {}", f.id_label(w.id)),
            _ => "one statement".to_string(),
        };
        bail!(
            "circular_buffer {}: its copy and a reader of it share {label} inside the pipelined loop {}; a reader must run after the copy's own loops (inline {} so that its loops right of the pipelined one are its own)",
            f.tv_name(tvs[0]),
            f.id_label(l.id),
            f.tv_name(tvs[0])
        );
    }
    let zero = f.scalars.int(0);
    let s = f.scalars.int(stages);
    let issues = match array {
        Some(a) => to_bulk(f, &mut loads, BarrierRef { array: a, index: zero })?,
        None => 0,
    };
    let raw = |f: &mut Fusion, a: u32, j: ValId| BarrierRef { array: a, index: f.scalars.binary(ScalarOp::Mod, j, s) };
    let war = |f: &mut Fusion, a: u32, j: ValId| {
        let k = f.scalars.binary(ScalarOp::Mod, j, s);
        BarrierRef { array: a, index: f.scalars.add(k, s) }
    };
    // The parity of the phase that iteration j's use of its stage completes (its
    // (j / stages)-th use).
    let parity = |f: &mut Fusion, j: ValId| {
        let two = f.scalars.int(2);
        let u = f.scalars.div(j, s);
        f.scalars.binary(ScalarOp::Mod, u, two)
    };
    let n = l.extent;
    let d = f.scalars.int(prefetch);
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
    // Register stages are plain loads: a thread waits on a load only where it reads the
    // register, so nothing orders them.
    match array {
        Some(a) => {
            let bar = raw(f, a, p);
            bind_barriers(&mut pro, bar, None);
        }
        None if registers => {}
        None => pro.push(Node::CpAsync(CpAsyncOp::Commit)),
    }
    // Main: iteration i loads i + prefetch, then computes i.
    let diff = f.scalars.sub(n, d);
    let main_extent = f.scalars.max(diff, zero);
    if let Some(c) = n_const.map(|c| c - prefetch).filter(|&c| c >= 1) {
        f.scalars.set_bound(sym, c);
    }
    let ahead = f.scalars.add(l.index, d);
    let mut main = at_iteration(f, &loads, sym, ahead, &sized, stages, true);
    if let Some(a) = array {
        // The stage of i + prefetch was read in iteration i + prefetch - stages.
        let bar = raw(f, a, ahead);
        let w = war(f, a, ahead);
        let before = f.scalars.sub(ahead, s);
        let wp = parity(f, before);
        let when = f.scalars.binary(ScalarOp::Le, s, ahead);
        bind_barriers(&mut main, bar, Some((w, wp, when)));
        let bar = raw(f, a, l.index);
        let rp = parity(f, l.index);
        main.push(Node::Barrier(BarrierOp::Wait { bar, parity: rp }));
    } else if !registers {
        // The groups of iterations i .. i + prefetch are in flight: iteration i's has landed
        // once at most `prefetch` remain.
        main.push(Node::CpAsync(CpAsyncOp::Commit));
        main.push(Node::CpAsync(CpAsyncOp::Wait(cb.prefetch)));
    }
    if cross {
        main.push(Node::Sync(SyncKind::Raw));
    }
    main.extend(at_iteration(f, &rest, sym, l.index, &sized, stages, false));
    if let Some(a) = array {
        let bar = war(f, a, l.index);
        main.push(Node::Barrier(BarrierOp::Arrive { bar }));
    }
    if (cross || (array.is_none() && !registers)) && prefetch == stages - 1 {
        // The next iteration loads into the stage this one read (an asynchronous copy is
        // not ordered after its own thread's reads either).
        main.push(Node::Sync(SyncKind::War));
    }
    // Epilogue: the last iterations compute what is already loaded.
    let epi_extent = f.scalars.min(d, n);
    let e = fresh_index(f, next_index, f.scalars.as_int(epi_extent));
    let from = f.scalars.add(e, main_extent);
    let mut epi = Vec::new();
    match array {
        Some(a) => {
            let bar = raw(f, a, from);
            let rp = parity(f, from);
            epi.push(Node::Barrier(BarrierOp::Wait { bar, parity: rp }));
        }
        None if registers => {}
        None => {
            // Every group has landed (the tail is short: no count per iteration).
            epi.push(Node::CpAsync(CpAsyncOp::Wait(0)));
            if cross {
                epi.push(Node::Sync(SyncKind::Raw));
            }
        }
    }
    epi.extend(at_iteration(f, &rest, sym, from, &sized, stages, false));

    let mut nodes = Vec::new();
    if cross && in_serial {
        nodes.push(Node::Sync(SyncKind::War));
    }
    if let Some(a) = array {
        // Seed 000: the barriers are initialised in a stage-depth loop before the pipeline:
        // read-after-write ones expect the stage's bulk copies, write-after-read ones every
        // thread of the block.
        let k = fresh_index(f, next_index, Some(stages));
        let threads = [ParallelType::TIDx, ParallelType::TIDy, ParallelType::TIDz]
            .map(|pt| f.scalars.symbol(Symbol::ParallelDim(pt)));
        let threads = f.scalars.product(threads);
        let copies = f.scalars.int(issues as i64);
        let k_war = f.scalars.add(k, s);
        let init = vec![
            Node::Barrier(BarrierOp::Init { bar: BarrierRef { array: a, index: k }, arrivals: copies }),
            Node::Barrier(BarrierOp::Init { bar: BarrierRef { array: a, index: k_war }, arrivals: threads }),
        ];
        nodes.push(plain_loop(&l, k, s, init));
        nodes.push(Node::Sync(SyncKind::Raw));
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
    if cross && array.is_some() {
        // When the main loop runs no iteration, the prologue's loads are read next.
        nodes.push(Node::Sync(SyncKind::Raw));
    }
    nodes.push(mk(PipelinePart::Epilogue, e, epi_extent, epi));
    if let Some(a) = array {
        // Every thread is past its last wait before the barriers are retired, in a
        // stage-depth loop after the pipeline.
        nodes.push(Node::Sync(SyncKind::Raw));
        let k = fresh_index(f, next_index, Some(2 * stages));
        let two_s = f.scalars.int(2 * stages);
        let inval = vec![Node::Barrier(BarrierOp::Inval { bar: BarrierRef { array: a, index: k } })];
        nodes.push(plain_loop(&l, k, two_s, inval));
    }
    // Back inside the loops the pipeline moved into, innermost last.
    for mut w in wrappers.into_iter().rev() {
        w.body = nodes;
        nodes = vec![Node::Loop(w)];
    }
    let list = list_at(body, outer);
    for (k, node) in nodes.into_iter().enumerate() {
        list.insert(at + k, node);
    }
    Ok(())
}
