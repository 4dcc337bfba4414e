//! Device lowering: a scheduled fusion (one kernel) to kernel IR. The passes, in order:
//!
//! 1. `validate`   — schedule checks that need the whole fusion
//! 2. `precision` — half/bf16 register intermediates held in float
//! 3. analyses     — exact id graph, loop groups and loop promotion
//! 4. `loops`      — loop nest generation
//! 5. `allocation` — allocation domains, Allocate placement, reduction inits, global buffers
//! 6. `indexing`   — element offsets of every access, gathers, predicates
//! 7. `syncs`      — block syncs for Shared memory RAW/WAR hazards
//! 8. `reduction_hoist` — register accumulators before block/grid reductions
//! 9. `launch`     — grid/block dims and the dynamic shared memory layout
//! 10. `unswitch`  — unswitched loops and loop-invariant bounds checks (`If` nodes)
//! 11. `vectorize` — wide vector copies with their element-loop fallback
//!
//! Codegen and the interpreter both run the kernel IR these passes leave: codegen prints
//! it and decides nothing, so the interpreter checks every rewrite the GPU runs.
//!
//! Passes hand results on explicitly (kernel IR plus side tables); none reaches into
//! another's internals.

pub mod allocation;
pub mod indexing;
pub mod launch;
pub mod loops;
pub mod precision;
pub mod predicate;
pub mod reduction_hoist;
pub mod syncs;
pub mod unswitch;
pub mod validate;
pub mod vectorize;

use crate::analysis::id_graph::IdGraph;
use crate::analysis::loop_graph::LoopGraph;
use crate::error::Result;
use crate::ir::Fusion;
use crate::kernel::Kernel;

/// Lower `fusion` to one kernel.
pub fn lower(fusion: &Fusion) -> Result<Kernel> {
    let mut f = fusion.clone();
    validate::run(&f)?;
    precision::run(&mut f);
    let exact = IdGraph::exact(&f);
    let order = loops::expr_order(&f);
    let tv_order = loops::tensor_order(&f, &order);
    let lg = LoopGraph::build(&f, &exact, &tv_order)?;
    validate::partial_inlining(&f, &lg, &exact)?;
    validate::unique_parallel_dims(&f, &lg)?;
    validate::reduction_consumers(&f, &lg, &order)?;
    validate::parallel_reads(&f, &lg, &exact)?;
    let (mut body, mut next_index) = loops::run(&mut f, &lg, &order)?;
    let alloc = allocation::run(&mut f, &lg, &exact, &order, &mut body, &mut next_index)?;
    indexing::run(&mut f, &lg, &alloc.allocations, &mut body)?;
    syncs::run(&f, &lg, &exact, &mut body);
    reduction_hoist::run(&f, &lg, &mut body)?;
    let size_constraints = size_constraints(&f);
    let launch = launch::run(&mut f, &body);
    unswitch::run(&mut f, &lg, &mut body)?;
    vectorize::run(&mut f, &mut body)?;
    let k = Kernel {
        fusion: f,
        loops: lg,
        body,
        allocations: alloc.allocations,
        summary: alloc.summary,
        launch,
        size_constraints,
    };
    // Static dimensions are checked now; symbolic ones when sizes are bound.
    k.check_launch(|v| k.fusion.scalars.as_int(v))?;
    Ok(k)
}

/// Pairs of extents an expr aligns (both iteration ids): they must agree at run time.
fn size_constraints(f: &Fusion) -> Vec<(crate::ir::ValId, crate::ir::ValId, String)> {
    let mut out = Vec::new();
    for e in f.topo_exprs() {
        for pos in 0..f.exprs[e].inputs.len() {
            let Some(p) = f.exprs[e].inputs[pos].tensor() else {
                continue;
            };
            for (pid, cid) in crate::ir::mapping::logical_pairs(f, e, pos) {
                let (a, b) = (&f.ids[pid], &f.ids[cid]);
                if a.iter_type == crate::ir::IterType::Broadcast
                    || b.iter_type == crate::ir::IterType::Broadcast
                    || a.extent == b.extent
                {
                    continue;
                }
                let c = f.exprs[e].output;
                let axis = f.tvs[c].logical.iter().position(|&x| x == cid).unwrap_or(0);
                let what = format!(
                    "{} axis {axis} and its input {} ({})",
                    f.tv_name(c),
                    f.tv_name(p),
                    f.expr_short(&f.exprs[e])
                );
                out.push((a.extent, b.extent, what));
            }
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests;
