//! The Harvester cloud-provider kubeconfig ("cloud-config"), as Harvester's
//! `generate_addon.sh` writes it: one cluster with embedded CA data, a
//! service-account token user, and a context naming the namespace of the
//! guest cluster's VMs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};

/// Where the cloud-config is looked for when `cloud_config` is not set:
/// where the docs place it on custom nodes, then where RKE2 writes the
/// `cloud-provider-config` it was given.
pub(crate) const DEFAULT_PATHS: &[&str] = &[
    "/etc/kubernetes/cloud-config",
    "/var/lib/rancher/rke2/etc/config-files/cloud-provider-config",
];

/// Client read timeout for the Harvester API; watches are bounded below it.
pub(crate) const READ_TIMEOUT: Duration = Duration::from_secs(70);
/// Server-side bound of one watch request on the Harvester API.
pub(crate) const WATCH_TIMEOUT_SECS: u32 = 55;

/// What is at the configured path(s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Found {
    Missing { searched: Vec<PathBuf> },
    Unreadable { path: PathBuf, error: String },
    File { path: PathBuf, content: Vec<u8> },
}

/// The first of `paths` that exists, read whole.
pub(crate) fn find(paths: &[PathBuf]) -> Found {
    for p in paths {
        match std::fs::read(p) {
            Ok(content) => {
                return Found::File {
                    path: p.clone(),
                    content,
                };
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Found::Unreadable {
                    path: p.clone(),
                    error: e.to_string(),
                };
            }
        }
    }
    Found::Missing {
        searched: paths.to_vec(),
    }
}

/// A client for the Harvester cluster.
#[derive(Clone)]
pub(crate) struct Harvester {
    pub(crate) path: PathBuf,
    pub(crate) client: kube::Client,
    /// The context's namespace (`default` when the context names none).
    pub(crate) namespace: String,
    pub(crate) server: String,
}

/// Why a cloud-config gives no client.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CloudConfigError {
    #[error("not UTF-8 text")]
    NotText,
    #[error("not a kubeconfig: {0}")]
    NotKubeconfig(#[source] kube::config::KubeconfigError),
    #[error("not usable: {0}")]
    NotUsable(#[source] kube::config::KubeconfigError),
    #[error("cannot build a client: {0}")]
    Client(#[source] kube::Error),
}

/// Client configuration from kubeconfig text (its current context).
pub(crate) async fn client_config(content: &[u8]) -> Result<kube::Config, CloudConfigError> {
    let text = std::str::from_utf8(content).map_err(|_| CloudConfigError::NotText)?;
    let kc = Kubeconfig::from_yaml(text).map_err(CloudConfigError::NotKubeconfig)?;
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(CloudConfigError::NotUsable)?;
    cfg.connect_timeout = Some(Duration::from_secs(5));
    cfg.read_timeout = Some(READ_TIMEOUT);
    cfg.reset_reader_on_write = true;
    Ok(cfg)
}

/// Builds a client from the kubeconfig text read from `path`.
pub(crate) async fn connect(path: &Path, content: &[u8]) -> Result<Harvester, CloudConfigError> {
    let cfg = client_config(content).await?;
    let namespace = cfg.default_namespace.clone();
    let server = cfg.cluster_url.to_string();
    let client = kube::Client::try_from(cfg).map_err(CloudConfigError::Client)?;
    Ok(Harvester {
        path: path.to_path_buf(),
        client,
        namespace,
        server,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_existing_path_wins_and_missing_lists_all() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        assert_eq!(
            find(&[a.clone(), b.clone()]),
            Found::Missing {
                searched: vec![a.clone(), b.clone()]
            }
        );
        std::fs::write(&b, "x").unwrap();
        assert_eq!(
            find(&[a.clone(), b.clone()]),
            Found::File {
                path: b.clone(),
                content: b"x".to_vec()
            }
        );
        std::fs::write(&a, "y").unwrap();
        assert!(matches!(find(&[a.clone(), b]), Found::File { path, .. } if path == a));
    }

    #[tokio::test]
    async fn generate_addon_output_gives_the_context_namespace() {
        // The shape generate_addon.sh prints (kubectl config set-cluster /
        // set-credentials / set-context --namespace).
        let text = "apiVersion: v1
clusters:
- cluster:
    server: https://harvester.example:6443/k8s/clusters/local
  name: local
contexts:
- context:
    cluster: local
    namespace: guest-vms
    user: harvester-cloud-provider-guest-vms-local
  name: harvester-cloud-provider-guest-vms-local
current-context: harvester-cloud-provider-guest-vms-local
kind: Config
preferences: {}
users:
- name: harvester-cloud-provider-guest-vms-local
  user:
    token: abc.def
";
        let cfg = client_config(text.as_bytes()).await.unwrap();
        assert_eq!(cfg.default_namespace, "guest-vms");
        assert_eq!(
            cfg.cluster_url.to_string(),
            "https://harvester.example:6443/k8s/clusters/local"
        );
        assert!(client_config(b"\xff").await.is_err());
        assert!(client_config(b"kind: [").await.is_err());
        assert!(
            client_config(b"apiVersion: v1\nkind: Config\n")
                .await
                .is_err()
        );
    }
}
