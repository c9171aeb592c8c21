//! DHCPv4 client engine for LoadBalancer addresses: one lease per address,
//! each on its own macvlan with its own MAC and client identifier.
//!
//! Layers, from pure to edge:
//! - [`packet`]: strict parsing of replies and building of requests
//!   (`dhcproto` is the codec);
//! - [`machine`]: the RFC 2131 state machine as plain data (events in,
//!   actions out), tested with paused tokio time;
//! - [`store`]: one lease file per lease, written atomically;
//! - `frame`: Ethernet-less IPv4/UDP and ARP framing for packet sockets;
//! - `raw`: the packet socket's shared syscalls;
//! - [`io`]: the [`io::Transport`] trait and its AF_PACKET implementation
//!   (nothing binds UDP port 68, so the node's own DHCP client keeps working);
//! - [`link`]: macvlan and address management over rtnetlink;
//! - `presence`: what keeps a held address's MAC on the LAN's switches
//!   (presence frames, the LAN watch), on threads of their own;
//! - [`driver`]: runs one machine against a transport, a link and a store;
//! - [`engine`]: many leases in one process, their status, and a hook
//!   told of each acquisition (the caller's metrics);
//! - [`probe`]: `dhcp-probe`, the operator's preflight (its command line
//!   lives with the others in `cli`);
//! - [`fuzzing`]: the receive path as one function of untrusted bytes
//!   (cargo-fuzz target in `fuzz/`, bounded harness in the unit tests);
//! - `mac`: MAC addresses as text in this crate's own records;
//! - `lease_engine`: the engine as the LoadBalancer layer sees it, a
//!   trait (`fake::FakeEngine`, in unit tests, records calls and injects
//!   failures).
//!
//! No Kubernetes, D-Bus or systemd in here: `cargo tree -p hna-dhcp` shows
//! it. A program that gets a lease on a macvlan of `eth0` (as root, or with
//! CAP_NET_ADMIN and CAP_NET_RAW) and keeps it until it ends:
//!
//! ```no_run
//! use hna_dhcp::io::ProbeConfig;
//! use hna_dhcp::store::Store;
//! use hna_dhcp::{Engine, Identity, LeaseConfig, StopMode, Timing};
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     // Lease files: a restart asks for the same address (INIT-REBOOT).
//!     let engine = Engine::new(Some(Store::open("/var/lib/example".as_ref())?))?;
//!     let mut status = engine
//!         .start(LeaseConfig {
//!             interface: "hlb-example".into(), // the macvlan made for it
//!             parent: "eth0".into(),
//!             identity: Identity::new([0x02, 0, 0, 0, 0, 0x01]),
//!             requested_ip: None,
//!             timing: Timing::default(),
//!             probe: ProbeConfig::default(),
//!             guarded_at: None,
//!             witness: None,
//!             presence: hna_dhcp::Presence::Off,
//!         })
//!         .await?;
//!     let bound = status.wait_for(|s| s.state.holds_address()).await?.clone();
//!     println!("{:?} from {:?}", bound.address, bound.server);
//!     tokio::signal::ctrl_c().await?;
//!     // Release: DHCPRELEASE, the macvlan and the lease file go.
//!     engine.stop("hlb-example", StopMode::Release).await?;
//!     Ok(())
//! }
//! ```

pub mod driver;
pub mod engine;
#[cfg(test)]
mod engine_tests;
/// A recording, failure-injecting [`LeaseEngine`] for unit tests of the
/// layers above (feature `fake`).
#[cfg(any(test, feature = "fake"))]
pub mod fake;
pub(crate) mod frame;
pub mod fuzzing;
pub mod io;
pub(crate) mod lease_engine;
pub mod link;
mod mac;
pub mod machine;
pub mod packet;
pub(crate) mod presence;
pub mod probe;
mod raw;
pub mod store;

#[cfg(test)]
mod machine_tests;

pub use driver::{AcquiredHook, Acquisition};
pub use engine::{Engine, EngineError, LeaseConfig, Presence};
pub use lease_engine::{LeaseEngine, SweepReport};
pub use machine::{Action, Event, Lease, Machine, State, StopMode, Timing};
pub use packet::Identity;
