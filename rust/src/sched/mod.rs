//! Manual scheduling primitives on a fusion's tensors (split, merge, reorder,
//! parallelize, memory type, caches, inlining, allocation domain). Each one checks
//! its arguments and leaves the fusion unchanged when it returns an error.

pub mod auto;
pub mod propagate;
pub mod replay;

use rustc_hash::FxHashMap;
use smallvec::smallvec;

use crate::error::Result;
use crate::ir::mapping::producer_to_consumer;
use crate::ir::{
    DataType, ExprId, Fusion, IterDomainId, IterType, MemoryType, Op, Operand, ParallelType, Transform, TvId,
};
use crate::{bail, bail_type};

/// The largest cluster every sm_90+ GPU launches (larger ones need an opt-in per kernel).
pub const MAX_CLUSTER: u32 = 8;

impl Fusion {
    /// Largest inline position of any producer of `tv`: axes left of it are shared.
    pub fn max_producer_inline_pos(&self, tv: TvId) -> usize {
        self.producers(tv).iter().map(|&p| self.tvs[p].inline_pos).max().unwrap_or(0)
    }

    /// Reject transforming `axis` of `tv` when an inlined loop depends on it.
    fn check_axis_not_inlined(&self, tv: TvId, axis: usize, what: &str) -> Result<()> {
        let own = self.tvs[tv].inline_pos;
        if axis < own {
            bail!(
                "{what} {}: axis {axis} is inside the inline position {own} of {}; transform axes before inlining",
                self.tv_name(tv),
                self.tv_name(tv)
            );
        }
        for p in self.producers(tv) {
            let pos = self.tvs[p].inline_pos;
            if axis < pos {
                bail!(
                    "{what} {}: axis {axis} is shared with producer {} inlined at position {pos}; transform axes before inlining",
                    self.tv_name(tv),
                    self.tv_name(p)
                );
            }
        }
        Ok(())
    }

    pub(crate) fn check_not_input(&self, tv: TvId, what: &str) -> Result<()> {
        if self.is_input(tv) {
            bail!(
                "{what}: {} is a fusion input; inputs are read as given (use cache_after() and schedule the cache)",
                self.tv_name(tv)
            );
        }
        Ok(())
    }

    /// Split loop axis `axis` by `factor` into (outer, inner); non-divisible sizes round up.
    pub fn split(&mut self, tv: TvId, axis: i64, factor: i64, inner_split: bool) -> Result<()> {
        let a = self.normalize_axis(tv, axis)?;
        if factor < 1 {
            bail!("split {}: axis {a}: factor must be >= 1, got {factor}", self.tv_name(tv));
        }
        // A factor is a loop extent: one past what a grid or a loop can count is a typo, and
        // its serial loop of predicated iterations would run for ever.
        if factor > i64::from(i32::MAX) {
            bail!(
                "split {}: axis {a}: factor {factor} is larger than 2^31 - 1, the longest loop a kernel runs",
                self.tv_name(tv)
            );
        }
        self.check_axis_not_inlined(tv, a, "split")?;
        let id = self.tvs[tv].loop_domain[a];
        if self.ids[id].parallel == ParallelType::Vectorize {
            bail!("split {}: axis {a} is vectorized; split before parallelizing", self.tv_name(tv));
        }
        let it = self.ids[id].iter_type;
        let extent = self.ids[id].extent;
        let f = self.scalars.int(factor);
        let rest = self.scalars.ceil_div(extent, f);
        // A broadcast has one element: both parts of its split keep extent one. A part of
        // `factor` would be a loop over copies of that element wherever no consumer's axis
        // gives it a size, so a reduction or a grid merged with it would add or write the
        // element `factor` times.
        let (oe, ie) = if it == IterType::Broadcast {
            (extent, extent)
        } else if inner_split {
            (rest, f)
        } else {
            (f, rest)
        };
        let outer = self.new_id(oe, it);
        let inner = self.new_id(ie, it);
        let t = self.transforms.push(Transform::Split { input: id, factor: f, inner_split, outer, inner });
        self.ids[outer].definition = Some(t);
        self.ids[inner].definition = Some(t);
        self.ids[id].use_ = Some(t);
        self.tvs[tv].loop_domain.splice(a..=a, [outer, inner]);
        self.manually_scheduled = true;
        Ok(())
    }

    /// Merge loop axes `a` (outer) and `b` (inner); the result takes `a`'s place.
    pub fn merge(&mut self, tv: TvId, a: i64, b: i64) -> Result<()> {
        let ia = self.normalize_axis(tv, a)?;
        let ib = self.normalize_axis(tv, b)?;
        let name = self.tv_name(tv);
        if ia == ib {
            bail!("merge {name}: axis {ia} cannot be merged with itself");
        }
        self.check_axis_not_inlined(tv, ia.min(ib), "merge")?;
        let (oa, ob) = (self.tvs[tv].loop_domain[ia], self.tvs[tv].loop_domain[ib]);
        let (ta, tb) = (self.ids[oa].iter_type, self.ids[ob].iter_type);
        let it = match (ta, tb) {
            (IterType::Broadcast, x) | (x, IterType::Broadcast) => x,
            (IterType::Reduction, IterType::Iteration) | (IterType::Iteration, IterType::Reduction) => {
                let (r, i) = if ta == IterType::Reduction { (ia, ib) } else { (ib, ia) };
                bail!("merge {name}: axis {r} is a reduction and axis {i} is an iteration axis; they cannot be merged");
            }
            (x, _) => x,
        };
        for (ax, id) in [(ia, oa), (ib, ob)] {
            if self.ids[id].parallel == ParallelType::Vectorize {
                bail!("merge {name}: axis {ax} is vectorized; merge before parallelizing");
            }
        }
        let extent = self.scalars.mul(self.ids[oa].extent, self.ids[ob].extent);
        // As for a split's factor: two split factors merged back can count past any loop.
        if let Some(n) = self.scalars.as_int(extent).filter(|&n| n > i64::from(i32::MAX)) {
            bail!(
                "merge {name}: axes {ia} and {ib} would make a loop of {n} iterations, more than 2^31 - 1, the longest loop a kernel runs"
            );
        }
        let out = self.new_id(extent, it);
        let t = self.transforms.push(Transform::Merge { outer: oa, inner: ob, out });
        self.ids[out].definition = Some(t);
        self.ids[oa].use_ = Some(t);
        self.ids[ob].use_ = Some(t);
        let ld = &mut self.tvs[tv].loop_domain;
        ld[ia] = out;
        ld.remove(ib);
        self.manually_scheduled = true;
        Ok(())
    }

    /// Move loop axes: `moves` lists (old, new); other axes keep their relative order.
    pub fn reorder(&mut self, tv: TvId, moves: &[(i64, i64)]) -> Result<()> {
        let name = self.tv_name(tv);
        let n = self.tvs[tv].loop_domain.len();
        let mut target: Vec<Option<usize>> = vec![None; n];
        let mut taken = vec![false; n];
        for &(old, new) in moves {
            let o = self.normalize_axis(tv, old)?;
            let nn = self.normalize_axis(tv, new).map_err(|_| {
                crate::error::KilnError::value(format!(
                    "reorder {name}: target position {new} for axis {o} is out of range for {n} axes"
                ))
            })?;
            if target[o].is_some() {
                bail!("reorder {name}: axis {o} is moved twice");
            }
            if taken[nn] {
                bail!("reorder {name}: two axes are moved to position {nn} (axis {o} and another)");
            }
            target[o] = Some(nn);
            taken[nn] = true;
        }
        let mut new_loop: Vec<Option<IterDomainId>> = vec![None; n];
        let old_loop = self.tvs[tv].loop_domain.clone();
        for (o, t) in target.iter().enumerate() {
            if let Some(t) = t {
                new_loop[*t] = Some(old_loop[o]);
            }
        }
        let mut free =
            new_loop.iter().enumerate().filter(|(_, x)| x.is_none()).map(|(i, _)| i).collect::<Vec<_>>().into_iter();
        for (o, t) in target.iter().enumerate() {
            if t.is_none() {
                let slot = free.next().expect("one free slot per unmoved axis");
                new_loop[slot] = Some(old_loop[o]);
            }
        }
        let new_loop: Vec<IterDomainId> = new_loop.into_iter().map(|x| x.expect("all slots filled")).collect();
        let first_changed = (0..n).find(|&i| new_loop[i] != old_loop[i]);
        if let Some(i) = first_changed {
            self.check_axis_not_inlined(tv, i, "reorder")?;
        }
        if let Some(v) = new_loop.iter().position(|&id| self.ids[id].parallel == ParallelType::Vectorize) {
            if v + 1 != n {
                bail!(
                    "reorder {name}: the vectorized axis would move to axis {v}; a vectorized axis must stay innermost"
                );
            }
        }
        self.tvs[tv].loop_domain = new_loop;
        self.manually_scheduled = true;
        Ok(())
    }

    /// Map loop axis `axis` onto a parallel type.
    pub fn parallelize(&mut self, tv: TvId, axis: i64, pt: ParallelType) -> Result<()> {
        let a = self.normalize_axis(tv, axis)?;
        let name = self.tv_name(tv);
        let ld = self.tvs[tv].loop_domain.clone();
        let id = ld[a];
        if pt.is_unique_per_tensor() {
            if let Some(other) = ld.iter().position(|&x| x != id && self.ids[x].parallel == pt) {
                bail!(
                    "parallelize {name}: axis {a}: {} is already used by axis {other}; each tensor may use it once",
                    pt.enum_name()
                );
            }
        }
        if pt == ParallelType::Vectorize {
            if a + 1 != ld.len() {
                bail!(
                    "parallelize {name}: axis {a}: Vectorize must be on the innermost axis ({}), not axis {a}",
                    ld.len() - 1
                );
            }
            if self.ids[id].iter_type == IterType::Reduction {
                bail!("parallelize {name}: axis {a} is a reduction axis; it cannot be vectorized");
            }
            let Some(w) = self.scalars.as_int(self.ids[id].extent) else {
                bail!(
                    "parallelize {name}: axis {a} has symbolic extent {}; Vectorize needs a constant extent (split by 2, 4, 8 ... first)",
                    self.scalars.render(self.ids[id].extent)
                );
            };
            let bytes = w as usize * self.tvs[tv].dtype.size_bytes();
            if !(w as u64).is_power_of_two() || bytes > 16 {
                bail!(
                    "parallelize {name}: axis {a} has extent {w} ({bytes} bytes of {}); Vectorize needs a power-of-two width of at most 16 bytes",
                    self.tvs[tv].dtype
                );
            }
        }
        if pt == ParallelType::Bulk {
            if a + 1 != ld.len() {
                bail!(
                    "parallelize {name}: axis {a}: Bulk must be on the innermost axis ({}), not axis {a} (a bulk copy moves one contiguous run of elements)",
                    ld.len() - 1
                );
            }
            let Some(w) = self.scalars.as_int(self.ids[id].extent) else {
                bail!(
                    "parallelize {name}: axis {a} has symbolic extent {}; a Bulk box has a constant size (split the axis first)",
                    self.scalars.render(self.ids[id].extent)
                );
            };
            let bytes = w * self.tvs[tv].dtype.size_bytes() as i64;
            if bytes % 16 != 0 {
                bail!(
                    "parallelize {name}: axis {a} has extent {w} ({bytes} bytes of {}); a Bulk copy moves a multiple of 16 bytes",
                    self.tvs[tv].dtype
                );
            }
        }
        self.ids[id].parallel = pt;
        self.manually_scheduled = true;
        Ok(())
    }

    /// Choose where `tv` lives.
    pub fn set_memory_type(&mut self, tv: TvId, mt: MemoryType) -> Result<()> {
        let name = self.tv_name(tv);
        if mt != MemoryType::Global && (self.is_input(tv) || self.is_output(tv)) {
            let kind = if self.is_input(tv) { "input" } else { "output" };
            bail!(
                "set_memory_type {name}: {name} is a fusion {kind} and must stay in Global memory (cache it instead)"
            );
        }
        self.tvs[tv].memory = mt;
        self.tvs[tv].tensor_memory = false;
        self.manually_scheduled = true;
        Ok(())
    }

    /// Keep `tv` in Tensor memory (Blackwell, sm_100a): thread-private cells like Local
    /// memory, one lane per thread, 32-bit cells.
    pub fn set_tensor_memory(&mut self, tv: TvId) -> Result<()> {
        self.set_memory_type(tv, MemoryType::Local)?;
        let name = self.tv_name(tv);
        let dt = self.tvs[tv].dtype;
        if dt.size_bytes() != 4 {
            bail!("set_memory_type {name}: Tensor memory holds 32-bit cells; {name} is {}", dt.enum_name());
        }
        self.tvs[tv].tensor_memory = true;
        Ok(())
    }

    /// Make expr `e` read `new` wherever it reads `old` (use lists follow).
    pub fn redirect_use(&mut self, e: ExprId, old: TvId, new: TvId) {
        for o in self.exprs[e].inputs.iter_mut() {
            if *o == Operand::Tensor(old) {
                *o = Operand::Tensor(new);
            }
        }
        self.tvs[old].uses.retain(|&u| u != e);
        if !self.tvs[new].uses.contains(&e) {
            self.tvs[new].uses.push(e);
        }
        self.note_stand_in(new, old);
    }

    /// A copy of `tv` that `tv`'s consumers read instead (a read cache).
    pub fn cache_after(&mut self, tv: TvId) -> Result<TvId> {
        let uses = self.tvs[tv].uses.clone();
        self.cache_after_uses(tv, uses)
    }

    /// [`Fusion::cache_after`] for the readers that read `tv` element by element: a gather
    /// or remap keeps reading `tv` at its own positions. None when no reader is plain.
    pub(crate) fn cache_after_plain_reads(&mut self, tv: TvId) -> Result<Option<TvId>> {
        let plain: Vec<ExprId> =
            self.tvs[tv].uses.iter().copied().filter(|&e| self.exprs[e].indexed_tensor() != Some(tv)).collect();
        if plain.is_empty() {
            return Ok(None);
        }
        self.cache_after_uses(tv, plain).map(Some)
    }

    /// A copy of `tv` that the readers `uses` read instead.
    pub(crate) fn cache_after_uses(&mut self, tv: TvId, uses: Vec<ExprId>) -> Result<TvId> {
        let name = self.tv_name(tv);
        if self.tvs[tv].inline_pos > 0 {
            bail!("cache_after {name}: {name} is already inlined; call cache_after before inline_at");
        }
        let c = self.set(tv)?;
        for e in uses {
            self.redirect_use(e, tv, c);
        }
        self.manually_scheduled = true;
        Ok(c)
    }

    /// A new tensor that takes over `tv`'s definition; `tv` becomes a copy of it (a write cache).
    pub fn cache_before(&mut self, tv: TvId) -> Result<TvId> {
        let name = self.tv_name(tv);
        self.check_not_input(tv, "cache_before")?;
        let Some(def) = self.tvs[tv].definition else {
            bail!("cache_before {name}: {name} has no definition to cache");
        };
        // The cache gets copies of all logical ids (reductions included) and tv's loop transforms.
        let old_logical = self.tvs[tv].logical.clone();
        let mut map: FxHashMap<IterDomainId, IterDomainId> = FxHashMap::default();
        let mut c_logical = Vec::with_capacity(old_logical.len());
        for &id in &old_logical {
            let src = self.ids[id].clone();
            let n = self.new_id(src.extent, src.iter_type);
            map.insert(id, n);
            c_logical.push(n);
        }
        let dtype = self.tvs[tv].dtype;
        let c = self.new_tv(dtype, MemoryType::Local, c_logical);
        self.note_stand_in(c, tv);
        let c_loop = replay::replay_onto(self, tv, &mut map);
        self.tvs[c].loop_domain = c_loop;
        // The cache follows tv's memory layout, so a vectorized store needs no reshuffle.
        if let Some(alloc) = self.tvs[tv].allocation.clone() {
            if let Some(mapped) = alloc.iter().map(|id| map.get(id).copied()).collect::<Option<Vec<_>>>() {
                let contig = mapped
                    .iter()
                    .map(|&id| if self.ids[id].iter_type == IterType::Broadcast { None } else { Some(true) })
                    .collect();
                self.tvs[c].allocation = Some(mapped);
                self.tvs[c].contiguity = contig;
            }
        }
        self.exprs[def].output = c;
        self.tvs[c].definition = Some(def);
        let has_reduction = old_logical.iter().any(|&id| self.ids[id].iter_type == IterType::Reduction);
        if has_reduction {
            // tv is now a plain copy: it no longer has the reduced axes, so its schedule restarts.
            let nr = self.no_reduction_logical(tv);
            // A stored order (`stride_order`) stays, without the reduced axes.
            let kept = self.tvs[tv]
                .allocation
                .take()
                .map(|a| a.into_iter().filter(|&id| self.ids[id].iter_type != IterType::Reduction).collect::<Vec<_>>());
            let kept = kept.filter(|a| a != &nr);
            self.tvs[tv].contiguity = kept
                .as_ref()
                .unwrap_or(&nr)
                .iter()
                .map(|&id| if self.ids[id].iter_type == IterType::Broadcast { None } else { Some(true) })
                .collect();
            self.tvs[tv].logical = nr.clone();
            // The copy keeps an inline position within its fewer axes.
            self.tvs[tv].inline_pos = self.tvs[tv].inline_pos.min(nr.len());
            self.tvs[tv].loop_domain = nr;
            self.tvs[tv].allocation = kept;
        }
        self.tvs[tv].definition = None;
        self.add_expr(Op::Set, smallvec![Operand::Tensor(c)], tv);
        self.manually_scheduled = true;
        Ok(c)
    }

    /// Inline `tv` into its consumers at loop position `pos` (`-1`: as deep as valid).
    pub fn inline_at(&mut self, tv: TvId, pos: i64) -> Result<()> {
        let name = self.tv_name(tv);
        self.check_not_input(tv, "inline_at")?;
        let n = self.tvs[tv].loop_domain.len();
        if pos == -1 {
            // An untouched consumer takes its schedule when the fusion is lowered
            // (`propagate`); the deepest position against that schedule is found then.
            let later = self.consumers(tv).into_iter().any(|c| crate::sched::propagate::untouched(self, c));
            self.tvs[tv].inline_pos = self.max_inline_pos(tv);
            self.tvs[tv].inline_deepest = later;
            self.manually_scheduled = true;
            return Ok(());
        }
        self.tvs[tv].inline_deepest = false;
        // Other negative positions count from the end, as nvFuser's do (-2 is `n - 1`).
        let given = pos;
        let pos = if pos < -1 { pos + n as i64 + 1 } else { pos };
        if pos < 0 || pos as usize > n {
            bail!("inline_at {name}: position {given} is out of range; expected 0 to {n}, -1 for the deepest valid position, or -2 to -{} counting from the end", n + 1);
        }
        let pos = pos as usize;
        if pos > 0 && self.tvs[tv].uses.is_empty() {
            bail!("inline_at {name}: {name} has no consumers to inline into");
        }
        if let Err(e) = self.check_inline(tv, pos) {
            // A consumer left untouched takes its own consumer's schedule when the fusion is
            // lowered (`propagate`): the position is checked against that schedule then.
            let later = self.consumers(tv).into_iter().any(|c| crate::sched::propagate::untouched(self, c));
            if !later {
                return Err(e);
            }
        }
        self.tvs[tv].inline_pos = pos;
        self.tvs[tv].inline_pinned = true;
        self.manually_scheduled = true;
        Ok(())
    }

    /// The deepest position at which `tv` can be inlined into all its consumers.
    pub fn max_inline_pos(&self, tv: TvId) -> usize {
        self.deepest_inline_within(tv, crate::sched::propagate::before_serial_reduction(self, tv))
    }

    /// The deepest position up to `limit` at which `tv` can be inlined into all its
    /// consumers: one `check_inline` accepts, sharing no loop that the producer and a
    /// consumer parallelize differently (one loop has one parallel type).
    pub(crate) fn deepest_inline_within(&self, tv: TvId, limit: usize) -> usize {
        if self.tvs[tv].uses.is_empty() || self.is_input(tv) {
            return 0;
        }
        // Like nvFuser's inlineMost: stop before a vectorized axis, so the vectorized
        // copy keeps its own loop and can be emitted as one wide access.
        let vec_pos =
            |t: TvId| self.tvs[t].loop_domain.iter().position(|&id| self.ids[id].parallel == ParallelType::Vectorize);
        let mut n = self.tvs[tv].loop_domain.len().min(limit);
        for t in std::iter::once(tv).chain(self.consumers(tv)) {
            if let Some(v) = vec_pos(t) {
                n = n.min(v);
            }
        }
        let ld = &self.tvs[tv].loop_domain;
        for c in self.consumers(tv) {
            let cl = &self.tvs[c].loop_domain;
            let clash = (0..n.min(cl.len())).find(|&i| {
                let (p, q) = (self.ids[ld[i]].parallel, self.ids[cl[i]].parallel);
                p != ParallelType::Serial && q != ParallelType::Serial && p != q
            });
            if let Some(i) = clash {
                n = i;
            }
        }
        (0..=n).rev().find(|&p| self.check_inline(tv, p).is_ok()).unwrap_or(0)
    }

    /// The id whose extent loop axis `i` of `t` runs: `t`'s own, or where `t` is inlined
    /// past it, its consumer's (which may concretize a broadcast `t` keeps), transitively.
    fn concretized_loop_id(&self, t: TvId, i: usize) -> IterDomainId {
        let mut t = t;
        for _ in 0..self.tvs.len() {
            let inner = self.tvs[t].uses.first().map(|&e| self.exprs[e].output);
            match inner {
                Some(c) if self.tvs[t].inline_pos > i && self.tvs[c].loop_domain.len() > i => t = c,
                _ => break,
            }
        }
        self.tvs[t].loop_domain[i]
    }

    /// A plain broadcast axis `i` of `tv` shared with several consumers: the loop runs one
    /// iteration space, so consumers that concretize it (those that keep it a broadcast
    /// follow any) must agree on whether they reduce it and on its (constant) extent.
    fn check_broadcast_consumers(&self, tv: TvId, i: usize) -> Result<()> {
        let name = self.tv_name(tv);
        let mut first: Option<(TvId, IterDomainId)> = None;
        for &e in &self.tvs[tv].uses {
            let c = self.exprs[e].output;
            if self.tvs[c].loop_domain.len() <= i {
                continue;
            }
            let cid = self.concretized_loop_id(c, i);
            if self.ids[cid].iter_type == IterType::Broadcast {
                continue;
            }
            let Some((c0, id0)) = first else {
                first = Some((c, cid));
                continue;
            };
            let (a, b) = (&self.ids[id0], &self.ids[cid]);
            let kinds_differ = (a.iter_type == IterType::Reduction) != (b.iter_type == IterType::Reduction);
            let sizes_differ = matches!(
                (self.scalars.as_int(a.extent), self.scalars.as_int(b.extent)),
                (Some(x), Some(y)) if x != y
            );
            if kinds_differ || sizes_differ {
                let how = |id: &crate::ir::IterDomain| {
                    let kind = if id.iter_type == IterType::Reduction { "reduces" } else { "iterates" };
                    format!("{kind} it over {}", self.scalars.render(id.extent))
                };
                bail!(
                    "inline_at {name}: axis {i} ({}) is a broadcast that its consumer {} {} and its consumer {} {}; one loop cannot run both: inline {name} at {i} or less",
                    self.id_label(self.tvs[tv].loop_domain[i]),
                    self.tv_name(c0),
                    how(a),
                    self.tv_name(c),
                    how(b)
                );
            }
        }
        Ok(())
    }

    /// Check that `tv`'s first `pos` loop axes are shared with every consumer.
    pub fn check_inline(&self, tv: TvId, pos: usize) -> Result<()> {
        let name = self.tv_name(tv);
        let ld = &self.tvs[tv].loop_domain;
        if pos > ld.len() {
            bail!("inline_at {name}: position {pos} exceeds its {} loop axes", ld.len());
        }
        for (i, &id) in ld.iter().enumerate().take(pos) {
            if self.ids[id].iter_type == IterType::Reduction {
                bail!("inline_at {name}: position {pos} is past axis {i}, a reduction axis; a reduction must complete before consumers read it (inline at {i} or less)");
            }
        }
        for &e in &self.tvs[tv].uses {
            let c = self.exprs[e].output;
            let cname = self.tv_name(c);
            let cl = &self.tvs[c].loop_domain;
            if pos > cl.len() {
                bail!("inline_at {name}: position {pos} exceeds the {} loop axes of consumer {cname}", cl.len());
            }
            for input_pos in 0..self.exprs[e].inputs.len() {
                if self.exprs[e].inputs[input_pos] != Operand::Tensor(tv) {
                    continue;
                }
                let map = producer_to_consumer(self, e, input_pos);
                for i in 0..pos {
                    let new_broadcast =
                        self.ids[cl[i]].iter_type == IterType::Broadcast && !map.values().any(|&v| v == cl[i]);
                    if map.get(&ld[i]) != Some(&cl[i]) && new_broadcast {
                        // The consumer's axis is one the broadcast adds: the producer has
                        // nothing to line up with it (nvFuser skips it; kiln's positions
                        // are axis by axis).
                        bail!(
                            "inline_at {name}: axis {i} of consumer {cname} ({}) is a broadcast axis {name} does not have, in front of position {pos}; move it behind the shared axes in {cname} and its consumers (e.g. {cname}.reorder({{{i}: -1}})), or inline {name} at {i}",
                            self.id_label(cl[i])
                        );
                    }
                    if map.get(&ld[i]) != Some(&cl[i]) {
                        bail!(
                            "inline_at {name}: axis {i} ({}) does not match axis {i} of consumer {cname} ({}); schedule both the same way up to position {pos}",
                            self.id_label(ld[i]),
                            self.id_label(cl[i])
                        );
                    }
                }
            }
        }
        // An axis merged from a broadcast and an iteration axis runs the extent its consumer
        // concretizes the broadcast with. Two consumers that iterate it with different
        // extents (one concretizes the broadcast, the other keeps it) cannot share one loop
        // with the producer: the loop would run the larger extent for both, and split it
        // into the wrong elements for the other. (A plain broadcast axis only repeats its
        // one element.)
        if self.tvs[tv].uses.len() > 1 {
            for (i, &pid) in ld.iter().enumerate().take(pos) {
                let mixed = self.ids[pid].iter_type != IterType::Broadcast
                    && crate::analysis::loop_graph::depends_on_broadcast(self, pid);
                if !mixed {
                    if self.ids[pid].iter_type == IterType::Broadcast {
                        self.check_broadcast_consumers(tv, i)?;
                    }
                    continue;
                }
                let mut first: Option<(TvId, IterDomainId)> = None;
                for &e in &self.tvs[tv].uses {
                    let c = self.exprs[e].output;
                    let cid = self.concretized_loop_id(c, i);
                    match first {
                        None => first = Some((c, cid)),
                        Some((c0, id0)) if self.ids[id0].extent != self.ids[cid].extent => bail!(
                            "inline_at {name}: axis {i} ({}) comes from a broadcast that its consumers {} and {} iterate with different extents ({} and {}); one loop cannot run both: inline {name} at {i} or less",
                            self.id_label(pid),
                            self.tv_name(c0),
                            self.tv_name(c),
                            self.scalars.render(self.ids[id0].extent),
                            self.scalars.render(self.ids[cid].extent)
                        ),
                        _ => {}
                    }
                }
            }
        }
        Ok(())
    }

    /// Set the memory layout of `tv` to `ids` (a transform of its logical domain).
    pub fn set_allocation_domain(&mut self, tv: TvId, ids: &[IterDomainId], contiguity: &[Option<bool>]) -> Result<()> {
        let name = self.tv_name(tv);
        if contiguity.len() != ids.len() {
            bail!(
                "set_allocation_domain {name}: contiguity has {} entries but the allocation domain has {} axes",
                contiguity.len(),
                ids.len()
            );
        }
        for (i, &id) in ids.iter().enumerate() {
            if let Some(j) = ids[..i].iter().position(|&x| x == id) {
                let which = match self.tvs[tv].loop_domain.iter().position(|&x| x == id) {
                    Some(a) => format!("loop axis {a} ({})", self.id_label(id)),
                    None => self.id_label(id),
                };
                bail!("set_allocation_domain {name}: {which} is listed twice, at entries {j} and {i} of the allocation domain");
            }
            match (self.ids[id].iter_type == IterType::Broadcast, contiguity[i]) {
                (true, Some(_)) => {
                    bail!("set_allocation_domain {name}: axis {i} is a broadcast and takes contiguity None")
                }
                (false, None) => bail!(
                    "set_allocation_domain {name}: axis {i} is not a broadcast and needs contiguity True or False"
                ),
                _ => {}
            }
        }
        self.check_covers_logical(tv, ids)?;
        // A fusion output is handed back as an array with strides: its layout can only be
        // an order of its logical axes, not a split or merge of them.
        if self.is_output(tv) {
            let logical = self.no_reduction_logical(tv);
            let kept: Vec<IterDomainId> =
                ids.iter().copied().filter(|&id| self.ids[id].iter_type != IterType::Reduction).collect();
            if let Some((i, &id)) = kept.iter().enumerate().find(|(_, id)| !logical.contains(id)) {
                bail!(
                    "set_allocation_domain {name}: axis {i} ({}) is not one of its logical axes; an output's layout is an order of its logical axes (split or merge a loop axis instead)",
                    self.id_label(id)
                );
            }
            if let Some((a, &id)) = logical.iter().enumerate().find(|(_, id)| !kept.contains(id)) {
                bail!(
                    "set_allocation_domain {name}: its logical axis {a} ({}) is missing; an output's layout lists every logical axis once",
                    self.id_label(id)
                );
            }
        }
        self.tvs[tv].allocation = Some(ids.to_vec());
        self.tvs[tv].contiguity = contiguity.to_vec();
        self.manually_scheduled = true;
        Ok(())
    }

    /// Store output `tv` dense in nvFuser's `stride_order` (axis `i` of its non-reduction
    /// logical domain has the `stride_order[i]`-th smallest stride): a property of the
    /// definition (`add_output(t, stride_order)`), which leaves the fusion to the automatic
    /// schedulers, unlike `set_allocation_domain`.
    fn set_output_order(&mut self, tv: TvId, stride_order: &[usize]) -> Result<()> {
        let (ids, contiguity) = self.output_order_domain(tv, stride_order)?;
        self.tvs[tv].allocation = Some(ids);
        self.tvs[tv].contiguity = contiguity;
        Ok(())
    }

    /// Mark `tv` as an output stored in `stride_order`. Adding a tensor that is already an
    /// output stores a copy, so each of the two outputs keeps its own order.
    pub fn add_output_ordered(&mut self, tv: TvId, stride_order: &[usize]) -> Result<()> {
        // Checked before anything changes, so a refused order adds no output.
        self.output_order_domain(tv, stride_order)?;
        self.add_output(tv)?;
        let stored = *self.outputs.last().expect("add_output pushed it");
        self.set_output_order(stored, stride_order)
    }

    /// The allocation domain and contiguity that store `tv` dense in `stride_order`.
    fn output_order_domain(&self, tv: TvId, stride_order: &[usize]) -> Result<(Vec<IterDomainId>, Vec<Option<bool>>)> {
        let name = self.tv_name(tv);
        if self.tvs[tv].definition.is_none() {
            bail!("add_output {name}: stride_order applies to computed outputs, and {name} is an input");
        }
        let logical = self.no_reduction_logical(tv);
        let mut seen = stride_order.to_vec();
        seen.sort_unstable();
        if seen != (0..logical.len()).collect::<Vec<_>>() {
            bail!(
                "add_output {name}: stride_order {stride_order:?} is not a permutation of 0..{} (one entry per axis of the {}-d output)",
                logical.len().saturating_sub(1),
                logical.len()
            );
        }
        // Outermost first: the axis with the largest order.
        let mut axes: Vec<usize> = (0..logical.len()).collect();
        axes.sort_by_key(|&a| std::cmp::Reverse(stride_order[a]));
        let ids: Vec<IterDomainId> = axes.iter().map(|&a| logical[a]).collect();
        let contiguity: Vec<Option<bool>> =
            ids.iter().map(|&id| (self.ids[id].iter_type != IterType::Broadcast).then_some(true)).collect();
        self.check_covers_logical(tv, &ids)?;
        Ok((ids, contiguity))
    }

    /// `ids` must be exactly a cut of `tv`'s transform graph over its logical domain.
    fn check_covers_logical(&self, tv: TvId, ids: &[IterDomainId]) -> Result<()> {
        let name = self.tv_name(tv);
        let known: Vec<IterDomainId> = {
            let mut v = self.tvs[tv].logical.clone();
            for t in self.transforms_of(tv) {
                v.extend(self.transforms[t].outputs());
            }
            v
        };
        for (i, id) in ids.iter().enumerate() {
            if !known.contains(id) {
                bail!("set_allocation_domain {name}: axis {i} ({}) is not an axis of {name}", self.id_label(*id));
            }
        }
        // Walk back to the logical domain, undoing a transform only when all its outputs are present.
        let mut set: Vec<IterDomainId> = ids.to_vec();
        loop {
            let mut changed = false;
            for t in self.transforms_of(tv).into_iter().rev() {
                let outs = self.transforms[t].outputs();
                if outs.iter().all(|o| set.contains(o)) {
                    set.retain(|x| !outs.contains(x));
                    set.extend(self.transforms[t].inputs());
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        for (axis, &l) in self.tvs[tv].logical.iter().enumerate() {
            let optional = self.ids[l].iter_type != IterType::Iteration;
            if !set.contains(&l) && !optional {
                bail!(
                    "set_allocation_domain {name}: logical axis {axis} ({}) is not covered by the allocation domain",
                    self.id_label(l)
                );
            }
        }
        if let Some(&extra) = set.iter().find(|x| !self.tvs[tv].logical.contains(x)) {
            bail!(
                "set_allocation_domain {name}: {} covers only part of a split axis; list both halves of a split",
                self.id_label(extra)
            );
        }
        Ok(())
    }

    /// Pipeline loads of `tv` over `stages` buffers, each iteration loading the data of the
    /// iteration `prefetch` ahead (default `stages - 1`); lowered by the circular-buffer pass.
    pub fn circular_buffer(&mut self, tv: TvId, stages: i64, prefetch: Option<i64>) -> Result<()> {
        let name = self.tv_name(tv);
        self.check_not_input(tv, "circular_buffer")?;
        if !(2..=32).contains(&stages) {
            bail!("circular_buffer {name}: stages must be between 2 and 32, got {stages}");
        }
        let prefetch = prefetch.unwrap_or(stages - 1);
        if !(1..stages).contains(&prefetch) {
            bail!(
                "circular_buffer {name}: prefetch must be at least 1 and below the {stages} stages (a stage is read while the next ones load), got {prefetch}"
            );
        }
        self.tvs[tv].circular_buffer =
            Some(crate::ir::CircularBuffer { stages: stages as u32, prefetch: prefetch as u32 });
        self.manually_scheduled = true;
        Ok(())
    }

    /// The fusion input that `tv`'s definition reads directly (a `cache_after` copy, an
    /// `index_select` or a remap of it), else an error naming `what` was asked.
    fn direct_input_read(&self, tv: TvId, what: &str) -> Result<TvId> {
        let name = self.tv_name(tv);
        let src = match self.tvs[tv].definition.map(|e| &self.exprs[e]) {
            Some(e) if matches!(e.op, Op::Set | Op::IndexSelect { .. } | Op::Remap { .. }) => e.inputs[0].tensor(),
            _ => None,
        };
        match src {
            Some(s) if self.is_input(s) => Ok(s),
            _ => bail!("{what} {name}: {name} does not read a fusion input directly; call it on the tensor that cache_after() returns for an input (or on an index_select of an input)"),
        }
    }

    /// Mark `tv`, which reads a fusion input directly (`cache_after`, `index_select`), as
    /// read once: its vector loads skip L1 allocation, so streaming data does not evict
    /// what other loads reuse.
    pub fn set_streaming_load(&mut self, tv: TvId) -> Result<()> {
        self.direct_input_read(tv, "set_streaming_load")?;
        self.tvs[tv].streaming_load = true;
        Ok(())
    }

    /// Mark `tv`, which reads a fusion input directly (`cache_after`, `index_select`), so
    /// that its vector loads keep their lines in L2 ahead of other data (evict_last).
    pub fn set_evict_last(&mut self, tv: TvId) -> Result<()> {
        self.direct_input_read(tv, "set_evict_last")?;
        self.tvs[tv].evict_last_load = true;
        Ok(())
    }

    /// Ask for the serial grid-reduction protocol on reduction output `tv`.
    pub fn set_serial_grid_reduction(&mut self, tv: TvId) -> Result<()> {
        let name = self.tv_name(tv);
        let is_reduction = matches!(self.tvs[tv].definition.map(|e| &self.exprs[e].op), Some(Op::Reduction { .. }));
        if !is_reduction {
            bail!("set_serial_grid_reduction {name}: {name} is not the output of a reduction");
        }
        self.tvs[tv].serial_grid_reduction = true;
        self.manually_scheduled = true;
        Ok(())
    }

    /// Launch the kernel's blocks in clusters of `size` along block dimension `pt` (sm_90+).
    /// The grid along `pt` must then be exactly `size` blocks, and reductions over `pt`
    /// become cluster reductions whose result every block holds.
    pub fn set_cluster(&mut self, pt: ParallelType, size: u32) -> Result<()> {
        if !pt.is_block() {
            bail!("set_cluster: {} is not a block dimension (expected BIDx, BIDy or BIDz)", pt.enum_name());
        }
        if !(2..=MAX_CLUSTER).contains(&size) {
            bail!("set_cluster: a cluster of {size} blocks along {}; expected 2 to {MAX_CLUSTER} (the portable cluster sizes)", pt.enum_name());
        }
        // One cluster shape per kernel: a second call along another dimension would drop the
        // first without a word (and the reductions clustered along it with it).
        if let Some((old_pt, old_size)) = self.cluster {
            if old_pt != pt {
                bail!(
                    "set_cluster: the fusion already has clusters of {old_size} blocks along {}; a kernel has clusters along one block dimension",
                    old_pt.enum_name()
                );
            }
        }
        self.cluster = Some((pt, size));
        self.manually_scheduled = true;
        Ok(())
    }

    /// Cast helper used by bindings: validates that a dtype name exists.
    pub fn parse_dtype(name: &str) -> Result<DataType> {
        match DataType::from_enum_name(name) {
            Some(d) => Ok(d),
            None => {
                let names: Vec<&str> = DataType::ALL.iter().map(|d| d.enum_name()).collect();
                bail_type!("unknown dtype {name:?}; expected one of {}", names.join(", "))
            }
        }
    }
}

#[cfg(test)]
mod tests;
