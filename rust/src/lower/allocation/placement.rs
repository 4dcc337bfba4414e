//! Placement (rule 7): where an Allocate goes in the loop nest, and the init loop
//! nest of a reduction (its identity over the non-reduction, non-broadcast ids right
//! of the allocation position).

use rustc_hash::FxHashMap;

use crate::analysis::loop_graph::LoopGraph;
use crate::error::Result;
use crate::ir::{ExprId, Fusion, IterType, ParallelType, Symbol, TvId, ValId};
use crate::kernel::{ForLoop, Node};

/// Nodes to insert into the loop nest, collected for every tensor and inserted in one pass:
/// inserted one by one, each insertion scanned the body for its definition and shifted the
/// rest, n^2 work for a chain of n ops (a 16000-op chain spent seconds here).
pub struct Insertions {
    /// Per expr of the nest: the positions of the nodes leading to it, outermost first.
    paths: FxHashMap<ExprId, Vec<usize>>,
    /// (path of the body, position in it, nodes), in the order they were asked for.
    pending: Vec<(Vec<usize>, usize, Vec<Node>)>,
}

impl Insertions {
    /// Insertions into `body` (as it is now; apply them before it changes otherwise).
    pub fn new(body: &[Node]) -> Self {
        fn walk(nodes: &[Node], path: &mut Vec<usize>, out: &mut FxHashMap<ExprId, Vec<usize>>) {
            for (i, n) in nodes.iter().enumerate() {
                path.push(i);
                match n {
                    Node::Expr { expr, .. } => {
                        out.insert(*expr, path.clone());
                    }
                    Node::Loop(l) => walk(&l.body, path, out),
                    _ => {}
                }
                path.pop();
            }
        }
        let mut paths = FxHashMap::default();
        walk(body, &mut Vec::new(), &mut paths);
        Self { paths, pending: Vec::new() }
    }

    /// Insert `nodes` in the body of the `depth`-th loop around expr `e` (0: top level),
    /// right before the child that leads to `e` (after nodes inserted there before).
    #[allow(clippy::too_many_arguments)]
    pub fn before_expr(
        &mut self,
        f: &Fusion,
        body: &[Node],
        lg: &LoopGraph,
        tv: TvId,
        depth: usize,
        e: ExprId,
        nodes: Vec<Node>,
    ) -> Result<()> {
        let Some(path) = self.paths.get(&e) else {
            crate::bail_internal!("allocation of {}: its definition is not inside its loops", f.tv_name(tv));
        };
        let mut cur = body;
        for a in 0..depth {
            let g = lg.group(tv, a);
            match path.get(a).and_then(|&i| cur.get(i)) {
                Some(Node::Loop(l)) if l.group == Some(g) && a + 1 < path.len() => cur = &l.body,
                _ => crate::bail_internal!("allocation of {}: loop {a} around its definition not found", f.tv_name(tv)),
            }
        }
        self.pending.push((path[..depth].to_vec(), path[depth], nodes));
        Ok(())
    }

    /// Insert every pending node into `body`.
    pub fn apply(self, body: &mut Vec<Node>) {
        // Per body, per position: the nodes to insert before that child, in order.
        let mut by_body: FxHashMap<Vec<usize>, FxHashMap<usize, Vec<Node>>> = FxHashMap::default();
        for (path, at, nodes) in self.pending {
            by_body.entry(path).or_default().entry(at).or_default().extend(nodes);
        }
        fn rebuild(
            nodes: &mut Vec<Node>,
            path: &mut Vec<usize>,
            by_body: &mut FxHashMap<Vec<usize>, FxHashMap<usize, Vec<Node>>>,
        ) {
            for (i, n) in nodes.iter_mut().enumerate() {
                if let Node::Loop(l) = n {
                    path.push(i);
                    rebuild(&mut l.body, path, by_body);
                    path.pop();
                }
            }
            let Some(mut here) = by_body.remove(path.as_slice()) else { return };
            let old = std::mem::take(nodes);
            for (i, n) in old.into_iter().enumerate() {
                if let Some(ins) = here.remove(&i) {
                    nodes.extend(ins);
                }
                nodes.push(n);
            }
        }
        rebuild(body, &mut Vec::new(), &mut by_body);
    }
}

/// Where `tv`'s init goes: its allocation position, moved in past the loops of its broadcast
/// axes that a consumer's axis makes run more than once (up to its first reduced axis). The
/// reduction is recomputed in each of their iterations into the one element it allocates
/// there, so each needs its own init (an allocation moved out of an Unswitch loop leaves
/// such a loop between the init and the reduction).
pub fn init_position(f: &Fusion, lg: &LoopGraph, tv: TvId, alloc_pos: usize) -> usize {
    let ld = &f.tvs[tv].loop_domain;
    let mut pos = alloc_pos;
    for (a, &id) in ld.iter().enumerate().skip(alloc_pos) {
        match f.ids[id].iter_type {
            IterType::Reduction => break,
            IterType::Broadcast => {
                let promoted = lg.groups[lg.group(tv, a)].promoted;
                if !f.scalars.is_const(f.ids[promoted].extent, 1) {
                    pos = a + 1;
                }
            }
            _ => {}
        }
    }
    pos
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
