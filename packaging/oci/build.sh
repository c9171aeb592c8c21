#!/usr/bin/env bash
# Builds the controller's OCI image without a Docker daemon (buildah, as
# root) and writes it as an OCI archive:
#
#   cargo build --release
#   sudo packaging/oci/build.sh [BINARY [ARCHIVE]]
#
#   BINARY   default target/release/harvester-node-agent
#   ARCHIVE  default target/oci/harvester-node-agent.tar
#
# The image is `FROM scratch`: the binary (stripped copy) at
# /usr/bin/harvester-node-agent plus, for a dynamically linked binary, exactly
# the shared libraries `ldd` names (glibc, libgcc_s, libm and the loader), an
# /etc/passwd naming the non-root user 65532 the Deployment runs as, and /tmp.
# No shell, no package manager. A static binary
# (RUSTFLAGS='-C target-feature=+crt-static') needs no libraries at all.
#
# ENTRYPOINT is the binary and CMD is `controller`, so `podman run IMAGE`
# (or runc on the unpacked bundle) starts the controller, and
# packaging/kubernetes/deployment.yaml's `args: [controller, ...]` replace
# CMD as they are written.
#
# Load the archive elsewhere with e.g.
#   skopeo copy oci-archive:target/oci/harvester-node-agent.tar docker://REGISTRY/harvester-node-agent:VERSION
#   podman load -i target/oci/harvester-node-agent.tar
#
# Environment:
#   HNA_OCI_IMAGE    local image name (default localhost/harvester-node-agent:VERSION);
#                    removed from buildah's storage again after the push
#   HNA_OCI_VERSION  the version label (default: Cargo.toml's package version)
#   HNA_OCI_STRIP=0  copy the binary as it is (default: a stripped copy)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
binary=${1:-$repo/target/release/harvester-node-agent}
archive=${2:-$repo/target/oci/harvester-node-agent.tar}

log() { echo "oci/build.sh: $*" >&2; }
die() { log "$*"; exit 1; }

command -v buildah >/dev/null || die "buildah is missing; install it with \`sudo apt-get install buildah\` (Debian) or \`zypper in buildah\`"
[[ -x $binary ]] || die "no executable $binary; build it first (\`cargo build --release\`)"

version=${HNA_OCI_VERSION:-$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/Cargo.toml" | sed -n 1p)}
[[ -n $version ]] || die "no version in $repo/Cargo.toml; set HNA_OCI_VERSION"
image=${HNA_OCI_IMAGE:-localhost/harvester-node-agent:$version}

work=$(mktemp -d)
ctr=
cleanup() {
  [[ -n $ctr ]] && buildah rm "$ctr" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# The binary, stripped: the debug info is most of a build's size.
cp "$binary" "$work/harvester-node-agent"
if [[ ${HNA_OCI_STRIP:-1} != 0 ]] && command -v strip >/dev/null; then
  strip "$work/harvester-node-agent"
fi

# The shared libraries: every absolute path ldd prints (NAME => /path, and
# the loader on a line of its own). A static binary prints none.
libs=()
if ldd_out=$(ldd "$binary" 2>&1); then
  while read -r lib; do
    libs+=("$lib")
  done < <(sed -n -e 's/^.*=> \(\/[^ ]*\) (0x.*$/\1/p' -e 's/^[[:space:]]*\(\/[^ ]*\) (0x.*$/\1/p' <<<"$ldd_out")
fi

# A user for runAsUser 65532 (the distroless "nonroot" convention), so
# tools that map the uid to a name find one.
mkdir -p "$work/etc" "$work/tmp"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$work/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"$work/etc/group"

ctr=$(buildah from scratch)
buildah copy --quiet --chmod 0755 "$ctr" "$work/harvester-node-agent" /usr/bin/harvester-node-agent >/dev/null
for lib in "${libs[@]}"; do
  # Same path as on the build host (the loader path is baked into the
  # binary); the file itself, not a symlink chain.
  buildah copy --quiet "$ctr" "$(readlink -f "$lib")" "$lib" >/dev/null
done
buildah copy --quiet "$ctr" "$work/etc" /etc >/dev/null
buildah copy --quiet --chmod 1777 "$ctr" "$work/tmp" /tmp >/dev/null

buildah config \
  --entrypoint '["/usr/bin/harvester-node-agent"]' \
  --cmd controller \
  --user 65532:65532 \
  --workingdir / \
  --env HNA_LOG_TARGET=stderr \
  --label org.opencontainers.image.title=harvester-node-agent \
  --label org.opencontainers.image.description="harvester-node-agent controller (LoadBalancer addresses for guest clusters on Harvester)" \
  --label org.opencontainers.image.version="$version" \
  --label org.opencontainers.image.licenses=Apache-2.0 \
  "$ctr"

buildah commit --quiet --format oci --rm "$ctr" "$image" >/dev/null
ctr=
mkdir -p "$(dirname "$archive")"
rm -f "$archive"
buildah push --quiet "$image" "oci-archive:$archive:$image" >/dev/null
buildah rmi "$image" >/dev/null
log "$image (${#libs[@]} shared libraries) -> $archive ($(du -h "$archive" | cut -f1))"
echo "$archive"
