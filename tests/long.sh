#!/usr/bin/env bash
# What does not fit CI's hour on a cold machine (issue #31; docs/testing.md,
# "The long suites"), in one command, as root:
#
#   sudo tests/long.sh
#
# 1. installs everything the tests need (tests/rig/prereqs.sh: also the VM
#    image, kube-vip, MetalLB, the Harvester cloud provider and the oldest
#    supported Kubernetes release, which tests/run.sh does not build);
# 2. runs the long suites on the newest release (the integration harness's
#    LONG_SUITES: the booted VM image, the peers, the Harvester cloud
#    provider, the flaky API server);
# 3. runs the API-facing suites again on the oldest supported release;
# 4. fuzzes the DHCP receive path for a bounded time (tests/fuzz.sh, 60 s by
#    default, HNA_FUZZ_SECONDS to change; a crash fails the run).
#
# Every test of the project has run once tests/run.sh and this have both
# passed. The closing lines are tests/run.sh's (tests/rig/summary.sh), one
# `durations:` pair and `skipped:` line per integration run.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $(id -u) -ne 0 ]]; then
    echo "long.sh: must run as root (network namespaces, VMs, packages): sudo tests/long.sh" >&2
    exit 1
fi
if (($#)); then
    echo "long.sh: takes no arguments (HNA_FUZZ_SECONDS sets the fuzzing time)" >&2
    exit 2
fi

log="$(mktemp)"
# shellcheck source=tests/rig/summary.sh
source tests/rig/summary.sh
trap closing_summary EXIT

# The suites that run a second time on the oldest supported Kubernetes
# release (docs/testing.md, "Kubernetes versions").
OLDEST_SUITES=(manifests:: loadbalancer:: current_api:: tenants:: failover::)

# Both releases are built; the newest's folder comes first (the servers
# are the ones prereqs.sh builds, not a KUBEBUILDER_ASSETS of the caller's).
KUBEBUILDER_ASSETS="$(env -u KUBEBUILDER_ASSETS bash tests/rig/prereqs.sh | tail -n1)"
export KUBEBUILDER_ASSETS
newest="$KUBEBUILDER_ASSETS"
echo "long.sh: the long suites on $KUBEBUILDER_ASSETS" >&2
HNA_TEST_SET=long cargo test --locked --test integration | tee -a "$log"

KUBEBUILDER_ASSETS="$(env -u KUBEBUILDER_ASSETS HNA_KUBE_RELEASE=oldest bash tests/rig/prereqs.sh | tail -n1)"
if [[ "$KUBEBUILDER_ASSETS" == "$newest" ]]; then
    echo "long.sh: prereqs.sh gave the newest release's folder for the oldest" >&2
    exit 1
fi
echo "long.sh: ${OLDEST_SUITES[*]} on $KUBEBUILDER_ASSETS" >&2
HNA_TEST_FILTERS="${OLDEST_SUITES[*]}" cargo test --locked --test integration | tee -a "$log"

# The fuzz target of the DHCP receive path, for a bounded time.
bash tests/fuzz.sh
