//! Execution of a kernel's loop nest, vectorised over every thread of the grid (SIMT
//! lockstep: each node runs for all threads before the next), with checked memory.

use std::borrow::Cow;

use rustc_hash::FxHashMap;

use crate::bail_internal;
use crate::error::{KilnError, Result};
use crate::interp::mbarrier::{Arrival, BarKey, Barriers};
use crate::interp::prog::{coord, EvalEnv, Evaluator, Prog, Reg};
use crate::interp::values::{self, Col, ScalarValue};
use crate::interp::{Bindings, Buffer, Stats};
use crate::ir::dtype::{promote, PromotionOperand};
use crate::ir::scalar::Val;
use crate::ir::{DataType, ExprId, Fusion, IterType, MemoryType, Op, Operand, ParallelType, Symbol, TvId, ValId};
use crate::kernel::{AllocTarget, Allocate, BarrierOp, CpAsyncOp, Kernel, Node, VectorAccess};

/// Largest grid the interpreter runs (threads of all blocks together).
const MAX_THREADS: i64 = 1 << 24;

use crate::analysis::parallel::DIMS as PARALLEL_DIMS;

/// What an indexed statement does.
enum AccessKind {
    Init {
        value: ValId,
    },
    Expr {
        expr: ExprId,
    },
    /// A hoisted reduction's per-thread step, combined into register `acc`.
    Accumulate {
        expr: ExprId,
        acc: u32,
    },
    /// The block/grid reduction of register `acc` into the reduction's output; `complete`:
    /// stored, not combined with the output's running value.
    ReduceAccumulator {
        expr: ExprId,
        acc: u32,
        complete: bool,
    },
}

impl AccessKind {
    fn expr(&self) -> Option<ExprId> {
        match *self {
            AccessKind::Init { .. } => None,
            AccessKind::Expr { expr }
            | AccessKind::Accumulate { expr, .. }
            | AccessKind::ReduceAccumulator { expr, .. } => Some(expr),
        }
    }
}

/// A vector copy with its compiled offsets and guards.
struct CVector {
    expr: ExprId,
    src: TvId,
    width: i64,
    prog: Prog,
    out: u32,
    input: u32,
    first: u32,
    last: u32,
    gathers: Vec<CGather>,
    access: [VectorAccess; 2],
    whole: bool,
    fallback: Vec<CNode>,
}

/// An Init or Expr node with its compiled index program.
struct Access {
    kind: AccessKind,
    out_tv: TvId,
    prog: Prog,
    out: u32,
    inputs: Vec<Option<u32>>,
    pred: u32,
    wpred: u32,
    /// (symbol id, index tensor, compiled offset, selected-from tensor, its extent).
    gathers: Vec<CGather>,
    /// Thread/block parallel types of the reduced enclosing loops (reductions only).
    reduced: Vec<ParallelType>,
    /// The written element's logical position (iota, random numbers).
    element: Option<u32>,
}

/// The loop nest, compiled once per run.
enum CNode {
    Loop { var: Option<u32>, extent: ValId, parallel: ParallelType, body: Vec<CNode> },
    Alloc(Allocate),
    Access(Box<Access>),
    Sync,
    If { prog: Prog, cond: u32, then: Vec<CNode>, otherwise: Vec<CNode> },
    Vector(Box<CVector>),
    AccumulatorInit { acc: u32, expr: ExprId },
    Barrier(Box<CBarrier>),
    Bulk(Box<CBulk>),
    CpAsync(CpAsyncOp),
    TensorMemory(crate::kernel::TmemOp),
}

/// An mbarrier operation with its compiled values (entry, then the op's argument).
struct CBarrier {
    op: BarrierOp,
    prog: Prog,
    array: u32,
    entry: u32,
    arg: Option<u32>,
}

/// A bulk copy with its compiled values.
struct CBulk {
    expr: ExprId,
    src: TvId,
    prog: Prog,
    dst: u32,
    from: u32,
    elems: u32,
    guard: u32,
    array: u32,
    entry: u32,
    /// (array, entry, parity, condition) of the write-after-read wait.
    reuse: Option<(u32, u32, u32, u32)>,
}

fn compile(k: &Kernel, body: &[Node], stack: &mut Vec<(ParallelType, bool)>) -> Result<Vec<CNode>> {
    let f = &k.fusion;
    let mut out = Vec::with_capacity(body.len());
    for n in body {
        out.push(match n {
            Node::Loop(l) => {
                let reduced = l.group.is_some_and(|g| {
                    k.loops.groups.get(g).is_some_and(|gi| f.ids[gi.promoted].iter_type == IterType::Reduction)
                });
                let var = if l.parallel.is_thread_or_block() {
                    None
                } else {
                    match f.scalars.get(l.index) {
                        Val::Symbol(Symbol::LoopIndex(n)) => Some(n),
                        _ => bail_internal!(
                            "interpreter: loop variable {} is not a loop index",
                            f.scalars.render(l.index)
                        ),
                    }
                };
                stack.push((l.parallel, reduced));
                let body = compile(k, &l.body, stack)?;
                stack.pop();
                CNode::Loop { var, extent: l.extent, parallel: l.parallel, body }
            }
            Node::Alloc(a) => CNode::Alloc(a.clone()),
            Node::Sync(_) => CNode::Sync,
            Node::CpAsync(op) => CNode::CpAsync(*op),
            Node::TensorMemory(op) => CNode::TensorMemory(*op),
            Node::Barrier(op) => {
                let mut prog = Prog::default();
                let (bar, arg) = match op {
                    BarrierOp::Init { bar, arrivals } => (bar, Some(*arrivals)),
                    BarrierOp::Wait { bar, parity } => (bar, Some(*parity)),
                    BarrierOp::Inval { bar } | BarrierOp::Arrive { bar } => (bar, None),
                };
                let entry = prog.add(&f.scalars, bar.index)?;
                let arg = arg.map(|v| prog.add(&f.scalars, v)).transpose()?;
                CNode::Barrier(Box::new(CBarrier { op: op.clone(), prog, array: bar.array, entry, arg }))
            }
            Node::BulkLoad(b) => {
                let mut prog = Prog::default();
                let Some(Operand::Tensor(src)) = f.exprs[b.expr].inputs.first().copied() else {
                    bail_internal!("interpreter: bulk copy of a non-tensor operand");
                };
                let dst = prog.add(&f.scalars, b.dst)?;
                let from = prog.add(&f.scalars, b.src)?;
                let elems = prog.add(&f.scalars, b.elems)?;
                let guard = prog.add(&f.scalars, b.guard)?;
                let entry = prog.add(&f.scalars, b.bar.index)?;
                let reuse = match b.reuse {
                    Some((r, parity, when)) => Some((
                        r.array,
                        prog.add(&f.scalars, r.index)?,
                        prog.add(&f.scalars, parity)?,
                        prog.add(&f.scalars, when)?,
                    )),
                    None => None,
                };
                CNode::Bulk(Box::new(CBulk {
                    expr: b.expr,
                    src,
                    prog,
                    dst,
                    from,
                    elems,
                    guard,
                    array: b.bar.array,
                    entry,
                    reuse,
                }))
            }
            Node::Init { tv, value, index } => {
                let Some(ix) = index else {
                    bail_internal!("interpreter: init of {} is not indexed", f.tv_name(*tv));
                };
                let mut prog = Prog::default();
                let out = prog.add(&f.scalars, ix.out)?;
                let pred = prog.add(&f.scalars, ix.predicate)?;
                CNode::Access(Box::new(Access {
                    kind: AccessKind::Init { value: *value },
                    out_tv: *tv,
                    prog,
                    out,
                    inputs: Vec::new(),
                    pred,
                    wpred: pred,
                    gathers: Vec::new(),
                    reduced: Vec::new(),
                    element: None,
                }))
            }
            Node::Expr { expr, index } => {
                let Some(ix) = index else {
                    bail_internal!("interpreter: expression of {} is not indexed", f.tv_name(f.exprs[*expr].output));
                };
                CNode::Access(Box::new(compile_access(k, AccessKind::Expr { expr: *expr }, ix)?))
            }
            Node::Accumulate { acc, index } => CNode::Access(Box::new(compile_access(
                k,
                AccessKind::Accumulate { expr: acc.expr, acc: acc.id },
                index,
            )?)),
            Node::ReduceAccumulator { acc, index, complete, .. } => CNode::Access(Box::new(compile_access(
                k,
                AccessKind::ReduceAccumulator { expr: acc.expr, acc: acc.id, complete: *complete },
                index,
            )?)),
            Node::AccumulatorInit(a) => CNode::AccumulatorInit { acc: a.id, expr: a.expr },
            Node::If(i) => {
                let mut prog = Prog::default();
                let cond = prog.add(&f.scalars, i.cond)?;
                CNode::If { prog, cond, then: compile(k, &i.then, stack)?, otherwise: compile(k, &i.otherwise, stack)? }
            }
            Node::Vector(v) => {
                let mut prog = Prog::default();
                let out = prog.add(&f.scalars, v.out)?;
                let input = prog.add(&f.scalars, v.input)?;
                let first = prog.add(&f.scalars, v.first)?;
                let last = prog.add(&f.scalars, v.last)?;
                let gathers = compile_gathers(f, &mut prog, &v.gathers)?;
                let Some(Operand::Tensor(src)) = f.exprs[v.expr].inputs.first().copied() else {
                    bail_internal!("interpreter: vector copy of a non-tensor operand");
                };
                let fallback = compile(k, std::slice::from_ref(&Node::Loop(v.fallback.clone())), stack)?;
                CNode::Vector(Box::new(CVector {
                    expr: v.expr,
                    src,
                    width: v.width,
                    prog,
                    out,
                    input,
                    first,
                    last,
                    gathers,
                    access: v.access,
                    whole: v.whole,
                    fallback,
                }))
            }
        });
    }
    Ok(out)
}

/// A gathered index read: the index tensor at program value `at`, checked against the
/// table's `extent`; `element` is the row-major position errors report.
struct CGather {
    id: u32,
    index_tv: TvId,
    at: u32,
    table: TvId,
    extent: ValId,
    element: u32,
}

/// The gathers of an access, their positions compiled into `prog`.
fn compile_gathers(f: &Fusion, prog: &mut Prog, gathers: &[crate::kernel::Gather]) -> Result<Vec<CGather>> {
    gathers
        .iter()
        .map(|g| {
            Ok(CGather {
                id: g.id,
                index_tv: g.index_tv,
                at: prog.add(&f.scalars, g.at)?,
                table: g.table,
                extent: g.extent,
                element: prog.add(&f.scalars, g.element)?,
            })
        })
        .collect()
}

/// The compiled index program of an expression statement.
fn compile_access(k: &Kernel, kind: AccessKind, ix: &crate::kernel::AccessIndex) -> Result<Access> {
    let f = &k.fusion;
    let Some(expr) = kind.expr() else { bail_internal!("interpreter: an init is not an expression") };
    let e = &f.exprs[expr];
    let mut prog = Prog::default();
    let out = prog.add(&f.scalars, ix.out)?;
    let pred = prog.add(&f.scalars, ix.predicate)?;
    let wpred = prog.add(&f.scalars, ix.write_predicate)?;
    let gathers = compile_gathers(f, &mut prog, &ix.gathers)?;
    let mut inputs = Vec::new();
    for v in &ix.inputs {
        inputs.push(match v {
            Some(v) => Some(prog.add(&f.scalars, *v)?),
            None => None,
        });
    }
    if inputs.len() != e.inputs.len() {
        bail_internal!(
            "interpreter: {} operands but {} offsets for {}",
            e.inputs.len(),
            inputs.len(),
            f.tv_name(e.output)
        );
    }
    // The dims codegen reduces over (a shared loop may be promoted to another tensor's
    // iteration id, so they come from the output's own axes).
    let reduced = crate::analysis::parallel::reduced_dims(f, &k.loops, e.output);
    let element = match ix.element {
        Some(v) => Some(prog.add(&f.scalars, v)?),
        None => None,
    };
    Ok(Access { kind, out_tv: e.output, prog, out, inputs, pred, wpred, gathers, reduced, element })
}

/// Where a tensor's memory lives.
#[derive(Clone, Copy, Debug)]
enum Loc {
    Caller(usize),
    Own(usize),
}

/// Lanes of a value computed from an unwritten Local element, and the first such read.
#[derive(Clone, Debug)]
struct Poison {
    lanes: Vec<bool>,
    what: String,
}

impl Poison {
    /// Lanes poisoned in either (same lanes, same order).
    fn join(a: Option<Poison>, b: Option<Poison>) -> Option<Poison> {
        match (a, b) {
            (None, x) | (x, None) => x,
            (Some(mut a), Some(b)) => {
                for (x, y) in a.lanes.iter_mut().zip(&b.lanes) {
                    *x |= *y;
                }
                Some(a)
            }
        }
    }
}

/// A tensor's memory as accesses see it.
#[derive(Clone, Debug)]
struct Slot {
    loc: Loc,
    memory: MemoryType,
    /// Elements per instance (per thread for Local, per block for Shared).
    size: usize,
    name: String,
    /// Circular-buffer stages the instance holds (1 otherwise), for messages.
    stages: usize,
}

/// Accesses to one Shared element since the last barrier.
#[derive(Clone, Copy)]
struct RaceCell {
    /// Thread (in block) that wrote, -1 if none.
    writer: i32,
    /// Thread that read, -1 if none, -2 if several.
    reader: i32,
    /// Step of the latest read (0: none since the last barrier): a bulk copy may overwrite
    /// the element only after its issuer waited for arrivals that came after it.
    read_step: u64,
}

const CLEAN: RaceCell = RaceCell { writer: -1, reader: -1, read_step: 0 };

/// The bulk copy that last wrote a Shared element: its barrier (array, entry) and the
/// phase that reports its bytes.
type AsyncMark = Option<(u32, i64, u32)>;

/// The asynchronous copy that last wrote a Shared element: its thread (lane) and group.
type CpMark = Option<(u32, u32)>;

/// ` (stage k)` for an element of a circular-buffered tensor at physical index `p`.
fn slot_stage(slot: &Slot, p: usize) -> String {
    if slot.stages <= 1 || slot.size == 0 {
        return String::new();
    }
    format!(" (stage {})", (p % slot.size) / (slot.size / slot.stages).max(1))
}

/// Immutable context of a run: sizes, loop indices, launch.
struct Ctx<'k> {
    f: &'k Fusion,
    b: &'k Bindings,
    loops: Vec<Option<i64>>,
    grid: [i64; 3],
    block: [i64; 3],
    nt: usize,
    all: Vec<u32>,
    /// The lanes running the current statement: every lane, except inside the arms of an
    /// `If` (and a vector copy's fallback), which run only the lanes taking them.
    active: Vec<u32>,
    coords: [Vec<u32>; 6],
}

impl Ctx<'_> {
    fn uniform(&self, s: Symbol) -> Option<i64> {
        match s {
            Symbol::LoopIndex(n) => self.loops.get(n as usize).copied().flatten(),
            Symbol::ParallelDim(pt) => Some(match pt {
                ParallelType::BIDx => self.grid[0],
                ParallelType::BIDy => self.grid[1],
                ParallelType::BIDz => self.grid[2],
                ParallelType::TIDx => self.block[0],
                ParallelType::TIDy => self.block[1],
                ParallelType::TIDz => self.block[2],
                _ => 1,
            }),
            Symbol::ParallelIndex(_) | Symbol::Gathered(_) | Symbol::GridDone(_) => None,
            other => self.b.symbol(other),
        }
    }

    fn eval_uniform(&self, v: ValId) -> Result<i64> {
        self.f.scalars.eval(v, &|s| self.uniform(s))
    }

    fn value(&self, v: ValId) -> Result<ScalarValue> {
        Ok(match self.f.scalars.get(v) {
            Val::Int(i) => ScalarValue::Int(i),
            Val::Float(bits) => ScalarValue::Float(f64::from_bits(bits)),
            Val::Bool(b) => ScalarValue::Bool(b),
            Val::Symbol(Symbol::ScalarInput(n)) => match self.b.scalars.get(n as usize) {
                Some(&s) => s,
                None => return Err(KilnError::value(format!("interpreter: scalar input s{n} was not given"))),
            },
            _ => ScalarValue::Int(self.eval_uniform(v)?),
        })
    }

    fn scalar_dtype(&self, v: ValId) -> DataType {
        self.f.scalars.dtype(v, &self.f.scalar_input_dtypes)
    }

    fn thread(&self, lane: u32) -> String {
        let c: Vec<i64> = PARALLEL_DIMS.iter().map(|&p| coord(lane, p, self.block, self.grid)).collect();
        format!("thread ({}, {}, {}) of block ({}, {}, {})", c[3], c[4], c[5], c[0], c[1], c[2])
    }

    fn thread_xyz(&self, t_in_block: usize) -> String {
        let t = t_in_block as i64;
        let (x, y) = (self.block[0], self.block[1]);
        format!("({}, {}, {})", t % x, (t / x) % y, t / (x * y))
    }
}

/// Mutable memories of a run.
struct Mem<'b> {
    caller: &'b mut [Buffer],
    own: Vec<Buffer>,
    races: Vec<Option<Vec<RaceCell>>>,
    /// Per own Shared buffer: the bulk copy behind each element.
    asyncs: Vec<Option<Vec<AsyncMark>>>,
    /// mbarrier states and what each thread observed of them.
    bars: Barriers,
    /// Tensors written by asynchronous copies (`cp.async`), the copy (lane, group) behind
    /// each element of their own Shared buffers, and per lane its committed groups and the
    /// barrier epoch at which each completed group was waited for.
    async_tvs: Vec<TvId>,
    cp_marks: Vec<Option<Vec<CpMark>>>,
    cp_groups: FxHashMap<u32, (u32, Vec<u32>)>,
    slots: FxHashMap<TvId, Slot>,
    /// Names and locations of the summary's buffers.
    buffers: Vec<(String, usize)>,
    /// Caller buffers below this index (the fusion's inputs and outputs) are checked for
    /// reads of elements another thread wrote in this kernel; the summary's own buffers
    /// (grid-reduction work and semaphores) are ordered by their protocols instead.
    checked_globals: usize,
    /// Per checked caller buffer: the lane that last wrote each element and the barrier
    /// epoch it wrote in (lane -1: not written by this kernel).
    global_writers: FxHashMap<usize, Vec<(i64, u32)>>,
    /// Barriers passed so far.
    epoch: u32,
    /// Per grid-reduction output, which threads hold its finished result (as
    /// `Symbol::GridDone` reads it): index 0 of every reduced dimension. Which block
    /// finishes a grid reduction is up to the GPU; the result is the same.
    done: FxHashMap<TvId, Vec<bool>>,
    /// The Tensor-memory region: not allocated yet, allocated, or deallocated.
    tmem: TmemState,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TmemState {
    Unallocated,
    Allocated,
    Deallocated,
}

impl Mem<'_> {
    fn slot(&self, f: &Fusion, tv: TvId) -> Result<&Slot> {
        if f.tvs[tv].tensor_memory && self.tmem == TmemState::Deallocated {
            return Err(KilnError::value(format!(
                "{} is in Tensor memory and is read or written after its region was deallocated (tcgen05.dealloc)",
                f.tv_name(tv)
            )));
        }
        self.slots.get(&tv).ok_or_else(|| {
            KilnError::internal(format!("interpreter: {} is accessed before its Allocate", f.tv_name(tv)))
        })
    }

    fn buf(&mut self, loc: Loc) -> &mut Buffer {
        match loc {
            Loc::Caller(i) => &mut self.caller[i],
            Loc::Own(i) => &mut self.own[i],
        }
    }

    /// Physical indices of an access, bounds-checked.
    fn phys(&self, ctx: &Ctx, kname: &str, slot: &Slot, lanes: &[u32], offs: &Reg, what: &str) -> Result<Vec<usize>> {
        let size = slot.size;
        let mut out = Vec::with_capacity(lanes.len());
        for (i, &l) in lanes.iter().enumerate() {
            let o = offs.at(i);
            if o < 0 || o as usize >= size {
                return Err(KilnError::value(format!(
                    "kernel {kname}: out-of-bounds {what} of {} ({} memory) at index {o}; the allocation has {size} elements; by {}",
                    slot.name,
                    slot.memory.enum_name(),
                    ctx.thread(l)
                )));
            }
            let inst = match slot.memory {
                MemoryType::Local => l as usize,
                MemoryType::Shared => l as usize / ctx.nt,
                MemoryType::Global => 0,
            };
            out.push(inst * size + o as usize);
        }
        Ok(out)
    }

    fn race_check(
        &mut self,
        ctx: &Ctx,
        kname: &str,
        slot: &Slot,
        lanes: &[u32],
        phys: &[usize],
        write: bool,
    ) -> Result<()> {
        let Loc::Own(i) = slot.loc else {
            return Ok(());
        };
        let Some(Some(cells)) = self.races.get_mut(i) else {
            return Ok(());
        };
        if let Some(Some(cp)) = self.cp_marks.get_mut(i) {
            for (&l, &p) in lanes.iter().zip(phys) {
                if write {
                    // An asynchronous copy marks its elements after this check.
                    cp[p] = None;
                    continue;
                }
                let Some((w, g)) = cp[p] else { continue };
                let done = self.cp_groups.get(&w).and_then(|(_, e)| e.get(g as usize).copied());
                let why = match done {
                    None => Some(format!(
                        "thread {} has not waited for that copy's group (cp.async.wait_group)",
                        ctx.thread_xyz(w as usize % ctx.nt)
                    )),
                    Some(ep) if w != l && ep == self.epoch => {
                        Some(format!("no barrier since thread {} waited for it", ctx.thread_xyz(w as usize % ctx.nt)))
                    }
                    Some(_) => None,
                };
                if let Some(why) = why {
                    return Err(KilnError::value(format!(
                        "kernel {kname}: read of {}{} at index {} before the asynchronous copy that wrote it completed for the reader: {why}; by {}",
                        slot.name,
                        slot_stage(slot, p),
                        p % slot.size.max(1),
                        ctx.thread(l)
                    )));
                }
            }
        }
        let step = self.bars.step;
        let marks = self.asyncs.get_mut(i).and_then(|m| m.as_mut());
        if let Some(marks) = marks {
            for (&l, &p) in lanes.iter().zip(phys) {
                if write {
                    // A thread's own store replaces what a bulk copy brought.
                    marks[p] = None;
                    continue;
                }
                let Some((array, entry, phase)) = marks[p] else { continue };
                let key: BarKey = (array, l as usize / ctx.nt, entry);
                if self.bars.seen(key, l) <= phase {
                    let stage = slot_stage(slot, p);
                    return Err(KilnError::value(format!(
                        "kernel {kname}: read of {}{stage} at index {} before the bulk copy that wrote it completed: no wait on mbarrier mbar{array}[{entry}] saw its phase {phase} complete; by {}",
                        slot.name,
                        p % slot.size.max(1),
                        ctx.thread(l)
                    )));
                }
            }
        }
        for (&l, &p) in lanes.iter().zip(phys) {
            let t = (l as usize % ctx.nt) as i32;
            let c = &mut cells[p];
            if !write {
                c.read_step = step;
            }
            let other = if write {
                if c.writer >= 0 && c.writer != t {
                    Some((c.writer, "writes"))
                } else if c.reader == -2 || (c.reader >= 0 && c.reader != t) {
                    Some((c.reader, "reads"))
                } else {
                    None
                }
            } else if c.writer >= 0 && c.writer != t {
                Some((c.writer, "writes"))
            } else {
                None
            };
            if let Some((o, did)) = other {
                let o_txt = if o == -2 {
                    "several other threads".to_string()
                } else {
                    format!("thread {}", ctx.thread_xyz(o as usize))
                };
                let block = ctx.thread(l);
                let block = block.split(" of ").nth(1).unwrap_or("block").to_string();
                return Err(KilnError::value(format!(
                    "kernel {kname}: Shared memory race on {} at index {}: thread {} {} it after {o_txt} {did} it, with no barrier between (in {block})",
                    slot.name,
                    p % slot.size.max(1),
                    ctx.thread_xyz(t as usize),
                    if write { "writes" } else { "reads" },
                )));
            }
            if write {
                c.writer = t;
            } else if c.reader == -1 {
                c.reader = t;
            } else if c.reader != t {
                c.reader = -2;
            }
        }
        Ok(())
    }

    fn read(&mut self, ctx: &Ctx, kname: &str, tv: TvId, lanes: &[u32], offs: &Reg) -> Result<Col> {
        let (col, poison) = self.read_lenient(ctx, kname, tv, lanes, offs, false)?;
        debug_assert!(poison.is_none());
        Ok(col)
    }

    /// Read `tv` at `offs`. An unwritten element is an error, except in Local memory when
    /// `lenient`: a register read before it is written is harmless on the GPU unless the
    /// value reaches memory, so those lanes come back poisoned (see [`Poison`]).
    fn read_lenient(
        &mut self,
        ctx: &Ctx,
        kname: &str,
        tv: TvId,
        lanes: &[u32],
        offs: &Reg,
        lenient: bool,
    ) -> Result<(Col, Option<Poison>)> {
        let slot = self.slot(ctx.f, tv)?.clone();
        let phys = self.phys(ctx, kname, &slot, lanes, offs, "read")?;
        let mut poison: Option<Poison> = None;
        {
            let buf = self.buf(slot.loc);
            if let Some(w) = &buf.written {
                for (i, &p) in phys.iter().enumerate() {
                    if !w[p] {
                        let what = format!(
                            "read of uninitialized memory: {} ({} memory) at index {} was never written; by {}",
                            slot.name,
                            slot.memory.enum_name(),
                            offs.at(i),
                            ctx.thread(lanes[i])
                        );
                        if !(lenient && slot.memory == MemoryType::Local) {
                            return Err(KilnError::value(format!("kernel {kname}: {what}")));
                        }
                        let pz = poison.get_or_insert_with(|| Poison { lanes: vec![false; phys.len()], what });
                        pz.lanes[i] = true;
                    }
                }
            }
        }
        self.race_check(ctx, kname, &slot, lanes, &phys, false)?;
        // A racy Global read by a lane whose value is never used (a one-value register
        // computed on every thread, read back by thread 0 alone) is harmless on the GPU, like
        // an uninitialized register: where `lenient`, the lane is poisoned with the race.
        for (i, what) in self.global_check(ctx, kname, &slot, lanes, &phys, false, lenient)? {
            let pz = poison.get_or_insert_with(|| Poison { lanes: vec![false; phys.len()], what });
            pz.lanes[i] = true;
        }
        Ok((self.buf(slot.loc).data.gather(&phys), poison))
    }

    /// A bulk copy by `lane` of `col` to `tv` from element `dst`: each element must not
    /// have been read since its last barrier unless the issuer waited for a phase whose
    /// arrivals all came after that read (write-after-read); it lands marked with the
    /// phase `mark` of the barrier that reports it.
    #[allow(clippy::too_many_arguments)]
    fn bulk_write(
        &mut self,
        ctx: &Ctx,
        kname: &str,
        tv: TvId,
        lane: u32,
        dst: i64,
        col: &Col,
        mark: (u32, i64, u32),
    ) -> Result<()> {
        let slot = self.slot(ctx.f, tv)?.clone();
        let n = col.len();
        let offs = Reg::V((0..n as i64).map(|j| dst + j).collect());
        let lanes = vec![lane; n];
        let phys = self.phys(ctx, kname, &slot, &lanes, &offs, "bulk copy")?;
        let synced = self.bars.synced.get(&lane).copied().unwrap_or(0);
        let Loc::Own(i) = slot.loc else { bail_internal!("interpreter: a bulk copy into a Global tensor") };
        if let Some(Some(cells)) = self.races.get_mut(i) {
            for &p in &phys {
                let c = &mut cells[p];
                if c.read_step > 0 && synced <= c.read_step {
                    let reader = if c.reader == -2 {
                        "several threads".to_string()
                    } else {
                        format!("thread {}", ctx.thread_xyz(c.reader.max(0) as usize))
                    };
                    return Err(KilnError::value(format!(
                        "kernel {kname}: the bulk copy into {}{} overwrites index {} that {reader} read, before its issuer waited for the readers to finish (write-after-read: no completed wait on the stage's barrier since the read); by {}",
                        slot.name,
                        slot_stage(&slot, p),
                        p % slot.size.max(1),
                        ctx.thread(lane)
                    )));
                }
                *c = CLEAN;
            }
        }
        if let Some(Some(marks)) = self.asyncs.get_mut(i) {
            for &p in &phys {
                marks[p] = Some(mark);
            }
        }
        let buf = self.buf(slot.loc);
        buf.data.scatter(&phys, col)?;
        if let Some(w) = &mut buf.written {
            for &p in &phys {
                w[p] = true;
            }
        }
        Ok(())
    }

    fn write(&mut self, ctx: &Ctx, kname: &str, tv: TvId, lanes: &[u32], offs: &Reg, col: &Col) -> Result<()> {
        self.write_poisoned(ctx, kname, tv, lanes, offs, col, None)
    }

    /// Write `col`; poisoned lanes leave a Local element unwritten (still poison for the
    /// next reader) and are an error anywhere else: the uninitialized value reaches memory.
    #[allow(clippy::too_many_arguments)]
    fn write_poisoned(
        &mut self,
        ctx: &Ctx,
        kname: &str,
        tv: TvId,
        lanes: &[u32],
        offs: &Reg,
        col: &Col,
        poison: Option<&Poison>,
    ) -> Result<()> {
        let slot = self.slot(ctx.f, tv)?.clone();
        if let Some(pz) = poison {
            if slot.memory != MemoryType::Local && pz.lanes.iter().any(|&b| b) {
                return Err(KilnError::value(format!(
                    "kernel {kname}: {}, and the value computed from it is stored to {} ({} memory)",
                    pz.what,
                    slot.name,
                    slot.memory.enum_name()
                )));
            }
        }
        let phys = self.phys(ctx, kname, &slot, lanes, offs, "write")?;
        self.race_check(ctx, kname, &slot, lanes, &phys, true)?;
        self.global_check(ctx, kname, &slot, lanes, &phys, true, false)?;
        if let (Loc::Own(i), true) = (slot.loc, self.async_tvs.contains(&tv)) {
            if let Some(Some(cp)) = self.cp_marks.get_mut(i) {
                for (&l, &p) in lanes.iter().zip(&phys) {
                    let group = self.cp_groups.get(&l).map_or(0, |g| g.0);
                    cp[p] = Some((l, group));
                }
            }
        }
        let buf = self.buf(slot.loc);
        buf.data.scatter(&phys, col)?;
        if let Some(w) = &mut buf.written {
            for (i, &p) in phys.iter().enumerate() {
                w[p] = poison.is_none_or(|pz| !pz.lanes[i]);
            }
        }
        Ok(())
    }

    /// A Global element read by one thread after another thread wrote it in this kernel,
    /// from another block or without a barrier between, is a race on the GPU (the
    /// interpreter's statement-by-statement order would hide it).
    /// Where `lenient`, a racy read is returned (its lane and the race) instead of refused.
    #[allow(clippy::too_many_arguments)]
    fn global_check(
        &mut self,
        ctx: &Ctx,
        kname: &str,
        slot: &Slot,
        lanes: &[u32],
        phys: &[usize],
        write: bool,
        lenient: bool,
    ) -> Result<Vec<(usize, String)>> {
        let mut racy = Vec::new();
        let Loc::Caller(i) = slot.loc else { return Ok(racy) };
        if slot.memory != MemoryType::Global || i >= self.checked_globals {
            return Ok(racy);
        }
        let len = self.caller[i].data.len();
        let epoch = self.epoch;
        let cells = match self.global_writers.entry(i) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                // The race table is 16 bytes per element: allocated fallibly, as a failed
                // allocation would abort the process.
                let mut table = Vec::new();
                table.try_reserve_exact(len).map_err(|_| {
                    KilnError::value(format!(
                        "kernel {kname}: the CPU interpreter cannot allocate the race table of {} ({len} elements; out of memory, run it on a GPU)",
                        slot.name
                    ))
                })?;
                table.resize(len, (-1, 0));
                v.insert(table)
            }
        };
        for (k, (&l, &p)) in lanes.iter().zip(phys).enumerate() {
            let Some(c) = cells.get_mut(p) else { continue };
            if write {
                *c = (l as i64, epoch);
                continue;
            }
            let (w, ep) = *c;
            if w < 0 || w == l as i64 {
                continue;
            }
            let other_block = w as usize / ctx.nt != l as usize / ctx.nt;
            if other_block || ep == epoch {
                let why = if other_block {
                    "from another block (blocks do not synchronize)"
                } else {
                    "with no barrier between"
                };
                let what = format!(
                    "Global memory race on {} at index {p}: {} reads it after {} wrote it in this kernel, {why}",
                    slot.name,
                    ctx.thread(l),
                    ctx.thread(w as u32)
                );
                if !lenient {
                    return Err(KilnError::value(format!("kernel {kname}: {what}")));
                }
                racy.push((k, what));
            }
        }
        Ok(racy)
    }

    fn reset_races(&mut self) {
        self.epoch += 1;
        for c in self.races.iter_mut().flatten() {
            c.fill(CLEAN);
        }
    }
}

/// Run `kernel` over `buffers` (inputs, outputs, then the summary's global buffers).
pub fn run(kernel: &Kernel, bindings: &Bindings, buffers: &mut [Buffer]) -> Result<Stats> {
    let f = &kernel.fusion;
    let kname = bindings.kernel_name.as_str();
    let n_in = f.inputs.iter().filter(|o| o.tensor().is_some()).count();
    let n_out = f.outputs.len();
    let n_glob = kernel.summary.global_allocations.len();
    if buffers.len() != n_in + n_out + n_glob {
        return Err(KilnError::value(format!(
            "kernel {kname}: expected {} buffers ({n_in} inputs, {n_out} outputs, {n_glob} global buffers), got {}",
            n_in + n_out + n_glob,
            buffers.len()
        )));
    }
    let mut ctx = Ctx {
        f,
        b: bindings,
        loops: Vec::new(),
        grid: [1; 3],
        block: [1; 3],
        nt: 1,
        all: Vec::new(),
        active: Vec::new(),
        coords: Default::default(),
    };
    for i in 0..3 {
        ctx.grid[i] = ctx.eval_uniform(kernel.launch.grid[i])?;
        ctx.block[i] = ctx.eval_uniform(kernel.launch.block[i])?;
    }
    kernel.check_launch(|v| ctx.eval_uniform(v).ok())?;
    let dims: Vec<i64> = ctx.grid.iter().chain(ctx.block.iter()).copied().collect();
    if dims.iter().any(|&d| d < 1) {
        return Err(KilnError::value(format!(
            "kernel {kname}: launch grid {:?} block {:?} has an empty dimension",
            ctx.grid, ctx.block
        )));
    }
    let total = dims
        .iter()
        .try_fold(1i64, |a, &d| a.checked_mul(d))
        .filter(|&t| t <= MAX_THREADS)
        .ok_or_else(|| {
            KilnError::value(format!(
                "kernel {kname}: launch grid {:?} block {:?} is too large for the interpreter (at most {MAX_THREADS} threads)",
                ctx.grid, ctx.block
            ))
        })?;
    ctx.nt = (ctx.block[0] * ctx.block[1] * ctx.block[2]) as usize;
    ctx.all = (0..total as u32).collect();
    ctx.active = ctx.all.clone();
    for (k, &p) in PARALLEL_DIMS.iter().enumerate() {
        ctx.coords[k] = ctx.all.iter().map(|&l| coord(l, p, ctx.block, ctx.grid) as u32).collect();
    }

    let mut slots = FxHashMap::default();
    let mut k = 0;
    for op in &f.inputs {
        if let Operand::Tensor(tv) = op {
            slots.insert(*tv, global_slot(f, *tv, Loc::Caller(k), &buffers[k], None));
            k += 1;
        }
    }
    for &tv in &f.outputs {
        slots.insert(tv, global_slot(f, tv, Loc::Caller(k), &buffers[k], None));
        k += 1;
    }
    let mut named = Vec::new();
    for (i, g) in kernel.summary.global_allocations.iter().enumerate() {
        let at = n_in + n_out + i;
        if let Some(tv) = g.tv {
            slots.insert(tv, global_slot(f, tv, Loc::Caller(at), &buffers[at], Some(&g.name)));
        }
        named.push((g.name.clone(), at));
    }
    let mut mem = Mem {
        caller: buffers,
        own: Vec::new(),
        races: Vec::new(),
        asyncs: Vec::new(),
        bars: Barriers::default(),
        async_tvs: kernel.summary.async_copies.clone(),
        cp_marks: Vec::new(),
        cp_groups: FxHashMap::default(),
        slots,
        buffers: named,
        checked_globals: n_in + n_out,
        global_writers: FxHashMap::default(),
        epoch: 0,
        done: FxHashMap::default(),
        tmem: TmemState::Unallocated,
    };
    let body = compile(kernel, &kernel.body, &mut Vec::new())?;
    let mut ex = Exec {
        k: kernel,
        kname,
        ctx,
        mem,
        par: Vec::new(),
        accs: FxHashMap::default(),
        stats: Stats { threads: total as u64, ..Stats::default() },
    };
    ex.nodes(&body)?;
    if ex.mem.tmem == TmemState::Allocated {
        return Err(KilnError::value(format!(
            "kernel {}: its Tensor-memory region is never deallocated (a block must tcgen05.dealloc before it exits)",
            ex.kname
        )));
    }
    mem = ex.mem;
    drop(mem);
    Ok(ex.stats)
}

fn global_slot(f: &Fusion, tv: TvId, loc: Loc, buf: &Buffer, name: Option<&str>) -> Slot {
    Slot {
        loc,
        memory: MemoryType::Global,
        size: buf.data.len(),
        name: name.map(str::to_string).unwrap_or_else(|| f.tv_name(tv)),
        stages: 1,
    }
}

struct Exec<'k, 'b> {
    k: &'k Kernel,
    kname: &'k str,
    ctx: Ctx<'k>,
    mem: Mem<'b>,
    /// Enclosing thread/block loops and their extents (for divergent barriers).
    par: Vec<(ParallelType, i64)>,
    /// Register accumulators of hoisted reductions: one value per lane.
    accs: FxHashMap<u32, Col>,
    stats: Stats,
}

impl Exec<'_, '_> {
    fn nodes(&mut self, body: &[CNode]) -> Result<()> {
        for n in body {
            self.mem.bars.step += 1;
            match n {
                CNode::TensorMemory(op) => {
                    use crate::kernel::TmemOp;
                    let (want, next) = match op {
                        TmemOp::Alloc => (TmemState::Unallocated, TmemState::Allocated),
                        TmemOp::Relinquish | TmemOp::Dealloc => (
                            TmemState::Allocated,
                            if *op == TmemOp::Dealloc { TmemState::Deallocated } else { TmemState::Allocated },
                        ),
                    };
                    if self.mem.tmem != want {
                        return Err(KilnError::value(format!(
                            "kernel {}: {op:?} of the Tensor-memory region when it is {:?}",
                            self.kname, self.mem.tmem
                        )));
                    }
                    self.mem.tmem = next;
                }
                CNode::CpAsync(op) => {
                    let epoch = self.mem.epoch;
                    for &l in &self.ctx.active {
                        let g = self.mem.cp_groups.entry(l).or_default();
                        match op {
                            CpAsyncOp::Commit => g.0 += 1,
                            CpAsyncOp::Wait(n) => {
                                let target = g.0.saturating_sub(*n) as usize;
                                while g.1.len() < target {
                                    g.1.push(epoch);
                                }
                            }
                        }
                    }
                }
                CNode::Barrier(b) => self.barrier(b)?,
                CNode::Bulk(b) => self.bulk(b)?,
                CNode::Loop { var, extent, parallel, body } => {
                    let e = self.ctx.eval_uniform(*extent)?;
                    match var {
                        None => {
                            self.par.push((*parallel, e));
                            self.nodes(body)?;
                            self.par.pop();
                        }
                        Some(v) => {
                            let v = *v as usize;
                            if self.ctx.loops.len() <= v {
                                self.ctx.loops.resize(v + 1, None);
                            }
                            for i in 0..e {
                                self.ctx.loops[v] = Some(i);
                                self.nodes(body)?;
                            }
                            self.ctx.loops[v] = None;
                        }
                    }
                }
                CNode::Alloc(a) => self.alloc(a)?,
                CNode::Sync => {
                    for &(p, e) in &self.par {
                        let dim = match p {
                            ParallelType::TIDx => self.ctx.block[0],
                            ParallelType::TIDy => self.ctx.block[1],
                            ParallelType::TIDz => self.ctx.block[2],
                            _ => continue,
                        };
                        if e < dim {
                            return Err(KilnError::value(format!(
                                "kernel {}: divergent barrier: __syncthreads() inside a {} loop of extent {e} is reached by only {e} of {dim} threads",
                                self.kname,
                                p.enum_name()
                            )));
                        }
                    }
                    self.converged("__syncthreads()")?;
                    self.mem.reset_races();
                }
                CNode::Access(a) => self.access(a)?,
                CNode::If { prog, cond, then, otherwise } => {
                    let (yes, no) = self.split(prog, *cond)?;
                    self.on_lanes(yes, then)?;
                    self.on_lanes(no, otherwise)?;
                }
                CNode::Vector(v) => self.vector(v)?,
                CNode::AccumulatorInit { acc, expr } => {
                    let f = &self.k.fusion;
                    let Op::Reduction { init, .. } = f.exprs[*expr].op else {
                        bail_internal!("interpreter: accumulator of a non-reduction")
                    };
                    let dt = f.tvs[f.exprs[*expr].output].dtype;
                    let v =
                        Col::splat(self.ctx.value(init)?, self.ctx.scalar_dtype(init), self.ctx.all.len()).convert(dt);
                    self.accs.insert(*acc, v);
                }
            }
        }
        Ok(())
    }

    /// The active lanes where `cond` holds, and those where it does not.
    fn split(&self, prog: &Prog, cond: u32) -> Result<(Vec<u32>, Vec<u32>)> {
        let ctx = &self.ctx;
        let uniform = |s: Symbol| ctx.uniform(s);
        let gathered = FxHashMap::default();
        let mut ev = Evaluator::new(prog);
        let c = ev.eval(cond, &mk_env(&uniform, ctx, &ctx.active, &gathered, &self.mem.done))?;
        let (mut yes, mut no) = (Vec::new(), Vec::new());
        for (i, &l) in ctx.active.iter().enumerate() {
            if c.at(i) != 0 {
                yes.push(l);
            } else {
                no.push(l);
            }
        }
        Ok((yes, no))
    }

    /// Run `body` on `lanes` only (none: skipped).
    fn on_lanes(&mut self, lanes: Vec<u32>, body: &[CNode]) -> Result<()> {
        if lanes.is_empty() {
            return Ok(());
        }
        let outer = std::mem::replace(&mut self.ctx.active, lanes);
        let r = self.nodes(body);
        self.ctx.active = outer;
        r
    }

    /// A barrier or block reduction must be reached by every thread of a block or by none
    /// (a branch some threads of a block skip would deadlock or misreduce on the GPU).
    fn converged(&self, what: &str) -> Result<()> {
        let ctx = &self.ctx;
        if ctx.active.len() == ctx.all.len() {
            return Ok(());
        }
        let mut count: FxHashMap<usize, usize> = FxHashMap::default();
        for &l in &ctx.active {
            *count.entry(l as usize / ctx.nt).or_default() += 1;
        }
        if let Some((&b, &n)) = count.iter().find(|(_, &n)| n != ctx.nt) {
            let lane = (b * ctx.nt) as u32;
            let block = ctx.thread(lane);
            let block = block.split(" of ").nth(1).unwrap_or("a block").to_string();
            return Err(KilnError::value(format!(
                "kernel {}: divergent {what}: inside a branch taken by only {n} of the {} threads of {block}",
                self.kname, ctx.nt
            )));
        }
        Ok(())
    }

    /// What barrier entry `entry` of `array` orders, for messages.
    fn barrier_name(&self, array: u32, entry: i64) -> String {
        let f = &self.k.fusion;
        let Some(b) = self.k.summary.barriers.get(array as usize) else {
            return format!("mbar{array}[{entry}]");
        };
        let tvs: Vec<String> = b.tvs.iter().map(|&t| f.tv_name(t)).collect();
        let tvs = tvs.join(", ");
        if b.size == 1 {
            return format!("mbar{array}[{entry}] (the bulk copy of {tvs})");
        }
        let stages = b.size / 2;
        if entry < stages {
            format!("mbar{array}[{entry}] (read-after-write of {tvs} stage {entry})")
        } else {
            format!("mbar{array}[{entry}] (write-after-read of {tvs} stage {})", entry - stages)
        }
    }

    /// The active lanes that are their block's first thread.
    fn first_threads(&self) -> Vec<(usize, u32)> {
        let nt = self.ctx.nt;
        self.ctx
            .active
            .iter()
            .enumerate()
            .filter(|(_, &l)| (l as usize).is_multiple_of(nt))
            .map(|(i, &l)| (i, l))
            .collect()
    }

    fn barrier(&mut self, b: &CBarrier) -> Result<()> {
        let ctx = &self.ctx;
        let uniform = |s: Symbol| ctx.uniform(s);
        let gathered = FxHashMap::default();
        let mut ev = Evaluator::new(&b.prog);
        let env = mk_env(&uniform, ctx, &ctx.active, &gathered, &self.mem.done);
        let entry = ev.eval(b.entry, &env)?.clone();
        let arg = match b.arg {
            Some(a) => Some(ev.eval(a, &env)?.clone()),
            None => None,
        };
        let nt = ctx.nt;
        let kname = self.kname;
        match &b.op {
            BarrierOp::Init { .. } | BarrierOp::Inval { .. } => {
                for (i, l) in self.first_threads() {
                    let e = entry.at(i);
                    let key: BarKey = (b.array, l as usize / nt, e);
                    let ok = match (&b.op, &arg) {
                        (BarrierOp::Init { .. }, Some(a)) => self.mem.bars.init(key, a.at(i)),
                        _ => self.mem.bars.inval(key),
                    };
                    if !ok {
                        let what = if matches!(b.op, BarrierOp::Init { .. }) {
                            "is initialised again before it was invalidated"
                        } else {
                            "is invalidated but is not initialised"
                        };
                        return Err(KilnError::value(format!(
                            "kernel {kname}: mbarrier {} {what}; by {}",
                            self.barrier_name(b.array, e),
                            self.ctx.thread(l)
                        )));
                    }
                }
            }
            BarrierOp::Arrive { .. } => {
                for (i, &l) in self.ctx.active.clone().iter().enumerate() {
                    let e = entry.at(i);
                    self.arrive((b.array, l as usize / nt, e), l, 0, 0)?;
                }
            }
            BarrierOp::Wait { .. } => {
                let Some(parity) = arg else { bail_internal!("interpreter: a wait without a parity") };
                for (i, &l) in self.ctx.active.clone().iter().enumerate() {
                    self.wait((b.array, l as usize / nt, entry.at(i)), l, parity.at(i))?;
                }
            }
        }
        Ok(())
    }

    fn arrive(&mut self, key: BarKey, lane: u32, bytes: i64, landed: i64) -> Result<()> {
        let what = match self.mem.bars.arrive(key, bytes, landed) {
            Arrival::Ok => return Ok(()),
            Arrival::TooMany => "receives more arrivals than its phase expects",
            Arrival::Uninitialized => "receives an arrival but is not initialised",
        };
        Err(KilnError::value(format!(
            "kernel {}: mbarrier {} {what}; by {}",
            self.kname,
            self.barrier_name(key.0, key.2),
            self.ctx.thread(lane)
        )))
    }

    fn wait(&mut self, key: BarKey, lane: u32, parity: i64) -> Result<()> {
        match self.mem.bars.wait(key, lane, parity) {
            Ok(()) => Ok(()),
            Err(state) => {
                let why = match state {
                    None => "it is not initialised".to_string(),
                    Some(b) => format!(
                        "its phase {} still expects {} arrival(s) and {} byte(s), and nothing before the wait provides them",
                        b.completed, b.pending, b.tx
                    ),
                };
                Err(KilnError::value(format!(
                    "kernel {}: a wait on mbarrier {} for parity {} can never complete: {why}; by {}",
                    self.kname,
                    self.barrier_name(key.0, key.2),
                    parity.rem_euclid(2),
                    self.ctx.thread(lane)
                )))
            }
        }
    }

    /// A bulk copy: each block's first thread (when active) waits for the stage's readers
    /// where `reuse` says so, copies the run (none where the guard fails) and arrives.
    fn bulk(&mut self, b: &CBulk) -> Result<()> {
        let firsts = self.first_threads();
        if firsts.is_empty() {
            return Ok(());
        }
        let lanes: Vec<u32> = firsts.iter().map(|&(_, l)| l).collect();
        let vals = {
            let ctx = &self.ctx;
            let uniform = |s: Symbol| ctx.uniform(s);
            let gathered = FxHashMap::default();
            let mut ev = Evaluator::new(&b.prog);
            let env = mk_env(&uniform, ctx, &lanes, &gathered, &self.mem.done);
            let mut regs = Vec::new();
            for v in [b.dst, b.from, b.elems, b.guard, b.entry] {
                regs.push(ev.eval(v, &env)?.clone());
            }
            if let Some((_, entry, parity, when)) = b.reuse {
                for v in [entry, parity, when] {
                    regs.push(ev.eval(v, &env)?.clone());
                }
            }
            regs
        };
        let f = &self.k.fusion;
        let out_tv = f.exprs[b.expr].output;
        let dt = f.tvs[out_tv].dtype;
        let nt = self.ctx.nt;
        for (i, &l) in lanes.iter().enumerate() {
            let block = l as usize / nt;
            if let Some((array, ..)) = b.reuse {
                if vals[7].at(i) != 0 {
                    self.wait((array, block, vals[5].at(i)), l, vals[6].at(i))?;
                }
            }
            let elems = if vals[3].at(i) != 0 { vals[2].at(i).max(0) } else { 0 };
            let key: BarKey = (b.array, block, vals[4].at(i));
            let phase = self.mem.bars.current_phase(key);
            if elems > 0 {
                let src: Vec<i64> = (0..elems).map(|j| vals[1].at(i) + j).collect();
                let col = self.mem.read(&self.ctx, self.kname, b.src, &vec![l; elems as usize], &Reg::V(src))?;
                self.stats.thread_instructions += elems as u64;
                self.mem.bulk_write(
                    &self.ctx,
                    self.kname,
                    out_tv,
                    l,
                    vals[0].at(i),
                    &col.convert(dt),
                    (b.array, key.2, phase),
                )?;
            }
            // arrive.expect_tx with the copy's bytes; the copy engine counts them off.
            let bytes = elems * dt.size_bytes() as i64;
            self.arrive(key, l, bytes, bytes)?;
        }
        Ok(())
    }

    /// A vector copy: lanes whose vector is in range and aligned copy it element by element
    /// (checking the alignment codegen relies on without a test); the rest run the
    /// fallback loop.
    fn vector(&mut self, v: &CVector) -> Result<()> {
        let f = &self.k.fusion;
        let kname = self.kname;
        let ctx = &self.ctx;
        let mem = &mut self.mem;
        let uniform = |s: Symbol| ctx.uniform(s);
        let mut gathered: FxHashMap<u32, Vec<i64>> = FxHashMap::default();
        let mut ev = Evaluator::new(&v.prog);
        let lanes = &ctx.active;
        let first = ev.eval(v.first, &mk_env(&uniform, ctx, lanes, &gathered, &mem.done))?.clone();
        // Index reads where the first element is in range (elsewhere the GPU reads index 0).
        let reading: Vec<u32> = lanes.iter().enumerate().filter(|(i, _)| first.at(*i) != 0).map(|(_, &l)| l).collect();
        for &CGather { id, index_tv: tv, at, table, extent, element } in &v.gathers {
            ev.reset_varying();
            let offs = ev.eval(at, &mk_env(&uniform, ctx, &reading, &gathered, &mem.done))?.clone();
            let got = mem.read(ctx, kname, tv, &reading, &offs)?.to_i64();
            if let Some(j) = bad_index(ctx, extent, &got)? {
                let at = ev.eval(element, &mk_env(&uniform, ctx, &reading, &gathered, &mem.done))?.at(j);
                return Err(index_error(f, ctx, tv, table, extent, got[j], at));
            }
            // Lanes that read nothing hold index 0, as on the GPU.
            let mut all = vec![0i64; lanes.len()];
            let mut k = 0;
            for (i, slot) in all.iter_mut().enumerate() {
                if first.at(i) != 0 {
                    *slot = got[k];
                    k += 1;
                }
            }
            gathered.insert(id, all);
        }
        ev.reset_varying();
        let env = mk_env(&uniform, ctx, lanes, &gathered, &mem.done);
        let first = ev.eval(v.first, &env)?.clone();
        let last = ev.eval(v.last, &env)?.clone();
        let out = ev.eval(v.out, &env)?.clone();
        let input = ev.eval(v.input, &env)?.clone();
        let (mut wide, mut rest) = (Vec::new(), Vec::new());
        let mut wide_at: Vec<(i64, i64)> = Vec::new();
        for (i, &l) in lanes.iter().enumerate() {
            let offs = [out.at(i), input.at(i)];
            let mut ok = first.at(i) != 0 && last.at(i) != 0;
            for (side, acc) in v.access.iter().enumerate() {
                let aligned = offs[side].rem_euclid(v.width) == 0;
                match acc {
                    // The interpreter's arrays have aligned bases: an address is aligned when
                    // its offset is.
                    VectorAccess::WideIfOffsetAligned | VectorAccess::WideIfAddressAligned => ok &= aligned,
                    VectorAccess::Wide if ok && !aligned => {
                        let tv = if side == 0 { f.exprs[v.expr].output } else { v.src };
                        return Err(KilnError::value(format!(
                            "kernel {kname}: misaligned vector access: {} x{} at element offset {} is not a multiple of the width, which the wide access assumes without a check; by {}",
                            f.tv_name(tv),
                            v.width,
                            offs[side],
                            ctx.thread(l)
                        )));
                    }
                    VectorAccess::Wide | VectorAccess::Elements => {}
                }
            }
            if ok {
                wide.push(l);
                wide_at.push((offs[0], offs[1]));
            } else {
                rest.push(l);
            }
        }
        if !wide.is_empty() {
            let out_tv = f.exprs[v.expr].output;
            let dt = f.tvs[out_tv].dtype;
            self.stats.thread_instructions += wide.len() as u64;
            for j in 0..v.width {
                let src: Vec<i64> = wide_at.iter().map(|&(_, i)| i + j).collect();
                let dst: Vec<i64> = wide_at.iter().map(|&(o, _)| o + j).collect();
                let (col, pz) = mem.read_lenient(ctx, kname, v.src, &wide, &Reg::V(src), true)?;
                mem.write_poisoned(ctx, kname, out_tv, &wide, &Reg::V(dst), &col.convert(dt), pz.as_ref())?;
            }
        }
        if v.whole {
            // As the kernel: no element loop (a lane the wide copy skipped has every element
            // out of range; were that wrong, the elements would be missing here too).
            return Ok(());
        }
        self.on_lanes(rest, &v.fallback)
    }

    fn alloc(&mut self, a: &Allocate) -> Result<()> {
        let f = &self.k.fusion;
        let mut size: usize = 1;
        for &s in &a.shape {
            let e = self.ctx.eval_uniform(s)?;
            size = usize::try_from(e).ok().and_then(|e| size.checked_mul(e)).ok_or_else(|| {
                KilnError::value(format!(
                    "kernel {}: allocation of {} has a bad size {e}",
                    self.kname,
                    f.scalars.render(s)
                ))
            })?;
        }
        let (name, tv) = match a.target {
            AllocTarget::Barriers(i) => {
                // Fresh Shared memory: no barrier of the array is initialised.
                self.mem.bars.reset_array(i);
                return Ok(());
            }
            AllocTarget::Tensor(tv) => (f.tv_name(tv), Some(tv)),
            AllocTarget::Buffer(i) => match self.k.summary.global_allocations.get(i) {
                Some(g) => (g.name.clone(), None),
                None => bail_internal!("interpreter: Allocate of unknown buffer {i}"),
            },
        };
        match a.memory {
            MemoryType::Global => {
                // The caller provides Global buffers; check their size against the Allocate.
                let loc = match a.target {
                    AllocTarget::Tensor(tv) => self.mem.slot(f, tv)?.loc,
                    AllocTarget::Buffer(i) => Loc::Caller(self.mem.buffers[i].1),
                    AllocTarget::Barriers(_) => unreachable!("returned above"),
                };
                let have = self.mem.buf(loc).data.len();
                if have != size {
                    return Err(KilnError::value(format!(
                        "kernel {}: Global buffer {name} has {have} elements but its Allocate needs {size}",
                        self.kname
                    )));
                }
                Ok(())
            }
            MemoryType::Local | MemoryType::Shared => {
                let Some(tv) = tv else {
                    bail_internal!("interpreter: {name} is a non-tensor buffer in on-chip memory");
                };
                if f.tvs[tv].tensor_memory && self.mem.tmem != TmemState::Allocated {
                    return Err(KilnError::value(format!(
                        "kernel {}: {name} is in Tensor memory but its Allocate runs where the region is {:?}",
                        self.kname, self.mem.tmem
                    )));
                }
                let instances =
                    if a.memory == MemoryType::Local { self.ctx.all.len() } else { self.ctx.all.len() / self.ctx.nt };
                let n = size.checked_mul(instances).filter(|&n| n <= 1 << 31).ok_or_else(|| {
                    KilnError::value(format!(
                        "kernel {}: {name} ({} memory) needs {size} elements for each of {instances} {}: too large for the interpreter",
                        self.kname,
                        a.memory.enum_name(),
                        if a.memory == MemoryType::Local { "threads" } else { "blocks" }
                    ))
                })?;
                // Fresh (uninitialised) memory every time the Allocate runs.
                let fresh = Buffer::try_unwritten(a.dtype, n, &name)?;
                let races = (a.memory == MemoryType::Shared).then(|| vec![CLEAN; n]);
                let asyncs = (a.memory == MemoryType::Shared).then(|| vec![None; n]);
                let cp = (a.memory == MemoryType::Shared && self.mem.async_tvs.contains(&tv)).then(|| vec![None; n]);
                let loc = match self.mem.slots.get(&tv) {
                    Some(Slot { loc: Loc::Own(i), .. }) => {
                        let i = *i;
                        self.mem.own[i] = fresh;
                        self.mem.races[i] = races;
                        self.mem.asyncs[i] = asyncs;
                        self.mem.cp_marks[i] = cp;
                        Loc::Own(i)
                    }
                    _ => {
                        self.mem.own.push(fresh);
                        self.mem.races.push(races);
                        self.mem.asyncs.push(asyncs);
                        self.mem.cp_marks.push(cp);
                        Loc::Own(self.mem.own.len() - 1)
                    }
                };
                let stages = match (a.memory, f.tvs[tv].circular_buffer) {
                    (MemoryType::Shared, Some(cb)) => cb.stages as usize,
                    _ => 1,
                };
                self.mem.slots.insert(tv, Slot { loc, memory: a.memory, size, name, stages });
                Ok(())
            }
        }
    }

    fn access(&mut self, a: &Access) -> Result<()> {
        if let AccessKind::ReduceAccumulator { expr, acc, complete } = a.kind {
            let Op::Reduction { op, .. } = self.k.fusion.exprs[expr].op else {
                bail_internal!("interpreter: reduction of an accumulator of a non-reduction")
            };
            let Some(v) = self.accs.get(&acc).cloned() else {
                bail_internal!("interpreter: register accumulator {acc} is reduced before it is declared")
            };
            return self.collective(a, op, v, complete);
        }
        let f = &self.k.fusion;
        let kname = self.kname;
        let ctx = &self.ctx;
        let mem = &mut self.mem;
        let uniform = |s: Symbol| ctx.uniform(s);
        let mut gathered: FxHashMap<u32, Vec<i64>> = FxHashMap::default();
        let mut ev = Evaluator::new(&a.prog);
        // Which threads compute.
        let pred = ev.eval(a.pred, &mk_env(&uniform, ctx, &ctx.active, &gathered, &mem.done))?;
        let active: Cow<[u32]> = match pred {
            Reg::U(0) => Cow::Owned(Vec::new()),
            Reg::U(_) => Cow::Borrowed(&ctx.active),
            Reg::V(v) if v.iter().all(|&p| p != 0) => Cow::Borrowed(&ctx.active),
            Reg::V(v) => Cow::Owned(ctx.active.iter().zip(v).filter(|(_, &p)| p != 0).map(|(&l, _)| l).collect()),
        };
        let everyone_active = active.len() == ctx.active.len();
        let out_dt = f.tvs[a.out_tv].dtype;
        let collective = !a.reduced.is_empty() && matches!(a.kind, AccessKind::Expr { .. });
        if active.is_empty() && !collective {
            return Ok(());
        }
        self.stats.thread_instructions += active.len() as u64;
        if !everyone_active {
            ev.reset_varying();
        }

        // The computed value of each active thread, and the lanes computed from unwritten
        // registers.
        let mut result_poison: Option<Poison> = None;
        let result = match &a.kind {
            AccessKind::Init { value } => {
                Col::splat(ctx.value(*value)?, ctx.scalar_dtype(*value), active.len()).convert(out_dt)
            }
            AccessKind::ReduceAccumulator { .. } => {
                bail_internal!("interpreter: an accumulator reduction is collective")
            }
            AccessKind::Expr { expr } | AccessKind::Accumulate { expr, .. } => {
                let e = &f.exprs[*expr];
                for &CGather { id, index_tv: tv, at, table, extent, element } in &a.gathers {
                    let offs = ev.eval(at, &mk_env(&uniform, ctx, &active, &gathered, &mem.done))?.clone();
                    let vals = mem.read(ctx, kname, tv, &active, &offs)?.to_i64();
                    if let Some(j) = bad_index(ctx, extent, &vals)? {
                        let at = ev.eval(element, &mk_env(&uniform, ctx, &active, &gathered, &mem.done))?.at(j);
                        return Err(index_error(f, ctx, tv, table, extent, vals[j], at));
                    }
                    gathered.insert(id, vals);
                }
                let mut cols: Vec<Option<Col>> = Vec::with_capacity(e.inputs.len());
                let mut poison: Option<Poison> = None;
                for (pos, (op, off)) in e.inputs.iter().zip(&a.inputs).enumerate() {
                    if e.op.index_input() == Some(pos) {
                        cols.push(None);
                        continue;
                    }
                    cols.push(Some(match (op, off) {
                        (Operand::Tensor(tv), Some(off)) if matches!(e.op, Op::Remap { .. }) && a.element.is_some() => {
                            // A guarded remap reads only where its guard holds; 0 elsewhere.
                            let env = mk_env(&uniform, ctx, &active, &gathered, &mem.done);
                            let guard = ev.eval(a.element.expect("checked"), &env)?.clone();
                            let offs = ev.eval(*off, &env)?.clone();
                            let keep: Vec<usize> = (0..active.len()).filter(|&l| guard.at(l) != 0).collect();
                            let lanes: Vec<u32> = keep.iter().map(|&l| active[l]).collect();
                            let sub = Reg::V(keep.iter().map(|&l| offs.at(l)).collect());
                            let (col, pz) = mem.read_lenient(ctx, kname, *tv, &lanes, &sub, true)?;
                            let dt = f.tvs[*tv].dtype;
                            let mut full = Col::splat(ScalarValue::Int(0), dt, active.len());
                            full.place(&keep, &col)?;
                            if let Some(pz) = pz {
                                let mut all = vec![false; active.len()];
                                for (&l, &p) in keep.iter().zip(&pz.lanes) {
                                    all[l] = p;
                                }
                                poison = Poison::join(poison.take(), Some(Poison { lanes: all, what: pz.what }));
                            }
                            full
                        }
                        (Operand::Tensor(tv), Some(off)) => {
                            let offs = ev.eval(*off, &mk_env(&uniform, ctx, &active, &gathered, &mem.done))?.clone();
                            let (col, pz) = mem.read_lenient(ctx, kname, *tv, &active, &offs, true)?;
                            poison = Poison::join(poison.take(), pz);
                            col
                        }
                        (Operand::Scalar(v), _) => Col::splat(ctx.value(*v)?, ctx.scalar_dtype(*v), active.len()),
                        (Operand::Tensor(tv), None) => {
                            bail_internal!("interpreter: no offset for operand {}", f.tv_name(*tv))
                        }
                    }));
                }
                result_poison = poison;
                let mut take = |i: usize| -> Result<Col> {
                    match cols.get_mut(i).and_then(Option::take) {
                        Some(c) => Ok(c),
                        None => bail_internal!("interpreter: missing operand {i}"),
                    }
                };
                match &e.op {
                    Op::Unary(u) => {
                        let cd = u.compute_dtype(self_dtype(f, ctx, e.inputs[0]), out_dt);
                        values::unary(*u, take(0)?.convert(cd), cd)?.convert(out_dt)
                    }
                    Op::Binary(b) => {
                        let ops: Vec<PromotionOperand> = e
                            .inputs
                            .iter()
                            .map(|&o| PromotionOperand {
                                dtype: self_dtype(f, ctx, o),
                                is_tensor: o.tensor().is_some(),
                                zero_dim: false,
                            })
                            .collect();
                        let cd = b.compute_dtype(promote(&ops), out_dt);
                        let (x, y) = (take(0)?.convert(cd), take(1)?.convert(cd));
                        if b.is_comparison() {
                            values::compare(*b, x, y)?
                        } else {
                            values::arith(*b, x, y, cd)?.convert(out_dt)
                        }
                    }
                    Op::Where => {
                        let c = take(0)?.convert(DataType::Bool);
                        values::select(&c, take(1)?.convert(out_dt), take(2)?.convert(out_dt))?
                    }
                    Op::Cast(dt) => take(0)?.convert(*dt),
                    Op::Set
                    | Op::Broadcast { .. }
                    | Op::Squeeze { .. }
                    | Op::Permute { .. }
                    | Op::IndexSelect { .. }
                    | Op::Remap { .. }
                    | Op::Reduction { .. } => take(0)?.convert(out_dt),
                    Op::Full { value } => {
                        Col::splat(ctx.value(*value)?, ctx.scalar_dtype(*value), active.len()).convert(out_dt)
                    }
                    Op::Mask { .. } => {
                        let Some(slot) = a.element else {
                            bail_internal!("interpreter: {} has no mask condition", f.tv_name(e.output))
                        };
                        let v = ev.eval(slot, &mk_env(&uniform, ctx, &active, &gathered, &mem.done))?.clone();
                        Col::B((0..active.len()).map(|l| v.at(l) != 0).collect()).convert(out_dt)
                    }
                    Op::Iota { .. } | Op::Random { .. } => {
                        let Some(slot) = a.element else {
                            bail_internal!("interpreter: {} has no element position", f.tv_name(e.output))
                        };
                        let pos = ev.eval(slot, &mk_env(&uniform, ctx, &active, &gathered, &mem.done))?.clone();
                        let pos: Vec<i64> = (0..active.len()).map(|l| pos.at(l)).collect();
                        let scalar = |v: ValId| ctx.value(v);
                        values::positional(&e.op, &pos, scalar, out_dt)?
                    }
                }
            }
        };

        let reduction = match a.kind.expr() {
            Some(expr) => match f.exprs[expr].op {
                Op::Reduction { op, init } => Some((op, init)),
                _ => None,
            },
            None => None,
        };
        let Some((rop, init)) = reduction else {
            let offs = ev.eval(a.out, &mk_env(&uniform, ctx, &active, &gathered, &mem.done))?.clone();
            return mem.write_poisoned(ctx, kname, a.out_tv, &active, &offs, &result, result_poison.as_ref());
        };
        if let AccessKind::Accumulate { acc, .. } = a.kind {
            // The register accumulates like a serial reduction in Local memory, except that
            // a poisoned lane is an error (the block reduction after the loop combines it).
            poison_reaches_reduction(kname, f, a.out_tv, result_poison)?;
            let pos: Vec<usize> = active.iter().map(|&l| l as usize).collect();
            let Some(reg) = self.accs.get_mut(&acc) else {
                bail_internal!("interpreter: register accumulator {acc} is used before it is declared")
            };
            let r = values::combine(rop, reg.select(&pos), result, out_dt)?;
            return reg.place(&pos, &r);
        }
        if !collective {
            let offs = ev.eval(a.out, &mk_env(&uniform, ctx, &active, &gathered, &mem.done))?.clone();
            let (cur, pz) = mem.read_lenient(ctx, kname, a.out_tv, &active, &offs, true)?;
            let r = values::combine(rop, cur, result, out_dt)?;
            let pz = Poison::join(pz, result_poison);
            return mem.write_poisoned(ctx, kname, a.out_tv, &active, &offs, &r, pz.as_ref());
        }
        poison_reaches_reduction(kname, f, a.out_tv, result_poison)?;
        let pos: Vec<usize> = active.iter().map(|&l| l as usize).collect();
        let mut v = Col::splat(ctx.value(init)?, ctx.scalar_dtype(init), ctx.all.len()).convert(out_dt);
        v.place(&pos, &result)?;
        self.collective(a, rop, v, false)
    }

    /// The block or grid reduction of `v` (one value per lane, the identity where a lane
    /// does not contribute) over the reduced parallel types, combined into the output (or
    /// stored: `complete`) by the threads that hold the result.
    fn collective(&mut self, a: &Access, rop: crate::ir::ReductionOp, v: Col, complete: bool) -> Result<()> {
        let f = &self.k.fusion;
        let kname = self.kname;
        let out_dt = f.tvs[a.out_tv].dtype;
        let grid = a.reduced.iter().any(|&p| f.is_grid_dim(p));
        // A cluster reduction waits at a cluster barrier: every block must reach it.
        if a.reduced.iter().any(|p| p.is_block()) && self.ctx.active.len() != self.ctx.all.len() {
            return Err(KilnError::value(format!(
                "kernel {kname}: divergent {} reduction of {}: inside a branch only some threads take",
                if grid { "grid" } else { "cluster" },
                f.tv_name(a.out_tv)
            )));
        }
        self.converged(&format!("block reduction of {}", f.tv_name(a.out_tv)))?;
        let ctx = &self.ctx;
        let mem = &mut self.mem;
        let uniform = |s: Symbol| ctx.uniform(s);
        let mut gathered: FxHashMap<u32, Vec<i64>> = FxHashMap::default();
        let mut ev = Evaluator::new(&a.prog);
        let total = ctx.all.len();
        let dim = |p: ParallelType| -> i64 {
            match p {
                ParallelType::BIDx => ctx.grid[0],
                ParallelType::BIDy => ctx.grid[1],
                ParallelType::BIDz => ctx.grid[2],
                ParallelType::TIDx => ctx.block[0],
                ParallelType::TIDy => ctx.block[1],
                _ => ctx.block[2],
            }
        };
        let red: Vec<ParallelType> = PARALLEL_DIMS.iter().copied().filter(|p| a.reduced.contains(p)).collect();
        let kept: Vec<ParallelType> = PARALLEL_DIMS.iter().copied().filter(|p| !a.reduced.contains(p)).collect();
        let n_red: i64 = red.iter().map(|&p| dim(p)).product();
        let n_grp: i64 = kept.iter().map(|&p| dim(p)).product();
        let (n_red, n_grp) = (n_red as usize, n_grp as usize);
        let mut members = vec![0u32; total];
        let mut group_of = vec![0u32; total];
        for &l in ctx.all.iter() {
            let mut g = 0i64;
            for &p in &kept {
                g = g * dim(p) + coord(l, p, ctx.block, ctx.grid);
            }
            let mut j = 0i64;
            for &p in &red {
                j = j * dim(p) + coord(l, p, ctx.block, ctx.grid);
            }
            members[j as usize * n_grp + g as usize] = l;
            group_of[l as usize] = g as u32;
        }
        let sync_name = format!("{}_sync", f.tv_name(a.out_tv));
        let work_name = format!("{}_work", f.tv_name(a.out_tv));
        if grid {
            let Some(&(_, at)) = mem.buffers.iter().find(|(n, _)| *n == sync_name) else {
                bail_internal!(
                    "interpreter: grid reduction of {} has no {sync_name} semaphore buffer",
                    f.tv_name(a.out_tv)
                );
            };
            let buf = &mem.caller[at];
            for i in 0..buf.data.len() {
                let written = buf.written.as_ref().is_none_or(|w| w[i]);
                if !written || buf.data.get(i) != ScalarValue::Int(0) {
                    return Err(KilnError::value(format!(
                        "kernel {kname}: semaphore not zeroed: {sync_name}[{i}] is {} at the grid reduction of {} (the buffer must be zero-initialised and left zero by every reduction)",
                        if written { format!("{:?}", buf.data.get(i)) } else { "uninitialized".into() },
                        f.tv_name(a.out_tv)
                    )));
                }
            }
        }
        // Combined pairwise, as the GPU's butterflies and trees do: a chain over 50,000
        // threads' partial sums in float would drift by 1e-4 relative where the GPU's
        // result is within a few ulps.
        let mut parts: Vec<Col> = (0..n_red)
            .map(|j| v.select(&members[j * n_grp..(j + 1) * n_grp].iter().map(|&l| l as usize).collect::<Vec<_>>()))
            .collect();
        while parts.len() > 1 {
            let mut next = Vec::with_capacity(parts.len().div_ceil(2));
            let mut it = parts.into_iter();
            while let Some(a) = it.next() {
                next.push(match it.next() {
                    Some(b) => values::combine(rop, a, b, out_dt)?,
                    None => a,
                });
            }
            parts = next;
        }
        let Some(acc) = parts.pop() else { bail_internal!("interpreter: a collective reduction over no threads") };
        if grid {
            if let Some(&(_, at)) = mem.buffers.iter().find(|(n, _)| *n == work_name) {
                if let Some(w) = &mut mem.caller[at].written {
                    w.fill(true);
                }
            }
            let mut holders = vec![false; total];
            for &l in &members[..n_grp] {
                holders[l as usize] = true;
            }
            mem.done.insert(a.out_tv, holders);
        }
        let everyone = !grid && f.tvs[a.out_tv].memory == MemoryType::Local;
        let (writers, r): (Vec<u32>, Col) = if everyone {
            let sel: Vec<usize> = ctx.active.iter().map(|&l| group_of[l as usize] as usize).collect();
            (ctx.active.clone(), acc.select(&sel))
        } else if ctx.active.len() == total {
            (members[..n_grp].to_vec(), acc)
        } else {
            // Only the blocks that took the branch ran the reduction.
            let running: rustc_hash::FxHashSet<usize> = ctx.active.iter().map(|&l| l as usize / ctx.nt).collect();
            let keep: Vec<usize> = (0..n_grp).filter(|&g| running.contains(&(members[g] as usize / ctx.nt))).collect();
            (keep.iter().map(|&g| members[g]).collect(), acc.select(&keep))
        };
        ev.reset_varying();
        gathered.clear();
        let wp = ev.eval(a.wpred, &mk_env(&uniform, ctx, &writers, &gathered, &mem.done))?.clone();
        let keep: Vec<usize> = (0..writers.len()).filter(|&i| wp.at(i) != 0).collect();
        let writers: Vec<u32> = keep.iter().map(|&i| writers[i]).collect();
        let r = r.select(&keep);
        if writers.is_empty() {
            return Ok(());
        }
        ev.reset_varying();
        let offs = ev.eval(a.out, &mk_env(&uniform, ctx, &writers, &gathered, &mem.done))?.clone();
        let out = if complete {
            r
        } else {
            values::combine(rop, mem.read(ctx, kname, a.out_tv, &writers, &offs)?, r, out_dt)?
        };
        mem.write(ctx, kname, a.out_tv, &writers, &offs, &out)
    }
}

/// A block, grid or register reduction combines every lane: a value computed from an
/// unwritten register reaches its result, which is an error naming the read.
fn poison_reaches_reduction(kname: &str, f: &Fusion, out: TvId, poison: Option<Poison>) -> Result<()> {
    match poison.filter(|p| p.lanes.iter().any(|&b| b)) {
        Some(pz) => Err(KilnError::value(format!(
            "kernel {kname}: {}, and the value computed from it enters the reduction of {}",
            pz.what,
            f.tv_name(out)
        ))),
        None => Ok(()),
    }
}

/// The first lane whose gathered index value is outside its table's `extent`.
fn bad_index(ctx: &Ctx, extent: ValId, vals: &[i64]) -> Result<Option<usize>> {
    let n = ctx.value(extent)?.as_i64();
    Ok(vals.iter().position(|&v| v < 0 || v >= n))
}

/// Gathered index values must select an entry of their table: the error names both as
/// the definition does, and the element by its position in the index tensor.
fn index_error(f: &Fusion, ctx: &Ctx, tv: TvId, table: TvId, extent: ValId, value: i64, element: i64) -> KilnError {
    let n = ctx.value(extent).map(|v| v.as_i64()).unwrap_or(0);
    KilnError::value(format!(
        "gather: the index tensor {} holds {value} at element {element}; {} has {n} entries along the gathered axis (indices must be in [0, {n}))",
        f.index_name(tv),
        f.table_name(table)
    ))
}

fn mk_env<'a>(
    uniform: &'a dyn Fn(Symbol) -> Option<i64>,
    ctx: &'a Ctx,
    lanes: &'a [u32],
    gathered: &'a FxHashMap<u32, Vec<i64>>,
    done: &'a FxHashMap<TvId, Vec<bool>>,
) -> EvalEnv<'a> {
    EvalEnv { uniform, lanes, block: ctx.block, grid: ctx.grid, gathered, coords: Some(&ctx.coords), done: Some(done) }
}

fn self_dtype(f: &Fusion, ctx: &Ctx, o: Operand) -> DataType {
    match o {
        Operand::Tensor(t) => f.tvs[t].dtype,
        Operand::Scalar(v) => ctx.scalar_dtype(v),
    }
}
