#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs the prerequisites of
# the real-part tests (Debian packages; kube-apiserver, kubectl and etcd
# built from the Go module proxy, cached by version outside the checkout),
# then runs every test on the newest Kubernetes release and the API-facing
# suites again on the oldest supported one. Needs root: the tests
# create network namespaces, veths, macvlans and run dnsmasq, etcd and
# kube-apiserver. A non-root run skips what needs root (cargo counts those
# tests as ignored); as root or under CI=true a missing prerequisite fails a
# test, naming the command that installs it.
#
# The last lines are each failed test's message, shortened (`failed: NAME:
# ...`), the integration runs' `durations: ...` lines (their time per module
# and the longest tests), then their `skipped: N of M ...` summaries, also
# when something failed.
set -euo pipefail
cd "$(dirname "$0")/.."

log="$(mktemp)"
# One `skipped: ...` line per integration run (the newest release, then the
# oldest supported one), also when something failed.
skipped_summary() {
    local lines
    # Each failed test's message again, shortened, where a log cut to its
    # head and tail still shows it.
    awk '/^---- .* ----$/ { name = $2; n = 0; next }
         name != "" && /^$/ { name = ""; next }
         name != "" && n < 6 { print "failed: " name ": " substr($0, 1, 300); n++ }' \
        "$log" 2>/dev/null || true
    # Where the integration runs' time went (per module, the longest tests).
    grep -h '^durations: ' "$log" 2>/dev/null || true
    lines="$(grep -h '^skipped: ' "$log" 2>/dev/null || true)"
    echo "${lines:-skipped: unknown (the integration tests did not run to their end)}"
    rm -f "$log"
}
trap skipped_summary EXIT

# The suites that run a second time on the oldest supported Kubernetes
# release (docs/testing.md, "Kubernetes versions").
OLDEST_SUITES=(manifests:: loadbalancer:: current_api:: tenants:: failover::)

assets_given="${KUBEBUILDER_ASSETS:-}"
if [[ $(id -u) -eq 0 ]]; then
    KUBEBUILDER_ASSETS="$(bash tests/rig/prereqs.sh | tail -n1)"
    export KUBEBUILDER_ASSETS
else
    echo "run.sh: not root: the prerequisites are not installed and the tests that need root are skipped" >&2
fi
# The test binaries' output (stdout) is kept to repeat the summary at the end.
echo "run.sh: the whole suite on ${KUBEBUILDER_ASSETS:-no API server}" >&2
cargo test --locked --workspace "$@" | tee -a "$log"
# Unit tests that need root (private network namespaces) are #[ignore]d so
# that a plain `cargo test` counts them instead of passing them silently;
# as root they run here.
if [[ $(id -u) -eq 0 ]]; then
    cargo test --locked --workspace --lib -- --ignored
fi
# The API-facing suites again on the oldest supported release: only for a
# whole run (no test filter given) and when the servers are the ones
# prereqs.sh builds, not KUBEBUILDER_ASSETS's.
if [[ $(id -u) -eq 0 && $# -eq 0 && -z "$assets_given" ]]; then
    # (Without the KUBEBUILDER_ASSETS of the first run, which prereqs.sh
    # would take as an override.)
    newest="$KUBEBUILDER_ASSETS"
    KUBEBUILDER_ASSETS="$(env -u KUBEBUILDER_ASSETS HNA_KUBE_RELEASE=oldest bash tests/rig/prereqs.sh | tail -n1)"
    if [[ "$KUBEBUILDER_ASSETS" == "$newest" ]]; then
        echo "run.sh: prereqs.sh gave the newest release's folder for the oldest" >&2
        exit 1
    fi
    echo "run.sh: ${OLDEST_SUITES[*]} on $KUBEBUILDER_ASSETS" >&2
    HNA_TEST_FILTERS="${OLDEST_SUITES[*]}" cargo test --locked --test integration | tee -a "$log"
elif [[ -n "$assets_given" ]]; then
    echo "run.sh: KUBEBUILDER_ASSETS is set: the oldest supported release is not tried" >&2
fi
# The API docs of every crate build without a warning (broken or private
# links, unclosed tags).
RUSTDOCFLAGS="-D warnings" cargo doc --locked --workspace --no-deps
# The fuzz target of the DHCP receive path, for a bounded time (60 s by
# default, HNA_FUZZ_SECONDS to change); a crash fails the run.
bash tests/fuzz.sh
