//! Feeding a sweep's base replay: callers numbered and split over the
//! shards, each shard of callers on a thread of its own.

use std::sync::Arc;

use crate::engine::event::CallEvent;
use crate::error::IoError;
use crate::offline::order::OrderedLog;
use crate::offline::read::CallLog;

use super::Sweeper;

impl Sweeper {
    /// Feeds the base replay (only: no per-limit replays) every chunk of
    /// `chunks`, each shard of callers on a thread of its own with a queue,
    /// so the shards never wait for each other between chunks. Chunks
    /// without caller numbers are numbered here, like [`Sweeper::feed_unique`].
    pub(super) fn feed_queued(
        &mut self,
        chunks: &mut dyn Iterator<Item = CallLog>,
    ) -> Result<(), IoError> {
        let shards = self.base.len();
        let (rules, index) = (&self.rules, self.index);
        let numbers = &mut self.numbers;
        std::thread::scope(|s| {
            let mut queues = Vec::with_capacity(shards);
            for shard in &mut self.base {
                let (tx, rx) = std::sync::mpsc::sync_channel::<(Arc<CallLog>, Vec<usize>)>(2);
                queues.push(tx);
                s.spawn(move || {
                    for (log, idx) in rx {
                        let log: &CallLog = &log;
                        let numbered = (&log.events[..], &log.unique[..], &log.callers[..]);
                        shard.feed_all(rules, index, numbered, &idx, shards);
                    }
                });
            }
            for mut chunk in chunks {
                if let Some(callers) = number_callers(numbers, &chunk.events, &chunk.callers) {
                    chunk.callers = callers;
                }
                let parts = split_by_number(&chunk.callers, shards);
                let chunk = Arc::new(chunk);
                for (queue, part) in queues.iter().zip(parts) {
                    if queue.send((Arc::clone(&chunk), part)).is_err() {
                        return Err(IoError::WorkerLost("sweep shard"));
                    }
                }
            }
            Ok(())
        })
    }

    /// Feeds the base replay (only) the whole of `log`, held in memory
    /// with its callers numbered ([`OrderedLog::by_shards`]), each shard
    /// decoding its own callers' events on a thread of its own: no thread
    /// decodes every event for the others. `done(n)`: `n` more events were
    /// fed (by the first shard's count of positions passed).
    pub(super) fn feed_by_shards(&mut self, log: &OrderedLog, done: &(dyn Fn(u64) + Sync)) {
        let shards = self.base.len();
        let (rules, index) = (&self.rules, self.index);
        let n = log.len();
        std::thread::scope(|s| {
            for (k, shard) in self.base.iter_mut().enumerate() {
                s.spawn(move || {
                    for start in (0..n).step_by(super::SWEEP_CHUNK) {
                        let range = start..(start + super::SWEEP_CHUNK).min(n);
                        let len = range.len() as u64;
                        log.shard_events(range, (k, shards), |e, unique, caller| {
                            shard.feed(rules, index, e, unique, caller as usize / shards);
                        });
                        if k == 0 {
                            done(len);
                        }
                    }
                });
            }
        });
    }
}

/// The callers' numbers of `events` in a sweep that has numbered callers
/// itself in `numbers`: `None` when the log's own (`given`,
/// [`CallLog::callers`]) serve, as they do while the sweep has numbered
/// none; else the numbers, given here.
pub(super) fn number_callers(
    numbers: &mut foldhash::HashMap<compact_str::CompactString, u32>,
    events: &[(u64, CallEvent)],
    given: &[u32],
) -> Option<Vec<u32>> {
    if given.len() == events.len() && numbers.is_empty() {
        return None;
    }
    Some(
        events
            .iter()
            .map(|(_, e)| {
                let next = numbers.len() as u32;
                *numbers.entry(e.caller.clone()).or_insert(next)
            })
            .collect(),
    )
}

/// Per shard, the indices of the events whose caller's number it holds
/// (the number modulo the shards).
pub(super) fn split_by_number(callers: &[u32], shards: usize) -> Vec<Vec<usize>> {
    let mut parts = vec![Vec::with_capacity(callers.len() / shards + 1); shards];
    for (i, &c) in callers.iter().enumerate() {
        parts[c as usize % shards].push(i);
    }
    parts
}
