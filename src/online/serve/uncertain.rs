//! Calls answered 503 whose store call failed after it may have been
//! applied (a timeout, a connection lost mid-call): Redis may hold their
//! record although no verdict came back, so nothing was published for
//! them. When such a call is retried here and comes back `duplicate`, its
//! record is published then: with `--brokers`, every applied call reaches
//! Kafka once, not never.

use std::collections::{HashSet, VecDeque};

use compact_str::CompactString;

/// How many uncertain call ids are remembered; the oldest go first.
pub(super) const REMEMBERED: usize = 65_536;

/// A bounded set of call ids, oldest evicted first.
#[derive(Default)]
pub(super) struct Uncertain {
    ids: HashSet<CompactString>,
    order: VecDeque<CompactString>,
}

impl Uncertain {
    /// Remembers a call whose store call failed.
    pub(super) fn insert(&mut self, id: &str) {
        if self.ids.insert(id.into()) {
            self.order.push_back(id.into());
        }
        while self.order.len() > REMEMBERED {
            if let Some(old) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
    }

    /// Whether the call was uncertain; it is not any more.
    pub(super) fn settle(&mut self, id: &str) -> bool {
        // Its entry in `order` stays until evicted: a stale id there only
        // removes nothing.
        self.ids.remove(id)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn remembers_a_bounded_number_and_settles_once() {
        let mut u = super::Uncertain::default();
        for i in 0..super::REMEMBERED + 10 {
            u.insert(&format!("c{i}"));
        }
        assert!(!u.settle("c0"), "the oldest were evicted");
        assert!(u.settle("c10"));
        assert!(!u.settle("c10"), "settled once");
        assert!(u.settle(&format!("c{}", super::REMEMBERED + 9)));
    }
}
