//! The node's LoadBalancer work, all of it: the addresses the controller
//! assigned to this node in its `LoadBalancerNode` object, held through the
//! DHCP engine ([`hna_dhcp::LeaseEngine`]), and the status it reports.
//! `agent` only calls `spawn`.
//!
//! - `lease_plan`: the pure decision: assignments and running leases in,
//!   starts and stops out;
//! - `apply`: carries a plan out on the engine;
//! - [`task`]: the task that watches the node object, plans, applies and
//!   adopts leases at start-up;
//! - [`status_writes`] and `delivery`: the status write in a task of its
//!   own, delivered through a flaky API server in time;
//! - `fence`: when the node lets go of every address on its own (pure);
//! - [`lease_metrics`]: the lease families and the acquisition histogram;
//! - `spawn`: the task's set-up (membership, pause watch, uplink view).

pub(crate) mod apply;
pub(crate) mod delivery;
mod fence;
mod holder;
mod kept;
mod lan_word;
pub mod lease_metrics;
pub(crate) mod lease_plan;
pub(crate) mod spawn;
pub mod status_writes;
pub mod task;

use serde::{Deserialize, Serialize};

/// The LoadBalancer task's part of the daemon: the node's object as read,
/// and the status as last reported (see [`task`]).
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

#[cfg(test)]
mod tests {
    /// The DHCP engine's lease records (read by `status` and the status
    /// reports) and the contract's annotations write a MAC the same way.
    #[test]
    fn lease_records_and_the_contract_write_a_mac_alike() {
        for mac in [
            [0x00, 0x00, 0x6c, 0xab, 0xcd, 0xef],
            [0x02, 0xff, 0, 1, 0x10, 0xa0],
        ] {
            let record = hna_dhcp::driver::LeaseStatus::new("hlb-x", mac);
            assert_eq!(record.mac, hna_contract::mac::format(&mac));
            assert_eq!(hna_contract::mac::parse(&record.mac), Some(mac));
        }
    }
}
