//! The DHCP engine's lease families, for the daemon and `dhcp-hold`. One
//! series per lease (its interface, `lease`) and, for the state, one per
//! state the lease can be in: no address or MAC in a label, so a lease
//! that moves between addresses keeps its series.

use std::fmt;

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Unit;

use hna_dhcp::driver::LeaseStatus;
use hna_dhcp::{AcquiredHook, Acquisition, State};
use hna_edges::metrics::exposition::{Labels, counters, flag, gauge, gauges};

fn lease(l: &LeaseStatus) -> Labels {
    vec![("lease", l.name.clone())]
}

/// How long acquisitions take (seconds), by how: `begin="discover"` or
/// `"reboot"` (INIT-REBOOT).
pub(crate) type AcquisitionDurations = Family<Labels, Histogram, fn() -> Histogram>;

/// How long takeovers waited on the guard (`hna_lb_takeover_guard_wait`).
pub(crate) fn takeover_guard_wait() -> Histogram {
    // The guard listens 1 s by default; a holder that still answers keeps
    // it waiting, retried up to every 10 s.
    Histogram::new([
        0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
    ])
}

pub fn acquisition_durations() -> AcquisitionDurations {
    // An answer on a quiet LAN is a few milliseconds; retransmissions
    // (4, 8, 16 s) and the ARP check put the rest far out.
    fn buckets() -> Histogram {
        Histogram::new([
            0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0,
        ])
    }
    Family::new_with_constructor(buckets as fn() -> Histogram)
}

/// The engine's hook observing into `family`.
pub fn observe_acquisitions(family: AcquisitionDurations) -> AcquiredHook {
    std::sync::Arc::new(move |how: Acquisition, took| {
        family
            .get_or_create(&vec![("begin", how.as_str().to_string())])
            .observe(took.as_secs_f64());
    })
}

/// The lease table, read at each scrape.
pub(crate) struct LeaseTable(pub std::sync::Arc<dyn Fn() -> Vec<LeaseStatus> + Send + Sync>);

impl fmt::Debug for LeaseTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeaseTable")
    }
}

impl prometheus_client::collector::Collector for LeaseTable {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        encode_leases(&mut encoder, &(self.0)())
    }
}

/// `dhcp-hold`'s `/metrics`: its leases, their acquisitions and the
/// process.
pub fn registry(
    leases: std::sync::Arc<dyn Fn() -> Vec<LeaseStatus> + Send + Sync>,
    acquisitions: AcquisitionDurations,
) -> prometheus_client::registry::Registry {
    let mut r = prometheus_client::registry::Registry::default();
    r.register_collector(Box::new(LeaseTable(leases)));
    register_acquisitions(&mut r, acquisitions);
    hna_edges::metrics::register_common(&mut r);
    r
}

/// `hna_dhcp_acquisition_duration_seconds`, in the daemon's registry and
/// `dhcp-hold`'s.
pub(crate) fn register_acquisitions(
    registry: &mut prometheus_client::registry::Registry,
    acquisitions: AcquisitionDurations,
) {
    registry.register_with_unit(
        "hna_dhcp_acquisition_duration",
        "How long a lease took to come to hold an address: from its start, or from losing its address, to BOUND; by how it began (begin: discover, reboot)",
        Unit::Seconds,
        acquisitions,
    );
}

/// The lease table's families.
pub(crate) fn encode_leases(
    encoder: &mut DescriptorEncoder,
    leases: &[LeaseStatus],
) -> fmt::Result {
    gauge(
        encoder,
        "hna_dhcp_leases",
        "Leases the DHCP engine holds or is acquiring.",
        None,
        leases.len() as i64,
    )?;
    gauges(
        encoder,
        "hna_dhcp_lease_bound",
        "1 while the lease holds its address (BOUND, RENEWING, REBINDING).",
        None,
        leases
            .iter()
            .map(|l| (lease(l), flag(l.state.holds_address()))),
    )?;
    gauges(
        encoder,
        "hna_dhcp_lease_state",
        "1 for the state the lease is in, 0 for the others.",
        None,
        leases.iter().flat_map(|l| {
            State::ALL.into_iter().map(move |s| {
                (
                    vec![("lease", l.name.clone()), ("state", s.as_str().to_string())],
                    flag(s == l.state),
                )
            })
        }),
    )?;
    let at = |ms: Option<u64>| ms.map(|ms| ms as f64 / 1000.0);
    for (name, help, when) in [
        (
            "hna_dhcp_lease_expiry_timestamp",
            "When the held address's lease expires (Unix time); absent while none is held.",
            (|l: &LeaseStatus| l.expires_at_unix_ms) as fn(&LeaseStatus) -> Option<u64>,
        ),
        (
            "hna_dhcp_lease_t1_timestamp",
            "When renewal of the held address starts (Unix time).",
            |l: &LeaseStatus| l.t1_at_unix_ms,
        ),
        (
            "hna_dhcp_lease_t2_timestamp",
            "When rebinding of the held address starts (Unix time).",
            |l: &LeaseStatus| l.t2_at_unix_ms,
        ),
    ] {
        gauges(
            encoder,
            name,
            help,
            Some(Unit::Seconds),
            leases
                .iter()
                .filter(|l| l.state.holds_address())
                .filter_map(|l| Some((lease(l), at(when(l))?))),
        )?;
    }
    for (name, help, count) in [
        (
            "hna_dhcp_packets_sent",
            "DHCP messages sent.",
            (|l: &LeaseStatus| l.counters.sent) as fn(&LeaseStatus) -> u64,
        ),
        (
            "hna_dhcp_packets_received",
            "DHCP frames received on the lease's interface.",
            |l: &LeaseStatus| l.counters.received,
        ),
        (
            "hna_dhcp_packets_dropped",
            "Received frames not acted on (malformed, or not fitting xid, chaddr, type or state).",
            |l: &LeaseStatus| l.counters.dropped,
        ),
        (
            "hna_dhcp_packets_malformed",
            "Received frames that did not parse.",
            |l: &LeaseStatus| l.counters.malformed,
        ),
        ("hna_dhcp_naks", "DHCPNAKs honoured.", |l: &LeaseStatus| {
            l.counters.naks
        }),
        (
            "hna_dhcp_declines",
            "DHCPDECLINEs sent after an ARP conflict.",
            |l: &LeaseStatus| l.counters.declines,
        ),
    ] {
        counters(
            encoder,
            name,
            help,
            leases.iter().map(|l| (lease(l), count(l))),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    #[test]
    fn one_series_per_lease_and_no_address_in_a_label() {
        let mut a = LeaseStatus::new("hlb-00000001", [0, 0, 0x6c, 0, 0, 1]);
        a.state = State::Bound;
        a.address = Some("10.77.0.150".parse().unwrap());
        a.expires_at_unix_ms = Some(1_700_000_000_000);
        a.counters.sent = 3;
        let mut b = LeaseStatus::new("hlb-00000002\"\\", [0, 0, 0x6c, 0, 0, 2]);
        b.expires_at_unix_ms = Some(1_700_000_000_000);
        let mut registry = Registry::default();
        let table = vec![a, b];
        registry.register_collector(Box::new(LeaseTable(std::sync::Arc::new(move || {
            table.clone()
        }))));
        let text = hna_edges::metrics::exposition::encode(&registry);
        for line in [
            "hna_dhcp_leases 2\n",
            "hna_dhcp_lease_bound{lease=\"hlb-00000001\"} 1\n",
            // Label values are escaped.
            "hna_dhcp_lease_bound{lease=\"hlb-00000002\\\"\\\\\"} 0\n",
            "hna_dhcp_lease_expiry_timestamp_seconds{lease=\"hlb-00000001\"} 1700000000.0\n",
            "hna_dhcp_packets_sent_total{lease=\"hlb-00000001\"} 3\n",
            "hna_dhcp_lease_state{lease=\"hlb-00000001\",state=\"BOUND\"} 1\n",
            "hna_dhcp_lease_state{lease=\"hlb-00000001\",state=\"SELECTING\"} 0\n",
            "# EOF\n",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
        // A lease holding nothing has no expiry, whatever it remembers.
        assert!(!text.contains("hna_dhcp_lease_expiry_timestamp_seconds{lease=\"hlb-00000002"));
        assert!(!text.contains("10.77.0.150") && !text.contains("00:00:6c"));
        assert_eq!(
            text.matches("hna_dhcp_lease_state{").count(),
            2 * State::ALL.len()
        );
    }

    #[test]
    fn the_hook_counts_acquisitions_by_how() {
        let family = acquisition_durations();
        let hook = observe_acquisitions(family.clone());
        hook(Acquisition::Rebooted, std::time::Duration::from_millis(20));
        hook(Acquisition::Rebooted, std::time::Duration::from_millis(30));
        let reboot = family.get_or_create(&vec![("begin", "reboot".to_string())]);
        assert_eq!(reboot.count(), 2);
        assert!((reboot.sum() - 0.05).abs() < 1e-9);
    }
}
