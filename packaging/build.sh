#!/usr/bin/env bash
# Builds the .deb (cargo-deb) and the .rpm (cargo-generate-rpm) of
# harvester-node-agent, from the repository root or anywhere:
#
#   bash packaging/build.sh
#
# writes, and prints on its last two lines of stdout,
#   <target>/packages/harvester-node-agent_<version>_amd64.deb
#   <target>/packages/harvester-node-agent-<version>-1.x86_64.rpm
# where <target> is cargo's target directory (`target/` unless
# CARGO_TARGET_DIR says otherwise).
#
# Settings (environment):
#   HNA_PACKAGE_PROFILE  cargo profile of the binary (default `release`:
#                        optimised, thin LTO, ~8 min cold on 2 cores; `dev`
#                        for a quick, unoptimised package to test packaging).
#   HNA_PACKAGE_BINARY   package this already-built binary instead of running
#                        `cargo build` (CI: the binary the tests built).
#   HNA_PACKAGE_OUT      output directory instead of <target>/packages.
#   HNA_PACKAGE_FAST=1   lighter compression (gzip for the .deb): quicker,
#                        larger; for tests, not for shipping.
#
# Needs cargo-deb and cargo-generate-rpm (`cargo install --locked cargo-deb
# --version 3.8.0` and `cargo install --locked cargo-generate-rpm --version
# 0.21.1`; `sudo tests/rig/prereqs.sh` installs both), strip (binutils) and
# gzip. The staged binary is stripped of debug info (`strip --strip-debug`;
# the release profile has none already, a dev binary shrinks ~5x).
#
# How: both tools read their file lists from Cargo.toml
# ([package.metadata.deb], [package.metadata.generate-rpm]), whose binary and
# man page sources are `target/release/...`. This script stages the chosen
# binary and the gzip'd man pages (packaging/man/*.8) in a private target dir
# under `release/` and points both tools there with --no-build, so the package
# holds exactly the binary built here (or given), whatever the profile.
set -euo pipefail

log() { echo "build.sh: $*" >&2; }
die() { log "$*"; exit 1; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PROFILE="${HNA_PACKAGE_PROFILE:-release}"
NAME=harvester-node-agent
# cargo finds its subcommands in cargo's bin; so do the checks below.
export PATH="$PATH:${CARGO_HOME:-$HOME/.cargo}/bin"

for tool in cargo-deb cargo-generate-rpm; do
  command -v "$tool" >/dev/null || die "\`$tool\` is missing: install it with \`sudo tests/rig/prereqs.sh\` (or \`cargo install --locked $tool\`)"
done
for tool in strip gzip; do
  command -v "$tool" >/dev/null || die "\`$tool\` is missing: apt-get install binutils gzip"
done

# The version and the target directory, from cargo itself.
PKGID="$(cargo pkgid --quiet -p "$NAME")"   # e.g. path+file:///src#harvester-node-agent@0.1.0
VERSION="${PKGID##*[@#]}"
[[ "$VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+ ]] || die "cannot read the version from \`cargo pkgid\`: $PKGID"
TARGET_DIR="$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
[[ -n "$TARGET_DIR" ]] || die "cannot read the target directory from \`cargo metadata\`"
OUT="${HNA_PACKAGE_OUT:-$TARGET_DIR/packages}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

# The binary: built here with the chosen profile, or given.
if [[ -n "${HNA_PACKAGE_BINARY:-}" ]]; then
  BINARY="$HNA_PACKAGE_BINARY"
  [[ -x "$BINARY" ]] || die "HNA_PACKAGE_BINARY=$BINARY is not an executable file"
  log "packaging the given binary $BINARY"
else
  log "building $NAME $VERSION with profile \`$PROFILE\`"
  cargo build --locked --profile "$PROFILE" --bin "$NAME" >&2
  case "$PROFILE" in
    dev | test) PROFILE_DIR=debug ;;
    bench) PROFILE_DIR=release ;;
    *) PROFILE_DIR="$PROFILE" ;;
  esac
  BINARY="$TARGET_DIR/$PROFILE_DIR/$NAME"
  [[ -x "$BINARY" ]] || die "cargo build finished but $BINARY is not there"
fi

# Stage: <stage>/release/harvester-node-agent and <stage>/release/man/*.8.gz.
STAGE="$(mktemp -d "$OUT/.stage-XXXXXX")"
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/release/man"
strip --strip-debug -o "$STAGE/release/$NAME" "$BINARY"
chmod 755 "$STAGE/release/$NAME"
shopt -s nullglob
MAN_PAGES=(packaging/man/*.8)
shopt -u nullglob
for page in "${MAN_PAGES[@]}"; do
  # -n: no name or time stamp in the gzip header, so the same page gives the
  # same bytes (reproducible packages); -9 as Debian policy asks.
  gzip -9 -n -c "$page" > "$STAGE/release/man/$(basename "$page").gz"
done
if ((${#MAN_PAGES[@]} == 0)); then
  log "no man pages in packaging/man/: the packages have none"
fi

DEB="$OUT/${NAME}_${VERSION}_amd64.deb"
RPM="$OUT/${NAME}-${VERSION}-1.x86_64.rpm"
rm -f "$DEB" "$RPM"

# --compress-system: xz/gzip, not cargo-deb's built-in compressor, which
# took over 10 CPU-minutes for a 58 MB binary here (the tools: 30 s).
deb_args=(--no-build --no-strip --compress-system --output "$DEB")
rpm_args=(--target-dir "$STAGE" --output "$RPM")
if ((${#MAN_PAGES[@]})); then
  # Both tools refuse a glob that matches nothing: the man pages are in the
  # `man` variant of each (same package), used when there are any.
  deb_args+=(--variant man)
  rpm_args+=(--variant man)
fi
if [[ "${HNA_PACKAGE_FAST:-0}" == 1 ]]; then
  deb_args+=(--fast --compress-type gz)
fi

log "cargo deb"
# cargo-deb has no --target-dir; it takes cargo's. --no-strip: stripped above.
CARGO_TARGET_DIR="$STAGE" cargo deb "${deb_args[@]}" >&2
log "cargo generate-rpm"
cargo generate-rpm "${rpm_args[@]}" >&2

[[ -f "$DEB" ]] || die "cargo deb did not write $DEB"
[[ -f "$RPM" ]] || die "cargo generate-rpm did not write $RPM"
echo "$DEB"
echo "$RPM"
