//! Replay one tensor's loop transforms onto another tensor's ids: how caches inherit a
//! schedule and how schedulers propagate one from a reference tensor.

use rustc_hash::FxHashMap;

use crate::ir::{Fusion, IterDomain, IterDomainId, ParallelType, Transform, TvId};

/// Replay `src`'s transforms onto the ids `map` gives for its logical ids; returns the
/// replayed loop domain (ids of `src` without a counterpart are skipped). `map` is
/// extended with every replayed id.
pub fn replay_onto(f: &mut Fusion, src: TvId, map: &mut FxHashMap<IterDomainId, IterDomainId>) -> Vec<IterDomainId> {
    for t in f.transforms_of(src) {
        match f.transforms[t].clone() {
            Transform::Split { input, factor, inner_split, outer, inner } => {
                let Some(&din) = map.get(&input) else {
                    continue;
                };
                let (no, ni) = (clone_id(f, outer), clone_id(f, inner));
                let nt = f.transforms.push(Transform::Split { input: din, factor, inner_split, outer: no, inner: ni });
                f.ids[no].definition = Some(nt);
                f.ids[ni].definition = Some(nt);
                f.ids[din].use_ = Some(nt);
                map.insert(outer, no);
                map.insert(inner, ni);
            }
            Transform::Merge { outer, inner, out } => {
                let (Some(&dout), Some(&din)) = (map.get(&outer), map.get(&inner)) else {
                    continue;
                };
                let no = clone_id(f, out);
                let nt = f.transforms.push(Transform::Merge { outer: dout, inner: din, out: no });
                f.ids[no].definition = Some(nt);
                f.ids[dout].use_ = Some(nt);
                f.ids[din].use_ = Some(nt);
                map.insert(out, no);
            }
        }
    }
    let mut out = Vec::new();
    for id in f.tvs[src].loop_domain.clone() {
        if let Some(&d) = map.get(&id) {
            f.ids[d].parallel = f.ids[id].parallel;
            out.push(d);
        }
    }
    out
}

fn clone_id(f: &mut Fusion, id: IterDomainId) -> IterDomainId {
    let src = f.ids[id].clone();
    f.ids.push(IterDomain { parallel: ParallelType::Serial, definition: None, use_: None, ..src })
}
