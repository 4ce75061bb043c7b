//! The cached store's wire formats, the ones `lua/commit.lua` mirrors:
//! the state string, the commit call's keys and arguments, and the
//! replies (refusals, read-backs) decoded.

use compact_str::CompactString;
use redis::Value;

use super::cache::{Cached, Records};
use super::COMMIT_LUA;
use crate::engine::record::Verdict;
use crate::engine::window::{put_varint, take_varint, CallerState, PackedLog};
use crate::error::StoreError;
use crate::store::redis::RedisConfig;

/// What a write does to a caller's records hash.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum RecordsOp {
    /// Records inline; no hash.
    Inline,
    /// The hash: records set and deleted.
    Hash,
    /// The records moved out: the hash replaced by the ones set.
    Replace,
    /// The records moved back inline: the hash deleted.
    Delete,
}

impl RecordsOp {
    /// Its flag in the commit call's head (see `lua/commit.lua`).
    pub(super) fn code(self) -> u8 {
        match self {
            RecordsOp::Inline => b'-',
            RecordsOp::Hash => b'H',
            RecordsOp::Replace => b'S',
            RecordsOp::Delete => b'D',
        }
    }
}

/// What one caller's commit writes (its keys are written into the call
/// from the caller, see [`invocation`]).
pub(super) struct Write {
    pub(super) caller: CompactString,
    /// Its caller's place in the batch's list of callers.
    pub(super) pending: usize,
    /// Only check that the caller's version is `expected`; write nothing.
    pub(super) check: bool,
    pub(super) expected: Option<u64>,
    pub(super) version: u64,
    /// The TTL to set (ms), or `None` to leave the keys'.
    pub(super) ttl_ms: Option<u64>,
    pub(super) log_op: LogOp,
    /// Where the log is after this write.
    pub(super) log: PackedLog,
    /// The new state string (see `lua/commit.lua`).
    pub(super) value: Vec<u8>,
    pub(super) records_op: RecordsOp,
    pub(super) sets: Vec<(CompactString, String)>,
    pub(super) dels: Vec<CompactString>,
    pub(super) block: Option<(CompactString, i64)>,
    /// When refused, read back only the records of these call ids (the
    /// caller's calls in the batch) with its state and log, in one
    /// transaction, instead of all its records: see
    /// `CachedStore::try_batch`. `None`: read back its whole state.
    pub(super) read_ids: Option<Vec<CompactString>>,
}

impl Write {
    /// The keys its commit declares, in `lua/commit.lua`'s order, as
    /// (head, tail) of `<prefix><head>{<caller>}<tail>`: the state string,
    /// then the log, the records hash and the block key when it touches
    /// them.
    pub(super) fn key_parts(&self) -> impl Iterator<Item = (&'static str, &'static str)> {
        [
            Some(("", ":s")),
            (!matches!(self.log_op, LogOp::Inline)).then_some(("", ":l")),
            (self.records_op != RecordsOp::Inline).then_some(("", ":r")),
            self.block.is_some().then_some(("block:", "")),
        ]
        .into_iter()
        .flatten()
    }

    /// A write of nothing that only checks that the caller's version is
    /// still `cached`'s (its calls in the batch were all decided before).
    pub(super) fn check(caller: CompactString, pending: usize, cached: &Cached) -> Self {
        Write {
            caller,
            pending,
            check: true,
            expected: cached.version,
            version: cached.version.unwrap_or_default(),
            ttl_ms: None,
            log_op: LogOp::Inline,
            log: cached.log,
            value: Vec::new(),
            records_op: RecordsOp::Inline,
            sets: Vec::new(),
            dels: Vec::new(),
            block: None,
            read_ids: None,
        }
    }

    /// The TTL of a write that only creates a new caller's state string
    /// (no log or records apart, no block key): one plain `SET ... NX PX`,
    /// no script. `None` for any other write.
    pub(super) fn plain_ttl(&self) -> Option<u64> {
        let plain = self.expected.is_none()
            && matches!(self.log_op, LogOp::Inline)
            && self.records_op == RecordsOp::Inline
            && self.block.is_none();
        self.ttl_ms.filter(|_| plain)
    }
}

/// Whether a caller's state string holds its whole state: records inline
/// and the sliding log in the packed state (else they are in other keys).
pub(super) fn self_contained(value: &[u8]) -> bool {
    value.get(8) == Some(&0)
        && take_bytes(&value[9..])
            .and_then(|(packed, _)| CallerState::unpack(packed))
            .is_some_and(|(_, log)| log == PackedLog::Inline)
}

/// A refused write, with the caller's state as Redis holds it.
pub(super) struct Refused {
    /// Which of the round's writes.
    pub(super) write: usize,
    /// The state read; `None` when the caller was written again while its
    /// records were read (the next round reads it again).
    pub(super) read: Option<Found>,
}

/// A caller's state as read from Redis.
pub(super) struct Found {
    /// Its state string (`None`: the caller has none).
    pub(super) value: Option<Vec<u8>>,
    /// Its records hash, as `HGETALL` returns it (empty unless kept apart).
    pub(super) hash: Vec<Value>,
    /// Its log kept apart, if any.
    pub(super) log: Option<Vec<u8>>,
    /// `hash` holds only the records of the write's `read_ids`, not all.
    pub(super) partial: bool,
}

/// A group of writes sent, and those of them that were refused.
pub(super) struct Committed {
    pub(super) writes: Vec<Write>,
    pub(super) refused: Vec<Refused>,
}

/// What a write does to a caller's log kept apart.
pub(super) enum LogOp {
    /// The log is in the packed state, and no string is kept.
    Inline,
    /// The string stays as it is.
    Keep,
    /// Times appended to the string.
    Append(Vec<u8>),
    /// The string replaced (created, compacted, or changed inside).
    Set(Vec<u8>),
    /// The log moved back into the packed state: the string deleted.
    Delete,
}

impl LogOp {
    /// Its flag in the commit call's head (see `lua/commit.lua`).
    pub(super) fn code(&self) -> u8 {
        match self {
            LogOp::Inline => b'-',
            LogOp::Keep => b'K',
            LogOp::Append(_) => b'A',
            LogOp::Set(_) => b'S',
            LogOp::Delete => b'D',
        }
    }

    /// The times it sends, if any.
    pub(super) fn bytes(&self) -> Option<&[u8]> {
        match self {
            LogOp::Append(b) | LogOp::Set(b) => Some(b),
            _ => None,
        }
    }
}

/// The fixed-width (little-endian `i64`) bytes of `times`.
pub(super) fn time_bytes<'a>(times: impl Iterator<Item = &'a i64>) -> Vec<u8> {
    times.flat_map(|t| t.to_le_bytes()).collect()
}

/// The commit call for `writes`.
/// Keys and arguments are those each write needs (most need the
/// state key, a head and the new string), as `lua/commit.lua`'s header
/// lays out.
/// With `text`, the call carries the script's text (`EVAL`, which
/// also loads it again), else its SHA.
pub(super) fn invocation(
    config: &RedisConfig,
    sha: &str,
    writes: &[&Write],
    text: bool,
) -> redis::Cmd {
    let keys: usize = writes.iter().map(|w| w.key_parts().count()).sum();
    let mut cmd = redis::Cmd::with_capacity(
        2 + keys + writes.len() * 3,
        64 + writes.iter().map(|w| 96 + w.value.len()).sum::<usize>(),
    );
    if text {
        cmd.arg("EVAL").arg(COMMIT_LUA);
    } else {
        cmd.arg("EVALSHA").arg(sha);
    }
    cmd.arg(keys);
    // The keys, built in one buffer rather than a string each.
    let mut key = String::new();
    for w in writes {
        for (head, tail) in w.key_parts() {
            config.write_tagged(&mut key, head, &w.caller, tail);
            cmd.arg(key.as_str());
        }
    }
    for w in writes {
        let mut head = [0u8; 12];
        head[0] = if w.check { b'C' } else { w.log_op.code() };
        head[1] = w.records_op.code();
        head[2] = if w.block.is_some() { b'B' } else { b'-' };
        head[3] = if w.ttl_ms.is_some() { b'T' } else { b'-' };
        let head = match w.expected {
            Some(v) => {
                head[4..].copy_from_slice(&v.to_le_bytes());
                &head[..]
            }
            None => &head[..4],
        };
        cmd.arg(head).arg(&w.value[..]);
        if let Some(ms) = w.ttl_ms {
            cmd.arg(ms);
        }
        if let Some(bytes) = w.log_op.bytes() {
            cmd.arg(bytes);
        }
        if let Some((reason, ms)) = &w.block {
            cmd.arg(reason.as_str()).arg(*ms);
        }
        if matches!(w.records_op, RecordsOp::Hash | RecordsOp::Replace) {
            cmd.arg(w.sets.len()).arg(w.dels.len());
            for (id, record) in &w.sets {
                cmd.arg(id.as_str()).arg(record);
            }
            for id in &w.dels {
                cmd.arg(id.as_str());
            }
        }
    }
    cmd
}

/// The refused writes of one script call's `reply`, as indices of
/// `chunk` (the call's writes), with the state strings found.
pub(super) fn refusals(
    reply: Option<Value>,
    chunk: &[usize],
    found: &mut Vec<(usize, Option<Vec<u8>>)>,
) -> Result<(), redis::RedisError> {
    let items = match reply {
        Some(Value::Array(items)) => items,
        Some(Value::ServerError(e)) => return Err(e.into()),
        other => return Err(unexpected(format!("{other:?}"))),
    };
    let mut it = items.into_iter();
    while let (Some(idx), Some(value)) = (it.next(), it.next()) {
        let Value::Int(idx) = idx else {
            return Err(unexpected("a malformed refusal".into()));
        };
        let at = usize::try_from(idx)
            .ok()
            .and_then(|i| chunk.get(i))
            .ok_or_else(|| unexpected(format!("caller index {idx}")))?;
        found.push((*at, bulk(value)?));
    }
    Ok(())
}

/// An `HSCAN` reply: the next cursor and the field/value pairs.
pub(super) fn scanned(reply: Value) -> Result<(u64, Vec<Value>), redis::RedisError> {
    let Value::Array(mut parts) = reply else {
        return Err(unexpected(format!("HSCAN answered {reply:?}")));
    };
    let (Some(Value::Array(items)), Some(cursor)) = (parts.pop(), parts.pop()) else {
        return Err(unexpected("a malformed HSCAN reply".into()));
    };
    let cursor = text(&cursor)
        .and_then(|c| std::str::from_utf8(c).ok()?.parse().ok())
        .ok_or_else(|| unexpected("an HSCAN cursor".into()))?;
    Ok((cursor, items))
}

/// Field/value pairs with each field once (`HSCAN` may return a field
/// twice across calls).
pub(super) fn distinct_fields(pairs: Vec<Value>) -> Vec<Value> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(pairs.len());
    let mut it = pairs.into_iter();
    while let (Some(field), Some(value)) = (it.next(), it.next()) {
        if text(&field).is_some_and(|f| seen.insert(f.to_vec())) {
            out.push(field);
            out.push(value);
        }
    }
    out
}

/// A string of a reply, or nil.
pub(super) fn bulk(v: Value) -> Result<Option<Vec<u8>>, redis::RedisError> {
    match v {
        Value::BulkString(b) => Ok(Some(b)),
        Value::Nil => Ok(None),
        Value::ServerError(e) => Err(e.into()),
        other => Err(unexpected(format!("{other:?}"))),
    }
}

/// A caller's state string (see `lua/commit.lua`): version, form, the
/// packed window state and the records when inline.
pub(super) fn state_value(
    version: u64,
    state: &CallerState,
    log: PackedLog,
    records: &Records,
) -> Vec<u8> {
    let mut packed = Vec::with_capacity(48);
    state.pack(&mut packed, log);
    // Sized once: version, form, then each part after its length (at
    // most 10 bytes of LEB128 each).
    let inline: usize = match records {
        Records::Inline(list) => list.iter().map(|(id, r)| id.len() + r.len() + 20).sum(),
        Records::Apart | Records::Partial => 0,
    };
    let mut out = Vec::with_capacity(8 + 1 + 10 + packed.len() + inline);
    out.extend_from_slice(&version.to_le_bytes());
    match records {
        Records::Inline(list) => {
            out.push(0);
            put_bytes(&mut out, &packed);
            for (id, record) in list {
                put_bytes(&mut out, id.as_bytes());
                put_bytes(&mut out, record.as_bytes());
            }
        }
        Records::Apart | Records::Partial => {
            out.push(1);
            put_bytes(&mut out, &packed);
        }
    }
    out
}

/// `bytes` after their length (LEB128).
pub(super) fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// The bytes at the front of `input` after their length (LEB128), and the
/// rest.
pub(super) fn take_bytes(input: &[u8]) -> Option<(&[u8], &[u8])> {
    let (n, rest) = take_varint(input)?;
    let n = usize::try_from(n).ok().filter(|&n| n <= rest.len())?;
    Some(rest.split_at(n))
}

pub(super) fn unexpected(what: String) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::Client,
        "unexpected commit script reply",
        what,
    ))
}

pub(super) fn text(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

/// A caller's cache entry from its state string, records hash (as HGETALL
/// returns it) and log kept apart; no state string: a new caller.
pub(super) fn load(
    caller: &str,
    value: Option<Vec<u8>>,
    hash: Vec<Value>,
    log: Option<Vec<u8>>,
) -> Result<Cached, StoreError> {
    let bad = |what: &str| {
        StoreError::fatal(format!(
            "unreadable window state of caller {caller} in Redis: {what}"
        ))
    };
    let Some(value) = value else {
        return Ok(Cached::default());
    };
    let (version, rest) = value
        .split_first_chunk::<8>()
        .ok_or_else(|| bad("too short"))?;
    let version = u64::from_le_bytes(*version);
    let (&form, rest) = rest.split_first().ok_or_else(|| bad("too short"))?;
    let (packed, mut rest) = take_bytes(rest).ok_or_else(|| bad("packed state"))?;
    let (mut state, log_form) = CallerState::unpack(packed).ok_or_else(|| bad("packed state"))?;
    if let PackedLog::Outside { dead, len } = log_form {
        let bytes = log.unwrap_or_default();
        let times: Option<std::collections::VecDeque<i64>> =
            (bytes.len() as u64 == len * 8 && dead <= len).then(|| {
                bytes
                    .chunks_exact(8)
                    .skip(dead as usize)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default()))
                    .collect()
            });
        times
            .and_then(|t| state.restore_log(t))
            .ok_or_else(|| bad("log kept apart"))?;
    }
    let mut restored: Vec<(CompactString, Verdict)> = Vec::new();
    let mut restore = |id: &[u8], rec: &[u8]| {
        let (Ok(id), Ok(rec)) = (std::str::from_utf8(id), std::str::from_utf8(rec)) else {
            return Err(bad("record not UTF-8"));
        };
        let verdict = Verdict::from_stored(rec, id, caller, false).ok_or_else(|| bad(rec))?;
        restored.push((CompactString::from(id), verdict));
        Ok((CompactString::from(id), rec.to_string()))
    };
    let records = match form {
        0 => {
            let mut list = Vec::new();
            while !rest.is_empty() {
                let (id, after) = take_bytes(rest).ok_or_else(|| bad("record id"))?;
                let (rec, after) = take_bytes(after).ok_or_else(|| bad("record"))?;
                list.push(restore(id, rec)?);
                rest = after;
            }
            Records::Inline(list)
        }
        1 => {
            let mut it = hash.iter();
            while let (Some(id), Some(rec)) = (it.next(), it.next()) {
                let (Some(id), Some(rec)) = (text(id), text(rec)) else {
                    return Err(bad("record not a string"));
                };
                restore(id, rec)?;
            }
            Records::Apart
        }
        _ => return Err(bad("unknown form")),
    };
    state.restore_records(restored);
    Ok(Cached {
        state,
        version: Some(version),
        log: log_form,
        records,
        ..Cached::default()
    })
}

/// The byte formats alone, no server: lengths, the state string and its
/// peek, as `lua/commit.lua` reads them.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::event::CallEvent;
    use crate::engine::rules::RuleSet;

    #[test]
    fn lengths_round_trip_and_truncation_is_refused() {
        for n in [0usize, 1, 127, 128, 300, 16_383, 16_384, 70_000] {
            let bytes = vec![7u8; n];
            let mut out = Vec::new();
            put_bytes(&mut out, &bytes);
            out.extend_from_slice(b"rest");
            let (got, rest) = take_bytes(&out).expect("reads back");
            assert_eq!((got.len(), rest), (n, &b"rest"[..]), "{n}");
            // Cut anywhere before the end of the bytes: refused, never a
            // shorter slice.
            for cut in [0, 1, out.len() - 5] {
                if cut < out.len() - 4 {
                    assert_eq!(take_bytes(&out[..cut]), None, "{n} cut at {cut}");
                }
            }
        }
        // 128 is two bytes, low seven bits first.
        let mut out = Vec::new();
        put_varint(&mut out, 128);
        assert_eq!(out, [0x80, 0x01]);
        // More than 10 bytes of continuation: no varint.
        assert_eq!(take_varint(&[0xff; 11]), None);
    }

    /// A caller's state string holds its version (8 bytes, little-endian),
    /// its form, its packed state and its records; it loads back as it was
    /// written, and its peek says whether it holds everything.
    #[test]
    fn the_state_string_loads_back_as_written() {
        let rules = RuleSet::from_args(None, &["m:sliding:60s:2".into()]).unwrap();
        let mut state = CallerState::default();
        let mut list = Vec::new();
        for (i, dt) in [0, 1_000, 2_000].into_iter().enumerate() {
            let ev = CallEvent::new(format!("c{i}"), "+34911000001", 1_764_547_200_000 + dt);
            let v = state.apply(&rules, &ev);
            list.push((ev.call_id.clone(), v.to_reply()));
        }
        let version = 0x0102_0304_0506_0708;
        let value = state_value(
            version,
            &state,
            PackedLog::Inline,
            &Records::Inline(list.clone()),
        );
        assert_eq!(&value[..8], &version.to_le_bytes());
        assert_eq!(value[8], 0, "records inline");
        assert!(self_contained(&value));
        let cached = load("+34911000001", Some(value), Vec::new(), None).unwrap();
        assert_eq!(cached.version, Some(version));
        assert_eq!(cached.log, PackedLog::Inline);
        assert_eq!(cached.state.log(), state.log());
        assert_eq!(cached.state.record_count(), 3);
        match &cached.records {
            Records::Inline(got) => assert_eq!(got, &list),
            Records::Apart | Records::Partial => panic!("records moved apart"),
        }
        // Records apart: the string is not self-contained, and they load
        // from the hash.
        let value = state_value(version, &state, PackedLog::Inline, &Records::Apart);
        assert_eq!(value[8], 1);
        assert!(!self_contained(&value));
        let hash: Vec<Value> = list
            .iter()
            .flat_map(|(id, r)| {
                [
                    Value::BulkString(id.as_bytes().to_vec()),
                    Value::BulkString(r.as_bytes().to_vec()),
                ]
            })
            .collect();
        let cached = load("+34911000001", Some(value), hash, None).unwrap();
        assert!(matches!(cached.records, Records::Apart));
        assert_eq!(cached.state.record_count(), 3);
        // The log apart: the string's times after the dead ones.
        let times: Vec<i64> = state.log().iter().copied().collect();
        let log = PackedLog::Outside { dead: 1, len: 4 };
        let value = state_value(version, &state, log, &Records::Inline(Vec::new()));
        assert!(!self_contained(&value));
        let bytes = time_bytes([0].iter().chain(&times));
        let cached = load("+34911000001", Some(value.clone()), Vec::new(), Some(bytes)).unwrap();
        assert_eq!(
            cached.state.log().iter().copied().collect::<Vec<_>>(),
            times
        );
        // A log of the wrong length, a cut string: clear errors.
        assert!(load("+34911000001", Some(value), Vec::new(), Some(vec![0; 8])).is_err());
        assert!(load("+34911000001", Some(vec![1, 2, 3]), Vec::new(), None).is_err());
        // No string: a new caller.
        assert_eq!(
            load("+34911000001", None, Vec::new(), None)
                .unwrap()
                .version,
            None
        );
    }
}
