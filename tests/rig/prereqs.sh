#!/usr/bin/env bash
# Installs everything the test rig needs, from Debian's packages, and builds
# kube-apiserver, kubectl and etcd from the Go module proxy
# (tests/rig/kubernetes.sh), the peers (tests/rig/peers.sh), Helm
# (tests/rig/helm.sh), the VM kernel
# and image, kiwi and the packaging tools.
#
# Usage: prereqs.sh          everything the tests need (tests/long.sh)
#        prereqs.sh ci       what tests/run.sh (CI) runs: all but the long
#                            suites' (docs/testing.md): no VM image, no
#                            kube-vip, MetalLB or Harvester cloud provider,
#                            no oldest release
#        prereqs.sh demo     only what tests/demo.sh runs: a few Debian
#                            packages, etcd and the newest release's
#                            kube-apiserver (no kubectl, no peers, no oldest
#                            release, no VM, image, kiwi or packaging tools)
#
# The Go builds are cached outside the checkout, keyed by version, so repeat
# runs take seconds:
#   ${HNA_CACHE_DIR:-/var/cache/harvester-node-agent}/kubernetes/<release>/{kube-apiserver,kubectl,etcd}
# Set KUBEBUILDER_ASSETS to a folder holding `kube-apiserver` and `etcd`
# (and `kubectl`) to skip the build and use those binaries instead.
#
# Prints the folder that holds kube-apiserver on its last line of stdout:
# the newest release's, or HNA_KUBE_RELEASE=oldest's.
set -euo pipefail

CACHE_DIR="${HNA_CACHE_DIR:-/var/cache/harvester-node-agent}"
PACKAGES=(dnsmasq-base iproute2 busybox isc-dhcp-client dhcpcd-base
          procps psmisc jq rsync curl ca-certificates openssl
          man-db systemd iptables
          rpm rpm2cpio cpio binutils xz-utils)

log() { echo "prereqs: $*" >&2; }

if [[ $(id -u) -ne 0 ]]; then
  log "must run as root (network namespaces, packages)"; exit 1
fi

apt_updated=0
apt_update() {
  if [[ $apt_updated -eq 0 ]]; then
    log "apt-get update"
    apt-get update -qq >&2
    apt_updated=1
  fi
}
# Installs those of the named Debian packages that are not installed yet.
install_missing() {
  local missing=() p
  for p in "$@"; do
    [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" == "install ok installed" ]] || missing+=("$p")
  done
  if ((${#missing[@]})); then
    apt_update
    log "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
}
# The VM, shipping and image sections' packages, installed here in the same
# apt transaction (one dpkg run instead of four).
VM_PACKAGES=(qemu-system-x86 kmod cpio socat qemu-guest-agent)
SHIP_PACKAGES=(buildah runc umoci cloud-init python3-venv)
IMAGE_PACKAGES=(mmdebstrap e2fsprogs qemu-utils genisoimage)

# --- the demo (tests/demo.sh): the LAN's dnsmasq, ip, the guests' TCP
# listeners and the client (socat), the API server's certificates
# (openssl), the Go builds' lookups (jq, the CA bundle), and one Kubernetes
# release. Nothing else, so that a fresh machine runs the demo
# in minutes; the tests' prerequisites come with tests/run.sh.
DEMO_PACKAGES=(dnsmasq-base iproute2 socat procps psmisc jq ca-certificates openssl)
case "${1:-all}" in
  demo)
    install_missing "${DEMO_PACKAGES[@]}"
    if [[ -n "${KUBEBUILDER_ASSETS:-}" && -x "${KUBEBUILDER_ASSETS}/kube-apiserver" ]]; then
      log "using kube-apiserver from KUBEBUILDER_ASSETS=${KUBEBUILDER_ASSETS}"
      echo "${KUBEBUILDER_ASSETS}"; exit 0
    fi
    k8s_dir="$(HNA_KUBE_COMMANDS=kube-apiserver bash "$(dirname "$0")/kubernetes.sh" newest | tail -n1)"
    [[ -n "$k8s_dir" ]] || { log "tests/rig/kubernetes.sh printed no folder"; exit 1; }
    echo "$k8s_dir"; exit 0 ;;
  all|ci) ;;
  *) log "usage: prereqs.sh [ci|demo] (not \`$1\`)"; exit 2 ;;
esac
# The long suites' prerequisites (tests/long.sh), left out with `ci`.
long=1
[[ "${1:-all}" == ci ]] && long=0

install_missing "${PACKAGES[@]}" "${DEMO_PACKAGES[@]}" "${VM_PACKAGES[@]}" "${SHIP_PACKAGES[@]}" "${IMAGE_PACKAGES[@]}"

# --- image test (tests/integration/vm_image.rs) ----------------------------
# A Debian bookworm image with systemd, cloud-init and qemu-guest-agent,
# built once by tests/rig/image.sh and cached by its package list. Cold, that
# is minutes of downloading and unpacking, so it runs in the background while
# the sections below compile; `finish` waits for it (and fails if it did).
image_log="$(mktemp)"
image_pid=""
if ((long)); then
  bash "$(dirname "$0")/image.sh" >"$image_log" 2>&1 &
  image_pid=$!
fi
# Prints the kube-apiserver folder ($1) as the last line, once the image is
# ready, and exits.
finish() {
  if [[ -n "$image_pid" ]] && ! wait "$image_pid"; then
    cat "$image_log" >&2; rm -f "$image_log"
    log "tests/rig/image.sh failed (its output is above)"; exit 1
  fi
  cat "$image_log" >&2; rm -f "$image_log"
  echo "$1"
  exit 0
}
# --- end of image test section ---------------------------------------------

# --- packages (tests/integration/packaging.rs, packaging/build.sh) --------
# cargo-deb and cargo-generate-rpm, pinned (as in testkit/src/prereq.rs),
# installed with cargo only when missing or at another version. They land in
# cargo's bin (~/.cargo/bin), which outlives CI runs on a machine; cold, each
# takes several minutes to compile on 2 cores. Under sudo they are installed
# for the invoking user, whose cargo runs the tests.
CARGO_TOOLS=("cargo-deb 3.8.0" "cargo-generate-rpm 0.21.1")
cargo_user="${SUDO_USER:-$(id -un)}"
cargo_user_home="$(getent passwd "$cargo_user" | cut -d: -f6)"
cargo_bin="${CARGO_HOME:-$cargo_user_home/.cargo}/bin"
as_cargo_user() {
  if [[ "$cargo_user" == "$(id -un)" ]]; then
    "$@"
  else
    runuser -u "$cargo_user" -- env HOME="$cargo_user_home" "$@"
  fi
}
CARGO_INSTALL_TARGET="$CACHE_DIR/cargo-install-target"
mkdir -p "$CARGO_INSTALL_TARGET"
chown "$cargo_user" "$CARGO_INSTALL_TARGET"
for tool_version in "${CARGO_TOOLS[@]}"; do
  tool=${tool_version% *}; version=${tool_version#* }
  # `cargo install --list` names what is installed, e.g. "cargo-deb v3.8.0:".
  # Read whole, then matched (a pipe into an early-exiting grep: SIGPIPE race under pipefail).
  installed="$(PATH="$cargo_bin:$PATH" as_cargo_user cargo install --list 2>/dev/null)" || true
  if grep -qx "$tool v$version:" <<<"$installed"; then
    continue
  fi
  log "installing $tool $version with cargo (one-time, several minutes)"
  # One target dir for both (and tests/fuzz.sh's cargo-fuzz): what they
  # share (clap, serde, toml, ...) compiles once, also on a later version bump.
  PATH="$cargo_bin:$PATH" as_cargo_user env -u CARGO_TARGET_DIR \
    cargo install --locked --quiet "$tool" --version "$version" \
    --target-dir "$CARGO_INSTALL_TARGET" >&2
done
# --- end of packages section -----------------------------------------------

# --- VM tests (tests/vm) ---------------------------------------------------
# qemu, kmod and cpio, and Debian's stock kernel (where macvlan is a loadable
# module), unpacked, not installed, and cached by package version:
#   $CACHE_DIR/kernel/<version>/boot/vmlinuz-<release>
#   $CACHE_DIR/kernel/<version>/lib/modules/<release>/   (with modules.dep)
#   $CACHE_DIR/kernel/<version>/VERSION                  (<release>, uname -r)
# tests/vm uses the newest such folder, or HNA_VM_KERNEL_DIR.
# This section sits before the kube-apiserver part because that part exits
# early once its build is cached.
# (VM_PACKAGES are installed at the top.)
if [[ -n "${HNA_VM_KERNEL_DIR:-}" ]]; then
  log "using the VM kernel from HNA_VM_KERNEL_DIR=${HNA_VM_KERNEL_DIR}"
else
  kernel_pkg() {
    apt-cache depends linux-image-amd64 2>/dev/null \
      | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*-amd64\)$/\1/p' | sed -n 1p
  }
  KPKG=$(kernel_pkg)
  if [[ -z "$KPKG" ]]; then apt_update; KPKG=$(kernel_pkg); fi
  [[ -n "$KPKG" ]] || { log "cannot resolve the kernel package of linux-image-amd64"; exit 1; }
  KVER=$(apt-cache show --no-all-versions "$KPKG" | sed -n 's/^Version: //p' | sed -n 1p)
  [[ -n "$KVER" ]] || { log "no version found for $KPKG"; exit 1; }
  KDIR="$CACHE_DIR/kernel/$KVER"
  if [[ -f "$KDIR/VERSION" ]]; then
    log "VM kernel $KPKG $KVER ($(cat "$KDIR/VERSION")) cached at $KDIR"
  else
    log "fetching $KPKG $KVER for the VM tests (one-time, ~70 MB)"
    mkdir -p "$CACHE_DIR/kernel"
    KTMP=$(mktemp -d "$CACHE_DIR/kernel/.tmp-XXXXXX")
    trap 'rm -rf "$KTMP"' EXIT
    # apt-get download runs as the _apt user when that user can write here.
    chmod 755 "$KTMP"; mkdir "$KTMP/dl"
    chown _apt "$KTMP/dl" 2>/dev/null || true
    ( cd "$KTMP/dl" && apt-get download -qq "$KPKG=$KVER" >&2 )
    DEB=$(find "$KTMP/dl" -maxdepth 1 -name '*.deb' | sed -n 1p)
    [[ -f "$DEB" ]] || { log "apt-get download $KPKG=$KVER produced no .deb"; exit 1; }
    dpkg-deb -x "$DEB" "$KTMP/root"
    rm -rf "$KTMP/dl"
    VMLINUZ=$(find "$KTMP/root/boot" -maxdepth 1 -name 'vmlinuz-*' | sed -n 1p)
    [[ -f "$VMLINUZ" ]] || { log "$KPKG has no boot/vmlinuz-*"; exit 1; }
    KREL=${VMLINUZ##*/vmlinuz-}
    MODS="$KTMP/root/lib/modules/$KREL"
    [[ -d "$MODS" ]] || MODS="$KTMP/root/usr/lib/modules/$KREL"
    [[ -d "$MODS" ]] || { log "$KPKG has no lib/modules/$KREL"; exit 1; }
    mkdir -p "$KTMP/out/boot" "$KTMP/out/lib/modules"
    mv "$VMLINUZ" "$KTMP/out/boot/"
    mv "$MODS" "$KTMP/out/lib/modules/"
    rm -rf "$KTMP/root"
    depmod -b "$KTMP/out" "$KREL"
    echo "$KREL" > "$KTMP/out/VERSION"
    rm -rf "$KDIR"
    mv "$KTMP/out" "$KDIR"
    rm -rf "$KTMP"
    trap - EXIT
    log "VM kernel $KREL ($KPKG $KVER) cached at $KDIR"
  fi
fi
# --- end of VM tests section -----------------------------------------------

# --- Shipping: kiwi, OCI image, cloud-init (tests/integration/{kiwi,oci_image,cloud_init}.rs)
# buildah builds the controller image (packaging/oci/build.sh), umoci unpacks
# it into a bundle, runc runs it; cloud-init's `schema` checks the shipped
# user data. kiwi comes from PyPI into a venv cached by version (keep
# KIWI_VERSION in step with testkit/src/prereq.rs):
#   $CACHE_DIR/kiwi-venv-<version>/bin/kiwi-ng
# (SHIP_PACKAGES are installed at the top.)
KIWI_VERSION=11.1.6
KIWI_VENV="$CACHE_DIR/kiwi-venv-$KIWI_VERSION"
# Built in place: a venv's scripts name its absolute path, so it cannot be
# moved; a half-made one fails the version check and is made again.
kiwi_reported="$("$KIWI_VENV/bin/kiwi-ng" --version 2>/dev/null)" || true
if grep -q "version $KIWI_VERSION\$" <<<"$kiwi_reported"; then
  log "kiwi $KIWI_VERSION cached at $KIWI_VENV"
else
  log "installing kiwi $KIWI_VERSION from PyPI into $KIWI_VENV (one-time, ~1 minute)"
  rm -rf "$KIWI_VENV"
  /usr/bin/python3 -m venv "$KIWI_VENV"
  "$KIWI_VENV/bin/pip" install -q "kiwi==$KIWI_VERSION" >&2
fi
# --- end of shipping section ------------------------------------------------

# --- The peers (tests/integration/{peers,harvester_ccm}.rs,
# benches/peers.rs): kube-vip and MetalLB from the Go module proxy and the
# Harvester cloud provider from its snapshot (tests/rig/peers.sh), built
# once and cached by version (cold, about 10 minutes on 2 cores). A long
# suite's.
if ((long)); then
  bash "$(dirname "$0")/peers.sh" >&2
fi

# --- Helm (tests/integration/helm_chart.rs) from the Go module proxy
# (tests/rig/helm.sh), built once and cached by version (cold, about 1.5
# minutes on 2 cores with Go's caches warm).
bash "$(dirname "$0")/helm.sh" >&2

if [[ -n "${KUBEBUILDER_ASSETS:-}" && -x "${KUBEBUILDER_ASSETS}/kube-apiserver" ]]; then
  log "using kube-apiserver from KUBEBUILDER_ASSETS=${KUBEBUILDER_ASSETS}"
  finish "${KUBEBUILDER_ASSETS}"
fi

# --- Kubernetes and etcd from the Go module proxy (tests/rig/kubernetes.sh) -
# kube-apiserver and kubectl of the newest release and of the oldest
# supported one (the oldest: for tests/long.sh), and etcd; built once and
# cached by version. The folder printed last is the newest release's, or
# HNA_KUBE_RELEASE's (newest, oldest; by default both are built, with `ci`
# the newest only, and the newest is printed).
releases=all
((long)) || releases=newest
k8s_dir="$(bash "$(dirname "$0")/kubernetes.sh" "${HNA_KUBE_RELEASE:-$releases}" | tail -n1)"
[[ -n "$k8s_dir" ]] || { log "tests/rig/kubernetes.sh printed no folder"; exit 1; }
finish "$k8s_dir"
