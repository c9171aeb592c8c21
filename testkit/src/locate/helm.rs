//! Where `tests/rig/helm.sh` caches Helm, built from the Go module proxy by
//! version.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{Absent, is_executable};

/// The Helm release the chart's tests run (keep in step with
/// `tests/rig/helm.sh`).
pub const HELM_VERSION: &str = "v3.22.0";
/// Where `tests/rig/helm.sh` caches it, unless `HNA_CACHE_DIR` says
/// otherwise.
pub const CACHE_DIR: &str = "/var/cache/harvester-node-agent";
/// The command that builds and caches it.
pub const INSTALL: &str = "tests/rig/helm.sh";

/// The cached `helm` binary, or what is absent.
pub fn helm() -> Result<PathBuf, Absent> {
    let bin = std::env::var_os("HNA_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(CACHE_DIR))
        .join("helm")
        .join(HELM_VERSION)
        .join("helm");
    if is_executable(&bin) {
        Ok(bin)
    } else {
        Err(Absent::new(format!(
            "helm {HELM_VERSION} ({} absent)",
            bin.display()
        )))
    }
}

/// `helm` with its cache, configuration and data under `home`, so that a
/// test reads no user's repositories and leaves nothing in theirs.
pub fn command(home: &Path) -> Result<Command, Absent> {
    let mut cmd = Command::new(helm()?);
    cmd.env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"));
    Ok(cmd)
}
