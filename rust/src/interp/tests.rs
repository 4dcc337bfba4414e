//! Interpreter tests: results against plain Rust references, and planted bugs (kernel
//! IR mutations) that each checker must catch.

use super::*;
use crate::ir::{DataType, Fusion, MemoryType, Operand, ParallelType, ReductionOp, UnaryOp};
use crate::kernel::{AllocTarget, Node, SyncKind};
use crate::lower::lower;

fn f32s(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7919) % 101) as f32 * 0.01 - 0.5).collect()
}

fn input(v: Vec<f32>, shape: Vec<usize>) -> HostValue {
    HostValue::Tensor(HostTensor::contiguous(Data::F32(v), shape))
}

fn out_f32(t: &HostTensor) -> Vec<f32> {
    match t.to_row_major() {
        Data::F32(v) => v,
        d => panic!("expected f32, got {:?}", d.dtype()),
    }
}

fn close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "element {i}: {x} vs {y}");
    }
}

/// x -> exp -> neg, each [BIDx, TIDx 32, 4], exp inlined at 2 (Local [4]).
fn chain() -> Fusion {
    crate::lower::tests::chain(2, false).0
}

/// A Shared cache of x read transposed: y[i, j] = x[j, i] through a Shared tile with
/// one TIDx per element, so threads read what other threads wrote.
fn shared_transpose() -> Fusion {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let t = f.permute(x, &[1, 0]).unwrap();
    f.add_output(t).unwrap();
    let s = f.cache_before(t).unwrap();
    f.set_memory_type(s, MemoryType::Shared).unwrap();
    // s: [j, i] -> merge -> TIDx; t: [i, j] -> merge -> TIDx: other threads read.
    f.reorder(t, &[(0, 1)]).unwrap();
    for tv in [s, t] {
        f.merge(tv, 0, 1).unwrap();
        f.parallelize(tv, 0, ParallelType::TIDx).unwrap();
    }
    f
}

fn first_node<'a>(body: &'a mut [Node], pred: &dyn Fn(&Node) -> bool) -> Option<&'a mut Node> {
    for n in body.iter_mut() {
        if pred(n) {
            return Some(n);
        }
        for b in n.bodies_mut() {
            if let Some(x) = first_node(b, pred) {
                return Some(x);
            }
        }
    }
    None
}

#[test]
fn pointwise_chain_matches_reference() {
    let k = lower(&chain()).unwrap();
    let x = f32s(1000);
    let (outs, stats) = execute_stats(&k, vec![input(x.clone(), vec![1000])]).unwrap();
    let want: Vec<f32> = x.iter().map(|v| -v.exp()).collect();
    close(&out_f32(&outs[0]), &want);
    assert_eq!(stats.threads, 8 * 32);
    assert_eq!(stats.thread_instructions, 2000);
}

#[test]
fn block_reduction_matches_reference() {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let s = f.reduction(ReductionOp::Sum, x, &[1], false, None).unwrap();
    f.add_output(s).unwrap();
    f.split(s, 1, 32, true).unwrap();
    f.parallelize(s, 0, ParallelType::BIDx).unwrap();
    f.parallelize(s, 2, ParallelType::TIDx).unwrap();
    let acc = f.cache_before(s).unwrap();
    f.parallelize(s, 0, ParallelType::BIDx).unwrap();
    f.inline_at(acc, 1).unwrap();
    let k = lower(&f).unwrap();
    let (r, c) = (5, 77);
    let x = f32s(r * c);
    let outs = execute(&k, vec![input(x.clone(), vec![r, c])]).unwrap();
    let want: Vec<f32> = (0..r).map(|i| x[i * c..(i + 1) * c].iter().sum()).collect();
    close(&out_f32(&outs[0]), &want);
}

fn column_sum(serial: bool) -> Fusion {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let s = f.reduction(ReductionOp::Sum, x, &[0], false, None).unwrap();
    f.add_output(s).unwrap();
    f.split(s, 0, 4, true).unwrap();
    f.split(s, 2, 16, true).unwrap();
    f.parallelize(s, 0, ParallelType::BIDx).unwrap();
    f.parallelize(s, 2, ParallelType::BIDy).unwrap();
    f.parallelize(s, 3, ParallelType::TIDx).unwrap();
    if serial {
        f.set_serial_grid_reduction(s).unwrap();
    }
    f
}

#[test]
fn grid_reduction_matches_reference_and_checks_the_semaphore() {
    for serial in [false, true] {
        let k = lower(&column_sum(serial)).unwrap();
        let (r, c) = (37, 41);
        let x = f32s(r * c);
        let outs = execute(&k, vec![input(x.clone(), vec![r, c])]).unwrap();
        let want: Vec<f32> = (0..c).map(|j| (0..r).map(|i| x[i * c + j]).sum()).collect();
        close(&out_f32(&outs[0]), &want);
    }
    // Planted bug: a semaphore that is not zeroed.
    let k = lower(&column_sum(false)).unwrap();
    let mut b = Bindings { kernel_name: "k".into(), extents: vec![8, 16], ..Bindings::default() };
    b.scalars.clear();
    let bufs = |sync: Buffer| {
        vec![
            Buffer::new(Data::F32(vec![1.0; 128])),
            Buffer::unwritten(DataType::Float, 16),
            Buffer::unwritten(DataType::Float, 2 * 16),
            sync,
        ]
    };
    let mut ok = bufs(Buffer::new(Data::I64(vec![0])));
    run_kernel(&k, &b, &mut ok).unwrap();
    assert_eq!(ok[1].data, Data::F32(vec![8.0; 16]));
    let mut bad = bufs(Buffer::new(Data::I64(vec![3])));
    let e = run_kernel(&k, &b, &mut bad).unwrap_err();
    assert!(e.message.contains("semaphore not zeroed") && e.message.contains("T1_sync[0]"), "{e}");
    let mut unzeroed = bufs(Buffer::unwritten(DataType::Int, 1));
    let e = run_kernel(&k, &b, &mut unzeroed).unwrap_err();
    assert!(e.message.contains("semaphore not zeroed"), "{e}");
}

#[test]
fn shrunk_allocation_is_out_of_bounds() {
    let mut k = lower(&chain()).unwrap();
    let n = first_node(&mut k.body, &|n| matches!(n, Node::Alloc(a) if a.memory == MemoryType::Local)).unwrap();
    let Node::Alloc(a) = n else { unreachable!() };
    a.shape = vec![k.fusion.scalars.int(3)];
    let e = execute(&k, vec![input(f32s(1000), vec![1000])]).unwrap_err();
    let m = &e.message;
    assert!(m.contains("out-of-bounds write of T1 (Local memory) at index 3"), "{m}");
    assert!(m.contains("allocation has 3 elements"), "{m}");
    assert!(m.contains("thread (0, 0, 0) of block (0, 0, 0)"), "{m}");
    assert!(m.starts_with("kernel kernel0:"), "{m}");
}

#[test]
fn skipped_init_is_an_uninitialized_read() {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let s = f.reduction(ReductionOp::Sum, x, &[1], false, None).unwrap();
    f.add_output(s).unwrap();
    let mut k = lower(&f).unwrap();
    let n = first_node(&mut k.body, &|n| matches!(n, Node::Loop(l) if l.init_axis.is_some())).unwrap();
    let Node::Loop(l) = n else { unreachable!() };
    l.body.clear();
    let e = execute(&k, vec![input(f32s(12), vec![3, 4])]).unwrap_err();
    assert!(e.message.contains("read of uninitialized memory: T1 (Global memory) at index 0"), "{e}");
}

#[test]
fn shared_exchange_needs_a_barrier() {
    let mut k = lower(&shared_transpose()).unwrap();
    let (r, c) = (5, 6);
    let x = f32s(r * c);
    let args = || vec![input(x.clone(), vec![r, c])];
    // As lowered: no barrier between the Shared write and the transposed read.
    let has_sync = |b: &mut [Node]| first_node(b, &|n| matches!(n, Node::Sync(_))).is_some();
    if !has_sync(&mut k.body) {
        let e = execute(&k, args()).unwrap_err();
        let m = &e.message;
        assert!(m.contains("Shared memory race on T2"), "{m}");
        assert!(m.contains("thread (") && m.contains("block (0, 0, 0)"), "{m}");
        // Insert the barrier before the consumer's loop: then it runs and is right.
        let pos = k.body.iter().rposition(|n| matches!(n, Node::Loop(_))).unwrap();
        k.body.insert(pos, Node::Sync(SyncKind::Raw));
    }
    let outs = execute(&k, args()).unwrap();
    let want: Vec<f32> = (0..c).flat_map(|j| (0..r).map(move |i| (i, j))).map(|(i, j)| x[i * c + j]).collect();
    close(&out_f32(&outs[0]), &want);
    // Planted bug: drop the barrier again.
    let pos = k.body.iter().position(|n| matches!(n, Node::Sync(_))).unwrap();
    k.body.remove(pos);
    let e = execute(&k, args()).unwrap_err();
    assert!(e.message.contains("race"), "{e}");
}

#[test]
fn barrier_in_a_partial_thread_loop_is_divergent() {
    let mut k = lower(&chain()).unwrap();
    // The TIDx loop has extent 32 = blockDim.x; shrink it to 16 and put a barrier inside.
    let n = first_node(&mut k.body, &|n| matches!(n, Node::Loop(l) if l.parallel == ParallelType::TIDx)).unwrap();
    let Node::Loop(l) = n else { unreachable!() };
    l.extent = k.fusion.scalars.int(16);
    l.body.insert(0, Node::Sync(SyncKind::Raw));
    let e = execute(&k, vec![input(f32s(1000), vec![1000])]).unwrap_err();
    assert!(e.message.contains("divergent barrier"), "{e}");
}

#[test]
fn global_buffer_size_mismatch_and_out_of_bounds_input() {
    let k = lower(&chain()).unwrap();
    // A too-short input buffer behind the declared shape.
    let t = HostTensor { data: Data::F32(vec![0.0; 10]), shape: vec![20], strides: vec![1] };
    let e = execute(&k, vec![HostValue::Tensor(t)]).unwrap_err();
    assert!(e.message.contains("reach past"), "{e}");
    // The kernel itself reading past a Global input.
    let b = Bindings { kernel_name: "k".into(), extents: vec![20], ..Bindings::default() };
    let mut bufs = vec![Buffer::new(Data::F32(vec![0.0; 10])), Buffer::unwritten(DataType::Float, 20)];
    let e = run_kernel(&k, &b, &mut bufs).unwrap_err();
    assert!(
        e.message
            .contains("out-of-bounds read of T0 (Global memory) at index 12; the allocation has 10 elements; by thread (3, 0, 0) of block (0, 0, 0)"),
        "{e}"
    );
}

#[test]
fn dtypes_cast_and_wrap() {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1], DataType::Half, None).unwrap();
    let y = f.unary(UnaryOp::Sigmoid, Operand::Tensor(x)).unwrap();
    let z = f.cast(Operand::Tensor(y), DataType::Int32).unwrap();
    f.add_output(y).unwrap();
    f.add_output(z).unwrap();
    let k = lower(&f).unwrap();
    let xs: Vec<half::f16> = [-2.0f32, 0.0, 3.0].iter().map(|&v| half::f16::from_f32(v)).collect();
    let outs = execute(&k, vec![HostValue::Tensor(HostTensor::contiguous(Data::F16(xs.clone()), vec![3]))]).unwrap();
    let Data::F16(y) = &outs[0].data else { panic!() };
    for (a, b) in xs.iter().zip(y) {
        let want = half::f16::from_f32(1.0 / (1.0 + (-a.to_f32()).exp()));
        assert_eq!(*b, want);
    }
    assert_eq!(outs[1].data, Data::I32(vec![0, 0, 0]));
    let _ = AllocTarget::Buffer(0);
}

/// x -> exp -> neg over [BIDx, Unswitch 1, TIDx 32, 4] (both fully inlined): the unswitch
/// pass makes `if (the last element of the tile is in range) { unpredicated } else { .. }`.
fn unswitched_chain() -> Fusion {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1], DataType::Float, None).unwrap();
    let a = f.unary(UnaryOp::Exp, Operand::Tensor(x)).unwrap();
    let b = f.unary(UnaryOp::Neg, Operand::Tensor(a)).unwrap();
    f.add_output(b).unwrap();
    for t in [a, b] {
        f.split(t, 0, 128, true).unwrap();
        f.split(t, 1, 4, true).unwrap();
        f.split(t, 0, 1, true).unwrap();
        f.parallelize(t, 0, ParallelType::BIDx).unwrap();
        f.parallelize(t, 1, ParallelType::Unswitch).unwrap();
        f.parallelize(t, 2, ParallelType::TIDx).unwrap();
    }
    f.inline_at(a, 4).unwrap();
    f
}

#[test]
fn unswitched_loops_run_both_arms_and_a_wrong_condition_is_caught() {
    let mut k = lower(&unswitched_chain()).unwrap();
    let is_unswitch = |n: &Node| matches!(n, Node::If(i) if i.kind == crate::kernel::IfKind::Unswitch);
    assert!(first_node(&mut k.body, &is_unswitch).is_some(), "{}", k.to_text());
    // 1000 elements: seven full tiles take the unpredicated arm, the eighth the checked one.
    let x = f32s(1000);
    let outs = execute(&k, vec![input(x.clone(), vec![1000])]).unwrap();
    let want: Vec<f32> = x.iter().map(|v| -v.exp()).collect();
    close(&out_f32(&outs[0]), &want);
    // Planted bug: the unswitch condition always holds, so the last tile runs unpredicated.
    let Some(Node::If(i)) = first_node(&mut k.body, &is_unswitch) else { unreachable!() };
    i.cond = k.fusion.scalars.boolean(true);
    let e = execute(&k, vec![input(x, vec![1000])]).unwrap_err();
    assert!(e.message.contains("out-of-bounds read of T0 (Global memory) at index 1000"), "{e}");
}

/// y = x copied through a Local cache over [BIDx, TIDx 32, Vectorize 4].
fn vector_copy() -> Fusion {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1], DataType::Float, None).unwrap();
    let y = f.unary(UnaryOp::Neg, Operand::Tensor(x)).unwrap();
    f.add_output(y).unwrap();
    let c = f.cache_after(x).unwrap();
    for t in [c, y] {
        f.split(t, 0, 128, true).unwrap();
        f.split(t, 1, 4, true).unwrap();
        f.parallelize(t, 0, ParallelType::BIDx).unwrap();
        f.parallelize(t, 1, ParallelType::TIDx).unwrap();
    }
    f.parallelize(c, 2, ParallelType::Vectorize).unwrap();
    f.inline_at(c, 2).unwrap();
    f
}

#[test]
fn vector_copies_run_wide_or_fall_back_and_misalignment_is_caught() {
    let mut k = lower(&vector_copy()).unwrap();
    let is_vector = |n: &Node| matches!(n, Node::Vector(_));
    assert!(first_node(&mut k.body, &is_vector).is_some(), "{}", k.to_text());
    let x = f32s(1001);
    let outs = execute(&k, vec![input(x.clone(), vec![1001])]).unwrap();
    let want: Vec<f32> = x.iter().map(|v| -v).collect();
    close(&out_f32(&outs[0]), &want);
    // Planted bug: the Local side claims alignment by construction at an offset of one.
    let Some(Node::Vector(v)) = first_node(&mut k.body, &is_vector) else { unreachable!() };
    let one = k.fusion.scalars.int(1);
    v.out = k.fusion.scalars.add(v.out, one);
    v.access[0] = crate::kernel::VectorAccess::Wide;
    let e = execute(&k, vec![input(x, vec![1001])]).unwrap_err();
    assert!(e.message.contains("misaligned vector access: T"), "{e}");
}

#[test]
fn a_dropped_accumulator_reduction_leaves_the_output_unwritten() {
    // sum over a [BIDx rows, serial 4 x TIDx 32] row: the block reduction is hoisted.
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let s = f.reduction(ReductionOp::Sum, x, &[1], false, None).unwrap();
    f.add_output(s).unwrap();
    f.split(s, 1, 32, true).unwrap();
    f.parallelize(s, 0, ParallelType::BIDx).unwrap();
    f.parallelize(s, 2, ParallelType::TIDx).unwrap();
    let mut k = lower(&f).unwrap();
    let is_reduce = |n: &Node| matches!(n, Node::ReduceAccumulator { .. });
    assert!(first_node(&mut k.body, &is_reduce).is_some(), "{}", k.to_text());
    let x = f32s(3 * 100);
    let outs = execute(&k, vec![input(x.clone(), vec![3, 100])]).unwrap();
    let want: Vec<f32> = (0..3).map(|r| x[r * 100..(r + 1) * 100].iter().sum()).collect();
    close(&out_f32(&outs[0]), &want);
    fn drop_reduce(b: &mut Vec<Node>) {
        b.retain(|n| !matches!(n, Node::ReduceAccumulator { .. }));
        for n in b.iter_mut() {
            for c in n.bodies_mut() {
                drop_reduce(c);
            }
        }
    }
    drop_reduce(&mut k.body);
    let e = execute(&k, vec![input(x, vec![3, 100])]).unwrap_err();
    assert!(e.message.contains("T1") && e.message.contains("never written"), "{e}");
}

/// y = neg(x) over rows streamed through a 3-stage circular buffer of tiles of 32 floats
/// (`prefetch`, default 2), each tile one bulk copy (`bulk`) or one element per thread; y
/// runs a tile on 32 threads.
fn tile_pipeline(bulk: bool, prefetch: Option<i64>) -> Fusion {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let y = f.unary(UnaryOp::Neg, Operand::Tensor(x)).unwrap();
    f.add_output(y).unwrap();
    let c = f.cache_after(x).unwrap();
    f.set_memory_type(c, MemoryType::Shared).unwrap();
    for tv in [c, y] {
        f.split(tv, 1, 32, true).unwrap();
        f.parallelize(tv, 0, ParallelType::BIDx).unwrap();
    }
    f.parallelize(c, 2, if bulk { ParallelType::Bulk } else { ParallelType::TIDx }).unwrap();
    f.parallelize(y, 2, ParallelType::TIDx).unwrap();
    f.inline_at(c, 2).unwrap();
    f.circular_buffer(c, 3, prefetch).unwrap();
    f
}

fn bulk_args() -> (Vec<f32>, Vec<HostValue>) {
    let x = f32s(2 * 200);
    (x.clone(), vec![input(x, vec![2, 200])])
}

/// Apply `edit` to every node of `body` (and their children).
fn edit_all(body: &mut [Node], edit: &mut dyn FnMut(&mut Node)) {
    for n in body.iter_mut() {
        edit(n);
        for b in n.bodies_mut() {
            edit_all(b, edit);
        }
    }
}

#[test]
fn bulk_pipeline_matches_and_planted_barrier_bugs_are_caught() {
    use crate::kernel::{BarrierOp, PipelinePart};
    let k = lower(&tile_pipeline(true, None)).unwrap();
    let (x, args) = bulk_args();
    let want: Vec<f32> = x.iter().map(|v| -v).collect();
    close(&out_f32(&execute(&k, args).unwrap()[0]), &want);

    // The issuer refills a stage without waiting for its readers (write-after-read).
    let mut bad = k.clone();
    edit_all(&mut bad.body, &mut |n| {
        if let Node::BulkLoad(b) = n {
            b.reuse = None;
        }
    });
    let e = execute(&bad, bulk_args().1).unwrap_err();
    assert!(e.message.contains("the bulk copy into T2 (stage 0) overwrites index 0"), "{e}");
    assert!(e.message.contains("write-after-read"), "{e}");

    // The readers do not wait for the bytes of their stage (read-after-write).
    let mut bad = k.clone();
    let mut in_main = false;
    edit_all(&mut bad.body, &mut |n| {
        if let Node::Loop(l) = n {
            in_main = l.pipeline == Some(PipelinePart::Main);
            if in_main {
                l.body.retain(|c| !matches!(c, Node::Barrier(BarrierOp::Wait { .. })));
            }
        }
    });
    let e = execute(&bad, bulk_args().1).unwrap_err();
    assert!(e.message.contains("read of T2 (stage 0) at index 0 before the bulk copy that wrote it completed"), "{e}");
    assert!(e.message.contains("mbarrier mbar0[0]"), "{e}");

    // A wait for the wrong phase never completes.
    let mut bad = k.clone();
    let one = bad.fusion.scalars.int(1);
    let mut done = false;
    edit_all(&mut bad.body, &mut |n| {
        if let Node::Barrier(BarrierOp::Wait { parity, .. }) = n {
            if !done {
                *parity = one;
                done = true;
            }
        }
    });
    let e = execute(&bad, bulk_args().1).unwrap_err();
    assert!(e.message.contains("can never complete"), "{e}");
    assert!(e.message.contains("read-after-write of T2 stage 0"), "{e}");

    // Barriers set up twice without being retired.
    let mut bad = k.clone();
    let init = bad.body.iter().position(|n| matches!(n, Node::Loop(_))).unwrap();
    if let Node::Loop(l) = &mut bad.body[init] {
        let inner = l.body.iter().position(|n| matches!(n, Node::Loop(_))).unwrap();
        let first = l.body[inner].clone();
        l.body.insert(inner, first);
    }
    let e = execute(&bad, bulk_args().1).unwrap_err();
    assert!(e.message.contains("is initialised again before it was invalidated"), "{e}");
}

#[test]
fn plain_pipeline_reads_wait_for_their_asynchronous_copies() {
    use crate::kernel::{CpAsyncOp, PipelinePart};
    let k = lower(&tile_pipeline(false, Some(1))).unwrap();
    let (x, args) = bulk_args();
    let want: Vec<f32> = x.iter().map(|v| -v).collect();
    close(&out_f32(&execute(&k, args).unwrap()[0]), &want);
    // Planted bug: the main loop reads its stage without waiting for the copy's group.
    let mut bad = k.clone();
    edit_all(&mut bad.body, &mut |n| {
        if let Node::Loop(l) = n {
            if l.pipeline == Some(PipelinePart::Main) {
                l.body.retain(|c| !matches!(c, Node::CpAsync(CpAsyncOp::Wait(_))));
            }
        }
    });
    let e = execute(&bad, bulk_args().1).unwrap_err();
    assert!(
        e.message.contains("read of T2 (stage 0) at index 0 before the asynchronous copy that wrote it completed"),
        "{e}"
    );
    assert!(e.message.contains("has not waited for that copy's group"), "{e}");
}
