//! Interpreter speed: a 1M-element pointwise fusion (x -> exp -> *2 -> relu, merged,
//! split [BIDx, TIDx 128, 4], producers inlined), run through `interp::execute`.
//! Prints interpreted thread-instructions (Expr/Init executions summed over threads)
//! per second.

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion};
use kiln::interp::{execute_stats, Data, HostTensor, HostValue};
use kiln::ir::{BinaryOp, DataType, Fusion, Operand, ParallelType, UnaryOp};
use kiln::kernel::Kernel;

const N: usize = 1 << 20;

fn kernel() -> Kernel {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1], DataType::Float, None).unwrap();
    let a = f.unary(UnaryOp::Exp, Operand::Tensor(x)).unwrap();
    let two = f.scalars.float(2.0);
    let b = f.binary(BinaryOp::Mul, Operand::Tensor(a), Operand::Scalar(two)).unwrap();
    let c = f.unary(UnaryOp::Relu, Operand::Tensor(b)).unwrap();
    f.add_output(c).unwrap();
    for t in [a, b, c] {
        f.split(t, 0, 512, true).unwrap();
        f.split(t, 1, 4, true).unwrap();
        f.parallelize(t, 0, ParallelType::BIDx).unwrap();
        f.parallelize(t, 1, ParallelType::TIDx).unwrap();
    }
    f.inline_at(a, -1).unwrap();
    f.inline_at(b, -1).unwrap();
    kiln::lower::lower(&f).unwrap()
}

fn inputs() -> Vec<HostValue> {
    let v: Vec<f32> = (0..N).map(|i| (i % 1000) as f32 * 1e-3).collect();
    vec![HostValue::Tensor(HostTensor::contiguous(Data::F32(v), vec![N]))]
}

fn bench(c: &mut Criterion) {
    let k = kernel();
    // One timed run for the headline figure.
    let t0 = Instant::now();
    let (_, stats) = execute_stats(&k, inputs()).unwrap();
    let dt = t0.elapsed().as_secs_f64();
    println!(
        "interp: {} threads, {} thread-instructions in {:.3} s = {:.1} M thread-instructions/s",
        stats.threads,
        stats.thread_instructions,
        dt,
        stats.thread_instructions as f64 / dt / 1e6
    );
    let mut g = c.benchmark_group("interp");
    g.sample_size(10);
    g.bench_function("pointwise_1M", |b| {
        b.iter_batched(inputs, |inp| black_box(execute_stats(&k, inp).unwrap()), criterion::BatchSize::LargeInput)
    });
    g.finish();
    let (_, stats) = execute_stats(&k, inputs()).unwrap();
    let t0 = Instant::now();
    let reps = 3;
    for _ in 0..reps {
        black_box(execute_stats(&k, inputs()).unwrap());
    }
    let dt = t0.elapsed().as_secs_f64() / reps as f64;
    println!(
        "interp (mean of {reps}): {:.1} M thread-instructions/s ({:.0} ns per thread-instruction)",
        stats.thread_instructions as f64 / dt / 1e6,
        dt * 1e9 / stats.thread_instructions as f64
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
