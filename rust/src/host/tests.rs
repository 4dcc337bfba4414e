//! Unit tests of segmentation, host lowering and the concrete plan.

use crate::host::eval::{InputDesc, ScalarArg};
use crate::host::ir::HostInstr;
use crate::host::lower::lower_program;
use crate::host::plan::{plan_program, Place};
use crate::ir::{BinaryOp, DataType, Fusion, Operand, ParallelType, UnaryOp};

/// x -> a = exp(x) | b = a * 2 | c = b + a: three segments, `a` read by all later ones.
fn chain() -> Fusion {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let a = f.unary(UnaryOp::Exp, Operand::Tensor(x)).unwrap();
    let two = f.scalars.float(2.0);
    let b = f.binary(BinaryOp::Mul, Operand::Tensor(a), Operand::Scalar(two)).unwrap();
    let c = f.binary(BinaryOp::Add, Operand::Tensor(b), Operand::Tensor(a)).unwrap();
    f.add_output(c).unwrap();
    for t in [a, b, c] {
        f.split(t, 1, 128, true).unwrap();
        f.parallelize(t, 0, ParallelType::BIDx).unwrap();
        f.parallelize(t, -1, ParallelType::TIDx).unwrap();
    }
    f.mark_segment_after(a).unwrap();
    f.mark_segment_after(b).unwrap();
    f
}

#[test]
fn chain_segments_allocate_launch_and_free_in_order() {
    let p = lower_program(&chain()).unwrap();
    assert_eq!(p.kernels.len(), 3);
    let text = p.to_text();
    let ops: Vec<&str> = text
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().take(2).collect::<Vec<_>>())
        .map(|v| match (v[0], v[1]) {
            ("Allocate", n) | ("Deallocate", n) => n,
            (_, k) => k,
        })
        .collect();
    assert_eq!(
        ops,
        ["T1", "kernel0(inputs=[T0],", "T2", "kernel1(inputs=[T1],", "T3", "kernel2(inputs=[T1,", "T1", "T2"]
    );
    assert!(matches!(p.instrs.last(), Some(HostInstr::Deallocate(_))));
}

#[test]
fn later_segments_bind_sizes_from_fusion_inputs_and_plan_peak() {
    let p = lower_program(&chain()).unwrap();
    let inputs = [InputDesc { sizes: vec![4, 200], strides: vec![200, 1] }];
    let plan = plan_program(&p, &inputs, &[] as &[ScalarArg]).unwrap();
    let n = 4 * 200 * 4;
    assert_eq!(plan.peak_bytes, 3 * n);
    assert_eq!(plan.launches.len(), 3);
    for l in &plan.launches {
        assert_eq!(l.launch.grid, [4, 1, 1]);
    }
    assert!(plan.buffers.iter().any(|b| b.name == "T3" && b.place == Place::Output(0)));
}

#[test]
fn segment_after_an_input_is_an_error() {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1], DataType::Float, None).unwrap();
    let e = f.mark_segment_after(x).unwrap_err();
    assert!(e.message.contains("segment_after T0"), "{}", e.message);
}

/// Column sum over a grid of blocks: the kernel needs a work buffer and a semaphore.
fn grid_column_sum() -> Fusion {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let s = f.reduction(crate::ir::ReductionOp::Sum, x, &[0], false, None).unwrap();
    f.add_output(s).unwrap();
    f.split(s, 1, 32, true).unwrap(); // [r i0, i1/32, 32]
    f.split(s, 0, 4, true).unwrap(); // [r i0/4, r 4, i1/32, 32]
    f.parallelize(s, 0, ParallelType::BIDy).unwrap();
    f.parallelize(s, 1, ParallelType::TIDy).unwrap();
    f.parallelize(s, 2, ParallelType::BIDx).unwrap();
    f.parallelize(s, 3, ParallelType::TIDx).unwrap();
    f
}

#[test]
fn semaphores_that_reset_come_from_the_zeroed_pool_others_are_zeroed_per_launch() {
    let mut p = lower_program(&grid_column_sum()).unwrap();
    let inputs = [InputDesc { sizes: vec![64, 96], strides: vec![96, 1] }];
    let sync = p.buffers.iter().position(|b| b.name.ends_with("_sync")).unwrap();
    let work = p.buffers.iter().position(|b| b.name.ends_with("_work")).unwrap();
    assert!(p.buffers[sync].zero_init && p.buffers[sync].resets_to_zero);
    assert!(!p.buffers[work].zero_init);
    let plan = plan_program(&p, &inputs, &[] as &[ScalarArg]).unwrap();
    assert_eq!(plan.buffers[sync].place, Place::ZeroPool(0));
    assert_eq!(plan.buffers[sync].bytes, 3 * 8, "one int64 semaphore per column tile");
    assert!(plan.zero_pool_bytes >= 3 * 8);
    assert!(matches!(plan.buffers[work].place, Place::Arena(_)));
    assert!(plan.launches[0].memsets.is_empty());
    // A zero-initialised buffer that its kernel leaves dirty is zeroed before every launch.
    p.buffers[sync].resets_to_zero = false;
    let plan = plan_program(&p, &inputs, &[] as &[ScalarArg]).unwrap();
    assert!(matches!(plan.buffers[sync].place, Place::Arena(_)));
    assert_eq!(plan.zero_pool_bytes, 0);
    assert_eq!(plan.launches[0].memsets, vec![sync]);
}

/// `sum(x, [1])` and `mean` of x's sharded axis 1 over a mesh of `d` devices.
fn sharded_row_stats(d: usize) -> (Fusion, crate::ir::TvId) {
    use crate::ir::ReductionOp;
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let s = f.reduction(ReductionOp::Sum, x, &[1], false, None).unwrap();
    f.add_output(s).unwrap();
    let devices: Vec<i64> = (0..d as i64).collect();
    f.set_device_mesh(x, &devices).unwrap();
    f.mesh_split(x, 1, d as i64).unwrap();
    f.shard_axis(x, 1).unwrap();
    (f, x)
}

#[test]
fn sum_over_a_sharded_axis_is_a_local_sum_then_an_in_place_allreduce() {
    use crate::host::multidevice::{decompose, CommKind, MeshInstr};
    let (f, x) = sharded_row_stats(2);
    assert!(!f.manually_scheduled, "a mesh split is an annotation, not a schedule");
    assert_eq!(f.tvs[x].loop_domain.len(), 3);
    let p = decompose(&f).unwrap();
    assert_eq!(p.stages.len(), 1);
    assert_eq!(p.comms.len(), 1);
    let c = &p.comms[0];
    assert_eq!((c.kind, c.in_place), (CommKind::Allreduce, true));
    assert_eq!(p.instrs[0], MeshInstr::RunStage(0));
    assert_eq!(p.instrs[1], MeshInstr::Communication(0));
    assert_eq!(p.instrs[2], MeshInstr::Wait(0));
    assert_eq!(p.instrs[3], MeshInstr::Deallocate(c.input));
    assert_eq!(p.outputs, vec![c.output]);
    // The stage reduces the local slice: its input's axis 1 is bound from the local array.
    let shapes: std::collections::HashMap<_, _> = p.shapes(&[vec![5, 3]], &[]).unwrap().into_iter().collect();
    assert_eq!(shapes[&c.output], vec![5]);
    assert!(p.to_text(&[]).contains("Allreduce T1 -> T2 over mesh [0, 1] (sum, in place)"));
}

#[test]
fn bad_mesh_annotations_are_errors_not_panics() {
    let mut f = Fusion::new();
    let x = f.define_tensor(&[-1, -1], DataType::Float, None).unwrap();
    let y = f.unary(UnaryOp::Exp, Operand::Tensor(x)).unwrap();
    f.add_output(y).unwrap();
    assert!(f.set_device_mesh(x, &[]).is_err());
    assert!(f.set_device_mesh(x, &[0, 0]).is_err());
    assert!(f.set_device_mesh(x, &[-1]).is_err());
    assert!(f.shard_axis(x, 0).unwrap_err().message.contains("needs a device mesh"));
    f.set_device_mesh(x, &[0, 1]).unwrap();
    assert!(f.mesh_split(x, 0, 3).unwrap_err().message.contains("factor must be 2"));
    assert!(f.mesh_split(x, 5, 2).is_err());
    f.mesh_split(x, 0, 2).unwrap();
    assert!(f.mesh_split(x, 1, 2).unwrap_err().message.contains("already split"));
    let e = crate::host::multidevice::decompose(&f).unwrap_err();
    assert!(e.message.contains("not parallelized over DIDx"), "{}", e.message);
}
