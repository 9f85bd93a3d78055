//! The served filesystem: what answers the kernel behind a mount. [`devfs`] numbers a tree and
//! holds the live generation and the retired nodes (`Devfs`), [`takeover`] renumbers a
//! successor's tree after the nodes the kernel holds, [`adapter`] answers the kernel's
//! requests, bytes to bytes, with `Devfs` calls, and [`lifecycle`] is the daemon's life (serving, reloading,
//! stopping) as a state machine behind small traits.

pub mod adapter;
pub mod devfs;
pub mod lifecycle;
pub mod takeover;
