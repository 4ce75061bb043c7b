//! Rule reloading for the stream processor: on SIGHUP and when the rules
//! file changes. A file that does not parse keeps the old rules.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::cli::RuleArgs;
use crate::metrics::Metrics;
use crate::rules::RuleSet;

/// How often the rules file's modification time is checked.
pub const POLL: Duration = Duration::from_secs(1);

fn mtime(path: &Option<PathBuf>) -> Option<SystemTime> {
    path.as_ref()
        .and_then(|p| std::fs::metadata(p).ok())
        .and_then(|m| m.modified().ok())
}

/// Reloads once: sends the new rules if they parse and differ.
pub fn reload_now(args: &RuleArgs, tx: &watch::Sender<RuleSet>, metrics: &Metrics, why: &str) {
    match args.rule_set() {
        Ok(new) => {
            let old = tx.borrow().version().to_string();
            if new.version() != old {
                info!(why, old = %old, new = %new.version(), "rules reloaded");
                tx.send_replace(new);
            }
            Metrics::inc(&metrics.rule_reloads, "ok");
        }
        Err(e) => {
            warn!(why, error = %e, "rules not reloaded; keeping the current rules");
            Metrics::inc(&metrics.rule_reloads, "error");
        }
    }
}

/// Spawns the reloader task; it ends when every receiver is gone.
pub fn spawn(
    args: RuleArgs,
    tx: watch::Sender<RuleSet>,
    metrics: Arc<Metrics>,
) -> std::io::Result<()> {
    let mut hup = signal(SignalKind::hangup())?;
    tokio::spawn(async move {
        let mut seen = mtime(&args.rules);
        let mut tick = tokio::time::interval(POLL);
        loop {
            tokio::select! {
                _ = hup.recv() => reload_now(&args, &tx, &metrics, "SIGHUP"),
                _ = tick.tick() => {
                    let now = mtime(&args.rules);
                    if now != seen {
                        seen = now;
                        reload_now(&args, &tx, &metrics, "file changed");
                    }
                }
                _ = tx.closed() => return,
            }
        }
    });
    Ok(())
}
