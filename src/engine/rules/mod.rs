//! Rule sets: which windows to count and when to reject.
//!
//! A rule set comes from a TOML file or from `--rule NAME:KIND:WINDOW:LIMIT`
//! shorthands. Its version is a hash of its canonical form and is carried on
//! every decision, so a record always says which rules produced it.
//!
//! ```toml
//! count = "attempts"   # or "admitted"
//! grace = "5s"         # allowed lateness
//! shadow = false       # true: decide, report, but always allow
//! distinct_callees = true  # false: skip the distinct-callees feature
//! max_distinct_callees = 1000  # callees kept per caller; the feature saturates there
//! allow = ["+34910000000"]   # numbers or number prefixes
//! deny  = ["+882"]
//!
//! [[rule]]
//! name = "minute"
//! kind = "sliding"     # fixed | sliding | sliding-approx
//! window = "60s"
//! limit = 10
//! ```

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

pub use crate::engine::duration::{format_duration, parse_duration_ms};
use crate::engine::event::{CallEvent, BAD_CALLER};
pub use crate::engine::filter::Filter;
use crate::engine::model::Model;
pub use crate::engine::rule::{
    BadCallerPolicy, CountPolicy, Rate, Rule, RuleKey, Sum, SumOf, WindowKind,
};
use crate::error::RulesError;

/// Reason when the caller is on the allowlist.
pub const REASON_ALLOWLIST: &str = "allowlist";
/// Reason of a call whose caller is unusable, rejected or allowed as the
/// rule set's `bad_caller` policy says.
pub const REASON_BAD_CALLER: &str = "bad_caller";
/// Reason when the caller is on the denylist.
pub const REASON_DENYLIST: &str = "denylist";

mod build;
pub(crate) use build::normalize_prefix;

/// Names a rule may not take: they are decision reasons of their own.
pub const RESERVED_NAMES: [&str; 5] = ["ok", "allowlist", "denylist", "bad_caller", "model"];

/// Default allowed lateness.
pub const DEFAULT_GRACE_MS: i64 = 5_000;

/// Default cap on the distinct callees kept per caller: the feature
/// saturates there (a wangiri burst to thousands of numbers reads 1000).
pub const DEFAULT_MAX_DISTINCT_CALLEES: u64 = 1_000;

/// Default idempotency horizon (at least the retention is always kept).
pub const DEFAULT_DEDUP_MS: i64 = 3_600_000;

/// A complete, validated rule set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSet {
    /// The rules, in evaluation order (the first exceeded rule is the reason).
    pub rules: Vec<Rule>,
    /// Which calls are recorded.
    pub count: CountPolicy,
    /// Allowed lateness in milliseconds.
    pub grace_ms: i64,
    /// Numbers or prefixes that are always allowed.
    pub allow: Vec<String>,
    /// Numbers or prefixes that are always rejected (checked before `allow`).
    pub deny: Vec<String>,
    /// Decide and report, but always emit `allow`.
    pub shadow: bool,
    /// What to do with calls whose caller is unusable.
    pub bad_caller: BadCallerPolicy,
    /// Idempotency horizon as set (`dedup`); see [`RuleSet::dedup_ms`].
    dedup: Option<i64>,
    /// Whether the distinct-callees feature is kept (`distinct_callees`).
    callees: bool,
    /// Most distinct callees kept per caller (`max_distinct_callees`).
    max_callees: u64,
    /// Whether any rule sees only some calls.
    filtered: bool,
    /// Whether any rule keyed by caller is concurrent (asked per call:
    /// kept, not derived).
    concurrent: bool,
    /// Whether any rule is a pool ([`Rule::is_pooled`]; kept, not derived).
    pools: bool,
    /// Whether any rule adds up ended calls (`sum`; kept, not derived).
    sums: bool,
    /// The set's time zone (`timezone`): its rules' default, and the zone
    /// of the `local_hour` and `local_weekday` features (UTC without one).
    pub timezone: Option<chrono_tz::Tz>,
    /// Files the set was read from besides the rules file (`callees_file`s,
    /// the model).
    files: Vec<PathBuf>,
    /// The model that scores every attempt after the rules (`[model]`;
    /// shared: a rule set is cloned per batch in places).
    model: Option<std::sync::Arc<Model>>,
    version: String,
}

/// Everything a rule set is made of, before validation: build one with
/// [`RuleSet::build`], or take an existing set's with [`RuleSet::spec`],
/// change a field and build again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSpec {
    /// The rules, in evaluation order.
    pub rules: Vec<Rule>,
    /// Which calls are recorded.
    pub count: CountPolicy,
    /// Allowed lateness in milliseconds.
    pub grace_ms: i64,
    /// Numbers or prefixes always allowed.
    pub allow: Vec<String>,
    /// Numbers or prefixes always rejected.
    pub deny: Vec<String>,
    /// Decide and report, but always emit `allow`.
    pub shadow: bool,
    /// What to do with calls whose caller is unusable.
    pub bad_caller: BadCallerPolicy,
    /// The idempotency horizon (`dedup`), if set.
    pub dedup_ms: Option<i64>,
    /// Keep the distinct-callees feature.
    pub distinct_callees: bool,
    /// Most distinct callees kept per caller.
    pub max_distinct_callees: u64,
    /// Files the rules were read from besides the rules file (`callees_file`s).
    pub files: Vec<PathBuf>,
    /// The set's time zone (`timezone`), if set.
    pub timezone: Option<chrono_tz::Tz>,
    /// The model scoring every attempt after the rules (`[model]`), if any.
    pub model: Option<std::sync::Arc<Model>>,
}

impl RuleSpec {
    /// The defaults around `rules`: count attempts, 5 s grace, no lists,
    /// enforcing, the default horizon, distinct callees kept up to 1,000.
    pub fn new(rules: Vec<Rule>) -> Self {
        RuleSpec {
            rules,
            count: CountPolicy::Attempts,
            grace_ms: DEFAULT_GRACE_MS,
            allow: Vec::new(),
            deny: Vec::new(),
            shadow: false,
            bad_caller: BadCallerPolicy::Shared,
            dedup_ms: None,
            distinct_callees: true,
            max_distinct_callees: DEFAULT_MAX_DISTINCT_CALLEES,
            files: Vec::new(),
            timezone: None,
            model: None,
        }
    }
}

/// Which list, if any, a caller is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listed {
    /// On neither list.
    No,
    /// On the allowlist.
    Allow,
    /// On the denylist.
    Deny,
    /// An unusable caller the rule set rejects ([`BadCallerPolicy::Reject`]).
    BadCallerReject,
    /// An unusable caller the rule set allows ([`BadCallerPolicy::Allow`]).
    BadCallerAllow,
}

/// What a rule set says of a call, given its window counts: the decision
/// order of the window contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judgement {
    /// The caller is on the denylist (checked first), or unusable and
    /// rejected: the reason (`denylist`, `bad_caller`).
    Denylisted(&'static str),
    /// The caller is on the allowlist, or unusable and allowed: the
    /// reason (`allowlist`, `bad_caller`).
    Allowlisted(&'static str),
    /// Rule `i` is the first enforcing rule whose count exceeds its limit.
    Exceeded(usize),
    /// Rule `i` is the first rule whose count exceeds its limit, and a
    /// shadow rule (no enforcing rule's count exceeds its limit): reported,
    /// not rejected.
    ShadowExceeded(usize),
    /// No list and no rule singles the call out.
    Within,
}

impl RuleSet {
    /// Builds and validates a rule set of `rules` with these set-wide
    /// options and the defaults of [`RuleSpec::new`] for the others.
    pub fn new(
        rules: Vec<Rule>,
        count: CountPolicy,
        grace_ms: i64,
        allow: Vec<String>,
        deny: Vec<String>,
        shadow: bool,
    ) -> Result<Self, RulesError> {
        RuleSet::build(RuleSpec {
            count,
            grace_ms,
            allow,
            deny,
            shadow,
            ..RuleSpec::new(rules)
        })
    }

    /// What this set is made of (to build a changed copy).
    pub fn spec(&self) -> RuleSpec {
        RuleSpec {
            rules: self.rules.clone(),
            count: self.count,
            grace_ms: self.grace_ms,
            allow: self.allow.clone(),
            deny: self.deny.clone(),
            shadow: self.shadow,
            bad_caller: self.bad_caller,
            dedup_ms: self.dedup,
            distinct_callees: self.callees,
            max_distinct_callees: self.max_callees,
            files: self.files.clone(),
            timezone: self.timezone,
            model: self.model.clone(),
        }
    }

    /// A copy that keeps (or skips) the distinct-callees feature.
    pub fn with_distinct_callees(&self, on: bool) -> Self {
        let mut set = self.clone();
        set.callees = on;
        set.version = set.compute_version();
        set
    }

    /// A copy that keeps at most `cap` distinct callees per caller.
    pub fn with_max_distinct_callees(&self, cap: u64) -> Result<Self, RulesError> {
        RuleSet::build(RuleSpec {
            max_distinct_callees: cap,
            ..self.spec()
        })
    }

    /// Most distinct callees kept per caller: a new callee beyond it is not
    /// kept, so the feature saturates at this value.
    pub fn max_distinct_callees(&self) -> u64 {
        self.max_callees
    }

    /// Whether the distinct-callees feature is kept: each caller's callees
    /// over the longest window (one sorted set per caller in Redis).
    pub fn tracks_callees(&self) -> bool {
        self.callees
    }

    /// A copy with another idempotency horizon.
    pub fn with_dedup(&self, dedup_ms: i64) -> Result<Self, RulesError> {
        RuleSet::build(RuleSpec {
            dedup_ms: Some(dedup_ms),
            ..self.spec()
        })
    }

    /// How far (event time) behind a caller's latest call a decided call id is
    /// still recognised as a redelivery: the `dedup` setting (default 1h), but
    /// never less than the retention.
    pub fn dedup_ms(&self) -> i64 {
        self.dedup
            .unwrap_or(DEFAULT_DEDUP_MS)
            .max(self.retention_ms())
    }

    /// Builds the rule set from CLI arguments: a file, shorthands, or both (shorthands are appended).
    pub fn from_args(file: Option<&Path>, shorthands: &[String]) -> Result<Self, RulesError> {
        let extra = shorthands
            .iter()
            .map(|s| Rule::parse_shorthand(s))
            .collect::<Result<Vec<_>, _>>()?;
        match file {
            Some(path) => {
                let base = Self::from_file(path)?;
                if extra.is_empty() {
                    return Ok(base);
                }
                let mut spec = base.spec();
                spec.rules.extend(extra);
                RuleSet::build(spec)
            }
            None if extra.is_empty() => Err(RulesError::Invalid(
                "no rules: pass --rules FILE or --rule NAME:KIND:WINDOW:LIMIT".into(),
            )),
            None => RuleSet::build(RuleSpec::new(extra)),
        }
    }

    /// A copy with other set-wide options (used by `tune` and the CLI overrides).
    pub fn with_options(
        &self,
        count: CountPolicy,
        grace_ms: i64,
        shadow: bool,
    ) -> Result<Self, RulesError> {
        RuleSet::build(RuleSpec {
            count,
            grace_ms,
            shadow,
            ..self.spec()
        })
    }

    /// A copy with another policy for unusable callers.
    pub fn with_bad_caller(&self, bad_caller: BadCallerPolicy) -> Result<Self, RulesError> {
        RuleSet::build(RuleSpec {
            bad_caller,
            ..self.spec()
        })
    }

    /// A copy where rule `index` has another limit (a token bucket's
    /// burst, and with it its span; used by `tune`).
    pub fn with_limit(&self, index: usize, limit: u64) -> Result<Self, RulesError> {
        let mut spec = self.spec();
        let rule = spec
            .rules
            .get_mut(index)
            .ok_or_else(|| RulesError::Invalid(format!("no rule number {index}")))?;
        rule.limit = limit;
        if let Some(rate) = rule.rate {
            rule.window_ms = rate.span_ms(limit);
        }
        RuleSet::build(spec)
    }

    /// A copy without warning levels (they never decide a call).
    pub fn without_warnings(&self) -> Result<Self, RulesError> {
        let mut spec = self.spec();
        spec.rules.iter_mut().for_each(|r| r.warn = None);
        RuleSet::build(spec)
    }

    /// The version: the first 12 hex digits of the SHA-256 of the canonical form.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The longest window of any rule kept per caller, in milliseconds
    /// (rules keyed by callee or global keep no caller state).
    pub fn max_window_ms(&self) -> i64 {
        self.rules
            .iter()
            .filter(|r| !r.key.is_aggregate())
            .map(|r| r.window_ms)
            .max()
            .unwrap_or(0)
    }

    /// Whether any rule is counted through the gate's credits (keyed by
    /// callee, global or account, not concurrent: decided through
    /// [`crate::engine::aggregate::Gate`] before the caller's state).
    pub fn has_aggregates(&self) -> bool {
        self.rules.iter().any(Rule::is_gated)
    }

    /// Whether any rule is a pool: concurrent, keyed by account, callee or
    /// global (decided after the caller's rules, [`crate::engine::pool`]).
    pub fn has_pools(&self) -> bool {
        self.pools
    }

    /// The model scoring every attempt after the rules, if the set has one
    /// ([`crate::engine::model`]).
    pub fn model(&self) -> Option<&Model> {
        self.model.as_deref()
    }

    /// Whether verdicts are settled after the caller's store: by pools, or
    /// by a model.
    pub fn has_after_pass(&self) -> bool {
        self.pools || self.model.is_some()
    }

    /// How long state must be kept after a caller's latest call: longest window + grace.
    pub fn retention_ms(&self) -> i64 {
        self.max_window_ms() + self.grace_ms
    }

    /// Whether any rule keyed by caller counts calls open
    /// ([`WindowKind::Concurrent`]): its ends change the caller's state.
    pub fn has_concurrent(&self) -> bool {
        self.concurrent
    }

    /// Whether any rule keyed by caller adds up what ended calls add
    /// (`sum`): then call ends change the caller's state too.
    pub fn has_sums(&self) -> bool {
        self.sums
    }

    /// Whether call ends change anything: a concurrent or a sum rule (of
    /// the caller's, or a pool).
    pub fn uses_ends(&self) -> bool {
        self.concurrent || self.sums || self.pools
    }

    /// Whether call ends change a caller's state: a concurrent or sum rule
    /// keyed by caller (a pool's ends are the pool's).
    pub fn caller_uses_ends(&self) -> bool {
        self.concurrent || self.sums
    }

    /// The longest any caller's sum rule's call waits for its end (0: no
    /// such rule).
    pub fn max_sum_wait_ms(&self) -> i64 {
        self.rules
            .iter()
            .filter(|r| !r.is_pooled())
            .filter_map(|r| r.sum.as_ref())
            .map(|s| s.max_duration_ms)
            .max()
            .unwrap_or(0)
    }

    /// How long after its latest write a caller's state may still matter
    /// to its sum rules: a waiting call's `max_duration`, an ended call's
    /// two windows (a sliding-approx count weighs the bucket before), plus
    /// the grace (0 without sum rules). A store whose keys expire keeps
    /// them at least this long.
    pub fn sums_span_ms(&self) -> i64 {
        self.rules
            .iter()
            .filter(|r| !r.is_pooled())
            .filter_map(|r| {
                let sum = r.sum.as_ref()?;
                Some(sum.max_duration_ms.max(r.window_ms.saturating_mul(2)))
            })
            .max()
            .map_or(0, |span| span.saturating_add(self.grace_ms))
    }

    /// Whether any rule counts on the caller's shared sliding log (a
    /// sliding rule keyed by caller that sees every call).
    pub fn has_sliding(&self) -> bool {
        self.rules.iter().any(Rule::shares_log)
    }

    /// Whether any rule decides by the callee: a callee filter, a
    /// distinct-callees rule, a rule keyed by caller and callee (else the
    /// callee is only the distinct-callees feature).
    pub fn decides_by_callee(&self) -> bool {
        self.rules.iter().any(|r| {
            !r.filter.callees.is_empty()
                || r.kind == WindowKind::DistinctCallees
                || matches!(r.key, RuleKey::CallerCallee | RuleKey::Callee)
        })
    }

    /// Whether any rule adds up talk (`sum`, of talk or cost; a caller's or
    /// a pool's).
    pub fn adds_talk(&self) -> bool {
        self.rules.iter().any(|r| r.sum.is_some())
    }

    /// Whether any rule is keyed by account (counts an account's calls).
    pub fn keys_by_account(&self) -> bool {
        self.rules.iter().any(|r| r.key == RuleKey::Account)
    }

    /// Whether any rule sees only some calls.
    pub fn has_filters(&self) -> bool {
        self.filtered
    }

    /// Whether rule `i` sees `ev` (see [`Filter`]).
    pub fn sees(&self, i: usize, ev: &CallEvent) -> bool {
        !self.filtered || self.rules.get(i).is_some_and(|r| r.filter.sees(ev))
    }

    /// Which rules see `ev`, one character per rule, for a store that
    /// decides elsewhere (`lua/window.lua`): `1` sees it, `2` does not
    /// see it now (its time profile) but sees its callee (so it counts for
    /// the retry-after), `0` neither. `None` when every rule sees every call.
    pub fn mask(&self, ev: &CallEvent) -> Option<String> {
        self.filtered.then(|| {
            self.rules
                .iter()
                .map(|r| {
                    if !r.filter.sees_callee(ev.callee_for_filters()) {
                        '0'
                    } else if r.filter.sees_time(ev.ts_ms) {
                        '1'
                    } else {
                        '2'
                    }
                })
                .collect()
        })
    }

    /// The files besides the rules file this set was read from (its
    /// `callees_file`s): a reload watches them too.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The warning of a call with these counts: the first rule, in order,
    /// with a `warn` level its count exceeds, when the call is allowed and
    /// on no list (`None` otherwise).
    pub fn warning(&self, judgement: Judgement, shadowed: bool, counts: &[u64]) -> Option<usize> {
        let allowed = match judgement {
            Judgement::Within | Judgement::ShadowExceeded(_) => true,
            Judgement::Exceeded(_) => shadowed,
            Judgement::Denylisted(_) | Judgement::Allowlisted(_) => false,
        };
        if !allowed {
            return None;
        }
        self.rules
            .iter()
            .zip(counts)
            .position(|(r, &c)| r.warn.is_some_and(|w| c > w))
    }

    /// Which list the (normalised) caller is on; the denylist wins. An
    /// unusable caller ([`BAD_CALLER`]) is on a list of its own, as the
    /// set's `bad_caller` policy says (none when shared).
    pub fn listed(&self, caller: &str) -> Listed {
        if caller == BAD_CALLER {
            match self.bad_caller {
                BadCallerPolicy::Shared => Listed::No,
                BadCallerPolicy::Reject => Listed::BadCallerReject,
                BadCallerPolicy::Allow => Listed::BadCallerAllow,
            }
        } else if self.deny.iter().any(|p| caller.starts_with(p.as_str())) {
            Listed::Deny
        } else if self.allow.iter().any(|p| caller.starts_with(p.as_str())) {
            Listed::Allow
        } else {
            Listed::No
        }
    }

    /// Judges a call of `caller` with these counts (one per rule): the
    /// denylist, then the allowlist, then the first enforcing rule, in
    /// order, whose count exceeds its limit, then the first shadow rule
    /// that does. `skip` leaves one rule out (`tune` sweeps
    /// its limit separately).
    pub fn judge(&self, caller: &str, counts: &[u64], skip: Option<usize>) -> Judgement {
        match self.listed(caller) {
            Listed::Deny => Judgement::Denylisted(REASON_DENYLIST),
            Listed::Allow => Judgement::Allowlisted(REASON_ALLOWLIST),
            Listed::BadCallerReject => Judgement::Denylisted(REASON_BAD_CALLER),
            Listed::BadCallerAllow => Judgement::Allowlisted(REASON_BAD_CALLER),
            Listed::No => {
                let mut shadowed = None;
                for (i, (r, &c)) in self.rules.iter().zip(counts).enumerate() {
                    if Some(i) == skip || c <= r.limit {
                        continue;
                    }
                    if !r.shadow {
                        return Judgement::Exceeded(i);
                    }
                    shadowed.get_or_insert(i);
                }
                shadowed.map_or(Judgement::Within, Judgement::ShadowExceeded)
            }
        }
    }

    /// Index of a rule by name.
    pub fn rule_index(&self, name: &str) -> Option<usize> {
        self.rules.iter().position(|r| r.name == name)
    }

    fn compute_version(&self) -> String {
        let mut allow = self.allow.clone();
        allow.sort();
        let mut deny = self.deny.clone();
        deny.sort();
        let canonical = serde_json::json!({
            "rules": self.rules,
            "count": self.count,
            "grace_ms": self.grace_ms,
            "allow": allow,
            "deny": deny,
            "shadow": self.shadow,
            "dedup_ms": self.dedup_ms(),
        });
        // Added only when not the default, so versions of existing rule sets
        // stay the same.
        let mut canonical = canonical;
        if let serde_json::Value::Object(m) = &mut canonical {
            if !self.callees {
                m.insert("distinct_callees".into(), false.into());
            }
            if self.max_callees != DEFAULT_MAX_DISTINCT_CALLEES {
                m.insert("max_distinct_callees".into(), self.max_callees.into());
            }
            if self.bad_caller != BadCallerPolicy::Shared {
                m.insert("bad_caller".into(), serde_json::json!(self.bad_caller));
            }
            // (The zone of the local-time features.)
            if let Some(tz) = self.timezone {
                m.insert("timezone".into(), tz.name().into());
            }
            // The model by its file's hash and how its score decides.
            if let Some(model) = &self.model {
                let mut entry = serde_json::json!({
                    "sha256": model.hash,
                    "inputs": model.input_names,
                    "threshold": model.threshold,
                    "shadow": model.shadow,
                    "warn": model.warn,
                    "retry_after_ms": model.retry_after_ms,
                });
                // (Only when set: the versions of sets without it stay.)
                if model.block {
                    entry["block"] = true.into();
                }
                m.insert("model".into(), entry);
            }
        }
        let digest = Sha256::digest(canonical.to_string().as_bytes());
        digest.iter().take(6).map(|b| format!("{b:02x}")).collect()
    }
}

/// Most rules in a set.
pub const MAX_RULES: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_toml_and_shorthand() {
        let set = RuleSet::from_toml(
            r#"
            count = "admitted"
            grace = "2s"
            deny = ["00882"]
            [[rule]]
            name = "minute"
            kind = "sliding"
            window = "1m"
            limit = 10
            [[rule]]
            name = "burst"
            kind = "fixed"
            window = "1s"
            limit = 3
        "#,
        )
        .unwrap();
        assert_eq!(set.rules.len(), 2);
        assert_eq!(set.count, CountPolicy::Admitted);
        assert_eq!(set.grace_ms, 2_000);
        assert_eq!(set.deny, vec!["+882".to_string()]);
        assert_eq!(set.listed("+88212345678"), Listed::Deny);
        assert_eq!(set.retention_ms(), 62_000);
        let r = Rule::parse_shorthand("minute:sliding-approx:60s:20").unwrap();
        assert_eq!(r.kind, WindowKind::SlidingApprox);
        assert_eq!(r.to_string(), "minute:sliding-approx:1m:20");
    }

    #[test]
    fn version_tracks_content() {
        let a = RuleSet::from_args(None, &["m:sliding:60s:20".into()]).unwrap();
        let b = RuleSet::from_args(None, &["m:sliding:60s:21".into()]).unwrap();
        let a2 = RuleSet::from_args(None, &["m:sliding:1m:20".into()]).unwrap();
        assert_ne!(a.version(), b.version());
        assert_eq!(a.version(), a2.version());
        assert_eq!(a.version().len(), 12);
    }

    #[test]
    fn rejects_bad_sets() {
        for bad in [
            "m:sliding:60s",
            "m:nope:60s:1",
            "m:sliding:0s:1",
            "m:sliding:1s:0",
            "OK:fixed:1s:1",
            "ok:fixed:1s:1",
        ] {
            assert!(RuleSet::from_args(None, &[bad.into()]).is_err(), "{bad}");
        }
        assert!(RuleSet::from_args(None, &["a:fixed:1s:1".into(), "a:fixed:2s:1".into()]).is_err());
        assert!(RuleSet::from_toml(
            "bogus = 1\n[[rule]]\nname='a'\nkind='fixed'\nwindow='1s'\nlimit=1"
        )
        .is_err());
        assert!(RuleSet::from_toml(
            "allow=['+34x']\n[[rule]]\nname='a'\nkind='fixed'\nwindow='1s'\nlimit=1"
        )
        .is_err());
    }
}
