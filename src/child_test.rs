//! Tests that need a process of their own (a process-wide setting, a
//! resource limit): the test binary runs one test again as a child, with
//! an environment variable that makes that test do its work.

/// Runs the test named `test` (its whole path) in a child of this test
/// binary, with `env` set; panics with the child's output unless it passed
/// and printed `expect`.
pub fn passes_in_child(test: &str, env: &[(&str, &str)], expect: &str) {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args(["--exact", test, "--nocapture"])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains(expect),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
