//! kiln: a fusion compiler for NVIDIA GPUs. The crate holds the whole compiler; the
//! `python` feature adds the PyO3 bindings that the `kiln` Python package loads.

pub mod analysis;
pub mod codegen;
pub mod compile;
pub mod error;
pub mod host;
pub mod interp;
pub mod ir;
pub mod kernel;
pub mod lower;
pub mod sched;

#[cfg(feature = "python")]
mod python;

pub use error::{KilnError, Result};
