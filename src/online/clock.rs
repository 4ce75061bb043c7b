//! The wall clock of the online path (the engine has none: event times
//! come with the events).

/// The wall clock, epoch milliseconds.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
