use crate::ir::{BinaryOp, DataType, Fusion, IterType, Operand, ParallelType, ReductionOp, TvId};

fn pointwise_2d() -> (Fusion, TvId, TvId) {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let y = f.binary(BinaryOp::Add, Operand::Tensor(x), Operand::Tensor(x)).unwrap();
    f.add_output(y).unwrap();
    (f, x, y)
}

fn extents(f: &Fusion, t: TvId) -> Vec<String> {
    f.tvs[t].loop_domain.iter().map(|&id| f.scalars.render(f.ids[id].extent)).collect()
}

#[test]
fn arena_ids_are_dense_and_typed() {
    let (f, x, y) = pointwise_2d();
    assert_eq!(x.as_u32(), 0);
    assert_eq!(y.as_u32(), 1);
    assert_eq!(f.tvs.len(), 2);
    assert_eq!(f.exprs.len(), 1);
    assert_eq!(f.tvs[y].definition.map(|e| e.as_u32()), Some(0));
    assert_eq!(f.tvs[x].uses.len(), 1);
    // Cloning a fusion is a plain copy: editing the clone leaves the original alone.
    let mut g = f.clone();
    g.split(y, 1, 4, true).unwrap();
    assert_eq!(f.tvs[y].loop_domain.len(), 2);
    assert_eq!(g.tvs[y].loop_domain.len(), 3);
}

#[test]
fn split_extents_including_non_divisible() {
    let (mut f, _, y) = pointwise_2d();
    f.split(y, 1, 128, true).unwrap();
    assert_eq!(extents(&f, y), ["i0", "ceilDiv(i1, 128)", "128"]);
    f.split(y, 0, 3, false).unwrap();
    assert_eq!(extents(&f, y), ["3", "ceilDiv(i0, 3)", "ceilDiv(i1, 128)", "128"]);
    // A static, non-divisible extent folds to a constant.
    let mut g = Fusion::new();
    let x = g.define_tensor(&[10], DataType::Float, None).unwrap();
    let z = g.unary(crate::ir::UnaryOp::Exp, Operand::Tensor(x)).unwrap();
    g.split(z, 0, 4, true).unwrap();
    assert_eq!(extents(&g, z), ["3", "4"]);
    g.split(z, 0, 1, true).unwrap();
    assert_eq!(extents(&g, z), ["3", "1", "4"]);
}

#[test]
fn merge_extents_and_split_back() {
    let (mut f, _, y) = pointwise_2d();
    f.split(y, 1, 4, true).unwrap();
    f.merge(y, 0, 1).unwrap();
    assert_eq!(extents(&f, y), ["i0 * ceilDiv(i1, 4)", "4"]);
    let mut g = Fusion::new();
    let x = g.define_tensor(&[4, 8], DataType::Float, None).unwrap();
    let z = g.unary(crate::ir::UnaryOp::Exp, Operand::Tensor(x)).unwrap();
    g.merge(z, 0, 1).unwrap();
    assert_eq!(extents(&g, z), ["32"]);
    g.split(z, 0, 8, true).unwrap();
    assert_eq!(extents(&g, z), ["4", "8"]);
}

#[test]
fn merge_of_non_adjacent_axes_takes_outer_position() {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[2, 3, 5], DataType::Float, None).unwrap();
    let z = f.unary(crate::ir::UnaryOp::Exp, Operand::Tensor(x)).unwrap();
    f.merge(z, 0, 2).unwrap();
    assert_eq!(extents(&f, z), ["10", "3"]);
}

#[test]
fn reorder_moves_listed_axes_and_keeps_the_rest_in_order() {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[2, 3, 5, 7], DataType::Float, None).unwrap();
    let z = f.unary(crate::ir::UnaryOp::Exp, Operand::Tensor(x)).unwrap();
    f.reorder(z, &[(0, 3)]).unwrap();
    assert_eq!(extents(&f, z), ["3", "5", "7", "2"]);
    f.reorder(z, &[(-1, 0), (0, -1)]).unwrap();
    assert_eq!(extents(&f, z), ["2", "5", "7", "3"]);
    assert!(f.reorder(z, &[(0, 1), (2, 1)]).is_err());
    assert!(f.reorder(z, &[(4, 0)]).is_err());
    assert_eq!(extents(&f, z), ["2", "5", "7", "3"], "a failed reorder leaves the domain alone");
}

#[test]
fn merging_reduction_with_iteration_is_rejected() {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let s = f.reduction(ReductionOp::Sum, x, &[1], false, None).unwrap();
    let err = f.merge(s, 0, 1).unwrap_err();
    assert!(err.message.contains("T1") && err.message.contains("axis 1"), "{}", err.message);
    assert_eq!(f.ids[f.tvs[s].loop_domain[1]].iter_type, IterType::Reduction);
}

#[test]
fn parallel_types_are_validated() {
    let (mut f, _, y) = pointwise_2d();
    f.parallelize(y, 0, ParallelType::TIDx).unwrap();
    let e = f.parallelize(y, 1, ParallelType::TIDx).unwrap_err();
    assert!(e.message.contains("axis 1") && e.message.contains("axis 0"), "{}", e.message);
    let e = f.parallelize(y, 1, ParallelType::Vectorize).unwrap_err();
    assert!(e.message.contains("symbolic"), "{}", e.message);
    f.split(y, 1, 4, true).unwrap();
    let e = f.parallelize(y, 1, ParallelType::Vectorize).unwrap_err();
    assert!(e.message.contains("innermost"), "{}", e.message);
    f.parallelize(y, 2, ParallelType::Vectorize).unwrap();
    assert!(f.reorder(y, &[(2, 1)]).is_err(), "vectorized axis must stay innermost");
}

#[test]
fn inline_checks_consumer_structure_and_reductions() {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let a = f.unary(crate::ir::UnaryOp::Exp, Operand::Tensor(x)).unwrap();
    let b = f.unary(crate::ir::UnaryOp::Neg, Operand::Tensor(a)).unwrap();
    f.add_output(b).unwrap();
    f.split(a, 1, 4, true).unwrap();
    f.split(b, 1, 8, true).unwrap();
    f.inline_at(a, 1).unwrap();
    let e = f.inline_at(a, 2).unwrap_err();
    assert!(e.message.contains("axis 1"), "{}", e.message);
    f.inline_at(a, -1).unwrap();
    assert_eq!(f.tvs[a].inline_pos, 1, "split by 4 vs split by 8: only axis 0 is shared");
    // Once inlined, the shared axes are frozen on both sides.
    assert!(f.split(a, 0, 2, true).is_err());
    assert!(f.split(b, 0, 2, true).is_err());
    assert!(f.split(b, 1, 2, true).is_ok());
    // Same split on both sides: the deepest position covers all of them.
    let mut g = Fusion::new();
    let x = g.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let a = g.unary(crate::ir::UnaryOp::Exp, Operand::Tensor(x)).unwrap();
    let s = g.reduction(ReductionOp::Sum, a, &[1], false, None).unwrap();
    g.add_output(s).unwrap();
    g.split(a, 1, 32, true).unwrap();
    g.split(s, 1, 32, true).unwrap();
    g.inline_at(a, -1).unwrap();
    assert_eq!(g.tvs[a].inline_pos, 3);
    // A producer whose reduction axis is outer cannot be inlined past it.
    let r = g.reduction(ReductionOp::Sum, x, &[0], false, None).unwrap();
    let n = g.unary(crate::ir::UnaryOp::Neg, Operand::Tensor(r)).unwrap();
    g.add_output(n).unwrap();
    let e = g.inline_at(r, 1).unwrap_err();
    assert!(e.message.contains("reduction") && e.message.contains("axis 0"), "{}", e.message);
}

#[test]
fn cache_before_moves_the_definition() {
    let (mut f, _, y) = pointwise_2d();
    f.split(y, 1, 4, true).unwrap();
    let c = f.cache_before(y).unwrap();
    assert_eq!(f.tvs[c].definition, Some(crate::ir::ExprId::from_u32(0)));
    assert_eq!(f.exprs[f.tvs[y].definition.unwrap()].op, crate::ir::Op::Set);
    assert_eq!(extents(&f, c), ["i0", "ceilDiv(i1, 4)", "4"], "the cache replays y's loop transforms");
    let order = f.topo_exprs();
    assert_eq!(order.len(), 2);
    assert_eq!(f.exprs[order[1]].output, y);
}

#[test]
fn allocation_domain_must_cover_logical() {
    let (mut f, _, y) = pointwise_2d();
    f.split(y, 1, 4, true).unwrap();
    let ld = f.tvs[y].loop_domain.clone();
    let e = f.set_allocation_domain(y, &[ld[0], ld[1]], &[Some(true), Some(true)]).unwrap_err();
    assert!(e.message.contains("T1"), "{}", e.message);
    // An output's layout is an order of its logical axes, not of split loop axes.
    let e = f.set_allocation_domain(y, &[ld[1], ld[2], ld[0]], &[Some(true), Some(true), Some(false)]).unwrap_err();
    assert!(e.message.contains("is not one of its logical axes"), "{}", e.message);
    let logical = f.tvs[y].logical.clone();
    f.set_allocation_domain(y, &[logical[1], logical[0]], &[Some(true), Some(true)]).unwrap();
    assert_eq!(f.tvs[y].allocation.as_ref().unwrap().len(), 2);
}
