//! Kernel global buffers (rule 8): a reduction across blocks needs a work buffer for
//! partial results and a semaphore per output segment. Flags follow seed 004: the
//! work buffer needs no zeroing; the semaphore is zeroed before the launch; the
//! serial protocol also returns it to zero, so a host may reuse a zeroed pool.

use crate::analysis::loop_graph::LoopGraph;
use crate::error::Result;
use crate::ir::{DataType, Fusion, IterType, TvId};
use crate::kernel::GlobalBuffer;

/// Buffers for `tv` if it is the output of a grid reduction; empty otherwise.
pub fn grid_reduction_buffers(
    f: &mut Fusion,
    lg: &LoopGraph,
    tv: TvId,
) -> Result<Vec<GlobalBuffer>> {
    let ld = f.tvs[tv].loop_domain.clone();
    let par = |a: usize| lg.groups[lg.group(tv, a)].parallel;
    let is_grid =
        (0..ld.len()).any(|a| f.ids[ld[a]].iter_type == IterType::Reduction && par(a).is_block());
    if !is_grid {
        return Ok(Vec::new());
    }
    let name = f.tv_name(tv);
    let serial = f.tvs[tv].serial_grid_reduction;
    // One semaphore per output segment: the non-reduced block dims.
    let mut seg = Vec::new();
    for (a, &id) in ld.iter().enumerate() {
        if par(a).is_block() && f.ids[id].iter_type != IterType::Reduction {
            seg.push(f.ids[lg.promoted(tv, a)].extent);
        }
    }
    let segments = f.scalars.product(seg);
    let work_shape = if serial {
        // Serial: the running result of every output element lives in the work buffer.
        f.no_reduction_logical(tv)
            .iter()
            .map(|&id| f.ids[id].extent)
            .filter(|&e| !f.scalars.is_const(e, 1))
            .collect()
    } else {
        // One partial per (block, thread) that takes part.
        let mut v = Vec::new();
        for (a, _) in ld.iter().enumerate() {
            if par(a).is_thread_or_block() {
                v.push(f.ids[lg.promoted(tv, a)].extent);
            }
        }
        v
    };
    let work_shape = if work_shape.is_empty() {
        vec![f.scalars.int(1)]
    } else {
        work_shape
    };
    Ok(vec![
        GlobalBuffer {
            name: format!("{name}_work"),
            tv: None,
            dtype: f.tvs[tv].dtype,
            shape: work_shape,
            zero_init: false,
            resets_to_zero: false,
        },
        GlobalBuffer {
            name: format!("{name}_sync"),
            tv: None,
            dtype: DataType::Int,
            shape: vec![segments],
            zero_init: true,
            resets_to_zero: serial,
        },
    ])
}
