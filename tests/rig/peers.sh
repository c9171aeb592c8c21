#!/usr/bin/env bash
# Builds the peers the rig measures us beside, from the Go module proxy with
# the ordinary `go` client: kube-vip (DHCP mode) and MetalLB's speaker and
# controller (L2); and the Harvester cloud provider (the guest CCM), which
# the proxy refuses, from the source snapshot the project's peers folder
# keeps (`../shared/peers/` beside the checkout; it vendors every
# dependency, so it builds offline). They are test prerequisites, never
# part of the product; nothing of those projects is kept in this
# repository, only the module paths, versions and the snapshot's name and
# checksum below.
#
# Cached by version outside the checkout, each folder complete or absent
# (built in a scratch folder, moved into place only when everything in it
# built):
#   $CACHE_DIR/peers/kube-vip/<version>/kube-vip
#   $CACHE_DIR/peers/metallb/<version>/{speaker,controller,crds/*.yaml}
#   $CACHE_DIR/peers/harvester-cloud-provider/<commit>/harvester-cloud-provider
#   $CACHE_DIR/go/{mod,build}     Go's module and build caches (shared with
#                                 kubernetes.sh)
#
# HNA_PEERS_SRC: the folder holding the snapshot, where it is not in a
# `shared/peers` folder beside the checkout or above it.
# The CRDs are MetalLB's own (config/crd/bases of the module), which both
# binaries watch at start; they are applied by the test kit.
#
# Usage: peers.sh           prints the peers' folder on its last line.
set -euo pipefail

# kube-vip v1.2.3 is the newest release, but the Go module proxy refuses it
# (403, "This module version is not available", tried 2026-11-25 and
# 2026-11-26); v1.2.2 is the newest it serves.
KUBE_VIP_VERSION="${HNA_KUBE_VIP_VERSION:-v1.2.2}"
METALLB_VERSION="${HNA_METALLB_VERSION:-v0.16.1}"

# The Harvester cloud provider's snapshot: master after v0.2.4
# (github.com/harvester/harvester-cloud-provider), `git archive` of it.
CCM_COMMIT=1a80755
CCM_TARBALL="harvester-cloud-provider-$CCM_COMMIT.tar.xz"
CCM_SHA256=0a1a8e94d857c35c982c895c9cba25ec184e883e6712165fa3cb0c6a01617553

CACHE_DIR="${HNA_CACHE_DIR:-/var/cache/harvester-node-agent}"

log() { echo "peers.sh: $*" >&2; }
die() { log "$*"; exit 1; }

# shellcheck source=tests/rig/go-build.sh
source "$(dirname "$0")/go-build.sh"

ensure_kube_vip() {
  local dir="$CACHE_DIR/peers/kube-vip/$KUBE_VIP_VERSION"
  if [[ -x "$dir/kube-vip" ]]; then
    log "kube-vip $KUBE_VIP_VERSION cached at $dir"; return
  fi
  local module=github.com/kube-vip/kube-vip
  scratch="$(mktemp -d "$CACHE_DIR/build/kube-vip-$KUBE_VIP_VERSION.XXXXXX")"
  log "building kube-vip $KUBE_VIP_VERSION from the Go module proxy (one-time, ~3 minutes)"
  printf 'module hna.invalid/rig-kube-vip\n\ngo 1.26\n' >"$scratch/go.mod"
  step "go get" "$module" "$KUBE_VIP_VERSION" go get "$module@$KUBE_VIP_VERSION"
  mkdir "$scratch/out"
  # What kube-vip's own Makefile stamps, so its log names the release.
  step "go build" "$module" "$KUBE_VIP_VERSION" \
    go build -trimpath -ldflags="-s -w -X main.Version=$KUBE_VIP_VERSION -X main.Build=module-proxy" \
    -o out/kube-vip "$module"
  # Read whole before it is matched: under pipefail a pipe into a grep that
  # quits at its first match fails when kube-vip then dies of SIGPIPE.
  local reported
  reported="$("$scratch/out/kube-vip" version 2>&1)" || true
  [[ "$reported" == *"$KUBE_VIP_VERSION"* ]] \
    || die "the kube-vip built from $module@$KUBE_VIP_VERSION does not report $KUBE_VIP_VERSION: $(head -3 <<<"$reported")"
  cache_built "$dir" "kube-vip $KUBE_VIP_VERSION"
}

ensure_metallb() {
  local dir="$CACHE_DIR/peers/metallb/$METALLB_VERSION"
  if [[ -x "$dir/speaker" && -x "$dir/controller" && -d "$dir/crds" ]]; then
    log "MetalLB $METALLB_VERSION cached at $dir"; return
  fi
  local module=go.universe.tf/metallb
  scratch="$(mktemp -d "$CACHE_DIR/build/metallb-$METALLB_VERSION.XXXXXX")"
  log "building MetalLB $METALLB_VERSION (speaker, controller) from the Go module proxy (one-time, ~4 minutes)"
  printf 'module hna.invalid/rig-metallb\n\ngo 1.26\n' >"$scratch/go.mod"
  step "go mod download" "$module" "$METALLB_VERSION" \
    go mod download -json "$module@$METALLB_VERSION"
  local src
  src="$(jq -r .Dir "$scratch/step.log")"
  step "go get" "$module" "$METALLB_VERSION" \
    go get "$module/speaker@$METALLB_VERSION" "$module/controller@$METALLB_VERSION"
  mkdir "$scratch/out"
  step "go build" "$module" "$METALLB_VERSION" \
    go build -trimpath -ldflags='-s -w' -o out/ "$module/speaker" "$module/controller"
  [[ -d "$src/config/crd/bases" ]] \
    || die "no config/crd/bases in $module@$METALLB_VERSION ($src): MetalLB's CRDs moved; update peers.sh"
  mkdir "$scratch/out/crds"
  cp "$src"/config/crd/bases/*.yaml "$scratch/out/crds/"
  cache_built "$dir" "MetalLB $METALLB_VERSION"
}

# The snapshot: HNA_PEERS_SRC, else the first `shared/peers` folder beside
# the checkout or one of the folders above it.
ccm_snapshot() {
  if [[ -n "${HNA_PEERS_SRC:-}" ]]; then
    echo "$HNA_PEERS_SRC/$CCM_TARBALL"; return
  fi
  local dir
  dir="$(cd "$(dirname "$0")/../.." && pwd)"
  while [[ "$dir" != / ]]; do
    dir="$(dirname "$dir")"
    if [[ -f "$dir/shared/peers/$CCM_TARBALL" ]]; then
      echo "$dir/shared/peers/$CCM_TARBALL"; return
    fi
  done
  echo "../shared/peers/$CCM_TARBALL"
}

ensure_harvester_ccm() {
  local dir="$CACHE_DIR/peers/harvester-cloud-provider/$CCM_COMMIT"
  if [[ -x "$dir/harvester-cloud-provider" ]]; then
    log "Harvester cloud provider $CCM_COMMIT cached at $dir"; return
  fi
  local tarball
  tarball="$(ccm_snapshot)"
  [[ -f "$tarball" ]] \
    || die "the Harvester cloud provider's snapshot $CCM_TARBALL is not at $tarball: set HNA_PEERS_SRC to the folder that holds it (the project's shared peers folder)"
  [[ "$(sha256sum "$tarball" | cut -d' ' -f1)" == "$CCM_SHA256" ]] \
    || die "$tarball does not have the sha256 $CCM_SHA256 this script was written for"
  scratch="$(mktemp -d "$CACHE_DIR/build/harvester-cloud-provider-$CCM_COMMIT.XXXXXX")"
  log "building the Harvester cloud provider $CCM_COMMIT from $tarball, offline from its vendor folder (one-time, ~5 CPU-minutes)"
  step "tar -xJf" harvester-cloud-provider "$CCM_COMMIT" tar -xJf "$tarball"
  local src="$scratch/harvester-cloud-provider-$CCM_COMMIT"
  [[ -d "$src/vendor" ]] \
    || die "$tarball holds no harvester-cloud-provider-$CCM_COMMIT/vendor folder"
  mkdir "$scratch/out"
  step "go build" harvester-cloud-provider "$CCM_COMMIT" \
    env -C "$src" GOFLAGS=-mod=vendor go build -trimpath -ldflags='-s -w' \
    -o "$scratch/out/harvester-cloud-provider" .
  local help
  help="$("$scratch/out/harvester-cloud-provider" --help 2>&1)" || true
  [[ "$help" == *"--cloud-config"* ]] \
    || die "the Harvester cloud provider built from $tarball does not answer --help with --cloud-config: $(head -3 <<<"$help")"
  cache_built "$dir" "Harvester cloud provider $CCM_COMMIT"
}

ensure_kube_vip
ensure_metallb
ensure_harvester_ccm
echo "$CACHE_DIR/peers"
