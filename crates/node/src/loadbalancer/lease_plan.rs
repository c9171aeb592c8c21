//! What the node does about its assignments, as a pure function: the
//! assignments from its `LoadBalancerNode` object and the leases running
//! now in; starts and stops out. Idempotent: a plan over its own outcome
//! is empty.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use hna_contract::{INTERFACE_PREFIX, node_object::Assignment};
use hna_dhcp::StopMode;

/// One assignment, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Want {
    pub(crate) service: String,
    pub(crate) interface: String,
    pub(crate) mac: [u8; 6],
    /// Empty: send none.
    pub(crate) client_id: Vec<u8>,
    pub(crate) hostname: Option<String>,
    pub(crate) requested_ip: Option<Ipv4Addr>,
    pub(crate) uplink: Option<String>,
    pub(crate) release: bool,
}

/// An assignment with a field this node cannot use.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, thiserror::Error)]
#[error("assignment for {service}: {field} `{value}` is not valid")]
pub(crate) struct InvalidAssignment {
    service: String,
    field: &'static str,
    value: String,
}

/// Checks an assignment; an unusable one is reported and left alone (the
/// running state is not touched because of it).
pub(crate) fn want(a: &Assignment) -> Result<Want, InvalidAssignment> {
    let what = |field: &'static str, v: &str| InvalidAssignment {
        service: a.service.clone(),
        field,
        value: v.to_string(),
    };
    let suffix = a
        .interface
        .strip_prefix(INTERFACE_PREFIX)
        .ok_or_else(|| what("interface", &a.interface))?;
    if suffix.is_empty() || a.interface.len() > 15 || !suffix.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return Err(what("interface", &a.interface));
    }
    let mac = hna_contract::mac::parse_unicast(&a.mac).ok_or_else(|| what("mac", &a.mac))?;
    // Empty: no option 61 (a Service kube-vip served without a hostname).
    let client_id = match a.client_id.as_str() {
        "" => Vec::new(),
        hex => hex_bytes(hex).ok_or_else(|| what("clientId", hex))?,
    };
    let requested_ip = match &a.requested_ip {
        Some(ip) => Some(ip.parse().map_err(|_| what("requestedIP", ip))?),
        None => None,
    };
    Ok(Want {
        service: a.service.clone(),
        interface: a.interface.clone(),
        mac,
        client_id,
        hostname: a.hostname.clone(),
        requested_ip,
        uplink: a.uplink.clone(),
        release: a.release,
    })
}

fn hex_bytes(v: &str) -> Option<Vec<u8>> {
    if v.is_empty() || !v.len().is_multiple_of(2) {
        return None;
    }
    (0..v.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(v.get(i..i + 2)?, 16).ok())
        .collect()
}

impl Want {
    /// What a lease started for this assignment runs with, besides its MAC.
    pub(crate) fn started_as(&self) -> StartedAs {
        StartedAs {
            parent: self.uplink.clone(),
            client_id: self.client_id.clone(),
            hostname: self.hostname.clone(),
        }
    }
}

/// The identity and parent a running lease was started with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StartedAs {
    pub(crate) parent: Option<String>,
    pub(crate) client_id: Vec<u8>,
    pub(crate) hostname: Option<String>,
}

/// A lease the engine runs now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Running {
    pub(crate) interface: String,
    pub(crate) mac: [u8; 6],
    /// `None` when not known (nothing restarts for it then).
    pub(crate) started_as: Option<StartedAs>,
    /// The kernel deleted its address when its lifetime ran out
    /// (`EXPIRED`): started again, so that the takeover guard asks the
    /// LAN before the address comes back.
    pub(crate) expired: bool,
}

/// Whether a running lease no longer matches its assignment: another MAC,
/// client identifier or hostname, or another parent (a changed
/// `serviceInterface` or network mapping, or the default uplink moved; the
/// caller resolves `uplink` to the default one). A `None` parent wanted
/// (none can be resolved now) keeps the lease where it runs.
fn outdated(w: &Want, r: &Running) -> bool {
    w.mac != r.mac
        || r.started_as.as_ref().is_some_and(|s| {
            s.client_id != w.client_id
                || s.hostname != w.hostname
                || (w.uplink.is_some() && s.parent != w.uplink)
        })
}

/// Whether the DHCP server would see another client: another MAC, or
/// (when known) another client identifier.
fn new_client(w: &Want, r: &Running) -> bool {
    w.mac != r.mac
        || r.started_as
            .as_ref()
            .is_some_and(|s| s.client_id != w.client_id)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    Start(Want),
    Stop { interface: String, mode: StopMode },
}

/// Stops first (so a changed identity frees its name before it starts
/// again), then starts, each in interface order.
pub(crate) fn plan(wanted: &[Want], running: &[Running]) -> Vec<Action> {
    let wanted: BTreeMap<&str, &Want> = wanted.iter().map(|w| (w.interface.as_str(), w)).collect();
    let running: BTreeMap<&str, &Running> =
        running.iter().map(|r| (r.interface.as_str(), r)).collect();
    let mut stops = Vec::new();
    let mut starts = Vec::new();
    for (name, r) in &running {
        let stop = |mode| Action::Stop {
            interface: name.to_string(),
            mode,
        };
        match wanted.get(name) {
            // Ours no more, or moved to another node: the new holder asks
            // for the same lease, so nothing may be released.
            None => stops.push(stop(StopMode::Handover)),
            Some(w) if w.release => stops.push(stop(StopMode::Release)),
            // Another client (MAC or client identifier) for the same
            // Service: nobody asks for the old lease again, so it is
            // released, or changing `kube-vip.io/hwaddr` again and again
            // would drain the server's pool (issue #29).
            Some(w) if !r.expired && new_client(w, r) => {
                stops.push(stop(StopMode::Release));
                starts.push(Action::Start((*w).clone()));
            }
            Some(w) if r.expired || outdated(w, r) => {
                stops.push(stop(StopMode::Handover));
                starts.push(Action::Start((*w).clone()));
            }
            Some(_) => {}
        }
    }
    for (name, w) in &wanted {
        if !w.release && !running.contains_key(name) {
            starts.push(Action::Start((*w).clone()));
        }
    }
    stops.extend(starts);
    stops
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assignment(uid8: &str) -> Assignment {
        Assignment {
            service: format!("default/svc-{uid8}"),
            uid: format!("{uid8}-0000-4000-8000-000000000000"),
            interface: format!("hlb-{uid8}"),
            mac: "02:11:22:33:44:55".into(),
            client_id: "00686e61".into(),
            hostname: None,
            requested_ip: Some("10.77.0.150".into()),
            uplink: None,
            release: false,
        }
    }

    fn running(w: &Want) -> Running {
        Running {
            interface: w.interface.clone(),
            mac: w.mac,
            started_as: Some(w.started_as()),
            expired: false,
        }
    }

    /// Issue #20: a lease whose address the kernel let expire is handed
    /// over and started again (through the takeover guard); one being
    /// released is released; one no longer assigned just goes.
    #[test]
    fn an_expired_lease_starts_again() {
        let w = want(&assignment("0a0b0c0d")).unwrap();
        let mut r = running(&w);
        r.expired = true;
        assert_eq!(
            plan(std::slice::from_ref(&w), std::slice::from_ref(&r)),
            vec![
                Action::Stop {
                    interface: w.interface.clone(),
                    mode: StopMode::Handover
                },
                Action::Start(w.clone())
            ]
        );
        let mut gone = w.clone();
        gone.release = true;
        assert_eq!(
            plan(&[gone], std::slice::from_ref(&r)),
            vec![Action::Stop {
                interface: w.interface.clone(),
                mode: StopMode::Release
            }]
        );
        assert_eq!(
            plan(&[], &[r]),
            vec![Action::Stop {
                interface: w.interface.clone(),
                mode: StopMode::Handover
            }]
        );
    }

    /// Applies a plan to a model of the engine, as the executor would.
    fn apply(running: &mut Vec<Running>, actions: &[Action]) {
        for a in actions {
            match a {
                Action::Stop { interface, .. } => running.retain(|r| &r.interface != interface),
                Action::Start(w) => running.push(super::tests::running(w)),
            }
        }
    }

    #[test]
    fn assignments_are_checked() {
        let w = want(&assignment("3f2a9c1e")).unwrap();
        assert_eq!(w.client_id, vec![0x00, 0x68, 0x6e, 0x61]);
        assert_eq!(w.requested_ip, Some(Ipv4Addr::new(10, 77, 0, 150)));
        for broken in [
            Assignment {
                interface: "vip-3f2a9c1e".into(),
                ..assignment("3f2a9c1e")
            },
            Assignment {
                interface: "hlb-3f2a9c1e00000".into(),
                ..assignment("3f2a9c1e")
            },
            Assignment {
                mac: "01:00:5e:00:00:01".into(),
                ..assignment("3f2a9c1e")
            },
            Assignment {
                client_id: "0".into(),
                ..assignment("3f2a9c1e")
            },
            Assignment {
                requested_ip: Some("10.77".into()),
                ..assignment("3f2a9c1e")
            },
        ] {
            let e = want(&broken).unwrap_err().to_string();
            assert!(e.starts_with("assignment for default/svc-3f2a9c1e"), "{e}");
        }
    }

    #[test]
    fn start_keep_move_release_and_idempotence() {
        let a = want(&assignment("aaaaaaaa")).unwrap();
        let b = want(&assignment("bbbbbbbb")).unwrap();
        let mut now: Vec<Running> = Vec::new();

        let p = plan(&[a.clone(), b.clone()], &now);
        assert_eq!(p, vec![Action::Start(a.clone()), Action::Start(b.clone())]);
        apply(&mut now, &p);
        assert_eq!(plan(&[a.clone(), b.clone()], &now), vec![], "idempotent");

        // b moves to another node: handed over, never released.
        let p = plan(std::slice::from_ref(&a), &now);
        assert_eq!(
            p,
            vec![Action::Stop {
                interface: "hlb-bbbbbbbb".into(),
                mode: StopMode::Handover
            }]
        );
        apply(&mut now, &p);

        // a's Service is deleted: released, and not started again.
        let gone = Want {
            release: true,
            ..a.clone()
        };
        let p = plan(std::slice::from_ref(&gone), &now);
        assert_eq!(
            p,
            vec![Action::Stop {
                interface: "hlb-aaaaaaaa".into(),
                mode: StopMode::Release
            }]
        );
        apply(&mut now, &p);
        assert_eq!(
            plan(&[gone], &now),
            vec![],
            "a released lease stays released"
        );
    }

    /// Issue #29: another MAC is another DHCP client; its old lease is
    /// asked for by nobody again, so it is released, not handed over.
    #[test]
    fn a_changed_mac_releases_the_old_lease_and_starts_again() {
        let a = want(&assignment("aaaaaaaa")).unwrap();
        let now = vec![Running {
            interface: a.interface.clone(),
            mac: [0x02, 0, 0, 0, 0, 1],
            started_as: None,
            expired: false,
        }];
        assert_eq!(
            plan(std::slice::from_ref(&a), &now),
            vec![
                Action::Stop {
                    interface: "hlb-aaaaaaaa".into(),
                    mode: StopMode::Release
                },
                Action::Start(a)
            ]
        );
    }

    /// Issue #22: a changed parent or hostname reaches a running lease
    /// (handed over and started again, never released); a changed client
    /// identifier is another client (issue #29: released).
    #[test]
    fn a_changed_parent_or_identity_restarts_the_lease() {
        let mut a = want(&assignment("aaaaaaaa")).unwrap();
        a.uplink = Some("eth0".into());
        let now = vec![running(&a)];
        assert_eq!(plan(std::slice::from_ref(&a), &now), vec![]);
        let restart = |w: &Want, mode| {
            vec![
                Action::Stop {
                    interface: "hlb-aaaaaaaa".into(),
                    mode,
                },
                Action::Start(w.clone()),
            ]
        };
        for (changed, mode) in [
            (
                Want {
                    uplink: Some("eth1".into()),
                    ..a.clone()
                },
                StopMode::Handover,
            ),
            (
                Want {
                    hostname: Some("web".into()),
                    ..a.clone()
                },
                StopMode::Handover,
            ),
            (
                Want {
                    client_id: vec![1, 2],
                    ..a.clone()
                },
                StopMode::Release,
            ),
        ] {
            assert_eq!(
                plan(std::slice::from_ref(&changed), &now),
                restart(&changed, mode)
            );
        }
        // No parent can be resolved now (no default route, none named):
        // the lease stays where it runs.
        let unresolved = Want {
            uplink: None,
            ..a.clone()
        };
        assert_eq!(plan(&[unresolved], &now), vec![]);
        // Started before this process knew (adopted): left alone.
        let adopted = vec![Running {
            started_as: None,
            ..running(&a)
        }];
        let moved = Want {
            uplink: Some("eth1".into()),
            ..a
        };
        assert_eq!(plan(&[moved], &adopted), vec![]);
    }
}
