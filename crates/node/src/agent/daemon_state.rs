//! The daemon's live state as reported by `status`, `STATUS=` and logs.
//! Plain data plus the one-line summary derived from it.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::guest::GuestAgentState;
use crate::kmod::MacvlanState;
pub use crate::loadbalancer::LbStatus;
use crate::node_conditions::Reported;
use crate::topology::TopologyState;
use hna_dhcp::driver::LeaseStatus;
pub use hna_edges::cluster::ClusterState;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateDirStatus {
    pub path: PathBuf,
    pub(crate) ok: bool,
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentStatus {
    pub version: String,
    pub pid: u32,
    pub node_name: String,
    /// RFC 3339 UTC.
    pub(crate) started_at: String,
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
