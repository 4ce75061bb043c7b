//! What an instance holds of each counter ([`Held`]), in a [`Slab`]: the
//! gate's buckets map a counter to its place here, so a batch's plan finds
//! each of its counters once and its decide goes straight to the place
//! (before, decide built each call's counter again and looked it up in its
//! bucket's table: a third of the gate's time).

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

/// [`Held`] counters by place; a place freed is reused.
#[derive(Debug, Default)]
pub(super) struct Slab {
    places: Vec<Held>,
    free: Vec<usize>,
}

impl Slab {
    /// Puts `held` in a free place; returns the place.
    pub fn put(&mut self, held: Held) -> usize {
        match self.free.pop() {
            Some(at) => {
                self.places[at] = held;
                at
            }
            None => {
                self.places.push(held);
                self.places.len() - 1
            }
        }
    }

    /// Frees place `at` (its counter is gone).
    pub fn free(&mut self, at: usize) {
        self.free.push(at);
    }

    /// The counter at place `at` (one [`Slab::put`] returned, not freed).
    pub fn get(&self, at: usize) -> &Held {
        &self.places[at]
    }

    /// The counter at place `at`, to change.
    pub fn get_mut(&mut self, at: usize) -> &mut Held {
        &mut self.places[at]
    }

    /// Places in use.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.places.len() - self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_place_is_reused() {
        let mut s = Slab::default();
        let a = s.put(Held::on_reserve(3, 3));
        let b = s.put(Held::default());
        s.get_mut(b).mine = 7;
        assert_eq!((s.get(a).reserve, s.get(b).mine, s.len()), (3, 7, 2));
        s.free(a);
        assert_eq!(s.len(), 1);
        let c = s.put(Held::on_reserve(1, 0));
        assert_eq!(c, a, "the freed place is used again");
        assert_eq!((s.get(c).reserve, s.get(c).held, s.len()), (1, 0, 2));
        assert_eq!(s.get(b).mine, 7, "the other untouched");
    }
}
