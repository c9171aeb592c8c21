#!/usr/bin/env bash
# The demo: installs what is needed, builds, brings up the local rig (a DHCP
# LAN, three guest-VM network namespaces and a client on it, a real
# kube-apiserver + etcd with packaging/kubernetes applied), runs the node
# agent in each guest namespace and two controller replicas, and tells the
# story of a DHCP LoadBalancer Service: its address, a TCP request through
# it, which node holds it, and its release. Pass --hold to keep everything running until Ctrl-C.
# Needs root (network namespaces). Everything stays inside the rig's
# namespaces and loopback, and is torn down at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
KUBEBUILDER_ASSETS="$(bash tests/rig/prereqs.sh | tail -n1)"
export KUBEBUILDER_ASSETS
cargo build --locked --release --bin harvester-node-agent --example demo
exec target/release/examples/demo --agent target/release/harvester-node-agent "$@"
