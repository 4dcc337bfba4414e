//! Tensor memory (seed 000's TMem regions), the last pass.
//! Consumes: the indexed, vectorized nest with its `Allocate` nodes and the launch. Produces:
//! the kernel's region in `KernelSummary::tensor_memory` (each tensor's lane and column
//! offsets), `tcgen05.alloc` and the relinquish of the allocation permit on the block's first
//! warp at the top of the kernel followed by a block barrier (every thread then reads the
//! region's address), and a barrier plus `tcgen05.dealloc` after the outermost statement that
//! holds the region's last access.
//! Guarantees: a KilnError naming the tensor for what tcgen05 cannot do here: a reduction
//! accumulating into it, a vector copy of it, cells that are not a constant count, a block
//! of more than 128 threads (one lane each), more than 512 columns, or an access guarded by
//! a condition on the thread index (tcgen05.ld/st are warp-wide instructions).

use crate::bail;
use crate::error::Result;
use crate::ir::scalar::{Scalars, Symbol, Val};
use crate::ir::{Fusion, Op, TvId, ValId};
use crate::kernel::{AllocTarget, KernelSummary, LaunchParams, Node, SyncKind, TmemOp, TmemPlacement, TmemRegion};

/// Lanes of a CTA's Tensor memory, and the most columns one allocation takes.
pub const LANES: i64 = 128;
pub const MAX_COLUMNS: i64 = 512;

/// Run the pass (see the module docs).
pub fn run(f: &Fusion, body: &mut Vec<Node>, launch: &LaunchParams, summary: &mut KernelSummary) -> Result<()> {
    let mut allocs: Vec<(TvId, Vec<ValId>)> = Vec::new();
    collect_allocs(f, body, &mut allocs);
    if allocs.is_empty() {
        return Ok(());
    }
    let sc = &f.scalars;
    let mut tensors = Vec::new();
    let mut next_column = 0;
    for (tv, shape) in &allocs {
        let name = f.tv_name(*tv);
        if let Some(e) = f.tvs[*tv].definition {
            if matches!(f.exprs[e].op, Op::Reduction { .. }) {
                bail!(
                    "{name} is in Tensor memory but is a reduction's output: reductions accumulate in registers; keep {name} in Local memory and copy it to Tensor memory"
                );
            }
        }
        let Some(columns) = shape.iter().try_fold(1i64, |acc, &e| sc.as_int(e).map(|x| acc * x)) else {
            let dims: Vec<String> = shape.iter().map(|&e| sc.render(e)).collect();
            bail!(
                "{name} is in Tensor memory but its allocation [{}] is not a constant number of cells per thread; inline it further or make the allocated axes constant",
                dims.join(", ")
            );
        };
        tensors.push(TmemPlacement { tv: *tv, lane_offset: 0, column_offset: next_column, columns });
        next_column += columns;
    }
    let names = || tensors.iter().map(|p| f.tv_name(p.tv)).collect::<Vec<_>>().join(", ");
    let threads = launch.block.iter().try_fold(1i64, |acc, &b| sc.as_int(b).map(|x| acc * x));
    match threads {
        Some(n) if n <= LANES => {}
        Some(n) => bail!(
            "{} in Tensor memory: a thread owns one of its {LANES} lanes, but the schedule launches {n} threads per block",
            names()
        ),
        None => bail!(
            "{} in Tensor memory: a thread owns one of its {LANES} lanes, so the block size must be a constant of at most {LANES} threads",
            names()
        ),
    }
    if next_column > MAX_COLUMNS {
        bail!("{} in Tensor memory need {next_column} columns per lane; a region holds at most {MAX_COLUMNS}", names());
    }
    let tmem: Vec<TvId> = tensors.iter().map(|p| p.tv).collect();
    check_accesses(f, body, &tmem, &mut Vec::new())?;
    let columns = (next_column.max(32) as u64).next_power_of_two() as i64;
    summary.tensor_memory = Some(TmemRegion { columns, tensors });

    let mut top = vec![
        Node::TensorMemory(TmemOp::Alloc),
        Node::TensorMemory(TmemOp::Relinquish),
        // Every thread reads the region's address from the Shared slot after this.
        Node::Sync(SyncKind::Raw),
    ];
    top.append(body);
    *body = top;
    insert_dealloc(f, body, &tmem);
    Ok(())
}

fn collect_allocs(f: &Fusion, body: &[Node], out: &mut Vec<(TvId, Vec<ValId>)>) {
    for n in body {
        if let Node::Alloc(a) = n {
            if let AllocTarget::Tensor(tv) = a.target {
                if f.tvs[tv].tensor_memory && !out.iter().any(|(t, _)| *t == tv) {
                    out.push((tv, a.shape.clone()));
                }
            }
        }
        for b in n.bodies() {
            collect_allocs(f, b, out);
        }
    }
}

/// True when `v` depends on a thread index.
fn on_thread(sc: &Scalars, v: ValId) -> bool {
    match sc.get(v) {
        Val::Symbol(Symbol::ParallelIndex(p)) => p.is_thread(),
        Val::Binary(_, a, b) => on_thread(sc, a) || on_thread(sc, b),
        _ => false,
    }
}

/// The Tensor-memory tensor a node reads or writes, if any.
fn touches(f: &Fusion, n: &Node, tmem: &[TvId]) -> Option<TvId> {
    let e = match n {
        Node::Expr { expr, .. } => *expr,
        Node::Init { tv, .. } => return tmem.contains(tv).then_some(*tv),
        Node::Vector(v) => v.expr,
        Node::Accumulate { acc, .. } | Node::ReduceAccumulator { acc, .. } => acc.expr,
        _ => return None,
    };
    let ex = &f.exprs[e];
    std::iter::once(ex.output).chain(ex.input_tvs()).find(|t| tmem.contains(t))
}

fn check_accesses(f: &Fusion, body: &[Node], tmem: &[TvId], conds: &mut Vec<ValId>) -> Result<()> {
    let sc = &f.scalars;
    for n in body {
        if let Some(tv) = touches(f, n, tmem) {
            let name = f.tv_name(tv);
            if matches!(n, Node::Vector(_)) {
                bail!("{name} is in Tensor memory, whose cells move 32 bits at a time here: it cannot be copied as a vector (do not vectorize its copies)");
            }
            let own = match n {
                Node::Expr { index: Some(ix), .. } | Node::Init { index: Some(ix), .. } => Some(ix.predicate),
                _ => None,
            };
            if let Some(c) = conds.iter().copied().chain(own).find(|&c| on_thread(sc, c)) {
                bail!(
                    "{name} is in Tensor memory, whose loads and stores every thread of a warp runs together, but its access here runs only where {} holds: make the thread-parallel extents exact (no partial thread tiles)",
                    sc.render(c)
                );
            }
        }
        match n {
            Node::If(i) => {
                conds.push(i.cond);
                check_accesses(f, &i.then, tmem, conds)?;
                check_accesses(f, &i.otherwise, tmem, conds)?;
                conds.pop();
            }
            _ => {
                for b in n.bodies() {
                    check_accesses(f, b, tmem, conds)?;
                }
            }
        }
    }
    Ok(())
}

fn holds_access(f: &Fusion, n: &Node, tmem: &[TvId]) -> bool {
    let allocates = matches!(n, Node::Alloc(a) if matches!(a.target, AllocTarget::Tensor(t) if tmem.contains(&t)));
    allocates || touches(f, n, tmem).is_some() || n.bodies().iter().any(|b| b.iter().any(|c| holds_access(f, c, tmem)))
}

/// A barrier and the dealloc after the statement holding the last access: the outermost
/// one, but inside block-parallel loops, which every thread of the block runs once (as the
/// seed does with the outermost serial loop holding the last read).
fn insert_dealloc(f: &Fusion, body: &mut Vec<Node>, tmem: &[TvId]) {
    let Some(last) = body.iter().rposition(|n| holds_access(f, n, tmem)) else {
        body.push(Node::Sync(SyncKind::War));
        body.push(Node::TensorMemory(TmemOp::Dealloc));
        return;
    };
    if let Node::Loop(l) = &mut body[last] {
        if l.parallel.is_block() {
            insert_dealloc(f, &mut l.body, tmem);
            return;
        }
    }
    body.insert(last + 1, Node::Sync(SyncKind::War));
    body.insert(last + 2, Node::TensorMemory(TmemOp::Dealloc));
}
