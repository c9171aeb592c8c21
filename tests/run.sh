#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs the prerequisites of
# the real-part tests (Debian packages, the kube-apiserver build, cached by
# version outside the checkout), then runs every test. Needs root: the tests
# create network namespaces, veths, macvlans and run dnsmasq, etcd and
# kube-apiserver. Under CI=true a missing prerequisite fails a test instead of
# skipping it.
set -euo pipefail
cd "$(dirname "$0")/.."
KUBEBUILDER_ASSETS="$(bash tests/rig/prereqs.sh | tail -n1)"
export KUBEBUILDER_ASSETS
cargo test --locked "$@"
# The fuzz target of the DHCP receive path, for a bounded time (60 s by
# default, HNA_FUZZ_SECONDS to change); a crash fails the run.
bash tests/fuzz.sh
