//! Loop groups and loop promotion. Inlining makes a producer's outer loop axes the
//! same loops as its consumers' axes; each group of (tensor, axis) pairs becomes one
//! ForLoop. The group's *promoted* id is the concrete id it iterates: for a producer
//! of a broadcast inlined into its consumer, that is the consumer's id, whose extent
//! is the real one.

use rustc_hash::FxHashMap;

use crate::analysis::id_graph::IdGraph;
use crate::bail;
use crate::error::Result;
use crate::ir::{Fusion, IterDomainId, IterType, ParallelType, TvId};

/// Index of a loop group.
pub type LoopGroup = usize;

/// One loop group: its members, promoted id and parallel type.
#[derive(Clone, Debug)]
pub struct GroupInfo {
    pub members: Vec<(TvId, usize)>,
    pub promoted: IterDomainId,
    pub parallel: ParallelType,
}

/// Loop groups of every tensor's loop axes.
#[derive(Clone, Debug, Default)]
pub struct LoopGraph {
    group_of: FxHashMap<(TvId, usize), LoopGroup>,
    pub groups: Vec<GroupInfo>,
}

impl LoopGraph {
    /// True when the loop axes of `tv` are in the graph (it is computed or read in the kernel).
    pub fn has(&self, tv: TvId) -> bool {
        self.group_of.contains_key(&(tv, 0))
    }

    /// The group of loop axis `axis` of `tv`.
    #[track_caller]
    pub fn group(&self, tv: TvId, axis: usize) -> LoopGroup {
        self.group_of[&(tv, axis)]
    }

    /// The promoted (concrete) id of `tv`'s loop axis `axis`.
    #[track_caller]
    pub fn promoted(&self, tv: TvId, axis: usize) -> IterDomainId {
        self.groups[self.group(tv, axis)].promoted
    }

    /// Build the groups; `tv_order[tv]` ranks tensors producer-before-consumer.
    pub fn build(f: &Fusion, exact: &IdGraph, tv_order: &FxHashMap<TvId, usize>) -> Result<Self> {
        let mut keys: Vec<(TvId, usize)> = Vec::new();
        let mut index: FxHashMap<(TvId, usize), usize> = FxHashMap::default();
        for (tv, t) in f.tvs.iter() {
            if !tv_order.contains_key(&tv) {
                continue;
            }
            for a in 0..t.loop_domain.len() {
                index.insert((tv, a), keys.len());
                keys.push((tv, a));
            }
        }
        let mut sets = crate::analysis::union_find::UnionFind::new(keys.len());
        for (tv, t) in f.tvs.iter() {
            if !tv_order.contains_key(&tv) || t.inline_pos == 0 {
                continue;
            }
            f.check_inline(tv, t.inline_pos)?;
            for c in f.consumers(tv) {
                if !tv_order.contains_key(&c) {
                    continue;
                }
                for a in 0..t.inline_pos {
                    sets.union(index[&(tv, a)], index[&(c, a)]);
                }
            }
        }
        let mut root_group: FxHashMap<usize, LoopGroup> = FxHashMap::default();
        let mut lg = LoopGraph::default();
        for (k, &key) in keys.iter().enumerate() {
            let r = sets.find(k);
            let g = *root_group.entry(r).or_insert_with(|| {
                lg.groups.push(GroupInfo {
                    members: Vec::new(),
                    promoted: f.tvs[key.0].loop_domain[key.1],
                    parallel: ParallelType::Serial,
                });
                lg.groups.len() - 1
            });
            lg.groups[g].members.push(key);
            lg.group_of.insert(key, g);
        }
        for g in lg.groups.iter_mut() {
            g.members.sort_by_key(|(tv, a)| (tv_order[tv], *a));
            promote(f, exact, g)?;
        }
        Ok(lg)
    }
}

/// True when `id` is derived from a broadcast logical id.
pub fn depends_on_broadcast(f: &Fusion, id: IterDomainId) -> bool {
    f.id_derived_from_any(id, |i| f.ids[i].definition.is_none() && f.ids[i].iter_type == IterType::Broadcast)
}

/// `roots` and every tensor they are (transitively) computed from.
fn upstream_of(f: &Fusion, roots: &[TvId]) -> rustc_hash::FxHashSet<TvId> {
    let mut seen = rustc_hash::FxHashSet::default();
    let mut stack = roots.to_vec();
    while let Some(t) = stack.pop() {
        if seen.insert(t) {
            stack.extend(f.producers(t));
        }
    }
    seen
}

fn promote(f: &Fusion, exact: &IdGraph, g: &mut GroupInfo) -> Result<()> {
    let ids: Vec<(TvId, usize, IterDomainId)> =
        g.members.iter().map(|&(tv, a)| (tv, a, f.tvs[tv].loop_domain[a])).collect();
    // Concrete candidates: ids not derived from a broadcast; the most-consumer one wins.
    let candidates: Vec<&(TvId, usize, IterDomainId)> =
        ids.iter().filter(|(_, _, id)| !depends_on_broadcast(f, *id)).collect();
    let chosen = candidates.last().copied().or(ids.last()).expect("a group has members");
    // What the chosen tensor is computed from, found once per group (not per member: a
    // group of a large fusion has thousands).
    let mut above: Option<rustc_hash::FxHashSet<TvId>> = None;
    let mut is_upstream = |f: &Fusion, t: TvId| above.get_or_insert_with(|| upstream_of(f, &[chosen.0])).contains(&t);
    for c in &candidates {
        // A producer upstream of the chosen tensor iterates a sub-space of it (inlining
        // was checked pair by pair); only unrelated tensors can disagree. Siblings inlined
        // into one consumer whose axis is a size-one broadcast where theirs iterate one
        // element (a reshape's literal 1 over a runtime size of one) are not exact-mapped
        // through it, but each was checked against that consumer: the same extent is the
        // same space.
        let same_extent = f.ids[c.2].extent == f.ids[chosen.2].extent;
        if !exact.same(c.2, chosen.2) && !same_extent && !is_upstream(f, c.0) {
            bail!(
                "cannot promote loop axis {} of {}: it iterates {} of {} and {} of {}, which are not the same iteration space",
                ids[0].1,
                f.tv_name(ids[0].0),
                f.id_label(c.2),
                f.tv_name(c.0),
                f.id_label(chosen.2),
                f.tv_name(chosen.0)
            );
        }
    }
    // Tensors upstream of a member that iterates the chosen space (computed when first
    // needed): a producer of any of them is indexed through its consumers in that space,
    // as a producer of the chosen tensor is (a bias broadcast feeding the first of two
    // outputs, where the chosen tensor is the second).
    let mut feeds_space: Option<rustc_hash::FxHashSet<TvId>> = None;
    for m in &ids {
        // A member that is neither a producer of a tensor iterating the chosen space nor
        // iterating it itself (a sibling consumer of a producer inlined into both, which
        // keeps a broadcast the other concretizes, merged with an iteration axis) would run
        // the chosen extent over its own smaller one. A plain broadcast axis reads and
        // writes its one element at every iteration: that only repeats it.
        let same_space = exact.same(m.2, chosen.2)
            || f.ids[m.2].extent == f.ids[chosen.2].extent
            || f.ids[m.2].iter_type == IterType::Broadcast;
        if same_space || is_upstream(f, m.0) {
            continue;
        }
        let feeds = feeds_space.get_or_insert_with(|| {
            let roots: Vec<TvId> = ids
                .iter()
                .filter(|(_, _, id)| exact.same(*id, chosen.2) || f.ids[*id].extent == f.ids[chosen.2].extent)
                .map(|x| x.0)
                .collect();
            upstream_of(f, &roots)
        });
        if !feeds.contains(&m.0) {
            bail!(
                "cannot promote loop axis {} of {}: it is one loop with {} axis {} ({}), but {} axis {} iterates {} there; inline the tensors they share at a position before this axis",
                m.1,
                f.tv_name(m.0),
                f.tv_name(chosen.0),
                chosen.1,
                f.id_label(chosen.2),
                f.tv_name(m.0),
                m.1,
                f.id_label(m.2)
            );
        }
    }
    g.promoted = chosen.2;
    let mut parallel = ParallelType::Serial;
    let mut owner: Option<(TvId, usize)> = None;
    for &(tv, a, id) in &ids {
        let p = f.ids[id].parallel;
        if p == ParallelType::Serial {
            continue;
        }
        match owner {
            Some((otv, oa)) if p != parallel => bail!(
                "inconsistent parallelization: {} axis {a} is {} but the same loop is {} in {} axis {oa}",
                f.tv_name(tv),
                p.enum_name(),
                parallel.enum_name(),
                f.tv_name(otv)
            ),
            _ => {
                parallel = p;
                owner = Some((tv, a));
            }
        }
    }
    g.parallel = parallel;
    Ok(())
}
