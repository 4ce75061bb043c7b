//! Process-wide settings the binary applies before any work: how the
//! allocator (mimalloc) gets and returns memory.
//!
//! Callers' window state is many small allocations. Measured on the store
//! benchmark (BENCHMARKS.md), mimalloc's defaults cost the cached store
//! about twice the CPU per event of the system allocator, nearly all in the
//! kernel: it asks for transparent huge pages on its arenas, and when it
//! purges freed memory it decommits it (`MADV_DONTNEED`), so memory used
//! again faults in, and is zeroed, afresh, 2 MiB at a time for a few KiB of
//! state. With huge pages off and purges that only reset memory
//! (`MADV_FREE`: the kernel takes the pages back when it needs them, and
//! until then they cost nothing to use again) the store's own CPU per
//! event is back below the system allocator's, and offline runs keep
//! mimalloc's edge (a 2,000,000-call `replay`: 0.89x the wall time of the
//! system allocator). `CALLGUARD_HUGE_PAGES=1` keeps mimalloc's defaults.

/// mimalloc's `mi_option_purge_decommits` (`mimalloc.h`, v3: the sixth
/// option). `tests::the_option_number_names_purge_decommits` checks the
/// number against the option's name.
const MI_OPTION_PURGE_DECOMMITS: libmimalloc_sys::mi_option_t = 5;

/// Applies the settings; returns whether they were applied (not on request
/// of `CALLGUARD_HUGE_PAGES=1`).
pub fn prefer_small_pages() -> bool {
    if std::env::var_os("CALLGUARD_HUGE_PAGES").is_some_and(|v| v == "1") {
        return false;
    }
    // SAFETY: sets one of mimalloc's integer options; any value is valid.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DECOMMITS, 0) };
    disable_thp();
    true
}

/// Transparent huge pages off for this process (Linux), as mimalloc's
/// `MIMALLOC_ALLOW_THP=0` would do at its start.
#[cfg(target_os = "linux")]
fn disable_thp() -> bool {
    // SAFETY: PR_SET_THP_DISABLE takes plain integers and touches no
    // memory of ours; it only sets a flag of this process.
    unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn disable_thp() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run with `MIMALLOC_PURGE_DECOMMITS=7` in the environment (as the
    /// test below does), mimalloc reads 7 into the option we set by number.
    #[test]
    fn child_reads_purge_decommits() {
        if std::env::var_os("CALLGUARD_MI_CHILD").is_none() {
            return;
        }
        // SAFETY: reads an integer option.
        assert_eq!(
            unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DECOMMITS) },
            7
        );
    }

    #[test]
    fn the_option_number_names_purge_decommits() {
        crate::child_test::passes_in_child(
            "process::tests::child_reads_purge_decommits",
            &[
                ("CALLGUARD_MI_CHILD", "1"),
                ("MIMALLOC_PURGE_DECOMMITS", "7"),
            ],
            "1 passed",
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn settings_apply() {
        assert!(prefer_small_pages());
        // SAFETY: PR_GET_THP_DISABLE reads the flag; mi_option_get an option.
        assert_eq!(
            unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) },
            1
        );
        assert_eq!(
            unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DECOMMITS) },
            0
        );
    }
}
