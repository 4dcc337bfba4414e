//! Device lowering: a scheduled fusion (one kernel) to kernel IR. The passes, in order:
//!
//! 1. `validate`   — schedule checks that need the whole fusion
//! 2. analyses     — exact id graph, loop groups and loop promotion
//! 3. `loops`      — loop nest generation
//! 4. `allocation` — allocation domains, Allocate placement, reduction inits, global buffers
//! 5. `indexing`   — element offsets of every access, gathers, predicates
//! 6. `launch`     — grid/block dims and the dynamic shared memory layout
//!
//! Passes hand results on explicitly (kernel IR plus side tables); none reaches into
//! another's internals.

pub mod allocation;
pub mod indexing;
pub mod launch;
pub mod loops;
pub mod validate;

use crate::analysis::id_graph::IdGraph;
use crate::analysis::loop_graph::LoopGraph;
use crate::error::Result;
use crate::ir::Fusion;
use crate::kernel::Kernel;

/// Lower `fusion` to one kernel.
pub fn lower(fusion: &Fusion) -> Result<Kernel> {
    let mut f = fusion.clone();
    validate::run(&f)?;
    let exact = IdGraph::exact(&f);
    let order = loops::expr_order(&f);
    let tv_order = loops::tensor_order(&f, &order);
    let lg = LoopGraph::build(&f, &exact, &tv_order)?;
    let (mut body, mut next_index) = loops::run(&mut f, &lg, &order)?;
    let alloc = allocation::run(&mut f, &lg, &exact, &order, &mut body, &mut next_index)?;
    indexing::run(&mut f, &lg, &alloc.allocations, &mut body)?;
    let launch = launch::run(&mut f, &body);
    Ok(Kernel {
        fusion: f,
        loops: lg,
        body,
        allocations: alloc.allocations,
        summary: alloc.summary,
        launch,
    })
}

#[cfg(test)]
mod tests;
