//! Test hooks, in builds with the `test-hooks` feature only (a release build has none):
//! `DEVREMAPD_FAILPOINT=STEP-wait:PATH` holds the step named STEP until PATH exists (up to a
//! minute), so that a test can act at that moment. The steps: `attach` and `move` (the wrapper,
//! before it asks for a copy of its mount and before it moves it), `reap` (a keeper's reaping of
//! a server that ended).

/// Waits (up to a minute) for the path the hook names for `step` to exist; returns at once
/// when the hook names another step, or none.
#[cfg(feature = "test-hooks")]
pub fn wait_at(step: &str) {
    use std::time::{Duration, Instant};
    let hook = std::env::var("DEVREMAPD_FAILPOINT").unwrap_or_default();
    let Some(path) = hook.strip_prefix(step).and_then(|h| h.strip_prefix("-wait:")) else { return };
    let until = Instant::now() + Duration::from_secs(60);
    while !std::path::Path::new(path).exists() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(not(feature = "test-hooks"))]
pub fn wait_at(_: &str) {}
