//! What the real-part tests, benches and the demo need from the machine, and
//! how to get it.
//!
//! Each [`Prereq`] is probed with [`Prereq::probe`]; a missing one comes back
//! as a [`Missing`] naming what is absent and the command that installs it.
//! `sudo tests/rig/prereqs.sh` installs every one of them (and builds
//! kube-apiserver once); [`Missing::install`] names the single package too.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::find_program;
// Where things are, never `rig` or `vm` themselves: they check their
// prerequisites here, and this file must not import them back.
use crate::locate::image::cached as cached_image;
use crate::locate::kernel::find_kernel;
use crate::locate::{Binaries, DNSMASQ, is_executable};

/// The command that installs every prerequisite.
pub const INSTALL_ALL: &str = "sudo tests/rig/prereqs.sh";

/// One thing a test needs from the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Prereq {
    /// Running as root (network namespaces, device nodes in an initramfs).
    Root,
    /// `ip` from iproute2.
    Iproute2,
    /// dnsmasq as DHCP server ([`DNSMASQ`]).
    Dnsmasq,
    /// `openssl`, etcd and kube-apiserver (`KUBEBUILDER_ASSETS`, or the
    /// build `tests/rig/prereqs.sh` caches).
    ApiServer,
    /// `kubectl` of the rig's release (next to kube-apiserver, else on
    /// `PATH`).
    Kubectl,
    /// ISC `dhclient`, a peer DHCP client.
    Dhclient,
    /// `busybox` (its `udhcpc`).
    Busybox,
    /// `curl`.
    Curl,
    /// `socat` (the VM tests' notify receiver and user-mode network
    /// forward).
    Socat,
    /// `ebtables` (iptables' nf_tables front end): a LAN split on the
    /// rig's bridge.
    Ebtables,
    /// The VM harness's programs: `qemu-system-x86_64`, kmod's `modprobe`
    /// and `depmod`, `cpio`, `busybox`, `ldd` and `strip`.
    Qemu,
    /// Debian's kernel package unpacked in the cache (see `vm::kernel()`).
    VmKernel,
    /// `/usr/sbin/qemu-ga`, Debian's qemu-guest-agent.
    QemuGuestAgent,
    /// `systemd-analyze`.
    SystemdAnalyze,
    /// `buildah` (the controller's OCI image, `packaging/oci/build.sh`).
    Buildah,
    /// `runc` and `umoci`: unpack an OCI image into a bundle and run it.
    Runc,
    /// kiwi's `kiwi-ng` at version [`KIWI_VERSION`] in its cached venv
    /// ([`kiwi_ng`]), from PyPI.
    Kiwi,
    /// `cloud-init` (its `schema` subcommand validates user data).
    CloudInit,
    /// The image test's tools: `mkfs.ext4` (with `-d`), `qemu-img`,
    /// `genisoimage`, `dpkg-deb`, `depmod` (`mmdebstrap` builds the image:
    /// [`Prereq::VmImage`]).
    ImageTools,
    /// The Debian image `tests/rig/image.sh` builds and caches
    /// (`locate::image::cached`).
    VmImage,
    /// `cargo-deb` ([`CARGO_DEB_VERSION`]), in `PATH` or cargo's `bin`.
    CargoDeb,
    /// `cargo-generate-rpm` ([`CARGO_GENERATE_RPM_VERSION`]), in `PATH` or
    /// cargo's `bin`.
    CargoGenerateRpm,
    /// `rpmbuild` and `rpm` (Debian's `rpm`).
    Rpmbuild,
    /// `dpkg-deb` and `dpkg`.
    Dpkg,
    /// `strip` and `gzip` (packaging/build.sh strips and compresses).
    Binutils,
    /// kube-vip ([`crate::locate::peers::KUBE_VIP_VERSION`]), built from the
    /// Go module proxy and cached by `tests/rig/peers.sh`.
    KubeVip,
    /// MetalLB's speaker, controller and CRDs
    /// ([`crate::locate::peers::METALLB_VERSION`]), built and cached the
    /// same way.
    MetalLb,
    /// The Harvester cloud provider ([`crate::locate::peers::CCM_COMMIT`]),
    /// built offline from the shared peers folder's snapshot and cached by
    /// `tests/rig/peers.sh`.
    HarvesterCcm,
    /// Helm ([`crate::locate::helm::HELM_VERSION`]), built from the Go
    /// module proxy and cached by `tests/rig/helm.sh`.
    Helm,
}

/// The cargo-deb `tests/rig/prereqs.sh` installs (keep the two in step).
pub const CARGO_DEB_VERSION: &str = "3.8.0";
/// The cargo-generate-rpm `tests/rig/prereqs.sh` installs (keep the two in
/// step).
pub const CARGO_GENERATE_RPM_VERSION: &str = "0.21.1";

/// A prerequisite that is not there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Missing {
    /// Which one.
    pub prereq: Prereq,
    /// What exactly is absent, e.g. "`qemu-system-x86_64`".
    pub what: String,
    /// The command that installs it.
    pub install: String,
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} is missing; {}", self.what, self.install)
    }
}

impl std::error::Error for Missing {}

impl Prereq {
    /// Short name for summaries: "root", or the Debian package to install.
    pub fn label(self) -> &'static str {
        match self {
            Prereq::Root => "root",
            Prereq::Iproute2 => "iproute2",
            Prereq::Dnsmasq => "dnsmasq-base",
            Prereq::ApiServer => "kube-apiserver",
            Prereq::Kubectl => "kubectl",
            Prereq::KubeVip => "kube-vip",
            Prereq::MetalLb => "MetalLB",
            Prereq::HarvesterCcm => "harvester-cloud-provider",
            Prereq::Helm => "helm",
            Prereq::Dhclient => "isc-dhcp-client",
            Prereq::Busybox => "busybox",
            Prereq::Curl => "curl",
            Prereq::Socat => "socat",
            Prereq::Ebtables => "ebtables",
            Prereq::Qemu => "qemu-system-x86",
            Prereq::VmKernel => "the VM kernel",
            Prereq::QemuGuestAgent => "qemu-guest-agent",
            Prereq::SystemdAnalyze => "systemd",
            Prereq::Buildah => "buildah",
            Prereq::Runc => "runc",
            Prereq::Kiwi => "kiwi",
            Prereq::CloudInit => "cloud-init",
            Prereq::ImageTools => "qemu-utils",
            Prereq::VmImage => "the VM image",
            Prereq::CargoDeb => "cargo-deb",
            Prereq::CargoGenerateRpm => "cargo-generate-rpm",
            Prereq::Rpmbuild => "rpm",
            Prereq::Dpkg => "dpkg",
            Prereq::Binutils => "binutils",
        }
    }

    /// `Ok` when present, else what is missing and how to install it.
    pub fn probe(self) -> Result<(), Missing> {
        let missing = |what: String, install: String| {
            Err(Missing {
                prereq: self,
                what,
                install,
            })
        };
        let program = |name: &str, package: &str| match find_program(name) {
            Some(_) => Ok(()),
            None => missing(format!("`{name}`"), apt_install(package)),
        };
        match self {
            Prereq::Root => {
                if is_root() {
                    Ok(())
                } else {
                    missing(
                        "root (network namespaces and VMs need it)".into(),
                        "run the tests as root, e.g. `sudo -E cargo test --test integration`"
                            .into(),
                    )
                }
            }
            Prereq::Iproute2 => program("ip", "iproute2"),
            Prereq::Dnsmasq => {
                if is_executable(Path::new(DNSMASQ)) {
                    Ok(())
                } else {
                    missing(format!("`{DNSMASQ}`"), apt_install("dnsmasq-base"))
                }
            }
            Prereq::ApiServer => {
                program("openssl", "openssl")?;
                match Binaries::find() {
                    Ok(_) => Ok(()),
                    Err(what) => missing(
                        what.to_string(),
                        format!(
                            "build and cache it with `{INSTALL_ALL}`, then \
                             `export KUBEBUILDER_ASSETS=\"$({INSTALL_ALL} | tail -n1)\"`"
                        ),
                    ),
                }
            }
            Prereq::KubeVip | Prereq::MetalLb | Prereq::HarvesterCcm => {
                let found = match self {
                    Prereq::KubeVip => crate::locate::peers::kube_vip().map(drop),
                    Prereq::MetalLb => crate::locate::peers::metallb().map(drop),
                    _ => crate::locate::peers::harvester_ccm().map(drop),
                };
                match found {
                    Ok(()) => Ok(()),
                    Err(what) => missing(
                        what.to_string(),
                        format!(
                            "build and cache it with `{INSTALL_ALL}` (or `sudo {}`)",
                            crate::locate::peers::INSTALL
                        ),
                    ),
                }
            }
            Prereq::Helm => match crate::locate::helm::helm() {
                Ok(_) => Ok(()),
                Err(what) => missing(
                    what.to_string(),
                    format!(
                        "build and cache it with `{INSTALL_ALL}` (or `sudo {}`)",
                        crate::locate::helm::INSTALL
                    ),
                ),
            },
            Prereq::Kubectl => match Binaries::find() {
                Ok(Binaries {
                    kubectl: Some(_), ..
                }) => Ok(()),
                Ok(b) => missing(
                    format!(
                        "kubectl (not next to {} nor on PATH)",
                        b.kube_apiserver.display()
                    ),
                    format!("build and cache it with `{INSTALL_ALL}`"),
                ),
                Err(what) => missing(
                    what.to_string(),
                    format!("build and cache it with `{INSTALL_ALL}`"),
                ),
            },
            Prereq::Dhclient => program("dhclient", "isc-dhcp-client"),
            Prereq::Busybox => program("busybox", "busybox"),
            Prereq::Curl => program("curl", "curl"),
            Prereq::Socat => program("socat", "socat"),
            Prereq::Ebtables => program("ebtables", "iptables"),
            Prereq::Qemu => {
                for (name, package) in [
                    ("qemu-system-x86_64", "qemu-system-x86"),
                    ("modprobe", "kmod"),
                    ("depmod", "kmod"),
                    ("cpio", "cpio"),
                    ("busybox", "busybox"),
                    ("ldd", "libc-bin"),
                    ("strip", "binutils"),
                ] {
                    program(name, package)?;
                }
                Ok(())
            }
            Prereq::VmKernel => match find_kernel() {
                Ok(_) => Ok(()),
                Err(e) => missing(
                    format!("the VM kernel ({e:#})"),
                    format!("fetch and unpack it with `{INSTALL_ALL}`"),
                ),
            },
            Prereq::QemuGuestAgent => {
                if Path::new(QEMU_GA).is_file() {
                    Ok(())
                } else {
                    missing(format!("`{QEMU_GA}`"), apt_install("qemu-guest-agent"))
                }
            }
            Prereq::SystemdAnalyze => program("systemd-analyze", "systemd"),
            Prereq::Buildah => program("buildah", "buildah"),
            Prereq::Runc => {
                program("runc", "runc")?;
                program("umoci", "umoci")
            }
            Prereq::Kiwi => {
                let kiwi = kiwi_ng();
                if is_executable(&kiwi) {
                    Ok(())
                } else {
                    missing(
                        format!("`{}` (kiwi {KIWI_VERSION})", kiwi.display()),
                        format!(
                            "install it with `{INSTALL_ALL}` (or `python3 -m venv {venv} && \
                             {venv}/bin/pip install kiwi=={KIWI_VERSION}`)",
                            venv = kiwi_venv().display()
                        ),
                    )
                }
            }
            Prereq::CloudInit => program("cloud-init", "cloud-init"),
            Prereq::ImageTools => {
                for (name, package) in [
                    ("mkfs.ext4", "e2fsprogs"),
                    ("qemu-img", "qemu-utils"),
                    ("genisoimage", "genisoimage"),
                    ("dpkg-deb", "dpkg"),
                    ("depmod", "kmod"),
                ] {
                    program(name, package)?;
                }
                Ok(())
            }
            Prereq::VmImage => match cached_image() {
                Ok(_) => Ok(()),
                Err(e) => missing(
                    format!("the VM image ({e:#})"),
                    format!(
                        "build it with `{INSTALL_ALL}` (or `sudo tests/rig/image.sh`, 3-10 minutes once)"
                    ),
                ),
            },
            Prereq::CargoDeb => {
                cargo_tool("cargo-deb", CARGO_DEB_VERSION).map_err(|(what, install)| Missing {
                    prereq: self,
                    what,
                    install,
                })
            }
            Prereq::CargoGenerateRpm => {
                cargo_tool("cargo-generate-rpm", CARGO_GENERATE_RPM_VERSION).map_err(
                    |(what, install)| Missing {
                        prereq: self,
                        what,
                        install,
                    },
                )
            }
            Prereq::Rpmbuild => {
                program("rpmbuild", "rpm")?;
                program("rpm", "rpm")
            }
            Prereq::Dpkg => {
                program("dpkg-deb", "dpkg")?;
                program("dpkg", "dpkg")
            }
            Prereq::Binutils => {
                program("strip", "binutils")?;
                program("gzip", "gzip")
            }
        }
    }
}

/// The kiwi release the image descriptions (`kiwi/`) are checked with; keep
/// in step with `tests/rig/prereqs.sh`.
pub const KIWI_VERSION: &str = "11.1.6";

/// kiwi's venv: `${HNA_CACHE_DIR:-/var/cache/harvester-node-agent}/kiwi-venv-<KIWI_VERSION>`.
pub fn kiwi_venv() -> PathBuf {
    let cache = std::env::var_os("HNA_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/harvester-node-agent"));
    cache.join(format!("kiwi-venv-{KIWI_VERSION}"))
}

/// `kiwi-ng` in [`kiwi_venv`].
pub fn kiwi_ng() -> PathBuf {
    kiwi_venv().join("bin/kiwi-ng")
}

/// Where Debian's qemu-guest-agent puts `qemu-ga`.
pub const QEMU_GA: &str = "/usr/sbin/qemu-ga";

/// `` `sudo tests/rig/prereqs.sh` (or `apt-get install PACKAGE`) ``.
fn apt_install(package: &str) -> String {
    format!("install it with `{INSTALL_ALL}` (or `sudo apt-get install {package}`)")
}

/// Where `cargo install` puts programs: `$CARGO_HOME/bin`, else
/// `~/.cargo/bin`.
pub fn cargo_bin_dir() -> Option<PathBuf> {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .map(|home| home.join("bin"))
}

/// A cargo subcommand installed with `cargo install`: found in `PATH` or in
/// cargo's `bin` (where cargo looks for subcommands), else what is missing
/// and how to install the pinned version.
fn cargo_tool(name: &str, version: &str) -> Result<(), (String, String)> {
    let in_cargo_bin = cargo_bin_dir().is_some_and(|d| is_executable(&d.join(name)));
    if in_cargo_bin || find_program(name).is_some() {
        return Ok(());
    }
    Err((
        format!("`{name}`"),
        format!(
            "install it with `{INSTALL_ALL}` (or `cargo install --locked {name} --version {version}`)"
        ),
    ))
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Every prerequisite of `needs` that is missing, each once, in order.
pub fn missing(needs: &[Prereq]) -> Vec<Missing> {
    let mut seen = Vec::new();
    needs
        .iter()
        .filter(|p| {
            let new = !seen.contains(*p);
            seen.push(**p);
            new
        })
        .filter_map(|p| p.probe().err())
        .collect()
}

/// `Ok` when every one of `needs` is present, else an error listing what is
/// missing and how to install it.
pub fn require(needs: &[Prereq]) -> anyhow::Result<()> {
    let missing = missing(needs);
    if missing.is_empty() {
        return Ok(());
    }
    let lines: Vec<String> = missing.iter().map(|m| format!("  - {m}")).collect();
    anyhow::bail!(
        "prerequisites missing (`{INSTALL_ALL}` installs them all):\n{}",
        lines.join("\n")
    )
}
