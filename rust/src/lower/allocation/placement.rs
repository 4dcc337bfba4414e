//! Placement (rule 7): where an Allocate goes in the loop nest, and the init loop
//! nest of a reduction (its identity over the non-reduction, non-broadcast ids right
//! of the allocation position).

use crate::analysis::loop_graph::LoopGraph;
use crate::error::Result;
use crate::ir::{ExprId, Fusion, IterType, ParallelType, Symbol, TvId, ValId};
use crate::kernel::{ForLoop, Node};

fn contains_expr(n: &Node, e: ExprId) -> bool {
    match n {
        Node::Expr { expr, .. } => *expr == e,
        Node::Loop(l) => l.body.iter().any(|c| contains_expr(c, e)),
        _ => false,
    }
}

/// Insert `nodes` in the body of the `depth`-th loop around expr `e` (0: top level),
/// right before the child that leads to `e`.
pub fn insert_before_expr(
    f: &Fusion,
    body: &mut Vec<Node>,
    lg: &LoopGraph,
    tv: TvId,
    depth: usize,
    e: ExprId,
    nodes: Vec<Node>,
) -> Result<()> {
    let mut cur = body;
    for a in 0..depth {
        let g = lg.group(tv, a);
        let pos = cur.iter().position(|n| matches!(n, Node::Loop(l) if l.group == Some(g) && contains_expr(n, e)));
        let Some(pos) = pos else {
            crate::bail_internal!("allocation of {}: loop {a} around its definition not found", f.tv_name(tv));
        };
        let Node::Loop(l) = &mut cur[pos] else { unreachable!("matched a loop") };
        cur = &mut l.body;
    }
    let Some(at) = cur.iter().position(|n| contains_expr(n, e)) else {
        crate::bail_internal!("allocation of {}: its definition is not inside its loops", f.tv_name(tv));
    };
    for (k, n) in nodes.into_iter().enumerate() {
        cur.insert(at + k, n);
    }
    Ok(())
}

/// The init loop nest of `tv`: `tv = value` over its non-reduction, non-broadcast
/// loop ids right of `alloc_pos` (promoted), parallel where the main nest is.
pub fn init_nest(
    f: &mut Fusion,
    lg: &LoopGraph,
    tv: TvId,
    alloc_pos: usize,
    value: ValId,
    next_index: &mut u32,
) -> Node {
    let mut node = Node::Init { tv, value, index: None };
    let ld = f.tvs[tv].loop_domain.clone();
    for a in (alloc_pos..ld.len()).rev() {
        let it = f.ids[ld[a]].iter_type;
        if it == IterType::Reduction || it == IterType::Broadcast {
            continue;
        }
        let g = lg.group(tv, a);
        let info = &lg.groups[g];
        // A vectorized id is written element by element here: the init is not a vector store.
        let parallel = if info.parallel == ParallelType::Vectorize { ParallelType::Serial } else { info.parallel };
        let index = if parallel.is_thread_or_block() {
            f.scalars.symbol(Symbol::ParallelIndex(parallel))
        } else {
            *next_index += 1;
            let sym = Symbol::LoopIndex(*next_index - 1);
            if let Some(c) = f.scalars.as_int(f.ids[info.promoted].extent) {
                f.scalars.set_bound(sym, c);
            }
            f.scalars.symbol(sym)
        };
        let id = info.promoted;
        let extent = f.ids[id].extent;
        node = Node::Loop(ForLoop {
            group: None,
            id,
            index,
            extent,
            parallel,
            init_axis: Some(a),
            pipeline: None,
            body: vec![node],
        });
    }
    node
}
