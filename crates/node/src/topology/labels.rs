//! The pure decision of the topology relay: from what Harvester says (the
//! VMI's annotations, the live labels of its host Node when readable), what
//! the guest Node carries now and the configured keys, to the labels the
//! guest Node should carry and the merge patch that gets it there.
//!
//! No I/O here, so every rule is unit-tested.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use hna_contract::k8s_names::is_label_value;

pub(crate) type Labels = BTreeMap<String, String>;

/// Where the relayed values came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Source {
    /// The live labels of the Harvester Node the VMI runs on
    /// (`status.nodeName`): seen when the credentials may read Nodes.
    HostNode,
    /// The annotations Harvester copies onto the VMI from its host.
    VmiAnnotations,
}

/// What the guest Node should carry for the configured keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Desired {
    pub(crate) source: Source,
    /// Key → value for every configured key that has a valid value.
    pub(crate) labels: Labels,
    /// Configured keys whose source value is not a valid label value: they
    /// are left alone on the guest Node (neither set nor removed).
    pub(crate) invalid: Vec<(String, String)>,
}

/// The outcome of [`plan`].
#[derive(Debug, Clone, PartialEq)]
#[cfg(test)]
pub(crate) struct Plan {
    pub(crate) desired: Desired,
    /// The JSON merge patch for the guest Node (`{"metadata":{"labels":{…}}}`
    /// touching only configured keys, `null` removing one), or `None` when
    /// the Node already carries exactly the desired values.
    pub(crate) patch: Option<Value>,
}

/// The whole decision: source values in, merge patch out.
///
/// * `host_labels` is `Some` when the host Node's labels are known (the
///   credentials may read Nodes and the host exists): they then win over the
///   annotations, so a host relabel is seen even before Harvester updates the
///   VMI. `None` falls back to the VMI annotations.
/// * A configured key the source lacks is removed from the guest Node.
/// * Keys that are not configured are never touched.
#[cfg(test)]
pub(crate) fn plan(
    vmi_annotations: &Labels,
    host_labels: Option<&Labels>,
    guest_labels: &Labels,
    keys: &[String],
) -> Plan {
    let desired = desired(vmi_annotations, host_labels, keys);
    let patch = patch(&desired, guest_labels, keys);
    Plan { desired, patch }
}

/// The values the guest Node should carry.
pub(crate) fn desired(
    vmi_annotations: &Labels,
    host_labels: Option<&Labels>,
    keys: &[String],
) -> Desired {
    let (source, from) = match host_labels {
        Some(h) => (Source::HostNode, h),
        None => (Source::VmiAnnotations, vmi_annotations),
    };
    let mut labels = Labels::new();
    let mut invalid = Vec::new();
    for key in keys {
        if let Some(v) = from.get(key) {
            if is_label_value(v) {
                labels.insert(key.clone(), v.clone());
            } else {
                invalid.push((key.clone(), v.clone()));
            }
        }
    }
    Desired {
        source,
        labels,
        invalid,
    }
}

/// The merge patch that makes `guest_labels` agree with `desired` on the
/// configured keys, or `None` when they already agree.
pub(crate) fn patch(desired: &Desired, guest_labels: &Labels, keys: &[String]) -> Option<Value> {
    let mut changes = Map::new();
    for key in keys {
        if desired.invalid.iter().any(|(k, _)| k == key) {
            continue;
        }
        match (desired.labels.get(key), guest_labels.get(key)) {
            (Some(want), Some(have)) if want == have => {}
            (Some(want), _) => {
                changes.insert(key.clone(), Value::String(want.clone()));
            }
            (None, Some(_)) => {
                changes.insert(key.clone(), Value::Null);
            }
            (None, None) => {}
        }
    }
    (!changes.is_empty()).then(|| json!({ "metadata": { "labels": changes } }))
}

/// `region/zone`-style short form of the relayed values, in key order;
/// `-` for a key without a value.
pub(crate) fn short(labels: &Labels, keys: &[String]) -> String {
    keys.iter()
        .map(|k| labels.get(k).map(String::as_str).unwrap_or("-"))
        .collect::<Vec<_>>()
        .join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    const REGION: &str = "topology.kubernetes.io/region";
    const ZONE: &str = "topology.kubernetes.io/zone";

    fn keys() -> Vec<String> {
        hna_contract::k8s_names::DEFAULT_TOPOLOGY_KEYS
            .iter()
            .map(|k| k.to_string())
            .collect()
    }

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn annotations_are_relayed_to_a_bare_node() {
        let p = plan(
            &labels(&[
                (REGION, "us-east-1"),
                (ZONE, "us-east-1a"),
                ("harvesterhci.io/other", "x"),
            ]),
            None,
            &labels(&[("kubernetes.io/hostname", "guest-1")]),
            &keys(),
        );
        assert_eq!(p.desired.source, Source::VmiAnnotations);
        assert_eq!(
            p.patch,
            Some(json!({"metadata":{"labels":{REGION:"us-east-1", ZONE:"us-east-1a"}}}))
        );
    }

    #[test]
    fn nothing_to_do_when_in_sync() {
        let src = labels(&[(REGION, "r"), (ZONE, "z")]);
        let guest = labels(&[(REGION, "r"), (ZONE, "z"), ("other", "1")]);
        assert_eq!(plan(&src, None, &guest, &keys()).patch, None);
    }

    #[test]
    fn host_labels_win_over_stale_annotations() {
        let ann = labels(&[(REGION, "r"), (ZONE, "old")]);
        let host = labels(&[
            (REGION, "r"),
            (ZONE, "new"),
            ("kubernetes.io/hostname", "h"),
        ]);
        let guest = labels(&[(REGION, "r"), (ZONE, "old")]);
        let p = plan(&ann, Some(&host), &guest, &keys());
        assert_eq!(p.desired.source, Source::HostNode);
        assert_eq!(p.patch, Some(json!({"metadata":{"labels":{ZONE:"new"}}})));
    }

    #[test]
    fn a_key_that_disappears_is_removed_with_null() {
        // Host readable, zone label removed from the host.
        let ann = labels(&[(REGION, "r"), (ZONE, "z")]);
        let host = labels(&[(REGION, "r")]);
        let guest = labels(&[(REGION, "r"), (ZONE, "z")]);
        let p = plan(&ann, Some(&host), &guest, &keys());
        assert_eq!(p.patch, Some(json!({"metadata":{"labels":{ZONE: null}}})));
        // Annotations only.
        let p = plan(&labels(&[]), None, &guest, &keys());
        assert_eq!(
            p.patch,
            Some(json!({"metadata":{"labels":{REGION: null, ZONE: null}}}))
        );
    }

    #[test]
    fn unconfigured_keys_are_never_touched() {
        let src = labels(&[(REGION, "r"), ("example.com/rack", "7")]);
        let guest = labels(&[
            ("example.com/rack", "1"),
            ("node-role.kubernetes.io/worker", "true"),
        ]);
        let p = plan(&src, None, &guest, &[REGION.to_string()]);
        assert_eq!(p.patch, Some(json!({"metadata":{"labels":{REGION:"r"}}})));
        let p = plan(&src, None, &guest, &["example.com/rack".to_string()]);
        assert_eq!(
            p.patch,
            Some(json!({"metadata":{"labels":{"example.com/rack":"7"}}}))
        );
    }

    #[test]
    fn invalid_values_are_left_alone() {
        let src = labels(&[(REGION, "not a label value"), (ZONE, "z")]);
        let guest = labels(&[(REGION, "r")]);
        let p = plan(&src, None, &guest, &keys());
        assert_eq!(
            p.desired.invalid,
            vec![(REGION.to_string(), "not a label value".to_string())]
        );
        assert_eq!(p.patch, Some(json!({"metadata":{"labels":{ZONE:"z"}}})));
    }

    #[test]
    fn an_empty_value_is_a_value() {
        let src = labels(&[(ZONE, "")]);
        let p = plan(&src, None, &labels(&[]), &[ZONE.to_string()]);
        assert_eq!(p.patch, Some(json!({"metadata":{"labels":{ZONE:""}}})));
    }

    #[test]
    fn short_form_follows_key_order() {
        let l = labels(&[(REGION, "us-east-1"), (ZONE, "us-east-1a")]);
        assert_eq!(short(&l, &keys()), "us-east-1/us-east-1a");
        assert_eq!(short(&labels(&[(ZONE, "z")]), &keys()), "-/z");
    }
}
