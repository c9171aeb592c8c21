#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs the prerequisites of
# the real-part tests (Debian packages, the kube-apiserver build, cached by
# version outside the checkout), then runs every test. Needs root: the tests
# create network namespaces, veths, macvlans and run dnsmasq, etcd and
# kube-apiserver. A non-root run skips what needs root (cargo counts those
# tests as ignored); as root or under CI=true a missing prerequisite fails a
# test, naming the command that installs it.
#
# The last line is the integration tests' `skipped: N of M ...` summary, also
# when something failed.
set -euo pipefail
cd "$(dirname "$0")/.."

log="$(mktemp)"
skipped_summary() {
    local line
    line="$(grep -h '^skipped: ' "$log" 2>/dev/null | tail -n1 || true)"
    echo "${line:-skipped: unknown (the integration tests did not run to their end)}"
    rm -f "$log"
}
trap skipped_summary EXIT

if [[ $(id -u) -eq 0 ]]; then
    KUBEBUILDER_ASSETS="$(bash tests/rig/prereqs.sh | tail -n1)"
    export KUBEBUILDER_ASSETS
else
    echo "run.sh: not root: the prerequisites are not installed and the tests that need root are skipped" >&2
fi
# The test binaries' output (stdout) is kept to repeat the summary at the end.
cargo test --locked "$@" | tee "$log"
# Unit tests that need root (private network namespaces) are #[ignore]d so
# that a plain `cargo test` counts them instead of passing them silently;
# as root they run here.
if [[ $(id -u) -eq 0 ]]; then
    cargo test --locked --lib -- --ignored
fi
# The fuzz target of the DHCP receive path, for a bounded time (60 s by
# default, HNA_FUZZ_SECONDS to change); a crash fails the run.
bash tests/fuzz.sh
