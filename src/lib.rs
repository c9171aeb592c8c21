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
//!   state machine, packet sockets, lease files, `dhcp-probe`);
//! - [`lb`]: the node's LoadBalancer data plane (assignments to leases);
//! - [`metrics`]: the optional `/metrics` and `/healthz` endpoint;
//! - [`contract`]: what the daemon and the controller share (and share
//!   with the Harvester cloud provider and kube-vip): annotation keys,
//!   which Services are ours, the address identity;
//! - [`agent`]: orchestration of the node daemon (`run`);
//! - [`controller`]: the in-cluster controller;
//! - [`logging`]: journald or stderr;
//! - [`cli`]: subcommands and exit codes.

pub mod dhcp;
pub mod mac;

/// Declares the modules that need the `node` feature (everything but the
/// DHCP engine; see Cargo.toml).
macro_rules! node_modules {
    ($($module:ident),* $(,)?) => {
        $(
            #[cfg(feature = "node")]
            pub mod $module;
        )*
    };
}

node_modules!(
    agent,
    check,
    cli,
    cluster,
    config,
    contract,
    control,
    controller,
    duration,
    guest,
    health,
    k8s_names,
    kmod,
    lb,
    logging,
    metrics,
    node_status,
    state_dir,
    systemd,
    topology
);
