//! Progress bars for long work (reading, replaying, producing): drawn on
//! stderr, only on a terminal.

use indicatif::{ProgressBar, ProgressStyle};

/// A progress bar on stderr, drawn only on a terminal and only if wanted.
pub fn progress_bar(len: u64, wanted: bool, what: &str) -> ProgressBar {
    if !wanted {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    let style = ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len} ({per_sec}, {eta})")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(what.to_string());
    bar
}
