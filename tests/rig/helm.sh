#!/usr/bin/env bash
# Builds Helm (the `helm` client, v3, as Rancher's Apps & Marketplace and
# RKE2's helm-controller run it) from the Go module proxy with the ordinary
# `go` client, for the chart's tests (tests/integration/helm_chart.rs). A
# test prerequisite, never part of the product.
#
# Cached by version outside the checkout, complete or absent:
#   $CACHE_DIR/helm/<version>/helm
#   $CACHE_DIR/go/{mod,build}     Go's caches (shared with kubernetes.sh)
#
# Usage: helm.sh      prints the folder holding `helm` on its last line.
set -euo pipefail

HELM_VERSION="${HNA_HELM_VERSION:-v3.22.0}"
CACHE_DIR="${HNA_CACHE_DIR:-/var/cache/harvester-node-agent}"

log() { echo "helm.sh: $*" >&2; }
die() { log "$*"; exit 1; }

# shellcheck source=tests/rig/go-build.sh
source "$(dirname "$0")/go-build.sh"

dir="$CACHE_DIR/helm/$HELM_VERSION"
if [[ -x "$dir/helm" ]]; then
  log "helm $HELM_VERSION cached at $dir"
else
  module=helm.sh/helm/v3
  scratch="$(mktemp -d "$CACHE_DIR/build/helm-$HELM_VERSION.XXXXXX")"
  log "building helm $HELM_VERSION from the Go module proxy (one-time, a few minutes)"
  printf 'module hna.invalid/rig-helm\n\ngo 1.26\n' >"$scratch/go.mod"
  step "go get" "$module" "$HELM_VERSION" go get "$module/cmd/helm@$HELM_VERSION"
  mkdir "$scratch/out"
  # What Helm's own Makefile stamps, so `helm version` names the release.
  step "go build" "$module" "$HELM_VERSION" \
    go build -trimpath \
    -ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    -o out/helm "$module/cmd/helm"
  reported="$("$scratch/out/helm" version --short 2>&1)" || true
  [[ "$reported" == "$HELM_VERSION"* ]] \
    || die "the helm built from $module@$HELM_VERSION reports $(head -1 <<<"$reported"), not $HELM_VERSION"
  cache_built "$dir" "helm $HELM_VERSION"
fi
echo "$dir"
