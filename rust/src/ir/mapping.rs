//! Which producer id lines up with which consumer id across one expr: first the
//! logical ids the op aligns, then ids produced by identical transforms on both
//! sides. Inlining, loop promotion and indexing all stand on this map.

use rustc_hash::FxHashMap;

use crate::ir::{ExprId, Fusion, IterDomainId, IterType, Op, Transform};

/// Logical (producer id, consumer id) pairs that expr `e` aligns for its input at `input_pos`.
pub fn logical_pairs(f: &Fusion, e: ExprId, input_pos: usize) -> Vec<(IterDomainId, IterDomainId)> {
    let expr = &f.exprs[e];
    let Some(p) = expr.inputs.get(input_pos).and_then(|o| o.tensor()) else {
        return Vec::new();
    };
    let pdom = f.no_reduction_logical(p);
    let cdom = &f.tvs[expr.output].logical;
    match &expr.op {
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_) | Op::Set | Op::Reduction { .. } => {
            pdom.iter().copied().zip(cdom.iter().copied()).collect()
        }
        Op::Broadcast { is_new } => {
            let kept = cdom.iter().zip(is_new).filter(|(_, &n)| !n).map(|(&c, _)| c);
            pdom.iter().copied().zip(kept).collect()
        }
        Op::Squeeze { removed } => {
            let kept = pdom.iter().zip(removed).filter(|(_, &r)| !r).map(|(&p, _)| p);
            kept.zip(cdom.iter().copied()).collect()
        }
        Op::Permute { perm } => perm.iter().enumerate().map(|(i, &src)| (pdom[src], cdom[i])).collect(),
        Op::IndexSelect { dim } => {
            if input_pos == 0 {
                // The indexed axis is read at data-dependent positions: it maps to nothing.
                pdom.iter()
                    .copied()
                    .zip(cdom.iter().copied())
                    .enumerate()
                    .filter(|(i, _)| i != dim)
                    .map(|(_, p)| p)
                    .collect()
            } else if pdom.len() == 1 {
                vec![(pdom[0], cdom[*dim])]
            } else {
                // An index of the output's rank (size one off `dim`, as the automatic
                // schedules broadcast a computed index): axis by axis.
                pdom.iter().copied().zip(cdom.iter().copied()).collect()
            }
        }
        // A remap's input is read at computed positions: no axis maps.
        Op::Full { .. } | Op::Iota { .. } | Op::Random { .. } | Op::Mask { .. } | Op::Remap { .. } => Vec::new(),
    }
}

/// Map every producer id (logical and derived) to the consumer id it iterates with.
///
/// Besides identical transforms, a consumer id merged with a broadcast id that has no
/// producer counterpart still maps ("broadcast forwarding"), so a producer of a
/// broadcast can be inlined into its consumer's merged loops.
pub fn producer_to_consumer(f: &Fusion, e: ExprId, input_pos: usize) -> FxHashMap<IterDomainId, IterDomainId> {
    let mut map: FxHashMap<IterDomainId, IterDomainId> = FxHashMap::default();
    let pairs = logical_pairs(f, e, input_pos);
    let mapped_consumer: Vec<IterDomainId> = pairs.iter().map(|&(_, c)| c).collect();
    for (p, c) in pairs {
        insert_forwarded(f, &mut map, &mapped_consumer, p, c);
    }
    let p = match f.exprs[e].inputs.get(input_pos).and_then(|o| o.tensor()) {
        Some(p) => p,
        None => return map,
    };
    for t in f.transforms_of(p) {
        match f.transforms[t] {
            Transform::Split { input, factor, inner_split, outer, inner } => {
                let Some(&c_in) = map.get(&input) else {
                    continue;
                };
                let Some(ct) = f.ids[c_in].use_ else { continue };
                if let Transform::Split { input: ci, factor: cf, inner_split: cis, outer: co, inner: cin } =
                    f.transforms[ct]
                {
                    let same_factor = cf == factor
                        || f.scalars.as_int(cf).is_some() && f.scalars.as_int(cf) == f.scalars.as_int(factor);
                    if ci == c_in && same_factor && cis == inner_split {
                        insert_forwarded(f, &mut map, &mapped_consumer, outer, co);
                        insert_forwarded(f, &mut map, &mapped_consumer, inner, cin);
                    }
                }
            }
            Transform::Merge { outer, inner, out } => {
                let (Some(&co), Some(&ci)) = (map.get(&outer), map.get(&inner)) else {
                    continue;
                };
                let Some(ct) = f.ids[co].use_ else { continue };
                if let Transform::Merge { outer: mo, inner: mi, out: cout } = f.transforms[ct] {
                    if mo == co && mi == ci {
                        insert_forwarded(f, &mut map, &mapped_consumer, out, cout);
                    }
                }
            }
        }
    }
    map
}

/// Insert `p -> c`, then follow merges of `c` with consumer-only broadcast ids.
fn insert_forwarded(
    f: &Fusion,
    map: &mut FxHashMap<IterDomainId, IterDomainId>,
    mapped_consumer: &[IterDomainId],
    p: IterDomainId,
    c: IterDomainId,
) {
    let mut c = c;
    map.insert(p, c);
    // Follow a chain of merges with broadcast ids the producer does not have.
    while let Some(t) = f.ids[c].use_ {
        let Transform::Merge { outer, inner, out } = f.transforms[t] else {
            break;
        };
        let other = if outer == c { inner } else { outer };
        let other_is_new_bcast = f.ids[other].iter_type == IterType::Broadcast
            && f.ids[other].definition.is_none()
            && !mapped_consumer.contains(&other);
        if !other_is_new_bcast {
            break;
        }
        c = out;
        // The producer id iterates the merged id: record it only if nothing better exists.
        map.entry(p).and_modify(|v| *v = out).or_insert(out);
    }
}
