//! Kernel IR: the loop nest of one kernel with allocations, reduction inits and
//! syncs, plus the side tables lowering hands to indexing and codegen.

use std::fmt::Write as _;

use rustc_hash::FxHashMap;

use crate::analysis::loop_graph::LoopGraph;
use crate::ir::{DataType, ExprId, Fusion, IterDomainId, MemoryType, ParallelType, TvId, ValId};

/// A loop of the nest. `group` is `None` for loops that lowering adds on its own
/// (reduction-init nests).
#[derive(Clone, Debug)]
pub struct ForLoop {
    pub group: Option<usize>,
    /// The promoted id this loop iterates.
    pub id: IterDomainId,
    /// The loop variable (`idx{n}`, or threadIdx/blockIdx for parallel loops).
    pub index: ValId,
    pub extent: ValId,
    pub parallel: ParallelType,
    /// For loops of a reduction-init nest: the loop axis of the initialised tensor.
    pub init_axis: Option<usize>,
    /// Which part of a circular-buffered loop this is (`None`: not pipelined).
    pub pipeline: Option<PipelinePart>,
    pub body: Vec<Node>,
}

/// The three loops a circular-buffered loop becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PipelinePart {
    /// Loads of the first `prefetch` iterations.
    Prologue,
    /// Iteration `i` loads iteration `i + prefetch`, then computes `i`.
    Main,
    /// The last `prefetch` iterations, computed from what is loaded.
    Epilogue,
}

impl PipelinePart {
    /// Lower-case name, as dumps print it.
    pub fn name(self) -> &'static str {
        match self {
            PipelinePart::Prologue => "prologue",
            PipelinePart::Main => "main",
            PipelinePart::Epilogue => "epilogue",
        }
    }
}

/// Which rewrite made an [`IfThenElse`] (it names the branch in dumps and in the CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IfKind {
    /// An unswitched loop: `then` is the loop without the bounds checks that hold for
    /// the whole tile, `otherwise` the checked loop.
    Unswitch,
    /// Bounds checks that no loop inside changes, tested once around the loop; `otherwise`
    /// is empty (every statement inside was guarded by `cond`).
    InvariantBounds,
}

/// Run `then` on the threads where `cond` holds and `otherwise` on the rest.
#[derive(Clone, Debug)]
pub struct IfThenElse {
    pub cond: ValId,
    pub kind: IfKind,
    pub then: Vec<Node>,
    pub otherwise: Vec<Node>,
}

/// How one side of a [`VectorCopy`] is accessed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VectorAccess {
    /// One wide access, aligned by construction (the offset is a multiple of the width in
    /// an aligned array): no run-time check.
    Wide,
    /// One wide access when the offset is a multiple of the width (the base is aligned).
    WideIfOffsetAligned,
    /// One wide access when the address is aligned (the base's alignment is unknown).
    WideIfAddressAligned,
    /// Element by element (a Shared tile whose row offset is not a multiple of the width).
    Elements,
}

/// A copy of `width` consecutive elements (a Vectorize loop holding one data-moving
/// expression) as one wide load and store; `fallback`, the element loop, runs instead
/// where part of the vector is out of range or an alignment check fails.
#[derive(Clone, Debug)]
pub struct VectorCopy {
    pub expr: ExprId,
    pub width: i64,
    /// Element offsets of the vector's first element in the written and the read tensor.
    pub out: ValId,
    pub input: ValId,
    /// The copy's predicate at the first and at the last element of the vector.
    pub first: ValId,
    pub last: ValId,
    /// Index reads at the first element (read only where `first` holds; they do not move
    /// along the vector).
    pub gathers: Vec<Gather>,
    /// Access of the written side and of the read side.
    pub access: [VectorAccess; 2],
    /// Cache hints of a wide Global load: (streaming, evict-last).
    pub load_hints: (bool, bool),
    /// The predicate holds on the whole vector or on none of it (its range bounds are
    /// multiples of the width), and neither side checks its alignment at run time: where
    /// `first` fails every element is out of range, so there is no element loop to run.
    pub whole: bool,
    /// A guarded remap into Local memory (a cat's or a pad's read) whose predicate and guard
    /// each hold on the whole vector or on none of it: where the guard fails on an in-range
    /// vector the whole vector is the pad value 0. Holds the predicate (without the guard)
    /// at the first element; then there is no element loop either.
    pub pad_else: Option<ValId>,
    pub fallback: ForLoop,
}

/// A reduction across threads or blocks inside serial loops over its own axes, hoisted
/// (see `lower::reduction_hoist`): each thread accumulates in a register through the
/// loops and the block/grid reduction runs once after them.
#[derive(Clone, Debug)]
pub struct Accumulator {
    /// Register number (`kiln_acc{id}`), unique in the kernel.
    pub id: u32,
    /// The reduction it stands for (its op, identity and output dtype).
    pub expr: ExprId,
}

/// A data-dependent index: the value of `index_tv` at `at`, bound to symbol `Symbol::Gathered(id)`.
#[derive(Clone, Debug)]
pub struct Gather {
    pub id: u32,
    pub index_tv: TvId,
    pub at: ValId,
    /// The tensor the value selects from, and the extent of its selected axis: a value
    /// outside `[0, extent)` is an error of the caller's data, never an address.
    pub table: TvId,
    pub extent: ValId,
    /// The element's row-major position in `index_tv`'s logical shape, which error
    /// messages report (`at` is a memory offset: a cache's, or a strided array's).
    pub element: ValId,
}

/// Memory offsets and guard of one tensor access site (filled by indexing).
#[derive(Clone, Debug)]
pub struct AccessIndex {
    /// Element offset of the written tensor.
    pub out: ValId,
    /// Element offset of each tensor operand (`None` for scalar operands).
    pub inputs: Vec<Option<ValId>>,
    /// Only compute where this holds (bounds of non-divisible splits, idle threads).
    pub predicate: ValId,
    /// Guard of the write of a reduction's result: `predicate` without the bounds and
    /// idle-thread guards of reduced ids (out-of-range threads still hold partials).
    pub write_predicate: ValId,
    /// Index-tensor reads this access depends on, in evaluation order.
    pub gathers: Vec<Gather>,
    /// Row-major position of the written element in its tensor's logical shape, for ops
    /// whose value depends on it (`Op::reads_position`: iota, random numbers); for a
    /// guarded remap, whether the written element reads its input (else it is 0).
    pub element: Option<ValId>,
}

/// What an `Allocate` reserves memory for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocTarget {
    /// A tensor of the fusion.
    Tensor(TvId),
    /// Entry `n` of `KernelSummary::global_allocations` that is not a fusion tensor.
    Buffer(usize),
    /// Entry `n` of `KernelSummary::barriers`: a Shared array of mbarriers.
    Barriers(u32),
}

/// One mbarrier: entry `index` of Shared barrier array `array` (`kiln_mbar{array}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarrierRef {
    pub array: u32,
    pub index: ValId,
}

/// An mbarrier operation (Hopper's asynchronous transaction barriers). `Init` and `Inval`
/// run on the block's first thread; `Arrive` and `Wait` on every thread of the block.
#[derive(Clone, Debug)]
pub enum BarrierOp {
    /// Set the barrier up for `arrivals` arrivals per phase, at phase 0.
    Init { bar: BarrierRef, arrivals: ValId },
    /// Retire the barrier (no thread may wait on it any more).
    Inval { bar: BarrierRef },
    /// Count this thread's arrival in the current phase (after its last read of a stage).
    Arrive { bar: BarrierRef },
    /// Wait until the phase of parity `parity` has completed.
    Wait { bar: BarrierRef, parity: ValId },
}

/// A bulk (TMA) copy of `elems` consecutive elements of `expr`'s input (from element
/// `src`) to its output (from element `dst`), issued by the block's first thread. Where
/// `reuse` is set and its condition holds, that thread first waits for the phase of the
/// given parity of the barrier the readers of the destination's previous contents arrive on
/// (write-after-read). It then announces the copy's bytes on `bar` (`arrive.expect_tx`,
/// zero bytes where `guard` fails) and starts it; `bar`'s phase completes when the bytes
/// have landed. Where the addresses or the size are not multiples of 16 bytes the same
/// thread copies element by element before arriving.
#[derive(Clone, Debug)]
pub struct BulkLoad {
    pub expr: ExprId,
    pub dst: ValId,
    pub src: ValId,
    pub elems: ValId,
    pub guard: ValId,
    pub bar: BarrierRef,
    pub reuse: Option<(BarrierRef, ValId, ValId)>,
}

/// A thread's asynchronous-copy bookkeeping: the copies to tensors of
/// `KernelSummary::async_copies` land in the background, in groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpAsyncOp {
    /// Close the group of the copies issued since the last commit.
    Commit,
    /// Wait until at most this many of the thread's groups are in flight.
    Wait(u32),
}

/// Tensor-memory management (Blackwell's tcgen05, seed 000's `AllocTMem` and the asm it
/// inserts): every op runs on the block's first warp, whole, and uses the kernel's region
/// (`KernelSummary::tensor_memory`) whose address a Shared slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TmemOp {
    /// `tcgen05.alloc` of the region's columns; the address lands in the Shared slot.
    Alloc,
    /// `tcgen05.relinquish_alloc_permit`: this block allocates no more.
    Relinquish,
    /// `tcgen05.dealloc` of the region (after a barrier: every thread is done with it).
    Dealloc,
}

/// The kernel's Tensor-memory region: `columns` 32-bit columns of 128 lanes (a power of two
/// from 32 to 512, as tcgen05.alloc takes them), and where each tensor lies in it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TmemRegion {
    pub columns: i64,
    pub tensors: Vec<TmemPlacement>,
}

/// A tensor's place in the region: each thread's cells are columns
/// `column_offset .. column_offset + columns` of lane `lane_offset + thread`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmemPlacement {
    pub tv: TvId,
    pub lane_offset: i64,
    pub column_offset: i64,
    pub columns: i64,
}

/// A Shared array of mbarriers the kernel uses, and the tensors whose loads it orders.
#[derive(Clone, Debug)]
pub struct BarrierArray {
    pub size: i64,
    pub tvs: Vec<TvId>,
}

/// Reserve memory for a tensor or buffer.
#[derive(Clone, Debug)]
pub struct Allocate {
    pub target: AllocTarget,
    pub memory: MemoryType,
    pub dtype: DataType,
    /// Extent of each allocated id, outermost first.
    pub shape: Vec<ValId>,
    pub zero_init: bool,
    pub resets_to_zero: bool,
}

/// Kind of a block synchronization.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncKind {
    /// Read-after-write on Shared memory.
    Raw,
    /// Write-after-read on Shared memory (before a buffer is overwritten).
    War,
}

/// A node of the loop nest.
#[derive(Clone, Debug)]
pub enum Node {
    Loop(ForLoop),
    Alloc(Allocate),
    /// Fill `tv` with `value` at the current indices (reduction identity).
    Init {
        tv: TvId,
        value: ValId,
        index: Option<AccessIndex>,
    },
    /// A tensor expression of the fusion, computed at the current indices.
    Expr {
        expr: ExprId,
        index: Option<AccessIndex>,
    },
    Sync(SyncKind),
    If(IfThenElse),
    Vector(Box<VectorCopy>),
    /// Declare register `acc` holding the reduction's identity (before the hoisted loops).
    AccumulatorInit(Accumulator),
    /// The reduction `acc.expr` at the current indices, combined into the register.
    Accumulate {
        acc: Accumulator,
        index: AccessIndex,
    },
    /// An mbarrier operation.
    Barrier(BarrierOp),
    /// A bulk (TMA) copy into Shared memory.
    BulkLoad(Box<BulkLoad>),
    /// Asynchronous copies (`cp.async`) of this thread: close its current group, or wait
    /// until at most `n` of its groups are still in flight.
    CpAsync(CpAsyncOp),
    /// Tensor-memory allocation, relinquish or deallocation (the block's first warp).
    TensorMemory(TmemOp),
    /// The block/grid reduction of the register into the output at `index` (after the
    /// hoisted loops). `complete`: no serial loop over the reduction's own axes encloses
    /// the hoist, so the result is final and stored rather than combined with the
    /// output's running value (the output then has no init statements).
    ReduceAccumulator {
        acc: Accumulator,
        index: AccessIndex,
        complete: bool,
        /// Reduced in one block reduction with the `ReduceAccumulator` right after it (see
        /// `lower::group_reductions`); the results are the same either way.
        grouped: bool,
    },
}

impl Node {
    /// The node lists directly inside this node (loop body, both arms of an `If`, a
    /// vector copy's fallback loop).
    pub fn bodies(&self) -> Vec<&[Node]> {
        match self {
            Node::Loop(l) => vec![&l.body],
            Node::If(i) => vec![&i.then, &i.otherwise],
            Node::Vector(v) => vec![&v.fallback.body],
            _ => Vec::new(),
        }
    }

    /// Mutable [`Node::bodies`].
    pub fn bodies_mut(&mut self) -> Vec<&mut Vec<Node>> {
        match self {
            Node::Loop(l) => vec![&mut l.body],
            Node::If(i) => vec![&mut i.then, &mut i.otherwise],
            Node::Vector(v) => vec![&mut v.fallback.body],
            _ => Vec::new(),
        }
    }

    /// Apply `g` to every scalar value this node (and its children) holds.
    pub fn map_vals(&mut self, g: &mut dyn FnMut(ValId) -> ValId) {
        fn gathers(gs: &mut [Gather], g: &mut dyn FnMut(ValId) -> ValId) {
            for gt in gs.iter_mut() {
                gt.at = g(gt.at);
                gt.extent = g(gt.extent);
                gt.element = g(gt.element);
            }
        }
        fn index(ix: &mut AccessIndex, g: &mut dyn FnMut(ValId) -> ValId) {
            ix.out = g(ix.out);
            for v in ix.inputs.iter_mut().flatten() {
                *v = g(*v);
            }
            ix.predicate = g(ix.predicate);
            ix.write_predicate = g(ix.write_predicate);
            gathers(&mut ix.gathers, g);
            if let Some(e) = ix.element.as_mut() {
                *e = g(*e);
            }
        }
        match self {
            Node::Loop(l) => {
                l.extent = g(l.extent);
                for c in l.body.iter_mut() {
                    c.map_vals(g);
                }
            }
            Node::Alloc(a) => {
                for s in a.shape.iter_mut() {
                    *s = g(*s);
                }
            }
            Node::Init { value, index: ix, .. } => {
                *value = g(*value);
                if let Some(ix) = ix.as_mut() {
                    index(ix, g);
                }
            }
            Node::Expr { index: Some(ix), .. } => index(ix, g),
            Node::Expr { index: None, .. }
            | Node::Sync(_)
            | Node::AccumulatorInit(_)
            | Node::CpAsync(_)
            | Node::TensorMemory(_) => {}
            Node::Barrier(op) => match op {
                BarrierOp::Init { bar, arrivals } => {
                    bar.index = g(bar.index);
                    *arrivals = g(*arrivals);
                }
                BarrierOp::Inval { bar } | BarrierOp::Arrive { bar } => bar.index = g(bar.index),
                BarrierOp::Wait { bar, parity } => {
                    bar.index = g(bar.index);
                    *parity = g(*parity);
                }
            },
            Node::BulkLoad(b) => {
                b.dst = g(b.dst);
                b.src = g(b.src);
                b.elems = g(b.elems);
                b.guard = g(b.guard);
                b.bar.index = g(b.bar.index);
                if let Some((bar, parity, when)) = b.reuse.as_mut() {
                    bar.index = g(bar.index);
                    *parity = g(*parity);
                    *when = g(*when);
                }
            }
            Node::Accumulate { index: ix, .. } | Node::ReduceAccumulator { index: ix, .. } => index(ix, g),
            Node::If(i) => {
                i.cond = g(i.cond);
                for c in i.then.iter_mut().chain(i.otherwise.iter_mut()) {
                    c.map_vals(g);
                }
            }
            Node::Vector(v) => {
                v.out = g(v.out);
                v.input = g(v.input);
                v.first = g(v.first);
                v.last = g(v.last);
                gathers(&mut v.gathers, g);
                for c in v.fallback.body.iter_mut() {
                    c.map_vals(g);
                }
            }
        }
    }

    /// The access index of an indexed statement.
    pub fn access_index(&self) -> Option<&AccessIndex> {
        match self {
            Node::Init { index, .. } | Node::Expr { index, .. } => index.as_ref(),
            Node::Accumulate { index, .. } | Node::ReduceAccumulator { index, .. } => Some(index),
            _ => None,
        }
    }
}

/// A global buffer the kernel needs besides its inputs and outputs.
#[derive(Clone, Debug)]
pub struct GlobalBuffer {
    /// Printed name (`T4` for a Global intermediate, `T4_work`, `T4_sync`).
    pub name: String,
    /// The fusion tensor for Global intermediates; `None` for work buffers and semaphores.
    pub tv: Option<TvId>,
    pub dtype: DataType,
    pub shape: Vec<ValId>,
    pub zero_init: bool,
    pub resets_to_zero: bool,
    /// The kernel's error word (`INDEX_ERROR`): four int64 that a gather writes when an
    /// index is out of range; the host places it where it can read it without a sync.
    pub error_word: bool,
}

/// Threads per block, block and grid dimensions every CUDA GPU allows, and Shared memory
/// per block of the default target (H100/H200 class, opt-in maximum).
pub const MAX_THREADS_PER_BLOCK: i64 = 1024;
pub const MAX_BLOCK: [i64; 3] = [1024, 1024, 64];
pub const MAX_GRID: [i64; 3] = [(1 << 31) - 1, 65535, 65535];
pub const MAX_SHARED_BYTES: i64 = 232_448;

/// Local memory a thread may use (CUDA's limit on every architecture since sm_20).
pub const MAX_LOCAL_BYTES: i64 = 512 * 1024;

/// Check concrete launch dimensions (`None`: not known yet) against the hardware limits:
/// every path (lowering for static sizes, the GPU plan, the interpreter) refuses the same
/// launches with the same message.
pub fn check_launch_dims(grid: [Option<i64>; 3], block: [Option<i64>; 3], smem: Option<i64>) -> crate::Result<()> {
    if let [Some(x), Some(y), Some(z)] = block {
        let threads = x.saturating_mul(y).saturating_mul(z);
        if threads > MAX_THREADS_PER_BLOCK {
            crate::bail!(
                "the schedule launches {threads} threads per block ({x} x {y} x {z}); the GPU allows at most {MAX_THREADS_PER_BLOCK}"
            );
        }
    }
    const AXES: [&str; 3] = ["x", "y", "z"];
    for k in 0..3 {
        if let Some(b) = block[k].filter(|&b| b > MAX_BLOCK[k]) {
            crate::bail!(
                "the schedule launches blockDim.{} = {b} threads; the GPU allows at most {} (split the axis mapped to TID{} further)",
                AXES[k],
                MAX_BLOCK[k],
                AXES[k]
            );
        }
        if let Some(g) = grid[k].filter(|&g| g > MAX_GRID[k]) {
            crate::bail!(
                "the schedule launches gridDim.{} = {g} blocks; the GPU allows at most {} (map the large axis to BIDx)",
                AXES[k],
                MAX_GRID[k]
            );
        }
    }
    if let Some(s) = smem.filter(|&s| s > MAX_SHARED_BYTES) {
        crate::bail!(
            "the schedule needs {s} bytes of Shared memory per block; the target allows at most {MAX_SHARED_BYTES} (use smaller tiles or Local memory)"
        );
    }
    Ok(())
}

/// The largest split factor allowed past the size it splits (2^20: a loop of that many
/// empty iterations takes about a second in the interpreter, a few milliseconds on a GPU).
pub const MAX_SPLIT_PADDING: i64 = 1 << 20;

/// Name of the error word of a kernel with gathers: [site + 1, element, value, extent] of
/// the first index found outside its table (all zero while none was).
pub const INDEX_ERROR: &str = "kiln_index_error";

/// Facts about a kernel that its launcher needs.
#[derive(Clone, Debug, Default)]
pub struct KernelSummary {
    /// Buffers the caller (host program or executor) allocates, in kernel parameter order.
    pub global_allocations: Vec<GlobalBuffer>,
    /// True when any reduction spans blocks.
    pub has_grid_reduction: bool,
    /// Shared mbarrier arrays (`AllocTarget::Barriers` indexes it).
    pub barriers: Vec<BarrierArray>,
    /// Shared tensors whose copies from Global memory are asynchronous (`cp.async`).
    pub async_copies: Vec<TvId>,
    /// The Tensor-memory region (tensors with `tensor_memory`), if any.
    pub tensor_memory: Option<TmemRegion>,
}

/// Where and how a tensor is allocated; what indexing reads.
#[derive(Clone, Debug)]
pub struct AllocationInfo {
    pub tv: TvId,
    pub memory: MemoryType,
    /// Allocated ids after loop promotion, outermost first.
    pub ids: Vec<IterDomainId>,
    /// The tensor's own id behind each entry of `ids` (before promotion): indexing uses
    /// it where the tensor is read outside the loops it shares.
    pub own_ids: Vec<IterDomainId>,
    /// Symbolic stride of each id (elements).
    pub strides: Vec<ValId>,
    pub contiguity: Vec<bool>,
    /// Number of loops enclosing the Allocate (0: kernel top level).
    pub position: usize,
    /// Buffers the Allocate holds (circular buffering), each of the layout above; 1 otherwise.
    pub stages: u32,
    pub zero_init: bool,
    pub resets_to_zero: bool,
}

/// Launch configuration as expressions of input sizes.
#[derive(Clone, Debug)]
pub struct LaunchParams {
    /// gridDim.{x,y,z}.
    pub grid: [ValId; 3],
    /// blockDim.{x,y,z}.
    pub block: [ValId; 3],
    /// Dynamic shared memory in bytes (Shared tensors, then reduction workspace).
    pub smem_bytes: ValId,
    /// Byte offset of each Shared tensor in dynamic shared memory.
    pub smem_offsets: Vec<(TvId, ValId)>,
    /// Byte offset of each mbarrier array in dynamic shared memory.
    pub barrier_offsets: Vec<(u32, ValId)>,
    /// Byte offset of the block-reduction workspace (blockDim.x*y*z elements of 8 bytes).
    pub reduction_workspace: Option<ValId>,
}

/// One lowered kernel.
#[derive(Clone, Debug)]
pub struct Kernel {
    /// The fusion the kernel was lowered from, extended with lowering's scalars.
    pub fusion: Fusion,
    pub loops: LoopGraph,
    pub body: Vec<Node>,
    pub allocations: FxHashMap<TvId, AllocationInfo>,
    pub summary: KernelSummary,
    pub launch: LaunchParams,
    /// Extents that must be equal at run time, with what combines them.
    pub size_constraints: Vec<(ValId, ValId, String)>,
    /// Kernel IR after the passes `KILN_DUMP=after:<pass>` asked for: (pass, text).
    pub pass_dumps: Vec<(String, String)>,
}

impl Kernel {
    /// [`check_launch_dims`] for this kernel's launch with extents evaluated by `eval`
    /// (`None`: unknown); the error names the tensor axes that set the dimensions.
    pub fn check_launch(&self, eval: impl Fn(ValId) -> Option<i64>) -> crate::Result<()> {
        let l = &self.launch;
        let grid = l.grid.map(&eval);
        let block = l.block.map(&eval);
        if let Some((pt, n)) = self.fusion.cluster {
            // A cluster reduction combines one cluster's blocks: the grid along the
            // clusters' dimension must be that one cluster.
            let d = crate::analysis::parallel::DIMS.iter().position(|&p| p == pt).unwrap_or(0);
            if let Some(g) = grid[d].filter(|&g| g != i64::from(n)) {
                let f = &self.fusion;
                let by: Vec<String> = self
                    .loops
                    .groups
                    .iter()
                    .filter(|gr| gr.parallel == pt)
                    .filter_map(|gr| gr.members.last().map(|&(tv, a)| format!("{} axis {a}", f.tv_name(tv))))
                    .collect();
                crate::bail!(
                    "the kernel runs in clusters of {n} blocks along {}, so its grid along {} must be {n} blocks (one cluster); the schedule launches {g} ({})",
                    pt.enum_name(),
                    pt.enum_name(),
                    if by.is_empty() { format!("no axis runs {}", pt.enum_name()) } else { by.join(", ") }
                );
            }
        }
        self.check_memory(&eval, false)?;
        self.check_split_padding(&eval)?;
        check_launch_dims(grid, block, eval(l.smem_bytes)).map_err(|e| {
            // The axes that set each parallel dimension (the widest loop of its type).
            let f = &self.fusion;
            let mut by: Vec<String> = Vec::new();
            for pt in crate::analysis::parallel::DIMS {
                let widest = self
                    .loops
                    .groups
                    .iter()
                    .filter(|g| g.parallel == pt)
                    .filter_map(|g| Some((eval(f.ids[g.promoted].extent)?, g)))
                    .max_by_key(|(n, _)| *n);
                if let Some((n, g)) = widest {
                    let (tv, a) = g.members[g.members.len() - 1];
                    by.push(format!("{} axis {a} runs {} over {n}", f.tv_name(tv), pt.enum_name()));
                }
            }
            if by.is_empty() {
                return e;
            }
            crate::error::KilnError { kind: e.kind, message: format!("{} [{}]", e.message, by.join(", ")) }
        })
    }

    /// No split factor far past the size it splits: its loop would run mostly empty
    /// (predicated-off) iterations, for as long as the factor says (a typo such as a factor
    /// of 2^31 - 1 on an axis of 16 would keep the GPU, or the interpreter, busy for minutes).
    fn check_split_padding(&self, eval: &impl Fn(ValId) -> Option<i64>) -> crate::Result<()> {
        let f = &self.fusion;
        for tv in f.tvs.keys() {
            for t in f.transforms_of(tv) {
                let crate::ir::Transform::Split { input, factor, .. } = f.transforms[t] else { continue };
                let (Some(k), Some(n)) = (f.scalars.as_int(factor), eval(f.ids[input].extent)) else { continue };
                if k > MAX_SPLIT_PADDING && k > n {
                    crate::bail!(
                        "split {}: axis {} has size {n} but is split by {k}: its loop would run {k} iterations for {n} elements; split it by at most {}",
                        f.tv_name(tv),
                        f.id_label(input),
                        n.max(MAX_SPLIT_PADDING)
                    );
                }
            }
        }
        Ok(())
    }

    /// Local memory per thread within the GPU's limit (constant sizes; CUDA code generation
    /// checks it: the interpreter of a fusion as written holds whole tensors per thread).
    pub fn check_local_memory(&self) -> crate::Result<()> {
        self.check_memory(&|v| self.fusion.scalars.as_int(v), true)
    }

    /// Shared memory per block (and with `local`, Local memory per thread) within the
    /// device's limits, the error naming the tensors that take it (largest first).
    fn check_memory(&self, eval: &impl Fn(ValId) -> Option<i64>, local: bool) -> crate::Result<()> {
        fn walk(nodes: &[Node], out: &mut Vec<(TvId, MemoryType, Option<i64>)>, eval: &dyn Fn(ValId) -> Option<i64>) {
            for n in nodes {
                if let Node::Alloc(a) = n {
                    if let AllocTarget::Tensor(tv) = a.target {
                        let mut bytes = Some(a.dtype.size_bytes() as i64);
                        for &e in &a.shape {
                            bytes = bytes.zip(eval(e)).map(|(b, n)| b.saturating_mul(n));
                        }
                        out.push((tv, a.memory, bytes));
                    }
                }
                for b in n.bodies() {
                    walk(b, out, eval);
                }
            }
        }
        let mut allocs = Vec::new();
        walk(&self.body, &mut allocs, eval);
        let f = &self.fusion;
        let named = |mt: MemoryType| -> String {
            let mut v: Vec<(i64, TvId)> =
                allocs.iter().filter(|a| a.1 == mt).filter_map(|&(tv, _, b)| Some((b?, tv))).collect();
            v.sort_by_key(|a| std::cmp::Reverse(a.0));
            v.iter().map(|(b, tv)| format!("{} {b} bytes", f.tv_name(*tv))).collect::<Vec<_>>().join(", ")
        };
        let local_bytes: i64 = allocs.iter().filter(|a| a.1 == MemoryType::Local).filter_map(|a| a.2).sum();
        if local_bytes > MAX_LOCAL_BYTES && local {
            crate::bail!(
                "the schedule needs {local_bytes} bytes of Local memory per thread ({}); the GPU allows at most {MAX_LOCAL_BYTES} (inline the tensors deeper, or parallelize their axes)",
                named(MemoryType::Local)
            );
        }
        if let Some(s) = eval(self.launch.smem_bytes).filter(|&s| s > MAX_SHARED_BYTES) {
            crate::bail!(
                "the schedule needs {s} bytes of Shared memory per block; the target allows at most {MAX_SHARED_BYTES} (use smaller tiles or Local memory; Shared tensors: {})",
                named(MemoryType::Shared)
            );
        }
        Ok(())
    }

    /// Every gather of the kernel: (site id, index tensor, selected-from tensor), the
    /// sites its error word names.
    pub fn gathers(&self) -> Vec<(u32, TvId, TvId)> {
        fn walk(nodes: &[Node], out: &mut Vec<(u32, TvId, TvId)>) {
            for n in nodes {
                if let Some(ix) = n.access_index() {
                    out.extend(ix.gathers.iter().map(|g| (g.id, g.index_tv, g.table)));
                }
                for b in n.bodies() {
                    walk(b, out);
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.body, &mut out);
        out
    }

    /// The first size constraint that sizes evaluated by `eval` break, as the error to
    /// raise before the kernel runs (the GPU plan and the interpreter both check).
    pub fn size_violation(&self, eval: impl Fn(ValId) -> Option<i64>) -> Option<crate::error::KilnError> {
        self.size_constraints.iter().find_map(|(x, y, what)| match (eval(*x), eval(*y)) {
            (Some(a), Some(b)) if a != b => {
                Some(crate::error::KilnError::value(format!("{what}: sizes {a} and {b} must be equal")))
            }
            _ => None,
        })
    }

    /// Allocation records in tensor order.
    pub fn allocation_list(&self) -> Vec<&AllocationInfo> {
        let mut v: Vec<&AllocationInfo> = self.allocations.values().collect();
        v.sort_by_key(|a| a.tv);
        v
    }

    /// Readable kernel IR.
    pub fn to_text(&self) -> String {
        IrText { fusion: &self.fusion, summary: &self.summary }.body(&self.body)
    }

    /// The allocation table as text (`KILN_DUMP=allocations`).
    pub fn allocations_text(&self) -> String {
        let f = &self.fusion;
        let mut s = String::new();
        for a in self.allocation_list() {
            let ids: Vec<String> = a.ids.iter().map(|&i| f.id_label(i)).collect();
            let strides: Vec<String> = a.strides.iter().map(|&v| f.scalars.render(v)).collect();
            let _ = writeln!(
                s,
                "{} {} ids=[{}] strides=[{}] contiguity={:?} position={}{}{}",
                f.tv_name(a.tv),
                a.memory.enum_name(),
                ids.join(", "),
                strides.join(", "),
                a.contiguity,
                a.position,
                if a.zero_init { " zero_init" } else { "" },
                if a.resets_to_zero { " resets_to_zero" } else { "" }
            );
        }
        for b in &self.summary.global_allocations {
            let shape: Vec<String> = b.shape.iter().map(|&v| f.scalars.render(v)).collect();
            let _ = writeln!(
                s,
                "global buffer {} {} [{}] zero_init={} resets_to_zero={}",
                b.name,
                b.dtype,
                shape.join(", "),
                b.zero_init,
                b.resets_to_zero
            );
        }
        s
    }
}

/// The printer of kernel IR (`KILN_DUMP=kernel_ir`, `after:<pass>`): the nodes with the
/// fusion and buffer list they refer to.
pub struct IrText<'a> {
    pub fusion: &'a Fusion,
    pub summary: &'a KernelSummary,
}

impl IrText<'_> {
    /// Readable text of `body`.
    pub fn body(&self, body: &[Node]) -> String {
        let mut s = String::new();
        for n in body {
            self.write_node(n, 0, &mut s);
        }
        s
    }

    fn write_node(&self, n: &Node, depth: usize, s: &mut String) {
        let f = &self.fusion;
        let pad = "  ".repeat(depth);
        match n {
            Node::Loop(l) => {
                let part = match l.pipeline {
                    Some(p) => format!("  // pipelined {}, {} iterations", p.name(), f.scalars.render(l.extent)),
                    // A loop lowering made over an id's range of another length.
                    None if l.extent != f.ids[l.id].extent => {
                        format!("  // {} iterations", f.scalars.render(l.extent))
                    }
                    None => String::new(),
                };
                let _ = writeln!(
                    s,
                    "{pad}FOR {} in {}:{part}",
                    f.scalars.render(l.index),
                    if l.parallel == ParallelType::Serial {
                        f.id_label(l.id)
                    } else {
                        format!("{} ({})", f.id_label(l.id), l.parallel.enum_name())
                    }
                );
                for c in &l.body {
                    self.write_node(c, depth + 1, s);
                }
            }
            Node::Alloc(a) => {
                let name = match a.target {
                    AllocTarget::Tensor(tv) => f.tv_name(tv),
                    AllocTarget::Buffer(i) => self.summary.global_allocations[i].name.clone(),
                    AllocTarget::Barriers(i) => format!("mbar{i} (mbarriers)"),
                };
                let shape: Vec<String> = a.shape.iter().map(|&v| f.scalars.render(v)).collect();
                // A Tensor-memory tensor: its lane and columns in the region.
                let place = match a.target {
                    AllocTarget::Tensor(tv) => {
                        self.summary.tensor_memory.as_ref().and_then(|r| r.tensors.iter().find(|p| p.tv == tv)).map(
                            |p| {
                                format!(
                                    " at lane offset {} columns {}..{}",
                                    p.lane_offset,
                                    p.column_offset,
                                    p.column_offset + p.columns
                                )
                            },
                        )
                    }
                    _ => None,
                };
                let _ = writeln!(
                    s,
                    "{pad}ALLOCATE {name} {} {} [{}]{}{}{}",
                    if place.is_some() { "Tensor" } else { a.memory.enum_name() },
                    a.dtype,
                    shape.join(", "),
                    if a.zero_init { " zero_init" } else { "" },
                    if a.resets_to_zero { " resets_to_zero" } else { "" },
                    place.unwrap_or_default()
                );
            }
            Node::Init { tv, value, index } => {
                let note = self.index_note(index.as_ref());
                let _ = writeln!(s, "{pad}{} = {}  // init{note}", f.tv_name(*tv), f.scalars.render(*value));
            }
            Node::Expr { expr, index } => {
                let note = self.index_note(index.as_ref());
                let _ = writeln!(s, "{pad}{}{note}", f.expr_short(&f.exprs[*expr]));
            }
            Node::Sync(k) => {
                let _ = writeln!(s, "{pad}__syncthreads()  // {}", if *k == SyncKind::Raw { "RAW" } else { "WAR" });
            }
            Node::If(i) => {
                let why = match i.kind {
                    IfKind::Unswitch => "unswitch",
                    IfKind::InvariantBounds => "invariant bounds",
                };
                let _ = writeln!(s, "{pad}IF {}:  // {why}", f.scalars.render(i.cond));
                for c in &i.then {
                    self.write_node(c, depth + 1, s);
                }
                if !i.otherwise.is_empty() {
                    let _ = writeln!(s, "{pad}ELSE:");
                    for c in &i.otherwise {
                        self.write_node(c, depth + 1, s);
                    }
                }
            }
            Node::Vector(v) => {
                let sc = &f.scalars;
                let when = if v.whole {
                    format!("{} (whole or none)", sc.render(v.first))
                } else if let Some(p) = v.pad_else {
                    format!("{} (whole), else zeros if {}", sc.render(v.first), sc.render(p))
                } else {
                    format!("{} and {}; else:", sc.render(v.first), sc.render(v.last))
                };
                let _ = writeln!(
                    s,
                    "{pad}VECTOR x{} {}  @ [{}] <- [{}] {:?} if {when}",
                    v.width,
                    f.expr_short(&f.exprs[v.expr]),
                    sc.render(v.out),
                    sc.render(v.input),
                    v.access,
                );
                if !v.whole && v.pad_else.is_none() {
                    self.write_node(&Node::Loop(v.fallback.clone()), depth + 1, s);
                }
            }
            Node::Barrier(op) => {
                let sc = &f.scalars;
                let b = |r: &BarrierRef| format!("mbar{}[{}]", r.array, sc.render(r.index));
                let _ = match op {
                    BarrierOp::Init { bar, arrivals } => {
                        writeln!(s, "{pad}MBARRIER_INIT {} arrivals={}  // first thread", b(bar), sc.render(*arrivals))
                    }
                    BarrierOp::Inval { bar } => writeln!(s, "{pad}MBARRIER_INVAL {}  // first thread", b(bar)),
                    BarrierOp::Arrive { bar } => writeln!(s, "{pad}MBARRIER_ARRIVE {}", b(bar)),
                    BarrierOp::Wait { bar, parity } => {
                        writeln!(s, "{pad}MBARRIER_WAIT {} parity {}", b(bar), sc.render(*parity))
                    }
                };
            }
            Node::CpAsync(op) => {
                let _ = match op {
                    CpAsyncOp::Commit => writeln!(s, "{pad}CP_ASYNC_COMMIT"),
                    CpAsyncOp::Wait(n) => writeln!(s, "{pad}CP_ASYNC_WAIT {n}"),
                };
            }
            Node::TensorMemory(op) => {
                let cols = self.summary.tensor_memory.as_ref().map_or(0, |r| r.columns);
                let _ = match op {
                    TmemOp::Alloc => writeln!(s, "{pad}TMEM_ALLOC {cols} columns -> smem slot  // first warp"),
                    TmemOp::Relinquish => writeln!(s, "{pad}TMEM_RELINQUISH_ALLOC_PERMIT  // first warp"),
                    TmemOp::Dealloc => writeln!(s, "{pad}TMEM_DEALLOC {cols} columns  // first warp"),
                };
            }
            Node::BulkLoad(bl) => {
                let sc = &f.scalars;
                let e = &f.exprs[bl.expr];
                let src = e.inputs[0].tensor().map_or_else(String::new, |t| f.tv_name(t));
                let mut line = format!(
                    "{pad}BULK {}[{}] <- {src}[{}] x {} arrive mbar{}[{}]",
                    f.tv_name(e.output),
                    sc.render(bl.dst),
                    sc.render(bl.src),
                    sc.render(bl.elems),
                    bl.bar.array,
                    sc.render(bl.bar.index)
                );
                if sc.as_int(bl.guard) != Some(1) {
                    let _ = write!(line, " if {}", sc.render(bl.guard));
                }
                if let Some((r, parity, when)) = &bl.reuse {
                    let _ = write!(
                        line,
                        " after MBARRIER_WAIT mbar{}[{}] parity {} if {}",
                        r.array,
                        sc.render(r.index),
                        sc.render(*parity),
                        sc.render(*when)
                    );
                }
                let _ = writeln!(s, "{line}  // first thread");
            }
            Node::AccumulatorInit(a) => {
                let _ =
                    writeln!(s, "{pad}acc{} = identity  // register of {}", a.id, f.tv_name(f.exprs[a.expr].output));
            }
            Node::Accumulate { acc, index } => {
                let note = self.index_note(Some(index));
                let _ = writeln!(s, "{pad}acc{} += {}{note}", acc.id, f.expr_short(&f.exprs[acc.expr]));
            }
            Node::ReduceAccumulator { acc, index, complete, grouped } => {
                let note = self.index_note(Some(index));
                let _ = writeln!(
                    s,
                    "{pad}{} {} parallel reduction of acc{}{note}{}",
                    f.tv_name(f.exprs[acc.expr].output),
                    if *complete { "=" } else { "+=" },
                    acc.id,
                    if *grouped { "  // grouped with the next" } else { "" }
                );
            }
        }
    }

    /// `  @ [out offset] <- [input offsets] if predicate` for an indexed node.
    fn index_note(&self, index: Option<&AccessIndex>) -> String {
        let Some(ix) = index else {
            return String::new();
        };
        let sc = &self.fusion.scalars;
        let mut s = format!("  @ [{}]", sc.render(ix.out));
        let ins: Vec<String> = ix.inputs.iter().flatten().map(|&v| format!("[{}]", sc.render(v))).collect();
        if !ins.is_empty() {
            let _ = write!(s, " <- {}", ins.join(", "));
        }
        for g in &ix.gathers {
            let _ = write!(s, " with g{} = {}[{}]", g.id, self.fusion.tv_name(g.index_tv), sc.render(g.at));
        }
        if sc.as_int(ix.predicate) != Some(1) {
            let _ = write!(s, " if {}", sc.render(ix.predicate));
        }
        s
    }
}
