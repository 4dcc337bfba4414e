//! The kernel-IR verifier, run after every lowering pass in tests and debug builds (and
//! on request): the invariants codegen and the interpreter rely on.
//! - Every serial loop index a statement, loop extent, allocation or condition reads is
//!   the index of a loop around it.
//! - Every Local or Shared tensor a statement touches was allocated before, in a scope
//!   around it.
//! - No barrier or block reduction sits in a branch whose condition differs between the
//!   threads of a block (some would never reach it).

use rustc_hash::FxHashSet;

use crate::error::Result;
use crate::ir::scalar::Val;
use crate::ir::{Fusion, MemoryType, Operand, ParallelType, Symbol, TvId, ValId};
use crate::kernel::{AllocTarget, Node};

/// What the verifier can check at a point of the pipeline.
#[derive(Clone, Copy, Debug)]
pub struct Stage {
    /// Statements carry their access indices (after `indexing`).
    pub indexed: bool,
    /// Allocations are placed (after `allocation`).
    pub allocated: bool,
}

/// Check `body` after pass `pass`; the error names the pass and the broken rule.
pub fn run(f: &Fusion, body: &[Node], stage: Stage, pass: &str) -> Result<()> {
    let mut v = Verifier { f, stage, loops: Vec::new(), allocated: Vec::new(), divergent: 0 };
    v.nodes(body).map_err(|m| crate::error::KilnError::internal(format!("kernel IR after {pass}: {m}")))
}

struct Verifier<'a> {
    f: &'a Fusion,
    stage: Stage,
    /// Serial loop indices in scope.
    loops: Vec<u32>,
    /// Local and Shared tensors allocated in scope.
    allocated: Vec<TvId>,
    /// Enclosing branches whose condition reads a thread index.
    divergent: usize,
}

impl Verifier<'_> {
    fn nodes(&mut self, body: &[Node]) -> std::result::Result<(), String> {
        let (loops, allocated) = (self.loops.len(), self.allocated.len());
        for n in body {
            self.node(n)?;
        }
        self.loops.truncate(loops);
        self.allocated.truncate(allocated);
        Ok(())
    }

    fn node(&mut self, n: &Node) -> std::result::Result<(), String> {
        let f = self.f;
        match n {
            Node::Loop(l) => {
                self.in_scope(l.extent, "a loop extent")?;
                let bound = match f.scalars.get(l.index) {
                    Val::Symbol(Symbol::LoopIndex(i)) if !l.parallel.is_thread_or_block() => Some(i),
                    _ => None,
                };
                self.loops.extend(bound);
                self.nodes(&l.body)?;
                if bound.is_some() {
                    self.loops.pop();
                }
                return Ok(());
            }
            Node::Alloc(a) => {
                for &e in &a.shape {
                    self.in_scope(e, "an allocation size")?;
                }
                if let (AllocTarget::Tensor(tv), MemoryType::Local | MemoryType::Shared) = (a.target, a.memory) {
                    self.allocated.push(tv);
                }
            }
            Node::Sync(_) | Node::ReduceAccumulator { .. } if self.divergent > 0 => {
                return Err("a barrier or block reduction inside a branch on a thread index".into());
            }
            Node::If(i) => {
                self.in_scope(i.cond, "a branch condition")?;
                let thread_dependent = reads_thread_index(f, i.cond);
                self.divergent += usize::from(thread_dependent);
                self.nodes(&i.then)?;
                self.nodes(&i.otherwise)?;
                self.divergent -= usize::from(thread_dependent);
                return Ok(());
            }
            Node::Vector(v) => {
                for x in [v.out, v.input, v.first, v.last] {
                    self.in_scope(x, "a vector copy's offset or guard")?;
                }
                self.nodes(std::slice::from_ref(&Node::Loop(v.fallback.clone())))?;
                return Ok(());
            }
            _ => {}
        }
        if let Some(ix) = n.access_index() {
            if self.stage.indexed {
                self.in_scope(ix.out, "an output offset")?;
                self.in_scope(ix.predicate, "a predicate")?;
                self.in_scope(ix.write_predicate, "a write predicate")?;
                for &v in ix.inputs.iter().flatten() {
                    self.in_scope(v, "an operand offset")?;
                }
                for g in &ix.gathers {
                    self.in_scope(g.at, "a gather offset")?;
                }
            }
        }
        if self.stage.allocated {
            for tv in touched(f, n) {
                let mem = f.tvs[tv].memory;
                if matches!(mem, MemoryType::Local | MemoryType::Shared) && !self.allocated.contains(&tv) {
                    return Err(format!(
                        "{} ({} memory) is accessed outside any Allocate of it",
                        f.tv_name(tv),
                        mem.enum_name()
                    ));
                }
            }
        }
        Ok(())
    }

    fn in_scope(&self, v: ValId, what: &str) -> std::result::Result<(), String> {
        let mut syms = FxHashSet::default();
        crate::lower::predicate::symbols(&self.f.scalars, v, &mut syms);
        for s in syms {
            if let Symbol::LoopIndex(i) = s {
                if !self.loops.contains(&i) {
                    return Err(format!(
                        "{what} ({}) reads idx{i}, which no loop around it defines",
                        self.f.scalars.render(v)
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The tensors a statement reads or writes.
fn touched(f: &Fusion, n: &Node) -> Vec<TvId> {
    let expr = match n {
        Node::Init { tv, .. } => return vec![*tv],
        Node::Expr { expr, .. } => *expr,
        Node::Accumulate { acc, .. } => acc.expr,
        Node::ReduceAccumulator { acc, .. } => return vec![f.exprs[acc.expr].output],
        _ => return Vec::new(),
    };
    let e = &f.exprs[expr];
    let mut out: Vec<TvId> =
        e.inputs.iter().filter_map(|o| if let Operand::Tensor(t) = o { Some(*t) } else { None }).collect();
    if !matches!(n, Node::Accumulate { .. }) {
        out.push(e.output);
    }
    out
}

/// True when `v` reads a thread index (it differs between the threads of a block).
fn reads_thread_index(f: &Fusion, v: ValId) -> bool {
    let mut syms = FxHashSet::default();
    crate::lower::predicate::symbols(&f.scalars, v, &mut syms);
    syms.iter().any(|s| {
        matches!(s, Symbol::ParallelIndex(ParallelType::TIDx | ParallelType::TIDy | ParallelType::TIDz))
            || matches!(s, Symbol::Gathered(_))
    })
}
