//! `callguard features`: point-in-time features of every call of a log.
//!
//! Every value is computed only from calls at or before the call in
//! processing order (no leakage from the future). The columns are
//! [`Schema::features`]: the same the consumer emits on the features topic;
//! or a selection of them, which holds the same values.

use std::path::Path;

use crate::engine::record::{Field, Schema};
use crate::engine::rules::RuleSet;
use crate::error::ReplayError;
use crate::offline::read::ReadOptions;
use crate::offline::replay::ReplayStore;
use crate::offline::replay::{to_table, TableReport};
use crate::store::memory::MemoryStore;
use crate::store::sharded::ShardedStore;

/// Writes the feature table of the call log at `input` to `output`
/// (Parquet, recommended for its typed timestamps, or CSV): the columns
/// named in `columns`, in that order, or all of them if it is empty.
///
/// Work a selection does not need is skipped: without `distinct_callees`
/// (and `rules_version`, which names the rule set including that
/// feature, and a model fed it), the callees are not tracked, and without `callee` either,
/// not even read. Columns no rule and no feature reads are not read: talk
/// and accounts, and durations without `duration_ms`, unless the rules
/// use calls' ends or accounts.
pub async fn export(
    input: &Path,
    read: &ReadOptions,
    rules: &RuleSet,
    columns: &[String],
    output: &Path,
) -> Result<TableReport, ReplayError> {
    let schema = Schema::features(rules).select(columns)?;
    let lean;
    // (A model fed the distinct callees needs them whatever the columns.)
    let model_needs = rules
        .model()
        .is_some_and(|m| m.uses(Field::DistinctCallees));
    let rules = if rules.tracks_callees()
        && !schema.has(Field::DistinctCallees)
        && !schema.has(Field::RulesVersion)
        && !model_needs
    {
        lean = rules.with_distinct_callees(false);
        &lean
    } else {
        rules
    };
    // Callees are read only for a column that shows or counts them (a
    // callee never makes a row invalid: the same rows are valid either way).
    let mut read = read.clone();
    read.callees &= schema.has(Field::Callee) || rules.tracks_callees();
    // So are durations, for their column or the calls' ends, talk for a
    // sum rule, and accounts for a rule keyed by them.
    read.durations &= schema.has(Field::DurationMs) || rules.uses_ends();
    read.talk &= rules.adds_talk();
    read.accounts &= rules.keys_by_account();
    to_table(
        input,
        &read,
        rules,
        &mut ReplayStore::<MemoryStore>::Sharded(ShardedStore::per_core()),
        schema,
        output,
    )
    .await
}
