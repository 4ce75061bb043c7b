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

/// Events handed to a [`ShardedStore`] at once in a replay: enough that
/// starting the shards' threads is a small part of the work.
pub const SHARDED_BATCH: usize = 65_536;

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

/// Threads kept for the life of a sharded computation, one per shard, that
/// run [`run_shards`]' work batch after batch: a batch costs no thread
/// start, and each thread's allocator keeps the memory it freed for the
/// next batch instead of faulting in fresh pages. One shard, or a pool
/// that could not be started, runs as [`run_shards`] does.
#[derive(Debug)]
pub struct ShardThreads {
    pool: Option<rayon::ThreadPool>,
}

impl ShardThreads {
    /// Threads for `shards` shards (none for one).
    pub fn new(shards: usize) -> Self {
        let pool = (shards > 1)
            .then(|| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(shards)
                    .thread_name(|i| format!("shard-{i}"))
                    .build()
            })
            .and_then(|built| {
                built
                    .map_err(|e| tracing::warn!(error = %e, "shard threads not started; using scoped threads"))
                    .ok()
            });
        ShardThreads { pool }
    }

    /// Runs `work(shard, its indices)` for every shard, each on a thread,
    /// and returns the results in shard order. A panic in a shard is
    /// resumed here.
    pub fn run<T: Send, R: Send>(
        &self,
        shards: &mut [T],
        parts: &[Vec<usize>],
        work: impl Fn(&mut T, &[usize]) -> R + Sync,
    ) -> Vec<R> {
        let Some(pool) = &self.pool else {
            return run_shards(shards, parts, work);
        };
        let work = &work;
        let mut out: Vec<Option<R>> = shards.iter().map(|_| None).collect();
        pool.scope(|s| {
            for ((shard, idx), slot) in shards.iter_mut().zip(parts).zip(&mut out) {
                s.spawn(move |_| *slot = Some(work(shard, idx)));
            }
        });
        // Every spawned job filled its slot (a panic would have been
        // resumed by the scope).
        out.into_iter().flatten().collect()
    }
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
    threads: ShardThreads,
}

impl ShardedStore {
    /// An empty store of `shards` shards (at least one).
    pub fn new(shards: usize) -> Self {
        let shards = shards.max(1);
        ShardedStore {
            shards: (0..shards).map(|_| MemoryStore::new()).collect(),
            threads: ShardThreads::new(shards),
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
        let flag = |i: usize| unique.get(i).copied().unwrap_or(false);
        let results = self.threads.run(&mut self.shards, &parts, |store, idx| {
            idx.iter()
                .map(|&i| store.apply_unique(rules, &events[i], flag(i)))
                .collect::<Vec<_>>()
        });
        let mut per_shard: Vec<_> = results.into_iter().map(Vec::into_iter).collect();
        let mut verdicts = Vec::with_capacity(of.len());
        for &s in &of {
            verdicts.extend(per_shard.get_mut(s).and_then(Iterator::next));
        }
        verdicts
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

    async fn apply_batch_unique(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        unique: &[bool],
    ) -> Result<Vec<Verdict>, StoreError> {
        Ok(self.apply_unique(rules, events, unique))
    }

    fn replay_batch(&self) -> usize {
        SHARDED_BATCH
    }

    fn as_sharded(&mut self) -> Option<&mut ShardedStore> {
        Some(self)
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
