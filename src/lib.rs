//! harvester-node-agent's binary: the command line over the node daemon
//! (`hna-node`) and the controller (`hna-controller`), and the one-shot
//! checks. The crates below are the architecture (docs/design.md):
//! `hna-contract` (what the two programs share), `hna-dhcp` (the DHCP
//! client, no Kubernetes in it), `hna-edges` (the cluster connection,
//! systemd, metrics, durations), `hna-node`, `hna-controller`.
//!
//! This package's own modules:
//! - [`cli`]: subcommands, flags and exit codes;
//! - [`check`]: the one-shot preflight (`check`);
//! - [`cni`]: the CNI coexistence check (`check cni`);
//! - [`logging`]: journald or stderr.

pub mod check;
pub mod cli;
pub mod cni;
pub mod logging;
