//! Predicates as sets of conjuncts: the helpers the unswitch and vectorize passes share.

use rustc_hash::FxHashSet;

use crate::ir::scalar::{ScalarOp, Val};
use crate::ir::{Scalars, Symbol, ValId};
use crate::kernel::Node;

/// Split a predicate into its `&&` conjuncts (a `true` conjunct is dropped).
pub fn conjuncts(sc: &Scalars, v: ValId, out: &mut Vec<ValId>) {
    match sc.get(v) {
        Val::Binary(ScalarOp::And, a, b) => {
            conjuncts(sc, a, out);
            conjuncts(sc, b, out);
        }
        Val::Bool(true) => {}
        _ => out.push(v),
    }
}

/// The conjunction of `parts` (`true` when empty).
pub fn and_all(sc: &mut Scalars, parts: impl IntoIterator<Item = ValId>) -> ValId {
    // Each conjunct once: the bounds checks of many reads of one tensor (the parts of a cat
    // over one runtime size) are often the same check, and repeating it lengthens every
    // predicate the kernel prints.
    let mut seen = FxHashSet::default();
    let mut flat = Vec::new();
    let mut v = sc.boolean(true);
    for c in parts {
        flat.clear();
        conjuncts(sc, c, &mut flat);
        for &c in &flat {
            if seen.insert(c) {
                v = sc.binary(ScalarOp::And, v, c);
            }
        }
    }
    v
}

/// `v` without the conjuncts in `known` (they are known to hold where it is evaluated).
pub fn without(sc: &mut Scalars, v: ValId, known: &[ValId]) -> ValId {
    let mut parts = Vec::new();
    conjuncts(sc, v, &mut parts);
    if !parts.iter().any(|c| known.contains(c)) {
        return v;
    }
    parts.retain(|c| !known.contains(c));
    and_all(sc, parts)
}

/// Every symbol `v` reads, added to `out`.
pub fn symbols(sc: &Scalars, v: ValId, out: &mut FxHashSet<Symbol>) {
    match sc.get(v) {
        Val::Symbol(s) => {
            out.insert(s);
        }
        Val::Binary(_, a, b) => {
            symbols(sc, a, out);
            symbols(sc, b, out);
        }
        _ => {}
    }
}

/// True when `v` mentions one of `syms`.
pub fn mentions(sc: &Scalars, v: ValId, syms: &FxHashSet<Symbol>) -> bool {
    match sc.get(v) {
        Val::Symbol(s) => syms.contains(&s),
        Val::Binary(_, a, b) => mentions(sc, a, syms) || mentions(sc, b, syms),
        _ => false,
    }
}

/// True when `v` reads a gathered index value or a grid reduction's completion (defined
/// per statement, not before a loop).
pub fn mentions_per_statement(sc: &Scalars, v: ValId) -> bool {
    match sc.get(v) {
        Val::Symbol(s) => matches!(s, Symbol::Gathered(_) | Symbol::GridDone(_)),
        Val::Binary(_, a, b) => mentions_per_statement(sc, a) || mentions_per_statement(sc, b),
        _ => false,
    }
}

/// True when `v` never decreases as any (non-negative) symbol grows: sums and products
/// of non-negative terms.
pub fn monotone(sc: &Scalars, v: ValId) -> bool {
    match sc.get(v) {
        Val::Symbol(_) => true,
        Val::Int(i) => i >= 0,
        Val::Binary(ScalarOp::Add | ScalarOp::Mul, a, b) => monotone(sc, a) && monotone(sc, b),
        _ => false,
    }
}

/// The constant coefficient of `sym` in `v` when `v` is affine in it (it appears only
/// under sums and products with constants); `None` otherwise.
pub fn linear_coeff(sc: &Scalars, v: ValId, sym: Symbol) -> Option<i64> {
    match sc.get(v) {
        Val::Symbol(s) => Some(if s == sym { 1 } else { 0 }),
        Val::Int(_) | Val::Bool(_) | Val::Float(_) => Some(0),
        Val::Binary(ScalarOp::Add, a, b) => Some(linear_coeff(sc, a, sym)? + linear_coeff(sc, b, sym)?),
        Val::Binary(ScalarOp::Sub, a, b) => Some(linear_coeff(sc, a, sym)? - linear_coeff(sc, b, sym)?),
        Val::Binary(ScalarOp::Mul, a, b) => {
            let (ca, cb) = (linear_coeff(sc, a, sym)?, linear_coeff(sc, b, sym)?);
            match (ca, cb) {
                (0, 0) => Some(0),
                (k, 0) => sc.as_int(b).map(|c| k * c),
                (0, k) => sc.as_int(a).map(|c| k * c),
                _ => None,
            }
        }
        Val::Binary(_, a, b) => {
            // Any other operator is fine only if the symbol does not occur under it.
            (linear_coeff(sc, a, sym)? == 0 && linear_coeff(sc, b, sym)? == 0).then_some(0)
        }
    }
}

/// Drop the conjuncts in `known` from the predicates of every statement under `nodes`.
pub fn assume(sc: &mut Scalars, nodes: &mut [Node], known: &[ValId]) {
    for n in nodes {
        match n {
            Node::Init { index: Some(ix), .. }
            | Node::Expr { index: Some(ix), .. }
            | Node::Accumulate { index: ix, .. }
            | Node::ReduceAccumulator { index: ix, .. } => {
                ix.predicate = without(sc, ix.predicate, known);
                ix.write_predicate = without(sc, ix.write_predicate, known);
            }
            _ => {}
        }
        for b in n.bodies_mut() {
            assume(sc, b, known);
        }
    }
}
