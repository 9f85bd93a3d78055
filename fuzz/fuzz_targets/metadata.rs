//! Fuzz target: the checkpoint metadata reader.
//!
//! Any bytes go to `metadata::parse` and `metadata::needed_len`; neither may panic. When
//! parse succeeds the saved GPU list must be what the rest of devremap assumes: sorted by
//! minor, no minor twice, every minor a regular GPU minor (<= 247), no non-empty UUID twice;
//! a GPU's `earlier_minors` sorted, regular minors, and no name (a minor or an earlier one) of
//! two GPUs; a `model` or `driver_version` only as a fact (short, non-empty, no control
//! character: it reaches messages).
//! And the reader's promise holds: a reader that stops at `needed_len` bytes gets the same
//! answer as one that read the whole file.
#![no_main]

use devremap::device::{MAX_DRIVER_VERSION_LEN, MAX_MODEL_LEN, fact_fault};
use devremap::family::nvidia::MAX_REGULAR_MINOR;
use devremap::inputs::metadata::{self, Format};
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeSet;

fuzz_target!(|data: &[u8]| {
    let needed = metadata::needed_len(data);
    let parsed = metadata::parse(data);

    if needed.is_err() {
        assert!(parsed.is_err(), "needed_len refused a header that parse took");
    }
    if let Ok(Some(n)) = needed {
        assert!(n >= 16, "needed_len {n} is shorter than the state file prefix");
        assert!(n <= 16 + metadata::MAX_METADATA_LEN, "needed_len {n} is over the limit");
        // Only the header is looked at: the prefix a reader stops at parses the same.
        if let Ok(n) = usize::try_from(n) {
            if n <= data.len() {
                assert_eq!(metadata::parse(&data[..n]), parsed, "parse of the first {n} bytes differs");
            }
        }
    }

    if let Ok(m) = parsed {
        assert!(
            m.saved.gpus.windows(2).all(|w| w[0].minor < w[1].minor),
            "gpus not strictly sorted by minor: {:?}",
            m.saved.gpus.iter().map(|g| g.minor).collect::<Vec<_>>()
        );
        let mut names = BTreeSet::new();
        for g in &m.saved.gpus {
            assert!(g.minor <= MAX_REGULAR_MINOR, "minor {} over {MAX_REGULAR_MINOR}", g.minor);
            assert!(
                g.earlier_minors.windows(2).all(|w| w[0] < w[1]),
                "earlier_minors not sorted: {:?}",
                g.earlier_minors
            );
            for &n in std::iter::once(&g.minor).chain(&g.earlier_minors) {
                assert!(n <= MAX_REGULAR_MINOR, "name {n} over {MAX_REGULAR_MINOR}");
                assert!(names.insert(n), "minor {n} names two GPUs, or one twice");
            }
            let facts = [(&g.model, MAX_MODEL_LEN), (&g.driver_version, MAX_DRIVER_VERSION_LEN)];
            for (fact, max) in facts {
                if let Some(text) = fact {
                    assert_eq!(fact_fault(text, max), None, "{text:?} taken as a fact");
                }
            }
        }
        let mut uuids = BTreeSet::new();
        for g in m.saved.gpus.iter().filter(|g| !g.uuid.is_empty()) {
            assert!(uuids.insert(g.uuid.as_str()), "uuid {:?} twice", g.uuid);
        }
        if m.format == Format::Array {
            assert!(m.gpu_key_present && m.tpus.is_empty());
        }
        if !m.gpu_key_present {
            assert!(m.saved.gpus.is_empty());
        }
        assert!(m.tpus.iter().all(|t| t.is_object()));
    }
});
