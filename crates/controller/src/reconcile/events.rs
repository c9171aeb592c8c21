//! What the controller tells about a Service: the Events of a decision,
//! their reasons and the wording they share.

use hna_contract::ServiceKey;

use super::world::ServiceIn;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum EventType {
    Normal,
    Warning,
}

/// An Event on a Service.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventOut {
    pub(crate) service: ServiceKey,
    pub(crate) uid: String,
    pub(crate) type_: EventType,
    pub reason: &'static str,
    pub(crate) message: String,
}

/// Event reasons (the `reason` field: CamelCase, stable).
pub(crate) mod reason {
    pub(crate) const HOLDER_CHOSEN: &str = "HolderChosen";
    pub(crate) const MOVED: &str = "HolderMoved";
    pub(crate) const ADDRESS_ASSIGNED: &str = "AddressAssigned";
    pub(crate) const ADDRESS_SHARED: &str = "AddressShared";
    pub(crate) const NO_ELIGIBLE_NODE: &str = "NoEligibleNode";
    pub(crate) const RELEASING: &str = "Releasing";
    pub(crate) const RELEASED: &str = "Released";
    pub(crate) const RELEASED_WITHOUT_DHCPRELEASE: &str = "ReleasedWithoutDHCPRelease";
    pub(crate) const RELEASE_DEFERRED: &str = "ReleaseDeferred";
    pub(crate) const SECONDARIES_LIVE: &str = "SecondariesStillShareAddress";
    pub(crate) const IPAM_CHANGE_REFUSED: &str = "IPAMChangeRefused";
    pub(crate) const PORTS_OVERLAP: &str = "PortsOverlap";
    pub(crate) const PRIMARY_IS_SECONDARY: &str = "PrimaryIsSecondary";
    pub(crate) const PRIMARY_NOT_OURS: &str = "PrimaryNotOurs";
    pub(crate) const INVALID: &str = "InvalidConfiguration";
    pub(crate) const HANDED_OVER: &str = "HandedOver";
    pub(crate) const NETWORK_UNRESOLVED: &str = "NetworkNotResolved";
    pub(crate) const IPV4_REQUIRED: &str = "IPv4Required";
    pub(crate) const IPV6_NOT_SERVED: &str = "IPv6NotServed";
    pub(crate) const SHARING_ENDED: &str = "SharingEnded";
    pub(crate) const IDENTITY_IN_USE: &str = "AddressIdentityInUse";
    pub(crate) const ADDRESS_IMPLAUSIBLE: &str = "AddressImplausible";
    pub(crate) const MAC_REFUSED: &str = "MACAddressRefused";
}

/// The Events of one decision, in the order it came to them.
#[derive(Debug, Default)]
pub(super) struct Events(Vec<EventOut>);

impl Events {
    pub(super) fn tell(
        &mut self,
        s: &ServiceIn,
        type_: EventType,
        reason: &'static str,
        message: String,
    ) {
        self.0.push(EventOut {
            service: s.key.clone(),
            uid: s.uid.clone(),
            type_,
            reason,
            message,
        })
    }

    pub(super) fn into_vec(self) -> Vec<EventOut> {
        self.0
    }
}

/// `default/api, default/db and 2 Services in other namespaces`: the names
/// of `namespace`'s own Services only, the others counted.
pub(super) fn describe_sharers(namespace: &str, sharers: &[&ServiceKey]) -> String {
    let (own, others): (Vec<&&ServiceKey>, Vec<&&ServiceKey>) =
        sharers.iter().partition(|k| k.namespace == namespace);
    let mut parts: Vec<String> = own.iter().map(|k| k.to_string()).collect();
    match others.len() {
        0 => {}
        1 => parts.push("1 Service in another namespace".into()),
        n => parts.push(format!("{n} Services in other namespaces")),
    }
    parts.join(", ")
}
