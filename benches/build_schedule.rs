//! Compiler-side speed: build a 1,000-op fusion and schedule every tensor of it.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use kiln::ir::{BinaryOp, DataType, Fusion, Operand, ParallelType, ReductionOp, TvId, UnaryOp};
use kiln::lower::lower;

fn build(n_ops: usize) -> (Fusion, Vec<TvId>) {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let b = f.define_tensor(&[1, -1], DataType::Float, None).unwrap();
    let mut cur = x;
    let mut tvs = Vec::with_capacity(n_ops);
    for i in 0..n_ops {
        cur = if i % 3 == 0 {
            f.binary(BinaryOp::Add, Operand::Tensor(cur), Operand::Tensor(b)).unwrap()
        } else if i % 3 == 1 {
            f.unary(UnaryOp::Tanh, Operand::Tensor(cur)).unwrap()
        } else {
            let c = f.scalars.float(0.5);
            f.binary(BinaryOp::Mul, Operand::Tensor(cur), Operand::Scalar(c)).unwrap()
        };
        tvs.push(cur);
    }
    f.add_output(cur).unwrap();
    (f, tvs)
}

fn schedule(f: &mut Fusion, tvs: &[TvId]) {
    for &t in tvs {
        f.merge(t, 0, 1).unwrap();
        f.split(t, 0, 128, true).unwrap();
        f.split(t, 1, 4, true).unwrap();
        f.parallelize(t, 0, ParallelType::BIDx).unwrap();
        f.parallelize(t, 1, ParallelType::TIDx).unwrap();
        f.parallelize(t, 2, ParallelType::Vectorize).unwrap();
    }
    // Inline producers last-to-first is not needed: each producer checks against its consumer's final loop.
    for &t in &tvs[..tvs.len() - 1] {
        f.inline_at(t, -1).unwrap();
    }
}

/// 50 pointwise ops then a row sum, scheduled [BIDx, serial, TIDx] and inlined.
fn pointwise_reduction(n_ops: usize) -> Fusion {
    let (mut f, mut tvs) = build(n_ops);
    let last = *tvs.last().unwrap();
    f.outputs.clear();
    let s = f.reduction(ReductionOp::Sum, last, &[1], false, None).unwrap();
    f.add_output(s).unwrap();
    tvs.push(s);
    for &t in &tvs {
        f.split(t, 1, 128, true).unwrap();
        f.parallelize(t, 0, ParallelType::BIDx).unwrap();
        f.parallelize(t, 2, ParallelType::TIDx).unwrap();
    }
    for &t in &tvs[..tvs.len() - 1] {
        f.inline_at(t, -1).unwrap();
    }
    f
}

fn bench(c: &mut Criterion) {
    let f = pointwise_reduction(50);
    c.bench_function("lower 50-op pointwise + reduction", |bch| bch.iter(|| black_box(lower(black_box(&f)).unwrap())));
    c.bench_function("build 1000 ops", |bch| bch.iter(|| black_box(build(1000))));
    c.bench_function("build + schedule 1000 ops", |bch| {
        bch.iter(|| {
            let (mut f, tvs) = build(1000);
            schedule(&mut f, &tvs);
            black_box(f)
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
