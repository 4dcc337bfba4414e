//! The compile driver: a fusion, and what is known of its inputs, to the host program that
//! runs it (segments, their schedules, one lowered kernel each). Python's `fd.lower` and
//! `fd.execute` (GPU and interpreter) compile through [`compile`]; below it sit the
//! segmenter and scheduler registry (`host::segmenter`, `sched::auto`), lowering
//! (`lower`) and the host-program builder (`host::lower`).

use crate::error::Result;
use crate::host::ir::HostProgram;
use crate::ir::Fusion;
use crate::sched::auto::{DeviceProps, Heuristic};

/// The inputs an automatic schedule is chosen for.
#[derive(Clone, Debug, Default)]
pub struct InputsSeen {
    /// Sizes of each tensor input.
    pub sizes: Vec<Vec<i64>>,
    /// Element strides of each tensor input's array (empty: row-major).
    pub strides: Vec<Vec<i64>>,
    /// Runtime scalar values that a shape reads (None for the others).
    pub scalars: Vec<Option<i64>>,
    /// Every tensor input starts 16-byte aligned.
    pub aligned_bases: bool,
    pub device: DeviceProps,
}

/// Which schedule a compile uses.
#[derive(Clone, Debug)]
pub enum Schedule {
    /// The fusion's own (hand) schedule and `segment_after` marks, for any input sizes.
    AsScheduled,
    /// The scheduler registry and the segmenter, for these inputs.
    Automatic(InputsSeen),
}

/// A compiled fusion: its host program and, for an automatic schedule, the heuristic
/// that chose it (part of the plan key).
pub struct Compiled {
    pub program: HostProgram,
    pub heuristic: Option<Heuristic>,
}

/// Stack for a compile: the passes recurse along chains of expressions (and of scalar
/// expressions), so a fusion thousands of ops deep overflowed the caller's 8 MiB stack and
/// crashed the process. Reserved, not committed: untouched pages cost nothing.
const COMPILE_STACK_BYTES: usize = 1 << 30;

/// Compile `f` with `schedule`.
pub fn compile(f: &Fusion, schedule: &Schedule) -> Result<Compiled> {
    std::thread::scope(|s| {
        let worker = std::thread::Builder::new()
            .name("kiln-compile".into())
            .stack_size(COMPILE_STACK_BYTES)
            .spawn_scoped(s, || compile_here(f, schedule));
        match worker {
            // A panic in the worker goes on in the caller, which turns it into an error.
            Ok(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
            // No thread to be had: compile on this one.
            Err(_) => compile_here(f, schedule),
        }
    })
}

fn compile_here(f: &Fusion, schedule: &Schedule) -> Result<Compiled> {
    match schedule {
        Schedule::AsScheduled => {
            let mut g = f.clone();
            g.hand_schedule = true;
            Ok(Compiled { program: crate::host::lower::lower_program(&g)?, heuristic: None })
        }
        Schedule::Automatic(seen) => {
            let (program, h) = crate::host::segmenter::auto_program_strided(
                f,
                &seen.sizes,
                &seen.strides,
                &seen.scalars,
                seen.aligned_bases,
                seen.device,
            )?;
            Ok(Compiled { program, heuristic: Some(h) })
        }
    }
}
