//! Values by place, a place freed used again: the gate's counters
//! ([`crate::engine::aggregate::held::Held`]) and the reserves spent in counters past their
//! time ([`crate::engine::aggregate::counter::Spent`]) live in one each, and the tables that
//! find them hold places.

/// Values by place; a place freed is reused.
#[derive(Debug)]
pub(crate) struct Slab<T> {
    places: Vec<T>,
    free: Vec<usize>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            places: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T> Slab<T> {
    /// Puts `value` in a free place; returns the place.
    pub fn put(&mut self, value: T) -> usize {
        match self.free.pop() {
            Some(at) => {
                self.places[at] = value;
                at
            }
            None => {
                self.places.push(value);
                self.places.len() - 1
            }
        }
    }

    /// Frees place `at` (its value is gone).
    pub fn free(&mut self, at: usize) {
        self.free.push(at);
    }

    /// The value at place `at` (one [`Slab::put`] returned, not freed).
    pub fn get(&self, at: usize) -> &T {
        &self.places[at]
    }

    /// The value at place `at`, to change.
    pub fn get_mut(&mut self, at: usize) -> &mut T {
        &mut self.places[at]
    }

    /// Places in use.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.places.len() - self.free.len()
    }

    /// Places made, in use or free.
    #[cfg(test)]
    pub fn made(&self) -> usize {
        self.places.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::aggregate::held::Held;

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
