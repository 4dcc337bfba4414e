//! The interpreter's model of mbarriers and bulk copies.
//!
//! The interpreter runs every thread in lockstep, so a wait runs only after everything
//! before it in program order: a phase that is not complete when a thread waits for it can
//! never complete (on the GPU that thread would hang). A bulk copy lands its bytes at once
//! but marks them with the barrier phase that reports them; a thread may read them only
//! after a wait that observed that phase. A bulk copy may overwrite an element that threads
//! read only after its issuing thread waited for a phase all of whose arrivals came after
//! those reads (the stage's write-after-read barrier), or after a `__syncthreads()`.

use rustc_hash::FxHashMap;

/// Which barrier: (array, block, entry).
pub type BarKey = (u32, usize, i64);

/// One mbarrier of one block.
#[derive(Clone, Debug, Default)]
pub struct MBar {
    pub initialized: bool,
    /// Arrivals each phase expects.
    pub arrivals: i64,
    /// Arrivals the current phase still expects.
    pub pending: i64,
    /// Transaction bytes the current phase still expects.
    pub tx: i64,
    /// Phases completed so far (the current phase's number).
    pub completed: u32,
    /// Step of the current phase's first arrival.
    pub first_arrival: Option<u64>,
    /// Step of the first arrival of the last completed phase: every arrival of that phase
    /// came at or after it.
    pub last_release: u64,
}

/// Barrier states of a run, and what each thread observed.
#[derive(Default)]
pub struct Barriers {
    pub bars: FxHashMap<BarKey, MBar>,
    /// Per (barrier, lane): phases the lane has seen complete through its waits.
    pub seen: FxHashMap<(BarKey, u32), u32>,
    /// Per lane: the latest release step of a phase it waited for (its reads and the
    /// reads of every thread that arrived in that phase came before it).
    pub synced: FxHashMap<u32, u64>,
    /// Statement counter: orders reads, arrivals and releases.
    pub step: u64,
}

/// The outcome of an arrival or a transaction count on a barrier.
pub enum Arrival {
    Ok,
    /// More arrivals than the phase expects.
    TooMany,
    /// The barrier is not initialised.
    Uninitialized,
}

impl Barriers {
    /// Forget every barrier of `array` (its Allocate ran again: fresh memory).
    pub fn reset_array(&mut self, array: u32) {
        self.bars.retain(|k, _| k.0 != array);
        self.seen.retain(|k, _| k.0 .0 != array);
    }

    /// Initialise: false when the barrier is already live (initialised and not invalidated).
    pub fn init(&mut self, key: BarKey, arrivals: i64) -> bool {
        let b = self.bars.entry(key).or_default();
        if b.initialized {
            return false;
        }
        *b = MBar { initialized: true, arrivals, pending: arrivals, ..MBar::default() };
        self.seen.retain(|k, _| k.0 != key);
        true
    }

    /// Invalidate: false when the barrier is not live.
    pub fn inval(&mut self, key: BarKey) -> bool {
        match self.bars.get_mut(&key) {
            Some(b) if b.initialized => {
                b.initialized = false;
                true
            }
            _ => false,
        }
    }

    /// One arrival, expecting `bytes` more transaction bytes (`arrive.expect_tx`), then the
    /// `landed` bytes counted off (a bulk copy completing).
    pub fn arrive(&mut self, key: BarKey, bytes: i64, landed: i64) -> Arrival {
        let step = self.step;
        let Some(b) = self.bars.get_mut(&key).filter(|b| b.initialized) else {
            return Arrival::Uninitialized;
        };
        if b.pending <= 0 {
            return Arrival::TooMany;
        }
        b.first_arrival.get_or_insert(step);
        b.pending -= 1;
        b.tx += bytes - landed;
        if b.pending == 0 && b.tx == 0 {
            b.completed += 1;
            b.pending = b.arrivals;
            b.last_release = b.first_arrival.take().unwrap_or(step);
        }
        Arrival::Ok
    }

    /// Wait by `lane` for the phase of `parity`: `Err(state)` when that phase has not
    /// completed (it never will: everything before the wait has run).
    pub fn wait(&mut self, key: BarKey, lane: u32, parity: i64) -> Result<(), Option<MBar>> {
        let Some(b) = self.bars.get(&key).filter(|b| b.initialized) else {
            return Err(None);
        };
        // try_wait.parity(P) passes while the current phase's parity differs from P.
        if i64::from(b.completed % 2) == parity.rem_euclid(2) {
            return Err(Some(b.clone()));
        }
        let (completed, release) = (b.completed, b.last_release);
        self.seen.insert((key, lane), completed);
        let s = self.synced.entry(lane).or_default();
        *s = (*s).max(release);
        Ok(())
    }

    /// Phases `lane` has seen complete on `key`.
    pub fn seen(&self, key: BarKey, lane: u32) -> u32 {
        self.seen.get(&(key, lane)).copied().unwrap_or(0)
    }

    /// The phase a copy arriving on `key` now completes.
    pub fn current_phase(&self, key: BarKey) -> u32 {
        self.bars.get(&key).map_or(0, |b| b.completed)
    }
}
