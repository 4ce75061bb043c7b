//! Decoded call events held column by column: what an offline run keeps of
//! a log between reading it and deciding it.
//!
//! A log of millions of calls is read once, decoded once, and then visited
//! in time order a chunk at a time. Holding it as [`CallEvent`]s would cost
//! about 150 bytes a call, and as the file's text columns about 90; here a
//! call costs about 40: the time, the file row, the two numbers packed
//! into 8 bytes each (an E.164 number is at most 15 digits), the call id's
//! bytes in one arena, the duration and the label. [`EventColumns::event`]
//! gives back exactly the event that was pushed.

use compact_str::CompactString;

use crate::engine::event::{CallEvent, EventKind};

/// Bits of a packed number's digits (10^15 < 2^50).
const DIGIT_BITS: u32 = 50;
/// Set on a number that is not E.164 digits (a pseudonym): an index into
/// the text table follows.
const TEXT_FLAG: u64 = 1 << 63;
/// "No number" (a call without a callee); never a packed E.164 number,
/// whose digit count is at least 1.
const NO_NUMBER: u64 = 0;

/// Decoded events in push order, column by column.
#[derive(Debug, Default)]
pub struct EventColumns {
    ts: Vec<i64>,
    row: Vec<u64>,
    caller: Vec<u64>,
    callee: Vec<u64>,
    /// Call ids, concatenated; `id_end[i]` is where event `i`'s ends.
    ids: String,
    id_end: Vec<u64>,
    duration: Vec<i64>,
    /// Talk times, by index, once some event has one (empty before: a
    /// log without talk times pays nothing for the column).
    talk: Vec<i64>,
    /// Accounts, as indices into `texts` plus one (0: none), once some
    /// event has one (as `talk`).
    account: Vec<u32>,
    /// 0: no duration and no label; bit 0: a duration; bits 1-2: the
    /// label (1 legit, 2 fraud); bit 3: the row is a call's end; bit 4: a
    /// talk time.
    flags: Vec<u8>,
    /// Numbers that are not E.164 digits, by index (pseudonyms).
    texts: Vec<CompactString>,
    text_index: foldhash::HashMap<CompactString, u64>,
    /// The real caller of events that carry one (pseudonymised input), by
    /// event index.
    list_numbers: foldhash::HashMap<usize, String>,
    /// The real callee of events that carry one, by event index.
    filter_callees: foldhash::HashMap<usize, CompactString>,
}

impl EventColumns {
    /// An empty set of columns with room for `n` events.
    pub fn with_capacity(n: usize) -> Self {
        EventColumns {
            ts: Vec::with_capacity(n),
            row: Vec::with_capacity(n),
            caller: Vec::with_capacity(n),
            callee: Vec::with_capacity(n),
            ids: String::with_capacity(n * 8),
            id_end: Vec::with_capacity(n),
            duration: Vec::with_capacity(n),
            flags: Vec::with_capacity(n),
            ..EventColumns::default()
        }
    }

    /// Makes room for `n` events more, their call ids as long as
    /// `sample`'s on average.
    pub fn reserve_like(&mut self, n: usize, sample: &EventColumns) {
        self.ts.reserve(n);
        self.row.reserve(n);
        self.caller.reserve(n);
        self.callee.reserve(n);
        self.ids
            .reserve(n.saturating_mul(sample.ids.len().div_ceil(sample.len().max(1))));
        self.id_end.reserve(n);
        self.duration.reserve(n);
        self.flags.reserve(n);
    }

    /// Number of events.
    pub fn len(&self) -> usize {
        self.ts.len()
    }

    /// No events.
    pub fn is_empty(&self) -> bool {
        self.ts.is_empty()
    }

    /// Event `i`'s duration, ms (0 when it has none).
    pub fn duration(&self, i: usize) -> i64 {
        self.duration[i]
    }

    /// Event times, by index.
    pub fn times(&self) -> &[i64] {
        &self.ts
    }

    /// The caller of event `i` (as [`EventColumns::event`] gives it).
    pub fn caller(&self, i: usize) -> CompactString {
        self.unpack(self.caller[i]).unwrap_or_default()
    }

    /// The file row (1-based) of event `i`.
    pub fn row(&self, i: usize) -> u64 {
        self.row[i]
    }

    /// The call id of event `i`.
    pub fn call_id(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.id_end[i - 1] } as usize;
        // Pushed whole, so cut at character boundaries.
        self.ids
            .get(start..self.id_end[i] as usize)
            .unwrap_or_default()
    }

    /// Appends an event read from file row `row`.
    pub fn push(&mut self, row: u64, e: &CallEvent) {
        let i = self.ts.len();
        self.ts.push(e.ts_ms);
        self.row.push(row);
        let caller = self.pack(&e.caller);
        self.caller.push(caller);
        let callee = match &e.callee {
            Some(c) => self.pack(c),
            None => NO_NUMBER,
        };
        self.callee.push(callee);
        self.ids.push_str(&e.call_id);
        self.id_end.push(self.ids.len() as u64);
        self.duration.push(e.duration_ms.unwrap_or(0));
        if let Some(talk) = e.talk_ms {
            self.talk.resize(i, 0);
            self.talk.push(talk);
        }
        if let Some(account) = &e.account {
            let code = self.text_code(account);
            self.account.resize(i, 0);
            self.account.push(code + 1);
        }
        let label = match e.label {
            None => 0,
            Some(false) => 1,
            Some(true) => 2,
        };
        let end = u8::from(e.kind == EventKind::End) << 3;
        let talk = u8::from(e.talk_ms.is_some()) << 4;
        self.flags
            .push(u8::from(e.duration_ms.is_some()) | (label << 1) | end | talk);
        if let Some(n) = &e.list_number {
            self.list_numbers.insert(i, n.clone());
        }
        if let Some(c) = &e.filter_callee {
            self.filter_callees.insert(i, c.clone());
        }
    }

    /// Appends every event of `other`, in order.
    pub fn append(&mut self, other: EventColumns) {
        let base = self.len();
        let id_base = self.ids.len() as u64;
        self.ts.extend_from_slice(&other.ts);
        self.row.extend_from_slice(&other.row);
        self.ids.push_str(&other.ids);
        self.id_end.extend(other.id_end.iter().map(|e| e + id_base));
        self.duration.extend_from_slice(&other.duration);
        if !other.talk.is_empty() {
            self.talk.resize(base, 0);
            self.talk.extend_from_slice(&other.talk);
        }
        if !other.account.is_empty() {
            self.account.resize(base, 0);
            for (k, &code) in other.account.iter().enumerate() {
                let mapped = match code {
                    0 => 0,
                    c => self.text_code(&other.texts[c as usize - 1]) + 1,
                };
                self.account.resize(base + k, 0);
                self.account.push(mapped);
            }
        }
        self.flags.extend_from_slice(&other.flags);
        // Numbers kept as text are indices into `other`'s table.
        let remap = |this: &mut Self, codes: &[u64]| -> Vec<u64> {
            codes
                .iter()
                .map(
                    |&code| match other.texts.get((code & !TEXT_FLAG) as usize) {
                        Some(text) if code & TEXT_FLAG != 0 => this.pack(text),
                        _ => code,
                    },
                )
                .collect()
        };
        let callers = remap(self, &other.caller);
        let callees = remap(self, &other.callee);
        self.caller.extend(callers);
        self.callee.extend(callees);
        self.list_numbers
            .extend(other.list_numbers.into_iter().map(|(i, n)| (base + i, n)));
        self.filter_callees
            .extend(other.filter_callees.into_iter().map(|(i, c)| (base + i, c)));
    }

    /// Per event, a dense number for its caller: equal callers get equal
    /// numbers, numbered 0, 1, ... in order of first appearance.
    pub fn caller_ids(&self) -> Vec<u32> {
        let mut ids: foldhash::HashMap<u64, u32> = foldhash::HashMap::default();
        self.caller
            .iter()
            .map(|&code| {
                let next = ids.len() as u32;
                *ids.entry(code).or_insert(next)
            })
            .collect()
    }

    /// Event `i`'s end, when it is an attempt with a duration: a call-log
    /// row with `duration_ms` is an attempt at `ts` and an end at
    /// `ts + duration_ms`.
    pub fn end_of(&self, i: usize) -> Option<CallEvent> {
        self.has_end(i).then(|| CallEvent {
            call_id: self.call_id(i).into(),
            caller: self.unpack(self.caller[i]).unwrap_or_default(),
            ts_ms: self.ts[i].saturating_add(self.duration[i]),
            callee: self.unpack(self.callee[i]),
            kind: EventKind::End,
            talk_ms: (self.flags[i] & 16 == 16).then(|| self.talk.get(i).copied().unwrap_or(0)),
            account: self.account_of(i),
            list_number: self.list_numbers.get(&i).cloned(),
            filter_callee: self.filter_callees.get(&i).cloned(),
            ..Default::default()
        })
    }

    /// Whether event `i` is an attempt with a duration (so has an end of
    /// its own, [`EventColumns::end_of`]).
    pub fn has_end(&self, i: usize) -> bool {
        let flags = self.flags[i];
        flags & 1 == 1 && flags & 8 == 0
    }

    /// Whether event `i` is a call's end row.
    pub fn is_end(&self, i: usize) -> bool {
        self.flags[i] & 8 == 8
    }

    /// Index of `text` in the text table (added if new).
    fn text_code(&mut self, text: &str) -> u32 {
        if let Some(&i) = self.text_index.get(text) {
            return i as u32;
        }
        let i = self.texts.len() as u64;
        self.texts.push(text.into());
        self.text_index.insert(text.into(), i);
        i as u32
    }

    /// Event `i`'s account, if it has one.
    fn account_of(&self, i: usize) -> Option<CompactString> {
        match self.account.get(i) {
            Some(&c) if c > 0 => self.texts.get(c as usize - 1).cloned(),
            _ => None,
        }
    }

    /// Event `i`, as it was pushed.
    pub fn event(&self, i: usize) -> CallEvent {
        let flags = self.flags[i];
        CallEvent {
            call_id: self.call_id(i).into(),
            caller: self.unpack(self.caller[i]).unwrap_or_default(),
            ts_ms: self.ts[i],
            callee: self.unpack(self.callee[i]),
            kind: if flags & 8 == 8 {
                EventKind::End
            } else {
                EventKind::Attempt
            },
            duration_ms: (flags & 1 == 1).then_some(self.duration[i]),
            talk_ms: (flags & 16 == 16).then(|| self.talk.get(i).copied().unwrap_or(0)),
            account: self.account_of(i),
            label: match (flags >> 1) & 3 {
                1 => Some(false),
                2 => Some(true),
                _ => None,
            },
            list_number: self.list_numbers.get(&i).cloned(),
            filter_callee: self.filter_callees.get(&i).cloned(),
            ..Default::default()
        }
    }

    /// A number's code: `+` and 1 to 15 digits packed (the digit count
    /// above the value, so leading zeros survive), anything else as an
    /// index into the text table.
    fn pack(&mut self, number: &str) -> u64 {
        if let Some(code) = pack_digits(number) {
            return code;
        }
        if let Some(&i) = self.text_index.get(number) {
            return TEXT_FLAG | i;
        }
        let i = self.texts.len() as u64;
        self.texts.push(number.into());
        self.text_index.insert(number.into(), i);
        TEXT_FLAG | i
    }

    fn unpack(&self, code: u64) -> Option<CompactString> {
        if code == NO_NUMBER {
            return None;
        }
        if code & TEXT_FLAG != 0 {
            return self.texts.get((code & !TEXT_FLAG) as usize).cloned();
        }
        let len = (code >> DIGIT_BITS) as usize;
        let mut digits = itoa::Buffer::new();
        let value = digits.format(code & ((1 << DIGIT_BITS) - 1)).as_bytes();
        // `+`, the leading zeros, then the value's digits.
        let mut buf = [b'0'; 16];
        buf[0] = b'+';
        buf.get_mut(len.checked_sub(value.len())? + 1..=len)?
            .copy_from_slice(value);
        std::str::from_utf8(&buf[..=len])
            .ok()
            .map(CompactString::from)
    }
}

/// `+` and 1 to 15 ASCII digits, packed; `None` for anything else.
fn pack_digits(number: &str) -> Option<u64> {
    let digits = number.strip_prefix('+')?.as_bytes();
    if digits.is_empty() || digits.len() > 15 {
        return None;
    }
    let mut value = 0u64;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        value = value * 10 + u64::from(d - b'0');
    }
    Some(((digits.len() as u64) << DIGIT_BITS) | value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: &str, caller: &str, callee: Option<&str>) -> CallEvent {
        CallEvent {
            call_id: id.into(),
            caller: caller.into(),
            ts_ms: -5,
            callee: callee.map(Into::into),
            ..Default::default()
        }
    }

    #[test]
    fn every_event_comes_back_as_pushed() {
        let mut events = vec![
            event("a", "+34911000001", Some("+34600000001")),
            event("", "+000000", None),
            event("ü-ñ", "+999999999999999", Some("+0")),
            event(
                "long call id of more than twenty-four bytes",
                "h0123456789abcdef0123456789abcdef",
                Some("h0123456789abcdef0123456789abcdef"),
            ),
            event("x", "+1234567890123456", Some("+12a4")),
            event("y", "34911000001", Some("+")),
        ];
        events[0].duration_ms = Some(0);
        events[0].label = Some(true);
        events[1].duration_ms = Some(i64::MAX);
        events[1].label = Some(false);
        events[2].ts_ms = i64::MIN;
        events[3].list_number = Some("+34911000002".into());
        let mut rng_state = 0x2545_f491_4f6c_dd1d_u64;
        for k in 0..2_000u64 {
            rng_state ^= rng_state << 13;
            rng_state ^= rng_state >> 7;
            rng_state ^= rng_state << 17;
            let digits = 1 + (rng_state % 15) as usize;
            let n = format!(
                "+{:0width$}",
                rng_state % 10u64.pow(digits as u32),
                width = digits
            );
            let mut e = event(&format!("r{k}"), &n, (k % 3 == 0).then_some(n.as_str()));
            e.ts_ms = rng_state as i64;
            e.duration_ms = (k % 2 == 0).then_some(k as i64);
            e.label = [None, Some(true), Some(false)][(k % 3) as usize];
            events.push(e);
        }
        let mut cols = EventColumns::with_capacity(4);
        for (row, e) in events.iter().enumerate() {
            cols.push(row as u64 + 1, e);
        }
        assert_eq!(cols.len(), events.len());
        for (i, e) in events.iter().enumerate() {
            assert_eq!(&cols.event(i), e, "event {i}");
            assert_eq!(cols.row(i), i as u64 + 1);
            assert_eq!(cols.call_id(i), e.call_id);
        }
        // One pseudonym, one entry in the text table.
        assert_eq!(cols.texts.len(), 5, "{:?}", cols.texts);
        let mut again = EventColumns::default();
        again.push(9, &events[0]);
        again.append(cols);
        assert_eq!(again.event(1), events[0]);
        assert_eq!(again.event(4), events[3]);
        assert_eq!(again.len(), events.len() + 1);
        // Caller numbers: equal exactly when the callers are.
        let ids = again.caller_ids();
        for i in 0..again.len() {
            for j in 0..again.len().min(64) {
                let same = again.event(i).caller == again.event(j).caller;
                assert_eq!(ids[i] == ids[j], same, "events {i} and {j}");
            }
        }
        assert_eq!(ids[0], 0);
    }
}
