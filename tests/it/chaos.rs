//! Chaos on the real components (reliability issue): tansu on its sqlite
//! storage (topics, offsets and groups survive) and redis-server with the
//! AOF, each killed (SIGKILL) and restarted while the consumer works. Every
//! call must be decided exactly once in effect: one distinct record per
//! call, equal to `replay`.
//!
//! tansu 0.6 never expires a group member killed while joining; these tests
//! kill the broker and Redis, never a member, and start killing only once
//! decisions flow (the member has joined).

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use callguard::engine::event::CallEvent;
use callguard::engine::rules::RuleSet;
use callguard::online::consumer::ConsumeConfig;
use callguard::store::redis::{RedisConfig, RedisStore};
use common::kafka::TOPICS;
use common::kafka::{by_call_id, read_decisions};
use common::{RedisServer, Tansu};
use serde_json::Value;

/// A day of generated calls in processing order, and the replay's records.
fn sample(rows: usize, seed: u64) -> (Vec<CallEvent>, RuleSet, HashMap<String, Value>) {
    let (_dir, path) = common::generated_csv(rows, seed);
    let log = callguard::offline::order::OrderedLog::open(&path, &Default::default())
        .unwrap()
        .read_all()
        .unwrap();
    let events: Vec<CallEvent> = log.events.into_iter().map(|(_, e)| e).collect();
    let rules = RuleSet::from_file(std::path::Path::new("data/rules.toml")).unwrap();
    let expected = common::replay_records(&events, &rules);
    (events, rules, expected)
}

async fn start(
    brokers: &str,
    redis_url: &str,
    rules: RuleSet,
    group: &str,
) -> common::kafka::InProcess {
    let store = RedisStore::connect(RedisConfig {
        urls: vec![redis_url.to_string()],
        ..RedisConfig::default()
    })
    .await
    .unwrap();
    let mut config = ConsumeConfig::new(brokers, group, TOPICS[0], TOPICS[1], TOPICS[2], TOPICS[3]);
    config.batch_size = 100;
    config.kafka_settings = vec![("session.timeout.ms".into(), "10000".into())];
    common::kafka::in_process(config, store, rules)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_killed_and_restarted_mid_run_loses_nothing() {
    let redis = RedisServer::start(&[]);
    let tansu = Tansu::start_sqlite();
    let brokers = tansu.with_topics(&TOPICS.map(|t| (t, 2)));
    let (events, rules, expected) = sample(15_000, 31);
    let (first, second) = events.split_at(events.len() / 2);
    callguard::online::produce::produce(first.iter(), &brokers, &[], "calls")
        .await
        .unwrap();
    let run = start(&brokers, &redis.url(), rules, "g-broker-chaos").await;
    let partial = read_decisions(&brokers, "call-decisions", 2_000, Duration::from_secs(180)).await;
    assert!(
        by_call_id(&partial).len() >= 2_000,
        "decisions flow before the kill"
    );
    let tansu = tansu.restart();
    // The second half goes to the restarted broker: the consumer must carry
    // on past the restart to decide it.
    callguard::online::produce::produce(second.iter(), &brokers, &[], "calls")
        .await
        .unwrap();
    let records = read_decisions(
        &brokers,
        "call-decisions",
        events.len(),
        Duration::from_secs(600),
    )
    .await;
    run.stop().await;
    common::assert_records_equal_replay(&records, &expected);
    drop(tansu);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_mid_run_loses_nothing() {
    let aof = ["--appendonly", "yes", "--appendfsync", "always"];
    let redis = RedisServer::start(&aof);
    let tansu = Tansu::start_sqlite();
    let brokers = tansu.with_topics(&TOPICS.map(|t| (t, 2)));
    let (events, rules, expected) = sample(15_000, 32);
    let (first, second) = events.split_at(events.len() / 2);
    callguard::online::produce::produce(first.iter(), &brokers, &[], "calls")
        .await
        .unwrap();
    let run = start(&brokers, &redis.url(), rules, "g-redis-chaos").await;
    let partial = read_decisions(&brokers, "call-decisions", 2_000, Duration::from_secs(180)).await;
    assert!(
        by_call_id(&partial).len() >= 2_000,
        "decisions flow before the kill"
    );
    let (port, dir) = redis.stop();
    // The second half arrives while Redis is down: the consumer blocks on
    // it and decides it after the restart, from the windows the AOF kept.
    callguard::online::produce::produce(second.iter(), &brokers, &[], "calls")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let redis = RedisServer::start_in(port, dir, &aof);
    let records = read_decisions(
        &brokers,
        "call-decisions",
        events.len(),
        Duration::from_secs(600),
    )
    .await;
    run.stop().await;
    common::assert_records_equal_replay(&records, &expected);
    drop(redis);
}
