//! Kernel IR -> readable CUDA C++ (one `__global__` function per kernel) with the
//! runtime header prepended.
//!
//! Kernel parameter order (fixed): tensor inputs (fusion input order), outputs (fusion
//! output order), the KernelSummary global buffers (in order), then scalar inputs, then
//! the symbolic sizes and strides the kernel reads (extents `i{n}` ascending, then
//! strides). `CudaKernel::params` lists them with their sources.

use std::fmt::Write as _;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::bail;
use crate::error::Result;
use crate::ir::op_table::Cuda;
use crate::ir::scalar::{ScalarOp, Val};
use crate::ir::{
    BinaryOp, DataType, ExprId, Fusion, MemoryType, Op, Operand, ParallelType, ReductionOp, Symbol, TvId, UnaryOp,
    ValId,
};
use crate::kernel::{
    AccessIndex, AllocTarget, BarrierOp, BarrierRef, CpAsyncOp, ForLoop, IfKind, Kernel, Node, PipelinePart, SyncKind,
    TmemOp, VectorAccess, VectorCopy,
};
use crate::lower::predicate::conjuncts;

/// The runtime header every kernel includes.
pub const RUNTIME_HEADER: &str = include_str!("runtime.cuh");

/// Name of the generated `__global__` function.
pub const KERNEL_NAME: &str = "kiln_kernel";

/// Where a kernel parameter's value comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// Tensor input number `n` (position among the fusion's tensor inputs).
    Input(usize),
    /// Fusion output number `n`.
    Output(usize),
    /// `KernelSummary::global_allocations[n]`.
    Buffer(usize),
    /// Runtime scalar input `s{n}`.
    Scalar(u32),
    /// Symbolic extent `i{n}`.
    Extent(u32),
    /// Element stride `k` of a tensor's allocation domain.
    Stride(TvId, u32),
}

/// Generated CUDA source and its parameter list.
#[derive(Clone, Debug)]
pub struct CudaKernel {
    pub name: String,
    /// The kernel body (without the runtime header).
    pub body: String,
    /// Parameters in order: (C name, source, dtype).
    pub params: Vec<(String, ParamKind, DataType)>,
}

impl CudaKernel {
    /// Full translation unit: runtime header + kernel.
    pub fn source(&self) -> String {
        format!("{RUNTIME_HEADER}\n{}", self.body)
    }
}

struct Gen<'a> {
    k: &'a Kernel,
    f: &'a Fusion,
    sc: &'a crate::ir::Scalars,
    out: String,
    /// C name of each tensor's buffer.
    names: FxHashMap<TvId, String>,
    scratch: u32,
    /// Float values that end as half/bfloat16 values: their `exp`, `sigmoid` and division
    /// use the hardware approximations (see `analysis::narrow`).
    narrow: FxHashSet<TvId>,
    /// Float `exp` terms of shifted sums, computed with `ex2.approx` (see
    /// `analysis::narrow::shifted_sum_terms`).
    shifted: FxHashSet<TvId>,
    /// Large expressions of the kernel's parameters alone, computed once at its start.
    hoisted: FxHashMap<ValId, String>,
}

/// Expressions printed in full that span more nodes than this are computed once instead.
const HOIST_NODES: u64 = 24;

/// The expressions under `roots` that read only the kernel's parameters (sizes, strides,
/// scalar inputs) and print as more than [`HOIST_NODES`] nodes, operands before the
/// expressions that read them. A scalar DAG shares its nodes, but C prints each use again:
/// an axis sliced again and again (`e - min(e, 1)` of the last extent, every time) or a size
/// computed from itself twice per step doubles its printed length at each step, and such
/// sizes appear in every bounds check and index of the kernel.
fn large_invariants(sc: &crate::ir::Scalars, roots: &[ValId]) -> Vec<ValId> {
    // Per node: printed size (saturating), and whether it reads only parameters.
    let mut info: FxHashMap<ValId, (u64, bool)> = FxHashMap::default();
    let mut order = Vec::new();
    fn walk(sc: &crate::ir::Scalars, v: ValId, info: &mut FxHashMap<ValId, (u64, bool)>, order: &mut Vec<ValId>) {
        if info.contains_key(&v) {
            return;
        }
        let r = match sc.get(v) {
            Val::Symbol(Symbol::Extent(_) | Symbol::Stride(..) | Symbol::ScalarInput(_)) => (1, true),
            Val::Symbol(_) => (1, false),
            Val::Binary(_, a, b) => {
                walk(sc, a, info, order);
                walk(sc, b, info, order);
                let ((sa, ia), (sb, ib)) = (info[&a], info[&b]);
                (sa.saturating_add(sb).saturating_add(1), ia && ib)
            }
            _ => (1, true),
        };
        info.insert(v, r);
        order.push(v);
    }
    for &v in roots {
        walk(sc, v, &mut info, &mut order);
    }
    order.into_iter().filter(|v| matches!(info[v], (n, true) if n > HOIST_NODES)).collect()
}

fn collect_symbols(f: &Fusion, v: ValId, seen: &mut FxHashSet<ValId>, out: &mut FxHashSet<Symbol>) {
    if !seen.insert(v) {
        return;
    }
    match f.scalars.get(v) {
        Val::Symbol(s) => {
            out.insert(s);
        }
        Val::Binary(_, a, b) => {
            collect_symbols(f, a, seen, out);
            collect_symbols(f, b, seen, out);
        }
        _ => {}
    }
}

fn node_vals(n: &Node, f: &Fusion, acc: &mut Vec<ValId>) {
    match n {
        Node::Loop(l) => acc.push(l.extent),
        Node::Alloc(a) => acc.extend(a.shape.iter().copied()),
        Node::Init { value, .. } => acc.push(*value),
        Node::Expr { expr, .. } | Node::Accumulate { acc: crate::kernel::Accumulator { expr, .. }, .. } => {
            for o in &f.exprs[*expr].inputs {
                if let Operand::Scalar(v) = o {
                    acc.push(*v);
                }
            }
            acc.extend(f.exprs[*expr].op.scalars());
        }
        Node::AccumulatorInit(a) | Node::ReduceAccumulator { acc: a, .. } => {
            if let Op::Reduction { init, .. } = f.exprs[a.expr].op {
                acc.push(init);
            }
        }
        Node::If(i) => acc.push(i.cond),
        Node::Vector(v) => {
            acc.extend([v.out, v.input, v.first, v.last]);
            for g in &v.gathers {
                acc.extend([g.at, g.extent]);
            }
        }
        Node::Sync(_) | Node::CpAsync(_) | Node::TensorMemory(_) => {}
        Node::Barrier(op) => match op {
            BarrierOp::Init { bar, arrivals } => acc.extend([bar.index, *arrivals]),
            BarrierOp::Inval { bar } | BarrierOp::Arrive { bar } => acc.push(bar.index),
            BarrierOp::Wait { bar, parity } => acc.extend([bar.index, *parity]),
        },
        Node::BulkLoad(b) => {
            acc.extend([b.dst, b.src, b.elems, b.guard, b.bar.index]);
            if let Some((r, parity, when)) = b.reuse {
                acc.extend([r.index, parity, when]);
            }
        }
    }
    push_index(n.access_index(), acc);
    for b in n.bodies() {
        for c in b {
            node_vals(c, f, acc);
        }
    }
}

fn push_index(ix: Option<&AccessIndex>, acc: &mut Vec<ValId>) {
    if let Some(ix) = ix {
        acc.push(ix.out);
        acc.extend(ix.inputs.iter().flatten().copied());
        acc.push(ix.predicate);
        acc.push(ix.write_predicate);
        acc.extend(ix.element);
        for g in &ix.gathers {
            acc.push(g.at);
            acc.push(g.extent);
            // The element position an out-of-range index reports (the index tensor's own
            // sizes, which the loops may not read otherwise).
            acc.push(g.element);
        }
    }
}

/// Generate CUDA for a lowered kernel; `index32` picks 32-bit index arithmetic (valid
/// when every offset fits, which the host plan checks for concrete sizes).
pub fn generate(k: &Kernel, index32: bool) -> Result<CudaKernel> {
    k.check_local_memory()?;
    let index_dt = if index32 { DataType::Int32 } else { DataType::Int };
    let f = &k.fusion;
    let mut params: Vec<(String, ParamKind, DataType)> = Vec::new();
    let mut names: FxHashMap<TvId, String> = FxHashMap::default();
    let tensor_inputs: Vec<TvId> = f.inputs.iter().filter_map(|o| o.tensor()).collect();
    for (i, &tv) in tensor_inputs.iter().enumerate() {
        names.insert(tv, f.tv_name(tv));
        params.push((f.tv_name(tv), ParamKind::Input(i), f.tvs[tv].dtype));
    }
    for (i, &tv) in f.outputs.iter().enumerate() {
        if names.contains_key(&tv) {
            bail!("{} is both an input and an output of the fusion; copy it with a set op first", f.tv_name(tv));
        }
        names.insert(tv, f.tv_name(tv));
        params.push((f.tv_name(tv), ParamKind::Output(i), f.tvs[tv].dtype));
    }
    for (i, b) in k.summary.global_allocations.iter().enumerate() {
        if let Some(tv) = b.tv {
            names.insert(tv, b.name.clone());
        }
        params.push((b.name.clone(), ParamKind::Buffer(i), b.dtype));
    }
    // Scalars the kernel reads.
    let mut vals = Vec::new();
    for n in &k.body {
        node_vals(n, f, &mut vals);
    }
    if let Some(ws) = k.launch.reduction_workspace {
        vals.push(ws);
    }
    vals.extend(k.launch.smem_offsets.iter().map(|&(_, o)| o));
    let mut syms = FxHashSet::default();
    let mut seen = FxHashSet::default();
    for &v in &vals {
        collect_symbols(f, v, &mut seen, &mut syms);
    }
    let invariant = large_invariants(&f.scalars, &vals);
    let mut scalar_ins: Vec<u32> =
        syms.iter().filter_map(|s| if let Symbol::ScalarInput(n) = s { Some(*n) } else { None }).collect();
    scalar_ins.sort();
    for n in scalar_ins {
        params.push((format!("s{n}"), ParamKind::Scalar(n), f.scalar_input_dtypes[n as usize]));
    }
    let mut extents: Vec<u32> =
        syms.iter().filter_map(|s| if let Symbol::Extent(n) = s { Some(*n) } else { None }).collect();
    extents.sort();
    for n in extents {
        params.push((format!("i{n}"), ParamKind::Extent(n), index_dt));
    }
    let mut strides: Vec<(TvId, u32)> =
        syms.iter().filter_map(|s| if let Symbol::Stride(t, a) = s { Some((*t, *a)) } else { None }).collect();
    strides.sort();
    for (t, a) in strides {
        params.push((format!("{}_stride{a}", f.tv_name(t)), ParamKind::Stride(t, a), DataType::Int));
    }

    let narrow = crate::analysis::narrow::ends_narrow(f);
    let shifted = crate::analysis::narrow::shifted_sum_terms(f);
    let mut g = Gen {
        k,
        f,
        sc: &f.scalars,
        out: String::new(),
        names,
        scratch: 0,
        narrow,
        shifted,
        hoisted: FxHashMap::default(),
    };
    let sig: Vec<String> = params
        .iter()
        .map(|(name, kind, dt)| match kind {
            ParamKind::Input(_) => format!("const {}* __restrict__ {name}", dt.c_type()),
            // An output the kernel reads back is written and read by different threads across
            // a barrier; `__restrict__` lets the compiler hoist the read above the barrier (and
            // store the stale value back), so such outputs are plain pointers.
            ParamKind::Output(i) if !f.consumers(f.outputs[*i]).is_empty() => format!("{}* {name}", dt.c_type()),
            ParamKind::Output(_) => format!("{}* __restrict__ {name}", dt.c_type()),
            ParamKind::Buffer(_) => format!("{}* {name}", dt.c_type()),
            ParamKind::Extent(_) | ParamKind::Stride(..) => format!("kiln_index_t {name}"),
            _ => format!("{} {name}", dt.c_type()),
        })
        .collect();
    // A block fixed at generation time is given to the runtime header as constants: its
    // block reductions then fold their shape and path (faster kernels and compiles).
    let dims: Vec<String> = ["x", "y", "z"]
        .iter()
        .zip(k.launch.block)
        .map(|(d, v)| match f.scalars.get(v) {
            Val::Int(n) if n > 0 && n <= i64::from(u32::MAX) => format!("{n}"),
            _ => format!("blockDim.{d}"),
        })
        .collect();
    let _ = writeln!(g.out, "KILN_BLOCK_SHAPE({})", dims.join(", "));
    // A kernel that pipelines loads through register stages tells ptxas its block size, so
    // that it budgets the registers the stages need instead of issuing the prefetch loads
    // late, after the block reductions they should overlap (LayerNorm backward's 16 rows per
    // block, H200: 246.1 -> 214.5 us). Not for other kernels: given the bound, ptxas grows
    // them to what one block per SM allows (a row sum's 34 registers became 128) and
    // occupancy falls.
    let threads: Option<i64> = k.launch.block.iter().map(|&v| f.scalars.as_int(v)).product();
    let bounds = match threads {
        Some(n) if n > 0 && g.register_stages().is_some() => format!("__launch_bounds__({n}, 1) "),
        _ => String::new(),
    };
    let _ = writeln!(g.out, "typedef {} kiln_index_t;", if index32 { "int" } else { "int64_t" });
    // Clusters are fixed at compile time: a plain launch then forms them.
    let cluster = match f.cluster {
        Some((p, n)) => {
            let mut dims = [1u32; 3];
            dims[crate::analysis::parallel::DIMS.iter().position(|&q| q == p).unwrap_or(0)] = n;
            format!("__cluster_dims__({}, {}, {}) ", dims[0], dims[1], dims[2])
        }
        None => String::new(),
    };
    let _ = writeln!(g.out, "extern \"C\" __global__ void {bounds}{cluster}{KERNEL_NAME}({}) {{", sig.join(", "));
    g.out.push_str("  extern __shared__ __align__(16) char kiln_smem[];\n");
    if k.summary.tensor_memory.is_some() {
        // tcgen05.alloc writes the region's address here.
        g.out.push_str("  __shared__ uint32_t kiln_tmem_slot;\n");
    }
    // Which threads hold each grid reduction's finished result (`Symbol::GridDone`).
    for tv in f.tvs.keys() {
        let sync = format!("{}_sync", f.tv_name(tv));
        if k.summary.global_allocations.iter().any(|b| b.name == sync) {
            let _ = writeln!(g.out, "  bool kiln_done_{} = false;", f.tv_name(tv));
        }
    }
    if f.cluster.is_some() {
        // A cluster reduction's second barrier, arrived at but not yet waited for.
        g.out.push_str("  bool kiln_cluster_pending = false;\n");
    }
    for (n, &v) in invariant.iter().enumerate() {
        let name = format!("kiln_size{n}");
        let _ = writeln!(g.out, "  const auto {name} = {};", g.c(v));
        g.hoisted.insert(v, name);
    }
    g.nodes(&k.body, 1)?;
    if f.cluster.is_some() {
        // No block leaves while a peer may still read its partial.
        g.out.push_str("  kiln::clusterSettle(kiln_cluster_pending);\n");
    }
    g.out.push_str("}\n");
    Ok(CudaKernel { name: KERNEL_NAME.to_string(), body: g.out, params })
}

impl Gen<'_> {
    fn pad(depth: usize) -> String {
        "  ".repeat(depth)
    }

    /// In a clustered kernel, completes the cluster barrier the last cluster reduction
    /// arrived at before the reduction workspace is written again (peers may still read it).
    fn settle_cluster(&mut self, pad: &str) {
        if self.f.cluster.is_some() {
            let _ = writeln!(self.out, "{pad}  kiln::clusterSettle(kiln_cluster_pending);");
        }
    }

    /// C expression of an integer/bool scalar.
    fn c(&self, v: ValId) -> String {
        if let Some(name) = self.hoisted.get(&v) {
            return name.clone();
        }
        let sc = self.sc;
        match sc.get(v) {
            Val::Int(i) => {
                if i == i64::MIN {
                    "(-9223372036854775807LL - 1)".into()
                } else if i32::try_from(i).is_ok() {
                    // Unsuffixed: takes the index type of the other operand.
                    format!("{i}")
                } else {
                    format!("{i}LL")
                }
            }
            Val::Bool(b) => b.to_string(),
            Val::Float(bits) => float_literal(f64::from_bits(bits)),
            Val::Symbol(s) => match s {
                Symbol::Extent(n) => format!("i{n}"),
                Symbol::Stride(t, a) => format!("{}_stride{a}", self.f.tv_name(t)),
                Symbol::ScalarInput(n) => format!("s{n}"),
                Symbol::LoopIndex(n) => format!("idx{n}"),
                Symbol::Gathered(n) => format!("g{n}"),
                Symbol::GridDone(t) => format!("kiln_done_{}", self.f.tv_name(t)),
                // Indexing substitutes every remap position; one left over fails to compile.
                Symbol::OutAxis(k) => format!("kiln_unbound_remap_position_{k}"),
                Symbol::ParallelIndex(p) => {
                    format!("((kiln_index_t){})", crate::ir::scalar::parallel_index_name(p))
                }
                Symbol::ParallelDim(p) => {
                    format!("((kiln_index_t){})", crate::ir::scalar::parallel_dim_name(p))
                }
            },
            Val::Binary(op, a, b) => {
                let (x, y) = (self.c(a), self.c(b));
                match op {
                    ScalarOp::Add => format!("({x} + {y})"),
                    ScalarOp::Sub => format!("({x} - {y})"),
                    ScalarOp::Mul => format!("({x} * {y})"),
                    ScalarOp::Div => format!("({x} / {y})"),
                    ScalarOp::Mod => format!("({x} % {y})"),
                    ScalarOp::CeilDiv => format!("kiln::ceilDiv((kiln_index_t){x}, (kiln_index_t){y})"),
                    ScalarOp::Min => format!("min((kiln_index_t){x}, (kiln_index_t){y})"),
                    ScalarOp::Max => format!("max((kiln_index_t){x}, (kiln_index_t){y})"),
                    ScalarOp::Lt => format!("({x} < {y})"),
                    ScalarOp::Le => format!("({x} <= {y})"),
                    ScalarOp::Eq => format!("({x} == {y})"),
                    ScalarOp::And => format!("({x} && {y})"),
                }
            }
        }
    }

    /// `kiln_mbar{array}[index]`.
    fn mbar(&self, r: &BarrierRef) -> String {
        format!("kiln_mbar{}[{}]", r.array, self.c(r.index))
    }

    fn buf(&self, tv: TvId) -> String {
        self.names.get(&tv).cloned().unwrap_or_else(|| self.f.tv_name(tv))
    }

    /// A node list, a `grouped` block reduction printed with the one after it.
    fn nodes(&mut self, list: &[Node], depth: usize) -> Result<()> {
        let mut i = 0;
        while i < list.len() {
            if let (Node::ReduceAccumulator { grouped: true, .. }, Some(Node::ReduceAccumulator { .. })) =
                (&list[i], list.get(i + 1))
            {
                self.reduce_pair(&list[i], &list[i + 1], depth)?;
                i += 2;
            } else {
                self.node(&list[i], depth)?;
                i += 1;
            }
        }
        Ok(())
    }

    /// Two block reductions over the same threads into Local outputs of one dtype (marked
    /// by `lower::group_reductions`), as one `blockAllReduce2`.
    fn reduce_pair(&mut self, a: &Node, b: &Node, depth: usize) -> Result<()> {
        let pad = Self::pad(depth);
        let f = self.f;
        let mut parts = Vec::new();
        for n in [a, b] {
            let Node::ReduceAccumulator { acc, index, complete, .. } = n else {
                crate::bail_internal!("a grouped reduction pairs with a non-reduction")
            };
            let Op::Reduction { op, init } = f.exprs[acc.expr].op else {
                crate::bail_internal!("reduction of an accumulator of a non-reduction")
            };
            parts.push((acc.id, acc.expr, index, *complete, op, init));
        }
        let out0 = f.exprs[parts[0].1].output;
        let ty = f.tvs[out0].dtype.c_type();
        let red = crate::analysis::parallel::reduced_dims(f, &self.k.loops, out0);
        let has = |p: ParallelType| red.contains(&p);
        let tflags = format!("{}, {}, {}", has(ParallelType::TIDx), has(ParallelType::TIDy), has(ParallelType::TIDz));
        let Some(ws) = self.k.launch.reduction_workspace else { crate::bail_internal!("reduction without workspace") };
        let _ = writeln!(self.out, "{pad}{{");
        self.settle_cluster(&pad);
        let _ = writeln!(self.out, "{pad}  {ty}* kiln_ws = reinterpret_cast<{ty}*>(kiln_smem + {});", self.c(ws));
        let mut names = Vec::new();
        for &(id, _, _, _, _, _) in &parts {
            self.scratch += 1;
            let r = format!("kiln_r{}", self.scratch);
            let _ = writeln!(self.out, "{pad}  {ty} {r} = kiln_acc{id};");
            names.push(r);
        }
        let (op0, init0, op1, init1) = (parts[0].4, parts[0].5, parts[1].4, parts[1].5);
        let _ = writeln!(
            self.out,
            "{pad}  kiln::blockAllReduce2<{tflags}>({}, {}, kiln::cast<{ty}>({}), {}, {}, kiln::cast<{ty}>({}), kiln_ws);",
            names[0],
            functor(op0),
            self.c(init0),
            names[1],
            functor(op1),
            self.c(init1)
        );
        for (k, &(_, e, ix, complete, op, _)) in parts.iter().enumerate() {
            let out = format!("{}[{}]", self.buf(f.exprs[e].output), self.c(ix.out));
            let r = &names[k];
            let store =
                if complete { format!("{out} = {r};") } else { format!("{out} = {}({out}, {r});", functor(op)) };
            let _ = writeln!(self.out, "{pad}  if ({}) {{ {store} }}", self.pred(ix.write_predicate));
        }
        let _ = writeln!(self.out, "{pad}}}");
        Ok(())
    }

    fn node(&mut self, n: &Node, depth: usize) -> Result<()> {
        let pad = Self::pad(depth);
        match n {
            Node::Loop(l) => {
                if l.parallel.is_thread_or_block() {
                    let _ = writeln!(self.out, "{pad}{{  // {} over {}", l.parallel.enum_name(), self.f.id_label(l.id));
                } else {
                    let idx = self.c(l.index);
                    // Unroll short constant loops too: Local arrays indexed by their index
                    // then stay in registers instead of spilling to local memory.
                    let c = self.f.scalars.as_int(l.extent);
                    // A loop over unswitched tiles stays rolled: each tile already unrolls
                    // its steps, and copies of the tile would only multiply the code.
                    // (An Unswitch loop whose tiles are all whole has no If around it.)
                    let over_tiles = l.body.iter().any(|n| match n {
                        Node::If(i) => i.kind == IfKind::Unswitch,
                        Node::Loop(inner) => inner.parallel == ParallelType::Unswitch,
                        _ => false,
                    });
                    // Nor is a loop whose steps each end in a block-wide barrier (a block
                    // reduction per step): the barrier keeps the steps from overlapping, so
                    // copies only add code, and ptxas then rations the registers that keep
                    // the next step's loads in flight (LayerNorm backward's 16 rows per block:
                    // 234.7 us rolled, 289.4 us unrolled, H200).
                    let unroll = c.is_some()
                        && (matches!(l.parallel, ParallelType::Unroll | ParallelType::Vectorize)
                            || (c.is_some_and(|n| n <= 16) && !over_tiles && !self.waits_for_block(&l.body)));
                    if let Some(block) = self.lse_block(l).filter(|_| unroll) {
                        return self.lse_block_loop(l, block, depth);
                    }
                    if unroll {
                        let _ = writeln!(self.out, "{pad}#pragma unroll");
                    } else if let Some(n) = self.register_stages().filter(|_| l.pipeline == Some(PipelinePart::Main)) {
                        // Register stages are picked by `i % stages`: unrolled that many times,
                        // each copy's pick is a constant and the stages stay in registers
                        // instead of local memory.
                        let _ = writeln!(self.out, "{pad}#pragma unroll {n}");
                    }
                    let _ = writeln!(
                        self.out,
                        "{pad}for (kiln_index_t {idx} = 0; {idx} < {}; ++{idx}) {{  // {}{}",
                        self.c(l.extent),
                        self.f.id_label(l.id),
                        l.pipeline.map_or(String::new(), |p| format!(", pipelined {}", p.name()))
                    );
                }
                self.nodes(&l.body, depth + 1)?;
                let _ = writeln!(self.out, "{pad}}}");
            }
            Node::Alloc(a) => {
                if let AllocTarget::Barriers(i) = a.target {
                    let off = self.k.launch.barrier_offsets.iter().find(|(b, _)| *b == i).map(|&(_, o)| o);
                    let Some(off) = off else { crate::bail_internal!("mbarriers {i}: no shared memory offset") };
                    let _ = writeln!(
                        self.out,
                        "{pad}uint64_t* kiln_mbar{i} = reinterpret_cast<uint64_t*>(kiln_smem + {});",
                        self.c(off)
                    );
                    return Ok(());
                }
                let AllocTarget::Tensor(tv) = a.target else {
                    return Ok(());
                };
                let ty = a.dtype.c_type();
                let name = self.buf(tv);
                match a.memory {
                    MemoryType::Local => {
                        let Some(size) =
                            a.shape.iter().try_fold(1i64, |acc, &e| self.f.scalars.as_int(e).map(|x| acc * x))
                        else {
                            let dims: Vec<String> = a.shape.iter().map(|&e| self.f.scalars.render(e)).collect();
                            // An unswitched loop hoists the allocations inside it above itself
                            // (one copy serves both versions of the loop body): inlining further
                            // cannot help then.
                            let ld = &self.f.tvs[tv].loop_domain;
                            // So does an unrolled one: each unrolled iteration keeps its own
                            // registers, allocated together above the loop. The axis is the
                            // tensor's own, or one of the consumer it follows (a tensor left to
                            // its consumer's schedule stops before that axis).
                            let hoists = |id: crate::ir::IterDomainId| {
                                matches!(self.f.ids[id].parallel, ParallelType::Unswitch | ParallelType::Unroll)
                            };
                            let own = ld.iter().position(|&id| hoists(id)).map(|u| (tv, u));
                            let hoister = own.or_else(|| {
                                self.f.tvs.keys().find_map(|t| {
                                    let l = &self.f.tvs[t].loop_domain;
                                    l.iter()
                                        .position(|&id| hoists(id) && a.shape.contains(&self.f.ids[id].extent))
                                        .map(|u| (t, u))
                                })
                            });
                            let hint = match hoister {
                                Some((t, u)) => {
                                    let id = self.f.tvs[t].loop_domain[u];
                                    let (done, pt, fix) = if self.f.ids[id].parallel == ParallelType::Unswitch {
                                        ("unswitched", "Unswitch", "unswitch an axis that is constant, with constant axes inside it (a split by 1, as the automatic schedules make)")
                                    } else {
                                        ("unrolled", "Unroll", "unroll an axis of constant extent (split by a constant and unroll the inner part)")
                                    };
                                    let whose = if t == tv {
                                        "its".to_string()
                                    } else {
                                        format!("it follows {}, whose", self.f.tv_name(t))
                                    };
                                    format!("; {whose} axis {u} ({}) is {done}, which places the allocation outside that loop: {fix}, or leave {pt} out", self.f.id_label(id))
                                }
                                None => "; inline it further or make the allocated axes constant".to_string(),
                            };
                            bail!(
                                "{name} is in Local memory but its allocation [{}] is not a constant size{hint}",
                                dims.join(", ")
                            );
                        };
                        if self.f.tvs[tv].tensor_memory {
                            // Columns of the region in this thread's lane (the warp's lanes).
                            let place = self
                                .k
                                .summary
                                .tensor_memory
                                .as_ref()
                                .and_then(|r| r.tensors.iter().find(|p| p.tv == tv));
                            let Some(p) = place else { crate::bail_internal!("{name}: not placed in Tensor memory") };
                            let _ = writeln!(
                                self.out,
                                "{pad}const kiln::TmemTensor<{ty}> {name}{{kiln::tmemAddress(kiln_tmem_slot, {}, {})}};  // Tensor memory, {size} column(s)",
                                p.lane_offset, p.column_offset
                            );
                            return Ok(());
                        }
                        // 16-byte alignment lets vectorized copies skip a run-time address check.
                        let _ = writeln!(self.out, "{pad}__align__(16) {ty} {name}[{size}];");
                    }
                    MemoryType::Shared => {
                        let off = self.k.launch.smem_offsets.iter().find(|(t, _)| *t == tv).map(|&(_, o)| o);
                        let Some(off) = off else { crate::bail_internal!("{name}: no shared memory offset") };
                        let _ = writeln!(
                            self.out,
                            "{pad}{ty}* {name} = reinterpret_cast<{ty}*>(kiln_smem + {});",
                            self.c(off)
                        );
                    }
                    // Global buffers are kernel parameters.
                    MemoryType::Global => {}
                }
            }
            Node::Init { tv, value, index } => {
                let Some(ix) = index else { crate::bail_internal!("init of {} was not indexed", self.f.tv_name(*tv)) };
                let ty = self.f.tvs[*tv].dtype.c_type();
                let _ = writeln!(
                    self.out,
                    "{pad}if ({}) {{ {}[{}] = kiln::cast<{ty}>({}); }}",
                    self.pred(ix.predicate),
                    self.buf(*tv),
                    self.c(ix.out),
                    self.c(*value)
                );
            }
            Node::Expr { expr, index } => {
                let Some(ix) = index else { crate::bail_internal!("expr was not indexed") };
                let e = &self.f.exprs[*expr];
                let async_src = if self.k.summary.async_copies.contains(&e.output) && matches!(e.op, Op::Set) {
                    e.inputs.first().and_then(|o| o.tensor())
                } else {
                    None
                };
                match async_src {
                    Some(src) => {
                        let Some(input) = ix.inputs.first().copied().flatten() else {
                            crate::bail_internal!("an asynchronous copy without its input offset")
                        };
                        let _ = writeln!(
                            self.out,
                            "{pad}if ({}) {{ kiln::cpAsyncElem(&{}[{}], &{}[{}]); }}",
                            self.pred(ix.predicate),
                            self.buf(e.output),
                            self.c(ix.out),
                            self.buf(src),
                            self.c(input)
                        );
                    }
                    _ => self.expr(*expr, ix, depth)?,
                }
            }
            Node::CpAsync(op) => {
                let _ = match op {
                    CpAsyncOp::Commit => writeln!(self.out, "{pad}kiln::cpAsyncCommit();"),
                    CpAsyncOp::Wait(n) => writeln!(self.out, "{pad}kiln::cpAsyncWait<{n}>();"),
                };
            }
            Node::TensorMemory(op) => {
                let cols = self.k.summary.tensor_memory.as_ref().map_or(0, |r| r.columns);
                let call = match op {
                    TmemOp::Alloc => format!("kiln::tmemAlloc<{cols}>(&kiln_tmem_slot);"),
                    TmemOp::Relinquish => "kiln::tmemRelinquish();".to_string(),
                    TmemOp::Dealloc => format!("kiln::tmemDealloc<{cols}>(kiln_tmem_slot);"),
                };
                // tcgen05.alloc/dealloc are warp-wide (.sync.aligned): the whole first warp.
                let _ = writeln!(self.out, "{pad}if (kiln::isFirstWarp()) {{ {call} }}");
            }
            Node::Sync(k) => {
                let _ =
                    writeln!(self.out, "{pad}__syncthreads();  // {}", if *k == SyncKind::Raw { "RAW" } else { "WAR" });
            }
            Node::If(i) => {
                let note = match i.kind {
                    IfKind::Unswitch => "unswitched: bounds hold for the whole tile",
                    IfKind::InvariantBounds => "bounds no inner loop changes",
                };
                let _ = writeln!(self.out, "{pad}if ({}) {{  // {note}", self.pred(i.cond));
                self.nodes(&i.then, depth + 1)?;
                if !i.otherwise.is_empty() {
                    let _ = writeln!(self.out, "{pad}}} else {{");
                    self.nodes(&i.otherwise, depth + 1)?;
                }
                let _ = writeln!(self.out, "{pad}}}");
            }
            Node::Vector(v) => self.vector_copy(v, depth)?,
            Node::Barrier(op) => {
                let line = match op {
                    BarrierOp::Init { bar, arrivals } => format!(
                        "if (kiln::isFirstThread()) kiln::mbarrierInit(&{}, (unsigned)({}));",
                        self.mbar(bar),
                        self.c(*arrivals)
                    ),
                    BarrierOp::Inval { bar } => {
                        format!("if (kiln::isFirstThread()) kiln::mbarrierInval(&{});", self.mbar(bar))
                    }
                    BarrierOp::Arrive { bar } => format!("kiln::mbarrierArrive(&{});", self.mbar(bar)),
                    BarrierOp::Wait { bar, parity } => {
                        format!("kiln::mbarrierWait(&{}, (unsigned)({}));", self.mbar(bar), self.c(*parity))
                    }
                };
                let _ = writeln!(self.out, "{pad}{line}");
            }
            Node::BulkLoad(b) => {
                let e = &self.f.exprs[b.expr];
                let Some(src) = e.inputs[0].tensor() else { crate::bail_internal!("a bulk copy reads no tensor") };
                let (dst, src) = (self.buf(e.output), self.buf(src));
                let _ = writeln!(self.out, "{pad}if (kiln::isFirstThread()) {{  // bulk copy");
                if let Some((r, parity, when)) = &b.reuse {
                    let _ = writeln!(
                        self.out,
                        "{pad}  if ({}) kiln::mbarrierWait(&{}, (unsigned)({}));  // its readers are done with the stage",
                        self.pred(*when),
                        self.mbar(r),
                        self.c(*parity)
                    );
                }
                let elems = if self.f.scalars.as_int(b.guard) == Some(1) {
                    self.c(b.elems)
                } else {
                    format!("({}) ? {} : 0", self.pred(b.guard), self.c(b.elems))
                };
                let _ = writeln!(
                    self.out,
                    "{pad}  kiln::bulkLoad(&{dst}[{}], &{src}[{}], (unsigned)({elems}), &{});",
                    self.c(b.dst),
                    self.c(b.src),
                    self.mbar(&b.bar)
                );
                let _ = writeln!(self.out, "{pad}}}");
            }
            Node::AccumulatorInit(a) => {
                let Op::Reduction { op, init } = self.f.exprs[a.expr].op else {
                    crate::bail_internal!("accumulator of a non-reduction")
                };
                let ty = self.f.tvs[self.f.exprs[a.expr].output].dtype.c_type();
                if op.is_log_sum_exp() {
                    // A running (maximum, sum) pair: one exp per element (see kiln::LseAcc).
                    let ty = lse_element_dtype(self.f, a.expr).c_type();
                    let _ = writeln!(self.out, "{pad}kiln::LseAcc<{ty}> kiln_acc{} = kiln::lseEmpty<{ty}>();", a.id);
                } else {
                    let _ = writeln!(self.out, "{pad}{ty} kiln_acc{} = kiln::cast<{ty}>({});", a.id, self.c(init));
                }
            }
            Node::Accumulate { acc, index } => {
                let Op::Reduction { op, .. } = self.f.exprs[acc.expr].op else {
                    crate::bail_internal!("accumulate of a non-reduction")
                };
                let dt = match op {
                    op if op.is_log_sum_exp() => lse_element_dtype(self.f, acc.expr),
                    _ => self.f.tvs[self.f.exprs[acc.expr].output].dtype,
                };
                let pre = self.gather_reads(index);
                let input = self.operand(acc.expr, index, 0, dt);
                let _ = writeln!(
                    self.out,
                    "{pad}if ({}) {{ {pre}kiln_acc{} = {}(kiln_acc{}, {input}); }}",
                    self.pred(index.predicate),
                    acc.id,
                    functor(op),
                    acc.id
                );
            }
            Node::ReduceAccumulator { acc, index, complete, .. } => {
                let Op::Reduction { op, init } = self.f.exprs[acc.expr].op else {
                    crate::bail_internal!("reduction of an accumulator of a non-reduction")
                };
                let ty = self.f.tvs[self.f.exprs[acc.expr].output].dtype.c_type();
                let red = crate::analysis::parallel::reduced_dims(self.f, &self.k.loops, self.f.exprs[acc.expr].output);
                let grid = red.iter().any(|&p| p.is_block() && !self.f.clustered(p));
                let float_lse = op.is_log_sum_exp() && lse_element_dtype(self.f, acc.expr) == DataType::Float;
                let partials = if float_lse && !grid {
                    // Float (maximum, sum) pairs merge between threads and blocks of a cluster
                    // in the 8 bytes a workspace slot has, finished once (see kiln::LsePair).
                    Partials {
                        ty: "kiln::LseAcc<float>".into(),
                        functor: "kiln::LsePair()",
                        init: "kiln::lseEmpty<float>()".into(),
                        value: format!("kiln_acc{}", acc.id),
                        finish: Some(format!("kiln::lseFinish<{ty}>")),
                    }
                } else {
                    Partials {
                        ty: ty.into(),
                        functor: merge_functor(self.f, acc.expr),
                        init: format!("kiln::cast<{ty}>({})", self.c(init)),
                        value: if op.is_log_sum_exp() {
                            format!("kiln::lseFinish<{ty}>(kiln_acc{})", acc.id)
                        } else {
                            format!("kiln_acc{}", acc.id)
                        },
                        finish: None,
                    }
                };
                self.parallel_reduce(acc.expr, index, &red, &partials, depth, "", *complete)?;
            }
        }
        Ok(())
    }

    /// The gathered index reads an access depends on, as C declarations.
    fn gather_reads(&self, ix: &AccessIndex) -> String {
        let pred = self.pred(ix.predicate);
        let mut pre = String::new();
        for gth in &ix.gathers {
            let _ = write!(
                pre,
                "const kiln_index_t g{} = kiln::checkedIndex(({}) ? (int64_t){}[{}] : 0, {}, {}, {}, {}); ",
                gth.id,
                pred,
                self.buf(gth.index_tv),
                self.c(gth.at),
                self.c(gth.extent),
                crate::kernel::INDEX_ERROR,
                gth.id,
                self.c(gth.element)
            );
        }
        pre
    }

    /// A predicate, its conjuncts joined by `&&`.
    fn pred(&self, v: ValId) -> String {
        let mut parts = Vec::new();
        conjuncts(self.sc, v, &mut parts);
        let kept: Vec<String> = parts.into_iter().map(|c| self.c(c)).collect();
        if kept.is_empty() {
            "true".into()
        } else {
            kept.join(" && ")
        }
    }

    /// A vector copy: one wide load and store where the whole vector is in range and
    /// aligned, the element loop otherwise.
    fn vector_copy(&mut self, v: &VectorCopy, depth: usize) -> Result<()> {
        let f = self.f;
        let e = &f.exprs[v.expr];
        let Some(Operand::Tensor(src)) = e.inputs.first().copied() else {
            crate::bail_internal!("vector copy of a non-tensor operand")
        };
        let [Node::Expr { index: Some(ix), .. }] = v.fallback.body.as_slice() else {
            crate::bail_internal!("vector copy without its element statement")
        };
        let n = v.width;
        let dt = f.tvs[e.output].dtype;
        let bytes = n as usize * dt.size_bytes();
        let pad = Self::pad(depth);
        let ty = dt.c_type();
        let (ob, ib) = (self.buf(e.output), self.buf(src));
        let _ = writeln!(self.out, "{pad}{{  // Vectorize x{n} over {}", f.id_label(v.fallback.id));
        for g in &v.gathers {
            // Read only where the vector's first element is in bounds; the address below is
            // dereferenced only then.
            let _ = writeln!(
                self.out,
                "{pad}  const kiln_index_t g{} = kiln::checkedIndex(({}) ? (int64_t){}[{}] : 0, {}, {}, {}, {});",
                g.id,
                self.pred(v.first),
                self.buf(g.index_tv),
                self.c(g.at),
                self.c(g.extent),
                crate::kernel::INDEX_ERROR,
                g.id,
                self.c(g.element)
            );
        }
        let _ =
            writeln!(self.out, "{pad}  const kiln_index_t kiln_ob = {}, kiln_ib = {};", self.c(v.out), self.c(v.input));
        let mut checks = Vec::new();
        for (k, buf) in [&ob, &ib].into_iter().enumerate() {
            let var = if k == 0 { "kiln_ob" } else { "kiln_ib" };
            match v.access[k] {
                VectorAccess::WideIfOffsetAligned => checks.push(format!(" && {var} % {n} == 0")),
                VectorAccess::WideIfAddressAligned => {
                    checks.push(format!(" && reinterpret_cast<unsigned long long>(&{buf}[{var}]) % {bytes} == 0"))
                }
                VectorAccess::Wide | VectorAccess::Elements => {}
            }
        }
        if v.whole {
            let _ = writeln!(self.out, "{pad}  if ({}) {{", self.pred(v.first));
        } else {
            let _ = writeln!(
                self.out,
                "{pad}  if (({}) && ({}){}) {{",
                self.pred(v.first),
                self.pred(v.last),
                checks.concat()
            );
        }
        if self.k.summary.async_copies.contains(&e.output) {
            // An asynchronous copy: one cp.async of the vector's 4, 8 or 16 bytes, or one per element
            // (an element below 4 bytes is stored at once).
            let line = if v.access.iter().all(|&a| a != VectorAccess::Elements) && matches!(bytes, 4 | 8 | 16) {
                format!("{pad}    kiln::cpAsyncBytes<{bytes}>(&{ob}[kiln_ob], &{ib}[kiln_ib]);")
            } else {
                format!("{each_pad}    #pragma unroll\n{each_pad}    for (int kiln_j = 0; kiln_j < {n}; ++kiln_j) kiln::cpAsyncElem(&{ob}[kiln_ob + kiln_j], &{ib}[kiln_ib + kiln_j]);", each_pad = pad)
            };
            let _ = writeln!(self.out, "{line}");
        } else {
            let _ = writeln!(self.out, "{pad}    kiln::Array<{ty}, {n}> kiln_vec;");
            let each = format!("{pad}    #pragma unroll\n{pad}    for (int kiln_j = 0; kiln_j < {n}; ++kiln_j) ");
            let load = if v.access[1] != VectorAccess::Elements {
                let func = match v.load_hints {
                    (false, false) => "loadVec",
                    (true, false) => "loadVecStreaming",
                    (false, true) => "loadVecEvictLast",
                    (true, true) => "loadVecStreamingEvictLast",
                };
                format!("{pad}    kiln::{func}<{ty}, {n}>(kiln_vec, &{ib}[kiln_ib]);")
            } else {
                format!("{each}kiln_vec[kiln_j] = {ib}[kiln_ib + kiln_j];")
            };
            let store = if v.access[0] != VectorAccess::Elements {
                format!("{pad}    kiln::storeVec<{ty}, {n}>(&{ob}[kiln_ob], kiln_vec);")
            } else {
                format!("{each}{ob}[kiln_ob + kiln_j] = kiln_vec[kiln_j];")
            };
            let _ = writeln!(self.out, "{load}\n{store}");
        }
        if v.whole || v.pad_else.is_some() {
            // Out of range as a whole: nothing to copy element by element. In range but
            // outside a remap's guard as a whole: all padding.
            if let Some(in_range) = v.pad_else {
                let _ = writeln!(self.out, "{pad}  }} else if ({}) {{", self.pred(in_range));
                let _ = writeln!(self.out, "{pad}    kiln::Array<{ty}, {n}> kiln_vec;");
                let _ = writeln!(self.out, "{pad}    #pragma unroll");
                let _ = writeln!(
                    self.out,
                    "{pad}    for (int kiln_j = 0; kiln_j < {n}; ++kiln_j) kiln_vec[kiln_j] = kiln::cast<{ty}>(0);"
                );
                let _ = writeln!(self.out, "{pad}    kiln::storeVec<{ty}, {n}>(&{ob}[kiln_ob], kiln_vec);");
            }
            let _ = writeln!(self.out, "{pad}  }}");
            let _ = writeln!(self.out, "{pad}}}");
            return Ok(());
        }
        let _ = writeln!(self.out, "{pad}  }} else {{");
        let idx = self.c(v.fallback.index);
        let _ = writeln!(self.out, "{pad}    #pragma unroll");
        let _ = writeln!(self.out, "{pad}    for (kiln_index_t {idx} = 0; {idx} < {n}; ++{idx}) {{");
        self.expr(v.expr, ix, depth + 3)?;
        let _ = writeln!(self.out, "{pad}    }}");
        let _ = writeln!(self.out, "{pad}  }}");
        let _ = writeln!(self.out, "{pad}}}");
        Ok(())
    }

    /// C expression reading operand `pos` of `e`, converted to dtype `to`.
    fn operand(&self, e: ExprId, ix: &AccessIndex, pos: usize, to: DataType) -> String {
        let ty = to.c_type();
        match self.f.exprs[e].inputs[pos] {
            Operand::Tensor(t) => {
                let off = ix.inputs[pos].map(|v| self.c(v)).unwrap_or_else(|| "0".into());
                format!("kiln::cast<{ty}>({}[{off}])", self.buf(t))
            }
            Operand::Scalar(v) => format!("kiln::cast<{ty}>({})", self.c(v)),
        }
    }

    /// The function codegen calls for an element-wise op computing in `cd`.
    fn call(name: &str, cuda: Cuda, cd: DataType) -> String {
        match cuda {
            Cuda::Runtime => format!("kiln::{name}"),
            Cuda::Libm(_, f64_name) if cd == DataType::Double => format!("::{f64_name}"),
            Cuda::Libm(f32_name, _) => format!("::{f32_name}"),
        }
    }

    fn operand_dtype(&self, o: Operand) -> DataType {
        match o {
            Operand::Tensor(t) => self.f.tvs[t].dtype,
            Operand::Scalar(v) => self.f.scalars.dtype(v, &self.f.scalar_input_dtypes),
        }
    }

    fn expr(&mut self, e: ExprId, ix: &AccessIndex, depth: usize) -> Result<()> {
        let pad = Self::pad(depth);
        let f = self.f;
        let ex = &f.exprs[e];
        let out_tv = ex.output;
        let out_dt = f.tvs[out_tv].dtype;
        let out_ty = out_dt.c_type();
        let out = format!("{}[{}]", self.buf(out_tv), self.c(ix.out));
        let pred = self.pred(ix.predicate);
        let pre = self.gather_reads(ix);
        let value = match &ex.op {
            Op::Unary(u) => {
                let cd = u.compute_dtype(self.operand_dtype(ex.inputs[0]), out_dt);
                let approx = cd == DataType::Float && self.narrow.contains(&out_tv);
                let call = match u {
                    UnaryOp::Exp | UnaryOp::Sigmoid if approx => format!("kiln::{}Narrow", u.name()),
                    UnaryOp::Exp if cd == DataType::Float && self.shifted.contains(&out_tv) => "kiln::lseExp".into(),
                    _ => Self::call(u.name(), u.cuda(), cd),
                };
                format!("kiln::cast<{out_ty}>({call}({}))", self.operand(e, ix, 0, cd))
            }
            Op::Binary(b) => {
                let dts: Vec<_> = ex
                    .inputs
                    .iter()
                    .map(|&o| crate::ir::dtype::PromotionOperand {
                        dtype: self.operand_dtype(o),
                        is_tensor: o.tensor().is_some(),
                        zero_dim: false,
                    })
                    .collect();
                let cd = b.compute_dtype(crate::ir::dtype::promote(&dts), out_dt);
                let call = if matches!(b, BinaryOp::Div | BinaryOp::Truediv)
                    && cd == DataType::Float
                    && self.narrow.contains(&out_tv)
                {
                    "kiln::divNarrow".to_string()
                } else {
                    Self::call(b.name(), b.cuda(), cd)
                };
                format!("kiln::cast<{out_ty}>({call}({}, {}))", self.operand(e, ix, 0, cd), self.operand(e, ix, 1, cd))
            }
            Op::Where => format!(
                "kiln::where({}, {}, {})",
                self.operand(e, ix, 0, DataType::Bool),
                self.operand(e, ix, 1, out_dt),
                self.operand(e, ix, 2, out_dt)
            ),
            Op::Cast(_)
            | Op::Set
            | Op::Broadcast { .. }
            | Op::Squeeze { .. }
            | Op::Permute { .. }
            | Op::IndexSelect { .. } => self.operand(e, ix, 0, out_dt),
            Op::Remap { .. } => match ix.element {
                // Outside its guard a remap reads nothing and gives 0.
                Some(g) => format!("(({}) ? {} : kiln::cast<{out_ty}>(0))", self.c(g), self.operand(e, ix, 0, out_dt)),
                None => self.operand(e, ix, 0, out_dt),
            },
            Op::Full { value } => format!("kiln::cast<{out_ty}>({})", self.c(*value)),
            Op::Mask { .. } => {
                let Some(v) = ix.element else { bail!("{}: mask without its condition", f.tv_name(out_tv)) };
                format!("kiln::cast<{out_ty}>((bool)({}))", self.c(v))
            }
            Op::Iota { start, step } => {
                let Some(pos) = ix.element else { bail!("{}: iota without an element position", f.tv_name(out_tv)) };
                let cd = out_dt.compute_dtype().c_type();
                format!(
                    "kiln::cast<{out_ty}>(kiln::iotaValue<{cd}>(kiln::cast<{cd}>({}), kiln::cast<{cd}>({}), (int64_t)({})))",
                    self.c(*start),
                    self.c(*step),
                    self.c(pos)
                )
            }
            Op::Random { dist, a, b, seed, offset } => {
                let Some(pos) = ix.element else { bail!("{}: random without an element position", f.tv_name(out_tv)) };
                let (fun, cd) = if out_dt.compute_dtype() == DataType::Double {
                    ("kiln::randomDouble", "double")
                } else {
                    ("kiln::randomFloat", "float")
                };
                let draw = format!(
                    "{fun}({}, (int64_t)({}), (int64_t)({}), (int64_t)({}), kiln::cast<{cd}>({}), kiln::cast<{cd}>({}))",
                    i32::from(*dist == crate::ir::RandomDist::Normal),
                    self.c(*seed),
                    self.c(*offset),
                    self.c(pos),
                    self.c(*a),
                    self.c(*b)
                );
                if *dist == crate::ir::RandomDist::Uniform {
                    // [a, b) stays half-open after rounding to the output type.
                    format!(
                        "kiln::uniformBelow<{out_ty}, {cd}>({draw}, kiln::cast<{cd}>({}), kiln::cast<{cd}>({}))",
                        self.c(*a),
                        self.c(*b)
                    )
                } else {
                    format!("kiln::cast<{out_ty}>({draw})")
                }
            }
            Op::Reduction { init, .. } => return self.reduction(e, ix, *init, depth, &pre),
        };
        let _ = writeln!(self.out, "{pad}if ({pred}) {{ {pre}{out} = {value}; }}");
        Ok(())
    }

    /// The most stages of a circular-buffered Local tensor of the kernel, if it has one.
    fn register_stages(&self) -> Option<u32> {
        self.k
            .allocations
            .iter()
            .filter(|(&tv, a)| a.stages > 1 && self.f.tvs[tv].memory == MemoryType::Local)
            .map(|(_, a)| a.stages)
            .max()
    }

    /// The register accumulator of a float or double log-sum-exp that loop `l` (constant, 2 to
    /// 16 steps) feeds with one element per step, as the last statement of its body: those
    /// elements then update the running (maximum, sum) pair once per loop instead of once
    /// per element (`lse_block_loop`).
    fn lse_block(&self, l: &ForLoop) -> Option<(u32, i64)> {
        let n = self.f.scalars.as_int(l.extent).filter(|n| (2..=16).contains(n))?;
        let Some(Node::Accumulate { acc, .. }) = l.body.last() else { return None };
        let Op::Reduction { op, .. } = self.f.exprs[acc.expr].op else { return None };
        if !op.is_log_sum_exp() {
            return None;
        }
        if !matches!(lse_element_dtype(self.f, acc.expr), DataType::Float | DataType::Double) {
            return None;
        }
        // The body's other statements must not feed the same register (it is read only here).
        fn feeds(nodes: &[Node], id: u32) -> bool {
            nodes.iter().any(|n| match n {
                Node::Accumulate { acc, .. } | Node::ReduceAccumulator { acc, .. } => acc.id == id,
                _ => n.bodies().iter().any(|b| feeds(b, id)),
            })
        }
        (!feeds(&l.body[..l.body.len() - 1], acc.id)).then_some((acc.id, n))
    }

    /// Loop `l` whose steps each add one element to a log-sum-exp register (`lse_block`): the
    /// steps stage their elements, and `kiln::lseAddBlock` takes their maximum first, so each
    /// element costs a maximum, an exponential and an add, where adding it alone also
    /// rescales the sum (a compare, a select and a multiply more). An element whose predicate
    /// fails stages -inf, which adds nothing.
    fn lse_block_loop(&mut self, l: &ForLoop, (id, n): (u32, i64), depth: usize) -> Result<()> {
        let outer = Self::pad(depth);
        let pad = Self::pad(depth + 1);
        let Some((Node::Accumulate { acc, index }, rest)) = l.body.split_last() else {
            crate::bail_internal!("log-sum-exp block without its accumulate")
        };
        let ty = lse_element_dtype(self.f, acc.expr);
        let c = ty.c_type();
        let idx = self.c(l.index);
        // A scope of its own: two such loops of one register in one body (a tile and its
        // remainder) each declare the staging array.
        let _ = writeln!(self.out, "{outer}{{");
        let _ = writeln!(self.out, "{pad}{c} kiln_blk{id}[{n}];");
        let _ = writeln!(self.out, "{pad}#pragma unroll");
        let _ = writeln!(
            self.out,
            "{pad}for (kiln_index_t {idx} = 0; {idx} < {n}; ++{idx}) {{  // {}, log-sum-exp block",
            self.f.id_label(l.id)
        );
        self.nodes(rest, depth + 2)?;
        let inner = Self::pad(depth + 2);
        let pre = self.gather_reads(index);
        let input = self.operand(acc.expr, index, 0, ty);
        let _ = writeln!(self.out, "{inner}kiln_blk{id}[{idx}] = kiln::numeric<{c}>::lowest();");
        let _ =
            writeln!(self.out, "{inner}if ({}) {{ {pre}kiln_blk{id}[{idx}] = {input}; }}", self.pred(index.predicate));
        let _ = writeln!(self.out, "{pad}}}");
        // A floored log-sum-exp raises its elements only where the block's maximum is near the
        // floor: anywhere else a raised element's term is zero as the raw one's is.
        let add = match self.f.exprs[acc.expr].op {
            Op::Reduction { op: ReductionOp::LogSumExpFloored, .. } => "lseAddBlockRaised",
            _ => "lseAddBlock",
        };
        let _ = writeln!(self.out, "{pad}kiln_acc{id} = kiln::{add}(kiln_acc{id}, kiln_blk{id});");
        let _ = writeln!(self.out, "{outer}}}");
        Ok(())
    }

    /// True when `nodes` hold a block-wide barrier: a `__syncthreads`, or a block or grid
    /// reduction.
    fn waits_for_block(&self, nodes: &[Node]) -> bool {
        let parallel = |e: ExprId| {
            matches!(self.f.exprs[e].op, Op::Reduction { .. })
                && !crate::analysis::parallel::reduced_dims(self.f, &self.k.loops, self.f.exprs[e].output).is_empty()
        };
        nodes.iter().any(|n| match n {
            Node::Sync(_) => true,
            Node::ReduceAccumulator { acc, .. } => parallel(acc.expr),
            Node::Expr { expr, .. } => parallel(*expr),
            _ => n.bodies().iter().any(|b| self.waits_for_block(b)),
        })
    }

    fn reduction(&mut self, e: ExprId, ix: &AccessIndex, init: ValId, depth: usize, pre: &str) -> Result<()> {
        let pad = Self::pad(depth);
        let f = self.f;
        let out_tv = f.exprs[e].output;
        let dt = f.tvs[out_tv].dtype;
        let ty = dt.c_type();
        let functor = merge_functor(f, e);
        let out = format!("{}[{}]", self.buf(out_tv), self.c(ix.out));
        let input = self.operand(e, ix, 0, dt);
        let init_c = format!("kiln::cast<{ty}>({})", self.c(init));
        let red = crate::analysis::parallel::reduced_dims(f, &self.k.loops, out_tv);
        let pred = self.pred(ix.predicate);
        if red.is_empty() {
            let _ = writeln!(self.out, "{pad}if ({pred}) {{ {pre}{out} = {functor}({out}, {input}); }}");
            return Ok(());
        }
        let value = format!("({pred}) ? {input} : {init_c}");
        let partials = Partials { ty: ty.into(), functor, init: init_c, value, finish: None };
        self.parallel_reduce(e, ix, &red, &partials, depth, pre, false)
    }

    /// The block or grid reduction of a per-thread `value`, combined into the output.
    #[allow(clippy::too_many_arguments)]
    fn parallel_reduce(
        &mut self,
        e: ExprId,
        ix: &AccessIndex,
        red: &[ParallelType],
        partials: &Partials,
        depth: usize,
        pre: &str,
        complete: bool,
    ) -> Result<()> {
        let pad = Self::pad(depth);
        let f = self.f;
        let out_tv = f.exprs[e].output;
        let Partials { ty: pty, functor: pfunctor, init: init_c, value, .. } = partials;
        let ty = f.tvs[out_tv].dtype.c_type();
        let functor = merge_functor(f, e);
        let out = format!("{}[{}]", self.buf(out_tv), self.c(ix.out));
        let wpred = self.pred(ix.write_predicate);
        let has = |p: ParallelType| red.contains(&p);
        let tflags = format!("{}, {}, {}", has(ParallelType::TIDx), has(ParallelType::TIDy), has(ParallelType::TIDz));
        let bflags = format!("{}, {}, {}", has(ParallelType::BIDx), has(ParallelType::BIDy), has(ParallelType::BIDz));
        let Some(ws) = self.k.launch.reduction_workspace else { crate::bail_internal!("reduction without workspace") };
        self.scratch += 1;
        let v = format!("kiln_v{}", self.scratch);
        let r = format!("kiln_r{}", self.scratch);
        // The merged partials, and the line that turns them into the output's type.
        let (rp, finish) = match &partials.finish {
            Some(fin) => {
                let rp = format!("kiln_p{}", self.scratch);
                let line = format!("{pad}  const {ty} {r} = {fin}({rp});");
                (rp, Some(line))
            }
            None => (r.clone(), None),
        };
        let store = if complete { format!("{out} = {r};") } else { format!("{out} = {functor}({out}, {r});") };
        let _ = writeln!(self.out, "{pad}{{");
        let cluster_reduction = red.iter().any(|&p| f.clustered(p)) && !red.iter().any(|&p| f.is_grid_dim(p));
        if !cluster_reduction {
            self.settle_cluster(&pad);
        }
        let _ = writeln!(self.out, "{pad}  {pty}* kiln_ws = reinterpret_cast<{pty}*>(kiln_smem + {});", self.c(ws));
        let _ = writeln!(self.out, "{pad}  {pre}const {pty} {v} = {value};");
        if cluster_reduction {
            // Every thread of every block of the cluster gets the result.
            // The cluster's size as a constant lets the peers' partials load all at once.
            let blocks = f.cluster.map_or(0, |(_, n)| n);
            let _ = writeln!(
                self.out,
                "{pad}  const {pty} {rp} = kiln::clusterAllReduce<{tflags}, {blocks}>({v}, {pfunctor}, {init_c}, kiln_ws, kiln_cluster_pending);"
            );
            if let Some(line) = &finish {
                let _ = writeln!(self.out, "{line}");
            }
            if f.tvs[out_tv].memory == MemoryType::Local {
                let _ = writeln!(self.out, "{pad}  if ({wpred}) {{ {store} }}");
            } else {
                let holder: Vec<String> =
                    red.iter().map(|p| format!("{} == 0", crate::ir::scalar::parallel_index_name(*p))).collect();
                let _ = writeln!(self.out, "{pad}  if ({} && ({wpred})) {{ {store} }}", holder.join(" && "));
            }
        } else if red.iter().any(|p| p.is_block()) {
            if finish.is_some() {
                crate::bail_internal!("grid reduction of finished partials");
            }
            let names = &self.k.summary.global_allocations;
            let tname = f.tv_name(out_tv);
            let work = names.iter().find(|b| b.name == format!("{tname}_work")).map(|b| b.name.clone());
            let sync = names.iter().find(|b| b.name == format!("{tname}_sync")).map(|b| b.name.clone());
            let (Some(work), Some(sync)) = (work, sync) else {
                crate::bail_internal!("{tname}: grid reduction buffers missing")
            };
            let func = if f.tvs[out_tv].serial_grid_reduction { "gridReduceSerial" } else { "gridReduce" };
            let _ = writeln!(self.out, "{pad}  {ty} {r};");
            let _ = writeln!(
                self.out,
                "{pad}  kiln_done_{tname} = kiln::{func}<{bflags}, {tflags}>({r}, {v}, {pfunctor}, {init_c}, {work}, {sync}, kiln_ws, true);"
            );
            let _ = writeln!(self.out, "{pad}  if (kiln_done_{tname}) {{");
            let _ = writeln!(self.out, "{pad}    if ({wpred}) {{ {store} }}");
            let _ = writeln!(self.out, "{pad}  }}");
        } else if f.tvs[out_tv].memory == MemoryType::Local {
            // Every thread may read a Local result later: all threads get it.
            let _ = writeln!(
                self.out,
                "{pad}  const {pty} {rp} = kiln::blockAllReduce<{tflags}>({v}, {pfunctor}, {init_c}, kiln_ws);"
            );
            if let Some(line) = &finish {
                let _ = writeln!(self.out, "{line}");
            }
            let _ = writeln!(self.out, "{pad}  if ({wpred}) {{ {store} }}");
        } else {
            let _ = writeln!(
                self.out,
                "{pad}  const {pty} {rp} = kiln::blockReduce<{tflags}>({v}, {pfunctor}, {init_c}, kiln_ws);"
            );
            if let Some(line) = &finish {
                let _ = writeln!(self.out, "{line}");
            }
            let holder: Vec<String> = red
                .iter()
                .filter(|p| p.is_thread())
                .map(|p| format!("{} == 0", crate::ir::scalar::parallel_index_name(*p)))
                .collect();
            let _ = writeln!(self.out, "{pad}  if ({} && ({wpred})) {{ {store} }}", holder.join(" && "));
        }
        let _ = writeln!(self.out, "{pad}}}");
        Ok(())
    }
}

/// How a reduction's per-thread partial values travel between threads and blocks: their C
/// type, merge functor, identity and per-thread value, and the function that turns the
/// merged value into the output's type (none where they have it already).
struct Partials<'a> {
    ty: String,
    functor: &'a str,
    init: String,
    value: String,
    finish: Option<String>,
}

/// The type a log-sum-exp accumulates its row in: the input's compute type (float for
/// float, half and bfloat16 rows) where that is narrower than the result. A float row whose
/// log-sum-exp is a double (the automatic schedules' softmax, see
/// `sched::auto::canonical::online_logsumexp`) pays for a float exp per element, and its
/// maximum and sum are finished and merged in double.
fn lse_element_dtype(f: &Fusion, e: ExprId) -> DataType {
    let out = f.tvs[f.exprs[e].output].dtype;
    let input = f.exprs[e].inputs[0].tensor().map_or(out, |x| f.tvs[x].dtype.compute_dtype());
    if input.size_bytes() < out.size_bytes() {
        input
    } else {
        out
    }
}

/// The functor that merges partial results of reduction `e`: a float row's double
/// log-sum-exp merges with a float correction (`kiln::LogSumExpOfFloats`), others with their
/// op's functor.
fn merge_functor(f: &Fusion, e: ExprId) -> &'static str {
    match f.exprs[e].op {
        Op::Reduction { op: ReductionOp::LogSumExp | ReductionOp::LogSumExpFloored, .. }
            if f.tvs[f.exprs[e].output].dtype == DataType::Double && lse_element_dtype(f, e) == DataType::Float =>
        {
            "kiln::LogSumExpOfFloats()"
        }
        Op::Reduction { op, .. } => functor(op),
        _ => "",
    }
}

/// The combining functor of a reduction in the runtime header.
fn functor(op: ReductionOp) -> &'static str {
    match op {
        ReductionOp::Sum => "kiln::Sum()",
        ReductionOp::Max => "kiln::Max()",
        ReductionOp::Prod => "kiln::Prod()",
        ReductionOp::Min => "kiln::Min()",
        ReductionOp::LogSumExp => "kiln::LogSumExp()",
        ReductionOp::LogSumExpFloored => "kiln::LogSumExpFloored()",
    }
}

fn float_literal(x: f64) -> String {
    if x.is_nan() {
        "(0.0/0.0)".into()
    } else if x.is_infinite() {
        if x > 0.0 {
            "(1.0/0.0)".into()
        } else {
            "(-1.0/0.0)".into()
        }
    } else {
        format!("{x:?}")
    }
}
