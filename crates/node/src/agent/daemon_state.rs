//! The daemon's live state as reported by `status`, `STATUS=` and logs.
//! Plain data plus the one-line summary derived from it.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::guest::GuestAgentState;
use crate::kmod::MacvlanState;
use crate::node_conditions::Reported;
use crate::topology::TopologyState;
use hna_dhcp::driver::LeaseStatus;
pub use hna_edges::cluster::ClusterState;

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
/// and the status as last reported (see `crate::loadbalancer::task`).
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
    pub status: hna_contract::node_object::Status,
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
