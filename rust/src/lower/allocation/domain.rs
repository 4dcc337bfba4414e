//! Allocation-domain inference: which ids a tensor allocates, in which order, with
//! which strides and contiguity (rules 1–6 of DESIGN.md's allocation pass).

use crate::analysis::id_graph::IdGraph;
use crate::analysis::loop_graph::LoopGraph;
use crate::analysis::parallel::{is_partitioned_across, is_shared_across};
use crate::bail;
use crate::error::Result;
use crate::ir::{Fusion, IterDomainId, IterType, MemoryType, Op, Operand, ParallelType, Symbol, Transform, TvId};
use crate::kernel::AllocationInfo;

/// The allocation position: the inline position, moved out of Unroll/Unswitch loops
/// (each unrolled iteration needs its own storage).
pub fn alloc_position(f: &Fusion, lg: &LoopGraph, tv: TvId) -> usize {
    let ca = f.tvs[tv].inline_pos;
    (0..ca)
        .find(|&a| matches!(lg.groups[lg.group(tv, a)].parallel, ParallelType::Unroll | ParallelType::Unswitch))
        .unwrap_or(ca)
}

/// Parallel type of `tv`'s id as the loop nest runs it (the loop group's type).
fn effective_parallel(f: &Fusion, lg: &LoopGraph, tv: TvId, id: IterDomainId) -> ParallelType {
    match f.loop_position(tv, id) {
        Some(a) => lg.groups[lg.group(tv, a)].parallel,
        None => f.ids[id].parallel,
    }
}

/// False for ids that never take room: partitioned loop ids, size-one ids, reductions.
pub fn may_require_allocation(f: &Fusion, lg: &LoopGraph, tv: TvId, id: IterDomainId) -> bool {
    let d = &f.ids[id];
    let mem = f.tvs[tv].memory;
    let partitioned =
        f.loop_position(tv, id).is_some() && is_partitioned_across(mem, effective_parallel(f, lg, tv, id));
    let size_one = d.iter_type == IterType::Broadcast || f.scalars.is_const(d.extent, 1);
    !partitioned && !size_one && d.iter_type != IterType::Reduction
}

/// Which ids `tv` allocates, and their contiguity (before promotion and strides).
pub fn infer_ids(
    f: &Fusion,
    lg: &LoopGraph,
    exact: &IdGraph,
    tv: TvId,
    alloc_pos: usize,
) -> Result<(Vec<IterDomainId>, Vec<Option<bool>>)> {
    let t = &f.tvs[tv];
    let name = f.tv_name(tv);
    let mem = t.memory;
    if mem != MemoryType::Global {
        if let Some(alloc) = &t.allocation {
            if let Some(i) = t.contiguity.iter().position(|&c| c == Some(false)) {
                bail!(
                    "{name} is in {} memory but its allocation domain marks {} non-contiguous; Local and Shared tensors are always contiguous",
                    mem.enum_name(),
                    f.id_label(alloc[i])
                );
            }
        }
    }
    // A set allocation domain is honoured where it is valid: always on Global; on
    // Shared when it is a permutation of the loop domain.
    let use_set = match (&t.allocation, mem) {
        (Some(_), MemoryType::Global) => true,
        (Some(a), MemoryType::Shared) => a.len() == t.loop_domain.len() && a.iter().all(|x| t.loop_domain.contains(x)),
        _ => false,
    };
    if mem == MemoryType::Global {
        return Ok((t.maybe_allocation().to_vec(), t.contiguity.clone()));
    }
    if let (Some(alloc), false, MemoryType::Shared) = (&t.allocation, use_set, mem) {
        // A Shared layout the user asked for but that no longer fits the loops (it was
        // set before they were transformed) is an error, not something to drop silently.
        let dropped: Vec<String> = (0..alloc_pos)
            .map(|a| t.loop_domain[a])
            .filter(|&id| !is_shared_across(mem, effective_parallel(f, lg, tv, id)) && !alloc.contains(&id))
            .map(|id| f.id_label(id))
            .collect();
        if !dropped.is_empty() {
            bail!(
                "{name}: the set allocation domain drops inlined id(s) {}; set the allocation domain after transforming the loop domain, as a permutation of it",
                dropped.join(", ")
            );
        }
    }
    if use_set {
        let alloc = t.allocation.as_ref().expect("use_set implies a set domain");
        // Inlined ids that are not shared across must drop out; each must be in the set domain.
        let mut excluded: Vec<IterDomainId> = (0..alloc_pos)
            .map(|a| t.loop_domain[a])
            .filter(|&id| !is_shared_across(mem, effective_parallel(f, lg, tv, id)))
            .collect();
        let mut ids = Vec::new();
        let mut contig = Vec::new();
        for (i, &id) in alloc.iter().enumerate() {
            if let Some(p) = excluded.iter().position(|&x| x == id) {
                excluded.remove(p);
                continue;
            }
            if f.loop_position(tv, id).is_some() && is_partitioned_across(mem, effective_parallel(f, lg, tv, id)) {
                continue;
            }
            ids.push(id);
            contig.push(t.contiguity[i]);
        }
        if !excluded.is_empty() {
            let names: Vec<String> = excluded.iter().map(|&i| f.id_label(i)).collect();
            bail!(
                "{name}: the set allocation domain drops inlined id(s) {}; an allocation domain must contain every loop id left of the allocation position {alloc_pos}",
                names.join(", ")
            );
        }
        let keep: Vec<usize> = (0..ids.len()).filter(|&i| may_require_allocation(f, lg, tv, ids[i])).collect();
        return Ok((keep.iter().map(|&i| ids[i]).collect(), keep.iter().map(|&i| contig[i]).collect()));
    }
    // Inferred: loop ids right of the allocation position, plus ids left of it whose
    // parallel type the memory is shared across.
    let mut ids: Vec<IterDomainId> = Vec::new();
    for (a, &id) in t.loop_domain.iter().enumerate() {
        if a < alloc_pos && !is_shared_across(mem, effective_parallel(f, lg, tv, id)) {
            continue;
        }
        ids.push(id);
    }
    if let Some(patched) = patch_indexed_producer(f, tv, &ids)? {
        ids = patched;
    }
    ids.retain(|&id| may_require_allocation(f, lg, tv, id));
    if let Some(r) = reorder_allocation_ids(f, tv, &ids) {
        ids = r;
    }
    if let Some(p) = patch_transposed_smem(f, lg, exact, tv, &ids) {
        ids = p;
    }
    let contig = vec![Some(true); ids.len()];
    Ok((ids, contig))
}

/// Promote loop ids and compute strides, innermost to outermost (rules 2 and 3).
pub fn allocation_info(
    f: &mut Fusion,
    lg: &LoopGraph,
    tv: TvId,
    ids: &[IterDomainId],
    contig: &[Option<bool>],
    position: usize,
) -> Result<AllocationInfo> {
    let name = f.tv_name(tv);
    let mem = f.tvs[tv].memory;
    let promoted: Vec<IterDomainId> =
        ids.iter().map(|&id| f.loop_position(tv, id).map(|a| lg.promoted(tv, a)).unwrap_or(id)).collect();
    // Runtime strides count every non-reduction allocation dim (broadcasts included).
    let stride_dim = |f: &Fusion, i: usize| -> u32 {
        let alloc = f.tvs[tv].maybe_allocation();
        let target = ids[i];
        alloc.iter().take_while(|&&x| x != target).filter(|&&x| f.ids[x].iter_type != IterType::Reduction).count()
            as u32
    };
    let n = ids.len();
    let mut strides = vec![None; n];
    let mut cur = f.scalars.int(1);
    for i in (0..n).rev() {
        if !may_require_allocation(f, lg, tv, ids[i]) {
            continue;
        }
        let extent = f.ids[promoted[i]].extent;
        match contig[i] {
            Some(true) => {
                strides[i] = Some(cur);
                cur = f.scalars.mul(cur, extent);
            }
            Some(false) => {
                if mem != MemoryType::Global {
                    bail!("{name}: {} is non-contiguous, but only Global tensors may be", f.id_label(ids[i]));
                }
                let k = stride_dim(f, i);
                let s = f.scalars.symbol(Symbol::Stride(tv, k));
                strides[i] = Some(s);
                cur = f.scalars.mul(s, extent);
            }
            None => bail!("{name}: {} has no contiguity flag but takes room in memory", f.id_label(ids[i])),
        }
    }
    let mut out = AllocationInfo {
        tv,
        memory: mem,
        ids: Vec::new(),
        own_ids: Vec::new(),
        strides: Vec::new(),
        contiguity: Vec::new(),
        position,
        stages: 1,
        zero_init: false,
        resets_to_zero: false,
    };
    for i in 0..n {
        if let Some(s) = strides[i] {
            out.ids.push(promoted[i]);
            out.own_ids.push(ids[i]);
            out.strides.push(s);
            out.contiguity.push(contig[i] == Some(true));
        }
    }
    Ok(out)
}

/// Rule 4: order allocation ids by replaying the transforms from the logical (or set
/// allocation) domain, so a vectorized id ends innermost and a cache follows its
/// consumer's layout. `None` when the order already matches or cannot be replayed.
pub fn reorder_allocation_ids(f: &Fusion, tv: TvId, ids: &[IterDomainId]) -> Option<Vec<IterDomainId>> {
    let mut ordered: Vec<IterDomainId> = f.tvs[tv].maybe_allocation().to_vec();
    let mut any = false;
    for t in f.transforms_of(tv) {
        let tr = &f.transforms[t];
        let ins = tr.inputs();
        let positions: Vec<usize> = ins.iter().filter_map(|i| ordered.iter().position(|x| x == i)).collect();
        if positions.len() != ins.len() {
            continue;
        }
        any = true;
        // Outputs go right after the last input, in transform order.
        let at = positions.iter().max().copied().expect("a transform has inputs") + 1;
        ordered.splice(at..at, tr.outputs());
        ordered.retain(|x| !ins.contains(x));
    }
    if !any || !ids.iter().all(|i| ordered.contains(i)) {
        return None;
    }
    let reordered: Vec<IterDomainId> = ordered.into_iter().filter(|x| ids.contains(x)).collect();
    (reordered != ids).then_some(reordered)
}

/// For a Shared tile laid out as the reversed inputs of a merge (rule 5's patch), the
/// padded row length in elements (one 4-byte bank more than the row); `None` otherwise.
pub fn transposed_tile_row_padding(f: &Fusion, info: &AllocationInfo) -> Option<i64> {
    let [a, b] = info.own_ids.as_slice() else { return None };
    let t = f.ids[*a].use_?;
    let Transform::Merge { outer, inner, .. } = f.transforms[t] else { return None };
    if (outer, inner) != (*b, *a) {
        return None;
    }
    let row = f.scalars.as_int(f.ids[*b].extent)?;
    let dt = f.tvs[info.tv].dtype.size_bytes() as i64;
    // A row that is a multiple of the 32 banks maps every column to one bank.
    if (row * dt) % 128 != 0 {
        return None;
    }
    Some(row + (4 / dt).max(1))
}

/// The merge an id comes from, looking through splits.
fn originating_merge(f: &Fusion, mut id: IterDomainId) -> Option<(IterDomainId, IterDomainId, IterDomainId)> {
    loop {
        match f.transforms[f.ids[id].definition?] {
            Transform::Merge { outer, inner, out } => return Some((outer, inner, out)),
            Transform::Split { input, .. } => id = input,
        }
    }
}

/// Rule 5: a Shared staging buffer of a transpose, read by a vectorized Global store
/// whose merge is the reverse of the producer's, is allocated as `[inner, outer]` of
/// the producer's merge rather than as its split halves. kiln extends the rule to a tile
/// read by element-wise ops (an epilogue such as SiLU, computed into a Local tensor the
/// vectorized store then writes): each reader's innermost loop must run along the reversed
/// merge, so its reads walk the tile's rows as the store's would.
pub fn patch_transposed_smem(
    f: &Fusion,
    lg: &LoopGraph,
    exact: &IdGraph,
    tv: TvId,
    ids: &[IterDomainId],
) -> Option<Vec<IterDomainId>> {
    let t = &f.tvs[tv];
    if ids.is_empty() || t.memory != MemoryType::Shared || t.uses.is_empty() {
        return None;
    }
    if ids.iter().any(|&id| effective_parallel(f, lg, tv, id).is_block()) {
        return None;
    }
    // Each reader and the loop id its reads run along: a Global store's vectorized id, or
    // the innermost loop of a Local element-wise result.
    let mut readers = Vec::new();
    for &u in &t.uses {
        let use_ = &f.exprs[u];
        let consumer = use_.output;
        let c = &f.tvs[consumer];
        let along = match c.memory {
            MemoryType::Global if use_.op == Op::Set => {
                *c.loop_domain.iter().find(|&&id| f.ids[id].parallel == ParallelType::Vectorize)?
            }
            MemoryType::Local if use_.op.is_elementwise() => *c.loop_domain.last()?,
            _ => return None,
        };
        readers.push((consumer, along));
    }
    let (m_outer, m_inner, m_out) = originating_merge(f, ids[0])?;
    // The allocation ids must be exactly what the merge output was split into.
    let mut set: Vec<IterDomainId> = ids.to_vec();
    let between: Vec<_> = f
        .transforms_of(tv)
        .into_iter()
        .filter(|&tr| f.transforms[tr].inputs().iter().all(|&i| depends_on(f, i, m_out)))
        .collect();
    for tr in between.into_iter().rev() {
        let outs = f.transforms[tr].outputs();
        for o in &outs {
            if !set.contains(o) && may_require_allocation(f, lg, tv, *o) {
                return None;
            }
        }
        set.retain(|x| !outs.contains(x));
        for i in f.transforms[tr].inputs() {
            if !set.contains(&i) {
                set.push(i);
            }
        }
    }
    if set != [m_out] {
        return None;
    }
    // Find the reverse merge (outer ~ our inner, inner ~ our outer) and its output in the consumer.
    let reverse_out = f.transforms.values().find_map(|tr| match *tr {
        Transform::Merge { outer, inner, out } if exact.same(outer, m_inner) && exact.same(inner, m_outer) => Some(out),
        _ => None,
    })?;
    for (consumer, along) in readers {
        let consumer_ids = all_ids(f, consumer);
        let consumer_merge_out = *consumer_ids.iter().find(|&&id| exact.same(id, reverse_out))?;
        if !depends_on(f, along, consumer_merge_out) {
            return None;
        }
    }
    Some(vec![m_inner, m_outer])
}

/// Every id of a tensor: logical and everything derived from it.
fn all_ids(f: &Fusion, tv: TvId) -> Vec<IterDomainId> {
    let mut v = f.tvs[tv].logical.clone();
    for t in f.transforms_of(tv) {
        v.extend(f.transforms[t].outputs());
    }
    v
}

/// True when `id` is `ancestor` or derived from it.
fn depends_on(f: &Fusion, id: IterDomainId, ancestor: IterDomainId) -> bool {
    f.id_derived_from_any(id, |i| i == ancestor)
}

/// Rule 6: a producer read through indices (index_select) allocates the whole indexed
/// logical id in place of the allocation ids derived from it.
pub fn patch_indexed_producer(f: &Fusion, tv: TvId, ids: &[IterDomainId]) -> Result<Option<Vec<IterDomainId>>> {
    let mut indexed: Vec<IterDomainId> = Vec::new();
    for &u in &f.tvs[tv].uses {
        let e = &f.exprs[u];
        if e.inputs[0] != Operand::Tensor(tv) {
            continue;
        }
        let read: Vec<IterDomainId> = match e.op {
            Op::IndexSelect { dim } => vec![f.no_reduction_logical(tv)[dim]],
            // A remap reads every axis at computed positions.
            Op::Remap { .. } => f.no_reduction_logical(tv),
            _ => continue,
        };
        for id in read {
            if !ids.contains(&id) && !indexed.contains(&id) && f.ids[id].iter_type != IterType::Broadcast {
                indexed.push(id);
            }
        }
    }
    if indexed.is_empty() {
        return Ok(None);
    }
    let mut patched = ids.to_vec();
    for idx in indexed {
        let dependents: Vec<IterDomainId> = patched.iter().copied().filter(|&a| depends_on(f, a, idx)).collect();
        if dependents.is_empty() {
            bail!(
                "{}: it is read through indices along {}, which must be allocated whole, but none of its allocated ids [{}] covers it; inline {} to the left of that axis",
                f.tv_name(tv),
                f.id_label(idx),
                patched.iter().map(|&i| f.id_label(i)).collect::<Vec<_>>().join(", "),
                f.tv_name(tv)
            );
        }
        let last = patched.iter().rposition(|a| dependents.contains(a)).expect("non-empty");
        let mut next = Vec::with_capacity(patched.len());
        for (i, &a) in patched.iter().enumerate() {
            if i == last {
                next.push(idx);
            } else if !dependents.contains(&a) {
                next.push(a);
            }
        }
        patched = next;
    }
    Ok(Some(patched))
}
