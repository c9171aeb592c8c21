//! The real test rig of harvester-node-agent, shared by the integration
//! tests (`tests/integration`), the benches and the examples (the demo):
//!
//! - [`rig`]: network namespaces on a bridge, dnsmasq as DHCP server and a
//!   real etcd + kube-apiserver, torn down on drop;
//! - [`vm`]: Debian's stock kernel booted under qemu with a small initramfs
//!   that runs a test's shell script;
//! - [`lb`]: the LoadBalancer rig (the rig with the manifests applied,
//!   agents, controller replicas, a client on the LAN);
//! - [`prereq`]: what those need from the machine, how to tell whether it is
//!   there, and the command that installs it.
//!
//! It does not depend on the agent's crate: it drives the agent binary (or
//! the agent's library, in the caller) from the outside.

pub mod addrwatch;
pub mod arpprobe;
pub mod failover;
pub mod fdbwatch;
pub mod lb;
pub mod locate;
pub mod peers;
pub mod prereq;
pub mod promtext;
pub mod rig;
pub mod soak;
pub mod tcpprobe;
pub mod udpcapture;
pub mod vm;

/// The YAML parser of the manifests, for tests that read other YAML the
/// project ships (cloud-config) without a dependency of their own.
pub use serde_norway;

use std::path::PathBuf;

/// Finds the executable `name` in `$PATH` and the usual system folders
/// (`sudo` and cron leave the sbin folders out of `$PATH`).
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(
            [
                "/usr/local/sbin",
                "/usr/local/bin",
                "/usr/sbin",
                "/usr/bin",
                "/sbin",
                "/bin",
            ]
            .map(PathBuf::from),
        )
        .map(|dir| dir.join(name))
        .find(|p| locate::is_executable(p))
}
