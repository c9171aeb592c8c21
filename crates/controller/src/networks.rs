//! Which uplink a Service's `cloudprovider.harvesterhci.io/network` means.
//!
//! The Harvester cloud provider keeps a map from VM network (a Multus
//! NetworkAttachmentDefinition, `namespace/name`) to the guest's Linux
//! interface in the ConfigMap `kube-system/harvester-nad-mapping`, key
//! `interface-nad-mapping`, as a JSON object such as
//! `{"default/mgmt":"enp1s0","default/net123":"enp2s0"}`; it lists only the
//! networks that sit on the same interface on every node. From that map it
//! writes `kube-vip.io/serviceInterface`, after a round trip. The controller
//! reads the same map, so a Service naming a network gets its uplink at
//! once, and also under a cloud provider that predates the annotation.
//!
//! Precedence: `kube-vip.io/serviceInterface` (set by the cloud provider or
//! by hand) wins; then the network through this map; then the node's own
//! default (the agent's `uplink`, else its default route). A network that
//! cannot be resolved is refused rather than put on the default uplink,
//! where DHCP would answer from the wrong network.

use std::collections::{BTreeMap, BTreeSet};

use hna_contract::{Annotations, harvester, kube_vip};

/// Where the map lives.
pub(crate) const CONFIG_MAP_NAMESPACE: &str = "kube-system";
pub(crate) const CONFIG_MAP_NAME: &str = "harvester-nad-mapping";
pub(crate) const CONFIG_MAP_KEY: &str = "interface-nad-mapping";

/// What the controller knows of the map.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) enum NetworkMap {
    /// Not listed yet: Services naming a network wait, unrefused.
    #[default]
    Unknown,
    /// The ConfigMap does not exist.
    Missing,
    /// It could not be read or parsed; the reason.
    Unreadable(String),
    /// Network → interface.
    Known(BTreeMap<String, String>),
}

impl NetworkMap {
    /// The map from the ConfigMap's data value (`None`: the key is absent).
    pub(crate) fn parse(value: Option<&str>) -> NetworkMap {
        let Some(text) = value.map(str::trim).filter(|t| !t.is_empty()) else {
            return NetworkMap::Known(BTreeMap::new());
        };
        match serde_json::from_str::<BTreeMap<String, String>>(text) {
            Ok(map) => NetworkMap::Known(
                map.into_iter()
                    .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                    .filter(|(k, v)| !k.is_empty() && !v.is_empty())
                    .collect(),
            ),
            Err(e) => NetworkMap::Unreadable(format!(
                "{CONFIG_MAP_KEY} in {CONFIG_MAP_NAMESPACE}/{CONFIG_MAP_NAME} is not a JSON object of network to interface: {e}"
            )),
        }
    }
}

/// Why a Service has no uplink yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NoUplink {
    /// The map has not been read yet.
    Wait,
    /// Refused; the message says what to fix.
    Refused(String),
}

/// The uplink a Service asks for: `Ok(None)` means the node's default.
///
/// `kube-vip.io/serviceInterface` is taken only from an allow-list: an
/// interface the network map names, or one of `node_uplinks` (the uplinks
/// the nodes report, their configured or default-route interface). Any
/// other (a CNI bridge, a Pod's veth, a storage NIC) is refused: it is a
/// tenant's annotation, and the agent runs as root.
pub(crate) fn uplink_of(
    annotations: &Annotations,
    map: &NetworkMap,
    node_uplinks: &BTreeSet<String>,
) -> Result<Option<String>, NoUplink> {
    let named = annotations
        .get(kube_vip::SERVICE_INTERFACE)
        .map(|v| v.trim())
        .filter(|v| !v.is_empty() && *v != "auto");
    if let Some(iface) = named {
        let mapped: BTreeSet<&str> = match map {
            NetworkMap::Known(m) => m.values().map(String::as_str).collect(),
            _ => BTreeSet::new(),
        };
        if node_uplinks.contains(iface) || mapped.contains(iface) {
            return Ok(Some(iface.to_string()));
        }
        // Not yet known to be wrong: the map or the nodes' reports may
        // still be on their way.
        if matches!(map, NetworkMap::Unknown) || node_uplinks.is_empty() {
            return Err(NoUplink::Wait);
        }
        let list = |set: BTreeSet<&str>| {
            if set.is_empty() {
                "none".to_string()
            } else {
                set.into_iter().collect::<Vec<_>>().join(", ")
            }
        };
        return Err(NoUplink::Refused(format!(
            "{} `{iface}` is not an uplink: a LoadBalancer address may live only on a node's uplink ({}) or on an interface {CONFIG_MAP_NAMESPACE}/{CONFIG_MAP_NAME} names ({}); remove the annotation or set it to one of those",
            kube_vip::SERVICE_INTERFACE,
            list(node_uplinks.iter().map(String::as_str).collect()),
            list(mapped),
        )));
    }
    let Some(network) = annotations
        .get(harvester::NETWORK)
        .map(|v| v.trim())
        .filter(|v| !v.is_empty())
    else {
        return Ok(None);
    };
    let fix = format!(
        "set {} to the interface, or remove {}",
        kube_vip::SERVICE_INTERFACE,
        harvester::NETWORK
    );
    match map {
        NetworkMap::Unknown => Err(NoUplink::Wait),
        NetworkMap::Missing => Err(NoUplink::Refused(format!(
            "network {network}: ConfigMap {CONFIG_MAP_NAMESPACE}/{CONFIG_MAP_NAME} does not exist (the Harvester cloud provider writes it); {fix}"
        ))),
        NetworkMap::Unreadable(why) => Err(NoUplink::Refused(format!(
            "network {network}: {why}; {fix}"
        ))),
        NetworkMap::Known(map) => match map.get(network) {
            Some(iface) => Ok(Some(iface.clone())),
            None => Err(NoUplink::Refused(format!(
                "network {network} is not in {CONFIG_MAP_NAMESPACE}/{CONFIG_MAP_NAME} (it lists {}: only networks on the same interface on every node); {fix}",
                if map.is_empty() {
                    "none".to_string()
                } else {
                    map.keys().cloned().collect::<Vec<_>>().join(", ")
                }
            ))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ann(pairs: &[(&str, &str)]) -> Annotations {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn known() -> NetworkMap {
        NetworkMap::parse(Some(
            r#"{"default/mgmt":"enp1s0","default/net123":" enp2s0 "}"#,
        ))
    }

    #[test]
    fn the_cloud_providers_format_parses() {
        let NetworkMap::Known(map) = known() else {
            panic!()
        };
        assert_eq!(map["default/net123"], "enp2s0");
        assert_eq!(NetworkMap::parse(None), NetworkMap::Known(BTreeMap::new()));
        assert!(matches!(
            NetworkMap::parse(Some("[1,2]")),
            NetworkMap::Unreadable(m) if m.contains(CONFIG_MAP_KEY)
        ));
    }

    #[test]
    fn service_interface_wins_then_the_network_then_the_node_default() {
        let both = ann(&[
            (kube_vip::SERVICE_INTERFACE, "eth9"),
            (harvester::NETWORK, "default/net123"),
        ]);
        let uplinks: BTreeSet<String> = ["eth9".to_string()].into();
        assert_eq!(
            uplink_of(&both, &known(), &uplinks),
            Ok(Some("eth9".into()))
        );
        assert_eq!(
            uplink_of(&both, &NetworkMap::Unknown, &uplinks),
            Ok(Some("eth9".into())),
            "a node's uplink: no need to wait for the map"
        );
        let net = ann(&[
            (kube_vip::SERVICE_INTERFACE, "auto"),
            (harvester::NETWORK, "default/net123"),
        ]);
        assert_eq!(
            uplink_of(&net, &known(), &uplinks),
            Ok(Some("enp2s0".into()))
        );
        assert_eq!(
            uplink_of(&ann(&[]), &NetworkMap::Missing, &uplinks),
            Ok(None)
        );
    }

    #[test]
    fn a_named_interface_must_be_an_uplink_or_a_mapped_one() {
        let uplinks: BTreeSet<String> = ["eth0".to_string()].into();
        let named = |iface: &str| ann(&[(kube_vip::SERVICE_INTERFACE, iface)]);
        assert_eq!(
            uplink_of(&named("enp2s0"), &known(), &uplinks),
            Ok(Some("enp2s0".into())),
            "mapped"
        );
        assert_eq!(
            uplink_of(&named("eth0"), &known(), &uplinks),
            Ok(Some("eth0".into()))
        );
        for hostile in ["cni0", "cali1234", "flannel.1", "lo"] {
            let Err(NoUplink::Refused(m)) = uplink_of(&named(hostile), &known(), &uplinks) else {
                panic!("{hostile} accepted")
            };
            assert!(
                m.contains(hostile) && m.contains("eth0") && m.contains("enp1s0, enp2s0"),
                "{m}"
            );
        }
        // Before the map or any node's report: wait, do not refuse.
        assert_eq!(
            uplink_of(&named("cni0"), &NetworkMap::Unknown, &uplinks),
            Err(NoUplink::Wait)
        );
        assert_eq!(
            uplink_of(&named("cni0"), &known(), &BTreeSet::new()),
            Err(NoUplink::Wait)
        );
    }

    #[test]
    fn an_unresolvable_network_waits_for_the_map_then_is_refused_with_the_fix() {
        let net = ann(&[(harvester::NETWORK, "default/other")]);
        let none = BTreeSet::new();
        assert_eq!(
            uplink_of(&net, &NetworkMap::Unknown, &none),
            Err(NoUplink::Wait)
        );
        for map in [
            known(),
            NetworkMap::Missing,
            NetworkMap::Unreadable("bad".into()),
        ] {
            let Err(NoUplink::Refused(m)) = uplink_of(&net, &map, &none) else {
                panic!("{map:?}")
            };
            assert!(m.contains("default/other"), "{m}");
            assert!(m.contains(kube_vip::SERVICE_INTERFACE), "{m}");
        }
        let Err(NoUplink::Refused(m)) = uplink_of(&net, &known(), &none) else {
            panic!()
        };
        assert!(m.contains("default/mgmt, default/net123"), "{m}");
    }
}
