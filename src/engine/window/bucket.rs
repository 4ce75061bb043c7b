//! The token bucket (GCRA) of one rule, in exact integer arithmetic.
//!
//! With emission interval `T = per / n` (rate `n` calls per `per` ms) and
//! the theoretical arrival time `TAT`, a call at `t` gives
//! `tat' = max(TAT, t) + T` and counts `ceil((tat' - t) / T)`: the bucket
//! level after the call, in calls. A recorded call sets `TAT = tat'`.
//! Times are whole milliseconds plus a remainder in `n`-ths of one, so no
//! float is ever involved (`lua/window.lua` keeps the same pair).

use crate::engine::rule::Rate;

/// A theoretical arrival time: `ms + rem / n`, `0 <= rem < n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Tat {
    /// Whole milliseconds.
    pub ms: i64,
    /// The remainder, in `n`-ths of a millisecond.
    pub rem: u64,
}

impl Tat {
    /// `max(TAT, t) + T`.
    pub fn next(tat: Option<Tat>, t: i64, rate: Rate) -> Tat {
        let now = Tat { ms: t, rem: 0 };
        let base = tat.filter(|&x| x > now).unwrap_or(now);
        let n = rate.calls;
        let (q, r) = (rate.per_ms as u64 / n, rate.per_ms as u64 % n);
        let mut out = Tat {
            ms: base.ms.saturating_add(q as i64),
            rem: base.rem + r,
        };
        if out.rem >= n {
            out.rem -= n;
            out.ms = out.ms.saturating_add(1);
        }
        out
    }

    /// `(self - t)` in `n`-ths of a millisecond.
    fn ticks_after(self, t: i64, rate: Rate) -> i128 {
        i128::from(self.ms.saturating_sub(t)) * i128::from(rate.calls) + i128::from(self.rem)
    }

    /// The level of a call at `t` whose `tat'` this is: `ceil((tat' - t) / T)`.
    pub fn level(self, t: i64, rate: Rate) -> u64 {
        let ticks = self.ticks_after(t, rate).max(0);
        let per = i128::from(rate.per_ms);
        u64::try_from((ticks + per - 1) / per).unwrap_or(u64::MAX)
    }

    /// The last time `s > t` at which a call would still count above
    /// `burst`, with this `TAT` and no further calls: a call at `s < TAT`
    /// counts `ceil((TAT - s) / T) + 1`, above `burst` while
    /// `(TAT - s) > (burst - 1) T`.
    pub fn rejects_until(self, t: i64, rate: Rate, burst: u64) -> Option<i64> {
        let n = i128::from(rate.calls);
        let x = self.ticks_after(t, rate)
            - i128::from(burst.saturating_sub(1)) * i128::from(rate.per_ms);
        // The largest d with d * n < x.
        let d = (x + n - 1).div_euclid(n) - 1;
        (d >= 1).then(|| t.saturating_add(i64::try_from(d).unwrap_or(i64::MAX)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_fills_by_one_call_and_drains_at_the_rate() {
        let rate = Rate::parse("3/s").unwrap(); // T = 333.33 ms
        let mut tat = None;
        let mut levels = Vec::new();
        for _ in 0..4 {
            let next = Tat::next(tat, 1_000, rate);
            levels.push(next.level(1_000, rate));
            tat = Some(next);
        }
        assert_eq!(levels, [1, 2, 3, 4]);
        // TAT = 1000 + 4 T = 2333.33 ms.
        assert_eq!(tat, Some(Tat { ms: 2_333, rem: 1 }));
        // A call at s counts ceil((TAT - s) / T) + 1 > 3 while s < TAT - 2 T = 1666.67.
        let tat = tat.unwrap();
        assert_eq!(tat.rejects_until(1_000, rate, 3), Some(1_666));
        assert_eq!(Tat::next(Some(tat), 1_666, rate).level(1_666, rate), 4);
        assert_eq!(Tat::next(Some(tat), 1_667, rate).level(1_667, rate), 3);
        assert_eq!(tat.rejects_until(1_000, rate, 4), Some(1_333));
        assert_eq!(tat.rejects_until(1_000, rate, 5), None);
    }
}
