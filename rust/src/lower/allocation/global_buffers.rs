//! Kernel global buffers (rule 8): a reduction across blocks needs a work buffer for
//! partial results and a semaphore per output segment. Flags follow seed 004: the
//! work buffer needs no zeroing; the semaphore must be zero at launch. Both of the
//! runtime's protocols return it to zero (the last block to arrive resets it), so it is
//! also `resets_to_zero` and a host keeps it in a pool zeroed once: no memset per launch,
//! which costs a full-sum kernel about 1 us on the H200.

use crate::analysis::loop_graph::LoopGraph;
use crate::bail;
use crate::error::Result;
use crate::ir::{DataType, Fusion, MemoryType, ParallelType, TvId, ValId};
use crate::kernel::GlobalBuffer;

/// Launch extent of `pt`: the largest extent of any loop group mapped to it (1 if none).
pub fn launch_extent(f: &mut Fusion, lg: &LoopGraph, pt: ParallelType) -> ValId {
    let mut exts: Vec<ValId> = Vec::new();
    for g in &lg.groups {
        if g.parallel == pt {
            let e = f.ids[g.promoted].extent;
            if !exts.contains(&e) {
                exts.push(e);
            }
        }
    }
    let one = f.scalars.int(1);
    exts.into_iter().reduce(|a, b| f.scalars.max(a, b)).unwrap_or(one)
}

/// Buffers for `tv` if it is the output of a grid reduction; empty otherwise.
///
/// Sizes follow the runtime's protocols (`runtime.cuh`): with NSEG output segments
/// (non-reduced grid dims), G reducing blocks and P non-reduced threads per block, the
/// normal work buffer holds NSEG*G*P partials, the serial one NSEG*P running results,
/// and there is one int64 semaphore per segment.
pub fn grid_reduction_buffers(f: &mut Fusion, lg: &LoopGraph, tv: TvId) -> Result<Vec<GlobalBuffer>> {
    let reduced = crate::analysis::parallel::reduced_dims(f, lg, tv);
    if !reduced.iter().any(|&p| f.is_grid_dim(p)) {
        return Ok(Vec::new());
    }
    let name = f.tv_name(tv);
    if f.tvs[tv].memory != MemoryType::Global {
        bail!(
            "{name} is reduced across blocks but lives in {} memory; only one block would hold the result, so a grid reduction's output must be Global (make it a fusion output or set_memory_type(Global))",
            f.tvs[tv].memory.enum_name()
        );
    }
    let serial = f.tvs[tv].serial_grid_reduction;
    let product = |f: &mut Fusion, lg: &LoopGraph, types: &[ParallelType]| -> ValId {
        let exts: Vec<ValId> = types.iter().map(|&p| launch_extent(f, lg, p)).collect();
        f.scalars.product(exts)
    };
    let blocks = [ParallelType::BIDx, ParallelType::BIDy, ParallelType::BIDz];
    let threads = [ParallelType::TIDx, ParallelType::TIDy, ParallelType::TIDz];
    let seg_types: Vec<ParallelType> = blocks.iter().copied().filter(|p| !reduced.contains(p)).collect();
    let red_block_types: Vec<ParallelType> = blocks.iter().copied().filter(|p| reduced.contains(p)).collect();
    let out_thread_types: Vec<ParallelType> = threads.iter().copied().filter(|p| !reduced.contains(p)).collect();
    let nseg = product(f, lg, &seg_types);
    let g = product(f, lg, &red_block_types);
    let p = product(f, lg, &out_thread_types);
    let dims = if serial { vec![nseg, p] } else { vec![nseg, g, p] };
    let mut work_shape: Vec<ValId> = dims.into_iter().filter(|&d| !f.scalars.is_const(d, 1)).collect();
    if work_shape.is_empty() {
        work_shape.push(f.scalars.int(1));
    }
    Ok(vec![
        GlobalBuffer {
            name: format!("{name}_work"),
            tv: None,
            dtype: f.tvs[tv].dtype,
            shape: work_shape,
            zero_init: false,
            resets_to_zero: false,
            error_word: false,
        },
        GlobalBuffer {
            name: format!("{name}_sync"),
            tv: None,
            dtype: DataType::Int,
            shape: vec![nseg],
            zero_init: true,
            resets_to_zero: true,
            error_word: false,
        },
    ])
}
