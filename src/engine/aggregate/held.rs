//! What an instance holds of each counter ([`Held`]), kept in a
//! [`Slab`](super::table::Slab): the gate's buckets map a counter to its
//! place there, so a batch's plan finds each of its counters once and its
//! decide goes straight to the place (why: `BENCHMARKS.md`, "the gate's
//! profile").

/// What an instance holds of one counter.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Held {
    /// Credits handed out for it (all instances) as of the last lease.
    pub total: u64,
    /// Credits this instance holds, unused.
    pub held: u64,
    /// The previous bucket's credits as of the last lease.
    pub prev: u64,
    /// Calls this instance counted in it.
    pub mine: u64,
    /// [`Gate::decided`](super::Gate) at its last lease (`u64::MAX`:
    /// never leased).
    pub leased_at: u64,
    /// Credits of this instance's reserve taken for it (in `total`).
    pub reserve: u64,
    /// Of those, still unused (in `held`; spent first, never given back).
    pub reserve_left: u64,
    /// A reserve was taken for it (none is taken again).
    pub reserved: bool,
}

impl Held {
    /// A counter on a reserve of `reserve`, `left` of it in hand (never
    /// leased).
    pub fn on_reserve(reserve: u64, left: u64) -> Self {
        Held {
            total: reserve,
            held: left,
            reserve,
            reserve_left: left,
            reserved: true,
            leased_at: u64::MAX,
            ..Held::default()
        }
    }

    /// Credits held that came from the ledger (those it may get back).
    pub fn shared_held(&self) -> u64 {
        self.held - self.reserve_left
    }
}
