//! Host lowering: segments -> kernels -> `HostProgram`.
//!
//! For each segment in order: an Allocate for each segment output, then one for each
//! `KernelSummary` global buffer with its shape, dtype, `zero_init` and
//! `resets_to_zero` carried over (outputs then buffers: the kernel's parameter order),
//! then the LaunchKernel. Deallocates go right after each buffer's last use.

use rustc_hash::FxHashMap;

use crate::error::{KilnError, Result};
use crate::host::ir::{BufId, BufferRole, HostBuffer, HostInstr, HostProgram};
use crate::host::segment::{segment_fusion, segments, Segment};
use crate::ir::{Fusion, MemoryType, TvId};

/// Lower `f` to its kernels and host program.
pub fn lower_program(f: &Fusion) -> Result<HostProgram> {
    if f.manually_scheduled {
        // Tensors a manual schedule leaves untouched follow their parallelized consumers.
        return lower_program_with(&crate::sched::propagate::completed(f), &mut |_, _| Ok(None));
    }
    lower_program_with(f, &mut |_, _| Ok(None))
}

/// Like [`lower_program`], letting `prepare(k, segment)` schedule each segment's fusion
/// before it is lowered (the automatic segmenter schedules segments one by one) and hand
/// back its kernel and CUDA where it already lowered that fusion.
pub fn lower_program_with(f: &Fusion, prepare: &mut Prepare<'_>) -> Result<HostProgram> {
    lower_segments(f, &segments(f)?, prepare)
}

/// Schedules segment `k`'s fusion in place; returns its kernel and CUDA when it has already
/// lowered exactly that fusion (then it is not lowered again).
pub type Prepare<'a> =
    dyn FnMut(usize, &mut Fusion) -> Result<Option<(crate::kernel::Kernel, crate::codegen::CudaKernel)>> + 'a;

/// Lower `f` as the given segments (in an order where producers come first), letting
/// `prepare(k, segment)` schedule each segment's fusion before it is lowered.
pub fn lower_segments(f: &Fusion, segs: &[Segment], prepare: &mut Prepare<'_>) -> Result<HostProgram> {
    let multi = segs.len() > 1;
    let mut kernels = Vec::with_capacity(segs.len());
    let mut cuda = Vec::with_capacity(segs.len());
    let mut buffers: Vec<HostBuffer> = Vec::new();
    let mut instrs: Vec<HostInstr> = Vec::new();
    let mut of_tv: FxHashMap<TvId, BufId> = FxHashMap::default();
    let context = |k: usize, e: KilnError| -> KilnError {
        if multi {
            KilnError { kind: e.kind, message: format!("segment {k}: {}", e.message) }
        } else {
            e
        }
    };
    for (i, tv) in f.inputs.iter().filter_map(|o| o.tensor()).enumerate() {
        of_tv.insert(tv, buffers.len());
        buffers.push(tensor_buffer(f, tv, 0, BufferRole::Input(i)));
    }
    for &(view, input) in &f.input_views {
        let Some(n) = f.inputs.iter().filter_map(|o| o.tensor()).position(|t| t == input) else {
            crate::bail_internal!("view {} reads {}, which is not an input", f.tv_name(view), f.tv_name(input));
        };
        of_tv.insert(view, buffers.len());
        buffers.push(tensor_buffer(f, view, 0, BufferRole::InputView(n)));
    }
    for (k, seg) in segs.iter().enumerate() {
        let mut sf = segment_fusion(f, seg);
        let (kernel, code) = match prepare(k, &mut sf).map_err(|e| context(k, e))? {
            Some((kernel, code)) => (kernel, Ok(code)),
            None => {
                let kernel = crate::lower::lower(&sf).map_err(|e| context(k, e))?;
                let code = crate::codegen::generate(&kernel, false).map_err(|e| context(k, e));
                (kernel, code)
            }
        };
        let inputs = seg
            .inputs
            .iter()
            .map(|t| {
                of_tv.get(t).copied().ok_or_else(|| {
                    KilnError::internal(format!("segment {k} reads {} before any segment produces it", f.tv_name(*t)))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut outputs = Vec::new();
        for &tv in &seg.outputs {
            let role = match f.outputs.iter().position(|&o| o == tv) {
                Some(i) => BufferRole::Output(i),
                None => BufferRole::Intermediate,
            };
            let b = buffers.len();
            buffers.push(tensor_buffer(f, tv, k, role));
            of_tv.insert(tv, b);
            instrs.push(HostInstr::Allocate(b));
            outputs.push(b);
        }
        let mut intermediates = Vec::new();
        for g in &kernel.summary.global_allocations {
            let b = buffers.len();
            buffers.push(HostBuffer {
                name: g.name.clone(),
                tv: g.tv,
                dtype: g.dtype,
                memory: MemoryType::Global,
                shape: g.shape.clone(),
                kernel: k,
                zero_init: g.zero_init,
                resets_to_zero: g.resets_to_zero,
                role: if g.error_word { BufferRole::ErrorWord } else { BufferRole::KernelBuffer },
                view: None,
            });
            instrs.push(HostInstr::Allocate(b));
            intermediates.push(b);
        }
        instrs.push(HostInstr::LaunchKernel { kernel: k, inputs, outputs, intermediates });
        kernels.push(kernel);
        cuda.push(code);
    }
    let instrs = insert_deallocates(&buffers, instrs);
    Ok(HostProgram { fusion: f.clone(), kernels, cuda, buffers, instrs, segmentation: String::new() })
}

/// Put `Deallocate(b)` right after the instruction that post-dominates every use of
/// `b`. The program is straight-line, so that is its last use; with nested scopes it is
/// the end of the outermost scope holding a use. Fusion inputs and outputs belong to
/// the caller and are never deallocated.
fn insert_deallocates(buffers: &[HostBuffer], instrs: Vec<HostInstr>) -> Vec<HostInstr> {
    let mut last_use: FxHashMap<BufId, usize> = FxHashMap::default();
    for (i, instr) in instrs.iter().enumerate() {
        for b in instr.uses() {
            last_use.insert(b, i);
        }
    }
    let mut frees: Vec<Vec<BufId>> = vec![Vec::new(); instrs.len()];
    for (b, buf) in buffers.iter().enumerate() {
        if matches!(buf.role, BufferRole::Intermediate | BufferRole::KernelBuffer) {
            if let Some(&i) = last_use.get(&b) {
                frees[i].push(b);
            }
        }
    }
    let mut out = Vec::with_capacity(instrs.len() * 2);
    for (instr, fr) in instrs.into_iter().zip(frees) {
        out.push(instr);
        out.extend(fr.into_iter().map(HostInstr::Deallocate));
    }
    out
}

/// The Global buffer of fusion tensor `tv` (an input, an output or a tensor passed between
/// kernels), first used by kernel `kernel`.
fn tensor_buffer(f: &Fusion, tv: TvId, kernel: usize, role: BufferRole) -> HostBuffer {
    HostBuffer {
        name: f.tv_name(tv),
        tv: Some(tv),
        dtype: f.tvs[tv].dtype,
        memory: MemoryType::Global,
        shape: f.no_reduction_logical(tv).iter().map(|&id| f.ids[id].extent).collect(),
        kernel,
        zero_init: false,
        resets_to_zero: false,
        role,
        view: match role {
            BufferRole::Output(_) => f.output_views.iter().find(|(t, _)| *t == tv).map(|(_, v)| v.clone()),
            _ => None,
        },
    }
}
