//! The daemon's `/metrics`: its live state ([`AgentStatus`]) read at each
//! scrape, the histograms its tasks observe into, the API latency and the
//! `process_*` metrics. Names and labels: docs/operations.md, "Metric
//! reference".

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use super::daemon_state::{AgentStatus, ClusterState};
use crate::loadbalancer::lease_metrics::{
    AcquisitionDurations, acquisition_durations, encode_leases,
};
use hna_edges::metrics::exposition::{Labels, counters, flag, gauge, gauges, info};

/// The histograms the daemon's tasks observe into.
#[derive(Debug, Clone)]
pub(crate) struct AgentMetrics {
    /// Handed to the DHCP engine ([`crate::loadbalancer::lease_metrics::observe_acquisitions`]).
    pub(crate) acquisitions: AcquisitionDurations,
    /// Observed by the LoadBalancer task: from a start's first turn behind
    /// the takeover guard to the guard letting it go.
    pub(crate) takeover_guard_wait: Histogram,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        AgentMetrics {
            acquisitions: acquisition_durations(),
            takeover_guard_wait: crate::loadbalancer::lease_metrics::takeover_guard_wait(),
        }
    }
}

impl AgentMetrics {
    /// Everything `/metrics` shows; `status` is called at each scrape.
    pub(crate) fn registry(&self, status: Arc<dyn Fn() -> AgentStatus + Send + Sync>) -> Registry {
        let mut r = Registry::default();
        r.register_collector(Box::new(StatusCollector(status)));
        crate::loadbalancer::lease_metrics::register_acquisitions(
            &mut r,
            self.acquisitions.clone(),
        );
        r.register_with_unit(
            "hna_lb_takeover_guard_wait",
            "How long starts of an address another node held waited behind the takeover guard: from the first turn to the guard letting it go",
            Unit::Seconds,
            self.takeover_guard_wait.clone(),
        );
        hna_edges::metrics::register_common(&mut r);
        r
    }
}

struct StatusCollector(Arc<dyn Fn() -> AgentStatus + Send + Sync>);

impl fmt::Debug for StatusCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StatusCollector")
    }
}

impl Collector for StatusCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        encode_status(&mut encoder, &(self.0)())
    }
}

/// The daemon's own health as gauges, the LoadBalancer task's, the LAN
/// membership's, then the DHCP lease families.
pub(crate) fn encode_status(e: &mut DescriptorEncoder, st: &AgentStatus) -> fmt::Result {
    info(
        e,
        "hna_build",
        "The agent's version and node.",
        &vec![
            ("version", st.version.clone()),
            ("node", st.node_name.clone()),
        ],
    )?;
    let ready = |ready: bool, reason: &str| [(vec![("reason", reason.to_string())], flag(ready))];
    gauges(
        e,
        "hna_macvlan_ready",
        "1 when macvlan interfaces can be created (the MacvlanReady condition); reason: its reason.",
        None,
        ready(st.macvlan.ready, st.macvlan.reason.as_str()),
    )?;
    gauges(
        e,
        "hna_guest_agent_ready",
        "1 when qemu-guest-agent is running with its port open (the GuestAgentReady condition); reason: its reason.",
        None,
        ready(st.guest_agent.ready, st.guest_agent.reason.as_str()),
    )?;
    gauge(
        e,
        "hna_cluster_connected",
        "1 while the guest cluster's API server answers.",
        None,
        flag(matches!(st.cluster, ClusterState::Connected { .. })),
    )?;
    let lb = &st.lb;
    gauge(
        e,
        "hna_lb_assignments",
        "LoadBalancer addresses assigned to this node (not being released).",
        None,
        i64::from(lb.wanted),
    )?;
    gauge(
        e,
        "hna_lb_addresses_held",
        "LoadBalancer addresses this node holds (its leases BOUND).",
        None,
        i64::from(lb.status.held),
    )?;
    gauge(
        e,
        "hna_lb_ready",
        "1 when this node can hold LoadBalancer addresses (macvlan ready, an uplink known).",
        None,
        flag(lb.status.ready),
    )?;
    gauge(
        e,
        "hna_lb_status_write_failing",
        "1 while writing this node's LoadBalancerNode status fails (the agent's log says why).",
        None,
        flag(lb.write_error.is_some()),
    )?;
    gauges(
        e,
        "hna_lb_lease_held",
        "1 while the Service's address is held on this node, 0 while it is being acquired; one series per Service assigned here.",
        None,
        lb.status.leases.iter().map(|l| {
            let held = matches!(l.state.as_str(), "BOUND" | "RENEWING" | "REBINDING");
            (vec![("service", l.service.clone())] as Labels, flag(held))
        }),
    )?;
    let lan = lb.status.lan.as_ref();
    gauge(
        e,
        "hna_lan_membership_running",
        "1 while the LAN membership runs (lb_membership_port, a key and an uplink address).",
        None,
        flag(lan.is_some()),
    )?;
    gauge(
        e,
        "hna_lan_peers_alive",
        "Peers on this node's LAN the membership counts alive.",
        None,
        i64::from(lan.map_or(0, |l| l.alive)),
    )?;
    gauge(
        e,
        "hna_lan_peers_reported_down",
        "Peers this node witnesses and found dead on the LAN (status.lan.down).",
        None,
        lan.map_or(0, |l| l.down.len()) as i64,
    )?;
    counters(
        e,
        "hna_lan_packets_dropped",
        "Membership packets dropped, by reason: received and refused before the protocol saw them (malformed, unknown_key, unauthenticated, replayed, not_a_member, future_epoch: a run epoch more than 10 minutes ahead of this node's clock; unmatched_answer: an answer to no recent probe of its, late, replayed or meant for another), or not sent (unsent: no room in the socket buffer, no route).",
        lb.membership_dropped
            .iter()
            .map(|(reason, n)| (vec![("reason", reason.clone())], *n)),
    )?;
    encode_leases(e, &st.dhcp.leases)
}
