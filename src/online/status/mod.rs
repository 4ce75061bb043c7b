//! The live status of `consume` and `serve`: what is being rejected right
//! now and why, as JSON (`/v1/stats`) and as a page (`/`).
//!
//! [`Status`] keeps what Prometheus counters cannot answer without a
//! Prometheus: decisions per second over the last minutes, rejects and
//! shadow rejects per rule, the callers rejected most ([`top`]), recent
//! store latencies, consumer lag per partition and the rule set's
//! version. The page (`page.html`) is one self-contained file (no
//! external scripts, styles or fonts) that polls `/v1/stats` every second.

pub mod top;

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde::Serialize;

use crate::engine::record::{Decision, Verdict};
use crate::online::clock::now_ms;
use top::{RecentTop, TopCaller};

/// The page served at `/`.
pub const PAGE: &str = include_str!("page.html");

/// Seconds of per-second history kept (and charted).
pub const HISTORY_S: i64 = 300;
/// Callers in the top list.
pub const TOP_N: usize = 10;
/// Counters per minute of the top list (a caller rejected more than
/// 1/`TOP_CAPACITY` of a minute's rejects is always in it).
pub const TOP_CAPACITY: usize = 128;
/// Store latencies kept for the percentiles.
const LATENCIES: usize = 2_048;
/// Seconds of store latencies the percentiles cover.
const LATENCY_WINDOW_S: i64 = 60;

#[derive(Debug, Default, Clone, Copy)]
struct Second {
    at: i64,
    decided: u64,
    rejected: u64,
    shadow: u64,
    degraded: u64,
}

#[derive(Debug)]
struct Inner {
    role: &'static str,
    started_ms: i64,
    seconds: Vec<Second>,
    decided: u64,
    rejected: u64,
    shadow: u64,
    rejects_per_rule: BTreeMap<String, u64>,
    shadow_per_rule: BTreeMap<String, u64>,
    warned_per_rule: BTreeMap<String, u64>,
    top: RecentTop,
    dead_letters: u64,
    invalid_checks: u64,
    store_errors: u64,
    /// (epoch seconds, milliseconds), a ring.
    latencies: Vec<(i64, f64)>,
    latency_next: usize,
    lag: BTreeMap<(String, i32), i64>,
    rules: RulesInfo,
}

/// The rule set in force.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RulesInfo {
    /// Its version (a hash of its content).
    pub version: String,
    /// Its rules, as written (`minute:sliding:60s:20`).
    pub rules: Vec<String>,
    /// When it came into force, epoch milliseconds.
    pub since_ms: i64,
    /// Reloads that failed (the set in force was kept).
    pub failed_reloads: u64,
    /// Why the last reload failed, while no reload has succeeded since.
    pub last_error: Option<String>,
}

/// Counters kept by the Prometheus metrics, read for a snapshot.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Counters {
    /// Redelivered or retried call ids answered from the store.
    pub duplicates: u64,
    /// Calls later than the grace.
    pub late: u64,
    /// Calls decided by the fallback policy while the store failed.
    pub fallbacks: u64,
    /// Of those, decided on this instance's own windows (`local`).
    pub local_fallbacks: u64,
    /// Decided calls whose caller was unusable (`bad_caller`).
    pub bad_callers: u64,
    /// Fields of checks that were not read (`serve`).
    pub ignored_fields: u64,
    /// Writes refused because another instance had changed the caller.
    pub conflicts: u64,
    /// Times Redis was found to have lost every key.
    pub data_lost: u64,
    /// Records that could not be produced.
    pub publish_failures: u64,
    /// Batches awaiting the broker.
    pub in_flight: i64,
}

/// Health as shown on the page.
#[derive(Debug, Clone, Default, Serialize)]
pub struct HealthView {
    /// `/readyz` would answer 200.
    pub ready: bool,
    /// Why not, if not.
    pub detail: String,
    /// What an operator should know while ready.
    pub note: String,
}

/// One second of the chart.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// Epoch seconds.
    pub t: i64,
    /// Calls decided that second.
    pub decided: u64,
    /// Calls rejected.
    pub rejected: u64,
    /// Calls that would have been rejected (shadow).
    pub shadow: u64,
    /// Calls decided without the window store (`degraded`).
    pub degraded: u64,
}

/// A rule's line in the table.
#[derive(Debug, Clone, Serialize)]
pub struct RuleLine {
    /// Rule name (or `denylist`).
    pub rule: String,
    /// Calls it rejected.
    pub rejects: u64,
    /// Calls it would have rejected (shadow).
    pub shadow: u64,
    /// Allowed calls over its warn level.
    pub warned: u64,
}

/// A partition's lag.
#[derive(Debug, Clone, Serialize)]
pub struct Lag {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Messages behind.
    pub lag: i64,
}

/// What `/v1/stats` answers.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    /// `consume` or `serve`.
    pub role: &'static str,
    /// When this was taken, epoch milliseconds.
    pub now_ms: i64,
    /// When the process started, epoch milliseconds.
    pub started_ms: i64,
    /// Health.
    pub health: HealthView,
    /// The rule set in force.
    pub rules: RulesInfo,
    /// Calls decided since start (duplicates included, as in
    /// `callguard_events_total`).
    pub decided: u64,
    /// Of which rejected.
    pub rejected: u64,
    /// Allowed calls a rule in shadow mode would have rejected.
    pub shadow: u64,
    /// Decisions per second over the last 10 seconds.
    pub rate_10s: f64,
    /// Share of calls rejected over the last minute (0 to 1).
    pub reject_share_60s: f64,
    /// Calls decided without the window store over the last minute
    /// (`degraded`: the store failed, and the failure policy decided).
    pub degraded_60s: u64,
    /// The last [`HISTORY_S`] seconds, oldest first.
    pub series: Vec<Point>,
    /// Rejects per rule since start.
    pub per_rule: Vec<RuleLine>,
    /// The callers rejected most over the last minutes (retries not counted).
    pub top_rejected: Vec<TopCaller>,
    /// Minutes the top list covers.
    pub top_minutes: i64,
    /// Consumer lag per partition (`consume`).
    pub lag: Vec<Lag>,
    /// Store latency over the last minute, milliseconds (p50, p99); `None`
    /// without a store call.
    pub store_p50_ms: Option<f64>,
    /// See `store_p50_ms`.
    pub store_p99_ms: Option<f64>,
    /// Store calls that failed.
    pub store_errors: u64,
    /// Events sent to the dead-letter topic (`consume`).
    pub dead_letters: u64,
    /// Checks refused as invalid (`serve`).
    pub invalid_checks: u64,
    /// From the Prometheus counters.
    pub counters: Counters,
}

/// Adds one to `key`'s count (allocating only for a new key).
fn bump(counts: &mut BTreeMap<String, u64>, key: &str) {
    match counts.get_mut(key) {
        Some(n) => *n += 1,
        None => {
            counts.insert(key.to_string(), 1);
        }
    }
}

impl Inner {
    /// The last [`HISTORY_S`] seconds up to `now_s`, oldest first.
    fn series(&self, now_s: i64) -> Vec<Point> {
        (now_s - HISTORY_S + 1..=now_s)
            .map(|t| {
                let s = self.seconds[t.rem_euclid(HISTORY_S) as usize];
                let s = if s.at == t { s } else { Second::default() };
                Point {
                    t,
                    decided: s.decided,
                    rejected: s.rejected,
                    shadow: s.shadow,
                    degraded: s.degraded,
                }
            })
            .collect()
    }

    /// p50 and p99 of the store latencies of the last minute.
    fn latency_quantiles(&self, now_s: i64) -> (Option<f64>, Option<f64>) {
        let mut recent: Vec<f64> = self
            .latencies
            .iter()
            .filter(|(at, _)| *at > now_s - LATENCY_WINDOW_S)
            .map(|(_, ms)| *ms)
            .collect();
        recent.sort_by(f64::total_cmp);
        let quantile = |q: f64| -> Option<f64> {
            let last = recent.len().checked_sub(1)?;
            Some(recent[((last as f64) * q).round() as usize])
        };
        (quantile(0.5), quantile(0.99))
    }

    /// Rejects and shadow rejects per rule, by rule name.
    fn per_rule(&self) -> Vec<RuleLine> {
        let mut rules: Vec<&String> = self
            .rejects_per_rule
            .keys()
            .chain(self.shadow_per_rule.keys())
            .chain(self.warned_per_rule.keys())
            .collect();
        rules.sort();
        rules.dedup();
        rules
            .into_iter()
            .map(|r| RuleLine {
                rule: r.clone(),
                rejects: self.rejects_per_rule.get(r).copied().unwrap_or(0),
                shadow: self.shadow_per_rule.get(r).copied().unwrap_or(0),
                warned: self.warned_per_rule.get(r).copied().unwrap_or(0),
            })
            .collect()
    }

    /// Lag per partition.
    fn lags(&self) -> Vec<Lag> {
        self.lag
            .iter()
            .map(|((topic, partition), lag)| Lag {
                topic: topic.clone(),
                partition: *partition,
                lag: *lag,
            })
            .collect()
    }
}

/// The live status; cheap to update from the deciding path (one
/// uncontended lock per call).
#[derive(Debug)]
pub struct Status {
    inner: Mutex<Inner>,
}

impl Default for Status {
    fn default() -> Self {
        Status {
            inner: Mutex::new(Inner {
                role: "consume",
                started_ms: now_ms(),
                seconds: vec![Second::default(); HISTORY_S as usize],
                decided: 0,
                rejected: 0,
                shadow: 0,
                rejects_per_rule: BTreeMap::new(),
                shadow_per_rule: BTreeMap::new(),
                warned_per_rule: BTreeMap::new(),
                top: RecentTop::new(TOP_CAPACITY),
                dead_letters: 0,
                invalid_checks: 0,
                store_errors: 0,
                latencies: Vec::with_capacity(LATENCIES),
                latency_next: 0,
                lag: BTreeMap::new(),
                rules: RulesInfo::default(),
            }),
        }
    }
}

impl Status {
    fn with(&self, f: impl FnOnce(&mut Inner)) {
        if let Ok(mut inner) = self.inner.lock() {
            f(&mut inner);
        }
    }

    /// Names the process (`consume` or `serve`).
    pub fn set_role(&self, role: &'static str) {
        self.with(|i| i.role = role);
    }

    /// Counts a batch of decided calls at the wall clock: one clock read
    /// and one lock per batch.
    pub fn decided<'v>(&self, verdicts: impl IntoIterator<Item = &'v Verdict>) {
        let now_s = now_ms().div_euclid(1000);
        self.with(|i| {
            let slot = &mut i.seconds[now_s.rem_euclid(HISTORY_S) as usize];
            if slot.at != now_s {
                *slot = Second {
                    at: now_s,
                    ..Second::default()
                };
            }
            for v in verdicts {
                let r = &v.record;
                slot.decided += 1;
                i.decided += 1;
                if r.decision == Decision::Reject {
                    slot.rejected += 1;
                    i.rejected += 1;
                    bump(&mut i.rejects_per_rule, &r.reason);
                    if !v.duplicate {
                        i.top.add(now_s, &r.caller);
                    }
                } else if r.shadow {
                    slot.shadow += 1;
                    i.shadow += 1;
                    bump(&mut i.shadow_per_rule, &r.reason);
                }
                if r.degraded {
                    slot.degraded += 1;
                }
                if let (Some(w), false) = (&r.warn, v.duplicate) {
                    bump(&mut i.warned_per_rule, w);
                }
            }
        });
    }

    /// Counts an event sent to the dead-letter topic.
    pub fn dead_letter(&self) {
        self.with(|i| i.dead_letters += 1);
    }

    /// Counts a check refused as invalid.
    pub fn invalid_check(&self) {
        self.with(|i| i.invalid_checks += 1);
    }

    /// Counts a failed store call.
    pub fn store_error(&self) {
        self.with(|i| i.store_errors += 1);
    }

    /// Notes one store call's latency.
    pub fn store_latency(&self, seconds: f64) {
        let at = now_ms().div_euclid(1000);
        self.with(|i| {
            let entry = (at, seconds * 1000.0);
            if i.latencies.len() < LATENCIES {
                i.latencies.push(entry);
            } else {
                let n = i.latency_next;
                i.latencies[n] = entry;
            }
            i.latency_next = (i.latency_next + 1) % LATENCIES;
        });
    }

    /// Notes a partition's lag.
    pub fn lag(&self, topic: &str, partition: i32, lag: i64) {
        self.with(|i| {
            i.lag.insert((topic.to_string(), partition), lag);
        });
    }

    /// Notes the rule set now in force.
    pub fn rules_in_force(&self, version: &str, rules: Vec<String>) {
        self.with(|i| {
            i.rules.version = version.to_string();
            i.rules.rules = rules;
            i.rules.since_ms = now_ms();
        });
    }

    /// Notes a reload that succeeded (the set may be the one in force):
    /// the last failure is history, still counted.
    pub fn reload_succeeded(&self) {
        self.with(|i| i.rules.last_error = None);
    }

    /// Notes a reload that failed.
    pub fn reload_failed(&self, error: String) {
        self.with(|i| {
            i.rules.failed_reloads += 1;
            i.rules.last_error = Some(error);
        });
    }

    /// What `/v1/stats` answers, with the Prometheus `counters` and
    /// `health` read by the caller.
    pub fn snapshot(&self, counters: Counters, health: HealthView) -> Option<Snapshot> {
        let now = now_ms();
        let now_s = now.div_euclid(1000);
        let i = self.inner.lock().ok()?;
        let series = i.series(now_s);
        let sum = |last: usize, f: fn(&Point) -> u64| -> u64 {
            series.iter().rev().take(last).map(f).sum()
        };
        let (decided_60, rejected_60) = (sum(60, |p| p.decided), sum(60, |p| p.rejected));
        let (store_p50_ms, store_p99_ms) = i.latency_quantiles(now_s);
        Some(Snapshot {
            role: i.role,
            now_ms: now,
            started_ms: i.started_ms,
            health,
            rules: i.rules.clone(),
            decided: i.decided,
            rejected: i.rejected,
            shadow: i.shadow,
            rate_10s: sum(10, |p| p.decided) as f64 / 10.0,
            reject_share_60s: if decided_60 == 0 {
                0.0
            } else {
                rejected_60 as f64 / decided_60 as f64
            },
            degraded_60s: sum(60, |p| p.degraded),
            per_rule: i.per_rule(),
            series,
            top_rejected: i.top.top(now_s, TOP_N),
            top_minutes: top::MINUTES,
            lag: i.lags(),
            store_p50_ms,
            store_p99_ms,
            store_errors: i.store_errors,
            dead_letters: i.dead_letters,
            invalid_checks: i.invalid_checks,
            counters,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::record::DecisionRecord;

    fn verdict(caller: &str, decision: Decision, reason: &str, shadow: bool) -> Verdict {
        Verdict {
            record: DecisionRecord {
                call_id: "c".into(),
                caller: caller.into(),
                ts_ms: 0,
                decision,
                reason: reason.into(),
                counts: Default::default(),
                shadow,
                late: false,
                degraded: false,
                rules_version: "v".into(),
                retry_after_ms: None,
                warn: None,
            },
            prev_ts_ms: None,
            distinct_callees: None,
            duplicate: false,
            end: false,
            score: None,
        }
    }

    #[test]
    fn snapshot_counts_what_was_decided() {
        let s = Status::default();
        for _ in 0..7 {
            s.decided([&verdict("+1", Decision::Allow, "ok", false)]);
        }
        for _ in 0..3 {
            s.decided([&verdict("+2", Decision::Reject, "minute", false)]);
        }
        s.decided([&verdict("+3", Decision::Allow, "hour", true)]);
        let mut dup = verdict("+2", Decision::Reject, "minute", false);
        dup.duplicate = true;
        s.decided([&dup]);
        s.store_latency(0.002);
        s.store_latency(0.010);
        let snap = s
            .snapshot(Counters::default(), HealthView::default())
            .unwrap();
        assert_eq!((snap.decided, snap.rejected, snap.shadow), (12, 4, 1));
        assert_eq!(snap.series.len(), HISTORY_S as usize);
        let last_two: u64 = snap.series.iter().rev().take(2).map(|p| p.decided).sum();
        assert_eq!(last_two, 12);
        assert_eq!(snap.per_rule.len(), 2);
        assert_eq!(
            (snap.per_rule[0].rule.as_str(), snap.per_rule[0].shadow),
            ("hour", 1)
        );
        assert_eq!(
            (snap.per_rule[1].rule.as_str(), snap.per_rule[1].rejects),
            ("minute", 4)
        );
        // The retry is not a new reject of the caller.
        assert_eq!(snap.top_rejected[0].rejects, 3);
        assert_eq!(snap.store_p50_ms, Some(10.0));
        assert!((snap.reject_share_60s - 4.0 / 12.0).abs() < 1e-9);
    }

    /// A failed reload shows its error until a reload succeeds; the count
    /// of failures stays.
    #[test]
    fn a_successful_reload_clears_the_last_error() {
        let s = Status::default();
        let rules = |s: &Status| {
            s.snapshot(Counters::default(), HealthView::default())
                .unwrap()
                .rules
        };
        s.rules_in_force("v1", vec!["m:sliding:60s:5".into()]);
        s.reload_failed("bad rules file: expected `=`".into());
        let r = rules(&s);
        assert_eq!((r.failed_reloads, r.version.as_str()), (1, "v1"));
        assert_eq!(
            r.last_error.as_deref(),
            Some("bad rules file: expected `=`")
        );
        s.rules_in_force("v2", vec!["m:sliding:60s:6".into()]);
        s.reload_succeeded();
        let r = rules(&s);
        assert_eq!((r.failed_reloads, r.version.as_str()), (1, "v2"));
        assert_eq!(r.last_error, None);
    }
}
