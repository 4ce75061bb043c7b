//! Rule reloading for the stream processor: on SIGHUP and when the rules
//! file changes. A rule set that does not load keeps the old rules.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::engine::rules::RuleSet;
use crate::error::RulesError;
use crate::online::metrics::Metrics;

/// How often the rules file's modification time is checked.
pub const POLL: Duration = Duration::from_secs(1);

fn mtime(path: Option<&PathBuf>) -> Option<SystemTime> {
    path.and_then(|p| std::fs::metadata(p).ok())
        .and_then(|m| m.modified().ok())
}

/// The modification times of the rules file and of the files the rules in
/// force were read from (`callees_file`s).
fn stamps(watched: Option<&PathBuf>, rules: &RuleSet) -> Vec<Option<SystemTime>> {
    std::iter::once(mtime(watched))
        .chain(rules.files().iter().map(|f| mtime(Some(f))))
        .collect()
}

/// Shows `rules` on the status page as the set in force.
pub fn note_in_force(rules: &RuleSet, metrics: &Metrics) {
    let list = rules.rules.iter().map(ToString::to_string).collect();
    metrics.status.rules_in_force(rules.version(), list);
}

/// Reloads once: sends the new rules if they load and differ.
pub fn reload_now(
    load: &impl Fn() -> Result<RuleSet, RulesError>,
    tx: &watch::Sender<RuleSet>,
    metrics: &Metrics,
    why: &str,
) {
    match load() {
        Ok(new) => {
            let old = tx.borrow().version().to_string();
            if new.version() != old {
                info!(why, old = %old, new = %new.version(), "rules reloaded");
                note_in_force(&new, metrics);
                tx.send_replace(new);
            }
            metrics.status.reload_succeeded();
            Metrics::inc(&metrics.rule_reloads, "ok");
        }
        Err(e) => {
            warn!(why, error = %e, "rules not reloaded; keeping the current rules");
            metrics.status.reload_failed(e.to_string());
            Metrics::inc(&metrics.rule_reloads, "error");
        }
    }
}

/// Spawns the reloader task; it ends when every receiver is gone. `load`
/// builds the rule set afresh; `watched` is the rules file, if any, whose
/// modification time is polled, with those of the files the rules in force
/// name (`callees_file`).
pub fn spawn(
    load: impl Fn() -> Result<RuleSet, RulesError> + Send + 'static,
    watched: Option<PathBuf>,
    tx: watch::Sender<RuleSet>,
    metrics: Arc<Metrics>,
) -> std::io::Result<()> {
    let mut hup = signal(SignalKind::hangup())?;
    note_in_force(&tx.borrow(), &metrics);
    tokio::spawn(async move {
        let mut seen = stamps(watched.as_ref(), &tx.borrow());
        let mut tick = tokio::time::interval(POLL);
        loop {
            tokio::select! {
                _ = hup.recv() => reload_now(&load, &tx, &metrics, "SIGHUP"),
                _ = tick.tick() => {
                    let now = stamps(watched.as_ref(), &tx.borrow());
                    if now != seen {
                        seen = now;
                        reload_now(&load, &tx, &metrics, "file changed");
                    }
                }
                _ = tx.closed() => return,
            }
        }
    });
    Ok(())
}
