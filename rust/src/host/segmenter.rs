//! The automatic segmenter: a host program for any unscheduled fusion whose ops the
//! schedulers can place one by one, in as few kernels as they allow.
//!
//! The whole fusion is tried first. Failing that, every live expr starts as a group of its
//! own, and neighbouring groups merge, greedily, while the merged group is covered by a
//! scheduler of the registry (it schedules, lowers and generates code) and the group graph
//! stays acyclic. Neighbours are a producer and its consumer, or two groups reading the
//! same tensor; merges that save the most Global traffic go first. Tensors crossing groups
//! become Global intermediates of the host program (allocated and freed by it, as seed 004
//! lifts kernel buffers). `segment_after` marks are kept: no group holds both a marked
//! tensor's definition and one of its uses.
//!
//! Two splits are tried beside the greedy merge: the rows, then their totals
//! (`rows_then_totals`, taken first when covered), and one kernel per class of reductions
//! with each element-wise prologue recomputed by its readers (`by_reduction_class`, taken
//! when its kernels move no more bytes than the greedy merge's).

use std::fmt::Write as _;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::error::{KilnError, Result};
use crate::host::ir::HostProgram;
use crate::host::lower::lower_segments;
use crate::host::segment::{segment_fusion, segment_of, Segment};
use crate::ir::{ExprId, Fusion, TvId};
use crate::sched::auto::registry::schedule_fusion;
use crate::sched::auto::{extent_values, refused, tensor_sizes, Ctx, DeviceProps, Heuristic, Params, Refusal};

/// A group the schedulers covered: its segment's scheduled fusion and heuristic.
#[derive(Clone)]
struct Covered {
    fusion: Fusion,
    heuristic: Heuristic,
    /// Why the schedulers before the one that covered it refused (`KILN_DUMP=segments`).
    passed_over: Vec<Refusal>,
    /// The kernel and CUDA of `fusion`, from the scheduler's check that it lowers; taken by
    /// the host program's lowering instead of lowering it again.
    lowered: Option<(crate::kernel::Kernel, crate::codegen::CudaKernel)>,
}

/// The segment report's lines for one covered group: its schedule, its exprs, and the
/// refusals of the schedulers tried before the one that covered it.
fn covered_text(report: &mut String, k: usize, c: &Covered, exprs: &str) {
    let _ = writeln!(report, "  segment {k}: {} {exprs}", c.heuristic.describe());
    for r in &c.passed_over {
        let _ = writeln!(report, "    passed over: {r}");
    }
}

/// Groups of exprs in dependency order, and how each is covered.
type Segmentation = (Vec<Vec<ExprId>>, Vec<Covered>);

/// Whether one group of exprs is covered, and by what.
fn try_group(f: &Fusion, order: &[ExprId], group: &[ExprId], cx: &Ctx) -> Result<std::result::Result<Covered, String>> {
    let seg = segment_of(f, group, order)?;
    if seg.outputs.is_empty() {
        return Ok(Err("the group produces nothing".into()));
    }
    let mut sf = segment_fusion(f, &seg);
    // The registry's schedules lower and print (a scheduler whose schedule does not is
    // skipped for the next one).
    match schedule_fusion(&mut sf, cx)? {
        Ok(p) => {
            Ok(Ok(Covered { fusion: sf, heuristic: p.heuristic, passed_over: p.passed_over, lowered: Some(p.lowered) }))
        }
        Err(refusals) => Ok(Err(join(&refusals))),
    }
}

fn join(refusals: &[Refusal]) -> String {
    refusals.iter().map(|r| r.to_string()).collect::<Vec<_>>().join("; ")
}

/// The host program the automatic schedulers and the segmenter pick for `f` (unscheduled)
/// and inputs of `inputs` sizes on `device`, with its plan key. `scalars`: the values of
/// the integer scalar inputs that tensor shapes read (`shape_scalars`), None for others. `aligned_bases`: every
/// input starts 16-byte aligned (see `Fusion::aligned_bases`).
pub fn auto_program(
    f: &Fusion,
    inputs: &[Vec<i64>],
    scalars: &[Option<i64>],
    aligned_bases: bool,
    device: DeviceProps,
) -> Result<(HostProgram, Heuristic)> {
    auto_program_strided(f, inputs, &[], scalars, aligned_bases, device)
}

/// [`auto_program`] for arrays of these element `strides` (one list per tensor input;
/// none: row-major): inputs without declared contiguity are read with the arrays' layout.
pub fn auto_program_strided(
    f: &Fusion,
    inputs: &[Vec<i64>],
    strides: &[Vec<i64>],
    scalars: &[Option<i64>],
    aligned_bases: bool,
    device: DeviceProps,
) -> Result<(HostProgram, Heuristic)> {
    let cx = Ctx { extents: extent_values(f, inputs)?, scalars: scalars.to_vec(), device };
    // An output no GPU can hold is refused by its size, before the schedulers refuse its
    // grid (`full([2**62])`, an expand to [2**31, 2**31]).
    for &o in &f.outputs {
        let Ok(all) = crate::sched::auto::tensor_sizes(f, &cx, o) else { continue };
        let sizes: Vec<i64> = f.tvs[o]
            .logical
            .iter()
            .zip(all)
            .filter(|(&id, _)| f.ids[id].iter_type != crate::ir::IterType::Reduction)
            .map(|(_, n)| n)
            .collect();
        crate::host::plan::check_buffer_size(&f.tv_name(o), &sizes, f.tvs[o].dtype)?;
    }
    let mut g = f.clone();
    g.aligned_bases = aligned_bases;
    if g.user_tvs == 0 {
        g.user_tvs = g.tvs.len();
    }
    if !strides.is_empty() {
        let descs: Vec<crate::host::eval::InputDesc> = inputs
            .iter()
            .zip(strides)
            .map(|(s, st)| crate::host::eval::InputDesc { sizes: s.clone(), strides: st.clone() })
            .collect();
        crate::host::bind::specialize_layout(&mut g, &descs);
    }
    let pinned = crate::sched::auto::canonical::concretize_reshapes(&mut g, &cx)?;
    let (program, mut h) = plan_canonical(g, &cx)?;
    h.specialized.extend(pinned);
    Ok((program, h))
}

/// [`auto_program_strided`] from the specialized fusion `g`: the canonical rewrites, then
/// the plans with and without the rewrites for long rows and column partials.
fn plan_canonical(mut g: Fusion, cx: &Ctx) -> Result<(HostProgram, Heuristic)> {
    let cx = cx.clone();
    crate::sched::auto::canonical::expand_small_powers(&mut g)?;
    crate::sched::auto::canonical::read_through_expands(&mut g)?;
    crate::sched::auto::canonical::cancel_permutes(&mut g)?;
    crate::sched::auto::canonical::sink_squeezes(&mut g)?;
    crate::sched::auto::canonical::view_output_squeezes(&mut g)?;
    crate::sched::auto::canonical::hoist_output_reshapes(&mut g)?;
    let pinned = crate::sched::auto::canonical::sink_remaps_at(&mut g, Some(&cx.extents))?;
    // A remap moved through an op (`squeeze(slice(cast(x)))` becomes
    // `squeeze(cast(slice(x)))`) leaves a squeeze over that op again: sunk too, it meets
    // the remap, which reads its one position (`squeeze_remaps`).
    crate::sched::auto::canonical::sink_squeezes(&mut g)?;
    let (program, mut h) = plan_sunk(g, &cx)?;
    h.specialized.extend(pinned);
    Ok((program, h))
}

/// [`plan_canonical`] once the remaps are sunk to what they read.
fn plan_sunk(mut g: Fusion, cx: &Ctx) -> Result<(HostProgram, Heuristic)> {
    let cx = cx.clone();
    crate::sched::auto::canonical::view_input_reshapes(&mut g);
    crate::sched::auto::canonical::view_self_mapped_inputs(&mut g);
    crate::sched::auto::canonical::reduce_through_broadcasts(&mut g)?;
    crate::sched::auto::canonical::merge_nested_reductions(&mut g)?;
    crate::sched::auto::canonical::split_reductions_of_rows(&mut g)?;
    crate::sched::auto::canonical::reuse_partial_reductions(&mut g)?;
    crate::sched::auto::canonical::sink_gathers(&mut g)?;
    crate::sched::auto::canonical::widen_broadcast_reductions(&mut g)?;
    crate::sched::auto::canonical::reduce_broadcast_axes(&mut g)?;
    crate::sched::auto::canonical::squeeze_broadcasts(&mut g)?;
    crate::sched::auto::canonical::squeeze_remaps(&mut g)?;
    crate::sched::auto::canonical::store_output_permutes(&mut g)?;
    // Rows longer than a block keeps on chip (sizes unknown here: not long).
    let long_row = |g: &Fusion, e: ExprId| {
        let out = g.exprs[e].output;
        let Ok(sizes) = crate::sched::auto::tensor_sizes(g, &cx, out) else { return false };
        let row: i64 = g.tvs[out]
            .logical
            .iter()
            .zip(&sizes)
            .filter(|(&id, _)| g.ids[id].iter_type == crate::ir::IterType::Reduction)
            .map(|(_, &n)| n)
            .product();
        let bytes = g.exprs[e].inputs[0].tensor().map_or(4, |x| g.tvs[x].dtype.size_bytes()) as i64;
        row.saturating_mul(bytes) > crate::sched::auto::canonical::ROW_ON_CHIP_BYTES
    };
    let mut short = g.clone();
    finish_canonical(&mut short, &long_row)?;
    let rewrites = short.exprs.len();
    let every = short.topo_exprs();
    let partials = if crate::sched::auto::partials::enabled() {
        crate::sched::auto::partials::column_partials(&short, &cx)?
    } else {
        None
    };
    let mut first = plan(short, &cx)?;
    if let Some(mut pf) = partials {
        // Row and column reductions of the same rows: read once, with the column sums as
        // per-block partials (see sched::auto::partials), when a kernel covers that.
        crate::sched::auto::canonical::hoist_output_reshapes(&mut pf)?;
        crate::sched::auto::canonical::sink_remaps(&mut pf)?;
        crate::sched::auto::canonical::view_input_reshapes(&mut pf);
        let fused = |h: &Heuristic| match &h.params {
            Params::Segmented(parts) => parts.iter().any(|(_, h)| matches!(h.params, Params::ColumnPartials { .. })),
            p => matches!(p, Params::ColumnPartials { .. }),
        };
        match plan(pf, &cx) {
            Ok(mut second) if fused(&second.1) => {
                second.0.segmentation = format!(
                    "column sums as per-block partials beside the row reductions ({} kernels against {})\n{}",
                    second.0.kernels.len(),
                    first.0.kernels.len(),
                    second.0.segmentation
                );
                first = second;
            }
            Ok(second) => {
                let _ = writeln!(
                    first.0.segmentation,
                    "column partials: no kernel covers the rows and partials; their plan was:\n{}",
                    second.0.segmentation
                );
            }
            Err(e) => {
                let _ = writeln!(first.0.segmentation, "column partials: refused ({e})");
            }
        }
    }
    // A row the schedule streams from memory (`looped_normalization`: the row did not fit
    // in registers, next to what else the fusion keeps) is read once per pass over it (and
    // one split over a cluster waits at cluster barriers once per reduction). The
    // long-row rewrites then save whole passes, whatever the row's length: planned again
    // with them for the streamed rows, that plan is taken when it needs no more kernels.
    let streamed = streamed_exprs(&first.1, &every);
    if streamed.is_empty() {
        return Ok(first);
    }
    let mut long = g;
    finish_canonical(&mut long, &|h: &Fusion, e: ExprId| long_row(h, e) || streamed.contains(&e))?;
    if long.exprs.len() == rewrites {
        return Ok(first);
    }
    match plan(long, &cx) {
        Ok(mut second) if second.0.kernels.len() <= first.0.kernels.len() => {
            second.0.segmentation = format!(
                "rows streamed from memory: statistics rewritten to be computed in one pass over the row ({} kernels against {})\n{}",
                second.0.kernels.len(),
                first.0.kernels.len(),
                second.0.segmentation
            );
            Ok(second)
        }
        Ok(second) => {
            let _ = writeln!(
                first.0.segmentation,
                "statistics in one pass over the streamed rows: {} kernels against {}, not taken",
                second.0.kernels.len(),
                first.0.kernels.len()
            );
            Ok(first)
        }
        Err(e) => {
            let _ = writeln!(first.0.segmentation, "statistics in one pass over the streamed rows: refused ({e})");
            Ok(first)
        }
    }
}

/// The exprs whose kernels stream their rows from memory, pass after pass
/// (`looped_normalization`), by the heuristic `auto_program` chose (`every`: the fusion's
/// exprs, for a heuristic of the whole fusion).
fn streamed_exprs(h: &Heuristic, every: &[ExprId]) -> FxHashSet<ExprId> {
    // A row split over a cluster pays two cluster barriers per reduction: fewer reductions
    // save as much there as fewer passes save a streamed row (cross-entropy over 32000 float
    // columns, [16384, 32000] on the H200: 2453 us in a cluster, one pass 600 us).
    let looped = |h: &Heuristic| {
        matches!(h.params, Params::LoopedNormalization { .. } | Params::SharedNormalization { cluster: 2.., .. })
    };
    match &h.params {
        Params::Segmented(parts) => parts
            .iter()
            .filter(|(_, h)| looped(h))
            .flat_map(|(ids, _)| ids.iter().map(|&i| ExprId::from_u32(i)))
            .collect(),
        _ if looped(h) => every.iter().copied().collect(),
        _ => FxHashSet::default(),
    }
}

/// The host program for `g` in canonical form: the whole fusion in one kernel where a
/// scheduler covers it, else the segments picked by the splits and the greedy merge.
fn plan(mut g: Fusion, cx: &Ctx) -> Result<(HostProgram, Heuristic)> {
    let mut order = g.topo_exprs();
    if order.is_empty() {
        return Ok((crate::host::lower::lower_program(&g)?, Heuristic::new(Params::Empty)));
    }
    // Empty tensors: no schedule to tune; the kernels as written do the little there is.
    if crate::sched::auto::has_empty_tensor(&g, cx) {
        crate::sched::auto::canonical::empty_outputs_to_full(&mut g, cx)?;
        crate::sched::auto::canonical::empty_reductions_to_identity(&mut g, cx)?;
        // Intermediates in Global memory: a Local array must have a constant size, and the
        // serial kernels have no other use for registers.
        let inner: Vec<_> = g.tvs.keys().filter(|&t| g.tvs[t].definition.is_some() && !g.is_output(t)).collect();
        for t in inner {
            g.tvs[t].memory = crate::ir::MemoryType::Global;
        }
        // Which reductions became identities depends on which extents are zero: plans are
        // shared only between inputs with the same zero extents.
        let zeros = cx.extents.iter().enumerate().filter(|(_, &v)| v == 0).map(|(n, _)| (n as u32, 0)).collect();
        let h = Heuristic { params: Params::ZeroSize, specialized: zeros };
        // Outputs with no elements in a kernel of their own, which never launches: in one
        // with the others, a serial loop over a large axis of an empty output would still
        // run its iterations ([2^40, 0, 3] next to a sum).
        let order = g.topo_exprs();
        let (none, some): (Vec<ExprId>, Vec<ExprId>) = order.iter().partition(|&&e| {
            let o = g.exprs[e].output;
            g.is_output(o) && g.tvs[o].uses.is_empty() && crate::sched::auto::holds_nothing(&g, cx, o)
        });
        if none.is_empty() || some.is_empty() {
            return Ok((crate::host::lower::lower_program(&g)?, h));
        }
        let segs = crate::host::segment::segments_from_groups(&g, &[some, none])?;
        return Ok((lower_segments(&g, &segs, &mut |_, _| Ok(None))?, h));
    }
    let mut report = String::new();
    if g.segment_after.is_empty() {
        match try_group(&g, &order, &order, cx)? {
            Ok(c) => return whole_program(&g, &order, c, report),
            Err(why) => {
                let _ = writeln!(report, "the whole fusion as one kernel: refused ({why})");
            }
        }
        // Permutes of inputs that keep the last axis, read through the inputs' strides
        // instead: no scheduler then sees a permute (`q.transpose(1, 2)` into attention
        // scores, a normalization of a permuted input), and the reads stay coalesced.
        let mut v = g.clone();
        if crate::sched::auto::canonical::view_input_permutes(&mut v) {
            let v_order = v.topo_exprs();
            if !v_order.is_empty() {
                match try_group(&v, &v_order, &v_order, cx)? {
                    Ok(c) => {
                        let _ = writeln!(report, "the permuted inputs read through their strides: covered");
                        return whole_program(&v, &v_order, c, report);
                    }
                    Err(why) => {
                        let _ = writeln!(report, "the permuted inputs read through their strides: refused ({why})");
                    }
                }
            }
        }
    }
    let first_split = match rows_then_totals(&g, &order, cx, &mut report)? {
        Some(split) => Some(split),
        None => full_reductions_then_readers(&g, &order, cx, &mut report)?,
    };
    let (groups, mut covered) = match first_split {
        Some(split) => split,
        None => {
            let split = merge_groups(&g, &order, cx, &mut report)?;
            // One kernel per class of reductions (rows, columns), each reader of an
            // element-wise prologue computing its own copy: kept when its kernels move fewer
            // bytes than the greedy merge's.
            let mut r = g.clone();
            let split_bytes = traffic(&g, &order, &split.0, cx)?;
            let mut chosen = None;
            if crate::sched::auto::canonical::recompute_prologues(&mut r)? {
                let r_order = r.topo_exprs();
                if let Some(by_class) = by_reduction_class(&r, &r_order, cx, &mut report)? {
                    let bytes = traffic(&r, &r_order, &by_class.0, cx)?;
                    // On a tie the copies win: no Global intermediate to allocate.
                    if bytes < split_bytes || (bytes == split_bytes && by_class.0.len() <= split.0.len()) {
                        let _ = writeln!(
                            report,
                            "one kernel per class of reductions, prologues recomputed: {bytes} bytes moved against {split_bytes}"
                        );
                        chosen = Some((r, r_order, by_class));
                    }
                }
            }
            match chosen {
                Some((r, r_order, by_class)) => {
                    g = r;
                    order = r_order;
                    by_class
                }
                None => split,
            }
        }
    };
    let segs: Vec<Segment> = groups.iter().map(|grp| segment_of(&g, grp, &order)).collect::<Result<_>>()?;
    let mut parts = Vec::new();
    let _ = writeln!(report, "segments: {} kernels", groups.len());
    for (k, grp) in groups.iter().enumerate() {
        let h = &covered[k].heuristic;
        covered_text(&mut report, k, &covered[k], &group_text(&g, grp));
        parts.push((grp.iter().map(|e| e.as_u32()).collect(), h.clone()));
    }
    let mut program = lower_segments(&g, &segs, &mut |k, sf| {
        *sf = covered[k].fusion.clone();
        Ok(covered[k].lowered.take())
    })?;
    program.segmentation = report;
    Ok((program, Heuristic::new(Params::Segmented(parts))))
}

/// The host program of `g` as the one kernel `c` covers (`order`: all of `g`'s exprs).
fn whole_program(g: &Fusion, order: &[ExprId], mut c: Covered, mut report: String) -> Result<(HostProgram, Heuristic)> {
    let _ = writeln!(report, "segments: 1 kernel (the whole fusion)");
    covered_text(&mut report, 0, &c, &group_text(g, order));
    let h = c.heuristic.clone();
    let mut program = lower_segments(g, &[segment_of(g, order, order)?], &mut |_, sf| {
        *sf = c.fusion.clone();
        Ok(c.lowered.take())
    })?;
    program.segmentation = report;
    Ok((program, h))
}

/// One group per class of reductions (those reducing the same axes of inputs of the same
/// rank), each with the exprs that feed its reductions and the ops on their results; in
/// dependency order. None when there are fewer than two classes, an expr serves two of
/// them, the classes depend on each other both ways, or a group is not covered.
fn by_reduction_class(f: &Fusion, order: &[ExprId], cx: &Ctx, report: &mut String) -> Result<Option<Segmentation>> {
    use crate::ir::{IterType, Op};
    let key = |e: ExprId| -> (usize, Vec<bool>) {
        let out = f.exprs[e].output;
        let rank = f.exprs[e].inputs[0].tensor().map_or(0, |x| f.no_reduction_logical(x).len());
        (rank, f.tvs[out].logical.iter().map(|&id| f.ids[id].iter_type == IterType::Reduction).collect())
    };
    let mut keys: Vec<(usize, Vec<bool>)> = Vec::new();
    let mut class: FxHashMap<ExprId, usize> = FxHashMap::default();
    for &e in order {
        if matches!(f.exprs[e].op, Op::Reduction { .. }) {
            let k = key(e);
            let c = keys.iter().position(|x| *x == k).unwrap_or_else(|| {
                keys.push(k);
                keys.len() - 1
            });
            class.insert(e, c);
        }
    }
    if keys.len() < 2 {
        return Ok(None);
    }
    let def = |t: TvId| f.tvs[t].definition;
    // The classes of the reductions each expr feeds (its readers', back to front) ...
    let mut feeds: FxHashMap<ExprId, Vec<usize>> = FxHashMap::default();
    for &e in order.iter().rev() {
        let mut cs: Vec<usize> = class.get(&e).map(|&c| vec![c]).unwrap_or_default();
        for u in &f.tvs[f.exprs[e].output].uses {
            for &c in feeds.get(u).map(|v| v.as_slice()).unwrap_or(&[]) {
                if !cs.contains(&c) {
                    cs.push(c);
                }
            }
        }
        feeds.insert(e, cs);
    }
    // ... and of the reductions it reads the results of (front to back).
    let mut reads: FxHashMap<ExprId, Vec<usize>> = FxHashMap::default();
    for &e in order {
        let mut cs: Vec<usize> = class.get(&e).map(|&c| vec![c]).unwrap_or_default();
        for p in f.exprs[e].input_tvs().filter_map(def) {
            for &c in reads.get(&p).map(|v| v.as_slice()).unwrap_or(&[]) {
                if !cs.contains(&c) {
                    cs.push(c);
                }
            }
        }
        reads.insert(e, cs);
    }
    let mut groups: Vec<Vec<ExprId>> = vec![Vec::new(); keys.len()];
    for &e in order {
        let owner = match (feeds[&e].as_slice(), reads[&e].as_slice()) {
            ([c], _) => *c,
            ([], [c]) => *c,
            ([], []) => 0, // element-wise outputs beside every reduction
            _ => return Ok(None),
        };
        groups[owner].push(e);
    }
    // Launch order: a class reading another's results after it.
    let mut after: Vec<Vec<usize>> = vec![Vec::new(); keys.len()];
    for (c, grp) in groups.iter().enumerate() {
        for &e in grp {
            for p in f.exprs[e].input_tvs().filter_map(def) {
                let pc = (0..keys.len()).find(|&k| groups[k].contains(&p)).unwrap_or(c);
                if pc != c && !after[c].contains(&pc) {
                    after[c].push(pc);
                }
            }
        }
    }
    let mut launch: Vec<usize> = Vec::new();
    while launch.len() < keys.len() {
        let Some(c) = (0..keys.len()).find(|&c| !launch.contains(&c) && after[c].iter().all(|p| launch.contains(p)))
        else {
            return Ok(None);
        };
        launch.push(c);
    }
    let mut out_groups = Vec::new();
    let mut covered = Vec::new();
    for c in launch {
        let grp = std::mem::take(&mut groups[c]);
        if grp.is_empty() {
            continue;
        }
        match try_group(f, order, &grp, cx)? {
            Ok(cov) => covered.push(cov),
            Err(why) => {
                let _ = writeln!(report, "one kernel per class of reductions: {} refused ({why})", group_text(f, &grp));
                return Ok(None);
            }
        }
        out_groups.push(grp);
    }
    Ok(Some((out_groups, covered)))
}

/// The canonical rewrites that depend on the rows' length (`long_row`), and those after them.
fn finish_canonical(g: &mut Fusion, long_row: &dyn Fn(&Fusion, ExprId) -> bool) -> Result<()> {
    crate::sched::auto::canonical::online_logsumexp(g, long_row)?;
    crate::sched::auto::canonical::hoist_row_terms(g, long_row)?;
    crate::sched::auto::canonical::expand_centered_squares(g, long_row)?;
    // The shifted sums read each row's first element through a slice: from the inputs.
    crate::sched::auto::canonical::sink_remaps(g)?;
    crate::sched::auto::canonical::broadcast_computed_indices(g)?;
    crate::sched::auto::canonical::sink_broadcasts(g)?;
    crate::sched::auto::canonical::view_gather_tables(g);
    crate::sched::auto::canonical::view_strided_gather_tables(g)?;
    crate::sched::auto::canonical::unify_mapped_extents(g);
    Ok(())
}

/// Bytes the kernels of `groups` read and write in Global memory: each segment's inputs
/// and outputs, once per segment.
fn traffic(f: &Fusion, order: &[ExprId], groups: &[Vec<ExprId>], cx: &Ctx) -> Result<i64> {
    let mut bytes = 0i64;
    for grp in groups {
        let seg = segment_of(f, grp, order)?;
        for &t in seg.inputs.iter().chain(&seg.outputs) {
            let sizes = tensor_sizes(f, cx, t).unwrap_or_default();
            let n: i64 = f.tvs[t]
                .logical
                .iter()
                .zip(&sizes)
                .filter(|(&id, _)| f.ids[id].iter_type != crate::ir::IterType::Reduction)
                .map(|(_, &n)| n)
                .product();
            bytes = bytes.saturating_add(n.saturating_mul(f.tvs[t].dtype.size_bytes() as i64));
        }
    }
    Ok(bytes)
}

/// Two kernels, the rows then their totals, where the whole fusion is a row schedule with
/// totals of its rows that want a kernel of their own (more rows than a grid reduction
/// serves well): the rows' group as a whole, which greedy pairwise merging may not reach
/// when its partial groups are not covered. None when there are no totals, or either
/// group is not covered.
fn rows_then_totals(f: &Fusion, order: &[ExprId], cx: &Ctx, report: &mut String) -> Result<Option<Segmentation>> {
    let reds: Vec<ExprId> =
        order.iter().copied().filter(|&e| matches!(f.exprs[e].op, crate::ir::Op::Reduction { .. })).collect();
    let (rows, totals) = crate::sched::auto::split_totals(f, &reds);
    if totals.is_empty() || rows.is_empty() {
        return Ok(None);
    }
    let roots: Vec<TvId> = totals.iter().map(|&e| f.exprs[e].output).collect();
    let post: FxHashSet<TvId> = crate::sched::auto::downstream(f, &roots).into_iter().chain(roots).collect();
    let (second, first): (Vec<ExprId>, Vec<ExprId>) =
        order.iter().copied().partition(|&e| post.contains(&f.exprs[e].output));
    let names = ["the rows without their totals", "the totals of the rows", "the rows, then their totals"];
    two_groups(f, order, cx, report, first, second, names)
}

/// `first` then `second` as two kernels when both have a schedule, reported under `names`
/// (each group, then the pair); None (with the refusal in the report) otherwise.
fn two_groups(
    f: &Fusion,
    order: &[ExprId],
    cx: &Ctx,
    report: &mut String,
    first: Vec<ExprId>,
    second: Vec<ExprId>,
    names: [&str; 3],
) -> Result<Option<Segmentation>> {
    let mut covered = Vec::with_capacity(2);
    for (what, group) in [(names[0], &first), (names[1], &second)] {
        match try_group(f, order, group, cx)? {
            Ok(c) => covered.push(c),
            Err(why) => {
                let _ = writeln!(report, "{what}: refused ({why})");
                return Ok(None);
            }
        }
    }
    let _ = writeln!(report, "{}: covered", names[2]);
    Ok(Some((vec![first, second], covered)))
}

/// Two groups: the full reductions (to rank 0) with everything they need and the rank-0
/// math on their results, then the tensors that read those results. A tensor read in every
/// block needs the total finished first, which takes a kernel boundary; a gradient clip over
/// k parameters (k sums of squares, one coefficient, k scaled outputs) is planned with two
/// schedules here, where merging pair by pair lowers a reduction group that grows by one
/// parameter per step (k^2 work). None when there is no such reader, the first group would
/// read the second, or either group has no schedule.
fn full_reductions_then_readers(
    f: &Fusion,
    order: &[ExprId],
    cx: &Ctx,
    report: &mut String,
) -> Result<Option<Segmentation>> {
    let full = |e: ExprId| {
        matches!(f.exprs[e].op, crate::ir::Op::Reduction { .. }) && f.no_reduction_logical(f.exprs[e].output).is_empty()
    };
    let mut downstream: FxHashSet<TvId> = FxHashSet::default();
    let mut second: FxHashSet<ExprId> = FxHashSet::default();
    for &e in order {
        let out = f.exprs[e].output;
        let reads_total = f.exprs[e].input_tvs().any(|t| downstream.contains(&t));
        if full(e) || reads_total {
            downstream.insert(out);
        }
        if reads_total && !f.no_reduction_logical(out).is_empty() {
            second.insert(e);
        }
    }
    if second.is_empty() {
        return Ok(None);
    }
    let (second, first): (Vec<ExprId>, Vec<ExprId>) = order.iter().partition(|e| second.contains(e));
    let second_out: FxHashSet<TvId> = second.iter().map(|&e| f.exprs[e].output).collect();
    if first.is_empty() || first.iter().any(|&e| f.exprs[e].input_tvs().any(|t| second_out.contains(&t))) {
        return Ok(None);
    }
    let names = ["the full reductions, apart", "their readers, apart", "the full reductions, then their readers"];
    two_groups(f, order, cx, report, first, second, names)
}

/// `{T3 = sum(T2), T4 = mul(T3, ..)}`-style short listing of a group's results.
fn group_text(f: &Fusion, group: &[ExprId]) -> String {
    let names: Vec<String> = group.iter().map(|&e| f.tv_name(f.exprs[e].output)).collect();
    format!("{{{}}}", names.join(", "))
}

/// Greedy merging from one group per expr; returns the groups in launch order and the
/// schedule of each.
fn merge_groups(
    f: &Fusion,
    order: &[ExprId],
    cx: &Ctx,
    report: &mut String,
) -> Result<(Vec<Vec<ExprId>>, Vec<Covered>)> {
    let pos: FxHashMap<ExprId, usize> = order.iter().enumerate().map(|(i, &e)| (e, i)).collect();
    // Groups by index; a merged-away group is None. Exprs kept in dependency order.
    let mut groups: Vec<Option<Vec<ExprId>>> = order.iter().map(|&e| Some(vec![e])).collect();
    // The schedule of each group, once it has one: a lone expr is scheduled only if it is
    // still alone when merging ends (each schedule is lowered, and most exprs merge).
    let mut covered: Vec<Option<Covered>> = vec![None; order.len()];
    let bytes: FxHashMap<TvId, i64> = f
        .tvs
        .keys()
        .map(|t| {
            let n: i64 = tensor_sizes(f, cx, t).map(|s| s.iter().product()).unwrap_or(1);
            (t, n.max(1) * f.tvs[t].dtype.size_bytes() as i64)
        })
        .collect();
    // Pairs refused as they were, by index and size: a group only grows (a merge puts the
    // union at one index and empties the other), so its size names its contents.
    let mut refused_pairs: FxHashSet<(usize, usize, usize, usize)> = FxHashSet::default();
    let sized = |groups: &[Option<Vec<ExprId>>], a: usize, b: usize| {
        let len = |i: usize| groups[i].as_ref().map_or(0, |g| g.len());
        (a, len(a), b, len(b))
    };
    // Pairs of groups refused in this round, by index, whatever either has absorbed since:
    // asking again after every merge that grows one of them costs a schedule per pair and
    // merge (minutes for a gradient clip over a few dozen tensors). A round ends when no
    // pair merges; the next round asks every pair once more with the groups grown.
    let mut refused_this_round: FxHashSet<(usize, usize)> = FxHashSet::default();
    let mut merged_this_round = false;
    let mut refusals: Vec<String> = Vec::new();
    loop {
        let group_of = group_index(&groups);
        let candidates = candidates(f, order, &groups, &group_of, &bytes, &pos);
        let mut merged = false;
        for (_, a, b) in candidates {
            if refused_this_round.contains(&(a, b)) {
                continue;
            }
            let key = sized(&groups, a, b);
            if refused_pairs.contains(&key) {
                continue;
            }
            let (ga, gb) = (groups[a].as_deref().unwrap_or_default(), groups[b].as_deref().unwrap_or_default());
            if crosses_mark(f, ga, gb) || makes_cycle(f, &groups, &group_of, a, b) {
                refused_pairs.insert(key);
                refused_this_round.insert((a, b));
                continue;
            }
            let mut union: Vec<ExprId> = ga.iter().chain(gb).copied().collect();
            union.sort_by_key(|e| pos[e]);
            match try_group(f, order, &union, cx)? {
                Ok(c) => {
                    groups[a] = Some(union);
                    groups[b] = None;
                    covered[a] = Some(c);
                    covered[b] = None;
                    absorb_partners(f, order, cx, &pos, &bytes, &refused_this_round, &mut groups, &mut covered, a)?;
                    merged = true;
                    merged_this_round = true;
                    break;
                }
                Err(why) => {
                    refusals.push(format!("  {} + {}: {why}", group_text(f, ga), group_text(f, gb)));
                    refused_pairs.insert(key);
                    refused_this_round.insert((a, b));
                }
            }
        }
        if !merged {
            if !merged_this_round {
                break;
            }
            refused_this_round.clear();
            merged_this_round = false;
        }
    }
    for (i, g) in groups.iter().enumerate() {
        let Some(g) = g else { continue };
        if covered[i].is_some() {
            continue;
        }
        match try_group(f, order, g, cx)? {
            Ok(c) => covered[i] = Some(c),
            Err(why) => {
                return Err(KilnError::value(format!(
                    "{}: no automatic schedule places this op even on its own ({why}); schedule the fusion by hand",
                    f.expr_short(&f.exprs[g[0]])
                )));
            }
        }
    }
    if !refusals.is_empty() {
        let _ = writeln!(report, "refused merges:");
        for r in &refusals {
            let _ = writeln!(report, "{r}");
        }
    }
    // Launch order: a group after every group it reads from (ties by first expr).
    let alive: Vec<usize> = (0..groups.len()).filter(|&i| groups[i].is_some()).collect();
    let group_of = group_index(&groups);
    let mut preds: FxHashMap<usize, FxHashSet<usize>> = FxHashMap::default();
    for &i in &alive {
        let entry = preds.entry(i).or_default();
        for &e in groups[i].as_ref().expect("alive") {
            for t in f.exprs[e].input_tvs() {
                if let Some(d) = f.tvs[t].definition {
                    if let Some(&p) = group_of.get(&d) {
                        if p != i {
                            entry.insert(p);
                        }
                    }
                }
            }
        }
    }
    let mut done: FxHashSet<usize> = FxHashSet::default();
    let mut out_groups = Vec::with_capacity(alive.len());
    let mut out_cov = Vec::with_capacity(alive.len());
    while done.len() < alive.len() {
        let next = alive
            .iter()
            .copied()
            .filter(|i| !done.contains(i) && preds[i].iter().all(|p| done.contains(p)))
            .min_by_key(|&i| pos[&groups[i].as_ref().expect("alive")[0]]);
        let Some(i) = next else {
            return Err(KilnError::internal("the segmenter's groups form a cycle"));
        };
        done.insert(i);
        out_groups.push(groups[i].clone().expect("alive"));
        out_cov.push(covered[i].clone().ok_or_else(|| KilnError::internal("an alive group without a schedule"))?);
    }
    if out_groups.is_empty() {
        return Err(refused(&[]));
    }
    Ok((out_groups, out_cov))
}

/// After group `a` grew: where the next pairs the greedy merge would ask all grow `a`,
/// merge their partners in one schedule when one covers them all (else the first half),
/// instead of one schedule per partner. A group that absorbs many (the outputs of a
/// gradient clip over hundreds of tensors) would otherwise be scheduled and lowered once
/// per partner, each time larger.
#[allow(clippy::too_many_arguments)]
fn absorb_partners(
    f: &Fusion,
    order: &[ExprId],
    cx: &Ctx,
    pos: &FxHashMap<ExprId, usize>,
    bytes: &FxHashMap<TvId, i64>,
    refused: &FxHashSet<(usize, usize)>,
    groups: &mut [Option<Vec<ExprId>>],
    covered: &mut [Option<Covered>],
    a: usize,
) -> Result<()> {
    loop {
        let group_of = group_index(groups);
        // The pairs the greedy merge would ask next, while they all grow `a`.
        let partners: Vec<usize> = candidates(f, order, groups, &group_of, bytes, pos)
            .into_iter()
            .filter(|&(_, x, y)| !refused.contains(&(x, y)))
            .take_while(|&(_, x, y)| x == a || y == a)
            .map(|(_, x, y)| if x == a { y } else { x })
            .collect();
        if partners.len() < 2 {
            return Ok(());
        }
        let mut n = partners.len();
        loop {
            // The first n partners that keep the group graph acyclic, merged in a copy.
            let mut scratch = groups.to_vec();
            let mut taken = Vec::new();
            for &p in &partners[..n] {
                let sg = group_index(&scratch);
                let (ga, gp) = (scratch[a].clone().unwrap_or_default(), scratch[p].clone().unwrap_or_default());
                if crosses_mark(f, &ga, &gp) || makes_cycle(f, &scratch, &sg, a.min(p), a.max(p)) {
                    continue;
                }
                let mut union: Vec<ExprId> = ga.into_iter().chain(gp).collect();
                union.sort_by_key(|e| pos[e]);
                scratch[a] = Some(union);
                scratch[p] = None;
                taken.push(p);
            }
            if taken.len() < 2 {
                return Ok(());
            }
            let union = scratch[a].clone().unwrap_or_default();
            match try_group(f, order, &union, cx)? {
                Ok(c) => {
                    groups.clone_from_slice(&scratch);
                    covered[a] = Some(c);
                    for p in taken {
                        covered[p] = None;
                    }
                    break;
                }
                Err(_) if n >= 4 => n /= 2,
                Err(_) => return Ok(()),
            }
        }
    }
}

fn group_index(groups: &[Option<Vec<ExprId>>]) -> FxHashMap<ExprId, usize> {
    let mut m = FxHashMap::default();
    for (i, g) in groups.iter().enumerate() {
        for &e in g.iter().flatten() {
            m.insert(e, i);
        }
    }
    m
}

/// Pairs of groups worth merging, best first: `(bytes saved, a, b)` with `a < b`.
/// Producer and consumer save the intermediate's read (and its write when nothing else
/// needs it in Global); two readers of one tensor save one read of it; two producers of
/// one consumer save a launch.
fn candidates(
    f: &Fusion,
    order: &[ExprId],
    groups: &[Option<Vec<ExprId>>],
    group_of: &FxHashMap<ExprId, usize>,
    bytes: &FxHashMap<TvId, i64>,
    pos: &FxHashMap<ExprId, usize>,
) -> Vec<(i64, usize, usize)> {
    let live: FxHashSet<ExprId> = order.iter().copied().collect();
    let mut saved: FxHashMap<(usize, usize), i64> = FxHashMap::default();
    let mut readers: FxHashMap<TvId, Vec<usize>> = FxHashMap::default();
    for (i, g) in groups.iter().enumerate() {
        for &e in g.iter().flatten() {
            for t in f.exprs[e].input_tvs() {
                let r = readers.entry(t).or_default();
                if !r.contains(&i) {
                    r.push(i);
                }
            }
        }
    }
    for (&t, rs) in &readers {
        let b = bytes.get(&t).copied().unwrap_or(1);
        let producer = f.tvs[t].definition.and_then(|d| group_of.get(&d).copied());
        if let Some(p) = producer {
            let uses: Vec<usize> =
                f.tvs[t].uses.iter().filter(|u| live.contains(u)).filter_map(|u| group_of.get(u).copied()).collect();
            for &c in rs {
                if c == p {
                    continue;
                }
                let write_too = !f.is_output(t) && uses.iter().all(|&u| u == p || u == c);
                *saved.entry((p.min(c), p.max(c))).or_default() += b + if write_too { b } else { 0 };
            }
        }
        // Readers pair with the first reader and with the next one, not every other: a
        // tensor many groups read (a clip coefficient that scales k gradients) would give
        // k^2 pairs per round of merging, and merging the readers one at a time into the
        // first reaches the same group.
        let rs: Vec<usize> = rs.iter().copied().filter(|&i| Some(i) != producer).collect();
        for (x, &j) in rs.iter().enumerate().skip(1) {
            let (first, prev) = (rs[0], rs[x - 1]);
            for i in if first == prev { vec![first] } else { vec![first, prev] } {
                *saved.entry((i.min(j), i.max(j))).or_default() += b;
            }
        }
    }
    // Groups feeding one consumer (a sum and a count that a division reads) save no traffic
    // when merged, but a launch: tried after every merge that saves bytes.
    let mut fed_by: FxHashMap<usize, Vec<usize>> = FxHashMap::default();
    for (&t, rs) in &readers {
        if let Some(p) = f.tvs[t].definition.and_then(|d| group_of.get(&d).copied()) {
            for &c in rs {
                let v = fed_by.entry(c).or_default();
                if c != p && !v.contains(&p) {
                    v.push(p);
                }
            }
        }
    }
    // Likewise groups reading one producer group's results (the totals of two column
    // partials): one launch instead of two.
    let mut feeds: FxHashMap<usize, Vec<usize>> = FxHashMap::default();
    for (&c, ps) in &fed_by {
        for &p in ps {
            feeds.entry(p).or_default().push(c);
        }
    }
    for cs in feeds.values_mut() {
        cs.sort_unstable();
    }
    for ps in fed_by.values().chain(feeds.values()) {
        // With the first and the next, as readers pair above.
        for (x, &j) in ps.iter().enumerate().skip(1) {
            for i in [ps[0], ps[x - 1]] {
                saved.entry((i.min(j), i.max(j))).or_insert(0);
            }
        }
    }
    let first: Vec<usize> = groups.iter().map(|g| g.as_ref().map_or(usize::MAX, |g| pos[&g[0]])).collect();
    let mut out: Vec<(i64, usize, usize)> = saved.into_iter().map(|((a, b), s)| (s, a, b)).collect();
    out.sort_unstable_by_key(|&(s, a, b)| (-s, first[a].min(first[b]), first[a].max(first[b])));
    out
}

/// True when merging would put a `segment_after` tensor's definition and a use of it in
/// one group.
fn crosses_mark(f: &Fusion, a: &[ExprId], b: &[ExprId]) -> bool {
    let union: FxHashSet<ExprId> = a.iter().chain(b).copied().collect();
    f.segment_after.iter().any(|&t| {
        f.tvs[t].definition.is_some_and(|d| union.contains(&d)) && f.tvs[t].uses.iter().any(|u| union.contains(u))
    })
}

/// True when merging groups `a` and `b` would make the group graph cyclic: some other
/// group lies on a path from one to the other.
fn makes_cycle(
    f: &Fusion,
    groups: &[Option<Vec<ExprId>>],
    group_of: &FxHashMap<ExprId, usize>,
    a: usize,
    b: usize,
) -> bool {
    let succ = |i: usize| -> FxHashSet<usize> {
        let mut s = FxHashSet::default();
        for &e in groups[i].iter().flatten() {
            for &u in &f.tvs[f.exprs[e].output].uses {
                if let Some(&j) = group_of.get(&u) {
                    if j != i {
                        s.insert(j);
                    }
                }
            }
        }
        s
    };
    let reaches_through_other = |from: usize, to: usize| -> bool {
        let mut stack: Vec<usize> = succ(from).into_iter().filter(|&j| j != to).collect();
        let mut seen: FxHashSet<usize> = stack.iter().copied().collect();
        while let Some(i) = stack.pop() {
            if i == to {
                return true;
            }
            for j in succ(i) {
                if seen.insert(j) {
                    stack.push(j);
                }
            }
        }
        false
    };
    reaches_through_other(a, b) || reaches_through_other(b, a)
}
