//! The scheduler registry: one trait, one list in priority order.
//!
//! A scheduler first says whether it covers a fusion (`accepts`: a structural check, cheap,
//! no mutation), then schedules a copy of it (`schedule`: heuristic and transforms). A
//! scheduler that cannot place what it accepted after all (rows too long for registers,
//! a grid dimension past its limit) refuses from `schedule` with a user-kind error, which
//! the registry turns into a [`Refusal`]. An internal error is a kiln bug: it is returned
//! as an error and never makes the registry try the next scheduler.

use std::fmt;

use crate::error::{ErrorKind, Result};
use crate::ir::{ExprId, Fusion, Op};
use crate::sched::auto::{
    looped, normalization, pointwise, reduction, shared, specialize_reduced_extents, transpose, Heuristic,
};

/// Properties of the target GPU that the heuristics read; part of every plan key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceProps {
    /// Streaming multiprocessors: sizes grids to whole waves.
    pub sm_count: i64,
    /// Threads a block may have.
    pub max_threads_per_block: i64,
    /// Shared memory a block may use (opt-in maximum), bytes.
    pub shared_per_block: i64,
    /// 32-bit registers a block may use.
    pub registers_per_block: i64,
    /// Compute capability as `major * 10 + minor`.
    pub arch: i64,
}

impl Default for DeviceProps {
    /// The documented default target, an H100/H200-class GPU (sm_90, 132 SMs): used by
    /// `fd.lower` and the interpreter when no GPU is asked.
    fn default() -> Self {
        Self {
            sm_count: 132,
            max_threads_per_block: 1024,
            shared_per_block: 232_448,
            registers_per_block: 65_536,
            arch: 90,
        }
    }
}

/// What a scheduler is given besides the fusion.
#[derive(Clone, Debug)]
pub struct Ctx {
    /// Values of the symbolic extents `i{n}` for the inputs at hand.
    pub extents: Vec<i64>,
    /// Values of the runtime scalar inputs `s{n}` that shapes read (a `full` of a runtime
    /// size); None where not given.
    pub scalars: Vec<Option<i64>>,
    pub device: DeviceProps,
}

/// A scheduler does not cover a fusion, and why. Not an error: the segmenter then tries
/// smaller groups.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub scheduler: &'static str,
    pub reason: String,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.scheduler, self.reason)
    }
}

/// One automatic scheduler.
pub trait Scheduler: Sync {
    /// Short name, as printed in dumps and plan keys.
    fn name(&self) -> &'static str;
    /// Whether this scheduler covers the unscheduled fusion `f` (structure only).
    fn accepts(&self, f: &Fusion, cx: &Ctx) -> std::result::Result<(), String>;
    /// Schedule `f` in place; a user-kind error is a refusal, an internal one a bug.
    fn schedule(&self, f: &mut Fusion, cx: &Ctx) -> Result<Heuristic>;
}

/// The ops of `f` that decide which scheduler fits: its reductions and permutes.
struct Shape {
    reductions: Vec<ExprId>,
    permutes: usize,
}

fn shape(f: &Fusion) -> Shape {
    let exprs = f.topo_exprs();
    let reductions = exprs.iter().copied().filter(|&e| matches!(f.exprs[e].op, Op::Reduction { .. })).collect();
    let permutes = exprs.iter().filter(|&&e| matches!(f.exprs[e].op, Op::Permute { .. })).count();
    Shape { reductions, permutes }
}

struct Pointwise;
struct Normalization;
struct LoopedNormalization;
struct Reduction;
struct Transpose;

impl Scheduler for Pointwise {
    fn name(&self) -> &'static str {
        "pointwise"
    }
    fn accepts(&self, f: &Fusion, cx: &Ctx) -> std::result::Result<(), String> {
        let s = shape(f);
        if !s.reductions.is_empty() {
            return Err("the fusion has a reduction".into());
        }
        if s.permutes > 0 && pointwise::kept_last_permute_at(f, Some(cx)).is_none() {
            return Err("a permute moves the last axis (or there are several)".into());
        }
        Ok(())
    }
    fn schedule(&self, f: &mut Fusion, cx: &Ctx) -> Result<Heuristic> {
        pointwise::schedule(f, cx)
    }
}

impl Scheduler for Normalization {
    fn name(&self) -> &'static str {
        "normalization"
    }
    fn accepts(&self, f: &Fusion, _: &Ctx) -> std::result::Result<(), String> {
        let s = shape(f);
        if s.permutes > 0 {
            return Err("the fusion has a permute".into());
        }
        if s.reductions.is_empty() {
            return Err("the fusion has no reduction".into());
        }
        if !normalization::is_normalization(f, &s.reductions) {
            return Err("no reduction result meets its unreduced input again".into());
        }
        Ok(())
    }
    fn schedule(&self, f: &mut Fusion, cx: &Ctx) -> Result<Heuristic> {
        let reductions = shape(f).reductions;
        normalization::schedule(f, cx, &reductions)
    }
}

struct SharedNormalization;

impl Scheduler for SharedNormalization {
    fn name(&self) -> &'static str {
        "shared_normalization"
    }
    fn accepts(&self, f: &Fusion, cx: &Ctx) -> std::result::Result<(), String> {
        Normalization.accepts(f, cx)
    }
    fn schedule(&self, f: &mut Fusion, cx: &Ctx) -> Result<Heuristic> {
        let reductions = shape(f).reductions;
        shared::schedule(f, cx, &reductions)
    }
}

impl Scheduler for LoopedNormalization {
    fn name(&self) -> &'static str {
        "looped_normalization"
    }
    fn accepts(&self, f: &Fusion, cx: &Ctx) -> std::result::Result<(), String> {
        Normalization.accepts(f, cx)
    }
    fn schedule(&self, f: &mut Fusion, cx: &Ctx) -> Result<Heuristic> {
        let reductions = shape(f).reductions;
        looped::schedule(f, cx, &reductions)
    }
}

impl Scheduler for Reduction {
    fn name(&self) -> &'static str {
        "reduction"
    }
    fn accepts(&self, f: &Fusion, _: &Ctx) -> std::result::Result<(), String> {
        let s = shape(f);
        if s.permutes > 0 {
            return Err("the fusion has a permute".into());
        }
        let pattern = |e: ExprId| -> Vec<bool> {
            let o = f.exprs[e].output;
            f.tvs[o].logical.iter().map(|&id| f.ids[id].iter_type == crate::ir::IterType::Reduction).collect()
        };
        let (rows, _) = super::split_totals(f, &s.reductions);
        match rows.as_slice() {
            [] => Err("the fusion has no reduction".into()),
            [first, rest @ ..] if rest.iter().all(|&e| pattern(e) == pattern(*first)) => Ok(()),
            // Totals of tensors of several shapes share one grid.
            all if all.iter().all(|&e| pattern(e).iter().all(|&r| r)) => Ok(()),
            _ => Err(format!(
                "{} reductions of different axes (one, or siblings of the same axes, are covered)",
                s.reductions.len()
            )),
        }
    }
    fn schedule(&self, f: &mut Fusion, cx: &Ctx) -> Result<Heuristic> {
        let reds = shape(f).reductions;
        reduction::schedule(f, cx, &reds)
    }
}

impl Scheduler for Transpose {
    fn name(&self) -> &'static str {
        "transpose"
    }
    fn accepts(&self, f: &Fusion, _: &Ctx) -> std::result::Result<(), String> {
        let s = shape(f);
        if !s.reductions.is_empty() {
            return Err("the fusion has a reduction".into());
        }
        if s.permutes != 1 {
            return Err(format!("{} permutes (one is covered)", s.permutes));
        }
        Ok(())
    }
    fn schedule(&self, f: &mut Fusion, cx: &Ctx) -> Result<Heuristic> {
        transpose::schedule(f, cx)
    }
}

struct StridedPermute;
struct ColumnPartials;

impl Scheduler for ColumnPartials {
    fn name(&self) -> &'static str {
        "column_partials"
    }
    fn accepts(&self, f: &Fusion, _: &Ctx) -> std::result::Result<(), String> {
        match super::partials::kernel_reductions(f) {
            Some(_) => Ok(()),
            None => Err("not row reductions and column partials of [G, S, N] tensors".into()),
        }
    }
    fn schedule(&self, f: &mut Fusion, cx: &Ctx) -> Result<Heuristic> {
        super::partials::schedule(f, cx)
    }
}

impl Scheduler for StridedPermute {
    fn name(&self) -> &'static str {
        "strided_permute"
    }
    fn accepts(&self, f: &Fusion, _: &Ctx) -> std::result::Result<(), String> {
        let s = shape(f);
        if !s.reductions.is_empty() {
            return Err("the fusion has a reduction".into());
        }
        if s.permutes != 1 {
            return Err(format!("{} permutes (one is covered)", s.permutes));
        }
        // Like the tiled transpose, it reads a fusion input: ops before the permute get a
        // kernel of their own rather than strided reads of a large computed tensor.
        let (e, _) = pointwise::single_permute(f).ok_or("no permute")?;
        if !f.exprs[e].inputs[0].tensor().is_some_and(|x| f.is_input(x)) {
            return Err("the permute reads a computed tensor".into());
        }
        Ok(())
    }
    fn schedule(&self, f: &mut Fusion, cx: &Ctx) -> Result<Heuristic> {
        pointwise::schedule_strided_permute(f, cx)
    }
}

/// Every automatic scheduler, in the order they are asked.
pub static REGISTRY: [&dyn Scheduler; 8] = [
    &Pointwise,
    &Normalization,
    &SharedNormalization,
    &ColumnPartials,
    &LoopedNormalization,
    &Reduction,
    &Transpose,
    &StridedPermute,
];

/// Index of the scheduler that produced heuristic kind `kind` (for plan keys).
pub fn kind_index(kind: &str) -> i64 {
    const KINDS: [&str; 10] = [
        "pointwise",
        "inner_reduction",
        "outer_reduction",
        "full_reduction",
        "normalization",
        "transpose",
        "strided_permute",
        "looped_normalization",
        "column_partials",
        "shared_normalization",
    ];
    KINDS.iter().position(|&k| k == kind).unwrap_or(KINDS.len()) as i64
}

/// A fusion a scheduler placed: its heuristic, the refusals of the schedulers tried before
/// it, and the kernel and CUDA that checked the schedule lowers (the same a later lowering
/// of the scheduled fusion gives, so the host program reuses them).
pub struct Placed {
    pub heuristic: Heuristic,
    pub passed_over: Vec<Refusal>,
    pub lowered: (crate::kernel::Kernel, crate::codegen::CudaKernel),
}

/// What [`schedule_fusion`] found: the placement, or every scheduler's refusal.
pub type Scheduled = std::result::Result<Placed, Vec<Refusal>>;

/// Schedule the unscheduled fusion `f` in place with the first scheduler that accepts it
/// and places it, with the refusals of the schedulers tried before it; `Ok(Err(refusals))`
/// when none does (one refusal per scheduler).
pub fn schedule_fusion(out: &mut Fusion, cx: &Ctx) -> Result<Scheduled> {
    if out.manually_scheduled {
        crate::bail!(
            "the fusion is already scheduled by hand; automatic scheduling only applies to unscheduled fusions"
        );
    }
    let mut base = out.clone();
    super::canonical::private_broadcasts(&mut base)?;
    super::canonical::reread_outputs(&mut base)?;
    let f = &mut base;
    if let Some((t, i, j)) = super::canonical::self_mapping(f) {
        let reason = format!(
            "{}: axes {i} and {j} map to each other (one tensor is broadcast into both); no loop nest computes it once for both",
            f.tv_name(t)
        );
        return Ok(Err(vec![Refusal { scheduler: "any", reason }]));
    }
    let mut refusals = Vec::new();
    for s in REGISTRY {
        if let Err(reason) = s.accepts(f, cx) {
            refusals.push(Refusal { scheduler: s.name(), reason });
            continue;
        }
        let mut g = f.clone();
        let sh = shape(&g);
        let specialized =
            if sh.permutes == 0 { specialize_reduced_extents(&mut g, &sh.reductions, &cx.extents) } else { Vec::new() };
        match s.schedule(&mut g, cx) {
            Ok(mut h) => {
                super::settle_inlining(&mut g)?;
                super::drop_unvectorized_hints(&mut g);
                h.specialized.extend(specialized);
                // A schedule that does not lower (or print) is one this scheduler cannot
                // place after all: the next one may.
                let lowered = crate::lower::lower(&g)
                    .and_then(|k| crate::codegen::generate(&k, false).map(|c| (k, c)))
                    .and_then(|(k, c)| {
                        // Nor one whose block the inputs at hand make invalid (a thread
                        // dimension sized by an axis the heuristic did not size it by). Grids
                        // too large for any GPU are the inputs' fault, reported by the plan.
                        let env = |sym: crate::ir::scalar::Symbol| match sym {
                            crate::ir::scalar::Symbol::Extent(n) => cx.extents.get(n as usize).copied(),
                            crate::ir::scalar::Symbol::ScalarInput(n) => cx.scalars.get(n as usize).copied().flatten(),
                            _ => None,
                        };
                        let block = k.launch.block.map(|v| k.fusion.scalars.eval(v, &env).ok());
                        crate::kernel::check_launch_dims([None; 3], block, None)?;
                        Ok((k, c))
                    });
                match lowered {
                    Ok(lowered) => {
                        *out = g;
                        return Ok(Ok(Placed { heuristic: h, passed_over: refusals, lowered }));
                    }
                    Err(e) if e.kind == ErrorKind::Internal => return Err(e),
                    Err(e) => refusals.push(Refusal {
                        scheduler: s.name(),
                        reason: format!("the {} schedule does not lower: {}", h.kind(), e.message),
                    }),
                }
            }
            Err(e) if e.kind == ErrorKind::Internal => return Err(e),
            Err(e) => refusals.push(Refusal { scheduler: s.name(), reason: e.message }),
        }
    }
    Ok(Err(refusals))
}
