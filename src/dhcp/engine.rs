//! Many leases in one process: each on its own macvlan with its own MAC,
//! client identifier and packet socket, driven by its own task.

use std::collections::BTreeMap;
use std::sync::Mutex;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use super::driver::{Command, Driver, LeaseStatus};
use super::io::{AfPacket, ProbeConfig};
use super::link::{LinkError, Netlink};
use super::machine::{Machine, StopMode, Timing};
use super::packet::Identity;
use super::store::{Store, StoreError, validate_name};

/// One LB address to hold.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// The macvlan's name (`vip-<8 hex>`), also the lease file's name.
    pub interface: String,
    /// The uplink the macvlan sits on.
    pub parent: String,
    pub identity: Identity,
    pub timing: Timing,
    pub probe: ProbeConfig,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("lease {0} is already running")]
    Exists(String),
    #[error("no lease {0}")]
    Unknown(String),
    #[error("macvlan not ready for {name}: {source}")]
    Link { name: String, source: LinkError },
    #[error("packet socket on {name}: {source}")]
    Socket {
        name: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

struct Running {
    cmds: mpsc::Sender<Command>,
    status: watch::Receiver<LeaseStatus>,
    task: JoinHandle<()>,
}

/// The lease table.
pub struct Engine {
    nl: Netlink,
    store: Option<Store>,
    leases: Mutex<BTreeMap<String, Running>>,
}

impl Engine {
    /// `store`: where lease files live; `None` for throwaway leases
    /// (`dhcp-probe`). Must be called inside a tokio runtime.
    pub fn new(store: Option<Store>) -> Result<Engine, EngineError> {
        let nl = Netlink::connect().map_err(|source| EngineError::Link {
            name: "netlink".into(),
            source,
        })?;
        Ok(Engine {
            nl,
            store,
            leases: Mutex::new(BTreeMap::new()),
        })
    }

    pub fn netlink(&self) -> &Netlink {
        &self.nl
    }

    /// Creates (or reuses) the macvlan, opens its packet socket and starts
    /// the lease: in INIT-REBOOT when a lease file for the same MAC exists.
    pub async fn start(
        &self,
        cfg: LeaseConfig,
    ) -> Result<watch::Receiver<LeaseStatus>, EngineError> {
        let name = cfg.interface.clone();
        validate_name(&name)?;
        if self.leases.lock().expect("lease table").contains_key(&name) {
            return Err(EngineError::Exists(name));
        }
        let link_err = |source| EngineError::Link {
            name: name.clone(),
            source,
        };
        let index = self
            .nl
            .ensure_macvlan(&name, &cfg.parent, cfg.identity.mac)
            .await
            .map_err(link_err)?;
        let transport = AfPacket::open(index, cfg.identity.mac, cfg.probe).map_err(|source| {
            EngineError::Socket {
                name: name.clone(),
                source,
            }
        })?;
        let stored = match &self.store {
            Some(s) => s
                .load(&name)?
                .filter(|r| r.identity.mac == cfg.identity.mac)
                .map(|r| r.to_lease()),
            None => None,
        };
        let machine = Machine::new(cfg.identity, cfg.timing, fastrand::u64(..));
        let (driver, status) = Driver::new(
            &name,
            machine,
            transport,
            self.nl.on(&name, index),
            self.store.clone(),
        );
        let (tx, rx) = mpsc::channel(4);
        let task = tokio::spawn(driver.run(stored, rx));
        self.leases.lock().expect("lease table").insert(
            name,
            Running {
                cmds: tx,
                status: status.clone(),
                task,
            },
        );
        Ok(status)
    }

    /// Stops a lease and deletes its macvlan. `Release` sends DHCPRELEASE
    /// and deletes the lease file; `Handover` does neither.
    pub async fn stop(&self, name: &str, mode: StopMode) -> Result<(), EngineError> {
        let running = self
            .leases
            .lock()
            .expect("lease table")
            .remove(name)
            .ok_or_else(|| EngineError::Unknown(name.into()))?;
        let (done_tx, done_rx) = oneshot::channel();
        if running
            .cmds
            .send(Command::Stop(mode, done_tx))
            .await
            .is_ok()
        {
            let _ = done_rx.await;
        }
        let _ = running.task.await;
        self.nl
            .delete(name)
            .await
            .map_err(|source| EngineError::Link {
                name: name.into(),
                source,
            })
    }

    /// Stops every lease, all at once: a daemon stopping (or handing over)
    /// a hundred addresses should not take a hundred link deletions in a
    /// row.
    pub async fn stop_all(&self, mode: StopMode) -> Vec<EngineError> {
        let names: Vec<String> = self
            .leases
            .lock()
            .expect("lease table")
            .keys()
            .cloned()
            .collect();
        futures::future::join_all(names.iter().map(|n| self.stop(n, mode)))
            .await
            .into_iter()
            .filter_map(Result::err)
            .collect()
    }

    /// Gratuitous ARP for a lease now (takeover).
    pub async fn announce(&self, name: &str) -> Result<(), EngineError> {
        let tx = self
            .leases
            .lock()
            .expect("lease table")
            .get(name)
            .map(|r| r.cmds.clone())
            .ok_or_else(|| EngineError::Unknown(name.into()))?;
        let _ = tx.send(Command::Announce).await;
        Ok(())
    }

    /// Deletes the macvlans an earlier run left behind (a crash, `kill -9`,
    /// power loss): a link named like a stored lease and carrying its MAC.
    /// Nothing is released and the lease files stay, so a lease started
    /// again resumes in INIT-REBOOT; until then this node must not answer
    /// for an address the controller may have moved elsewhere. Links that
    /// are not the agent's (no lease file, other MAC, a running lease) are
    /// left alone. Returns what was removed and what could not be looked at.
    pub async fn remove_leftovers(&self) -> (Vec<String>, Vec<String>) {
        let Some(store) = &self.store else {
            return (Vec::new(), Vec::new());
        };
        let (mut removed, mut problems) = (Vec::new(), Vec::new());
        let names = match store.list() {
            Ok(n) => n,
            Err(e) => return (removed, vec![e.to_string()]),
        };
        for name in names {
            if self.leases.lock().expect("lease table").contains_key(&name) {
                continue;
            }
            let record = match store.load(&name) {
                Ok(Some(r)) => r,
                Ok(None) => continue,
                Err(e) => {
                    problems.push(e.to_string());
                    continue;
                }
            };
            match self.nl.link(&name).await {
                Ok(Some(link)) if link.mac == Some(record.identity.mac) => {
                    match self.nl.delete(&name).await {
                        Ok(()) => removed.push(name),
                        Err(e) => problems.push(format!("{name}: {e}")),
                    }
                }
                Ok(_) => {}
                Err(e) => problems.push(format!("{name}: {e}")),
            }
        }
        (removed, problems)
    }

    /// Every lease's current status, by name.
    pub fn snapshot(&self) -> Vec<LeaseStatus> {
        self.leases
            .lock()
            .expect("lease table")
            .values()
            .map(|r| r.status.borrow().clone())
            .collect()
    }
}

/// Prometheus text exposition of the lease table.
pub fn render_metrics(leases: &[LeaseStatus]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let mut family =
        |name: &str, help: &str, ty: &str, value: &dyn Fn(&LeaseStatus) -> Option<f64>| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {ty}");
            for l in leases {
                if let Some(v) = value(l) {
                    let _ = writeln!(out, "{name}{{lease=\"{}\",mac=\"{}\"}} {v}", l.name, l.mac);
                }
            }
        };
    family(
        "hna_dhcp_lease_bound",
        "1 while the lease holds its address (BOUND, RENEWING, REBINDING).",
        "gauge",
        &|l| Some(if l.state.holds_address() { 1.0 } else { 0.0 }),
    );
    family(
        "hna_dhcp_lease_expiry_timestamp_seconds",
        "When the lease expires (Unix time).",
        "gauge",
        &|l| l.expires_at_unix_ms.map(|ms| ms as f64 / 1000.0),
    );
    family(
        "hna_dhcp_lease_t1_timestamp_seconds",
        "When renewal starts (Unix time).",
        "gauge",
        &|l| l.t1_at_unix_ms.map(|ms| ms as f64 / 1000.0),
    );
    family(
        "hna_dhcp_lease_t2_timestamp_seconds",
        "When rebinding starts (Unix time).",
        "gauge",
        &|l| l.t2_at_unix_ms.map(|ms| ms as f64 / 1000.0),
    );
    family(
        "hna_dhcp_packets_sent_total",
        "DHCP messages sent.",
        "counter",
        &|l| Some(l.counters.sent as f64),
    );
    family(
        "hna_dhcp_packets_received_total",
        "DHCP frames received on the lease's interface.",
        "counter",
        &|l| Some(l.counters.received as f64),
    );
    family(
        "hna_dhcp_packets_dropped_total",
        "Received frames not acted on (malformed, or not fitting xid, chaddr, type or state).",
        "counter",
        &|l| Some(l.counters.dropped as f64),
    );
    family(
        "hna_dhcp_packets_malformed_total",
        "Received frames that did not parse.",
        "counter",
        &|l| Some(l.counters.malformed as f64),
    );
    family(
        "hna_dhcp_naks_total",
        "DHCPNAKs honoured.",
        "counter",
        &|l| Some(l.counters.naks as f64),
    );
    family(
        "hna_dhcp_declines_total",
        "DHCPDECLINEs sent after an ARP conflict.",
        "counter",
        &|l| Some(l.counters.declines as f64),
    );
    let _ = writeln!(
        out,
        "# HELP hna_dhcp_lease_state 1 for the lease's current state.\n# TYPE hna_dhcp_lease_state gauge"
    );
    for l in leases {
        let _ = writeln!(
            out,
            "hna_dhcp_lease_state{{lease=\"{}\",state=\"{}\",address=\"{}\"}} 1",
            l.name,
            l.state.as_str(),
            l.address.map(|a| a.to_string()).unwrap_or_default()
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dhcp::machine::State;

    #[test]
    fn metrics_have_one_series_per_lease() {
        let mut a = LeaseStatus::new("vip-00000001", [0, 0, 0x6c, 0, 0, 1]);
        a.state = State::Bound;
        a.address = Some("10.77.0.150".parse().unwrap());
        a.expires_at_unix_ms = Some(1_700_000_000_000);
        a.counters.sent = 3;
        let b = LeaseStatus::new("vip-00000002", [0, 0, 0x6c, 0, 0, 2]);
        let text = render_metrics(&[a, b]);
        assert!(text.contains(
            "hna_dhcp_lease_bound{lease=\"vip-00000001\",mac=\"00:00:6c:00:00:01\"} 1\n"
        ));
        assert!(text.contains(
            "hna_dhcp_lease_bound{lease=\"vip-00000002\",mac=\"00:00:6c:00:00:02\"} 0\n"
        ));
        assert!(text.contains("hna_dhcp_lease_expiry_timestamp_seconds{lease=\"vip-00000001\",mac=\"00:00:6c:00:00:01\"} 1700000000\n"));
        assert!(!text.contains("hna_dhcp_lease_expiry_timestamp_seconds{lease=\"vip-00000002\""));
        assert!(text.contains(
            "hna_dhcp_packets_sent_total{lease=\"vip-00000001\",mac=\"00:00:6c:00:00:01\"} 3\n"
        ));
        assert!(text.contains(
            "hna_dhcp_lease_state{lease=\"vip-00000001\",state=\"BOUND\",address=\"10.77.0.150\"} 1"
        ));
        // Every sample line belongs to a declared family.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let metric = line.split('{').next().unwrap();
            assert!(text.contains(&format!("# TYPE {metric} ")), "{line}");
        }
    }
}
