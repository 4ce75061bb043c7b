//! The distinct-callees feature's state: each kept callee's latest call
//! time (see the window contract in [`crate::engine::window`]).
//!
//! Most callers call a few numbers an hour, so a caller's few callees are a
//! list inside its state, searched in order: no table and no index of its
//! own, which every call would reach in memory of their own. A caller with
//! more (a trunk, a PBX, a flood) gets a table by callee and an index by
//! time. Either form answers every question the same.

use std::collections::VecDeque;

use compact_str::CompactString;
use foldhash::HashMap;
use smallvec::SmallVec;

use super::counting::insert_sorted;

/// Callees kept in the list at most; one more moves them to a table.
const LISTED: usize = 8;

/// Each kept callee's latest call time.
#[derive(Debug, Clone, Default)]
pub(super) struct CalleeTimes {
    /// The callees and their latest times, unordered, while `table` is
    /// `None` (the first inside the state itself).
    listed: SmallVec<[(CompactString, i64); 1]>,
    /// Beyond [`LISTED`] callees: all of them (and `listed` is empty).
    table: Option<Box<Table>>,
}

/// The callees of a caller with many.
#[derive(Debug, Clone, Default)]
struct Table {
    /// Callee → latest call time.
    latest: HashMap<CompactString, i64>,
    /// (time, callee) ordered by time, for trimming and counting; an entry
    /// is live while it holds its callee's latest time in `latest`. A
    /// callee called again leaves its old entry behind, stale, rather than
    /// removing it from the middle: calls in time order then only append
    /// and trim, whatever a busy trunk's callee list looks like.
    by_ts: VecDeque<(i64, CompactString)>,
}

impl Table {
    /// Sets `callee`'s latest time to `t`.
    fn set(&mut self, callee: CompactString, t: i64) {
        self.latest.insert(callee.clone(), t);
        insert_sorted(&mut self.by_ts, (t, callee), |(ts, _)| *ts <= t);
    }
}

impl CalleeTimes {
    /// How many callees are kept.
    pub(super) fn len(&self) -> usize {
        match &self.table {
            Some(table) => table.latest.len(),
            None => self.listed.len(),
        }
    }

    /// Notes a call to `callee` at `t`: its latest time becomes `t` unless
    /// it is later already; a callee not kept is kept only while fewer
    /// than `cap` are.
    pub(super) fn note(&mut self, callee: &str, t: i64, cap: u64) {
        let kept = self.len() as u64;
        if let Some(table) = &mut self.table {
            use std::collections::hash_map::Entry;
            // One lookup (numbers are kept inline: making the key allocates nothing).
            let name = match table.latest.entry(CompactString::from(callee)) {
                Entry::Occupied(e) if *e.get() >= t => return,
                // Its old entry in `by_ts` turns stale.
                Entry::Occupied(mut e) => {
                    e.insert(t);
                    e.key().clone()
                }
                Entry::Vacant(e) if kept < cap => {
                    let name = e.key().clone();
                    e.insert(t);
                    name
                }
                Entry::Vacant(_) => return,
            };
            insert_sorted(&mut table.by_ts, (t, name), |(ts, _)| *ts <= t);
            return;
        }
        if let Some((_, latest)) = self.listed.iter_mut().find(|(c, _)| c == callee) {
            *latest = (*latest).max(t);
            return;
        }
        if kept >= cap {
            return;
        }
        if self.listed.len() < LISTED {
            self.listed.push((CompactString::from(callee), t));
            return;
        }
        let mut table = Table::default();
        for (c, ts) in self.listed.drain(..) {
            table.set(c, ts);
        }
        table.set(CompactString::from(callee), t);
        self.table = Some(Box::new(table));
    }

    /// How many kept callees' latest time is at or after `after`.
    pub(super) fn count_from(&self, after: i64) -> u64 {
        let Some(table) = &self.table else {
            return self.listed.iter().filter(|(_, ts)| *ts >= after).count() as u64;
        };
        // Live entries before `after` lie between the horizon and `after`
        // (at most grace + 1 ms when `after` is `t - Wmax + 1`), so counting
        // them is cheap. (A scan from the front: the band is short, and
        // scanned below anyway.)
        let band = table.by_ts.iter().take_while(|(ts, _)| *ts < after).count();
        let before = table
            .by_ts
            .range(..band)
            .filter(|(ts, callee)| table.latest.get(callee) == Some(ts))
            .count();
        (table.latest.len() - before) as u64
    }

    /// Lets go of the callees whose latest time is at or before `horizon`.
    pub(super) fn trim(&mut self, horizon: i64) {
        let Some(table) = &mut self.table else {
            self.listed.retain(|(_, ts)| *ts > horizon);
            return;
        };
        while table.by_ts.front().is_some_and(|(ts, _)| *ts <= horizon) {
            if let Some((ts, callee)) = table.by_ts.pop_front() {
                if table.latest.get(&callee) == Some(&ts) {
                    table.latest.remove(&callee);
                }
            }
        }
    }

    /// Lets go of every callee (keeping the list's own allocation, if any).
    pub(super) fn clear(&mut self) {
        self.listed.clear();
        self.table = None;
    }

    /// The kept callees and their latest times, in no given order (the
    /// list is empty while there is a table: one of the two holds them).
    pub(super) fn iter(&self) -> impl Iterator<Item = (&CompactString, i64)> {
        let listed = self.listed.iter().map(|(c, ts)| (c, *ts));
        let table = self
            .table
            .iter()
            .flat_map(|t| t.latest.iter().map(|(c, &ts)| (c, ts)));
        listed.chain(table)
    }

    /// The state of `entries` (callee, latest time; a callee given twice
    /// keeps its last time), as [`CalleeTimes::iter`] gave them.
    pub(super) fn from_entries(entries: Vec<(CompactString, i64)>) -> Self {
        let mut times = CalleeTimes::default();
        if entries.len() <= LISTED {
            for (callee, ts) in entries {
                match times.listed.iter_mut().find(|(c, _)| *c == callee) {
                    Some((_, latest)) => *latest = ts,
                    None => times.listed.push((callee, ts)),
                }
            }
            return times;
        }
        let mut table = Table::default();
        for (callee, ts) in entries {
            table.latest.insert(callee.clone(), ts);
            table.by_ts.push_back((ts, callee));
        }
        table.by_ts.make_contiguous().sort_by_key(|(ts, _)| *ts);
        times.table = Some(Box::new(table));
        times
    }

    /// Bytes held, roughly.
    pub(super) fn approx_bytes(&self) -> usize {
        let entry = size_of::<(CompactString, i64)>();
        match &self.table {
            Some(table) => {
                size_of::<Table>() + table.latest.len() * (entry + 16) + table.by_ts.len() * entry
            }
            None if self.listed.spilled() => self.listed.capacity() * entry,
            None => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// The contract, plainly: callee → latest time.
    #[derive(Default)]
    struct Model(BTreeMap<String, i64>);

    impl Model {
        fn note(&mut self, callee: &str, t: i64, cap: u64) {
            let kept = self.0.len() as u64;
            match self.0.get_mut(callee) {
                Some(l) => *l = (*l).max(t),
                None if kept < cap => {
                    self.0.insert(callee.to_string(), t);
                }
                None => {}
            }
        }
    }

    fn sorted(times: &CalleeTimes) -> Vec<(String, i64)> {
        let mut v: Vec<(String, i64)> = times.iter().map(|(c, t)| (c.to_string(), t)).collect();
        v.sort();
        v
    }

    /// Random calls, some late, to callee sets small and large, with trims
    /// and caps: the list, the table and a move from one to the other
    /// answer as the plain map does, and a packed copy answers the same.
    #[test]
    fn list_and_table_answer_as_the_plain_map() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut moved = 0;
        for round in 0..300 {
            let callees = [2, 6, 9, 30][round % 4];
            let cap = [u64::MAX, 5, 12][round % 3];
            let (mut times, mut model) = (CalleeTimes::default(), Model::default());
            let mut t = 1_000_000i64;
            for _ in 0..200 {
                t += next(5_000) as i64;
                // One call in eight is late.
                let at = if next(8) == 0 {
                    t - next(20_000) as i64
                } else {
                    t
                };
                let callee = format!("+3491{}", next(callees));
                times.note(&callee, at, cap);
                model.note(&callee, at, cap);
                if next(4) == 0 {
                    let horizon = t - 10_000 - next(10_000) as i64;
                    times.trim(horizon);
                    model.0.retain(|_, ts| *ts > horizon);
                }
                let after = t - next(15_000) as i64;
                let expected = model.0.values().filter(|ts| **ts >= after).count() as u64;
                assert_eq!(times.count_from(after), expected, "round {round}");
                assert_eq!(times.len(), model.0.len());
                let plain: Vec<(String, i64)> =
                    model.0.iter().map(|(c, t)| (c.clone(), *t)).collect();
                assert_eq!(sorted(&times), plain);
                let copy =
                    CalleeTimes::from_entries(times.iter().map(|(c, t)| (c.clone(), t)).collect());
                assert_eq!(copy.count_from(after), expected);
                assert_eq!(sorted(&copy), plain);
            }
            moved += usize::from(times.table.is_some());
            times.clear();
            assert_eq!(times.len(), 0);
            assert_eq!(times.count_from(i64::MIN), 0);
        }
        // Both forms were exercised.
        assert!(
            moved > 0 && moved < 300,
            "{moved} of 300 rounds ended with a table"
        );
    }
}
