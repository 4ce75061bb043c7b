//! `callguard features`: point-in-time features of every call of a log.
//!
//! Every value is computed only from calls at or before the call in
//! processing order (no leakage from the future). The columns are
//! [`Schema::features`]: the same the consumer emits on the features topic.

use std::path::Path;

use crate::engine::record::Schema;
use crate::engine::rules::RuleSet;
use crate::error::ReplayError;
use crate::offline::read::ReadOptions;
use crate::offline::replay::{to_table, TableReport};
use crate::store::sharded::ShardedStore;

/// Writes the feature table of the call log at `input` to `output`
/// (Parquet, recommended for its typed timestamps, or CSV).
pub async fn export(
    input: &Path,
    read: &ReadOptions,
    rules: &RuleSet,
    output: &Path,
) -> Result<TableReport, ReplayError> {
    let schema = Schema::features(rules);
    to_table(
        input,
        read,
        rules,
        &mut ShardedStore::per_core(),
        schema,
        output,
    )
    .await
}
