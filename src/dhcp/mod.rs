//! DHCPv4 client engine for LoadBalancer addresses: one lease per address,
//! each on its own macvlan with its own MAC and client identifier.
//!
//! Layers, from pure to edge:
//! - [`packet`]: strict parsing of replies and building of requests
//!   (`dhcproto` is the codec);
//! - [`machine`]: the RFC 2131 state machine as plain data (events in,
//!   actions out), tested with paused tokio time;
//! - [`store`]: one lease file per lease, written atomically;
//! - [`frame`]: Ethernet-less IPv4/UDP and ARP framing for packet sockets;
//! - [`io`]: the [`io::Transport`] trait and its AF_PACKET implementation
//!   (nothing binds UDP port 68, so the node's own DHCP client keeps working);
//! - [`link`]: macvlan and address management over rtnetlink;
//! - [`driver`]: runs one machine against a transport, a link and a store;
//! - [`engine`]: many leases in one process, their status and metrics;
//! - [`probe`]: `dhcp-probe`, the operator's preflight (its command line
//!   lives with the others in `cli`);
//! - [`fuzzing`]: the receive path as one function of untrusted bytes
//!   (cargo-fuzz target in `fuzz/`, bounded harness in the unit tests);
//! - [`lease_engine`]: the engine as the LoadBalancer layer sees it, a
//!   trait (`fake::FakeEngine`, in unit tests, records calls and injects
//!   failures).

pub mod driver;
pub mod engine;
#[cfg(test)]
mod engine_tests;
#[cfg(test)]
pub mod fake;
pub mod frame;
pub mod fuzzing;
pub mod io;
pub mod lease_engine;
pub mod link;
pub mod machine;
pub mod packet;
pub mod probe;
pub mod store;

#[cfg(test)]
mod machine_tests;

pub use engine::{Engine, EngineError, LeaseConfig};
pub use lease_engine::{LeaseEngine, SweepReport};
pub use machine::{Action, Event, Lease, Machine, State, StopMode, Timing};
pub use packet::Identity;
