//! Launch parameters.
//! Consumes: the indexed loop nest and its allocations. Produces: grid and block
//! dimensions (the largest extent of any loop of each parallel type, at least one where the
//! loops guard an empty extent: `ParallelExtents::ragged`) and the dynamic
//! shared memory layout (Shared tensors, then the block-reduction workspace), all as
//! expressions of input sizes.

use crate::ir::{Fusion, IterType, MemoryType, Op, ParallelType, ValId};
use crate::kernel::{AllocTarget, LaunchParams, Node};
use rustc_hash::FxHashMap;

/// The thread and block loops of a kernel body, per parallel type: the distinct extents of
/// its loops, and whether any of them runs a reduction axis.
#[derive(Default)]
pub struct ParallelExtents(pub FxHashMap<ParallelType, (Vec<ValId>, bool)>);

impl ParallelExtents {
    /// The thread and block loops of `body`.
    pub fn of(f: &Fusion, body: &[Node]) -> Self {
        let mut out = ParallelExtents::default();
        out.collect(f, body);
        out
    }

    fn collect(&mut self, f: &Fusion, body: &[Node]) {
        for n in body {
            if let Node::Loop(l) = n {
                if l.parallel.is_thread_or_block() {
                    let (v, reduces) = self.0.entry(l.parallel).or_default();
                    if !v.contains(&l.extent) {
                        v.push(l.extent);
                    }
                    *reduces |= f.ids[l.id].iter_type == IterType::Reduction;
                }
            }
            for b in n.bodies() {
                self.collect(f, b);
            }
        }
    }

    /// True when the loops of `pt` need `index < extent` guards: their extents differ, or
    /// the one extent may be 0 and is launched as 1. (A thread axis of a runtime size can
    /// be empty, and a reduction over an empty block axis still writes its identity; a
    /// block axis that runs only outputs is not clamped, as an empty one has nothing to
    /// write, and the automatic schedules' grids are left without guards.)
    pub fn ragged(&self, f: &Fusion, pt: ParallelType) -> bool {
        self.0.get(&pt).is_some_and(|(v, reduces)| v.len() > 1 || self.clamped(f, pt, v, *reduces))
    }

    fn clamped(&self, f: &Fusion, pt: ParallelType, extents: &[ValId], reduces: bool) -> bool {
        (pt.is_thread() || reduces) && extents.iter().all(|&e| f.scalars.range(e).0 < 1)
    }

    /// The launch dimension of `pt`: the largest extent of its loops, at least one where
    /// `ragged` guards an empty one.
    fn dim(&self, f: &mut Fusion, pt: ParallelType) -> ValId {
        let one = f.scalars.int(1);
        let Some((v, reduces)) = self.0.get(&pt) else { return one };
        let largest = v.iter().copied().reduce(|a, b| f.scalars.max(a, b)).unwrap_or(one);
        if self.clamped(f, pt, v, *reduces) {
            f.scalars.max(largest, one)
        } else {
            largest
        }
    }
}

fn collect(body: &[Node], f: &Fusion, reductions: &mut bool) {
    for n in body {
        match n {
            Node::Expr { expr, .. } => {
                if matches!(f.exprs[*expr].op, Op::Reduction { .. }) {
                    *reductions = true;
                }
            }
            Node::ReduceAccumulator { .. } => *reductions = true,
            _ => {}
        }
        for b in n.bodies() {
            collect(b, f, reductions);
        }
    }
}

/// Compute the launch parameters of a lowered body.
pub fn run(f: &mut Fusion, body: &[Node]) -> LaunchParams {
    let mut has_reduction = false;
    collect(body, f, &mut has_reduction);
    let extents = ParallelExtents::of(f, body);
    let out = crate::analysis::parallel::DIMS.map(|pt| extents.dim(f, pt));
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
