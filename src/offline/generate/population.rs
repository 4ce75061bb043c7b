//! `generate --subscribers N`: a day of a carrier's whole population, for
//! measuring cost at a carrier's shape rather than a benchmark's.
//!
//! Every subscriber has a daily call rate of its own, drawn once from a
//! heavy-tailed mix:
//!
//! | kind | share of the numbers | calls a day |
//! |---|---|---|
//! | `subscriber` | the rest | log-normal, median 2, σ 0.9: most 1 to 5, one in twenty over 8 |
//! | `pbx` | 1 in 200 | log-uniform 50 to 500, through a trunk (`account`) |
//! | `flood` (fraud) | 1 in 100,000, at least one | 2,000 to 10,000 within 1 to 3 hours |
//!
//! The day is written a minute at a time, in time order: ordinary calls
//! follow the hour-of-day curve of the other populations, each call's
//! caller drawn in proportion to the callers' rates and its callee from
//! the whole population; a flood calls at an even rate through its own
//! hours. `rows` below the day's expected total thins every caller's calls
//! alike (a sample of the day, whose active callers are fewer than the
//! day's); memory holds the rates' running sum (8 bytes a subscriber) and
//! one minute's calls.

use std::path::Path;

use chrono_tz::Tz;
use rand::rngs::StdRng;
use rand::Rng;

use super::DAY_START_MS;
use super::{hour_weight, legit_call, maybe_answered, rng_of, sort_by_time, GenCall, Out, Written};
use crate::error::IoError;
use crate::offline::cdr::InputFormat;

/// Most subscribers a population may have: each gets a number of its own
/// among the 10^8 of `+346` followed by eight digits.
pub const MAX_SUBSCRIBERS: u64 = 100_000_000;

/// A stream tag for [`rng_of`], apart from the other populations'.
const TAG: u64 = 0x706f_7075_6c61_7469;

/// A subscriber's kind and daily calls.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Subscriber(f64),
    Pbx(f64),
    /// Calls, first minute of the day, minutes of calling.
    Flood(f64, u32, u32),
}

/// Subscriber `i`'s kind and rate (the same for a seed and `i`).
fn kind_of(seed: u64, i: u64) -> Kind {
    let mut rng = rng_of(&[seed, TAG, i]);
    let u: f64 = rng.random();
    if i == 0 || u < 1e-5 {
        let minutes = rng.random_range(60..=180);
        let start = rng.random_range(0..(24 * 60 - minutes));
        return Kind::Flood(rng.random_range(2_000.0..10_000.0), start, minutes);
    }
    if u < 1.0 / 200.0 {
        return Kind::Pbx((rng.random_range(50f64.ln()..500f64.ln())).exp());
    }
    // A standard normal (Box-Muller).
    let a: f64 = rng.random_range(f64::EPSILON..1.0);
    let b: f64 = rng.random();
    let z = (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos();
    Kind::Subscriber((2.0 * (0.9 * z).exp()).clamp(0.05, 80.0))
}

/// Subscriber `i`'s number: `+346` and eight digits, a different number
/// for every `i` below [`MAX_SUBSCRIBERS`] (multiplying by a number prime
/// to 10^8 permutes the residues), spread over the range.
pub fn number_of(i: u64) -> String {
    const SPREAD: u64 = 48_271_393; // odd, not a multiple of 5
    format!(
        "+346{:08}",
        (i % MAX_SUBSCRIBERS).wrapping_mul(SPREAD) % MAX_SUBSCRIBERS
    )
}

/// A flooding subscriber: its calls of the day, and the minutes it calls
/// through.
struct Flood {
    i: u64,
    calls: f64,
    minutes: std::ops::Range<usize>,
}

/// The population: the ordinary callers' rates, summed, the PBXs among
/// them and the floods.
struct Population {
    /// `sums[i]`: the daily calls of subscribers `0..=i` (floods 0).
    sums: Vec<f64>,
    /// The PBX trunks' subscribers, in order.
    pbxs: Vec<u64>,
    floods: Vec<Flood>,
}

impl Population {
    fn new(subscribers: u64, seed: u64) -> Self {
        let mut sums = Vec::with_capacity(subscribers as usize);
        let (mut total, mut pbxs, mut floods) = (0.0, Vec::new(), Vec::new());
        for i in 0..subscribers {
            match kind_of(seed, i) {
                Kind::Subscriber(r) => total += r,
                Kind::Pbx(r) => {
                    total += r;
                    pbxs.push(i);
                }
                Kind::Flood(calls, start, minutes) => floods.push(Flood {
                    i,
                    calls,
                    minutes: start as usize..(start + minutes) as usize,
                }),
            }
            sums.push(total);
        }
        Population { sums, pbxs, floods }
    }

    /// The ordinary callers' calls a day.
    fn ordinary(&self) -> f64 {
        self.sums.last().copied().unwrap_or(0.0)
    }

    fn flood_calls(&self) -> f64 {
        self.floods.iter().map(|f| f.calls).sum()
    }

    fn is_pbx(&self, i: u64) -> bool {
        self.pbxs.binary_search(&i).is_ok()
    }

    /// An ordinary caller drawn in proportion to the rates.
    fn draw(&self, rng: &mut StdRng) -> u64 {
        let u = rng.random_range(0.0..self.ordinary());
        let i = self.sums.partition_point(|&s| s <= u);
        i.min(self.sums.len().saturating_sub(1)) as u64
    }
}

/// What [`write_population`] wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PopulationWritten {
    /// Calls, and of those labelled fraud.
    pub written: Written,
    /// Subscribers with a PBX's rate.
    pub pbxs: u64,
    /// Flooding subscribers.
    pub floods: u64,
    /// The calls a whole day of the population makes (expected).
    pub day_calls: u64,
}

/// `n` scaled so that the whole of `k` of `total` gives the rounded
/// count of calls due by then: `due(k) - due(k - 1)` calls fall in step
/// `k`, and they add up to `n` exactly.
fn due(n: f64, k: f64, total: f64) -> u64 {
    (n * k / total).round() as u64
}

/// Writes a day of `subscribers` subscribers' calls (see the module): the
/// expected day's calls, or `rows` of them (a thinned day), as callguard's
/// CSV (`format` `None`) or a switch's call records.
pub fn write_population(
    path: &Path,
    subscribers: u64,
    rows: Option<u64>,
    seed: u64,
    format: Option<InputFormat>,
    tz: Tz,
) -> Result<PopulationWritten, IoError> {
    let subscribers = subscribers.clamp(1, MAX_SUBSCRIBERS);
    let pop = Population::new(subscribers, seed);
    let day = pop.ordinary() + pop.flood_calls();
    let share = rows.map_or(1.0, |r| r as f64 / day.max(1.0));
    let ordinary = pop.ordinary() * share;
    // The day's minutes weighed by the hour-of-day curve, summed.
    let weights: Vec<f64> = (0..24 * 60)
        .scan(0.0, |s, m| {
            *s += hour_weight(m / 60);
            Some(*s)
        })
        .collect();
    let all = weights.last().copied().unwrap_or(1.0);
    let mut out = Out::create(path, format, tz)?;
    let mut written = Written::default();
    let mut calls = Vec::new();
    for m in 0..24 * 60usize {
        let mut rng = rng_of(&[seed, TAG, u64::MAX, m as u64]);
        let before = if m == 0 { 0.0 } else { weights[m - 1] };
        let n = due(ordinary, weights[m], all) - due(ordinary, before, all);
        let t0 = DAY_START_MS + m as i64 * 60_000;
        for _ in 0..n {
            let caller = pop.draw(&mut rng);
            let pbx = pop.is_pbx(caller);
            calls.push(ordinary_call(caller, pbx, subscribers, t0, &mut rng));
        }
        for f in pop.floods.iter().filter(|f| f.minutes.contains(&m)) {
            let total = f.calls * share;
            let (k, len) = ((m - f.minutes.start) as f64, f.minutes.len() as f64);
            let n = due(total, k + 1.0, len) - due(total, k, len);
            for _ in 0..n {
                calls.push(flood_call(f.i, subscribers, t0, &mut rng));
            }
        }
        sort_by_time(&mut calls);
        written.calls += calls.len() as u64;
        written.fraud += calls.iter().filter(|c| c.fraud).count() as u64;
        let until = (m + 1 < 24 * 60).then_some(t0 + 60_000);
        out.calls(&calls, until)?;
        calls.clear();
    }
    out.finish()?;
    Ok(PopulationWritten {
        written,
        pbxs: pop.pbxs.len() as u64,
        floods: pop.floods.len() as u64,
        day_calls: day.round() as u64,
    })
}

/// A call of ordinary caller `i` (a PBX trunk's if `pbx`) within the
/// minute from `t0`.
fn ordinary_call(i: u64, pbx: bool, subscribers: u64, t0: i64, rng: &mut StdRng) -> GenCall {
    let shape = legit_call(rng);
    if pbx {
        call(
            i,
            subscribers,
            t0,
            rng,
            shape,
            "pbx",
            Some(format!("trunk{i}")),
        )
    } else {
        call(i, subscribers, t0, rng, shape, "subscriber", None)
    }
}

/// A flood's call within the minute from `t0`: short, seldom answered.
fn flood_call(i: u64, subscribers: u64, t0: i64, rng: &mut StdRng) -> GenCall {
    let shape = maybe_answered(rng, 0.15, 3_000..40_000);
    call(i, subscribers, t0, rng, shape, "flood", None)
}

/// Subscriber `i`'s call of `(ring, talk)` ms to a random subscriber, at a
/// random time of the minute from `t0`; fraud for a flood.
fn call(
    i: u64,
    subscribers: u64,
    t0: i64,
    rng: &mut StdRng,
    (ring_ms, talk_ms): (i64, i64),
    population: &'static str,
    account: Option<String>,
) -> GenCall {
    GenCall {
        caller: number_of(i),
        callee: number_of(rng.random_range(0..subscribers)),
        ts_ms: t0 + rng.random_range(0..60_000),
        ring_ms,
        talk_ms,
        fraud: population == "flood",
        population,
        account,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, HashSet};

    #[test]
    fn numbers_are_distinct() {
        let n: HashSet<String> = (0..200_000).map(number_of).collect();
        assert_eq!(n.len(), 200_000);
        assert!(n.iter().all(|s| s.len() == 12 && s.starts_with("+346")));
    }

    #[test]
    fn rates_are_heavy_tailed() {
        let kinds: Vec<Kind> = (0..200_000).map(|i| kind_of(7, i)).collect();
        let ordinary: Vec<f64> = kinds
            .iter()
            .filter_map(|k| match k {
                Kind::Subscriber(r) => Some(*r),
                _ => None,
            })
            .collect();
        let share = |f: &dyn Fn(f64) -> bool| {
            ordinary.iter().filter(|&&r| f(r)).count() as f64 / ordinary.len() as f64
        };
        let most = share(&|r| (0.5..=5.0).contains(&r));
        assert!(
            most > 0.6,
            "{most} of the subscribers make 0.5-5 calls a day"
        );
        let heavy = share(&|r| r > 8.0);
        assert!((0.02..0.1).contains(&heavy), "{heavy} over 8 a day");
        let pbxs = kinds.iter().filter(|k| matches!(k, Kind::Pbx(_))).count();
        assert!((700..1_300).contains(&pbxs), "{pbxs} PBXs in 200,000");
        let floods = kinds
            .iter()
            .filter(|k| matches!(k, Kind::Flood(..)))
            .count();
        assert!((1..=8).contains(&floods), "{floods} floods in 200,000");
    }

    fn read(path: &Path) -> Vec<(String, i64, String)> {
        let mut r = csv::Reader::from_path(path).unwrap();
        r.records()
            .map(|row| {
                let row = row.unwrap();
                let ts = chrono::DateTime::parse_from_rfc3339(&row[3])
                    .unwrap()
                    .timestamp_millis();
                (row[1].to_string(), ts, row[6].to_string())
            })
            .collect()
    }

    #[test]
    fn a_day_is_in_order_sized_and_thinned_alike() {
        let dir = tempfile::tempdir().unwrap();
        let whole = dir.path().join("day.csv");
        let w = write_population(&whole, 20_000, None, 3, None, Tz::UTC).unwrap();
        let rows = read(&whole);
        assert_eq!(rows.len() as u64, w.written.calls);
        let diff = (w.written.calls as f64 - w.day_calls as f64).abs();
        assert!(
            diff <= 2.0,
            "{} calls of {} expected",
            w.written.calls,
            w.day_calls
        );
        assert!(rows.windows(2).all(|p| p[0].1 <= p[1].1), "in time order");
        assert!(w.floods >= 1 && w.written.fraud > 0);
        let mut per: HashMap<&str, u64> = HashMap::new();
        for (caller, _, _) in &rows {
            *per.entry(caller.as_str()).or_default() += 1;
        }
        // Most active callers call a few times; the busiest (a flood) thousands.
        let few = per.values().filter(|&&n| n <= 5).count() as f64 / per.len() as f64;
        assert!(
            few > 0.7,
            "{few} of the active callers call at most 5 times"
        );
        assert!(per.values().max().copied().unwrap_or(0) >= 2_000);
        // Thinned to a tenth: a tenth of the calls, the same shape.
        let thin = dir.path().join("thin.csv");
        let t = write_population(&thin, 20_000, Some(w.day_calls / 10), 3, None, Tz::UTC).unwrap();
        assert!((t.written.calls as i64 - (w.day_calls / 10) as i64).abs() <= 2);
        let fraud_share = |x: &PopulationWritten| x.written.fraud as f64 / x.written.calls as f64;
        assert!((fraud_share(&t) - fraud_share(&w)).abs() < 0.02);
        // The same seed writes the same day.
        let again = dir.path().join("again.csv");
        write_population(&again, 20_000, None, 3, None, Tz::UTC).unwrap();
        assert_eq!(
            std::fs::read(&whole).unwrap(),
            std::fs::read(&again).unwrap()
        );
    }
}
