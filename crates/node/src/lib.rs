//! harvester-node-agent's node daemon (`harvester-node-agent run`): what
//! runs on every guest VM. It shares only the contract (`hna-contract`)
//! and the common edges (`hna-edges`) with the controller, and never
//! imports it.
//!
//! Where to look:
//! - [`agent`]: the daemon's orchestration: start-up order, the tasks it
//!   spawns, `STATUS=`, reload and stop;
//! - [`config`]: the daemon's configuration (the TOML file, environment
//!   and flags), validated before anything touches the host;
//! - [`kmod`]: the macvlan preflight (detect, load, probe);
//! - [`loadbalancer`]: the LoadBalancer addresses this node is assigned,
//!   held through the DHCP engine (`hna-dhcp`), and the status it reports;
//! - [`membership`]: liveness on the LAN: the agents of one network watch
//!   each other (SWIM and witnesses), with sealed packets;
//! - `pause`: pauses of this VM its clocks do not count (live migration,
//!   suspend), seen on its RTC;
//! - [`guest`]: qemu-guest-agent health;
//! - [`topology`]: Harvester topology labels relayed to this node's Node;
//! - [`node_conditions`]: the Node conditions the daemon owns;
//! - [`health`]: the status vocabulary every subsystem reports in;
//! - [`state_dir`]: the persistent state directory;
//! - [`control`]: the local socket `status` talks to.

pub mod agent;
pub mod config;
pub mod control;
pub mod guest;
pub mod health;
pub mod kmod;
pub mod loadbalancer;
pub mod membership;
pub mod node_conditions;
pub(crate) mod pause;
pub mod state_dir;
pub mod topology;
