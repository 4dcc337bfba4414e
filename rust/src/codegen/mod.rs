//! Code generation: kernel IR to CUDA C++.

pub mod cuda;

pub use cuda::{generate, CudaKernel, ParamKind};
