//! How the gate judges a call by each rule keyed by callee or global: on
//! the counters its batch's plan found, or looking them up, and the count
//! against the limit ([`Gate::decide`] calls these in order).

use std::sync::Arc;

use super::plan::Planned;
use super::{counter_of, ttl_of, CounterId, Gate};
use crate::engine::event::{Aggregated, CallEvent};
use crate::engine::rules::{RuleSet, WindowKind};
use crate::engine::window::{approx_estimate, approx_rejects_until};

impl Gate {
    /// Call `j` of a planned batch, at `t`, judged by each rule in order
    /// (as the caller's rules are), on the counters the plan found.
    pub(super) fn judge_planned(
        &mut self,
        rules: &RuleSet,
        p: &mut Planned,
        j: usize,
        t: i64,
    ) -> Arc<[Aggregated]> {
        (0..rules.rules.len())
            .map(|i| match p.need_of(j, i) {
                Some(k) => {
                    let need = &mut p.needs[k];
                    let at = match need.place {
                        Some(at) => at,
                        None => {
                            let due = need.id.expires_at(ttl_of(rules, i));
                            *need.place.insert(self.place_of(&need.id, due))
                        }
                    };
                    self.judge(rules, i, &need.id, at, t)
                }
                None => Aggregated::default(),
            })
            .collect()
    }

    /// `ev` judged by each rule in order, its counters looked up.
    pub(super) fn judge_call(&mut self, rules: &RuleSet, ev: &CallEvent) -> Arc<[Aggregated]> {
        (0..rules.rules.len())
            .map(|i| match counter_of(rules, i, ev) {
                Some(id) => {
                    let at = self.place_of(&id, id.expires_at(ttl_of(rules, i)));
                    self.judge(rules, i, &id, at, ev.ts_ms)
                }
                None => Aggregated::default(),
            })
            .collect()
    }

    /// Rule `i`'s result for a call at `t` counted in `id`, held at `at`.
    fn judge(
        &mut self,
        rules: &RuleSet,
        i: usize,
        id: &CounterId,
        at: usize,
        t: i64,
    ) -> Aggregated {
        let rule = &rules.rules[i];
        let (w, n, b) = (rule.window_ms, rule.limit, id.bucket);
        let r = t - b.saturating_mul(w);
        let approx = rule.kind == WindowKind::SlidingApprox;
        let prev = if approx { self.prev_view(id) } else { 0 };
        let weighted = approx_estimate(prev, 0, w, r) - 1;
        let h = self.held.get_mut(at);
        let used = h.total - h.held;
        let mut count = weighted + used + 1;
        let admitted = h.held > 0 && count <= n;
        if admitted {
            h.held -= 1;
            h.reserve_left = h.reserve_left.saturating_sub(1);
            h.mine += 1;
        } else {
            // No credit in hand: over the limit as this instance sees it.
            count = count.max(n + 1);
        }
        let after = used + u64::from(admitted);
        let bucket_last = b.saturating_add(1).saturating_mul(w).saturating_sub(1);
        let until = if approx {
            approx_rejects_until(b, after, prev, w, n, i64::MAX).or((!admitted).then_some(t))
        } else {
            (!admitted || after >= n).then_some(bucket_last)
        };
        // It rejects only the calls its time profile lets it see.
        let until = until.and_then(|u| rule.filter.last_seen_within(t, u));
        Aggregated { count, until }
    }

    /// The previous bucket's count as this instance sees it: the calls
    /// counted there as of its own last lease of it, or the ledger's count
    /// when it leased this bucket (less what it still holds there), the
    /// larger. With one instance, exactly the calls counted there.
    fn prev_view(&self, id: &CounterId) -> u64 {
        let snapshot = self.held_of(id).map_or(0, |h| h.prev);
        match self.held_of(&id.prev()) {
            Some(p) => (p.total - p.held).max(snapshot.saturating_sub(p.held)),
            // (The ledger's count has no reserve in it.)
            None => {
                let spent = self.spent.get(&id.prev());
                snapshot + spent.map_or(0, |s| s.reserve - s.left)
            }
        }
    }
}
