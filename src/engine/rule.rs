//! One rule: a window kind, a window length and a limit.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::engine::duration::{format_duration, parse_duration_ms};
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
}

impl WindowKind {
    /// The name used in rule files and shorthands.
    pub fn as_str(self) -> &'static str {
        match self {
            WindowKind::Fixed => "fixed",
            WindowKind::Sliding => "sliding",
            WindowKind::SlidingApprox => "sliding-approx",
        }
    }

    /// The numeric code passed to the Redis script.
    pub fn code(self) -> u8 {
        match self {
            WindowKind::Fixed => 0,
            WindowKind::Sliding => 1,
            WindowKind::SlidingApprox => 2,
        }
    }

    /// Parses `fixed`, `sliding` or `sliding-approx`.
    pub fn parse(s: &str) -> Result<Self, RulesError> {
        match s {
            "fixed" => Ok(WindowKind::Fixed),
            "sliding" => Ok(WindowKind::Sliding),
            "sliding-approx" | "sliding_approx" | "approx" => Ok(WindowKind::SlidingApprox),
            other => Err(RulesError::Invalid(format!(
                "unknown window kind `{other}` (fixed, sliding, sliding-approx)"
            ))),
        }
    }
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

/// One rule: reject when the count in the window exceeds the limit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rule {
    /// Name: lowercase letters, digits and `_`; used in column names (`count_<name>`).
    pub name: String,
    /// How the window counts.
    pub kind: WindowKind,
    /// Window length in milliseconds.
    pub window_ms: i64,
    /// Largest allowed count; a call whose count exceeds it is rejected.
    pub limit: u64,
}

impl Rule {
    /// Parses the shorthand `NAME:KIND:WINDOW:LIMIT`, e.g. `minute:sliding:60s:20`.
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
        Ok(Rule {
            name: name.trim().to_string(),
            kind: WindowKind::parse(kind.trim())?,
            window_ms: parse_duration_ms(window.trim())?,
            limit,
        })
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}:{}",
            self.name,
            self.kind.as_str(),
            format_duration(self.window_ms),
            self.limit
        )
    }
}
