//! Argument groups shared by several subcommands, and their mapping onto
//! the library's configurations. Defaults come from the library's constants.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};

use callguard::engine::event::{Decoder, FieldMap, NumberHasher};
use callguard::engine::rules::{parse_duration_ms, BadCallerPolicy, CountPolicy, RuleSet};
use callguard::error::{EventError, RulesError};
use callguard::offline::read::{InputFormat, ReadOptions};
use callguard::online::metrics::Metrics;
use callguard::online::reload;
use tokio::sync::watch;

/// Kafka connection options.
#[derive(Debug, Clone, Args)]
pub struct KafkaArgs {
    /// Bootstrap servers (HOST:PORT,...), or `mock` for an embedded
    /// in-process mock cluster (topics are created on it).
    #[arg(long, env = "CALLGUARD_BROKERS", default_value = "localhost:9092")]
    pub brokers: String,
    /// librdkafka settings.
    #[command(flatten)]
    pub settings: KafkaSettingsArgs,
}

/// Extra librdkafka settings (`-X`).
#[derive(Debug, Clone, Args)]
pub struct KafkaSettingsArgs {
    /// Any librdkafka setting, KEY=VALUE (SASL, SSL, client.id, ...);
    /// repeatable. Values are taken whole (a password may contain `;`). In
    /// CALLGUARD_KAFKA_SETTINGS, put one setting per line. Never echoed.
    #[arg(
        short = 'X',
        value_name = "KEY=VALUE",
        env = "CALLGUARD_KAFKA_SETTINGS",
        value_delimiter = '\n',
        hide_env_values = true
    )]
    pub settings: Vec<String>,
}

impl KafkaSettingsArgs {
    /// The settings as (key, value) pairs.
    pub fn parse(&self) -> Result<Vec<(String, String)>, callguard::error::KafkaError> {
        callguard::online::kafka::parse_settings(&self.settings)
    }
}

/// Input layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FormatArg {
    /// `.parquet` is Parquet; a CSV is told by its first line: a header
    /// with the mapped columns is plain CSV, else a switch's CDR file
    /// (header or row) is its preset.
    Auto,
    /// CSV with a header row.
    Csv,
    /// Parquet.
    Parquet,
    /// Asterisk `Master.csv`: `uniqueid` is the call id, `src` the caller,
    /// `dst` the callee, `start` the time, `duration` the call's length
    /// (ringing included), `billsec` its talk, `accountcode` the account.
    Asterisk,
    /// FreeSWITCH `mod_cdr_csv` (default template): `uuid`,
    /// `caller_id_number`, `destination_number`, `start_stamp`, `duration`,
    /// `billsec` (talk), `accountcode`.
    Freeswitch,
    /// Kamailio `acc` (with the `src_user`, `dst_user`, `src_ip` extras):
    /// `callid`, `src_user`, `dst_user`, `time`; only INVITE rows are calls.
    KamailioAcc,
}

/// How fields are named in the input and how numbers are normalised.
#[derive(Debug, Clone, Args)]
pub struct DecoderArgs {
    /// Field mapping, FIELD=NAME[,...], e.g. `caller=src,ts=start_time`.
    /// Fields: call_id, caller, ts, callee, duration_ms, talk_ms, account,
    /// label, event. `ts`, `duration_ms` and `talk_ms` take a unit, `:s`
    /// for seconds (`talk_ms=billsec:s`,
    /// `ts=start_epoch:s`; fractions allowed) or `:ms` (the default). A
    /// named column that is not in a call log is an error.
    #[arg(
        long = "map",
        value_name = "FIELD=NAME",
        env = "CALLGUARD_MAP",
        value_delimiter = ';'
    )]
    pub map: Vec<String>,
    /// Country code for national numbers (leading 0 or no prefix), e.g. 34.
    /// Set it whenever the switch may send a national number: without it
    /// such a caller is unusable, and every one is decided under the rules'
    /// `bad_caller` policy (by default, all of them as one caller).
    #[arg(long, env = "CALLGUARD_DEFAULT_COUNTRY_CODE")]
    pub default_country_code: Option<String>,
}

impl DecoderArgs {
    /// The decoder.
    pub fn decoder(&self) -> Result<Decoder, EventError> {
        Decoder::new(
            FieldMap::parse(&self.map)?,
            self.default_country_code.clone(),
        )
    }
}

/// Pseudonymised numbers.
#[derive(Debug, Clone, Args)]
pub struct PrivacyArgs {
    /// Replace every caller and callee, in Redis keys, records, features and
    /// logs, by an HMAC-SHA256 pseudonym of the normalised number (`h` and
    /// 32 hex digits) under a secret key (CALLGUARD_HASH_KEY, or
    /// --hash-key-file). Allow and deny lists and rules' callee prefixes
    /// still match the real numbers.
    /// Use the same key online and offline for equal pseudonyms. Dead
    /// letters keep the original bytes.
    #[arg(long, env = "CALLGUARD_HASH_NUMBERS")]
    pub hash_numbers: bool,
    /// File holding the key (at least 16 bytes; a trailing newline is
    /// dropped); otherwise CALLGUARD_HASH_KEY.
    #[arg(long, env = "CALLGUARD_HASH_KEY_FILE")]
    pub hash_key_file: Option<PathBuf>,
}

impl PrivacyArgs {
    /// Sets the decoder's hasher when `--hash-numbers` is given.
    pub fn apply(&self, decoder: &mut Decoder) -> Result<()> {
        if !self.hash_numbers {
            return Ok(());
        }
        let key = match &self.hash_key_file {
            Some(path) => {
                let mut key = std::fs::read(path)
                    .with_context(|| format!("reading the hash key file {}", path.display()))?;
                while key.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                    key.pop();
                }
                key
            }
            None => std::env::var("CALLGUARD_HASH_KEY")
                .map(String::into_bytes)
                .map_err(|_| {
                    anyhow::anyhow!(
                        "--hash-numbers needs a key: set CALLGUARD_HASH_KEY or pass --hash-key-file"
                    )
                })?,
        };
        decoder.hasher = Some(NumberHasher::new(&key)?);
        Ok(())
    }
}

/// Where call events come from on disk and how to read them.
#[derive(Debug, Clone, Args)]
pub struct InputArgs {
    /// Call log: CSV (header row), Parquet, or a switch's CDR file
    /// (Asterisk Master.csv, FreeSWITCH mod_cdr_csv, Kamailio acc).
    #[arg(long, short)]
    pub input: PathBuf,
    /// Input layout; `auto` picks Parquet for `.parquet`, else CSV.
    #[arg(long, value_enum, default_value_t = FormatArg::Auto)]
    pub format: FormatArg,
    /// Field names and number normalisation.
    #[command(flatten)]
    pub decoder: DecoderArgs,
    /// Time zone of the switch's local times (`YYYY-MM-DD HH:MM:SS` in CDR
    /// files), e.g. Europe/Madrid; DST switches included (a time in the
    /// repeated hour is read as its first occurrence). Default UTC.
    #[arg(long)]
    pub timezone: Option<chrono_tz::Tz>,
    /// The form of the time column when it is in none of the forms read
    /// by default (epoch milliseconds, RFC 3339, `YYYY-MM-DD HH:MM:SS`), in
    /// strftime syntax: `%d/%m/%Y %H:%M:%S`, `%Y-%m-%dT%H:%M:%S` (local, in
    /// --timezone), `%Y-%m-%dT%H:%M:%S%z` (an offset such as +0100). Epoch
    /// seconds need no format: map the column with a unit, `--map ts=start:s`.
    #[arg(long, value_parser = parse_ts_format)]
    pub ts_format: Option<String>,
    /// Field delimiter of CSV input, one character: `,` (default), `;`
    /// (common in European CDR exports), `\t` or `|`. A header that looks
    /// separated by another one is reported with the delimiter to pass.
    #[arg(long, default_value = ",", value_parser = parse_delimiter)]
    pub delimiter: u8,
    /// Rows held in memory to put the log in time order (about 120 bytes
    /// each while reading: 1.2 GB at the default). A longer log file already in time order (as
    /// switches write CDRs) is read a second time instead of being held. A
    /// longer unordered log is sorted in runs of this many rows, written to
    /// the temporary directory ($TMPDIR, about 90 bytes a row) and merged
    /// back; if the order breaks partway, only the rows after the break go
    /// to runs. Memory stays bounded whatever the log's length or order,
    /// and the records are the same. Input that cannot be read twice (a
    /// pipe) is always sorted in runs. Where memory allows, a budget above
    /// the log's rows is faster: the log is read once and held whole; on a
    /// machine short of memory, a lower one bounds memory lower.
    #[arg(long, default_value_t = callguard::offline::spill::DEFAULT_SORT_ROWS as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub sort_rows: u64,
}

/// Checks `--ts-format` as it is parsed.
fn parse_ts_format(s: &str) -> Result<String, String> {
    callguard::offline::read::check_ts_format(s).map(|()| s.to_string())
}

/// Parses `--delimiter`: one ASCII character, or `\t` for a tab.
fn parse_delimiter(s: &str) -> Result<u8, String> {
    match s {
        "\\t" | "tab" => Ok(b'\t'),
        _ if s.len() == 1 && s.is_ascii() && s != "\"" && s != "\n" => Ok(s.as_bytes()[0]),
        _ => Err(format!(
            "`{s}`: one ASCII character (not a quote or newline), or \\t"
        )),
    }
}

impl InputArgs {
    /// Read options from the arguments.
    pub fn read_options(&self, progress: bool) -> Result<ReadOptions, EventError> {
        Ok(ReadOptions {
            format: match self.format {
                FormatArg::Auto => InputFormat::Auto,
                FormatArg::Csv => InputFormat::Csv,
                FormatArg::Parquet => InputFormat::Parquet,
                FormatArg::Asterisk => InputFormat::Asterisk,
                FormatArg::Freeswitch => InputFormat::FreeSwitch,
                FormatArg::KamailioAcc => InputFormat::KamailioAcc,
            },
            decoder: self.decoder.decoder()?,
            timezone: self.timezone,
            ts_format: self.ts_format.clone(),
            delimiter: self.delimiter,
            progress,
            callees: true,
            durations: true,
            talk: true,
            accounts: true,
            sort_rows: usize::try_from(self.sort_rows).unwrap_or(usize::MAX),
        })
    }
}

/// The flags `consume` and `serve` share: the rule set, the window store,
/// how call events are decoded and whether numbers are pseudonymised.
#[derive(Debug, Clone, Args)]
pub struct OnlineArgs {
    /// Rule options (the rules file is reloaded on SIGHUP and when it changes).
    #[command(flatten)]
    pub rules: RuleArgs,
    /// Store options.
    #[command(flatten)]
    pub store: StoreArgs,
    /// Field names of the JSON events and number normalisation.
    #[command(flatten)]
    pub decoder: DecoderArgs,
    /// Pseudonymised numbers.
    #[command(flatten)]
    pub privacy: PrivacyArgs,
    /// Limits shared between instances: reserve slots, and the local
    /// fallback's share.
    #[command(flatten)]
    pub fallback: FallbackArgs,
}

/// Limits shared between instances (rules keyed by callee or global): how
/// many instances share them, and how much one may admit alone under
/// `--on-store-error local`.
#[derive(Debug, Clone, Args)]
pub struct FallbackArgs {
    /// Instances deciding the same calls (consume members and serve
    /// processes together). As many reserve slots: each instance holding
    /// one spends floor(limit / (16 x this)) calls of each counter of a rule
    /// keyed by callee or global without asking Redis (the first call to a
    /// callee costs no Redis write); the first instance records the number
    /// in Redis and every instance follows the recorded one. While Redis
    /// fails, each admits at most limit / this of such a rule, at least one
    /// call per bucket (`--on-store-error local`).
    #[arg(long, env = "CALLGUARD_EXPECTED_INSTANCES", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub expected_instances: u32,
    /// The share of such a limit one instance admits alone while Redis
    /// fails, 0 to 1 (instead of 1 / --expected-instances).
    #[arg(long, env = "CALLGUARD_LOCAL_SHARE")]
    pub local_share: Option<f64>,
}

impl FallbackArgs {
    /// The share: `--local-share`, else 1 / `--expected-instances`.
    pub fn share(&self) -> Result<f64> {
        match self.local_share {
            Some(s) if s.is_finite() && s > 0.0 && s <= 1.0 => Ok(s),
            Some(s) => anyhow::bail!("--local-share {s}: must be above 0 and at most 1"),
            None => Ok(1.0 / f64::from(self.expected_instances)),
        }
    }
}

impl OnlineArgs {
    /// The rule set, reloaded on SIGHUP and when its file changes: the
    /// receiver always holds the set in force.
    pub fn watch_rules(&self, metrics: &Arc<Metrics>) -> Result<watch::Receiver<RuleSet>> {
        let (tx, rx) = watch::channel(self.rules.rule_set()?);
        let rule_args = self.rules.clone();
        reload::spawn(
            move || rule_args.rule_set(),
            self.rules.rules.clone(),
            tx,
            metrics.clone(),
        )?;
        Ok(rx)
    }

    /// The event decoder, pseudonymising numbers when asked.
    pub fn event_decoder(&self) -> Result<Decoder> {
        let mut decoder = self.decoder.decoder()?;
        self.privacy.apply(&mut decoder)?;
        Ok(decoder)
    }
}

/// The flags the offline commands share: the call log and how to read
/// it, the rule set, and whether numbers are pseudonymised.
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Input options.
    #[command(flatten)]
    pub input: InputArgs,
    /// Rule options.
    #[command(flatten)]
    pub rules: RuleArgs,
    /// Pseudonymised numbers.
    #[command(flatten)]
    pub privacy: PrivacyArgs,
}

impl LogArgs {
    /// The rule set.
    pub fn rule_set(&self) -> Result<RuleSet, RulesError> {
        self.rules.rule_set()
    }

    /// How to read the log, numbers pseudonymised when asked.
    pub fn read_options(&self, progress: bool) -> Result<ReadOptions> {
        let mut read = self.input.read_options(progress)?;
        self.privacy.apply(&mut read.decoder)?;
        Ok(read)
    }
}

/// The rule set: a file, shorthands, and overrides.
#[derive(Debug, Clone, Args)]
pub struct RuleArgs {
    /// Rule set file (TOML); see data/rules.toml, and data/rules-fraud.toml
    /// for token buckets, distinct-callees rules, callee and time-of-day
    /// filters, warn levels, per-rule shadow and caller+callee keys. A
    /// `callees_file` it names is reloaded with it.
    #[arg(long, env = "CALLGUARD_RULES")]
    pub rules: Option<PathBuf>,
    /// A rule NAME:KIND:WINDOW:LIMIT (KIND: fixed, sliding, sliding-approx,
    /// distinct-callees; a token bucket and rule options need a file), e.g.
    /// `minute:sliding:60s:20`; repeatable, appended to --rules.
    #[arg(long = "rule", value_name = "NAME:KIND:WINDOW:LIMIT")]
    pub rule: Vec<String>,
    /// Override the counting policy: `attempts` (every call counts) or
    /// `admitted` (only allowed calls count).
    #[arg(long, value_enum)]
    pub count: Option<CountArg>,
    /// Override the allowed lateness (e.g. 5s).
    #[arg(long)]
    pub grace: Option<String>,
    /// Shadow mode: decide and report, but allow every call.
    #[arg(long)]
    pub shadow: bool,
    /// What to do with a call whose caller is unusable (missing, garbage,
    /// or a national number without --default-country-code): `shared`
    /// (default; every such call counts under the one caller `bad_caller`,
    /// so the rules limit a spray of garbage CLI together), `reject`
    /// (reason `bad_caller`) or `allow` (reason `bad_caller`, unchecked).
    /// Overrides the rules file's `bad_caller`.
    #[arg(long, value_enum, env = "CALLGUARD_ON_BAD_CALLER")]
    pub on_bad_caller: Option<BadCallerArg>,
}

/// `--on-bad-caller` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BadCallerArg {
    /// Count every unusable caller under one key.
    Shared,
    /// Reject the call.
    Reject,
    /// Allow the call unchecked.
    Allow,
}

impl From<BadCallerArg> for BadCallerPolicy {
    fn from(b: BadCallerArg) -> Self {
        match b {
            BadCallerArg::Shared => BadCallerPolicy::Shared,
            BadCallerArg::Reject => BadCallerPolicy::Reject,
            BadCallerArg::Allow => BadCallerPolicy::Allow,
        }
    }
}

/// `--count` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CountArg {
    /// Every call attempt counts.
    Attempts,
    /// Only allowed calls count.
    Admitted,
}

impl From<CountArg> for CountPolicy {
    fn from(c: CountArg) -> Self {
        match c {
            CountArg::Attempts => CountPolicy::Attempts,
            CountArg::Admitted => CountPolicy::Admitted,
        }
    }
}

impl RuleArgs {
    /// Builds the rule set.
    pub fn rule_set(&self) -> Result<RuleSet, RulesError> {
        let base = RuleSet::from_args(self.rules.as_deref(), &self.rule)?;
        let base = match self.on_bad_caller.map(BadCallerPolicy::from) {
            Some(policy) if policy != base.bad_caller => base.with_bad_caller(policy)?,
            _ => base,
        };
        let count = self.count.map_or(base.count, CountPolicy::from);
        let grace = match &self.grace {
            Some(g) => parse_duration_ms(g)?,
            None => base.grace_ms,
        };
        if count == base.count && grace == base.grace_ms && (!self.shadow || base.shadow) {
            return Ok(base);
        }
        base.with_options(count, grace, self.shadow || base.shadow)
    }
}

mod store;
pub use store::{StoreArgs, StoreKind};
