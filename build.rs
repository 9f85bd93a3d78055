//! Generates NRI's messages (issue 32) from containerd/nri v0.6.1's `pkg/api/api.proto`, kept
//! as it is in proto/nri/api.proto, into `$OUT_DIR/nri.pkg.api.v1alpha1.rs` (src/nri/api.rs
//! includes it). Only the messages: the ttrpc services are served by src/nri's own dispatch.

fn main() {
    println!("cargo:rerun-if-changed=proto/nri/api.proto");
    if let Err(e) = prost_build::Config::new()
        // NRI's maps (labels, annotations) as ordered maps, so a converted value's order is
        // the key order whatever the wire's was.
        .btree_map(["."])
        .compile_protos(&["proto/nri/api.proto"], &["proto/nri"])
    {
        eprintln!(
            "error: generating NRI's messages from proto/nri/api.proto (needs protoc, Debian's protobuf-compiler): {e}"
        );
        std::process::exit(1);
    }
}
