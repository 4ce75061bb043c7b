//! Rate-limit headers on a check's answer, for clients and proxies that
//! read them: the rule nearest its limit, as `X-RateLimit-Limit`,
//! `X-RateLimit-Remaining` and `X-RateLimit-Reset`, and as the IETF
//! `RateLimit-Policy` and `RateLimit` fields
//! (draft-ietf-httpapi-ratelimit-headers: `"<rule>";q=<limit>;w=<window
//! s>` and `"<rule>";r=<remaining>;t=<reset s>`).
//!
//! They are read from the call's record, so a retransmission gets the same
//! headers as the first answer. `Reset` is the Retry-After on a reject by
//! a rule; on an allow, the rule's window in seconds: by then its count
//! has surely dropped (it may drop sooner; a token bucket's window is the
//! time its burst takes to drain). Calls on the allow- or denylist carry
//! none: no rule limits them; nor do shadow rules, or rules that do not
//! see the call (their count is empty).

use axum::http::{HeaderMap, HeaderName, HeaderValue};

use crate::engine::record::{Decision, Verdict, REASON_OK};
use crate::engine::rules::RuleSet;

/// A rule's name, limit and window, as the headers name them.
#[derive(Debug, Clone)]
pub(super) struct RuleLimit {
    name: String,
    limit: u64,
    window_s: u64,
    shadow: bool,
    /// `RateLimit-Policy`'s value, which depends on the rule alone.
    policy: Option<HeaderValue>,
}

/// The limits of `rules`, in rule order.
pub(super) fn limits(rules: &RuleSet) -> Vec<RuleLimit> {
    rules
        .rules
        .iter()
        .map(|r| {
            let window_s = (r.window_ms.max(0) as u64).div_ceil(1000);
            let policy = format!("\"{}\";q={};w={window_s}", r.name, r.limit);
            RuleLimit {
                name: r.name.clone(),
                limit: r.limit,
                window_s,
                shadow: r.shadow,
                policy: HeaderValue::from_str(&policy).ok(),
            }
        })
        .collect()
}

/// The rule nearest its limit for this record: the one that rejected it,
/// or the fewest calls left (the first on a tie); with its remaining
/// calls. `None` for a listed caller.
fn nearest<'a>(limits: &'a [RuleLimit], v: &Verdict) -> Option<(&'a RuleLimit, u64)> {
    let r = &v.record;
    if r.decision == Decision::Reject {
        let i = limits.iter().position(|l| l.name == r.reason.as_str())?;
        let left = limits[i]
            .limit
            .saturating_sub(r.counts.get(i).copied().unwrap_or(0));
        return Some((&limits[i], left));
    }
    // Allowed: by no list, maybe over a shadow rule's limit.
    let listed = r.reason != REASON_OK && !limits.iter().any(|l| l.name == r.reason.as_str());
    if listed {
        return None;
    }
    limits
        .iter()
        .zip(&r.counts)
        .filter(|(l, &c)| !l.shadow && c > 0)
        .map(|(l, &c)| (l, l.limit.saturating_sub(c)))
        .min_by_key(|(_, left)| *left)
}

/// The nearest rule, the calls left under it and the reset (s).
fn nearest_with_reset<'a>(
    limits: &'a [RuleLimit],
    v: &Verdict,
) -> Option<(&'a RuleLimit, u64, u64)> {
    let (rule, left) = nearest(limits, v)?;
    let reset = match (v.record.decision, v.record.retry_after_ms) {
        (Decision::Reject, Some(ms)) => (ms.max(0) as u64).div_ceil(1000),
        _ => rule.window_s,
    };
    Some((rule, left, reset))
}

/// The same as a JSON object for the answer's body (`ratelimit`: `rule`,
/// `limit`, `remaining`, `reset`), for a client that reads only bodies (a
/// Kamailio `http_client` query, which passes them on in its SIP reply).
/// Written as JSON text, keys in order (as a `serde_json` map writes them).
pub(super) fn body(limits: &[RuleLimit], v: &Verdict) -> Option<Vec<u8>> {
    let (rule, left, reset) = nearest_with_reset(limits, v)?;
    let mut digits = itoa::Buffer::new();
    let mut out = Vec::with_capacity(64 + rule.name.len());
    out.extend_from_slice(b"{\"limit\":");
    out.extend_from_slice(digits.format(rule.limit).as_bytes());
    out.extend_from_slice(b",\"remaining\":");
    out.extend_from_slice(digits.format(left).as_bytes());
    out.extend_from_slice(b",\"reset\":");
    out.extend_from_slice(digits.format(reset).as_bytes());
    out.extend_from_slice(b",\"rule\":");
    // Writing a str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut out, &rule.name);
    out.push(b'}');
    Some(out)
}

/// Adds the rate-limit headers of `v` to `headers`.
pub(super) fn add_headers(headers: &mut HeaderMap, limits: &[RuleLimit], v: &Verdict) {
    let Some((rule, left, reset)) = nearest_with_reset(limits, v) else {
        return;
    };
    // Numbers straight into header values, the policy made once per rule:
    // this runs for every check.
    let numbers = [
        ("x-ratelimit-limit", rule.limit),
        ("x-ratelimit-remaining", left),
        ("x-ratelimit-reset", reset),
    ];
    for (name, value) in numbers {
        headers.insert(HeaderName::from_static(name), HeaderValue::from(value));
    }
    if let Some(policy) = &rule.policy {
        headers.insert(HeaderName::from_static("ratelimit-policy"), policy.clone());
    }
    let now = format!("\"{}\";r={left};t={reset}", rule.name);
    if let Ok(value) = HeaderValue::from_str(&now) {
        headers.insert(HeaderName::from_static("ratelimit"), value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::record::DecisionRecord;

    fn verdict(decision: Decision, reason: &str, counts: &[u64], retry: Option<i64>) -> Verdict {
        Verdict {
            record: DecisionRecord {
                call_id: "c".into(),
                caller: "+34911000001".into(),
                ts_ms: 0,
                decision,
                reason: reason.into(),
                counts: counts.iter().copied().collect(),
                shadow: false,
                late: false,
                degraded: false,
                rules_version: "v".into(),
                retry_after_ms: retry,
                warn: None,
            },
            prev_ts_ms: None,
            distinct_callees: None,
            duplicate: false,
            end: false,
            score: None,
        }
    }

    fn header(h: &HeaderMap, name: &str) -> String {
        h.get(name).unwrap().to_str().unwrap().to_string()
    }

    /// The body's object is the text `serde_json` writes for the same map.
    #[test]
    fn the_body_is_serde_s_text() {
        let rules = RuleSet::from_args(None, &["minute_2:sliding:60s:10".into()]).unwrap();
        let limits = limits(&rules);
        let v = verdict(Decision::Reject, "minute_2", &[12], Some(4_001));
        let body = String::from_utf8(body(&limits, &v).unwrap()).unwrap();
        let expected = serde_json::json!({
            "rule": "minute_2",
            "limit": 10,
            "remaining": 0,
            "reset": 5,
        });
        assert_eq!(body, expected.to_string());
    }

    #[test]
    fn the_rule_nearest_its_limit_is_named() {
        let rules = RuleSet::from_args(
            None,
            &["burst:fixed:1s:2".into(), "minute:sliding:60s:10".into()],
        )
        .unwrap();
        let limits = limits(&rules);
        // 1 of 2 left in the burst, 2 of 10 in the minute: the burst.
        let mut h = HeaderMap::new();
        add_headers(
            &mut h,
            &limits,
            &verdict(Decision::Allow, "ok", &[1, 8], None),
        );
        assert_eq!(header(&h, "x-ratelimit-limit"), "2");
        assert_eq!(header(&h, "x-ratelimit-remaining"), "1");
        assert_eq!(header(&h, "x-ratelimit-reset"), "1");
        assert_eq!(header(&h, "ratelimit-policy"), "\"burst\";q=2;w=1");
        assert_eq!(header(&h, "ratelimit"), "\"burst\";r=1;t=1");
        // Rejected by the minute rule: it, with the Retry-After, rounded up.
        let mut h = HeaderMap::new();
        add_headers(
            &mut h,
            &limits,
            &verdict(Decision::Reject, "minute", &[1, 11], Some(12_300)),
        );
        assert_eq!(header(&h, "ratelimit"), "\"minute\";r=0;t=13");
        assert_eq!(header(&h, "x-ratelimit-limit"), "10");
        // Listed callers: none.
        let mut h = HeaderMap::new();
        add_headers(
            &mut h,
            &limits,
            &verdict(Decision::Reject, "denylist", &[1, 1], None),
        );
        assert!(h.is_empty());
    }
}
