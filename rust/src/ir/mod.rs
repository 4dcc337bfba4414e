//! The fusion IR: an arena of plain-data nodes named by typed `u32` ids.
//! Use-def links are ids; analyses keep their results in side tables.

pub mod dtype;
pub mod mapping;
pub mod mesh;
pub mod op_table;
pub mod ops;
pub mod printer;
pub mod random;
pub mod scalar;
pub mod shape_ops;

use cranelift_entity::{entity_impl, PrimaryMap};
use smallvec::SmallVec;

pub use dtype::{DataType, IterType, MemoryType, ParallelType};
pub use op_table::{BinaryClass, BinaryOp, UnaryClass, UnaryOp};
pub use scalar::{Scalars, Symbol, ValId};

use crate::error::Result;

/// Id of an [`IterDomain`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IterDomainId(u32);
entity_impl!(IterDomainId, "id");

/// Id of a domain [`Transform`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransformId(u32);
entity_impl!(TransformId, "tr");

/// Id of a [`TensorView`]; printed `T{n}`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TvId(u32);
entity_impl!(TvId, "T");

/// Id of a tensor [`Expr`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExprId(u32);
entity_impl!(ExprId, "e");

/// One axis of iteration: an extent, an iteration kind and a hardware mapping.
#[derive(Clone, Debug)]
pub struct IterDomain {
    pub extent: ValId,
    pub start: ValId,
    pub iter_type: IterType,
    pub parallel: ParallelType,
    /// The transform that produced this id; `None` for logical ids.
    pub definition: Option<TransformId>,
    /// The transform that consumes this id, if it was split or merged.
    pub use_: Option<TransformId>,
}

/// A transform between IterDomains of one tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transform {
    /// `input` -> (`outer`, `inner`); the `factor` sizes `inner` when `inner_split`,
    /// else `outer`. The other side is `ceilDiv(extent, factor)`.
    Split { input: IterDomainId, factor: ValId, inner_split: bool, outer: IterDomainId, inner: IterDomainId },
    /// (`outer`, `inner`) -> `out` with extent `outer * inner`.
    Merge { outer: IterDomainId, inner: IterDomainId, out: IterDomainId },
}

impl Transform {
    /// Ids this transform consumes.
    pub fn inputs(&self) -> SmallVec<[IterDomainId; 2]> {
        match *self {
            Transform::Split { input, .. } => SmallVec::from_slice(&[input]),
            Transform::Merge { outer, inner, .. } => SmallVec::from_slice(&[outer, inner]),
        }
    }
    /// Ids this transform produces.
    pub fn outputs(&self) -> SmallVec<[IterDomainId; 2]> {
        match *self {
            Transform::Split { outer, inner, .. } => SmallVec::from_slice(&[outer, inner]),
            Transform::Merge { out, .. } => SmallVec::from_slice(&[out]),
        }
    }
}

/// How a tensor's loads are pipelined: `stages` buffers, each iteration of the pipelined
/// loop loading the data of the iteration `prefetch` ahead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CircularBuffer {
    pub stages: u32,
    pub prefetch: u32,
}

/// A tensor: its domains, dtype, memory and inline position.
#[derive(Clone, Debug)]
pub struct TensorView {
    pub dtype: DataType,
    pub memory: MemoryType,
    /// The shape the user sees (reduction outputs keep their reduced ids here).
    pub logical: Vec<IterDomainId>,
    /// Set where a reduction's rfactor needs a domain before `logical`.
    pub root: Option<Vec<IterDomainId>>,
    /// Memory layout, any transform of `logical`; `None` means logical order.
    pub allocation: Option<Vec<IterDomainId>>,
    /// Per id of the allocation (or logical) domain; `None` for broadcast ids.
    pub contiguity: Vec<Option<bool>>,
    /// What the loop nest iterates.
    pub loop_domain: Vec<IterDomainId>,
    /// Number of outer loop ids shared with consumers (compute-at position).
    pub inline_pos: usize,
    /// `inline_at(-1)` asked while a consumer was untouched: the deepest valid position is
    /// found again once that consumer has taken its schedule (`propagate`).
    pub inline_deepest: bool,
    /// Its inline position was asked for (`inline_at`): propagation keeps it, even at 0.
    pub inline_pinned: bool,
    pub definition: Option<ExprId>,
    pub uses: Vec<ExprId>,
    /// Its loads pipelined over several Shared buffers (`circular_buffer`).
    pub circular_buffer: Option<CircularBuffer>,
    /// Reduce across blocks one block at a time (deterministic; semaphores reset to zero).
    pub serial_grid_reduction: bool,
    /// Its definition reads a Global tensor that nothing reads again: vector loads skip
    /// L1 allocation (`set_streaming_load`).
    pub streaming_load: bool,
    /// Its definition reads a Global input whose lines should outlive other data in L2:
    /// vector loads carry an L2 evict_last hint (`set_evict_last`).
    pub evict_last_load: bool,
    /// Kept in Blackwell's Tensor memory (`MemoryType.Tensor`, sm_100a): `memory` stays
    /// Local, since each thread reads only the cells it wrote (its lane), and every analysis
    /// treats it as such; allocation, codegen and the interpreter place it in a Tensor-memory
    /// region (tcgen05.alloc/ld/st/dealloc).
    pub tensor_memory: bool,
    /// An input whose contiguity the definition declared: arrays must honour it. An input
    /// without one takes the layout of the arrays it is run with (the automatic path
    /// specialises its kernels on their stride pattern).
    pub declared_contiguity: bool,
}

impl TensorView {
    /// The allocation domain if set, else the logical domain.
    pub fn maybe_allocation(&self) -> &[IterDomainId] {
        self.allocation.as_deref().unwrap_or(&self.logical)
    }
}

/// An operand of a tensor expression.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operand {
    Tensor(TvId),
    Scalar(ValId),
}

impl Operand {
    /// The tensor behind the operand, if it is one.
    pub fn tensor(self) -> Option<TvId> {
        match self {
            Operand::Tensor(t) => Some(t),
            Operand::Scalar(_) => None,
        }
    }
}

/// Reduction combiners.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReductionOp {
    Sum,
    Max,
    Min,
    Prod,
    /// `log(sum(exp(x)))`, floating point only: one pass with a running maximum.
    LogSumExp,
    /// `LogSumExp` of the elements raised to `-LSE_FLOOR` unless they are -inf (not in the
    /// Python API: the online log-sum-exp of `sched::auto::canonical`, see `LSE_FLOOR`).
    /// Its partial results are at or above the floor already (or -inf), so they merge as
    /// `LogSumExp`'s do, and raising them again leaves them as they are.
    LogSumExpFloored,
}

impl ReductionOp {
    /// Both log-sum-exps, plain and floored.
    pub fn is_log_sum_exp(self) -> bool {
        matches!(self, ReductionOp::LogSumExp | ReductionOp::LogSumExpFloored)
    }
}

/// Values below `-LSE_FLOOR` in a floored log-sum-exp's row (masks such as -1e30 or
/// `finfo.min`) are summed as `-LSE_FLOOR`: next to a maximum that large the log-sum-exp,
/// even in double, loses `log(n)` (from 1e16 on, a row masked whole gave 1 per element, not
/// 1/n). Beside any value above the floor such a term is `exp(-2^32 - max)`, zero as it was;
/// a row with nothing above it counts its finite values as equal, which they are where one
/// mask fills it. 2^32 keeps the usual -1e9 padding mask above the floor (a padding row under
/// a causal `finfo.min` mask shares among its -1e9 entries), and there the double's own
/// rounding is 2^-21 of `log(n)`.
pub const LSE_FLOOR: f64 = 4_294_967_296.0;

/// `x` raised to `-LSE_FLOOR` unless it is -inf or NaN (the elements of
/// `ReductionOp::LogSumExpFloored`).
pub fn lse_raise(x: f64) -> f64 {
    if x.is_nan() || x == f64::NEG_INFINITY {
        x
    } else {
        x.max(-LSE_FLOOR)
    }
}

/// What a tensor expression computes.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    Unary(UnaryOp),
    Binary(BinaryOp),
    /// `where(cond, a, b)`.
    Where,
    Cast(DataType),
    /// Reduces the output's Reduction ids; `init` is the identity.
    Reduction {
        op: ReductionOp,
        init: ValId,
    },
    /// `is_new[i]` marks output logical ids that are new broadcast ids.
    Broadcast {
        is_new: Vec<bool>,
    },
    /// Drops the input's size-one axes where `removed[i]` (nvFuser's `squeeze`).
    Squeeze {
        removed: Vec<bool>,
    },
    /// `output.logical[i]` comes from `input.logical[perm[i]]`.
    Permute {
        perm: Vec<usize>,
    },
    /// `out = input.index_select(dim, index)`; inputs are [input, index].
    IndexSelect {
        dim: usize,
    },
    /// Reads the input at positions computed from the output's logical positions: input
    /// axis `j` at `index[j]`, an expression of `Symbol::OutAxis(k)` (the position along
    /// output axis `k`), where `valid` holds; elsewhere it reads nothing and its value is
    /// unspecified (0 in the kernels), so every builder masks those positions. slice, pad,
    /// cat and reshape are remaps; `name` says which one the user wrote. No input axis maps
    /// to an output axis, so the input is read whole from memory, like a gather's table.
    Remap {
        name: &'static str,
        index: Vec<ValId>,
        valid: Option<ValId>,
    },
    /// A copy (`set`), used by caches.
    Set,
    /// Bool: true where `valid`, an expression of the output's positions
    /// (`Symbol::OutAxis(k)`), holds. Pad, cat and triu choose by it.
    Mask {
        valid: ValId,
    },
    /// A tensor filled with a scalar.
    Full {
        value: ValId,
    },
    /// `start + i * step` at row-major position `i` of the output (one axis as users write
    /// it; the canonical form remakes it at shapes that keep every element's position: a
    /// broadcast's rank with size-one new axes, a reshape).
    Iota {
        start: ValId,
        step: ValId,
    },
    /// Counter-based random numbers (Philox 4x32-10): the element at row-major position
    /// `i` of the output is drawn from counter `(i, offset)` under key `seed`, so it does
    /// not depend on the schedule. Uniform in `[a, b)`, or normal with mean `a` and
    /// standard deviation `b`.
    Random {
        dist: RandomDist,
        a: ValId,
        b: ValId,
        seed: ValId,
        offset: ValId,
    },
}

/// The distribution of [`Op::Random`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RandomDist {
    Uniform,
    Normal,
}

impl Op {
    /// The operand read at positions that another operand holds (a gather's table) or that
    /// the op computes (a remap's input).
    pub fn indexed_input(&self) -> Option<usize> {
        matches!(self, Op::IndexSelect { .. } | Op::Remap { .. }).then_some(0)
    }

    /// The operand holding positions into [`Op::indexed_input`] (a gather's index tensor).
    pub fn index_input(&self) -> Option<usize> {
        matches!(self, Op::IndexSelect { .. }).then_some(1)
    }

    /// True for an op that reads one operand at data-dependent positions.
    pub fn is_gather(&self) -> bool {
        self.indexed_input().is_some()
    }

    /// True for an op that computes each output element from its operands' elements at the
    /// same position (unary, binary, where, cast, set).
    pub fn is_elementwise(&self) -> bool {
        matches!(self, Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_) | Op::Set)
    }

    /// True for an op that reads no tensor and makes its output from scalars.
    pub fn is_source(&self) -> bool {
        matches!(self, Op::Full { .. } | Op::Iota { .. } | Op::Random { .. } | Op::Mask { .. })
    }

    /// True for an op whose value depends on the position of the element it writes
    /// (`AccessIndex::element` carries it).
    pub fn reads_position(&self) -> bool {
        matches!(self, Op::Iota { .. } | Op::Random { .. })
    }

    /// The expressions of output positions a remap or mask computes with.
    pub fn position_exprs(&self) -> SmallVec<[ValId; 4]> {
        match self {
            Op::Remap { index, valid, .. } => index.iter().copied().chain(*valid).collect(),
            Op::Mask { valid } => smallvec::smallvec![*valid],
            _ => SmallVec::new(),
        }
    }

    /// The scalars the op reads besides its operands.
    pub fn scalars(&self) -> SmallVec<[ValId; 4]> {
        match *self {
            Op::Reduction { init, .. } => smallvec::smallvec![init],
            Op::Full { value } => smallvec::smallvec![value],
            Op::Iota { start, step } => smallvec::smallvec![start, step],
            Op::Random { a, b, seed, offset, .. } => smallvec::smallvec![a, b, seed, offset],
            _ => SmallVec::new(),
        }
    }
}

/// A tensor expression with one output.
#[derive(Clone, Debug)]
pub struct Expr {
    pub op: Op,
    pub inputs: SmallVec<[Operand; 3]>,
    pub output: TvId,
}

impl Expr {
    /// The tensor this expression reads at data-dependent positions (a gather's table).
    pub fn indexed_tensor(&self) -> Option<TvId> {
        self.op.indexed_input().and_then(|p| self.inputs[p].tensor())
    }

    /// The tensor holding those positions (a gather's index tensor).
    pub fn index_tensor(&self) -> Option<TvId> {
        self.op.index_input().and_then(|p| self.inputs[p].tensor())
    }

    /// Tensor inputs, in operand order.
    pub fn input_tvs(&self) -> impl Iterator<Item = TvId> + '_ {
        self.inputs.iter().filter_map(|o| o.tensor())
    }
}

/// A whole fusion: the arena every other stage reads.
#[derive(Clone, Debug, Default)]
pub struct Fusion {
    pub scalars: Scalars,
    pub ids: PrimaryMap<IterDomainId, IterDomain>,
    pub transforms: PrimaryMap<TransformId, Transform>,
    pub tvs: PrimaryMap<TvId, TensorView>,
    pub exprs: PrimaryMap<ExprId, Expr>,
    /// Fusion inputs in the order `execute` takes them (tensors and scalars).
    pub inputs: Vec<Operand>,
    pub outputs: Vec<TvId>,
    /// Dtype of each runtime scalar input `s{n}`.
    pub scalar_input_dtypes: Vec<DataType>,
    next_extent: u32,
    /// Where each symbolic extent `i{n}` comes from: (input tensor, logical axis).
    pub extent_sources: Vec<(TvId, usize)>,
    /// True once any scheduling primitive was called; the auto-schedulers then stay out.
    pub manually_scheduled: bool,
    /// The schedule is the user's own (`fd.lower` of a hand schedule): a Vectorize loop
    /// that cannot be one wide access is an error, where an automatic schedule (compiled
    /// for any input layout) falls back to element accesses.
    pub hand_schedule: bool,
    /// Tensors after whose definition a new segment (kernel) starts (`fd.segment_after`).
    pub segment_after: Vec<TvId>,
    /// Give every reduction and permute a segment of its own (the automatic segmenter's
    /// fallback: two independent reductions over different axes cannot share a kernel).
    pub segment_each_boundary: bool,
    /// Every Global tensor the kernels access starts at a 16-byte aligned address (the
    /// host checked the user's inputs for this plan; kiln's own buffers always are). A
    /// vector access then needs only its offset checked, or nothing when the offset is a
    /// known multiple of the vector width.
    pub aligned_bases: bool,
    /// In-place outputs (`fd.add_output(out, alias_input=inp)`): (output, the input whose
    /// buffer receives it). The output is computed like any other, then copied into the
    /// input's buffer after every launch, so no kernel reads an input it overwrites.
    pub aliases: Vec<(TvId, TvId)>,
    /// Outputs the host hands back reshaped: (output, the shape the definition gave it).
    /// The canonical form computes a reshaped output at its source's shape
    /// (`canonical::hoist_output_reshapes`); row-major, the elements are the same.
    pub output_views: Vec<(TvId, Vec<ValId>)>,
    /// Outputs the host hands back in their stored order, as a plain row-major array of the
    /// stored shape. The canonical form computes an output that permutes a normalized tensor
    /// (`permute(rmsnorm(q), [0, 2, 1, 3])`) in the unpermuted order and stores it permuted
    /// (`canonical::store_output_permutes`): the same array, without a permute in the kernel.
    pub stored_outputs: Vec<TvId>,
    /// Tensors that read an input at another shape without a kernel: (view, input). The
    /// canonical form turns a row-major reshape of an input whose arrays are row-major
    /// (`canonical::view_input_reshapes`) into a tensor with no definition that the host
    /// binds to the input's buffer; kernels read it as a plain Global tensor in logical
    /// order, so its loads vectorize like any input's instead of going through the
    /// reshape's index arithmetic.
    pub input_views: Vec<(TvId, TvId)>,
    /// Views of `input_views` that read the input's buffer through its strides instead of
    /// row-major: per view axis, the input axis it reads (its size at most the input's,
    /// from index 0) or None for a new size-one axis. A gather's table that is a prefix
    /// slice of an input (`logits[:, :-1]`) or a broadcast of a transposed one
    /// (`canonical::view_strided_gather_tables`).
    pub strided_views: Vec<(TvId, Vec<Option<usize>>)>,
    /// Thread-block clusters (sm_90+): the block dimension whose blocks form one cluster,
    /// and its size, which the launch grid along that dimension must equal. A reduction
    /// over that dimension combines the cluster's blocks through their Shared memory
    /// (distributed Shared memory) and leaves the result in every block, like a block
    /// reduction; it needs no Global work buffers or semaphores.
    pub cluster: Option<(ParallelType, u32)>,
    /// Sizes the definition needs equal at run time (reshape's element counts, cat's kept
    /// axes), checked when the inputs are bound.
    pub size_checks: Vec<shape_ops::SizeCheck>,
    /// Tensors `0..user_tvs` are the definition's own; 0: all are. The automatic path
    /// sets it before it rewrites and schedules, so messages about a tensor it made (a
    /// cache, a recomputed copy, a canonical rewrite) can name the one the user defined.
    pub user_tvs: usize,
    /// A tensor the schedule made, and the tensor whose values it holds for its readers
    /// (see [`Fusion::user_tv`]).
    pub stands_for: rustc_hash::FxHashMap<TvId, TvId>,
    /// An intermediate that a kernel reads as an input, and the tensor the whole fusion cut
    /// or reshaped it from (see [`Fusion::reshaped_from`]), for messages.
    pub cut_from: rustc_hash::FxHashMap<TvId, TvId>,
    /// Device meshes and DIDx shardings of tensors (`t.set_device_mesh`, see `ir::mesh`).
    pub meshes: rustc_hash::FxHashMap<TvId, mesh::TvMesh>,
}

impl Fusion {
    /// True when `p` is the block dimension of the kernel's clusters.
    pub fn clustered(&self, p: ParallelType) -> bool {
        matches!(self.cluster, Some((c, _)) if c == p)
    }

    /// True when a reduction over `p` combines blocks through Global memory (a grid
    /// reduction): a block dimension that is not the clusters'.
    pub fn is_grid_dim(&self, p: ParallelType) -> bool {
        p.is_block() && !self.clustered(p)
    }

    /// An empty fusion.
    pub fn new() -> Self {
        Self::default()
    }

    /// A fresh symbolic extent `i{n}`.
    pub fn new_extent_symbol(&mut self) -> ValId {
        let n = self.next_extent;
        self.next_extent += 1;
        self.scalars.symbol(Symbol::Extent(n))
    }

    /// A new logical IterDomain.
    pub fn new_id(&mut self, extent: ValId, iter_type: IterType) -> IterDomainId {
        let start = self.scalars.int(0);
        self.ids.push(IterDomain {
            extent,
            start,
            iter_type,
            parallel: ParallelType::Serial,
            definition: None,
            use_: None,
        })
    }

    /// A new tensor whose loop domain is its logical domain.
    pub fn new_tv(&mut self, dtype: DataType, memory: MemoryType, logical: Vec<IterDomainId>) -> TvId {
        let contiguity = logical
            .iter()
            .map(|&id| if self.ids[id].iter_type == IterType::Broadcast { None } else { Some(true) })
            .collect();
        self.tvs.push(TensorView {
            dtype,
            memory,
            loop_domain: logical.clone(),
            logical,
            root: None,
            allocation: None,
            contiguity,
            inline_pos: 0,
            inline_deepest: false,
            inline_pinned: false,
            definition: None,
            uses: Vec::new(),
            circular_buffer: None,
            serial_grid_reduction: false,
            streaming_load: false,
            tensor_memory: false,
            evict_last_load: false,
            declared_contiguity: false,
        })
    }

    /// Add an expression and wire its use-def links.
    pub fn add_expr(&mut self, op: Op, inputs: SmallVec<[Operand; 3]>, output: TvId) -> ExprId {
        let e = self.exprs.push(Expr { op, inputs: inputs.clone(), output });
        for t in inputs.iter().filter_map(|o| o.tensor()) {
            if !self.tvs[t].uses.contains(&e) {
                self.tvs[t].uses.push(e);
            }
        }
        self.tvs[output].definition = Some(e);
        e
    }

    /// Make input extents `Extent(n)` the constants `value` of `(n, value)` everywhere.
    pub fn specialize_extents(&mut self, values: &[(u32, i64)]) {
        let by: rustc_hash::FxHashMap<crate::ir::Symbol, ValId> =
            values.iter().map(|&(n, v)| (crate::ir::Symbol::Extent(n), self.scalars.int(v))).collect();
        let mut memo = rustc_hash::FxHashMap::default();
        let ids: Vec<IterDomainId> = self.ids.keys().collect();
        for id in ids {
            let e = self.ids[id].extent;
            self.ids[id].extent = self.scalars.substitute_all(e, &by, &mut memo);
        }
    }

    /// True when `pred` holds for `id` or for an id it is computed from by splits and
    /// merges. Each id is visited once: a split merged back shares its input between both
    /// paths, so a walk of every path doubles with each split-merge pair of a schedule.
    pub fn id_derived_from_any(&self, id: IterDomainId, pred: impl Fn(IterDomainId) -> bool) -> bool {
        let mut seen = rustc_hash::FxHashSet::default();
        let mut stack = vec![id];
        while let Some(i) = stack.pop() {
            if !seen.insert(i) {
                continue;
            }
            if pred(i) {
                return true;
            }
            if let Some(t) = self.ids[i].definition {
                stack.extend(self.transforms[t].inputs().iter().copied());
            }
        }
        false
    }

    /// True when `tv` is a fusion input.
    pub fn is_input(&self, tv: TvId) -> bool {
        self.inputs.contains(&Operand::Tensor(tv))
    }

    /// The input axis each axis of `tv` reads where `tv` is a strided view of an input
    /// (`strided_views`), else None.
    pub fn strided_view_axes(&self, tv: TvId) -> Option<&[Option<usize>]> {
        self.strided_views.iter().find(|(v, _)| *v == tv).map(|(_, a)| a.as_slice())
    }

    /// True when `tv` is a fusion output.
    pub fn is_output(&self, tv: TvId) -> bool {
        self.outputs.contains(&tv)
    }

    /// Logical ids that are not reductions: the shape consumers see.
    pub fn no_reduction_logical(&self, tv: TvId) -> Vec<IterDomainId> {
        self.tvs[tv].logical.iter().copied().filter(|&id| self.ids[id].iter_type != IterType::Reduction).collect()
    }

    /// Tensors that read `tv`.
    pub fn consumers(&self, tv: TvId) -> Vec<TvId> {
        self.tvs[tv].uses.iter().map(|&e| self.exprs[e].output).collect()
    }

    /// Tensors `tv` is computed from.
    pub fn producers(&self, tv: TvId) -> Vec<TvId> {
        match self.tvs[tv].definition {
            Some(e) => self.exprs[e].input_tvs().collect(),
            None => Vec::new(),
        }
    }

    /// Exprs that contribute to the outputs, in dependency order.
    pub fn topo_exprs(&self) -> Vec<ExprId> {
        let mut order = Vec::new();
        let mut visited = cranelift_entity::EntitySet::<ExprId>::new();
        // Iterative DFS: deep chains (benchmarks build 1,000 ops) must not blow the stack.
        for &out in &self.outputs {
            let Some(root) = self.tvs[out].definition else {
                continue;
            };
            let mut stack: Vec<(ExprId, bool)> = vec![(root, false)];
            while let Some((e, done)) = stack.pop() {
                if done {
                    order.push(e);
                    continue;
                }
                if visited.contains(e) {
                    continue;
                }
                visited.insert(e);
                stack.push((e, true));
                for t in self.exprs[e].input_tvs() {
                    if let Some(d) = self.tvs[t].definition {
                        if !visited.contains(d) {
                            stack.push((d, false));
                        }
                    }
                }
            }
        }
        order
    }

    /// Every id between `tv`'s logical domain and its loop/allocation domains,
    /// with the transforms connecting them in application order.
    pub fn transforms_of(&self, tv: TvId) -> Vec<TransformId> {
        let mut out = Vec::new();
        let mut frontier: Vec<IterDomainId> = self.tvs[tv].logical.clone();
        if let Some(root) = &self.tvs[tv].root {
            frontier = root.clone();
        }
        let mut i = 0;
        while i < frontier.len() {
            if let Some(t) = self.ids[frontier[i]].use_ {
                if !out.contains(&t) {
                    // A merge is applied once both inputs are reached; the second reach records it.
                    let ready = self.transforms[t].inputs().iter().all(|x| frontier.contains(x));
                    if ready {
                        out.push(t);
                        frontier.extend(self.transforms[t].outputs());
                    }
                }
            }
            i += 1;
        }
        // Transform ids are allocated in application order.
        out.sort();
        out
    }

    /// Name of a tensor, `T{n}`.
    pub fn tv_name(&self, tv: TvId) -> String {
        format!("T{}", tv.as_u32())
    }

    /// Record that the schedule's tensor `new` holds `old`'s values for its readers (a
    /// cache, a recomputed copy, a rewrite); only tensors made after the definition count.
    pub fn note_stand_in(&mut self, new: TvId, old: TvId) {
        if self.user_tvs > 0 && new.as_u32() as usize >= self.user_tvs && new != old {
            self.stands_for.entry(new).or_insert(old);
        }
    }

    /// The definition's tensor that `tv` stands for (itself when it is one, or when the
    /// schedule made it from scratch).
    pub fn user_tv(&self, tv: TvId) -> TvId {
        let mut t = tv;
        for _ in 0..self.tvs.len() {
            if self.user_tvs == 0 || (t.as_u32() as usize) < self.user_tvs {
                break;
            }
            match self.stands_for.get(&t) {
                Some(&o) => t = o,
                None => break,
            }
        }
        t
    }

    /// How messages name a gather's table: [`Fusion::user_tv_name`], plus the tensor it was
    /// cut or reshaped from (`T2 (from T0)`), since a definition's `gather` or `select`
    /// makes tables the user never named.
    pub fn table_name(&self, tv: TvId) -> String {
        let t = self.user_tv(tv);
        let src = self.reshaped_from(t);
        if src == t {
            self.tv_name(t)
        } else {
            format!("{} (from {})", self.tv_name(t), self.tv_name(src))
        }
    }

    /// The tensor `tv` was cut, broadcast, permuted or copied from, through any chain of
    /// such ops (itself when it is computed otherwise, or an input).
    pub fn reshaped_from(&self, tv: TvId) -> TvId {
        let mut src = tv;
        for _ in 0..self.tvs.len() {
            let next = match self.tvs[src].definition {
                Some(d) => {
                    let ex = &self.exprs[d];
                    let reshaping = matches!(
                        ex.op,
                        Op::Remap { .. } | Op::Broadcast { .. } | Op::Squeeze { .. } | Op::Set | Op::Permute { .. }
                    );
                    ex.inputs.first().and_then(|o| o.tensor()).filter(|_| reshaping)
                }
                // A view of an input's buffer (`input_views`) was cut from that input.
                None => self
                    .cut_from
                    .get(&src)
                    .copied()
                    .or_else(|| self.input_views.iter().find(|&&(v, _)| v == src).map(|&(_, x)| x)),
            };
            match next {
                Some(x) => src = self.user_tv(x),
                None => break,
            }
        }
        src
    }

    /// How messages name a gather's index tensor: [`Fusion::user_tv_name`] of the tensor
    /// it was copied from through ops that keep its elements in row-major order (a 0-d
    /// index that `index_select` gave an axis of one, a squeeze), so that an element
    /// position in the message is one of the tensor the user passed.
    pub fn index_name(&self, tv: TvId) -> String {
        let mut t = tv;
        for _ in 0..self.tvs.len() {
            let Some(d) = self.tvs[t].definition else {
                match self.user_tv(t) {
                    u if u != t => {
                        t = u;
                        continue;
                    }
                    _ => break,
                }
            };
            let ex = &self.exprs[d];
            let same_order = match &ex.op {
                Op::Set | Op::Squeeze { .. } => true,
                // New axes of one element each keep every element's row-major position.
                Op::Broadcast { is_new } => self
                    .no_reduction_logical(ex.output)
                    .iter()
                    .zip(is_new)
                    .all(|(&id, &new)| !new || self.scalars.as_int(self.ids[id].extent) == Some(1)),
                _ => false,
            };
            match ex.inputs.first().and_then(|o| o.tensor()).filter(|_| same_order) {
                Some(x) => t = x,
                None => break,
            }
        }
        self.user_tv_name(t)
    }

    /// [`Fusion::tv_name`] of [`Fusion::user_tv`]: what messages about user data print.
    pub fn user_tv_name(&self, tv: TvId) -> String {
        self.tv_name(self.user_tv(tv))
    }

    /// Position of `id` in `tv`'s loop domain.
    pub fn loop_position(&self, tv: TvId, id: IterDomainId) -> Option<usize> {
        self.tvs[tv].loop_domain.iter().position(|&x| x == id)
    }

    /// Check a user-given axis against `tv`'s loop domain; negative counts from the end.
    pub fn normalize_axis(&self, tv: TvId, axis: i64) -> Result<usize> {
        let n = self.tvs[tv].loop_domain.len() as i64;
        let a = if axis < 0 { axis + n } else { axis };
        if a < 0 || a >= n {
            crate::bail!(
                "{}: axis {axis} is out of range; the loop domain has {n} axes (valid: {} to {})",
                self.tv_name(tv),
                -n,
                n - 1
            );
        }
        Ok(a as usize)
    }
}
