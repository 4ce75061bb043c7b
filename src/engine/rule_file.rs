//! Rule files: the TOML an operator writes, read into a [`RuleSet`].
//!
//! Every field error names the rule and the field. A `callees_file` is read
//! relative to the rules file; the set remembers it, so a reload notices
//! when it changes, and its prefixes are part of the version.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use crate::engine::duration::parse_duration_ms;
use crate::engine::filter::{parse_days, parse_timezone, Filter, Hours};
use crate::engine::model::{Model, DEFAULT_MODEL_RETRY_AFTER_MS};
use crate::engine::rates::{Rates, MICROS};
use crate::engine::rule::{
    BadCallerPolicy, CountPolicy, Rate, Rule, RuleKey, Sum, SumOf, WindowKind,
    DEFAULT_SUM_MAX_DURATION_MS,
};
use crate::engine::rules::normalize_prefix;
use crate::engine::rules::{RuleSet, RuleSpec, DEFAULT_GRACE_MS, DEFAULT_MAX_DISTINCT_CALLEES};
use crate::error::RulesError;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    #[serde(default)]
    count: CountPolicy,
    grace: Option<String>,
    #[serde(default)]
    shadow: bool,
    #[serde(default)]
    bad_caller: BadCallerPolicy,
    dedup: Option<String>,
    distinct_callees: Option<bool>,
    max_distinct_callees: Option<u64>,
    timezone: Option<String>,
    #[serde(default)]
    allow: Vec<String>,
    #[serde(default)]
    deny: Vec<String>,
    #[serde(default, rename = "rule")]
    rules: Vec<RuleEntry>,
    model: Option<ModelEntry>,
    model_retry_after: Option<String>,
}

/// `[model]`: see [`crate::engine::model`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelEntry {
    path: String,
    inputs: Vec<String>,
    threshold: f32,
    #[serde(default)]
    shadow: bool,
    warn: Option<f32>,
    #[serde(default)]
    block: bool,
}

impl ModelEntry {
    /// Reads and loads the model, its `path` relative to `dir`; noted in
    /// `files` so that a reload notices a new model.
    fn load(
        self,
        dir: Option<&Path>,
        retry_after_ms: i64,
        files: &mut Vec<PathBuf>,
    ) -> Result<Model, RulesError> {
        let err = |m: String| RulesError::Invalid(format!("model: {m}"));
        let path = match dir {
            Some(d) => d.join(&self.path),
            None => PathBuf::from(&self.path),
        };
        let bytes = std::fs::read(&path)
            .map_err(|e| err(format!("path: cannot read {}: {e}", path.display())))?;
        files.push(path.clone());
        let mut model = Model::load(
            path.clone(),
            &bytes,
            self.inputs,
            self.threshold,
            self.shadow,
            self.warn,
            retry_after_ms,
        )
        .map_err(|e| err(format!("{}: {e}", path.display())))?;
        model.block = self.block;
        Ok(model)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleEntry {
    name: String,
    kind: String,
    window: Option<String>,
    max_duration: Option<String>,
    limit: Option<Level>,
    rate: Option<String>,
    burst: Option<u64>,
    warn: Option<Level>,
    sum: Option<String>,
    rates_file: Option<String>,
    #[serde(default)]
    shadow: bool,
    key: Option<String>,
    callees: Option<Vec<String>>,
    callees_file: Option<String>,
    hours: Option<String>,
    days: Option<Vec<String>>,
    timezone: Option<String>,
}

/// A limit or warn level as written: a whole number, or text in a sum
/// rule's unit (`"90m"` of talk, `"50.00"` of currency).
#[derive(Deserialize)]
#[serde(untagged)]
enum Level {
    Whole(u64),
    Text(String),
}

impl Level {
    /// The level in the rule's count unit: calls, seconds of talk, or
    /// micro-units of currency.
    fn value(&self, sum: Option<&SumOf>) -> Result<u64, String> {
        match (self, sum) {
            (Level::Whole(n), None | Some(SumOf::Talk)) => Ok(*n),
            (Level::Whole(n), Some(SumOf::Cost(_))) => n
                .checked_mul(MICROS)
                .ok_or_else(|| format!("{n}: too large")),
            (Level::Text(t), Some(of)) => of.parse_level(t),
            (Level::Text(t), None) => Err(format!(
                "`{t}`: a whole number of calls (text is for sum rules: \"90m\" of talk, \"50.00\" of spend)"
            )),
        }
    }
}

/// `rule `NAME`, FIELD: MESSAGE`.
fn field_error(rule: &str, field: &str, msg: impl std::fmt::Display) -> RulesError {
    RulesError::Invalid(format!("rule `{rule}`, {field}: {msg}"))
}

/// Reads a callees file: one prefix per line, `#` starts a comment.
fn read_prefix_file(path: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok(text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect())
}

impl RuleEntry {
    /// The rule's sum (`sum`, with its `rates_file` read from `dir` and
    /// noted in `files`, and its `max_duration`), or why not: (field,
    /// message).
    fn sum_of(
        &self,
        dir: Option<&Path>,
        files: &mut Vec<PathBuf>,
    ) -> Result<Option<Sum>, (&'static str, String)> {
        let Some(what) = self.sum.as_deref() else {
            if self.rates_file.is_some() {
                return Err((
                    "rates_file",
                    "only a rule with sum = \"cost\" has one".into(),
                ));
            }
            return Ok(None);
        };
        let of = match what {
            "talk" => {
                if self.rates_file.is_some() {
                    return Err((
                        "rates_file",
                        "only a rule with sum = \"cost\" has one".into(),
                    ));
                }
                SumOf::Talk
            }
            "cost" => {
                let file = self.rates_file.as_deref().ok_or((
                    "rates_file",
                    "missing: a cost sum prices talk by a rates file (prefix,price_per_minute[,increment_s])".to_string(),
                ))?;
                let path = dir.map(|d| d.join(file)).ok_or((
                    "rates_file",
                    "needs a rules file to be read relative to".to_string(),
                ))?;
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| ("rates_file", format!("cannot read {}: {e}", path.display())))?;
                let rates = Rates::parse(&text, normalize_prefix)
                    .map_err(|e| ("rates_file", format!("{}: {e}", path.display())))?;
                files.push(path);
                SumOf::Cost(Arc::new(rates))
            }
            other => {
                return Err((
                    "sum",
                    format!("`{other}`: talk (seconds of talk) or cost (priced by rates_file)"),
                ))
            }
        };
        let max_duration_ms = match self.max_duration.as_deref() {
            Some(d) => parse_duration_ms(d).map_err(|e| ("max_duration", e.to_string()))?,
            None => DEFAULT_SUM_MAX_DURATION_MS,
        };
        Ok(Some(Sum {
            of,
            max_duration_ms,
        }))
    }

    /// The rule, with `callees_file` read from `dir` (noted in `files`)
    /// and `default_tz` for a time profile without its own zone.
    fn into_rule(
        self,
        dir: Option<&Path>,
        default_tz: Option<chrono_tz::Tz>,
        files: &mut Vec<PathBuf>,
    ) -> Result<Rule, RulesError> {
        let name = self.name.clone();
        let err = |field: &str, msg: String| field_error(&name, field, msg);
        let kind = WindowKind::parse(&self.kind).map_err(|e| err("kind", e.to_string()))?;
        if kind != WindowKind::Concurrent && self.sum.is_none() && self.max_duration.is_some() {
            return Err(err(
                "max_duration",
                "only a concurrent or a sum rule has one (a window rule has `window`)".into(),
            ));
        }
        let sum = self.sum_of(dir, files).map_err(|(f, e)| err(f, e))?;
        let level = |field: &str, l: &Option<Level>| -> Result<Option<u64>, RulesError> {
            l.as_ref()
                .map(|l| l.value(sum.as_ref().map(|s| &s.of)))
                .transpose()
                .map_err(|e| err(field, e))
        };
        let limit_value = level("limit", &self.limit)?;
        let warn = level("warn", &self.warn)?;
        let (window_ms, limit, rate) = if kind == WindowKind::Concurrent {
            for (set, field) in [
                (self.window.is_some(), "window"),
                (self.rate.is_some(), "rate"),
                (self.burst.is_some(), "burst"),
            ] {
                if set {
                    return Err(err(
                        field,
                        "a concurrent rule has `limit` and `max_duration` instead".into(),
                    ));
                }
            }
            let longest = self.max_duration.as_deref().ok_or_else(|| {
                err(
                    "max_duration",
                    "missing: the longest a call holds a slot when its end never comes, e.g. \"4h\"".into(),
                )
            })?;
            let max_ms =
                parse_duration_ms(longest).map_err(|e| err("max_duration", e.to_string()))?;
            let limit = limit_value.ok_or_else(|| err("limit", "missing".into()))?;
            (max_ms, limit, None)
        } else if kind == WindowKind::TokenBucket {
            for (set, field) in [
                (self.window.is_some(), "window"),
                (self.limit.is_some(), "limit"),
            ] {
                if set {
                    return Err(err(
                        field,
                        "a token bucket has `rate` and `burst` instead".into(),
                    ));
                }
            }
            let rate = Rate::parse(
                self.rate
                    .as_deref()
                    .ok_or_else(|| err("rate", "missing".into()))?,
            )
            .map_err(|e| err("rate", e))?;
            let burst = self.burst.ok_or_else(|| err("burst", "missing".into()))?;
            if burst == 0 {
                return Err(err("burst", "must be at least 1".into()));
            }
            (rate.span_ms(burst), burst, Some(rate))
        } else {
            for (set, field) in [
                (self.rate.is_some(), "rate"),
                (self.burst.is_some(), "burst"),
            ] {
                if set {
                    return Err(err(field, "only a token bucket has one".into()));
                }
            }
            let window = self
                .window
                .as_deref()
                .ok_or_else(|| err("window", "missing".into()))?;
            let window_ms = parse_duration_ms(window).map_err(|e| err("window", e.to_string()))?;
            let limit = limit_value.ok_or_else(|| err("limit", "missing".into()))?;
            (window_ms, limit, None)
        };
        let key = match self.key.as_deref() {
            Some(k) => RuleKey::parse(k).map_err(|e| err("key", e))?,
            None => RuleKey::Caller,
        };
        let mut callees = self.callees.unwrap_or_default();
        if let Some(file) = &self.callees_file {
            let path = match dir {
                Some(d) => d.join(file),
                None => {
                    return Err(err(
                        "callees_file",
                        "needs a rules file to be read relative to".into(),
                    ))
                }
            };
            callees.extend(read_prefix_file(&path).map_err(|e| err("callees_file", e))?);
            files.push(path);
        }
        let hours = self
            .hours
            .as_deref()
            .map(Hours::parse)
            .transpose()
            .map_err(|e| err("hours", e))?;
        let days = self
            .days
            .as_deref()
            .map(parse_days)
            .transpose()
            .map_err(|e| err("days", e))?;
        let timezone = match self.timezone.as_deref() {
            Some(tz) => Some(parse_timezone(tz).map_err(|e| err("timezone", e.to_string()))?),
            None => default_tz,
        };
        let has_time = hours.is_some() || days.is_some();
        let filter = Filter {
            callees,
            hours,
            days,
            timezone: timezone.filter(|_| has_time),
        };
        Ok(Rule {
            rate,
            warn,
            sum,
            shadow: self.shadow,
            key,
            filter,
            ..Rule::new(name.clone(), kind, window_ms, limit)
        })
    }
}

impl RuleSet {
    /// Parses a TOML rule set (a `callees_file` cannot be read: use
    /// [`RuleSet::from_file`]).
    pub fn from_toml(text: &str) -> Result<Self, RulesError> {
        Self::from_toml_in(text, None)
    }

    /// Parses a TOML rule set whose `callees_file`s are relative to `dir`.
    pub fn from_toml_in(text: &str, dir: Option<&Path>) -> Result<Self, RulesError> {
        let file: RuleFile = toml::from_str(text).map_err(|e| RulesError::Toml(e.to_string()))?;
        let default_tz = file.timezone.as_deref().map(parse_timezone).transpose()?;
        let mut files = Vec::new();
        let rules = file
            .rules
            .into_iter()
            .map(|e| e.into_rule(dir, default_tz, &mut files))
            .collect::<Result<Vec<_>, RulesError>>()?;
        let grace_ms = match file.grace {
            Some(g) => parse_duration_ms(&g)?,
            None => DEFAULT_GRACE_MS,
        };
        let retry_after_ms = match file.model_retry_after.as_deref() {
            Some(d) => parse_duration_ms(d)?,
            None => DEFAULT_MODEL_RETRY_AFTER_MS,
        };
        if file.model.is_none() && file.model_retry_after.is_some() {
            return Err(RulesError::Invalid(
                "model_retry_after: there is no [model]".into(),
            ));
        }
        let model = file
            .model
            .map(|m| m.load(dir, retry_after_ms, &mut files).map(Arc::new))
            .transpose()?;
        RuleSet::build(RuleSpec {
            rules,
            count: file.count,
            grace_ms,
            allow: file.allow,
            deny: file.deny,
            shadow: file.shadow,
            bad_caller: file.bad_caller,
            dedup_ms: file.dedup.as_deref().map(parse_duration_ms).transpose()?,
            distinct_callees: file.distinct_callees.unwrap_or(true),
            max_distinct_callees: file
                .max_distinct_callees
                .unwrap_or(DEFAULT_MAX_DISTINCT_CALLEES),
            files,
            timezone: default_tz,
            model,
        })
    }

    /// Reads a TOML rule set from a file.
    pub fn from_file(path: &Path) -> Result<Self, RulesError> {
        let text = std::fs::read_to_string(path).map_err(|source| RulesError::Read {
            path: path.display().to_string(),
            source,
        })?;
        // Say which file: the parser's messages give lines, not the file.
        Self::from_toml_in(&text, path.parent()).map_err(|e| match e {
            RulesError::Toml(m) => RulesError::Toml(format!("{}: {m}", path.display())),
            RulesError::Invalid(m) => RulesError::Invalid(format!("{}: {m}", path.display())),
            other => other,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "timezone = \"Europe/Madrid\"\n[[rule]]\nname = \"irsf\"\n";

    fn error_of(rule_text: &str) -> String {
        match RuleSet::from_toml(&format!("{BASE}{rule_text}")) {
            Ok(_) => panic!("accepted: {rule_text}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn bad_fields_name_the_rule_and_the_field() {
        let w = "kind = \"sliding\"\nwindow = \"1h\"\nlimit = 3\n";
        for (extra, field) in [
            ("days = [\"mon\", \"funday\"]", "days"),
            ("hours = \"25:00-07:00\"", "hours"),
            ("timezone = \"Mars/Olympus\"", "timezone"),
            ("callees = [\"+882\", \"\"]", "callees"),
            ("key = \"callee+caller\"", "key"),
            ("warn = 3", "warn"),
        ] {
            let e = error_of(&format!("{w}{extra}\n"));
            assert!(e.contains("`irsf`") && e.contains(field), "{extra}: {e}");
        }
        let e = error_of("kind = \"token-bucket\"\nrate = \"2/s\"\nburst = 0\n");
        assert!(e.contains("`irsf`") && e.contains("burst"), "{e}");
        let e = error_of("kind = \"token-bucket\"\nrate = \"2/d\"\nburst = 3\n");
        assert!(e.contains("rate"), "{e}");
        let e = error_of(&format!("{w}callees_file = \"ranges.txt\"\n"));
        assert!(e.contains("callees_file"), "{e}");
    }

    #[test]
    fn a_concurrent_rule_needs_a_max_duration_and_no_window() {
        let rules = RuleSet::from_toml(&format!(
            "{BASE}kind = \"concurrent\"\nlimit = 10\nmax_duration = \"4h\"\n"
        ))
        .unwrap();
        assert_eq!(rules.rules[0].kind, WindowKind::Concurrent);
        assert_eq!(rules.rules[0].window_ms, 4 * 3_600_000);
        assert_eq!(rules.rules[0].to_string(), "irsf:concurrent:4h:10");
        assert!(rules.has_concurrent());
        for (text, field) in [
            ("kind = \"concurrent\"\nlimit = 10\n", "max_duration"),
            (
                "kind = \"concurrent\"\nlimit = 10\nmax_duration = \"4h\"\nwindow = \"1h\"\n",
                "window",
            ),
            ("kind = \"concurrent\"\nmax_duration = \"4h\"\n", "limit"),
            (
                "kind = \"sliding\"\nwindow = \"1h\"\nlimit = 3\nmax_duration = \"4h\"\n",
                "max_duration",
            ),
        ] {
            let e = error_of(text);
            assert!(e.contains("`irsf`") && e.contains(field), "{text}: {e}");
        }
        // Keyed by callee (or account, or global): a pool, not the caller's.
        let pool = RuleSet::from_toml(&format!(
            "{BASE}kind = \"concurrent\"\nlimit = 3\nmax_duration = \"4h\"\nkey = \"callee\"\n"
        ))
        .unwrap();
        assert!(pool.has_pools() && !pool.has_concurrent() && !pool.caller_uses_ends());
        // The shorthand takes the max duration where a window goes.
        let short = RuleSet::from_args(None, &["ch:concurrent:30m:2".into()]).unwrap();
        assert_eq!(short.rules[0].window_ms, 1_800_000);
    }

    #[test]
    fn sum_rules_take_levels_in_their_unit_and_say_what_is_wrong() {
        let talk = "kind = \"sliding\"\nwindow = \"1h\"\nsum = \"talk\"\n";
        let rules =
            RuleSet::from_toml(&format!("{BASE}{talk}limit = \"90m\"\nwarn = 600\n")).unwrap();
        assert_eq!(
            (rules.rules[0].limit, rules.rules[0].warn),
            (5_400, Some(600))
        );
        assert!(rules.has_sums() && rules.uses_ends() && !rules.has_concurrent());
        // Keyed by account: a pool, not the caller's sum.
        let pool =
            RuleSet::from_toml(&format!("{BASE}{talk}limit = 10\nkey = \"account\"\n")).unwrap();
        assert!(pool.has_pools() && !pool.has_sums() && pool.uses_ends());
        for (text, field) in [
            (format!("{talk}limit = \"90m500ms\"\n"), "limit"),
            (
                format!("{talk}limit = 10\nrates_file = \"r.csv\"\n"),
                "rates_file",
            ),
            (
                format!("{talk}limit = 10\nkey = \"caller+callee\"\n"),
                "key",
            ),
            (
                "kind = \"sliding\"\nwindow = \"1h\"\nlimit = \"10\"\n".into(),
                "limit",
            ),
            (
                "kind = \"sliding\"\nwindow = \"1h\"\nsum = \"cost\"\nlimit = \"1.00\"\n".into(),
                "rates_file",
            ),
            (
                "kind = \"sliding\"\nwindow = \"1h\"\nsum = \"calls\"\nlimit = 1\n".into(),
                "sum",
            ),
            (
                "kind = \"token-bucket\"\nrate = \"1/s\"\nburst = 3\nsum = \"talk\"\n".into(),
                "sum",
            ),
        ] {
            let e = error_of(&text);
            assert!(e.contains("`irsf`") && e.contains(field), "{text}: {e}");
        }
    }

    #[test]
    fn a_callees_file_is_read_merged_and_versioned() {
        let dir = tempfile::tempdir().unwrap();
        let rules = dir.path().join("rules.toml");
        let ranges = dir.path().join("ranges.txt");
        std::fs::write(
            &rules,
            "[[rule]]\nname = \"irsf\"\nkind = \"sliding\"\nwindow = \"1h\"\nlimit = 3\ncallees = [\"+53\"]\ncallees_file = \"ranges.txt\"\n",
        )
        .unwrap();
        std::fs::write(&ranges, "# premium ranges\n+882\n00881 # satellite\n\n").unwrap();
        let a = RuleSet::from_file(&rules).unwrap();
        assert_eq!(a.rules[0].filter.callees, ["+53", "+881", "+882"]);
        assert_eq!(a.files(), std::slice::from_ref(&ranges));
        std::fs::write(&ranges, "+882\n").unwrap();
        let b = RuleSet::from_file(&rules).unwrap();
        assert_ne!(a.version(), b.version());
        std::fs::remove_file(&ranges).unwrap();
        let e = RuleSet::from_file(&rules).unwrap_err().to_string();
        assert!(e.contains("`irsf`") && e.contains("callees_file"), "{e}");
    }
}
