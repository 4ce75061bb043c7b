//! Building a rule set from its spec: every check a rule, a list and the
//! set's options must pass, and the prefix lists in their one spelling.

use super::{CountPolicy, RuleKey, RuleSet, RuleSpec, WindowKind, MAX_RULES, RESERVED_NAMES};
use crate::engine::model::Model;
use crate::engine::rule::Rule;
use crate::error::RulesError;

impl RuleSet {
    /// Validates `spec` and computes the set's version.
    pub fn build(spec: RuleSpec) -> Result<Self, RulesError> {
        let RuleSpec {
            rules,
            count,
            grace_ms,
            allow,
            deny,
            shadow,
            bad_caller,
            dedup_ms,
            distinct_callees,
            max_distinct_callees,
            files,
            timezone,
            model,
        } = spec;
        if rules.is_empty() {
            return Err(RulesError::Invalid(
                "a rule set needs at least one rule".into(),
            ));
        }
        for (i, r) in rules.iter().enumerate() {
            let valid_name = !r.name.is_empty()
                && r.name.len() <= 32
                && r.name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
            if !valid_name {
                return Err(RulesError::Invalid(format!(
                    "rule name `{}`: 1 to 32 lowercase letters, digits or _",
                    r.name
                )));
            }
            if RESERVED_NAMES.contains(&r.name.as_str()) {
                return Err(RulesError::Invalid(format!(
                    "rule name `{}` is reserved",
                    r.name
                )));
            }
            if rules[..i].iter().any(|o| o.name == r.name) {
                return Err(RulesError::Invalid(format!(
                    "rule name `{}` is used twice",
                    r.name
                )));
            }
            if r.window_ms < 1 || r.window_ms > 31 * 86_400_000 {
                return Err(RulesError::Invalid(format!(
                    "rule `{}`: window must be 1ms to 31d",
                    r.name
                )));
            }
            if r.limit == 0 {
                return Err(RulesError::Invalid(format!(
                    "rule `{}`, {}: must be at least 1",
                    r.name,
                    if r.rate.is_some() { "burst" } else { "limit" }
                )));
            }
            check_rule(r, max_distinct_callees)?;
        }
        if rules.len() > MAX_RULES {
            return Err(RulesError::Invalid(format!(
                "{} rules: at most {MAX_RULES}",
                rules.len()
            )));
        }
        let rules = rules
            .into_iter()
            .map(|mut r| {
                let callees = std::mem::take(&mut r.filter.callees);
                let mut callees =
                    normalize_prefixes(callees, &format!("rule `{}`, callees", r.name))?;
                callees.sort();
                callees.dedup();
                r.filter.callees = callees;
                Ok(r)
            })
            .collect::<Result<Vec<_>, RulesError>>()?;
        if !(0..=3_600_000).contains(&grace_ms) {
            return Err(RulesError::Invalid("grace must be 0 to 1h".into()));
        }
        if !(1..=100_000).contains(&max_distinct_callees) {
            return Err(RulesError::Invalid(
                "max_distinct_callees must be 1 to 100000".into(),
            ));
        }
        if dedup_ms.is_some_and(|d| !(1..=31 * 86_400_000).contains(&d)) {
            return Err(RulesError::Invalid("dedup must be 1ms to 31d".into()));
        }
        let allow = normalize_prefixes(allow, "allow")?;
        let deny = normalize_prefixes(deny, "deny")?;
        let mut set = RuleSet {
            rules,
            count,
            grace_ms,
            allow,
            deny,
            shadow,
            bad_caller,
            dedup: dedup_ms,
            callees: distinct_callees,
            max_callees: max_distinct_callees,
            timezone,
            filtered: false,
            concurrent: false,
            pools: false,
            sums: false,
            files,
            model: None,
            version: String::new(),
        };
        set.filtered = set.rules.iter().any(|r| !r.filter.is_empty());
        set.concurrent = set
            .rules
            .iter()
            .any(|r| r.kind == WindowKind::Concurrent && !r.is_pooled());
        set.pools = set.rules.iter().any(Rule::is_pooled);
        check_pools(&set)?;
        set.sums = set.rules.iter().any(|r| r.sum.is_some() && !r.is_pooled());
        set.model = model
            .map(|m| check_model(&set, std::sync::Arc::unwrap_or_clone(m)).map(std::sync::Arc::new))
            .transpose()?;
        set.version = set.compute_version();
        Ok(set)
    }
}

/// Resolves a model's inputs against the set (see
/// [`crate::engine::model`]), and checks that an enforcing model's rejects
/// leave no state behind: nothing of the set may depend on the final
/// decision.
fn check_model(set: &RuleSet, mut model: Model) -> Result<Model, RulesError> {
    model
        .resolve(set)
        .map_err(|e| RulesError::Invalid(format!("model: {e}")))?;
    if model.shadow || set.shadow {
        return Ok(model);
    }
    let clash = if set.count == CountPolicy::Admitted {
        Some("count = \"admitted\"".to_string())
    } else if let Some(r) = set.rules.iter().find(|r| r.is_pooled()) {
        Some(format!("the pool `{}`", r.name))
    } else {
        set.rules
            .iter()
            .find(|r| r.kind == WindowKind::Concurrent || r.sum.is_some())
            .map(|r| {
                format!(
                    "the caller's {} rule `{}`",
                    if r.sum.is_some() { "sum" } else { "concurrent" },
                    r.name
                )
            })
    };
    match clash {
        Some(what) => Err(RulesError::Invalid(format!(
            "model: an enforcing model cannot go with {what}: it decides before the model, and would keep a call the model rejects (set `shadow = true` in [model], or leave {what} out)"
        ))),
        None => Ok(model),
    }
}

/// Checks what pools (concurrent and sum rules keyed by account, callee
/// or global) need of the rest of the set: they decide after the caller's
/// rules, only the calls those allow, so nothing of the caller's may
/// depend on the final decision.
fn check_pools(set: &RuleSet) -> Result<(), RulesError> {
    let Some(pool) = set.rules.iter().find(|r| r.is_pooled()) else {
        return Ok(());
    };
    let clash = if set.count == CountPolicy::Admitted {
        Some("`count = \"admitted\"`".to_string())
    } else {
        set.rules
            .iter()
            .find(|r| {
                !r.key.is_aggregate() && (r.kind == WindowKind::Concurrent || r.sum.is_some())
            })
            .map(|r| format!("rule `{}` (a caller's concurrent or sum rule)", r.name))
    };
    match clash {
        None => Ok(()),
        Some(what) => Err(RulesError::Invalid(format!(
            "rule `{}`: a {} rule keyed by {} decides after the caller's rules, so it \
             cannot be combined with {what}, whose state would keep calls it rejects \
             (not built yet: key one of them by caller)",
            pool.name,
            if pool.sum.is_some() {
                "sum"
            } else {
                "concurrent"
            },
            pool.key.as_str()
        ))),
    }
}

/// Checks what a rule's kind, key and levels must agree on.
fn check_rule(r: &Rule, max_callees: u64) -> Result<(), RulesError> {
    let bad = |field: &str, msg: &str| {
        Err(RulesError::Invalid(format!(
            "rule `{}`, {field}: {msg}",
            r.name
        )))
    };
    if r.warn.is_some_and(|w| w >= r.limit) {
        return bad(
            "warn",
            "must be below the limit (a warning comes before a reject)",
        );
    }
    if (r.kind == WindowKind::TokenBucket) != r.rate.is_some() {
        return bad(
            "rate",
            "a token bucket needs one, and only a token bucket has one",
        );
    }
    if r.is_gated() && !matches!(r.kind, WindowKind::Fixed | WindowKind::SlidingApprox) {
        return bad(
            "key",
            "a rule keyed by callee, global or account is `fixed`, `sliding-approx` or \
             `concurrent` (its count is shared between instances)",
        );
    }
    if r.sum.is_some() {
        if !matches!(
            r.kind,
            WindowKind::Fixed | WindowKind::Sliding | WindowKind::SlidingApprox
        ) {
            return bad(
                "sum",
                "a sum rule is `fixed`, `sliding` or `sliding-approx` (it adds up what ended calls add in its window)",
            );
        }
        if r.key == RuleKey::CallerCallee {
            return bad(
                "key",
                "a sum rule adds up the calls of a caller, an account, a callee or everyone: \
                 keyed by caller+callee is not built",
            );
        }
    }
    if r.kind == WindowKind::DistinctCallees {
        if r.key != RuleKey::Caller {
            return bad(
                "key",
                "a distinct-callees rule counts a caller's callees: key must be `caller`",
            );
        }
        if r.limit >= max_callees {
            return bad(
                "limit",
                "must be below max_distinct_callees (the count saturates there)",
            );
        }
    }
    Ok(())
}

/// One number prefix in the rules' spelling (`+` and 1 to 15 digits;
/// `00` read as `+`, spaces, dashes, dots and brackets dropped).
pub(crate) fn normalize_prefix(raw: &str) -> Result<String, String> {
    normalize_prefixes(vec![raw.to_string()], "prefix")
        .map_err(|e| e.to_string())?
        .pop()
        .ok_or_else(|| format!("`{raw}`: no prefix"))
}

fn normalize_prefixes(list: Vec<String>, which: &str) -> Result<Vec<String>, RulesError> {
    list.into_iter()
        .map(|raw| {
            let s: String = raw
                .chars()
                .filter(|c| !matches!(c, ' ' | '-' | '.' | '(' | ')'))
                .collect();
            let s = match s.strip_prefix("00") {
                Some(rest) => format!("+{rest}"),
                None => s,
            };
            let digits = s.strip_prefix('+').unwrap_or("");
            if raw.trim().is_empty() {
                return Err(RulesError::Invalid(format!(
                    "{which}: an empty prefix (it would match every number)"
                )));
            }
            if digits.is_empty() || digits.len() > 15 || !digits.bytes().all(|b| b.is_ascii_digit())
            {
                return Err(RulesError::Invalid(format!(
                    "{which}: entry `{raw}`: expected + followed by 1 to 15 digits"
                )));
            }
            Ok(s)
        })
        .collect()
}
