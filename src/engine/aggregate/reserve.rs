//! Reserves: credits of a counter an instance spends without asking the
//! ledger, so that a key called once in a bucket (most callees) costs no
//! shared write.
//!
//! The instances sharing a limit are counted: `E` reserve slots (the
//! `--expected-instances` the first instance recorded in Redis). Each slot
//! owns `r = reserve_of(limit, E)` credits of every counter, and the
//! shared ledger hands out at most `shared_limit(limit, E) = limit - E r`.
//! A counter's calls across all instances are therefore never more than
//! `E r + (limit - E r) = limit`, provided no slot's reserve of a counter
//! is spent twice. That is what a [`Span`] fences: a slot's holder spends
//! its reserve only in buckets that start inside the span it was given
//! (`[from, until)`, event time), where `from` is the end of the spans of
//! the slot's earlier holders. A holder is told its span by the store
//! (`src/store/redis/aggregate/slot.rs`), which raises `until` in Redis before any
//! call beyond it; a holder that lost its slot can no longer raise it.
//! Within one span a holder spends a counter's reserve once: a counter it
//! forgets (dropped after its time) closes the span below that bucket's
//! end ([`Gate`](super::Gate) keeps that floor).

/// Credits a slot's holder may spend per counter without asking the
/// ledger: `floor(limit / (16 E))`, at least one when the limit is at
/// least `2 E` (so the reserves are never more than half the limit), none
/// when it is smaller or there are no slots.
pub fn reserve_of(limit: u64, slots: u32) -> u64 {
    let e = u64::from(slots);
    if e == 0 || limit < e.saturating_mul(2) {
        return 0;
    }
    (limit / e.saturating_mul(16)).max(1)
}

/// What the shared ledger hands out of a counter when `slots` slots each
/// own [`reserve_of`] credits of it: the limit less every reserve.
pub fn shared_limit(limit: u64, slots: u32) -> u64 {
    limit.saturating_sub(u64::from(slots).saturating_mul(reserve_of(limit, slots)))
}

/// The buckets (by their start, event time ms) in which this instance may
/// spend its slot's reserve: `from <= b W < until`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// The end of the slot's earlier holders' spans (`i64::MIN`: none).
    pub from: i64,
    /// How far the store has claimed the slot in Redis.
    pub until: i64,
}

impl Span {
    /// Every bucket: one instance alone, with nobody to share a slot with.
    pub const ALL: Span = Span {
        from: i64::MIN,
        until: i64::MAX,
    };

    /// Whether a bucket starting at `start` is inside the span.
    pub fn holds(&self, start: i64) -> bool {
        self.from <= start && start < self.until
    }
}

/// The reserves a gate works with: how many slots share each limit, and
/// the span of the slot this instance holds, if it holds one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reserves {
    /// Slots sharing each limit (0: no reserves, the whole limit shared).
    pub slots: u32,
    /// This instance's span; `None` while it holds no slot.
    pub span: Option<Span>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserves_never_take_more_than_half_the_limit() {
        for slots in 0..40u32 {
            for limit in 0..2_000u64 {
                let r = reserve_of(limit, slots);
                let e = u64::from(slots);
                assert!(e * r <= limit / 2, "{limit} {slots}: {r}");
                assert_eq!(shared_limit(limit, slots) + e * r, limit);
                if slots > 0 && limit >= 2 * e {
                    assert!(r >= 1, "{limit} {slots}");
                }
            }
        }
        assert_eq!(reserve_of(50, 1), 3);
        assert_eq!(reserve_of(50, 3), 1);
        assert_eq!(reserve_of(50, 30), 0);
        assert_eq!(reserve_of(1_000_000, 3), 20_833);
        assert_eq!(shared_limit(50, 3), 47);
        assert_eq!(shared_limit(50, 0), 50);
    }

    #[test]
    fn a_span_holds_the_buckets_starting_inside_it() {
        let s = Span {
            from: 1_000,
            until: 5_000,
        };
        assert!(s.holds(1_000) && s.holds(4_999));
        assert!(!s.holds(999) && !s.holds(5_000));
        assert!(Span::ALL.holds(i64::MIN) && Span::ALL.holds(i64::MAX - 1));
    }
}
