//! `callguard replay`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use callguard::engine::record::Schema;
use callguard::offline::replay::{to_table, ReplayStore};
use callguard::store::WindowStore;

use callguard::store::redis::{self, PrefixReuse, ReplayClaim};

use crate::cmd::args::{LogArgs, StoreArgs, StoreKind};
use crate::cmd::{describe_cache, describe_rules, progress_wanted, report_invalid};

/// Decide every call of a historical call log, offline, with the same
/// window semantics as the online consumer.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// The call log, the rules, pseudonyms.
    #[command(flatten)]
    pub log: LogArgs,
    /// Store options.
    #[command(flatten)]
    pub store: StoreArgs,
    /// Decision records: `.csv` or `.parquet`. Invalid rows go to
    /// `<name>.invalid.csv` beside it.
    #[arg(long, short)]
    pub output: PathBuf,
    /// With `--store redis`: when the key prefix holds records of another
    /// rule set (or of an unknown one, such as consume's), continue on them
    /// (their calls get their old records back). Without it, or --fresh,
    /// such a prefix is refused. Records of the same rule set always
    /// continue: every call already decided gets its record back.
    #[arg(long, conflicts_with = "fresh")]
    pub resume: bool,
    /// With `--store redis`: delete every key of the key prefix first (only
    /// that prefix's), then replay afresh.
    #[arg(long)]
    pub fresh: bool,
}

/// Takes the Redis key prefix for this rule set (see
/// [`callguard::store::redis::claim_replay`]) and says what it found.
async fn claim_prefix(args: &ReplayArgs, version: &str) -> Result<()> {
    let reuse = match (args.resume, args.fresh) {
        (true, _) => PrefixReuse::Resume,
        (_, true) => PrefixReuse::Fresh,
        _ => PrefixReuse::Refuse,
    };
    let config = args.store.redis_config();
    match redis::claim_replay(&config, version, reuse).await? {
        ReplayClaim::New | ReplayClaim::Same => {}
        ReplayClaim::Resumed(found) if found.is_empty() => {
            println!("key prefix       continuing on records of an unknown rule set (--resume)")
        }
        ReplayClaim::Resumed(found) => {
            println!("key prefix       continuing on records of rule set {found} (--resume)")
        }
        ReplayClaim::Emptied(n) => println!("key prefix       {n} keys deleted first (--fresh)"),
    }
    Ok(())
}

/// Runs `callguard replay`.
pub async fn run(args: ReplayArgs) -> Result<()> {
    let rules = args.log.rule_set()?;
    let read = args.log.read_options(progress_wanted())?;
    if args.store.kind(StoreKind::Memory)? == StoreKind::Redis {
        claim_prefix(&args, rules.version()).await?;
    } else if args.resume || args.fresh {
        anyhow::bail!("--resume and --fresh are for --store redis (the memory store starts empty)");
    }
    let mut store = args.store.open_replay().await?;
    let schema = Schema::decisions(&rules);
    let report = to_table(
        &args.log.input.input,
        &read,
        &rules,
        &mut store,
        schema,
        &args.output,
    )
    .await?;
    println!("rules            {}", describe_rules(&rules));
    println!("{}", report.streamed.summary);
    if let ReplayStore::Batched(s) = &store {
        if let Some(line) = describe_cache(&s.stats().cache) {
            println!("cache            {line}");
        }
    }
    println!("decisions        {}", args.output.display());
    if let Some(path) = &report.invalid_file {
        report_invalid(path, &report.streamed.invalid);
    }
    Ok(())
}
