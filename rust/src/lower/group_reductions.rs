//! Grouped block reductions.
//! Consumes: the finished nest (every other pass has run). Produces: `grouped` marks on
//! `ReduceAccumulator` nodes, each moved down next to its partner past statements that do
//! not touch its output (the register accumulation of the partner).
//! Guarantees: a node marked `grouped` is followed directly by another `ReduceAccumulator`
//! over the same thread dimensions, with an output of the same dtype in Local memory and
//! neither a grid reduction nor a log-sum-exp; the two may run as one block reduction of a
//! pair (one barrier pair instead of two). Both results are what the two reductions give
//! one after the other, which is how the interpreter runs them.
//!
//! Why: sibling reductions of one row (LayerNorm backward's `sum(g)` and `sum(g * xhat)`,
//! a variance's sum and sum of squares) each wait for two block barriers; grouped, a block
//! pays that latency once per row.

use crate::analysis::loop_graph::LoopGraph;
use crate::analysis::parallel::reduced_dims;
use crate::error::Result;
use crate::ir::{Fusion, MemoryType, Op};
use crate::kernel::Node;

/// Mark groupable pairs of adjacent block reductions throughout `body`.
pub fn run(f: &Fusion, lg: &LoopGraph, body: &mut Vec<Node>) -> Result<()> {
    mark(f, lg, body);
    Ok(())
}

fn mark(f: &Fusion, lg: &LoopGraph, list: &mut Vec<Node>) {
    let mut i = 0;
    while i + 1 < list.len() {
        match partner(f, lg, list, i) {
            Some(j) => {
                // Nothing between reads the first result: it moves down next to its partner.
                let mut n = list.remove(i);
                if let Node::ReduceAccumulator { grouped, .. } = &mut n {
                    *grouped = true;
                }
                list.insert(j - 1, n);
                i = j + 1;
            }
            None => i += 1,
        }
    }
    for n in list.iter_mut() {
        for b in n.bodies_mut() {
            mark(f, lg, b);
        }
    }
}

/// The next block reduction that `list[i]` can pair with: of the same key, with only
/// statements between that neither read nor write `list[i]`'s output and hold no barrier
/// (register accumulators and the loops feeding them, from sibling loops left unfused).
fn partner(f: &Fusion, lg: &LoopGraph, list: &[Node], i: usize) -> Option<usize> {
    let k = key(f, lg, &list[i])?;
    let Node::ReduceAccumulator { acc, .. } = &list[i] else { return None };
    let out = f.exprs[acc.expr].output;
    for (j, n) in list.iter().enumerate().skip(i + 1) {
        if key(f, lg, n).as_ref() == Some(&k) {
            return Some(j);
        }
        if !independent(f, n, out) {
            return None;
        }
    }
    None
}

/// True when `n` neither touches `tv` nor holds a barrier or another block reduction.
fn independent(f: &Fusion, n: &Node, tv: crate::ir::TvId) -> bool {
    let touches = |e: crate::ir::ExprId| f.exprs[e].output == tv || f.exprs[e].input_tvs().any(|t| t == tv);
    match n {
        Node::Loop(l) => l.body.iter().all(|c| independent(f, c, tv)),
        Node::Expr { expr, .. } => !touches(*expr),
        Node::Accumulate { acc, .. } => !touches(acc.expr),
        Node::AccumulatorInit(_) => true,
        Node::Alloc(a) => a.target != crate::kernel::AllocTarget::Tensor(tv),
        _ => false,
    }
}

/// The key a block reduction groups by, or None where it stays on its own.
fn key(f: &Fusion, lg: &LoopGraph, n: &Node) -> Option<(Vec<crate::ir::ParallelType>, crate::ir::DataType)> {
    let Node::ReduceAccumulator { acc, .. } = n else { return None };
    let out = f.exprs[acc.expr].output;
    let Op::Reduction { op, .. } = f.exprs[acc.expr].op else { return None };
    if op.is_log_sum_exp() || f.tvs[out].memory != MemoryType::Local {
        return None;
    }
    let dims = reduced_dims(f, lg, out);
    if dims.is_empty() || dims.iter().any(|p| p.is_block()) {
        return None;
    }
    Some((dims, f.tvs[out].dtype))
}
