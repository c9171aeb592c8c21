//! Where `tests/rig/helm.sh` caches Helm, built from the Go module proxy by
//! version.

use std::path::PathBuf;

use super::is_executable;

/// The Helm release the chart's tests run (keep in step with
/// `tests/rig/helm.sh`).
pub const HELM_VERSION: &str = "v3.22.0";
/// Where `tests/rig/helm.sh` caches it, unless `HNA_CACHE_DIR` says
/// otherwise.
pub const CACHE_DIR: &str = "/var/cache/harvester-node-agent";
/// The command that builds and caches it.
pub const INSTALL: &str = "tests/rig/helm.sh";

/// The cached `helm` binary, or what is absent.
pub fn helm() -> Result<PathBuf, String> {
    let bin = std::env::var_os("HNA_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(CACHE_DIR))
        .join("helm")
        .join(HELM_VERSION)
        .join("helm");
    if is_executable(&bin) {
        Ok(bin)
    } else {
        Err(format!("helm {HELM_VERSION} ({} absent)", bin.display()))
    }
}
