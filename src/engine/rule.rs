//! One rule: a window kind, a window length (or a rate) and a limit, with
//! what it is keyed by, which calls it sees, a warning level and shadow.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::engine::duration::{format_duration, parse_duration_ms};
use crate::engine::filter::Filter;
use crate::engine::rates::{Price, Rates};
use crate::error::RulesError;

/// How a rule counts calls in its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WindowKind {
    /// Buckets aligned to epoch multiples of the window: bucket = floor(ts / W).
    Fixed,
    /// The exact sliding log: calls with ts in (t - W, t].
    Sliding,
    /// Two-bucket weighted counter: O(1) memory, an estimate of the sliding count.
    SlidingApprox,
    /// GCRA: a rate and a burst (the limit); the count is the bucket level
    /// after the call, in calls.
    TokenBucket,
    /// Distinct callees of the recorded calls in `(t - W, t]`.
    DistinctCallees,
    /// Calls of the key open at the attempt's time, this one included: an
    /// allowed attempt is open from its start until its end event, or
    /// for at most the rule's `max_duration` (its window).
    Concurrent,
}

impl WindowKind {
    /// The name used in rule files and shorthands.
    pub fn as_str(self) -> &'static str {
        match self {
            WindowKind::Fixed => "fixed",
            WindowKind::Sliding => "sliding",
            WindowKind::SlidingApprox => "sliding-approx",
            WindowKind::TokenBucket => "token-bucket",
            WindowKind::DistinctCallees => "distinct-callees",
            WindowKind::Concurrent => "concurrent",
        }
    }

    /// The numeric code passed to the Redis script.
    pub fn code(self) -> u8 {
        match self {
            WindowKind::Fixed => 0,
            WindowKind::Sliding => 1,
            WindowKind::SlidingApprox => 2,
            WindowKind::TokenBucket => 3,
            WindowKind::DistinctCallees => 4,
            WindowKind::Concurrent => 6,
        }
    }

    /// Parses `fixed`, `sliding`, `sliding-approx`, `token-bucket`,
    /// `distinct-callees` or `concurrent`.
    pub fn parse(s: &str) -> Result<Self, RulesError> {
        match s {
            "fixed" => Ok(WindowKind::Fixed),
            "sliding" => Ok(WindowKind::Sliding),
            "sliding-approx" | "sliding_approx" | "approx" => Ok(WindowKind::SlidingApprox),
            "token-bucket" | "token_bucket" => Ok(WindowKind::TokenBucket),
            "distinct-callees" | "distinct_callees" => Ok(WindowKind::DistinctCallees),
            "concurrent" => Ok(WindowKind::Concurrent),
            other => Err(RulesError::Invalid(format!(
                "unknown window kind `{other}` (fixed, sliding, sliding-approx, token-bucket, distinct-callees, concurrent)"
            ))),
        }
    }
}

/// What a rule counts calls by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RuleKey {
    /// The caller's calls (the default).
    #[default]
    Caller,
    /// A caller's calls to one callee: one window per (caller, callee).
    #[serde(rename = "caller+callee")]
    CallerCallee,
    /// All calls to one callee, from any caller: one window per callee,
    /// shared by every instance through leased credits
    /// ([`crate::engine::aggregate`]).
    Callee,
    /// All calls the rule sees, network-wide: one window, shared like a
    /// callee's.
    Global,
    /// All calls of one account (customer, tenant or trunk: the event's
    /// `account`), from any of its numbers: one window per account, shared
    /// like a callee's. A call without an account is not counted.
    Account,
}

impl RuleKey {
    /// Parses `caller`, `caller+callee`, `callee` or `global`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "caller" => Ok(RuleKey::Caller),
            "caller+callee" => Ok(RuleKey::CallerCallee),
            "callee" => Ok(RuleKey::Callee),
            "global" => Ok(RuleKey::Global),
            "account" => Ok(RuleKey::Account),
            other => Err(format!(
                "unknown key `{other}` (caller, caller+callee, callee, global, account)"
            )),
        }
    }

    /// Whether the rule counts calls of many callers (`callee`, `global`,
    /// `account`): its state is not the caller's, and instances share it
    /// through leased credits.
    pub fn is_aggregate(self) -> bool {
        matches!(self, RuleKey::Callee | RuleKey::Global | RuleKey::Account)
    }

    fn is_caller(&self) -> bool {
        *self == RuleKey::Caller
    }

    /// Its name in a rules file.
    pub fn as_str(self) -> &'static str {
        match self {
            RuleKey::Caller => "caller",
            RuleKey::CallerCallee => "caller+callee",
            RuleKey::Callee => "callee",
            RuleKey::Global => "global",
            RuleKey::Account => "account",
        }
    }
}

/// A token bucket's rate: `calls` per `per_ms` milliseconds. Its emission
/// interval `T = per_ms / calls` is kept exact: times inside the bucket
/// are whole milliseconds plus a remainder in `calls`-ths of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Rate {
    /// Calls per period.
    pub calls: u64,
    /// The period, ms: 1 s, 1 min or 1 h.
    pub per_ms: i64,
}

impl Rate {
    /// Parses `N/s`, `N/m` or `N/h`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}`: expected N/s, N/m or N/h, e.g. 2/s");
        let (n, unit) = s.split_once('/').ok_or_else(bad)?;
        let calls: u64 = n.trim().parse().map_err(|_| bad())?;
        let per_ms = match unit.trim() {
            "s" => 1_000,
            "m" | "min" => 60_000,
            "h" => 3_600_000,
            _ => return Err(bad()),
        };
        if !(1..=1_000_000).contains(&calls) {
            return Err(format!("`{s}`: the rate must be 1 to 1000000 per unit"));
        }
        Ok(Rate { calls, per_ms })
    }

    /// How long a bucket of `burst` calls takes to drain, ms, rounded up:
    /// a caller idle that long starts afresh (the rule's span).
    pub fn span_ms(self, burst: u64) -> i64 {
        let ticks = i128::from(burst) * i128::from(self.per_ms);
        let n = i128::from(self.calls);
        i64::try_from((ticks + n - 1) / n).unwrap_or(i64::MAX)
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.per_ms {
            1_000 => "s",
            60_000 => "m",
            _ => "h",
        };
        write!(f, "{}/{unit}", self.calls)
    }
}

/// What a rule set does with a call whose caller is unusable: missing, or
/// not a telephone number (garbage or spoofed CLI, or a national number
/// without `--default-country-code`). Such a call is decided under the
/// one caller key [`BAD_CALLER`](crate::engine::event::BAD_CALLER).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BadCallerPolicy {
    /// Every unusable caller is one caller for the rules: a spray of
    /// garbage CLI is limited together, and a switch sending national
    /// numbers without the country code shows at once.
    #[default]
    Shared,
    /// Rejected (reason `bad_caller`), as regulators ask of calls with
    /// invalid CLI.
    Reject,
    /// Allowed (reason `bad_caller`), unchecked.
    Allow,
}

/// Which calls are recorded in the windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CountPolicy {
    /// Every call attempt counts: a caller who keeps calling stays blocked.
    #[default]
    Attempts,
    /// Only allowed calls count: the classic rate limiter.
    Admitted,
}

/// What a window rule adds up instead of counting calls (`sum`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SumOf {
    /// Talk time, whole seconds (each call's rounded up).
    Talk,
    /// Talk priced by a rate table, micro-units of currency.
    Cost(Arc<Rates>),
}

impl SumOf {
    /// A level (limit, warn, a limit to sweep) written in its unit: a
    /// whole number is seconds of talk or whole units of currency; else
    /// a duration of talk (`"90m"`) or an amount (`"50.00"`).
    pub fn parse_level(&self, s: &str) -> Result<u64, String> {
        let s = s.trim();
        let whole = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        match self {
            SumOf::Talk if whole => s.parse().map_err(|_| format!("`{s}`: too large")),
            SumOf::Talk => {
                let ms =
                    crate::engine::duration::parse_duration_ms(s).map_err(|e| e.to_string())?;
                if ms % 1_000 != 0 {
                    return Err(format!("`{s}`: talk is counted in whole seconds"));
                }
                Ok(ms.unsigned_abs() / 1_000)
            }
            SumOf::Cost(_) => crate::engine::rates::parse_money(s),
        }
    }
}

/// A sum rule's measure: the key's allowed calls that ended in the
/// window, each adding its talk time or its cost at its end.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Sum {
    /// What each ended call adds.
    pub of: SumOf,
    /// How long a call waits for its end, at most: a call whose end has
    /// not come this long after its start (and past the grace) is let go,
    /// and its end, if it comes, adds nothing.
    pub max_duration_ms: i64,
}

/// How long a call of a sum rule waits for its end by default.
pub const DEFAULT_SUM_MAX_DURATION_MS: i64 = 4 * 3_600_000;

impl Sum {
    /// What a call ending with `talk_ms` of talk adds: its talk in whole
    /// seconds, rounded up, or its cost at `price` (the price of its
    /// callee when it started; none: it costs nothing).
    pub fn amount(&self, price: Option<Price>, talk_ms: i64) -> u64 {
        match self.of {
            SumOf::Talk => u64::try_from(talk_ms.max(0)).map_or(0, |t| t.div_ceil(1_000)),
            SumOf::Cost(_) => price.map_or(0, |p| p.cost(talk_ms)),
        }
    }

    /// The price a call to `callee` is charged at (cost sums only).
    pub fn price(&self, callee: Option<&str>) -> Option<Price> {
        match &self.of {
            SumOf::Talk => None,
            SumOf::Cost(rates) => rates.price(callee?),
        }
    }

    /// The unit of its counts, limit and warn level.
    pub fn unit(&self) -> &'static str {
        match self.of {
            SumOf::Talk => "seconds of talk",
            SumOf::Cost(_) => "micro-units of currency",
        }
    }
}

/// One rule: reject when the count in the window exceeds the limit.
///
/// The fields beyond the first four are left out of the canonical form
/// when they hold their defaults, so a rule set that uses none of them
/// keeps its version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rule {
    /// Name: lowercase letters, digits and `_`; used in column names (`count_<name>`).
    pub name: String,
    /// How the window counts.
    pub kind: WindowKind,
    /// Window length in milliseconds; for a token bucket its span
    /// ([`Rate::span_ms`] of the burst); for a concurrent rule its
    /// `max_duration`, the longest a call holds a slot.
    pub window_ms: i64,
    /// Largest allowed count (a token bucket's burst); a call whose count
    /// exceeds it is rejected.
    pub limit: u64,
    /// A token bucket's rate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate: Option<Rate>,
    /// A count above this (on a call not rejected) is a warning.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warn: Option<u64>,
    /// Report, never reject.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub shadow: bool,
    /// What the rule counts calls by.
    #[serde(skip_serializing_if = "RuleKey::is_caller")]
    pub key: RuleKey,
    /// Which calls it sees.
    #[serde(skip_serializing_if = "Filter::is_empty")]
    pub filter: Filter,
    /// What it adds up instead of counting calls (a window rule keyed by
    /// caller): its count, limit and warn level are in that sum's unit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sum: Option<Sum>,
}

impl Rule {
    /// A concurrent or sum rule keyed by account, callee or global: its
    /// calls are a pool many callers share, decided after the caller's
    /// rules ([`crate::engine::pool`]).
    pub fn is_pooled(&self) -> bool {
        (self.kind == WindowKind::Concurrent || self.sum.is_some()) && self.key.is_aggregate()
    }

    /// A rule keyed by callee, global or account counted through the
    /// gate's credits ([`crate::engine::aggregate`]): not a pool.
    pub fn is_gated(&self) -> bool {
        self.key.is_aggregate() && !self.is_pooled()
    }

    /// A window rule seeing every call, keyed by caller, enforcing, without
    /// a warning level.
    pub fn new(name: impl Into<String>, kind: WindowKind, window_ms: i64, limit: u64) -> Self {
        Rule {
            name: name.into(),
            kind,
            window_ms,
            limit,
            rate: None,
            warn: None,
            shadow: false,
            key: RuleKey::Caller,
            filter: Filter::default(),
            sum: None,
        }
    }

    /// Whether it counts on the caller's shared sliding log: a sliding
    /// rule keyed by caller that sees every call.
    pub fn shares_log(&self) -> bool {
        self.kind == WindowKind::Sliding
            && self.key == RuleKey::Caller
            && self.filter.is_empty()
            && self.sum.is_none()
    }

    /// Whether it keeps a sliding log of its own: a sliding rule keyed by
    /// caller that sees only some calls.
    pub fn own_log(&self) -> bool {
        self.kind == WindowKind::Sliding
            && self.key == RuleKey::Caller
            && !self.filter.is_empty()
            && self.sum.is_none()
    }

    /// Parses the shorthand `NAME:KIND:WINDOW:LIMIT`, e.g. `minute:sliding:60s:20`
    /// (for `concurrent`, WINDOW is the max duration: `channels:concurrent:4h:10`).
    pub fn parse_shorthand(s: &str) -> Result<Self, RulesError> {
        let parts: Vec<&str> = s.split(':').collect();
        let [name, kind, window, limit] = parts[..] else {
            return Err(RulesError::Invalid(format!(
                "rule `{s}`: expected NAME:KIND:WINDOW:LIMIT"
            )));
        };
        let limit = limit.trim().parse::<u64>().map_err(|_| {
            RulesError::Invalid(format!("rule `{s}`: limit `{limit}` is not a whole number"))
        })?;
        let kind = WindowKind::parse(kind.trim())?;
        if matches!(kind, WindowKind::TokenBucket) {
            return Err(RulesError::Invalid(format!(
                "rule `{s}`: a token bucket needs a rate: write it in a rules file"
            )));
        }
        Ok(Rule::new(
            name.trim(),
            kind,
            parse_duration_ms(window.trim())?,
            limit,
        ))
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.rate {
            Some(rate) => write!(
                f,
                "{}:{}:{rate}:{}",
                self.name,
                self.kind.as_str(),
                self.limit
            )?,
            None => write!(
                f,
                "{}:{}:{}:{}",
                self.name,
                self.kind.as_str(),
                format_duration(self.window_ms),
                self.limit
            )?,
        }
        match &self.sum {
            Some(Sum {
                of: SumOf::Talk, ..
            }) => write!(f, " sum=talk (s)"),
            Some(Sum {
                of: SumOf::Cost(_), ..
            }) => write!(f, " sum=cost (micro-units)"),
            None => Ok(()),
        }
    }
}
