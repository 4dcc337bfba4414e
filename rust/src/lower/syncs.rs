//! Block synchronization for memory that threads share.
//! Consumes: the loop nest, its loop and exact id graphs. Produces: `Sync` nodes.
//! Guarantees: between a write of a Shared (or in-kernel Global) tensor and a later read
//! of it by other threads of the block (`analysis::parallel::cross_reads`) there is a
//! `__syncthreads()` (RAW); when both sit in one loop, the loop body ends with one so the
//! next iteration's write cannot overtake slow readers (WAR). No sync is added where one
//! already separates them. `validate::parallel_reads` has refused the reads no barrier
//! can order (across blocks, out of Local memory, inside a partial thread loop).

use crate::analysis::id_graph::IdGraph;
use crate::analysis::loop_graph::LoopGraph;
use crate::analysis::parallel::cross_reads;
use crate::ir::{ExprId, Fusion, MemoryType, Operand, TvId};
use crate::kernel::{Node, SyncKind};

/// An access site of a tensor other threads can see: its path in the nest, the tensor
/// and, for a read, the expr that reads it.
struct Site {
    path: Vec<usize>,
    tv: TvId,
    write: bool,
    reader: Option<ExprId>,
}

/// Shared tensors, and Global ones the kernel computes (not fusion inputs). Circular-buffered
/// tensors get their barriers from the `circular_buffer` pass, which knows their stages.
fn visible(f: &Fusion, tv: TvId) -> bool {
    if crate::lower::circular_buffer::is_pipelined(f, tv) {
        return false;
    }
    match f.tvs[tv].memory {
        MemoryType::Shared => true,
        MemoryType::Global => f.tvs[tv].definition.is_some() && !f.is_input(tv),
        MemoryType::Local => false,
    }
}

fn collect(f: &Fusion, body: &[Node], prefix: &mut Vec<usize>, out: &mut Vec<Site>) {
    for (i, n) in body.iter().enumerate() {
        prefix.push(i);
        match n {
            Node::Loop(l) => collect(f, &l.body, prefix, out),
            Node::Init { tv, .. } if visible(f, *tv) => {
                out.push(Site { path: prefix.clone(), tv: *tv, write: true, reader: None })
            }
            Node::Expr { expr, .. } => {
                let e = &f.exprs[*expr];
                for o in &e.inputs {
                    if let Operand::Tensor(t) = o {
                        if visible(f, *t) {
                            out.push(Site { path: prefix.clone(), tv: *t, write: false, reader: Some(*expr) });
                        }
                    }
                }
                if visible(f, e.output) {
                    out.push(Site { path: prefix.clone(), tv: e.output, write: true, reader: None });
                }
            }
            _ => {}
        }
        prefix.pop();
    }
}

/// True when a loop on `path` iterates within a thread (not a thread/block loop).
fn in_real_loop(body: &[Node], path: &[usize]) -> bool {
    let mut cur = body;
    for &i in path {
        let Node::Loop(l) = &cur[i] else { return false };
        if !l.parallel.is_thread_or_block() {
            return true;
        }
        cur = &l.body;
    }
    false
}

fn scope_mut<'a>(body: &'a mut Vec<Node>, path: &[usize]) -> &'a mut Vec<Node> {
    let mut cur = body;
    for &i in path {
        match &mut cur[i] {
            Node::Loop(l) => cur = &mut l.body,
            _ => unreachable!("scope paths only go through loops"),
        }
    }
    cur
}

/// Insert RAW and WAR syncs into `body`.
pub fn run(f: &Fusion, lg: &LoopGraph, exact: &IdGraph, body: &mut Vec<Node>) {
    // Reads by other threads of the block; each element read by the thread that wrote it
    // needs no barrier.
    let crosses = |tv: TvId, e: ExprId| cross_reads(f, lg, exact, tv, e).iter().any(|x| x.pt.is_thread());
    // Each insertion shifts positions, so recompute the sites after every change.
    loop {
        let mut sites = Vec::new();
        collect(f, body, &mut Vec::new(), &mut sites);
        let mut change: Option<(Vec<usize>, usize, SyncKind)> = None;
        'outer: for r in sites.iter().filter(|s| !s.write && s.reader.is_some_and(|e| crosses(s.tv, e))) {
            for w in sites.iter().filter(|s| s.write && s.tv == r.tv) {
                let l = w.path.iter().zip(&r.path).take_while(|(a, b)| a == b).count();
                if l == w.path.len() || l == r.path.len() {
                    continue; // the same statement reads and writes (e.g. a reduction)
                }
                let (iw, ir) = (w.path[l], r.path[l]);
                if iw >= ir {
                    continue;
                }
                let scope = scope_mut(body, &w.path[..l]);
                if !scope[iw + 1..ir].iter().any(|n| matches!(n, Node::Sync(_))) {
                    change = Some((w.path[..l].to_vec(), ir, SyncKind::Raw));
                    break 'outer;
                }
                // Inside a real loop, the next iteration's write must wait for this one's
                // reads. Thread and block loops run once per thread/block: no WAR there.
                if in_real_loop(body, &w.path[..l])
                    && !scope_mut(body, &w.path[..l])[ir + 1..].iter().any(|n| matches!(n, Node::Sync(_)))
                {
                    let scope = scope_mut(body, &w.path[..l]);
                    let end = scope.len();
                    change = Some((w.path[..l].to_vec(), end, SyncKind::War));
                    break 'outer;
                }
            }
        }
        match change {
            Some((path, at, kind)) => scope_mut(body, &path).insert(at, Node::Sync(kind)),
            None => break,
        }
    }
}
