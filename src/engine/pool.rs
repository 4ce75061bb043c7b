//! Pools: concurrent rules keyed by account, callee or global. The calls
//! they hold open belong to many callers, so a pool is decided after the
//! caller's rules, for the calls in processing order.
//!
//! The contract (also in docs/rules.md, "Concurrent calls per account"):
//!
//! * A pool is one rule's open calls for one key (the account, the callee,
//!   or everyone's for `global`). A call with no value for the key (no
//!   account) is not seen by it, nor one its filters leave out.
//! * An attempt's count is the calls open in the pool at its time `t`,
//!   plus one; a call `c` is open at `t` when
//!   `start(c) <= t < min(max(end(c), start(c)), start(c) + max_duration)`,
//!   `end(c)` the time of its first end seen (as for a caller's rule).
//! * The count is taken for every attempt the pool sees. The decision is
//!   the caller's rules' first: a call they reject (or a list denies)
//!   stays rejected, for its own reason. A call they allow is then judged
//!   with every rule in order, the pools' counts included: over a pool's
//!   limit it is rejected for that pool (or flagged, for a shadow rule),
//!   warned as for every rule. A call allowed in the end (shadow
//!   included) opens in each pool that sees it; a call rejected opens in
//!   none (nor where it holds a slot already: a call seen again after
//!   what it got was forgotten).
//! * The Retry-After of a call a pool rejects is when its pools' counts
//!   would drop to their limits, given the ends known and `max_duration`
//!   (the caller's rules, which allowed it, are not asked again). A pool's
//!   reject writes no block key (it is no caller's).
//! * Time: each pool has its own `L'_p`, the newest attempt it has seen
//!   (the partitions of a stream run apart in event time: a trunk's calls
//!   must not lose their slots to another partition's later calls). A
//!   call closed at or before `L'_p - grace` is dropped (it could count
//!   only for a call later than the grace), a sum pool's call waiting past
//!   `start + max_duration` there is let go, and its ended calls are kept
//!   as a caller's sum rule keeps them, by `L'_p`. What a call got is
//!   remembered until its time is at or before `L' - dedup`, `L'` the
//!   newest attempt any pool has seen: a call id seen again gets it again
//!   (whatever the caller's store says of it) and changes nothing; past
//!   that an end no longer finds where the call is held.
//! * Ends: an end closes the call in every pool holding it (a second end
//!   changes nothing; an end before the start closes it at its start). An
//!   end for a call not seen yet is kept until `L' - dedup` (at most
//!   [`MAX_PENDING_ENDS`], the earliest let go first), and the call, if
//!   it comes, opens only until then. An end for a call decided but not
//!   held changes nothing.
//!
//! A rule set with pools counts every attempt (`count = "attempts"`) and
//! has no concurrent or sum rule of the caller's: those keep state by the
//! caller's decision, which a pool may still turn into a reject.
//!
//! [`Pools`] is the in-process form (offline work, one instance); the
//! Redis form (`src/store/redis/aggregate/pool.rs`) runs the same steps in
//! one script per batch and shares the pools between instances.

use std::collections::BTreeSet;

use compact_str::CompactString;
use foldhash::HashMap;

use crate::engine::event::{CallEvent, EventKind};
use crate::engine::record::{Decision, Verdict, REASON_OK};
use crate::engine::rules::{Judgement, Listed, Rule, RuleKey, RuleSet, Sum};
use crate::engine::window::{Shape, Sums};

/// Most ends of calls not seen yet the pools keep (the earliest goes
/// first past this).
pub const MAX_PENDING_ENDS: usize = 1 << 16;

/// What one pool found for a call: the rule's index, its count (this call
/// included) and the last time a call of the same key would still be over
/// the limit (see [`rejects_until`]; found only for a call the pools turn
/// away, whose Retry-After it is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    pub rule: usize,
    pub count: u64,
    pub until: Option<i64>,
}

/// How a call opens in its pools, as the caller's rules left it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opening {
    /// Rejected already: opens nowhere.
    Never,
    /// Allowed whatever the pools say (an allowlisted caller, or the set
    /// in shadow mode).
    Always,
    /// Allowed unless an enforcing pool is over its limit.
    Unless,
}

impl Opening {
    /// How the call `v` the caller's rules decided opens.
    pub fn of(rules: &RuleSet, ev: &CallEvent, v: &Verdict) -> Self {
        if v.record.decision == Decision::Reject || v.record.degraded || v.end {
            return Opening::Never;
        }
        let listed = matches!(
            rules.listed(ev.number_for_lists()),
            Listed::Allow | Listed::BadCallerAllow
        );
        if listed || rules.shadow {
            Opening::Always
        } else {
            Opening::Unless
        }
    }

    /// Whether the call opens, given what its pools found.
    pub fn opens(self, rules: &RuleSet, found: &[Found]) -> bool {
        match self {
            Opening::Never => false,
            Opening::Always => true,
            Opening::Unless => !found.iter().any(|f| {
                let r = &rules.rules[f.rule];
                !r.shadow && f.count > r.limit
            }),
        }
    }
}

/// The pool rule `i` holds `ev` in, if it sees it: `rule:max_duration:key`
/// for a concurrent rule, `rule:window:max_duration:key` for a sum rule
/// (the key empty for a global rule).
pub fn pool_of(rules: &RuleSet, i: usize, ev: &CallEvent) -> Option<String> {
    let rule = &rules.rules[i];
    if !rule.is_pooled() || ev.kind == EventKind::End || !rules.sees(i, ev) {
        return None;
    }
    let key = match rule.key {
        RuleKey::Account => ev.account.as_deref().filter(|a| !a.is_empty())?,
        RuleKey::Callee => ev.callee.as_deref().filter(|c| !c.is_empty())?,
        RuleKey::Global => "",
        RuleKey::Caller | RuleKey::CallerCallee => return None,
    };
    Some(match &rule.sum {
        Some(sum) => format!(
            "{}:{}:{}:{key}",
            rule.name, rule.window_ms, sum.max_duration_ms
        ),
        None => format!("{}:{}:{key}", rule.name, rule.window_ms),
    })
}

/// The pools that see `ev`, with their rules' indices.
pub fn pools_of(rules: &RuleSet, ev: &CallEvent) -> Vec<(usize, String)> {
    if !rules.has_pools() {
        return Vec::new();
    }
    (0..rules.rules.len())
        .filter_map(|i| pool_of(rules, i, ev).map(|p| (i, p)))
        .collect()
}

/// A call's identity in the pools: its caller and id (as a caller's store
/// keys its records).
pub fn call_key(ev: &CallEvent) -> CompactString {
    let mut k = CompactString::with_capacity(ev.caller.len() + ev.call_id.len() + 1);
    k.push_str(&ev.caller);
    k.push(' ');
    k.push_str(&ev.call_id);
    k
}

/// When a call started at `start` stops holding its slot, given its end
/// (if seen): an end before the start closes it at its start.
pub fn close_of(start: i64, end: Option<i64>, max_duration: i64) -> i64 {
    let longest = start.saturating_add(max_duration);
    end.map_or(longest, |e| e.max(start).min(longest))
}

/// The last time `s > t` at which a call would still be over `limit`
/// (more than `limit - 1` calls open at `s`), given the calls held
/// (`(start, close)`) and no others. The count drops only at a close, so
/// that time is some close minus one.
pub fn rejects_until(slots: &[(i64, i64)], t: i64, limit: u64) -> Option<i64> {
    let mut starts: Vec<i64> = slots.iter().map(|s| s.0).collect();
    let mut closes: Vec<i64> = slots.iter().map(|s| s.1).collect();
    starts.sort_unstable();
    closes.sort_unstable();
    // Open at s: started at or before s, not closed at or before s.
    let open_at = |s: i64| {
        let started = starts.partition_point(|&x| x <= s);
        let closed = closes.partition_point(|&x| x <= s);
        (started - closed) as u64
    };
    closes
        .iter()
        .rev()
        .map(|&c| c - 1)
        .filter(|&s| s > t)
        .find(|&s| open_at(s) + 1 > limit)
}

/// The verdict of a call the caller's rules decided (`v`), given what its
/// pools found: their counts written in, and, for a call those rules
/// allowed, judged again with every rule (see the module).
pub fn settle(rules: &RuleSet, ev: &CallEvent, v: &mut Verdict, found: &[Found]) {
    if v.end || v.record.degraded || found.is_empty() {
        return;
    }
    for f in found {
        if let Some(c) = v.record.counts.get_mut(f.rule) {
            *c = f.count;
        }
    }
    if v.record.decision == Decision::Reject {
        return;
    }
    let counts = &v.record.counts;
    let judgement = rules.judge(ev.number_for_lists(), counts, None);
    let reason = match judgement {
        Judgement::Exceeded(i) | Judgement::ShadowExceeded(i) => {
            CompactString::from(rules.rules[i].name.as_str())
        }
        Judgement::Allowlisted(r) | Judgement::Denylisted(r) => CompactString::const_new(r),
        Judgement::Within => CompactString::const_new(REASON_OK),
    };
    let would_reject = matches!(
        judgement,
        Judgement::Exceeded(_) | Judgement::ShadowExceeded(_) | Judgement::Denylisted(_)
    );
    let shadow =
        would_reject && (rules.shadow || matches!(judgement, Judgement::ShadowExceeded(_)));
    let t = ev.ts_ms;
    let r = &mut v.record;
    r.retry_after_ms = (would_reject && !shadow).then(|| {
        let last = found
            .iter()
            .filter(|f| !rules.rules[f.rule].shadow)
            .filter_map(|f| f.until)
            .fold(t, i64::max);
        last.saturating_add(1).saturating_sub(t)
    });
    r.warn = rules
        .warning(judgement, shadow, &r.counts)
        .map(|i| CompactString::from(rules.rules[i].name.as_str()));
    r.decision = if would_reject && !shadow {
        Decision::Reject
    } else {
        Decision::Allow
    };
    r.reason = reason;
    r.shadow = shadow;
}

/// The rule of pool `pool` (its name is the pool's first part).
fn rule_of<'a>(rules: &'a RuleSet, pool: &str) -> Option<&'a Rule> {
    let name = pool.split(':').next()?;
    rules.rules.iter().find(|r| r.name == name && r.is_pooled())
}

/// One call a pool holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    start: i64,
    close: i64,
    ended: bool,
}

/// One concurrent pool's calls, by call and in time order: counts and
/// trims read only the calls near the time asked about.
#[derive(Debug, Default)]
struct Slots {
    by_key: HashMap<CompactString, Slot>,
    /// (start, call) and (close, call).
    by_start: BTreeSet<(i64, CompactString)>,
    by_close: BTreeSet<(i64, CompactString)>,
}

/// The first entry of a time-ordered set at `t` or later.
fn at(t: i64) -> (i64, CompactString) {
    (t, CompactString::default())
}

impl Slots {
    fn contains(&self, key: &str) -> bool {
        self.by_key.contains_key(key)
    }

    fn insert(&mut self, key: &CompactString, slot: Slot) {
        self.by_start.insert((slot.start, key.clone()));
        self.by_close.insert((slot.close, key.clone()));
        self.by_key.insert(key.clone(), slot);
    }

    fn remove(&mut self, key: &CompactString) {
        if let Some(slot) = self.by_key.remove(key) {
            self.by_start.remove(&(slot.start, key.clone()));
            self.by_close.remove(&(slot.close, key.clone()));
        }
    }

    fn slot(&self, key: &str) -> Option<&Slot> {
        self.by_key.get(key)
    }

    /// Closes call `key` at `end`, if no end came before.
    fn close(&mut self, key: &CompactString, end: i64) {
        let Some(slot) = self.by_key.get_mut(key) else {
            return;
        };
        if slot.ended {
            return;
        }
        let old = slot.close;
        slot.ended = true;
        slot.close = old.min(end.max(slot.start));
        if slot.close != old {
            self.by_close.remove(&(old, key.clone()));
            self.by_close.insert((slot.close, key.clone()));
        }
    }

    /// The calls closed at or before `t`.
    fn closed_by(&self, t: i64) -> Vec<CompactString> {
        self.by_close
            .range(..at(t.saturating_add(1)))
            .map(|(_, k)| k.clone())
            .collect()
    }

    /// The calls open at `t`: all but those closed by `t` and those
    /// starting after it (a call starting after `t` closes after it too).
    fn open_at(&self, t: i64) -> u64 {
        let closed = self.by_close.range(..at(t.saturating_add(1))).count();
        let later = self.by_start.range(at(t.saturating_add(1))..).count();
        (self.by_key.len() - closed - later) as u64
    }

    /// [`rejects_until`] of these calls; when none starts after `t`, the
    /// count falls only as calls close: over until the `limit`-th latest
    /// close.
    fn rejects_until(&self, t: i64, limit: u64) -> Option<i64> {
        if self
            .by_start
            .range(at(t.saturating_add(1))..)
            .next()
            .is_none()
        {
            let n = usize::try_from(limit).ok()?.checked_sub(1)?;
            let (close, _) = self.by_close.iter().rev().nth(n)?;
            return Some(close - 1).filter(|&s| s > t);
        }
        let slots: Vec<(i64, i64)> = self.by_key.values().map(|s| (s.start, s.close)).collect();
        rejects_until(&slots, t, limit)
    }

    fn len(&self) -> usize {
        self.by_key.len()
    }

    fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}

/// The pools in process: every pool's open calls, the ends that came
/// first, and what each call got (see the module).
#[derive(Debug, Default)]
pub struct Pools {
    /// Pool → call → its slot.
    pools: HashMap<String, Slots>,
    /// Call → the pools holding it.
    held_in: HashMap<CompactString, Vec<String>>,
    /// Sum pool → its waiting calls and what ended ones added (the
    /// window's [`Sums`], shared by the pool's callers).
    sums: HashMap<String, Sums>,
    /// Pool → the newest attempt it has seen (its own `L'`).
    latest_of: HashMap<String, i64>,
    /// Ends of calls not seen yet: call → (end, talk), and (end, call).
    pending: HashMap<CompactString, (i64, i64)>,
    pending_by_end: BTreeSet<(i64, CompactString)>,
    /// What each call got, and (time, call) for forgetting it.
    results: HashMap<CompactString, Vec<Found>>,
    results_by_ts: BTreeSet<(i64, CompactString)>,
    /// The newest attempt any pool has seen (the horizon of ends kept and
    /// of what calls got).
    latest: Option<i64>,
}

impl Pools {
    /// No pool yet.
    pub fn new() -> Self {
        Pools::default()
    }

    /// Applies events the caller's rules decided (`verdicts`, index for
    /// index, `None` for a call left undecided), in order: each attempt's
    /// verdict settled by its pools, each end applied.
    /// Returns how many events the pools took (every end, and the
    /// attempts a pool sees).
    pub fn apply(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        verdicts: &mut [Option<Verdict>],
    ) -> u64 {
        if !rules.has_pools() {
            return 0;
        }
        let mut taken = 0;
        for (ev, v) in events.iter().zip(verdicts.iter_mut()) {
            if let Some(v) = v {
                taken += u64::from(self.apply_one(rules, ev, v));
            }
        }
        taken
    }

    /// [`Pools::apply`] of one event: whether the pools took it.
    pub fn apply_one(&mut self, rules: &RuleSet, ev: &CallEvent, v: &mut Verdict) -> bool {
        if !rules.has_pools() || v.record.degraded {
            return false;
        }
        if ev.kind == EventKind::End {
            self.end(rules, ev);
            return true;
        }
        let key = call_key(ev);
        if let Some(found) = self.results.get(&key) {
            settle(rules, ev, v, found);
            return true;
        }
        let pools = pools_of(rules, ev);
        if pools.is_empty() {
            return false;
        }
        let t = ev.ts_ms;
        self.advance(rules, t);
        for (i, pool) in &pools {
            self.touch(rules, *i, pool, t);
        }
        let mut found: Vec<Found> = pools
            .iter()
            .map(|(i, pool)| self.count(rules, *i, pool, t, false))
            .collect();
        let opening = Opening::of(rules, ev, v);
        // The last times the pools would still turn a call away matter only
        // to the Retry-After of a call they turn away: found then.
        if opening == Opening::Unless && !opening.opens(rules, &found) {
            for (f, (i, pool)) in found.iter_mut().zip(&pools) {
                if !rules.rules[*i].shadow {
                    f.until = self.count(rules, *i, pool, t, true).until;
                }
            }
        }
        settle(rules, ev, v, &found);
        if opening.opens(rules, &found) {
            let end = self.take_pending(&key);
            for (i, pool) in &pools {
                let rule = &rules.rules[*i];
                match &rule.sum {
                    Some(sum) => self.wait(ev, &key, pool, sum, end),
                    None => {
                        let close = close_of(t, end.map(|e| e.0), rule.window_ms);
                        let ended = end.is_some();
                        self.open(
                            &key,
                            pool,
                            Slot {
                                start: t,
                                close,
                                ended,
                            },
                        );
                    }
                }
            }
        }
        self.results_by_ts.insert((t, key.clone()));
        self.results.insert(key, found);
        true
    }

    /// What pool `pool` (of rule `i`) finds for a call at `t`: its count,
    /// and with `until` the last time a call would still be over.
    fn count(&mut self, rules: &RuleSet, i: usize, pool: &str, t: i64, until: bool) -> Found {
        let rule = &rules.rules[i];
        if rule.sum.is_some() {
            let shape = Shape::of(rule, rules.grace_ms);
            let l = self.latest_of.get(pool).copied().unwrap_or(t);
            let Some(sums) = self.sums.get_mut(pool) else {
                return Found {
                    rule: i,
                    count: 0,
                    until: None,
                };
            };
            let until = until
                .then(|| sums.rejects_until(shape, t, rule.limit))
                .flatten()
                .and_then(|u| rule.filter.last_seen_within(t, u));
            return Found {
                rule: i,
                count: sums.count(shape, t, l),
                until,
            };
        }
        let slots = self.pools.get(pool);
        let open = slots.map_or(0, |p| p.open_at(t));
        let until = until
            .then(|| slots.and_then(|p| p.rejects_until(t, rule.limit)))
            .flatten()
            .and_then(|u| rule.filter.last_seen_within(t, u));
        Found {
            rule: i,
            count: open + 1,
            until,
        }
    }

    /// A call held from now on in `pool` (unless it holds a slot there
    /// already: a call seen again after its result was forgotten).
    fn open(&mut self, key: &CompactString, pool: &str, slot: Slot) {
        if self.pools.get(pool).is_some_and(|p| p.contains(key)) {
            return;
        }
        self.pools
            .entry(pool.to_string())
            .or_default()
            .insert(key, slot);
        self.held_in
            .entry(key.clone())
            .or_default()
            .push(pool.to_string());
    }

    /// The end kept for call `key`, if it came first (let go: the call
    /// holds it now).
    fn take_pending(&mut self, key: &CompactString) -> Option<(i64, i64)> {
        let (end, talk) = self.pending.remove(key)?;
        self.pending_by_end.remove(&(end, key.clone()));
        Some((end, talk))
    }

    /// A call allowed at its attempt waits in sum pool `pool` for its
    /// end, or adds at once by the end that came first.
    fn wait(
        &mut self,
        ev: &CallEvent,
        key: &CompactString,
        pool: &str,
        sum: &Sum,
        end: Option<(i64, i64)>,
    ) {
        let (t, max) = (ev.ts_ms, sum.max_duration_ms);
        let price = sum.price(ev.callee_for_filters());
        let sums = self.sums.entry(pool.to_string()).or_default();
        match end {
            Some((e, talk)) if e < t.saturating_add(max) => {
                sums.add(e.max(t), sum.amount(price, talk));
            }
            Some(_) => {}
            // (Waiting already: a call seen again after what it got was
            // forgotten.)
            None if sums.waiting().any(|(id, _, _)| id == key.as_str()) => {}
            None => {
                sums.wait(key, t, price);
                self.held_in
                    .entry(key.clone())
                    .or_default()
                    .push(pool.to_string());
            }
        }
    }

    /// Moves the pools' `L'` to `t` if later, and forgets what falls
    /// behind its idempotency horizon: ends kept, and what calls got (with
    /// where they are held: an end no longer finds them).
    fn advance(&mut self, rules: &RuleSet, t: i64) {
        let latest = self.latest.map_or(t, |l| l.max(t));
        self.latest = Some(latest);
        let horizon = latest.saturating_sub(rules.dedup_ms());
        while let Some((end, key)) = self.pending_by_end.first().cloned() {
            if end > horizon {
                break;
            }
            self.pending_by_end.pop_first();
            self.pending.remove(&key);
        }
        while let Some((ts, key)) = self.results_by_ts.first().cloned() {
            if ts > horizon {
                break;
            }
            self.results_by_ts.pop_first();
            self.results.remove(&key);
            self.held_in.remove(&key);
        }
    }

    /// Moves pool `pool`'s own `L'` to `t` if later, and drops what it no
    /// longer needs: calls closed at or before `L' - grace`, a sum pool's
    /// calls whose `start + max_duration` is there, and its ended calls
    /// no call at or after it can see. (A pool's own time, not every
    /// pool's: the partitions of a stream run apart in event time, and a
    /// trunk's calls in one of them must not lose their slots to calls in
    /// another.)
    fn touch(&mut self, rules: &RuleSet, i: usize, pool: &str, t: i64) {
        let latest = self.latest_of.get(pool).map_or(t, |l| (*l).max(t));
        self.latest_of.insert(pool.to_string(), latest);
        let rule = &rules.rules[i];
        let let_go = latest.saturating_sub(rules.grace_ms);
        let gone: Vec<CompactString> = match &rule.sum {
            None => self
                .pools
                .get(pool)
                .map(|p| p.closed_by(let_go))
                .unwrap_or_default(),
            Some(sum) => {
                let Some(sums) = self.sums.get_mut(pool) else {
                    return;
                };
                let max = sum.max_duration_ms;
                // (By start: the calls let go are a prefix.)
                let gone = sums
                    .waiting()
                    .take_while(|(_, start, _)| start.saturating_add(max) <= let_go)
                    .map(|(id, _, _)| CompactString::from(id))
                    .collect();
                sums.trim(Shape::of(rule, rules.grace_ms), max, latest);
                gone
            }
        };
        for key in gone {
            self.drop_slot(&key, pool);
        }
    }

    /// Call `key` is no longer held in `pool`.
    fn unhold(&mut self, key: &CompactString, pool: &str) {
        if let Some(held) = self.held_in.get_mut(key) {
            held.retain(|h| h != pool);
            if held.is_empty() {
                self.held_in.remove(key);
            }
        }
    }

    /// Forgets call `key`'s slot in `pool` (or its wait: a sum pool's
    /// trim has let go of it).
    fn drop_slot(&mut self, key: &CompactString, pool: &str) {
        if let Some(p) = self.pools.get_mut(pool) {
            p.remove(key);
            if p.is_empty() {
                self.pools.remove(pool);
            }
        }
        self.unhold(key, pool);
    }

    /// A call's end: closes it in every pool holding it; kept if the call
    /// has not come (see the module).
    fn end(&mut self, rules: &RuleSet, ev: &CallEvent) {
        let key = call_key(ev);
        if let Some(held) = self.held_in.get(&key).cloned() {
            // (A call's first end closes it everywhere at once: one that
            // ended in one pool has ended; a sum pool lets go of it then.)
            let ended = held.iter().any(|pool| {
                self.pools
                    .get(pool)
                    .and_then(|p| p.slot(&key))
                    .is_some_and(|s| s.ended)
            });
            if !ended {
                for pool in held {
                    match rule_of(rules, &pool).and_then(|r| r.sum.as_ref().map(|s| (r, s))) {
                        Some((_, sum)) => self.end_waiting(sum, &key, &pool, ev),
                        None => self.close(&key, &pool, ev.ts_ms),
                    }
                }
            }
            return;
        }
        if self.results.contains_key(&key) || self.pending.contains_key(&key) {
            return;
        }
        self.pending
            .insert(key.clone(), (ev.ts_ms, ev.talk_ms.unwrap_or(0)));
        self.pending_by_end.insert((ev.ts_ms, key));
        while self.pending.len() > MAX_PENDING_ENDS {
            let Some((_, first)) = self.pending_by_end.pop_first() else {
                break;
            };
            self.pending.remove(&first);
        }
    }

    /// The end of call `key`, waiting in sum pool `pool`: it adds its
    /// amount at its end if it came within max_duration.
    fn end_waiting(&mut self, sum: &Sum, key: &CompactString, pool: &str, ev: &CallEvent) {
        // (Let go of only by an attempt's L', as a caller's sum rule.)
        if let Some(sums) = self.sums.get_mut(pool) {
            if let Some(Some((at, price))) = sums.end(key, ev.ts_ms, sum.max_duration_ms) {
                sums.add(at, sum.amount(price, ev.talk_ms.unwrap_or(0)));
            }
        }
        self.unhold(key, pool);
    }

    /// Closes call `key` in `pool` at `end`, if no end came before.
    fn close(&mut self, key: &CompactString, pool: &str, end: i64) {
        if let Some(p) = self.pools.get_mut(pool) {
            p.close(key, end);
        }
    }

    /// Calls held, over every pool (open calls, and calls a sum pool
    /// waits on).
    pub fn held(&self) -> usize {
        let waiting: usize = self.sums.values().map(Sums::waiting_len).sum();
        self.pools.values().map(Slots::len).sum::<usize>() + waiting
    }
}

#[cfg(test)]
mod tests;
