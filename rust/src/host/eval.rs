//! Shape evaluation: input sizes/strides in, a concrete plan out (every buffer's size,
//! output layouts, launch dims, scalar kernel arguments). One call, no symbolic work
//! left for the caller; callers cache the plan per input signature.

use rustc_hash::FxHashMap;

use crate::bail;
use crate::codegen::{CudaKernel, ParamKind};
use crate::error::{KilnError, Result};
use crate::ir::{DataType, IterType, Symbol, TvId, ValId};
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

/// Bindings of the symbols of a kernel for concrete inputs.
pub struct Env<'a> {
    pub kernel: &'a Kernel,
    pub extents: Vec<i64>,
    pub strides: FxHashMap<(TvId, u32), i64>,
    pub scalars: Vec<ScalarArg>,
}

impl Env<'_> {
    /// Evaluate an integer expression over sizes and strides.
    pub fn eval(&self, v: ValId) -> Result<i64> {
        let env = |s: Symbol| match s {
            Symbol::Extent(n) => self.extents.get(n as usize).copied(),
            Symbol::Stride(t, a) => self.strides.get(&(t, a)).copied(),
            Symbol::ScalarInput(n) => match self.scalars.get(n as usize) {
                Some(ScalarArg::Int(i)) => Some(*i),
                Some(ScalarArg::Bool(b)) => Some(*b as i64),
                _ => None,
            },
            _ => None,
        };
        self.kernel.fusion.scalars.eval(v, &env)
    }
}

/// Bind input sizes/strides and check them against the definition.
pub fn bind<'a>(kernel: &'a Kernel, inputs: &[InputDesc], scalars: &[ScalarArg]) -> Result<Env<'a>> {
    let f = &kernel.fusion;
    let tensor_inputs: Vec<TvId> = f.inputs.iter().filter_map(|o| o.tensor()).collect();
    if inputs.len() != tensor_inputs.len() {
        bail!("the fusion takes {} tensor inputs but {} were given", tensor_inputs.len(), inputs.len());
    }
    let pos: FxHashMap<TvId, usize> = tensor_inputs.iter().enumerate().map(|(i, &t)| (t, i)).collect();
    let mut extents = Vec::with_capacity(f.extent_sources.len());
    for &(tv, axis) in &f.extent_sources {
        let d = &inputs[pos[&tv]];
        let Some(&s) = d.sizes.get(axis) else {
            bail!("input {} ({}): rank {} but axis {axis} is needed", pos[&tv], f.tv_name(tv), d.sizes.len());
        };
        extents.push(s);
    }
    let mut strides = FxHashMap::default();
    for (&tv, &i) in &pos {
        let d = &inputs[i];
        let logical = f.no_reduction_logical(tv);
        if d.sizes.len() != logical.len() || d.strides.len() != logical.len() {
            bail!(
                "input {i} ({}): rank {} does not match the definition's rank {}",
                f.tv_name(tv),
                d.sizes.len(),
                logical.len()
            );
        }
        for (axis, &id) in logical.iter().enumerate() {
            let want = &f.ids[id];
            if want.iter_type == IterType::Broadcast && d.sizes[axis] != 1 {
                bail!(
                    "input {i} ({}): axis {axis} has size {} but is declared a broadcast (size 1)",
                    f.tv_name(tv),
                    d.sizes[axis]
                );
            }
            if let Some(c) = f.scalars.as_int(want.extent) {
                if c != d.sizes[axis] {
                    bail!(
                        "input {i} ({}): axis {axis} has size {} but the definition fixes it to {c}",
                        f.tv_name(tv),
                        d.sizes[axis]
                    );
                }
            }
        }
        // Runtime strides of the allocation domain, skipping reductions.
        let alloc = f.tvs[tv].maybe_allocation().to_vec();
        let mut k = 0u32;
        for id in alloc {
            if f.ids[id].iter_type == IterType::Reduction {
                continue;
            }
            let axis = logical.iter().position(|&l| l == id).ok_or_else(|| {
                KilnError::value(format!(
                    "input {i} ({}): its allocation domain must be a permutation of its logical axes",
                    f.tv_name(tv)
                ))
            })?;
            strides.insert((tv, k), d.strides[axis]);
            k += 1;
        }
        check_contiguity(f, tv, i, d)?;
    }
    let env = Env { kernel, extents, strides, scalars: scalars.to_vec() };
    for (a, b, what) in &kernel.size_constraints {
        let (x, y) = (env.eval(*a)?, env.eval(*b)?);
        if x != y {
            bail!("{what}: sizes {x} and {y} must be equal");
        }
    }
    Ok(env)
}

/// Strides must match what the definition's contiguity promises.
fn check_contiguity(f: &crate::ir::Fusion, tv: TvId, i: usize, d: &InputDesc) -> Result<()> {
    let t = &f.tvs[tv];
    let logical = f.no_reduction_logical(tv);
    let alloc: Vec<_> =
        t.maybe_allocation().iter().copied().filter(|&id| f.ids[id].iter_type != IterType::Reduction).collect();
    let contig: Vec<Option<bool>> = t
        .maybe_allocation()
        .iter()
        .zip(&t.contiguity)
        .filter(|(id, _)| f.ids[**id].iter_type != IterType::Reduction)
        .map(|(_, c)| *c)
        .collect();
    let mut expected = 1i64;
    for (k, &id) in alloc.iter().enumerate().rev() {
        let Some(axis) = logical.iter().position(|&l| l == id) else {
            continue;
        };
        let (size, stride) = (d.sizes[axis], d.strides[axis]);
        match contig.get(k).copied().flatten() {
            Some(true) => {
                if size > 1 && stride != expected {
                    bail!(
                        "input {i} ({}): axis {axis} has stride {stride} but is declared contiguous (expected stride {expected}); pass a contiguous array or declare contiguity=False",
                        f.tv_name(tv)
                    );
                }
                expected = expected.saturating_mul(size.max(1));
            }
            Some(false) => expected = stride.saturating_mul(size.max(1)),
            None => {}
        }
    }
    Ok(())
}

/// Evaluate the plan of `kernel` (generated as `cuda`) for concrete inputs.
pub fn plan(kernel: &Kernel, cuda: &CudaKernel, inputs: &[InputDesc], scalars: &[ScalarArg]) -> Result<Plan> {
    let f = &kernel.fusion;
    let env = bind(kernel, inputs, scalars)?;
    let mut outputs = Vec::new();
    for &tv in &f.outputs {
        let logical = f.no_reduction_logical(tv);
        let sizes = logical.iter().map(|&id| env.eval(f.ids[id].extent)).collect::<Result<Vec<_>>>()?;
        let alloc: Vec<_> = f.tvs[tv]
            .maybe_allocation()
            .iter()
            .copied()
            .filter(|&id| f.ids[id].iter_type != IterType::Reduction)
            .collect();
        let layout =
            alloc.iter().map(|id| logical.iter().position(|l| l == id)).collect::<Option<Vec<_>>>().ok_or_else(
                || {
                    KilnError::value(format!(
                        "output {}: its allocation domain must be a permutation of its logical axes",
                        f.tv_name(tv)
                    ))
                },
            )?;
        outputs.push(OutputPlan { sizes, layout, dtype: f.tvs[tv].dtype });
    }
    let mut buffers = Vec::new();
    for b in &kernel.summary.global_allocations {
        let mut n = 1i64;
        for &e in &b.shape {
            n = n.saturating_mul(env.eval(e)?);
        }
        buffers.push(BufferPlan {
            name: b.name.clone(),
            elements: n,
            dtype: b.dtype,
            zero_init: b.zero_init,
            resets_to_zero: b.resets_to_zero,
        });
    }
    let mut scalar_args = Vec::new();
    for (name, kind, _) in &cuda.params {
        match kind {
            ParamKind::Extent(n) => scalar_args.push(ScalarArg::Int(env.extents[*n as usize])),
            ParamKind::Stride(t, a) => {
                let Some(&s) = env.strides.get(&(*t, *a)) else {
                    bail!("{name}: only inputs may have non-contiguous strides");
                };
                scalar_args.push(ScalarArg::Int(s));
            }
            ParamKind::Scalar(n) => scalar_args
                .push(*scalars.get(*n as usize).ok_or_else(|| KilnError::value(format!("scalar input s{n} missing")))?),
            _ => {}
        }
    }
    let l = &kernel.launch;
    let grid = [env.eval(l.grid[0])?, env.eval(l.grid[1])?, env.eval(l.grid[2])?];
    let block = [env.eval(l.block[0])?, env.eval(l.block[1])?, env.eval(l.block[2])?];
    let threads = block.iter().product::<i64>();
    if threads > 1024 {
        bail!("the schedule launches {threads} threads per block ({block:?}); the GPU allows at most 1024");
    }
    if grid[1] > 65535 || grid[2] > 65535 {
        bail!("the schedule launches a grid of {grid:?}; gridDim.y and gridDim.z are limited to 65535 (map the large axis to BIDx)");
    }
    let smem_bytes = env.eval(l.smem_bytes)?;
    // Largest element offset any access can form: tensor spans, buffers, and the linear
    // thread index (loops may round up past a tensor's end before predicates apply).
    let mut span = grid.iter().chain(block.iter()).map(|&d| d.max(1)).fold(1i64, |a, b| a.saturating_mul(b));
    for d in inputs {
        let s =
            d.sizes.iter().zip(&d.strides).map(|(&n, &st)| (n - 1).max(0).saturating_mul(st.abs())).sum::<i64>() + 1;
        span = span.max(s);
    }
    for o in &outputs {
        span = span.max(o.sizes.iter().product::<i64>());
    }
    for b in &buffers {
        span = span.max(b.elements);
    }
    for &e in &env.extents {
        span = span.max(e);
    }
    // Margin of 2x for index arithmetic that steps one tile past the end.
    let index32 = span.saturating_mul(2) < i64::from(i32::MAX);
    Ok(Plan { outputs, buffers, scalar_args, grid, block, smem_bytes, index32 })
}
