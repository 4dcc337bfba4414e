//! CPU interpreter of kernel IR: the oracle every scenario and random fusion is checked
//! against, and `fd.execute(numpy_arrays)`.
//!
//! The loop nest runs once in statement order, vectorised over every thread of the
//! grid (SIMT lockstep; control flow is uniform because loop extents depend only on
//! sizes). Memories are separate and checked: Global buffers (the caller's), Shared per
//! block, Local per thread. Every access is bounds-checked against its allocation,
//! reads of never-written memory are errors, and two threads of a block touching one
//! Shared element between barriers (one writing) is a race.
//!
//! Pieces: `values` (typed storage, dtype-exact element math), `prog` (index
//! expressions compiled for lane-vectorised evaluation), `exec` (the executor).

mod exec;
pub mod prog;
pub mod values;

use rustc_hash::FxHashMap;

use crate::error::{KilnError, Result};
use crate::ir::{DataType, IterType, Operand, Symbol, TvId};
use crate::kernel::Kernel;

pub use values::{Data, ScalarValue};

/// One Global buffer of a launch, with its initialisation state.
#[derive(Clone, Debug, PartialEq)]
pub struct Buffer {
    pub data: Data,
    /// Per element: written yet? `None` means fully initialised (inputs, zero_init).
    pub written: Option<Vec<bool>>,
}

impl Buffer {
    /// A fully initialised buffer.
    pub fn new(data: Data) -> Self {
        Buffer { data, written: None }
    }

    /// A buffer of `n` elements none of which is written yet.
    pub fn unwritten(dtype: DataType, n: usize) -> Self {
        Buffer { data: Data::zeros(dtype, n), written: Some(vec![false; n]) }
    }

    /// Number of elements never written (0 when fully initialised).
    pub fn unwritten_count(&self) -> usize {
        self.written.as_ref().map_or(0, |w| w.iter().filter(|&&x| !x).count())
    }
}

/// Values of the symbols of a launch.
#[derive(Clone, Debug, Default)]
pub struct Bindings {
    /// Name used in error messages.
    pub kernel_name: String,
    /// `Symbol::Extent(n)`.
    pub extents: Vec<i64>,
    /// `Symbol::Stride(tv, k)`.
    pub strides: FxHashMap<(TvId, u32), i64>,
    /// `Symbol::ScalarInput(n)`.
    pub scalars: Vec<ScalarValue>,
}

impl Bindings {
    /// The value of a size, stride or scalar-input symbol.
    pub fn symbol(&self, s: Symbol) -> Option<i64> {
        match s {
            // A negative value marks a size this kernel's inputs do not carry.
            Symbol::Extent(n) => self.extents.get(n as usize).copied().filter(|&v| v >= 0),
            Symbol::Stride(tv, k) => self.strides.get(&(tv, k)).copied(),
            Symbol::ScalarInput(n) => self.scalars.get(n as usize).map(|v| v.as_i64()),
            _ => None,
        }
    }
}

/// Counters of one run.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    /// Threads of the launch.
    pub threads: u64,
    /// Expr/Init executions summed over the threads that executed them.
    pub thread_instructions: u64,
}

/// Run `kernel` on `buffers`: the tensor inputs (in `fusion.inputs` order), the outputs
/// (in `fusion.outputs` order), then `summary.global_allocations` in order.
pub fn run_kernel(kernel: &Kernel, bindings: &Bindings, buffers: &mut [Buffer]) -> Result<()> {
    exec::run(kernel, bindings, buffers).map(|_| ())
}

/// [`run_kernel`], returning execution counters.
pub fn run_kernel_stats(kernel: &Kernel, bindings: &Bindings, buffers: &mut [Buffer]) -> Result<Stats> {
    exec::run(kernel, bindings, buffers)
}

/// A host array: element `i` (a multi-index) lives at `data[sum(i[k] * strides[k])]`.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub data: Data,
    pub shape: Vec<usize>,
    /// Element strides (non-negative).
    pub strides: Vec<i64>,
}

impl HostTensor {
    /// A contiguous row-major tensor.
    pub fn contiguous(data: Data, shape: Vec<usize>) -> Self {
        let mut strides = vec![0i64; shape.len()];
        let mut acc = 1i64;
        for k in (0..shape.len()).rev() {
            strides[k] = acc;
            acc *= shape[k] as i64;
        }
        HostTensor { data, shape, strides }
    }

    /// Elements the strides reach (0 for an empty tensor).
    pub fn span(&self) -> usize {
        if self.shape.contains(&0) {
            return 0;
        }
        1 + self.shape.iter().zip(&self.strides).map(|(&n, &s)| (n as i64 - 1) * s).sum::<i64>() as usize
    }

    /// The elements in row-major logical order.
    pub fn to_row_major(&self) -> Data {
        let n: usize = self.shape.iter().product();
        let mut idx = Vec::with_capacity(n);
        let mut cur = vec![0usize; self.shape.len()];
        for _ in 0..n {
            idx.push(cur.iter().zip(&self.strides).map(|(&i, &s)| i as i64 * s).sum::<i64>() as usize);
            for k in (0..cur.len()).rev() {
                cur[k] += 1;
                if cur[k] < self.shape[k] {
                    break;
                }
                cur[k] = 0;
            }
        }
        let col = self.data.gather(&idx);
        let mut out = Data::zeros(self.data.dtype(), n);
        let all: Vec<usize> = (0..n).collect();
        // `col` holds values of this dtype already: storing cannot fail.
        let _ = out.scatter(&all, &col);
        out
    }
}

/// A runtime argument of a fusion.
#[derive(Clone, Debug)]
pub enum HostValue {
    Tensor(HostTensor),
    Scalar(ScalarValue),
}

/// Execute a lowered kernel on host arrays: binds sizes and strides, allocates the
/// outputs (contiguous in their allocation order, returned as logical-order views) and
/// the summary's global buffers (zero-filled when `zero_init`), runs the kernel, and
/// checks that every output element was written.
pub fn execute(kernel: &Kernel, inputs: Vec<HostValue>) -> Result<Vec<HostTensor>> {
    execute_stats(kernel, inputs).map(|(o, _)| o)
}

/// [`execute`], returning execution counters too.
pub fn execute_stats(kernel: &Kernel, inputs: Vec<HostValue>) -> Result<(Vec<HostTensor>, Stats)> {
    let f = &kernel.fusion;
    if inputs.len() != f.inputs.len() {
        return Err(KilnError::value(format!(
            "the fusion takes {} inputs but {} were given",
            f.inputs.len(),
            inputs.len()
        )));
    }
    let mut b = Bindings { kernel_name: "kernel0".to_string(), ..Bindings::default() };
    let mut tensors: Vec<(TvId, HostTensor)> = Vec::new();
    for (i, (op, v)) in f.inputs.iter().zip(inputs).enumerate() {
        match (op, v) {
            (Operand::Tensor(tv), HostValue::Tensor(t)) => {
                let tv = *tv;
                let want = f.tvs[tv].dtype;
                if t.data.dtype() != want {
                    return Err(KilnError::type_error(format!(
                        "input {i} ({}): dtype {} does not match the definition's {}",
                        f.tv_name(tv),
                        t.data.dtype().enum_name(),
                        want.enum_name()
                    )));
                }
                let rank = f.tvs[tv].logical.len();
                if t.shape.len() != rank || t.strides.len() != rank {
                    return Err(KilnError::value(format!(
                        "input {i} ({}): rank {} does not match the definition's rank {rank}",
                        f.tv_name(tv),
                        t.shape.len()
                    )));
                }
                if t.strides.iter().any(|&s| s < 0) || t.span() > t.data.len() {
                    return Err(KilnError::value(format!(
                        "input {i} ({}): strides {:?} of shape {:?} reach past its {} elements or are negative",
                        f.tv_name(tv),
                        t.strides,
                        t.shape,
                        t.data.len()
                    )));
                }
                for (axis, &id) in f.tvs[tv].logical.iter().enumerate() {
                    if let Some(e) = f.scalars.as_int(f.ids[id].extent) {
                        if e != t.shape[axis] as i64 {
                            return Err(KilnError::value(format!(
                                "input {i} ({}): axis {axis} has size {} but the definition fixes it to {e}",
                                f.tv_name(tv),
                                t.shape[axis]
                            )));
                        }
                    }
                }
                // Runtime strides: the k-th non-reduction dim of the allocation domain.
                let logical = &f.tvs[tv].logical;
                for (k, id) in f.tvs[tv].maybe_allocation().iter().enumerate() {
                    if let Some(p) = logical.iter().position(|x| x == id) {
                        b.strides.insert((tv, k as u32), t.strides[p]);
                    }
                }
                tensors.push((tv, t));
            }
            (Operand::Scalar(v), HostValue::Scalar(s)) => {
                let Some(crate::ir::scalar::Val::Symbol(Symbol::ScalarInput(n))) = Some(f.scalars.get(*v)) else {
                    crate::bail_internal!("scalar input {i} is not a scalar-input symbol");
                };
                let dt = f.scalar_input_dtypes.get(n as usize).copied().unwrap_or(DataType::Double);
                let s = match (dt, s) {
                    (d, ScalarValue::Int(x)) if d.is_float() => ScalarValue::Float(x as f64),
                    (d, ScalarValue::Bool(x)) if d.is_float() => ScalarValue::Float(x as u8 as f64),
                    (d, ScalarValue::Bool(x)) if d.is_integer() => ScalarValue::Int(x as i64),
                    (d, ScalarValue::Float(x)) if !d.is_float() => {
                        return Err(KilnError::type_error(format!(
                            "input {i} (s{n}): got float {x} for a {} scalar",
                            d.enum_name()
                        )))
                    }
                    (_, s) => s,
                };
                if b.scalars.len() <= n as usize {
                    b.scalars.resize(n as usize + 1, ScalarValue::Int(0));
                }
                b.scalars[n as usize] = s;
            }
            (Operand::Tensor(tv), HostValue::Scalar(_)) => {
                return Err(KilnError::type_error(format!(
                    "input {i} ({}): expected an array, got a scalar",
                    f.tv_name(*tv)
                )))
            }
            (Operand::Scalar(_), HostValue::Tensor(_)) => {
                return Err(KilnError::type_error(format!("input {i}: expected a scalar, got an array")))
            }
        }
    }
    for (n, &(tv, axis)) in f.extent_sources.iter().enumerate() {
        let size = match tensors.iter().find(|(x, _)| *x == tv) {
            Some((_, t)) => t.shape.get(axis).map(|&s| s as i64),
            // A later segment of a host program: the size may come from an intermediate
            // input whose axis has this extent; else this kernel does not use it.
            None => {
                let sym = f.scalars.symbol_id(Symbol::Extent(n as u32));
                tensors.iter().find_map(|(x, t)| {
                    let axis = f.no_reduction_logical(*x).iter().position(|&id| Some(f.ids[id].extent) == sym)?;
                    t.shape.get(axis).map(|&s| s as i64)
                })
            }
        };
        b.extents.push(size.unwrap_or(-1));
    }
    let eval = |b: &Bindings, v| f.scalars.eval(v, &|s| b.symbol(s));
    // Sizes the definition makes equal are checked before anything runs, as the GPU plan does.
    if let Some(e) = kernel.size_violation(|v| eval(&b, v).ok()) {
        return Err(e);
    }
    if let Some(e) = kernel.launch_violation(|v| eval(&b, v).ok()) {
        return Err(e);
    }

    // Outputs: contiguous in allocation order, viewed in logical order.
    let mut views: Vec<(Vec<usize>, Vec<i64>)> = Vec::new();
    let mut buffers: Vec<Buffer> = tensors.into_iter().map(|(_, t)| Buffer::new(t.data)).collect();
    for &tv in &f.outputs {
        let t = &f.tvs[tv];
        let alloc: Vec<_> =
            t.maybe_allocation().iter().copied().filter(|&id| f.ids[id].iter_type != IterType::Reduction).collect();
        let mut ext = Vec::with_capacity(alloc.len());
        for &id in &alloc {
            ext.push(eval(&b, f.ids[id].extent)?.max(0));
        }
        let mut strides = vec![0i64; alloc.len()];
        let mut acc = 1i64;
        for k in (0..alloc.len()).rev() {
            strides[k] = acc;
            acc = acc.saturating_mul(ext[k]);
        }
        for (k, &s) in strides.iter().enumerate() {
            b.strides.insert((tv, k as u32), s);
        }
        let mut shape = Vec::new();
        let mut vstrides = Vec::new();
        for id in f.no_reduction_logical(tv) {
            let Some(p) = alloc.iter().position(|&x| x == id) else {
                return Err(KilnError::value(format!(
                    "output {}: its allocation domain is not a permutation of its logical domain; the interpreter cannot return it",
                    f.tv_name(tv)
                )));
            };
            shape.push(ext[p] as usize);
            vstrides.push(strides[p]);
        }
        buffers.push(Buffer::unwritten(t.dtype, acc as usize));
        views.push((shape, vstrides));
    }
    for g in &kernel.summary.global_allocations {
        let mut n: i64 = 1;
        for &s in &g.shape {
            n = n.saturating_mul(eval(&b, s)?.max(0));
        }
        if let Some(tv) = g.tv {
            let mut acc = 1i64;
            let ids: Vec<_> = f.tvs[tv]
                .maybe_allocation()
                .iter()
                .copied()
                .filter(|&id| f.ids[id].iter_type != IterType::Reduction)
                .collect();
            for k in (0..ids.len()).rev() {
                b.strides.insert((tv, k as u32), acc);
                acc = acc.saturating_mul(eval(&b, f.ids[ids[k]].extent)?.max(0));
            }
        }
        buffers.push(if g.zero_init {
            Buffer::new(Data::zeros(g.dtype, n as usize))
        } else {
            Buffer::unwritten(g.dtype, n as usize)
        });
    }
    let stats = exec::run(kernel, &b, &mut buffers)?;
    let n_in = buffers.len() - f.outputs.len() - kernel.summary.global_allocations.len();
    let mut outs = Vec::new();
    for (j, ((shape, strides), buf)) in views.into_iter().zip(buffers.drain(n_in..n_in + f.outputs.len())).enumerate() {
        let missing = buf.unwritten_count();
        if missing > 0 {
            let first = buf.written.as_ref().and_then(|w| w.iter().position(|&x| !x)).unwrap_or(0);
            return Err(KilnError::value(format!(
                "kernel {}: output {} ({}): {missing} of {} elements were never written (first at index {first})",
                b.kernel_name,
                j,
                f.tv_name(f.outputs[j]),
                buf.data.len()
            )));
        }
        outs.push(HostTensor { data: buf.data, shape, strides });
    }
    Ok((outs, stats))
}

#[cfg(test)]
mod tests;
