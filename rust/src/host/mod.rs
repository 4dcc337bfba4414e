//! Host side of a compiled fusion: turning symbolic sizes into a concrete launch plan.

pub mod eval;
