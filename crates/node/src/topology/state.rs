//! The relay's live state, as `status`, `STATUS=` and `check` show it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::health::{Check, Status};

use super::labels::Source;

/// Why the relay is where it is: a stable CamelCase word.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Reason {
    /// `topology_labels` is empty: nothing is relayed.
    Disabled,
    /// Started; the first answers are not in yet.
    Starting,
    /// No Harvester cloud-provider kubeconfig at the configured path(s).
    NoCloudConfig,
    /// The cloud-provider kubeconfig exists but cannot be read or used.
    InvalidCloudConfig,
    /// An API server (Harvester's or the guest cluster's, as the message
    /// says) did not answer.
    Unreachable,
    /// Credentials were refused: reading the VMI on Harvester, or patching
    /// the guest Node's labels.
    Forbidden,
    /// No VirtualMachineInstance of this name in the kubeconfig's namespace.
    VmiNotFound,
    /// No guest-cluster credentials yet (the node has not joined).
    WaitingForGuestCluster,
    /// This node's Node object does not exist (yet) in the guest cluster.
    NodeNotFound,
    /// The guest Node carries the Harvester topology.
    Relayed,
    /// Found by `check`: the guest Node differs from Harvester (the daemon
    /// corrects it on its next event).
    OutOfSync,
}

impl Reason {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::Disabled => "Disabled",
            Reason::Starting => "Starting",
            Reason::NoCloudConfig => "NoCloudConfig",
            Reason::InvalidCloudConfig => "InvalidCloudConfig",
            Reason::Unreachable => "Unreachable",
            Reason::Forbidden => "Forbidden",
            Reason::VmiNotFound => "VmiNotFound",
            Reason::WaitingForGuestCluster => "WaitingForGuestCluster",
            Reason::NodeNotFound => "NodeNotFound",
            Reason::Relayed => "Relayed",
            Reason::OutOfSync => "OutOfSync",
        }
    }

    /// How `check` rates it.
    pub(crate) fn status(self) -> Status {
        match self {
            Reason::Disabled | Reason::Starting | Reason::Relayed => Status::Ok,
            _ => Status::Warn,
        }
    }
}

/// The relay's state. Serialized into `status --output json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyState {
    pub reason: Reason,
    /// One sentence for people.
    pub message: String,
    /// The cloud-provider kubeconfig in use.
    pub cloud_config: Option<PathBuf>,
    /// `<namespace>/<name>` of this VM's VirtualMachineInstance.
    pub vmi: Option<String>,
    /// The Harvester Node the VMI runs on (`status.nodeName`).
    pub host: Option<String>,
    /// Where the values come from.
    pub source: Option<Source>,
    /// The configured keys, in order.
    pub(crate) keys: Vec<String>,
    /// The values Harvester has for them (what the guest Node should carry).
    pub labels: BTreeMap<String, String>,
    /// RFC 3339 time of the last patch of the guest Node's labels.
    pub(crate) last_patch: Option<String>,
}

impl TopologyState {
    pub(crate) fn new(reason: Reason, message: impl Into<String>, keys: &[String]) -> Self {
        TopologyState {
            reason,
            message: message.into(),
            cloud_config: None,
            vmi: None,
            host: None,
            source: None,
            keys: keys.to_vec(),
            labels: BTreeMap::new(),
            last_patch: None,
        }
    }

    /// For `STATUS=`: the relayed values (`us-east-1/us-east-1a`) once
    /// relayed, else the reason word.
    pub fn short(&self) -> String {
        match self.reason {
            Reason::Relayed if self.labels.is_empty() => "no topology".into(),
            Reason::Relayed => super::labels::short(&self.labels, &self.keys),
            other => other.as_str().into(),
        }
    }

    /// The `topology` entry of `check` (and the daemon's report).
    pub fn check(&self) -> Check {
        Check {
            name: "topology".into(),
            status: self.reason.status(),
            reason: self.reason.as_str().into(),
            message: self.message.clone(),
            remediation: remediation(self.reason).into(),
        }
    }
}

fn remediation(reason: Reason) -> &'static str {
    match reason {
        Reason::Disabled | Reason::Starting | Reason::Relayed => "",
        Reason::NoCloudConfig => {
            "place the Harvester cloud-provider kubeconfig (the output of Harvester's generate_addon.sh <serviceaccount> <namespace>) at /etc/kubernetes/cloud-config, or set `cloud_config`; set `topology_labels = []` to turn the relay off"
        }
        Reason::InvalidCloudConfig => {
            "regenerate the cloud-provider kubeconfig with Harvester's generate_addon.sh and make it readable by root"
        }
        Reason::Unreachable => {
            "check the VM's network path to the API server named in the message; the agent keeps retrying"
        }
        Reason::Forbidden => {
            "on Harvester, give the cloud-provider service account get/list/watch on kubevirt.io virtualmachineinstances in its namespace (generate_addon.sh's Role does); on the guest cluster, relay only keys the kubelet may set (topology.kubernetes.io/region and /zone are allowed by NodeRestriction)"
        }
        Reason::VmiNotFound => {
            "set `vm_name` to this VM's name in Harvester (default: the hostname), and make sure the cloud-provider kubeconfig's context names the VM's namespace"
        }
        Reason::WaitingForGuestCluster => {
            "nothing, if the node is still joining; otherwise see the `kubeconfig` check"
        }
        Reason::NodeNotFound => {
            "nothing, if the kubelet has not registered yet; otherwise check `node_name`"
        }
        Reason::OutOfSync => {
            "nothing if the daemon runs (it corrects this at once); otherwise start it"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> Vec<String> {
        hna_contract::k8s_names::DEFAULT_TOPOLOGY_KEYS
            .iter()
            .map(|k| k.to_string())
            .collect()
    }

    #[test]
    fn short_shows_values_once_relayed() {
        let mut s = TopologyState::new(Reason::Relayed, "ok", &keys());
        s.labels
            .insert("topology.kubernetes.io/region".into(), "us-east-1".into());
        s.labels
            .insert("topology.kubernetes.io/zone".into(), "us-east-1a".into());
        assert_eq!(s.short(), "us-east-1/us-east-1a");
        let s = TopologyState::new(Reason::NoCloudConfig, "none", &keys());
        assert_eq!(s.short(), "NoCloudConfig");
    }

    #[test]
    fn check_has_the_documented_shape() {
        let c = TopologyState::new(Reason::NoCloudConfig, "no file", &keys()).check();
        assert_eq!(c.name, "topology");
        assert_eq!(c.status, Status::Warn);
        assert_eq!(c.reason, "NoCloudConfig");
        assert!(c.remediation.contains("generate_addon.sh"));
        let c = TopologyState::new(Reason::Relayed, "ok", &keys()).check();
        assert_eq!((c.status, c.remediation.as_str()), (Status::Ok, ""));
    }

    #[test]
    fn reason_serializes_as_its_word() {
        let s = TopologyState::new(Reason::VmiNotFound, "m", &keys());
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["reason"], "VmiNotFound");
    }
}
