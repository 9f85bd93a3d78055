//! The keeper protocol: everything `devremapd mount` (the keeper, `mountd/keeper/`) decides,
//! without I/O, while it holds `/dev/fuse` and relays the kernel's FUSE traffic to its server.
//!
//! [`servers`] decides what happens to the servers (signals in each phase, restarts, takeovers,
//! hangs); [`relay`] decides the traffic (which server a request goes to, what is in flight);
//! [`kernel_nodes`] is the table of node ids the kernel holds, learned from the messages relayed;
//! [`fuse_wire`] reads the few FUSE messages the keeper looks into; [`control`] is the codec of
//! the control messages the keeper and its server exchange beside the FUSE traffic (readiness,
//! reloads, the resume payload a successor takes over).

pub mod control;
pub mod fuse_wire;
pub mod kernel_nodes;
pub mod relay;
pub mod servers;
