//! The cached store's own guarantees through a real redis-server, one test
//! per way a call could get a wrong or second record: a reload that
//! lengthens the needed span, a restarted server's lost script in the
//! middle of a batch, a batch of duplicates, writers really at once on the
//! same caller, a contended caller that exhausts its rounds, a prefix
//! whose claim was lost or never recorded.

use crate::common;

use std::time::Duration;

use callguard::engine::event::CallEvent;
use callguard::engine::record::Verdict;
use callguard::engine::rules::RuleSet;
use callguard::store::cached::{CachedStore, SCAN_COUNT, SETTLED_AFTER, TRIM_COUNT};
use callguard::store::memory::MemoryStore;
use callguard::store::redis::{RedisConfig, RedisStore};
use callguard::store::{Next, WindowStore};
use common::scenarios::T0;
use common::{ev, raw_command, RedisCluster, RedisServer};

fn config(urls: Vec<String>, prefix: &str, idempotency: bool) -> RedisConfig {
    RedisConfig {
        cluster: urls.len() > 1,
        urls,
        key_prefix: prefix.to_string(),
        idempotency,
        decide_ahead: true,
        timeout: Duration::from_secs(5),
        ttl_slack: Duration::ZERO,
        tls_ca: None,
        block_keys: true,
        ..RedisConfig::default()
    }
}

async fn cached(urls: Vec<String>, prefix: &str) -> CachedStore {
    CachedStore::connect(config(urls, prefix, true), 1_000)
        .await
        .unwrap()
}

/// Two writers on `server` under `prefix`: one that gives a caller up at
/// its first refusal (one round a batch), and another with the defaults.
async fn one_round_and_another(server: &RedisServer, prefix: &str) -> (CachedStore, CachedStore) {
    let urls = vec![server.url()];
    let one_round = CachedStore::connect(config(urls.clone(), prefix, true), 100)
        .await
        .unwrap()
        .with_max_rounds(1);
    (one_round, cached(urls, prefix).await)
}

async fn memory_run(rules: &RuleSet, batches: &[&[CallEvent]]) -> Vec<Verdict> {
    let mut m = MemoryStore::new();
    let mut out = Vec::new();
    for b in batches {
        out.extend(m.apply_batch(rules, b).await.unwrap());
    }
    out
}

fn pttl(con: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(con).unwrap()
}

fn version(con: &mut redis::Connection, key: &str) -> Vec<u8> {
    redis::cmd("GETRANGE")
        .arg(key)
        .arg(0)
        .arg(7)
        .query(con)
        .unwrap()
}

/// A reload from a 10 s to a 30 min window: the caller's keys must outlive
/// the new span (and so its calls 30 min apart still count), not keep the
/// TTL set under the old rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_lengthens_the_span_sets_the_ttl_again() {
    let server = RedisServer::start(&[]);
    // The idempotency horizon at 160 s: the window's span decides it.
    let short = RuleSet::from_args(None, &["s:sliding:10s:2".into()])
        .unwrap()
        .with_dedup(160_000)
        .unwrap();
    let long = RuleSet::from_args(None, &["s:sliding:30m:2".into()])
        .unwrap()
        .with_dedup(160_000)
        .unwrap();
    assert!(long.dedup_ms() >= 1_800_000, "{}", long.dedup_ms());
    let mut store = cached(vec![server.url()], "reload:").await;
    let caller = "+34911000001";
    store
        .apply_batch(&short, &[ev(caller, "c1", T0)])
        .await
        .unwrap();
    store
        .apply_batch(&long, &[ev(caller, "c2", T0 + 1_000)])
        .await
        .unwrap();
    let mut con = server.connection();
    let ttl = pttl(&mut con, &store.state_key(caller));
    assert!(
        ttl >= long.dedup_ms() - 60_000,
        "PTTL {ttl} ms after the reload: the keys would expire before the new span ({} ms)",
        long.dedup_ms()
    );
}

/// A server that lost the commit script (a restart, `SCRIPT FLUSH`, a
/// failover) while a batch holds a known caller's scripted write and a
/// new caller's plain write: only the script call is sent again, so the
/// new caller's first call is decided once (not `duplicate`, counted
/// once), as memory decides it. Standalone and Cluster, with and without
/// idempotency.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_script_resends_only_the_script_calls() {
    let server = RedisServer::start(&[]);
    let cluster = RedisCluster::start();
    let rules = RuleSet::from_args(None, &["s:sliding:60s:2".into()]).unwrap();
    for (urls, ports) in [
        (vec![server.url()], vec![server.port]),
        (
            cluster.urls(),
            cluster.nodes.iter().map(|n| n.port).collect(),
        ),
    ] {
        for idempotency in [true, false] {
            let prefix = format!("ns{idempotency}:");
            let mut store = CachedStore::connect(config(urls.clone(), &prefix, idempotency), 100)
                .await
                .unwrap();
            let known: Vec<CallEvent> = (0..8)
                .map(|i| ev(&format!("+3491100{i:04}"), &format!("k{i}"), T0))
                .collect();
            // Known callers (scripted writes) and new ones (plain writes),
            // spread over the Cluster's slots.
            let mixed: Vec<CallEvent> = (0..8)
                .map(|i| ev(&format!("+3491100{i:04}"), &format!("m{i}"), T0 + 10))
                .chain((0..8).map(|i| ev(&format!("+3492200{i:04}"), &format!("n{i}"), T0 + 10)))
                .collect();
            let mut got = store.apply_batch(&rules, &known).await.unwrap();
            for port in &ports {
                assert!(raw_command(*port, "SCRIPT FLUSH")
                    .unwrap()
                    .starts_with("+OK"));
            }
            got.extend(store.apply_batch(&rules, &mixed).await.unwrap());
            let expected = memory_run(&rules, &[&known, &mixed]).await;
            assert_eq!(got, expected, "idempotency {idempotency}, {urls:?}");
            assert!(got.iter().all(|v| !v.duplicate));
            // And the records stored are the ones answered.
            let again = store.apply_batch(&rules, &mixed).await.unwrap();
            if idempotency {
                for (a, g) in again.iter().zip(&got[8..]) {
                    assert!(a.duplicate);
                    assert_eq!(a.record, g.record);
                }
            }
        }
    }
}

/// A batch of calls already decided changes nothing, so it writes
/// nothing: the caller keeps its version (another writer holding it, e.g.
/// `serve` beside `consume`, is not made to re-read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_duplicates_writes_nothing() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["s:sliding:60s:2".into()]).unwrap();
    let mut store = CachedStore::connect(config(vec![server.url()], "dup:", true), 100)
        .await
        .unwrap()
        .with_records_apart_above(2);
    let mut con = server.connection();
    let caller = "+34911000001";
    let calls: Vec<CallEvent> = (0..5)
        .map(|i| ev(caller, &format!("c{i}"), T0 + i))
        .collect();
    // Inline records, then records kept apart.
    for n in [1, 5] {
        let first = store.apply_batch(&rules, &calls[..n]).await.unwrap();
        let before = version(&mut con, &store.state_key(caller));
        let again = store.apply_batch(&rules, &calls[..n]).await.unwrap();
        assert!(again.iter().all(|v| v.duplicate));
        assert_eq!(
            again.iter().map(|v| &v.record).collect::<Vec<_>>(),
            first.iter().map(|v| &v.record).collect::<Vec<_>>()
        );
        assert_eq!(
            version(&mut con, &store.state_key(caller)),
            before,
            "a batch of {n} duplicates wrote a new version"
        );
    }
}

/// A caller refused in its last round leaves only its own calls
/// undecided: the other callers of the batch are written and answered,
/// nothing of the refused caller's calls is written (so when tried again
/// they are decided once, not as duplicates), and a conflict is counted
/// for it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contended_caller_fails_alone() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["s:sliding:60s:3".into()]).unwrap();
    let (mut a, mut b) = one_round_and_another(&server, "cont:").await;
    let hot = "+34911000001";
    a.apply_batch(&rules, &[ev(hot, "h1", T0)]).await.unwrap();
    // Another writer changes the hot caller behind a's back.
    b.apply_batch(&rules, &[ev(hot, "h2", T0 + 1)])
        .await
        .unwrap();
    let batch = vec![
        ev("+34922000001", "o1", T0 + 2),
        ev(hot, "h3", T0 + 2),
        ev("+34922000002", "o2", T0 + 2),
    ];
    let conflicts = a.conflicts();
    let got = a.apply_batch_partial(&rules, &batch).await.unwrap();
    assert!(got[1].is_none(), "the contended call was decided: {got:?}");
    let expected = memory_run(&rules, &[&batch[..1], &batch[2..]]).await;
    assert_eq!(got[0].as_ref(), Some(&expected[0]));
    assert_eq!(got[2].as_ref(), Some(&expected[1]));
    assert_eq!(a.conflicts(), conflicts + 1);
    // Nothing of h3 was written: b decides it as the third call.
    let h3 = b.apply_batch(&rules, &batch[1..2]).await.unwrap();
    assert!(!h3[0].duplicate);
    assert_eq!(h3[0].record.counts[0], 3);
    // The all-or-nothing call says why, naming no caller.
    let hot = "+34911000002";
    let mut c = CachedStore::connect(config(vec![server.url()], "cont:", true), 100)
        .await
        .unwrap()
        .with_max_rounds(1);
    c.apply_batch(&rules, &[ev(hot, "h4", T0 + 3)])
        .await
        .unwrap();
    b.apply_batch(&rules, &[ev(hot, "h5", T0 + 4)])
        .await
        .unwrap();
    let err = c
        .apply_batch(&rules, &[ev(hot, "h6", T0 + 5)])
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err}");
    assert!(!err.to_string().contains(hot), "{err}");
}

/// A caller left undecided by contention keeps the state Redis returned
/// with its refusal: its calls, tried again in the next batch (as `serve`
/// and `consume` do), are decided on it at the first round, counted as
/// in memory, with no second conflict and no write assumed new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contended_caller_is_decided_on_the_state_its_refusal_returned() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["s:sliding:60s:3".into()]).unwrap();
    let (mut a, mut b) = one_round_and_another(&server, "again:").await;
    let hot = "+34911000003";
    let calls = [
        ev(hot, "k1", T0),
        ev(hot, "k2", T0 + 1),
        ev(hot, "k3", T0 + 2),
        ev(hot, "k4", T0 + 3),
    ];
    a.apply_batch(&rules, &calls[..1]).await.unwrap();
    b.apply_batch(&rules, &calls[1..2]).await.unwrap();
    let got = a.apply_batch_partial(&rules, &calls[2..3]).await.unwrap();
    assert!(got[0].is_none(), "the contended call was decided: {got:?}");
    let (conflicts, misses) = (a.conflicts(), a.misses());
    // The same call again, then the next: each decided at its first round.
    let again = a.apply_batch(&rules, &calls[2..3]).await.unwrap();
    let next = a.apply_batch(&rules, &calls[3..4]).await.unwrap();
    assert_eq!((a.conflicts(), a.misses()), (conflicts, misses));
    let expected = memory_run(&rules, &[&calls[..]]).await;
    assert_eq!(again[0], expected[2]);
    assert_eq!(next[0], expected[3]);
    assert_eq!(next[0].record.counts[0], 4);
    assert!(!again[0].duplicate, "tried again, it is not a redelivery");
}

/// A caller refused under contention is read back with only its batch's
/// records (a flood's thousands are not read, so the next commit lands
/// before the other writer writes again): a redelivered call in that batch
/// still gets its first record back, the new calls are counted as in
/// memory, the records hash keeps every record (a caller known in part
/// never moves its records inline or trims what it did not read), and
/// once no other writer is seen for [`SETTLED_AFTER`] batches the caller
/// is read whole again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contended_caller_is_read_back_in_part_and_decided_as_in_memory() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["m:sliding:60s:12".into()]).unwrap();
    let urls = vec![server.url()];
    let mut a = CachedStore::connect(config(urls.clone(), "part:", true), 100)
        .await
        .unwrap()
        .with_records_apart_above(4)
        .with_partial_reads_after(0);
    let mut b = cached(urls, "part:").await;
    let hot = "+34911000001";
    let n = 23 + SETTLED_AFTER as usize;
    let calls: Vec<CallEvent> = (0..n as i64)
        .map(|i| ev(hot, &format!("h{i}"), T0 + i * 100))
        .collect();
    let mut got = a.apply_batch(&rules, &calls[..20]).await.unwrap();
    // Another writer decides one call behind a's back.
    got.extend(b.apply_batch(&rules, &calls[20..21]).await.unwrap());
    // a's cache is stale: refused, read back in part, decided again.
    let conflicts = a.conflicts();
    let redelivered = calls[5].clone();
    let contended = [redelivered.clone(), calls[21].clone()];
    let again = a.apply_batch(&rules, &contended).await.unwrap();
    assert_eq!(a.conflicts(), conflicts + 1, "the batch was not refused");
    assert!(again[0].duplicate, "{:?}", again[0]);
    assert_eq!(
        again[0].record, got[5].record,
        "the redelivery's record changed"
    );
    got.push(again[1].clone());
    let mut con = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let hlen: usize = redis::cmd("HLEN")
        .arg(a.records_key(hot))
        .query(&mut con)
        .unwrap();
    assert_eq!(hlen, 22, "records were lost or moved while known in part");
    // No other writer now: written at the first try, batch after batch,
    // then forgotten, so the next batch reads the caller whole (a miss,
    // not a conflict).
    let misses = a.misses();
    for call in &calls[22..n - 1] {
        got.extend(
            a.apply_batch(&rules, std::slice::from_ref(call))
                .await
                .unwrap(),
        );
    }
    assert_eq!(a.misses(), misses, "a caller known in part was read again");
    got.extend(a.apply_batch(&rules, &calls[n - 1..]).await.unwrap());
    assert_eq!(
        a.misses(),
        misses + 1,
        "a caller known in part stayed cached"
    );
    let expected = memory_run(&rules, &[&calls[..]]).await;
    assert_eq!(got, expected);
}

/// Two cached stores deciding one hot caller at the same time, each also
/// with callers of its own: no call is lost or counted twice (with one
/// fixed bucket and no limit reached, the counts of all decided calls are
/// exactly 1..=n), and the writers' own callers are always decided.
///
/// An undecided answer is two refused rounds. The first may be free (a
/// call left undecided drops the caller from the cache, so the next try
/// starts blind and is refused with the state), but the second is refused
/// only when the other writer wrote the hot caller since that state was
/// read: each undecided answer is paid for by one of the other's `CALLS`
/// writes, so a writer gets at most `CALLS` of them however the machine
/// schedules the two. That bounds the retries, not a guess.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_at_once_on_a_hot_caller_lose_and_double_nothing() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["f:fixed:1h:1000000".into()]).unwrap();
    const CALLS: usize = 300;
    let run = |w: usize| {
        let url = server.url();
        let rules = rules.clone();
        tokio::spawn(async move {
            let mut store = CachedStore::connect(config(vec![url], "hot:", true), 1_000)
                .await
                .unwrap()
                .with_max_rounds(2);
            let mut counts = Vec::new();
            let mut undecided = 0;
            for i in 0..CALLS {
                let decided = counts.len();
                let mut batch = vec![
                    ev("+34911000001", &format!("w{w}-{i}"), T0 + 1 + i as i64),
                    ev(
                        &format!("+3493{w}00{:04}", i % 50),
                        &format!("own{w}-{i}"),
                        T0 + 1 + i as i64,
                    ),
                ];
                // Bounded: the other writer's commits bound the refusals.
                for _ in 0..=CALLS {
                    let got = store.apply_batch_partial(&rules, &batch).await.unwrap();
                    assert!(got[1..].iter().all(Option::is_some), "an own caller failed");
                    match &got[0] {
                        Some(v) => {
                            assert!(!v.duplicate);
                            counts.push(v.record.counts[0]);
                            break;
                        }
                        None => {
                            undecided += 1;
                            batch.truncate(1);
                        }
                    }
                }
                assert_eq!(
                    counts.len(),
                    decided + 1,
                    "writer {w}'s call {i} was refused more often than the other writer wrote"
                );
            }
            (counts, undecided, store.conflicts())
        })
    };
    let (a, b) = tokio::join!(run(0), run(1));
    let (mut counts, undecided_a, conflicts_a) = a.unwrap();
    let (counts_b, undecided_b, conflicts_b) = b.unwrap();
    counts.extend(counts_b);
    counts.sort_unstable();
    assert_eq!(
        counts,
        (1..=(2 * CALLS) as u64).collect::<Vec<_>>(),
        "calls lost or counted twice"
    );
    assert!(
        conflicts_a + conflicts_b > 0,
        "the writers never met: the test proves nothing"
    );
    for (w, undecided) in [undecided_a, undecided_b].into_iter().enumerate() {
        assert!(
            undecided <= CALLS,
            "writer {w} was left undecided {undecided} times: more refusals than the other's writes"
        );
    }
    eprintln!(
        "conflicts {conflicts_a} + {conflicts_b}, undecided rounds {undecided_a} + {undecided_b}"
    );
}

/// A prefix's claim is renewed while the store runs: after a flush, an
/// instance of the other mode that claims the prefix is refused by the
/// running one's next batch instead of both counting their own share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_claim_is_made_again() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["s:sliding:60s:2".into()]).unwrap();
    let mut store = cached(vec![server.url()], "claim:").await;
    store
        .apply_batch(&rules, &[ev("+34911000001", "c1", T0)])
        .await
        .unwrap();
    assert!(raw_command(server.port, "FLUSHALL")
        .unwrap()
        .starts_with("+OK"));
    let _script = RedisStore::connect(config(vec![server.url()], "claim:", true))
        .await
        .unwrap();
    tokio::time::sleep(callguard::store::redis::CLAIM_EVERY + Duration::from_millis(100)).await;
    let err = store
        .apply_batch(&rules, &[ev("+34911000001", "c2", T0 + 1)])
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("--redis-mode script"), "{err}");
}

/// A prefix written by a callguard that recorded no mode (the window
/// script's layout, before the mode key) is refused by both stores with a
/// message that says what to do; a prefix without keys is claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_without_a_mode_but_with_state_is_refused() {
    let server = RedisServer::start(&[]);
    let cluster = RedisCluster::start();
    let rules = RuleSet::from_args(None, &["s:sliding:60s:2".into()]).unwrap();
    for urls in [vec![server.url()], cluster.urls()] {
        let mut old = RedisStore::connect(config(urls.clone(), "old:", true))
            .await
            .unwrap();
        let events: Vec<CallEvent> = (0..20)
            .map(|i| ev(&format!("+349110{i:05}"), &format!("c{i}"), T0))
            .collect();
        old.apply_batch(&rules, &events).await.unwrap();
        let mut con = redis::Client::open(urls[0].as_str())
            .unwrap()
            .get_connection()
            .unwrap();
        // Where the mode key lives (on a Cluster: whichever node holds it).
        let deleted: i64 = if urls.len() > 1 {
            let c = redis::cluster::ClusterClient::new(urls.clone()).unwrap();
            redis::cmd("DEL")
                .arg("old:mode")
                .query(&mut c.get_connection().unwrap())
                .unwrap()
        } else {
            redis::cmd("DEL").arg("old:mode").query(&mut con).unwrap()
        };
        assert_eq!(deleted, 1);
        let err = CachedStore::connect(config(urls.clone(), "old:", true), 10)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("did not record its mode"), "{err}");
        assert!(err.contains("SET old:mode script"), "{err}");
        let err = RedisStore::connect(config(urls.clone(), "old:", true))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("did not record its mode"), "{err}");
        // An empty prefix is simply claimed.
        cached(urls, "new:").await;
    }
}

/// A flooding caller's records are read back and trimmed a bounded amount
/// per call: with 100,000 records kept apart, a reload (the cache
/// cleared), a jump in time that trims half of them, and one past the
/// horizon, every command Redis runs (its `MONITOR`, script calls
/// included) reads at most [`SCAN_COUNT`] and deletes at most
/// [`TRIM_COUNT`] of the caller's records, the hash ends up holding about the records the state keeps,
/// and every decision equals memory's. (Counted, not timed: a command's
/// time on a shared 2-core machine says more about the neighbours.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_callers_records_are_loaded_and_trimmed_in_bounded_steps() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["s:sliding:10m:1000000".into()])
        .unwrap()
        .with_dedup(1_200_000)
        .unwrap();
    let mut store = cached(vec![server.url()], "flood:").await;
    let caller = "+34911000009";
    let flood: Vec<CallEvent> = (0..100_000i64)
        .map(|i| ev(caller, &format!("f{i}"), T0 + i * 10))
        .collect();
    let mut batches: Vec<Vec<CallEvent>> = flood.chunks(1_000).map(<[_]>::to_vec).collect();
    let end = T0 + 1_000_000;
    // After the flood: a reload; a jump trimming the first half; calls
    // that drain the trimmed records; a call past the horizon.
    let later = |id: &str, ts: i64| vec![ev(caller, id, ts)];
    let tail = vec![later("reload", end), later("jump", end + 700_000)];
    let drain: Vec<Vec<CallEvent>> = (0..60)
        .map(|i| later(&format!("d{i}"), end + 700_001 + i))
        .collect();
    let afresh = later("afresh", end + 5_000_000);
    let mut con = server.connection();
    let mut got = Vec::new();
    for b in &batches {
        got.extend(store.apply_batch(&rules, b).await.unwrap());
    }
    let monitor = Monitor::start(server.port);
    store.clear_cache();
    for b in tail.iter().chain(&drain) {
        got.extend(store.apply_batch(&rules, b).await.unwrap());
    }
    let records = store.records_key(caller);
    let held: i64 = redis::cmd("HLEN").arg(&records).query(&mut con).unwrap();
    // Calls after about end + 700_000 - 1_200_000 are kept: the flood's
    // last 50,000 or so and the 62 since (the engine trims by its own
    // horizon, a few calls either way); the other 50,000 left the hash.
    assert!(
        (49_900..=50_100).contains(&held),
        "{held} records in the hash: the trimmed ones were not deleted"
    );
    got.extend(store.apply_batch(&rules, &afresh).await.unwrap());
    let work = monitor.record_work(&records);
    assert!(
        work.hscans >= 100_000 / SCAN_COUNT,
        "100,000 records read in {} HSCANs",
        work.hscans
    );
    assert!(
        work.most_read <= SCAN_COUNT,
        "a command read {} records (bound {SCAN_COUNT})",
        work.most_read
    );
    assert!(
        work.trimming_calls >= 40,
        "50,000 trimmed records deleted in {} calls",
        work.trimming_calls
    );
    assert!(
        work.most_deleted <= TRIM_COUNT,
        "a command deleted {} records (bound {TRIM_COUNT})",
        work.most_deleted
    );
    batches.extend(tail);
    batches.extend(drain);
    batches.push(afresh.clone());
    let refs: Vec<&[CallEvent]> = batches.iter().map(Vec::as_slice).collect();
    assert_eq!(got, memory_run(&rules, &refs).await);
    // Past the horizon the one record kept moved back inline (the hash is
    // gone), written from the state's packed records: after a reload its
    // redelivery gets the record it got.
    let held: i64 = redis::cmd("HLEN").arg(&records).query(&mut con).unwrap();
    assert_eq!(held, 0, "the records did not move back inline");
    store.clear_cache();
    let again = store.apply_batch(&rules, &afresh).await.unwrap();
    assert!(again[0].duplicate, "{:?}", again[0]);
    assert_eq!(Some(&again[0].record), got.last().map(|v| &v.record));
}

/// A bound on the cached callers' memory: a flooding caller's records
/// count, callers are dropped past it and read back from Redis when they
/// call again, every decision equals memory's, and after each batch the
/// cache holds at most the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_stays_within_its_memory_bound() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["s:sliding:10s:50".into(), "f:fixed:1m:200".into()])
        .unwrap()
        .with_dedup(60_000)
        .unwrap();
    const BOUND: usize = 64 * 1024;
    let mut store = CachedStore::connect(config(vec![server.url()], "mem:", true), 1_000_000)
        .await
        .unwrap()
        .with_max_bytes(BOUND);
    // A flooding caller among quiet ones.
    let events: Vec<CallEvent> = (0..6_000i64)
        .map(|i| {
            let caller = if i % 3 == 0 {
                "+34911000009".to_string()
            } else {
                format!("+3492200{:04}", i % 97)
            };
            ev(&caller, &format!("c{i}"), T0 + i * 5)
        })
        .collect();
    let batches: Vec<&[CallEvent]> = events.chunks(128).collect();
    let mut got = Vec::new();
    let mut peak = 0;
    for b in &batches {
        got.extend(store.apply_batch(&rules, b).await.unwrap());
        peak = peak.max(store.cached_bytes());
        assert!(
            store.cached_bytes() <= BOUND,
            "{} bytes cached over a bound of {BOUND}",
            store.cached_bytes()
        );
    }
    assert!(store.misses() > 0, "no caller was dropped and read back");
    assert!(peak > BOUND / 2, "the bound never mattered: peak {peak}");
    assert_eq!(got, memory_run(&rules, &batches).await);
}

/// Redis's `MONITOR` (every command, script calls' own included) written
/// by `redis-cli` to a file while it runs.
struct Monitor {
    child: std::process::Child,
    file: tempfile::NamedTempFile,
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the commands `MONITOR` saw did to one records hash.
struct RecordWork {
    /// `HSCAN`s of it.
    hscans: usize,
    /// Script calls that deleted records from it.
    trimming_calls: usize,
    /// Most records one command read.
    most_read: usize,
    /// Most records one command (a script call counted whole) deleted.
    most_deleted: usize,
}

impl Monitor {
    fn start(port: u16) -> Self {
        let file = tempfile::NamedTempFile::new().unwrap();
        let child = std::process::Command::new("redis-cli")
            .args(["-p", &port.to_string(), "monitor"])
            .stdout(file.reopen().unwrap())
            .spawn()
            .expect("redis-cli (Debian: redis-tools, with redis-server)");
        let monitor = Monitor { child, file };
        // Until it is listening: its first line is OK.
        for _ in 0..250 {
            if std::fs::read_to_string(monitor.file.path()).is_ok_and(|t| t.starts_with("OK")) {
                return monitor;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-cli monitor did not start");
    }

    /// Stops it and sums up what the commands did to `key`, a records hash.
    fn record_work(mut self, key: &str) -> RecordWork {
        std::thread::sleep(Duration::from_millis(300));
        let _ = self.child.kill();
        let _ = self.child.wait();
        let text = std::fs::read_to_string(self.file.path()).unwrap();
        let mut work = RecordWork {
            hscans: 0,
            trimming_calls: 0,
            most_read: 0,
            most_deleted: 0,
        };
        // Records deleted by the script call being read (its commands
        // follow it, marked `lua`).
        let mut in_call = 0;
        let close_call = |n: &mut usize, work: &mut RecordWork| {
            if *n > 0 {
                work.trimming_calls += 1;
                work.most_deleted = work.most_deleted.max(*n);
            }
            *n = 0;
        };
        for line in text.lines().skip(1) {
            let args = monitor_args(line);
            let (Some(cmd), Some(target)) = (args.first(), args.get(1)) else {
                continue;
            };
            let cmd = cmd.to_ascii_uppercase();
            if !line.contains(" lua] ") {
                close_call(&mut in_call, &mut work);
            }
            if target != key {
                continue;
            }
            match cmd.as_str() {
                "HGETALL" | "HVALS" | "HKEYS" => {
                    work.most_read = usize::MAX;
                }
                "HSCAN" => {
                    work.hscans += 1;
                    let count = args
                        .iter()
                        .position(|a| a.eq_ignore_ascii_case("COUNT"))
                        .and_then(|i| args.get(i + 1)?.parse().ok())
                        .unwrap_or(usize::MAX);
                    work.most_read = work.most_read.max(count);
                }
                "HDEL" => in_call += args.len() - 2,
                _ => {}
            }
        }
        close_call(&mut in_call, &mut work);
        work
    }
}

/// The quoted arguments of a `MONITOR` line.
fn monitor_args(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c != '"' {
            continue;
        }
        let mut arg = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => {
                    if let Some(e) = chars.next() {
                        arg.push(e);
                    }
                }
                '"' => break,
                c => arg.push(c),
            }
        }
        out.push(arg);
    }
    out
}

/// Instances starting at once on a fresh prefix, each writing as soon as
/// it is connected: none takes another's first writes for an older
/// callguard's state (which it refuses) because it looked for the mode key
/// before the other recorded it and for window state after the other
/// wrote some. Every round, every instance connects and writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_starting_at_once_on_a_fresh_prefix_all_start() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["f:fixed:1h:1000000".into()]).unwrap();
    const ROUNDS: usize = 100;
    const INSTANCES: usize = 6;
    for round in 0..ROUNDS {
        let prefix = format!("start{round}:");
        let tasks: Vec<_> = (0..INSTANCES)
            .map(|w| {
                let (url, rules, prefix) = (server.url(), rules.clone(), prefix.clone());
                tokio::spawn(async move {
                    let mut store = CachedStore::connect(config(vec![url], &prefix, true), 100)
                        .await
                        .map_err(|e| format!("instance {w} did not start: {e}"))?;
                    let call = ev(&format!("+3495{w}000000"), &format!("s{w}"), T0 + 1);
                    store
                        .apply_batch(&rules, &[call])
                        .await
                        .map_err(|e| format!("instance {w} did not write: {e}"))?;
                    Ok::<(), String>(())
                })
            })
            .collect();
        for task in tasks {
            if let Err(e) = task.await.unwrap() {
                panic!("round {round}: {e}");
            }
        }
    }
}

/// The batch after this one, as the consumer tells it to the store.
fn then<'a>(rules: &'a RuleSet, events: &'a [CallEvent]) -> Option<Next<'a>> {
    Some(Next { rules, events })
}

/// Waits (at most 10 s) until `key` exists: a commit sent ahead lands
/// after the store call that sent it has returned.
async fn until_exists(con: &mut redis::Connection, key: &str) {
    for _ in 0..1_000 {
        let there: bool = redis::cmd("EXISTS").arg(key).query(con).unwrap();
        if there {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{key} was never written");
}

/// A batch whose callers are not in the batch before is decided and
/// written while that one commits, and handed out only in its turn: a
/// retry of part of the batch before, in between, leaves it alone, and its
/// calls come out as memory decides them, not as redeliveries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_decided_ahead_is_handed_out_in_its_turn() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["s:sliding:60s:2".into()]).unwrap();
    let mut a = cached(vec![server.url()], "ahead:").await;
    let mut con = server.connection();
    let (x, y, z) = ("+34911000001", "+34911000002", "+34911000003");
    let first = [ev(x, "x1", T0), ev(y, "y1", T0)];
    let second = [
        ev(x, "x2", T0 + 1),
        ev(z, "z1", T0 + 1),
        ev(z, "z2", T0 + 2),
        ev(z, "z3", T0 + 3),
    ];
    let mut got = a
        .apply_batch_partial_ahead(&rules, &first, &mut then(&rules, &second))
        .await
        .unwrap();
    // z's calls are written before their batch is asked for.
    until_exists(&mut con, &a.state_key(z)).await;
    assert_eq!(a.calls_decided_ahead(), 0);
    // A retry of part of the first batch (the failure policy's), a
    // redelivery: the batch decided ahead is kept for its turn.
    let retry = a.apply_batch(&rules, &first[1..]).await.unwrap();
    assert!(retry[0].duplicate);
    got.extend(a.apply_batch_partial(&rules, &second).await.unwrap());
    let got: Vec<Verdict> = got.into_iter().map(Option::unwrap).collect();
    assert_eq!(got, memory_run(&rules, &[&first, &second]).await);
    assert!(got.iter().all(|v| !v.duplicate));
    assert_eq!(
        got[5].record.decision,
        callguard::engine::record::Decision::Reject
    );
    // z's three calls came decided ahead; x's was decided in its turn.
    assert_eq!(a.calls_decided_ahead(), 3);
    assert_eq!(a.stats().cache.decided_ahead, 3);
}

/// A caller decided ahead on a state another writer had changed is refused
/// like any write: its calls are decided in their batch's turn, on the
/// state Redis returned, as memory decides them; the batch's other callers
/// stand as decided ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_decided_ahead_on_a_changed_state_is_decided_in_its_turn() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["s:sliding:60s:2".into()]).unwrap();
    let urls = vec![server.url()];
    let (mut a, mut b) = (
        cached(urls.clone(), "stale:").await,
        cached(urls, "stale:").await,
    );
    let (x, z, w) = ("+34911000001", "+34911000003", "+34911000004");
    let zs = [ev(z, "z1", T0), ev(z, "z2", T0 + 1)];
    a.apply_batch(&rules, &zs[..1]).await.unwrap();
    // Another writer's call of z: a's cached z is behind.
    b.apply_batch(&rules, &zs[1..]).await.unwrap();
    let first = [ev(x, "x1", T0 + 2)];
    let second = [ev(z, "z3", T0 + 3), ev(w, "w1", T0 + 3)];
    let conflicts = a.conflicts();
    let mut got = a
        .apply_batch_partial_ahead(&rules, &first, &mut then(&rules, &second))
        .await
        .unwrap();
    got.extend(a.apply_batch_partial(&rules, &second).await.unwrap());
    assert_eq!(
        a.conflicts(),
        conflicts + 1,
        "z's write ahead was not refused"
    );
    let got: Vec<Verdict> = got.into_iter().map(Option::unwrap).collect();
    let expected = memory_run(&rules, &[&zs, &first, &second]).await;
    assert_eq!(got, expected[2..]);
    // z3 is z's third call: rejected, as Redis's state says.
    assert_eq!(got[1].record.counts[0], 3);
    assert_eq!(a.calls_decided_ahead(), 1);
}

/// A batch decided ahead and then let go (a revoke, a crash before its
/// turn) was written, not produced: read again, in other batches and by
/// another instance, its calls get their records back as redeliveries, and
/// the next call counts each of them once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_decided_ahead_and_let_go_gets_its_records_back() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["s:sliding:60s:2".into()]).unwrap();
    let urls = vec![server.url()];
    let (x, z) = ("+34911000001", "+34911000003");
    let first = [ev(x, "x1", T0)];
    let second = [
        ev(z, "z1", T0 + 1),
        ev(z, "z2", T0 + 2),
        ev(z, "z3", T0 + 3),
    ];
    let mut con = server.connection();
    {
        let mut a = cached(urls.clone(), "letgo:").await;
        a.apply_batch_partial_ahead(&rules, &first, &mut then(&rules, &second))
            .await
            .unwrap();
        // (A crash before the commits sent ahead land loses them: the
        // calls are then decided anew when read again, as they were
        // never written.)
        until_exists(&mut con, &a.state_key(z)).await;
    }
    let mut c = cached(urls, "letgo:").await;
    let again = [second.to_vec(), vec![ev(z, "z4", T0 + 4)]].concat();
    let mut got = c.apply_batch(&rules, &again[..2]).await.unwrap();
    got.extend(c.apply_batch(&rules, &again[2..]).await.unwrap());
    let expected = memory_run(&rules, &[&first, &again]).await;
    for (i, (g, x)) in got.iter().zip(&expected[1..]).enumerate() {
        assert_eq!(g.record, x.record, "call {}", again[i].call_id);
    }
    assert_eq!(
        got.iter().map(|v| v.duplicate).collect::<Vec<_>>(),
        [true, true, true, false]
    );
    assert_eq!(got[3].record.counts[0], 4);
}

/// A round Redis fails while a batch is decided ahead: the callers decided
/// ahead are not cached (Redis may not have them), but a local fallback
/// still starts from their state, as for the batch's own callers, both
/// while their commits are in flight and once they have failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_round_keeps_the_states_decided_ahead_for_a_fallback() {
    let server = RedisServer::start(&[
        "--user", "cg", "on", ">s3cret", "~cg:*", "+@all", "--user", "admin", "on", ">adm1n", "~*",
        "+@all", "--user", "default", "off",
    ]);
    let rules = RuleSet::from_args(None, &["s:sliding:60s:2".into()]).unwrap();
    let url = format!("redis://cg:s3cret@127.0.0.1:{}", server.port);
    let mut a = cached(vec![url], "cg:").await;
    let (x, z) = ("+34911000001", "+34911000003");
    a.apply_batch(&rules, &[ev(x, "x0", T0), ev(z, "z1", T0)])
        .await
        .unwrap();
    // From now on only the mode key may be written: every commit fails.
    let admin =
        redis::Client::open(format!("redis://admin:adm1n@127.0.0.1:{}", server.port)).unwrap();
    let mut con = admin.get_connection().unwrap();
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("cg")
        .arg("resetkeys")
        .arg("~cg:mode")
        .query(&mut con)
        .unwrap();
    let first = [ev(x, "x1", T0 + 1)];
    let second = [ev(z, "z2", T0 + 2)];
    a.apply_batch_partial_ahead(&rules, &first, &mut then(&rules, &second))
        .await
        .expect_err("the commits were refused");
    let state = a.cached_state(z).expect("z's state decided ahead was lost");
    assert_eq!(state.latest(), Some(T0 + 2));
    assert_eq!(a.cached_state(x).and_then(|s| s.latest()), Some(T0 + 1));
    // The next batch lands the failed commits, and fails too.
    let third = [ev(x, "x2", T0 + 3)];
    a.apply_batch_partial(&rules, &third)
        .await
        .expect_err("the commits were refused");
    let state = a.cached_state(z).expect("z's state decided ahead was lost");
    assert_eq!(state.latest(), Some(T0 + 2));
}
