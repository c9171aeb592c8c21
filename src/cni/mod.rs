//! `harvester-node-agent check cni`: whether the node's CNI and network
//! managers keep off our `hlb-*` links.
//!
//! A CNI that takes a load-balancer address for the node's own (Calico's
//! `first-found`, harvester/harvester#10784 with kube-vip's `vip-*`), one
//! that attaches BPF programs to our links (Cilium's device detection), or
//! a network manager that configures them breaks the node's pod network or
//! our addresses, quietly. The facts are gathered read-only at the edge
//! (`host`); `assess` turns them into checks, and
//! `helm_chart_configs` says what keeps RKE2's CNIs off our links.

pub(crate) mod host;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use hna_contract::INTERFACE_PREFIX;
use hna_node::health::{Check, Status};

/// Where CNI configurations live: RKE2 and kubeadm, then K3s.
pub(crate) const DEFAULT_CONF_DIRS: &[&str] =
    &["/etc/cni/net.d", "/var/lib/rancher/k3s/agent/etc/cni/net.d"];

/// The Node annotations in which CNIs publish the address they took for the
/// node: (annotation, whose).
pub(crate) const NODE_ADDRESS_ANNOTATIONS: &[(&str, &str)] = &[
    ("projectcalico.org/IPv4Address", "Calico"),
    ("flannel.alpha.coreos.com/public-ip", "flannel"),
    ("flannel.alpha.coreos.com/public-ip-overwrite", "flannel"),
];

/// The NetworkManager drop-in the packages ship.
pub(crate) const NM_DROP_IN: &str = "/usr/lib/NetworkManager/conf.d/90-harvester-node-agent.conf";

/// One CNI configuration file and the plugin types it chains.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ConfFile {
    pub(crate) path: PathBuf,
    pub(crate) plugins: Vec<String>,
}

/// The primary CNIs RKE2 ships, as their configuration shows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Cni {
    /// Calico for policy, flannel for the overlay (RKE2's default).
    Canal,
    Calico,
    Cilium,
    Flannel,
}

impl Cni {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Cni::Canal => "canal",
            Cni::Calico => "calico",
            Cni::Cilium => "cilium",
            Cni::Flannel => "flannel",
        }
    }
}

/// Which CNIs the configurations name. Canal chains the `calico` plugin
/// like Calico does (flannel only carries the overlay): RKE2's file is
/// `10-canal.conflist`.
pub(crate) fn detect(files: &[ConfFile]) -> Vec<Cni> {
    let mut found = Vec::new();
    for f in files {
        let has = |t: &str| f.plugins.iter().any(|p| p == t);
        let canal_file = f
            .path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().contains("canal"));
        let cni = if has("calico") && (canal_file || has("flannel")) {
            Some(Cni::Canal)
        } else if has("calico") {
            Some(Cni::Calico)
        } else if has("cilium-cni") {
            Some(Cni::Cilium)
        } else if has("flannel") {
            Some(Cni::Flannel)
        } else {
            None
        };
        if let Some(c) = cni.filter(|c| !found.contains(c)) {
            found.push(c);
        }
    }
    found
}

/// One of our links as the kernel has it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct OurLink {
    pub(crate) name: String,
    pub(crate) index: u32,
    pub(crate) addresses: Vec<Ipv4Addr>,
}

/// What the API server told about this node, or why it could not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum NodeFacts {
    Read {
        node: String,
        annotations: BTreeMap<String, String>,
        /// Every LoadBalancer Service's address: `namespace/name` by address.
        service_addresses: BTreeMap<Ipv4Addr, String>,
    },
    NotRead(String),
}

/// Who manages a link besides us.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Managed {
    pub(crate) link: String,
    pub(crate) manager: Manager,
    /// What says so (the state file and its line).
    pub(crate) evidence: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Manager {
    NetworkManager,
    SystemdNetworkd,
}

/// Everything [`assess`] judges, gathered by [`host::gather`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Facts {
    pub(crate) conf_dirs: Vec<PathBuf>,
    pub(crate) conf_files: Vec<ConfFile>,
    /// The uplink our links sit on (the one Cilium's `devices` should name).
    pub(crate) uplink: Option<String>,
    pub(crate) links: Vec<OurLink>,
    pub(crate) node: NodeFacts,
    /// BPF programs on our links, one line each (`hlb-…: tc ingress bpf …`).
    pub(crate) bpf: Vec<String>,
    /// Why the BPF attachments could not all be read.
    pub(crate) bpf_error: Option<String>,
    pub(crate) managed: Vec<Managed>,
}

/// The node's CNI checks, in the order they are printed.
pub(crate) fn assess(f: &Facts) -> Vec<Check> {
    let cnis = detect(&f.conf_files);
    vec![
        cni_check(f, &cnis),
        node_address_check(f, &cnis),
        bpf_check(f, &cnis),
        managers_check(f),
    ]
}

fn names(cnis: &[Cni]) -> String {
    cnis.iter()
        .map(|c| c.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

fn cni_check(f: &Facts, cnis: &[Cni]) -> Check {
    let dirs = f
        .conf_dirs
        .iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    if f.conf_files.is_empty() {
        return Check::new(
            "cni",
            Status::Warn,
            "NotFound",
            format!(
                "no CNI configuration in {dirs}; normal before the node joins (RKE2 writes it when its CNI starts)"
            ),
            "nothing, if the node is still joining; otherwise pass the directory with --cni-conf-dir",
        );
    }
    let files = f
        .conf_files
        .iter()
        .map(|c| format!("{} ({})", c.path.display(), c.plugins.join("+")))
        .collect::<Vec<_>>()
        .join(", ");
    if cnis.is_empty() {
        Check::new(
            "cni",
            Status::Ok,
            "Unknown",
            format!(
                "none of canal, calico, cilium, flannel in {files}; only the Node annotations, BPF programs and link managers below are checked"
            ),
            "",
        )
    } else {
        Check::new(
            "cni",
            Status::Ok,
            "Found",
            format!("{} in {files}", names(cnis)),
            "",
        )
    }
}

fn keep_off(cnis: &[Cni]) -> String {
    if cnis.is_empty() {
        "keep the CNI off hlb-* links (see `harvester-node-agent check cni` for RKE2's HelmChartConfigs)".into()
    } else {
        format!(
            "keep {} off hlb-* links with the HelmChartConfig printed below (RKE2: save it in /var/lib/rancher/rke2/server/manifests/ on a server), then restart the CNI's DaemonSet",
            names(cnis)
        )
    }
}

fn node_address_check(f: &Facts, cnis: &[Cni]) -> Check {
    let (node, annotations, service_addresses) = match &f.node {
        NodeFacts::Read {
            node,
            annotations,
            service_addresses,
        } => (node, annotations, service_addresses),
        NodeFacts::NotRead(why) => {
            return Check::new(
                "cni-node-address",
                Status::Warn,
                "NotRead",
                format!("the Node's CNI annotations were not read: {why}"),
                "run where the node's kubeconfig is found (or pass --kubeconfig) to compare the CNI's node address with the load-balancer addresses",
            );
        }
    };
    let mut bad = Vec::new();
    let mut seen = Vec::new();
    for (key, whose) in NODE_ADDRESS_ANNOTATIONS {
        let Some(value) = annotations.get(*key) else {
            continue;
        };
        // Calico writes `address/prefix`, flannel the bare address.
        let bare = value.split('/').next().unwrap_or_default().trim();
        seen.push(format!("{whose} {bare} ({key})"));
        let Ok(ip) = bare.parse::<Ipv4Addr>() else {
            continue;
        };
        if let Some(link) = f.links.iter().find(|l| l.addresses.contains(&ip)) {
            bad.push(format!(
                "{whose}'s node address {ip} ({key}) is held on our link {}",
                link.name
            ));
        } else if let Some(svc) = service_addresses.get(&ip) {
            bad.push(format!(
                "{whose}'s node address {ip} ({key}) is the load-balancer address of Service {svc}"
            ));
        }
    }
    if !bad.is_empty() {
        return Check::new(
            "cni-node-address",
            Status::Fail,
            "LoadBalancerAddress",
            format!(
                "Node {node}: {}; pod traffic to this node goes to whichever node holds that address",
                bad.join("; ")
            ),
            &keep_off(cnis),
        );
    }
    if seen.is_empty() {
        Check::new(
            "cni-node-address",
            Status::Ok,
            "NoAnnotation",
            format!("Node {node} carries no Calico or flannel node address"),
            "",
        )
    } else {
        Check::new(
            "cni-node-address",
            Status::Ok,
            "NotOurs",
            format!("Node {node}: {}: no load-balancer address", seen.join(", ")),
            "",
        )
    }
}

fn no_links_yet(name: &str) -> Check {
    Check::new(
        name,
        Status::Ok,
        "NoLinks",
        format!("no {INTERFACE_PREFIX}* links on this node: nothing to check yet"),
        "",
    )
}

fn bpf_check(f: &Facts, cnis: &[Cni]) -> Check {
    if !f.bpf.is_empty() {
        return Check::new(
            "cni-bpf",
            Status::Fail,
            "BpfAttached",
            format!(
                "BPF programs on our links (we attach none): {}",
                f.bpf.join("; ")
            ),
            &keep_off(cnis),
        );
    }
    if let Some(why) = &f.bpf_error {
        return Check::new(
            "cni-bpf",
            Status::Warn,
            "NotRead",
            format!("the BPF programs on our links were not all read: {why}"),
            "run as root",
        );
    }
    if f.links.is_empty() {
        return no_links_yet("cni-bpf");
    }
    Check::new(
        "cni-bpf",
        Status::Ok,
        "None",
        format!(
            "no tc or tcx BPF program on {} {INTERFACE_PREFIX}* link(s)",
            f.links.len()
        ),
        "",
    )
}

fn managers_check(f: &Facts) -> Check {
    if f.managed.is_empty() {
        if f.links.is_empty() {
            return no_links_yet("cni-link-managers");
        }
        return Check::new(
            "cni-link-managers",
            Status::Ok,
            "Unmanaged",
            format!(
                "neither NetworkManager nor systemd-networkd manages the {} {INTERFACE_PREFIX}* link(s)",
                f.links.len()
            ),
            "",
        );
    }
    let said = f
        .managed
        .iter()
        .map(|m| format!("{}: {:?} ({})", m.link, m.manager, m.evidence))
        .collect::<Vec<_>>()
        .join("; ");
    let mut fixes = Vec::new();
    if f.managed
        .iter()
        .any(|m| m.manager == Manager::NetworkManager)
    {
        fixes.push(format!(
            "NetworkManager: install the packages' {NM_DROP_IN} (unmanaged-devices=interface-name:{INTERFACE_PREFIX}*), then `systemctl reload NetworkManager`"
        ));
    }
    if f.managed
        .iter()
        .any(|m| m.manager == Manager::SystemdNetworkd)
    {
        fixes.push(format!(
            "systemd-networkd: add `Name=!{INTERFACE_PREFIX}*` to the [Match] section of the .network file named, then `networkctl reload`"
        ));
    }
    Check::new(
        "cni-link-managers",
        Status::Fail,
        "Managed",
        format!("our links are managed by another: {said}"),
        &fixes.join("; "),
    )
}

/// The HelmChartConfig that keeps `cni` off our links on RKE2, or nothing
/// for a CNI RKE2 does not configure that way. `uplink` is what Cilium's
/// `devices` names (the node's uplink; `eth0` when unknown).
pub(crate) fn helm_chart_config(cni: Cni, uplink: Option<&str>) -> Option<String> {
    let values = match cni {
        // Calico's autodetection skips our links and kube-vip's; flannel
        // follows the default route, never one of ours.
        Cni::Canal => format!(
            "calico:\n  ipAutoDetectionMethod: \"skip-interface={INTERFACE_PREFIX}.*,vip-.*\""
        ),
        // The tigera operator rewrites calico-node's environment: the
        // Installation is where the method lasts.
        Cni::Calico => format!(
            "installation:\n  calicoNetwork:\n    nodeAddressAutodetectionV4:\n      skipInterface: \"{INTERFACE_PREFIX}.*|vip-.*\""
        ),
        // Cilium takes every up device with a global unicast route unless
        // told which: name the uplink (a `+` suffix matches a prefix).
        Cni::Cilium => format!(
            "devices:\n  - {}",
            uplink.filter(|u| !u.is_empty()).unwrap_or("eth0")
        ),
        Cni::Flannel => return None,
    };
    let mut out = String::new();
    let _ = writeln!(out, "apiVersion: helm.cattle.io/v1");
    let _ = writeln!(out, "kind: HelmChartConfig");
    let _ = writeln!(out, "metadata:");
    let _ = writeln!(out, "  name: rke2-{}", cni.as_str());
    let _ = writeln!(out, "  namespace: kube-system");
    let _ = writeln!(out, "spec:");
    let _ = writeln!(out, "  valuesContent: |-");
    for line in values.lines() {
        let _ = writeln!(out, "    {line}");
    }
    Some(out)
}

/// The HelmChartConfigs to print: the detected CNIs', or all three RKE2
/// ones when none is detected.
pub(crate) fn helm_chart_configs(f: &Facts) -> Vec<(Cni, String)> {
    let detected = detect(&f.conf_files);
    let cnis = if detected.is_empty() {
        vec![Cni::Canal, Cni::Calico, Cni::Cilium]
    } else {
        detected
    };
    cnis.into_iter()
        .filter_map(|c| helm_chart_config(c, f.uplink.as_deref()).map(|y| (c, y)))
        .collect()
}

#[cfg(test)]
mod tests;
