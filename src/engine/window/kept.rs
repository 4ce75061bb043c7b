//! A decided call's verdict as a caller's idempotency table keeps it:
//! packed into one small allocation, without the call id and the caller
//! (the table's key and the state's own caller), read back whole for a
//! redelivery.
//!
//! A caller keeps a record of every call inside the idempotency horizon
//! (a day by default), so records are most of a caller's memory: a
//! [`Verdict`] held whole took 248 bytes and a boxed allocation, most of it
//! inline room for strings a record does not need. Packed, a verdict under
//! a few rules is 35-45 bytes.

use compact_str::CompactString;

use super::pack::{put_signed, put_str, put_varint, Unpacker};
use crate::engine::record::{Counts, Decision, DecisionRecord, Verdict};

/// The verdict was a reject.
const REJECT: u16 = 1;
/// The record's flags, then which optional values follow.
const SHADOW: u16 = 1 << 1;
const LATE: u16 = 1 << 2;
const DEGRADED: u16 = 1 << 3;
const END: u16 = 1 << 4;
const PREV: u16 = 1 << 5;
const DISTINCT: u16 = 1 << 6;
const RETRY: u16 = 1 << 7;
const WARN: u16 = 1 << 8;
const SCORE: u16 = 1 << 9;

/// A verdict, packed: its time (8 bytes, first, so that trimming and the
/// horizon check read it without unpacking), the flags (2 bytes), the
/// reason, the rule set's version and the counts, then the optional
/// values the flags name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Kept(Box<[u8]>);

impl Kept {
    /// Packs `v` (all but its call id, caller and `duplicate` flag).
    pub(super) fn of(v: &Verdict) -> Self {
        let r = &v.record;
        let flags = [
            (r.decision == Decision::Reject, REJECT),
            (r.shadow, SHADOW),
            (r.late, LATE),
            (r.degraded, DEGRADED),
            (v.end, END),
            (v.prev_ts_ms.is_some(), PREV),
            (v.distinct_callees.is_some(), DISTINCT),
            (r.retry_after_ms.is_some(), RETRY),
            (r.warn.is_some(), WARN),
            (v.score.is_some(), SCORE),
        ]
        .into_iter()
        .filter(|(on, _)| *on)
        .fold(0u16, |f, (_, bit)| f | bit);
        let mut out = Vec::with_capacity(32 + r.reason.len() + r.rules_version.len());
        out.extend_from_slice(&r.ts_ms.to_le_bytes());
        out.extend_from_slice(&flags.to_le_bytes());
        put_str(&mut out, &r.reason);
        put_str(&mut out, &r.rules_version);
        put_varint(&mut out, r.counts.len() as u64);
        for &c in &r.counts {
            put_varint(&mut out, c);
        }
        if let Some(p) = v.prev_ts_ms {
            put_signed(&mut out, r.ts_ms.wrapping_sub(p));
        }
        if let Some(d) = v.distinct_callees {
            put_varint(&mut out, d);
        }
        if let Some(ms) = r.retry_after_ms {
            put_signed(&mut out, ms);
        }
        if let Some(w) = &r.warn {
            put_str(&mut out, w);
        }
        if let Some(s) = v.score {
            out.extend_from_slice(&s.to_bits().to_le_bytes());
        }
        Kept(out.into_boxed_slice())
    }

    /// The call's event time.
    pub(super) fn ts_ms(&self) -> i64 {
        let mut ts = [0u8; 8];
        if let Some(b) = self.0.get(..8) {
            ts.copy_from_slice(b);
        }
        i64::from_le_bytes(ts)
    }

    /// Bytes the packed verdict holds.
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    /// The verdict packed, with its call id and caller given back (not
    /// flagged `duplicate`); `None` only if the bytes were not written by
    /// [`Kept::of`].
    pub(super) fn verdict(&self, call_id: &str, caller: &str) -> Option<Verdict> {
        let (head, rest) = self.0.split_at_checked(10)?;
        let ts_ms = self.ts_ms();
        let flags = u16::from_le_bytes([head[8], head[9]]);
        let on = |bit: u16| flags & bit != 0;
        let mut r = Unpacker(rest);
        let reason = CompactString::from(r.string()?);
        let rules_version = CompactString::from(r.string()?);
        let counts = (0..r.len()?)
            .map(|_| r.varint())
            .collect::<Option<Counts>>()?;
        let prev_ts_ms = match on(PREV) {
            true => Some(ts_ms.wrapping_sub(r.signed()?)),
            false => None,
        };
        let distinct_callees = match on(DISTINCT) {
            true => Some(r.varint()?),
            false => None,
        };
        let retry_after_ms = match on(RETRY) {
            true => Some(r.signed()?),
            false => None,
        };
        let warn = match on(WARN) {
            true => Some(CompactString::from(r.string()?)),
            false => None,
        };
        let score = match on(SCORE) {
            true => Some(f32::from_bits(u32::from_le_bytes(r.array()?))),
            false => None,
        };
        r.0.is_empty().then(|| Verdict {
            record: DecisionRecord {
                call_id: call_id.into(),
                caller: caller.into(),
                ts_ms,
                decision: if on(REJECT) {
                    Decision::Reject
                } else {
                    Decision::Allow
                },
                reason,
                counts,
                shadow: on(SHADOW),
                late: on(LATE),
                degraded: on(DEGRADED),
                rules_version,
                retry_after_ms,
                warn,
            },
            prev_ts_ms,
            distinct_callees,
            duplicate: false,
            end: on(END),
            score,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A verdict with every optional value present or absent as `bits`
    /// says, and values from `seed`.
    fn verdict(bits: u32, seed: u64) -> Verdict {
        let on = |i: u32| bits & (1 << i) != 0;
        let ts = 1_764_547_200_000 + (seed % 100_000) as i64;
        Verdict {
            record: DecisionRecord {
                call_id: format!("call-{seed}").into(),
                caller: "+34911000001".into(),
                ts_ms: ts,
                decision: if on(0) {
                    Decision::Reject
                } else {
                    Decision::Allow
                },
                reason: if on(0) { "minute" } else { "ok" }.into(),
                counts: (0..(seed % 6))
                    .map(|i| i.wrapping_mul(seed) % 1_000_003)
                    .collect(),
                shadow: on(1),
                late: on(2),
                degraded: on(3),
                rules_version: format!("v{seed:x}").into(),
                retry_after_ms: on(4).then_some((seed % 70_000) as i64),
                warn: on(5).then(|| "a-rule-name-longer-than-twenty-four".into()),
            },
            // Before the call, and after it (a late call's).
            prev_ts_ms: on(6).then_some(ts - 1_000 + (seed % 3_000) as i64),
            distinct_callees: on(7).then_some(seed % 900),
            duplicate: false,
            end: on(8),
            score: on(9).then_some(f32::from_bits(seed as u32)),
        }
    }

    /// Every combination of flags and optional values reads back as the
    /// verdict packed, with the call id and caller given; the time reads
    /// without unpacking; bytes cut short are refused.
    #[test]
    fn verdicts_read_back_whole() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for bits in 0..1024u32 {
            seed = seed.rotate_left(13) ^ u64::from(bits).wrapping_mul(0x2545_F491_4F6C_DD1D);
            let v = verdict(bits, seed);
            let kept = Kept::of(&v);
            assert_eq!(kept.ts_ms(), v.record.ts_ms);
            let back = kept
                .verdict(&v.record.call_id, &v.record.caller)
                .expect("reads back");
            // (A NaN score compares unequal to itself: compared as bits.)
            assert_eq!(back.score.map(f32::to_bits), v.score.map(f32::to_bits));
            let (back, v) = (
                Verdict {
                    score: None,
                    ..back
                },
                Verdict { score: None, ..v },
            );
            assert_eq!(back, v, "flags {bits:#b}");
            for cut in 0..kept.len() {
                let short = Kept(kept.0[..cut].into());
                assert!(short.verdict("c", "+3491").is_none(), "cut at {cut}");
            }
        }
    }

    /// A verdict under `data/rules.toml`'s three rules packs small.
    #[test]
    fn a_usual_verdict_packs_in_under_fifty_bytes() {
        let mut v = verdict(0b100_0000, 7);
        v.record.counts = [1, 4, 37].into_iter().collect();
        v.record.rules_version = "3f9a1c2e".into();
        let kept = Kept::of(&v);
        assert!(kept.len() < 50, "{} bytes", kept.len());
    }
}
