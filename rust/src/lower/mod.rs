//! Device lowering: a scheduled fusion (one kernel) to kernel IR. In order:
//!
//! 1. `validate`   — schedule checks that need the whole fusion
//! 2. `precision` — half/bf16 register intermediates held in float
//! 3. analyses     — exact id graph, loop groups and loop promotion
//!
//! then the kernel-IR passes of [`PASSES`]:
//!
//! 4. `schedule_checks` — schedule rules that need the loop groups
//! 5. `loops`      — loop nest generation
//! 6. `allocation` — allocation domains, Allocate placement, reduction inits, global buffers
//! 7. `indexing`   — element offsets of every access, gathers, predicates
//! 8. `syncs`      — block syncs for Shared memory RAW/WAR hazards
//! 9. `reduction_hoist` — register accumulators before block/grid reductions
//! 10. `fuse_loops` — sibling loops with the same iterations and no dependence, merged
//! 11. `circular_buffer` — pipelined loops split into prologue, main and epilogue
//! 12. `launch`    — grid/block dims and the dynamic shared memory layout
//! 13. `unswitch`  — unswitched loops and loop-invariant bounds checks (`If` nodes)
//! 14. `vectorize` — wide vector copies with their element-loop fallback
//! 15. `group_reductions` — adjacent block reductions over the same threads, paired
//! 16. `tensor_memory` — Tensor-memory regions, their alloc/relinquish/dealloc
//!
//! Codegen and the interpreter both run the kernel IR these passes leave: codegen prints
//! it and decides nothing, so the interpreter checks every rewrite the GPU runs.
//!
//! Steps 4-16 are one list of functions over one [`LowerCtx`]; the verifier
//! (`verify`) runs after each in tests and debug builds. Passes hand results on explicitly
//! (kernel IR plus side tables); none reaches into another's internals.

pub mod allocation;
pub mod circular_buffer;
pub mod fuse_loops;
pub mod group_reductions;
pub mod indexing;
pub mod launch;
pub mod loops;
pub mod precision;
pub mod predicate;
pub mod reduction_hoist;
pub mod syncs;
pub mod tensor_memory;
pub mod unswitch;
pub mod validate;
pub mod vectorize;
pub mod verify;

use std::sync::RwLock;

use rustc_hash::FxHashMap;

use crate::analysis::id_graph::IdGraph;
use crate::analysis::loop_graph::LoopGraph;
use crate::error::Result;
use crate::ir::{ExprId, Fusion, TvId};
use crate::kernel::{AllocationInfo, IrText, Kernel, KernelSummary, LaunchParams, Node};

/// Everything the kernel-IR passes read and write: the fusion (lowering adds scalars to
/// it), its analyses, the loop nest and the side tables the passes fill in.
pub struct LowerCtx {
    pub f: Fusion,
    pub exact: IdGraph,
    pub lg: LoopGraph,
    /// Expressions in the order the nest computes them.
    pub order: Vec<ExprId>,
    pub body: Vec<Node>,
    /// The next free loop-index number.
    pub next_index: u32,
    pub allocations: FxHashMap<TvId, AllocationInfo>,
    pub summary: KernelSummary,
    pub launch: Option<LaunchParams>,
    pub size_constraints: Vec<(crate::ir::ValId, crate::ir::ValId, String)>,
}

/// A kernel-IR pass: one step of [`PASSES`].
pub struct Pass {
    pub name: &'static str,
    pub run: fn(&mut LowerCtx) -> Result<()>,
}

/// The kernel-IR passes, in order (`KILN_DUMP=after:<name>` prints the IR after one).
pub const PASSES: &[Pass] = &[
    Pass { name: "schedule_checks", run: schedule_checks },
    Pass {
        name: "loops",
        run: |c| {
            // Deferred accumulator stores can close loops a later expr needs where the
            // kernel has several loop nests: then the plain order is used. Where a producer
            // in a loop of its own would close a loop a deeper sibling opened, the orders
            // that place shallower producers first are tried.
            let mut errors = Vec::new();
            let mut tried: Vec<Vec<ExprId>> = Vec::new();
            let candidates = [
                None,
                Some(loops::expr_order(&c.f, false)),
                Some(loops::expr_order_with(&c.f, true, true)),
                Some(loops::expr_order_with(&c.f, false, true)),
            ];
            for order in candidates {
                let order = order.unwrap_or_else(|| c.order.clone());
                if tried.contains(&order) {
                    continue;
                }
                tried.push(order.clone());
                let lg = if tried.len() == 1 {
                    c.lg.clone()
                } else {
                    match LoopGraph::build(&c.f, &c.exact, &loops::tensor_order(&c.f, &order)) {
                        Ok(lg) => lg,
                        Err(e) => {
                            errors.push(e);
                            continue;
                        }
                    }
                };
                let mut f = c.f.clone();
                match loops::run(&mut f, &lg, &order) {
                    Ok((body, next)) => {
                        (c.f, c.body, c.next_index, c.lg, c.order) = (f, body, next, lg, order);
                        return Ok(());
                    }
                    Err(e) => errors.push(e),
                }
            }
            // The plain order's error where it was tried (the one the user's schedule meets).
            let at = usize::from(errors.len() > 1);
            Err(errors.swap_remove(at))
        },
    },
    Pass {
        name: "allocation",
        run: |c| {
            let r = allocation::run(&mut c.f, &c.lg, &c.exact, &c.order, &mut c.body, &mut c.next_index)?;
            (c.allocations, c.summary) = (r.allocations, r.summary);
            Ok(())
        },
    },
    Pass { name: "indexing", run: |c| indexing::run(&mut c.f, &c.lg, &c.exact, &c.allocations, &c.order, &mut c.body) },
    Pass {
        name: "syncs",
        run: |c| {
            syncs::run(&c.f, &c.lg, &c.exact, &mut c.body);
            Ok(())
        },
    },
    Pass { name: "reduction_hoist", run: |c| reduction_hoist::run(&c.f, &c.lg, &mut c.body) },
    Pass { name: "fuse_loops", run: |c| fuse_loops::run(&mut c.f, &c.lg, &mut c.body) },
    Pass {
        name: "circular_buffer",
        run: |c| circular_buffer::run(&mut c.f, &c.lg, &c.exact, &mut c.summary, &mut c.body, &mut c.next_index),
    },
    Pass {
        name: "launch",
        run: |c| {
            c.size_constraints = size_constraints(&mut c.f);
            c.launch = Some(launch::run(&mut c.f, &c.body));
            Ok(())
        },
    },
    Pass { name: "unswitch", run: |c| unswitch::run(&mut c.f, &c.lg, &mut c.body) },
    Pass { name: "vectorize", run: |c| vectorize::run(&mut c.f, &mut c.body) },
    Pass { name: "group_reductions", run: |c| group_reductions::run(&c.f, &c.lg, &mut c.body) },
    Pass {
        name: "tensor_memory",
        run: |c| {
            let Some(launch) = c.launch.as_ref() else { crate::bail_internal!("tensor_memory runs after launch") };
            tensor_memory::run(&c.f, &mut c.body, launch, &mut c.summary)
        },
    },
];

/// What lowering records beside the kernel: IR dumps after the named passes, and whether
/// the verifier runs after every pass (always in debug builds).
#[derive(Clone, Debug, Default)]
pub struct LowerOptions {
    pub dump_after: Vec<String>,
    pub verify: bool,
}

static OPTIONS: RwLock<LowerOptions> = RwLock::new(LowerOptions { dump_after: Vec::new(), verify: false });

/// Set the options every later lowering uses (the Python layer sets them from `KILN_DUMP`
/// and its test configuration).
pub fn set_options(o: LowerOptions) -> Result<()> {
    for name in &o.dump_after {
        if !PASSES.iter().any(|p| p.name == name) {
            let names: Vec<&str> = PASSES.iter().map(|p| p.name).collect();
            crate::bail!("KILN_DUMP=after:{name}: no such pass; the passes are {}", names.join(", "));
        }
    }
    *OPTIONS.write().unwrap_or_else(|e| e.into_inner()) = o;
    Ok(())
}

/// Schedule rules that need the loop groups (the fusion-level ones ran before the
/// analyses).
fn schedule_checks(c: &mut LowerCtx) -> Result<()> {
    validate::partial_inlining(&c.f, &c.lg, &c.exact)?;
    validate::unique_parallel_dims(&c.f, &c.lg)?;
    validate::reduction_consumers(&c.f, &c.lg, &c.order)?;
    validate::parallel_reads(&c.f, &c.lg, &c.exact)?;
    circular_buffer::drop_single_iteration(&mut c.f, &c.lg);
    circular_buffer::check(&c.f, &c.lg)
}

/// Lower `fusion` to one kernel.
pub fn lower(fusion: &Fusion) -> Result<Kernel> {
    let options = OPTIONS.read().unwrap_or_else(|e| e.into_inner()).clone();
    let mut f = fusion.clone();
    validate::run(&f)?;
    precision::run(&mut f);
    let exact = IdGraph::exact(&f);
    let order = loops::expr_order(&f, true);
    let tv_order = loops::tensor_order(&f, &order);
    let lg = LoopGraph::build(&f, &exact, &tv_order)?;
    let mut c = LowerCtx {
        f,
        exact,
        lg,
        order,
        body: Vec::new(),
        next_index: 0,
        allocations: FxHashMap::default(),
        summary: KernelSummary::default(),
        launch: None,
        size_constraints: Vec::new(),
    };
    let verify = options.verify || cfg!(debug_assertions);
    let mut dumps = Vec::new();
    let mut stage = verify::Stage { indexed: false, allocated: false, synced: false, pipelined: false };
    for p in PASSES {
        (p.run)(&mut c)?;
        stage.indexed |= p.name == "indexing";
        stage.allocated |= p.name == "allocation";
        stage.synced |= p.name == "syncs";
        stage.pipelined |= p.name == "circular_buffer";
        if verify {
            verify::run(&c.f, &c.lg, &c.exact, &c.body, stage, p.name)?;
        }
        if options.dump_after.iter().any(|n| n == p.name) {
            dumps.push((p.name.to_string(), IrText { fusion: &c.f, summary: &c.summary }.body(&c.body)));
        }
    }
    let Some(launch) = c.launch else { crate::bail_internal!("lowering ended without launch parameters") };
    let k = Kernel {
        fusion: c.f,
        loops: c.lg,
        body: c.body,
        allocations: c.allocations,
        summary: c.summary,
        launch,
        size_constraints: c.size_constraints,
        pass_dumps: dumps,
    };
    // Static dimensions are checked now; symbolic ones when sizes are bound.
    k.check_launch(|v| k.fusion.scalars.as_int(v))?;
    Ok(k)
}

/// Pairs of extents an expr aligns (both iteration ids): they must agree at run time.
fn size_constraints(f: &mut Fusion) -> Vec<(crate::ir::ValId, crate::ir::ValId, String)> {
    let mut out = Vec::new();
    let one = f.scalars.int(1);
    for e in f.topo_exprs() {
        // A squeezed axis whose size is only known to be at most one must be one.
        if let crate::ir::Op::Squeeze { removed } = &f.exprs[e].op {
            if let Some(x) = f.exprs[e].inputs[0].tensor() {
                for (axis, (&id, &r)) in f.no_reduction_logical(x).iter().zip(removed).enumerate() {
                    let d = &f.ids[id];
                    if r && d.iter_type != crate::ir::IterType::Broadcast && f.scalars.as_int(d.extent) != Some(1) {
                        let what =
                            format!("{} axis {axis}, squeezed into {}", f.tv_name(x), f.tv_name(f.exprs[e].output));
                        out.push((d.extent, one, what));
                    }
                }
            }
        }
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
                // Named as the definition names them: the schedule's copies and rewrites
                // are not tensors the user knows.
                let (uc, up) = (f.user_tv(c), f.user_tv(p));
                let how = if (uc, up) == (c, p) { format!(" ({})", f.expr_short(&f.exprs[e])) } else { String::new() };
                let what = format!("{} axis {axis} and its input {}{how}", f.tv_name(uc), f.tv_name(up));
                out.push((a.extent, b.extent, what));
            }
        }
    }
    out
}

#[cfg(test)]
mod snapshots;
#[cfg(test)]
pub(crate) mod tests;
