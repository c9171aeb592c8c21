#!/usr/bin/env bash
# The demo: installs only what it runs, builds, brings up the local rig (a
# DHCP LAN, three guest-VM network namespaces and a client on it, a real
# kube-apiserver + etcd with packaging/kubernetes applied), runs the node
# agent in each guest namespace and two controller replicas, and tells the
# story of a DHCP LoadBalancer Service: its address, a TCP request through
# it, which node holds it, and its release. Pass --hold to keep everything
# running until Ctrl-C.
# Needs root (network namespaces). Everything stays inside the rig's
# namespaces and loopback, and is torn down at the end.
#
# On a fresh machine the builds (our binaries with cargo; kube-apiserver and
# etcd from the Go module proxy) run side by side, so that one's downloads
# overlap another's compiling; the test-only prerequisites (kubectl, the
# peers, a second release, the VM kernel and image, kiwi, the packaging
# tools) come with tests/run.sh, not here.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
say() { echo "demo.sh: $*" >&2; }

build_log="$(mktemp)"
trap 'rm -f "$build_log"' EXIT
# The dev profile: what tests/run.sh builds too, so a later test run reuses
# it, and quicker to build than the release profile's optimised, thin-LTO one.
say "building harvester-node-agent and the demo (cargo build) in the background"
cargo build --locked --bin harvester-node-agent --example demo >"$build_log" 2>&1 &
build_pid=$!

say "installing what the demo runs (tests/rig/prereqs.sh demo)"
if ! KUBEBUILDER_ASSETS="$(bash tests/rig/prereqs.sh demo | tail -n1)"; then
  kill "$build_pid" 2>/dev/null || true
  say "tests/rig/prereqs.sh demo failed (its output is above)"; exit 1
fi
export KUBEBUILDER_ASSETS
if ! wait "$build_pid"; then
  cat "$build_log" >&2
  say "cargo build failed (its output is above)"; exit 1
fi
say "ready after $((SECONDS - started)) s: kube-apiserver and etcd from $KUBEBUILDER_ASSETS"
exec target/debug/examples/demo --agent target/debug/harvester-node-agent "$@"
