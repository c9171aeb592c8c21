//! Carries out a [`plan`](super::lease_plan::plan) on a [`LeaseEngine`]: the thin
//! edge of the data plane. Each action's outcome is returned; a failed one
//! is simply planned again on the next round.
//!
//! The takeover guard: a start for an address (one the Service already
//! has, so another node may have held it) first asks the LAN whether
//! anybody still answers for it ([`LeaseEngine::answered`]) and, while
//! somebody does, does not start: the outcome is `guarded` and the round
//! is tried again soon. A frozen agent's node keeps answering from the
//! kernel until its addresses' lifetime runs out, and a lease whose
//! address expired starts again through here: this is what keeps a second
//! node from answering too.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use hna_dhcp::io::ProbeConfig;
use hna_dhcp::{Identity, LeaseConfig, LeaseEngine, Presence, Timing};

use super::lease_plan::{Action, Want};

/// What every lease of this node shares.
#[derive(Debug, Clone, Default)]
pub(crate) struct Settings {
    /// The uplink when an assignment names none (configuration `uplink`,
    /// else the default route's interface).
    pub(crate) default_uplink: Option<String>,
    pub(crate) timing: Timing,
    pub(crate) probe: ProbeConfig,
    /// How long the takeover guard listens; zero: no guard.
    pub(crate) takeover_guard: Duration,
    /// The default route's gateway: on the default uplink, the guard's
    /// silence counts only while the gateway answers ARP, so a node that
    /// cannot hear its LAN (its port silent, a switch filtering it) never
    /// takes that silence for a free address (issue #29: the soak found
    /// one binding nine addresses its former holder, cut off from the API
    /// server, still answered for).
    pub(crate) witness: Option<std::net::Ipv4Addr>,
    /// Presence frames from each held address's MAC (`lb_presence`).
    pub(crate) presence: Presence,
}

/// Why an action did not happen (it is planned again on the next round).
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum ActionError {
    #[error(
        "{service}: no uplink: the Service names none (kube-vip.io/serviceInterface) and this node has no default route; set `uplink` in the configuration"
    )]
    NoUplink { service: String },
    #[error(
        "{addr} still answers on {parent}'s LAN (another node holds it): waiting until it stops before taking it over"
    )]
    StillAnswers { addr: Ipv4Addr, parent: String },
    #[error("takeover guard for {addr}: {error}; waiting until this node hears its LAN again")]
    Deaf {
        addr: Ipv4Addr,
        error: Arc<hna_dhcp::EngineError>,
    },
    #[error("takeover guard for {addr}: {error}")]
    Guard {
        addr: Ipv4Addr,
        error: Arc<hna_dhcp::EngineError>,
    },
    #[error(transparent)]
    Engine(Arc<hna_dhcp::EngineError>),
}

/// The same when it says the same: the engine's errors compare no other
/// way, and the outcomes are compared as what they report.
impl PartialEq for ActionError {
    fn eq(&self, other: &ActionError) -> bool {
        self.to_string() == other.to_string()
    }
}

impl Eq for ActionError {}

/// One action's result, by interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Outcome {
    pub(crate) interface: String,
    pub(crate) result: Result<(), ActionError>,
    /// Not started because another host answers for the address.
    pub(crate) guarded: bool,
    /// Started after the takeover guard heard nobody answer for the
    /// address.
    pub(crate) passed_guard: bool,
}

/// The guard's probe: two probes, the second a third of the way in, then
/// listening for the rest.
fn guard_probe(listen: Duration) -> ProbeConfig {
    ProbeConfig {
        probes: 2,
        interval: listen / 3,
        wait: listen - listen / 3,
        ..ProbeConfig::default()
    }
}

pub(crate) fn lease_config(w: &Want, settings: &Settings) -> Result<LeaseConfig, ActionError> {
    let parent = w
        .uplink
        .clone()
        .or_else(|| settings.default_uplink.clone())
        .ok_or_else(|| ActionError::NoUplink {
            service: w.service.clone(),
        })?;
    let witness = settings
        .witness
        .filter(|_| settings.default_uplink.as_deref() == Some(parent.as_str()));
    Ok(LeaseConfig {
        interface: w.interface.clone(),
        parent,
        identity: Identity {
            mac: w.mac,
            // Empty stays empty: no option 61 (`Identity::client_id`).
            client_id: Some(w.client_id.clone()),
            hostname: w.hostname.clone(),
        },
        requested_ip: w.requested_ip,
        timing: settings.timing.clone(),
        probe: settings.probe,
        guarded_at: None,
        witness,
        presence: settings.presence,
    })
}

/// How many starts run at once. A start behind the takeover guard waits
/// for its ARP probe (150 ms by default); one after another, 30 Services
/// moving onto one node took seconds, during which the loop that also
/// writes the node's heartbeat did nothing else. 16 at once, the 100
/// Services each receiver of a 200-Service failover takes over came in
/// seven rounds; 64, in two (issue #30: all 200 held again 2.1–2.2 s after
/// their holder's VM was deleted, in the failover bench).
pub(crate) const CONCURRENT_STARTS: usize = 64;

/// Carries out `actions`, returning one outcome per action, in their order.
/// Stops first, one after another (a stop may free a link a start reuses),
/// then the starts, [`CONCURRENT_STARTS`] at a time.
pub(crate) async fn apply<E: LeaseEngine>(
    engine: &E,
    actions: Vec<Action>,
    settings: &Settings,
) -> Vec<Outcome> {
    use futures::StreamExt as _;
    let mut out: Vec<Option<Outcome>> = Vec::new();
    out.resize_with(actions.len(), || None);
    let mut starts = Vec::new();
    for (i, action) in actions.into_iter().enumerate() {
        match action {
            Action::Stop { interface, mode } => {
                let result = engine
                    .stop(&interface, mode)
                    .await
                    .map_err(|e| ActionError::Engine(Arc::new(e)));
                out[i] = Some(Outcome {
                    interface,
                    result,
                    guarded: false,
                    passed_guard: false,
                });
            }
            Action::Start(w) => starts.push((i, w)),
        }
    }
    let started: Vec<(usize, Outcome)> = futures::stream::iter(starts)
        .map(|(i, w)| async move {
            let (result, guard) = start(engine, &w, settings).await;
            (
                i,
                Outcome {
                    interface: w.interface,
                    result,
                    guarded: guard == Guard::HeldBack,
                    passed_guard: guard == Guard::Passed,
                },
            )
        })
        .buffer_unordered(CONCURRENT_STARTS)
        .collect()
        .await;
    for (i, o) in started {
        out[i] = Some(o);
    }
    out.into_iter()
        .map(|o| o.expect("every action has an outcome"))
        .collect()
}

/// What the takeover guard did to a start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Guard {
    /// Not asked (a new address, or a guard of zero), or it failed.
    NotAsked,
    /// Another host answers, or the node cannot hear its LAN.
    HeldBack,
    /// Nobody answered: the start went ahead.
    Passed,
}

/// One start, behind the takeover guard when the address is known: the
/// result, and what the guard did.
async fn start<E: LeaseEngine>(
    engine: &E,
    w: &Want,
    settings: &Settings,
) -> (Result<(), ActionError>, Guard) {
    let mut cfg = match lease_config(w, settings) {
        Ok(cfg) => cfg,
        Err(e) => return (Err(e), Guard::NotAsked),
    };
    let mut guard = Guard::NotAsked;
    if let Some(addr) = w.requested_ip
        && !settings.takeover_guard.is_zero()
    {
        // The guard's word holds from when it began asking: a binding much
        // later (this process frozen meanwhile) asks again (`GUARD_FRESH`).
        cfg.guarded_at = Some(tokio::time::Instant::now());
        let answered = engine
            .answered(
                &cfg.parent,
                addr,
                cfg.witness,
                guard_probe(settings.takeover_guard),
            )
            .await;
        match answered {
            Ok(false) => guard = Guard::Passed,
            Ok(true) => {
                return (
                    Err(ActionError::StillAnswers {
                        addr,
                        parent: cfg.parent,
                    }),
                    Guard::HeldBack,
                );
            }
            // Guarded, not failed: looked at again soon, as for a holder
            // that still answers.
            Err(e @ hna_dhcp::EngineError::Deaf { .. }) => {
                return (
                    Err(ActionError::Deaf {
                        addr,
                        error: Arc::new(e),
                    }),
                    Guard::HeldBack,
                );
            }
            Err(e) => {
                return (
                    Err(ActionError::Guard {
                        addr,
                        error: Arc::new(e),
                    }),
                    Guard::NotAsked,
                );
            }
        }
    }
    let result = engine
        .start(cfg)
        .await
        .map(|_| ())
        .map_err(|e| ActionError::Engine(Arc::new(e)));
    (result, guard)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loadbalancer::lease_plan::{Running, plan, want};
    use hna_contract::node_object::Assignment;
    use hna_dhcp::StopMode;
    use hna_dhcp::fake::{Call, FakeEngine, link_error};

    fn settings() -> Settings {
        Settings {
            default_uplink: Some("eth0".into()),
            ..Settings::default()
        }
    }

    fn wanted(release: bool, uplink: Option<&str>) -> Want {
        want(&Assignment {
            service: "default/web".into(),
            uid: "3f2a9c1e-77b0-4d2e-9a51-0c8d2b6e4f11".into(),
            interface: "hlb-3f2a9c1e".into(),
            mac: "02:11:22:33:44:55".into(),
            client_id: "00686e61".into(),
            hostname: Some("web-lb".into()),
            requested_ip: None,
            uplink: uplink.map(str::to_string),
            release,
        })
        .unwrap()
    }

    fn running(engine: &FakeEngine) -> Vec<Running> {
        engine
            .running()
            .into_iter()
            .map(|interface| {
                let mac = engine.config(&interface).unwrap().identity.mac;
                Running {
                    interface,
                    mac,
                    started_as: None,
                    expired: false,
                }
            })
            .collect()
    }

    async fn round(engine: &FakeEngine, wants: &[Want]) -> Vec<Outcome> {
        let actions = plan(wants, &running(engine));
        apply(engine, actions, &settings()).await
    }

    /// The whole life of one address on a node, without root: start with
    /// the assignment's identity on its uplink, a failed start retried by
    /// the next round, nothing done while in sync, RELEASE on delete.
    #[tokio::test]
    async fn an_assignment_is_held_then_released() {
        let engine = FakeEngine::new();
        let w = wanted(false, Some("eth1"));
        engine.fail_next_start("hlb-3f2a9c1e", link_error("hlb-3f2a9c1e", "no such device"));
        let first = round(&engine, std::slice::from_ref(&w)).await;
        assert!(first[0].result.is_err(), "{first:?}");
        assert!(engine.running().is_empty());

        let second = round(&engine, std::slice::from_ref(&w)).await;
        assert_eq!(
            second,
            vec![Outcome {
                interface: "hlb-3f2a9c1e".into(),
                result: Ok(()),
                guarded: false,
                passed_guard: false,
            }]
        );
        assert!(
            round(&engine, std::slice::from_ref(&w)).await.is_empty(),
            "in sync"
        );

        round(&engine, &[wanted(true, Some("eth1"))]).await;
        let calls = engine.take_calls();
        let identity = Identity {
            mac: [0x02, 0x11, 0x22, 0x33, 0x44, 0x55],
            client_id: Some(vec![0x00, 0x68, 0x6e, 0x61]),
            hostname: Some("web-lb".into()),
        };
        let start = Call::Start {
            name: "hlb-3f2a9c1e".into(),
            parent: "eth1".into(),
            identity,
        };
        assert_eq!(
            calls,
            vec![
                start.clone(),
                start,
                Call::Stop {
                    name: "hlb-3f2a9c1e".into(),
                    mode: StopMode::Release
                }
            ]
        );
        assert!(engine.links().is_empty(), "no link left behind");
    }

    #[tokio::test]
    async fn the_default_uplink_serves_and_its_absence_is_explained() {
        let engine = FakeEngine::new();
        round(&engine, &[wanted(false, None)]).await;
        assert_eq!(engine.config("hlb-3f2a9c1e").unwrap().parent, "eth0");

        let engine = FakeEngine::new();
        let out = apply(
            &engine,
            plan(&[wanted(false, None)], &[]),
            &Settings::default(),
        )
        .await;
        let e = out[0].result.clone().unwrap_err().to_string();
        assert!(e.contains("no uplink"), "{e}");
        assert!(engine.calls().is_empty(), "nothing was tried");
    }

    fn settings_guarded() -> Settings {
        Settings {
            takeover_guard: Duration::from_millis(150),
            ..settings()
        }
    }

    /// An address the Service already has is taken over only once nobody
    /// answers for it; the guard asks on the uplink the lease would use,
    /// and a new address (none yet) or a guard of zero asks nothing.
    /// Issue #29: on the default uplink, a guard that hears nobody, not even
    /// the gateway (this node's LAN port silent), holds the takeover back
    /// as guarded, never as a free address; heard again, it takes over.
    #[tokio::test]
    async fn a_guard_that_cannot_hear_its_lan_does_not_take_over() {
        let engine = FakeEngine::new();
        let addr = std::net::Ipv4Addr::new(10, 77, 0, 150);
        let gateway = std::net::Ipv4Addr::new(10, 77, 0, 1);
        let mut w = wanted(false, None);
        w.requested_ip = Some(addr);
        let s = Settings {
            witness: Some(gateway),
            ..settings_guarded()
        };
        engine.set_deaf(true);
        let actions = plan(std::slice::from_ref(&w), &running(&engine));
        let held = apply(&engine, actions, &s).await;
        assert!(held[0].guarded, "{held:?}");
        let message = held[0].result.clone().unwrap_err().to_string();
        assert!(
            message.contains("10.77.0.1") && message.contains("eth0"),
            "{message}"
        );
        assert!(engine.running().is_empty(), "not started while deaf");
        engine.set_deaf(false);
        let actions = plan(std::slice::from_ref(&w), &running(&engine));
        let taken = apply(&engine, actions, &s).await;
        assert_eq!(taken[0].result, Ok(()));
        assert_eq!(
            engine.config("hlb-3f2a9c1e").unwrap().witness,
            Some(gateway),
            "the late binding's re-check asks the gateway too"
        );
    }

    #[tokio::test]
    async fn a_takeover_waits_while_the_address_answers_elsewhere() {
        let engine = FakeEngine::new();
        let addr = std::net::Ipv4Addr::new(10, 77, 0, 150);
        let mut w = wanted(false, Some("eth1"));
        w.requested_ip = Some(addr);
        engine.set_answering(addr, true);
        let run = |w: Want, s: Settings| {
            let engine = engine.clone();
            async move {
                let actions = plan(std::slice::from_ref(&w), &running(&engine));
                apply(&engine, actions, &s).await
            }
        };
        let held = run(w.clone(), settings_guarded()).await;
        assert_eq!(held.len(), 1);
        assert!(held[0].guarded, "{held:?}");
        let message = held[0].result.clone().unwrap_err().to_string();
        assert!(
            message.contains("10.77.0.150") && message.contains("eth1"),
            "{message}"
        );
        assert!(engine.running().is_empty(), "not started while it answers");
        assert!(engine.links().is_empty(), "no link made either");
        assert_eq!(
            engine.take_calls(),
            vec![Call::Guard {
                parent: "eth1".into(),
                addr
            }]
        );

        engine.set_answering(addr, false);
        let taken = run(w.clone(), settings_guarded()).await;
        assert_eq!(taken[0].result, Ok(()));
        assert!(!taken[0].guarded);
        assert_eq!(engine.running(), vec!["hlb-3f2a9c1e"]);
        // The lease knows when the guard asked, so that a binding long
        // after it (the agent frozen meanwhile) asks again.
        assert!(engine.config("hlb-3f2a9c1e").unwrap().guarded_at.is_some());
        engine
            .stop("hlb-3f2a9c1e", StopMode::Handover)
            .await
            .unwrap();
        engine.take_calls();

        // Guard off: started even while it answers.
        engine.set_answering(addr, true);
        let off = run(w.clone(), settings()).await;
        assert_eq!(off[0].result, Ok(()));
        assert_eq!(engine.config("hlb-3f2a9c1e").unwrap().guarded_at, None);
        assert!(
            !engine
                .take_calls()
                .iter()
                .any(|c| matches!(c, Call::Guard { .. })),
            "no probe with the guard off"
        );
        engine
            .stop("hlb-3f2a9c1e", StopMode::Handover)
            .await
            .unwrap();

        // No address yet: nothing to guard.
        let fresh = run(wanted(false, Some("eth1")), settings_guarded()).await;
        assert_eq!(fresh[0].result, Ok(()));
        assert!(
            !engine
                .take_calls()
                .iter()
                .any(|c| matches!(c, Call::Guard { .. })),
            "no probe for a new address"
        );
    }

    #[test]
    fn the_guard_probe_fits_in_its_time() {
        let p = guard_probe(Duration::from_millis(150));
        assert_eq!(p.probes, 2);
        assert_eq!(p.interval + p.wait, Duration::from_millis(150));
    }
}
