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
mod mbarrier;
pub mod prog;
pub mod values;

use rustc_hash::FxHashMap;

use crate::error::{KilnError, Result};
use crate::host::bind::{bind_args, Arg};
use crate::host::eval::{InputDesc, ScalarArg};
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

    /// `unwritten`, or an error naming `what` where the memory cannot be had.
    pub fn try_unwritten(dtype: DataType, n: usize, what: &str) -> Result<Self> {
        let Data::Bool(written) = Data::try_zeros(DataType::Bool, n, what)? else {
            unreachable!("a Bool buffer holds bools")
        };
        Ok(Buffer { data: Data::try_zeros(dtype, n, what)?, written: Some(written) })
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

/// Largest buffer the interpreter allocates (elements): it runs every thread of a grid on
/// the CPU, so anything larger is out of its reach (and would exhaust host memory).
pub const MAX_HOST_ELEMENTS: i64 = 1 << 31;

/// The memory the interpreter's buffers of one kernel may take: what the machine has
/// available when the kernel starts. Past it the allocations would fail (aborting the
/// process) or push the machine into swap; the kernel is refused instead.
struct MemoryBudget {
    left: u64,
    used: u64,
}

impl MemoryBudget {
    fn of_this_machine() -> Self {
        // Linux: MemAvailable in /proc/meminfo (kB); elsewhere no limit but the allocator's.
        let avail = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
                .map(|kb| kb.saturating_mul(1024))
        });
        MemoryBudget { left: avail.unwrap_or(u64::MAX), used: 0 }
    }

    /// Take `n` elements of `dtype` for buffer `what`, with their written flags and the
    /// 16 bytes per element of the race checks on Global memory.
    fn take(&mut self, what: &str, n: usize, dtype: DataType) -> Result<()> {
        let bytes = (n as u64).saturating_mul(dtype.size_bytes() as u64 + 17);
        self.used = self.used.saturating_add(bytes);
        if self.used > self.left {
            return Err(KilnError::value(format!(
                "{what}: the CPU interpreter needs {} bytes for this kernel's buffers so far, more than the {} bytes of memory available (run it on a GPU, or with smaller inputs)",
                self.used, self.left
            )));
        }
        Ok(())
    }
}

fn host_elements(name: String, n: i64) -> Result<usize> {
    if !(0..=MAX_HOST_ELEMENTS).contains(&n) {
        return Err(KilnError::value(format!(
            "{name}: {n} elements; the CPU interpreter allocates at most 2^31 elements per tensor (run it on a GPU)"
        )));
    }
    Ok(n as usize)
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
    // The input contract is the GPU plan's: one binding for both.
    let mut args = Vec::with_capacity(inputs.len());
    for v in &inputs {
        args.push(match v {
            HostValue::Tensor(t) => {
                if t.strides.iter().any(|&s| s < 0) || t.span() > t.data.len() {
                    return Err(KilnError::value(format!(
                        "input {}: strides {:?} of shape {:?} reach past its {} elements or are negative",
                        args.len(),
                        t.strides,
                        t.shape,
                        t.data.len()
                    )));
                }
                Arg::Tensor {
                    dtype: Ok(Some(t.data.dtype())),
                    desc: InputDesc { sizes: t.shape.iter().map(|&s| s as i64).collect(), strides: t.strides.clone() },
                }
            }
            HostValue::Scalar(ScalarValue::Bool(x)) => Arg::Scalar(ScalarArg::Bool(*x)),
            HostValue::Scalar(ScalarValue::Int(x)) => Arg::Scalar(ScalarArg::Int(*x)),
            HostValue::Scalar(ScalarValue::Float(x)) => Arg::Scalar(ScalarArg::Float(*x)),
        });
    }
    let bound = bind_args(f, &args)?;
    let mut b = Bindings {
        kernel_name: "kernel0".to_string(),
        extents: Vec::new(),
        strides: bound.strides,
        scalars: bound
            .scalars
            .iter()
            .enumerate()
            .map(|(n, s)| match *s {
                ScalarArg::Bool(x) => ScalarValue::Bool(x),
                ScalarArg::Int(x) => ScalarValue::Int(x),
                // A Float scalar input is a `float` kernel parameter on the GPU: rounded once
                // when it is passed, whatever reads it (an iota's start as well as a sum).
                ScalarArg::Float(x) if f.scalar_input_dtypes.get(n) == Some(&DataType::Float) => {
                    ScalarValue::Float(f64::from(x as f32))
                }
                ScalarArg::Float(x) => ScalarValue::Float(x),
            })
            .collect(),
    };
    let tensors: Vec<(TvId, HostTensor)> = f
        .inputs
        .iter()
        .zip(inputs)
        .filter_map(|(op, v)| match (op, v) {
            (Operand::Tensor(tv), HostValue::Tensor(t)) => Some((*tv, t)),
            _ => None,
        })
        .collect();
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

    // Outputs: contiguous in allocation order, viewed in logical order.
    let mut budget = MemoryBudget::of_this_machine();
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
        let n = host_elements(f.tv_name(tv), acc)?;
        budget.take(&f.tv_name(tv), n, t.dtype)?;
        buffers.push(Buffer::try_unwritten(t.dtype, n, &f.tv_name(tv))?);
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
        let n = host_elements(g.name.clone(), n)?;
        budget.take(&g.name, n, g.dtype)?;
        buffers.push(if g.zero_init {
            Buffer::new(Data::try_zeros(g.dtype, n, &g.name)?)
        } else {
            Buffer::try_unwritten(g.dtype, n, &g.name)?
        });
    }
    // A kernel with no element to write does not run (the GPU plan does not launch it).
    let nothing_to_write = views.iter().all(|(shape, _)| shape.contains(&0));
    let stats = if nothing_to_write { Stats::default() } else { exec::run(kernel, &b, &mut buffers)? };
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
