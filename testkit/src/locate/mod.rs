//! Where the rig's and the VMs' prerequisites are: the Kubernetes
//! binaries, dnsmasq, the unpacked kernel and the cached image. Found
//! without checking anything, so that the prerequisite check
//! (`prereq`) can look for them and the rig and the VM harness,
//! which check their prerequisites, can use them: everything imports this,
//! this imports none of them.

use std::fs;
use std::path::{Path, PathBuf};

pub mod helm;
pub mod image;
pub mod kernel;
pub mod peers;

/// dnsmasq, the rig's DHCP server.
pub const DNSMASQ: &str = "/usr/sbin/dnsmasq";

/// The binaries the API server part of the rig runs.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// `kube-apiserver`
    pub kube_apiserver: PathBuf,
    /// `etcd`
    pub etcd: PathBuf,
    /// `kubectl` of the same release, where there is one (next to
    /// kube-apiserver, else on `PATH`).
    pub kubectl: Option<PathBuf>,
}

/// The folder under the cache that `tests/rig/kubernetes.sh` builds each
/// Kubernetes release into: `<cache>/kubernetes/<release>/`.
pub fn releases_dir() -> PathBuf {
    std::env::var_os("HNA_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/harvester-node-agent"))
        .join("kubernetes")
}

/// `v1.37.2` as `(1, 37, 2)`, for ordering releases.
fn release_key(name: &str) -> Option<(u32, u32, u32)> {
    let mut parts = name.strip_prefix('v')?.split('.').map(|p| p.parse().ok());
    Some((parts.next()??, parts.next()??, parts.next()??))
}

impl Binaries {
    /// Finds `kube-apiserver` in `$KUBEBUILDER_ASSETS` if that is set, else
    /// in the newest release under [`releases_dir`]; `etcd` and `kubectl`
    /// next to it (`kubectl` else on `PATH`). The error says what is
    /// missing and where it was looked for.
    pub fn find() -> std::result::Result<Binaries, Absent> {
        let folder = if let Some(assets) = std::env::var_os("KUBEBUILDER_ASSETS") {
            let p = PathBuf::from(assets);
            if !is_executable(&p.join("kube-apiserver")) {
                return Err(Absent::new(format!(
                    "kube-apiserver (not found in KUBEBUILDER_ASSETS={})",
                    p.display()
                )));
            }
            p
        } else {
            let root = releases_dir();
            let newest = fs::read_dir(&root)
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| is_executable(&e.path().join("kube-apiserver")))
                .filter_map(|e| Some((release_key(e.file_name().to_str()?)?, e.path())))
                .max();
            match newest {
                Some((_, p)) => p,
                None => {
                    return Err(Absent::new(format!(
                        "kube-apiserver (no {}/v*/kube-apiserver; or set KUBEBUILDER_ASSETS)",
                        root.display()
                    )));
                }
            }
        };
        let etcd = folder.join("etcd");
        if !is_executable(&etcd) {
            return Err(Absent::new(format!("etcd (not in {})", folder.display())));
        }
        let kubectl = Some(folder.join("kubectl"))
            .filter(|p| is_executable(p))
            .or_else(|| crate::find_program("kubectl"));
        Ok(Binaries {
            kube_apiserver: folder.join("kube-apiserver"),
            etcd,
            kubectl,
        })
    }
}

/// Whether `p` is an existing executable file (following symlinks).
/// A prerequisite that is not where the tests look for it: what, and where
/// it was looked for (the text a skip or a failure shows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Absent(String);

impl Absent {
    pub(crate) fn new(what: impl Into<String>) -> Absent {
        Absent(what.into())
    }
}

impl std::fmt::Display for Absent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Absent {}

pub fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}
