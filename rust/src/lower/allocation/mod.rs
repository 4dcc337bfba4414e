//! The allocation pass (seed 000).
//! Consumes: the loop nest (kernel IR before indexing), the loop graph and the exact
//! id graph. Produces: (1) an `AllocationInfo` for every tensor the kernel touches —
//! allocated ids after loop promotion, stride per id, contiguity — for indexing;
//! (2) `Allocate` nodes placed in the nest, with reduction-init loop nests; (3) the
//! kernel's global buffers in `KernelSummary`.
//! Guarantees: every violated precondition is a `KilnError` naming tensor and ids.
//!
//! Three pieces, one file each: `domain` (which ids, strides, contiguity),
//! `placement` (where the Allocate and the init go), `global_buffers` (grid
//! reduction work buffers and semaphores, Global intermediates).

pub mod domain;
pub mod global_buffers;
pub mod placement;

use rustc_hash::FxHashMap;

use crate::analysis::id_graph::IdGraph;
use crate::analysis::loop_graph::LoopGraph;
use crate::error::Result;
use crate::ir::{ExprId, Fusion, MemoryType, Op, TvId};
use crate::kernel::{AllocTarget, Allocate, AllocationInfo, GlobalBuffer, KernelSummary, Node};

/// Output of the allocation pass.
pub struct AllocationResult {
    pub allocations: FxHashMap<TvId, AllocationInfo>,
    pub summary: KernelSummary,
}

/// Run the pass over `body` (mutated in place: Allocate and init nodes are inserted).
pub fn run(
    f: &mut Fusion,
    lg: &LoopGraph,
    exact: &IdGraph,
    order: &[ExprId],
    body: &mut Vec<Node>,
    next_index: &mut u32,
) -> Result<AllocationResult> {
    let mut allocations: FxHashMap<TvId, AllocationInfo> = FxHashMap::default();
    let mut summary = KernelSummary::default();
    let mut top: Vec<Node> = Vec::new();
    let mut placed = placement::Insertions::new(body);

    // Inputs are read as given: their layout is their logical (or set) domain.
    for op in f.inputs.clone() {
        let Some(tv) = op.tensor() else { continue };
        if f.tvs[tv].uses.is_empty() {
            continue;
        }
        let (ids, contig) = domain::infer_ids(f, lg, exact, tv, 0)?;
        let info = domain::allocation_info(f, lg, tv, &ids, &contig, 0)?;
        allocations.insert(tv, info);
    }

    for &e in order {
        let tv = f.exprs[e].output;
        let mem = f.tvs[tv].memory;
        let alloc_pos = if mem == MemoryType::Global { 0 } else { domain::alloc_position(f, lg, tv) };
        let (ids, contig) = domain::infer_ids(f, lg, exact, tv, alloc_pos)?;
        // Only Local allocations sit inside the nest; Shared and Global ones are at the top.
        let position = if mem == MemoryType::Local { alloc_pos } else { 0 };
        let mut info = domain::allocation_info(f, lg, tv, &ids, &contig, position)?;
        let is_output = f.is_output(tv);
        // A transposed Shared tile gets its rows padded so that both the row-wise writes
        // and the column-wise reads hit distinct banks (rule 5's tile, made conflict-free).
        let padded_row = if mem == MemoryType::Shared { domain::transposed_tile_row_padding(f, &info) } else { None };
        if let Some(row) = padded_row {
            info.strides[0] = f.scalars.int(row);
        }

        let mut nodes: Vec<Node> = Vec::new();
        if !is_output {
            let mut shape: Vec<_> = info.ids.iter().map(|&id| f.ids[id].extent).collect();
            if let Some(row) = padded_row {
                shape[1] = f.scalars.int(row);
            }
            if shape.is_empty() {
                shape.push(f.scalars.int(1));
            }
            // Rule 9: a circular-buffered tensor holds one buffer per stage; its
            // AllocationInfo keeps one buffer's layout, which indexing reads.
            // A circular-buffered Local copy (registers loaded ahead) is declared at the top
            // of the kernel too: its stages outlive one iteration of the pipelined loop.
            let staged = f.tvs[tv].circular_buffer.filter(|_| mem != MemoryType::Global);
            if let Some(cb) = staged {
                shape.insert(0, f.scalars.int(i64::from(cb.stages)));
                info.stages = cb.stages;
            }
            let dtype = f.tvs[tv].dtype;
            let alloc = Allocate {
                target: AllocTarget::Tensor(tv),
                memory: mem,
                dtype,
                shape: shape.clone(),
                zero_init: false,
                resets_to_zero: false,
            };
            match mem {
                MemoryType::Local if staged.is_some() => top.push(Node::Alloc(alloc)),
                MemoryType::Local => nodes.push(Node::Alloc(alloc)),
                MemoryType::Shared => top.push(Node::Alloc(alloc)),
                MemoryType::Global => {
                    // A Global intermediate is a kernel buffer the caller provides.
                    summary.global_allocations.push(GlobalBuffer {
                        name: f.tv_name(tv),
                        tv: Some(tv),
                        dtype,
                        shape,
                        zero_init: false,
                        resets_to_zero: false,
                        error_word: false,
                    });
                    top.push(Node::Alloc(alloc));
                }
            }
        }

        if let Op::Reduction { init, .. } = f.exprs[e].op {
            let init_pos = placement::init_position(f, lg, tv, alloc_pos);
            let nest = placement::init_nest(f, lg, tv, init_pos, init, next_index);
            if init_pos == alloc_pos {
                nodes.push(nest);
            } else {
                placed.before_expr(f, body, lg, tv, init_pos, e, vec![nest])?;
            }
            for b in global_buffers::grid_reduction_buffers(f, lg, tv)? {
                summary.has_grid_reduction = true;
                summary.global_allocations.push(b);
                let i = summary.global_allocations.len() - 1;
                let b = &summary.global_allocations[i];
                top.push(Node::Alloc(Allocate {
                    target: AllocTarget::Buffer(i),
                    memory: MemoryType::Global,
                    dtype: b.dtype,
                    shape: b.shape.clone(),
                    zero_init: b.zero_init,
                    resets_to_zero: b.resets_to_zero,
                }));
            }
        }
        if !nodes.is_empty() {
            // Local allocations and every init sit at the allocation position in the nest.
            placed.before_expr(f, body, lg, tv, alloc_pos, e, nodes)?;
        }
        allocations.insert(tv, info);
    }
    // Gathers report indices outside their table through the kernel's error word.
    if order.iter().any(|&e| f.exprs[e].op.index_input().is_some()) {
        let four = f.scalars.int(4);
        summary.global_allocations.push(GlobalBuffer {
            name: crate::kernel::INDEX_ERROR.to_string(),
            tv: None,
            dtype: crate::ir::DataType::Int,
            shape: vec![four],
            zero_init: true,
            resets_to_zero: true,
            error_word: true,
        });
    }
    // Rule 9: the mbarriers of bulk copies, in Shared memory.
    summary.barriers = crate::lower::circular_buffer::barrier_arrays(f, lg);
    for (i, b) in summary.barriers.iter().enumerate() {
        top.push(Node::Alloc(Allocate {
            target: AllocTarget::Barriers(i as u32),
            memory: MemoryType::Shared,
            dtype: crate::ir::DataType::Int,
            shape: vec![f.scalars.int(b.size)],
            zero_init: false,
            resets_to_zero: false,
        }));
    }
    placed.apply(body);
    top.append(body);
    *body = top;
    Ok(AllocationResult { allocations, summary })
}
