//! `harvester-node-agent check`: a one-shot, read-only preflight of this node.
//!
//! Each check yields a [`Check`]; the report is printed for people or as one
//! JSON object, and the exit code is 1 when any check fails.

use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use hna_edges::cluster::credentials::{self, Discovery, DiscoveryEnv};
use hna_node::config::{Config, ConfigError};
pub use hna_node::health::{Check, Status};
use hna_node::state_dir::{self, Inspection};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Report {
    pub(crate) checks: Vec<Check>,
    /// What the `cni` check advises applying, printed after the checks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) helm_chart_configs: Vec<Advice>,
}

/// A manifest to apply, and what it is for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Advice {
    pub(crate) title: String,
    pub(crate) text: String,
}

impl Report {
    pub(crate) fn failed(&self) -> bool {
        self.checks.iter().any(|c| c.status == Status::Fail)
    }

    pub(crate) fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("report serializes")
    }

    pub(crate) fn to_human(&self) -> String {
        let width = self.checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
        let mut out = String::new();
        for c in &self.checks {
            let tag = match c.status {
                Status::Ok => "ok  ",
                Status::Warn => "WARN",
                Status::Fail => "FAIL",
            };
            let _ = writeln!(
                out,
                "{tag}  {:width$}  {}: {}",
                c.name,
                c.reason,
                c.message,
                width = width
            );
            if !c.remediation.is_empty() {
                let _ = writeln!(
                    out,
                    "      {:width$}  fix: {}",
                    "",
                    c.remediation,
                    width = width
                );
            }
        }
        let fails = self
            .checks
            .iter()
            .filter(|c| c.status == Status::Fail)
            .count();
        let warns = self
            .checks
            .iter()
            .filter(|c| c.status == Status::Warn)
            .count();
        let _ = writeln!(
            out,
            "{} checks: {} failed, {} warnings",
            self.checks.len(),
            fails,
            warns
        );
        for a in &self.helm_chart_configs {
            let _ = write!(out, "\n# {}\n---\n{}", a.title, a.text);
        }
        out
    }
}

/// The configuration check, from the outcome of loading it.
pub(crate) fn config_check(loaded: &Result<Config, ConfigError>) -> Check {
    match loaded {
        Ok(cfg) => match &cfg.file {
            Some(path) => Check::new(
                "config",
                Status::Ok,
                "Loaded",
                format!("{} is valid", path.display()),
                "",
            ),
            None => Check::new(
                "config",
                Status::Ok,
                "Defaults",
                format!(
                    "no file at {}; built-in defaults, environment and flags apply",
                    hna_node::config::DEFAULT_CONFIG_PATH
                ),
                "",
            ),
        },
        Err(e) => Check::new(
            "config",
            Status::Fail,
            "Invalid",
            e.to_string(),
            "correct the named key (see `harvester-node-agent run --help` and the configuration reference in docs/operations.md); the daemon refuses to start until then",
        ),
    }
}

pub(crate) fn state_dir_check(cfg: &Config) -> Check {
    let path = cfg.state_dir.display();
    match state_dir::inspect(&cfg.state_dir) {
        Inspection::Writable => Check::new(
            "state-dir",
            Status::Ok,
            "Writable",
            format!("{path} is writable"),
            "",
        ),
        Inspection::WillBeCreated { ancestor } => Check::new(
            "state-dir",
            Status::Ok,
            "WillBeCreated",
            format!(
                "{path} does not exist yet; the daemon creates it (under writable {})",
                ancestor.display()
            ),
            "",
        ),
        Inspection::NotWritable { path: p, reason } => Check::new(
            "state-dir",
            Status::Fail,
            "NotWritable",
            format!("{} is not writable: {reason}", p.display()),
            "run the agent as root, or set state_dir to a writable directory (a read-only root needs StateDirectory= in the unit)",
        ),
        Inspection::NotADirectory { path: p } => Check::new(
            "state-dir",
            Status::Fail,
            "NotADirectory",
            format!(
                "{} is in the way of the state directory {path} and is not a directory",
                p.display()
            ),
            "remove or move that file, or set state_dir elsewhere",
        ),
    }
}

/// Looks for credentials and, when found, asks the API server for its
/// version. Finding nothing is a warning: a node that has not joined yet is
/// normal, and the daemon picks the credentials up when they appear.
pub(crate) async fn kubeconfig_checks(
    cfg: &Config,
    env: &dyn DiscoveryEnv,
    timeout: Duration,
) -> Vec<Check> {
    let found = credentials::discover(&cfg.credential_settings(), env);
    let where_ = match &found {
        Discovery::File { path, source } => {
            format!(
                "{} ({})",
                path.display(),
                serde_json::to_value(source).unwrap().as_str().unwrap_or("")
            )
        }
        Discovery::InCluster => "in-cluster service account".to_string(),
        Discovery::NotFound {
            searched,
            configured,
        } => {
            let list = searched
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ");
            return vec![if *configured {
                Check::new(
                    "kubeconfig",
                    Status::Fail,
                    "ConfiguredFileMissing",
                    format!("configured kubeconfig {list} does not exist"),
                    "fix the `kubeconfig` setting, or unset it to use discovery (RKE2, K3s, kubeadm kubelet kubeconfigs)",
                )
            } else {
                Check::new(
                    "kubeconfig",
                    Status::Warn,
                    "NotFound",
                    format!(
                        "no kubeconfig yet (searched {list}); normal before the node joins the cluster"
                    ),
                    "nothing, if the node is still joining; otherwise set `kubeconfig` to the node's kubeconfig",
                )
            }];
        }
    };
    let mut checks = vec![Check::new(
        "kubeconfig",
        Status::Ok,
        "Found",
        format!("using {where_}"),
        "",
    )];
    checks.push(match credentials::connect(&found, timeout).await {
        Ok(conn) => Check::new(
            "api-server",
            Status::Ok,
            "Reachable",
            format!("{} answered, version {}", conn.server, conn.server_version),
            "",
        ),
        Err(e) => Check::new(
            "api-server",
            Status::Warn,
            "Unreachable",
            format!("{e:#}"),
            "check the node's network path to the API server and that the kubeconfig's certificates are current; the daemon keeps retrying",
        ),
    });
    checks
}

/// Someone who asked for `api-server` by name gets an entry of that name,
/// also when there were no credentials to connect with.
pub(crate) fn name_api_server(checks: &mut Vec<Check>) {
    if checks.iter().any(|c| c.name == "api-server") {
        return;
    }
    let failed_kubeconfig = checks
        .iter()
        .any(|c| c.name == "kubeconfig" && c.status == Status::Fail);
    checks.push(Check::new(
        "api-server",
        if failed_kubeconfig {
            Status::Fail
        } else {
            Status::Warn
        },
        "NoCredentials",
        "not checked: there are no credentials to connect with (see the kubeconfig entry)".into(),
        "see the kubeconfig entry",
    ));
}

/// The `macvlan` check, from a preflight result.
pub(crate) fn macvlan_check(state: &hna_node::kmod::MacvlanState) -> Check {
    Check::new(
        "macvlan",
        state.status,
        state.reason.as_str(),
        state.message.clone(),
        &state.remediation,
    )
}

/// The `qemu-guest-agent` check.
pub(crate) fn guest_agent_check(state: &hna_node::guest::GuestAgentState) -> Check {
    Check::new(
        "qemu-guest-agent",
        state.status,
        state.reason.as_str(),
        state.message.clone(),
        &state.remediation,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(statuses: &[Status]) -> Report {
        Report {
            helm_chart_configs: Vec::new(),
            checks: statuses
                .iter()
                .enumerate()
                .map(|(i, s)| Check::new(&format!("c{i}"), *s, "R", "m".into(), ""))
                .collect(),
        }
    }

    #[test]
    fn api_server_by_name_always_has_an_entry() {
        let mut checks = vec![Check::new(
            "kubeconfig",
            Status::Warn,
            "NotFound",
            "m".into(),
            "",
        )];
        name_api_server(&mut checks);
        assert_eq!(checks[1].name, "api-server");
        assert_eq!(checks[1].reason, "NoCredentials");
        assert_eq!(checks[1].status, Status::Warn);
        let before = checks.clone();
        name_api_server(&mut checks);
        assert_eq!(checks, before, "an existing entry is kept as it is");
    }

    #[test]
    fn only_a_failure_fails_the_report() {
        assert!(!report(&[Status::Ok, Status::Warn]).failed());
        assert!(report(&[Status::Ok, Status::Fail]).failed());
    }

    #[test]
    fn json_has_the_documented_fields() {
        let v: serde_json::Value =
            serde_json::from_str(&report(&[Status::Warn]).to_json()).unwrap();
        let c = &v["checks"][0];
        for field in ["name", "status", "reason", "message", "remediation"] {
            assert!(c.get(field).is_some(), "{field}");
        }
        assert_eq!(c["status"], "warn");
    }
}
