//! NRI's messages (issue 32) are committed as generated code (src/nri/api/generated.rs), so that
//! building devremap needs no `protoc`; this test generates them again from
//! proto/nri/api.proto, as they were made, and fails where the two differ.
//! `DEVREMAP_REGENERATE=1` writes the file instead.

use std::path::Path;

/// Rule (issue 32): src/nri/api/generated.rs is exactly what prost-build makes of
/// proto/nri/api.proto (NRI's maps as ordered maps, no comments: prost-build's comment
/// cleaning depends on its features, which another crate in a build may switch on).
#[test]
#[ignore = "needs protoc (Debian's protobuf-compiler)"]
fn the_committed_nri_messages_are_the_protos() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::TempDir::new().unwrap();
    prost_build::Config::new()
        .btree_map(["."])
        .disable_comments(["."])
        .out_dir(out.path())
        .compile_protos(&[root.join("proto/nri/api.proto")], &[root.join("proto/nri")])
        .unwrap_or_else(|e| panic!("generating proto/nri/api.proto's messages (needs protoc): {e}"));
    let made = std::fs::read_to_string(out.path().join("nri.pkg.api.v1alpha1.rs")).unwrap();
    let committed = root.join("src/nri/api/generated.rs");
    if std::env::var_os("DEVREMAP_REGENERATE").is_some() {
        std::fs::write(&committed, &made).unwrap();
    }
    let kept = std::fs::read_to_string(&committed).unwrap_or_default();
    assert!(
        kept == made,
        "{} is not what proto/nri/api.proto gives: run DEVREMAP_REGENERATE=1 cargo test --test nri_api -- --ignored",
        committed.display()
    );
}
