//! Rate tables: what a minute of talk to a destination costs, for rules
//! that add up spend (`sum = "cost"`).
//!
//! A rates file is CSV, one destination prefix per line:
//! `prefix,price_per_minute[,increment_s]`; `#` starts a comment and a
//! first line naming the columns is skipped. A call is priced by the
//! longest prefix that matches its callee; its talk time is rounded up to
//! the prefix's increment (default 60 s, per-minute billing), and its cost
//! is `billed seconds * price / 60`, rounded up to a whole micro-unit (a
//! millionth of the currency). Everything is exact integer arithmetic in
//! micro-units: a sum never drifts with the order calls end in.

use serde::Serialize;

/// The default billing increment, seconds: per-minute billing.
pub const DEFAULT_INCREMENT_S: u32 = 60;

/// Micro-units in one unit of currency.
pub const MICROS: u64 = 1_000_000;

/// One destination's price.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Price {
    /// Price per minute of talk, in micro-units.
    pub per_minute: u64,
    /// Talk is billed in whole multiples of this many seconds.
    pub increment_s: u32,
}

impl Price {
    /// The cost of `talk_ms` of talk, micro-units: the talk rounded up to
    /// the increment, priced per minute, rounded up to a micro-unit. No
    /// talk (an unanswered call) costs nothing.
    pub fn cost(self, talk_ms: i64) -> u64 {
        if talk_ms <= 0 {
            return 0;
        }
        let step_ms = u128::from(self.increment_s) * 1_000;
        let talk = talk_ms.unsigned_abs() as u128;
        let billed_s = talk.div_ceil(step_ms) * u128::from(self.increment_s);
        let micros = (billed_s * u128::from(self.per_minute)).div_ceil(60);
        u64::try_from(micros).unwrap_or(u64::MAX)
    }
}

/// A rate table: prefixes (in the rules' one spelling, `+` and digits)
/// and their prices, longest match wins.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Rates {
    /// (prefix, price), sorted by prefix.
    entries: Vec<(String, Price)>,
}

/// Parses a decimal amount of currency (`"50"`, `"0.25"`, up to 6
/// decimals) into micro-units.
pub fn parse_money(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let bad = || format!("`{s}`: expected an amount such as 50 or 0.125 (at most 6 decimals)");
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    let digits = |d: &str| d.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(frac) || frac.len() > 6 {
        return Err(bad());
    }
    let whole: u64 = whole.parse().map_err(|_| bad())?;
    let frac: u64 = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<6}").parse().map_err(|_| bad())?
    };
    whole
        .checked_mul(MICROS)
        .and_then(|w| w.checked_add(frac))
        .ok_or_else(bad)
}

/// Micro-units written as currency with 6 decimals (`50.000000`).
pub fn format_money(micros: u64) -> String {
    format!("{}.{:06}", micros / MICROS, micros % MICROS)
}

impl Rates {
    /// Parses a rates file's text; `normalize` turns a prefix into the
    /// rules' spelling (or says why it is not a number prefix).
    pub fn parse(
        text: &str,
        normalize: impl Fn(&str) -> Result<String, String>,
    ) -> Result<Self, String> {
        let mut entries: Vec<(String, Price)> = Vec::new();
        for (n, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let at = |msg: String| format!("line {}: {msg}", n + 1);
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            if entries.is_empty() && fields.first().is_some_and(|f| *f == "prefix") {
                continue;
            }
            let (prefix, price, increment) = match fields[..] {
                [p, price] => (p, price, None),
                [p, price, inc] => (p, price, Some(inc)),
                _ => {
                    return Err(at(format!(
                        "`{line}`: expected prefix,price_per_minute[,increment_s]"
                    )))
                }
            };
            let prefix = normalize(prefix).map_err(at)?;
            let per_minute = parse_money(price).map_err(at)?;
            let increment_s = match increment {
                None => DEFAULT_INCREMENT_S,
                Some(i) => i
                    .parse::<u32>()
                    .ok()
                    .filter(|i| (1..=3_600).contains(i))
                    .ok_or_else(|| at(format!("increment `{i}`: 1 to 3600 seconds")))?,
            };
            if entries.iter().any(|(p, _)| *p == prefix) {
                return Err(at(format!("prefix {prefix} is listed twice")));
            }
            entries.push((
                prefix,
                Price {
                    per_minute,
                    increment_s,
                },
            ));
        }
        if entries.is_empty() {
            return Err("no prefixes: a rates file lists prefix,price_per_minute lines".into());
        }
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Rates { entries })
    }

    /// The price of a call to `callee`: that of the longest matching
    /// prefix, if any.
    pub fn price(&self, callee: &str) -> Option<Price> {
        (1..=callee.len()).rev().find_map(|n| {
            let head = callee.get(..n)?;
            self.entries
                .binary_search_by(|(p, _)| p.as_str().cmp(head))
                .ok()
                .map(|i| self.entries[i].1)
        })
    }

    /// How many prefixes it lists.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it lists none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(p: &str) -> Result<String, String> {
        Ok(p.to_string())
    }

    #[test]
    fn money_is_exact_micro_units() {
        assert_eq!(parse_money("50"), Ok(50_000_000));
        assert_eq!(parse_money("50.00"), Ok(50_000_000));
        assert_eq!(parse_money("0.125"), Ok(125_000));
        assert_eq!(parse_money("1.000001"), Ok(1_000_001));
        for bad in ["", "-1", "1.0000001", "1,5", "x", ".5"] {
            assert!(parse_money(bad).is_err(), "{bad}");
        }
        assert_eq!(format_money(12_345_000), "12.345000");
    }

    #[test]
    fn talk_is_rounded_up_to_the_increment_and_the_cost_to_a_micro_unit() {
        let per_minute = Price {
            per_minute: 250_000,
            increment_s: 60,
        };
        assert_eq!(per_minute.cost(0), 0, "unanswered");
        assert_eq!(per_minute.cost(1), 250_000, "one minute started");
        assert_eq!(per_minute.cost(60_000), 250_000);
        assert_eq!(per_minute.cost(60_001), 500_000);
        let per_second = Price {
            per_minute: 100_000,
            increment_s: 1,
        };
        // 7 s at 0.10 a minute: 0.011666.. rounded up.
        assert_eq!(per_second.cost(6_500), 11_667);
    }

    #[test]
    fn the_longest_prefix_prices_the_call() {
        let rates = Rates::parse(
            "prefix,price_per_minute,increment_s\n# premium\n+882,2.50\n+88216,4.00,1\n+44, 0.01 # UK\n",
            plain,
        )
        .unwrap();
        assert_eq!(rates.len(), 3);
        assert_eq!(
            rates.price("+88216123").map(|p| p.per_minute),
            Some(4_000_000)
        );
        assert_eq!(rates.price("+8821").map(|p| p.increment_s), Some(60));
        assert_eq!(rates.price("+34911"), None);
        for (bad, says) in [
            ("+882", "expected"),
            ("+882,x", "amount"),
            ("+882,1,0", "increment"),
            ("+882,1\n+882,2", "twice"),
            ("# nothing\n", "no prefixes"),
        ] {
            let e = Rates::parse(bad, plain).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
