//! Guest-cluster credentials: which kubeconfig this node uses, and a client
//! built from it.
//!
//! Order (first match wins):
//! 1. `kubeconfig` from configuration (flag, `HNA_KUBECONFIG`, file) — used
//!    alone: if it is missing the daemon waits for it rather than guessing;
//! 2. `$KUBECONFIG` (first existing entry of the colon-separated list);
//! 3. `kubeconfig_search`, by default the kubelet kubeconfigs of RKE2, K3s and
//!    kubeadm nodes, in that order;
//! 4. the in-cluster service account, when running in a Pod.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};
use serde::Serialize;

/// Where to look for credentials: what the daemon's configuration and the
/// controller's options both provide.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Settings {
    /// Used alone when set.
    pub kubeconfig: Option<PathBuf>,
    /// Tried in order when `kubeconfig` is unset (after `$KUBECONFIG`).
    pub search: Vec<PathBuf>,
}

/// Kubeconfigs tried in order when none is configured; the first that
/// exists wins. The kubelet's own credentials come first because they carry
/// the node identity (`system:node:<name>`) that may patch only this node.
pub const DEFAULT_SEARCH: &[&str] = &[
    "/var/lib/rancher/rke2/agent/kubelet.kubeconfig",
    "/var/lib/rancher/k3s/agent/kubelet.kubeconfig",
    "/etc/kubernetes/kubelet.conf",
];

/// How the credentials were found, for reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Source {
    Configured,
    KubeconfigEnv,
    Search,
    InCluster,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Discovery {
    /// A kubeconfig file exists at `path`.
    File { path: PathBuf, source: Source },
    /// Running in a Pod with a service account.
    InCluster,
    /// Nothing found yet (normal before the node joins).
    NotFound {
        searched: Vec<PathBuf>,
        configured: bool,
    },
}

/// The filesystem and environment view discovery needs; a trait so the order
/// is testable without touching real paths.
pub trait DiscoveryEnv {
    fn exists(&self, path: &Path) -> bool;
    fn var(&self, name: &str) -> Option<String>;
}

pub struct HostEnv;

impl DiscoveryEnv for HostEnv {
    fn exists(&self, path: &Path) -> bool {
        path.is_file()
    }
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

pub fn discover(cfg: &Settings, env: &dyn DiscoveryEnv) -> Discovery {
    if let Some(path) = &cfg.kubeconfig {
        return if env.exists(path) {
            Discovery::File {
                path: path.clone(),
                source: Source::Configured,
            }
        } else {
            Discovery::NotFound {
                searched: vec![path.clone()],
                configured: true,
            }
        };
    }
    let mut searched = Vec::new();
    if let Some(list) = env.var("KUBECONFIG") {
        for p in list.split(':').filter(|s| !s.is_empty()).map(PathBuf::from) {
            if env.exists(&p) {
                return Discovery::File {
                    path: p,
                    source: Source::KubeconfigEnv,
                };
            }
            searched.push(p);
        }
    }
    for p in &cfg.search {
        if env.exists(p) {
            return Discovery::File {
                path: p.clone(),
                source: Source::Search,
            };
        }
        searched.push(p.clone());
    }
    if env.var("KUBERNETES_SERVICE_HOST").is_some()
        && env.exists(Path::new(
            "/var/run/secrets/kubernetes.io/serviceaccount/token",
        ))
    {
        return Discovery::InCluster;
    }
    Discovery::NotFound {
        searched,
        configured: false,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error("cannot read kubeconfig {path}: {source}", path = path.display())]
    Read {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error("kubeconfig {path} is not usable: {source}", path = path.display())]
    Invalid {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error("in-cluster credentials are not usable: {0}")]
    InCluster(#[from] kube::config::InClusterError),
    #[error("cannot build a Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    #[error("no credentials found")]
    NotFound,
}

/// Kubernetes client configuration from a discovery result.
pub(crate) async fn client_config(found: &Discovery) -> Result<kube::Config, CredentialsError> {
    // kube's default client repeats a 429, 503 or 504 by itself (up to 15
    // times), out of our writers' sight: its repeat went out beside our
    // hedges, so a server's `Retry-After` was not honoured by the node as a
    // whole. Off: each writer sees every answer and holds back as asked
    // (`loadbalancer::delivery`, the controller's per-object backoff). It had
    // stayed on while liveness rode on API writes (a heartbeat that waited
    // out two 1 s `Retry-After`s went past a 3 s staleness bound); liveness
    // is on the LAN now, and the backstop heartbeat has 40 s (issue #30).
    match found {
        Discovery::File { path, .. } => {
            let kc = Kubeconfig::read_from(path).map_err(|source| CredentialsError::Read {
                path: path.clone(),
                source,
            })?;
            let mut cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|source| CredentialsError::Invalid {
                    path: path.clone(),
                    source,
                })?;
            // A node agent must notice a dead API server quickly; the
            // defaults wait far longer than a health check should.
            cfg.connect_timeout = Some(Duration::from_secs(5));
            cfg.read_timeout = Some(READ_TIMEOUT);
            cfg.default_retry = false;
            Ok(cfg)
        }
        Discovery::InCluster => {
            let mut cfg = kube::Config::incluster()?;
            cfg.default_retry = false;
            Ok(cfg)
        }
        Discovery::NotFound { .. } => Err(CredentialsError::NotFound),
    }
}

/// How long a client built from a kubeconfig file waits for the next bytes
/// of an answer, a watch's included; see [`WATCH_TIMEOUT_SECS`].
pub(crate) const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// The server-side bound of every watch request (`timeoutSeconds`): under
/// `READ_TIMEOUT`, so that the API server ends a quiet watch cleanly (and
/// it is resumed from its resourceVersion) before the client would cut it
/// as an error: an error that counts against the controller's watch health
/// and makes it distrust heartbeat staleness for a while.
pub const WATCH_TIMEOUT_SECS: u32 = 25;
const _: () = assert!((WATCH_TIMEOUT_SECS as u64) < READ_TIMEOUT.as_secs());

/// A connected client and what the server said about itself.
pub struct Connection {
    pub client: kube::Client,
    pub server: String,
    pub server_version: String,
}

/// Why [`connect`] has no connection.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    #[error("API server {server} did not answer within {}", humantime::format_duration(*.timeout))]
    Timeout { server: String, timeout: Duration },
    #[error("API server {server} is not reachable: {source}")]
    Unreachable {
        server: String,
        #[source]
        source: kube::Error,
    },
}

/// Builds a client and asks the server for its version, within `timeout`.
pub async fn connect(found: &Discovery, timeout: Duration) -> Result<Connection, ConnectError> {
    let cfg = client_config(found).await?;
    let server = cfg.cluster_url.to_string();
    let client = kube::client::ClientBuilder::try_from(cfg)
        .map_err(CredentialsError::Client)?
        .with_layer(&crate::metrics::api::TimedLayer)
        .build();
    let info = tokio::time::timeout(timeout, client.apiserver_version())
        .await
        .map_err(|_| ConnectError::Timeout {
            server: server.clone(),
            timeout,
        })?
        .map_err(|source| ConnectError::Unreachable {
            server: server.clone(),
            source,
        })?;
    Ok(Connection {
        client,
        server,
        server_version: info.git_version,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, HashSet};

    struct FakeEnv {
        files: HashSet<PathBuf>,
        vars: HashMap<String, String>,
    }
    impl DiscoveryEnv for FakeEnv {
        fn exists(&self, path: &Path) -> bool {
            self.files.contains(path)
        }
        fn var(&self, name: &str) -> Option<String> {
            self.vars.get(name).cloned()
        }
    }

    fn cfg(kubeconfig: Option<&str>) -> Settings {
        Settings {
            kubeconfig: kubeconfig.map(PathBuf::from),
            search: DEFAULT_SEARCH.iter().map(PathBuf::from).collect(),
        }
    }

    fn env(files: &[&str], vars: &[(&str, &str)]) -> FakeEnv {
        FakeEnv {
            files: files.iter().map(PathBuf::from).collect(),
            vars: vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    #[test]
    fn configured_path_is_used_alone() {
        let e = env(&["/etc/kubernetes/kubelet.conf"], &[]);
        let d = discover(&cfg(Some("/opt/kc")), &e);
        assert_eq!(
            d,
            Discovery::NotFound {
                searched: vec!["/opt/kc".into()],
                configured: true
            }
        );
    }

    #[test]
    fn rke2_wins_over_kubeadm_and_env_wins_over_both() {
        let e = env(
            &[
                "/etc/kubernetes/kubelet.conf",
                "/var/lib/rancher/rke2/agent/kubelet.kubeconfig",
            ],
            &[],
        );
        assert_eq!(
            discover(&cfg(None), &e),
            Discovery::File {
                path: "/var/lib/rancher/rke2/agent/kubelet.kubeconfig".into(),
                source: Source::Search
            }
        );
        let mut e = e;
        e.files.insert("/home/k".into());
        e.vars
            .insert("KUBECONFIG".into(), "/missing:/home/k".into());
        assert_eq!(
            discover(&cfg(None), &e),
            Discovery::File {
                path: "/home/k".into(),
                source: Source::KubeconfigEnv
            }
        );
    }

    #[test]
    fn nothing_found_lists_what_was_searched() {
        let d = discover(&cfg(None), &env(&[], &[]));
        match d {
            Discovery::NotFound {
                searched,
                configured,
            } => {
                assert!(!configured);
                assert_eq!(searched.len(), 3);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn in_cluster_is_the_last_resort() {
        let e = env(
            &["/var/run/secrets/kubernetes.io/serviceaccount/token"],
            &[("KUBERNETES_SERVICE_HOST", "10.0.0.1")],
        );
        assert_eq!(discover(&cfg(None), &e), Discovery::InCluster);
    }
}
