//! The relay's decisions as plain functions over what it has seen.
//!
//! [`Seen`] holds the latest word on the cloud-config, the VMI, its host
//! Node and the guest Node, as plain data. Its methods record new views and
//! say which watch to start or stop (a moved VMI means a new host to
//! follow); [`assess`] turns it into the state to report and the merge
//! patch to send. No clients, no clock, no I/O: the relay task
//! ([`super::relay`]) watches, patches and feeds the results in.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use serde_json::Value;

use super::labels::{self, Labels};
use super::state::{Reason, TopologyState};
use hna_edges::cluster::watch_one::{Failure, FailureKind};

/// The latest word on one watched object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum View<T> {
    Pending,
    Present(T),
    Absent,
    Failed(Failure),
}

/// What the relay needs of a VirtualMachineInstance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Vmi {
    pub(crate) annotations: Labels,
    /// `status.nodeName`: the Harvester Node it runs on.
    pub(crate) node_name: Option<String>,
}

/// The cloud-provider kubeconfig as last looked at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Cloud {
    /// Not looked at yet.
    Unread,
    /// None of these paths exists.
    Missing(Vec<PathBuf>),
    /// The file cannot be read or is not a usable kubeconfig.
    Invalid(PathBuf, String),
    /// A client was made from `path` for the API server `server`; the VMs
    /// live in `namespace`.
    Ready {
        path: PathBuf,
        namespace: String,
        server: String,
    },
}

/// What the relay works on, fixed for its lifetime.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scope<'a> {
    /// The label keys relayed.
    pub(crate) keys: &'a [String],
    /// This VM's VirtualMachineInstance on Harvester.
    pub(crate) vm_name: &'a str,
    /// This node's Node in the guest cluster.
    pub(crate) node_name: &'a str,
}

/// Everything the relay has seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seen {
    pub(crate) cloud: Cloud,
    pub(crate) vmi: View<Vmi>,
    /// The Harvester Node followed: the VMI's `status.nodeName` as last seen
    /// (kept while the VMI cannot be read).
    pub(crate) host_name: Option<String>,
    pub(crate) host: View<Labels>,
    /// The credentials may not read Harvester Nodes: use the annotations.
    pub(crate) host_forbidden: bool,
    /// There is a guest-cluster connection (the node has joined).
    pub(crate) guest_connected: bool,
    pub(crate) guest: View<Labels>,
    /// RFC 3339 time of the last patch of the guest Node's labels.
    pub(crate) last_patch: Option<String>,
}

/// The host Node to follow after the VMI changed hosts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostChange {
    /// The host followed until now.
    pub(crate) from: Option<String>,
    /// The host to watch from now on; `None` when there is none to watch
    /// (no host, or no Harvester client).
    pub(crate) watch: Option<String>,
}

/// Whether the host-Node watch should go on after an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HostWatch {
    Continue,
    /// Harvester Nodes are not readable with these credentials; that lasts
    /// until the credentials change, so stop asking.
    Stop,
}

/// Why a patch of the guest Node did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PatchError {
    Failed(Failure),
    TimedOut(Duration),
}

impl Default for Seen {
    fn default() -> Self {
        Seen {
            cloud: Cloud::Unread,
            vmi: View::Pending,
            host_name: None,
            host: View::Pending,
            host_forbidden: false,
            guest_connected: false,
            guest: View::Pending,
            last_patch: None,
        }
    }
}

impl Seen {
    /// The cloud-config changed (appeared, gone, new content): everything
    /// seen on the Harvester side is void.
    pub(crate) fn cloud_changed(&mut self, cloud: Cloud) {
        self.cloud = cloud;
        self.vmi = View::Pending;
        self.host_name = None;
        self.host = View::Pending;
        self.host_forbidden = false;
    }

    /// A new view of the VMI; `Some` when the host to follow changed (a
    /// live migration, or the VMI appeared or went).
    pub(crate) fn vmi_seen(&mut self, vmi: View<Vmi>) -> Option<HostChange> {
        self.vmi = vmi;
        let host = match &self.vmi {
            View::Present(v) => v.node_name.clone(),
            View::Absent => None,
            // Keep following the last host while the VMI is unreadable.
            View::Pending | View::Failed(_) => return None,
        };
        if host == self.host_name {
            return None;
        }
        let from = self.host_name.take();
        Some(HostChange {
            from,
            watch: self.follow_host(host),
        })
    }

    /// Follows `host`; returns the name to watch, if any.
    fn follow_host(&mut self, host: Option<String>) -> Option<String> {
        self.host_name = host.clone();
        match (host, &self.cloud) {
            (Some(name), Cloud::Ready { .. }) => {
                self.host = View::Pending;
                Some(name)
            }
            _ => {
                self.host = View::Absent;
                None
            }
        }
    }

    /// A new view of the host Node's labels.
    pub(crate) fn host_seen(&mut self, host: View<Labels>) -> HostWatch {
        self.host = host;
        match &self.host {
            View::Failed(f) if f.kind == FailureKind::Forbidden => {
                self.host_forbidden = true;
                HostWatch::Stop
            }
            View::Present(_) => {
                self.host_forbidden = false;
                HostWatch::Continue
            }
            _ => HostWatch::Continue,
        }
    }

    /// The guest-cluster connection came or went: the guest Node is to be
    /// read again.
    pub(crate) fn guest_connection(&mut self, connected: bool) {
        self.guest_connected = connected;
        self.guest = View::Pending;
    }

    /// A new view of the guest Node's labels.
    pub(crate) fn guest_seen(&mut self, guest: View<Labels>) {
        self.guest = guest;
    }

    /// The guest Node was patched at `now` and now carries `labels`.
    pub(crate) fn patched(&mut self, labels: Labels, now: SystemTime) {
        self.guest = View::Present(labels);
        self.last_patch = Some(humantime::format_rfc3339_seconds(now).to_string());
    }
}

/// The state to report and the merge patch the guest Node needs (`None`
/// when it needs none or cannot be patched yet).
pub(crate) fn assess(scope: Scope<'_>, seen: &Seen) -> (TopologyState, Option<Value>) {
    let Scope {
        keys,
        vm_name,
        node_name,
    } = scope;
    let mut st = TopologyState::new(Reason::Starting, "starting", keys);
    st.last_patch = seen.last_patch.clone();
    // Each gate below either yields what the next one needs or has said in
    // `st` why the relay waits.
    let Some((path, namespace, server)) = cloud_config(&mut st, &seen.cloud) else {
        return (st, None);
    };
    st.cloud_config = Some(path.clone());
    let vmi_ref = format!("{namespace}/{vm_name}");
    st.vmi = Some(vmi_ref.clone());
    let harvester = format!("Harvester ({server})");
    let Some(vmi) = vmi_read(&mut st, &seen.vmi, &vmi_ref, server, &harvester) else {
        return (st, None);
    };
    st.host = vmi.node_name.clone();
    let Some(host_labels) = host_labels(&mut st, seen, &harvester) else {
        return (st, None);
    };
    let desired = labels::desired(&vmi.annotations, host_labels, keys);
    st.source = Some(desired.source);
    st.labels = desired.labels.clone();
    let origin = match (desired.source, &vmi.node_name) {
        (labels::Source::HostNode, Some(n)) => format!("Harvester Node {n}"),
        (_, Some(n)) => format!("the annotations of VMI {vmi_ref} (on {n})"),
        (_, None) => format!("the annotations of VMI {vmi_ref}"),
    };
    let invalid = if desired.invalid.is_empty() {
        String::new()
    } else {
        format!(
            "; not relayed (invalid label values): {}",
            desired
                .invalid
                .iter()
                .map(|(k, v)| format!("{k}={v:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    if !seen.guest_connected {
        st.reason = Reason::WaitingForGuestCluster;
        st.message = format!(
            "no guest-cluster connection yet; will relay {} from {origin}{invalid}",
            describe(&st.labels, keys)
        );
        return (st, None);
    }
    let Some(guest) = guest_node(&mut st, &seen.guest, node_name) else {
        return (st, None);
    };
    let patch = labels::patch(&desired, guest, keys);
    st.reason = Reason::Relayed;
    st.message = if st.labels.is_empty() && desired.invalid.is_empty() {
        format!(
            "{origin} has no topology ({} unset); Node {node_name} carries none",
            keys.join(", ")
        )
    } else {
        format!(
            "Node {node_name} carries {} from {origin}{invalid}",
            describe(&st.labels, keys)
        )
    };
    (st, patch)
}

/// The usable cloud-config's path, namespace and server.
fn cloud_config<'a>(
    st: &mut TopologyState,
    cloud: &'a Cloud,
) -> Option<(&'a PathBuf, &'a String, &'a String)> {
    match cloud {
        Cloud::Unread => None,
        Cloud::Missing(searched) => {
            st.reason = Reason::NoCloudConfig;
            st.message = format!(
                "no Harvester cloud-provider kubeconfig (looked for {})",
                searched
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            None
        }
        Cloud::Invalid(path, e) => {
            st.reason = Reason::InvalidCloudConfig;
            st.message = format!("cloud-provider kubeconfig {}: {e}", path.display());
            st.cloud_config = Some(path.clone());
            None
        }
        Cloud::Ready {
            path,
            namespace,
            server,
        } => Some((path, namespace, server)),
    }
}

/// This VM's VirtualMachineInstance, once read.
fn vmi_read<'a>(
    st: &mut TopologyState,
    vmi: &'a View<Vmi>,
    vmi_ref: &str,
    server: &str,
    harvester: &str,
) -> Option<&'a Vmi> {
    match vmi {
        View::Pending => {
            st.message = format!("reading VirtualMachineInstance {vmi_ref} at {server}");
            None
        }
        View::Absent => {
            st.reason = Reason::VmiNotFound;
            st.message = format!(
                "no VirtualMachineInstance {vmi_ref} on Harvester ({server}); labels left as they are"
            );
            None
        }
        View::Failed(f) => {
            let what = format!("reading VirtualMachineInstance {vmi_ref}");
            failed(st, harvester, &what, f);
            None
        }
        View::Present(v) => Some(v),
    }
}

/// The Harvester Node's labels to relay: `Some(None)` when the VMI's
/// annotations are the source instead, `None` while the relay waits.
fn host_labels<'a>(
    st: &mut TopologyState,
    seen: &'a Seen,
    harvester: &str,
) -> Option<Option<&'a Labels>> {
    let host_name = seen.host_name.as_deref().unwrap_or("");
    match &seen.host {
        View::Present(l) if seen.host_name.is_some() => Some(Some(l)),
        View::Pending if !seen.host_forbidden && seen.host_name.is_some() => {
            st.message = format!("reading Harvester Node {host_name}");
            None
        }
        // A readable host that cannot be reached right now: hold rather
        // than fall back to possibly older annotations.
        View::Failed(f) if f.kind == FailureKind::Unreachable => {
            let what = format!("reading Harvester Node {host_name}");
            failed(st, harvester, &what, f);
            None
        }
        // Not readable (Forbidden), not found, or no host: annotations.
        _ => Some(None),
    }
}

/// The guest Node's labels, once read.
fn guest_node<'a>(
    st: &mut TopologyState,
    guest: &'a View<Labels>,
    node_name: &str,
) -> Option<&'a Labels> {
    match guest {
        View::Pending => {
            st.message = format!("reading Node {node_name}");
            None
        }
        View::Absent => {
            st.reason = Reason::NodeNotFound;
            st.message = format!("Node {node_name} is not registered in the guest cluster yet");
            None
        }
        View::Failed(f) => {
            let what = format!("reading Node {node_name}");
            failed(st, "guest cluster", &what, f);
            None
        }
        View::Present(l) => Some(l),
    }
}

/// What `check` reports: [`assess`], except that a Node still needing a
/// patch is `OutOfSync` (`check` never patches).
pub(crate) fn assess_for_check(scope: Scope<'_>, seen: &Seen) -> TopologyState {
    let (mut state, patch) = assess(scope, seen);
    if patch.is_some() {
        state.reason = Reason::OutOfSync;
        state.message = format!(
            "Node {} does not carry Harvester's topology yet ({})",
            scope.node_name,
            describe(&state.labels, &state.keys)
        );
    }
    state
}

/// `state` (from [`assess`]) after the patch it called for went wrong.
pub(crate) fn patch_failed(
    mut state: TopologyState,
    node_name: &str,
    error: &PatchError,
) -> TopologyState {
    match error {
        PatchError::Failed(f) => {
            state.reason = reason_of(f);
            state.message = format!(
                "guest cluster: patching the labels of Node {node_name} failed: {}",
                f.message
            );
        }
        PatchError::TimedOut(after) => {
            state.reason = Reason::Unreachable;
            state.message = format!(
                "guest cluster: patching the labels of Node {node_name} did not finish within {}",
                humantime::format_duration(*after)
            );
        }
    }
    state
}

fn reason_of(f: &Failure) -> Reason {
    match f.kind {
        FailureKind::Forbidden => Reason::Forbidden,
        FailureKind::Unreachable => Reason::Unreachable,
    }
}

fn failed(st: &mut TopologyState, side: &str, what: &str, f: &Failure) {
    st.reason = reason_of(f);
    st.message = format!("{side}: {what}: {}", f.message);
}

/// `key=value, key unset` for people.
fn describe(labels: &Labels, keys: &[String]) -> String {
    keys.iter()
        .map(|k| match labels.get(k) {
            Some(v) => format!("{k}={v}"),
            None => format!("{k} unset"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use serde_json::json;

    use super::*;
    use crate::topology::Source;

    const REGION: &str = "topology.kubernetes.io/region";
    const ZONE: &str = "topology.kubernetes.io/zone";
    const NODE: &str = "guest-1";
    const VM: &str = "vm-1";
    const SERVER: &str = "https://harvester.example:6443";
    const CLOUD_CONFIG: &str = "/etc/kubernetes/cloud-config";
    /// Both keys, as `describe` writes them, for the host's values.
    const HOST_A_TOPOLOGY: &str =
        "topology.kubernetes.io/region=us-east-1, topology.kubernetes.io/zone=us-east-1a";

    fn keys() -> Vec<String> {
        hna_contract::k8s_names::DEFAULT_TOPOLOGY_KEYS
            .iter()
            .map(|k| k.to_string())
            .collect()
    }

    fn scope(keys: &[String]) -> Scope<'_> {
        Scope {
            keys,
            vm_name: VM,
            node_name: NODE,
        }
    }

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn forbidden(message: &str) -> Failure {
        Failure {
            kind: FailureKind::Forbidden,
            message: message.into(),
        }
    }

    fn unreachable(message: &str) -> Failure {
        Failure {
            kind: FailureKind::Unreachable,
            message: message.into(),
        }
    }

    fn ready() -> Cloud {
        Cloud::Ready {
            path: CLOUD_CONFIG.into(),
            namespace: "vms".into(),
            server: SERVER.into(),
        }
    }

    /// Host `host-a` is labelled us-east-1/us-east-1a.
    fn host_a() -> Labels {
        labels(&[
            (REGION, "us-east-1"),
            (ZONE, "us-east-1a"),
            ("kubernetes.io/hostname", "host-a"),
        ])
    }

    /// Annotations Harvester copied before the host was relabelled: stale.
    fn stale_annotations() -> Labels {
        labels(&[
            (REGION, "us-west-2"),
            (ZONE, "us-west-2a"),
            ("harvesterhci.io/sshNames", "[]"),
        ])
    }

    fn vmi_on(host: Option<&str>, annotations: Labels) -> View<Vmi> {
        View::Present(Vmi {
            annotations,
            node_name: host.map(str::to_string),
        })
    }

    /// Everything read, the guest Node already carrying host-a's values.
    fn in_sync() -> Seen {
        Seen {
            cloud: ready(),
            vmi: vmi_on(Some("host-a"), stale_annotations()),
            host_name: Some("host-a".into()),
            host: View::Present(host_a()),
            host_forbidden: false,
            guest_connected: true,
            guest: View::Present(labels(&[
                (REGION, "us-east-1"),
                (ZONE, "us-east-1a"),
                ("kubernetes.io/hostname", NODE),
            ])),
            last_patch: None,
        }
    }

    fn with(change: impl FnOnce(&mut Seen)) -> Seen {
        let mut s = in_sync();
        change(&mut s);
        s
    }

    struct Case {
        name: &'static str,
        seen: Seen,
        reason: Reason,
        message: String,
        patch: Option<Value>,
    }

    fn case(name: &'static str, seen: Seen, reason: Reason, message: &str) -> Case {
        Case {
            name,
            seen,
            reason,
            message: message.to_string(),
            patch: None,
        }
    }

    impl Case {
        fn patch(mut self, patch: Value) -> Self {
            self.patch = Some(patch);
            self
        }
    }

    fn cases() -> Vec<Case> {
        let from_annotations =
            "topology.kubernetes.io/region=us-west-2, topology.kubernetes.io/zone=us-west-2a";
        vec![
            case("cloud-config not looked at yet", Seen::default(), Reason::Starting, "starting"),
            case(
                "no cloud-config",
                with(|s| {
                    s.cloud = Cloud::Missing(vec![CLOUD_CONFIG.into(), "/var/lib/cc".into()])
                }),
                Reason::NoCloudConfig,
                "no Harvester cloud-provider kubeconfig (looked for /etc/kubernetes/cloud-config, /var/lib/cc)",
            ),
            case(
                "unusable cloud-config",
                with(|s| s.cloud = Cloud::Invalid(CLOUD_CONFIG.into(), "not a kubeconfig: x".into())),
                Reason::InvalidCloudConfig,
                "cloud-provider kubeconfig /etc/kubernetes/cloud-config: not a kubeconfig: x",
            ),
            case(
                "VMI not read yet",
                with(|s| s.vmi = View::Pending),
                Reason::Starting,
                "reading VirtualMachineInstance vms/vm-1 at https://harvester.example:6443",
            ),
            case(
                "no such VMI",
                with(|s| s.vmi = View::Absent),
                Reason::VmiNotFound,
                "no VirtualMachineInstance vms/vm-1 on Harvester (https://harvester.example:6443); labels left as they are",
            ),
            case(
                "VMI not readable with these credentials",
                with(|s| s.vmi = View::Failed(forbidden("403 vmis forbidden"))),
                Reason::Forbidden,
                "Harvester (https://harvester.example:6443): reading VirtualMachineInstance vms/vm-1: 403 vmis forbidden",
            ),
            case(
                "Harvester unreachable for the VMI",
                with(|s| s.vmi = View::Failed(unreachable("connection refused"))),
                Reason::Unreachable,
                "Harvester (https://harvester.example:6443): reading VirtualMachineInstance vms/vm-1: connection refused",
            ),
            case(
                "host Node not read yet",
                with(|s| s.host = View::Pending),
                Reason::Starting,
                "reading Harvester Node host-a",
            ),
            case(
                "Harvester unreachable for the host Node: hold, no stale annotations",
                with(|s| {
                    s.host = View::Failed(unreachable("timed out"));
                    s.guest = View::Present(Labels::new());
                }),
                Reason::Unreachable,
                "Harvester (https://harvester.example:6443): reading Harvester Node host-a: timed out",
            ),
            case(
                "host Nodes not readable: the annotations",
                with(|s| {
                    s.host = View::Failed(forbidden("nodes is forbidden"));
                    s.host_forbidden = true;
                }),
                Reason::Relayed,
                &format!(
                    "Node guest-1 carries {from_annotations} from the annotations of VMI vms/vm-1 (on host-a)"
                ),
            )
            .patch(json!({"metadata":{"labels":{REGION:"us-west-2", ZONE:"us-west-2a"}}})),
            case(
                "host Nodes not readable, new host not read yet: the annotations at once",
                with(|s| {
                    s.host = View::Pending;
                    s.host_forbidden = true;
                    s.guest = View::Present(labels(&[(REGION, "us-west-2"), (ZONE, "us-west-2a")]));
                }),
                Reason::Relayed,
                &format!(
                    "Node guest-1 carries {from_annotations} from the annotations of VMI vms/vm-1 (on host-a)"
                ),
            ),
            case(
                "host Node gone: the annotations",
                with(|s| s.host = View::Absent),
                Reason::Relayed,
                &format!(
                    "Node guest-1 carries {from_annotations} from the annotations of VMI vms/vm-1 (on host-a)"
                ),
            )
            .patch(json!({"metadata":{"labels":{REGION:"us-west-2", ZONE:"us-west-2a"}}})),
            case(
                "VMI not scheduled: the annotations",
                with(|s| {
                    s.vmi = vmi_on(None, stale_annotations());
                    s.host_name = None;
                    s.host = View::Absent;
                }),
                Reason::Relayed,
                &format!("Node guest-1 carries {from_annotations} from the annotations of VMI vms/vm-1"),
            )
            .patch(json!({"metadata":{"labels":{REGION:"us-west-2", ZONE:"us-west-2a"}}})),
            case(
                "no guest-cluster connection",
                with(|s| {
                    s.guest_connected = false;
                    s.guest = View::Pending;
                }),
                Reason::WaitingForGuestCluster,
                &format!(
                    "no guest-cluster connection yet; will relay {HOST_A_TOPOLOGY} from Harvester Node host-a"
                ),
            ),
            case(
                "guest Node not read yet",
                with(|s| s.guest = View::Pending),
                Reason::Starting,
                "reading Node guest-1",
            ),
            case(
                "Node not registered",
                with(|s| s.guest = View::Absent),
                Reason::NodeNotFound,
                "Node guest-1 is not registered in the guest cluster yet",
            ),
            case(
                "guest Node not readable",
                with(|s| s.guest = View::Failed(forbidden("nodes \"guest-1\" is forbidden"))),
                Reason::Forbidden,
                "guest cluster: reading Node guest-1: nodes \"guest-1\" is forbidden",
            ),
            case(
                "guest cluster unreachable",
                with(|s| s.guest = View::Failed(unreachable("connection reset"))),
                Reason::Unreachable,
                "guest cluster: reading Node guest-1: connection reset",
            ),
            case(
                "in sync: nothing to patch",
                in_sync(),
                Reason::Relayed,
                &format!("Node guest-1 carries {HOST_A_TOPOLOGY} from Harvester Node host-a"),
            ),
            case(
                "bare Node: both keys set, the host's labels winning over the annotations",
                with(|s| s.guest = View::Present(labels(&[("kubernetes.io/hostname", NODE)]))),
                Reason::Relayed,
                &format!("Node guest-1 carries {HOST_A_TOPOLOGY} from Harvester Node host-a"),
            )
            .patch(json!({"metadata":{"labels":{REGION:"us-east-1", ZONE:"us-east-1a"}}})),
            case(
                "one key differs: only it is patched",
                with(|s| s.guest = View::Present(labels(&[(REGION, "us-east-1"), (ZONE, "us-east-1c")]))),
                Reason::Relayed,
                &format!("Node guest-1 carries {HOST_A_TOPOLOGY} from Harvester Node host-a"),
            )
            .patch(json!({"metadata":{"labels":{ZONE:"us-east-1a"}}})),
            case(
                "host lost its zone: the configured key is removed, other labels kept",
                with(|s| {
                    s.host = View::Present(labels(&[(REGION, "us-east-1")]));
                    s.guest = View::Present(labels(&[
                        (REGION, "us-east-1"),
                        (ZONE, "us-east-1a"),
                        ("example.com/rack", "7"),
                    ]));
                }),
                Reason::Relayed,
                "Node guest-1 carries topology.kubernetes.io/region=us-east-1, topology.kubernetes.io/zone unset from Harvester Node host-a",
            )
            .patch(json!({"metadata":{"labels":{ZONE: null}}})),
            case(
                "Harvester has no topology, the Node none either",
                with(|s| {
                    s.host = View::Present(labels(&[("kubernetes.io/hostname", "host-a")]));
                    s.guest = View::Present(labels(&[("example.com/rack", "7")]));
                }),
                Reason::Relayed,
                "Harvester Node host-a has no topology (topology.kubernetes.io/region, topology.kubernetes.io/zone unset); Node guest-1 carries none",
            ),
            case(
                "Harvester has no topology any more: both removed",
                with(|s| {
                    s.vmi = vmi_on(Some("host-a"), Labels::new());
                    s.host = View::Failed(forbidden("forbidden"));
                    s.host_forbidden = true;
                }),
                Reason::Relayed,
                "the annotations of VMI vms/vm-1 (on host-a) has no topology (topology.kubernetes.io/region, topology.kubernetes.io/zone unset); Node guest-1 carries none",
            )
            .patch(json!({"metadata":{"labels":{REGION: null, ZONE: null}}})),
            case(
                "invalid value: that key left alone, neither set nor removed",
                with(|s| {
                    s.host = View::Present(labels(&[(REGION, "us-east-1"), (ZONE, "zone a")]));
                    s.guest = View::Present(labels(&[(ZONE, "us-east-1a")]));
                }),
                Reason::Relayed,
                "Node guest-1 carries topology.kubernetes.io/region=us-east-1, topology.kubernetes.io/zone unset from Harvester Node host-a; not relayed (invalid label values): topology.kubernetes.io/zone=\"zone a\"",
            )
            .patch(json!({"metadata":{"labels":{REGION:"us-east-1"}}})),
            case(
                "only invalid values: no patch, and said so",
                with(|s| {
                    s.host = View::Present(labels(&[(REGION, "-"), (ZONE, "zone a")]));
                    s.guest = View::Present(Labels::new());
                }),
                Reason::Relayed,
                "Node guest-1 carries topology.kubernetes.io/region unset, topology.kubernetes.io/zone unset from Harvester Node host-a; not relayed (invalid label values): topology.kubernetes.io/region=\"-\", topology.kubernetes.io/zone=\"zone a\"",
            ),
            case(
                "invalid value while waiting for the guest cluster",
                with(|s| {
                    s.host = View::Present(labels(&[(REGION, "us-east-1"), (ZONE, "zone a")]));
                    s.guest_connected = false;
                }),
                Reason::WaitingForGuestCluster,
                "no guest-cluster connection yet; will relay topology.kubernetes.io/region=us-east-1, topology.kubernetes.io/zone unset from Harvester Node host-a; not relayed (invalid label values): topology.kubernetes.io/zone=\"zone a\"",
            ),
        ]
    }

    #[test]
    fn every_view_gives_its_reason_message_and_patch() {
        let keys = keys();
        for c in cases() {
            let (state, patch) = assess(scope(&keys), &c.seen);
            assert_eq!(
                (state.reason, state.message.as_str()),
                (c.reason, c.message.as_str()),
                "{}",
                c.name
            );
            assert_eq!(patch, c.patch, "{}", c.name);
            // Only a known, readable guest Node is ever patched.
            if patch.is_some() {
                assert_eq!(state.reason, Reason::Relayed, "{}", c.name);
            }
        }
    }

    #[test]
    fn the_table_covers_every_reason_assess_gives() {
        let keys = keys();
        let given: std::collections::HashSet<Reason> = cases()
            .iter()
            .map(|c| assess(scope(&keys), &c.seen).0.reason)
            .collect();
        for r in [
            Reason::Starting,
            Reason::NoCloudConfig,
            Reason::InvalidCloudConfig,
            Reason::Unreachable,
            Reason::Forbidden,
            Reason::VmiNotFound,
            Reason::WaitingForGuestCluster,
            Reason::NodeNotFound,
            Reason::Relayed,
        ] {
            assert!(given.contains(&r), "no case gives {r:?}");
        }
    }

    #[test]
    fn the_state_names_what_it_read() {
        let keys = keys();
        let (s, _) = assess(scope(&keys), &in_sync());
        assert_eq!(s.cloud_config, Some(PathBuf::from(CLOUD_CONFIG)));
        assert_eq!(s.vmi.as_deref(), Some("vms/vm-1"));
        assert_eq!(s.host.as_deref(), Some("host-a"));
        assert_eq!(s.source, Some(Source::HostNode));
        assert_eq!(
            s.labels,
            labels(&[(REGION, "us-east-1"), (ZONE, "us-east-1a")])
        );
        assert_eq!(s.keys, keys);

        let (s, _) = assess(scope(&keys), &with(|s| s.host = View::Absent));
        assert_eq!(s.source, Some(Source::VmiAnnotations));
        assert_eq!(
            s.labels,
            labels(&[(REGION, "us-west-2"), (ZONE, "us-west-2a")])
        );

        let (s, _) = assess(
            scope(&keys),
            &with(|s| s.cloud = Cloud::Invalid("/etc/cc".into(), "bad".into())),
        );
        assert_eq!(s.cloud_config, Some(PathBuf::from("/etc/cc")));
        assert_eq!((s.vmi, s.host, s.source), (None, None, None));

        // Before the VMI is read there is no host and no values.
        let (s, _) = assess(scope(&keys), &with(|s| s.vmi = View::Pending));
        assert_eq!(s.vmi.as_deref(), Some("vms/vm-1"));
        assert_eq!((s.host, s.source), (None, None));
        assert!(s.labels.is_empty());
    }

    #[test]
    fn unconfigured_keys_are_neither_relayed_nor_removed() {
        let keys = vec!["example.com/rack".to_string()];
        let seen = with(|s| {
            s.host = View::Present(labels(&[(REGION, "us-east-1"), ("example.com/rack", "7")]));
            s.guest = View::Present(labels(&[(ZONE, "mine"), ("example.com/rack", "1")]));
        });
        let (state, patch) = assess(scope(&keys), &seen);
        assert_eq!(state.reason, Reason::Relayed);
        assert_eq!(
            patch,
            Some(json!({"metadata":{"labels":{"example.com/rack":"7"}}}))
        );
        assert_eq!(state.labels, labels(&[("example.com/rack", "7")]));
    }

    #[test]
    fn a_live_migration_follows_the_new_host_and_holds_until_it_is_read() {
        let keys = keys();
        let mut seen = in_sync();
        let host_b = labels(&[(REGION, "us-east-1"), (ZONE, "us-east-1b")]);
        // Harvester has not updated the annotations yet.
        let change = seen.vmi_seen(vmi_on(Some("host-b"), stale_annotations()));
        assert_eq!(
            change,
            Some(HostChange {
                from: Some("host-a".into()),
                watch: Some("host-b".into()),
            })
        );
        assert_eq!(seen.host_name.as_deref(), Some("host-b"));
        let (state, patch) = assess(scope(&keys), &seen);
        assert_eq!(
            (state.reason, state.message.as_str(), patch),
            (Reason::Starting, "reading Harvester Node host-b", None)
        );
        assert_eq!(state.host.as_deref(), Some("host-b"));

        assert_eq!(
            seen.host_seen(View::Present(host_b.clone())),
            HostWatch::Continue
        );
        let (state, patch) = assess(scope(&keys), &seen);
        assert_eq!(state.reason, Reason::Relayed);
        assert_eq!(
            patch,
            Some(json!({"metadata":{"labels":{ZONE:"us-east-1b"}}}))
        );
        assert_eq!(
            state.message,
            "Node guest-1 carries topology.kubernetes.io/region=us-east-1, topology.kubernetes.io/zone=us-east-1b from Harvester Node host-b"
        );

        // 1_700_000_000 s after the epoch is 2023-11-14T22:13:20Z.
        let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        seen.patched(host_b, now);
        let (state, patch) = assess(scope(&keys), &seen);
        assert_eq!((state.reason, patch), (Reason::Relayed, None));
        assert_eq!(state.last_patch.as_deref(), Some("2023-11-14T22:13:20Z"));
    }

    #[test]
    fn the_same_host_again_changes_nothing() {
        let mut seen = in_sync();
        let mut annotations = stale_annotations();
        annotations.insert(ZONE.into(), "us-east-1a".into());
        assert_eq!(seen.vmi_seen(vmi_on(Some("host-a"), annotations)), None);
        assert_eq!(seen.host, View::Present(host_a()));
    }

    #[test]
    fn an_unreadable_vmi_keeps_the_host_followed() {
        let keys = keys();
        let mut seen = in_sync();
        assert_eq!(
            seen.vmi_seen(View::Failed(unreachable("connection refused"))),
            None
        );
        assert_eq!(seen.host_name.as_deref(), Some("host-a"));
        assert_eq!(seen.host, View::Present(host_a()));
        let (state, patch) = assess(scope(&keys), &seen);
        assert_eq!((state.reason, patch), (Reason::Unreachable, None));
        // Back: the host was never dropped, so nothing to re-read.
        assert_eq!(
            seen.vmi_seen(vmi_on(Some("host-a"), stale_annotations())),
            None
        );
        assert_eq!(assess(scope(&keys), &seen).0.reason, Reason::Relayed);
    }

    #[test]
    fn a_gone_vmi_drops_the_host_and_leaves_labels_alone() {
        let keys = keys();
        let mut seen = in_sync();
        let change = seen.vmi_seen(View::Absent);
        assert_eq!(
            change,
            Some(HostChange {
                from: Some("host-a".into()),
                watch: None,
            })
        );
        assert_eq!(
            (seen.host_name.as_deref(), &seen.host),
            (None, &View::Absent)
        );
        let (state, patch) = assess(scope(&keys), &seen);
        assert_eq!((state.reason, patch), (Reason::VmiNotFound, None));
        // It comes back on a host: that host is followed.
        let change = seen.vmi_seen(vmi_on(Some("host-c"), stale_annotations()));
        assert_eq!(
            change,
            Some(HostChange {
                from: None,
                watch: Some("host-c".into()),
            })
        );
        assert_eq!(seen.host, View::Pending);
    }

    #[test]
    fn without_a_harvester_client_no_host_is_watched() {
        let mut seen = Seen {
            cloud: Cloud::Missing(vec![CLOUD_CONFIG.into()]),
            ..Seen::default()
        };
        let change = seen.vmi_seen(vmi_on(Some("host-a"), stale_annotations()));
        assert_eq!(
            change,
            Some(HostChange {
                from: None,
                watch: None,
            })
        );
        assert_eq!(seen.host, View::Absent);
    }

    #[test]
    fn a_scheduled_vmi_is_followed_from_the_start() {
        let mut seen = Seen::default();
        seen.cloud_changed(ready());
        assert_eq!(
            seen.vmi_seen(vmi_on(Some("host-a"), stale_annotations())),
            Some(HostChange {
                from: None,
                watch: Some("host-a".into()),
            })
        );
        // Not scheduled yet: nothing to follow, the annotations are used.
        let mut seen = Seen::default();
        seen.cloud_changed(ready());
        assert_eq!(seen.vmi_seen(vmi_on(None, stale_annotations())), None);
        seen.guest_connection(true);
        seen.guest_seen(View::Present(Labels::new()));
        let keys = keys();
        let (state, patch) = assess(scope(&keys), &seen);
        assert_eq!(state.source, Some(Source::VmiAnnotations));
        assert_eq!(
            patch,
            Some(json!({"metadata":{"labels":{REGION:"us-west-2", ZONE:"us-west-2a"}}}))
        );
    }

    #[test]
    fn unreadable_host_nodes_stop_the_watch_until_readable_again() {
        let keys = keys();
        let mut seen = in_sync();
        assert_eq!(
            seen.host_seen(View::Failed(forbidden("nodes is forbidden"))),
            HostWatch::Stop
        );
        assert!(seen.host_forbidden);
        assert_eq!(
            assess(scope(&keys), &seen).0.source,
            Some(Source::VmiAnnotations)
        );
        // A migration still tries the new host; meanwhile the annotations.
        let change = seen.vmi_seen(vmi_on(Some("host-b"), stale_annotations()));
        assert_eq!(change.and_then(|c| c.watch).as_deref(), Some("host-b"));
        assert!(seen.host_forbidden);
        let (state, _) = assess(scope(&keys), &seen);
        assert_eq!(
            (state.reason, state.source),
            (Reason::Relayed, Some(Source::VmiAnnotations))
        );
        assert_eq!(seen.host_seen(View::Present(host_a())), HostWatch::Continue);
        assert!(!seen.host_forbidden);
        assert_eq!(assess(scope(&keys), &seen).0.source, Some(Source::HostNode));
        // Other failures and absence keep the watch.
        assert_eq!(
            seen.host_seen(View::Failed(unreachable("timed out"))),
            HostWatch::Continue
        );
        assert_eq!(seen.host_seen(View::Absent), HostWatch::Continue);
    }

    #[test]
    fn a_new_cloud_config_starts_over_on_the_harvester_side() {
        let keys = keys();
        let mut seen = with(|s| {
            s.host = View::Failed(forbidden("forbidden"));
            s.host_forbidden = true;
            s.last_patch = Some("2023-11-14T22:13:20Z".into());
        });
        seen.cloud_changed(ready());
        assert_eq!(
            (
                &seen.vmi,
                &seen.host,
                seen.host_name.as_deref(),
                seen.host_forbidden
            ),
            (&View::Pending, &View::Pending, None, false)
        );
        // The guest side is untouched.
        assert!(seen.guest_connected);
        assert!(matches!(seen.guest, View::Present(_)));
        let (state, patch) = assess(scope(&keys), &seen);
        assert_eq!(
            (state.reason, state.message.as_str(), patch),
            (
                Reason::Starting,
                "reading VirtualMachineInstance vms/vm-1 at https://harvester.example:6443",
                None
            )
        );
        assert_eq!(state.last_patch.as_deref(), Some("2023-11-14T22:13:20Z"));
        seen.cloud_changed(Cloud::Missing(vec![CLOUD_CONFIG.into()]));
        assert_eq!(assess(scope(&keys), &seen).0.reason, Reason::NoCloudConfig);
    }

    #[test]
    fn a_new_guest_connection_reads_the_node_again() {
        let keys = keys();
        let mut seen = in_sync();
        seen.guest_connection(false);
        assert_eq!(
            assess(scope(&keys), &seen).0.reason,
            Reason::WaitingForGuestCluster
        );
        seen.guest_connection(true);
        assert_eq!(seen.guest, View::Pending);
        let (state, patch) = assess(scope(&keys), &seen);
        assert_eq!(
            (state.reason, state.message.as_str(), patch),
            (Reason::Starting, "reading Node guest-1", None)
        );
    }

    #[test]
    fn a_failed_patch_is_reported_with_what_was_to_be_relayed() {
        let keys = keys();
        let seen = with(|s| s.guest = View::Present(Labels::new()));
        let (state, patch) = assess(scope(&keys), &seen);
        assert!(patch.is_some());
        for (error, reason, message) in [
            (
                PatchError::Failed(forbidden(
                    "nodes \"guest-1\" is forbidden: label not allowed",
                )),
                Reason::Forbidden,
                "guest cluster: patching the labels of Node guest-1 failed: nodes \"guest-1\" is forbidden: label not allowed",
            ),
            (
                PatchError::Failed(unreachable("connection reset")),
                Reason::Unreachable,
                "guest cluster: patching the labels of Node guest-1 failed: connection reset",
            ),
            (
                PatchError::TimedOut(Duration::from_secs(10)),
                Reason::Unreachable,
                "guest cluster: patching the labels of Node guest-1 did not finish within 10s",
            ),
        ] {
            let failed = patch_failed(state.clone(), NODE, &error);
            assert_eq!((failed.reason, failed.message.as_str()), (reason, message));
            assert_eq!(
                failed.labels,
                labels(&[(REGION, "us-east-1"), (ZONE, "us-east-1a")])
            );
            assert_eq!(failed.host.as_deref(), Some("host-a"));
        }
    }

    #[test]
    fn check_reports_a_node_needing_a_patch_as_out_of_sync() {
        let keys = keys();
        let behind = with(|s| s.guest = View::Present(labels(&[(ZONE, "us-east-1c")])));
        let state = assess_for_check(scope(&keys), &behind);
        assert_eq!(state.reason, Reason::OutOfSync);
        assert_eq!(
            state.message,
            format!("Node guest-1 does not carry Harvester's topology yet ({HOST_A_TOPOLOGY})")
        );
        assert_eq!(
            assess_for_check(scope(&keys), &in_sync()).reason,
            Reason::Relayed
        );
        // Anything short of a readable Node is reported as it is.
        for (seen, reason) in [
            (with(|s| s.guest = View::Absent), Reason::NodeNotFound),
            (
                with(|s| s.guest_connected = false),
                Reason::WaitingForGuestCluster,
            ),
            (with(|s| s.vmi = View::Absent), Reason::VmiNotFound),
        ] {
            assert_eq!(assess_for_check(scope(&keys), &seen).reason, reason);
        }
    }
}
