//! Collecting a batch: messages read and decoded as they arrive, cut at
//! the batch size or the linger, and sorted into events to decide and
//! dead letters.

use std::future::Future;
use std::time::{Duration, Instant};

use rdkafka::message::Message;
use tokio::sync::oneshot;
use tracing::warn;

use crate::engine::event::CallEvent;
use crate::error::KafkaError;
use crate::online::metrics::Metrics;

use super::checkpoint::Spans;
use super::clients::Clients;
use super::decide::{Decided, Deciding};
use super::delivery::{ConsumerCtx, Offsets, OutRecord, Shared};
use super::encode::{dead_letter, decode_message, Item};
use super::{ConsumeConfig, ConsumeStats};

/// Most messages held undecided while a checkpoint waits for its commit.
const MAX_HELD: usize = 100_000;

/// How often an idle consumer stores the offsets of acknowledged batches.
const IDLE_SETTLE: Duration = Duration::from_millis(100);

/// Messages read and not yet decided: decoded as they arrive, while the
/// batch before is with the store.
#[derive(Default)]
pub(super) struct Read {
    pub(super) items: Vec<Item>,
}

impl Read {
    pub(super) fn len(&self) -> usize {
        self.items.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub(super) fn push(&mut self, m: &impl Message, clients: &Clients, config: &ConsumeConfig) {
        let read_at = Instant::now();
        let topic = if m.topic() == &*clients.input_topic {
            clients.input_topic.clone()
        } else {
            m.topic().into()
        };
        let event = decode_message(m, config).map_err(|err| {
            let letter = dead_letter(m, &err, &clients.dlq_topic, config.max_payload_bytes);
            (err.kind(), Box::new(letter))
        });
        self.items.push(Item {
            topic,
            partition: m.partition(),
            offset: m.offset(),
            read_at,
            event,
        });
    }

    /// Drops the messages of partitions revoked since the last call.
    pub(super) fn drop_revoked(&mut self, shared: &Shared) {
        let revoked = shared.take_revoked();
        if revoked.is_empty() {
            return;
        }
        self.items.retain(|m| {
            !revoked
                .iter()
                .any(|(t, p)| *p == m.partition && *t == *m.topic)
        });
    }

    /// Splits off the messages from `at` on.
    pub(super) fn split_off(&mut self, at: usize) -> Read {
        Read {
            items: self.items.split_off(at),
        }
    }
}

/// The largest batch to collect next: small while the consumer keeps up,
/// so a burst the broker delivers at once is split and its first events
/// are decided without waiting for the store to take its last; doubled
/// after two full batches in a row (a backlog: fewer, fuller store calls),
/// up to `--batch-size`; back to the start after a batch cut short.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BatchCap {
    now: usize,
    full_in_a_row: usize,
    max: usize,
}

impl BatchCap {
    /// Starts at a fifth of `max` (at least one event).
    pub(super) fn new(max: usize) -> Self {
        let max = max.max(1);
        BatchCap {
            now: Self::start(max),
            full_in_a_row: 0,
            max,
        }
    }

    fn start(max: usize) -> usize {
        (max / 5).max(1)
    }

    /// The cap for the next batch.
    pub(super) fn get(&self) -> usize {
        self.now
    }

    /// Notes a batch of `len` events collected under the cap.
    pub(super) fn note(&mut self, len: usize) {
        if len >= self.now {
            self.full_in_a_row += 1;
            if self.full_in_a_row >= 2 {
                self.now = (self.now * 2).min(self.max);
                self.full_in_a_row = 0;
            }
        } else {
            self.now = Self::start(self.max);
            self.full_in_a_row = 0;
        }
    }
}

/// Collects the next batch: waits for a first message, then up to the
/// linger time or `cap` events ([`BatchCap`]). When the verdicts of the
/// batch being decided arrive it stops lingering: it returns at once if it
/// has nothing, else after taking the messages already received. `None`
/// when shutdown is requested. While idle it stores the offsets of
/// acknowledged batches now and then.
pub(super) async fn next_batch<F: Future<Output = ()> + Unpin>(
    clients: &Clients,
    config: &ConsumeConfig,
    shutdown: &mut F,
    held: Read,
    mut deciding: Option<&mut Deciding>,
    cap: usize,
) -> Result<Option<Read>, KafkaError> {
    // Held messages (see `checkpoint_due` in `run`) come first, topped up to
    // a batch; while a checkpoint waits, at least one more message is read
    // per retry, as reading serves rebalances.
    let limit = if held.len() >= MAX_HELD {
        held.len() // hold no more: wait for the commit without reading
    } else {
        cap.max(held.len() + 1)
    };
    let mut batch = held;
    batch.drop_revoked(&clients.shared);
    let mut lingering = !batch.is_empty();
    // One timer per batch, not one per message: the linger deadline once
    // a message is in, the idle settle interval before.
    let timer = tokio::time::sleep(if lingering {
        config.batch_linger
    } else {
        IDLE_SETTLE
    });
    tokio::pin!(timer);
    // Watch the batch being decided only until its verdicts are in.
    if deciding.as_ref().is_some_and(|d| d.ready.is_some()) {
        deciding = None;
    }
    // No linger: a batch is cut as soon as nothing more is waiting, not at
    // the timer's next tick (tokio's timers tick in milliseconds: a zero
    // deadline still waited up to one, at every batch).
    let no_linger = config.batch_linger.is_zero();
    while batch.len() < limit {
        let watching = deciding.is_some();
        tokio::select! {
            biased;
            _ = &mut *shutdown => return Ok(None),
            r = reply_of(&mut deciding), if watching => {
                if let Some(d) = deciding.take() {
                    d.ready = Some(r);
                }
                if batch.is_empty() {
                    break;
                }
                // Take what is already there (a backlog), then go.
                timer.as_mut().reset(tokio::time::Instant::now());
                lingering = true;
            }
            m = clients.consumer.recv() => match m {
                Ok(m) => {
                    // What was read from partitions revoked meanwhile is read again
                    // by their new owner; this message comes from the current assignment.
                    batch.drop_revoked(&clients.shared);
                    batch.push(&m, clients, config);
                    if !lingering {
                        lingering = true;
                        timer.as_mut().reset(tokio::time::Instant::now() + config.batch_linger);
                    }
                }
                Err(e) => {
                    warn!(error = %e, "consumer error");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            // (Polled after the consumer: reached only when no message
            // is waiting.)
            () = std::future::ready(()), if lingering && no_linger => break,
            _ = timer.as_mut() => {
                if lingering {
                    break;
                }
                clients.shared.settle::<ConsumerCtx, _>(&*clients.consumer)?;
                timer.as_mut().reset(tokio::time::Instant::now() + IDLE_SETTLE);
            }
        }
    }
    batch.drop_revoked(&clients.shared);
    Ok(Some(batch))
}

/// The verdicts of the batch being decided, when they come (never, for
/// none).
fn reply_of<'a, 'b: 'a>(
    deciding: &'a mut Option<&'b mut Deciding>,
) -> impl Future<Output = Result<Decided, oneshot::error::RecvError>> + use<'a, 'b> {
    std::future::poll_fn(move |cx| match deciding {
        Some(d) => std::pin::Pin::new(&mut d.reply).poll(cx),
        None => std::task::Poll::Pending,
    })
}

/// A batch sorted for deciding.
pub(super) struct Sorted {
    /// The events to decide, in the order read.
    pub(super) events: Vec<CallEvent>,
    /// Their event times per partition.
    pub(super) spans: Spans,
    /// The last offset per partition of every message of the batch.
    pub(super) offsets: Offsets,
    /// When each message was read, in order (the first the oldest).
    pub(super) read_at: Vec<Instant>,
}

/// Sorts a batch read: events to decide, and dead letters (into `out`) for
/// messages that did not decode.
pub(super) fn sort_read(
    items: Vec<Item>,
    metrics: &Metrics,
    stats: &mut ConsumeStats,
    out: &mut Vec<OutRecord>,
) -> Sorted {
    let mut events = Vec::with_capacity(items.len());
    let mut spans = Spans::default();
    let mut offsets = Offsets::default();
    let mut read_at = Vec::with_capacity(items.len());
    for m in items {
        read_at.push(m.read_at);
        offsets.note(&m.topic, m.partition, m.offset, |last| {
            *last = (*last).max(m.offset)
        });
        match m.event {
            Ok(e) => {
                spans.note(&m.topic, m.partition, e.ts_ms);
                metrics.dropped_fields(&e);
                events.push(e);
            }
            Err((kind, letter)) => {
                metrics.dead_letter(kind);
                stats.dead_letters += 1;
                out.push(*letter);
            }
        }
    }
    Sorted {
        events,
        spans,
        offsets,
        read_at,
    }
}

#[cfg(test)]
mod tests {
    use super::BatchCap;

    #[test]
    fn the_cap_starts_small_doubles_under_a_backlog_and_resets() {
        let mut cap = BatchCap::new(500);
        assert_eq!(cap.get(), 100);
        // A burst of 230 events: 100, 100, 30; the cap stays small but
        // for one doubling, then resets.
        cap.note(100);
        assert_eq!(cap.get(), 100);
        cap.note(100);
        assert_eq!(cap.get(), 200);
        cap.note(30);
        assert_eq!(cap.get(), 100);
        // A backlog: every batch full, up to --batch-size and no further.
        for _ in 0..10 {
            let n = cap.get();
            cap.note(n);
        }
        assert_eq!(cap.get(), 500);
        cap.note(499);
        assert_eq!(cap.get(), 100);
        // Small settings still give at least one event.
        assert_eq!(BatchCap::new(3).get(), 1);
        assert_eq!(BatchCap::new(0).get(), 1);
    }
}
