//! The fusion a Python `FusionDefinition` owns, with a version that every mutable access
//! bumps: Python's caches of lowerings key on it, and no mutation can forget to bump it.

use crate::ir::Fusion;

/// A fusion and the number of mutable accesses to it so far.
pub struct Versioned {
    fusion: Fusion,
    version: u64,
}

impl Versioned {
    /// Wrap `fusion` at version 0.
    pub fn new(fusion: Fusion) -> Self {
        Self { fusion, version: 0 }
    }

    /// Read access (the version stays).
    pub fn get(&self) -> &Fusion {
        &self.fusion
    }

    /// Write access: the version moves on, so every cache of the old fusion is stale.
    pub fn get_mut(&mut self) -> &mut Fusion {
        self.version += 1;
        &mut self.fusion
    }

    /// The version: how many mutable accesses there have been.
    pub fn version(&self) -> u64 {
        self.version
    }
}
