//! What the controller reports: the `STATUS=` line and Prometheus metrics.

use std::collections::BTreeMap;

use crate::controller::reconcile::{EventOut, EventType, Summary};

#[derive(Debug, Default, Clone)]
pub struct Stats {
    pub leader: bool,
    pub identity: String,
    /// The Lease holder as last read (when following).
    pub holder: Option<String>,
    pub connected: bool,
    /// The watch caches hold a first complete list.
    pub synced: bool,
    pub summary: Summary,
    pub writes: BTreeMap<&'static str, u64>,
    pub write_errors: u64,
    /// Writes held back while their object waits out its backoff.
    pub writes_deferred: u64,
    /// Objects whose writes wait out a backoff now.
    pub objects_backing_off: u64,
    pub watch_errors: u64,
    /// Warning Events published, by reason.
    pub refusals: BTreeMap<&'static str, u64>,
    pub reconciles: u64,
    /// Wake-ups that found the inputs of the last settled pass unchanged.
    pub skipped: u64,
    pub last_error: Option<String>,
}

impl Stats {
    pub fn count_events<'a>(&mut self, published: impl IntoIterator<Item = &'a EventOut>) {
        for e in published {
            if e.type_ == EventType::Warning {
                *self.refusals.entry(e.reason).or_default() += 1;
            }
        }
    }

    /// The `STATUS=` line.
    pub fn status_line(&self) -> String {
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

    /// The Prometheus text exposition.
    pub fn metrics(&self) -> String {
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, kind: &str, samples: Vec<(String, u64)>| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for (labels, v) in samples {
                out.push_str(&format!("{name}{labels} {v}\n"));
            }
        };
        gauge(
            "hna_controller_leader",
            "1 while this replica holds the controller Lease.",
            "gauge",
            vec![(String::new(), u64::from(self.leader))],
        );
        let s = &self.summary;
        gauge(
            "hna_controller_services",
            "Services by state.",
            "gauge",
            [
                ("served", s.served),
                ("pending", s.pending),
                ("shared", s.shared),
                ("releasing", s.releasing),
                ("refused", s.refused),
            ]
            .into_iter()
            .map(|(k, v)| (format!("{{state=\"{k}\"}}"), v as u64))
            .collect(),
        );
        gauge(
            "hna_controller_nodes",
            "LoadBalancer nodes, all and eligible to hold addresses.",
            "gauge",
            vec![
                ("{state=\"eligible\"}".into(), s.nodes_eligible as u64),
                ("{state=\"total\"}".into(), s.nodes_total as u64),
            ],
        );
        gauge(
            "hna_controller_writes_total",
            "Successful writes by kind.",
            "counter",
            self.writes
                .iter()
                .map(|(k, v)| (format!("{{kind=\"{k}\"}}"), *v))
                .collect(),
        );
        gauge(
            "hna_controller_write_errors_total",
            "Failed writes.",
            "counter",
            vec![(String::new(), self.write_errors)],
        );
        gauge(
            "hna_controller_writes_deferred_total",
            "Writes held back because their object waits out a backoff after a failed write (each object backs off alone).",
            "counter",
            vec![(String::new(), self.writes_deferred)],
        );
        gauge(
            "hna_controller_objects_backing_off",
            "Objects whose writes wait out a backoff after a failed write.",
            "gauge",
            vec![(String::new(), self.objects_backing_off)],
        );
        gauge(
            "hna_controller_watch_errors_total",
            "Watch errors (retried with backoff).",
            "counter",
            vec![(String::new(), self.watch_errors)],
        );
        gauge(
            "hna_controller_refusals_total",
            "Warning Events published, by reason.",
            "counter",
            self.refusals
                .iter()
                .map(|(k, v)| (format!("{{reason=\"{k}\"}}"), *v))
                .collect(),
        );
        gauge(
            "hna_controller_reconciles_total",
            "Reconcile passes.",
            "counter",
            vec![(String::new(), self.reconciles)],
        );
        gauge(
            "hna_controller_reconciles_skipped_total",
            "Wake-ups (watch events, ticks) that skipped the pass: nothing it decides from had changed since a pass that left nothing to do.",
            "counter",
            vec![(String::new(), self.skipped)],
        );
        out
    }
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
        let m = s.metrics();
        for line in [
            "hna_controller_leader 1\n",
            "hna_controller_services{state=\"served\"} 2\n",
            "hna_controller_nodes{state=\"eligible\"} 1\n",
            "hna_controller_writes_total{kind=\"service_status\"} 4\n",
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
