//! [`CallerState`]'s compact binary form, for a store that keeps a
//! caller's window state as one value (the cached Redis store), the ways
//! back in of what such a store keeps apart (a sliding log, records), and
//! what such a store asks of a state (its records, its size).

use std::collections::VecDeque;

use super::*;

/// Where [`CallerState::pack`] put the sliding log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PackedLog {
    /// In the packed bytes.
    #[default]
    Inline,
    /// Apart, as `len` fixed-width times of which the first `dead` are
    /// no longer in the log (trimmed, not yet rewritten).
    Outside {
        /// Times at the front that are trimmed.
        dead: u64,
        /// Times kept apart in all.
        len: u64,
    },
}

/// Version byte of [`CallerState::pack`]'s format.
const PACK_FORMAT: u8 = 1;

/// The same format followed by the state of rules with state of their own.
const PACK_FORMAT_RULES: u8 = 2;

/// [`PACK_FORMAT_RULES`] followed by the calls the concurrent rules hold
/// open and the ends that came before their calls.
const PACK_FORMAT_OPEN: u8 = 3;

/// [`PACK_FORMAT_OPEN`] followed by the sum rules' state (calls waiting
/// for their ends, what ended calls added) and the kept ends' talk times.
const PACK_FORMAT_SUMS: u8 = 4;

/// Writes `v` as unsigned LEB128 (7 bits a byte, low first, the high
/// bit set on every byte but the last): the one varint of callguard's
/// byte formats (this packed state, and the cached store's state string,
/// which `lua/commit.lua` reads too).
pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads what [`put_varint`] wrote at the front of `input`: the value and
/// the rest; `None` when truncated or longer than 10 bytes.
pub(crate) fn take_varint(input: &[u8]) -> Option<(u64, &[u8])> {
    let mut v = 0u64;
    for (i, &b) in input.iter().enumerate().take(10) {
        v |= u64::from(b & 0x7f) << (7 * i);
        if b < 0x80 {
            return Some((v, &input[i + 1..]));
        }
    }
    None
}

/// Writes `v` zigzagged (small magnitudes, either sign, in few bytes).
pub(super) fn put_signed(out: &mut Vec<u8>, v: i64) {
    put_varint(out, ((v << 1) ^ (v >> 63)) as u64);
}

/// A tag byte (0 none, 1 some) and the value.
fn put_opt(out: &mut Vec<u8>, v: Option<i64>) {
    match v {
        Some(v) => {
            out.push(1);
            put_signed(out, v);
        }
        None => out.push(0),
    }
}

/// Writes `s`'s length, then its bytes.
pub(super) fn put_str(out: &mut Vec<u8>, s: &str) {
    put_varint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// Reads what [`CallerState::pack`] wrote; every read fails on truncation.
pub(super) struct Unpacker<'a>(pub(super) &'a [u8]);

impl Unpacker<'_> {
    pub(super) fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }

    pub(super) fn varint(&mut self) -> Option<u64> {
        let (v, rest) = take_varint(self.0)?;
        self.0 = rest;
        Some(v)
    }

    pub(super) fn signed(&mut self) -> Option<i64> {
        let z = self.varint()?;
        Some(((z >> 1) as i64) ^ -((z & 1) as i64))
    }

    /// What [`put_opt`] wrote: `None` when corrupt, `Some(None)` for none.
    fn opt(&mut self) -> Option<Option<i64>> {
        match self.byte()? {
            0 => Some(None),
            1 => Some(Some(self.signed()?)),
            _ => None,
        }
    }

    pub(super) fn len(&mut self) -> Option<usize> {
        let n = usize::try_from(self.varint()?).ok()?;
        // Every element takes at least one byte: a length beyond what is
        // left is corrupt, and must not reserve memory.
        (n <= self.0.len()).then_some(n)
    }

    pub(super) fn string(&mut self) -> Option<&str> {
        let n = self.len()?;
        let (s, rest) = self.0.split_at(n);
        self.0 = rest;
        std::str::from_utf8(s).ok()
    }

    /// The next `N` bytes as they are.
    pub(super) fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (a, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*a)
    }

    fn pair(&mut self, base: i64) -> Option<Pair> {
        let latest = base.wrapping_sub(self.signed()?);
        let mut log = VecDeque::new();
        for _ in 0..self.len()? {
            log.push_back(base.wrapping_sub(self.signed()?));
        }
        let mut fixed = BTreeMap::new();
        for _ in 0..self.len()? {
            let b = self.signed()?;
            fixed.insert(b, self.varint()?);
        }
        let approx = Approx {
            bucket: self.opt()?,
            cur: self.varint()?,
            prev: self.varint()?,
        };
        let ms = self.opt()?;
        let rem = self.varint()?;
        Some(Pair {
            latest,
            log,
            fixed,
            approx,
            tat: ms.map(|d| Tat {
                ms: base.wrapping_add(d),
                rem,
            }),
        })
    }

    fn rule_id(&mut self) -> Option<RuleId> {
        Some(RuleId {
            name: self.string()?.into(),
            window_ms: self.signed()?,
            max_duration_ms: 0,
        })
    }
}

impl CallerState {
    /// The window state (everything but the idempotency records) in a
    /// compact binary form, for a store that keeps it as one value:
    /// times as varint distances from the latest time, callees without
    /// their stale entries. [`CallerState::unpack`] reads it back to a
    /// state that decides every later call exactly as this one.
    ///
    /// With `log` [`PackedLog::Outside`] the sliding log is left out (its
    /// store keeps it apart) and only its place there is written.
    pub fn pack(&self, out: &mut Vec<u8>, log: PackedLog) {
        let rare = self.rare.as_deref();
        let sums_state =
            rare.is_some_and(|r| !r.sums.is_empty() || r.pending_ends.talks().any(|t| t != 0));
        let open_state =
            sums_state || rare.is_some_and(|r| !(r.open.is_empty() && r.pending_ends.is_empty()));
        let rule_state = open_state
            || rare.is_some_and(|r| {
                !(r.own_logs.is_empty()
                    && r.buckets.is_empty()
                    && r.distinct.is_empty()
                    && r.pairs.is_empty())
            });
        out.push(if sums_state {
            PACK_FORMAT_SUMS
        } else if open_state {
            PACK_FORMAT_OPEN
        } else if rule_state {
            PACK_FORMAT_RULES
        } else {
            PACK_FORMAT
        });
        let base = self.latest.unwrap_or(0);
        put_opt(out, self.latest);
        match log {
            PackedLog::Inline => {
                out.push(0);
                put_varint(out, self.log.len() as u64);
                let mut prev = base;
                for (i, &e) in self.log.iter().enumerate() {
                    let d = if i == 0 {
                        base.wrapping_sub(e)
                    } else {
                        e.wrapping_sub(prev)
                    };
                    put_signed(out, d);
                    prev = e;
                }
            }
            PackedLog::Outside { dead, len } => {
                out.push(1);
                put_varint(out, dead);
                put_varint(out, len);
            }
        }
        put_varint(out, self.fixed.len() as u64);
        for (id, buckets) in &self.fixed {
            put_str(out, &id.name);
            put_signed(out, id.window_ms);
            put_varint(out, buckets.len() as u64);
            for (&b, &c) in buckets {
                put_signed(out, b);
                put_varint(out, c);
            }
        }
        put_varint(out, self.approx.len() as u64);
        for (id, a) in &self.approx {
            put_str(out, &id.name);
            put_signed(out, id.window_ms);
            put_opt(out, a.bucket);
            put_varint(out, a.cur);
            put_varint(out, a.prev);
        }
        put_varint(out, self.callees.len() as u64);
        for (callee, ts) in self.callees.iter() {
            put_signed(out, base.wrapping_sub(ts));
            put_str(out, callee);
        }
        let Some(rare) = rare.filter(|_| rule_state) else {
            return;
        };
        rare.pack_rule_state(out, base);
        if open_state {
            rare.pack_open_state(out, base);
        }
        if sums_state {
            rare.pack_sums_state(out, base);
        }
    }
}

/// The rarer rules' state, after the rest ([`CallerState::pack`]).
impl Rare {
    /// The sum rules' state under [`PACK_FORMAT_SUMS`]: per rule (name,
    /// window, max duration) its waiting calls (id, start, price: 0 none,
    /// 1 then per minute and increment) and its ended ones (time, amount);
    /// then the talk time of each kept end, in the order the ends were
    /// written.
    fn pack_sums_state(&self, out: &mut Vec<u8>, base: i64) {
        put_varint(out, self.sums.len() as u64);
        for (id, sums) in &self.sums {
            put_str(out, &id.name);
            put_signed(out, id.window_ms);
            put_signed(out, id.max_duration_ms);
            put_varint(out, sums.waiting_len() as u64);
            for (call, start, price) in sums.waiting() {
                put_str(out, call);
                put_signed(out, base.wrapping_sub(start));
                match price {
                    Some(p) => {
                        out.push(1);
                        put_varint(out, p.per_minute);
                        put_varint(out, u64::from(p.increment_s));
                    }
                    None => out.push(0),
                }
            }
            put_varint(out, sums.ended_len() as u64);
            for (at, amount) in sums.ended() {
                put_signed(out, base.wrapping_sub(at));
                put_varint(out, amount);
            }
        }
        for talk in self.pending_ends.talks() {
            put_signed(out, talk);
        }
    }

    /// Reads what [`Rare::pack_sums_state`] wrote.
    fn unpack_sums_state(&mut self, r: &mut Unpacker<'_>, base: i64) -> Option<()> {
        for _ in 0..r.len()? {
            let name = r.string()?.into();
            let window_ms = r.signed()?;
            let max_duration_ms = r.signed()?;
            let mut sums = Sums::default();
            for _ in 0..r.len()? {
                let call = CompactString::from(r.string()?);
                let start = base.wrapping_sub(r.signed()?);
                let price = match r.byte()? {
                    0 => None,
                    1 => Some(crate::engine::rates::Price {
                        per_minute: r.varint()?,
                        increment_s: u32::try_from(r.varint()?).ok()?,
                    }),
                    _ => return None,
                };
                sums.wait(&call, start, price);
            }
            for _ in 0..r.len()? {
                let at = base.wrapping_sub(r.signed()?);
                sums.add(at, r.varint()?);
            }
            let id = RuleId {
                name,
                window_ms,
                max_duration_ms,
            };
            self.sums.push((id, sums));
        }
        let talks = (0..self.pending_ends.len())
            .map(|_| r.signed())
            .collect::<Option<Vec<i64>>>()?;
        self.pending_ends.restore_talks(&talks);
        Some(())
    }

    /// The calls held open and the ends kept, under [`PACK_FORMAT_OPEN`]:
    /// per concurrent rule its calls (id, callee or '', start, close after
    /// start, ended), then the ends (time, id).
    fn pack_open_state(&self, out: &mut Vec<u8>, base: i64) {
        put_varint(out, self.open.len() as u64);
        for (id, calls) in &self.open {
            put_str(out, &id.name);
            put_signed(out, id.window_ms);
            put_varint(out, calls.len() as u64);
            for c in calls.calls() {
                put_str(out, &c.id);
                put_str(out, c.callee.as_deref().unwrap_or(""));
                put_signed(out, base.wrapping_sub(c.start));
                put_signed(out, c.close.wrapping_sub(c.start));
                out.push(u8::from(c.ended));
            }
        }
        put_varint(out, self.pending_ends.len() as u64);
        for (end, id) in self.pending_ends.iter() {
            put_signed(out, base.wrapping_sub(*end));
            put_str(out, id);
        }
    }

    /// Reads what [`Rare::pack_open_state`] wrote.
    fn unpack_open_state(&mut self, r: &mut Unpacker<'_>, base: i64) -> Option<()> {
        for _ in 0..r.len()? {
            let rule = r.rule_id()?;
            let mut calls = OpenCalls::default();
            for _ in 0..r.len()? {
                let id = CompactString::from(r.string()?);
                let callee = Some(r.string()?)
                    .filter(|c| !c.is_empty())
                    .map(CompactString::from);
                let start = base.wrapping_sub(r.signed()?);
                let close = start.wrapping_add(r.signed()?);
                let ended = match r.byte()? {
                    0 => false,
                    1 => true,
                    _ => return None,
                };
                calls.restore(open::Open {
                    id,
                    callee,
                    start,
                    close,
                    ended,
                });
            }
            self.open.push((rule, calls));
        }
        for _ in 0..r.len()? {
            let end = base.wrapping_sub(r.signed()?);
            self.pending_ends.restore(end, r.string()?);
        }
        Some(())
    }

    /// The state of rules with state of their own (own logs, token
    /// buckets, distinct callees), under [`PACK_FORMAT_RULES`]; a state
    /// without them packs as before.
    fn pack_rule_state(&self, out: &mut Vec<u8>, base: i64) {
        put_varint(out, self.own_logs.len() as u64);
        for (id, log) in &self.own_logs {
            put_str(out, &id.name);
            put_signed(out, id.window_ms);
            put_varint(out, log.len() as u64);
            for &e in log {
                put_signed(out, base.wrapping_sub(e));
            }
        }
        put_varint(out, self.buckets.len() as u64);
        for (id, tat) in &self.buckets {
            put_str(out, &id.name);
            put_signed(out, id.window_ms);
            put_opt(out, tat.map(|x| x.ms.wrapping_sub(base)));
            put_varint(out, tat.map_or(0, |x| x.rem));
        }
        put_varint(out, self.distinct.len() as u64);
        for (id, callees) in &self.distinct {
            put_str(out, &id.name);
            put_signed(out, id.window_ms);
            put_varint(out, callees.len() as u64);
            for (ts, callee) in callees.iter() {
                put_signed(out, base.wrapping_sub(*ts));
                put_str(out, callee);
            }
        }
        put_varint(out, self.pairs.len() as u64);
        for (id, pairs) in &self.pairs {
            put_str(out, &id.name);
            put_signed(out, id.window_ms);
            put_varint(out, pairs.len() as u64);
            for (callee, pair) in pairs.iter() {
                put_str(out, callee);
                put_signed(out, base.wrapping_sub(pair.latest));
                put_varint(out, pair.log.len() as u64);
                for &e in &pair.log {
                    put_signed(out, base.wrapping_sub(e));
                }
                put_varint(out, pair.fixed.len() as u64);
                for (&b, &c) in &pair.fixed {
                    put_signed(out, b);
                    put_varint(out, c);
                }
                put_opt(out, pair.approx.bucket);
                put_varint(out, pair.approx.cur);
                put_varint(out, pair.approx.prev);
                put_opt(out, pair.tat.map(|x| x.ms.wrapping_sub(base)));
                put_varint(out, pair.tat.map_or(0, |x| x.rem));
            }
        }
    }

    /// Reads what [`Rare::pack_rule_state`] wrote.
    fn unpack_rule_state(&mut self, r: &mut Unpacker<'_>, base: i64) -> Option<()> {
        for _ in 0..r.len()? {
            let id = r.rule_id()?;
            let mut log = VecDeque::new();
            for _ in 0..r.len()? {
                log.push_back(base.wrapping_sub(r.signed()?));
            }
            self.own_logs.push((id, log));
        }
        for _ in 0..r.len()? {
            let id = r.rule_id()?;
            let ms = r.opt()?;
            let rem = r.varint()?;
            let tat = ms.map(|d| Tat {
                ms: base.wrapping_add(d),
                rem,
            });
            self.buckets.push((id, tat));
        }
        for _ in 0..r.len()? {
            let id = r.rule_id()?;
            let mut callees = Callees::default();
            for _ in 0..r.len()? {
                let ts = base.wrapping_sub(r.signed()?);
                callees.record(r.string()?, ts, u64::MAX);
            }
            self.distinct.push((id, callees));
        }
        for _ in 0..r.len()? {
            let id = r.rule_id()?;
            let mut pairs = Pairs::default();
            for _ in 0..r.len()? {
                let callee = r.string()?.to_string();
                let pair = r.pair(base)?;
                pairs.restore(&callee, pair);
            }
            self.pairs.push((id, pairs));
        }
        Some(())
    }
}

impl CallerState {
    /// Reads a state written by [`CallerState::pack`] (without records),
    /// and where its log was; `None` if the bytes are not one. A log kept
    /// outside comes back empty: see [`CallerState::restore_log`].
    pub fn unpack(bytes: &[u8]) -> Option<(Self, PackedLog)> {
        let mut r = Unpacker(bytes);
        let format = r.byte()?;
        if ![
            PACK_FORMAT,
            PACK_FORMAT_RULES,
            PACK_FORMAT_OPEN,
            PACK_FORMAT_SUMS,
        ]
        .contains(&format)
        {
            return None;
        }
        let latest = r.opt()?;
        let base = latest.unwrap_or(0);
        let mut state = CallerState {
            latest,
            ..CallerState::default()
        };
        let log = match r.byte()? {
            0 => {
                let n = r.len()?;
                let mut prev = base;
                for i in 0..n {
                    let d = r.signed()?;
                    let e = if i == 0 {
                        base.wrapping_sub(d)
                    } else {
                        prev.wrapping_add(d)
                    };
                    state.log.push_back(e);
                    prev = e;
                }
                PackedLog::Inline
            }
            1 => PackedLog::Outside {
                dead: r.varint()?,
                len: r.varint()?,
            },
            _ => return None,
        };
        for _ in 0..r.len()? {
            let id = r.rule_id()?;
            let mut buckets = BTreeMap::new();
            for _ in 0..r.len()? {
                let b = r.signed()?;
                buckets.insert(b, r.varint()?);
            }
            state.fixed.push((id, buckets));
        }
        for _ in 0..r.len()? {
            let id = r.rule_id()?;
            let bucket = r.opt()?;
            let (cur, prev) = (r.varint()?, r.varint()?);
            state.approx.push((id, Approx { bucket, cur, prev }));
        }
        let mut callees = Vec::new();
        for _ in 0..r.len()? {
            let ts = base.wrapping_sub(r.signed()?);
            callees.push((CompactString::from(r.string()?), ts));
        }
        state.callees = CalleeTimes::from_entries(callees);
        if format >= PACK_FORMAT_RULES {
            let rare = state.rare_mut();
            rare.unpack_rule_state(&mut r, base)?;
            if format >= PACK_FORMAT_OPEN {
                rare.unpack_open_state(&mut r, base)?;
            }
            if format == PACK_FORMAT_SUMS {
                rare.unpack_sums_state(&mut r, base)?;
            }
        }
        r.0.is_empty().then_some((state, log))
    }

    /// Puts back a sliding log kept apart ([`PackedLog::Outside`]); `None`
    /// (and nothing changed) unless the times are in order.
    pub fn restore_log(&mut self, times: VecDeque<i64>) -> Option<()> {
        times
            .iter()
            .zip(times.iter().skip(1))
            .all(|(a, b)| a <= b)
            .then(|| {
                self.log = times;
            })
    }

    /// Takes back a record kept elsewhere (its call id and verdict), as if
    /// this state had decided the call.
    pub fn restore_record(&mut self, call_id: &str, verdict: Verdict) {
        let t = verdict.record.ts_ms;
        let pos = self.seen_by_ts.partition_point(|(ts, _)| *ts <= t);
        self.seen_by_ts.insert(pos, (t, call_id.into()));
        self.keep_record(call_id.into(), &verdict);
    }

    /// Takes back many records at once, as [`CallerState::restore_record`]
    /// does one by one, in O(n log n) whatever their order: a records hash
    /// is read back in no particular order, and placing each record in
    /// time order as it comes moved half the list per record (a flooding
    /// caller's thousands of records took tens of milliseconds).
    pub fn restore_records(&mut self, records: impl IntoIterator<Item = (CompactString, Verdict)>) {
        for (call_id, verdict) in records {
            self.seen_by_ts
                .push_back((verdict.record.ts_ms, call_id.clone()));
            self.keep_record(call_id, &verdict);
        }
        // Stable: records of the same time keep their order.
        self.seen_by_ts.make_contiguous().sort_by_key(|(ts, _)| *ts);
    }
}

impl CallerState {
    /// Whether the state keeps a record of call `call_id`.
    pub fn holds_record(&self, call_id: &str) -> bool {
        self.seen.contains_key(call_id)
    }

    /// How many call records the state keeps.
    pub fn record_count(&self) -> usize {
        self.seen.len()
    }

    /// About how many bytes of memory the state holds (its tables' entries
    /// and the records' text; allocator slack and table capacity not
    /// counted), for a store that bounds the memory of the callers it
    /// keeps.
    pub fn approx_bytes(&self) -> usize {
        use std::mem::size_of;
        // A hash table entry costs about its key and value plus a control
        // byte and the table's spare room; a tree entry about twice its
        // pair. Counted from lengths only (constant time: it runs for
        // every caller of every batch, and the packed records' bytes are
        // kept as a sum), so text a call id keeps on the heap beyond its
        // inline 24 bytes is not counted.
        size_of::<Self>()
            + self.log.len() * size_of::<i64>()
            + self
                .fixed
                .iter()
                .map(|(id, map)| {
                    size_of::<(RuleId, BTreeMap<i64, u64>)>() + id.name.len() + map.len() * 32
                })
                .sum::<usize>()
            + self.approx.len() * size_of::<(RuleId, Approx)>()
            + self.seen.len() * (size_of::<(CompactString, Kept)>() + 16)
            + self.seen_bytes
            + self.seen_by_ts.len() * size_of::<(i64, CompactString)>()
            + self.callees.approx_bytes()
            + self.rare.as_deref().map_or(0, Rare::approx_bytes)
    }

    /// The call records the state keeps (call id and verdict), in no
    /// particular order; `caller` is the state's caller (the records keep
    /// it once, there).
    pub fn records<'a>(&'a self, caller: &'a str) -> impl Iterator<Item = (&'a str, Verdict)> {
        self.seen
            .iter()
            .filter_map(move |(id, v)| Some((id.as_str(), v.verdict(id, caller)?)))
    }
}

impl Rare {
    /// [`CallerState::approx_bytes`] for this part (its own size included).
    fn approx_bytes(&self) -> usize {
        use std::mem::size_of;
        size_of::<Self>()
            + self
                .own_logs
                .iter()
                .map(|(id, log)| {
                    size_of::<(RuleId, VecDeque<i64>)>() + id.name.len() + log.len() * 8
                })
                .sum::<usize>()
            + self.buckets.len() * size_of::<(RuleId, Option<Tat>)>()
            + self
                .pairs
                .iter()
                .map(|(_, p)| size_of::<(RuleId, Pairs)>() + p.approx_bytes())
                .sum::<usize>()
            + self
                .distinct
                .iter()
                .map(|(_, c)| size_of::<(RuleId, Callees)>() + c.approx_bytes())
                .sum::<usize>()
            + self
                .open
                .iter()
                .map(|(_, c)| size_of::<(RuleId, OpenCalls)>() + c.len() * size_of::<open::Open>())
                .sum::<usize>()
            + self.pending_ends.len() * size_of::<(i64, CompactString)>()
            + self
                .sums
                .iter()
                .map(|(_, s)| size_of::<(RuleId, Sums)>() + s.approx_bytes())
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{call, T0};
    use super::*;

    #[test]
    fn packed_state_reads_back_and_corrupt_bytes_are_refused() {
        // Every kind, and a sliding rule with a log of its own.
        let rules = RuleSet::from_toml(
            r#"
            [[rule]]
            name = "f"
            kind = "fixed"
            window = "10s"
            limit = 3
            [[rule]]
            name = "s"
            kind = "sliding"
            window = "20s"
            limit = 3
            [[rule]]
            name = "a"
            kind = "sliding-approx"
            window = "30s"
            limit = 3
            [[rule]]
            name = "own"
            kind = "sliding"
            window = "20s"
            limit = 2
            callees = ["+34912", "+34913"]
            [[rule]]
            name = "tb"
            kind = "token-bucket"
            rate = "3/s"
            burst = 4
            [[rule]]
            name = "spray"
            kind = "distinct-callees"
            window = "10s"
            limit = 3
            [[rule]]
            name = "same_callee"
            key = "caller+callee"
            kind = "sliding-approx"
            window = "20s"
            limit = 2
            [[rule]]
            name = "pair_tb"
            key = "caller+callee"
            kind = "token-bucket"
            rate = "1/s"
            burst = 2
            "#,
        )
        .unwrap()
        .with_distinct_callees(true);
        let mut state = CallerState::default();
        let mut copy_at = Vec::new();
        for i in 0..40i64 {
            let mut ev = call(&format!("c{i}"), T0 + i * 700 - (i % 3) * 900);
            ev.callee = Some(format!("+3491{}", i % 7).into());
            // Decide the next call on the state and on a copy read back
            // from its packed form (records are kept apart: unique ids).
            let mut packed = Vec::new();
            state.pack(&mut packed, PackedLog::Inline);
            let (mut copy, log) = CallerState::unpack(&packed).expect("reads back");
            assert_eq!(log, PackedLog::Inline);
            // The same with the log kept apart and put back.
            let mut apart = Vec::new();
            state.pack(&mut apart, PackedLog::Outside { dead: 3, len: 9 });
            let (mut other, log) = CallerState::unpack(&apart).expect("reads back");
            assert_eq!(log, PackedLog::Outside { dead: 3, len: 9 });
            assert!(other.log.is_empty());
            other.restore_log(state.log.clone()).expect("in order");
            let a = state.apply_unique(&rules, &ev, true);
            let b = copy.apply_unique(&rules, &ev, true);
            let c = other.apply_unique(&rules, &ev, true);
            assert_eq!(a, b, "call {i}");
            assert_eq!(a, c, "call {i}, log apart");
            copy_at = packed;
        }
        // The rules with state of their own were packed and read back.
        let rare = state.rare.as_deref().expect("the rarer rules' state");
        assert!(
            !rare.own_logs.is_empty()
                && !rare.buckets.is_empty()
                && !rare.distinct.is_empty()
                && !rare.pairs.is_empty()
        );
        for cut in 0..copy_at.len() {
            assert!(
                CallerState::unpack(&copy_at[..cut]).is_none(),
                "prefix {cut}"
            );
        }
        let mut longer = copy_at.clone();
        longer.push(0);
        assert!(CallerState::unpack(&longer).is_none());
        assert!(CallerState::unpack(&[3, 0, 0, 0, 0, 0]).is_none());
    }

    /// Decides 60 calls and ends under `rules` (every third event the end
    /// of the call before, or every fourth of one to come, with talk),
    /// packing the state before each and reading it back: the copy packs
    /// the same and decides the event as the state does; some state
    /// packed under `format`, and every truncation of the last is
    /// refused. The state after them.
    fn reads_back(rules: &RuleSet, format: u8) -> CallerState {
        use crate::engine::event::EventKind;
        let mut state = CallerState::default();
        let mut packed_some = false;
        for i in 0..60i64 {
            let t = T0 + i * 900;
            let ev = if i % 3 == 2 {
                let id = if i % 4 == 0 {
                    format!("c{}", i + 1)
                } else {
                    format!("c{}", i - 1)
                };
                CallEvent {
                    kind: EventKind::End,
                    talk_ms: Some(1_000 + i * 100),
                    ..call(&id, t + 400)
                }
            } else {
                call(&format!("c{i}"), t)
            };
            let mut packed = Vec::new();
            state.pack(&mut packed, PackedLog::Inline);
            packed_some |= packed[0] == format;
            let (mut copy, _) = CallerState::unpack(&packed).expect("reads back");
            let mut again = Vec::new();
            copy.pack(&mut again, PackedLog::Inline);
            assert_eq!(packed, again, "event {i}: packs the same");
            assert_eq!(state.apply(rules, &ev), copy.apply(rules, &ev), "event {i}");
        }
        assert!(packed_some, "nothing packed under format {format}");
        let mut packed = Vec::new();
        state.pack(&mut packed, PackedLog::Inline);
        for cut in 0..packed.len() {
            assert!(
                CallerState::unpack(&packed[..cut]).is_none(),
                "prefix {cut}"
            );
        }
        state
    }

    /// Sum rules' waiting calls, what ended calls added and the talk of
    /// ends that came first read back.
    #[test]
    fn sums_read_back() {
        let rules = RuleSet::from_toml(
            "[[rule]]\nname = \"talk\"\nkind = \"sliding-approx\"\nwindow = \"20s\"\nsum = \"talk\"\nlimit = 30\nmax_duration = \"5s\"\n",
        )
        .unwrap();
        let state = reads_back(&rules, PACK_FORMAT_SUMS);
        let rare = state.rare.as_deref().expect("the sums' state");
        assert!(!rare.sums.is_empty() && !rare.pending_ends.is_empty());
    }

    /// Calls held open (ended or not) and ends that came before their
    /// calls read back.
    #[test]
    fn open_calls_and_pending_ends_read_back() {
        let rules = RuleSet::from_args(None, &["ch:concurrent:20s:3".into()]).unwrap();
        let state = reads_back(&rules, PACK_FORMAT_OPEN);
        let rare = state.rare.as_deref().expect("the open calls' state");
        assert!(!rare.open.is_empty() && !rare.pending_ends.is_empty());
    }
}
