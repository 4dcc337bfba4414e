//! Precision of register intermediates.
//!
//! Consumes a scheduled fusion (memory types and parallel types set). Produces the same
//! fusion where every half/bfloat16 tensor that lives in Local memory and only carries an
//! arithmetic value between two ops holds float instead. Guarantees: a value is rounded to
//! half/bfloat16 only where it is stored to memory the user can see or that is shared
//! (Global, Shared), where the user asked for it (the output of an explicit cast), or where
//! a vectorized copy moves its raw bits (caches of inputs and outputs keep their dtype so
//! 16-byte copies stay bit copies). Codegen and the interpreter both read dtypes from the
//! lowered fusion, so they agree by construction.
//!
//! Why: rounding after every op costs a convert per op and per element, and loses
//! precision that no user asked to lose (torch.compile and nvFuser also compute in float).

use crate::ir::{DataType, Fusion, MemoryType, Op, ParallelType, TvId};

/// Promote Local half/bfloat16 intermediates of `f` to float (see the module comment).
pub fn run(f: &mut Fusion) {
    let promote: Vec<TvId> = f.tvs.keys().filter(|&tv| promotable(f, tv)).collect();
    for tv in promote {
        f.tvs[tv].dtype = DataType::Float;
    }
}

fn promotable(f: &Fusion, tv: TvId) -> bool {
    let t = &f.tvs[tv];
    if !matches!(t.dtype, DataType::Half | DataType::BFloat16)
        || t.memory != MemoryType::Local
        || f.is_input(tv)
        || f.is_output(tv)
    {
        return false;
    }
    let Some(def) = t.definition else { return false };
    if matches!(f.exprs[def].op, Op::Cast(_)) || vector_copy(f, tv) {
        return false;
    }
    // A reader of the raw bits through a vectorized copy needs them unchanged.
    !t.uses.iter().any(|&u| vector_copy(f, f.exprs[u].output))
}

/// True when `tv` is written by a Set or broadcast with a vectorized axis (a 16-byte-style copy).
fn vector_copy(f: &Fusion, tv: TvId) -> bool {
    let t = &f.tvs[tv];
    let Some(def) = t.definition else { return false };
    matches!(f.exprs[def].op, Op::Set | Op::Broadcast { .. })
        && t.loop_domain.iter().any(|&id| f.ids[id].parallel == ParallelType::Vectorize)
}
