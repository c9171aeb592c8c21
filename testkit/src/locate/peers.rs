//! Where `tests/rig/peers.sh` caches the peers the rig measures us beside
//! (kube-vip, MetalLB), built from the Go module proxy by version, and the
//! Harvester cloud provider, built from the shared peers folder's snapshot.

use std::path::PathBuf;

use super::{Absent, is_executable};

/// The kube-vip release the rig runs (keep in step with
/// `tests/rig/peers.sh`).
pub const KUBE_VIP_VERSION: &str = "v1.2.2";
/// The MetalLB release the rig runs (keep in step with
/// `tests/rig/peers.sh`).
pub const METALLB_VERSION: &str = "v0.16.1";
/// The Harvester cloud provider's snapshot (its commit; keep in step with
/// `tests/rig/peers.sh`).
pub const CCM_COMMIT: &str = "1a80755";
/// Where `tests/rig/peers.sh` caches the peers, unless `HNA_PEERS_DIR`
/// says otherwise, or `HNA_CACHE_DIR` (then its `peers/`, as the script's).
pub const PEERS_DIR: &str = "/var/cache/harvester-node-agent/peers";
/// The command that builds and caches them.
pub const INSTALL: &str = "tests/rig/peers.sh";

/// See [`PEERS_DIR`].
pub fn peers_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("HNA_PEERS_DIR") {
        return PathBuf::from(dir);
    }
    match std::env::var_os("HNA_CACHE_DIR") {
        Some(cache) => PathBuf::from(cache).join("peers"),
        None => PathBuf::from(PEERS_DIR),
    }
}

/// The cached kube-vip binary, or what is absent.
pub fn kube_vip() -> Result<PathBuf, Absent> {
    cached_binary(
        &["kube-vip", KUBE_VIP_VERSION, "kube-vip"],
        &format!("kube-vip {KUBE_VIP_VERSION}"),
    )
}

/// `peers_dir()/<parts>` if it is an executable, else `"<what> (<path> absent)"`.
fn cached_binary(parts: &[&str], what: &str) -> Result<PathBuf, Absent> {
    let bin = parts.iter().fold(peers_dir(), |p, part| p.join(part));
    if is_executable(&bin) {
        Ok(bin)
    } else {
        Err(Absent::new(format!("{what} ({} absent)", bin.display())))
    }
}

/// The cached MetalLB speaker and controller binaries and its CRDs'
/// directory, or what is absent.
pub fn metallb() -> Result<(PathBuf, PathBuf, PathBuf), Absent> {
    let dir = peers_dir().join("metallb").join(METALLB_VERSION);
    let (speaker, controller, crds) = (
        dir.join("speaker"),
        dir.join("controller"),
        dir.join("crds"),
    );
    if is_executable(&speaker) && is_executable(&controller) && crds.is_dir() {
        Ok((speaker, controller, crds))
    } else {
        Err(Absent::new(format!(
            "MetalLB {METALLB_VERSION} ({} incomplete)",
            dir.display()
        )))
    }
}

/// The cached Harvester cloud provider binary, or what is absent.
pub fn harvester_ccm() -> Result<PathBuf, Absent> {
    cached_binary(
        &[
            "harvester-cloud-provider",
            CCM_COMMIT,
            "harvester-cloud-provider",
        ],
        &format!("the Harvester cloud provider {CCM_COMMIT}"),
    )
}
