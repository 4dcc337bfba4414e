//! Launch parameters.
//! Consumes: the indexed loop nest and its allocations. Produces: grid and block
//! dimensions (the largest extent of any loop of each parallel type) and the dynamic
//! shared memory layout (Shared tensors, then the block-reduction workspace), all as
//! expressions of input sizes.

use crate::ir::{Fusion, MemoryType, Op, ParallelType, ValId};
use crate::kernel::{AllocTarget, LaunchParams, Node};

fn collect(body: &[Node], f: &Fusion, dims: &mut [Vec<ValId>; 6], reductions: &mut bool) {
    for n in body {
        match n {
            Node::Loop(l) => {
                let slot = match l.parallel {
                    ParallelType::BIDx => Some(0),
                    ParallelType::BIDy => Some(1),
                    ParallelType::BIDz => Some(2),
                    ParallelType::TIDx => Some(3),
                    ParallelType::TIDy => Some(4),
                    ParallelType::TIDz => Some(5),
                    _ => None,
                };
                if let Some(s) = slot {
                    if !dims[s].contains(&l.extent) {
                        dims[s].push(l.extent);
                    }
                }
            }
            Node::Expr { expr, .. } => {
                if matches!(f.exprs[*expr].op, Op::Reduction { .. }) {
                    *reductions = true;
                }
            }
            Node::ReduceAccumulator { .. } => *reductions = true,
            _ => {}
        }
        for b in n.bodies() {
            collect(b, f, dims, reductions);
        }
    }
}

/// Compute the launch parameters of a lowered body.
pub fn run(f: &mut Fusion, body: &[Node]) -> LaunchParams {
    let mut dims: [Vec<ValId>; 6] = Default::default();
    let mut has_reduction = false;
    collect(body, f, &mut dims, &mut has_reduction);
    let one = f.scalars.int(1);
    let mut out = [one; 6];
    for (i, v) in dims.iter().enumerate() {
        out[i] = v.iter().copied().reduce(|a, b| f.scalars.max(a, b)).unwrap_or(one);
    }
    // Shared tensors first, each 16-byte aligned, then the reduction workspace.
    let mut offset = f.scalars.int(0);
    let mut smem_offsets = Vec::new();
    let mut barrier_offsets = Vec::new();
    let sixteen = f.scalars.int(16);
    for n in body {
        if let Node::Alloc(a) = n {
            let place = match (a.target, a.memory) {
                (AllocTarget::Tensor(tv), MemoryType::Shared) => {
                    smem_offsets.push((tv, offset));
                    true
                }
                (AllocTarget::Barriers(i), _) => {
                    barrier_offsets.push((i, offset));
                    true
                }
                _ => false,
            };
            if place {
                let elems = f.scalars.product(a.shape.iter().copied());
                let bytes_per = f.scalars.int(a.dtype.size_bytes() as i64);
                let bytes = f.scalars.mul(elems, bytes_per);
                let padded = f.scalars.ceil_div(bytes, sixteen);
                let padded = f.scalars.mul(padded, sixteen);
                offset = f.scalars.add(offset, padded);
            }
        }
    }
    let mut reduction_workspace = None;
    if has_reduction {
        reduction_workspace = Some(offset);
        let threads = f.scalars.product([out[3], out[4], out[5]]);
        let eight = f.scalars.int(8);
        let bytes = f.scalars.mul(threads, eight);
        offset = f.scalars.add(offset, bytes);
    }
    LaunchParams {
        grid: [out[0], out[1], out[2]],
        block: [out[3], out[4], out[5]],
        smem_bytes: offset,
        smem_offsets,
        barrier_offsets,
        reduction_workspace,
    }
}
