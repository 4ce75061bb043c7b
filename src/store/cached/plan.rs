//! What one caller's commit writes: its calls decided on its cached
//! state, then where its records and log go and what the write sends.
//! No I/O.

use compact_str::CompactString;

use super::cache::{Cached, Records, TtlPlan};
use super::wire::{state_value, time_bytes, LogOp, RecordsOp, Write};
use super::TRIM_COUNT;
use crate::engine::event::CallEvent;
use crate::engine::record::{Decision, Verdict};
use crate::engine::rules::RuleSet;
use crate::engine::window::{CallerState, Journal, PackedLog};

/// The settings a commit is planned with.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    /// Keep each call's record ([`crate::store::redis::RedisConfig::idempotency`]).
    pub(super) idempotency: bool,
    /// Set block keys on rejects.
    pub(super) block_keys: bool,
    /// See [`super::DEFAULT_LOG_APART_ABOVE`].
    pub(super) log_apart_above: usize,
    /// See [`super::DEFAULT_RECORDS_APART_ABOVE`].
    pub(super) records_apart_above: usize,
}

/// One caller's part of a batch while it is being decided.
pub(super) struct Pending {
    pub(super) caller: CompactString,
    /// Indices of its events in the batch, in order.
    pub(super) events: Vec<usize>,
    /// Boxed, so the cache's table holds a pointer per caller: growing it
    /// moves a few bytes per caller, not the whole state.
    pub(super) cached: Box<Cached>,
    /// Rounds of this batch whose write of it was refused.
    pub(super) refused: u32,
    /// Its state is the one Redis returned with its latest refusal (not
    /// the decisions of a write Redis refused).
    pub(super) read_back: bool,
}

/// How a caller's log is written back, and where it then is: `old_len`
/// times before the batch, `journal` what the batch did to them.
pub(super) fn log_write(
    plan: &Plan,
    state: &CallerState,
    was: PackedLog,
    old_len: usize,
    journal: &Journal,
) -> (LogOp, PackedLog) {
    let log = state.log();
    let n = log.len();
    let whole = || {
        (
            LogOp::Set(time_bytes(log.iter())),
            PackedLog::Outside {
                dead: 0,
                len: n as u64,
            },
        )
    };
    match was {
        PackedLog::Inline if n > plan.log_apart_above => whole(),
        PackedLog::Inline => (LogOp::Inline, PackedLog::Inline),
        PackedLog::Outside { .. } if n < plan.log_apart_above / 4 => {
            (LogOp::Delete, PackedLog::Inline)
        }
        PackedLog::Outside { dead, len } => {
            // Only appended, and trimmed at the front among the times
            // kept before: the string's tail grows.
            if journal.log_inserted_inside || journal.log_trimmed > old_len {
                return whole();
            }
            let dead = dead + journal.log_trimmed as u64;
            let appended = n - (old_len - journal.log_trimmed);
            if dead > n as u64 && dead > plan.log_apart_above as u64 {
                return whole(); // mostly trimmed: compact
            }
            let op = if appended == 0 {
                LogOp::Keep
            } else {
                LogOp::Append(time_bytes(log.iter().skip(n - appended)))
            };
            (
                op,
                PackedLog::Outside {
                    dead,
                    len: len + appended as u64,
                },
            )
        }
    }
}

/// Decides `p`'s events on its cached state and says what to write.
/// When every one of them was a call already decided (a duplicate
/// changes no state), the write only checks that the caller's version
/// is still the one cached, and writes nothing: the caller keeps its
/// version, and a cache another writer made stale is still caught.
pub(super) fn decide_caller(
    plan: &Plan,
    rules: &RuleSet,
    events: &[CallEvent],
    (at, p): (usize, &mut Pending),
    verdicts: &mut [Option<Verdict>],
    ttl: TtlPlan,
) -> Write {
    let idem = plan.idempotency;
    let mut journal = Journal::default();
    let old_len = p.cached.state.log().len();
    let mut made: Vec<(CompactString, String)> =
        Vec::with_capacity(if idem { p.events.len() } else { 0 });
    let mut block = None;
    let mut changed = false;
    for &i in &p.events {
        let ev = &events[i];
        let v = p
            .cached
            .state
            .apply_journaled(rules, ev, !idem, &mut journal);
        if v.end {
            // A call's end changes the calls held open; it has no record.
            changed = true;
        } else if !v.duplicate {
            changed = true;
            if idem {
                made.push((ev.call_id.clone(), v.to_reply()));
            }
            if plan.block_keys && v.record.decision == Decision::Reject {
                // (A rule keyed by callee or global blocks no caller.)
                let by_aggregate = rules
                    .rule_index(&v.record.reason)
                    .is_some_and(|r| rules.rules[r].key.is_aggregate());
                if let Some(ms) = v.record.retry_after_ms.filter(|_| !by_aggregate) {
                    block = Some((v.record.reason.clone(), ms));
                }
            }
        }
        verdicts[i] = Some(v);
    }
    if !changed {
        return Write::check(p.caller.clone(), at, &p.cached);
    }
    let cached = &mut *p.cached;
    let (records_op, sets, dels) = records_write(
        plan,
        (&p.caller, &cached.state),
        (&mut cached.records, &mut cached.stale),
        made,
        &mut journal,
    );
    let state = &p.cached.state;
    let (log_op, log) = log_write(plan, state, p.cached.log, old_len, &journal);
    let version = rand::random::<u64>() | 1;
    let value = state_value(version, state, log, &p.cached.records);
    let fresh = p.cached.version.is_some() && ttl.covered_by(p.cached.ttl_until);
    // SET drops a key's TTL, and a new hash has none: a replaced log
    // or records moved out get it again.
    let must_set_ttl = matches!(log_op, LogOp::Set(_)) || records_op == RecordsOp::Replace;
    Write {
        caller: p.caller.clone(),
        pending: at,
        check: false,
        expected: p.cached.version,
        version,
        ttl_ms: (!fresh || must_set_ttl).then_some(ttl.ms),
        log_op,
        log,
        value,
        records_op,
        sets,
        dels,
        block,
        read_ids: None,
    }
}

/// Where a caller's changed records go: inline in the state, moved out to
/// (or back from) the records hash, or set and trimmed there; the hash's
/// fields to set and to delete.
fn records_write(
    plan: &Plan,
    (caller, state): (&str, &CallerState),
    (records, stale): (&mut Records, &mut Vec<CompactString>),
    mut made: Vec<(CompactString, String)>,
    journal: &mut Journal,
) -> (RecordsOp, Vec<(CompactString, String)>, Vec<CompactString>) {
    match records {
        Records::Inline(list) => {
            // Records trimmed leave; a record trimmed and made again in
            // this batch is replaced.
            if !made.is_empty() || !journal.dropped_records.is_empty() {
                list.retain(|(id, _)| state.holds_record(id) && !made.iter().any(|(m, _)| m == id));
                if list.len() + made.len() <= 4 {
                    // A caller of a few calls: room for them, not for four.
                    list.reserve_exact(made.len());
                }
                list.extend(made.drain(..).filter(|(id, _)| state.holds_record(id)));
            }
            if list.len() > plan.records_apart_above {
                let all = std::mem::take(list);
                *records = Records::Apart;
                (RecordsOp::Replace, all, Vec::new())
            } else {
                (RecordsOp::Inline, Vec::new(), Vec::new())
            }
        }
        Records::Apart if state.record_count() <= plan.records_apart_above / 4 => {
            let all = state
                .records(caller)
                .map(|(id, v)| (CompactString::from(id), v.to_reply()))
                .collect();
            *records = Records::Inline(all);
            stale.clear();
            (RecordsOp::Delete, Vec::new(), Vec::new())
        }
        Records::Apart | Records::Partial => {
            // Trimmed records leave the hash at most TRIM_COUNT a
            // write; the rest wait for the caller's next writes. A
            // record trimmed and then made again in this batch stays.
            stale.append(&mut journal.dropped_records);
            let n = stale.len().min(TRIM_COUNT);
            let dels = stale
                .drain(..n)
                .filter(|id| !state.holds_record(id))
                .collect();
            (RecordsOp::Hash, made, dels)
        }
    }
}
