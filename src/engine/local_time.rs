//! The local hour and weekday of an event time in a time zone (the
//! `local_hour` and `local_weekday` features).
//!
//! A zone's offset changes a few times a year, but finding it means a
//! search of the zone's transitions and a calendar date for every call:
//! a fifth of the instructions that build a feature table's columns. So
//! the offset is looked up once per minute of UTC time and kept (per
//! thread: a table is built in time order, a minute's calls one after
//! another); a minute whose two ends have different offsets (a transition
//! inside it) is worked out call by call, as before.

use std::cell::Cell;

use chrono::{DateTime, Datelike, Offset, TimeZone, Timelike};
use chrono_tz::Tz;

/// The span of UTC time one looked-up offset serves.
const SPAN_MS: i64 = 60_000;

/// A local time's hour and weekday.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalParts {
    /// 0 to 23.
    pub hour: u32,
    /// 1 (Monday) to 7 (Sunday).
    pub weekday: u32,
}

/// The offset of `tz` through one span of UTC time.
#[derive(Debug, Clone, Copy)]
struct KnownOffset {
    tz: Tz,
    span: i64,
    seconds: i64,
}

thread_local! {
    static KNOWN: Cell<Option<KnownOffset>> = const { Cell::new(None) };
}

/// The hour and weekday in `tz` of the epoch milliseconds `ms` (`None`
/// past chrono's range, which no valid event time is).
pub fn local_parts(ms: i64, tz: Tz) -> Option<LocalParts> {
    let span = ms.div_euclid(SPAN_MS);
    let seconds = match KNOWN.get() {
        Some(k) if k.tz == tz && k.span == span => k.seconds,
        _ => match span_offset(tz, span) {
            Some(seconds) => {
                KNOWN.set(Some(KnownOffset { tz, span, seconds }));
                seconds
            }
            None => return exact(ms, tz),
        },
    };
    Some(parts(ms.div_euclid(1000) + seconds))
}

/// The offset of `tz` (seconds east of UTC) through the whole span, if the
/// same offset holds at both its ends: zones change offset at most a few
/// times a year, never twice within a minute.
fn span_offset(tz: Tz, span: i64) -> Option<i64> {
    let start = span.checked_mul(SPAN_MS)?;
    let first = offset_at(start, tz)?;
    let last = offset_at(start.checked_add(SPAN_MS - 1)?, tz)?;
    (first == last).then_some(first)
}

/// The offset of `tz` at `ms`, in seconds east of UTC.
fn offset_at(ms: i64, tz: Tz) -> Option<i64> {
    let utc = DateTime::from_timestamp_millis(ms)?.naive_utc();
    Some(i64::from(
        tz.offset_from_utc_datetime(&utc).fix().local_minus_utc(),
    ))
}

/// The hour and weekday through chrono's calendar.
fn exact(ms: i64, tz: Tz) -> Option<LocalParts> {
    let local = DateTime::from_timestamp_millis(ms)?.with_timezone(&tz);
    Some(LocalParts {
        hour: local.hour(),
        weekday: local.weekday().number_from_monday(),
    })
}

/// The hour and weekday of a local time given as seconds since the
/// epoch's local midnight (1970-01-01 was a Thursday).
fn parts(local_seconds: i64) -> LocalParts {
    let hour = local_seconds.div_euclid(3_600).rem_euclid(24);
    let weekday = (local_seconds.div_euclid(86_400) + 3).rem_euclid(7) + 1;
    LocalParts {
        hour: u32::try_from(hour).unwrap_or_default(),
        weekday: u32::try_from(weekday).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Zones with DST (whole hours, half an hour), with offsets of 45 or
    /// 30 minutes, one whose changes were at 00:01 local time, and zones
    /// whose first offsets (local mean time) have seconds.
    const ZONES: [Tz; 8] = [
        Tz::Europe__Madrid,
        Tz::America__New_York,
        Tz::Asia__Kathmandu,
        Tz::Asia__Kolkata,
        Tz::Australia__Lord_Howe,
        Tz::America__St_Johns,
        Tz::Africa__Monrovia,
        Tz::UTC,
    ];

    fn check(ms: i64, tz: Tz) {
        assert_eq!(local_parts(ms, tz), exact(ms, tz), "{ms} in {tz}");
    }

    #[test]
    fn every_second_across_offset_changes_reads_as_chrono() {
        // Madrid's spring and autumn changes of 2025, New York's, St
        // John's at 00:01 in 2010, Lord Howe's half hour, Madrid's local
        // mean time ending in 1901, and Kolkata's changing by 8 seconds in
        // 1854 at 32 seconds past a minute (a minute with two offsets):
        // every second or so from two hours before to two hours after.
        let changes = [
            (Tz::Europe__Madrid, 1_743_296_400_000),
            (Tz::Europe__Madrid, 1_761_440_400_000),
            (Tz::America__New_York, 1_741_503_600_000),
            (Tz::America__St_Johns, 1_268_537_460_000),
            (Tz::Australia__Lord_Howe, 1_743_865_200_000),
            (Tz::Europe__Madrid, -2_177_452_800_000),
            (Tz::Asia__Kolkata, -3_645_237_208_000),
        ];
        for (tz, at) in changes {
            assert_ne!(
                offset_at(at - 7_200_000, tz),
                offset_at(at + 7_200_000, tz),
                "{tz} changes offset near {at}"
            );
            for ms in (at - 7_200_000..at + 7_200_000).step_by(997) {
                check(ms, tz);
            }
        }
    }

    #[test]
    fn random_times_and_zones_read_as_chrono() {
        // Times from 1850 to 2100 and before the epoch, in turn across
        // zones (the kept offset is for one zone at a time).
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let ms = (x % 7_900_000_000_000) as i64 - 3_800_000_000_000;
            let tz = ZONES[(x >> 59) as usize % ZONES.len()];
            check(ms, tz);
            check(ms + 1, tz);
        }
    }

    #[test]
    fn times_past_chronos_range_have_no_local_time() {
        assert_eq!(local_parts(i64::MAX, Tz::Europe__Madrid), None);
        assert_eq!(local_parts(i64::MIN, Tz::UTC), None);
    }
}
