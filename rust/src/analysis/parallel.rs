//! Which parallel types partition or are shared across each memory type.
//!
//! *Partitioned*: each thread/block owns a private copy, so an id with that parallel
//! type needs no room in the allocation (Local vs TID/BID, Shared vs BID).
//! *Shared across*: all threads/blocks see the same buffer, so an id with that parallel
//! type must be allocated even left of the inline position (Shared vs TID, Global vs
//! TID/BID).

use crate::ir::{MemoryType, ParallelType};

/// True when memory of type `mem` is private per `pt` index.
pub fn is_partitioned_across(mem: MemoryType, pt: ParallelType) -> bool {
    match mem {
        MemoryType::Local => pt.is_thread_or_block(),
        MemoryType::Shared => pt.is_block(),
        MemoryType::Global => false,
    }
}

/// True when memory of type `mem` is visible to every `pt` index.
pub fn is_shared_across(mem: MemoryType, pt: ParallelType) -> bool {
    match mem {
        MemoryType::Local => false,
        MemoryType::Shared => pt.is_thread(),
        MemoryType::Global => pt.is_thread_or_block(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use MemoryType::*;
    use ParallelType::*;

    #[test]
    fn memory_parallel_tables() {
        assert!(is_partitioned_across(Local, TIDx) && is_partitioned_across(Local, BIDy));
        assert!(is_partitioned_across(Shared, BIDx) && !is_partitioned_across(Shared, TIDx));
        assert!(!is_partitioned_across(Global, BIDx));
        assert!(is_shared_across(Shared, TIDz) && !is_shared_across(Shared, BIDx));
        assert!(!is_shared_across(Local, TIDx));
        assert!(is_shared_across(Global, BIDx));
        for m in [Local, Shared, Global] {
            for p in [Serial, Unroll, Unswitch, Vectorize] {
                assert!(!is_partitioned_across(m, p) && !is_shared_across(m, p));
            }
        }
    }
}
