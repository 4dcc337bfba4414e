//! Index expressions compiled for lane-vectorised evaluation. A node's offsets,
//! predicates and gather positions form one small program over the scalar DAG; values
//! that depend only on sizes, scalar inputs and loop indices are *uniform* (one i64 per
//! evaluation), the others (thread/block coordinates, gathered values) are *varying*
//! (one i64 per lane).

use rustc_hash::FxHashMap;

use crate::bail_internal;
use crate::error::{KilnError, Result};
use crate::ir::scalar::{ScalarOp, Val};
use crate::ir::{ParallelType, Scalars, Symbol, ValId};

/// One instruction of a compiled program.
#[derive(Clone, Copy, Debug)]
enum Instr {
    Const(i64),
    Sym(Symbol),
    Bin(ScalarOp, u32, u32),
}

/// A compiled set of scalar expressions.
#[derive(Clone, Debug, Default)]
pub struct Prog {
    instrs: Vec<Instr>,
    varying: Vec<bool>,
    map: FxHashMap<ValId, u32>,
}

/// A register: one value for all lanes, or one per lane.
#[derive(Clone, Debug)]
pub enum Reg {
    U(i64),
    V(Vec<i64>),
}

impl Reg {
    /// The value of lane `i`.
    #[inline]
    pub fn at(&self, i: usize) -> i64 {
        match self {
            Reg::U(v) => *v,
            Reg::V(v) => v[i],
        }
    }
}

impl Prog {
    /// Add `v` (and its operands) to the program; returns its slot.
    pub fn add(&mut self, sc: &Scalars, v: ValId) -> Result<u32> {
        if let Some(&s) = self.map.get(&v) {
            return Ok(s);
        }
        let (ins, varying) = match sc.get(v) {
            Val::Int(i) => (Instr::Const(i), false),
            Val::Bool(b) => (Instr::Const(b as i64), false),
            Val::Float(bits) => (Instr::Const(f64::from_bits(bits) as i64), false),
            Val::Symbol(s) => {
                (Instr::Sym(s), matches!(s, Symbol::ParallelIndex(_) | Symbol::Gathered(_) | Symbol::GridDone(_)))
            }
            Val::Binary(op, a, b) => {
                let sa = self.add(sc, a)?;
                let sb = self.add(sc, b)?;
                (Instr::Bin(op, sa, sb), self.varying[sa as usize] || self.varying[sb as usize])
            }
        };
        let slot = self.instrs.len() as u32;
        self.instrs.push(ins);
        self.varying.push(varying);
        self.map.insert(v, slot);
        Ok(slot)
    }

    /// True when slot `s` differs between lanes.
    pub fn is_varying(&self, s: u32) -> bool {
        self.varying[s as usize]
    }
}

/// What an evaluation needs besides the program.
pub struct EvalEnv<'a> {
    /// Uniform symbol values (sizes, strides, scalar inputs, loop indices, launch dims).
    pub uniform: &'a dyn Fn(Symbol) -> Option<i64>,
    /// The lanes evaluated (global thread ids).
    pub lanes: &'a [u32],
    /// Threads per block and block dims, grid dims (for thread/block coordinates).
    pub block: [i64; 3],
    pub grid: [i64; 3],
    /// Gathered values bound so far (per lane of `lanes`).
    pub gathered: &'a FxHashMap<u32, Vec<i64>>,
    /// Coordinates of every thread of the launch, per parallel type (BIDx..TIDz), if
    /// precomputed.
    pub coords: Option<&'a [Vec<u32>; 6]>,
    /// Per grid-reduction output, which threads (by global id) hold its finished result.
    pub done: Option<&'a FxHashMap<crate::ir::TvId, Vec<bool>>>,
}

/// Slot of a thread/block parallel type in `EvalEnv::coords`.
pub fn coord_slot(pt: ParallelType) -> Option<usize> {
    Some(match pt {
        ParallelType::BIDx => 0,
        ParallelType::BIDy => 1,
        ParallelType::BIDz => 2,
        ParallelType::TIDx => 3,
        ParallelType::TIDy => 4,
        ParallelType::TIDz => 5,
        _ => return None,
    })
}

/// Coordinate of parallel type `pt` of global thread id `lane`.
#[inline]
pub fn coord(lane: u32, pt: ParallelType, block: [i64; 3], grid: [i64; 3]) -> i64 {
    let nt = (block[0] * block[1] * block[2]) as u64;
    let l = lane as u64;
    let (t, b) = (l % nt, l / nt);
    let (dims, v) = if pt.is_thread() { (block, t) } else { (grid, b) };
    let (x, y) = (dims[0] as u64, dims[1] as u64);
    (match pt {
        ParallelType::TIDx | ParallelType::BIDx => v % x,
        ParallelType::TIDy | ParallelType::BIDy => (v / x) % y,
        ParallelType::TIDz | ParallelType::BIDz => v / (x * y),
        _ => 0,
    }) as i64
}

/// Memoised evaluation of a program over one lane list.
pub struct Evaluator<'p> {
    prog: &'p Prog,
    memo: Vec<Option<Reg>>,
}

impl<'p> Evaluator<'p> {
    /// A fresh evaluation (no values computed yet).
    pub fn new(prog: &'p Prog) -> Self {
        Evaluator { prog, memo: vec![None; prog.instrs.len()] }
    }

    /// Forget varying values (after the lane list changed); uniform ones stay.
    pub fn reset_varying(&mut self) {
        for (m, &v) in self.memo.iter_mut().zip(&self.prog.varying) {
            if v {
                *m = None;
            }
        }
    }

    /// The value of slot `s`.
    pub fn eval(&mut self, s: u32, env: &EvalEnv) -> Result<&Reg> {
        self.compute(s, env)?;
        match &self.memo[s as usize] {
            Some(r) => Ok(r),
            None => bail_internal!("interpreter: slot {s} not computed"),
        }
    }

    fn compute(&mut self, s: u32, env: &EvalEnv) -> Result<()> {
        if self.memo[s as usize].is_some() {
            return Ok(());
        }
        let r = match self.prog.instrs[s as usize] {
            Instr::Const(c) => Reg::U(c),
            Instr::Sym(Symbol::ParallelIndex(pt)) => match (env.coords, coord_slot(pt)) {
                (Some(c), Some(k)) => {
                    let c = &c[k];
                    Reg::V(env.lanes.iter().map(|&l| c[l as usize] as i64).collect())
                }
                _ => Reg::V(env.lanes.iter().map(|&l| coord(l, pt, env.block, env.grid)).collect()),
            },
            Instr::Sym(Symbol::Gathered(g)) => match env.gathered.get(&g) {
                Some(v) => Reg::V(v.clone()),
                None => bail_internal!("interpreter: gathered value g{g} used before its read"),
            },
            // Before its grid reduction has run, no thread holds the result.
            Instr::Sym(Symbol::GridDone(t)) => {
                let done = env.done.and_then(|d| d.get(&t));
                Reg::V(env.lanes.iter().map(|&l| i64::from(done.is_some_and(|d| d[l as usize]))).collect())
            }
            Instr::Sym(sym) => match (env.uniform)(sym) {
                Some(v) => Reg::U(v),
                None => {
                    let mut name = String::new();
                    crate::ir::scalar::render_symbol(sym, &mut name);
                    return Err(KilnError::value(format!("interpreter: no value bound for {name}")));
                }
            },
            Instr::Bin(op, a, b) => {
                self.compute(a, env)?;
                self.compute(b, env)?;
                let (ra, rb) = match (&self.memo[a as usize], &self.memo[b as usize]) {
                    (Some(x), Some(y)) => (x, y),
                    _ => bail_internal!("interpreter: operands not computed"),
                };
                match (ra, rb) {
                    (Reg::U(x), Reg::U(y)) => match op.apply(*x, *y) {
                        Some(v) => Reg::U(v),
                        None => {
                            return Err(KilnError::value(format!(
                                "interpreter: index arithmetic {op:?}({x}, {y}) overflows or divides by zero"
                            )))
                        }
                    },
                    (Reg::V(x), Reg::U(y)) => {
                        let y = *y;
                        Reg::V(x.iter().map(|&x| lane_op(op, x, y)).collect())
                    }
                    (Reg::U(x), Reg::V(y)) => {
                        let x = *x;
                        Reg::V(y.iter().map(|&y| lane_op(op, x, y)).collect())
                    }
                    (Reg::V(x), Reg::V(y)) => {
                        Reg::V(x.iter().zip(y.iter()).map(|(&x, &y)| lane_op(op, x, y)).collect())
                    }
                }
            }
        };
        self.memo[s as usize] = Some(r);
        Ok(())
    }
}

/// Per-lane integer op ([`ScalarOp::apply_wrapping`], what the generated C computes);
/// division by zero gives 0 (such lanes are predicated off).
#[inline]
fn lane_op(op: ScalarOp, a: i64, b: i64) -> i64 {
    op.apply_wrapping(a, b).unwrap_or(0)
}
