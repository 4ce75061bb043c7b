//! The window algorithm for one caller: the reference semantics.
//!
//! Every store must produce exactly what [`CallerState::apply`] produces; the
//! Redis script (`lua/window.lua`) is a line-by-line port of it. The contract
//! (also in the README):
//!
//! * `L` is the caller's latest event time before the event, `t` the event
//!   time, `L' = max(L, t)`, `R` the retention (longest window + grace) and
//!   `H = L' - R` the horizon. Recorded data with `ts <= H` is dropped, and a
//!   previous state whose `L <= H` counts as no state at all.
//! * A call id already decided, whose record is newer than `L' - D` (`D`, the
//!   idempotency horizon, is at least `R`), gets the same record back and
//!   changes nothing.
//! * sliding: count = 1 + recorded events with ts in `(t - W, t]`.
//! * fixed: bucket `b = floor(t / W)`; count = 1 + recorded events in `b`.
//!   A bucket is dead once `(b + 1) * W + grace <= L'`: a late event in a
//!   dead bucket counts 1 and is not recorded.
//! * sliding-approx: counters for the current bucket `B` and the one before;
//!   the estimate is `floor(prev * (W - r - 1) / W) + cur + 1` with
//!   `r = t - b * W` (the previous bucket weighted by its overlap with
//!   `(t - W, t]`, in whole milliseconds). An event in bucket `B - 1` above
//!   the horizon (`t > H`) counts `prev + 1`; older events count 1 and are
//!   not recorded.
//! * token-bucket (rate `n` per `P` ms, `T = P / n`, burst `N`): `tat' =
//!   max(TAT, t) + T`, count `ceil((tat' - t) / T)`; recorded: `TAT = tat'`
//!   (`bucket.rs`); the rule's window is its span `ceil(N T)`. At or below
//!   the horizon a call counts 1 and is not recorded.
//! * distinct-callees: `min(C, |{callees with latest recorded > t - W} ∪
//!   {own}|)`, the `C` most recently called kept (`distinct.rs`).
//! * A rule keyed by caller and callee applies its kind to the calls to
//!   this call's callee alone, one pair each (`pairs.rs`).
//! * A rule keyed by callee or global keeps nothing of the caller's: its
//!   count and its part of the retry-after come with the event, from
//!   [`crate::engine::aggregate`].
//! * A rule that does not see a call (its filters) neither counts nor
//!   records it; its count is 0, written empty. A sliding rule that sees
//!   only some calls keeps a log of its own.
//! * `late = L exists and t < L - grace`.
//! * Decision: denylist, then allowlist, then the first enforcing rule
//!   whose count exceeds its limit, then the first shadow rule that does
//!   (allowed, `shadow`); shadow mode emits `allow` instead of `reject`.
//!   `warn`: the first rule whose count exceeds its warn level, on an
//!   allowed call on no list.
//! * Recording: every event under `attempts`; under `admitted` only events
//!   whose decision (before shadow) is allow.
//! * Retry-after, on a reject by a rule (not shadow, not the denylist): the
//!   smallest `d >= 1` such that a call of this caller at any time `>= t + d`
//!   would pass every rule, given the state after this call and no further
//!   calls. Per rule, the last time `s > t` at which such a call would still
//!   exceed the limit, then the largest over the enforcing rules that see
//!   the call's callee, plus one. A rule with a time profile rejects only at
//!   the instants its profile holds: its last time is the last of those up
//!   to `s` (none: no part), up to `t + grace + retention`; past it (only a
//!   late call's reaches there) `s` stands (`counting.rs`, `profiled`):
//!   * sliding (limit `N`, recorded times `e_1 <= ... <= e_k`): a call at `s`
//!     is over the limit iff `N` recorded calls lie in `(s - W, s]`, i.e.
//!     `e_{i+N-1} <= s <= e_i + W - 1` for some `i`; the last such `s` is
//!     `e_i + W - 1` for the largest `i` with `e_{i+N-1} <= e_i + W - 1`
//!     (for calls in time order, `i = k - N + 1`: "until the `N`-th newest
//!     recorded call leaves the window").
//!   * fixed: a live bucket `b` (`(b + 1) * W + grace > L'`) holding `>= N`
//!     recorded calls rejects until its end, `(b + 1) * W - 1`.
//!   * sliding-approx (bucket `B`, counters `cur`, `prev` after this call):
//!     in bucket `B + 1` the estimate is `floor(cur * (W - r - 1) / W) + 1`,
//!     in `B` it is `floor(prev * (W - r - 1) / W) + cur + 1`, in `B - 1`
//!     `prev + 1`, elsewhere 1; each falls with `r`, so the last rejecting
//!     time is found from the latest of these buckets back. A caller whose
//!     state expires (`s >= L' + R`) starts afresh and is allowed.
//! * Distinct callees (a feature, when the rule set keeps it): each callee's
//!   latest call time is kept for every non-duplicate call that names one,
//!   whatever its decision, and trimmed at `H` like the rest. The feature is
//!   the number of callees whose latest call time is after `t - Wmax`
//!   (`Wmax` the longest window), this call's callee included. For calls in
//!   time order that is the distinct callees in `(t - Wmax, t]`. A caller
//!   keeps at most `max_distinct_callees` callees (after trimming): a new
//!   callee beyond that is not kept, so the feature saturates there.

use std::collections::{BTreeMap, VecDeque};

use compact_str::CompactString;
use foldhash::HashMap;

use crate::engine::event::{CallEvent, EventKind};
use crate::engine::record::{Counts, Decision, DecisionRecord, Verdict, REASON_OK};
use crate::engine::rules::{CountPolicy, Judgement, Rule, RuleKey, RuleSet, WindowKind};

mod bucket;
mod callee_times;
mod counting;
mod distinct;
mod kept;
mod open;
mod pack;
mod pairs;
mod sums;

pub use bucket::Tat;
use callee_times::CalleeTimes;
pub(crate) use counting::approx_rejects_until;
pub use counting::{approx_estimate, bucket_of};
use counting::{
    bucket_end, insert_sorted, pair_count, pair_record, sliding_count, Approx, Horizons,
};
pub use distinct::Callees;
use kept::Kept;
pub use open::{OpenCalls, PendingEnds, MAX_PENDING_ENDS};
pub use pack::PackedLog;
pub(crate) use pack::{put_varint, take_varint};
use pairs::{Pair, Pairs};
pub(crate) use sums::Shape;
pub use sums::Sums;

/// The decision and reason of a judgement, before shadow mode.
/// (Reasons and rule names are short: kept inline, never allocated.)
fn outcome(rules: &RuleSet, judgement: Judgement) -> (Decision, CompactString) {
    match judgement {
        Judgement::Denylisted(reason) => (Decision::Reject, CompactString::const_new(reason)),
        Judgement::Allowlisted(reason) => (Decision::Allow, CompactString::const_new(reason)),
        Judgement::Exceeded(i) | Judgement::ShadowExceeded(i) => {
            (Decision::Reject, rules.rules[i].name.as_str().into())
        }
        Judgement::Within => (Decision::Allow, CompactString::const_new(REASON_OK)),
    }
}

/// What per-rule state is kept under: the rule's name and window, as in
/// its Redis keys (`f:<name>:<W>:<bucket>`, `a:<name>:<W>:`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct RuleId {
    /// (Inline up to 24 bytes: no allocation per caller and rule.)
    name: CompactString,
    window_ms: i64,
    /// A sum rule's `max_duration` (else 0): how long its calls wait.
    max_duration_ms: i64,
}

/// Where rule `rule`'s state is in `slots`, if it has some.
fn slot_index<T>(slots: &[(RuleId, T)], rule: &Rule) -> Option<usize> {
    slots.iter().position(|(id, _)| {
        id.window_ms == rule.window_ms
            && id.name == rule.name
            && id.max_duration_ms == rule.sum.as_ref().map_or(0, |s| s.max_duration_ms)
    })
}

/// The state kept for rule `rule` in `slots`, if any (none is made).
fn existing_slot<'a, T>(slots: &'a mut [(RuleId, T)], rule: &Rule) -> Option<&'a mut T> {
    let at = slot_index(slots, rule)?;
    Some(&mut slots[at].1)
}

/// The state kept for rule `rule` in `slots`, created empty if missing.
fn slot<'a, T: Default>(slots: &'a mut Vec<(RuleId, T)>, rule: &Rule) -> &'a mut T {
    let at = match slot_index(slots, rule) {
        Some(at) => at,
        None => {
            if slots.len() == slots.capacity() && slots.len() < 4 {
                // A few rules: room for one more, not four.
                slots.reserve_exact(1);
            }
            slots.push((
                RuleId {
                    name: rule.name.as_str().into(),
                    window_ms: rule.window_ms,
                    max_duration_ms: rule.sum.as_ref().map_or(0, |s| s.max_duration_ms),
                },
                T::default(),
            ));
            slots.len() - 1
        }
    };
    &mut slots[at].1
}

/// What calls changed in a [`CallerState`], for a store that keeps a copy
/// of it elsewhere and writes back only the changes
/// ([`CallerState::apply_journaled`]).
#[derive(Debug, Default)]
pub struct Journal {
    /// Call ids whose records were trimmed (past the idempotency horizon).
    pub dropped_records: Vec<CompactString>,
    /// Times dropped from the front of the sliding log.
    pub log_trimmed: usize,
    /// A time went into the sliding log before its newest one (a call out
    /// of order): the log changed other than at its ends.
    pub log_inserted_inside: bool,
}

/// Entries a caller's log and callee tables keep allocated when it
/// starts afresh (see `CallerState::start_afresh`).
const KEPT_CAPACITY: usize = 16;

/// When a store may let callers go ([`CallerState::may_let_go`]): the
/// times at or before which a caller's latest data no longer matters.
#[derive(Debug, Clone, Copy)]
pub struct LetGo {
    /// For a caller that keeps only window data: the newest time seen less
    /// the retention and the grace (at most the idempotency horizon).
    windows: i64,
    /// For any other caller: the newest time less the idempotency horizon.
    records: i64,
}

impl LetGo {
    /// The cut-offs under `rules` when the newest event time seen is
    /// `newest`.
    pub fn new(rules: &RuleSet, newest: i64) -> Self {
        let dedup = rules.dedup_ms();
        let windows = rules
            .retention_ms()
            .saturating_add(rules.grace_ms)
            .min(dedup);
        LetGo {
            windows: newest.saturating_sub(windows),
            records: newest.saturating_sub(dedup),
        }
    }
}

/// The part of a caller's state that most rule sets never fill: rules
/// with a log of their own, token buckets, distinct callees per rule,
/// pairs, calls held open, sums, ends before their calls. Apart, behind
/// one pointer, so that a caller under the usual rules (fixed, sliding
/// and approximate windows) keeps its state in a few cache lines: every
/// call reads the whole state, and a flood's callers are many.
#[derive(Debug, Clone, Default)]
struct Rare {
    /// Per sliding rule that sees only some calls, by identity: its own
    /// sorted log of recorded times.
    own_logs: Vec<(RuleId, VecDeque<i64>)>,
    /// Per token-bucket rule, by identity: its theoretical arrival time.
    buckets: Vec<(RuleId, Option<Tat>)>,
    /// Per distinct-callees rule, by identity: its recorded callees.
    distinct: Vec<(RuleId, Callees)>,
    /// Per rule keyed by caller and callee, by identity: its pairs.
    pairs: Vec<(RuleId, Pairs)>,
    /// Per concurrent rule, by identity: the calls it holds open.
    open: Vec<(RuleId, OpenCalls)>,
    /// Per sum rule, by identity: its calls waiting for their ends and
    /// what ended calls added (kept when the caller starts afresh).
    sums: Vec<(RuleId, Sums)>,
    /// Ends that came before their calls, for the idempotency horizon.
    pending_ends: PendingEnds,
}

impl Rare {
    /// No call is held open or waits for its end, and no end came before
    /// its call.
    fn holds_no_calls(&self) -> bool {
        self.pending_ends.is_empty()
            && self.open.iter().all(|(_, calls)| calls.len() == 0)
            && self.sums.iter().all(|(_, s)| s.is_empty())
    }

    /// Closes the call that `ev` ends (with `talk` ms of talk) in every
    /// concurrent rule that holds it, and in every sum rule that waits for
    /// it; whether any did.
    fn end_call(&mut self, rules: &RuleSet, ev: &CallEvent, talk: i64) -> bool {
        let mut held = false;
        for (_, calls) in &mut self.open {
            held |= calls.end(&ev.call_id, ev.ts_ms);
        }
        for rule in rules.rules.iter() {
            let Some(sum) = &rule.sum else { continue };
            let Some(sums) = existing_slot(&mut self.sums, rule) else {
                continue;
            };
            let Some(ended) = sums.end(&ev.call_id, ev.ts_ms, sum.max_duration_ms) else {
                continue;
            };
            held = true;
            if let Some((at, price)) = ended {
                sums.add(at, sum.amount(price, talk));
            }
        }
        held
    }

    /// [`CallerState::trim`] for this part.
    fn trim(&mut self, rules: &RuleSet, h: &Horizons) {
        let (horizon, dedup_horizon, l_new) = (h.retention, h.dedup, h.latest);
        for (_, log) in &mut self.own_logs {
            let cut = log.iter().take_while(|&&x| x <= horizon).count();
            log.drain(..cut);
        }
        for (_, callees) in &mut self.distinct {
            callees.trim(horizon);
        }
        // A call closed more than the grace ago matters only to a late
        // call, whose count sees what is kept: dropped (so a busy trunk
        // keeps its open calls, not every call of the last max_duration).
        let closed = l_new.saturating_sub(rules.grace_ms);
        for (_, calls) in &mut self.open {
            calls.trim(closed);
        }
        self.pending_ends.trim(dedup_horizon);
        self.trim_sums(rules, l_new);
        let grace = rules.grace_ms;
        for (id, pairs) in &mut self.pairs {
            let w = id.window_ms;
            pairs.trim(horizon, |p| {
                let cut = p.log.iter().take_while(|&&x| x <= horizon).count();
                p.log.drain(..cut);
                p.fixed.retain(|&b, _| bucket_end(b, w, grace) > l_new);
            });
        }
    }

    /// Drops what no call at or after `L' - grace` can see from every sum
    /// rule's state, and the state of sum rules no longer in the set.
    fn trim_sums(&mut self, rules: &RuleSet, l_new: i64) {
        if self.sums.is_empty() {
            return;
        }
        let mut kept = Vec::with_capacity(self.sums.len());
        for rule in &rules.rules {
            let Some(sum) = &rule.sum else { continue };
            let Some(at) = self.sums.iter().position(|(id, _)| {
                id.name == rule.name
                    && id.window_ms == rule.window_ms
                    && id.max_duration_ms == sum.max_duration_ms
            }) else {
                continue;
            };
            let (id, mut sums) = self.sums.swap_remove(at);
            sums.trim(Shape::of(rule, rules.grace_ms), sum.max_duration_ms, l_new);
            if !sums.is_empty() {
                kept.push((id, sums));
            }
        }
        self.sums = kept;
    }
}

/// All window state of one caller.
#[derive(Debug, Clone, Default)]
pub struct CallerState {
    latest: Option<i64>,
    /// Sorted event times of recorded events (shared by all sliding rules);
    /// a deque, as calls in time order append at the back and trim the front.
    log: VecDeque<i64>,
    /// Per fixed rule, by identity (name, window): bucket → recorded count.
    /// Keyed by identity, as the Redis keys are, so a reload that changes a
    /// rule's window never reads counters kept for the old one.
    fixed: Vec<(RuleId, BTreeMap<i64, u64>)>,
    /// Per sliding-approx rule, by identity: its counters.
    approx: Vec<(RuleId, Approx)>,
    /// The state of the rule kinds most rule sets leave out and of calls
    /// that last (see [`Rare`]); `None` until one of them keeps something.
    rare: Option<Box<Rare>>,
    /// Idempotency: call id → the verdict it got, packed ([`Kept`]).
    seen: HashMap<CompactString, Kept>,
    /// Bytes of the packed verdicts in `seen`, for [`CallerState::approx_bytes`].
    seen_bytes: usize,
    /// Idempotency index for trimming: call ids by (ts, insertion order).
    /// Sorted deques here and below: calls in time order append at the
    /// back and trim the front, and a sparse caller costs a few bytes, not
    /// a B-tree node.
    seen_by_ts: VecDeque<(i64, CompactString)>,
    /// Distinct callees: each kept callee's latest event time.
    callees: CalleeTimes,
}

impl CallerState {
    /// The caller's latest event time.
    pub fn latest(&self) -> Option<i64> {
        self.latest
    }

    /// The rarer rules' part of the state, made (empty) on first use: by
    /// a rule of those kinds, or an end before its call.
    fn rare_mut(&mut self) -> &mut Rare {
        self.rare.get_or_insert_with(Box::default)
    }

    /// Whether a store may let the caller go when the newest event time it
    /// has seen is `newest`: on time-sorted input, the caller's next event
    /// (at `newest` or later) would then decide exactly as with no state.
    ///
    /// A caller that keeps only window data (no idempotency record, no call
    /// held open or waiting for its end, no end before its call) goes once
    /// its latest call is past the retention plus the grace: its next call
    /// starts afresh, as a new caller does. Anything else is kept for the
    /// idempotency horizon from the latest time it holds (an end before its
    /// call, a sum's waiting call or ended amount, the latest call).
    pub fn may_let_go(&self, rules: &RuleSet, newest: i64) -> bool {
        self.may_let_go_by(&LetGo::new(rules, newest))
    }

    /// [`CallerState::may_let_go`] with the cut-offs worked out once, for a
    /// store that asks of every caller in turn.
    pub fn may_let_go_by(&self, cut: &LetGo) -> bool {
        // Kept either way: its latest call is inside both horizons (the
        // usual case, answered from one field).
        if self.latest.is_some_and(|l| l > cut.windows) {
            return false;
        }
        let rare = self.rare.as_deref();
        let windows_only = self.seen.is_empty() && rare.is_none_or(Rare::holds_no_calls);
        let before = if windows_only {
            cut.windows
        } else {
            cut.records
        };
        let pending = rare.and_then(|r| r.pending_ends.newest());
        let sums = rare
            .into_iter()
            .flat_map(|r| r.sums.iter())
            .filter_map(|(id, s)| s.kept_until(id.window_ms, id.max_duration_ms))
            .max();
        let kept = [self.latest, pending, sums].into_iter().flatten().max();
        kept.is_none_or(|k| k <= before)
    }

    /// Applies one event and returns its verdict.
    pub fn apply(&mut self, rules: &RuleSet, ev: &CallEvent) -> Verdict {
        self.apply_unique(rules, ev, false)
    }

    /// [`CallerState::apply`], where `unique = true` says the call id
    /// occurs nowhere else in the input: the idempotency lookup would miss
    /// and the record would never be looked up, so both are skipped (the
    /// verdict is the same; offline replays of unique ids save the work and
    /// the memory).
    pub fn apply_unique(&mut self, rules: &RuleSet, ev: &CallEvent, unique: bool) -> Verdict {
        self.apply_inner(rules, ev, unique, None)
    }

    /// [`CallerState::apply_unique`], also noting in `journal` what a
    /// store that keeps a copy of the state elsewhere must change there.
    pub fn apply_journaled(
        &mut self,
        rules: &RuleSet,
        ev: &CallEvent,
        unique: bool,
        journal: &mut Journal,
    ) -> Verdict {
        self.apply_inner(rules, ev, unique, Some(journal))
    }

    /// The sliding log's recorded times, oldest first.
    pub fn log(&self) -> &VecDeque<i64> {
        &self.log
    }

    fn apply_inner(
        &mut self,
        rules: &RuleSet,
        ev: &CallEvent,
        unique: bool,
        mut journal: Option<&mut Journal>,
    ) -> Verdict {
        if ev.kind == EventKind::End {
            self.end_call(rules, ev);
            return Verdict::of_end(ev, rules);
        }
        let t = ev.ts_ms;
        let h = Horizons::new(rules, self.latest, t);
        if !unique {
            if let Some(v) = self.redelivered(ev, h.dedup) {
                return v;
            }
        }
        let prev = self.latest.filter(|&l| l > h.retention);
        if prev.is_none() {
            if let Some(j) = journal.as_deref_mut() {
                j.log_trimmed += self.log.len();
            }
            self.start_afresh();
        }
        self.trim(rules, &h, journal.as_deref_mut());
        let distinct_callees = rules
            .tracks_callees()
            .then(|| self.distinct_callees(rules, ev));
        let late = prev.is_some_and(|l| t < l.saturating_sub(rules.grace_ms));
        let counts: Counts = (0..rules.rules.len())
            .map(|i| {
                if rules.rules[i].key.is_aggregate() {
                    ev.aggregated(i).count
                } else if rules.sees(i, ev) {
                    self.count(rules, i, ev, &h)
                } else {
                    0
                }
            })
            .collect();
        let judgement = rules.judge(ev.number_for_lists(), &counts, None);
        let (would, reason) = outcome(rules, judgement);
        if rules.count == CountPolicy::Attempts || would == Decision::Allow {
            if let Some(j) = journal {
                j.log_inserted_inside |= self.log.back().is_some_and(|&b| b > t);
            }
            self.record(rules, ev, &h, &counts);
        }
        let shadow = would == Decision::Reject
            && (rules.shadow || matches!(judgement, Judgement::ShadowExceeded(_)));
        if rules.caller_uses_ends() && (would == Decision::Allow || shadow) && t > h.retention {
            self.open_call(rules, ev, &counts);
        }
        self.cap_pairs(rules);
        self.latest = Some(h.latest);

        // A list's reject is for good: no time after which it would pass.
        let listed = matches!(judgement, Judgement::Denylisted(_));
        let retry_after_ms = (would == Decision::Reject && !shadow && !listed)
            .then(|| self.retry_after(rules, ev, h.latest));
        let warn = rules
            .warning(judgement, shadow, &counts)
            .map(|i| CompactString::from(rules.rules[i].name.as_str()));
        let verdict = Verdict {
            record: DecisionRecord {
                call_id: ev.call_id.clone(),
                caller: ev.caller.clone(),
                ts_ms: t,
                decision: if shadow { Decision::Allow } else { would },
                reason,
                counts,
                shadow,
                late,
                degraded: false,
                rules_version: rules.version().into(),
                retry_after_ms,
                warn,
            },
            prev_ts_ms: prev,
            distinct_callees,
            duplicate: false,
            end: false,
            score: None,
        };
        if !unique {
            self.remember(t, &ev.call_id, &verdict);
        }
        verdict
    }

    /// Milliseconds from `t` until a call would pass every rule from then on
    /// (the contract's retry-after), from the state after the call at `t`.
    /// Drops, per rule keyed by caller and callee, the pairs past the cap.
    fn cap_pairs(&mut self, rules: &RuleSet) {
        let Some(rare) = self.rare.as_deref_mut() else {
            return;
        };
        for (_, pairs) in &mut rare.pairs {
            pairs.cap(rules.max_distinct_callees());
        }
    }

    /// The record a call id got before, if it is newer than the idempotency
    /// horizon: a redelivery, answered without changing anything.
    fn redelivered(&self, ev: &CallEvent, dedup_horizon: i64) -> Option<Verdict> {
        let kept = self.seen.get(&ev.call_id)?;
        if kept.ts_ms() <= dedup_horizon {
            return None;
        }
        // (The state is its caller's: the event's caller is the record's.)
        let v = kept.verdict(&ev.call_id, &ev.caller)?;
        Some(Verdict {
            duplicate: true,
            ..v
        })
    }

    /// Keeps a decided call's verdict for redeliveries.
    fn remember(&mut self, t: i64, call_id: &str, verdict: &Verdict) {
        let pos = self.seen_by_ts.partition_point(|(ts, _)| *ts <= t);
        grow_small(&mut self.seen_by_ts);
        self.seen_by_ts.insert(pos, (t, call_id.into()));
        self.keep_record(call_id.into(), verdict);
    }

    /// Puts `verdict` in the idempotency table under `call_id` (replacing
    /// a record of the same id), counting its bytes.
    fn keep_record(&mut self, call_id: CompactString, verdict: &Verdict) {
        let kept = Kept::of(verdict);
        self.seen_bytes += kept.len();
        if let Some(old) = self.seen.insert(call_id, kept) {
            self.seen_bytes -= old.len();
        }
    }

    /// No window data older than the horizon can matter: start afresh
    /// (idempotency records have their own, longer horizon). Emptied in
    /// place: a caller back after its windows passed (most callers, most
    /// of the time) refills the same tables, so they keep a small
    /// allocation ([`KEPT_CAPACITY`] entries) instead of being freed and
    /// made again; a past flood's larger ones are let go. (Every field is
    /// named, so a new one cannot be forgotten here.)
    fn start_afresh(&mut self) {
        let CallerState {
            latest,
            log,
            fixed,
            approx,
            rare,
            seen: _,
            seen_bytes: _,
            seen_by_ts: _,
            callees,
        } = self;
        *latest = None;
        log.clear();
        log.shrink_to(KEPT_CAPACITY);
        fixed.clear();
        approx.clear();
        callees.clear();
        if let Some(rare) = rare.as_deref_mut() {
            let Rare {
                own_logs,
                buckets,
                distinct,
                pairs,
                open,
                sums: _,
                pending_ends: _,
            } = rare;
            own_logs.clear();
            buckets.clear();
            distinct.clear();
            pairs.clear();
            open.clear();
        }
    }

    /// Empties the state whole, as a new caller's (`CallerState::default()`),
    /// keeping small allocations: a store hands the state of a caller it let
    /// go to the next new caller rather than free one and allocate another.
    /// [`CallerState::start_afresh`] and what it keeps: the idempotency
    /// records, ends before their calls and the sums.
    pub fn reset(&mut self) {
        self.start_afresh();
        let CallerState {
            rare,
            seen,
            seen_bytes,
            seen_by_ts,
            ..
        } = self;
        if let Some(rare) = rare.as_deref_mut() {
            rare.sums.clear();
            rare.pending_ends = PendingEnds::default();
        }
        seen.clear();
        seen.shrink_to(KEPT_CAPACITY);
        *seen_bytes = 0;
        seen_by_ts.clear();
        seen_by_ts.shrink_to(KEPT_CAPACITY);
    }

    /// Notes the call's callee, then counts the callees whose latest call is
    /// after `t - Wmax`.
    fn distinct_callees(&mut self, rules: &RuleSet, ev: &CallEvent) -> u64 {
        let t = ev.ts_ms;
        if let Some(callee) = ev.callee.as_deref().filter(|c| !c.is_empty()) {
            self.note_callee(callee, t, rules.max_distinct_callees());
        }
        self.callees
            .count_from(t.saturating_sub(rules.max_window_ms()).saturating_add(1))
    }

    /// Rule `i`'s count for a call at `t` that it sees, this call included.
    fn count(&mut self, rules: &RuleSet, i: usize, ev: &CallEvent, h: &Horizons) -> u64 {
        let t = ev.ts_ms;
        let l_new = h.latest;
        let rule = &rules.rules[i];
        let w = rule.window_ms;
        if rule.kind == WindowKind::Concurrent {
            return self.concurrent_count(rule, ev, h);
        }
        if rule.sum.is_some() {
            let shape = Shape::of(rule, rules.grace_ms);
            return slot(&mut self.rare_mut().sums, rule).count(shape, t, l_new);
        }
        if rule.key == RuleKey::CallerCallee {
            return match ev.callee.as_deref().filter(|c| !c.is_empty()) {
                None => 0,
                // Past the retention: counts 1, touches nothing.
                Some(_) if t <= h.retention => 1,
                Some(callee) => {
                    let pair = slot(&mut self.rare_mut().pairs, rule).touch(callee, t);
                    pair_count(rule, pair, t, h, rules.grace_ms)
                }
            };
        }
        match rule.kind {
            WindowKind::Sliding if rule.own_log() => {
                sliding_count(slot(&mut self.rare_mut().own_logs, rule), t, w)
            }
            WindowKind::Sliding => sliding_count(&self.log, t, w),
            // A call at or below the horizon is past the retention: it
            // counts 1 and is not recorded (as in the other kinds).
            WindowKind::TokenBucket => match rule.rate {
                Some(rate) if t > h.retention => {
                    Tat::next(*slot(&mut self.rare_mut().buckets, rule), t, rate).level(t, rate)
                }
                _ => 1,
            },
            WindowKind::DistinctCallees => match ev.callee.as_deref().filter(|c| !c.is_empty()) {
                Some(own) => slot(&mut self.rare_mut().distinct, rule).count(
                    own,
                    t,
                    w,
                    rules.max_distinct_callees(),
                ),
                None => 0,
            },
            WindowKind::Fixed => {
                let b = bucket_of(t, w);
                if bucket_end(b, w, rules.grace_ms) <= l_new {
                    1
                } else {
                    1 + slot(&mut self.fixed, &rules.rules[i])
                        .get(&b)
                        .copied()
                        .unwrap_or(0)
                }
            }
            // At or below the horizon: past the retention, counts 1, moves
            // and records nothing (a rule that sees only some calls may
            // keep counters of a bucket that old).
            WindowKind::SlidingApprox if t <= h.retention => 1,
            WindowKind::SlidingApprox => {
                slot(&mut self.approx, &rules.rules[i]).advance_and_count(t, w, h.retention)
            }
            WindowKind::Concurrent => self.concurrent_count(rule, ev, h),
        }
    }

    /// A concurrent rule's count of a call that it sees: the calls open at
    /// its time (keyed by caller and callee: to its callee alone; none
    /// without a callee, as every such rule), plus one. At or below the
    /// horizon the calls that were open then are gone: it counts 1, and
    /// the call opens nothing.
    fn concurrent_count(&mut self, rule: &Rule, ev: &CallEvent, h: &Horizons) -> u64 {
        let callee = ev.callee.as_deref().filter(|c| !c.is_empty());
        let by_callee = rule.key == RuleKey::CallerCallee;
        if by_callee && callee.is_none() {
            return 0;
        }
        if ev.ts_ms <= h.retention {
            return 1;
        }
        slot(&mut self.rare_mut().open, rule).count(ev.ts_ms, callee.filter(|_| by_callee))
    }

    /// Holds an allowed call (shadow rejects included: they connect) open
    /// in every concurrent rule that saw it (`counts`: 0 for exactly the
    /// rules that did not), closed at its end if that came first.
    /// In every sum rule that sees it, the call waits for its end, or
    /// adds what it adds at once if its end came first.
    fn open_call(&mut self, rules: &RuleSet, ev: &CallEvent, counts: &[u64]) {
        let mut end = None;
        let mut taken = false;
        for (i, (rule, &count)) in rules.rules.iter().zip(counts).enumerate() {
            let holds = match (&rule.sum, rule.kind) {
                (Some(_), _) => rules.sees(i, ev),
                (None, WindowKind::Concurrent) => count != 0,
                (None, _) => false,
            };
            if !holds {
                continue;
            }
            if !taken {
                end = self.rare_mut().pending_ends.take(&ev.call_id);
                taken = true;
            }
            if let Some(sum) = &rule.sum {
                let price = sum.price(ev.callee_for_filters());
                let sums = slot(&mut self.rare_mut().sums, rule);
                match end {
                    Some((e, talk)) if e < ev.ts_ms.saturating_add(sum.max_duration_ms) => {
                        sums.add(e.max(ev.ts_ms), sum.amount(price, talk));
                    }
                    Some(_) => {}
                    None => sums.wait(&ev.call_id, ev.ts_ms, price),
                }
                continue;
            }
            let end = end.map(|(e, _)| e);
            // (A rule keyed by caller and callee counts 0 without a callee.)
            let callee = ev
                .callee
                .as_deref()
                .filter(|_| rule.key == RuleKey::CallerCallee);
            slot(&mut self.rare_mut().open, rule).open(
                &ev.call_id,
                callee,
                ev.ts_ms,
                end,
                rule.window_ms,
            );
        }
    }

    /// A call's end: closes it in every concurrent rule that holds it. An
    /// end for a call not held is remembered, unless the call was decided
    /// already (rejected, or seen by no concurrent rule): then it changes
    /// nothing. Ends move no horizon (they are not calls).
    fn end_call(&mut self, rules: &RuleSet, ev: &CallEvent) {
        if !rules.caller_uses_ends() {
            return;
        }
        let talk = ev.talk_ms.unwrap_or(0);
        let held = self
            .rare
            .as_deref_mut()
            .is_some_and(|rare| rare.end_call(rules, ev, talk));
        if !held && !self.seen.contains_key(&ev.call_id) {
            let talk = if rules.has_sums() { talk } else { 0 };
            self.rare_mut()
                .pending_ends
                .note(&ev.call_id, ev.ts_ms, talk);
        }
    }

    /// Records the call in the state of every rule that saw it (`counts`:
    /// its counts, 0 for exactly the rules that did not).
    fn record(&mut self, rules: &RuleSet, ev: &CallEvent, h: &Horizons, counts: &[u64]) {
        let t = ev.ts_ms;
        let l_new = h.latest;
        if rules.has_sliding() {
            insert_sorted(&mut self.log, t, |&x| x <= t);
        }
        for (rule, &count) in rules.rules.iter().zip(counts) {
            // Rules keyed by callee or global keep nothing of the caller's;
            // a concurrent rule's call opens by its decision, and a sum
            // rule's adds at its end (`open_call`).
            if count == 0
                || rule.key.is_aggregate()
                || rule.kind == WindowKind::Concurrent
                || rule.sum.is_some()
            {
                continue;
            }
            let w = rule.window_ms;
            let b = bucket_of(t, w);
            if rule.key == RuleKey::CallerCallee {
                if let Some(callee) = ev
                    .callee
                    .as_deref()
                    .filter(|c| !c.is_empty() && t > h.retention)
                {
                    let pair = slot(&mut self.rare_mut().pairs, rule).touch(callee, t);
                    pair_record(rule, pair, t, h, rules.grace_ms);
                }
                continue;
            }
            match rule.kind {
                WindowKind::Sliding if rule.own_log() => {
                    insert_sorted(slot(&mut self.rare_mut().own_logs, rule), t, |&x| x <= t);
                }
                WindowKind::Sliding => {}
                WindowKind::TokenBucket => {
                    if let Some(rate) = rule.rate.filter(|_| t > h.retention) {
                        let tat = slot(&mut self.rare_mut().buckets, rule);
                        *tat = Some(Tat::next(*tat, t, rate));
                    }
                }
                WindowKind::DistinctCallees => {
                    if let Some(own) = ev.callee.as_deref().filter(|c| !c.is_empty()) {
                        slot(&mut self.rare_mut().distinct, rule).record(
                            own,
                            t,
                            rules.max_distinct_callees(),
                        );
                    }
                }
                WindowKind::Fixed => {
                    if bucket_end(b, w, rules.grace_ms) > l_new {
                        *slot(&mut self.fixed, rule).entry(b).or_insert(0) += 1;
                    }
                }
                WindowKind::SlidingApprox => {
                    let a = slot(&mut self.approx, rule);
                    match a.bucket {
                        Some(cb) if cb == b && t > h.retention => a.cur += 1,
                        Some(cb) if Approx::counts_in_prev(b, cb, t, h.retention) => a.prev += 1,
                        _ => {}
                    }
                }
                // Opened by its decision, not by `count` (see `open_call`).
                WindowKind::Concurrent => {}
            }
        }
    }

    /// Raises the callee's latest call time to `t` (never lowers it); a new
    /// callee is kept only while fewer than `cap` are.
    fn note_callee(&mut self, callee: &str, t: i64, cap: u64) {
        self.callees.note(callee, t, cap);
    }

    fn trim(&mut self, rules: &RuleSet, h: &Horizons, mut journal: Option<&mut Journal>) {
        let (horizon, dedup_horizon, l_new) = (h.retention, h.dedup, h.latest);
        // From the front: what is cut is dropped anyway, and is usually little.
        let cut = self.log.iter().take_while(|&&x| x <= horizon).count();
        self.log.drain(..cut);
        if let Some(j) = journal.as_deref_mut() {
            j.log_trimmed += cut;
        }
        for (id, map) in &mut self.fixed {
            let w = id.window_ms;
            map.retain(|&b, _| bucket_end(b, w, rules.grace_ms) > l_new);
        }
        if let Some(rare) = self.rare.as_deref_mut() {
            rare.trim(rules, h);
        }
        self.callees.trim(horizon);
        while self
            .seen_by_ts
            .front()
            .is_some_and(|(ts, _)| *ts <= dedup_horizon)
        {
            let Some((_, id)) = self.seen_by_ts.pop_front() else {
                break;
            };
            if self
                .seen
                .get(&id)
                .is_some_and(|v| v.ts_ms() <= dedup_horizon)
            {
                if let Some(old) = self.seen.remove(&id) {
                    self.seen_bytes -= old.len();
                }
                if let Some(j) = journal.as_deref_mut() {
                    j.dropped_records.push(id);
                }
            }
        }
    }
}

/// Makes room for one more entry in a deque of a few: exactly, below four
/// entries (a caller who called once keeps one slot, not the four a
/// deque's doubling starts at); as a deque grows, from there on.
fn grow_small<T>(d: &mut VecDeque<T>) {
    if d.len() == d.capacity() && d.len() < 4 {
        d.reserve_exact(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const T0: i64 = 1_764_547_200_000; // a multiple of 10 s

    pub(super) fn call(id: &str, ts_ms: i64) -> CallEvent {
        CallEvent {
            call_id: id.into(),
            caller: "+34911000001".into(),
            ts_ms,
            ..Default::default()
        }
    }

    /// The retry-after of a third call at +2 s after calls at +0 and +1 s,
    /// limit 2 in 10 s, under `attempts`.
    fn third_call_retry(kind: &str) -> Option<i64> {
        let rules = RuleSet::from_args(None, &[format!("r:{kind}:10s:2")]).unwrap();
        let mut state = CallerState::default();
        for (i, dt) in [0, 1_000].into_iter().enumerate() {
            let v = state.apply(&rules, &call(&format!("c{i}"), T0 + dt));
            assert_eq!(v.record.decision, Decision::Allow);
            assert_eq!(v.record.retry_after_ms, None);
        }
        let v = state.apply(&rules, &call("c2", T0 + 2_000));
        assert_eq!(v.record.decision, Decision::Reject);
        v.record.retry_after_ms
    }

    #[test]
    fn retry_after_per_kind() {
        // Sliding: the call at +1 s leaves the window at +11 s.
        assert_eq!(third_call_retry("sliding"), Some(9_000));
        // Fixed: the bucket [0, 10 s) ends.
        assert_eq!(third_call_retry("fixed"), Some(8_000));
        // Approx: in the next bucket the estimate floor(3 * (W - r - 1) / W) + 1
        // drops to 2 at r = 3333 ms, i.e. at +13.333 s.
        assert_eq!(third_call_retry("sliding-approx"), Some(11_333));
    }

    /// A rule with a time profile rejects only calls in its profile: its
    /// part of the retry-after ends when the profile does, not when its
    /// window would let the call through.
    #[test]
    fn retry_after_ends_with_the_time_profile() {
        let retry = |profile: &str, first: i64, second: i64| {
            let text = format!(
                "[[rule]]\nname = \"r\"\nkind = \"sliding\"\nwindow = \"1h\"\nlimit = 1\n{profile}"
            );
            let rules = RuleSet::from_toml(&text).unwrap();
            let mut s = CallerState::default();
            s.apply(&rules, &call("a", T0 + first));
            let v = s.apply(&rules, &call("b", T0 + second));
            assert_eq!(v.record.decision, Decision::Reject, "{profile}");
            v.record.retry_after_ms
        };
        let (h, m) = (3_600_000, 60_000);
        // T0 is Monday 2025-12-01 00:00 UTC. Calls at 11:59:00 and 11:59:30.
        let (first, second) = (11 * h + 59 * m, 11 * h + 59 * m + 30_000);
        // Every attempt counts: the window holds the rejected call until 12:59:30.
        assert_eq!(retry("", first, second), Some(h), "no profile: the window");
        assert_eq!(
            retry("hours = \"00:00-12:00\"\n", first, second),
            Some(30_000)
        );
        // 01:00-13:00 in Madrid is 00:00-12:00 UTC in December.
        let madrid = "hours = \"01:00-13:00\"\ntimezone = \"Europe/Madrid\"\n";
        assert_eq!(retry(madrid, first, second), Some(30_000));
        // Monday only: a reject at 23:59:30 on Monday ends at midnight.
        let (first, second) = (23 * h + 59 * m, 23 * h + 59 * m + 30_000);
        assert_eq!(retry("days = [\"mon\"]\n", first, second), Some(30_000));
        // A profile that holds past the window changes nothing.
        assert_eq!(
            retry("hours = \"06:00-18:00\"\n", 8 * h, 8 * h + 1),
            Some(h)
        );
    }

    fn end(id: &str, ts_ms: i64, talk_ms: i64) -> CallEvent {
        CallEvent {
            kind: EventKind::End,
            talk_ms: Some(talk_ms),
            ..call(id, ts_ms)
        }
    }

    /// A talk cap: allowed calls add their talk (rounded up to seconds)
    /// at their ends; a rejected call never adds; the retry-after waits
    /// for the talk to leave the window.
    #[test]
    fn a_talk_sum_adds_the_talk_of_allowed_calls_at_their_ends() {
        let rules = RuleSet::from_toml(
            "[[rule]]\nname = \"talk\"\nkind = \"sliding\"\nwindow = \"1h\"\nsum = \"talk\"\nlimit = \"2m\"\n",
        )
        .unwrap();
        assert_eq!(rules.rules[0].limit, 120);
        let (m, mut s) = (60_000, CallerState::default());
        let a = s.apply(&rules, &call("a", T0));
        assert_eq!(
            (a.record.decision, a.record.counts[0]),
            (Decision::Allow, 0)
        );
        s.apply(&rules, &call("b", T0 + 1));
        assert!(s.apply(&rules, &end("a", T0 + 2 * m, 90_500)).end);
        s.apply(&rules, &end("a", T0 + 3 * m, 90_500));
        let c = s.apply(&rules, &call("c", T0 + 3 * m));
        assert_eq!(c.record.counts[0], 91, "a's talk, rounded up, once");
        s.apply(&rules, &end("b", T0 + 4 * m, 30_000));
        let d = s.apply(&rules, &call("d", T0 + 5 * m));
        assert_eq!(
            (d.record.counts[0], d.record.decision),
            (121, Decision::Reject)
        );
        // d was rejected: its end adds nothing.
        s.apply(&rules, &end("d", T0 + 6 * m, 600_000));
        // a's 91 s leave the window at T0 + 62 min; b's 30 s stay.
        assert_eq!(d.record.retry_after_ms, Some(57 * m));
        let e = s.apply(&rules, &call("e", T0 + 62 * m));
        assert_eq!(
            (e.record.counts[0], e.record.decision),
            (30, Decision::Allow)
        );
    }

    /// A spend cap: talk priced by the longest prefix of the rates file,
    /// billed in its increments; an end before its attempt (the switch's
    /// messages reordered) adds at the attempt.
    #[test]
    fn a_cost_sum_prices_talk_by_the_callees_longest_prefix() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("rates.csv"), "+882,2.00\n+88216,5.00,1\n").unwrap();
        std::fs::write(
            dir.path().join("rules.toml"),
            "[[rule]]\nname = \"spend\"\nkind = \"fixed\"\nwindow = \"1d\"\nsum = \"cost\"\nrates_file = \"rates.csv\"\nlimit = \"10.00\"\n",
        )
        .unwrap();
        let rules = RuleSet::from_file(&dir.path().join("rules.toml")).unwrap();
        assert_eq!(rules.rules[0].limit, 10_000_000);
        let to = |id: &str, ts: i64, callee: &str| CallEvent {
            callee: Some(callee.into()),
            ..call(id, ts)
        };
        let mut s = CallerState::default();
        s.apply(&rules, &to("a", T0, "+8821234"));
        s.apply(&rules, &end("a", T0 + 70_000, 61_000));
        // 61 s, per minute: 2 minutes at 2.00.
        assert_eq!(
            s.apply(&rules, &to("x", T0 + 80_000, "+34911"))
                .record
                .counts[0],
            4_000_000
        );
        // b's end comes first: 7 s at 5.00 a minute, per second, at b's start.
        s.apply(&rules, &end("b", T0 + 90_000, 7_000));
        s.apply(&rules, &to("b", T0 + 95_000, "+882161"));
        let c = s.apply(&rules, &to("c", T0 + 96_000, "+34911"));
        assert_eq!(c.record.counts[0], 4_000_000 + 583_334);
        // An unpriced callee costs nothing.
        s.apply(&rules, &end("x", T0 + 97_000, 600_000));
        assert_eq!(
            s.apply(&rules, &call("y", T0 + 98_000)).record.counts[0],
            4_583_334
        );
    }

    #[test]
    fn denylist_and_shadow_rejects_carry_no_retry_after() {
        let text = "deny = [\"+34911\"]\n[[rule]]\nname = \"r\"\nkind = \"sliding\"\nwindow = \"10s\"\nlimit = 1\n";
        let rules = RuleSet::from_toml(text).unwrap();
        let v = CallerState::default().apply(&rules, &call("d", T0));
        assert_eq!(
            (v.record.decision, v.record.retry_after_ms),
            (Decision::Reject, None)
        );
        let text = "shadow = true\n[[rule]]\nname = \"r\"\nkind = \"sliding\"\nwindow = \"10s\"\nlimit = 1\n";
        let rules = RuleSet::from_toml(text).unwrap();
        let mut s = CallerState::default();
        s.apply(&rules, &call("a", T0));
        let v = s.apply(&rules, &call("b", T0));
        assert!(v.record.shadow);
        assert_eq!(v.record.retry_after_ms, None);
    }

    /// Under the usual rules (fixed, sliding, approximate), with callees,
    /// ends (no rule holds calls open) and redeliveries, a caller's state
    /// never makes the rarer rules' part: it stays in a few cache lines.
    #[test]
    fn usual_rules_leave_the_rarer_part_out() {
        let rules = RuleSet::from_toml(
            "[[rule]]\nname = \"burst\"\nkind = \"fixed\"\nwindow = \"1s\"\nlimit = 2\n\
             [[rule]]\nname = \"minute\"\nkind = \"sliding\"\nwindow = \"60s\"\nlimit = 10\n\
             [[rule]]\nname = \"hour\"\nkind = \"sliding-approx\"\nwindow = \"1h\"\nlimit = 200\n",
        )
        .unwrap();
        let mut state = CallerState::default();
        for i in 0..40i64 {
            let ev = CallEvent {
                callee: Some(format!("+3491{}", i % 12).into()),
                ..call(&format!("c{}", i % 30), T0 + i * 700)
            };
            state.apply(&rules, &ev);
            state.apply(
                &rules,
                &end(&format!("c{}", i % 30), T0 + i * 700 + 300, 300),
            );
        }
        assert!(state.rare.is_none(), "{:?}", state.rare);
        // The rest fits in four cache lines.
        assert!(
            size_of::<CallerState>() <= 256,
            "{}",
            size_of::<CallerState>()
        );
    }

    /// A state emptied by `reset` is a new caller's, whatever it held:
    /// every table of every kind of rule, idempotency records, calls open
    /// and waiting, ends before their calls, sums. (Compared as printed: a
    /// field `reset` forgot to empty would show.) And it then decides as a
    /// new state does.
    #[test]
    fn a_reset_state_is_a_new_callers() {
        let text = "count = \"attempts\"\n\
            [[rule]]\nname = \"s\"\nkind = \"sliding\"\nwindow = \"10m\"\nlimit = 3\n\
            [[rule]]\nname = \"p\"\nkind = \"sliding\"\nwindow = \"10m\"\nlimit = 5\ncallees = [\"+882\"]\n\
            [[rule]]\nname = \"f\"\nkind = \"fixed\"\nwindow = \"1h\"\nlimit = 9\n\
            [[rule]]\nname = \"a\"\nkind = \"sliding-approx\"\nwindow = \"1h\"\nlimit = 9\n\
            [[rule]]\nname = \"b\"\nkind = \"token-bucket\"\nrate = \"1/m\"\nburst = 2\n\
            [[rule]]\nname = \"d\"\nkind = \"distinct-callees\"\nwindow = \"1h\"\nlimit = 9\n\
            [[rule]]\nname = \"cc\"\nkind = \"sliding\"\nwindow = \"1h\"\nlimit = 2\nkey = \"caller+callee\"\n\
            [[rule]]\nname = \"o\"\nkind = \"concurrent\"\nlimit = 2\nmax_duration = \"1h\"\n\
            [[rule]]\nname = \"t\"\nkind = \"sliding\"\nwindow = \"1h\"\nsum = \"talk\"\nlimit = \"2m\"\n";
        let rules = RuleSet::from_toml(text).unwrap();
        let to = |id: &str, ts_ms: i64, callee: &str| CallEvent {
            callee: Some(callee.into()),
            ..call(id, ts_ms)
        };
        let script = [
            to("a", T0, "+882161"),
            to("b", T0 + 1_000, "+34911"),
            end("a", T0 + 30_000, 20_000),
            // An end before its call.
            end("z", T0 + 40_000, 5_000),
            to("c", T0 + 50_000, "+882161"),
            // A redelivery.
            to("b", T0 + 60_000, "+34911"),
        ];
        let mut used = CallerState::default();
        let fresh: Vec<_> = script.iter().map(|e| used.apply(&rules, e)).collect();
        let new = format!("{:?}", CallerState::default());
        assert_ne!(format!("{used:?}"), new, "the script left state behind");
        used.reset();
        // The rarer rules' part stays allocated, emptied, for the next caller.
        let kept = used.rare.take().expect("the rarer part is kept");
        assert_eq!(format!("{kept:?}"), format!("{:?}", Rare::default()));
        assert_eq!(format!("{used:?}"), new);
        used.rare = Some(kept);
        let again: Vec<_> = script.iter().map(|e| used.apply(&rules, e)).collect();
        assert_eq!(format!("{again:?}"), format!("{fresh:?}"));
    }
}
