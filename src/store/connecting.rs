//! A Redis store that connects when it first can: `serve` starts while
//! Redis is down and answers not-ready (and 503s) until it is up, as
//! `consume` waits for its store, instead of exiting.

use crate::engine::event::CallEvent;
use crate::engine::record::Verdict;
use crate::engine::rules::RuleSet;
use crate::engine::window::CallerState;
use crate::error::StoreError;
use crate::store::{cached, redis, AnyStore, StoreStats, WindowStore};

/// A Redis store, connected on the first call or probe that reaches Redis.
pub struct Connecting {
    config: redis::RedisConfig,
    cache: Option<cached::CacheLimit>,
    store: Option<AnyStore>,
}

impl Connecting {
    /// Not connected yet: [`AnyStore::connect_redis`] with these settings
    /// is tried again on every call and probe until it succeeds.
    pub fn later(config: redis::RedisConfig, cache: Option<cached::CacheLimit>) -> Self {
        Connecting {
            config,
            cache,
            store: None,
        }
    }

    /// Already connected.
    pub fn now(store: AnyStore) -> Self {
        Connecting {
            config: redis::RedisConfig::default(),
            cache: None,
            store: Some(store),
        }
    }

    async fn store(&mut self) -> Result<&mut AnyStore, StoreError> {
        if self.store.is_none() {
            let store = AnyStore::connect_redis(self.config.clone(), self.cache).await?;
            tracing::info!("connected to Redis");
            self.store = Some(store);
        }
        self.store
            .as_mut()
            .ok_or_else(|| StoreError::transient("not connected to Redis"))
    }
}

impl WindowStore for Connecting {
    async fn apply_batch(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Verdict>, StoreError> {
        self.store().await?.apply_batch(rules, events).await
    }

    async fn apply_batch_partial(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Option<Verdict>>, StoreError> {
        self.store().await?.apply_batch_partial(rules, events).await
    }

    fn cached_state(&self, caller: &str) -> Option<CallerState> {
        self.store.as_ref()?.cached_state(caller)
    }

    fn stats(&self) -> StoreStats {
        self.store
            .as_ref()
            .map(WindowStore::stats)
            .unwrap_or_default()
    }

    async fn probe(&mut self) -> Result<(), StoreError> {
        self.store().await?.probe().await
    }
}
