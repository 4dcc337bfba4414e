//! Shape evaluation: input sizes/strides in, a concrete plan out (every buffer's size,
//! output layouts, launch dims, scalar kernel arguments). One call, no symbolic work
//! left for the caller; callers cache the plan per input signature.

use rustc_hash::FxHashMap;

use crate::bail;
use crate::codegen::{CudaKernel, ParamKind};
use crate::error::{KilnError, Result};
use crate::ir::{DataType, Fusion, IterType, Scalars, Symbol, TvId, ValId};
use crate::kernel::Kernel;

/// Sizes and element strides of one tensor input.
#[derive(Clone, Debug)]
pub struct InputDesc {
    pub sizes: Vec<i64>,
    pub strides: Vec<i64>,
}

/// How to allocate one output: logical sizes and the order its axes are laid out in.
#[derive(Clone, Debug)]
pub struct OutputPlan {
    pub sizes: Vec<i64>,
    /// `perm[k]` is the logical axis stored k-th (outermost first).
    pub layout: Vec<usize>,
    pub dtype: DataType,
}

/// A global buffer to allocate.
#[derive(Clone, Debug)]
pub struct BufferPlan {
    pub name: String,
    pub elements: i64,
    pub dtype: DataType,
    pub zero_init: bool,
    pub resets_to_zero: bool,
}

/// A scalar kernel argument.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScalarArg {
    Int(i64),
    Float(f64),
    Bool(bool),
}

/// Launch configuration and scalar arguments (with their parameter dtypes) of one kernel.
#[derive(Clone, Debug)]
pub struct LaunchPlan {
    pub scalar_args: Vec<(ScalarArg, DataType)>,
    pub grid: [i64; 3],
    pub block: [i64; 3],
    pub smem_bytes: i64,
    /// True when every offset of this launch fits in 32 bits: use the int32-index variant
    /// (its size and stride parameters are then `Int32`).
    pub index32: bool,
}

/// Everything needed to launch a kernel for concrete inputs.
#[derive(Clone, Debug)]
pub struct Plan {
    pub outputs: Vec<OutputPlan>,
    pub buffers: Vec<BufferPlan>,
    /// Scalar parameters in kernel parameter order (after the tensor parameters).
    pub scalar_args: Vec<ScalarArg>,
    pub grid: [i64; 3],
    pub block: [i64; 3],
    pub smem_bytes: i64,
    /// True when every offset fits in 32 bits: the int32-index variant of the kernel is safe.
    pub index32: bool,
}

/// Concrete values of the symbols of a fusion (sizes `i{n}`, input strides, scalar
/// inputs), bound once from the ORIGINAL fusion inputs; every kernel of a host program
/// evaluates its expressions against the same bindings.
#[derive(Clone, Debug, Default)]
pub struct Bindings {
    pub extents: Vec<i64>,
    pub strides: FxHashMap<(TvId, u32), i64>,
    pub scalars: Vec<ScalarArg>,
}

impl Bindings {
    /// Evaluate an integer expression of the arena `sc` over sizes and strides.
    pub fn eval(&self, sc: &Scalars, v: ValId) -> Result<i64> {
        let env = |s: Symbol| match s {
            Symbol::Extent(n) => self.extents.get(n as usize).copied().filter(|&e| e >= 0),
            Symbol::Stride(t, a) => self.strides.get(&(t, a)).copied(),
            Symbol::ScalarInput(n) => match self.scalars.get(n as usize) {
                Some(ScalarArg::Int(i)) => Some(*i),
                Some(ScalarArg::Bool(b)) => Some(*b as i64),
                _ => None,
            },
            _ => None,
        };
        sc.eval(v, &env)
    }
}

/// Check the extents `kernel` aligns agree under `b`.
pub fn check_constraints(kernel: &Kernel, b: &Bindings) -> Result<()> {
    let sc = &kernel.fusion.scalars;
    for (x, y, _) in &kernel.size_constraints {
        b.eval(sc, *x)?;
        b.eval(sc, *y)?;
    }
    match kernel.size_violation(|v| b.eval(sc, v).ok()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Launch dims, dynamic shared memory and scalar arguments of `kernel` under `b`.
pub fn kernel_launch(kernel: &Kernel, cuda: &CudaKernel, b: &Bindings) -> Result<LaunchPlan> {
    let sc = &kernel.fusion.scalars;
    let mut scalar_args = Vec::new();
    for (name, kind, dtype) in &cuda.params {
        match kind {
            ParamKind::Extent(n) => {
                let v = b.extents.get(*n as usize).copied().unwrap_or(-1);
                if v < 0 {
                    bail!(
                        "{name}: this kernel's inputs do not carry size i{n}; run it through the fusion's host program"
                    );
                }
                scalar_args.push((ScalarArg::Int(v), *dtype))
            }
            ParamKind::Stride(t, a) => {
                let Some(&s) = b.strides.get(&(*t, *a)) else {
                    let tensor = kernel.fusion.tv_name(*t);
                    bail!(
                        "{tensor}: axis {a} is marked non-contiguous (set_allocation_domain), which only a fusion input may be: its strides come from the array passed in; a tensor kiln writes is laid out contiguously (mark the axis contiguous)"
                    );
                };
                scalar_args.push((ScalarArg::Int(s), *dtype));
            }
            ParamKind::Scalar(n) => scalar_args.push((
                *b.scalars.get(*n as usize).ok_or_else(|| KilnError::value(format!("scalar input s{n} missing")))?,
                *dtype,
            )),
            _ => {}
        }
    }
    let l = &kernel.launch;
    let grid = [b.eval(sc, l.grid[0])?, b.eval(sc, l.grid[1])?, b.eval(sc, l.grid[2])?];
    let block = [b.eval(sc, l.block[0])?, b.eval(sc, l.block[1])?, b.eval(sc, l.block[2])?];
    let smem_bytes = b.eval(sc, l.smem_bytes)?;
    kernel.check_launch(|v| b.eval(sc, v).ok())?;
    // Largest element offset any access can form: every allocation's last element,
    // every global buffer, and the linear thread index (2x margin for tiles that step
    // past a tensor's end before their predicates apply).
    let mut span = grid.iter().chain(block.iter()).map(|&d| d.max(1)).fold(1i64, |a, x| a.saturating_mul(x));
    for info in kernel.allocations.values() {
        let mut last = 0i64;
        for (&id, &stride) in info.ids.iter().zip(&info.strides) {
            let (e, st) = (b.eval(sc, kernel.fusion.ids[id].extent)?, b.eval(sc, stride)?);
            last = last.saturating_add((e - 1).max(0).saturating_mul(st.abs()));
        }
        span = span.max(last.saturating_add(1));
    }
    for g in &kernel.summary.global_allocations {
        let mut n = 1i64;
        for &e in &g.shape {
            n = n.saturating_mul(b.eval(sc, e)?);
        }
        span = span.max(n);
    }
    for &e in &b.extents {
        span = span.max(e);
    }
    span = span.max(largest_tensor(&kernel.fusion, b));
    let index32 = offsets_fit_int32(span, &kernel.fusion, b);
    if index32 {
        for ((_, kind, _), (_, dt)) in cuda
            .params
            .iter()
            .filter(|(_, k, _)| matches!(k, ParamKind::Extent(_) | ParamKind::Stride(..) | ParamKind::Scalar(_)))
            .zip(scalar_args.iter_mut())
        {
            if matches!(kind, ParamKind::Extent(_) | ParamKind::Stride(..)) {
                *dt = DataType::Int32;
            }
        }
    }
    Ok(LaunchPlan { scalar_args, grid, block, smem_bytes, index32 })
}

/// Sizes and storage order of output `tv` of `f` under `b`.
pub fn output_plan(f: &Fusion, sc: &Scalars, tv: TvId, b: &Bindings) -> Result<OutputPlan> {
    let logical = f.no_reduction_logical(tv);
    let sizes = logical.iter().map(|&id| b.eval(sc, f.ids[id].extent)).collect::<Result<Vec<_>>>()?;
    let alloc: Vec<_> =
        f.tvs[tv].maybe_allocation().iter().copied().filter(|&id| f.ids[id].iter_type != IterType::Reduction).collect();
    let layout =
        alloc.iter().map(|id| logical.iter().position(|l| l == id)).collect::<Option<Vec<_>>>().ok_or_else(|| {
            KilnError::value(format!(
                "output {}: its allocation domain must be a permutation of its logical axes",
                f.tv_name(tv)
            ))
        })?;
    Ok(OutputPlan { sizes, layout, dtype: f.tvs[tv].dtype })
}

/// Evaluate the plan of `kernel` (generated as `cuda`) for concrete inputs of the kernel.
pub fn plan(kernel: &Kernel, cuda: &CudaKernel, inputs: &[InputDesc], scalars: &[ScalarArg]) -> Result<Plan> {
    let f = &kernel.fusion;
    let sc = &f.scalars;
    let b = crate::host::bind::bind(f, inputs, scalars)?;
    check_constraints(kernel, &b)?;
    let outputs = f.outputs.iter().map(|&tv| output_plan(f, sc, tv, &b)).collect::<Result<Vec<_>>>()?;
    let mut buffers = Vec::new();
    for g in &kernel.summary.global_allocations {
        let mut n = 1i64;
        for &e in &g.shape {
            n = n.saturating_mul(b.eval(sc, e)?);
        }
        buffers.push(BufferPlan {
            name: g.name.clone(),
            elements: n,
            dtype: g.dtype,
            zero_init: g.zero_init,
            resets_to_zero: g.resets_to_zero,
        });
    }
    let l = kernel_launch(kernel, cuda, &b)?;
    let index32 = fits_int32(f, inputs, &outputs, &buffers, &b, &l);
    Ok(Plan {
        outputs,
        buffers,
        scalar_args: l.scalar_args.into_iter().map(|(a, _)| a).collect(),
        grid: l.grid,
        block: l.block,
        smem_bytes: l.smem_bytes,
        index32,
    })
}

/// Elements of the largest tensor of `f` (unknown sizes count as unbounded): a reshape or
/// slice of an expanded input, and random numbers, index by row-major positions that pass
/// any buffer's span.
fn largest_tensor(f: &crate::ir::Fusion, b: &Bindings) -> i64 {
    f.tvs
        .values()
        .map(|t| {
            t.logical.iter().fold(1i64, |n, &id| {
                n.saturating_mul(b.eval(&f.scalars, f.ids[id].extent).map_or(i64::MAX, |e| e.max(1)))
            })
        })
        .max()
        .unwrap_or(0)
}

/// True when every element offset the kernel can form fits in 32 bits: tensor spans,
/// buffers, sizes, every tensor's element count, and the linear thread index (see
/// [`offsets_fit_int32`] for the room left to rounded-up loops).
fn fits_int32(
    f: &crate::ir::Fusion,
    inputs: &[InputDesc],
    outputs: &[OutputPlan],
    buffers: &[BufferPlan],
    b: &Bindings,
    l: &LaunchPlan,
) -> bool {
    let mut span = l.grid.iter().chain(l.block.iter()).map(|&d| d.max(1)).fold(1i64, |a, x| a.saturating_mul(x));
    for d in inputs {
        let s =
            d.sizes.iter().zip(&d.strides).map(|(&n, &st)| (n - 1).max(0).saturating_mul(st.abs())).sum::<i64>() + 1;
        span = span.max(s);
    }
    for o in outputs {
        span = span.max(o.sizes.iter().product::<i64>());
    }
    for x in buffers {
        span = span.max(x.elements);
    }
    for &e in &b.extents {
        span = span.max(e);
    }
    offsets_fit_int32(span.max(largest_tensor(f, b)), f, b)
}

/// True when offsets up to `span` elements fit in 32 bits: with room for loops that round
/// up past a tensor's end before predicates apply (twice `span`), unless every split of
/// `f` divides its extent under `b`, when no loop passes an end.
fn offsets_fit_int32(span: i64, f: &Fusion, b: &Bindings) -> bool {
    let margin = if loops_round_up(f, b) { 2 } else { 1 };
    span.max(1).saturating_mul(margin).saturating_add(2) < i64::from(i32::MAX)
}

/// True when some split of `f` (of an axis that advances an index: not a broadcast) does
/// not divide its extent under `b`, or either is not known.
fn loops_round_up(f: &Fusion, b: &Bindings) -> bool {
    use crate::ir::{IterType, Transform};
    f.transforms.values().any(|t| {
        let Transform::Split { input, factor, .. } = *t else { return false };
        if f.ids[input].iter_type == IterType::Broadcast {
            return false;
        }
        match (b.eval(&f.scalars, f.ids[input].extent), b.eval(&f.scalars, factor)) {
            (Ok(n), Ok(by)) => by <= 0 || n % by != 0,
            _ => true,
        }
    })
}
