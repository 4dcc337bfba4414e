//! Snapshots of the kernel IR and allocation table of each seed scenario
//! (`tests/scenarios.py`), so `cargo test` guards the allocation pass without Python.
//! After an intended change: `UPDATE_EXPECT=1 cargo test snapshots`, then review the diff.

use expect_test::expect;

use crate::ir::{BinaryOp, DataType, Fusion, MemoryType, Operand, ParallelType, ReductionOp, TvId, UnaryOp};
use crate::lower::lower;
use crate::sched::propagate::completed;

/// Lower as the Python layer does for a hand schedule, then render IR and allocations.
fn snapshot(f: &Fusion) -> String {
    let k = lower(&completed(f)).unwrap();
    format!("{}\n{}", k.to_text(), k.allocations_text())
}

fn input(f: &mut Fusion, shape: &[i64]) -> TvId {
    f.define_tensor(shape, DataType::Float, None).unwrap()
}

fn un(f: &mut Fusion, op: UnaryOp, x: TvId) -> TvId {
    f.unary(op, Operand::Tensor(x)).unwrap()
}

fn bin_scalar(f: &mut Fusion, op: BinaryOp, x: TvId, v: f64) -> TvId {
    let s = f.scalars.float(v);
    f.binary(op, Operand::Tensor(x), Operand::Scalar(s)).unwrap()
}

fn sum(f: &mut Fusion, x: TvId, dim: i64) -> TvId {
    f.reduction(ReductionOp::Sum, x, &[dim], false, None).unwrap()
}

/// A pointwise chain inlined at 2 and at the deepest position: each Local holds only the ids right of it.
#[test]
fn a_pointwise() {
    let mut f = Fusion::new();
    let x = input(&mut f, &[-1, -1]);
    let a = un(&mut f, UnaryOp::Exp, x);
    let b = bin_scalar(&mut f, BinaryOp::Mul, a, 2.0);
    let c = bin_scalar(&mut f, BinaryOp::Sub, b, 1.5);
    f.add_output(c).unwrap();
    for t in [a, b, c] {
        f.merge(t, 0, 1).unwrap();
        f.split(t, 0, 128, true).unwrap();
        f.split(t, 1, 4, true).unwrap();
        f.parallelize(t, 0, ParallelType::BIDx).unwrap();
        f.parallelize(t, 1, ParallelType::TIDx).unwrap();
    }
    f.inline_at(a, 2).unwrap();
    f.inline_at(b, -1).unwrap();
    expect![[r#"
        FOR blockIdx.x in iblockIdx.x19{ceilDiv(i0 * i1, 128)} (BIDx):
          FOR threadIdx.x in ithreadIdx.x21{32} (TIDx):
            ALLOCATE T1 Local float [4]
            FOR idx0 in iS12{4}:
              T1 = exp(T0)  @ [idx0] <- [blockIdx.x * 128 + (threadIdx.x * 4 + idx0)] if blockIdx.x * 128 + (threadIdx.x * 4 + idx0) < i0 * i1
            FOR idx1 in iS22{4}:
              ALLOCATE T2 Local float [1]
              T2 = mul(T1, 2.0)  @ [0] <- [idx1] if blockIdx.x * 128 + (threadIdx.x * 4 + idx1) < i0 * i1
              T3 = sub(T2, 1.5)  @ [blockIdx.x * 128 + (threadIdx.x * 4 + idx1)] <- [0] if blockIdx.x * 128 + (threadIdx.x * 4 + idx1) < i0 * i1

        T0 Global ids=[iS0{i0}, iS1{i1}] strides=[i1, 1] contiguity=[true, true] position=0
        T1 Local ids=[iS12{4}] strides=[1] contiguity=[true] position=2
        T2 Local ids=[] strides=[] contiguity=[] position=3
        T3 Global ids=[iS6{i0}, iS7{i1}] strides=[i1, 1] contiguity=[true, true] position=0
    "#]].assert_eq(&snapshot(&f));
}

/// A read cache of x in `mem`, inlined at 2 into a sigmoid, both [BIDx, TIDx, serial].
fn cache(mem: MemoryType) -> Fusion {
    let mut f = Fusion::new();
    let x = input(&mut f, &[3, 300]);
    let y = un(&mut f, UnaryOp::Sigmoid, x);
    f.add_output(y).unwrap();
    let c = f.cache_after(x).unwrap();
    f.set_memory_type(c, mem).unwrap();
    for t in [c, y] {
        f.split(t, 1, 128, true).unwrap();
        f.reorder(t, &[(2, 1)]).unwrap();
        f.parallelize(t, 0, ParallelType::BIDx).unwrap();
        f.parallelize(t, 1, ParallelType::TIDx).unwrap();
    }
    f.inline_at(c, 2).unwrap();
    f
}

/// A Shared cache of x: its Allocate sits at the inline position, sized by the ids right of it.
#[test]
fn b_shared() {
    expect![[r#"
        ALLOCATE T2 Shared float [3, 128]
        FOR blockIdx.x in iblockIdx.x2{3} (BIDx):
          FOR threadIdx.x in ithreadIdx.x9{128} (TIDx):
            FOR idx0 in iS6{3}:
              T2 = set(T0)  @ [idx0 * 128 + threadIdx.x] <- [blockIdx.x * 300 + (idx0 * 128 + threadIdx.x)] if idx0 * 128 + threadIdx.x < 300
            FOR idx1 in iS8{3}:
              T1 = sigmoid(T2)  @ [blockIdx.x * 300 + (idx1 * 128 + threadIdx.x)] <- [idx1 * 128 + threadIdx.x] if idx1 * 128 + threadIdx.x < 300

        T0 Global ids=[iS0{3}, iS1{300}] strides=[300, 1] contiguity=[true, true] position=0
        T1 Global ids=[iblockIdx.x2{3}, iS3{300}] strides=[300, 1] contiguity=[true, true] position=0
        T2 Shared ids=[iS6{3}, ithreadIdx.x9{128}] strides=[128, 1] contiguity=[true, true] position=0
    "#]].assert_eq(&snapshot(&cache(MemoryType::Shared)));
}

/// A Local cache of x: TIDx partitions registers, so only the serial id right of the inline position takes room.
#[test]
fn b_local() {
    expect![[r#"
        FOR blockIdx.x in iblockIdx.x2{3} (BIDx):
          FOR threadIdx.x in ithreadIdx.x9{128} (TIDx):
            ALLOCATE T2 Local float [3]
            FOR idx0 in iS6{3}:
              T2 = set(T0)  @ [idx0] <- [blockIdx.x * 300 + (idx0 * 128 + threadIdx.x)] if idx0 * 128 + threadIdx.x < 300
            FOR idx1 in iS8{3}:
              T1 = sigmoid(T2)  @ [blockIdx.x * 300 + (idx1 * 128 + threadIdx.x)] <- [idx1] if idx1 * 128 + threadIdx.x < 300

        T0 Global ids=[iS0{3}, iS1{300}] strides=[300, 1] contiguity=[true, true] position=0
        T1 Global ids=[iblockIdx.x2{3}, iS3{300}] strides=[300, 1] contiguity=[true, true] position=0
        T2 Local ids=[iS6{3}] strides=[1] contiguity=[true] position=2
    "#]].assert_eq(&snapshot(&cache(MemoryType::Local)));
}

/// Producers inlined inside an Unroll loop: their Allocates move out of it, sized for every unrolled iteration.
#[test]
fn c_inlined_unroll() {
    let mut f = Fusion::new();
    let x0 = input(&mut f, &[6]);
    let x1 = input(&mut f, &[6, 5]);
    let t2 = un(&mut f, UnaryOp::Exp, x0);
    let t3 = f.broadcast_in_dim(t2, &[-1, -1], &[0]).unwrap();
    let t4 = f.binary(BinaryOp::Add, Operand::Tensor(t3), Operand::Tensor(x1)).unwrap();
    f.add_output(t4).unwrap();
    for t in [t3, t4] {
        f.merge(t, 0, 1).unwrap();
        f.split(t, 0, 4, false).unwrap();
        f.parallelize(t, 0, ParallelType::Unroll).unwrap();
    }
    f.split(t2, 0, 4, false).unwrap();
    f.inline_at(t2, 2).unwrap();
    f.inline_at(t3, 2).unwrap();
    expect![[r#"
        ALLOCATE T2 Local float [4, 8]
        ALLOCATE T3 Local float [4, 8]
        FOR idx0 in iUR12{4} (Unroll):
          FOR idx1 in iS13{8}:
            T2 = exp(T0)  @ [idx0 * 8 + idx1] <- [(idx0 * 8 + idx1) / 5] if idx0 * 8 + idx1 < 30
            T3 = broadcast(T2)  @ [idx0 * 8 + idx1] <- [idx0 * 8 + idx1] if idx0 * 8 + idx1 < 30
            T4 = add(T3, T1)  @ [idx0 * 8 + idx1] <- [idx0 * 8 + idx1], [idx0 * 8 + idx1] if idx0 * 8 + idx1 < 30

        T0 Global ids=[iS0{6}] strides=[1] contiguity=[true] position=0
        T1 Global ids=[iS1{6}, iS2{5}] strides=[5, 1] contiguity=[true, true] position=0
        T2 Local ids=[iUR12{4}, iS13{8}] strides=[8, 1] contiguity=[true, true] position=0
        T3 Local ids=[iUR12{4}, iS13{8}] strides=[8, 1] contiguity=[true, true] position=0
        T4 Global ids=[iS6{6}, iS7{5}] strides=[5, 1] contiguity=[true, true] position=0
    "#]]
    .assert_eq(&snapshot(&f));
}

/// An input whose last axis is not contiguous is indexed through its run-time stride.
#[test]
fn d_non_contiguous() {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, Some(&[Some(true), Some(false)])).unwrap();
    let y = un(&mut f, UnaryOp::Neg, x);
    f.add_output(y).unwrap();
    f.split(y, 1, 32, true).unwrap();
    f.parallelize(y, 0, ParallelType::BIDx).unwrap();
    f.parallelize(y, 2, ParallelType::TIDx).unwrap();
    expect![[r#"
        FOR blockIdx.x in iblockIdx.x2{i0} (BIDx):
          FOR idx0 in iS4{ceilDiv(i1, 32)}:
            FOR threadIdx.x in ithreadIdx.x5{32} (TIDx):
              T1 = neg(T0)  @ [blockIdx.x * i1 + (idx0 * 32 + threadIdx.x)] <- [blockIdx.x * (T0.stride[1] * i1) + (idx0 * 32 + threadIdx.x) * T0.stride[1]] if idx0 * 32 + threadIdx.x < i1

        T0 Global ids=[iS0{i0}, iS1{i1}] strides=[T0.stride[1] * i1, T0.stride[1]] contiguity=[true, false] position=0
        T1 Global ids=[iblockIdx.x2{i0}, iS3{i1}] strides=[i1, 1] contiguity=[true, true] position=0
    "#]].assert_eq(&snapshot(&f));
}

/// An NHWC allocation domain on the output: written channel-last from a vectorized Local write cache.
#[test]
fn e_nhwc() {
    let mut f = Fusion::new();
    let x = input(&mut f, &[2, 8, 3, 5]);
    let y = un(&mut f, UnaryOp::Relu, x);
    f.add_output(y).unwrap();
    let ld = f.tvs[y].loop_domain.clone();
    f.set_allocation_domain(y, &[ld[0], ld[2], ld[3], ld[1]], &[Some(true); 4]).unwrap();
    let c = f.cache_before(y).unwrap();
    f.reorder(y, &[(1, 3)]).unwrap();
    f.split(y, 3, 4, true).unwrap();
    f.parallelize(y, 0, ParallelType::BIDx).unwrap();
    f.parallelize(y, 4, ParallelType::Vectorize).unwrap();
    f.split(c, 1, 4, true).unwrap();
    f.reorder(c, &[(2, 4)]).unwrap();
    f.parallelize(c, 0, ParallelType::BIDx).unwrap();
    f.parallelize(c, 4, ParallelType::Vectorize).unwrap();
    f.inline_at(c, 1).unwrap();
    expect![[r#"
        FOR blockIdx.x in iblockIdx.x4{2} (BIDx):
          ALLOCATE T2 Local float [3, 5, 2, 4]
          FOR idx0 in iS14{2}:
            FOR idx1 in iS10{3}:
              FOR idx2 in iS11{5}:
                FOR idx3 in iV15{4} (Vectorize):
                  T2 = relu(T0)  @ [idx1 * 40 + idx2 * 8 + idx0 * 4 + idx3] <- [blockIdx.x * 120 + (idx0 * 4 + idx3) * 15 + idx1 * 5 + idx2]
          FOR idx4 in iS6{3}:
            FOR idx5 in iS7{5}:
              FOR idx6 in iS12{2}:
                VECTOR x4 T1 = set(T2)  @ [blockIdx.x * 120 + idx4 * 40 + idx5 * 8 + idx6 * 4] <- [idx4 * 40 + idx5 * 8 + idx6 * 4] [WideIfAddressAligned, Wide] if true and true; else:
                  FOR idx7 in iV13{4} (Unroll):
                    T1 = set(T2)  @ [blockIdx.x * 120 + idx4 * 40 + idx5 * 8 + (idx6 * 4 + idx7)] <- [idx4 * 40 + idx5 * 8 + idx6 * 4 + idx7]

        T0 Global ids=[iS0{2}, iS1{8}, iS2{3}, iS3{5}] strides=[120, 15, 5, 1] contiguity=[true, true, true, true] position=0
        T1 Global ids=[iblockIdx.x4{2}, iS6{3}, iS7{5}, iS5{8}] strides=[120, 40, 8, 1] contiguity=[true, true, true, true] position=0
        T2 Local ids=[iS10{3}, iS11{5}, iS14{2}, iV15{4}] strides=[40, 8, 4, 1] contiguity=[true, true, true, true] position=1
    "#]].assert_eq(&snapshot(&f));
}

/// A Shared transpose tile per block, rows padded to 33 against bank conflicts, with a RAW barrier before the read.
#[test]
fn f_transpose() {
    let mut f = Fusion::new();
    let x = input(&mut f, &[-1, -1]);
    let t = f.permute(x, &[1, 0]).unwrap();
    f.add_output(t).unwrap();
    let s = f.cache_before(t).unwrap();
    f.set_memory_type(s, MemoryType::Shared).unwrap();
    f.split(t, 0, 32, true).unwrap();
    f.split(t, 2, 32, true).unwrap();
    f.reorder(t, &[(1, 2)]).unwrap();
    f.merge(t, 2, 3).unwrap();
    f.split(t, 2, 4, true).unwrap();
    f.parallelize(t, 0, ParallelType::BIDy).unwrap();
    f.parallelize(t, 1, ParallelType::BIDx).unwrap();
    f.parallelize(t, 2, ParallelType::TIDx).unwrap();
    f.parallelize(t, 3, ParallelType::Vectorize).unwrap();
    f.split(s, 0, 32, true).unwrap();
    f.split(s, 2, 32, true).unwrap();
    f.reorder(s, &[(1, 3), (3, 2)]).unwrap();
    f.merge(s, 2, 3).unwrap();
    f.split(s, 2, 4, true).unwrap();
    f.parallelize(s, 0, ParallelType::BIDy).unwrap();
    f.parallelize(s, 1, ParallelType::BIDx).unwrap();
    f.parallelize(s, 2, ParallelType::TIDx).unwrap();
    f.inline_at(s, 2).unwrap();
    expect![[r#"
        ALLOCATE T2 Shared float [32, 33]
        FOR blockIdx.y in iblockIdx.y6{ceilDiv(i1, 32)} (BIDy):
          FOR blockIdx.x in iblockIdx.x8{ceilDiv(i0, 32)} (BIDx):
            FOR threadIdx.x in ithreadIdx.x18{256} (TIDx):
              IF blockIdx.x * 32 + threadIdx.x / 8 < i0:  // invariant bounds
                FOR idx0 in iS19{4}:
                  T2 = permute[1, 0](T0)  @ [(threadIdx.x % 8 * 4 + idx0) * 33 + threadIdx.x / 8] <- [(blockIdx.x * 32 + threadIdx.x / 8) * i1 + (blockIdx.y * 32 + (threadIdx.x % 8 * 4 + idx0))] if blockIdx.y * 32 + (threadIdx.x % 8 * 4 + idx0) < i1
            __syncthreads()  // RAW
            FOR threadIdx.x in ithreadIdx.x11{256} (TIDx):
              VECTOR x4 T1 = set(T2)  @ [(blockIdx.y * 32 + threadIdx.x / 8) * i0 + (blockIdx.x * 32 + threadIdx.x % 8 * 4)] <- [threadIdx.x / 8 * 33 + threadIdx.x % 8 * 4] [WideIfAddressAligned, Elements] if blockIdx.y * 32 + threadIdx.x / 8 < i1 && blockIdx.x * 32 + threadIdx.x % 8 * 4 < i0 and blockIdx.y * 32 + threadIdx.x / 8 < i1 && blockIdx.x * 32 + (threadIdx.x % 8 * 4 + 3) < i0; else:
                FOR idx1 in iV12{4} (Unroll):
                  T1 = set(T2)  @ [(blockIdx.y * 32 + threadIdx.x / 8) * i0 + (blockIdx.x * 32 + (threadIdx.x % 8 * 4 + idx1))] <- [threadIdx.x / 8 * 33 + (threadIdx.x % 8 * 4 + idx1)] if blockIdx.y * 32 + threadIdx.x / 8 < i1 && blockIdx.x * 32 + (threadIdx.x % 8 * 4 + idx1) < i0

        T0 Global ids=[iS0{i0}, iS1{i1}] strides=[i1, 1] contiguity=[true, true] position=0
        T1 Global ids=[iS2{i1}, iS3{i0}] strides=[i0, 1] contiguity=[true, true] position=0
        T2 Shared ids=[iS14{32}, iS16{32}] strides=[33, 1] contiguity=[true, true] position=0
    "#]].assert_eq(&snapshot(&f));
}

/// A producer of index_select keeps its whole selected axis, since any of its rows may be gathered.
#[test]
fn g_index_select() {
    let mut f = Fusion::new();
    let x = input(&mut f, &[10, -1]);
    let idx = f.define_tensor(&[-1], DataType::Int, None).unwrap();
    let t1 = un(&mut f, UnaryOp::Exp, x);
    let t2 = f.index_select(t1, idx, 0).unwrap();
    f.add_output(t2).unwrap();
    f.reorder(t1, &[(0, 1)]).unwrap();
    f.split(t1, 1, 4, true).unwrap();
    f.reorder(t2, &[(0, 1)]).unwrap();
    f.parallelize(t2, 0, ParallelType::BIDx).unwrap();
    f.inline_at(t1, 1).unwrap();
    expect![[r#"
        FOR blockIdx.x in iblockIdx.x6{i0} (BIDx):
          ALLOCATE T2 Local float [10]
          FOR idx0 in iS7{3}:
            FOR idx1 in iS8{4}:
              T2 = exp(T0)  @ [idx0 * 4 + idx1] <- [(idx0 * 4 + idx1) * i0 + blockIdx.x] if idx0 * 4 + idx1 < 10
          FOR idx2 in iS5{i1}:
            T3 = index_select<dim=0>(T2, T1)  @ [idx2 * i0 + blockIdx.x] <- [g0], [idx2] with g0 = T1[idx2]

        T0 Global ids=[iS0{10}, iS1{i0}] strides=[i0, 1] contiguity=[true, true] position=0
        T1 Global ids=[iS2{i1}] strides=[1] contiguity=[true] position=0
        T2 Local ids=[iS3{10}] strides=[1] contiguity=[true] position=1
        T3 Global ids=[iS5{i1}, iblockIdx.x6{i0}] strides=[i0, 1] contiguity=[true, true] position=0
        global buffer kiln_index_error int64 [4] zero_init=true resets_to_zero=true
    "#]]
    .assert_eq(&snapshot(&f));
}

/// A row sum across TIDx into a cached accumulator: a register accumulates, then one block reduction per row.
#[test]
fn h_block_row_sum() {
    let mut f = Fusion::new();
    let x = input(&mut f, &[-1, -1]);
    let s = sum(&mut f, x, 1);
    f.add_output(s).unwrap();
    f.split(s, 1, 128, true).unwrap();
    f.parallelize(s, 0, ParallelType::BIDx).unwrap();
    f.parallelize(s, 2, ParallelType::TIDx).unwrap();
    let acc = f.cache_before(s).unwrap();
    f.parallelize(s, 0, ParallelType::BIDx).unwrap();
    f.inline_at(acc, 1).unwrap();
    expect![[r#"
        FOR blockIdx.x in iblockIdx.x2{i0} (BIDx):
          ALLOCATE T2 Local float [1]
          acc0 = identity  // register of T2
          FOR idx0 in rS8{ceilDiv(i1, 128)}:
            FOR threadIdx.x in rthreadIdx.x9{128} (TIDx):
              acc0 += T2 = reduce_sum(T0)  @ [0] <- [blockIdx.x * i1 + (idx0 * 128 + threadIdx.x)] if idx0 * 128 + threadIdx.x < i1
          T2 = parallel reduction of acc0  @ [0]
          T1 = set(T2)  @ [blockIdx.x] <- [0] if threadIdx.x == 0

        T0 Global ids=[iS0{i0}, iS1{i1}] strides=[i1, 1] contiguity=[true, true] position=0
        T1 Global ids=[iblockIdx.x2{i0}] strides=[1] contiguity=[true] position=0
        T2 Local ids=[] strides=[] contiguity=[] position=1
    "#]].assert_eq(&snapshot(&f));
}

/// A column sum reduced over BIDx and TIDy; `serial` asks for the one-block-at-a-time protocol.
fn column_sum(serial: bool) -> Fusion {
    let mut f = Fusion::new();
    let x = input(&mut f, &[-1, -1]);
    let s = sum(&mut f, x, 0);
    f.add_output(s).unwrap();
    f.split(s, 0, 4, true).unwrap();
    f.split(s, 2, 128, true).unwrap();
    f.parallelize(s, 0, ParallelType::BIDx).unwrap();
    f.parallelize(s, 1, ParallelType::TIDy).unwrap();
    f.parallelize(s, 2, ParallelType::BIDy).unwrap();
    f.parallelize(s, 3, ParallelType::TIDx).unwrap();
    if serial {
        f.set_serial_grid_reduction(s).unwrap();
    }
    f
}

/// A grid reduction across BIDx: its work buffer (a slot per block) and semaphores are Global allocations.
#[test]
fn h_grid_column_sum() {
    expect![[r#"
        ALLOCATE T1_work Global float [ceilDiv(i1, 128), ceilDiv(i0, 4), 128]
        ALLOCATE T1_sync Global int64 [ceilDiv(i1, 128)] zero_init resets_to_zero
        FOR blockIdx.y in iblockIdx.y6{ceilDiv(i1, 128)} (BIDy):
          FOR threadIdx.x in ithreadIdx.x7{128} (TIDx):
            T1 = 0.0  // init  @ [blockIdx.y * 128 + threadIdx.x] if blockIdx.y * 128 + threadIdx.x < i1 && threadIdx.y == 0 && blockIdx.x == 0
        FOR blockIdx.x in rblockIdx.x4{ceilDiv(i0, 4)} (BIDx):
          FOR threadIdx.y in rthreadIdx.y5{4} (TIDy):
            FOR blockIdx.y in iblockIdx.y6{ceilDiv(i1, 128)} (BIDy):
              FOR threadIdx.x in ithreadIdx.x7{128} (TIDx):
                T1 = reduce_sum(T0)  @ [blockIdx.y * 128 + threadIdx.x] <- [(blockIdx.x * 4 + threadIdx.y) * i1 + (blockIdx.y * 128 + threadIdx.x)] if blockIdx.x * 4 + threadIdx.y < i0 && blockIdx.y * 128 + threadIdx.x < i1 && blockIdx.x < ceilDiv(i0, 4)

        T0 Global ids=[iS0{i0}, iS1{i1}] strides=[i1, 1] contiguity=[true, true] position=0
        T1 Global ids=[iS3{i1}] strides=[1] contiguity=[true] position=0
        global buffer T1_work float [ceilDiv(i1, 128), ceilDiv(i0, 4), 128] zero_init=false resets_to_zero=false
        global buffer T1_sync int64 [ceilDiv(i1, 128)] zero_init=true resets_to_zero=true
    "#]].assert_eq(&snapshot(&column_sum(false)));
}

/// A serial grid reduction: blocks take turns on one work slot per output, so the buffer has no per-block axis.
#[test]
fn h_serial_grid_column_sum() {
    expect![[r#"
        ALLOCATE T1_work Global float [ceilDiv(i1, 128), 128]
        ALLOCATE T1_sync Global int64 [ceilDiv(i1, 128)] zero_init resets_to_zero
        FOR blockIdx.y in iblockIdx.y6{ceilDiv(i1, 128)} (BIDy):
          FOR threadIdx.x in ithreadIdx.x7{128} (TIDx):
            T1 = 0.0  // init  @ [blockIdx.y * 128 + threadIdx.x] if blockIdx.y * 128 + threadIdx.x < i1 && threadIdx.y == 0 && blockIdx.x == 0
        FOR blockIdx.x in rblockIdx.x4{ceilDiv(i0, 4)} (BIDx):
          FOR threadIdx.y in rthreadIdx.y5{4} (TIDy):
            FOR blockIdx.y in iblockIdx.y6{ceilDiv(i1, 128)} (BIDy):
              FOR threadIdx.x in ithreadIdx.x7{128} (TIDx):
                T1 = reduce_sum(T0)  @ [blockIdx.y * 128 + threadIdx.x] <- [(blockIdx.x * 4 + threadIdx.y) * i1 + (blockIdx.y * 128 + threadIdx.x)] if blockIdx.x * 4 + threadIdx.y < i0 && blockIdx.y * 128 + threadIdx.x < i1 && blockIdx.x < ceilDiv(i0, 4)

        T0 Global ids=[iS0{i0}, iS1{i1}] strides=[i1, 1] contiguity=[true, true] position=0
        T1 Global ids=[iS3{i1}] strides=[1] contiguity=[true] position=0
        global buffer T1_work float [ceilDiv(i1, 128), 128] zero_init=false resets_to_zero=false
        global buffer T1_sync int64 [ceilDiv(i1, 128)] zero_init=true resets_to_zero=true
    "#]].assert_eq(&snapshot(&column_sum(true)));
}

/// A serial loop inside each block of a grid reduction accumulates in a register; one parallel reduction follows.
#[test]
fn h_grid_column_sum_hoisted() {
    let mut f = Fusion::new();
    let x = input(&mut f, &[-1, -1]);
    let s = sum(&mut f, x, 0);
    f.add_output(s).unwrap();
    f.split(s, 0, 16, true).unwrap();
    f.split(s, 1, 4, true).unwrap();
    f.split(s, 3, 128, true).unwrap();
    f.parallelize(s, 0, ParallelType::BIDx).unwrap();
    f.parallelize(s, 1, ParallelType::TIDy).unwrap();
    f.parallelize(s, 3, ParallelType::BIDy).unwrap();
    f.parallelize(s, 4, ParallelType::TIDx).unwrap();
    expect![[r#"
        ALLOCATE T1_work Global float [ceilDiv(i1, 128), ceilDiv(i0, 16), 128]
        ALLOCATE T1_sync Global int64 [ceilDiv(i1, 128)] zero_init resets_to_zero
        FOR blockIdx.x in rblockIdx.x4{ceilDiv(i0, 16)} (BIDx):
          FOR threadIdx.y in rthreadIdx.y6{4} (TIDy):
            acc0 = identity  // register of T1
            IF blockIdx.y * 128 + threadIdx.x < i1 && blockIdx.x < ceilDiv(i0, 16):  // invariant bounds
              FOR idx0 in rS7{4}:
                FOR blockIdx.y in iblockIdx.y8{ceilDiv(i1, 128)} (BIDy):
                  FOR threadIdx.x in ithreadIdx.x9{128} (TIDx):
                    acc0 += T1 = reduce_sum(T0)  @ [blockIdx.y * 128 + threadIdx.x] <- [(blockIdx.x * 16 + (threadIdx.y * 4 + idx0)) * i1 + (blockIdx.y * 128 + threadIdx.x)] if blockIdx.x * 16 + (threadIdx.y * 4 + idx0) < i0
            T1 = parallel reduction of acc0  @ [blockIdx.y * 128 + threadIdx.x] if blockIdx.y * 128 + threadIdx.x < i1

        T0 Global ids=[iS0{i0}, iS1{i1}] strides=[i1, 1] contiguity=[true, true] position=0
        T1 Global ids=[iS3{i1}] strides=[1] contiguity=[true] position=0
        global buffer T1_work float [ceilDiv(i1, 128), ceilDiv(i0, 16), 128] zero_init=false resets_to_zero=false
        global buffer T1_sync int64 [ceilDiv(i1, 128)] zero_init=true resets_to_zero=true
    "#]].assert_eq(&snapshot(&f));
}

/// An outer reduction loop around the row loop: each hoisted block reduction adds its partial sum to the output.
#[test]
fn h_row_sum_partial_hoist() {
    let mut f = Fusion::new();
    let x = input(&mut f, &[-1, -1]);
    let s = sum(&mut f, x, 1);
    f.add_output(s).unwrap();
    f.split(s, 1, 64, true).unwrap();
    f.split(s, 1, 2, true).unwrap();
    f.reorder(s, &[(1, 0)]).unwrap();
    f.parallelize(s, 3, ParallelType::TIDx).unwrap();
    expect![[r#"
        FOR idx3 in iS2{i0}:
          T1 = 0.0  // init  @ [idx3] if threadIdx.x == 0
        FOR idx0 in rS6{ceilDiv(i1, 128)}:
          FOR idx1 in iS2{i0}:
            acc0 = identity  // register of T1
            FOR idx2 in rS7{2}:
              FOR threadIdx.x in rthreadIdx.x5{64} (TIDx):
                acc0 += T1 = reduce_sum(T0)  @ [idx1] <- [idx1 * i1 + ((idx0 * 2 + idx2) * 64 + threadIdx.x)] if (idx0 * 2 + idx2) * 64 + threadIdx.x < i1 && idx0 * 2 + idx2 < ceilDiv(i1, 64)
            T1 += parallel reduction of acc0  @ [idx1]

        T0 Global ids=[iS0{i0}, iS1{i1}] strides=[i1, 1] contiguity=[true, true] position=0
        T1 Global ids=[iS2{i0}] strides=[1] contiguity=[true] position=0
    "#]].assert_eq(&snapshot(&f));
}

/// Vectorized read and write caches hold 4 elements per thread; the inlined intermediates need one register each.
#[test]
fn v_vectorized() {
    let mut f = Fusion::new();
    let x = input(&mut f, &[-1, -1]);
    let m = bin_scalar(&mut f, BinaryOp::Mul, x, 1.5);
    let a = bin_scalar(&mut f, BinaryOp::Add, m, 0.5);
    let r = un(&mut f, UnaryOp::Relu, a);
    let g = un(&mut f, UnaryOp::Sigmoid, x);
    let y = f.binary(BinaryOp::Mul, Operand::Tensor(r), Operand::Tensor(g)).unwrap();
    f.add_output(y).unwrap();
    let xc = f.cache_after(x).unwrap();
    f.cache_before(y).unwrap();
    let every: Vec<TvId> = (0..f.tvs.len() as u32).map(TvId::from_u32).filter(|&t| t != x).collect();
    for &t in &every {
        f.merge(t, 0, 1).unwrap();
        f.split(t, 0, 4, true).unwrap();
        f.split(t, 0, 128, true).unwrap();
        f.parallelize(t, 0, ParallelType::BIDx).unwrap();
        f.parallelize(t, 1, ParallelType::TIDx).unwrap();
    }
    f.parallelize(xc, 2, ParallelType::Vectorize).unwrap();
    f.parallelize(y, 2, ParallelType::Vectorize).unwrap();
    for &t in every.iter().filter(|&&t| t != y) {
        f.inline_at(t, -1).unwrap();
    }
    expect![[r#"
        FOR blockIdx.x in iblockIdx.x39{ceilDiv(i0 * i1, 512)} (BIDx):
          FOR threadIdx.x in ithreadIdx.x40{128} (TIDx):
            ALLOCATE T6 Local float [4]
            VECTOR x4 T6 = set(T0)  @ [0] <- [(blockIdx.x * 128 + threadIdx.x) * 4] [Wide, WideIfAddressAligned] if (blockIdx.x * 128 + threadIdx.x) * 4 < i0 * i1 && blockIdx.x * 128 + threadIdx.x < ceilDiv(i0 * i1, 4) and (blockIdx.x * 128 + threadIdx.x) * 4 + 3 < i0 * i1 && blockIdx.x * 128 + threadIdx.x < ceilDiv(i0 * i1, 4); else:
              FOR idx0 in iV43{4} (Unroll):
                T6 = set(T0)  @ [idx0] <- [(blockIdx.x * 128 + threadIdx.x) * 4 + idx0] if (blockIdx.x * 128 + threadIdx.x) * 4 + idx0 < i0 * i1 && blockIdx.x * 128 + threadIdx.x < ceilDiv(i0 * i1, 4)
            ALLOCATE T7 Local float [4]
            IF blockIdx.x * 128 + threadIdx.x < ceilDiv(i0 * i1, 4):  // invariant bounds
              FOR idx1 in iS48{4}:
                ALLOCATE T1 Local float [1]
                T1 = mul(T6, 1.5)  @ [0] <- [idx1] if (blockIdx.x * 128 + threadIdx.x) * 4 + idx1 < i0 * i1
                ALLOCATE T2 Local float [1]
                T2 = add(T1, 0.5)  @ [0] <- [0] if (blockIdx.x * 128 + threadIdx.x) * 4 + idx1 < i0 * i1
                ALLOCATE T3 Local float [1]
                T3 = relu(T2)  @ [0] <- [0] if (blockIdx.x * 128 + threadIdx.x) * 4 + idx1 < i0 * i1
                ALLOCATE T4 Local float [1]
                T4 = sigmoid(T6)  @ [0] <- [idx1] if (blockIdx.x * 128 + threadIdx.x) * 4 + idx1 < i0 * i1
                T7 = mul(T3, T4)  @ [idx1] <- [0], [0] if (blockIdx.x * 128 + threadIdx.x) * 4 + idx1 < i0 * i1
            VECTOR x4 T5 = set(T7)  @ [(blockIdx.x * 128 + threadIdx.x) * 4] <- [0] [WideIfAddressAligned, Wide] if (blockIdx.x * 128 + threadIdx.x) * 4 < i0 * i1 && blockIdx.x * 128 + threadIdx.x < ceilDiv(i0 * i1, 4) and (blockIdx.x * 128 + threadIdx.x) * 4 + 3 < i0 * i1 && blockIdx.x * 128 + threadIdx.x < ceilDiv(i0 * i1, 4); else:
              FOR idx2 in iV38{4} (Unroll):
                T5 = set(T7)  @ [(blockIdx.x * 128 + threadIdx.x) * 4 + idx2] <- [idx2] if (blockIdx.x * 128 + threadIdx.x) * 4 + idx2 < i0 * i1 && blockIdx.x * 128 + threadIdx.x < ceilDiv(i0 * i1, 4)

        T0 Global ids=[iS0{i0}, iS1{i1}] strides=[i1, 1] contiguity=[true, true] position=0
        T1 Local ids=[] strides=[] contiguity=[] position=3
        T2 Local ids=[] strides=[] contiguity=[] position=3
        T3 Local ids=[] strides=[] contiguity=[] position=3
        T4 Local ids=[] strides=[] contiguity=[] position=3
        T5 Global ids=[iS10{i0}, iS11{i1}] strides=[i1, 1] contiguity=[true, true] position=0
        T6 Local ids=[iV43{4}] strides=[1] contiguity=[true] position=2
        T7 Local ids=[iS48{4}] strides=[1] contiguity=[true] position=2
    "#]].assert_eq(&snapshot(&f));
}
