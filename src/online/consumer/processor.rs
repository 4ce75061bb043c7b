//! The stream processor's loop as an object: one [`Processor`] per run,
//! whose [`Processor::step`] reads a batch, admits what fits in the
//! checkpoint allowance, hands it to the decider and finishes the batch
//! before it (encode, produce, background commit).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures::future::Shared as SharedFuture;
use futures::FutureExt;
use tokio::sync::watch;
use tracing::info;

use crate::engine::rules::RuleSet;
use crate::error::ConsumeError;
use crate::online::metrics::{Health, Metrics};
use crate::store::WindowStore;

use super::batch::{next_batch, sort_read, BatchCap, Read, Sorted};
use super::checkpoint::Checkpoint;
use super::clients::{
    commit_now, connect, drain, produce_batch, wait_for_room, warm_producer, Clients,
};
use super::decide::{self, Decider, Deciding};
use super::delivery::{ConsumerCtx, OutRecord};
use super::encode::Encoder;
use super::{ConsumeConfig, ConsumeStats, CHECKPOINT_RETRY};

/// The shutdown signal, shared by the loop and the decider.
type Shutdown = SharedFuture<Pin<Box<dyn Future<Output = ()> + Send>>>;

/// What became of a batch offered for deciding.
enum Admission {
    /// Decide these (the rest, past the checkpoint allowance, is held).
    Decide(Read, RuleSet),
    /// Nothing fits until a checkpoint commits; the batch is held.
    Wait,
    /// Shutdown came while the store was failing.
    Stop,
}

/// One run of the stream processor.
pub(super) struct Processor {
    clients: Clients,
    config: ConsumeConfig,
    metrics: Arc<Metrics>,
    rules: watch::Receiver<RuleSet>,
    decider: Decider,
    shutdown: Shutdown,
    /// Encodes the records of decided batches.
    encoder: Encoder,
    stats: ConsumeStats,
    checkpoint: Checkpoint,
    /// Batches submitted so far.
    seq: u64,
    /// Messages read but not admitted yet.
    held: Read,
    /// The batch being decided while the next one is collected.
    deciding: Option<Deciding>,
    /// The largest batch to collect next.
    cap: BatchCap,
}

impl Processor {
    /// Connects, subscribes and starts the decider on `store`.
    pub async fn start<S: WindowStore + 'static>(
        config: ConsumeConfig,
        store: S,
        rules: watch::Receiver<RuleSet>,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<Self, ConsumeError> {
        config.check()?;
        let clients = connect(&config, &metrics, &health)?;
        warm_producer(&clients, &config).await;
        info!(topic = %config.input_topic, group = %config.group, "consuming");
        let shutdown: Shutdown =
            (Box::pin(shutdown) as Pin<Box<dyn Future<Output = ()> + Send>>).shared();
        let decider = Decider::spawn(
            store,
            config.clone(),
            metrics.clone(),
            health,
            shutdown.clone(),
        );
        let (encoder, checkpoint) = {
            let current = rules.borrow();
            (
                Encoder::new(&current, &config),
                Checkpoint::new(current.dedup_ms()),
            )
        };
        let cap = BatchCap::new(config.batch_size);
        Ok(Processor {
            clients,
            config,
            metrics,
            rules,
            decider,
            shutdown,
            encoder,
            stats: ConsumeStats::default(),
            checkpoint,
            seq: 0,
            held: Read::default(),
            deciding: None,
            cap,
        })
    }

    /// One turn: read a batch, admit it, hand it to the decider, and finish
    /// the batch before it. `false` when the run is over.
    pub async fn step(&mut self) -> Result<bool, ConsumeError> {
        let held = std::mem::take(&mut self.held);
        let next = next_batch(
            &self.clients,
            &self.config,
            &mut self.shutdown,
            held,
            self.deciding.as_mut(),
            self.cap.get(),
        )
        .await?;
        // Store what was acknowledged meanwhile; a wanted background commit
        // may start.
        self.settle()?;
        let batch = match next {
            Some(b) if !b.is_empty() => {
                self.cap.note(b.len());
                b
            }
            // Nothing new (the batch being decided is back, or all of it
            // came from partitions revoked meanwhile): finish that one.
            Some(_) => return self.finish(false).await,
            None => {
                self.finish(false).await?;
                return Ok(false);
            }
        };
        match self.admit(batch).await? {
            Admission::Decide(batch, rules) => self.submit(batch, rules).await,
            Admission::Wait => {
                tokio::time::sleep(CHECKPOINT_RETRY).await;
                Ok(true)
            }
            Admission::Stop => Ok(false),
        }
    }

    /// Ends the run: the background commit, the last acknowledgements and
    /// a synchronous commit.
    pub async fn drain(mut self) -> Result<ConsumeStats, ConsumeError> {
        self.checkpoint.settle_background().await;
        drain(&self.clients, self.config.drain_timeout).await?;
        Ok(self.stats)
    }

    /// Stores the offsets of acknowledged batches and moves a wanted
    /// background commit on.
    fn settle(&mut self) -> Result<(), ConsumeError> {
        self.clients
            .shared
            .settle::<ConsumerCtx, _>(&*self.clients.consumer)?;
        self.checkpoint
            .after_settle(&self.clients.consumer, &self.clients.shared);
        Ok(())
    }

    /// Admits only what fits in the checkpoint allowance; when nothing
    /// does, finishes the batch being decided and commits (now, or after
    /// the commit under way).
    async fn admit(&mut self, mut batch: Read) -> Result<Admission, ConsumeError> {
        let rules = self.rules.borrow().clone();
        let dedup = rules.dedup_ms();
        let mut cut = self.checkpoint.fits(&batch.items, dedup);
        if cut == 0 {
            // Everything decided is produced first, so a commit covers it.
            if !self.finish(false).await? {
                return Ok(Admission::Stop);
            }
            self.checkpoint.settle_background().await;
            cut = self.checkpoint.fits(&batch.items, dedup);
            if cut == 0 {
                let ok = commit_now(&self.clients, self.config.drain_timeout).await?;
                self.checkpoint.committed(ok);
                if !ok {
                    // Decide nothing more until it is committed (a
                    // rebalance usually; reading on serves it). What was
                    // read meanwhile waits, undecided; what a revoke takes
                    // is dropped from it and re-read by the new owner.
                    self.held = batch;
                    return Ok(Admission::Wait);
                }
                cut = self.checkpoint.fits(&batch.items, dedup);
            }
        }
        if cut < batch.len() {
            self.held = batch.split_off(cut);
        }
        Ok(Admission::Decide(batch, rules))
    }

    /// Hands `batch` to the decider, then finishes the one before (it is
    /// produced while this one is decided).
    async fn submit(&mut self, batch: Read, rules: RuleSet) -> Result<bool, ConsumeError> {
        let mut out: Vec<OutRecord> = Vec::with_capacity(batch.len() * 2);
        let Sorted {
            events,
            spans,
            offsets,
            read_at,
        } = sort_read(batch.items, &self.metrics, &mut self.stats, &mut out);
        if let Some(first) = read_at.first() {
            self.metrics
                .batch_wait
                .observe(first.elapsed().as_secs_f64());
        }
        self.seq += 1;
        self.checkpoint.admitted(self.seq, spans);
        let reply = self.decider.submit(rules, events).await?;
        let previous = self.deciding.replace(Deciding {
            seq: self.seq,
            offsets,
            out,
            read_at,
            reply,
            ready: None,
        });
        let cut = !self.held.is_empty();
        self.finish_one(previous, cut).await
    }

    /// Finishes the batch being decided, if any (see [`Self::finish_one`]).
    async fn finish(&mut self, cut: bool) -> Result<bool, ConsumeError> {
        let deciding = self.deciding.take();
        self.finish_one(deciding, cut).await
    }

    /// Waits for a batch's verdicts and records, then produces them and
    /// starts a background commit once a quarter of the checkpoint
    /// allowance is used (or `cut`: the next batch did not fit). `false`:
    /// shutdown came while the store was failing, and nothing of the batch
    /// is produced or committed.
    async fn finish_one(
        &mut self,
        deciding: Option<Deciding>,
        cut: bool,
    ) -> Result<bool, ConsumeError> {
        let Some(mut d) = deciding else {
            return Ok(true);
        };
        let decided = match d.ready.take() {
            Some(r) => r,
            None => (&mut d.reply).await,
        }
        .map_err(|_| ConsumeError::DeciderStopped)?;
        let Some(verdicts) = decided.verdicts else {
            return Ok(false);
        };
        let verdicts = verdicts?;
        self.metrics.batch_size.observe(verdicts.len() as f64);
        decide::count(&self.metrics, &mut self.stats, &verdicts);
        // Encoded here, not by the decider: the store is the pipeline's
        // slowest step, so it does nothing else.
        self.encoder.follow(&decided.rules);
        d.out.reserve(2 * verdicts.len());
        self.encoder.encode(&decided.events, &verdicts, &mut d.out);
        self.stats.batches += 1;
        produce_batch(&self.clients, d.seq, d.offsets, &d.out).await;
        let produced = Instant::now();
        for t in &d.read_at {
            let delay = produced.saturating_duration_since(*t);
            self.metrics.decision_delay.observe(delay.as_secs_f64());
        }
        wait_for_room(&self.clients, self.config.max_in_flight).await?;
        self.checkpoint
            .after_produce(d.seq, cut, &self.clients.consumer, &self.clients.shared);
        Ok(true)
    }
}
