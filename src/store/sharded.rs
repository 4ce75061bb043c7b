//! The in-memory store split by caller over threads, for offline work.
//!
//! Callers are independent: the window algorithm never looks at one
//! caller's state while deciding another's call. So each caller's events
//! go, in their order, to the one shard its number hashes to, and each
//! shard is a [`MemoryStore`] running the reference algorithm. The
//! verdicts are the sequential store's by construction, computed on
//! several cores, and come back in input order.

use std::hash::BuildHasher;

use crate::engine::event::CallEvent;
use crate::engine::record::Verdict;
use crate::engine::rules::RuleSet;
use crate::error::StoreError;
use crate::store::memory::MemoryStore;
use crate::store::WindowStore;

/// The shard of a caller among `shards`: a fixed hash of the number, so a
/// caller stays in its shard for the whole run.
pub fn shard_of(caller: &str, shards: usize) -> usize {
    const SEED: u64 = 0x63_616c_6c67_7561; // any fixed value
    let hash = foldhash::fast::FixedState::with_seed(SEED).hash_one(caller);
    // The high bits, spread over the shards without a division bias worth
    // noting (shards is a handful).
    ((hash >> 32) as usize * shards) >> 32
}

/// Per shard, the indices (in input order) of the events whose caller it
/// holds; and per event, its shard.
pub fn split_by_caller<'a>(
    callers: impl ExactSizeIterator<Item = &'a str>,
    shards: usize,
) -> (Vec<usize>, Vec<Vec<usize>>) {
    let shards = shards.max(1);
    let mut of = Vec::with_capacity(callers.len());
    let mut parts = vec![Vec::with_capacity(callers.len() / shards + 1); shards];
    for (i, caller) in callers.enumerate() {
        let s = shard_of(caller, shards);
        of.push(s);
        parts[s].push(i);
    }
    (of, parts)
}

/// Runs `work(shard, its indices)` for every shard, each on a thread of its
/// own (the first on the calling thread), and returns the results in shard
/// order. A panic in a shard is resumed here.
pub fn run_shards<T: Send, R: Send>(
    shards: &mut [T],
    parts: &[Vec<usize>],
    work: impl Fn(&mut T, &[usize]) -> R + Sync,
) -> Vec<R> {
    let work = &work;
    std::thread::scope(|s| {
        let mut pairs = shards.iter_mut().zip(parts);
        let first = pairs.next();
        let handles: Vec<_> = pairs
            .map(|(shard, idx)| s.spawn(move || work(shard, idx)))
            .collect();
        let mut out = Vec::with_capacity(handles.len() + 1);
        if let Some((shard, idx)) = first {
            out.push(work(shard, idx));
        }
        for h in handles {
            out.push(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        }
        out
    })
}

/// Decides a shard's share of `events` (the indices `idx`, in order) on
/// its store; `unique[i]` as in [`MemoryStore::apply_unique`] (missing
/// flags are false).
pub fn decide_share(
    store: &mut MemoryStore,
    rules: &RuleSet,
    events: &[CallEvent],
    unique: &[bool],
    idx: &[usize],
) -> Vec<Verdict> {
    idx.iter()
        .map(|&i| store.apply_unique(rules, &events[i], unique.get(i).copied().unwrap_or(false)))
        .collect()
}

/// The shards' results back in input order: `of[i]` is event `i`'s shard,
/// and each shard's results (verdicts, or references to them) come in its
/// events' order.
pub fn merge_in_order<I: Iterator>(
    of: &[usize],
    parts: impl IntoIterator<Item = I>,
) -> Vec<I::Item> {
    let mut parts: Vec<I> = parts.into_iter().collect();
    let mut merged = Vec::with_capacity(of.len());
    for &s in of {
        merged.extend(parts.get_mut(s).and_then(Iterator::next));
    }
    merged
}

/// The number of shards that suits this machine: one per core.
pub fn shards_per_core() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// [`MemoryStore`]s, one per shard of callers, applied on as many threads.
///
/// For time-sorted input (replay, features): each shard evicts idle
/// callers against the newest time it has seen, which never changes a
/// result on such input (see [`MemoryStore`]).
#[derive(Debug)]
pub struct ShardedStore {
    shards: Vec<MemoryStore>,
}

impl ShardedStore {
    /// An empty store of `shards` shards (at least one).
    pub fn new(shards: usize) -> Self {
        ShardedStore {
            shards: (0..shards.max(1)).map(|_| MemoryStore::new()).collect(),
        }
    }

    /// An empty store with one shard per core.
    pub fn per_core() -> Self {
        Self::new(shards_per_core())
    }

    /// Number of shards.
    pub fn shards(&self) -> usize {
        self.shards.len()
    }

    /// The shards: shard `i` holds the callers [`shard_of`] puts in it.
    pub fn shards_mut(&mut self) -> &mut [MemoryStore] {
        &mut self.shards
    }

    /// Number of callers with state, over all shards.
    pub fn callers(&self) -> usize {
        self.shards.iter().map(MemoryStore::callers).sum()
    }

    /// Applies events in order (per caller, the order given); `unique[i]`
    /// as in [`MemoryStore::apply_unique`] (missing flags are false).
    /// Verdicts come back in input order.
    pub fn apply_unique(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        unique: &[bool],
    ) -> Vec<Verdict> {
        let (of, parts) =
            split_by_caller(events.iter().map(|e| e.caller.as_str()), self.shards.len());
        let results = run_shards(&mut self.shards, &parts, |store, idx| {
            decide_share(store, rules, events, unique, idx)
        });
        merge_in_order(&of, results.into_iter().map(Vec::into_iter))
    }
}

impl WindowStore for ShardedStore {
    async fn apply_batch(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Verdict>, StoreError> {
        Ok(self.apply_unique(rules, events, &[]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_every_index_once_in_order() {
        let callers: Vec<String> = (0..1_000).map(|i| format!("+3491{:07}", i % 97)).collect();
        let (of, parts) = split_by_caller(callers.iter().map(String::as_str), 3);
        assert_eq!(of.len(), callers.len());
        let mut seen = vec![false; callers.len()];
        for (s, idx) in parts.iter().enumerate() {
            assert!(
                idx.windows(2).all(|w| w[0] < w[1]),
                "shard {s} out of order"
            );
            for &i in idx {
                assert_eq!(of[i], s);
                assert!(!std::mem::replace(&mut seen[i], true));
            }
        }
        assert!(seen.iter().all(|&x| x));
        // A caller always lands in the same shard, and all shards get some.
        for (i, c) in callers.iter().enumerate() {
            assert_eq!(of[i], shard_of(c, 3));
        }
        assert!(parts.iter().all(|p| !p.is_empty()));
    }
}
