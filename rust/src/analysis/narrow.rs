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
//!
//! The terms of a shifted sum, `sum(exp(x - max(x)))` where every use of the exp is a sum
//! (`shifted_sum_terms`), take `ex2.approx` too: each argument is at most zero, so the
//! largest term (1) carries only the approximation's 2 ulp, and a term's error from rounding
//! `d * log2(e)` grows with `|d|` as the term itself shrinks by `e^d`; weighted by their
//! shares, the terms of `n` elements stay within `2 + (1 + ln n) / 2` ulp of the sum, under
//! the float summation's own error (the bound of `kiln::LseAcc`). Terms below 2^-126 of the
//! largest flush to zero. A float cross-entropy row spent two thirds of its instructions on
//! the exact `expf` otherwise.

use rustc_hash::FxHashSet;

use crate::ir::{BinaryOp, DataType, Fusion, MemoryType, Op, Operand, ReductionOp, TvId, UnaryOp};

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

/// The float `exp(x - broadcast(max(x)))` tensors whose every use is a sum (see the module
/// docs): a maximum over any axes of the same values, so no argument is above zero.
pub fn shifted_sum_terms(f: &Fusion) -> FxHashSet<TvId> {
    let mut terms = FxHashSet::default();
    for e in f.topo_exprs() {
        let t = f.exprs[e].output;
        if f.exprs[e].op != Op::Unary(UnaryOp::Exp) || f.tvs[t].dtype != DataType::Float || f.is_output(t) {
            continue;
        }
        let summed = !f.tvs[t].uses.is_empty()
            && f.tvs[t].uses.iter().all(|&u| matches!(f.exprs[u].op, Op::Reduction { op: ReductionOp::Sum, .. }));
        if summed && at_most_zero(f, f.exprs[e].inputs[0]) {
            terms.insert(t);
        }
    }
    terms
}

/// True where `d` is `x - broadcast(max(x))` (through copies and exact float widenings).
fn at_most_zero(f: &Fusion, d: Operand) -> bool {
    let Some(d) = d.tensor() else { return false };
    let Some(de) = f.tvs[d].definition else { return false };
    if f.exprs[de].op != Op::Binary(BinaryOp::Sub) {
        return false;
    }
    let (Some(x), Some(b)) = (f.exprs[de].inputs[0].tensor(), f.exprs[de].inputs[1].tensor()) else { return false };
    // The subtracted value, back through broadcasts and copies to a maximum.
    let mut m = b;
    loop {
        let Some(me) = f.tvs[m].definition else { return false };
        match f.exprs[me].op {
            Op::Broadcast { .. } | Op::Set => {}
            Op::Cast(dt) if Some(dt) == f.exprs[me].inputs[0].tensor().map(|i| f.tvs[i].dtype) => {}
            Op::Reduction { op: ReductionOp::Max, .. } => {
                let Some(src) = f.exprs[me].inputs[0].tensor() else { return false };
                return f.tvs[src].dtype == f.tvs[x].dtype && same_values(f, src) == same_values(f, x);
            }
            _ => return false,
        }
        let Some(next) = f.exprs[me].inputs[0].tensor() else { return false };
        m = next;
    }
}

/// The tensor `t`'s values are copied from: back through copies and exact widenings of
/// floats (per-pass copies of one row hold equal values).
fn same_values(f: &Fusion, mut t: TvId) -> TvId {
    while let Some(e) = f.tvs[t].definition {
        let Some(src) = f.exprs[e].inputs.first().and_then(|o| o.tensor()) else { break };
        let exact = match f.exprs[e].op {
            Op::Set => true,
            Op::Cast(dt) => {
                let from = f.tvs[src].dtype;
                from == dt || (from.is_float() && dt.is_float() && from.size_bytes() <= dt.size_bytes())
            }
            _ => false,
        };
        if !exact {
            break;
        }
        t = src;
    }
    t
}
