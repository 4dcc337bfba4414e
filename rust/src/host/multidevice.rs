//! Multi-device fusions: sharding propagation, decomposition into local fusions and
//! collectives, and the mesh program each rank runs.
//!
//! The definition is written on global shapes; each rank holds the local slice of every
//! sharded axis (`ir::mesh`). Propagation gives every tensor a *spread*: replicated,
//! sharded along one axis, or partial (a reduction over a sharded axis, whose ranks each
//! hold a part of the result). Where a reader needs another spread than its producer's,
//! a collective goes between them:
//! - a partial result becomes an `Allreduce` (replicated result) or, when the user shards
//!   the reduction's output, a `ReduceScatter` along that axis;
//! - a sharded tensor that an op must read whole (a gather, a reshape, a pad), or that the
//!   user declares replicated, becomes an `Allgather`;
//! - pointwise ops, broadcasts, permutes and reductions over unsharded axes need nothing.
//!
//! The local fusion (`MeshProgram::local`) computes on local extents: a sharded axis's
//! extent is its local size, every other use of a sharded extent (a mean's divisor, a
//! reshape's size) is the global size, `d` times the local one. Collectives cut it into
//! stages, each an ordinary fusion that the automatic schedulers and the segmenter lower
//! to kernels. NCCL's collectives concatenate along the first axis, so a gathered tensor
//! arrives as `[d, local...]` and a permute + reshape in the next stage puts the slices in
//! place (a free view when the axis is the first); a reduce-scatter's input is laid out
//! `[d, ...]` by the stage that computes it.

use std::fmt::Write as _;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::bail;
use crate::error::{KilnError, Result};
use crate::host::segment::{segment_fusion, Segment};
use crate::ir::scalar::{Symbol, Val};
use crate::ir::{DataType, ExprId, Fusion, IterDomainId, IterType, MemoryType, Op, Operand, ReductionOp, TvId, ValId};

/// How a tensor's values are spread over the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spread {
    /// Every rank holds all of it.
    Replicated,
    /// Rank `i` holds slice `i` of this axis (an index into the non-reduction logical domain).
    Sharded(usize),
    /// A reduction over a sharded axis: each rank holds the reduction of its slice.
    Partial(ReductionOp),
}

/// A collective of the host program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommKind {
    Allreduce,
    Allgather,
    ReduceScatter,
}

impl CommKind {
    /// The name the host program prints.
    pub fn name(self) -> &'static str {
        match self {
            CommKind::Allreduce => "Allreduce",
            CommKind::Allgather => "Allgather",
            CommKind::ReduceScatter => "ReduceScatter",
        }
    }
}

/// One collective: `output` is made from every rank's `input`.
#[derive(Clone, Debug)]
pub struct Communication {
    pub kind: CommKind,
    /// The combiner of Allreduce / ReduceScatter.
    pub op: Option<ReductionOp>,
    /// A tensor some stage computes (Allgather: the local slice; ReduceScatter: `[d, ...]`).
    pub input: TvId,
    /// Read by later stages or handed back (Allgather: `[d, local...]`).
    pub output: TvId,
    /// Allreduce runs in place: `output` is `input`'s buffer.
    pub in_place: bool,
    /// The user's tensor the collective produces and its axis (gathered or scattered;
    /// `usize::MAX` for an Allgather of partial results).
    pub of: TvId,
    pub axis: usize,
}

/// One local fusion of the mesh program; its tensors keep the local fusion's ids.
#[derive(Clone, Debug)]
pub struct Stage {
    pub fusion: Fusion,
    /// Tensor inputs in the stage fusion's order (its scalar inputs follow: the fusion's).
    pub inputs: Vec<TvId>,
    pub outputs: Vec<TvId>,
}

/// One step of a rank's host program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MeshInstr {
    /// Run stage `k`'s kernels (its own host program).
    RunStage(usize),
    /// Allocate a collective's output buffer.
    Allocate(TvId),
    /// Start collective `c` on the communication stream.
    Communication(usize),
    /// Make the compute stream wait for collective `c`.
    Wait(usize),
    /// Release a buffer after its last use.
    Deallocate(TvId),
}

/// A sharded fusion decomposed into local stages and collectives.
#[derive(Clone, Debug)]
pub struct MeshProgram {
    pub devices: Vec<i64>,
    /// The local fusion every stage is cut from (names, dtypes, extents).
    pub local: Fusion,
    pub stages: Vec<Stage>,
    pub comms: Vec<Communication>,
    pub instrs: Vec<MeshInstr>,
    /// The tensors handed back, in output order.
    pub outputs: Vec<TvId>,
    /// The spread of each tensor the definition made, for the dump.
    pub spreads: Vec<(TvId, Spread)>,
    /// The stages take the rank's position in the mesh as their last scalar input.
    pub takes_rank: bool,
}

/// Where an input axis of an expr lands in its output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mapped {
    /// The output's non-reduction axis.
    Axis(usize),
    /// Reduced by the expr.
    Reduced,
    /// The op reads the input whole (a gather, a remap): no output axis holds it.
    Lost,
}

fn map_axis(f: &Fusion, e: ExprId, input: TvId, axis: usize) -> Mapped {
    let expr = &f.exprs[e];
    let out = expr.output;
    let in_rank = f.no_reduction_logical(input).len();
    match &expr.op {
        op if op.is_elementwise() => {
            if f.no_reduction_logical(out).len() == in_rank {
                Mapped::Axis(axis)
            } else {
                Mapped::Lost
            }
        }
        Op::Reduction { .. } => {
            let logical = &f.tvs[out].logical;
            if logical.len() != in_rank {
                return Mapped::Lost;
            }
            if f.ids[logical[axis]].iter_type == IterType::Reduction {
                return Mapped::Reduced;
            }
            let before = logical[..axis].iter().filter(|&&id| f.ids[id].iter_type == IterType::Reduction).count();
            Mapped::Axis(axis - before)
        }
        Op::Broadcast { is_new } => {
            is_new.iter().enumerate().filter(|(_, &n)| !n).nth(axis).map_or(Mapped::Lost, |(p, _)| Mapped::Axis(p))
        }
        Op::Squeeze { removed } => {
            if removed.get(axis).copied().unwrap_or(true) {
                Mapped::Lost
            } else {
                Mapped::Axis(removed[..axis].iter().filter(|&&r| !r).count())
            }
        }
        Op::Permute { perm } => perm.iter().position(|&p| p == axis).map_or(Mapped::Lost, Mapped::Axis),
        _ => Mapped::Lost,
    }
}

/// What must happen after a tensor is computed so that its readers see the right spread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resolve {
    Allreduce(ReductionOp),
    ReduceScatter(ReductionOp, usize),
    Allgather(usize),
    /// Allgather the partial results, then reduce them on every rank.
    GatherReduce(ReductionOp),
    /// A tensor declared sharded on axis `to` that is not computed so: each rank keeps
    /// its slice along `to` of the whole value (made as [`Whole`] says), and its readers
    /// read that slice.
    Scatter(Whole, usize),
}

/// How a [`Resolve::Scatter`] gets the whole value it slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Whole {
    /// Computed whole on every rank already.
    Computed,
    /// Sharded along this axis: gathered.
    Gathered(usize),
    /// Partial results no collective combines: gathered and reduced on every rank.
    GatherReduced(ReductionOp),
}

/// The result of propagation over the user's fusion.
struct Propagation {
    produced: FxHashMap<TvId, Spread>,
    resolve: FxHashMap<TvId, Resolve>,
    /// Operand reads (expr, operand position) that need the operand gathered first.
    gathers: FxHashSet<(ExprId, usize)>,
    /// Replicated operand reads (expr, operand position) -> (operand axis, output axis):
    /// each rank reads its slice of the operand along that axis.
    slices: FxHashMap<(ExprId, usize), (usize, usize)>,
}

impl Propagation {
    /// The spread readers of `tv` see (after its collective, if any).
    fn reader(&self, tv: TvId) -> Spread {
        match self.resolve.get(&tv) {
            Some(Resolve::Allreduce(_) | Resolve::Allgather(_) | Resolve::GatherReduce(_)) => Spread::Replicated,
            Some(Resolve::ReduceScatter(_, k) | Resolve::Scatter(_, k)) => Spread::Sharded(*k),
            None => self.produced.get(&tv).copied().unwrap_or(Spread::Replicated),
        }
    }
}

/// The spread the user declared for `tv` (None: nothing declared), as a non-reduction axis.
fn declared(f: &Fusion, tv: TvId) -> Result<Option<Spread>> {
    let Some(m) = f.meshes.get(&tv) else { return Ok(None) };
    let Some(axis) = m.axis else { return Ok(Some(Spread::Replicated)) };
    let logical = &f.tvs[tv].logical;
    if f.ids[logical[axis]].iter_type == IterType::Reduction {
        bail!("{}: axis {axis} is reduced; a reduction's output can be sharded on a kept axis only", f.tv_name(tv));
    }
    let before = logical[..axis].iter().filter(|&&id| f.ids[id].iter_type == IterType::Reduction).count();
    Ok(Some(Spread::Sharded(axis - before)))
}

fn spread_text(f: &Fusion, tv: TvId, s: Spread) -> String {
    match s {
        Spread::Replicated => format!("{} (replicated)", f.tv_name(tv)),
        Spread::Sharded(a) => format!("{} (axis {a} sharded over DIDx)", f.tv_name(tv)),
        Spread::Partial(_) => format!("{} (partial over the mesh)", f.tv_name(tv)),
    }
}

fn propagate(f: &Fusion, order: &[ExprId]) -> Result<Propagation> {
    let mut p = Propagation {
        produced: FxHashMap::default(),
        resolve: FxHashMap::default(),
        gathers: FxHashSet::default(),
        slices: FxHashMap::default(),
    };
    for t in tensor_inputs(f) {
        p.produced.insert(t, declared(f, t)?.unwrap_or(Spread::Replicated));
    }
    for &e in order {
        let expr = &f.exprs[e];
        let out = expr.output;
        let oname = f.tv_name(out);
        let mut target: Option<(Mapped, TvId)> = None;
        let mut reads: Vec<(usize, TvId, Spread)> = Vec::new();
        for (pos, o) in expr.inputs.iter().enumerate() {
            let Operand::Tensor(t) = *o else { continue };
            let s = p.reader(t);
            reads.push((pos, t, s));
        }
        for &(pos, t, s) in &reads {
            let Spread::Sharded(a) = s else { continue };
            match map_axis(f, e, t, a) {
                Mapped::Lost => {
                    p.gathers.insert((e, pos));
                }
                m => {
                    if let Some((prev, pt)) = target {
                        if prev != m {
                            bail!(
                                "{oname}: its inputs are sharded differently: {} and {} (no collective reconciles two sharded axes of one op; give them the same sharding)",
                                spread_text(f, pt, p.reader(pt)),
                                spread_text(f, t, s)
                            );
                        }
                    } else {
                        target = Some((m, t));
                    }
                }
            }
        }
        if let Some((Mapped::Axis(b), _)) = target {
            // Replicated operands that hold the output's sharded axis whole.
            for &(pos, t, s) in &reads {
                if matches!(s, Spread::Sharded(_)) && !p.gathers.contains(&(e, pos)) {
                    continue;
                }
                let ids = f.no_reduction_logical(t);
                for (j, &id) in ids.iter().enumerate() {
                    if f.ids[id].iter_type != IterType::Broadcast && map_axis(f, e, t, j) == Mapped::Axis(b) {
                        // A constant (a `full`, and what pointwise ops make of it alone) is
                        // the same on every slice: each device makes its slice.
                        if s == Spread::Replicated && shard_uniform(f, &mut p, t, j) {
                            continue;
                        }
                        // A whole tensor read beside a sharded one: each rank reads its own
                        // slice of it (the offset is the rank's), no collective needed.
                        p.slices.insert((e, pos), (j, b));
                        break;
                    }
                }
            }
        }
        let produced = match (target.map(|t| t.0), &expr.op) {
            (Some(Mapped::Reduced), Op::Reduction { op, .. }) => Spread::Partial(*op),
            (Some(Mapped::Axis(b)), _) => Spread::Sharded(b),
            _ => Spread::Replicated,
        };
        if expr.op.reads_position() && produced != Spread::Replicated {
            bail!("{oname}: iota and random numbers cannot be sharded (their values depend on the global position)");
        }
        p.produced.insert(out, produced);
        let decl = declared(f, out)?;
        let resolve = match (produced, decl) {
            // No NCCL collective combines log-sum-exps: the ranks' partial results are
            // gathered and each rank reduces them.
            (Spread::Partial(op), None | Some(Spread::Replicated)) if op.is_log_sum_exp() => {
                Some(Resolve::GatherReduce(op))
            }
            (Spread::Partial(op), Some(Spread::Sharded(k))) if op.is_log_sum_exp() => {
                Some(Resolve::Scatter(Whole::GatherReduced(op), k))
            }
            (Spread::Partial(op), None | Some(Spread::Replicated)) => Some(Resolve::Allreduce(op)),
            (Spread::Partial(op), Some(Spread::Sharded(k))) => Some(Resolve::ReduceScatter(op, k)),
            (Spread::Sharded(b), Some(Spread::Replicated)) => Some(Resolve::Allgather(b)),
            // Moving a sharding to another axis: gather, then each rank keeps its slice.
            (Spread::Sharded(b), Some(Spread::Sharded(k))) if b != k => Some(Resolve::Scatter(Whole::Gathered(b), k)),
            // Computed whole on every rank (a mean's division after its allreduce, a
            // function of replicated inputs): each rank keeps its slice, no collective.
            (Spread::Replicated, Some(Spread::Sharded(k))) => Some(Resolve::Scatter(Whole::Computed, k)),
            _ => None,
        };
        if let Some(r) = resolve {
            p.resolve.insert(out, r);
        }
    }
    Ok(p)
}

/// Shard `t` along `axis` if it holds one value everywhere (made from `full` alone by
/// pointwise ops and broadcasts, each read once, none handed back or resolved by a
/// collective).
fn shard_uniform(f: &Fusion, p: &mut Propagation, t: TvId, axis: usize) -> bool {
    let mut marks = Vec::new();
    if !uniform(f, p, t, axis, &mut marks) {
        return false;
    }
    for (x, a) in marks {
        p.produced.insert(x, Spread::Sharded(a));
    }
    true
}

/// True when `t` is uniform along `axis` (see [`shard_uniform`]); `marks` collects the
/// tensors to shard and their axes.
fn uniform(f: &Fusion, p: &Propagation, t: TvId, axis: usize, marks: &mut Vec<(TvId, usize)>) -> bool {
    let Some(e) = f.tvs[t].definition else { return false };
    // Another reader may need it whole (a reduction over that axis, read earlier): only a
    // tensor read once, by the chain being sharded, is made slice by slice.
    if f.is_output(t) || p.resolve.contains_key(&t) || f.tvs[t].uses.len() != 1 {
        return false;
    }
    let expr = &f.exprs[e];
    let ok = match &expr.op {
        Op::Full { .. } => true,
        op if op.is_elementwise() || matches!(op, Op::Broadcast { .. }) => expr.input_tvs().all(|x| {
            let ids = f.no_reduction_logical(x);
            match (0..ids.len()).find(|&j| map_axis(f, e, x, j) == Mapped::Axis(axis)) {
                Some(j) => f.ids[ids[j]].iter_type == IterType::Broadcast || uniform(f, p, x, j, marks),
                None => true,
            }
        }),
        _ => false,
    };
    if ok {
        marks.push((t, axis));
    }
    ok
}

/// Rewrites every scalar of `g` to the local fusion's meaning: ids in `sharded` get their
/// local extent, every other use of a sharded input's extent symbol its global size.
fn localize_extents(g: &mut Fusion, symbols: &FxHashSet<u32>, sharded: &FxHashSet<IterDomainId>, d: i64) {
    let dv = g.scalars.int(d);
    let mut memo: FxHashMap<ValId, ValId> = FxHashMap::default();
    let mut glob = |g: &mut Fusion, v: ValId| -> ValId {
        if let Some(&r) = memo.get(&v) {
            return r;
        }
        let mut r = v;
        for &n in symbols {
            let Some(sym) = g.scalars.symbol_id(Symbol::Extent(n)) else { continue };
            let by = g.scalars.mul(sym, dv);
            r = g.scalars.substitute(r, Symbol::Extent(n), by);
        }
        memo.insert(v, r);
        r
    };
    let ids: Vec<IterDomainId> = g.ids.keys().collect();
    for id in ids {
        let ext = g.ids[id].extent;
        let new = if sharded.contains(&id) {
            match g.scalars.get(ext) {
                Val::Symbol(Symbol::Extent(n)) if symbols.contains(&n) => ext,
                _ => {
                    let gl = glob(g, ext);
                    g.scalars.div(gl, dv)
                }
            }
        } else {
            glob(g, ext)
        };
        g.ids[id].extent = new;
    }
    let exprs: Vec<ExprId> = g.exprs.keys().collect();
    for e in exprs {
        let mut op = g.exprs[e].op.clone();
        match &mut op {
            Op::Reduction { init, .. } => *init = glob(g, *init),
            Op::Full { value } => *value = glob(g, *value),
            Op::Iota { start, step } => {
                *start = glob(g, *start);
                *step = glob(g, *step);
            }
            Op::Random { a, b, seed, offset, .. } => {
                *a = glob(g, *a);
                *b = glob(g, *b);
                *seed = glob(g, *seed);
                *offset = glob(g, *offset);
            }
            Op::Remap { index, valid, .. } => {
                for v in index.iter_mut() {
                    *v = glob(g, *v);
                }
                if let Some(v) = valid {
                    *v = glob(g, *v);
                }
            }
            Op::Mask { valid } => *valid = glob(g, *valid),
            _ => {}
        }
        g.exprs[e].op = op;
        let inputs = g.exprs[e].inputs.clone();
        for (k, o) in inputs.iter().enumerate() {
            if let Operand::Scalar(v) = *o {
                let nv = glob(g, v);
                g.exprs[e].inputs[k] = Operand::Scalar(nv);
            }
        }
    }
    let views = std::mem::take(&mut g.output_views);
    g.output_views = views.into_iter().map(|(t, vs)| (t, vs.into_iter().map(|v| glob(g, v)).collect())).collect();
    let mut checks = std::mem::take(&mut g.size_checks);
    for c in checks.iter_mut() {
        c.holds = glob(g, c.holds);
        for v in c.values.iter_mut() {
            *v = glob(g, *v);
        }
    }
    g.size_checks = checks;
}

/// A tensor with no definition (a collective's output) of these extents and iter types.
fn free_tensor(g: &mut Fusion, like: TvId, extents: &[(ValId, IterType)]) -> TvId {
    let logical: Vec<IterDomainId> = extents.iter().map(|&(e, it)| g.new_id(e, it)).collect();
    let dt = g.tvs[like].dtype;
    let t = g.new_tv(dt, MemoryType::Global, logical);
    g.note_stand_in(t, like);
    t
}

fn extents_of(g: &Fusion, tv: TvId) -> Vec<(ValId, IterType)> {
    g.no_reduction_logical(tv)
        .iter()
        .map(|&id| {
            let it = match g.ids[id].iter_type {
                IterType::Reduction => IterType::Iteration,
                x => x,
            };
            (g.ids[id].extent, it)
        })
        .collect()
}

/// Reroute operand `pos` of `e` to `to`.
fn reroute(g: &mut Fusion, e: ExprId, pos: usize, to: TvId) {
    let Operand::Tensor(from) = g.exprs[e].inputs[pos] else { return };
    if from == to {
        return;
    }
    g.exprs[e].inputs[pos] = Operand::Tensor(to);
    if !g.exprs[e].input_tvs().any(|t| t == from) {
        g.tvs[from].uses.retain(|&u| u != e);
    }
    if !g.tvs[to].uses.contains(&e) {
        g.tvs[to].uses.push(e);
    }
}

/// Decompose a sharded fusion into local stages and collectives.
pub fn decompose(f: &Fusion) -> Result<MeshProgram> {
    let mut meshed: Vec<(&TvId, &crate::ir::mesh::TvMesh)> = f.meshes.iter().collect();
    meshed.sort_by_key(|(t, _)| **t);
    let Some(&(first, m0)) = meshed.first() else {
        crate::bail_internal!("decompose: the fusion has no device mesh");
    };
    let devices = m0.devices.clone();
    for (t, m) in &meshed {
        if m.devices != devices {
            bail!(
                "{} is on mesh {:?} and {} on mesh {devices:?}; a fusion runs on one mesh",
                f.tv_name(**t),
                m.devices,
                f.tv_name(*first)
            );
        }
        if let Some((_, axis)) = m.pending {
            bail!(
                "{}: logical axis {axis} was split by the mesh size but its outer part was not parallelized over DIDx",
                f.tv_name(**t)
            );
        }
    }
    if f.manually_scheduled {
        bail!("a sharded fusion is scheduled automatically (per stage); it cannot also be scheduled by hand");
    }
    let d = devices.len() as i64;
    let order = f.topo_exprs();
    let prop = propagate(f, &order)?;

    let mut g = f.clone();
    g.meshes.clear();
    if g.user_tvs == 0 {
        g.user_tvs = g.tvs.len();
    }
    // The mesh splits were annotations: every tensor's loop domain is its logical domain.
    let tvs: Vec<TvId> = g.tvs.keys().collect();
    for &t in &tvs {
        let logical = g.tvs[t].logical.clone();
        for &id in &logical {
            g.ids[id].use_ = None;
        }
        g.tvs[t].loop_domain = logical;
    }
    // Sharded symbols: extents of the inputs' sharded axes (bound to local sizes).
    let mut symbols: FxHashSet<u32> = FxHashSet::default();
    let mut sharded_ids: FxHashSet<IterDomainId> = FxHashSet::default();
    for (&t, &s) in &prop.produced {
        let axis = match s {
            Spread::Sharded(a) => g.no_reduction_logical(t).get(a).copied(),
            Spread::Partial(_) => None,
            Spread::Replicated => None,
        };
        if let Some(id) = axis {
            sharded_ids.insert(id);
            if f.is_input(t) {
                if let Val::Symbol(Symbol::Extent(n)) = g.scalars.get(g.ids[id].extent) {
                    symbols.insert(n);
                }
            }
        }
        if let Spread::Partial(_) = s {
            // The reduced axis that was sharded iterates over the local slice.
            if let Some(e) = g.tvs[t].definition {
                if let Some(x) = g.exprs[e].input_tvs().next() {
                    if let Spread::Sharded(a) = prop.reader(x) {
                        if let Some(&id) = g.tvs[t].logical.get(a) {
                            sharded_ids.insert(id);
                        }
                    }
                }
            }
        }
    }
    for (&t, &s) in &prop.produced {
        if let (true, Spread::Sharded(a)) = (f.is_input(t), s) {
            let id = g.no_reduction_logical(t)[a];
            if let Some(c) = g.scalars.as_int(g.ids[id].extent) {
                if c % d != 0 {
                    bail!(
                        "{}: axis {a} has {c} elements, which do not split evenly over the {d} devices of mesh {devices:?}",
                        f.tv_name(t)
                    );
                }
            }
        }
    }
    localize_extents(&mut g, &symbols, &sharded_ids, d);
    let dv = g.scalars.int(d);

    // Materialize the collectives and reroute readers.
    let mut comms: Vec<Communication> = Vec::new();
    let mut replaced: FxHashMap<TvId, TvId> = FxHashMap::default();
    let mut gathered: FxHashMap<TvId, TvId> = FxHashMap::default();
    // The rank's position in the mesh, a scalar input the executor appends (only when some
    // replicated tensor is read slice by slice).
    let mut rank: Option<ValId> = None;
    let mut sliced: FxHashMap<(TvId, usize, ValId), TvId> = FxHashMap::default();
    let gather = |g: &mut Fusion, comms: &mut Vec<Communication>, x: TvId, a: usize, of: TvId| -> Result<TvId> {
        let mut ext = vec![(dv, IterType::Iteration)];
        ext.extend(extents_of(g, x));
        let xg = free_tensor(g, of, &ext);
        comms.push(Communication {
            kind: CommKind::Allgather,
            op: None,
            input: x,
            output: xg,
            in_place: false,
            of,
            axis: a,
        });
        let rank = ext.len() - 1;
        let moved = if a == 0 {
            xg
        } else {
            let mut dims: Vec<i64> = (1..=a as i64).collect();
            dims.push(0);
            dims.extend((a as i64 + 1)..=(rank as i64));
            let p = g.permute(xg, &dims)?;
            g.note_stand_in(p, of);
            p
        };
        let mut shape: Vec<Option<ValId>> = extents_of(g, x).iter().map(|&(e, _)| Some(e)).collect();
        shape[a] = Some(g.scalars.mul(ext[a + 1].0, dv));
        let r = g.reshape(moved, &shape)?;
        g.note_stand_in(r, of);
        Ok(r)
    };
    for &e in &order {
        // Readers first: operands that must be read whole.
        let inputs = g.exprs[e].inputs.clone();
        for (pos, o) in inputs.iter().enumerate() {
            let Operand::Tensor(t) = *o else { continue };
            let src = replaced.get(&t).copied().unwrap_or(t);
            let to = if let Some(&(j, b)) = prop.slices.get(&(e, pos)) {
                let out_id = g.no_reduction_logical(g.exprs[e].output)[b];
                let local = g.ids[out_id].extent;
                let key = (src, j, local);
                if let Some(&x) = sliced.get(&key) {
                    x
                } else {
                    let r = *rank.get_or_insert_with(|| g.define_scalar_input(DataType::Int));
                    let what = format!(
                        "{} is whole on every device and read beside a sharded axis: its axis {j} must hold the mesh's slices exactly (size = devices x local slice)",
                        g.user_tv_name(t)
                    );
                    let x = local_slice(&mut g, src, j, local, r, dv, t, what)?;
                    sliced.insert(key, x);
                    x
                }
            } else if prop.gathers.contains(&(e, pos)) {
                if let Some(&x) = gathered.get(&src) {
                    x
                } else {
                    let Spread::Sharded(a) = prop.reader(t) else {
                        crate::bail_internal!("gather of {} which is not sharded", g.tv_name(t));
                    };
                    let x = gather(&mut g, &mut comms, src, a, t)?;
                    gathered.insert(src, x);
                    x
                }
            } else {
                src
            };
            reroute(&mut g, e, pos, to);
        }
        let out = g.exprs[e].output;
        match prop.resolve.get(&out) {
            None => {}
            Some(&Resolve::Allreduce(op)) => {
                let ext = extents_of(&g, out);
                let full = free_tensor(&mut g, out, &ext);
                comms.push(Communication {
                    kind: CommKind::Allreduce,
                    op: Some(op),
                    input: out,
                    output: full,
                    in_place: true,
                    of: out,
                    axis: 0,
                });
                replaced.insert(out, full);
            }
            Some(&Resolve::GatherReduce(op)) => {
                let r = gather_reduce(&mut g, &mut comms, out, op, dv)?;
                replaced.insert(out, r);
            }
            Some(&Resolve::Allgather(a)) => {
                let r = gather(&mut g, &mut comms, out, a, out)?;
                replaced.insert(out, r);
            }
            Some(&Resolve::ReduceScatter(op, k)) => {
                let ext = extents_of(&g, out);
                let part = g.scalars.div(ext[k].0, dv);
                let mut shape: Vec<Option<ValId>> = Vec::with_capacity(ext.len() + 1);
                for (j, &(x, _)) in ext.iter().enumerate() {
                    if j == k {
                        shape.push(Some(dv));
                        shape.push(Some(part));
                    } else {
                        shape.push(Some(x));
                    }
                }
                let split = g.reshape(out, &shape)?;
                g.note_stand_in(split, out);
                let staged = if k == 0 {
                    split
                } else {
                    let mut dims: Vec<i64> = vec![k as i64];
                    dims.extend((0..=ext.len() as i64).filter(|&j| j != k as i64));
                    let p = g.permute(split, &dims)?;
                    g.note_stand_in(p, out);
                    p
                };
                let mut oext = ext.clone();
                oext[k].0 = part;
                let local = free_tensor(&mut g, out, &oext);
                comms.push(Communication {
                    kind: CommKind::ReduceScatter,
                    op: Some(op),
                    input: staged,
                    output: local,
                    in_place: false,
                    of: out,
                    axis: k,
                });
                replaced.insert(out, local);
            }
            Some(&Resolve::Scatter(from, k)) => {
                let whole = match from {
                    Whole::Gathered(b) => gather(&mut g, &mut comms, out, b, out)?,
                    Whole::GatherReduced(op) => gather_reduce(&mut g, &mut comms, out, op, dv)?,
                    Whole::Computed => out,
                };
                let ext = extents_of(&g, whole);
                let local = g.scalars.div(ext[k].0, dv);
                let r = *rank.get_or_insert_with(|| g.define_scalar_input(DataType::Int));
                let what = format!(
                    "{} is declared sharded on axis {k}: that axis must split evenly over the {d} devices of the mesh",
                    g.user_tv_name(out)
                );
                let x = local_slice(&mut g, whole, k, local, r, dv, out, what)?;
                replaced.insert(out, x);
            }
        }
    }
    let outputs: Vec<TvId> = f.outputs.iter().map(|o| replaced.get(o).copied().unwrap_or(*o)).collect();
    for (o, _) in g.aliases.iter_mut() {
        if let Some(&r) = replaced.get(o) {
            *o = r;
        }
    }
    g.outputs = outputs.clone();
    let mut spreads: Vec<(TvId, Spread)> = prop.produced.iter().map(|(&t, &s)| (t, s)).collect();
    spreads.sort_by_key(|(t, _)| *t);
    let mut p = build_program(g, devices, comms, outputs, spreads)?;
    p.takes_rank = rank.is_some();
    Ok(p)
}

/// Every rank's partial results of `out` gathered along a new first axis and reduced by
/// `op` on every rank (for reductions no NCCL collective combines).
fn gather_reduce(
    g: &mut Fusion,
    comms: &mut Vec<Communication>,
    out: TvId,
    op: ReductionOp,
    dv: ValId,
) -> Result<TvId> {
    let mut ext = vec![(dv, IterType::Iteration)];
    ext.extend(extents_of(g, out));
    let parts = free_tensor(g, out, &ext);
    comms.push(Communication {
        kind: CommKind::Allgather,
        op: None,
        input: out,
        output: parts,
        in_place: false,
        of: out,
        axis: usize::MAX,
    });
    let r = g.reduction(op, parts, &[0], false, None)?;
    g.note_stand_in(r, out);
    Ok(r)
}

/// Rank `rank`'s slice along axis `j` of the whole tensor `t`: `local` elements from
/// `rank * local`, with a check that the mesh's slices cover the axis exactly.
#[allow(clippy::too_many_arguments)]
fn local_slice(
    g: &mut Fusion,
    t: TvId,
    j: usize,
    local: ValId,
    rank: ValId,
    dv: ValId,
    of: TvId,
    what: String,
) -> Result<TvId> {
    let ext: Vec<ValId> = g.no_reduction_logical(t).iter().map(|&id| g.ids[id].extent).collect();
    let start = g.scalars.mul(rank, local);
    let mut index = Vec::with_capacity(ext.len());
    let mut extents = ext.clone();
    for k in 0..ext.len() {
        let o = g.scalars.symbol(Symbol::OutAxis(k as u32));
        index.push(if k == j { g.scalars.add(o, start) } else { o });
    }
    extents[j] = local;
    let whole = g.scalars.mul(local, dv);
    let holds = g.scalars.binary(crate::ir::scalar::ScalarOp::Eq, whole, ext[j]);
    g.size_checks.push(crate::ir::shape_ops::SizeCheck { holds, values: vec![ext[j], local], what });
    let x = g.remap(t, "slice", &extents, index, None)?;
    g.note_stand_in(x, of);
    Ok(x)
}

/// Cut the local fusion into stages around its collectives, and order the host program.
fn build_program(
    g: Fusion,
    devices: Vec<i64>,
    comms: Vec<Communication>,
    outputs: Vec<TvId>,
    spreads: Vec<(TvId, Spread)>,
) -> Result<MeshProgram> {
    let comm_of_output: FxHashMap<TvId, usize> = comms.iter().enumerate().map(|(c, x)| (x.output, c)).collect();
    // Live exprs in an order where producers come first, a collective's input before
    // the readers of its output.
    let mut roots: Vec<TvId> = outputs.clone();
    roots.extend(g.aliases.iter().map(|(o, _)| *o));
    let mut order: Vec<ExprId> = Vec::new();
    let mut visited: FxHashSet<ExprId> = FxHashSet::default();
    let mut stack: Vec<(TvId, bool)> = roots.iter().rev().map(|&t| (t, false)).collect();
    let mut done_tv: FxHashSet<TvId> = FxHashSet::default();
    while let Some((t, expanded)) = stack.pop() {
        if expanded {
            if let Some(e) = g.tvs[t].definition {
                if visited.insert(e) {
                    order.push(e);
                }
            }
            continue;
        }
        if !done_tv.insert(t) {
            continue;
        }
        stack.push((t, true));
        if let Some(&c) = comm_of_output.get(&t) {
            stack.push((comms[c].input, false));
        } else if let Some(e) = g.tvs[t].definition {
            for x in g.exprs[e].input_tvs().collect::<Vec<_>>().into_iter().rev() {
                stack.push((x, false));
            }
        }
    }
    let mut level: FxHashMap<TvId, usize> = FxHashMap::default();
    let tv_level = |level: &FxHashMap<TvId, usize>, t: TvId| level.get(&t).copied().unwrap_or(0);
    let mut expr_level: FxHashMap<ExprId, usize> = FxHashMap::default();
    // Collectives' outputs are one level above their inputs; order guarantees inputs first.
    for &e in &order {
        let l = g.exprs[e]
            .input_tvs()
            .map(|t| match comm_of_output.get(&t) {
                Some(&c) => tv_level(&level, comms[c].input) + 1,
                None => tv_level(&level, t),
            })
            .max()
            .unwrap_or(0);
        expr_level.insert(e, l);
        level.insert(g.exprs[e].output, l);
    }
    for c in &comms {
        let l = tv_level(&level, c.input) + 1;
        level.insert(c.output, l);
    }
    let in_order: FxHashMap<ExprId, usize> = order.iter().enumerate().map(|(i, &e)| (e, i)).collect();
    let comm_inputs: FxHashSet<TvId> = comms.iter().map(|c| c.input).collect();
    // Slots: `2l` runs before level `l`'s collectives are issued, `2l + 1` after them
    // (overlapping them). An expr runs as late as its readers allow, so that cheap work
    // (a weight's broadcast) joins the kernel that reads it instead of being written out
    // early; an expr that feeds a collective runs before it; a tensor only handed back
    // runs right after the collectives of its level, overlapping them.
    // A cheap pointwise expr read in several slots is recomputed in each (its inputs are
    // there too) rather than written out by the first and read back by the others.
    let cheap = |e: ExprId| {
        let op = &g.exprs[e].op;
        (op.is_elementwise() || matches!(op, Op::Broadcast { .. } | Op::Squeeze { .. } | Op::Full { .. }))
            && !outputs.contains(&g.exprs[e].output)
    };
    let mut slots: FxHashMap<ExprId, Vec<usize>> = FxHashMap::default();
    for &e in order.iter().rev() {
        let out = g.exprs[e].output;
        let l = expr_level[&e];
        let mut readers: Vec<usize> = Vec::new();
        for u in &g.tvs[out].uses {
            if let Some(su) = slots.get(u) {
                readers.extend(su);
            }
        }
        readers.sort_unstable();
        readers.dedup();
        let mine: Vec<usize> = if comm_inputs.contains(&out) {
            vec![2 * l]
        } else if readers.is_empty() {
            vec![2 * l + 1]
        } else if cheap(e) {
            readers.iter().map(|&s| s.max(2 * l)).collect()
        } else {
            vec![readers[0].max(2 * l)]
        };
        slots.insert(e, mine);
    }
    let issue_levels: std::collections::BTreeSet<usize> = comms.iter().map(|c| tv_level(&level, c.input)).collect();
    let last_slot = slots
        .values()
        .flatten()
        .copied()
        .max()
        .unwrap_or(0)
        .max(issue_levels.iter().map(|&l| 2 * l).max().unwrap_or(0));
    // Group slots into stages: a stage ends where collectives are issued after it, or
    // waited for before the next.
    let mut stage_of_slot: Vec<usize> = Vec::with_capacity(last_slot + 1);
    let mut k = 0;
    for sl in 0..=last_slot {
        stage_of_slot.push(k);
        if issue_levels.contains(&(sl / 2)) {
            k += 1;
        }
    }
    let mut members: Vec<Vec<ExprId>> = vec![Vec::new(); k + 1];
    for &e in &order {
        let mut ks: Vec<usize> = slots[&e].iter().map(|&sl| stage_of_slot[sl]).collect();
        ks.dedup();
        for kk in ks {
            if !members[kk].contains(&e) {
                members[kk].push(e);
            }
        }
    }
    let member_sets: Vec<FxHashSet<ExprId>> = members.iter().map(|m| m.iter().copied().collect()).collect();
    let mut stages: Vec<Stage> = Vec::new();
    let mut instrs: Vec<MeshInstr> = Vec::new();
    for (sk, part) in members.iter().enumerate() {
        if !part.is_empty() {
            // Read elsewhere: by a live expr of another stage that does not compute it too.
            let read_elsewhere = |t: TvId| -> bool {
                let Some(def) = g.tvs[t].definition else { return false };
                g.tvs[t].uses.iter().any(|u| {
                    in_order.contains_key(u)
                        && (0..member_sets.len())
                            .any(|o| o != sk && member_sets[o].contains(u) && !member_sets[o].contains(&def))
                })
            };
            let idx = stages.len();
            let stage = make_stage(&g, part, &outputs, &comm_inputs, &read_elsewhere)?;
            // Wait for the collectives whose outputs this stage reads.
            for &t in &stage.inputs {
                if let Some(&c) = comm_of_output.get(&t) {
                    if !instrs.contains(&MeshInstr::Wait(c)) {
                        instrs.push(MeshInstr::Wait(c));
                    }
                }
            }
            stages.push(stage);
            instrs.push(MeshInstr::RunStage(idx));
        }
        // The collectives issued after this stage: those of the level whose slot ends it.
        let ends: Vec<usize> = (0..=last_slot).filter(|&sl| stage_of_slot[sl] == sk).collect();
        if let Some(&end) = ends.last() {
            if end % 2 == 0 && issue_levels.contains(&(end / 2)) {
                for c in (0..comms.len()).filter(|&c| tv_level(&level, comms[c].input) == end / 2) {
                    if !comms[c].in_place {
                        instrs.push(MeshInstr::Allocate(comms[c].output));
                    }
                    instrs.push(MeshInstr::Communication(c));
                }
            }
        }
    }
    for c in 0..comms.len() {
        if !instrs.contains(&MeshInstr::Wait(c)) {
            instrs.push(MeshInstr::Wait(c));
        }
    }
    let instrs = with_deallocates(&g, &stages, &comms, &outputs, instrs);
    Ok(MeshProgram { devices, local: g, stages, comms, instrs, outputs, spreads, takes_rank: false })
}

/// One stage: the exprs `part` of `g` as a fusion of their own.
fn make_stage(
    g: &Fusion,
    part: &[ExprId],
    outputs: &[TvId],
    comm_inputs: &FxHashSet<TvId>,
    read_elsewhere: &dyn Fn(TvId) -> bool,
) -> Result<Stage> {
    let produced: FxHashSet<TvId> = part.iter().map(|&e| g.exprs[e].output).collect();
    let mut ins: Vec<TvId> = Vec::new();
    for &e in part {
        for t in g.exprs[e].input_tvs() {
            if !produced.contains(&t) && !ins.contains(&t) {
                ins.push(t);
            }
        }
    }
    // Every input of the definition, read or not: each carries extents some stage may
    // compute with (a mean's divisor, a gathered tensor's size), and binding the stage
    // from them checks them before any stage runs.
    let mut inputs: Vec<TvId> = tensor_inputs(g).collect();
    inputs.extend(ins.iter().copied().filter(|t| !g.is_input(*t)));
    let mut outs: Vec<TvId> = outputs.iter().copied().filter(|t| produced.contains(t)).collect();
    outs.dedup();
    for &e in part {
        let t = g.exprs[e].output;
        if outs.contains(&t) {
            continue;
        }
        if comm_inputs.contains(&t) || read_elsewhere(t) || g.aliases.iter().any(|(o, _)| *o == t) {
            outs.push(t);
        }
    }
    let seg = Segment { exprs: part.to_vec(), inputs, outputs: outs };
    let mut fusion = segment_fusion(g, &seg);
    fusion.aliases.retain(|(o, _)| seg.outputs.contains(o));
    Ok(Stage { fusion, inputs: seg.inputs, outputs: seg.outputs })
}

/// `instrs` with a Deallocate after the last use of every buffer the program made (stage
/// outputs it does not hand back, collective buffers). A collective uses its buffers until
/// its Wait.
fn with_deallocates(
    g: &Fusion,
    stages: &[Stage],
    comms: &[Communication],
    outputs: &[TvId],
    instrs: Vec<MeshInstr>,
) -> Vec<MeshInstr> {
    let mut last: FxHashMap<TvId, usize> = FxHashMap::default();
    for (i, ins) in instrs.iter().enumerate() {
        let used: Vec<TvId> = match *ins {
            MeshInstr::RunStage(k) => stages[k].inputs.iter().chain(&stages[k].outputs).copied().collect(),
            MeshInstr::Communication(c) | MeshInstr::Wait(c) => vec![comms[c].input, comms[c].output],
            MeshInstr::Allocate(t) => vec![t],
            MeshInstr::Deallocate(_) => vec![],
        };
        for t in used {
            last.insert(t, i);
        }
    }
    let keep = |t: TvId| g.is_input(t) || outputs.contains(&t) || g.aliases.iter().any(|(o, _)| *o == t);
    let mut frees: Vec<Vec<TvId>> = vec![Vec::new(); instrs.len()];
    let mut ts: Vec<(TvId, usize)> = last.into_iter().filter(|(t, _)| !keep(*t)).collect();
    ts.sort();
    for (t, i) in ts {
        frees[i].push(t);
    }
    let mut out = Vec::with_capacity(instrs.len() * 2);
    for (ins, fr) in instrs.into_iter().zip(frees) {
        out.push(ins);
        out.extend(fr.into_iter().map(MeshInstr::Deallocate));
    }
    out
}

impl MeshProgram {
    fn reduction_name(op: ReductionOp) -> &'static str {
        match op {
            ReductionOp::Sum => "sum",
            ReductionOp::Max => "max",
            ReductionOp::Min => "min",
            ReductionOp::Prod => "prod",
            ReductionOp::LogSumExp => "logsumexp",
            ReductionOp::LogSumExpFloored => "logsumexp_floored",
        }
    }

    /// The line of a collective (`Allreduce T5 -> T6 over mesh [0, 1] (sum, in place)`).
    pub fn comm_text(&self, c: usize) -> String {
        let x = &self.comms[c];
        let g = &self.local;
        let mut notes: Vec<String> = Vec::new();
        if let Some(op) = x.op {
            notes.push(Self::reduction_name(op).to_string());
        }
        match x.kind {
            CommKind::Allgather if x.axis == usize::MAX => {
                notes.push(format!("partial results of {}, reduced on every rank", g.user_tv_name(x.of)))
            }
            CommKind::Allgather => notes.push(format!("axis {} of {}", x.axis, g.user_tv_name(x.of))),
            CommKind::ReduceScatter => notes.push(format!("scatters axis {} of {}", x.axis, g.user_tv_name(x.of))),
            CommKind::Allreduce => {}
        }
        if x.in_place {
            notes.push("in place".into());
        }
        format!(
            "{} {} -> {} over mesh {:?} ({})",
            x.kind.name(),
            g.tv_name(x.input),
            g.tv_name(x.output),
            self.devices,
            notes.join(", ")
        )
    }

    /// Readable program; `stage_texts[k]` is stage `k`'s host program (indented here).
    pub fn to_text(&self, stage_texts: &[String]) -> String {
        let g = &self.local;
        let names = |ts: &[TvId]| ts.iter().map(|&t| g.tv_name(t)).collect::<Vec<_>>().join(", ");
        let ins: Vec<TvId> = tensor_inputs(g).collect();
        let mut s = String::new();
        let _ = writeln!(
            s,
            "MeshProgram({}) -> ({}) over mesh {:?}: {} stage(s), {} communication(s)",
            names(&ins),
            names(&self.outputs),
            self.devices,
            self.stages.len(),
            self.comms.len()
        );
        for ins in &self.instrs {
            match *ins {
                MeshInstr::RunStage(k) => {
                    let st = &self.stages[k];
                    let _ = writeln!(s, "  Stage {k}({}) -> ({}):", names(&st.inputs), names(&st.outputs));
                    if let Some(t) = stage_texts.get(k) {
                        for line in t.lines() {
                            let _ = writeln!(s, "    {line}");
                        }
                    }
                }
                MeshInstr::Allocate(t) => {
                    let shape: Vec<String> =
                        g.no_reduction_logical(t).iter().map(|&id| g.scalars.render(g.ids[id].extent)).collect();
                    let _ = writeln!(s, "  Allocate {} [{}] {}", g.tv_name(t), shape.join(", "), g.tvs[t].dtype);
                }
                MeshInstr::Communication(c) => {
                    let _ = writeln!(s, "  {} on the communication stream", self.comm_text(c));
                }
                MeshInstr::Wait(c) => {
                    let _ = writeln!(s, "  Wait {}", g.tv_name(self.comms[c].output));
                }
                MeshInstr::Deallocate(t) => {
                    let _ = writeln!(s, "  Deallocate {}", g.tv_name(t));
                }
            }
        }
        s
    }

    /// How propagation spread each tensor of the definition (`KILN_DUMP=sharding`).
    pub fn spreads_text(&self) -> String {
        let mut s = String::new();
        for &(t, sp) in &self.spreads {
            let _ = writeln!(s, "{}", spread_text(&self.local, t, sp));
        }
        s
    }

    /// Logical sizes of every tensor the program moves (stage inputs and outputs, collective
    /// buffers) for tensor inputs of these local `sizes` and these integer scalar inputs.
    pub fn shapes(&self, sizes: &[Vec<i64>], scalars: &[Option<i64>]) -> Result<Vec<(TvId, Vec<i64>)>> {
        let g = &self.local;
        let ins: Vec<TvId> = tensor_inputs(g).collect();
        if sizes.len() != ins.len() {
            bail!("the fusion takes {} tensor input(s), got {}", ins.len(), sizes.len());
        }
        let env = |s: Symbol| -> Option<i64> {
            match s {
                Symbol::Extent(n) => {
                    let &(tv, axis) = g.extent_sources.get(n as usize)?;
                    let pos = ins.iter().position(|&t| t == tv)?;
                    sizes.get(pos)?.get(axis).copied()
                }
                Symbol::ScalarInput(k) => scalars.get(k as usize).copied().flatten(),
                _ => None,
            }
        };
        let mut tvs: Vec<TvId> = Vec::new();
        for st in &self.stages {
            tvs.extend(st.inputs.iter().chain(&st.outputs));
        }
        for c in &self.comms {
            tvs.push(c.input);
            tvs.push(c.output);
        }
        tvs.extend(&self.outputs);
        let mut seen = FxHashSet::default();
        tvs.retain(|t| seen.insert(*t));
        let d = self.devices.len() as i64;
        for c in &self.comms {
            if c.kind == CommKind::ReduceScatter {
                let id = g.no_reduction_logical(c.of)[c.axis];
                let n = g.scalars.eval(g.ids[id].extent, &env)?;
                if n % d != 0 {
                    bail!(
                        "{}: axis {} has {n} elements, which do not split evenly over the {d} devices of mesh {:?} (ReduceScatter)",
                        g.user_tv_name(c.of),
                        c.axis,
                        self.devices
                    );
                }
            }
        }
        tvs.into_iter()
            .map(|t| {
                let shape = g
                    .no_reduction_logical(t)
                    .iter()
                    .map(|&id| g.scalars.eval(g.ids[id].extent, &env))
                    .collect::<Result<Vec<i64>>>()
                    .map_err(|e| KilnError { kind: e.kind, message: format!("{}: {}", g.tv_name(t), e.message) })?;
                Ok((t, shape))
            })
            .collect()
    }
}

/// The fusion's tensor inputs, in order.
fn tensor_inputs(f: &Fusion) -> impl Iterator<Item = TvId> + '_ {
    f.inputs.iter().filter_map(|o| o.tensor())
}
