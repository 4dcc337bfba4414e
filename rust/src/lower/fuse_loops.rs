//! Sibling loop fusion.
//! Consumes: the nest after reduction hoisting (no `If` or vector-copy nodes yet).
//! Produces: fewer loops.
//! Guarantees: two loops of one body with the same extent, parallel type and kind of axis
//! become one loop running the first body then the second in each iteration (the second's
//! index replaced by the first's) when the second loop neither reads nor writes anything
//! the first writes, nor writes what the first reads (tensors and register accumulators).
//! The statements between them move before the fused loop where they are independent of
//! the first loop, after it otherwise, and the second loop must then be independent of
//! them. Loops that touch a Shared tensor stay apart (their barriers were placed for the
//! order as written), as do vectorized loops (one wide copy each) and plain serial loops of
//! one iteration (fusing them saves nothing and would delay their readers). Every fused loop is
//! block-uniform, so a block reduction inside still meets all threads.
//!
//! Why: the looped normalization gives each reduction its own pass over the row, and a
//! row too long to keep on chip is then read from memory once per pass. Fused, sibling
//! reductions of one input (a max beside a log-sum-exp, two sums) read it once; their
//! second load of each element hits L1.

use rustc_hash::FxHashSet;

use crate::analysis::loop_graph::LoopGraph;
use crate::error::Result;
use crate::ir::scalar::Val;
use crate::ir::{Fusion, MemoryType, Operand, ParallelType, Symbol, TvId};
use crate::kernel::{AccessIndex, AllocTarget, ForLoop, Node};

/// What a statement touches: a tensor's memory or a register accumulator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Res {
    Tv(TvId),
    Acc(u32),
}

/// Reads and writes of a statement list, and whether it holds something fusion must not
/// reorder (Shared memory, whose barriers were placed for the order as written).
#[derive(Default)]
struct Effects {
    reads: FxHashSet<Res>,
    writes: FxHashSet<Res>,
    pinned: bool,
}

impl Effects {
    fn of(f: &Fusion, nodes: &[Node]) -> Effects {
        let mut e = Effects::default();
        for n in nodes {
            e.add(f, n);
        }
        e
    }

    fn read_tv(&mut self, f: &Fusion, t: TvId) {
        self.pinned |= f.tvs[t].memory == MemoryType::Shared;
        self.reads.insert(Res::Tv(t));
    }

    fn write_tv(&mut self, f: &Fusion, t: TvId) {
        self.pinned |= f.tvs[t].memory == MemoryType::Shared;
        self.writes.insert(Res::Tv(t));
    }

    fn expr(&mut self, f: &Fusion, e: crate::ir::ExprId, index: Option<&AccessIndex>) {
        for o in &f.exprs[e].inputs {
            if let Operand::Tensor(t) = o {
                self.read_tv(f, *t);
            }
        }
        for g in index.map(|ix| ix.gathers.as_slice()).unwrap_or_default() {
            self.read_tv(f, g.index_tv);
        }
    }

    fn add(&mut self, f: &Fusion, n: &Node) {
        match n {
            Node::Loop(l) => {
                for c in &l.body {
                    self.add(f, c);
                }
            }
            Node::Alloc(a) => {
                self.pinned |= a.memory == MemoryType::Shared;
                if let AllocTarget::Tensor(t) = a.target {
                    self.write_tv(f, t);
                }
            }
            Node::Init { tv, .. } => self.write_tv(f, *tv),
            Node::Expr { expr, index } => {
                self.expr(f, *expr, index.as_ref());
                self.write_tv(f, f.exprs[*expr].output);
            }
            Node::AccumulatorInit(a) => {
                self.writes.insert(Res::Acc(a.id));
            }
            Node::Accumulate { acc, index } => {
                self.expr(f, acc.expr, Some(index));
                self.reads.insert(Res::Acc(acc.id));
                self.writes.insert(Res::Acc(acc.id));
            }
            Node::ReduceAccumulator { acc, .. } => {
                self.reads.insert(Res::Acc(acc.id));
                self.write_tv(f, f.exprs[acc.expr].output);
            }
            // A barrier orders Shared accesses, which pin the loop anyway; block reductions
            // end with one, so their shared workspace may be reused in any order.
            Node::Sync(_) => {}
            // Made after fusion; pinned should one ever come earlier.
            Node::If(_)
            | Node::Vector(_)
            | Node::Barrier(_)
            | Node::BulkLoad(_)
            | Node::CpAsync(_)
            | Node::TensorMemory(_) => self.pinned = true,
        }
    }

    /// True when running `self` and `other` in the other order could change a result.
    fn conflicts(&self, other: &Effects) -> bool {
        self.writes.iter().any(|r| other.reads.contains(r) || other.writes.contains(r))
            || other.writes.iter().any(|r| self.reads.contains(r))
    }

    fn absorb(&mut self, other: Effects) {
        self.reads.extend(other.reads);
        self.writes.extend(other.writes);
        self.pinned |= other.pinned;
    }
}

/// Fuse sibling loops throughout `body` (see the module docs).
pub fn run(f: &mut Fusion, lg: &LoopGraph, body: &mut Vec<Node>) -> Result<()> {
    fuse_in(f, lg, body);
    Ok(())
}

fn fuse_in(f: &mut Fusion, lg: &LoopGraph, body: &mut Vec<Node>) {
    let mut i = 0;
    while i < body.len() {
        if fuse_at(f, lg, body, i).is_some() {
            // Statements that moved before the fused loop now start at `i`: try them (and
            // then the fused loop, against later siblings) too. Each fusion removes a loop,
            // so this ends.
        } else {
            i += 1;
        }
    }
    for n in body.iter_mut() {
        for b in n.bodies_mut() {
            fuse_in(f, lg, b);
        }
    }
}

/// Fuse the loop at `body[i]` with the first later sibling loop it can take; the fused
/// loop's new position, or None.
fn fuse_at(f: &mut Fusion, lg: &LoopGraph, body: &mut Vec<Node>, i: usize) -> Option<usize> {
    let Node::Loop(l1) = &body[i] else { return None };
    if !fusible(f, l1) {
        return None;
    }
    let first = Effects::of(f, std::slice::from_ref(&body[i]));
    if first.pinned {
        return None;
    }
    for j in i + 1..body.len() {
        let Node::Loop(l2) = &body[j] else { continue };
        if !same_iteration(f, lg, l1, l2) {
            continue;
        }
        let second = Effects::of(f, std::slice::from_ref(&body[j]));
        if second.pinned {
            continue;
        }
        // Statements between: before the fused loop unless they depend on the first loop
        // (or on statements that stay after it).
        let mut after_fx = Effects::of(f, std::slice::from_ref(&body[i]));
        let mut before = Vec::new();
        let mut after = Vec::new();
        let mut ok = true;
        for (k, node) in body.iter().enumerate().take(j).skip(i + 1) {
            let fx = Effects::of(f, std::slice::from_ref(node));
            if matches!(node, Node::Sync(_)) {
                ok = false;
                break;
            }
            if after_fx.conflicts(&fx) {
                after.push(k);
                after_fx.absorb(fx);
            } else {
                before.push(k);
            }
        }
        if !ok || after_fx.conflicts(&second) {
            continue;
        }
        // Rebuild body[i..=j]: before, fused, after.
        let tail: Vec<Node> = body.drain(i..=j).collect();
        let mut slots: Vec<Option<Node>> = tail.into_iter().map(Some).collect();
        let Some(Node::Loop(mut fused)) = slots[0].take() else { unreachable!("checked above") };
        let Some(Node::Loop(l2)) = slots[j - i].take() else { unreachable!("checked above") };
        append_renamed(f, &mut fused, l2);
        let mut rebuilt: Vec<Node> = before.iter().filter_map(|&k| slots[k - i].take()).collect();
        let at = i + rebuilt.len();
        rebuilt.push(Node::Loop(fused));
        rebuilt.extend(after.iter().filter_map(|&k| slots[k - i].take()));
        body.splice(i..i, rebuilt);
        return Some(at);
    }
    None
}

/// Loops fusion may merge: lowering's own loops (reduction inits) and vectorized loops keep
/// their shape.
fn fusible(f: &Fusion, l: &ForLoop) -> bool {
    l.init_axis.is_none() && l.parallel != ParallelType::Vectorize && !one_trip(f, l)
}

/// A plain serial loop of one iteration (a broadcast axis): nothing to save by fusing it,
/// and moving it behind the statements between would only delay what reads it. Unswitched
/// and unrolled loops of one iteration still fuse: an unswitched tile holds the loads and
/// the math of its loop nest, and tiles fused are one bounds test and loads of one tensor
/// next to each other instead of a tile per reduction.
fn one_trip(f: &Fusion, l: &ForLoop) -> bool {
    l.parallel == ParallelType::Serial && f.scalars.as_int(l.extent) == Some(1)
}

/// True when `b` runs the same iterations as `a`: same extent and parallel type, over the
/// same kind of axis (the interpreter and codegen treat reduction axes of parallel loops
/// differently); parallel loops must share their index (a thread or block index).
fn same_iteration(f: &Fusion, lg: &LoopGraph, a: &ForLoop, b: &ForLoop) -> bool {
    let kind = |l: &ForLoop| l.group.and_then(|g| lg.groups.get(g)).map(|gi| f.ids[gi.promoted].iter_type);
    let extent_eq = a.extent == b.extent
        || matches!((f.scalars.as_int(a.extent), f.scalars.as_int(b.extent)), (Some(x), Some(y)) if x == y);
    let index_ok = if a.parallel.is_thread_or_block() {
        a.index == b.index
    } else {
        matches!(f.scalars.get(b.index), Val::Symbol(Symbol::LoopIndex(_)))
    };
    fusible(f, b) && a.parallel == b.parallel && extent_eq && kind(a) == kind(b) && index_ok
}

/// Append `l2`'s body to `fused`, its loop index replaced by `fused`'s.
fn append_renamed(f: &mut Fusion, fused: &mut ForLoop, l2: ForLoop) {
    let mut body = l2.body;
    if l2.index != fused.index {
        if let Val::Symbol(sym) = f.scalars.get(l2.index) {
            let by = fused.index;
            for n in body.iter_mut() {
                n.map_vals(&mut |v| f.scalars.substitute(v, sym, by));
            }
        }
    }
    fused.body.extend(body);
}
