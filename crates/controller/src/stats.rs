//! What the controller reports: the `STATUS=` line and Prometheus metrics.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use hna_edges::metrics::exposition::{Labels, counter, counters, flag, gauge, gauges};

use crate::reconcile::{EventOut, EventType, Summary};

#[derive(Debug, Default, Clone)]
pub(crate) struct Stats {
    pub(crate) leader: bool,
    /// The Lease holder as last read (when following).
    pub(crate) holder: Option<String>,
    pub(crate) connected: bool,
    /// The watch caches hold a first complete list.
    pub(crate) synced: bool,
    pub(crate) summary: Summary,
    pub(crate) writes: BTreeMap<&'static str, u64>,
    pub(crate) write_errors: u64,
    /// Writes held back while their object waits out its backoff.
    pub(crate) writes_deferred: u64,
    /// Objects whose writes wait out a backoff now.
    pub(crate) objects_backing_off: u64,
    pub(crate) watch_errors: u64,
    /// Warning Events published, by reason.
    pub(crate) refusals: BTreeMap<&'static str, u64>,
    pub(crate) reconciles: u64,
    /// Wake-ups that found the inputs of the last settled pass unchanged.
    pub(crate) skipped: u64,
    pub(crate) last_error: Option<String>,
}

impl Stats {
    pub(crate) fn count_events<'a>(&mut self, published: impl IntoIterator<Item = &'a EventOut>) {
        for e in published {
            if e.type_ == EventType::Warning {
                *self.refusals.entry(e.reason).or_default() += 1;
            }
        }
    }

    /// The `STATUS=` line.
    pub(crate) fn status_line(&self) -> String {
        if !self.connected {
            return "controller: not connected to the cluster".into();
        }
        let role = if self.leader {
            "leader".to_string()
        } else {
            match &self.holder {
                Some(h) => format!("follower (leader: {h})"),
                None => "follower (no leader yet)".into(),
            }
        };
        if !self.synced {
            return format!("controller: {role}; loading Services, Nodes and LoadBalancerNodes");
        }
        let s = &self.summary;
        let mut line = format!(
            "controller: {role}; Services: {} served, {} pending, {} shared, {} releasing, {} refused; nodes eligible {}/{}",
            s.served, s.pending, s.shared, s.releasing, s.refused, s.nodes_eligible, s.nodes_total
        );
        if let Some(e) = &self.last_error {
            line.push_str(&format!("; last error: {e}"));
        }
        line
    }

    /// The controller's families (`hna_controller_*`), written at each
    /// scrape from the stats as they are.
    pub(crate) fn encode(&self, e: &mut DescriptorEncoder) -> fmt::Result {
        gauge(
            e,
            "hna_controller_leader",
            "1 while this replica holds the controller Lease.",
            None,
            flag(self.leader),
        )?;
        let s = &self.summary;
        gauges(
            e,
            "hna_controller_services",
            "Services this controller is responsible for, by state (each in one state).",
            None,
            [
                ("served", s.served),
                ("pending", s.pending),
                ("shared", s.shared),
                ("releasing", s.releasing),
                ("refused", s.refused),
            ]
            .map(|(k, v)| (vec![("state", k.to_string())] as Labels, v as i64)),
        )?;
        gauge(
            e,
            "hna_controller_nodes",
            "Nodes with a LoadBalancerNode.",
            None,
            s.nodes_total as i64,
        )?;
        gauge(
            e,
            "hna_controller_nodes_eligible",
            "Nodes that may hold addresses now (agent ready, heartbeat fresh, not fenced).",
            None,
            s.nodes_eligible as i64,
        )?;
        counters(
            e,
            "hna_controller_writes",
            "Successful writes by kind.",
            self.writes
                .iter()
                .map(|(k, v)| (vec![("kind", k.to_string())] as Labels, *v)),
        )?;
        counter(
            e,
            "hna_controller_write_errors",
            "Failed writes.",
            self.write_errors,
        )?;
        counter(
            e,
            "hna_controller_writes_deferred",
            "Writes held back because their object waits out a backoff after a failed write (each object backs off alone).",
            self.writes_deferred,
        )?;
        gauge(
            e,
            "hna_controller_objects_backing_off",
            "Objects whose writes wait out a backoff after a failed write.",
            None,
            self.objects_backing_off as i64,
        )?;
        counter(
            e,
            "hna_controller_watch_errors",
            "Watch errors (retried with backoff).",
            self.watch_errors,
        )?;
        counters(
            e,
            "hna_controller_refusals",
            "Warning Events published, by reason.",
            self.refusals
                .iter()
                .map(|(k, v)| (vec![("reason", k.to_string())] as Labels, *v)),
        )?;
        counter(
            e,
            "hna_controller_reconciles",
            "Reconcile passes.",
            self.reconciles,
        )?;
        counter(
            e,
            "hna_controller_reconciles_skipped",
            "Wake-ups (watch events, ticks) that skipped the pass: nothing it decides from had changed since a pass that left nothing to do.",
            self.skipped,
        )
    }
}

/// Where the reconcile loop reports: the stats, and the failover
/// histogram (observed by the leader).
#[derive(Debug, Clone)]
pub(crate) struct Reports {
    pub(crate) stats: Arc<Mutex<Stats>>,
    pub(crate) failover: Histogram,
}

/// The stats, read at each scrape.
#[derive(Debug)]
pub(crate) struct StatsCollector(pub Arc<Mutex<Stats>>);

impl Collector for StatsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let stats = self.0.lock().expect("stats lock").clone();
        stats.encode(&mut encoder)
    }
}

/// The controller's `/metrics`: its stats, the failover histogram, the API
/// latency and the `process_*` metrics.
pub(crate) fn registry(stats: Arc<Mutex<Stats>>, failover: Histogram) -> Registry {
    let mut r = Registry::default();
    r.register_collector(Box::new(StatsCollector(stats)));
    r.register_with_unit(
        "hna_controller_failover_duration",
        "How long Services were without a holder when theirs was lost: from the old holder's last heartbeat change (the controller's clock; the decision, when it was not heard at all) to the new holder reporting the address BOUND",
        Unit::Seconds,
        failover,
    );
    hna_edges::metrics::register_common(&mut r);
    r
}

/// Buckets for [`registry`]'s failover histogram: the detection (the
/// node's staleness bound, 10 s by default, or its LAN witnesses' word,
/// about 2 s) plus the takeover guard and DHCP.
pub(crate) fn failover_histogram() -> Histogram {
    Histogram::new([
        1.0, 2.0, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_and_metrics_say_what_is_known() {
        let mut s = Stats {
            connected: true,
            synced: true,
            leader: true,
            ..Default::default()
        };
        s.summary.served = 2;
        s.summary.nodes_eligible = 1;
        s.summary.nodes_total = 3;
        s.writes.insert("service_status", 4);
        assert_eq!(
            s.status_line(),
            "controller: leader; Services: 2 served, 0 pending, 0 shared, 0 releasing, 0 refused; nodes eligible 1/3"
        );
        let m = hna_edges::metrics::exposition::encode(&registry(
            Arc::new(Mutex::new(s.clone())),
            failover_histogram(),
        ));
        for line in [
            "hna_controller_leader 1\n",
            "hna_controller_services{state=\"served\"} 2\n",
            "hna_controller_nodes 3\n",
            "hna_controller_nodes_eligible 1\n",
            "hna_controller_writes_total{kind=\"service_status\"} 4\n",
            "# TYPE hna_controller_failover_duration_seconds histogram\n",
            "# TYPE process_cpu_seconds counter\n",
        ] {
            assert!(m.contains(line), "{line} in\n{m}");
        }
        s.leader = false;
        s.holder = Some("other".into());
        assert!(
            s.status_line()
                .starts_with("controller: follower (leader: other);")
        );
    }
}
