#!/usr/bin/env bash
# Builds the rig's control plane from the Go module proxy with the ordinary
# `go` client: kube-apiserver and kubectl of each pinned Kubernetes release,
# and etcd. Nothing of those projects is kept in this repository: only the
# module paths and versions below.
#
# Cached by version outside the checkout, each folder complete or absent
# (built in a scratch folder, moved into place only when everything in it
# built):
#   $CACHE_DIR/kubernetes/<release>/{kube-apiserver,kubectl,etcd}   (etcd: a link;
#                                 each binary whole or absent)
#   $CACHE_DIR/etcd/<version>/etcd
#   $CACHE_DIR/go/{mod,build}     Go's module and build caches
# A warm run only checks that the folders are there.
#
# Usage: kubernetes.sh [newest|oldest|all]   (default all)
# Prints the folder of the named release (newest for `all`) on its last line.
set -euo pipefail

# The releases the rig runs (keep in step with docs/testing.md, "Kubernetes
# versions" and testkit/src/rig/apiserver.rs):
#   newest: the newest release the Go module proxy serves; every test.
#   oldest: the oldest minor the product supports (k8s-openapi's floor,
#           v1_33, and the RKE2 lines Harvester pairs with); the
#           LoadBalancer and failover suites run on it too.
# The HNA_* overrides are for trying another release (and for the test of
# this script's errors); CI uses the pins.
KUBE_NEWEST="${HNA_KUBE_NEWEST:-v1.37.2}"
KUBE_OLDEST="${HNA_KUBE_OLDEST:-v1.33.13}"
ETCD_VERSION="${HNA_ETCD_VERSION:-v3.6.16}"

CACHE_DIR="${HNA_CACHE_DIR:-/var/cache/harvester-node-agent}"
which_release="${1:-all}"
# The commands to build: both by default; `HNA_KUBE_COMMANDS=kube-apiserver`
# for the demo, which runs no kubectl.
read -r -a KUBE_COMMANDS <<<"${HNA_KUBE_COMMANDS:-kube-apiserver kubectl}"

log() { echo "kubernetes.sh: $*" >&2; }
die() { log "$*"; exit 1; }

# shellcheck source=tests/rig/go-build.sh
source "$(dirname "$0")/go-build.sh"

# served MODULE VERSION: stops unless the proxy serves that version.
served() {
  step "looking up $1@$2 on the Go module proxy" "$1" "$2" go list -m -json "$1@$2"
}

ensure_etcd() {
  local dir="$CACHE_DIR/etcd/$ETCD_VERSION"
  if [[ -x "$dir/etcd" ]]; then
    log "etcd $ETCD_VERSION cached at $dir"; return
  fi
  scratch="$(mktemp -d "$CACHE_DIR/build/etcd-$ETCD_VERSION.XXXXXX")"
  local module=go.etcd.io/etcd/server/v3
  log "building etcd $ETCD_VERSION from the Go module proxy (one-time, ~2 minutes)"
  served "$module" "$ETCD_VERSION"
  printf 'module hna.invalid/rig-etcd\n\ngo 1.26\n' >"$scratch/go.mod"
  step "go get" "$module" "$ETCD_VERSION" go get "$module@$ETCD_VERSION"
  mkdir "$scratch/out"
  step "go build" "$module" "$ETCD_VERSION" \
    go build -trimpath -ldflags='-s -w' -o out/etcd "$module"
  # Read whole before it is matched: under pipefail a pipe into a grep
  # that quits at its first match fails at random (SIGPIPE).
  local reported
  reported="$("$scratch/out/etcd" --version 2>&1)" || true
  [[ "$reported" == *"etcd Version: ${ETCD_VERSION#v}"* ]] \
    || die "the etcd built from $module@$ETCD_VERSION does not report version ${ETCD_VERSION#v}: $(head -3 <<<"$reported")"
  cache_built "$dir" "etcd $ETCD_VERSION"
}

# ensure_kubernetes vX.Y.Z: the commands in KUBE_COMMANDS (kube-apiserver
# and kubectl; the demo asks for kube-apiserver alone) of that release. What
# is cached is kept; only what is missing is built, so a later full run
# after the demo's adds kubectl with most packages from Go's build cache.
ensure_kubernetes() {
  local release="$1" dir="$CACHE_DIR/kubernetes/$1" cmd missing=()
  for cmd in "${KUBE_COMMANDS[@]}"; do
    [[ -x "$dir/$cmd" ]] || missing+=("$cmd")
  done
  if ((${#missing[@]} == 0)) && [[ -e "$dir/etcd" ]]; then
    log "Kubernetes $release (${KUBE_COMMANDS[*]}) cached at $dir"; return
  fi
  scratch="$(mktemp -d "$CACHE_DIR/build/kubernetes-$release.XXXXXX")"
  local module=k8s.io/kubernetes minor staging
  minor="$(cut -d. -f2 <<<"$release")"
  staging="v0.${release#v1.}"
  if ((${#missing[@]})); then
    log "building ${missing[*]} $release from the Go module proxy (one-time, ~10 minutes)"
    served "$module" "$release"
    # k8s.io/kubernetes points its k8s.io/* staging modules at ./staging, which
    # a module download leaves out: a wrapper module pins each of them to the
    # matching published v0.Y.Z (kubernetes/kubernetes#79384).
    step "go mod download" "$module" "$release" \
      go mod download -json "$module@$release"
    local gomod
    gomod="$(jq -r .GoMod "$scratch/step.log")"
    printf 'module hna.invalid/rig-kubernetes\n\ngo 1.26\n' >"$scratch/go.mod"
    local staged
    staged="$(go mod edit -json "$gomod" \
      | jq -r '.Replace[] | select(.New.Path | startswith("./staging/")) | .Old.Path')"
    [[ -n "$staged" ]] || die "no ./staging replace directives in the go.mod of $module@$release: the wrapper pattern does not apply to it"
    local m
    # Not looked up one by one: the build reads only those it needs (some,
    # like the sample modules, are not served at every version), and `go get`
    # below names any it cannot fetch.
    for m in $staged; do
      (cd "$scratch" && go mod edit -replace "$m=$m@$staging")
    done
    local packages=()
    for cmd in "${missing[@]}"; do packages+=("$module/cmd/$cmd"); done
    step "go get" "$module" "$release" \
      go get "${packages[@]/%/@$release}"
    # What Kubernetes' own build stamps (hack/lib/version.sh), so /version and
    # `kubectl version` name the release.
    local ldflags="-s -w" pkg
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      ldflags+=" -X $pkg.gitVersion=$release -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
      ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    done
    mkdir "$scratch/out"
    step "go build" "$module" "$release" \
      go build -trimpath -ldflags="$ldflags" -o out/ "${packages[@]}"
    if [[ -x "$scratch/out/kube-apiserver" ]]; then
      local reported
      reported="$("$scratch/out/kube-apiserver" --version 2>&1)" || true
      [[ "$reported" == "Kubernetes $release" ]] \
        || die "the kube-apiserver built from $module@$release reports $reported"
    fi
  fi
  # Each binary is moved into place whole, so the folder never holds a
  # half-written one; etcd is a link to its own cached build.
  mkdir -p "$dir"
  for cmd in "${missing[@]}"; do
    mv "$scratch/out/$cmd" "$dir/$cmd"
  done
  ln -sfn "../../etcd/$ETCD_VERSION/etcd" "$dir/etcd"
  rm -rf "$scratch"; scratch=""
  log "Kubernetes $release (${KUBE_COMMANDS[*]}) built and cached at $dir"
}

case "$which_release" in
  newest) releases=("$KUBE_NEWEST") ;;
  oldest) releases=("$KUBE_OLDEST") ;;
  all) releases=("$KUBE_NEWEST" "$KUBE_OLDEST") ;;
  *) die "usage: kubernetes.sh [newest|oldest|all] (not \`$which_release\`)" ;;
esac
# Every version that is to be built is looked up first, so that a pin the
# proxy does not serve stops the script in seconds, before any build.
scratch="$(mktemp -d "$CACHE_DIR/build/lookup.XXXXXX")"
[[ -x "$CACHE_DIR/etcd/$ETCD_VERSION/etcd" ]] || served go.etcd.io/etcd/server/v3 "$ETCD_VERSION"
for release in "${releases[@]}"; do
  [[ -x "$CACHE_DIR/kubernetes/$release/kube-apiserver" ]] || served k8s.io/kubernetes "$release"
done
rm -rf "$scratch"; scratch=""

# etcd builds beside Kubernetes: on a fresh machine one's downloads overlap
# the other's compiling.
( trap cleanup EXIT; ensure_etcd ) &
etcd_pid=$!
case "$which_release" in
  newest) ensure_kubernetes "$KUBE_NEWEST"; out="$CACHE_DIR/kubernetes/$KUBE_NEWEST" ;;
  oldest) ensure_kubernetes "$KUBE_OLDEST"; out="$CACHE_DIR/kubernetes/$KUBE_OLDEST" ;;
  all)
    ensure_kubernetes "$KUBE_NEWEST"
    ensure_kubernetes "$KUBE_OLDEST"
    out="$CACHE_DIR/kubernetes/$KUBE_NEWEST" ;;
  *) die "usage: kubernetes.sh [newest|oldest|all] (not \`$which_release\`)" ;;
esac
wait "$etcd_pid" || die "building etcd $ETCD_VERSION failed (its output is above)"
echo "$out"
