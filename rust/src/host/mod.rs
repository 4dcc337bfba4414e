//! Host side of a compiled fusion: segmentation, the host program (Allocate /
//! LaunchKernel / Deallocate), its lowering, and shape evaluation into a concrete plan.

pub mod bind;
pub mod eval;
pub mod ir;
pub mod lower;
pub mod multidevice;
pub mod plan;
pub mod segment;
pub mod segmenter;

#[cfg(test)]
mod tests;
