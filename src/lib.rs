//! harvester-node-agent: a node daemon and controller for Kubernetes guest
//! clusters on Harvester.
//!
//! Module map (one concern each):
//! - [`k8s_names`]: Kubernetes name and label rules, default topology keys;
//! - [`config`]: the TOML file, environment and flags, validated before
//!   anything touches the host;
//! - [`mac`]: MAC addresses as text (kube-vip's format);
//! - [`duration`]: the one duration syntax (bare seconds or units);
//! - [`cluster`]: the guest-cluster connection shared by daemon and
//!   controller (credentials, the credentials watcher, the single-object
//!   watch);
//! - [`state_dir`]: the persistent state directory;
//! - [`systemd`]: `Type=notify` messages and the liveness-gated watchdog;
//! - [`control`]: the local socket `status` talks to;
//! - [`kmod`]: the macvlan preflight (detect, load, probe);
//! - [`guest`]: qemu-guest-agent health;
//! - [`topology`]: Harvester topology labels relayed to this node's Node;
//! - [`node_status`]: the conditions the agent owns on its Node;
//! - [`health`]: the status vocabulary every subsystem reports in (leaf);
//! - [`check`]: the one-shot preflight;
//! - [`dhcp`]: the DHCP client engine for LoadBalancer addresses (pure
//!   state machine, packet sockets, lease files, `dhcp-probe`), the crate
//!   `hna-dhcp` in `crates/dhcp`;
//! - [`lb`]: the node's LoadBalancer data plane (assignments to leases);
//! - [`pause`]: pauses of this VM that its clocks do not count (live
//!   migration, suspend), seen on its RTC;
//! - [`membership`]: liveness on the LAN (issue #30): the agents of one
//!   network watch each other (SWIM and witnesses), with sealed packets;
//! - [`metrics`]: the optional `/metrics` and `/healthz` endpoint;
//! - [`contract`]: what the daemon and the controller share (and share
//!   with the Harvester cloud provider and kube-vip): annotation keys,
//!   which Services are ours, the address identity; the crate
//!   `hna-contract` in `crates/contract`, with [`k8s_names`];
//! - [`agent`]: orchestration of the node daemon (`run`);
//! - [`controller`]: the in-cluster controller;
//! - [`logging`]: journald or stderr;
//! - [`cli`]: subcommands and exit codes.

// The DHCP client and the contract are crates of their own (`crates/`);
// re-exported under their old paths so the daemon, the controller, the
// tests and the benches name them as before.
pub use hna_contract as contract;
pub use hna_contract::k8s_names;
pub use hna_dhcp as dhcp;
pub use hna_dhcp::mac;

pub mod agent;
pub mod check;
pub mod cli;
pub mod cluster;
pub mod cni;
pub mod config;
pub mod control;
pub mod controller;
pub mod duration;
pub mod guest;
pub mod health;
pub mod kmod;
pub mod lb;
pub mod logging;
pub mod membership;
pub mod metrics;
pub mod node_status;
pub mod pause;
pub mod state_dir;
pub mod systemd;
pub mod topology;

/// The node daemon's modules and the controller's share only the contract
/// (and the common edges: `cluster`, `systemd`, `config`, ...); neither
/// imports the other. One package keeps one binary, so this test, not the
/// compiler, holds the line (docs/design.md says why).
#[cfg(test)]
mod boundaries {
    use std::path::Path;

    const DAEMON: &[&str] = &[
        "agent",
        "lb",
        "membership",
        "kmod",
        "guest",
        "topology",
        "node_status",
    ];
    const CONTROLLER: &[&str] = &["controller"];

    fn sources(module: &str) -> Vec<(String, String)> {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut out = Vec::new();
        let file = src.join(format!("{module}.rs"));
        if file.is_file() {
            out.push((
                file.display().to_string(),
                std::fs::read_to_string(&file).unwrap(),
            ));
        }
        let mut dirs = vec![src.join(module)];
        while let Some(dir) = dirs.pop() {
            for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let p = e.path();
                if p.is_dir() {
                    dirs.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    out.push((
                        p.display().to_string(),
                        std::fs::read_to_string(&p).unwrap(),
                    ));
                }
            }
        }
        assert!(!out.is_empty(), "no sources for {module}");
        out
    }

    fn imports(text: &str, module: &str) -> bool {
        [
            format!("crate::{module}::"),
            format!("crate::{module};"),
            format!("crate::{module}}}"),
            format!("crate::{{{module}"),
        ]
        .iter()
        .any(|p| text.contains(p.as_str()))
    }

    #[test]
    fn the_daemon_and_the_controller_never_import_each_other() {
        for (from, to) in [(DAEMON, CONTROLLER), (CONTROLLER, DAEMON)] {
            for module in from {
                for (file, text) in sources(module) {
                    for other in to {
                        assert!(!imports(&text, other), "{file} imports crate::{other}");
                    }
                }
            }
        }
        // The test can see an import.
        assert!(imports("use crate::controller::reconcile;", "controller"));
    }
}
