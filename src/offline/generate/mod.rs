//! `callguard generate`: a synthetic, labelled call log.
//!
//! Populations and rates follow published figures on telephone traffic:
//!
//! | population | label | shape |
//! |---|---|---|
//! | subscriber | legit | a few calls a day, daytime-heavy; redials in 2-3 call bursts 10-60 s apart |
//! | pbx | legit | business PBX trunk (an `account`) calling from 1-6 numbers: 0.5-5 calls/min in business hours, steady |
//! | dialer | legit | call centre on one caller ID: ~8 calls/min in shifts (allowlist candidate) |
//! | robocaller | fraud | one number at 5-10 calls/min for 10-60 min, short calls |
//! | wangiri | fraud | one-ring bursts at 3-5 calls/s for 30 s to 3 min, at night, every callee distinct, some calls in the same millisecond |
//! | irsf | fraud | a hacked PBX trunk at night (Madrid time), dialing out from 2-4 of its numbers: a few short test calls, then 5-30 min calls to premium ranges ([`IRSF_RANGES`]) holding 20-60 open at once for 20-120 min, a new number every ~10 calls |
//! | pbx_burst | legit | a PBX dialing its queue: 10-25 calls within seconds at 09:00 Madrid time and two or three more bursts in the day, quiet in between |
//! | harasser | fraud | one caller calling one callee again and again: 8-30 calls, 2-10 min apart, mostly unanswered |
//! | tdos | fraud | only with `--tdos N`: N calls at ~40/s to one victim ([`TDOS_VICTIM`]) from N/8 spoofed callers, from 11:00 UTC |
//!
//! Every call rings before it is answered or given up: an answered call
//! 2-12 s, an unanswered one 8-40 s (a wangiri call one ring, 1-4 s).
//! Ordinary calls (subscribers, PBXs) go unanswered 30% of the time and
//! talk a log-normal while otherwise, median 2 min: three in four last 30 s
//! to 5 min.
//!
//! The log covers one day from 2025-12-01T00:00:00Z. Columns: `call_id`,
//! `caller`, `callee`, `ts` (RFC 3339, milliseconds), `duration_ms` (attempt
//! to hang-up: ringing and talk), `label` (`fraud`/`legit`), `population`,
//! `talk_ms` (the answered time, 0 when unanswered) and `account` (the PBX
//! trunk, empty for calls made through none).

use std::io::Write;
use std::path::Path;

use chrono::{DateTime, SecondsFormat};
use chrono_tz::Tz;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::IoError;
use crate::offline::cdr::InputFormat;

pub mod population;

/// Start of the generated day (2025-12-01T00:00:00Z), epoch ms.
pub const DAY_START_MS: i64 = 1_764_547_200_000;
const DAY_MS: i64 = 86_400_000;

/// A generated call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenCall {
    /// Caller, E.164.
    pub caller: String,
    /// Callee, E.164.
    pub callee: String,
    /// Event time, epoch ms.
    pub ts_ms: i64,
    /// Ringing time before the answer or the hang-up, ms.
    pub ring_ms: i64,
    /// Talk time, ms (0: unanswered).
    pub talk_ms: i64,
    /// Fraud or not.
    pub fraud: bool,
    /// Population name.
    pub population: &'static str,
    /// The customer or SIP trunk billed for the call: a PBX's trunk, which
    /// calls from several numbers (DIDs); `None` for a subscriber's call.
    pub account: Option<String>,
}

impl GenCall {
    /// Attempt to hang-up, ms: ringing and talk.
    pub fn duration_ms(&self) -> i64 {
        self.ring_ms + self.talk_ms
    }

    /// Whether the call was answered.
    pub fn answered(&self) -> bool {
        self.talk_ms > 0
    }
}

/// An answered call's ringing and talk times: it rings 2-12 s first.
fn answered(rng: &mut StdRng, talk_ms: i64) -> (i64, i64) {
    (rng.random_range(2_000..12_000), talk_ms)
}

/// An unanswered call's ringing and talk times: rung 8-40 s, given up.
fn unanswered(rng: &mut StdRng) -> (i64, i64) {
    (rng.random_range(8_000..40_000), 0)
}

/// Answered with probability `p`, talking a uniform `talk` ms then.
fn maybe_answered(rng: &mut StdRng, p: f64, talk: std::ops::Range<i64>) -> (i64, i64) {
    if rng.random_bool(p) {
        let t = rng.random_range(talk);
        answered(rng, t)
    } else {
        unanswered(rng)
    }
}

/// The callee of the TDoS attack [`add_tdos`] writes (a hospital's
/// switchboard, say).
pub const TDOS_VICTIM: &str = "+34915550100";

/// When the TDoS attack starts: 11:00 UTC of the generated day.
pub const TDOS_START_MS: i64 = DAY_START_MS + 11 * HOUR_MS;

/// Adds a telephony denial-of-service attack of `count` calls to `calls`
/// (kept sorted): about 40 calls a second to [`TDOS_VICTIM`] from
/// `count / 8` (at least 10) spoofed callers, each calling a few times,
/// from [`TDOS_START_MS`]; labelled fraud, population `tdos`. No caller
/// stands out: only a limit on the callee stops it.
pub fn add_tdos(calls: &mut Vec<GenCall>, count: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x7d05);
    let callers: Vec<String> = (0..(count / 8).max(10))
        .map(|_| number(&mut rng, "+4420", 8))
        .collect();
    let mut t = TDOS_START_MS;
    for _ in 0..count {
        t += rng.random_range(0..50);
        let (ring_ms, talk_ms) = maybe_answered(&mut rng, 0.3, 1_000..20_000);
        calls.push(GenCall {
            caller: callers[rng.random_range(0..callers.len())].clone(),
            callee: TDOS_VICTIM.into(),
            ts_ms: t,
            ring_ms,
            talk_ms,
            fraud: true,
            population: "tdos",
            account: None,
        });
    }
    sort_by_time(calls);
}

/// Adds day `day`'s low-and-slow dialers to `calls` (kept sorted):
/// `callers` numbers, new every day, each working through a list at night
/// (00:00 to 05:00 UTC) for one to two hours, a call every 20 to 40 s, each
/// to a new subscriber, rarely answered; labelled fraud, population
/// `low_and_slow`. Every caller stays under every limit of
/// `data/rules.toml` (at most 3 a minute, 180 an hour): the rules alone miss
/// them, while their features (calls in the hour, distinct callees, the
/// gap since the previous call, the hour of the night) set them apart from
/// the subscribers and PBXs the generator makes.
pub fn add_low_and_slow(calls: &mut Vec<GenCall>, callers: usize, seed: u64, day: u64) {
    let day0 = DAY_START_MS.saturating_add((day as i64).saturating_mul(DAY_MS));
    for id in 0..callers as u64 {
        let mut who = rng_of(&[seed, 0x51_0e, id, day + 1]);
        let mut rng = rng_of(&[seed, 0x51_0e, id, day + 1, day, 1]);
        let caller = subscriber_number(&mut who);
        let gap = rng.random_range(20_000..40_000);
        let mut t = day0 + rng.random_range(0..5 * HOUR_MS);
        let end = t + rng.random_range(HOUR_MS..2 * HOUR_MS);
        while t < end {
            let (ring_ms, talk_ms) = maybe_answered(&mut rng, 0.05, 2_000..20_000);
            calls.push(GenCall {
                caller: caller.clone(),
                callee: subscriber_number(&mut rng),
                ts_ms: t,
                ring_ms,
                talk_ms,
                fraud: true,
                population: "low_and_slow",
                account: None,
            });
            // A machine's pace: the same gap, a second's jitter either way.
            t += gap + rng.random_range(-1_000..=1_000);
        }
    }
    sort_by_time(calls);
}

/// The log's order: by time, calls at the same millisecond by caller.
fn sort_by_time(calls: &mut [GenCall]) {
    calls.sort_by(|a, b| a.ts_ms.cmp(&b.ts_ms).then_with(|| a.caller.cmp(&b.caller)));
}

/// Generates about `rows` calls (exactly `rows` unless `rows` is tiny), sorted by time.
pub fn generate(rows: usize, seed: u64) -> Vec<GenCall> {
    generate_day(rows, seed, 0)
}

/// The populations and their shares of the calls, in the order they are
/// made.
const SHARES: [(&str, f64); 8] = [
    ("subscriber", 0.51),
    ("pbx", 0.18),
    ("dialer", 0.10),
    ("robocaller", 0.11),
    ("wangiri", 0.06),
    ("irsf", 0.02),
    ("pbx_burst", 0.01),
    ("harasser", 0.01),
];

/// Whether a population is fraud: a fraudster calls from new numbers every
/// day, an ordinary caller from the same ones.
fn rotates(population: &str) -> bool {
    matches!(population, "robocaller" | "wangiri" | "irsf" | "harasser")
}

/// A generator seeded by `parts` (SplitMix64 over them), so each caller's
/// number and each caller's day have a stream of their own.
fn rng_of(parts: &[u64]) -> StdRng {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for &p in parts {
        x ^= p;
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 31;
    }
    StdRng::seed_from_u64(x)
}

/// Day `day` (0 from [`DAY_START_MS`]) of a log of `rows` calls a day,
/// sorted by time. The callers of a population are numbered from 1 every
/// day, and caller `n` of an ordinary population has the same number on
/// every day (its calls differ): the same subscribers, PBXs and call
/// centres day after day, while fraud comes from new numbers.
pub fn generate_day(rows: usize, seed: u64, day: u64) -> Vec<GenCall> {
    let day0 = DAY_START_MS.saturating_add((day as i64).saturating_mul(DAY_MS));
    let mut calls = Vec::with_capacity(rows + 1024);
    for (k, (pop, share)) in SHARES.into_iter().enumerate() {
        let target = ((rows as f64) * share).round() as usize;
        let start = calls.len();
        let mut id = 0u64;
        while calls.len() - start < target {
            id += 1;
            let identity = if rotates(pop) { day + 1 } else { 0 };
            let mut who = rng_of(&[seed, k as u64, id, identity]);
            let mut rng = rng_of(&[seed, k as u64, id, identity, day, 1]);
            let (who, rng, out) = (&mut who, &mut rng, &mut calls);
            match pop {
                "subscriber" => subscriber(who, rng, day0, out),
                "pbx" => pbx(who, rng, day0, out),
                "dialer" => dialer(who, rng, day0, out),
                "robocaller" => robocaller(who, rng, day0, out),
                "wangiri" => wangiri(who, rng, day0, out),
                "irsf" => irsf(who, rng, day0, out),
                "pbx_burst" => pbx_burst(who, rng, day0, out),
                _ => harasser(who, rng, day0, out),
            }
        }
        calls.truncate(start + target);
    }
    sort_by_time(&mut calls);
    calls
}

fn number(rng: &mut StdRng, prefix: &str, digits: usize) -> String {
    let mut s = String::from(prefix);
    for _ in 0..digits {
        s.push(char::from(b'0' + rng.random_range(0..10u8)));
    }
    s
}

fn subscriber_number(rng: &mut StdRng) -> String {
    if rng.random_bool(0.7) {
        number(rng, "+346", 8)
    } else {
        number(rng, "+349", 8)
    }
}

/// Hour-of-day weight for ordinary callers (quiet at night, peaks late morning and evening).
fn hour_weight(hour: i64) -> f64 {
    const W: [f64; 24] = [
        0.1, 0.05, 0.03, 0.03, 0.05, 0.1, 0.3, 0.6, 0.9, 1.0, 1.0, 1.0, 0.9, 0.8, 0.8, 0.9, 1.0,
        1.0, 1.0, 0.9, 0.8, 0.6, 0.4, 0.2,
    ];
    W[(hour.rem_euclid(24)) as usize]
}

fn daytime_ts(rng: &mut StdRng, day0: i64) -> i64 {
    loop {
        let t = rng.random_range(0..DAY_MS);
        if rng.random::<f64>() < hour_weight(t / 3_600_000) {
            return day0 + t;
        }
    }
}

/// An ordinary call's ringing and talk: unanswered 30% of the time;
/// answered, a log-normal talk of median 2 min and sigma 1 (three in four
/// between 30 s and 5 min), 3 s to 2 h.
fn legit_call(rng: &mut StdRng) -> (i64, i64) {
    if rng.random_bool(0.3) {
        return unanswered(rng);
    }
    // A standard normal (Box-Muller).
    let u: f64 = rng.random_range(f64::EPSILON..1.0);
    let v: f64 = rng.random();
    let z = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
    let talk = (120_000.0 * z.exp()).clamp(3_000.0, 7_200_000.0) as i64;
    answered(rng, talk)
}

fn subscriber(who: &mut StdRng, rng: &mut StdRng, day0: i64, out: &mut Vec<GenCall>) {
    let caller = subscriber_number(who);
    let n = rng.random_range(1..=6);
    for _ in 0..n {
        let mut t = daytime_ts(rng, day0);
        let callee = subscriber_number(rng);
        let redials = if rng.random_bool(0.2) {
            rng.random_range(1..=2)
        } else {
            0
        };
        for _ in 0..=redials {
            let (ring_ms, talk_ms) = legit_call(rng);
            out.push(GenCall {
                caller: caller.clone(),
                callee: callee.clone(),
                ts_ms: t,
                ring_ms,
                talk_ms,
                fraud: false,
                population: "subscriber",
                account: None,
            });
            t += rng.random_range(10_000..60_000);
        }
    }
}

/// A PBX's SIP trunk: its account and the numbers (DIDs) it calls from,
/// `base` followed by `00`, `01`, ... (at least one).
struct Trunk {
    account: String,
    dids: Vec<String>,
}

impl Trunk {
    /// A trunk of `dids` numbers on `+3491` and five random digits.
    fn new(who: &mut StdRng, dids: usize) -> Self {
        let base = number(who, "+3491", 5);
        Trunk {
            account: format!("trunk-{}", &base[1..]),
            dids: (0..dids.max(1)).map(|k| format!("{base}{k:02}")).collect(),
        }
    }

    /// The number a call goes out from.
    fn did(&self, rng: &mut StdRng) -> String {
        self.dids[rng.random_range(0..self.dids.len())].clone()
    }
}

fn pbx(who: &mut StdRng, rng: &mut StdRng, day0: i64, out: &mut Vec<GenCall>) {
    // (A PBX's size is its own: the same numbers and rate every day.)
    let dids = who.random_range(1..=6);
    let trunk = Trunk::new(who, dids);
    let per_min = who.random_range(0.5..5.0);
    let mean_gap = 60_000.0 / per_min;
    let mut t = day0 + 9 * 3_600_000 + rng.random_range(0..1_800_000);
    let end = day0 + 18 * 3_600_000;
    while t < end {
        let (ring_ms, talk_ms) = legit_call(rng);
        out.push(GenCall {
            caller: trunk.did(rng),
            callee: subscriber_number(rng),
            ts_ms: t,
            ring_ms,
            talk_ms,
            fraud: false,
            population: "pbx",
            account: Some(trunk.account.clone()),
        });
        t += exp_gap(rng, mean_gap);
    }
}

fn dialer(who: &mut StdRng, rng: &mut StdRng, day0: i64, out: &mut Vec<GenCall>) {
    let caller = number(who, "+34900", 6);
    let shift_start = day0 + rng.random_range(8..13) * 3_600_000;
    let end = shift_start + 4 * 3_600_000;
    let mean_gap = 60_000.0 / rng.random_range(6.0..10.0);
    let mut t = shift_start;
    while t < end {
        let (ring_ms, talk_ms) = maybe_answered(rng, 0.3, 10_000..300_000);
        out.push(GenCall {
            caller: caller.clone(),
            callee: subscriber_number(rng),
            ts_ms: t,
            ring_ms,
            talk_ms,
            fraud: false,
            population: "dialer",
            account: None,
        });
        t += exp_gap(rng, mean_gap);
    }
}

fn robocaller(who: &mut StdRng, rng: &mut StdRng, day0: i64, out: &mut Vec<GenCall>) {
    let caller = if who.random_bool(0.5) {
        number(who, "+1", 10)
    } else {
        number(who, "+3461", 7)
    };
    let start = daytime_ts(rng, day0);
    let end = start + rng.random_range(10..60) * 60_000;
    let mean_gap = 60_000.0 / rng.random_range(5.0..10.0);
    let mut t = start;
    while t < end {
        let (ring_ms, talk_ms) = maybe_answered(rng, 0.15, 3_000..40_000);
        out.push(GenCall {
            caller: caller.clone(),
            callee: subscriber_number(rng),
            ts_ms: t,
            ring_ms,
            talk_ms,
            fraud: true,
            population: "robocaller",
            account: None,
        });
        t += exp_gap(rng, mean_gap);
    }
}

fn wangiri(who: &mut StdRng, rng: &mut StdRng, day0: i64, out: &mut Vec<GenCall>) {
    let prefix = ["+882", "+216", "+373", "+269"][who.random_range(0..4)];
    let caller = number(who, prefix, 8);
    // At night: 22:00 to 04:00.
    let start = day0 + (22 * 3_600_000 + rng.random_range(0..6 * 3_600_000)) % DAY_MS;
    let end = start + rng.random_range(30_000..180_000);
    let mean_gap = 1_000.0 / rng.random_range(3.0..5.0);
    let mut t = start;
    while t < end {
        // Several SIP legs can be stamped in the same millisecond.
        let legs = if rng.random_bool(0.1) { 2 } else { 1 };
        for _ in 0..legs {
            out.push(GenCall {
                caller: caller.clone(),
                callee: subscriber_number(rng),
                ts_ms: t,
                // One ring, then hung up.
                ring_ms: rng.random_range(1_000..4_000),
                talk_ms: 0,
                fraud: true,
                population: "wangiri",
                account: None,
            });
        }
        t += exp_gap(rng, mean_gap);
    }
}

/// Premium-rate and high-cost ranges IRSF pumps traffic to (satellite and
/// international networks, high-termination countries): the generator's
/// and `data/irsf-ranges.txt`'s example list.
pub const IRSF_RANGES: [&str; 6] = ["+881", "+882", "+883", "+53", "+252", "+232"];

const HOUR_MS: i64 = 3_600_000;

fn irsf(who: &mut StdRng, rng: &mut StdRng, day0: i64, out: &mut Vec<GenCall>) {
    // A hacked PBX: the attacker dials out from its trunk's 2-4 numbers.
    let dids = who.random_range(2..=4);
    let trunk = Trunk::new(who, dids);
    // 22:00 to 05:00 in Madrid (UTC+1 in December).
    let mut t = day0 + (21 * HOUR_MS + rng.random_range(0..7 * HOUR_MS)) % DAY_MS;
    // The attack lasts 20 to 120 minutes and holds 20 to 60 premium calls
    // open at once: calls of 5 to 30 minutes (17.5 on average), one every
    // 17.5 minutes / the calls held.
    let end = t + rng.random_range(20 * 60_000..120 * 60_000);
    let range = IRSF_RANGES[rng.random_range(0..IRSF_RANGES.len())];
    let mut callee = number(rng, range, 7);
    let held: f64 = rng.random_range(20.0..60.0);
    let mean_gap = 17.5 * 60_000.0 / held;
    let mut n = 0;
    while t < end {
        // A few short test calls first, then long ones; a new number
        // every ten calls or so.
        let test_call = n < 3;
        if n > 0 && rng.random_bool(0.1) {
            callee = number(rng, range, 7);
        }
        out.push(GenCall {
            caller: trunk.did(rng),
            callee: callee.clone(),
            ts_ms: t,
            // (Premium numbers answer at once.)
            ring_ms: rng.random_range(1_000..4_000),
            talk_ms: if test_call {
                rng.random_range(5_000..20_000)
            } else {
                rng.random_range(300_000..1_800_000)
            },
            fraud: true,
            population: "irsf",
            account: Some(trunk.account.clone()),
        });
        n += 1;
        t += exp_gap(rng, mean_gap);
    }
}

fn pbx_burst(who: &mut StdRng, rng: &mut StdRng, day0: i64, out: &mut Vec<GenCall>) {
    let caller = number(who, "+3493", 5) + "00";
    // 09:00 in Madrid, then two or three more bursts in business hours.
    let mut starts = vec![day0 + 8 * HOUR_MS + rng.random_range(0..60_000)];
    for _ in 0..rng.random_range(2..=3) {
        starts.push(day0 + rng.random_range(9 * HOUR_MS..17 * HOUR_MS));
    }
    for start in starts {
        let mut t = start;
        for _ in 0..rng.random_range(10..=25) {
            let (ring_ms, talk_ms) = legit_call(rng);
            out.push(GenCall {
                caller: caller.clone(),
                callee: subscriber_number(rng),
                ts_ms: t,
                ring_ms,
                talk_ms,
                fraud: false,
                population: "pbx_burst",
                account: None,
            });
            t += rng.random_range(50..800);
        }
    }
}

fn harasser(who: &mut StdRng, rng: &mut StdRng, day0: i64, out: &mut Vec<GenCall>) {
    let caller = subscriber_number(who);
    let callee = subscriber_number(who);
    let mut t = daytime_ts(rng, day0);
    for _ in 0..rng.random_range(8..=30) {
        let (ring_ms, talk_ms) = maybe_answered(rng, 0.2, 2_000..15_000);
        out.push(GenCall {
            caller: caller.clone(),
            callee: callee.clone(),
            ts_ms: t,
            ring_ms,
            talk_ms,
            fraud: true,
            population: "harasser",
            account: None,
        });
        t += rng.random_range(120_000..600_000);
    }
}

fn exp_gap(rng: &mut StdRng, mean_ms: f64) -> i64 {
    let u: f64 = rng.random_range(f64::EPSILON..1.0);
    (-u.ln() * mean_ms).max(1.0) as i64
}

/// Traffic [`write_days`] adds to the populations' own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Extra {
    /// Calls of a TDoS attack on the first day ([`add_tdos`]).
    pub tdos: usize,
    /// Low-and-slow dialers a day ([`add_low_and_slow`]).
    pub low_and_slow: usize,
}

/// What [`write_days`] wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Written {
    /// Calls.
    pub calls: u64,
    /// Of which labelled fraud.
    pub fraud: u64,
}

/// Writes `days` days of `rows` calls each ([`generate_day`]; `tdos`
/// calls of a TDoS attack added to the first, see [`add_tdos`]) as
/// callguard's CSV (`format` `None`) or a switch's call records, a day at
/// a time: memory holds one day's calls (and those after midnight, which
/// go with the next day's), whatever the number of days. The log is in
/// time order throughout; call ids run on across days.
pub fn write_days(
    path: &Path,
    rows: usize,
    seed: u64,
    days: u64,
    extra: Extra,
    format: Option<InputFormat>,
    tz: Tz,
) -> Result<Written, IoError> {
    let mut out = Out::create(path, format, tz)?;
    let mut written = Written::default();
    // Calls of the days before that start after midnight.
    let mut carried: Vec<GenCall> = Vec::new();
    for day in 0..days {
        let mut calls = generate_day(rows, seed, day);
        if day == 0 && extra.tdos > 0 {
            add_tdos(&mut calls, extra.tdos, seed);
        }
        if extra.low_and_slow > 0 {
            add_low_and_slow(&mut calls, extra.low_and_slow, seed, day);
        }
        written.calls += calls.len() as u64;
        written.fraud += calls.iter().filter(|c| c.fraud).count() as u64;
        if !carried.is_empty() {
            calls.append(&mut carried);
            sort_by_time(&mut calls);
        }
        // Every later call starts, and is written, after this day ends.
        let next_day = DAY_START_MS.saturating_add(((day + 1) as i64).saturating_mul(DAY_MS));
        let until = (day + 1 < days).then_some(next_day);
        if let Some(u) = until {
            carried = calls.split_off(calls.partition_point(|c| c.ts_ms < u));
        }
        out.calls(&calls, until)?;
    }
    out.finish()?;
    Ok(written)
}

/// Writes calls as CSV; call ids are `c<row>` in time order.
pub fn write_csv(path: &Path, calls: &[GenCall]) -> Result<(), IoError> {
    Out::write_all(path, calls, None, Tz::UTC)
}

/// Writes `calls` as a switch's call records (`format` one of the
/// presets), times in the switch's local time `tz`: what that switch would
/// have logged for them, its ringing and talk in whole seconds (as
/// switches log them: `billsec` the talk, `duration` both). Asterisk and FreeSWITCH
/// write a row at hangup, so rows are in order of end; Kamailio `acc`
/// logs the INVITE transaction when it ends and, for an answered call,
/// the BYE at hangup.
pub fn write_cdr(
    path: &Path,
    calls: &[GenCall],
    format: InputFormat,
    tz: Tz,
) -> Result<(), IoError> {
    Out::write_all(path, calls, Some(format), tz)
}

/// A generated log being written: callguard's CSV, or a switch's call
/// records with the rows not yet due (a switch writes a row when the call
/// ends).
struct Out {
    path: std::path::PathBuf,
    /// Calls written so far (the next call id's number, less one).
    n: usize,
    to: To,
}

enum To {
    Csv(std::io::BufWriter<std::fs::File>),
    Cdr {
        w: Box<csv::Writer<std::fs::File>>,
        format: InputFormat,
        tz: Tz,
        /// Rows not written yet, each with the time the switch writes it.
        pending: Vec<(i64, Vec<String>)>,
    },
}

impl Out {
    fn create(path: &Path, format: Option<InputFormat>, tz: Tz) -> Result<Self, IoError> {
        let err = |source| IoError::Io {
            context: format!("writing {}", path.display()),
            source,
        };
        let file = std::fs::File::create(path).map_err(err)?;
        let to = match format {
            None => {
                let mut w = std::io::BufWriter::new(file);
                writeln!(
                    w,
                    "call_id,caller,callee,ts,duration_ms,label,population,talk_ms,account"
                )
                .map_err(err)?;
                To::Csv(w)
            }
            Some(format) => {
                let quote = match format {
                    // Asterisk also leaves `duration` and `billsec` unquoted;
                    // readers take either.
                    InputFormat::FreeSwitch | InputFormat::Asterisk => csv::QuoteStyle::Always,
                    _ => csv::QuoteStyle::Necessary,
                };
                let w = Box::new(
                    csv::WriterBuilder::new()
                        .quote_style(quote)
                        .flexible(true)
                        .from_writer(file),
                );
                To::Cdr {
                    w,
                    format,
                    tz,
                    pending: Vec::new(),
                }
            }
        };
        Ok(Out {
            path: path.to_path_buf(),
            n: 0,
            to,
        })
    }

    /// `calls` written whole to `path`.
    fn write_all(
        path: &Path,
        calls: &[GenCall],
        format: Option<InputFormat>,
        tz: Tz,
    ) -> Result<(), IoError> {
        let mut out = Out::create(path, format, tz)?;
        out.calls(calls, None)?;
        out.finish()
    }

    fn err(&self, source: std::io::Error) -> IoError {
        IoError::Io {
            context: format!("writing {}", self.path.display()),
            source,
        }
    }

    /// Writes `calls` (sorted by time, after every call written before);
    /// call records due before `until` (all without it) are written, the
    /// rest kept for later.
    fn calls(&mut self, calls: &[GenCall], until: Option<i64>) -> Result<(), IoError> {
        let first = self.n;
        self.n += calls.len();
        match &mut self.to {
            To::Csv(w) => {
                let res =
                    (calls.iter().enumerate()).try_for_each(|(i, c)| csv_row(w, first + i, c));
                res.map_err(|e| self.err(e))
            }
            To::Cdr {
                w,
                format,
                tz,
                pending,
            } => {
                for (i, c) in calls.iter().enumerate() {
                    pending.extend(cdr_rows(first + i, c, *format, *tz));
                }
                // (Stable: rows written at the same time keep call order.)
                pending.sort_by_key(|(written, _)| *written);
                let due = until.map_or(pending.len(), |u| {
                    pending.partition_point(|(written, _)| *written < u)
                });
                let res = (pending.drain(..due)).try_for_each(|(_, row)| w.write_record(&row));
                res.map_err(|e| self.err(e.into()))
            }
        }
    }

    fn finish(mut self) -> Result<(), IoError> {
        let res = match &mut self.to {
            To::Csv(w) => w.flush(),
            To::Cdr { w, .. } => w.flush(),
        };
        res.map_err(|e| self.err(e))
    }
}

/// One row of callguard's CSV: call `i` (0-based; its id is `c<i + 1>`).
fn csv_row(w: &mut impl Write, i: usize, c: &GenCall) -> std::io::Result<()> {
    let ts = DateTime::from_timestamp_millis(c.ts_ms)
        .map(|d| d.to_rfc3339_opts(SecondsFormat::Millis, true))
        .unwrap_or_else(|| c.ts_ms.to_string());
    let label = if c.fraud { "fraud" } else { "legit" };
    writeln!(
        w,
        "c{},{},{},{},{},{},{},{},{}",
        i + 1,
        c.caller,
        c.callee,
        ts,
        c.duration_ms(),
        label,
        c.population,
        c.talk_ms,
        c.account.as_deref().unwrap_or("")
    )
}

/// The rows a switch logs for call `i`, each with the time it is written.
fn cdr_rows(i: usize, c: &GenCall, format: InputFormat, tz: Tz) -> Vec<(i64, Vec<String>)> {
    let local = |ms: i64| {
        DateTime::from_timestamp_millis(ms)
            .map(|d| d.with_timezone(&tz).format("%Y-%m-%d %H:%M:%S").to_string())
            .unwrap_or_default()
    };
    let answered = c.answered();
    let billsec = c.talk_ms / 1000;
    let answer_ms = c.ts_ms + c.ring_ms / 1000 * 1000;
    let end_ms = answer_ms + if answered { billsec * 1000 } else { 0 };
    let total = (end_ms - c.ts_ms) / 1000;
    let start = local(c.ts_ms);
    let answer = if answered {
        local(answer_ms)
    } else {
        String::new()
    };
    let end = local(end_ms);
    let account = c.account.clone().unwrap_or_default();
    let n = |v: i64| v.to_string();
    match format {
        InputFormat::Asterisk => vec![(
            end_ms,
            vec![
                // accountcode
                account.clone(),
                c.caller.clone(),
                c.callee.clone(),
                "from-trunk".into(),
                format!("\"\" <{}>", c.caller),
                format!("SIP/trunk-{i:08x}"),
                if answered {
                    format!("SIP/out-{i:08x}")
                } else {
                    String::new()
                },
                "Dial".into(),
                format!("SIP/out/{}", c.callee),
                start,
                answer,
                end,
                n(total),
                n(billsec),
                if answered { "ANSWERED" } else { "NO ANSWER" }.into(),
                "DOCUMENTATION".into(),
                format!("{}.{i}", c.ts_ms / 1000),
                String::new(),
            ],
        )],
        InputFormat::FreeSwitch => vec![(
            end_ms,
            vec![
                String::new(),
                c.caller.clone(),
                c.callee.clone(),
                "default".into(),
                start,
                answer,
                end,
                n(total),
                n(billsec),
                if answered {
                    "NORMAL_CLEARING"
                } else {
                    "NO_ANSWER"
                }
                .into(),
                format!(
                    "{:08x}-{:04x}-4000-8000-{:012x}",
                    c.ts_ms / 1000,
                    i >> 48,
                    i
                ),
                String::new(),
                // accountcode
                account,
                "PCMA".into(),
                "PCMA".into(),
            ],
        )],
        _ => {
            let call_id = format!("{i:x}-gen@pbx.example");
            let row = |method: &str, code: &str, reason: &str, time: String| {
                vec![
                    method.to_string(),
                    format!("f{i:x}"),
                    format!("t{i:x}"),
                    call_id.clone(),
                    code.to_string(),
                    reason.to_string(),
                    time,
                    c.caller.clone(),
                    c.callee.clone(),
                    "127.0.0.1".to_string(),
                ]
            };
            let mut rows = vec![(
                answer_ms,
                if answered {
                    row("INVITE", "200", "OK", start)
                } else {
                    row("INVITE", "487", "Request Terminated", start)
                },
            )];
            if answered {
                rows.push((end_ms, row("BYE", "200", "OK", end)));
            }
            rows
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_deterministic_and_sized() {
        let a = generate(5_000, 7);
        let b = generate(5_000, 7);
        assert_eq!(a, b);
        assert_eq!(a.len(), 5_000);
        assert!(a.windows(2).all(|w| w[0].ts_ms <= w[1].ts_ms));
        let fraud = a.iter().filter(|c| c.fraud).count();
        assert!(fraud > 500 && fraud < 1_500, "fraud share off: {fraud}");
        assert!(a
            .windows(2)
            .any(|w| w[0].ts_ms == w[1].ts_ms && w[0].caller == w[1].caller));
        assert_ne!(generate(5_000, 8), a);
    }

    /// Over several days the ordinary callers are the same people, fraud
    /// comes from new numbers, and the first day is the one-day log.
    #[test]
    fn days_keep_their_population_and_rotate_fraud() {
        let numbers = |day: u64, pop: &str| -> std::collections::HashSet<String> {
            generate_day(20_000, 5, day)
                .into_iter()
                .filter(|c| c.population == pop)
                .map(|c| c.caller)
                .collect()
        };
        let accounts = |day: u64| -> std::collections::HashSet<String> {
            generate_day(20_000, 5, day)
                .into_iter()
                .filter(|c| c.population == "pbx")
                .filter_map(|c| c.account)
                .collect()
        };
        let (subs0, subs1) = (numbers(0, "subscriber"), numbers(1, "subscriber"));
        let kept = subs0.intersection(&subs1).count();
        assert!(
            kept * 10 >= subs0.len() * 9,
            "{kept} of {} subscribers call again the next day",
            subs0.len()
        );
        let (trunks0, trunks1) = (accounts(0), accounts(1));
        assert!(!trunks0.is_empty());
        assert!(
            trunks0.intersection(&trunks1).count() + 1 >= trunks0.len(),
            "{trunks0:?} {trunks1:?}"
        );
        for pop in ["robocaller", "wangiri", "irsf"] {
            let (f0, f1) = (numbers(0, pop), numbers(1, pop));
            assert!(!f0.is_empty(), "{pop}");
            assert_eq!(f0.intersection(&f1).count(), 0, "{pop}");
        }
        let day1 = generate_day(20_000, 5, 1);
        assert_eq!(day1.len(), 20_000);
        // (A burst or an attack that starts late runs past midnight.)
        assert!(day1.iter().all(|c| (DAY_START_MS + DAY_MS
            ..DAY_START_MS + 2 * DAY_MS + 3 * HOUR_MS)
            .contains(&c.ts_ms)));
        assert_eq!(generate_day(3_000, 5, 0), generate(3_000, 5));
    }

    /// `write_days` writes the days in time order, ids running on, the
    /// first day's calls before midnight as in the one-day log; a switch's
    /// records stay in the order the switch writes them across midnight.
    #[test]
    fn written_days_run_on_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let three = dir.path().join("3.csv");
        let w = write_days(&three, 2_000, 9, 3, Extra::default(), None, Tz::UTC).unwrap();
        assert_eq!(w.calls, 6_000);
        let text = std::fs::read_to_string(&three).unwrap();
        let rows: Vec<Vec<&str>> = text
            .lines()
            .skip(1)
            .map(|l| l.split(',').collect())
            .collect();
        assert_eq!(rows.len(), 6_000);
        for (i, r) in rows.iter().enumerate() {
            assert_eq!(r[0], format!("c{}", i + 1));
        }
        assert!(
            rows.windows(2).all(|w| w[0][3] <= w[1][3]),
            "out of time order"
        );
        // (RFC 3339 text in UTC sorts as the times do.)
        let midnight = "2025-12-02T";
        let before: Vec<(&str, &str, &str)> = rows
            .iter()
            .filter(|r| r[3] < midnight)
            .map(|r| (r[1], r[2], r[3]))
            .collect();
        let one: Vec<(String, String, i64)> = generate(2_000, 9)
            .into_iter()
            .filter(|c| c.ts_ms < DAY_START_MS + DAY_MS)
            .map(|c| (c.caller, c.callee, c.ts_ms))
            .collect();
        assert!(one.len() > 1_900);
        let pairs = |v: Vec<(String, String)>| v;
        assert_eq!(
            pairs(
                before
                    .iter()
                    .map(|(a, b, _)| (a.to_string(), b.to_string()))
                    .collect()
            ),
            pairs(one.iter().map(|(a, b, _)| (a.clone(), b.clone())).collect())
        );
        let cdr = dir.path().join("a.csv");
        write_days(
            &cdr,
            2_000,
            9,
            2,
            Extra::default(),
            Some(InputFormat::Asterisk),
            Tz::UTC,
        )
        .unwrap();
        let ends: Vec<String> = csv::ReaderBuilder::new()
            .has_headers(false)
            .flexible(true)
            .from_path(&cdr)
            .unwrap()
            .records()
            .map(|r| r.unwrap()[11].to_string())
            .collect();
        assert_eq!(ends.len(), 4_000);
        assert!(
            ends.windows(2).all(|w| w[0] <= w[1]),
            "rows out of end order"
        );
        assert!(ends.iter().any(|e| e.starts_with("2025-12-02")));
    }

    #[test]
    fn the_new_populations_have_their_shapes() {
        let calls = generate(50_000, 3);
        let of = |p: &str| {
            calls
                .iter()
                .filter(|c| c.population == p)
                .collect::<Vec<_>>()
        };
        let irsf = of("irsf");
        assert!(irsf.len() > 500, "{}", irsf.len());
        for c in &irsf {
            assert!(IRSF_RANGES.iter().any(|r| c.callee.starts_with(r)), "{c:?}");
            // 21:00 to 07:00 UTC at the latest (22:00 to 08:00 in Madrid).
            let hour = (c.ts_ms - DAY_START_MS).rem_euclid(DAY_MS) / HOUR_MS;
            assert!(!(7..21).contains(&hour), "{c:?}");
        }
        // PBX bursts: at least 10 calls of one caller within 20 s.
        let bursty = of("pbx_burst");
        assert!(bursty.iter().all(|c| !c.fraud));
        let burst_at = |c: &GenCall| {
            bursty
                .iter()
                .filter(|d| d.caller == c.caller && (d.ts_ms - c.ts_ms).abs() <= 20_000)
                .count()
        };
        // (The population's last caller may be cut short by the row count.)
        let short: std::collections::HashSet<&str> = bursty
            .iter()
            .filter(|c| burst_at(c) < 10)
            .map(|c| c.caller.as_str())
            .collect();
        assert!(short.len() <= 1, "{short:?}");
        // Harassers: one callee, again and again.
        let h = of("harasser");
        assert!(h.iter().all(|c| h
            .iter()
            .filter(|d| d.caller == c.caller)
            .all(|d| d.callee == c.callee)));
        let few: std::collections::HashSet<&str> = h
            .iter()
            .filter(|c| h.iter().filter(|d| d.caller == c.caller).count() < 8)
            .map(|c| c.caller.as_str())
            .collect();
        assert!(few.len() <= 1, "{few:?}");
    }
}
