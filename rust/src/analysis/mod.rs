//! Analyses over a scheduled fusion. Each returns a side table; none mutates the IR.

pub mod id_graph;
pub mod loop_graph;
pub mod narrow;
pub mod parallel;
pub mod union_find;
