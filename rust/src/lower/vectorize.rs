//! Vector copies.
//! Consumes: the nest after unswitching. Produces: `Vector` nodes.
//! Guarantees: a Vectorize loop of a constant 2/4/8/16-byte width holding one
//! data-moving expression (set, broadcast, gather) of one dtype, unit-stride in the loop
//! index on both sides, becomes one wide load and store, with the element loop as the
//! fallback where part of the vector is out of range or an alignment check fails (none
//! where the vector is in range whole or not at all and no alignment is checked at run
//! time: `VectorCopy::whole`). Each
//! side records the check its alignment needs: none where the offset is a multiple of the
//! width in an aligned array (a 16-byte aligned Local array, a Global array of aligned
//! base), the offset where only it can break the alignment, the address otherwise; a
//! Shared side whose offset is not a multiple of the width (a tile padded by one bank)
//! moves element by element, so the Global side keeps its wide access on every row.

use crate::error::Result;
use crate::ir::scalar::Val;
use crate::ir::{ExprId, Fusion, MemoryType, Op, Operand, ParallelType, Symbol, TvId};
use crate::kernel::{AccessIndex, ForLoop, Node, VectorAccess, VectorCopy};
use crate::lower::predicate::linear_coeff;

/// Rewrite every Vectorize loop of `body` that is a copy.
pub fn run(f: &mut Fusion, body: &mut [Node]) -> Result<()> {
    for n in body.iter_mut() {
        if let Node::Loop(l) = n {
            if let Some(v) = vector_copy(f, l) {
                *n = Node::Vector(Box::new(v));
                continue;
            }
            if f.hand_schedule {
                check_hand_vector(f, l)?;
            }
        }
        for b in n.bodies_mut() {
            run(f, b)?;
        }
    }
    Ok(())
}

/// What makes `l` a copy: (width, expr, its index, the read tensor, the loop symbol).
fn copy_shape<'l>(f: &Fusion, l: &'l ForLoop) -> Option<(i64, ExprId, &'l AccessIndex, TvId, Symbol)> {
    if l.parallel != ParallelType::Vectorize {
        return None;
    }
    let n = f.scalars.as_int(l.extent)?;
    let [Node::Expr { expr, index: Some(ix) }] = l.body.as_slice() else {
        return None;
    };
    let e = &f.exprs[*expr];
    // A broadcast moves data like a copy: along the vector it reads consecutive elements.
    let (Op::Set | Op::Broadcast { .. } | Op::IndexSelect { .. } | Op::Remap { .. }, Some(Operand::Tensor(src))) =
        (&e.op, e.inputs.first().copied())
    else {
        return None;
    };
    let dt = f.tvs[e.output].dtype;
    if !matches!(n as usize * dt.size_bytes(), 2 | 4 | 8 | 16) || f.tvs[src].dtype != dt {
        return None;
    }
    let Val::Symbol(sym) = f.scalars.get(l.index) else {
        return None;
    };
    let in_off = ix.inputs[0]?;
    // Unit stride in the vector index on both sides, or no wide access.
    if linear_coeff(&f.scalars, ix.out, sym) != Some(1) || linear_coeff(&f.scalars, in_off, sym) != Some(1) {
        return None;
    }
    // A gathered row: the index is read once for the whole vector, so it must not move
    // along it.
    if ix.gathers.iter().any(|g| linear_coeff(&f.scalars, g.at, sym) != Some(0)) {
        return None;
    }
    // A remap's guard joins the vector's first and last predicates: it must hold on an
    // interval of the vector index, so that holding at both ends means holding throughout.
    if ix.element.is_some_and(|g| !interval_along(&f.scalars, g, sym)) {
        return None;
    }
    Some((n, *expr, ix, src, sym))
}

/// A hand-scheduled Vectorize loop around a copy whose Global side does not move one
/// element per lane cannot be a wide access: refused (as nvFuser refuses to vectorize a
/// non-contiguous axis), where it would silently run one element at a time.
fn check_hand_vector(f: &Fusion, l: &ForLoop) -> Result<()> {
    if l.parallel != ParallelType::Vectorize {
        return Ok(());
    }
    let [Node::Expr { expr, index: Some(ix) }] = l.body.as_slice() else { return Ok(()) };
    let e = &f.exprs[*expr];
    let (Op::Set | Op::Remap { .. }, Some(Operand::Tensor(src))) = (&e.op, e.inputs.first().copied()) else {
        return Ok(());
    };
    let Val::Symbol(sym) = f.scalars.get(l.index) else { return Ok(()) };
    for (tv, off) in [(e.output, Some(ix.out)), (src, ix.inputs[0])] {
        let Some(off) = off else { continue };
        if f.tvs[tv].memory != MemoryType::Global {
            continue;
        }
        let step = linear_coeff(&f.scalars, off, sym);
        if step != Some(1) {
            let how = match step {
                Some(k) => format!("{k} elements apart"),
                None => format!("at {}", f.scalars.render(off)),
            };
            crate::bail!(
                "{}: its Vectorize axis ({}) reads {} with consecutive lanes {how}; Vectorize needs the axis that walks {}'s contiguous innermost axis",
                f.tv_name(e.output),
                f.id_label(l.id),
                f.tv_name(tv),
                f.tv_name(tv)
            );
        }
    }
    Ok(())
}

/// True when `v` holds on an interval of `sym`'s values: a conjunction of comparisons of
/// expressions linear in `sym` (or of terms that do not depend on it).
fn interval_along(sc: &crate::ir::Scalars, v: crate::ir::ValId, sym: Symbol) -> bool {
    use crate::ir::scalar::ScalarOp;
    match sc.get(v) {
        Val::Binary(ScalarOp::And, a, b) => interval_along(sc, a, sym) && interval_along(sc, b, sym),
        Val::Binary(ScalarOp::Lt | ScalarOp::Le, a, b) => {
            linear_coeff(sc, a, sym).is_some() && linear_coeff(sc, b, sym).is_some()
        }
        _ => linear_coeff(sc, v, sym) == Some(0),
    }
}

/// True when `l` is a loop this pass turns into a vector copy.
pub fn is_vector_copy(f: &Fusion, l: &ForLoop) -> bool {
    copy_shape(f, l).is_some()
}

fn vector_copy(f: &mut Fusion, l: &ForLoop) -> Option<VectorCopy> {
    let (n, expr, ix, src, sym) = copy_shape(f, l)?;
    let ix = ix.clone();
    let out_tv = f.exprs[expr].output;
    let local_remap = matches!(f.exprs[expr].op, Op::Remap { .. }) && f.tvs[out_tv].memory == MemoryType::Local;
    let sc = &mut f.scalars;
    let (zero, last) = (sc.int(0), sc.int(n - 1));
    let in_off = ix.inputs[0]?;
    let out = sc.substitute(ix.out, sym, zero);
    let input = sc.substitute(in_off, sym, zero);
    let live = match ix.element {
        // A guarded remap copies only where its guard holds on the whole vector; the
        // element loop does the rest.
        Some(g) if matches!(f.exprs[expr].op, Op::Remap { .. }) => {
            sc.binary(crate::ir::scalar::ScalarOp::And, ix.predicate, g)
        }
        _ => ix.predicate,
    };
    let first = sc.substitute(live, sym, zero);
    let at_end = sc.substitute(live, sym, last);
    let gathers = ix
        .gathers
        .iter()
        .map(|g| {
            let mut g = g.clone();
            g.at = sc.substitute(g.at, sym, zero);
            g.element = sc.substitute(g.element, sym, zero);
            g
        })
        .collect();
    let mut access = [VectorAccess::Wide; 2];
    for (k, (tv, off)) in [(out_tv, out), (src, input)].into_iter().enumerate() {
        let multiple = sc.known_multiple(off) % n == 0;
        access[k] = match f.tvs[tv].memory {
            MemoryType::Local if multiple => VectorAccess::Wide,
            MemoryType::Shared if !multiple => VectorAccess::Elements,
            // Every Shared tensor starts 16-byte aligned (`launch`): an offset that is a
            // multiple of the width is an aligned vector, with no run-time check (which, in
            // an unrolled copy, kept each load from issuing before the last one's store).
            MemoryType::Shared => VectorAccess::Wide,
            MemoryType::Global if f.aligned_bases && multiple => VectorAccess::Wide,
            MemoryType::Global if f.aligned_bases => VectorAccess::WideIfOffsetAligned,
            _ => VectorAccess::WideIfAddressAligned,
        };
    }
    let global_src = f.tvs[src].memory == MemoryType::Global;
    let load_hints = (f.tvs[out_tv].streaming_load && global_src, f.tvs[out_tv].evict_last_load && global_src);
    let unchecked = access.iter().all(|a| matches!(a, VectorAccess::Wide | VectorAccess::Elements));
    // A guarded remap's element loop also writes where its guard fails (a pad value, the
    // other input of a cat): only an unguarded copy has nothing to do out of range.
    let whole = unchecked && ix.element.is_none() && whole_or_none(sc, ix.predicate, sym, n);
    // A cat or pad read whose guard switches at a multiple of the width (RoPE's halves): each
    // vector is read whole or is all padding, never split element by element.
    let pad_else = match ix.element {
        Some(g)
            if unchecked && local_remap && whole_or_none(sc, ix.predicate, sym, n) && whole_or_none(sc, g, sym, n) =>
        {
            Some(sc.substitute(ix.predicate, sym, zero))
        }
        _ => None,
    };
    let last = if whole || pad_else.is_some() { first } else { at_end };
    let mut fallback = l.clone();
    fallback.parallel = ParallelType::Unroll;
    Some(VectorCopy { expr, width: n, out, input, first, last, gathers, access, load_hints, whole, pad_else, fallback })
}

/// True when predicate `live` holds at every element of the vector `sym` in `[0, n)` or at
/// none: a conjunction of bounds `a < b` where `a` steps by one along the vector from a
/// known multiple of `n` and `b` is a known multiple of `n` (the row extent the vector
/// width was chosen to divide), and of terms that do not depend on `sym`. Then `a < b` at
/// the first element means `a + n - 1 < b` at the last, and the element loop that handles a
/// partly covered vector is never needed (a partial tile's code was half a kernel's size).
fn whole_or_none(sc: &mut crate::ir::Scalars, live: crate::ir::ValId, sym: Symbol, n: i64) -> bool {
    use crate::ir::scalar::ScalarOp;
    let mut parts = Vec::new();
    crate::lower::predicate::conjuncts(sc, live, &mut parts);
    let zero = sc.int(0);
    parts.into_iter().all(|c| {
        // `a < b` and `b <= a` alike: `a` steps by one from a multiple of `n` and `b` is a
        // multiple of `n`, so the comparison at the first element holds for the whole vector
        // (`a < b` at the first means `a + n - 1 < b` at the last; `b <= a` only grows).
        let (a, b) = match sc.get(c) {
            Val::Binary(ScalarOp::Lt, a, b) | Val::Binary(ScalarOp::Le, b, a) => (a, b),
            _ => return linear_coeff(sc, c, sym) == Some(0),
        };
        match (linear_coeff(sc, a, sym), linear_coeff(sc, b, sym)) {
            (Some(0), Some(0)) => true,
            (Some(1), Some(0)) => {
                let start = sc.substitute(a, sym, zero);
                sc.known_multiple(start) % n == 0 && sc.known_multiple(b) % n == 0
            }
            _ => false,
        }
    })
}
