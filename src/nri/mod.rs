//! Kubernetes through NRI (issue 32): the node daemon registers with containerd as the NRI
//! plugin `devremap` and gives a GPU container its devremap `/dev` at `CreateContainer`, with no
//! runtime class and no runtime handler.
//!
//! [`view`] is the seam between the two halves: the NRI transport (the multiplexed ttrpc
//! connection, registration, the events) turns containerd's messages into these plain values and
//! calls a [`view::Handler`]; the handler decides as `devremap-runtime` does and answers with
//! the adjustment ([`decide`], the decision itself, pure). Neither half sees the other's types. Assumption: containerd 1.7's NRI, v0.6.1
//! of the protocol (`nri.pkg.api.v1alpha1`).

pub mod api;
pub mod convert;
pub mod decide;
pub mod session;
pub mod view;
pub mod wire;
