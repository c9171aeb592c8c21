#!/usr/bin/env bash
# Bounded cargo-fuzz run of the DHCP receive path (crates/dhcp/fuzz/fuzz_targets/
# dhcp_reply.rs, which calls hna_dhcp::fuzzing::exercise)
# on the stable toolchain, for CI.
#
#   bash tests/fuzz.sh                      # 60 s
#   HNA_FUZZ_SECONDS=600 bash tests/fuzz.sh
#
# - Installs cargo-fuzz $CARGO_FUZZ_VERSION once, into
#   ${HNA_CACHE_DIR:-/var/cache/harvester-node-agent}/cargo-fuzz/<version>/
#   (outside the checkout, kept between runs). A failed install fails.
# - Builds the target with AddressSanitizer into $HNA_CACHE_DIR/fuzz/target
#   (not the main target/, and kept between clones). cargo-fuzz passes nightly-only -Z flags; RUSTC_BOOTSTRAP=1 makes
#   the stable rustc accept them. The first build of the whole dependency
#   tree (release, ASan, coverage instrumentation) takes minutes; later ones
#   are incremental.
# - Fuzzes for ${HNA_FUZZ_SECONDS:-60} seconds. The corpus lives in
#   $HNA_CACHE_DIR/fuzz/corpus/dhcp_reply, so each run starts from what the
#   earlier ones found; fuzz/corpus-seeds/dhcp_reply (valid OFFER/ACK/NAK
#   payloads, the same as IPv4/UDP frames, an ARP reply) is read as well.
# - Exits non-zero when libFuzzer finds a crash, leak, timeout (> 10 s for
#   one input) or OOM, and prints the artifact's path and bytes. Reproduce:
#     RUSTC_BOOTSTRAP=1 cargo fuzz run dhcp_reply <artifact>
#
# Needs: rustup's stable toolchain (cargo on PATH or in $HOME/.cargo/bin), a C
# compiler (libfuzzer-sys builds libFuzzer), crates.io access for the first
# install and build. Runs as any user that can write $HNA_CACHE_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
# The fuzz target lives with the DHCP client crate (crates/dhcp/fuzz/).
cd crates/dhcp

CARGO_FUZZ_VERSION=0.13.2
TARGET=dhcp_reply
cache="${HNA_CACHE_DIR:-/var/cache/harvester-node-agent}"
seconds="${HNA_FUZZ_SECONDS:-60}"
if ! [[ $seconds =~ ^[0-9]+$ ]] || ((seconds < 1)); then
    # libFuzzer reads -max_total_time=0 as "no limit".
    echo "fuzz.sh: HNA_FUZZ_SECONDS must be a whole number of seconds >= 1, not '$seconds'" >&2
    exit 2
fi

if ! command -v cargo >/dev/null; then
    home="${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}"
    PATH="$home/.cargo/bin:$PATH"
    export PATH
fi
command -v cargo >/dev/null || { echo "fuzz.sh: cargo not found (PATH=$PATH)" >&2; exit 1; }

root="$cache/cargo-fuzz/$CARGO_FUZZ_VERSION"
cargo_fuzz="$root/bin/cargo-fuzz"
installed() { [[ "$("$cargo_fuzz" --version 2>/dev/null)" == "cargo-fuzz $CARGO_FUZZ_VERSION" ]]; }
if ! installed; then
    echo "fuzz.sh: installing cargo-fuzz $CARGO_FUZZ_VERSION into $root"
    mkdir -p "$root"
    start=$SECONDS
    # Plain stable here (no RUSTC_BOOTSTRAP): cargo-fuzz itself needs nothing
    # unstable. --force: a half-finished earlier install must not count as
    # installed; cargo locks the root, so concurrent runs wait for each other.
    # The target dir tests/rig/prereqs.sh gives cargo-deb and
    # cargo-generate-rpm: their common dependencies compile once.
    cargo install cargo-fuzz --version "=$CARGO_FUZZ_VERSION" --locked --force --root "$root" \
        --target-dir "$cache/cargo-install-target"
    echo "fuzz.sh: cargo-fuzz installed in $((SECONDS - start)) s"
    installed || { echo "fuzz.sh: $cargo_fuzz is not cargo-fuzz $CARGO_FUZZ_VERSION after install" >&2; exit 1; }
fi

corpus="$cache/fuzz/corpus/$TARGET"
artifacts="$cache/fuzz/artifacts/$TARGET"
mkdir -p "$corpus" "$artifacts"

# fuzz/ is its own workspace with its own committed lock file; fail rather
# than fuzz other dependency versions than the ones committed.
cargo metadata --locked --format-version 1 --manifest-path fuzz/Cargo.toml >/dev/null

# Same flags for build and run, or `run` rebuilds. The target directory is
# in the cache, outside the checkout, so a fresh clone (CI) rebuilds only
# this crate, not the whole instrumented dependency tree; naming it also
# keeps a CARGO_TARGET_DIR in the environment from mixing ASan builds in.
fuzz_flags=(--sanitizer address --target-dir "$cache/fuzz/target")
export RUSTC_BOOTSTRAP=1

start=$SECONDS
"$cargo_fuzz" build "${fuzz_flags[@]}" "$TARGET"
echo "fuzz.sh: fuzz build took $((SECONDS - start)) s"

marker="$(mktemp)"
trap 'rm -f "$marker"' EXIT
echo "fuzz.sh: fuzzing $TARGET for $seconds s (corpus $corpus, artifacts $artifacts)"
status=0
"$cargo_fuzz" run "${fuzz_flags[@]}" "$TARGET" "$corpus" "fuzz/corpus-seeds/$TARGET" -- \
    -max_total_time="$seconds" -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$artifacts/" || status=$?

if ((status != 0)); then
    echo "fuzz.sh: FAILED: the fuzzer exited with status $status" >&2
    found=0
    while IFS= read -r -d '' f; do
        found=1
        echo "fuzz.sh: crash artifact: $f ($(wc -c <"$f") bytes):" >&2
        od -An -tx1 -v "$f" | tr -d ' \n' >&2
        echo >&2
    done < <(find "$artifacts" -type f -newer "$marker" -print0)
    ((found)) || echo "fuzz.sh: no new artifact in $artifacts (build or start-up failure?)" >&2
    echo "fuzz.sh: reproduce: RUSTC_BOOTSTRAP=1 cargo fuzz run $TARGET <artifact>" >&2
    exit 1
fi
echo "fuzz.sh: no crash in $seconds s; corpus now $(find "$corpus" -type f | wc -l) inputs"
