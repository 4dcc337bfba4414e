//! Host IR: the program that allocates every buffer the kernels of a fusion need,
//! launches the kernels in order and frees each buffer after its last use.
//!
//! `Allocate(tensor, Global, zero_init, resets_to_zero)` reserves a buffer;
//! `LaunchKernel(kernel, inputs, outputs, intermediates, launch)` runs one segment's
//! kernel on buffers (parameter order: inputs, outputs, then the kernel's
//! `KernelSummary` global buffers); `Deallocate(tensor)` releases it.

use std::fmt::Write as _;

use crate::codegen::CudaKernel;
use crate::ir::{DataType, Fusion, MemoryType, TvId, ValId};
use crate::kernel::Kernel;

/// Index of a buffer in `HostProgram::buffers`.
pub type BufId = usize;

/// What a host buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferRole {
    /// Tensor input `n` of the fusion (provided by the caller, never allocated).
    Input(usize),
    /// Tensor input `n` read at another shape (`Fusion::input_views`): the caller's buffer,
    /// row-major, at the shape of `HostBuffer::shape`.
    InputView(usize),
    /// Output `n` of the fusion (allocated, handed back, never deallocated).
    Output(usize),
    /// A tensor produced by one segment and read by a later one.
    Intermediate,
    /// A global buffer of one kernel's `KernelSummary` (work buffer, semaphore, ...).
    KernelBuffer,
    /// A kernel's error word: host memory the device writes and the host reads later,
    /// without a sync (see `kernel::INDEX_ERROR`).
    ErrorWord,
}

/// A Global buffer of the host program.
#[derive(Clone, Debug)]
pub struct HostBuffer {
    /// `T3`, or a kernel buffer's name (`T4_work`, `T4_sync`).
    pub name: String,
    pub tv: Option<TvId>,
    pub dtype: DataType,
    pub memory: MemoryType,
    /// Extents, outermost first, as scalars of `kernels[kernel].fusion`.
    pub shape: Vec<ValId>,
    /// The kernel whose scalar arena holds `shape` (the producing kernel).
    pub kernel: usize,
    pub zero_init: bool,
    pub resets_to_zero: bool,
    pub role: BufferRole,
    /// For an output computed at another shape (`Fusion::output_views`): the shape it is
    /// handed back in, as scalars of `kernels[kernel].fusion` (row-major, same elements).
    pub view: Option<Vec<ValId>>,
}

/// One host instruction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostInstr {
    Allocate(BufId),
    LaunchKernel { kernel: usize, inputs: Vec<BufId>, outputs: Vec<BufId>, intermediates: Vec<BufId> },
    Deallocate(BufId),
}

impl HostInstr {
    /// Buffers a launch reads or writes (empty for Allocate / Deallocate).
    pub fn uses(&self) -> Vec<BufId> {
        match self {
            HostInstr::LaunchKernel { inputs, outputs, intermediates, .. } => {
                inputs.iter().chain(outputs).chain(intermediates).copied().collect()
            }
            _ => Vec::new(),
        }
    }
}

/// A lowered fusion: its kernels and the host program that runs them.
#[derive(Clone, Debug)]
pub struct HostProgram {
    /// The original fusion: symbols are bound from its inputs.
    pub fusion: Fusion,
    pub kernels: Vec<Kernel>,
    /// Generated CUDA of each kernel; a codegen error surfaces when the program is planned.
    pub cuda: Vec<crate::Result<CudaKernel>>,
    pub buffers: Vec<HostBuffer>,
    pub instrs: Vec<HostInstr>,
    /// How the automatic segmenter grouped the fusion (`KILN_DUMP=segments`); empty when
    /// the segments were the user's.
    pub segmentation: String,
}

impl HostProgram {
    /// Readable program text (`KILN_DUMP=host_ir`, `fd.lower(...).host_program`).
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let names = |ids: &[BufId]| -> String {
            ids.iter().map(|&b| self.buffers[b].name.clone()).collect::<Vec<_>>().join(", ")
        };
        let ins: Vec<BufId> =
            (0..self.buffers.len()).filter(|&b| matches!(self.buffers[b].role, BufferRole::Input(_))).collect();
        let outs: Vec<BufId> =
            (0..self.buffers.len()).filter(|&b| matches!(self.buffers[b].role, BufferRole::Output(_))).collect();
        let _ = writeln!(s, "HostProgram({}) -> ({}): {} kernel(s)", names(&ins), names(&outs), self.kernels.len());
        for buf in &self.buffers {
            if let BufferRole::InputView(n) = buf.role {
                let sc = &self.kernels[buf.kernel].fusion.scalars;
                let shape: Vec<String> = buf.shape.iter().map(|&v| sc.render(v)).collect();
                let strided = buf.tv.is_some_and(|t| self.fusion.strided_view_axes(t).is_some());
                let _ = writeln!(
                    s,
                    "  View {} = {} as [{}]{} (no copy)",
                    buf.name,
                    self.buffers[ins[n]].name,
                    shape.join(", "),
                    if strided { " through its strides" } else { "" }
                );
            }
        }
        for instr in &self.instrs {
            match instr {
                HostInstr::Allocate(b) => {
                    let buf = &self.buffers[*b];
                    let sc = &self.kernels[buf.kernel].fusion.scalars;
                    let shape: Vec<String> = buf.shape.iter().map(|&v| sc.render(v)).collect();
                    let view = buf
                        .view
                        .as_ref()
                        .map(|v| {
                            let v: Vec<String> = v.iter().map(|&e| sc.render(e)).collect();
                            format!(" (handed back as [{}])", v.join(", "))
                        })
                        .unwrap_or_default();
                    let _ = writeln!(
                        s,
                        "  Allocate {} [{}] {} zero_init={} resets_to_zero={}{view}",
                        buf.name,
                        shape.join(", "),
                        buf.dtype,
                        buf.zero_init,
                        buf.resets_to_zero
                    );
                }
                HostInstr::LaunchKernel { kernel, inputs, outputs, intermediates } => {
                    let k = &self.kernels[*kernel];
                    let sc = &k.fusion.scalars;
                    let dims =
                        |v: &[ValId; 3]| -> String { v.iter().map(|&x| sc.render(x)).collect::<Vec<_>>().join(", ") };
                    let _ = writeln!(
                        s,
                        "  LaunchKernel kernel{kernel}(inputs=[{}], outputs=[{}], intermediates=[{}]) grid=[{}] block=[{}] smem={}",
                        names(inputs),
                        names(outputs),
                        names(intermediates),
                        dims(&k.launch.grid),
                        dims(&k.launch.block),
                        sc.render(k.launch.smem_bytes)
                    );
                }
                HostInstr::Deallocate(b) => {
                    let _ = writeln!(s, "  Deallocate {}", self.buffers[*b].name);
                }
            }
        }
        for &(out, inp) in &self.fusion.aliases {
            let _ = writeln!(
                s,
                "  CopyInPlace {} -> input {} (after the launches; not returned)",
                self.fusion.tv_name(out),
                self.fusion.tv_name(inp)
            );
        }
        s
    }
}
