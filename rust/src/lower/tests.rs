//! Unit tests of the lowering passes' helpers, on small hand-scheduled fusions.

use crate::analysis::id_graph::IdGraph;
use crate::analysis::loop_graph::LoopGraph;
use crate::ir::{DataType, Fusion, MemoryType, Operand, ParallelType, ReductionOp, TvId, UnaryOp};
use crate::kernel::{IfKind, IfThenElse, Kernel, Node, SyncKind};
use crate::lower::allocation::domain;
use crate::lower::{loops, lower, verify};
use crate::sched::propagate::completed;

fn graphs(f: &Fusion) -> (IdGraph, LoopGraph) {
    let exact = IdGraph::exact(f);
    let order = loops::expr_order(f, true);
    let tv_order = loops::tensor_order(f, &order);
    let lg = LoopGraph::build(f, &exact, &tv_order).unwrap();
    (exact, lg)
}

fn extents(f: &Fusion, ids: &[crate::ir::IterDomainId]) -> Vec<String> {
    ids.iter().map(|&i| f.scalars.render(f.ids[i].extent)).collect()
}

/// x -> exp -> neg, each [BIDx, TIDx 32, 4], producer inlined at `pos`.
pub(crate) fn chain(pos: i64, unroll: bool) -> (Fusion, TvId, TvId) {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1], DataType::Float, None).unwrap();
    let a = f.unary(UnaryOp::Exp, Operand::Tensor(x)).unwrap();
    let b = f.unary(UnaryOp::Neg, Operand::Tensor(a)).unwrap();
    f.add_output(b).unwrap();
    for t in [a, b] {
        f.split(t, 0, 128, true).unwrap();
        f.split(t, 1, 4, true).unwrap();
        f.parallelize(t, 0, ParallelType::BIDx).unwrap();
        f.parallelize(t, 1, ParallelType::TIDx).unwrap();
        if unroll {
            f.parallelize(t, 2, ParallelType::Unroll).unwrap();
        }
    }
    f.inline_at(a, pos).unwrap();
    (f, a, b)
}

#[test]
fn alloc_position_moves_out_of_unrolled_loops() {
    let (f, a, _) = chain(3, false);
    let (_, lg) = graphs(&f);
    assert_eq!(domain::alloc_position(&f, &lg, a), 3);
    let (f, a, _) = chain(3, true);
    let (_, lg) = graphs(&f);
    assert_eq!(domain::alloc_position(&f, &lg, a), 2, "the Unroll loop at axis 2 keeps its storage");
}

#[test]
fn partitioned_and_size_one_ids_take_no_room() {
    let (mut f, a, _) = chain(1, false);
    let (_, lg) = graphs(&f);
    let ld = f.tvs[a].loop_domain.clone();
    assert!(!domain::may_require_allocation(&f, &lg, a, ld[0]), "BIDx partitions Local");
    assert!(!domain::may_require_allocation(&f, &lg, a, ld[1]), "TIDx partitions Local");
    assert!(domain::may_require_allocation(&f, &lg, a, ld[2]));
    f.tvs[a].memory = MemoryType::Shared;
    let (_, lg) = graphs(&f);
    assert!(domain::may_require_allocation(&f, &lg, a, ld[1]), "Shared is shared across TIDx");
    assert!(!domain::may_require_allocation(&f, &lg, a, ld[0]), "BIDx partitions Shared");
}

#[test]
fn inferred_ids_and_strides() {
    let (mut f, a, _) = chain(1, false);
    let (exact, lg) = graphs(&f);
    let (ids, contig) = domain::infer_ids(&f, &lg, &exact, a, 1).unwrap();
    assert_eq!(extents(&f, &ids), ["4"]);
    assert_eq!(contig, [Some(true)]);
    f.tvs[a].memory = MemoryType::Shared;
    let (exact, lg) = graphs(&f);
    let (ids, contig) = domain::infer_ids(&f, &lg, &exact, a, 1).unwrap();
    assert_eq!(extents(&f, &ids), ["32", "4"]);
    let info = domain::allocation_info(&mut f, &lg, a, &ids, &contig, 0).unwrap();
    let strides: Vec<String> = info.strides.iter().map(|&s| f.scalars.render(s)).collect();
    assert_eq!(strides, ["4", "1"]);
}

#[test]
fn non_contiguous_strides_come_from_runtime_strides() {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1, -1], DataType::Float, Some(&[Some(false), Some(true), Some(false)])).unwrap();
    let y = f.unary(UnaryOp::Neg, Operand::Tensor(x)).unwrap();
    f.add_output(y).unwrap();
    let (exact, lg) = graphs(&f);
    let (ids, contig) = domain::infer_ids(&f, &lg, &exact, x, 0).unwrap();
    let info = domain::allocation_info(&mut f, &lg, x, &ids, &contig, 0).unwrap();
    let strides: Vec<String> = info.strides.iter().map(|&s| f.scalars.render(s)).collect();
    assert_eq!(strides, ["T0.stride[0]", "T0.stride[2] * i2", "T0.stride[2]"]);
    assert_eq!(info.contiguity, [false, true, false]);
}

#[test]
fn reorder_follows_the_logical_order() {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let y = f.unary(UnaryOp::Exp, Operand::Tensor(x)).unwrap();
    f.add_output(y).unwrap();
    f.split(y, 1, 4, true).unwrap(); // [i0, i1/4, 4]
    f.reorder(y, &[(2, 0)]).unwrap(); // [4, i0, i1/4]
    let ld = f.tvs[y].loop_domain.clone();
    let r = domain::reorder_allocation_ids(&f, y, &ld).expect("reordered");
    assert_eq!(extents(&f, &r), ["i0", "ceilDiv(i1, 4)", "4"]);
    assert!(domain::reorder_allocation_ids(&f, y, &r).is_none(), "already in order");
}

#[test]
fn indexed_producer_patch_replaces_derived_ids() {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let idx = f.define_tensor(&[-1], DataType::Int, None).unwrap();
    let t1 = f.unary(UnaryOp::Exp, Operand::Tensor(x)).unwrap();
    let t2 = f.index_select(t1, idx, 0).unwrap();
    f.add_output(t2).unwrap();
    f.split(t1, 0, 4, true).unwrap();
    let ld = f.tvs[t1].loop_domain.clone();
    let patched = domain::patch_indexed_producer(&f, t1, &ld).unwrap().unwrap();
    assert_eq!(patched, vec![f.tvs[t1].logical[0], ld[2]]);
    // Without any id covering the indexed one the patch is an error, not a guess.
    let e = domain::patch_indexed_producer(&f, t1, &ld[2..]).unwrap_err();
    assert!(e.message.contains("T2") && e.message.contains("iS"), "{}", e.message);
}

#[test]
fn grid_reduction_summary_and_top_level_allocations() {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let s = f.reduction(ReductionOp::Sum, x, &[0], false, None).unwrap();
    f.add_output(s).unwrap();
    f.split(s, 0, 8, true).unwrap();
    f.parallelize(s, 0, ParallelType::BIDx).unwrap();
    f.parallelize(s, 1, ParallelType::TIDx).unwrap();
    f.parallelize(s, 2, ParallelType::BIDy).unwrap();
    let k = lower(&f).unwrap();
    let g = &k.summary.global_allocations;
    assert_eq!(g.len(), 2);
    assert!(k.summary.has_grid_reduction);
    assert!(!g[0].zero_init && !g[0].resets_to_zero && g[1].zero_init && g[1].resets_to_zero);
    assert_eq!(g[1].dtype, DataType::Int);
    let tops = k.body.iter().take_while(|n| matches!(n, Node::Alloc(_))).count();
    assert_eq!(tops, 2, "work buffer and semaphore are allocated at the top level");
}

#[test]
fn loop_nest_shares_loops_of_inlined_producers() {
    let (f, _, _) = chain(2, false);
    let k = lower(&f).unwrap();
    let text = k.to_text();
    assert_eq!(text.matches("FOR blockIdx.x").count(), 1, "{text}");
    assert_eq!(text.matches("FOR threadIdx.x").count(), 1, "{text}");
    assert_eq!(text.matches("FOR idx").count(), 2, "each tensor keeps its own serial loop: {text}");
}

/// A transpose through a Shared tile T2 (`snapshots::f_transpose`); with `serial_tiles` the
/// tiles along the input's rows are a serial loop of each block instead of `blockIdx.x`, so
/// the loop writes T2 again after other threads read it.
fn shared_transpose(serial_tiles: bool) -> Kernel {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let t = f.permute(x, &[1, 0]).unwrap();
    f.add_output(t).unwrap();
    let s = f.cache_before(t).unwrap();
    f.set_memory_type(s, MemoryType::Shared).unwrap();
    for (tv, order) in [(t, &[(1, 2)][..]), (s, &[(1, 3), (3, 2)][..])] {
        f.split(tv, 0, 32, true).unwrap();
        f.split(tv, 2, 32, true).unwrap();
        f.reorder(tv, order).unwrap();
        f.merge(tv, 2, 3).unwrap();
        f.split(tv, 2, 4, true).unwrap();
        f.parallelize(tv, 0, ParallelType::BIDy).unwrap();
        if !serial_tiles {
            f.parallelize(tv, 1, ParallelType::BIDx).unwrap();
        }
        f.parallelize(tv, 2, ParallelType::TIDx).unwrap();
    }
    f.parallelize(t, 3, ParallelType::Vectorize).unwrap();
    f.inline_at(s, 2).unwrap();
    lower(&completed(&f)).unwrap()
}

/// The verifier on a lowered kernel's (edited) body, at the end of the pipeline.
fn verify_body(k: &Kernel, body: &[Node]) -> crate::error::Result<()> {
    let stage = verify::Stage { indexed: true, allocated: true, synced: true, pipelined: true };
    verify::run(&k.fusion, &k.loops, &IdGraph::exact(&k.fusion), body, stage, "vectorize")
}

/// `body` with every barrier of `kind` replaced by what `with` makes of it.
fn replace_syncs(body: &[Node], kind: SyncKind, with: &dyn Fn() -> Vec<Node>) -> Vec<Node> {
    let mut out = Vec::new();
    for n in body {
        if matches!(n, Node::Sync(k) if *k == kind) {
            out.extend(with());
            continue;
        }
        let mut n = n.clone();
        for b in n.bodies_mut() {
            *b = replace_syncs(b, kind, with);
        }
        out.push(n);
    }
    out
}

fn count_syncs(body: &[Node], kind: SyncKind) -> usize {
    body.iter()
        .map(|n| {
            usize::from(matches!(n, Node::Sync(k) if *k == kind))
                + n.bodies().into_iter().map(|b| count_syncs(b, kind)).sum::<usize>()
        })
        .sum()
}

#[test]
fn verifier_requires_a_barrier_between_a_shared_write_and_cross_thread_reads() {
    let mut k = shared_transpose(false);
    assert_eq!(count_syncs(&k.body, SyncKind::Raw), 1, "{}", k.to_text());
    verify_body(&k, &k.body).unwrap();
    let e = verify_body(&k, &replace_syncs(&k.body, SyncKind::Raw, &Vec::new)).unwrap_err();
    assert!(e.message.contains("kernel IR after vectorize: T2 (Shared memory)"), "{}", e.message);
    assert!(e.message.contains("(RAW)") && e.message.contains("`T1 = set(T2)`"), "{}", e.message);
    // A barrier that only one arm of a branch runs does not separate them; one in both does.
    let cond = k.fusion.scalars.boolean(true);
    let branch = |otherwise: Vec<Node>| {
        move || {
            vec![Node::If(IfThenElse {
                cond,
                kind: IfKind::InvariantBounds,
                then: vec![Node::Sync(SyncKind::Raw)],
                otherwise: otherwise.clone(),
            })]
        }
    };
    let e = verify_body(&k, &replace_syncs(&k.body, SyncKind::Raw, &branch(Vec::new()))).unwrap_err();
    assert!(e.message.contains("T2") && e.message.contains("(RAW)"), "{}", e.message);
    verify_body(&k, &replace_syncs(&k.body, SyncKind::Raw, &branch(vec![Node::Sync(SyncKind::Raw)]))).unwrap();
}

#[test]
fn verifier_requires_a_barrier_before_a_serial_loop_overwrites_shared_memory() {
    let k = shared_transpose(true);
    assert_eq!(count_syncs(&k.body, SyncKind::War), 1, "{}", k.to_text());
    verify_body(&k, &k.body).unwrap();
    let e = verify_body(&k, &replace_syncs(&k.body, SyncKind::War, &Vec::new)).unwrap_err();
    assert!(e.message.contains("kernel IR after vectorize: T2 (Shared memory)"), "{}", e.message);
    assert!(e.message.contains("(WAR)") && e.message.contains("next iteration of loop"), "{}", e.message);
    // The WAR barrier ends the loop body: it does not order this iteration's read after
    // this iteration's write.
    let e = verify_body(&k, &replace_syncs(&k.body, SyncKind::Raw, &Vec::new)).unwrap_err();
    assert!(e.message.contains("T2") && e.message.contains("(RAW)"), "{}", e.message);
}

/// Row sums of `x` [R, C] on [BIDx, C/32 serial, 32 TIDx]: `sum(x)` and, with `dependent`,
/// `sum(x - sum(x))` (which reads the first), else `sum(x * x)` (which does not).
fn two_row_sums(dependent: bool) -> Fusion {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let s1 = f.reduction(ReductionOp::Sum, x, &[1], false, None).unwrap();
    let y = if dependent {
        let b = f.broadcast(s1, vec![false, true]).unwrap();
        f.binary(crate::ir::BinaryOp::Sub, Operand::Tensor(x), Operand::Tensor(b)).unwrap()
    } else {
        f.binary(crate::ir::BinaryOp::Mul, Operand::Tensor(x), Operand::Tensor(x)).unwrap()
    };
    let s2 = f.reduction(ReductionOp::Sum, y, &[1], false, None).unwrap();
    f.add_output(s1).unwrap();
    f.add_output(s2).unwrap();
    for t in [s1, y, s2] {
        f.split(t, 1, 32, true).unwrap();
        f.parallelize(t, 0, ParallelType::BIDx).unwrap();
        f.parallelize(t, 2, ParallelType::TIDx).unwrap();
    }
    if dependent {
        // The row's sum, broadcast: read by every element of the second pass.
        let b = f.tvs[y].definition.and_then(|d| f.exprs[d].inputs[1].tensor()).unwrap();
        f.parallelize(b, 0, ParallelType::BIDx).unwrap();
        f.inline_at(b, -1).unwrap();
    }
    f.inline_at(y, -1).unwrap();
    f
}

/// Serial loops (of more than one step) directly inside the kernel's block loops: passes
/// over a row.
fn row_passes(k: &Kernel) -> usize {
    k.body
        .iter()
        .filter_map(|n| match n {
            Node::Loop(b) if b.parallel == ParallelType::BIDx => Some(b),
            _ => None,
        })
        .map(|b| {
            let pass = |n: &&Node| {
                matches!(n, Node::Loop(l) if l.parallel == ParallelType::Serial && k.fusion.scalars.as_int(l.extent) != Some(1))
            };
            b.body.iter().filter(pass).count()
        })
        .sum()
}

#[test]
fn sibling_row_loops_fuse_and_dependent_ones_do_not() {
    let k = lower(&two_row_sums(false)).unwrap();
    assert_eq!(row_passes(&k), 1, "independent sums of one row share one loop");
    verify_body(&k, &k.body).unwrap();
    let k = lower(&two_row_sums(true)).unwrap();
    assert_eq!(row_passes(&k), 2, "a sum that reads the other's result keeps its own pass");
    verify_body(&k, &k.body).unwrap();
}

/// A transpose tile read by an element-wise epilogue (`neg(permute(x))` computed into a Local
/// tensor that a vectorized store writes) is laid out as the store reads it, rows padded
/// by one bank: the epilogue's reads walk its rows, not its columns 32 floats apart.
#[test]
fn transpose_tile_read_by_an_epilogue_is_padded_like_a_copied_one() {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let t = f.permute(x, &[1, 0]).unwrap();
    let o = f.unary(UnaryOp::Neg, Operand::Tensor(t)).unwrap();
    f.add_output(o).unwrap();
    let c = f.cache_before(o).unwrap();
    f.set_memory_type(t, MemoryType::Shared).unwrap();
    for (tv, order) in [(o, &[(1, 2)][..]), (c, &[(1, 2)][..]), (t, &[(1, 3), (3, 2)][..])] {
        f.split(tv, 0, 32, true).unwrap();
        f.split(tv, 2, 32, true).unwrap();
        f.reorder(tv, order).unwrap();
        f.merge(tv, 2, 3).unwrap();
        f.split(tv, 2, 4, true).unwrap();
        f.parallelize(tv, 0, ParallelType::BIDy).unwrap();
        f.parallelize(tv, 1, ParallelType::BIDx).unwrap();
        f.parallelize(tv, 2, ParallelType::TIDx).unwrap();
    }
    f.parallelize(o, 3, ParallelType::Vectorize).unwrap();
    f.inline_at(t, 2).unwrap();
    f.inline_at(c, 3).unwrap();
    let text = lower(&completed(&f)).unwrap().to_text();
    assert!(text.contains(&format!("ALLOCATE T{} Shared float [32, 33]", t.as_u32())), "{text}");
    // The epilogue reads a row of the tile: consecutive elements along the store's vector.
    assert!(text.contains("<- [threadIdx.x / 8 * 33 + (threadIdx.x % 8 * 4 + idx"), "{text}");
}
