//! The kernel-IR verifier, run after every lowering pass in tests and debug builds (and
//! on request): the invariants codegen and the interpreter rely on.
//! - Every serial loop index a statement, loop extent, allocation or condition reads is
//!   the index of a loop around it.
//! - Every Local or Shared tensor a statement touches was allocated before, in a scope
//!   around it.
//! - No barrier or block reduction sits in a branch whose condition differs between the
//!   threads of a block (some would never reach it).
//! - After `syncs`: between a write of a Shared tensor (or a Global one the kernel
//!   computes) and a later read of it by other threads of the block
//!   (`analysis::parallel::cross_reads`), every path passes a `__syncthreads()` (RAW); and
//!   where a serial loop holds both, every path from the read round that loop to the next
//!   iteration's write passes one (WAR). A barrier counts only where every thread surely
//!   runs it: in a list that holds one of the two sites, or in a branch with one in both
//!   arms, or in a loop that runs at least once.

use rustc_hash::FxHashSet;

use crate::analysis::id_graph::IdGraph;
use crate::analysis::loop_graph::LoopGraph;
use crate::analysis::parallel::cross_reads;
use crate::error::Result;
use crate::ir::scalar::Val;
use crate::ir::{ExprId, Fusion, MemoryType, Operand, ParallelType, Symbol, TvId, ValId};
use crate::kernel::{AllocTarget, Node};

/// What the verifier can check at a point of the pipeline.
#[derive(Clone, Copy, Debug)]
pub struct Stage {
    /// Statements carry their access indices (after `indexing`).
    pub indexed: bool,
    /// Allocations are placed (after `allocation`).
    pub allocated: bool,
    /// Barriers are placed around memory other threads see (after `syncs`).
    pub synced: bool,
    /// Circular-buffered loops are pipelined, with their barriers (after `circular_buffer`).
    pub pipelined: bool,
}

/// Check `body` after pass `pass`; the error names the pass and the broken rule. `lg` and
/// `exact` are the loop and exact id graphs lowering built, from which the barrier check
/// tells which reads cross threads.
pub fn run(f: &Fusion, lg: &LoopGraph, exact: &IdGraph, body: &[Node], stage: Stage, pass: &str) -> Result<()> {
    let mut v = Verifier { f, stage, loops: Vec::new(), allocated: Vec::new(), divergent: 0 };
    v.nodes(body)
        .and_then(|()| if stage.synced { syncs(f, lg, exact, body, stage.pipelined) } else { Ok(()) })
        .map_err(|m| crate::error::KilnError::internal(format!("kernel IR after {pass}: {m}")))
}

struct Verifier<'a> {
    f: &'a Fusion,
    stage: Stage,
    /// Serial loop indices in scope.
    loops: Vec<u32>,
    /// Local and Shared tensors allocated in scope.
    allocated: Vec<TvId>,
    /// Enclosing branches whose condition reads a thread index.
    divergent: usize,
}

impl Verifier<'_> {
    fn nodes(&mut self, body: &[Node]) -> std::result::Result<(), String> {
        let (loops, allocated) = (self.loops.len(), self.allocated.len());
        for n in body {
            self.node(n)?;
        }
        self.loops.truncate(loops);
        self.allocated.truncate(allocated);
        Ok(())
    }

    fn node(&mut self, n: &Node) -> std::result::Result<(), String> {
        let f = self.f;
        match n {
            Node::Loop(l) => {
                self.in_scope(l.extent, "a loop extent")?;
                let bound = match f.scalars.get(l.index) {
                    Val::Symbol(Symbol::LoopIndex(i)) if !l.parallel.is_thread_or_block() => Some(i),
                    _ => None,
                };
                self.loops.extend(bound);
                self.nodes(&l.body)?;
                if bound.is_some() {
                    self.loops.pop();
                }
                return Ok(());
            }
            Node::Alloc(a) => {
                for &e in &a.shape {
                    self.in_scope(e, "an allocation size")?;
                }
                if let (AllocTarget::Tensor(tv), MemoryType::Local | MemoryType::Shared) = (a.target, a.memory) {
                    self.allocated.push(tv);
                }
            }
            Node::Sync(_) | Node::ReduceAccumulator { .. } if self.divergent > 0 => {
                return Err("a barrier or block reduction inside a branch on a thread index".into());
            }
            Node::If(i) => {
                self.in_scope(i.cond, "a branch condition")?;
                let thread_dependent = reads_thread_index(f, i.cond);
                self.divergent += usize::from(thread_dependent);
                self.nodes(&i.then)?;
                self.nodes(&i.otherwise)?;
                self.divergent -= usize::from(thread_dependent);
                return Ok(());
            }
            Node::Vector(v) => {
                for x in [v.out, v.input, v.first, v.last] {
                    self.in_scope(x, "a vector copy's offset or guard")?;
                }
                self.nodes(std::slice::from_ref(&Node::Loop(v.fallback.clone())))?;
                return Ok(());
            }
            _ => {}
        }
        if let Some(ix) = n.access_index() {
            if self.stage.indexed {
                self.in_scope(ix.out, "an output offset")?;
                self.in_scope(ix.predicate, "a predicate")?;
                self.in_scope(ix.write_predicate, "a write predicate")?;
                if let Some(v) = ix.element {
                    self.in_scope(v, "an element position")?;
                }
                for &v in ix.inputs.iter().flatten() {
                    self.in_scope(v, "an operand offset")?;
                }
                for g in &ix.gathers {
                    self.in_scope(g.at, "a gather offset")?;
                    self.in_scope(g.element, "a gather's element position")?;
                }
            }
        }
        if self.stage.allocated {
            for tv in touched(f, n) {
                let mem = f.tvs[tv].memory;
                if matches!(mem, MemoryType::Local | MemoryType::Shared) && !self.allocated.contains(&tv) {
                    return Err(format!(
                        "{} ({} memory) is accessed outside any Allocate of it",
                        f.tv_name(tv),
                        mem.enum_name()
                    ));
                }
            }
        }
        Ok(())
    }

    fn in_scope(&self, v: ValId, what: &str) -> std::result::Result<(), String> {
        let mut syms = FxHashSet::default();
        crate::lower::predicate::symbols(&self.f.scalars, v, &mut syms);
        for s in syms {
            if let Symbol::LoopIndex(i) = s {
                if !self.loops.contains(&i) {
                    return Err(format!(
                        "{what} ({}) reads idx{i}, which no loop around it defines",
                        self.f.scalars.render(v)
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The tensors a statement reads or writes.
fn touched(f: &Fusion, n: &Node) -> Vec<TvId> {
    let expr = match n {
        Node::Init { tv, .. } => return vec![*tv],
        Node::Expr { expr, .. } => *expr,
        Node::Accumulate { acc, .. } => acc.expr,
        Node::ReduceAccumulator { acc, .. } => return vec![f.exprs[acc.expr].output],
        _ => return Vec::new(),
    };
    let e = &f.exprs[expr];
    let mut out: Vec<TvId> =
        e.inputs.iter().filter_map(|o| if let Operand::Tensor(t) = o { Some(*t) } else { None }).collect();
    if !matches!(n, Node::Accumulate { .. }) {
        out.push(e.output);
    }
    out
}

/// True when `v` reads a thread index (it differs between the threads of a block).
fn reads_thread_index(f: &Fusion, v: ValId) -> bool {
    let mut syms = FxHashSet::default();
    crate::lower::predicate::symbols(&f.scalars, v, &mut syms);
    syms.iter().any(|s| {
        matches!(s, Symbol::ParallelIndex(ParallelType::TIDx | ParallelType::TIDy | ParallelType::TIDz))
            || matches!(s, Symbol::Gathered(_))
    })
}

/// A Shared tensor, or a Global one the kernel computes: memory other threads of the block
/// see, whose cross-thread reads need a barrier after the write.
fn visible(f: &Fusion, tv: TvId) -> bool {
    match f.tvs[tv].memory {
        MemoryType::Shared => true,
        MemoryType::Global => f.tvs[tv].definition.is_some() && !f.is_input(tv),
        MemoryType::Local => false,
    }
}

/// Where a node sits: for each enclosing node, its index in its list and which of its
/// [`Node::bodies`] holds the next step; the last step is the node itself (body 0).
type Position = Vec<(usize, usize)>;

/// A write of a visible tensor, or a read of one by other threads of the block.
struct Access {
    at: Position,
    tv: TvId,
    /// The reading or writing expr (`None` for an init).
    expr: Option<ExprId>,
}

/// The writes of visible tensors in `body` and their reads by other threads of the block.
fn accesses(
    f: &Fusion,
    crosses: &dyn Fn(TvId, ExprId) -> bool,
    body: &[Node],
    prefix: &mut Position,
    writes: &mut Vec<Access>,
    reads: &mut Vec<Access>,
) {
    for (i, n) in body.iter().enumerate() {
        let (read, written): (Option<ExprId>, Option<(TvId, Option<ExprId>)>) = match n {
            Node::Init { tv, .. } => (None, Some((*tv, None))),
            Node::Expr { expr, .. } => (Some(*expr), Some((f.exprs[*expr].output, Some(*expr)))),
            // A hoisted reduction reads its input where the reduction stood and writes its
            // output after the hoisted loops.
            Node::Accumulate { acc, .. } => (Some(acc.expr), None),
            Node::ReduceAccumulator { acc, .. } => (None, Some((f.exprs[acc.expr].output, Some(acc.expr)))),
            _ => (None, None),
        };
        prefix.push((i, 0));
        if let Some(e) = read {
            for t in f.exprs[e].input_tvs() {
                if visible(f, t) && crosses(t, e) {
                    reads.push(Access { at: prefix.clone(), tv: t, expr: Some(e) });
                }
            }
        }
        if let Some((t, expr)) = written.filter(|&(t, _)| visible(f, t)) {
            writes.push(Access { at: prefix.clone(), tv: t, expr });
        }
        prefix.pop();
        // A vector copy is not a site itself: the expr of its fallback loop stands for its
        // accesses, at the same place in the nest.
        for (arm, b) in n.bodies().into_iter().enumerate() {
            prefix.push((i, arm));
            accesses(f, crosses, b, prefix, writes, reads);
            prefix.pop();
        }
    }
}

/// The node list that the steps `at` lead into.
fn list_at<'a>(body: &'a [Node], at: &[(usize, usize)]) -> &'a [Node] {
    at.iter().fold(body, |cur, &(i, arm)| cur[i].bodies()[arm])
}

/// True when every thread that runs `n` passes a `__syncthreads()` in it: a barrier, a
/// branch with one in both arms, or a loop with one in its body that runs at least once
/// (a thread or block loop, or a serial loop of a constant positive extent).
fn always_syncs(f: &Fusion, n: &Node) -> bool {
    match n {
        Node::Sync(_) => true,
        Node::If(i) => [&i.then, &i.otherwise].iter().all(|b| b.iter().any(|c| always_syncs(f, c))),
        Node::Loop(l) => {
            let runs = l.parallel.is_thread_or_block() || f.scalars.as_int(l.extent).is_some_and(|n| n > 0);
            runs && l.body.iter().any(|c| always_syncs(f, c))
        }
        _ => false,
    }
}

/// True when a barrier lies on every path from `from` to `to` that stays in the list both
/// reach at step `depth` (they share the steps before it): after `from` in each list below
/// that holds it, then in that list from `from` forward to `to` (where `to` does not come
/// later there, round the end of the loop body it is back to the start), then before `to`
/// in each list below that holds it.
fn barrier_between(f: &Fusion, body: &[Node], from: &[(usize, usize)], to: &[(usize, usize)], depth: usize) -> bool {
    let syncs = |nodes: &[Node]| nodes.iter().any(|n| always_syncs(f, n));
    let after = (depth + 1..from.len()).any(|j| syncs(&list_at(body, &from[..j])[from[j].0 + 1..]));
    let before = (depth + 1..to.len()).any(|j| syncs(&list_at(body, &to[..j])[..to[j].0]));
    let level = list_at(body, &from[..depth]);
    let (a, b) = (from[depth].0, to[depth].0);
    let between = if a < b { syncs(&level[a + 1..b]) } else { syncs(&level[a + 1..]) || syncs(&level[..b]) };
    after || between || before
}

/// The RAW and WAR barriers around visible memory (see the module doc).
fn syncs(
    f: &Fusion,
    lg: &LoopGraph,
    exact: &IdGraph,
    body: &[Node],
    pipelined: bool,
) -> std::result::Result<(), String> {
    // Each element read by the thread that wrote it needs no barrier. A circular-buffered
    // tensor gets its barriers when its loop is pipelined.
    let crosses = |t: TvId, e: ExprId| {
        (pipelined || !crate::lower::circular_buffer::is_pipelined(f, t))
            && cross_reads(f, lg, exact, t, e).iter().any(|x| x.pt.is_thread())
    };
    let (mut writes, mut reads) = (Vec::new(), Vec::new());
    accesses(f, &crosses, body, &mut Vec::new(), &mut writes, &mut reads);
    let what =
        |a: &Access| a.expr.map_or_else(|| "its init".to_string(), |e| format!("`{}`", f.expr_short(&f.exprs[e])));
    for r in &reads {
        for w in writes.iter().filter(|w| w.tv == r.tv) {
            let depth = w.at.iter().zip(&r.at).take_while(|(a, b)| a == b).count();
            // The same statement (a reduction reading and writing), or the two arms of one
            // branch (an unswitched loop's two copies): no thread runs both.
            if depth == w.at.len() || depth == r.at.len() || w.at[depth].0 == r.at[depth].0 {
                continue;
            }
            // A read before the write in the same iteration reads another iteration's
            // elements: the fusion's tensors are computed before they are read, so only a
            // write ahead of the read hands data on.
            if w.at[depth].0 > r.at[depth].0 {
                continue;
            }
            let (tv, mem) = (f.tv_name(r.tv), f.tvs[r.tv].memory.enum_name());
            if !barrier_between(f, body, &w.at, &r.at, depth) {
                return Err(format!(
                    "{tv} ({mem} memory) is written by {} and then read by other threads of the block in {} with no __syncthreads() between them (RAW)",
                    what(w),
                    what(r)
                ));
            }
            // Inside a loop that iterates within a thread, the next iteration's write must wait
            // for this one's reads: a barrier on the way from the read round the innermost
            // such loop to the write. Thread and block loops run once per thread/block.
            let serial = (0..depth).rev().find_map(|j| match &list_at(body, &w.at[..j])[w.at[j].0] {
                Node::Loop(l) if !l.parallel.is_thread_or_block() => Some((j, l)),
                _ => None,
            });
            // A circular buffer loading `prefetch < stages - 1` iterations ahead writes a
            // stage last read two or more iterations before: the read barrier of the
            // iteration between separates them.
            let staged = f.tvs[r.tv].circular_buffer.is_some_and(|cb| cb.prefetch + 1 < cb.stages);
            if let Some((j, l)) = serial.filter(|(_, l)| !(staged && l.body.iter().any(|n| matches!(n, Node::Sync(_)))))
            {
                if !barrier_between(f, body, &r.at, &w.at, j + 1) {
                    return Err(format!(
                        "{tv} ({mem} memory) is read by other threads of the block in {} and written again by {} in the next iteration of loop {} with no __syncthreads() between them (WAR)",
                        what(r),
                        what(w),
                        f.id_label(l.id)
                    ));
                }
            }
        }
    }
    Ok(())
}
