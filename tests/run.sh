#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs the prerequisites of
# the real-part tests (Debian packages; kube-apiserver, kubectl and etcd
# built from the Go module proxy, cached by version outside the checkout),
# then runs every test on the newest Kubernetes release but the long suites
# (tests/long.sh runs those, and the API-facing suites on the oldest
# supported release: docs/testing.md, "The long suites"). Needs root: the
# tests create network namespaces, veths, macvlans and run dnsmasq, etcd
# and kube-apiserver. A non-root run skips what needs root (cargo counts
# those tests as ignored); as root or under CI=true a missing prerequisite
# fails a test, naming the command that installs it.
#
# The last lines are each failed test's message, shortened (`failed: NAME:
# ...`), the integration run's `durations: ...` lines (its time per module
# and the longest tests), then its `skipped: N of M ...` summary, which
# also counts the long tests left out, also when something failed
# (tests/rig/summary.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

log="$(mktemp)"
# shellcheck source=tests/rig/summary.sh
source tests/rig/summary.sh
trap closing_summary EXIT

if [[ $(id -u) -eq 0 ]]; then
    KUBEBUILDER_ASSETS="$(bash tests/rig/prereqs.sh ci | tail -n1)"
    export KUBEBUILDER_ASSETS
else
    echo "run.sh: not root: the prerequisites are not installed and the tests that need root are skipped" >&2
fi
# The test binaries' output (stdout) is kept to repeat the summary at the end.
echo "run.sh: every test but the long suites on ${KUBEBUILDER_ASSETS:-no API server}" >&2
HNA_TEST_SET=ci cargo test --locked --workspace "$@" | tee -a "$log"
# Unit tests that need root (private network namespaces) are #[ignore]d so
# that a plain `cargo test` counts them instead of passing them silently;
# as root they run here.
if [[ $(id -u) -eq 0 ]]; then
    cargo test --locked --workspace --lib -- --ignored
fi
# The API docs of every crate build without a warning (broken or private
# links, unclosed tags).
RUSTDOCFLAGS="-D warnings" cargo doc --locked --workspace --no-deps
