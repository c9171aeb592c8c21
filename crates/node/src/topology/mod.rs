//! Topology label relay: Harvester's `topology.kubernetes.io/region` and
//! `.../zone` of the host a guest VM runs on, onto that guest's own Node.
//!
//! * The Harvester cloud-provider kubeconfig (`cloud_config`, as
//!   `generate_addon.sh` makes it) gives a client and the namespace of the
//!   VMs (`cloud_config`). Missing or unusable is reported, never fatal,
//!   and the file is looked at again every `recheck` until it appears or
//!   changes.
//! * This VM's `VirtualMachineInstance` (kubevirt.io/v1, by `vm_name`) is
//!   watched ([`hna_edges::cluster::watch_one`]); its annotations carry the region and zone
//!   Harvester copied from the host. When the credentials may read Nodes,
//!   the host Node (`status.nodeName`) is watched too and its live labels
//!   win, so a host relabel is seen at once.
//! * The guest Node is watched with the node's own credentials and gets a
//!   JSON merge patch touching only the configured keys (`null` removes one)
//!   whenever it differs (`labels`, pure; the relay's decisions over what it
//!   has seen are pure as well, in `assess`). A live migration is just a change
//!   of `status.nodeName`: re-synced immediately, without taints or node
//!   re-initialisation, and nothing polls.
//! * The state ([`TopologyState`]) feeds `status`, `STATUS=` and `check`.

mod assess;
pub(crate) mod cloud_config;
pub(crate) mod labels;
mod relay;
pub(crate) mod state;

use std::path::PathBuf;
use std::time::Duration;

pub use labels::Source;
pub use relay::{probe, run};
pub use state::{Reason, TopologyState};

use crate::config::Config;

/// What the relay needs from the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyConfig {
    /// Cloud-provider kubeconfigs tried in order; the first that exists is
    /// used. One entry when `cloud_config` is configured.
    pub cloud_config: Vec<PathBuf>,
    /// Name of this VM's VirtualMachineInstance.
    pub vm_name: String,
    /// Label keys relayed; empty turns the relay off.
    pub keys: Vec<String>,
    /// How often the cloud-config file is looked at (appearing, changing).
    pub recheck: Duration,
}

impl TopologyConfig {
    /// From the daemon's configuration: `cloud_config` (or
    /// `cloud_config::DEFAULT_PATHS`), `vm_name`, `topology_labels`, and
    /// `credentials_retry` as the file re-check period.
    pub fn from_config(cfg: &Config) -> Self {
        TopologyConfig {
            cloud_config: match &cfg.cloud_config {
                Some(p) => vec![p.clone()],
                None => cloud_config::DEFAULT_PATHS
                    .iter()
                    .map(PathBuf::from)
                    .collect(),
            },
            vm_name: cfg.vm_name.clone(),
            keys: cfg.topology_labels.clone(),
            recheck: cfg.credentials_retry,
        }
    }

    /// The state before [`run`] has reported anything.
    pub fn initial_state(&self) -> TopologyState {
        if self.keys.is_empty() {
            TopologyState::new(
                Reason::Disabled,
                "topology_labels is empty: no labels are relayed",
                &self.keys,
            )
        } else {
            TopologyState::new(Reason::Starting, "starting", &self.keys)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(keys: &[&str]) -> TopologyConfig {
        TopologyConfig {
            cloud_config: vec!["/etc/kubernetes/cloud-config".into()],
            vm_name: "vm-1".into(),
            keys: keys.iter().map(|k| k.to_string()).collect(),
            recheck: Duration::from_secs(10),
        }
    }

    #[test]
    fn no_keys_means_disabled_else_starting() {
        let s = cfg(&[]).initial_state();
        assert_eq!(s.reason, Reason::Disabled);
        assert_eq!(s.message, "topology_labels is empty: no labels are relayed");
        let s = cfg(hna_contract::k8s_names::DEFAULT_TOPOLOGY_KEYS).initial_state();
        assert_eq!(
            (s.reason, s.message.as_str()),
            (Reason::Starting, "starting")
        );
        assert_eq!(s.keys, hna_contract::k8s_names::DEFAULT_TOPOLOGY_KEYS);
    }
}
