//! Id graphs: union-find groups of IterDomains that iterate the same thing across
//! producer/consumer pairs. *Exact* maps only ids of equal extent (a broadcast never
//! maps to an iteration id); *permissive* also maps a broadcast to the id it is
//! broadcast against. Both propagate through identical splits and merges.

use rustc_hash::FxHashMap;

use crate::analysis::union_find::UnionFind;
use crate::ir::mapping::logical_pairs;
use crate::ir::{Fusion, IterDomainId, IterType, Transform, TransformId};

/// A partition of all ids of a fusion into groups.
#[derive(Clone, Debug)]
pub struct IdGraph {
    sets: UnionFind,
}

impl IdGraph {
    fn new(n: usize) -> Self {
        Self { sets: UnionFind::new(n) }
    }

    /// Representative of `id`'s group.
    pub fn find(&self, id: IterDomainId) -> IterDomainId {
        IterDomainId::from_u32(self.sets.find(id.as_u32() as usize) as u32)
    }

    fn union(&mut self, a: IterDomainId, b: IterDomainId) -> bool {
        self.sets.union(a.as_u32() as usize, b.as_u32() as usize)
    }

    /// True when `a` and `b` are in one group.
    pub fn same(&self, a: IterDomainId, b: IterDomainId) -> bool {
        self.find(a) == self.find(b)
    }

    /// Build the exact graph of `f`.
    pub fn exact(f: &Fusion) -> Self {
        Self::build(f, false)
    }

    /// Build the broadcast-permissive graph of `f`.
    pub fn permissive(f: &Fusion) -> Self {
        Self::build(f, true)
    }

    fn build(f: &Fusion, permissive: bool) -> Self {
        let mut g = IdGraph::new(f.ids.len());
        for e in f.topo_exprs() {
            for pos in 0..f.exprs[e].inputs.len() {
                for (p, c) in logical_pairs(f, e, pos) {
                    let pb = f.ids[p].iter_type == IterType::Broadcast;
                    let cb = f.ids[c].iter_type == IterType::Broadcast;
                    if permissive || pb == cb {
                        g.union(p, c);
                    }
                }
            }
        }
        // Identical transforms of mapped inputs produce mapped outputs; repeat to a fixed point.
        loop {
            let mut changed = false;
            let mut seen: FxHashMap<(u8, IterDomainId, IterDomainId, i64, bool), TransformId> = FxHashMap::default();
            for (t, tr) in f.transforms.iter() {
                let key = match *tr {
                    Transform::Split { input, factor, inner_split, .. } => {
                        let fc = f.scalars.as_int(factor).unwrap_or(-(factor.as_u32() as i64) - 1);
                        (0, g.find(input), g.find(input), fc, inner_split)
                    }
                    Transform::Merge { outer, inner, .. } => (1, g.find(outer), g.find(inner), 0, false),
                };
                match seen.get(&key) {
                    None => {
                        seen.insert(key, t);
                    }
                    Some(&other) => {
                        for (a, b) in f.transforms[t].outputs().iter().zip(f.transforms[other].outputs().iter()) {
                            changed |= g.union(*a, *b);
                        }
                    }
                }
            }
            if !changed {
                break;
            }
        }
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{BinaryOp, DataType, Operand};

    #[test]
    fn exact_maps_through_ops_and_identical_splits() {
        let mut f = Fusion::new();
        let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
        let b = f.define_tensor(&[1, -1], DataType::Float, None).unwrap();
        let y = f.binary(BinaryOp::Add, Operand::Tensor(x), Operand::Tensor(b)).unwrap();
        f.add_output(y).unwrap();
        f.split(x, 1, 4, true).unwrap();
        f.split(y, 1, 4, true).unwrap();
        let g = IdGraph::exact(&f);
        let (xl, yl, bl) = (f.tvs[x].loop_domain.clone(), f.tvs[y].loop_domain.clone(), f.tvs[b].logical.clone());
        assert!(g.same(xl[0], yl[0]));
        assert!(g.same(xl[2], yl[2]), "inner halves of identical splits map");
        assert!(g.same(f.tvs[b].logical[1], f.tvs[y].logical[1]));
        assert!(!g.same(bl[0], yl[0]), "exact graph keeps broadcasts apart");
        let p = IdGraph::permissive(&f);
        assert!(p.same(bl[0], yl[0]), "permissive graph maps broadcasts");
    }
}
