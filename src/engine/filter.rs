//! Which calls a rule sees: callee prefixes and a time-of-day and
//! day-of-week profile in a time zone.
//!
//! A rule that does not see a call neither counts nor records it, and the
//! call's count for that rule is empty. Every store gets the same answer:
//! the rule set works it out from the event alone (its callee and its event
//! time), before any state is read.

use chrono::{Datelike, TimeZone, Timelike};
use chrono_tz::Tz;
use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

use crate::engine::event::CallEvent;
use crate::error::RulesError;

/// Local times of day `[start, end)` in minutes after midnight; `end <
/// start` wraps past midnight (`22:00-07:00`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hours {
    /// First minute of the day inside the range.
    pub start: u16,
    /// First minute of the day after it (may be below `start`).
    pub end: u16,
}

impl Hours {
    /// Parses `HH:MM-HH:MM` (`24:00` allowed as an end).
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}`: expected HH:MM-HH:MM, e.g. 22:00-07:00");
        let (a, b) = s.split_once('-').ok_or_else(bad)?;
        let minute = |x: &str, end: bool| -> Option<u16> {
            let (h, m) = x.trim().split_once(':')?;
            if h.is_empty() || h.len() > 2 || m.len() != 2 {
                return None;
            }
            let (h, m): (u16, u16) = (h.parse().ok()?, m.parse().ok()?);
            let ok = (h < 24 && m < 60) || (end && h == 24 && m == 0);
            ok.then_some(h * 60 + m)
        };
        let start = minute(a, false).ok_or_else(bad)?;
        let end = minute(b, true).ok_or_else(bad)?;
        if start == end {
            return Err(format!("`{s}`: an empty range (start equals end)"));
        }
        Ok(Hours { start, end })
    }

    /// Whether minute-of-day `m` is inside.
    pub fn contains(self, m: u16) -> bool {
        if self.start < self.end {
            self.start <= m && m < self.end
        } else {
            m >= self.start || m < self.end
        }
    }

    fn text(self) -> String {
        format!(
            "{:02}:{:02}-{:02}:{:02}",
            self.start / 60,
            self.start % 60,
            self.end / 60,
            self.end % 60
        )
    }
}

/// Day names, Monday first, as rule files write them.
pub const DAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

/// The instant of minute `minute` (0 to 1440) of local date `date` in
/// `tz` ([`local_ms`]).
fn local_instant(tz: Tz, date: chrono::NaiveDate, minute: u16) -> Option<i64> {
    let midnight = date.and_hms_opt(0, 0, 0)?;
    local_ms(tz, midnight + chrono::Duration::minutes(i64::from(minute)))
}

/// A local time in `tz` as epoch milliseconds: in a repeated hour (a DST
/// fold) the earlier instant, in a skipped one (a gap) an hour later, as a
/// switch's clock reads it.
pub fn local_ms(tz: Tz, naive: chrono::NaiveDateTime) -> Option<i64> {
    tz.from_local_datetime(&naive)
        .earliest()
        .or_else(|| {
            tz.from_local_datetime(&(naive + chrono::Duration::hours(1)))
                .earliest()
        })
        .map(|d| d.timestamp_millis())
}

/// Parses day names into a bit set (bit 0 Monday).
pub fn parse_days(days: &[String]) -> Result<u8, String> {
    if days.is_empty() {
        return Err("an empty list (leave `days` out to match every day)".into());
    }
    days.iter().try_fold(0u8, |mask, d| {
        let i = DAYS
            .iter()
            .position(|n| n.eq_ignore_ascii_case(d.trim()))
            .ok_or_else(|| format!("unknown day `{d}` (mon, tue, wed, thu, fri, sat, sun)"))?;
        Ok(mask | (1 << i))
    })
}

/// Which calls a rule sees. The default sees every call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Normalised callee prefixes, sorted, without repeats; empty: any
    /// callee (or none).
    pub callees: Vec<String>,
    /// Local time-of-day range.
    pub hours: Option<Hours>,
    /// Local days of the week (bit 0 Monday).
    pub days: Option<u8>,
    /// The zone `hours` and `days` are read in.
    pub timezone: Option<Tz>,
}

impl Filter {
    /// Whether it sees every call.
    pub fn is_empty(&self) -> bool {
        self.callees.is_empty() && self.hours.is_none() && self.days.is_none()
    }

    /// Whether it has a time profile (`hours` or `days`).
    pub fn has_time(&self) -> bool {
        self.hours.is_some() || self.days.is_some()
    }

    /// Whether the rule sees `ev`.
    pub fn sees(&self, ev: &CallEvent) -> bool {
        self.sees_callee(ev.callee_for_filters()) && self.sees_time(ev.ts_ms)
    }

    /// Whether a call to `callee` passes the callee prefixes (a call with
    /// no callee passes only when there are none).
    pub fn sees_callee(&self, callee: Option<&str>) -> bool {
        if self.callees.is_empty() {
            return true;
        }
        callee.is_some_and(|c| self.callees.iter().any(|p| c.starts_with(p.as_str())))
    }

    /// The instants of `[from, to]` the time profile holds at, as ordered,
    /// disjoint ranges `[a, b)`: the whole span without a profile. Each
    /// local day's ranges come from its own zone offset (a day of a DST
    /// change has its own), and a boundary in a skipped hour is taken an
    /// hour later, as call-log times in that hour are.
    pub fn on_ranges(&self, from: i64, to: i64) -> Vec<(i64, i64)> {
        let end = to.saturating_add(1);
        if from >= end {
            return Vec::new();
        }
        if !self.has_time() {
            return vec![(from, end)];
        }
        let tz = self.timezone.unwrap_or(Tz::UTC);
        let local_date = |ms: i64| tz.timestamp_millis_opt(ms).single().map(|d| d.date_naive());
        let (Some(mut date), Some(last)) = (local_date(from), local_date(to)) else {
            return Vec::new();
        };
        let mut out: Vec<(i64, i64)> = Vec::new();
        while date <= last {
            let day_ok = self
                .days
                .is_none_or(|d| d & (1 << date.weekday().num_days_from_monday()) != 0);
            let minutes: &[(u16, u16)] = match self.hours {
                _ if !day_ok => &[],
                None => &[(0, 1440)],
                Some(h) if h.start < h.end => &[(h.start, h.end)][..],
                Some(h) => &[(0, h.end), (h.start, 1440)][..],
            };
            for &(a, b) in minutes {
                let (Some(a), Some(b)) = (local_instant(tz, date, a), local_instant(tz, date, b))
                else {
                    continue;
                };
                let (a, b) = (a.max(from), b.min(end));
                if a >= b {
                    continue;
                }
                match out.last_mut() {
                    Some(prev) if prev.1 >= a => prev.1 = prev.1.max(b),
                    _ => out.push((a, b)),
                }
            }
            let Some(next) = date.succ_opt() else { break };
            date = next;
        }
        out
    }

    /// The last instant of `[from, to]` the time profile holds at (`to`
    /// itself without a profile); `None` when it holds at none. A rule's
    /// part of a retry-after: its window would reject until `to`, but it
    /// rejects only calls it sees.
    pub fn last_seen_within(&self, from: i64, to: i64) -> Option<i64> {
        if !self.has_time() {
            return Some(to);
        }
        if to < from {
            return None;
        }
        // No window is longer than 31 days: a year bounds the walk.
        let to = to.min(from.saturating_add(366 * 86_400_000));
        self.on_ranges(from, to).last().map(|&(_, b)| b - 1)
    }

    /// Whether event time `ts_ms` falls in the time profile.
    pub fn sees_time(&self, ts_ms: i64) -> bool {
        if !self.has_time() {
            return true;
        }
        let tz = self.timezone.unwrap_or(Tz::UTC);
        let Some(local) = tz.timestamp_millis_opt(ts_ms).single() else {
            return false;
        };
        let day_ok = self
            .days
            .is_none_or(|d| d & (1 << local.weekday().num_days_from_monday()) != 0);
        let minute = (local.hour() * 60 + local.minute()) as u16;
        day_ok && self.hours.is_none_or(|h| h.contains(minute))
    }
}

/// The canonical form (part of the rule set's version): only what is set.
impl Serialize for Filter {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        if !self.callees.is_empty() {
            m.serialize_entry("callees", &self.callees)?;
        }
        if let Some(h) = self.hours {
            m.serialize_entry("hours", &h.text())?;
        }
        if let Some(d) = self.days {
            let names: Vec<&str> = (0..7)
                .filter(|i| d & (1 << i) != 0)
                .map(|i| DAYS[i])
                .collect();
            m.serialize_entry("days", &names)?;
        }
        if self.has_time() {
            m.serialize_entry("timezone", self.timezone.unwrap_or(Tz::UTC).name())?;
        }
        m.end()
    }
}

/// Parses an IANA time zone name.
pub fn parse_timezone(name: &str) -> Result<Tz, RulesError> {
    name.parse::<Tz>().map_err(|_| {
        RulesError::Invalid(format!(
            "timezone `{name}`: not an IANA time zone name (e.g. Europe/Madrid, UTC)"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hours_wrap_past_midnight() {
        let h = Hours::parse("22:00-07:00").unwrap();
        assert!(h.contains(22 * 60) && h.contains(0) && h.contains(6 * 60 + 59));
        assert!(!h.contains(7 * 60) && !h.contains(12 * 60));
        let d = Hours::parse("09:00-18:30").unwrap();
        assert!(d.contains(9 * 60) && !d.contains(18 * 60 + 30));
        assert!(Hours::parse("00:00-24:00").unwrap().contains(23 * 60 + 59));
        for bad in ["25:00-07:00", "22:00", "9-10", "10:00-10:00", "10:60-11:00"] {
            assert!(Hours::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn time_profile_reads_local_time_across_dst() {
        let f = Filter {
            hours: Some(Hours::parse("22:00-07:00").unwrap()),
            days: Some(parse_days(&["sat".into(), "sun".into()]).unwrap()),
            timezone: Some(parse_timezone("Europe/Madrid").unwrap()),
            ..Filter::default()
        };
        // Saturday 2025-03-29 21:30 UTC = 22:30 CET: inside.
        assert!(f.sees_time(1_743_283_800_000));
        // Sunday 2025-03-30 05:30 UTC = 07:30 CEST (after the switch): outside.
        assert!(!f.sees_time(1_743_312_600_000));
        // Sunday 2025-03-30 04:30 UTC = 06:30 CEST: inside.
        assert!(f.sees_time(1_743_309_000_000));
        // Friday 2025-03-28 23:00 UTC = Saturday 00:00 CET: inside.
        assert!(f.sees_time(1_743_202_800_000));
        // Friday 2025-03-28 22:30 UTC = Friday 23:30 CET: wrong day.
        assert!(!f.sees_time(1_743_201_000_000));
        assert!(parse_days(&["mon".into(), "funday".into()]).is_err());
        assert!(parse_timezone("Mars/Olympus").is_err());
    }
}
