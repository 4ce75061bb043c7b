//! A batch's call ids as [`Gate::plan`](super::Gate::plan) found them,
//! kept for [`Gate::decide`](super::Gate::decide) of the same batch: the
//! gate remembers hundreds of thousands of ids, and a lookup there is its
//! dearest step; with this, each call is looked up once (when planned)
//! rather than twice, and hashed once.

use std::sync::Arc;

use compact_str::CompactString;
use hashbrown::HashTable;

use super::recent::Recent;
use crate::engine::event::{Aggregated, CallEvent};

/// The results of the call ids the gate decided ([`super::REMEMBERED_IDS`]).
pub(super) type Remembered = Recent<CompactString, Arc<[Aggregated]>>;

/// Batches larger than this are not kept for decide (offline logs decided
/// in one go): each call is looked up again there, as it was.
const KEPT_MOST: usize = 1 << 16;

/// What plan found of one call's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Seen {
    /// Neither remembered nor earlier in the batch: decided afresh.
    New,
    /// Earlier in the batch (decide finds it remembered by then).
    Again,
    /// Remembered when planned: decided before.
    Known,
}

/// A batch's call ids, checked against the remembered ones.
#[derive(Debug)]
pub(super) struct Checked {
    /// The batch: length, first and last call ids.
    len: usize,
    first: Option<CompactString>,
    last: Option<CompactString>,
    /// Per call (when `kept`): what was found, and its id's hash.
    seen: Vec<Seen>,
    hashes: Vec<u64>,
    kept: bool,
    /// The gate's batches decided when it was planned.
    pub decided: u64,
}

impl Checked {
    /// Checks `events`' ids against `remembered`, with `decided` batches
    /// decided so far.
    pub fn new(events: &[CallEvent], remembered: &Remembered, decided: u64) -> Self {
        let kept = events.len() <= KEPT_MOST;
        let room = if kept { events.len() } else { 0 };
        let mut seen = Vec::with_capacity(events.len());
        let mut hashes = Vec::with_capacity(room);
        // (Ids first seen in this batch, with their hashes.)
        let mut ids: HashTable<(u64, usize)> = HashTable::with_capacity(room);
        for (j, ev) in events.iter().enumerate() {
            let hash = remembered.hash_of(&ev.call_id);
            let s = if remembered.get_hashed(hash, &ev.call_id).is_some() {
                Seen::Known
            } else if !kept {
                Seen::New
            } else if ids
                .find(hash, |&(_, k)| events[k].call_id == ev.call_id)
                .is_some()
            {
                Seen::Again
            } else {
                ids.insert_unique(hash, (hash, j), |&(h, _)| h);
                Seen::New
            };
            seen.push(s);
            if kept {
                hashes.push(hash);
            }
        }
        Checked {
            len: events.len(),
            first: events.first().map(|e| e.call_id.clone()),
            last: events.last().map(|e| e.call_id.clone()),
            seen,
            hashes,
            kept,
            decided,
        }
    }

    /// Call `j` was decided before (its id remembered).
    pub fn known(&self, j: usize) -> bool {
        self.seen[j] == Seen::Known
    }

    /// Kept for decide (the batch is not too large).
    pub fn kept(&self) -> bool {
        self.kept
    }

    /// Kept for decide, and checked for `events`.
    pub fn fits(&self, events: &[CallEvent]) -> bool {
        self.kept
            && self.len == events.len()
            && self.first.as_ref() == events.first().map(|e| &e.call_id)
            && self.last.as_ref() == events.last().map(|e| &e.call_id)
    }

    /// Call `j`'s id hash, and whether it may be remembered by now (else
    /// it is not: no lookup needed). Only when [`Checked::fits`].
    pub fn for_decide(&self, j: usize) -> (u64, bool) {
        (self.hashes[j], self.seen[j] != Seen::New)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(id: &str) -> CallEvent {
        CallEvent {
            call_id: id.into(),
            caller: "+34600000001".into(),
            ..CallEvent::default()
        }
    }

    #[test]
    fn ids_are_new_again_or_known() {
        let mut remembered: Remembered = Recent::new(8);
        remembered.put("old".into(), Arc::from(Vec::new()));
        let batch: Vec<CallEvent> = ["a", "old", "b", "a", "old"]
            .into_iter()
            .map(call)
            .collect();
        let c = Checked::new(&batch, &remembered, 0);
        let seen: Vec<Seen> = (0..batch.len()).map(|j| c.seen[j]).collect();
        use Seen::*;
        assert_eq!(seen, [New, Known, New, Again, Known]);
        assert!(c.fits(&batch));
        assert!(!c.fits(&batch[1..]), "another batch");
        let (hash, look) = c.for_decide(3);
        assert_eq!((hash, look), (remembered.hash_of("a"), true));
        assert!(!c.for_decide(2).1, "b: new, not looked up");
    }
}
