//! Which float values end as half or bfloat16 values: every use of them, through value-
//! carrying ops, reaches a cast to a 2-byte float or a 2-byte float tensor in memory, and
//! nothing else (no float output, no comparison, no index).
//!
//! Codegen computes `exp`, `sigmoid` and division of such values with the hardware's
//! approximations (`ex2.approx` after one multiplication, `div.full`). Their error, at most
//! `2 + 1.173 |x|` float ulp for `exp` (CUDA's bound for `__expf`, `2^-16` relative over
//! its whole range) and 2 ulp for division, is below 1/32 of the rounding to half (`2^-11`)
//! or bfloat16 (`2^-8`) that follows, so results stay at least as accurate as computing in
//! the 2-byte type op by op. A half softmax computed in float spends half its instructions
//! on the exact `expf` and IEEE division otherwise (H200: 63 instructions per element
//! against torch.compile's 27).

use rustc_hash::FxHashSet;

use crate::ir::{DataType, Fusion, MemoryType, Op, TvId};

/// True for the 2-byte float types.
fn narrow_type(dt: DataType) -> bool {
    dt.is_float() && dt.size_bytes() <= 2
}

/// The tensors of `f` whose values end as half or bfloat16 values (see the module docs).
pub fn ends_narrow(f: &Fusion) -> FxHashSet<TvId> {
    let mut narrow: FxHashSet<TvId> = FxHashSet::default();
    for &e in f.topo_exprs().iter().rev() {
        let t = f.exprs[e].output;
        let t_ = &f.tvs[t];
        let stored = f.is_output(t) || t_.memory != MemoryType::Local;
        let ends = if narrow_type(t_.dtype) && (stored || matches!(f.exprs[e].op, Op::Cast(_))) {
            true // rounded to a 2-byte float here
        } else {
            !stored
                && t_.dtype.is_float()
                && !t_.uses.is_empty()
                && t_.uses.iter().all(|&u| {
                    let out = f.exprs[u].output;
                    let carries = match &f.exprs[u].op {
                        op if op.is_elementwise() => true,
                        Op::Broadcast { .. } | Op::Squeeze { .. } | Op::Permute { .. } | Op::Reduction { .. } => true,
                        // A gather's table carries values; its index does not.
                        Op::IndexSelect { .. } | Op::Remap { .. } => f.exprs[u].inputs[0].tensor() == Some(t),
                        _ => false,
                    };
                    carries && f.tvs[out].dtype.is_float() && narrow.contains(&out)
                })
        };
        if ends {
            narrow.insert(t);
        }
    }
    narrow
}
