use super::*;
use crate::engine::window::CallerState;

const T0: i64 = 1_764_547_200_000;
const S: i64 = 1_000;

fn rules(extra: &str) -> RuleSet {
    RuleSet::from_toml(&format!(
        "[[rule]]\nname = \"minute\"\nkind = \"sliding\"\nwindow = \"1m\"\nlimit = 3\n\
         [[rule]]\nname = \"channels\"\nkind = \"concurrent\"\nkey = \"account\"\n\
         limit = 2\nmax_duration = \"1h\"\n{extra}"
    ))
    .expect("rules")
}

fn call(id: &str, caller: &str, account: &str, ts_ms: i64) -> CallEvent {
    CallEvent {
        call_id: id.into(),
        caller: caller.into(),
        ts_ms,
        account: Some(account.into()),
        ..Default::default()
    }
}

fn end_of(c: &CallEvent, ts_ms: i64) -> CallEvent {
    CallEvent {
        kind: EventKind::End,
        ts_ms,
        ..c.clone()
    }
}

/// The caller's rules in process, then the pools: what every store does.
#[derive(Default)]
struct Both {
    callers: HashMap<String, CallerState>,
    pools: Pools,
}

impl Both {
    fn apply(&mut self, rules: &RuleSet, ev: &CallEvent) -> Verdict {
        let state = self.callers.entry(ev.caller.to_string()).or_default();
        let mut v = state.apply(rules, ev);
        self.pools.apply_one(rules, ev, &mut v);
        v
    }
}

fn brief(v: &Verdict) -> (Decision, &str, u64, Option<i64>) {
    let r = &v.record;
    (r.decision, r.reason.as_str(), r.counts[1], r.retry_after_ms)
}

#[test]
fn an_account_s_calls_from_many_numbers_share_its_channels() {
    let rules = rules("");
    let mut b = Both::default();
    let a = call("a", "+34911000001", "trunk-1", T0);
    let c = call("b", "+34911000002", "trunk-1", T0 + S);
    assert_eq!(
        brief(&b.apply(&rules, &a)),
        (Decision::Allow, "ok", 1, None)
    );
    assert_eq!(
        brief(&b.apply(&rules, &c)),
        (Decision::Allow, "ok", 2, None)
    );
    // Two open: the third number's call is over, until the first closes
    // (its max_duration, an hour after it started).
    let third = b.apply(&rules, &call("c", "+34911000003", "trunk-1", T0 + 2 * S));
    assert_eq!(
        brief(&third),
        (Decision::Reject, "channels", 3, Some(3_600_000 - 2 * S))
    );
    // Another account is apart.
    let other = b.apply(&rules, &call("d", "+34911000003", "trunk-2", T0 + 2 * S));
    assert_eq!(brief(&other), (Decision::Allow, "ok", 1, None));
    // The first ends: a slot is free from its end on (an end at t closes
    // before a call at t counts).
    assert!(b.apply(&rules, &end_of(&a, T0 + 10 * S)).end);
    let after = b.apply(&rules, &call("e", "+34911000004", "trunk-1", T0 + 10 * S));
    assert_eq!(brief(&after), (Decision::Allow, "ok", 2, None));
    // (a is closed, kept until its trunk's own L' - grace passes its end:
    // another trunk's calls do not move it.)
    assert_eq!(b.pools.held(), 4);
    b.apply(&rules, &call("f", "+34911000005", "trunk-3", T0 + 20 * S));
    assert_eq!(b.pools.held(), 5, "a, b, d, e and f");
    let g = b.apply(&rules, &call("g", "+34911000006", "trunk-1", T0 + 20 * S));
    assert_eq!(
        brief(&g),
        (
            Decision::Reject,
            "channels",
            3,
            Some(3_600_000 - 20 * S + S)
        )
    );
    assert_eq!(
        b.pools.held(),
        4,
        "b, d, e and f: a dropped by its trunk's call"
    );
}

#[test]
fn a_call_the_caller_s_rules_reject_keeps_its_reason_and_opens_nowhere() {
    let rules = rules("");
    let mut b = Both::default();
    for i in 0..3 {
        let v = b.apply(&rules, &call(&format!("c{i}"), "+34911000001", "", T0 + i));
        assert_eq!(v.record.counts[1], 0, "no account: no pool sees it");
    }
    let v = b.apply(&rules, &call("c3", "+34911000001", "trunk-1", T0 + 3));
    assert_eq!(brief(&v), (Decision::Reject, "minute", 1, Some(60_001 - 3)));
    assert_eq!(b.pools.held(), 0);
    // Its end changes nothing.
    b.apply(
        &rules,
        &end_of(&call("c3", "+34911000001", "trunk-1", 0), T0 + 4),
    );
    assert_eq!(b.pools.held(), 0);
    let v = b.apply(&rules, &call("x", "+34911000002", "trunk-1", T0 + 5));
    assert_eq!(brief(&v), (Decision::Allow, "ok", 1, None));
}

#[test]
fn an_end_that_comes_first_closes_the_call_when_it_comes() {
    let rules = rules("");
    let mut b = Both::default();
    let a = call("a", "+34911000001", "trunk-1", T0);
    b.apply(&rules, &end_of(&a, T0 + 5 * S));
    b.apply(&rules, &a);
    b.apply(&rules, &call("b", "+34911000002", "trunk-1", T0 + S));
    let v = b.apply(&rules, &call("c", "+34911000003", "trunk-1", T0 + 2 * S));
    assert_eq!(brief(&v), (Decision::Reject, "channels", 3, Some(3 * S)));
    let v = b.apply(&rules, &call("d", "+34911000003", "trunk-1", T0 + 5 * S));
    assert_eq!(brief(&v), (Decision::Allow, "ok", 2, None));
}

#[test]
fn a_shadow_pool_flags_and_opens() {
    let rules = RuleSet::from_toml(
        "[[rule]]\nname = \"channels\"\nkind = \"concurrent\"\nkey = \"account\"\n\
         limit = 1\nmax_duration = \"1h\"\nshadow = true\n",
    )
    .expect("rules");
    let mut b = Both::default();
    b.apply(&rules, &call("a", "+34911000001", "t", T0));
    let v = b.apply(&rules, &call("b", "+34911000002", "t", T0 + 1));
    let r = &v.record;
    assert_eq!(
        (r.decision, r.shadow, r.reason.as_str(), r.counts[0]),
        (Decision::Allow, true, "channels", 2)
    );
    let v = b.apply(&rules, &call("c", "+34911000003", "t", T0 + 2));
    assert_eq!(v.record.counts[0], 3, "the shadowed call holds a slot");
}

#[test]
fn a_call_seen_again_gets_the_same_and_changes_nothing() {
    let rules = rules("");
    let mut b = Both::default();
    b.apply(&rules, &call("a", "+34911000001", "t", T0));
    b.apply(&rules, &call("b", "+34911000002", "t", T0 + 1));
    let first = b.apply(&rules, &call("c", "+34911000003", "t", T0 + 2));
    let again = b.apply(&rules, &call("c", "+34911000003", "t", T0 + 2));
    assert!(again.duplicate);
    assert_eq!(brief(&first), brief(&again));
    // Even from a store that forgot it (a fresh caller state).
    let mut v = CallerState::default().apply(&rules, &call("c", "+34911000003", "t", T0 + 2));
    b.pools
        .apply_one(&rules, &call("c", "+34911000003", "t", T0 + 2), &mut v);
    assert_eq!(brief(&first), brief(&v));
    assert_eq!(b.pools.held(), 2);
}

#[test]
fn warnings_and_rule_order_hold_with_pools() {
    let rules = rules("warn = 1\n");
    let mut b = Both::default();
    let v = b.apply(&rules, &call("a", "+34911000001", "t", T0));
    assert_eq!(v.record.warn, None);
    let v = b.apply(&rules, &call("b", "+34911000002", "t", T0 + 1));
    assert_eq!(v.record.warn.as_deref(), Some("channels"));
    let v = b.apply(&rules, &call("c", "+34911000002", "t", T0 + 2));
    assert_eq!(
        (v.record.decision, v.record.warn.as_deref()),
        (Decision::Reject, None)
    );
}

#[test]
fn rejects_until_counts_calls_that_start_later() {
    // Held: [0, 100) and [50, 200): at t = 10 with limit 1 the count is
    // over until 199 (from 50 on, the second call is open).
    assert_eq!(rejects_until(&[(0, 100), (50, 200)], 10, 1), Some(199));
    // Limit 2: over only while both are open, 50..=99.
    assert_eq!(rejects_until(&[(0, 100), (50, 200)], 10, 2), Some(99));
    assert_eq!(rejects_until(&[(0, 100), (50, 200)], 10, 3), None);
    assert_eq!(rejects_until(&[], 10, 1), None);
}

#[test]
fn sets_a_pool_cannot_be_part_of_are_refused() {
    for extra in [
        "count = \"admitted\"\n",
        "[[rule]]\nname = \"own\"\nkind = \"concurrent\"\nlimit = 2\nmax_duration = \"1h\"\n",
        "[[rule]]\nname = \"talk\"\nkind = \"fixed\"\nwindow = \"1h\"\nsum = \"talk\"\nlimit = \"1h\"\n",
    ] {
        let text = format!(
            "{extra}[[rule]]\nname = \"channels\"\nkind = \"concurrent\"\nkey = \"account\"\n\
             limit = 2\nmax_duration = \"1h\"\n"
        );
        let text = if extra.starts_with("count") {
            text
        } else {
            // (A table after the pool's: keep the top-level keys first.)
            format!(
                "[[rule]]\nname = \"channels\"\nkind = \"concurrent\"\nkey = \"account\"\n\
                 limit = 2\nmax_duration = \"1h\"\n{extra}"
            )
        };
        let err = RuleSet::from_toml(&text).expect_err(extra).to_string();
        assert!(err.contains("decides after the caller's rules"), "{err}");
    }
    for key in ["callee", "global"] {
        let set = RuleSet::from_toml(&format!(
            "[[rule]]\nname = \"c\"\nkind = \"concurrent\"\nkey = \"{key}\"\nlimit = 2\nmax_duration = \"1h\"\n"
        ))
        .expect(key);
        assert!(set.has_pools() && !set.has_aggregates() && !set.has_concurrent());
    }
}
