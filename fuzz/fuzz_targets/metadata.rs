//! Fuzz target: the checkpoint metadata reader.
//!
//! Any bytes go to `metadata::parse` and `metadata::needed_len`; neither may panic. When
//! parse succeeds the saved GPU list must be what the rest of devremap assumes: sorted by
//! minor, no minor twice, every minor a regular GPU minor (<= 247), no non-empty UUID twice.
//! And the reader's promise holds: a reader that stops at `needed_len` bytes gets the same
//! answer as one that read the whole file.
#![no_main]

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
            m.gpus.windows(2).all(|w| w[0].minor < w[1].minor),
            "gpus not strictly sorted by minor: {:?}",
            m.gpus.iter().map(|g| g.minor).collect::<Vec<_>>()
        );
        let mut minors = BTreeSet::new();
        for g in &m.gpus {
            assert!(minors.insert(g.minor), "minor {} twice", g.minor);
            assert!(g.minor <= MAX_REGULAR_MINOR, "minor {} over {MAX_REGULAR_MINOR}", g.minor);
        }
        let mut uuids = BTreeSet::new();
        for g in m.gpus.iter().filter(|g| !g.uuid.is_empty()) {
            assert!(uuids.insert(g.uuid.as_str()), "uuid {:?} twice", g.uuid);
        }
        if m.format == Format::Array {
            assert!(m.gpu_key_present && m.tpus.is_empty());
        }
        if !m.gpu_key_present {
            assert!(m.gpus.is_empty());
        }
        assert!(m.tpus.iter().all(|t| t.is_object()));
    }
});
