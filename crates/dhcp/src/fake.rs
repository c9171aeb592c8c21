//! [`FakeEngine`]: an in-memory [`LeaseEngine`] for unit tests of the
//! layers above the engine. It records every call in order, models the
//! engine's links and leases just enough to check what a caller leaves
//! behind, lets the test drive each lease's status, and injects failures.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::watch;

use super::driver::LeaseStatus;
use super::engine::{EngineError, LeaseConfig};
use super::io::ProbeConfig;
use super::lease_engine::{LeaseEngine, SweepReport};
use super::link::LinkError;
use super::machine::{State, StopMode};
use super::packet::Identity;
use super::store::validate_name;

/// One call to the engine, as the caller made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Start {
        name: String,
        parent: String,
        identity: Identity,
    },
    Stop {
        name: String,
        mode: StopMode,
    },
    Announce {
        name: String,
    },
    /// [`LeaseEngine::detach_all`]
    DetachAll {
        keep_for: std::time::Duration,
    },
    /// [`LeaseEngine::answered`]
    Guard {
        parent: String,
        addr: Ipv4Addr,
    },
    /// [`LeaseEngine::hears`]
    Hears {
        parent: String,
        witness: Ipv4Addr,
    },
    Sweep {
        prefix: String,
        keep: BTreeSet<String>,
    },
}

/// A macvlan as the fake sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeLink {
    pub(crate) parent: String,
    pub(crate) mac: [u8; 6],
}

struct FakeLease {
    config: LeaseConfig,
    status: watch::Sender<LeaseStatus>,
}

#[derive(Default)]
struct World {
    calls: Vec<Call>,
    leases: BTreeMap<String, FakeLease>,
    links: BTreeMap<String, FakeLink>,
    start_failures: BTreeMap<String, VecDeque<EngineError>>,
    stop_failures: BTreeMap<String, VecDeque<EngineError>>,
    /// Addresses somebody on the LAN answers for ([`LeaseEngine::answered`]).
    answering: BTreeSet<Ipv4Addr>,
    /// How long a guard probe takes (the real one waits for ARP replies).
    guard_delay: std::time::Duration,
    /// The guard hears nobody, not even a witness (a silent LAN port).
    deaf: bool,
}

/// Behaves like the real engine where a caller can tell: a start makes or
/// reuses the link (same parent and MAC) and a failed start leaves none it
/// made; a stop deletes the link; a second start of a running name is
/// `Exists`; `sweep` deletes unwanted prefixed links. Leases stay in INIT
/// until the test moves them ([`FakeEngine::set_status`],
/// [`FakeEngine::bind`]).
#[derive(Clone, Default)]
pub struct FakeEngine {
    world: Arc<Mutex<World>>,
}

/// A `Link` error as a failed macvlan creation gives it.
pub fn link_error(name: &str, reason: &str) -> EngineError {
    EngineError::Link {
        name: name.into(),
        source: LinkError::Netlink {
            what: "create macvlan",
            name: name.into(),
            reason: reason.into(),
        },
    }
}

impl FakeEngine {
    pub fn new() -> FakeEngine {
        FakeEngine::default()
    }

    fn world(&self) -> MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.world().calls.clone()
    }

    /// Every call since the last `take_calls`, in order.
    pub fn take_calls(&self) -> Vec<Call> {
        std::mem::take(&mut self.world().calls)
    }

    /// Somebody on the LAN answers for `addr` from now on (`false`: no
    /// longer).
    pub fn set_answering(&self, addr: Ipv4Addr, answering: bool) {
        let mut w = self.world();
        if answering {
            w.answering.insert(addr);
        } else {
            w.answering.remove(&addr);
        }
    }

    /// Every guard probe ([`LeaseEngine::answered`]) takes `delay` from
    /// now on, as the real one waits for replies.
    /// The LAN goes silent for the guard (`true`) or is heard again.
    pub fn set_deaf(&self, deaf: bool) {
        self.world().deaf = deaf;
    }

    pub fn set_guard_delay(&self, delay: std::time::Duration) {
        self.world().guard_delay = delay;
    }

    /// Names of the running leases.
    pub fn running(&self) -> Vec<String> {
        self.world().leases.keys().cloned().collect()
    }

    /// The configuration a running lease was started with.
    pub fn config(&self, name: &str) -> Option<LeaseConfig> {
        self.world().leases.get(name).map(|l| l.config.clone())
    }

    /// The links that exist now.
    pub fn links(&self) -> BTreeMap<String, FakeLink> {
        self.world().links.clone()
    }

    /// A link that was there before (a left-behind or pre-made macvlan).
    pub fn add_link(&self, name: &str, parent: &str, mac: [u8; 6]) {
        self.world().links.insert(
            name.into(),
            FakeLink {
                parent: parent.into(),
                mac,
            },
        );
    }

    /// The next start of `name` fails with `error` (queued: call again for
    /// the start after).
    pub fn fail_next_start(&self, name: &str, error: EngineError) {
        let mut w = self.world();
        w.start_failures
            .entry(name.into())
            .or_default()
            .push_back(error);
    }

    /// The next stop of `name` fails with `error`, as when the link cannot
    /// be deleted: the lease is stopped, the link stays.
    pub fn fail_next_stop(&self, name: &str, error: EngineError) {
        let mut w = self.world();
        w.stop_failures
            .entry(name.into())
            .or_default()
            .push_back(error);
    }

    /// Changes a running lease's status (seen by its receiver and by
    /// `snapshot`); `false` when no such lease runs.
    pub fn set_status(&self, name: &str, change: impl FnOnce(&mut LeaseStatus)) -> bool {
        match self.world().leases.get(name) {
            Some(l) => {
                l.status.send_modify(change);
                true
            }
            None => false,
        }
    }

    /// Moves a running lease to BOUND with `address` from `server`.
    pub fn bind(&self, name: &str, address: Ipv4Addr, server: Ipv4Addr) -> bool {
        self.set_status(name, |s| {
            s.state = State::Bound;
            s.address = Some(address);
            s.server = Some(server);
        })
    }

    /// [`FakeEngine::bind`], the server's replies from `server_mac`.
    pub fn bind_from(
        &self,
        name: &str,
        address: Ipv4Addr,
        server: Ipv4Addr,
        server_mac: &str,
    ) -> bool {
        self.set_status(name, |s| {
            s.state = State::Bound;
            s.address = Some(address);
            s.server = Some(server);
            s.server_mac = Some(server_mac.to_string());
        })
    }
}

impl LeaseEngine for FakeEngine {
    async fn start(&self, cfg: LeaseConfig) -> Result<watch::Receiver<LeaseStatus>, EngineError> {
        let mut w = self.world();
        let name = cfg.interface.clone();
        w.calls.push(Call::Start {
            name: name.clone(),
            parent: cfg.parent.clone(),
            identity: cfg.identity.clone(),
        });
        validate_name(&name)?;
        if w.leases.contains_key(&name) {
            return Err(EngineError::Exists(name));
        }
        if let Some(e) = w
            .start_failures
            .get_mut(&name)
            .and_then(VecDeque::pop_front)
        {
            return Err(e);
        }
        w.links.insert(
            name.clone(),
            FakeLink {
                parent: cfg.parent.clone(),
                mac: cfg.identity.mac,
            },
        );
        let (tx, rx) = watch::channel(LeaseStatus::new(&name, cfg.identity.mac));
        w.leases.insert(
            name,
            FakeLease {
                config: cfg,
                status: tx,
            },
        );
        Ok(rx)
    }

    async fn stop(&self, name: &str, mode: StopMode) -> Result<(), EngineError> {
        let mut w = self.world();
        w.calls.push(Call::Stop {
            name: name.into(),
            mode,
        });
        if w.leases.remove(name).is_none() {
            return Err(EngineError::Unknown(name.into()));
        }
        if let Some(e) = w.stop_failures.get_mut(name).and_then(VecDeque::pop_front) {
            return Err(e);
        }
        w.links.remove(name);
        Ok(())
    }

    async fn detach_all(&self, keep_for: std::time::Duration) -> Vec<EngineError> {
        let mut w = self.world();
        w.calls.push(Call::DetachAll { keep_for });
        // The links stay, as the real engine leaves them.
        w.leases.clear();
        Vec::new()
    }

    async fn answered(
        &self,
        parent: &str,
        addr: Ipv4Addr,
        witness: Option<Ipv4Addr>,
        _probe: ProbeConfig,
    ) -> Result<bool, EngineError> {
        let delay = {
            let mut w = self.world();
            w.calls.push(Call::Guard {
                parent: parent.into(),
                addr,
            });
            w.guard_delay
        };
        tokio::time::sleep(delay).await;
        let w = self.world();
        match witness {
            _ if w.answering.contains(&addr) => Ok(true),
            Some(witness) if w.deaf => Err(EngineError::Deaf {
                name: parent.into(),
                witness,
            }),
            _ => Ok(false),
        }
    }

    /// The witness answers unless the LAN is deaf ([`FakeEngine::set_deaf`]),
    /// after the guard's delay.
    async fn hears(
        &self,
        parent: &str,
        witness: Ipv4Addr,
        _probe: ProbeConfig,
    ) -> Result<bool, EngineError> {
        let delay = {
            let mut w = self.world();
            w.calls.push(Call::Hears {
                parent: parent.into(),
                witness,
            });
            w.guard_delay
        };
        tokio::time::sleep(delay).await;
        Ok(!self.world().deaf)
    }

    async fn announce(&self, name: &str) -> Result<(), EngineError> {
        let mut w = self.world();
        w.calls.push(Call::Announce { name: name.into() });
        if w.leases.contains_key(name) {
            Ok(())
        } else {
            Err(EngineError::Unknown(name.into()))
        }
    }

    fn snapshot(&self) -> Vec<LeaseStatus> {
        self.world()
            .leases
            .values()
            .map(|l| l.status.borrow().clone())
            .collect()
    }

    async fn sweep(&self, prefix: &str, keep: &BTreeSet<String>) -> SweepReport {
        let mut w = self.world();
        w.calls.push(Call::Sweep {
            prefix: prefix.into(),
            keep: keep.clone(),
        });
        let unwanted: Vec<String> = w
            .links
            .keys()
            .filter(|n| n.starts_with(prefix) && !keep.contains(*n) && !w.leases.contains_key(*n))
            .cloned()
            .collect();
        for n in &unwanted {
            w.links.remove(n);
        }
        SweepReport {
            removed: unwanted,
            problems: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::ProbeConfig;
    use crate::machine::Timing;

    const MAC: [u8; 6] = [0, 0, 0x6c, 1, 2, 3];

    fn cfg(name: &str) -> LeaseConfig {
        LeaseConfig {
            interface: name.into(),
            parent: "eth0".into(),
            identity: Identity::new(MAC),
            requested_ip: None,
            timing: Timing::default(),
            probe: ProbeConfig::default(),
            guarded_at: None,
            witness: None,
            presence: crate::lease_engine::Presence::Off,
        }
    }

    #[tokio::test]
    async fn records_calls_and_models_links() {
        let fake = FakeEngine::new();
        let mut rx = fake.start(cfg("vip-0000000a")).await.unwrap();
        assert!(matches!(
            fake.start(cfg("vip-0000000a")).await,
            Err(EngineError::Exists(_))
        ));
        assert_eq!(
            fake.links().get("vip-0000000a"),
            Some(&FakeLink {
                parent: "eth0".into(),
                mac: MAC
            })
        );

        let addr = Ipv4Addr::new(10, 77, 0, 150);
        assert!(fake.bind("vip-0000000a", addr, Ipv4Addr::new(10, 77, 0, 1)));
        let seen = rx
            .wait_for(|s| s.state == State::Bound)
            .await
            .unwrap()
            .clone();
        assert_eq!(seen.address, Some(addr));
        assert_eq!(fake.snapshot()[0].address, Some(addr));

        fake.announce("vip-0000000a").await.unwrap();
        fake.stop("vip-0000000a", StopMode::Release).await.unwrap();
        assert!(fake.links().is_empty());
        assert!(fake.running().is_empty());
        assert!(!fake.bind("vip-0000000a", addr, addr), "stopped lease");
        assert!(matches!(
            fake.stop("vip-0000000a", StopMode::Release).await,
            Err(EngineError::Unknown(_))
        ));

        let start = Call::Start {
            name: "vip-0000000a".into(),
            parent: "eth0".into(),
            identity: Identity::new(MAC),
        };
        let release = Call::Stop {
            name: "vip-0000000a".into(),
            mode: StopMode::Release,
        };
        assert_eq!(
            fake.take_calls(),
            vec![
                start.clone(),
                start,
                Call::Announce {
                    name: "vip-0000000a".into()
                },
                release.clone(),
                release,
            ]
        );
        assert!(fake.calls().is_empty());
    }

    #[tokio::test]
    async fn injected_failures_leave_what_the_real_engine_leaves() {
        let fake = FakeEngine::new();
        fake.fail_next_start(
            "vip-0000000b",
            link_error("vip-0000000b", "Operation not supported"),
        );
        let err = fake.start(cfg("vip-0000000b")).await.unwrap_err();
        assert!(err.to_string().contains("Operation not supported"), "{err}");
        assert!(fake.links().is_empty(), "a failed start leaves no link");
        assert!(fake.running().is_empty());
        // Only the next start failed.
        fake.start(cfg("vip-0000000b")).await.unwrap();

        fake.fail_next_stop(
            "vip-0000000b",
            link_error("vip-0000000b", "Device or resource busy"),
        );
        assert!(fake.stop("vip-0000000b", StopMode::Handover).await.is_err());
        assert!(fake.running().is_empty(), "the lease stopped");
        assert!(fake.links().contains_key("vip-0000000b"), "its link stayed");
    }

    #[tokio::test]
    async fn sweep_keeps_wanted_running_and_foreign_links() {
        let fake = FakeEngine::new();
        fake.add_link("vip-00000001", "eth0", MAC);
        fake.add_link("vip-00000002", "eth0", MAC);
        fake.add_link("eth0.100", "eth0", MAC);
        fake.start(cfg("vip-00000003")).await.unwrap();
        let keep = BTreeSet::from(["vip-00000001".to_string()]);
        let report = fake.sweep("vip-", &keep).await;
        assert_eq!(report.removed, vec!["vip-00000002".to_string()]);
        assert_eq!(
            fake.links().keys().cloned().collect::<Vec<_>>(),
            vec!["eth0.100", "vip-00000001", "vip-00000003"]
        );
    }
}
