//! Rules keyed by callee or global: windows many callers share, counted
//! through credits so that several instances can enforce one limit.
//!
//! The contract (also in the README, "Limits across callers"):
//!
//! * A rule keyed by `callee` has one window per callee, one keyed
//!   `global` a single window; `fixed` or `sliding-approx`, with the
//!   buckets of a caller's rules (`b = floor(t / W)`).
//! * It counts the calls it sees and admits, in processing order, before
//!   the caller's rules decide: a call another rule rejects still holds its
//!   place (under either count policy); a call over the rule's limit is not
//!   counted. A call id the gate decided before gets the same result again
//!   and counts nothing (within the last [`REMEMBERED_IDS`] ids).
//! * fixed: count `c + 1`, `c` the calls counted in the bucket before it;
//!   sliding-approx: `floor(p (W - r - 1) / W) + c + 1`, `p` the previous
//!   bucket's count, `r = t - b W`. Over the limit: rejected (or flagged,
//!   for a shadow rule), in rule order with the caller's rules.
//! * There is no dead bucket: a call counts in its bucket however late it
//!   comes (partitions of a stream can run far apart in event time, and
//!   the victim's calls come through all of them). A counter lives in
//!   Redis `3 W + grace` plus the TTL slack after its last lease (wall
//!   clock; it is also the previous bucket of a sliding-approx rule), in
//!   [`MemoryLedger`] until the newest call is [`MEMORY_MARGIN_MS`] past
//!   that (event time); a call after that starts its counter afresh.
//!   Online and offline differ only for calls that late.
//! * Credits: the count of a bucket is the credits handed out for it. An
//!   instance takes credits from a ledger in blocks (in Redis
//!   `src/store/redis/aggregate/lease.rs`, never past the limit), admits a call only with a
//!   credit in hand, and gives back what it still holds of a bucket when
//!   it first asks for the next one (unless the batch still needs them).
//!   Admitted calls per bucket across all instances therefore never
//!   exceed the limit. A sliding-approx rule's weighted estimate is
//!   checked by each instance against its view of the previous bucket, so
//!   across instances the estimate (never the bucket's limit) can be
//!   exceeded. A call is rejected while other instances hold unused
//!   credits: at most the sum over the others of what they hold, each at
//!   most one block beyond its batch's need ([`block_cap`]) for a fixed
//!   rule. (The batch may be the one queued behind the batch being
//!   committed: `consume` leases for it meanwhile; a counter asked for
//!   since the last batch was decided is not asked for again.)
//! * Reserves ([`reserve`]): with `E` reserve slots, each slot owns
//!   [`reserve_of`] credits of every counter and the ledger hands out
//!   [`shared_limit`]; the holder of a slot spends its reserve of a counter
//!   it first sees without asking, in the buckets of its [`Span`]. Still
//!   never past the limit; a call is also rejected while other slots'
//!   reserves are unspent (at most `E r` more).
//! * The count an instance writes is its view: the credits handed out as
//!   of its last lease less those it holds, plus its own calls and the
//!   reserve it spent. With one instance (and offline, where
//!   [`MemoryLedger`] plays Redis) that is the exact count above, whatever
//!   the batches (with the only slot: the reserve spent in a counter is
//!   remembered past its time, for late calls, up to [`SPENT_KEPT`]
//!   counters).

use compact_str::CompactString;

use crate::engine::event::CallEvent;
use crate::engine::rules::{RuleKey, RuleSet, WindowKind};
use crate::engine::window::bucket_of;

mod counter;
mod held;
mod judge;
mod ledger;
mod plan;
mod reserve;
mod table;
use counter::{Buckets, Counters, Spent, SpentBuckets};
use held::Held;
pub use ledger::{Lease, LeaseRequest, MemoryLedger};
use plan::{Checked, Planned, Remembered};
pub use reserve::{reserve_of, shared_limit, Reserves, Span};
use table::{Recent, Slab};

/// How much longer than `3 W + grace` the in-process ledger keeps a
/// counter (event time): calls later than that start it afresh.
pub const MEMORY_MARGIN_MS: i64 = 3_600_000;

/// Counters whose reserve was spent that the gate remembers after their
/// time, for late calls (their count includes the reserve spent; none is
/// taken for them again): about 70 bytes each (the bucket's table,
/// moved, and 16 bytes of reserve per counter), kept by bucket. Past this
/// many the oldest buckets are forgotten whole, and no reserve is taken
/// below their end.
pub const SPENT_KEPT: usize = 1 << 20;

/// Call ids whose results the gate keeps, so a redelivered or retried
/// call takes no second credit.
pub const REMEMBERED_IDS: usize = 1 << 18;

/// The largest block of credits taken beyond a batch's need: a sixteenth
/// of the limit, at least one. The bound on calls rejected while others
/// hold credits grows with it; the Redis calls saved grow with it too.
pub fn block_cap(limit: u64) -> u64 {
    (limit / 16).max(1)
}

/// Credits taken beyond a batch's need for a key this instance counted
/// `recent` calls of (in this bucket or the one before): as many again,
/// up to [`block_cap`]; none for a key called once (most callees: a
/// credit held for them would only die with the bucket).
fn extra(recent: u64, limit: u64) -> u64 {
    if recent < 2 {
        0
    } else {
        recent.min(block_cap(limit))
    }
}

/// One counter: a rule's window for one key in one bucket.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CounterId {
    /// The rule's name.
    pub rule: CompactString,
    /// Its window, ms (a reload that changes it starts new counters).
    pub window_ms: i64,
    /// The callee, or empty for a global rule.
    pub key: CompactString,
    /// The bucket, `floor(t / W)`.
    pub bucket: i64,
}

impl CounterId {
    /// The same counter one bucket earlier.
    pub fn prev(&self) -> CounterId {
        CounterId {
            bucket: self.bucket.saturating_sub(1),
            ..self.clone()
        }
    }

    /// When (event time) the counter is dropped: `b W + ttl`, with the
    /// ttl `3 W + grace` of [`LeaseRequest::ttl_ms`].
    fn expires_at(&self, ttl_ms: i64) -> i64 {
        self.bucket
            .saturating_mul(self.window_ms)
            .saturating_add(ttl_ms)
    }
}

/// Decides the rules keyed by callee or global for batches of calls, from
/// credits a ledger (Redis's lease script, or [`MemoryLedger`]) leases to
/// it: [`Gate::plan`] says what to ask for, [`Gate::settle`] takes the
/// answers, [`Gate::decide`] fills in each call's [`Aggregated`] entries,
/// in order.
#[derive(Debug)]
pub struct Gate {
    /// The counters' places in `held`.
    counters: Buckets<usize>,
    held: Slab<Held>,
    latest: Option<i64>,
    /// Batches decided so far.
    decided: u64,
    /// The results of the last [`REMEMBERED_IDS`] call ids decided.
    remembered: Remembered,
    /// The last batch planned (for its decide).
    planned: Option<Planned>,
    /// The reserve slots and this instance's span ([`reserve`]).
    reserves: Reserves,
    /// Counters given a reserve so far.
    reserved_counters: u64,
    /// Reserve spent of the last [`SPENT_KEPT`] counters (or a few
    /// fewer: whole buckets are forgotten) past their time.
    spent: SpentBuckets,
    /// No reserve is taken for a bucket starting below this.
    reserve_floor: Option<i64>,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            counters: Buckets::default(),
            held: Slab::default(),
            latest: None,
            decided: 0,
            remembered: Recent::new(REMEMBERED_IDS),
            planned: None,
            reserves: Reserves::default(),
            reserved_counters: 0,
            spent: SpentBuckets::new(SPENT_KEPT),
            reserve_floor: None,
        }
    }
}

/// The key of the counter rule `i` counts `ev` in (the callee, the
/// account, or empty for a global rule), if it sees it.
fn key_of<'a>(rules: &RuleSet, i: usize, ev: &'a CallEvent) -> Option<&'a str> {
    // A call's end is no call: no window counts it.
    if ev.kind == crate::engine::event::EventKind::End {
        return None;
    }
    if rules.rules[i].is_pooled() {
        return None;
    }
    let key = match rules.rules[i].key {
        RuleKey::Callee => ev.callee.as_deref().filter(|c| !c.is_empty())?,
        RuleKey::Account => ev.account.as_deref().filter(|a| !a.is_empty())?,
        RuleKey::Global => "",
        RuleKey::Caller | RuleKey::CallerCallee => return None,
    };
    rules.sees(i, ev).then_some(key)
}

/// The counter rule `i` counts `ev` in, if it sees it.
fn counter_of(rules: &RuleSet, i: usize, ev: &CallEvent) -> Option<CounterId> {
    let rule = &rules.rules[i];
    Some(CounterId {
        key: key_of(rules, i, ev)?.into(),
        rule: rule.name.as_str().into(),
        window_ms: rule.window_ms,
        bucket: bucket_of(ev.ts_ms, rule.window_ms),
    })
}

/// How long rule `i`'s counters live from their bucket's start, ms:
/// `3 W + grace` ([`LeaseRequest::ttl_ms`]).
fn ttl_of(rules: &RuleSet, i: usize) -> i64 {
    rules.rules[i]
        .window_ms
        .saturating_mul(3)
        .saturating_add(rules.grace_ms)
}

/// The rules keyed by callee or global, by index.
fn aggregate_rules(rules: &RuleSet) -> Vec<usize> {
    (0..rules.rules.len())
        .filter(|&i| rules.rules[i].is_gated())
        .collect()
}

impl Gate {
    /// An empty gate, without reserves (the whole limit leased) until
    /// [`Gate::set_reserves`].
    pub fn new() -> Self {
        Gate::default()
    }

    /// Sets the slots sharing each limit and this instance's span (see
    /// [`reserve`]); used from the next [`Gate::plan`] on.
    pub fn set_reserves(&mut self, reserves: Reserves) {
        self.reserves = reserves;
    }

    /// A counter past its time that had a reserve, back for a late call
    /// (if it had one): the reserve spent in its count, what was left of
    /// it in hand.
    fn revive(&mut self, id: &CounterId, ttl_ms: i64) {
        if let Some(spent) = self.spent.remove(id) {
            let at = self.held.put(Held::on_reserve(spent.reserve, spent.left));
            self.counters.insert(id, id.expires_at(ttl_ms), at);
        }
    }

    /// Where `id` is held; if it is not here, a counter first seen, on
    /// this instance's reserve if it has one for it: spent without asking,
    /// the ledger asked only for what the batch needs beyond it (one
    /// lookup either way).
    fn held_or_reserved(&mut self, id: &CounterId, limit: u64, ttl_ms: i64) -> Option<usize> {
        let reserve = self.reserve_for(id, limit);
        let (counters, held) = (&mut self.counters, &mut self.held);
        let mut taken = false;
        let at = counters
            .get_or_try_insert(id, id.expires_at(ttl_ms), || {
                taken = reserve > 0;
                taken.then(|| held.put(Held::on_reserve(reserve, reserve)))
            })
            .copied();
        if taken {
            self.reserved_counters += 1;
        }
        at
    }

    /// The counter `id` (if held).
    fn held_of(&self, id: &CounterId) -> Option<&Held> {
        self.counters.get(id).map(|&at| self.held.get(at))
    }

    /// Where `id` is held, a counter holding nothing put in if it is not
    /// (a bucket new here due at `due`).
    fn place_of(&mut self, id: &CounterId, due: i64) -> usize {
        let held = &mut self.held;
        *self
            .counters
            .get_or_insert_with(id, due, || held.put(Held::default()))
    }

    /// `events` are the batch planned last, and nothing was decided since:
    /// decide uses that plan (the tests' view of it).
    #[cfg(test)]
    pub fn planned(&self, events: &[CallEvent]) -> bool {
        self.planned
            .as_ref()
            .is_some_and(|p| p.checked.decided == self.decided && p.checked.fits(events))
    }

    /// Forgets the last plan (its lease failed: the batch is planned
    /// again when it comes).
    pub fn forget_plan(&mut self) {
        self.planned = None;
    }

    /// Batches decided so far: a batch decided with nothing decided after
    /// it is still the gate's latest word on its calls.
    pub fn decided(&self) -> u64 {
        self.decided
    }

    /// Counters given credits from this instance's reserve so far.
    pub fn reserved_counters(&self) -> u64 {
        self.reserved_counters
    }

    /// This instance's reserve of a counter of rule `limit` first seen in
    /// this batch: its credits, if its bucket is in the span.
    fn reserve_for(&self, id: &CounterId, limit: u64) -> u64 {
        let Some(span) = self.reserves.span else {
            return 0;
        };
        let start = id.bucket.saturating_mul(id.window_ms);
        if self.reserve_floor.is_some_and(|f| start < f) || !span.holds(start) {
            return 0;
        }
        reserve_of(limit, self.reserves.slots)
    }

    /// The credits `events` need beyond those held: one request per
    /// counter short of its calls in the batch, for what is missing plus a
    /// block sized from this instance's own calls to the key (this bucket's
    /// or the one before), at most [`block_cap`]. A counter asked for the
    /// first time gives back what is held of the bucket before.
    pub fn plan(&mut self, rules: &RuleSet, events: &[CallEvent]) -> Vec<LeaseRequest> {
        let aggs = aggregate_rules(rules);
        if aggs.is_empty() {
            return Vec::new();
        }
        let now = self.latest.unwrap_or(i64::MIN);
        self.expire(now);
        let checked = Checked::new(events, &self.remembered, self.decided);
        // (Sized for a counter per call and rule: growing it was a tenth
        // of the gate's time.)
        let most = events.len().saturating_mul(aggs.len());
        let mut planned = Planned::new(checked, events.len(), rules, most);
        for (j, ev) in events.iter().enumerate() {
            if planned.checked.known(j) {
                continue;
            }
            for &i in &aggs {
                let Some(key) = key_of(rules, i, ev) else {
                    continue;
                };
                let rule = &rules.rules[i];
                let bucket = bucket_of(ev.ts_ms, rule.window_ms);
                let k = planned.count(i, key, bucket, || CounterId {
                    rule: rule.name.as_str().into(),
                    window_ms: rule.window_ms,
                    key: key.into(),
                    bucket,
                });
                planned.note(j, i, k);
            }
        }
        let mut requests = Vec::new();
        for k in 0..planned.needs.len() {
            let (place, request) = self.request_for(rules, &planned, k, now);
            planned.needs[k].place = place;
            requests.extend(request);
        }
        self.planned = Some(planned);
        requests
    }

    /// Where need `k` of `planned` is held (if it is, or is now on a
    /// reserve), and the request for the credits it needs beyond those
    /// held, if any ([`Gate::plan`]).
    fn request_for(
        &mut self,
        rules: &RuleSet,
        planned: &Planned,
        k: usize,
        now: i64,
    ) -> (Option<usize>, Option<LeaseRequest>) {
        let n = &planned.needs[k];
        let (i, id, need) = (n.rule, &n.id, n.calls);
        let rule = &rules.rules[i];
        let approx = rule.kind == WindowKind::SlidingApprox;
        let ttl_ms = ttl_of(rules, i);
        // (Only a counter past its time can have been dropped.)
        if id.expires_at(ttl_ms) < now && !self.counters.contains(id) {
            self.revive(id, ttl_ms);
        }
        let place = self.held_or_reserved(id, rule.limit, ttl_ms);
        let held = place.map(|at| *self.held.get(at));
        // (Never leased in this life: held nothing of the ledger's. A
        // counter first seen, maybe on a reserve.)
        let first = held.is_none_or(|h| h.leased_at == u64::MAX);
        let have = held.map_or(0, |h| h.held);
        if let Some(h) = held {
            // (Asked already since the last batch was decided: a lease
            // ahead, answered in full or short. Asking again would be
            // answered the same, as far as this instance can tell.)
            let fresh = h.leased_at == self.decided;
            // (A sliding-approx counter whose previous bucket is not kept
            // here asks for that bucket's count: one leased before, or one
            // whose previous bucket may have been dropped.)
            let prev_unknown = approx && {
                let prev = id.prev();
                !self.counters.contains(&prev) && (!first || prev.expires_at(ttl_ms) < now)
            };
            if fresh || have >= need && !prev_unknown {
                return (place, None);
            }
        }
        let prev_id = id.prev();
        let gives_back = first && !planned.has(i, &id.key, prev_id.bucket);
        let prev_at = self.counters.get(&prev_id).copied();
        let (prev_mine, give_back) = match prev_at.map(|at| self.held.get_mut(at)) {
            Some(p) if gives_back => {
                // (The reserve is the slot's own: never given back.)
                let g = p.shared_held();
                p.held -= g;
                p.total -= g;
                (p.mine, g)
            }
            Some(p) => (p.mine, 0),
            None => (0, 0),
        };
        let recent = held.map_or(0, |h| h.mine).max(prev_mine);
        let request = LeaseRequest {
            counter: id.clone(),
            approx,
            limit: shared_limit(rule.limit, self.reserves.slots),
            want: need.saturating_sub(have) + extra(recent, rule.limit),
            give_back,
            ttl_ms,
            now_ms: now,
            cold: first,
        };
        (place, Some(request))
    }

    /// Takes the ledger's answers to [`Gate::plan`]'s requests.
    pub fn settle(&mut self, requests: &[LeaseRequest], leases: &[Lease]) {
        for (req, lease) in requests.iter().zip(leases) {
            let id = &req.counter;
            let at = self.place_of(id, id.expires_at(req.ttl_ms));
            let h = self.held.get_mut(at);
            h.held += lease.granted;
            h.total = lease.total.saturating_add(h.reserve).max(h.held);
            h.prev = lease.prev;
            h.leased_at = self.decided;
        }
    }

    /// Fills in `events`' [`CallEvent::aggregate`], in order, taking a
    /// credit for each call a rule admits.
    pub fn decide(&mut self, rules: &RuleSet, events: &mut [CallEvent]) {
        if !rules.has_aggregates() {
            return;
        }
        // (As planned, when this batch was: an id found new then is not
        // looked up again, and a call's counters are where plan found
        // them.)
        let (count, version) = (rules.rules.len(), rules.version());
        let mut planned = self
            .planned
            .take()
            .filter(|p| p.fits(events, count, version, self.decided));
        self.decided += 1;
        for (j, ev) in events.iter_mut().enumerate() {
            let t = ev.ts_ms;
            self.latest = Some(self.latest.map_or(t, |l| l.max(t)));
            let (hash, look) = match &planned {
                Some(p) => p.checked.for_decide(j),
                None => (self.remembered.hash_of(&ev.call_id), true),
            };
            debug_assert!(look || self.remembered.get(&ev.call_id).is_none());
            if let Some(known) = look
                .then(|| self.remembered.get_hashed(hash, &ev.call_id))
                .flatten()
            {
                ev.aggregate = Some(known.clone());
                continue;
            }
            // (A call remembered when planned has no counters in the plan:
            // one forgotten since is decided as without a plan.)
            let out = match planned.as_mut().filter(|p| !p.checked.known(j)) {
                Some(p) => self.judge_planned(rules, p, j, t),
                None => self.judge_call(rules, ev),
            };
            self.remembered
                .put_hashed(hash, ev.call_id.clone(), out.clone());
            ev.aggregate = Some(out);
        }
    }

    /// Plans, leases from `ledger` and decides: the whole gate on an
    /// in-process ledger.
    pub fn run(&mut self, ledger: &mut MemoryLedger, rules: &RuleSet, events: &mut [CallEvent]) {
        let requests = self.plan(rules, events);
        if !requests.is_empty() {
            let leases = ledger.lease(&requests);
            self.settle(&requests, &leases);
        }
        self.decide(rules, events);
    }

    /// [`Gate::run`] on events numbered by their rows (a call log's).
    pub fn run_rows(
        &mut self,
        ledger: &mut MemoryLedger,
        rules: &RuleSet,
        rows: &mut [(u64, CallEvent)],
    ) {
        if !rules.has_aggregates() {
            return;
        }
        let mut events: Vec<CallEvent> = rows.iter().map(|(_, e)| e.clone()).collect();
        self.run(ledger, rules, &mut events);
        for ((_, row), ev) in rows.iter_mut().zip(events) {
            row.aggregate = ev.aggregate;
        }
    }

    /// Drops counters past `3 W + grace` behind `now`, a bucket at a
    /// time; those that still hold credits are kept [`MEMORY_MARGIN_MS`]
    /// longer (the ledger counts them as handed out: dropped, they would
    /// count as calls). A counter dropped that had a reserve is kept for
    /// late calls: its count has the reserve spent in it, and no reserve
    /// is taken for it again.
    fn expire(&mut self, now: i64) {
        while let Some(mut due) = self.counters.pop_due(now) {
            let held = &mut self.held;
            // (Most go, and whole: the table becomes the bucket's memory
            // of spent reserves, its keys not hashed again.)
            let stay: Counters<usize> = match due.kept {
                true => Counters::default(),
                false => due
                    .counters
                    .extract_if(|_, &mut at| held.get(at).shared_held() > 0)
                    .collect(),
            };
            due.counters.retain(|_, &mut at| {
                let reserved = held.get(at).reserved;
                if !reserved {
                    held.free(at);
                }
                reserved
            });
            if !due.counters.is_empty() {
                let spent = |at| {
                    let h = held.get(at);
                    let (reserve, left) = (h.reserve, h.reserve_left);
                    held.free(at);
                    Spent { reserve, left }
                };
                if let Some(end) = self.spent.keep(due.id.clone(), due.counters, spent) {
                    self.raise_floor(end);
                }
            }
            if !stay.is_empty() {
                let at = due.at.saturating_add(MEMORY_MARGIN_MS);
                self.counters.keep_longer(due.id, stay, at);
            }
        }
    }

    /// A counter whose reserve was spent is forgotten: no reserve is taken
    /// again below the end of its bucket. (One revived since is not
    /// forgotten: it is back among the counters.)
    fn raise_floor(&mut self, end: i64) {
        self.reserve_floor = Some(self.reserve_floor.map_or(end, |f| f.max(end)));
    }

    /// Every counter held.
    #[cfg(test)]
    fn held_values(&self) -> impl Iterator<Item = &Held> {
        self.counters.values().map(|&at| self.held.get(at))
    }

    /// Forgets the oldest counter whose reserve was spent.
    #[cfg(test)]
    fn forget_oldest_spent(&mut self) {
        if let Some(end) = self.spent.forget_oldest() {
            self.raise_floor(end);
        }
    }
}

#[cfg(test)]
mod tests;
