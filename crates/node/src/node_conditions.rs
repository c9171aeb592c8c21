//! Node conditions the agent owns on its own Node (`MacvlanReady`, and the
//! guest-agent condition later). The agent is the only writer of these
//! condition types; it never touches other conditions, labels or Nodes.
//!
//! Like node-problem-detector, it sends a strategic-merge patch to
//! `nodes/<self>/status` (conditions merge by `type`), which the Node
//! authorizer and NodeRestriction allow with the node's own credentials.

use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// How often the Node is read again, and its conditions written if they
/// are not what the agent wants (something else changed them). Never
/// written when unchanged: the agent's liveness is its LoadBalancerNode
/// status and its LAN membership, and a re-send every 5 minutes from every
/// node is 1.7 writes a second at 500 nodes on top of the kubelet's own
/// (issue #30).
pub const RECHECK: Duration = Duration::from_secs(300);

/// One condition as the agent wants it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub ready: bool,
    pub reason: String,
    pub message: String,
}

/// The fields of an existing condition that decide whether to patch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Existing {
    pub(crate) type_: String,
    pub(crate) status: String,
    pub(crate) reason: String,
    pub(crate) message: String,
    pub(crate) last_transition_time: Option<String>,
}

fn status_word(ready: bool) -> &'static str {
    if ready { "True" } else { "False" }
}

/// The patch body for `wanted`, or `None` when every wanted condition is
/// already present as wanted and no heartbeat is due. `lastTransitionTime`
/// is kept when the status did not change.
pub(crate) fn plan(
    existing: &[Existing],
    wanted: &[Condition],
    now: SystemTime,
    heartbeat_due: bool,
) -> Option<Value> {
    let stamp = humantime::format_rfc3339_seconds(now).to_string();
    let mut changed = false;
    let conditions: Vec<Value> = wanted
        .iter()
        .map(|w| {
            let old = existing.iter().find(|e| e.type_ == w.type_);
            let status = status_word(w.ready);
            let same_status = old.is_some_and(|o| o.status == status);
            if !(same_status && old.is_some_and(|o| o.reason == w.reason && o.message == w.message))
            {
                changed = true;
            }
            let transition = match old {
                Some(o) if same_status => o
                    .last_transition_time
                    .clone()
                    .unwrap_or_else(|| stamp.clone()),
                _ => stamp.clone(),
            };
            json!({
                "type": w.type_,
                "status": status,
                "reason": w.reason,
                "message": w.message,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": transition,
            })
        })
        .collect();
    (changed || heartbeat_due).then(|| json!({ "status": { "conditions": conditions } }))
}

fn existing_from(node: &Node) -> Vec<Existing> {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .map(|cs| {
            cs.iter()
                .map(|c| Existing {
                    type_: c.type_.clone(),
                    status: c.status.clone(),
                    reason: c.reason.clone().unwrap_or_default(),
                    message: c.message.clone().unwrap_or_default(),
                    last_transition_time: c
                        .last_transition_time
                        .as_ref()
                        .and_then(|t| serde_json::to_value(t).ok())
                        .and_then(|v| v.as_str().map(str::to_string)),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Outcome of one reconcile, for `status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state")]
pub enum Reported {
    /// No cluster connection yet.
    NotConnected,
    /// The Node object does not exist yet (the kubelet registers it).
    NodeNotRegistered,
    /// Conditions are on the Node as wanted.
    Reported {
        at: String,
    },
    Failed {
        error: String,
    },
}

/// Reads this node and patches its conditions if needed.
pub async fn reconcile(
    client: &kube::Client,
    node_name: &str,
    wanted: &[Condition],
    heartbeat_due: bool,
) -> Reported {
    let nodes: Api<Node> = Api::all(client.clone());
    let node = match nodes.get_opt(node_name).await {
        Ok(Some(node)) => node,
        Ok(None) => return Reported::NodeNotRegistered,
        Err(e) => {
            return Reported::Failed {
                error: format!("reading Node {node_name}: {e}"),
            };
        }
    };
    let now = SystemTime::now();
    let Some(body) = plan(&existing_from(&node), wanted, now, heartbeat_due) else {
        return Reported::Reported {
            at: humantime::format_rfc3339_seconds(now).to_string(),
        };
    };
    match nodes
        .patch_status(node_name, &PatchParams::default(), &Patch::Strategic(body))
        .await
    {
        Ok(_) => Reported::Reported {
            at: humantime::format_rfc3339_seconds(now).to_string(),
        },
        Err(e) => Reported::Failed {
            error: format!("patching the status of Node {node_name}: {e}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cond(ready: bool, reason: &str) -> Condition {
        Condition {
            type_: "MacvlanReady".into(),
            ready,
            reason: reason.into(),
            message: "m".into(),
        }
    }

    #[test]
    fn new_condition_is_sent_with_both_times() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let body = plan(&[], &[cond(true, "Loaded")], now, false).unwrap();
        let c = &body["status"]["conditions"][0];
        assert_eq!(c["type"], "MacvlanReady");
        assert_eq!(c["status"], "True");
        assert_eq!(c["lastTransitionTime"], c["lastHeartbeatTime"]);
    }

    #[test]
    fn unchanged_condition_waits_for_the_heartbeat_and_keeps_transition_time() {
        let existing = vec![Existing {
            type_: "MacvlanReady".into(),
            status: "True".into(),
            reason: "Loaded".into(),
            message: "m".into(),
            last_transition_time: Some("2026-01-01T00:00:00Z".into()),
        }];
        let now = SystemTime::now();
        assert!(plan(&existing, &[cond(true, "Loaded")], now, false).is_none());
        let body = plan(&existing, &[cond(true, "Loaded")], now, true).unwrap();
        assert_eq!(
            body["status"]["conditions"][0]["lastTransitionTime"],
            "2026-01-01T00:00:00Z"
        );
        // Same status, new reason: patched, transition time kept.
        let body = plan(&existing, &[cond(true, "LoadedByAgent")], now, false).unwrap();
        assert_eq!(
            body["status"]["conditions"][0]["lastTransitionTime"],
            "2026-01-01T00:00:00Z"
        );
        // Status flips: new transition time.
        let body = plan(&existing, &[cond(false, "ModuleNotFound")], now, false).unwrap();
        assert_ne!(
            body["status"]["conditions"][0]["lastTransitionTime"],
            "2026-01-01T00:00:00Z"
        );
    }
}
