//! The daemon's live state as reported by `status`, `STATUS=` and logs.
//! Plain data plus the one-line summary derived from it.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use crate::cluster::ClusterState;
use crate::dhcp::driver::LeaseStatus;
use crate::guest::GuestAgentState;
use crate::kmod::MacvlanState;
use crate::node_status::Reported;
use crate::topology::TopologyState;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateDirStatus {
    pub path: PathBuf,
    pub ok: bool,
    pub message: String,
}

/// The DHCP engine's part of the daemon.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DhcpStatus {
    /// `http://ADDR:PORT/metrics` when `metrics_listen` is set.
    pub metrics_url: Option<String>,
    /// Macvlans an earlier run left behind (crash), removed at start-up
    /// without releasing; their lease files are kept for INIT-REBOOT.
    pub removed_at_start: Vec<String>,
    /// Lease files or links that could not be looked at during that sweep.
    pub sweep_problems: Vec<String>,
    /// Every lease the engine holds, by name.
    pub leases: Vec<LeaseStatus>,
}

/// The LoadBalancer task's part of the daemon: the node's object as read,
/// and the status as last reported (see `agent::lb`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct LbStatus {
    /// `namespace/node` of this node's `LoadBalancerNode`.
    pub object: String,
    /// How reading the object goes (`watching`, or why not).
    pub read: String,
    /// Whether the start-up adoption is done.
    pub adopted: bool,
    /// Links an earlier run left that no assignment wanted, removed at
    /// start-up without releasing.
    pub removed_at_start: Vec<String>,
    /// Assignments to hold (not being released).
    pub wanted: u32,
    /// Why the last status write failed, while it does.
    pub write_error: Option<String>,
    /// What is reported (heartbeat aside): `held`, `addresses`, `leases`.
    pub status: crate::contract::node_object::Status,
    /// Why the LAN membership is not running, while it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub membership_not_running: Option<String>,
    /// Membership packets dropped since it started, by reason.
    #[serde(default)]
    pub membership_dropped: std::collections::BTreeMap<String, u64>,
}

impl LbStatus {
    /// `lb 2/2 held` for `STATUS=`.
    pub fn short(&self) -> String {
        let mut s = format!("lb {}/{} held", self.status.held, self.wanted);
        if !self.status.ready && !self.status.reason.is_empty() {
            s.push_str(&format!(" ({})", self.status.reason));
        }
        s
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentStatus {
    pub version: String,
    pub pid: u32,
    pub node_name: String,
    /// RFC 3339 UTC.
    pub started_at: String,
    pub uptime_seconds: u64,
    pub state_dir: StateDirStatus,
    pub cluster: ClusterState,
    pub macvlan: MacvlanState,
    pub guest_agent: GuestAgentState,
    /// Harvester topology labels relayed to this Node.
    pub topology: TopologyState,
    /// Whether this node's own conditions (`MacvlanReady`) are on its Node.
    pub node_conditions: Reported,
    /// DHCP leases of LoadBalancer addresses on this node.
    pub dhcp: DhcpStatus,
    /// The LoadBalancer addresses assigned to this node.
    #[serde(default)]
    pub lb: LbStatus,
    /// The line systemd shows as `Status:`.
    pub summary: String,
}

/// The daemon's Prometheus exposition: its own health as gauges, then the
/// DHCP lease families.
pub fn metrics(st: &AgentStatus) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, labels: String, value: f64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{labels} {value}"
        );
    };
    gauge(
        "hna_build_info",
        "The agent's version, always 1.",
        format!("{{version=\"{}\",node=\"{}\"}}", st.version, st.node_name),
        1.0,
    );
    gauge(
        "hna_uptime_seconds",
        "Seconds since the daemon started.",
        String::new(),
        st.uptime_seconds as f64,
    );
    gauge(
        "hna_macvlan_ready",
        "1 when macvlan interfaces can be created (the MacvlanReady condition).",
        format!("{{reason=\"{}\"}}", st.macvlan.reason.as_str()),
        f64::from(u8::from(st.macvlan.ready)),
    );
    gauge(
        "hna_guest_agent_ready",
        "1 when qemu-guest-agent is running with its port open (the GuestAgentReady condition).",
        format!("{{reason=\"{}\"}}", st.guest_agent.reason.as_str()),
        f64::from(u8::from(st.guest_agent.ready)),
    );
    gauge(
        "hna_cluster_connected",
        "1 while the guest cluster's API server answers.",
        String::new(),
        f64::from(u8::from(matches!(
            st.cluster,
            ClusterState::Connected { .. }
        ))),
    );
    gauge(
        "hna_dhcp_leases",
        "Leases the DHCP engine holds or is acquiring.",
        String::new(),
        st.dhcp.leases.len() as f64,
    );
    gauge(
        "hna_lb_assignments",
        "LoadBalancer addresses assigned to this node (not being released).",
        String::new(),
        f64::from(st.lb.wanted),
    );
    gauge(
        "hna_lb_ready",
        "1 when this node can hold LoadBalancer addresses (macvlan ready, an uplink known).",
        String::new(),
        f64::from(u8::from(st.lb.status.ready)),
    );
    gauge(
        "hna_lan_membership_running",
        "1 while the LAN membership runs (lb_membership_port, a key and an uplink address).",
        String::new(),
        f64::from(u8::from(st.lb.status.lan.is_some())),
    );
    gauge(
        "hna_lan_peers_alive",
        "Peers on this node's LAN the membership counts alive.",
        String::new(),
        f64::from(st.lb.status.lan.as_ref().map_or(0, |l| l.alive)),
    );
    gauge(
        "hna_lan_peers_reported_down",
        "Peers this node witnesses and found dead on the LAN (status.lan.down).",
        String::new(),
        st.lb.status.lan.as_ref().map_or(0, |l| l.down.len()) as f64,
    );
    let _ = writeln!(
        out,
        "# HELP hna_lan_packets_dropped_total Membership packets dropped, by reason: received and refused before the protocol saw them (malformed, unknown_key, unauthenticated, replayed, not_a_member), or not sent (unsent: no room in the socket buffer, no route).\n# TYPE hna_lan_packets_dropped_total counter"
    );
    for (reason, n) in &st.lb.membership_dropped {
        let _ = writeln!(
            out,
            "hna_lan_packets_dropped_total{{reason=\"{reason}\"}} {n}"
        );
    }
    let _ = writeln!(
        out,
        "# HELP hna_lb_lease_bound 1 while the Service's address is held on this node.\n# TYPE hna_lb_lease_bound gauge"
    );
    for l in &st.lb.status.leases {
        let held = matches!(l.state.as_str(), "BOUND" | "RENEWING" | "REBINDING");
        let _ = writeln!(
            out,
            "hna_lb_lease_bound{{service=\"{}\",interface=\"{}\",state=\"{}\",address=\"{}\"}} {}",
            l.service,
            l.interface,
            l.state,
            l.address.as_deref().unwrap_or_default(),
            u8::from(held)
        );
    }
    out.push_str(&crate::dhcp::engine::render_metrics(&st.dhcp.leases));
    out
}
