//! Keeps `STATUS=` and the log in step with the daemon's state.
//!
//! [`summary`] is the line `systemctl status` shows: one part per thing a
//! node needs (macvlan, qemu-guest-agent, LoadBalancer addresses, topology,
//! the cluster link), each as `<part> <Reason>` so the words match `status`
//! and `check`, and a closing hint naming `harvester-node-agent check` for
//! every part whose problem has a fix there.

use std::sync::Arc;

use tokio::sync::watch;

use super::daemon_state::{AgentStatus, ClusterState, LbStatus, StateDirStatus};
use crate::guest::GuestAgentState;
use crate::health::Status;
use crate::kmod::MacvlanState;
use crate::topology::TopologyState;
use hna_edges::systemd::Notifier;

/// The command every fixable problem in the line points to.
pub(crate) const CHECK_COMMAND: &str = "harvester-node-agent check";

/// Error texts (API server, state directory) are cut to this many
/// characters: `check` and `status` give them whole.
const DETAIL_MAX: usize = 40;

/// What the line is made of: a snapshot of the daemon's state.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Summary<'a> {
    pub(crate) node: &'a str,
    pub(crate) state_dir: &'a StateDirStatus,
    pub(crate) cluster: &'a ClusterState,
    pub(crate) macvlan: &'a MacvlanState,
    pub(crate) guest: &'a GuestAgentState,
    pub(crate) topology: &'a TopologyState,
    pub(crate) lb: &'a LbStatus,
}

/// One line for `systemctl status`, e.g.
/// `node guest-1: macvlan Loaded; qemu-ga Ready; lb 1/1 held; topology
/// us-east-1/us-east-1a; cluster connected (v1.30.4+rke2r1)`.
pub(crate) fn summary(s: &Summary) -> String {
    // The `check` names of the parts whose problem `check` explains and fixes.
    let mut fixable: Vec<&str> = Vec::new();

    let macvlan = s.macvlan.short();
    if !s.macvlan.ready && has_fix(&s.macvlan.remediation) {
        fixable.push("macvlan");
    }

    let guest = s.guest.short();
    if s.guest.status != Status::Ok && has_fix(&s.guest.remediation) {
        fixable.push("qemu-guest-agent");
    }

    let lb = lb_part(s.lb, s.macvlan);

    let topology = format!("topology {}", s.topology.short());
    if has_fix(&s.topology.check().remediation) {
        fixable.push("topology");
    }

    let (cluster, cluster_fixable) = cluster_part(s.cluster);
    if cluster_fixable {
        fixable.push("kubeconfig");
    }

    let mut line = format!(
        "node {}: {macvlan}; {guest}; {lb}; {topology}; {cluster}",
        s.node
    );
    if !s.state_dir.ok {
        line.push_str(&format!(
            "; state dir: {}",
            cut(&s.state_dir.message, DETAIL_MAX)
        ));
        fixable.push("state-dir");
    }
    if !fixable.is_empty() {
        line.push_str(&format!(" — run {CHECK_COMMAND} {}", fixable.join(" ")));
    }
    line
}

/// Whether a remediation asks something of the operator: the checks say
/// "nothing, if ..." where waiting is the answer.
fn has_fix(remediation: &str) -> bool {
    !remediation.is_empty() && !remediation.starts_with("nothing")
}

/// `lb HELD/WANTED held`, and why none can be held when that is so. Not
/// ready because of macvlan is said once, in the macvlan part.
fn lb_part(lb: &LbStatus, macvlan: &MacvlanState) -> String {
    let mut part = format!("lb {}/{} held", lb.status.held, lb.wanted);
    if !macvlan.ready {
        part.push_str(" (needs macvlan)");
    } else if !lb.status.ready && !lb.status.reason.is_empty() {
        part.push_str(&format!(" ({})", cut(&lb.status.reason, DETAIL_MAX)));
    }
    if lb.write_error.is_some() {
        part.push_str(" (status not written)");
    }
    part
}

/// The cluster link, and whether `check kubeconfig` has a fix for it. No
/// kubeconfig before the node joins is normal: no fix to point to.
fn cluster_part(cluster: &ClusterState) -> (String, bool) {
    match cluster {
        ClusterState::WaitingForCredentials {
            configured: true,
            searched,
        } => (
            format!(
                "waiting for kubeconfig {}",
                searched
                    .first()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default()
            ),
            true,
        ),
        ClusterState::WaitingForCredentials { searched, .. } => (
            format!(
                "waiting for kubeconfig (node not joined? searched {} paths)",
                searched.len()
            ),
            false,
        ),
        ClusterState::Connecting { .. } => ("connecting to the cluster".into(), false),
        // The server is in `status`; the version says which cluster answered.
        ClusterState::Connected { server_version, .. } => {
            (format!("cluster connected ({server_version})"), false)
        }
        ClusterState::Unreachable { error, .. } => (
            format!("cluster unreachable: {}", cut(error, DETAIL_MAX)),
            true,
        ),
    }
}

/// `text` up to `max` characters, `…` marking a cut.
fn cut(text: &str, max: usize) -> String {
    let first_line = text.lines().next().unwrap_or_default();
    if first_line.chars().count() <= max && first_line.len() == text.len() {
        return text.to_string();
    }
    let mut out: String = first_line.chars().take(max).collect();
    out.push('…');
    out
}

/// What the publisher listens to: any change re-renders the summary.
pub(crate) struct Sources {
    pub(crate) cluster: watch::Receiver<ClusterState>,
    pub(crate) macvlan: watch::Receiver<MacvlanState>,
    pub(crate) guest: watch::Receiver<GuestAgentState>,
    pub(crate) topology: watch::Receiver<TopologyState>,
    pub(crate) lb: watch::Receiver<LbStatus>,
}

pub(crate) async fn status_line(
    notifier: Arc<dyn Notifier>,
    mut sources: Sources,
    snapshot: impl Fn() -> AgentStatus,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut last = String::new();
    loop {
        let summary = snapshot().summary;
        if summary != last {
            notifier.status(&summary);
            match &*sources.cluster.borrow() {
                ClusterState::Unreachable { error, .. } => tracing::warn!(%error, "{summary}"),
                _ => tracing::info!("{summary}"),
            }
            last = summary;
        }
        tokio::select! {
            changed = sources.cluster.changed() => if changed.is_err() { return },
            changed = sources.macvlan.changed() => if changed.is_err() { return },
            changed = sources.guest.changed() => if changed.is_err() { return },
            changed = sources.topology.changed() => if changed.is_err() { return },
            changed = sources.lb.changed() => if changed.is_err() { return },
            _ = shutdown.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hna_contract::node_object::Status as LbObjectStatus;

    /// `systemctl status` prints `Status: "…"` after 5 columns of indent and
    /// its pager chops long lines at the terminal's width: a healthy node
    /// fits 140 characters, one failing part 210, and the worst case (every
    /// part failing, a 63-character node name, long errors) stays one line
    /// of at most 400.
    const HEALTHY_MAX: usize = 140;
    const ONE_FAILURE_MAX: usize = 210;
    const WORST_MAX: usize = 400;

    fn macvlan(reason: crate::kmod::Reason, remediation: &str) -> MacvlanState {
        let ready = matches!(
            reason,
            crate::kmod::Reason::BuiltIn
                | crate::kmod::Reason::Loaded
                | crate::kmod::Reason::LoadedByAgent
        );
        MacvlanState {
            status: if ready { Status::Ok } else { Status::Fail },
            reason,
            message: String::new(),
            remediation: remediation.into(),
            ready,
            kernel: "6.1".into(),
            loaded_at_boot: None,
        }
    }

    fn guest(reason: crate::guest::Reason, status: Status, remediation: &str) -> GuestAgentState {
        GuestAgentState {
            status,
            reason,
            message: String::new(),
            remediation: remediation.into(),
            ready: reason == crate::guest::Reason::Ready,
        }
    }

    fn topology_relayed() -> TopologyState {
        let keys = vec![
            "topology.kubernetes.io/region".to_string(),
            "topology.kubernetes.io/zone".to_string(),
        ];
        let mut t = TopologyState::new(crate::topology::Reason::Relayed, "ok", &keys);
        t.labels.insert(keys[0].clone(), "us-east-1".into());
        t.labels.insert(keys[1].clone(), "us-east-1a".into());
        t
    }

    fn lb(held: u32, wanted: u32, ready: bool, reason: &str) -> LbStatus {
        LbStatus {
            wanted,
            status: LbObjectStatus {
                held,
                ready,
                reason: reason.into(),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn dir(ok: bool) -> StateDirStatus {
        StateDirStatus {
            path: "/var/lib/harvester-node-agent".into(),
            ok,
            message: if ok {
                "writable".into()
            } else {
                "/var/lib/harvester-node-agent is not writable: Read-only file system (os error 30)"
                    .into()
            },
        }
    }

    fn connected() -> ClusterState {
        ClusterState::Connected {
            kubeconfig: None,
            server: "https://127.0.0.1:6443".into(),
            server_version: "v1.30.4+rke2r1".into(),
        }
    }

    /// The line for node `rke2-pool1-7f9c4-x2k8p` from its parts.
    fn pool_node_line(
        (d, m, g, t, l, c): (
            StateDirStatus,
            MacvlanState,
            GuestAgentState,
            TopologyState,
            LbStatus,
            ClusterState,
        ),
    ) -> String {
        summary(&Summary {
            node: "rke2-pool1-7f9c4-x2k8p",
            state_dir: &d,
            cluster: &c,
            macvlan: &m,
            guest: &g,
            topology: &t,
            lb: &l,
        })
    }

    #[test]
    fn a_healthy_node_is_five_parts_and_no_hint() {
        let line = pool_node_line((
            dir(true),
            macvlan(crate::kmod::Reason::Loaded, ""),
            guest(crate::guest::Reason::Ready, Status::Ok, ""),
            topology_relayed(),
            lb(2, 2, true, "Ready"),
            connected(),
        ));
        assert_eq!(
            line,
            "node rke2-pool1-7f9c4-x2k8p: macvlan Loaded; qemu-ga Ready; lb 2/2 held; \
             topology us-east-1/us-east-1a; cluster connected (v1.30.4+rke2r1)"
        );
        assert!(!line.contains('\n'));
        assert!(
            line.chars().count() <= HEALTHY_MAX,
            "{} > {HEALTHY_MAX}: {line}",
            line.chars().count()
        );
    }

    #[test]
    fn one_missing_module_fits_and_points_to_check() {
        let line = pool_node_line((
            dir(true),
            macvlan(
                crate::kmod::Reason::ModuleNotFound,
                "install kernel-default",
            ),
            guest(crate::guest::Reason::Ready, Status::Ok, ""),
            topology_relayed(),
            lb(0, 2, false, "macvlan not ready: macvlan ModuleNotFound"),
            connected(),
        ));
        assert_eq!(
            line,
            "node rke2-pool1-7f9c4-x2k8p: macvlan ModuleNotFound; qemu-ga Ready; \
             lb 0/2 held (needs macvlan); topology us-east-1/us-east-1a; \
             cluster connected (v1.30.4+rke2r1) — run harvester-node-agent check macvlan"
        );
        assert!(
            line.chars().count() <= ONE_FAILURE_MAX,
            "{} > {ONE_FAILURE_MAX}: {line}",
            line.chars().count()
        );
    }

    #[test]
    fn every_fixable_failure_names_check_and_which_part() {
        let (d, m, g, l, c) = (
            dir(true),
            macvlan(
                crate::kmod::Reason::ModuleNotFound,
                "install kernel-default",
            ),
            guest(
                crate::guest::Reason::NotRunning,
                Status::Fail,
                "systemctl start qemu-guest-agent",
            ),
            lb(0, 1, false, "macvlan not ready: macvlan ModuleNotFound"),
            connected(),
        );
        let t = TopologyState::new(crate::topology::Reason::NoCloudConfig, "none", &[]);
        let line = summary(&Summary {
            node: "g",
            state_dir: &d,
            cluster: &c,
            macvlan: &m,
            guest: &g,
            topology: &t,
            lb: &l,
        });
        assert_eq!(
            line,
            "node g: macvlan ModuleNotFound; qemu-ga NotRunning; lb 0/1 held (needs macvlan); \
             topology NoCloudConfig; cluster connected (v1.30.4+rke2r1) \
             — run harvester-node-agent check macvlan qemu-guest-agent topology"
        );
    }

    #[test]
    fn waiting_is_not_a_failure_but_a_broken_link_is() {
        let (d, m, g, t, l) = (
            dir(true),
            macvlan(crate::kmod::Reason::BuiltIn, ""),
            guest(
                crate::guest::Reason::HostDisconnected,
                Status::Warn,
                "nothing on the guest; the hypervisor end is not attached",
            ),
            TopologyState::new(crate::topology::Reason::WaitingForGuestCluster, "m", &[]),
            lb(0, 0, true, "Ready"),
        );
        let joining = ClusterState::WaitingForCredentials {
            searched: vec!["/a".into(), "/b".into(), "/c".into()],
            configured: false,
        };
        let s = Summary {
            node: "g",
            state_dir: &d,
            cluster: &joining,
            macvlan: &m,
            guest: &g,
            topology: &t,
            lb: &l,
        };
        let line = summary(&s);
        assert!(
            line.ends_with("waiting for kubeconfig (node not joined? searched 3 paths)"),
            "{line}"
        );
        assert!(!line.contains(CHECK_COMMAND), "{line}");

        let unreachable = ClusterState::Unreachable {
            kubeconfig: None,
            error: "error trying to connect: tcp connect error: Connection refused (os error 111)\nmore"
                .into(),
        };
        let line = summary(&Summary {
            cluster: &unreachable,
            ..s
        });
        assert!(
            line.contains("cluster unreachable: error trying to connect: tcp connect err…"),
            "{line}"
        );
        assert!(
            line.ends_with("— run harvester-node-agent check kubeconfig"),
            "{line}"
        );

        let missing = ClusterState::WaitingForCredentials {
            searched: vec!["/etc/hna/kubeconfig".into()],
            configured: true,
        };
        let line = summary(&Summary {
            cluster: &missing,
            ..s
        });
        assert!(
            line.ends_with(
                "waiting for kubeconfig /etc/hna/kubeconfig — run harvester-node-agent check kubeconfig"
            ),
            "{line}"
        );
    }

    #[test]
    fn lb_says_why_it_holds_nothing() {
        let (d, m, g, t, c) = (
            dir(true),
            macvlan(crate::kmod::Reason::Loaded, ""),
            guest(crate::guest::Reason::Ready, Status::Ok, ""),
            topology_relayed(),
            connected(),
        );
        let mut l = lb(0, 1, false, "no default uplink: no IPv4 default route");
        l.write_error = Some("forbidden".into());
        let line = summary(&Summary {
            node: "g",
            state_dir: &d,
            cluster: &c,
            macvlan: &m,
            guest: &g,
            topology: &t,
            lb: &l,
        });
        assert!(
            line.contains(
                "; lb 0/1 held (no default uplink: no IPv4 default route) (status not written);"
            ),
            "{line}"
        );
    }

    #[test]
    fn the_worst_case_is_still_one_bounded_line() {
        let long_error = "x".repeat(500);
        let (m, g, l) = (
            macvlan(crate::kmod::Reason::LoadFailed, "see the journal"),
            guest(
                crate::guest::Reason::PortNotOpen,
                Status::Fail,
                "restart the agent",
            ),
            lb(0, 40, false, &long_error),
        );
        let t = TopologyState::new(crate::topology::Reason::Forbidden, "m", &[]);
        let d = StateDirStatus {
            path: "/x".into(),
            ok: false,
            message: long_error.clone(),
        };
        let c = ClusterState::Unreachable {
            kubeconfig: None,
            error: long_error.clone(),
        };
        let node = "n".repeat(63);
        let line = summary(&Summary {
            node: &node,
            state_dir: &d,
            cluster: &c,
            macvlan: &m,
            guest: &g,
            topology: &t,
            lb: &l,
        });
        assert!(!line.contains('\n'));
        assert!(
            line.chars().count() <= WORST_MAX,
            "{} > {WORST_MAX}: {line}",
            line.chars().count()
        );
        assert!(
            line.ends_with(
                "— run harvester-node-agent check macvlan qemu-guest-agent topology kubeconfig state-dir"
            ),
            "{line}"
        );
    }
}
