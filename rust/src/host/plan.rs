//! Concrete plan of a host program for concrete inputs: every buffer's size and place,
//! every launch's dims and scalar arguments, and a liveness-based memory plan.
//!
//! Memory plan: fusion outputs are separate allocations (they are handed back).
//! `zero_init && resets_to_zero` buffers live in a zeroed pool (zeroed once by the
//! evaluator; the kernels leave it at zero, so regions are reused within a call and
//! across calls). Every other buffer lives in one workspace arena; a region freed by a
//! Deallocate is reused by later Allocates (first fit). `zero_init` buffers without
//! `resets_to_zero` are zeroed right before the launch that uses them.

use std::sync::{Arc, Mutex};

use rustc_hash::FxHashMap;

use crate::error::{KilnError, Result};
use crate::host::bind::bind;
use crate::host::eval::{check_constraints, kernel_launch, output_plan, Bindings};
use crate::host::eval::{InputDesc, LaunchPlan, ScalarArg};
use crate::host::ir::{BufId, BufferRole, HostInstr, HostProgram};
use crate::ir::DataType;

/// Alignment of arena and pool regions (bytes).
pub const ALIGN: i64 = 256;

/// Where a buffer's memory comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// The caller's tensor input `n`.
    Input(usize),
    /// A fresh allocation handed back as fusion output `n`.
    Output(usize),
    /// Byte offset in the workspace arena.
    Arena(i64),
    /// Byte offset in the zeroed pool.
    ZeroPool(i64),
    /// Error word `n` of the program (four int64 each, in host memory the device can
    /// write: the host reads them at the next call without a sync).
    ErrorWord(usize),
}

/// One buffer of a concrete plan.
#[derive(Clone, Debug)]
pub struct BufferAlloc {
    pub name: String,
    pub dtype: DataType,
    /// Logical sizes (outputs and intermediates) or `[elements]` (kernel buffers).
    pub sizes: Vec<i64>,
    /// Storage order of `sizes` (`layout[k]` is the axis stored k-th).
    pub layout: Vec<usize>,
    pub elements: i64,
    pub bytes: i64,
    pub zero_init: bool,
    pub resets_to_zero: bool,
    pub place: Place,
}

/// One launch of a concrete plan.
#[derive(Clone, Debug)]
pub struct KernelLaunch {
    pub kernel: usize,
    /// Buffers in kernel parameter order: inputs, outputs, intermediates.
    pub args: Vec<BufId>,
    /// Buffers to zero right before this launch (`zero_init` without `resets_to_zero`).
    pub memsets: Vec<BufId>,
    pub launch: LaunchPlan,
}

/// A host program evaluated for concrete inputs.
#[derive(Clone, Debug)]
pub struct ProgramPlan {
    pub buffers: Vec<BufferAlloc>,
    pub launches: Vec<KernelLaunch>,
    /// Largest total of simultaneously live buffers (bytes, unaligned), outputs included.
    pub peak_bytes: i64,
    pub arena_bytes: i64,
    pub zero_pool_bytes: i64,
}

/// First-fit allocator over one region that grows at its end.
#[derive(Default)]
struct Region {
    /// Free blocks (offset, size), sorted by offset.
    free: Vec<(i64, i64)>,
    end: i64,
}

impl Region {
    fn alloc(&mut self, bytes: i64) -> i64 {
        let size = (bytes.max(1) + ALIGN - 1) / ALIGN * ALIGN;
        if let Some(i) = self.free.iter().position(|&(_, s)| s >= size) {
            let (off, s) = self.free[i];
            if s == size {
                self.free.remove(i);
            } else {
                self.free[i] = (off + size, s - size);
            }
            return off;
        }
        // Grow, absorbing a free block that ends at the top.
        if let Some(&(off, s)) = self.free.last() {
            if off + s == self.end {
                self.free.pop();
                self.end = off + size;
                return off;
            }
        }
        let off = self.end;
        self.end += size;
        off
    }

    fn release(&mut self, off: i64, bytes: i64) {
        let size = (bytes.max(1) + ALIGN - 1) / ALIGN * ALIGN;
        let i = self.free.partition_point(|&(o, _)| o < off);
        self.free.insert(i, (off, size));
        // Coalesce neighbours.
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }
}

/// The largest buffer a plan allocates (128 TiB, past any GPU's memory): a size that asks
/// for more is an error naming the tensor, not a launch that fails on its grid.
const MAX_BUFFER_BYTES: i64 = 1 << 47;

/// Refuse a buffer `name` of `sizes` elements of `dtype` that no GPU can hold.
pub(crate) fn check_buffer_size(name: &str, sizes: &[i64], dtype: DataType) -> Result<()> {
    let elements = sizes.iter().fold(1i64, |a, &s| a.saturating_mul(s.max(0)));
    let bytes = elements.saturating_mul(dtype.size_bytes() as i64);
    if bytes <= MAX_BUFFER_BYTES {
        return Ok(());
    }
    let (axis, size) = sizes.iter().copied().enumerate().max_by_key(|&(_, s)| s).unwrap_or((0, 0));
    Err(KilnError::value(format!(
        "{name}: its shape {sizes:?} ({dtype}) needs {} bytes, more than any GPU holds (at most 2^47 here); axis {axis} has size {size}",
        if bytes == i64::MAX { "2^63 or more".to_string() } else { bytes.to_string() },
    )))
}

/// Evaluate `p` for concrete inputs: one call, no symbolic work left for the caller.
pub fn plan_program(p: &HostProgram, inputs: &[InputDesc], scalars: &[ScalarArg]) -> Result<ProgramPlan> {
    let b = bind(&p.fusion, inputs, scalars)?;
    for k in &p.kernels {
        check_constraints(k, &b)?;
    }
    let mut buffers = Vec::with_capacity(p.buffers.len());
    for hb in &p.buffers {
        buffers.push(buffer_alloc(p, hb, &b, inputs)?);
    }
    let mut arena = Region::default();
    let mut pool = Region::default();
    let (mut live, mut peak) = (0i64, 0i64);
    let mut launches = Vec::new();
    let mut error_words = 0;
    for instr in &p.instrs {
        match instr {
            HostInstr::Allocate(id) => {
                let ba = &mut buffers[*id];
                ba.place = match p.buffers[*id].role {
                    BufferRole::Output(n) => Place::Output(n),
                    BufferRole::Input(n) | BufferRole::InputView(n) => Place::Input(n),
                    BufferRole::ErrorWord => {
                        error_words += 1;
                        Place::ErrorWord(error_words - 1)
                    }
                    _ if ba.zero_init && ba.resets_to_zero => Place::ZeroPool(pool.alloc(ba.bytes)),
                    _ => Place::Arena(arena.alloc(ba.bytes)),
                };
                live += ba.bytes;
                peak = peak.max(live);
            }
            HostInstr::Deallocate(id) => {
                let ba = &buffers[*id];
                match ba.place {
                    Place::Arena(off) => arena.release(off, ba.bytes),
                    Place::ZeroPool(off) => pool.release(off, ba.bytes),
                    _ => {}
                }
                live -= ba.bytes;
            }
            HostInstr::LaunchKernel { kernel, inputs: ins, outputs, intermediates } => {
                // A kernel with no element to write is not launched.
                if outputs.iter().all(|&o| buffers[o].elements == 0) {
                    continue;
                }
                let cuda = p.cuda[*kernel].as_ref().map_err(Clone::clone)?;
                let launch = kernel_launch(&p.kernels[*kernel], cuda, &b)?;
                let memsets = intermediates
                    .iter()
                    .copied()
                    .filter(|&i| buffers[i].zero_init && !buffers[i].resets_to_zero)
                    .collect();
                launches.push(KernelLaunch {
                    kernel: *kernel,
                    args: ins.iter().chain(outputs).chain(intermediates).copied().collect(),
                    memsets,
                    launch,
                });
            }
        }
    }
    Ok(ProgramPlan { buffers, launches, peak_bytes: peak, arena_bytes: arena.end, zero_pool_bytes: pool.end })
}

fn buffer_alloc(
    p: &HostProgram,
    hb: &crate::host::ir::HostBuffer,
    b: &Bindings,
    inputs: &[InputDesc],
) -> Result<BufferAlloc> {
    let k = &p.kernels[hb.kernel];
    let (sizes, layout, place) = match (hb.role, hb.tv) {
        (BufferRole::Input(n), _) => {
            let s = inputs[n].sizes.clone();
            let l = (0..s.len()).collect();
            (s, l, Place::Input(n))
        }
        (BufferRole::InputView(n), _) => {
            let mut sizes = Vec::new();
            for &e in &hb.shape {
                sizes.push(b.eval(&k.fusion.scalars, e)?);
            }
            let layout = (0..sizes.len()).collect();
            (sizes, layout, Place::Input(n))
        }
        (BufferRole::Output(_), Some(_)) if hb.view.is_some() => {
            // Computed at its source's shape, row-major: handed back at the defined shape.
            let mut sizes = Vec::new();
            for &e in hb.view.iter().flatten() {
                sizes.push(b.eval(&k.fusion.scalars, e)?);
            }
            let layout = (0..sizes.len()).collect();
            (sizes, layout, Place::Arena(0))
        }
        (BufferRole::Output(_), Some(tv)) if p.fusion.stored_outputs.contains(&tv) => {
            // Handed back in its stored order: a row-major array of the stored shape.
            let o = output_plan(&k.fusion, &k.fusion.scalars, tv, b)?;
            let sizes: Vec<i64> = o.layout.iter().map(|&a| o.sizes[a]).collect();
            let layout = (0..sizes.len()).collect();
            (sizes, layout, Place::Arena(0))
        }
        (BufferRole::Output(_) | BufferRole::Intermediate, Some(tv)) => {
            let o = output_plan(&k.fusion, &k.fusion.scalars, tv, b)?;
            (o.sizes, o.layout, Place::Arena(0))
        }
        _ => {
            let mut n = 1i64;
            for &e in &hb.shape {
                n = n.saturating_mul(b.eval(&k.fusion.scalars, e)?);
            }
            (vec![n], vec![0], Place::Arena(0))
        }
    };
    let elements = sizes.iter().fold(1i64, |a, &s| a.saturating_mul(s));
    let bytes = elements.saturating_mul(hb.dtype.size_bytes() as i64);
    if !matches!(place, Place::Input(_)) {
        check_buffer_size(&hb.name, &sizes, hb.dtype)?;
    }
    Ok(BufferAlloc {
        name: hb.name.clone(),
        dtype: hb.dtype,
        sizes,
        layout,
        elements,
        bytes,
        zero_init: hb.zero_init,
        resets_to_zero: hb.resets_to_zero,
        place,
    })
}

/// Key of a plan: input sizes and strides, scalar inputs (dtypes are checked by the caller).
pub type PlanKey = (Vec<Vec<i64>>, Vec<Vec<i64>>, Vec<u64>);

/// Plans of one program, cached per input signature: a repeated call is one lookup.
#[derive(Default)]
pub struct PlanCache {
    plans: Mutex<FxHashMap<PlanKey, Arc<ProgramPlan>>>,
    /// Number of plans evaluated (cache misses).
    pub misses: std::sync::atomic::AtomicU64,
}

impl PlanCache {
    /// The plan of `p` for these inputs, evaluated on the first call per signature.
    pub fn get(&self, p: &HostProgram, inputs: &[InputDesc], scalars: &[ScalarArg]) -> Result<Arc<ProgramPlan>> {
        let key: PlanKey = (
            inputs.iter().map(|d| d.sizes.clone()).collect(),
            inputs.iter().map(|d| d.strides.clone()).collect(),
            scalars
                .iter()
                .map(|s| match s {
                    ScalarArg::Int(i) => *i as u64,
                    ScalarArg::Float(x) => x.to_bits(),
                    ScalarArg::Bool(v) => u64::from(*v) | 2 << 62,
                })
                .collect(),
        );
        if let Some(hit) = self.plans.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(hit);
        }
        let plan = Arc::new(plan_program(p, inputs, scalars)?);
        self.misses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut m) = self.plans.lock() {
            m.insert(key, plan.clone());
        }
        Ok(plan)
    }
}
