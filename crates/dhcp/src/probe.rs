//! `dhcp-probe`: an operator's preflight for a VM network before any
//! Service exists. Creates a temporary macvlan, runs the exchange with the
//! real engine, reports what the server offered and how long each step
//! took, releases (unless told not to) and removes the macvlan, also on
//! Ctrl-C or SIGTERM.

use std::net::Ipv4Addr;
use std::time::Duration;

use serde::Serialize;

use super::driver::LeaseStatus;
use super::engine::{Engine, EngineError, LeaseConfig};
use super::io::ProbeConfig;
use super::link::{default_route_interface, random_vip_mac};
use super::machine::{Counters, State, StopMode, Timing};
use super::packet::Identity;

#[derive(Debug, Clone)]
pub struct ProbeOptions {
    /// Uplink; `None`: the interface of the default route.
    pub parent: Option<String>,
    pub mac: Option<[u8; 6]>,
    pub client_id: Option<Vec<u8>>,
    pub hostname: Option<String>,
    pub requested_ip: Option<Ipv4Addr>,
    pub release: bool,
    pub timeout: Duration,
    pub arp_probe: bool,
}

/// Milliseconds each step took.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub(crate) struct Timings {
    /// DISCOVER sent → OFFER received.
    pub(crate) offer_ms: Option<f64>,
    /// REQUEST sent → ACK received.
    pub(crate) ack_ms: Option<f64>,
    /// ARP probe of the offered address.
    pub(crate) arp_probe_ms: Option<f64>,
    /// Start → BOUND.
    pub(crate) bound_ms: Option<f64>,
    /// Release and macvlan removal.
    pub(crate) cleanup_ms: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProbeReport {
    pub ok: bool,
    /// Stable word: `Bound`, `NoReply`, `Nak`, `NoUsableReply`,
    /// `MacvlanNotReady`, `NoParent`, `Interrupted`, `Error`.
    pub(crate) reason: String,
    pub(crate) message: String,
    pub(crate) parent: String,
    pub(crate) interface: String,
    pub(crate) mac: String,
    pub(crate) server: Option<Ipv4Addr>,
    pub(crate) address: Option<Ipv4Addr>,
    pub(crate) lease_secs: Option<f64>,
    pub(crate) t1_secs: Option<f64>,
    pub(crate) t2_secs: Option<f64>,
    pub(crate) routers: Vec<Ipv4Addr>,
    pub(crate) released: bool,
    pub(crate) timings: Timings,
    pub(crate) counters: Counters,
}

fn step_timings(st: &LeaseStatus) -> Timings {
    let at = |s: State| {
        st.transitions
            .iter()
            .find(|t| t.state == s)
            .map(|t| t.at_ms)
    };
    let selecting = at(State::Selecting).unwrap_or(0.0);
    let requesting = at(State::Requesting);
    let checking = at(State::Checking);
    let bound = at(State::Bound);
    Timings {
        offer_ms: requesting.map(|r| r - selecting),
        ack_ms: requesting.and_then(|r| checking.or(bound).map(|a| a - r)),
        arp_probe_ms: checking.and_then(|c| bound.map(|b| b - c)),
        bound_ms: bound,
        cleanup_ms: None,
    }
}

/// Picks the reason for a lease that did not bind in time.
fn failure(st: &LeaseStatus, timeout: Duration) -> (String, String) {
    let c = st.counters;
    if c.naks > 0 {
        (
            "Nak".into(),
            format!(
                "the DHCP server refused the address (DHCPNAK){}",
                st.last_drop
                    .as_ref()
                    .map(|d| format!("; last dropped reply: {d}"))
                    .unwrap_or_default()
            ),
        )
    } else if c.received == 0 {
        (
            "NoReply".into(),
            format!(
                "no reply from a DHCP server within {} ({} messages sent); is DHCP enabled on this VM network?",
                humantime::format_duration(timeout),
                c.sent
            ),
        )
    } else {
        (
            "NoUsableReply".into(),
            format!(
                "{} replies received, none usable (state {}); last dropped: {}",
                c.received,
                st.state.as_str(),
                st.last_drop.as_deref().unwrap_or("-")
            ),
        )
    }
}

/// Runs the probe. Never returns with an interface or (with `release`) a
/// lease left behind.
pub async fn run(opts: ProbeOptions) -> ProbeReport {
    let mac = opts.mac.unwrap_or_else(random_vip_mac);
    let interface = format!("hna-probe-{:02x}{:02x}", mac[4], mac[5]);
    let mut report = ProbeReport {
        ok: false,
        reason: "Error".into(),
        message: String::new(),
        parent: opts.parent.clone().unwrap_or_default(),
        interface: interface.clone(),
        mac: crate::mac::format(&mac),
        server: None,
        address: None,
        lease_secs: None,
        t1_secs: None,
        t2_secs: None,
        routers: Vec::new(),
        released: false,
        timings: Timings::default(),
        counters: Counters::default(),
    };
    let parent = match opts.parent.clone().or_else(|| {
        std::fs::read_to_string(crate::link::ROUTE_TABLE)
            .ok()
            .and_then(|t| default_route_interface(&t))
    }) {
        Some(p) => p,
        None => {
            report.reason = "NoParent".into();
            report.message = "no default route to find the uplink; name it with --parent".into();
            return report;
        }
    };
    report.parent = parent.clone();
    // Handlers before the macvlan exists: a Ctrl-C from here on is noticed
    // and cleaned up after, never the default "die with the link left".
    use tokio::signal::unix::{SignalKind, signal};
    let mut sigint = signal(SignalKind::interrupt()).ok();
    let mut sigterm = signal(SignalKind::terminate()).ok();
    let engine = match Engine::new(None) {
        Ok(e) => e,
        Err(e) => {
            report.message = e.to_string();
            return report;
        }
    };
    let cfg = probe_lease(&opts, interface.clone(), parent, mac);
    let mut status = match engine.start(cfg).await {
        Ok(s) => s,
        Err(e @ EngineError::Link { .. }) => {
            report.reason = "MacvlanNotReady".into();
            report.message = e.to_string();
            // A half-created link must not stay behind.
            let _ = engine.netlink().delete(&interface).await;
            return report;
        }
        Err(e) => {
            report.message = e.to_string();
            let _ = engine.netlink().delete(&interface).await;
            return report;
        }
    };

    let outcome = bound_or_interrupted(&mut status, opts.timeout, &mut sigint, &mut sigterm).await;
    let st = status.borrow().clone();
    record(&mut report, &st, outcome, opts.timeout);

    let t = tokio::time::Instant::now();
    let mode = if opts.release {
        StopMode::Release
    } else {
        StopMode::Handover
    };
    report.released = opts.release && st.state.holds_address();
    if let Err(e) = engine.stop(&interface, mode).await {
        report.ok = false;
        report.reason = "Error".into();
        report.message = format!("{}; cleanup failed: {e}", report.message);
    }
    report.timings.cleanup_ms = Some(t.elapsed().as_secs_f64() * 1000.0);
    report
}

/// The probe's lease: no guard, no witness, no presence frames.
fn probe_lease(
    opts: &ProbeOptions,
    interface: String,
    parent: String,
    mac: [u8; 6],
) -> LeaseConfig {
    LeaseConfig {
        interface,
        parent,
        identity: Identity {
            mac,
            client_id: opts.client_id.clone(),
            hostname: opts.hostname.clone(),
        },
        requested_ip: opts.requested_ip,
        timing: Timing {
            arp_probe: opts.arp_probe,
            ..Timing::default()
        },
        probe: ProbeConfig::default(),
        guarded_at: None,
        witness: None,
        presence: crate::lease_engine::Presence::Off,
    }
}

/// Waits for the lease to bind, at most `timeout`: `Err(None)` when it
/// did not, `Err(Some(signal))` when the user stopped it first.
async fn bound_or_interrupted(
    status: &mut tokio::sync::watch::Receiver<crate::driver::LeaseStatus>,
    timeout: Duration,
    sigint: &mut Option<tokio::signal::unix::Signal>,
    sigterm: &mut Option<tokio::signal::unix::Signal>,
) -> Result<(), Option<&'static str>> {
    async fn received(s: &mut Option<tokio::signal::unix::Signal>) {
        match s.as_mut() {
            Some(s) => {
                s.recv().await;
            }
            None => std::future::pending().await,
        }
    }
    tokio::select! {
        r = tokio::time::timeout(timeout, status.wait_for(|s| s.state == State::Bound)) => match r {
            Ok(Ok(_)) => Ok(()),
            _ => Err(None),
        },
        _ = received(sigint) => Err(Some("interrupted (SIGINT)")),
        _ = received(sigterm) => Err(Some("interrupted (SIGTERM)")),
    }
}

/// What the lease came to, into the report.
fn record(
    report: &mut ProbeReport,
    st: &crate::driver::LeaseStatus,
    outcome: Result<(), Option<&'static str>>,
    timeout: Duration,
) {
    report.counters = st.counters;
    report.timings = step_timings(st);
    match outcome {
        Ok(()) => {
            report.ok = true;
            report.reason = "Bound".into();
            report.message = format!(
                "{} offered {} for {}",
                st.server.map(|s| s.to_string()).unwrap_or_default(),
                st.address.map(|s| s.to_string()).unwrap_or_default(),
                humantime::format_duration(Duration::from_secs_f64(st.lease_secs.unwrap_or(0.0)))
            );
        }
        Err(Some(why)) => {
            report.reason = "Interrupted".into();
            report.message = why.into();
        }
        Err(None) => {
            let (reason, message) = failure(st, timeout);
            report.reason = reason;
            report.message = message;
        }
    }
    report.server = st.server;
    report.address = st.address;
    report.lease_secs = st.lease_secs;
    report.t1_secs = st.t1_secs;
    report.t2_secs = st.t2_secs;
    report.routers = st.routers.clone();
}

impl ProbeReport {
    pub fn to_human(&self) -> String {
        let ip = |a: Option<Ipv4Addr>| a.map(|a| a.to_string()).unwrap_or_else(|| "-".into());
        let secs = |s: Option<f64>| {
            s.map(|s| humantime::format_duration(Duration::from_secs_f64(s)).to_string())
                .unwrap_or_else(|| "-".into())
        };
        let ms = |m: Option<f64>| {
            m.map(|m| format!("{m:.1} ms"))
                .unwrap_or_else(|| "-".into())
        };
        let routers = if self.routers.is_empty() {
            "-".to_string()
        } else {
            self.routers
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "dhcp-probe on {} via {} (MAC {}): {} — {}\n  server:    {}\n  address:   {}\n  lease:     {} (T1 {}, T2 {})\n  router:    {}\n  timings:   offer {}, ack {}, ARP probe {}, bound after {}, cleanup {}\n  released:  {}\n  packets:   {} sent, {} received, {} dropped, {} NAKs\n",
            self.parent,
            self.interface,
            self.mac,
            self.reason,
            self.message,
            ip(self.server),
            ip(self.address),
            secs(self.lease_secs),
            secs(self.t1_secs),
            secs(self.t2_secs),
            routers,
            ms(self.timings.offer_ms),
            ms(self.timings.ack_ms),
            ms(self.timings.arp_probe_ms),
            ms(self.timings.bound_ms),
            ms(self.timings.cleanup_ms),
            if self.released { "yes" } else { "no" },
            self.counters.sent,
            self.counters.received,
            self.counters.dropped,
            self.counters.naks,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::Transition;

    #[test]
    fn timings_come_from_the_transitions() {
        let mut st = LeaseStatus::new("x", [0; 6]);
        for (state, at_ms) in [
            (State::Selecting, 0.1),
            (State::Requesting, 2.1),
            (State::Checking, 3.1),
            (State::Bound, 303.1),
        ] {
            st.transitions.push(Transition { state, at_ms });
        }
        let t = step_timings(&st);
        assert_eq!(t.offer_ms, Some(2.0));
        assert_eq!(t.ack_ms, Some(1.0));
        assert_eq!(t.arp_probe_ms, Some(300.0));
        assert_eq!(t.bound_ms, Some(303.1));
    }

    #[test]
    fn failure_reasons() {
        let mut st = LeaseStatus::new("x", [0; 6]);
        st.counters.sent = 3;
        let (r, m) = failure(&st, Duration::from_secs(10));
        assert_eq!(r, "NoReply");
        assert!(m.contains("within 10s") && m.contains("3 messages"), "{m}");
        st.counters.received = 2;
        st.last_drop = Some("xid mismatch".into());
        assert_eq!(failure(&st, Duration::from_secs(10)).0, "NoUsableReply");
        st.counters.naks = 1;
        assert_eq!(failure(&st, Duration::from_secs(10)).0, "Nak");
    }
}
