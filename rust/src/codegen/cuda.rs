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
use crate::ir::scalar::{ScalarOp, Val};
use crate::ir::{
    BinaryOp, DataType, ExprId, Fusion, IterType, MemoryType, Op, Operand, ParallelType, ReductionOp, Symbol, TvId,
    UnaryOp, ValId,
};
use crate::kernel::{AccessIndex, AllocTarget, Kernel, Node, SyncKind};

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

/// C type of a dtype.
pub fn c_type(d: DataType) -> &'static str {
    match d {
        DataType::Float => "float",
        DataType::Double => "double",
        DataType::Half => "__half",
        DataType::BFloat16 => "__nv_bfloat16",
        DataType::Int => "int64_t",
        DataType::Int32 => "int",
        DataType::Bool => "bool",
    }
}

struct Gen<'a> {
    k: &'a Kernel,
    f: &'a Fusion,
    /// A copy of the kernel's scalars: codegen specializes index expressions (vector bases).
    sc: crate::ir::Scalars,
    out: String,
    /// Register accumulator of each hoisted reduction while its loops are emitted.
    hoisted: FxHashMap<ExprId, String>,
    /// Predicate conjuncts known to hold (inside the fast path of an unswitched loop).
    assumed: FxHashSet<ValId>,
    /// C name of each tensor's buffer.
    names: FxHashMap<TvId, String>,
    /// Outputs of complete hoisted reductions: they store every element themselves, so
    /// their init statements are dead (the interpreter still runs them: it does not hoist).
    stored_whole: FxHashSet<TvId>,
    scratch: u32,
}

fn complete_hoists(f: &Fusion, nodes: &[Node], out: &mut FxHashSet<TvId>) {
    for n in nodes {
        if let Node::Loop(l) = n {
            out.extend(l.hoisted.iter().filter(|h| h.complete).map(|h| f.exprs[h.expr].output));
            complete_hoists(f, &l.body, out);
        }
    }
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
        Node::Loop(l) => {
            acc.push(l.extent);
            for c in &l.body {
                node_vals(c, f, acc);
            }
        }
        Node::Alloc(a) => acc.extend(a.shape.iter().copied()),
        Node::Init { value, index, .. } => {
            acc.push(*value);
            push_index(index.as_ref(), acc);
        }
        Node::Expr { expr, index } => {
            push_index(index.as_ref(), acc);
            for o in &f.exprs[*expr].inputs {
                if let Operand::Scalar(v) = o {
                    acc.push(*v);
                }
            }
            match &f.exprs[*expr].op {
                Op::Reduction { init, .. } => acc.push(*init),
                Op::Full { value } => acc.push(*value),
                _ => {}
            }
        }
        Node::Sync(_) => {}
    }
}

fn push_index(ix: Option<&AccessIndex>, acc: &mut Vec<ValId>) {
    if let Some(ix) = ix {
        acc.push(ix.out);
        acc.extend(ix.inputs.iter().flatten().copied());
        acc.push(ix.predicate);
        acc.push(ix.write_predicate);
        for g in &ix.gathers {
            acc.push(g.at);
            acc.push(g.extent);
        }
    }
}

/// Generate CUDA for a lowered kernel; `index32` picks 32-bit index arithmetic (valid
/// when every offset fits, which the host plan checks for concrete sizes).
pub fn generate(k: &Kernel, index32: bool) -> Result<CudaKernel> {
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
    for v in vals {
        collect_symbols(f, v, &mut seen, &mut syms);
    }
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

    let mut g = Gen {
        k,
        f,
        sc: f.scalars.clone(),
        out: String::new(),
        hoisted: FxHashMap::default(),
        assumed: FxHashSet::default(),
        names,
        stored_whole: FxHashSet::default(),
        scratch: 0,
    };
    complete_hoists(f, &k.body, &mut g.stored_whole);
    let sig: Vec<String> = params
        .iter()
        .map(|(name, kind, dt)| match kind {
            ParamKind::Input(_) => format!("const {}* __restrict__ {name}", c_type(*dt)),
            ParamKind::Output(_) => format!("{}* __restrict__ {name}", c_type(*dt)),
            ParamKind::Buffer(_) => format!("{}* {name}", c_type(*dt)),
            ParamKind::Extent(_) | ParamKind::Stride(..) => format!("kiln_index_t {name}"),
            _ => format!("{} {name}", c_type(*dt)),
        })
        .collect();
    let _ = writeln!(g.out, "typedef {} kiln_index_t;", if index32 { "int" } else { "int64_t" });
    let _ = writeln!(g.out, "extern \"C\" __global__ void {KERNEL_NAME}({}) {{", sig.join(", "));
    g.out.push_str("  extern __shared__ __align__(16) char kiln_smem[];\n");
    // Which threads hold each grid reduction's finished result (`Symbol::GridDone`).
    for tv in f.tvs.keys() {
        let sync = format!("{}_sync", f.tv_name(tv));
        if k.summary.global_allocations.iter().any(|b| b.name == sync) {
            let _ = writeln!(g.out, "  bool kiln_done_{} = false;", f.tv_name(tv));
        }
    }
    for n in &k.body {
        g.node(n, 1)?;
    }
    g.out.push_str("}\n");
    Ok(CudaKernel { name: KERNEL_NAME.to_string(), body: g.out, params })
}

impl Gen<'_> {
    fn pad(depth: usize) -> String {
        "  ".repeat(depth)
    }

    /// C expression of an integer/bool scalar.
    fn c(&self, v: ValId) -> String {
        let sc = &self.sc;
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

    fn buf(&self, tv: TvId) -> String {
        self.names.get(&tv).cloned().unwrap_or_else(|| self.f.tv_name(tv))
    }

    /// True for an init statement that `stored_whole` makes dead, or a loop holding only such.
    fn dead_init(&self, n: &Node) -> bool {
        match n {
            Node::Init { tv, .. } => self.stored_whole.contains(tv),
            Node::Loop(l) => !l.body.is_empty() && l.body.iter().all(|c| self.dead_init(c)),
            _ => false,
        }
    }

    fn node(&mut self, n: &Node, depth: usize) -> Result<()> {
        let pad = Self::pad(depth);
        if self.dead_init(n) {
            return Ok(());
        }
        match n {
            Node::Loop(l) if self.try_vectorized_copy(l, depth)? => {}
            Node::Loop(l) if !l.hoisted.is_empty() => self.hoisting_loop(l, depth)?,
            Node::Loop(l) if l.parallel == ParallelType::Unswitch && self.unswitch(l, depth)? => {}
            Node::Loop(l) if !l.parallel.is_thread_or_block() && self.hoist_invariant(l, depth)? => {}
            Node::Loop(l) => {
                if l.parallel.is_thread_or_block() {
                    let _ = writeln!(self.out, "{pad}{{  // {} over {}", l.parallel.enum_name(), self.f.id_label(l.id));
                } else {
                    let idx = self.c(l.index);
                    // Unroll short constant loops too: Local arrays indexed by their index
                    // then stay in registers instead of spilling to local memory.
                    let c = self.f.scalars.as_int(l.extent);
                    let unroll = c.is_some()
                        && (matches!(l.parallel, ParallelType::Unroll | ParallelType::Vectorize)
                            || c.is_some_and(|n| n <= 16));
                    if unroll {
                        let _ = writeln!(self.out, "{pad}#pragma unroll");
                    }
                    let _ = writeln!(
                        self.out,
                        "{pad}for (kiln_index_t {idx} = 0; {idx} < {}; ++{idx}) {{  // {}",
                        self.c(l.extent),
                        self.f.id_label(l.id)
                    );
                }
                for c in &l.body {
                    self.node(c, depth + 1)?;
                }
                let _ = writeln!(self.out, "{pad}}}");
            }
            Node::Alloc(a) => {
                let AllocTarget::Tensor(tv) = a.target else {
                    return Ok(());
                };
                let ty = c_type(a.dtype);
                let name = self.buf(tv);
                match a.memory {
                    MemoryType::Local => {
                        let Some(size) =
                            a.shape.iter().try_fold(1i64, |acc, &e| self.f.scalars.as_int(e).map(|x| acc * x))
                        else {
                            let dims: Vec<String> = a.shape.iter().map(|&e| self.f.scalars.render(e)).collect();
                            bail!(
                                "{name} is in Local memory but its allocation [{}] is not a constant size; inline it further or make the allocated axes constant",
                                dims.join(", ")
                            );
                        };
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
                let ty = c_type(self.f.tvs[*tv].dtype);
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
                self.expr(*expr, ix, depth)?;
            }
            Node::Sync(k) => {
                let _ =
                    writeln!(self.out, "{pad}__syncthreads();  // {}", if *k == SyncKind::Raw { "RAW" } else { "WAR" });
            }
        }
        Ok(())
    }

    /// A predicate without the conjuncts assumed to hold.
    fn pred(&self, v: ValId) -> String {
        let mut parts = Vec::new();
        conjuncts(&self.sc, v, &mut parts);
        let kept: Vec<String> = parts.into_iter().filter(|c| !self.assumed.contains(c)).map(|c| self.c(c)).collect();
        if kept.is_empty() {
            "true".into()
        } else {
            kept.join(" && ")
        }
    }

    /// Unswitch: when every bound predicate inside the loop holds at the largest loop
    /// indices (the bounds are monotone in them), run a copy of the loop without those
    /// predicates; otherwise the predicated loop. Returns false when nothing can be
    /// hoisted (the loop is then emitted as a plain serial loop).
    fn unswitch(&mut self, l: &crate::kernel::ForLoop, depth: usize) -> Result<bool> {
        let mut loops: Vec<(Symbol, ValId)> = Vec::new();
        let mut preds: Vec<ValId> = Vec::new();
        collect_unswitch(&self.sc, &Node::Loop(l.clone()), &mut loops, &mut preds);
        let syms: FxHashSet<Symbol> = loops.iter().map(|&(s, _)| s).collect();
        let mut hoist: Vec<ValId> = Vec::new();
        for p in preds {
            let mut parts = Vec::new();
            conjuncts(&self.sc, p, &mut parts);
            for c in parts {
                if hoist.contains(&c) || self.assumed.contains(&c) {
                    continue;
                }
                if let Val::Binary(ScalarOp::Lt, a, b) = self.sc.get(c) {
                    if mentions(&self.sc, a, &syms) && !mentions(&self.sc, b, &syms) && monotone(&self.sc, a) {
                        hoist.push(c);
                    }
                }
            }
        }
        if hoist.is_empty() || loops.iter().any(|&(_, e)| mentions(&self.sc, e, &syms)) {
            return Ok(false);
        }
        // The fast-path condition: each hoisted bound at the largest indices.
        let mut cond = self.sc.boolean(true);
        for &c in &hoist {
            let mut v = c;
            for &(s, e) in &loops {
                let one = self.sc.int(1);
                let last = self.sc.sub(e, one);
                v = self.sc.substitute(v, s, last);
            }
            cond = self.sc.binary(ScalarOp::And, cond, v);
        }
        let pad = Self::pad(depth);
        let _ = writeln!(self.out, "{pad}if ({}) {{  // unswitched: bounds hold for the whole tile", self.pred(cond));
        let mut plain = l.clone();
        plain.parallel = ParallelType::Serial;
        let added: Vec<ValId> = hoist.iter().copied().filter(|c| self.assumed.insert(*c)).collect();
        self.node(&Node::Loop(plain.clone()), depth + 1)?;
        for c in added {
            self.assumed.remove(&c);
        }
        let _ = writeln!(self.out, "{pad}}} else {{");
        self.node(&Node::Loop(plain), depth + 1)?;
        let _ = writeln!(self.out, "{pad}}}");
        Ok(true)
    }

    /// Bounds checks that every statement under a serial loop repeats but no loop inside
    /// it changes (a column bound inside a loop over rows): test them once around the
    /// loop. Per-statement checks compile to a branch around every load, which keeps the
    /// loads of an unrolled loop from being issued together. Returns false (emitting
    /// nothing) when there is nothing to hoist or the loop holds a barrier or a block
    /// reduction, which every thread must reach.
    fn hoist_invariant(&mut self, l: &crate::kernel::ForLoop, depth: usize) -> Result<bool> {
        let mut loops: Vec<(Symbol, ValId)> = Vec::new();
        let mut preds: Vec<ValId> = Vec::new();
        if !self.only_local_statements(&l.body) {
            return Ok(false);
        }
        // This loop's index and those of the loops inside it (no clone of the subtree).
        if let Val::Symbol(s) = self.sc.get(l.index) {
            loops.push((s, l.extent));
        }
        for c in &l.body {
            collect_unswitch(&self.sc, c, &mut loops, &mut Vec::new());
        }
        collect_predicates(&l.body, &mut preds);
        let inner: FxHashSet<Symbol> = loops.iter().map(|&(s, _)| s).collect();
        let mut common: Option<Vec<ValId>> = None;
        for p in preds {
            let mut parts = Vec::new();
            conjuncts(&self.sc, p, &mut parts);
            parts.retain(|c| !self.assumed.contains(c));
            common = Some(match common {
                None => parts,
                Some(prev) => prev.into_iter().filter(|c| parts.contains(c)).collect(),
            });
        }
        let hoist: Vec<ValId> = common
            .unwrap_or_default()
            .into_iter()
            .filter(|&c| !mentions(&self.sc, c, &inner) && !mentions_gathered(&self.sc, c))
            .collect();
        if hoist.is_empty() {
            return Ok(false);
        }
        let mut cond = self.sc.boolean(true);
        for &c in &hoist {
            cond = self.sc.binary(ScalarOp::And, cond, c);
        }
        let pad = Self::pad(depth);
        let _ = writeln!(self.out, "{pad}if ({}) {{  // bounds no inner loop changes", self.pred(cond));
        let added: Vec<ValId> = hoist.iter().copied().filter(|c| self.assumed.insert(*c)).collect();
        let r = self.node(&Node::Loop(l.clone()), depth + 1);
        for c in added {
            self.assumed.remove(&c);
        }
        r?;
        let _ = writeln!(self.out, "{pad}}}");
        Ok(true)
    }

    /// True when `body` holds only loops, Local allocations and statements that emit no
    /// barrier (no syncs, no block or grid reductions that are not hoisted out).
    fn only_local_statements(&self, body: &[Node]) -> bool {
        body.iter().all(|n| match n {
            Node::Loop(l) => l.hoisted.is_empty() && self.only_local_statements(&l.body),
            Node::Alloc(a) => a.memory == MemoryType::Local,
            Node::Expr { expr, .. } => {
                let e = &self.f.exprs[*expr];
                let block_reduce = matches!(e.op, Op::Reduction { .. })
                    && !self.hoisted.contains_key(expr)
                    && self.f.tvs[e.output].loop_domain.iter().enumerate().any(|(a, &id)| {
                        self.f.ids[id].iter_type == IterType::Reduction
                            && self.k.loops.groups[self.k.loops.group(e.output, a)].parallel.is_thread_or_block()
                    });
                !block_reduce
            }
            Node::Init { .. } | Node::Sync(_) => false,
        })
    }

    /// A loop that hoisted reductions accumulate through: registers before it, the
    /// block/grid reductions after it.
    fn hoisting_loop(&mut self, l: &crate::kernel::ForLoop, depth: usize) -> Result<()> {
        let pad = Self::pad(depth);
        let f = self.f;
        let mut after = Vec::new();
        for &crate::kernel::Hoisted { expr: e, complete } in &l.hoisted {
            let Op::Reduction { op, init } = f.exprs[e].op else { crate::bail_internal!("hoisted a non-reduction") };
            let Some(ix) = find_index(&l.body, e) else { crate::bail_internal!("hoisted reduction not in its loop") };
            let ty = c_type(f.tvs[f.exprs[e].output].dtype);
            self.scratch += 1;
            let acc = format!("kiln_acc{}", self.scratch);
            let init_c = format!("kiln::cast<{ty}>({})", self.c(init));
            let _ = writeln!(self.out, "{pad}{ty} {acc} = {init_c};");
            self.hoisted.insert(e, acc.clone());
            after.push((e, ix.clone(), op, init_c, acc, complete));
        }
        let mut plain = l.clone();
        plain.hoisted.clear();
        self.node(&Node::Loop(plain), depth)?;
        for (e, ix, op, init_c, acc, complete) in after {
            self.hoisted.remove(&e);
            let out_tv = f.exprs[e].output;
            let mut red = Vec::new();
            for (a, &id) in f.tvs[out_tv].loop_domain.iter().enumerate() {
                let p = self.k.loops.groups[self.k.loops.group(out_tv, a)].parallel;
                if f.ids[id].iter_type == IterType::Reduction && p.is_thread_or_block() {
                    red.push(p);
                }
            }
            let functor = match op {
                ReductionOp::Sum => "kiln::Sum()",
                ReductionOp::Max => "kiln::Max()",
                ReductionOp::Min => "kiln::Min()",
            };
            self.parallel_reduce(e, &ix, &red, functor, &init_c, &acc, depth, "", complete)?;
        }
        Ok(())
    }

    /// Emit a Vectorize loop holding one copy as a single wide load and store, with a
    /// scalar fallback for misaligned or partly out-of-range vectors. Returns false (and
    /// emits nothing) when the loop is not such a copy.
    fn try_vectorized_copy(&mut self, l: &crate::kernel::ForLoop, depth: usize) -> Result<bool> {
        if l.parallel != ParallelType::Vectorize {
            return Ok(false);
        }
        let Some(n) = self.sc.as_int(l.extent) else {
            return Ok(false);
        };
        let [Node::Expr { expr, index: Some(ix) }] = l.body.as_slice() else {
            return Ok(false);
        };
        let f = self.f;
        let e = &f.exprs[*expr];
        // A broadcast moves data like a copy: along the vector it reads consecutive elements.
        let (Op::Set | Op::Broadcast { .. } | Op::IndexSelect { .. }, Some(Operand::Tensor(src))) =
            (&e.op, e.inputs.first().copied())
        else {
            return Ok(false);
        };
        let dt = f.tvs[e.output].dtype;
        let bytes = n as usize * dt.size_bytes();
        if !matches!(bytes, 2 | 4 | 8 | 16) || f.tvs[src].dtype != dt {
            return Ok(false);
        }
        let Val::Symbol(sym) = self.sc.get(l.index) else {
            return Ok(false);
        };
        let Some(in_off) = ix.inputs[0] else {
            return Ok(false);
        };
        let (zero, last) = (self.sc.int(0), self.sc.int(n - 1));
        let at = |v: ValId, k: ValId, sc: &mut crate::ir::Scalars| sc.substitute(v, sym, k);
        let (o0, i0) = (at(ix.out, zero, &mut self.sc), at(in_off, zero, &mut self.sc));
        // Unit stride in the vector index on both sides, or no wide access.
        if linear_coeff(&self.sc, ix.out, sym) != Some(1) || linear_coeff(&self.sc, in_off, sym) != Some(1) {
            return Ok(false);
        }
        // A gathered row: the index is read once for the whole vector, so it must not move
        // along it.
        if ix.gathers.iter().any(|g| linear_coeff(&self.sc, g.at, sym) != Some(0)) {
            return Ok(false);
        }
        // Conjuncts already known to hold (unswitched fast path) need no re-check per vector.
        let mut parts = Vec::new();
        conjuncts(&self.sc, ix.predicate, &mut parts);
        let mut live = self.sc.boolean(true);
        for c in parts.into_iter().filter(|c| !self.assumed.contains(c)) {
            live = self.sc.binary(ScalarOp::And, live, c);
        }
        let (p0, pl) = (at(live, zero, &mut self.sc), at(live, last, &mut self.sc));
        let pad = Self::pad(depth);
        let ty = c_type(dt);
        let (ob, ib) = (self.buf(e.output), self.buf(src));
        let _ = writeln!(self.out, "{pad}{{  // Vectorize x{n} over {}", f.id_label(l.id));
        for g in &ix.gathers {
            // Read only where the vector's first element is in bounds; the address below is
            // dereferenced only then.
            let _ = writeln!(
                self.out,
                "{pad}  const kiln_index_t g{} = kiln::checkedIndex(({}) ? (kiln_index_t){}[{}] : 0, {}, {}, {}, {});",
                g.id,
                self.pred(p0),
                self.buf(g.index_tv),
                self.c(g.at),
                self.c(g.extent),
                crate::kernel::INDEX_ERROR,
                g.id,
                self.c(g.at)
            );
        }
        let _ = writeln!(self.out, "{pad}  const kiln_index_t kiln_ob = {}, kiln_ib = {};", self.c(o0), self.c(i0));
        // Local arrays are declared 16-byte aligned, so an offset that is a multiple of the
        // vector width is aligned by construction. Checking a Local address at run time
        // would force the array out of registers into the stack frame. A Shared side whose
        // offset is not a multiple of the width (a tile padded by one bank) is moved element
        // by element, so that the Global side keeps its 16-byte access on every row.
        let mut checks = Vec::new();
        let mut wide = [true, true];
        for (k, (buf, tv, off)) in [(&ob, e.output, o0), (&ib, src, i0)].into_iter().enumerate() {
            let multiple = self.sc.known_multiple(off) % n == 0;
            match f.tvs[tv].memory {
                MemoryType::Local if multiple => {}
                MemoryType::Shared if !multiple => wide[k] = false,
                // Global with aligned bases: only the offset can break the alignment.
                MemoryType::Global if f.aligned_bases && multiple => {}
                MemoryType::Global if f.aligned_bases => {
                    checks.push(format!(" && {} % {n} == 0", if k == 0 { "kiln_ob" } else { "kiln_ib" }));
                }
                _ => {
                    let var = if k == 0 { "kiln_ob" } else { "kiln_ib" };
                    checks.push(format!(" && reinterpret_cast<unsigned long long>(&{buf}[{var}]) % {bytes} == 0"));
                }
            }
        }
        let _ = writeln!(self.out, "{pad}  if (({}) && ({}){}) {{", self.pred(p0), self.pred(pl), checks.concat());
        let _ = writeln!(self.out, "{pad}    kiln::Array<{ty}, {n}> kiln_vec;");
        let each = format!("{pad}    #pragma unroll\n{pad}    for (int kiln_j = 0; kiln_j < {n}; ++kiln_j) ");
        let load = if wide[1] {
            let global = f.tvs[src].memory == MemoryType::Global;
            let hints = (f.tvs[e.output].streaming_load && global, f.tvs[e.output].evict_last_load && global);
            let func = match hints {
                (false, false) => "loadVec",
                (true, false) => "loadVecStreaming",
                (false, true) => "loadVecEvictLast",
                (true, true) => "loadVecStreamingEvictLast",
            };
            format!("{pad}    kiln::{func}<{ty}, {n}>(kiln_vec, &{ib}[kiln_ib]);")
        } else {
            format!("{each}kiln_vec[kiln_j] = {ib}[kiln_ib + kiln_j];")
        };
        let store = if wide[0] {
            format!("{pad}    kiln::storeVec<{ty}, {n}>(&{ob}[kiln_ob], kiln_vec);")
        } else {
            format!("{each}{ob}[kiln_ob + kiln_j] = kiln_vec[kiln_j];")
        };
        let _ = writeln!(self.out, "{load}\n{store}");
        let _ = writeln!(self.out, "{pad}  }} else {{");
        let idx = self.c(l.index);
        let _ = writeln!(self.out, "{pad}    #pragma unroll");
        let _ = writeln!(self.out, "{pad}    for (kiln_index_t {idx} = 0; {idx} < {n}; ++{idx}) {{");
        self.expr(*expr, ix, depth + 3)?;
        let _ = writeln!(self.out, "{pad}    }}");
        let _ = writeln!(self.out, "{pad}  }}");
        let _ = writeln!(self.out, "{pad}}}");
        Ok(true)
    }

    /// C expression reading operand `pos` of `e`, converted to dtype `to`.
    fn operand(&self, e: ExprId, ix: &AccessIndex, pos: usize, to: DataType) -> String {
        let ty = c_type(to);
        match self.f.exprs[e].inputs[pos] {
            Operand::Tensor(t) => {
                let off = ix.inputs[pos].map(|v| self.c(v)).unwrap_or_else(|| "0".into());
                format!("kiln::cast<{ty}>({}[{off}])", self.buf(t))
            }
            Operand::Scalar(v) => format!("kiln::cast<{ty}>({})", self.c(v)),
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
        let out_ty = c_type(out_dt);
        let out = format!("{}[{}]", self.buf(out_tv), self.c(ix.out));
        let pred = self.pred(ix.predicate);
        let mut pre = String::new();
        for gth in &ix.gathers {
            let _ = write!(
                pre,
                "const kiln_index_t g{} = kiln::checkedIndex(({}) ? (kiln_index_t){}[{}] : 0, {}, {}, {}, {}); ",
                gth.id,
                pred,
                self.buf(gth.index_tv),
                self.c(gth.at),
                self.c(gth.extent),
                crate::kernel::INDEX_ERROR,
                gth.id,
                self.c(gth.at)
            );
        }
        let value = match &ex.op {
            Op::Unary(u) => {
                let cd = if matches!(u, UnaryOp::Abs | UnaryOp::Neg | UnaryOp::Relu) {
                    self.operand_dtype(ex.inputs[0])
                } else {
                    out_dt.compute_dtype()
                };
                format!("kiln::cast<{out_ty}>(kiln::{}({}))", unary_fn(*u), self.operand(e, ix, 0, cd))
            }
            Op::Binary(b) => {
                let cd = if is_comparison(*b) || (*b == BinaryOp::Div) {
                    let dts: Vec<_> = ex
                        .inputs
                        .iter()
                        .map(|&o| crate::ir::dtype::PromotionOperand {
                            dtype: self.operand_dtype(o),
                            is_tensor: o.tensor().is_some(),
                        })
                        .collect();
                    let p = crate::ir::dtype::promote(&dts);
                    if *b == BinaryOp::Div && !p.is_float() {
                        DataType::Float
                    } else if *b == BinaryOp::Div {
                        p.compute_dtype()
                    } else {
                        p
                    }
                } else {
                    out_dt.compute_dtype()
                };
                format!(
                    "kiln::cast<{out_ty}>(kiln::{}({}, {}))",
                    binary_fn(*b),
                    self.operand(e, ix, 0, cd),
                    self.operand(e, ix, 1, cd)
                )
            }
            Op::Where => format!(
                "kiln::where({}, {}, {})",
                self.operand(e, ix, 0, DataType::Bool),
                self.operand(e, ix, 1, out_dt),
                self.operand(e, ix, 2, out_dt)
            ),
            Op::Cast(_) | Op::Set | Op::Broadcast { .. } | Op::Permute { .. } | Op::IndexSelect { .. } => {
                self.operand(e, ix, 0, out_dt)
            }
            Op::Full { value } => format!("kiln::cast<{out_ty}>({})", self.c(*value)),
            Op::Reduction { op, init } => return self.reduction(e, ix, *op, *init, depth, &pre),
        };
        let _ = writeln!(self.out, "{pad}if ({pred}) {{ {pre}{out} = {value}; }}");
        Ok(())
    }

    fn reduction(
        &mut self,
        e: ExprId,
        ix: &AccessIndex,
        op: ReductionOp,
        init: ValId,
        depth: usize,
        pre: &str,
    ) -> Result<()> {
        let pad = Self::pad(depth);
        let f = self.f;
        let out_tv = f.exprs[e].output;
        let dt = f.tvs[out_tv].dtype;
        let ty = c_type(dt);
        let functor = match op {
            ReductionOp::Sum => "kiln::Sum()",
            ReductionOp::Max => "kiln::Max()",
            ReductionOp::Min => "kiln::Min()",
        };
        let out = format!("{}[{}]", self.buf(out_tv), self.c(ix.out));
        let input = self.operand(e, ix, 0, dt);
        let init_c = format!("kiln::cast<{ty}>({})", self.c(init));
        let red = crate::analysis::parallel::reduced_dims(f, &self.k.loops, out_tv);
        let pred = self.pred(ix.predicate);
        if red.is_empty() {
            let _ = writeln!(self.out, "{pad}if ({pred}) {{ {pre}{out} = {functor}({out}, {input}); }}");
            return Ok(());
        }
        if let Some(acc) = self.hoisted.get(&e) {
            // Hoisted: accumulate per thread now; the block/grid reduction follows the loop.
            let _ = writeln!(self.out, "{pad}if ({pred}) {{ {pre}{acc} = {functor}({acc}, {input}); }}");
            return Ok(());
        }
        let value = format!("({pred}) ? {input} : {init_c}");
        self.parallel_reduce(e, ix, &red, functor, &init_c, &value, depth, pre, false)
    }

    /// The block or grid reduction of a per-thread `value`, combined into the output.
    #[allow(clippy::too_many_arguments)]
    fn parallel_reduce(
        &mut self,
        e: ExprId,
        ix: &AccessIndex,
        red: &[ParallelType],
        functor: &str,
        init_c: &str,
        value: &str,
        depth: usize,
        pre: &str,
        complete: bool,
    ) -> Result<()> {
        let pad = Self::pad(depth);
        let f = self.f;
        let out_tv = f.exprs[e].output;
        let ty = c_type(f.tvs[out_tv].dtype);
        let out = format!("{}[{}]", self.buf(out_tv), self.c(ix.out));
        let wpred = self.pred(ix.write_predicate);
        let has = |p: ParallelType| red.contains(&p);
        let tflags = format!("{}, {}, {}", has(ParallelType::TIDx), has(ParallelType::TIDy), has(ParallelType::TIDz));
        let bflags = format!("{}, {}, {}", has(ParallelType::BIDx), has(ParallelType::BIDy), has(ParallelType::BIDz));
        let Some(ws) = self.k.launch.reduction_workspace else { crate::bail_internal!("reduction without workspace") };
        self.scratch += 1;
        let v = format!("kiln_v{}", self.scratch);
        let r = format!("kiln_r{}", self.scratch);
        let store = if complete { format!("{out} = {r};") } else { format!("{out} = {functor}({out}, {r});") };
        let _ = writeln!(self.out, "{pad}{{");
        let _ = writeln!(self.out, "{pad}  {ty}* kiln_ws = reinterpret_cast<{ty}*>(kiln_smem + {});", self.c(ws));
        let _ = writeln!(self.out, "{pad}  {pre}const {ty} {v} = {value};");
        if red.iter().any(|p| p.is_block()) {
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
                "{pad}  kiln_done_{tname} = kiln::{func}<{bflags}, {tflags}>({r}, {v}, {functor}, {init_c}, {work}, {sync}, kiln_ws, true);"
            );
            let _ = writeln!(self.out, "{pad}  if (kiln_done_{tname}) {{");
            let _ = writeln!(self.out, "{pad}    if ({wpred}) {{ {store} }}");
            let _ = writeln!(self.out, "{pad}  }}");
        } else if f.tvs[out_tv].memory == MemoryType::Local {
            // Every thread may read a Local result later: all threads get it.
            let _ = writeln!(
                self.out,
                "{pad}  const {ty} {r} = kiln::blockAllReduce<{tflags}>({v}, {functor}, {init_c}, kiln_ws);"
            );
            let _ = writeln!(self.out, "{pad}  if ({wpred}) {{ {store} }}");
        } else {
            let _ = writeln!(
                self.out,
                "{pad}  const {ty} {r} = kiln::blockReduce<{tflags}>({v}, {functor}, {init_c}, kiln_ws);"
            );
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

/// The constant coefficient of `sym` in `v` when `v` is affine in it (it appears only
/// under sums and products with constants); `None` otherwise.
fn linear_coeff(sc: &crate::ir::Scalars, v: ValId, sym: Symbol) -> Option<i64> {
    match sc.get(v) {
        Val::Symbol(s) => Some(if s == sym { 1 } else { 0 }),
        Val::Int(_) | Val::Bool(_) | Val::Float(_) => Some(0),
        Val::Binary(ScalarOp::Add, a, b) => Some(linear_coeff(sc, a, sym)? + linear_coeff(sc, b, sym)?),
        Val::Binary(ScalarOp::Sub, a, b) => Some(linear_coeff(sc, a, sym)? - linear_coeff(sc, b, sym)?),
        Val::Binary(ScalarOp::Mul, a, b) => {
            let (ca, cb) = (linear_coeff(sc, a, sym)?, linear_coeff(sc, b, sym)?);
            match (ca, cb) {
                (0, 0) => Some(0),
                (k, 0) => sc.as_int(b).map(|c| k * c),
                (0, k) => sc.as_int(a).map(|c| k * c),
                _ => None,
            }
        }
        Val::Binary(_, a, b) => {
            // Any other operator is fine only if the symbol does not occur under it.
            (linear_coeff(sc, a, sym)? == 0 && linear_coeff(sc, b, sym)? == 0).then_some(0)
        }
    }
}

/// Split a predicate into its `&&` conjuncts.
fn conjuncts(sc: &crate::ir::Scalars, v: ValId, out: &mut Vec<ValId>) {
    match sc.get(v) {
        Val::Binary(ScalarOp::And, a, b) => {
            conjuncts(sc, a, out);
            conjuncts(sc, b, out);
        }
        Val::Bool(true) => {}
        _ => out.push(v),
    }
}

/// True when `v` mentions one of `syms`.
fn mentions(sc: &crate::ir::Scalars, v: ValId, syms: &FxHashSet<Symbol>) -> bool {
    match sc.get(v) {
        Val::Symbol(s) => syms.contains(&s),
        Val::Binary(_, a, b) => mentions(sc, a, syms) || mentions(sc, b, syms),
        _ => false,
    }
}

/// The predicates of the statements in `body` (what each checks before it runs).
fn collect_predicates(body: &[Node], out: &mut Vec<ValId>) {
    for n in body {
        match n {
            Node::Loop(l) => collect_predicates(&l.body, out),
            Node::Expr { index: Some(ix), .. } => out.push(ix.predicate),
            _ => {}
        }
    }
}

/// True when `v` reads a gathered index value or a grid reduction's completion (defined
/// per statement, not before a loop).
fn mentions_gathered(sc: &crate::ir::Scalars, v: ValId) -> bool {
    match sc.get(v) {
        Val::Symbol(s) => matches!(s, Symbol::Gathered(_) | Symbol::GridDone(_)),
        Val::Binary(_, a, b) => mentions_gathered(sc, a) || mentions_gathered(sc, b),
        _ => false,
    }
}

/// True when `v` never decreases as any (non-negative) symbol grows: sums and products
/// of non-negative terms.
fn monotone(sc: &crate::ir::Scalars, v: ValId) -> bool {
    match sc.get(v) {
        Val::Symbol(_) => true,
        Val::Int(i) => i >= 0,
        Val::Binary(ScalarOp::Add | ScalarOp::Mul, a, b) => monotone(sc, a) && monotone(sc, b),
        _ => false,
    }
}

/// Loop-index symbols (with extents) and predicates of the nodes under an unswitched loop.
fn collect_unswitch(sc: &crate::ir::Scalars, n: &Node, loops: &mut Vec<(Symbol, ValId)>, preds: &mut Vec<ValId>) {
    match n {
        Node::Loop(l) => {
            if !l.parallel.is_thread_or_block() {
                if let Val::Symbol(s) = sc.get(l.index) {
                    loops.push((s, l.extent));
                }
            }
            for c in &l.body {
                collect_unswitch(sc, c, loops, preds);
            }
        }
        Node::Expr { index: Some(ix), .. } | Node::Init { index: Some(ix), .. } => {
            preds.push(ix.predicate);
            preds.push(ix.write_predicate);
        }
        _ => {}
    }
}

/// The access index of expr `e` somewhere in `body`.
fn find_index(body: &[Node], e: ExprId) -> Option<AccessIndex> {
    for n in body {
        match n {
            Node::Expr { expr, index } if *expr == e => return index.clone(),
            Node::Loop(l) => {
                if let Some(ix) = find_index(&l.body, e) {
                    return Some(ix);
                }
            }
            _ => {}
        }
    }
    None
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

fn is_comparison(b: BinaryOp) -> bool {
    matches!(b, BinaryOp::Eq | BinaryOp::Ne | BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge)
}

fn unary_fn(u: UnaryOp) -> &'static str {
    crate::ir::ops::unary_name(u)
}

fn binary_fn(b: BinaryOp) -> &'static str {
    crate::ir::ops::binary_name(b)
}
