//! What installing devremap on a node changes in other programs' configs: containerd's
//! `config.toml` ([`containerd`]). Pure: text in, edited text or a refusal out.

pub mod containerd;
