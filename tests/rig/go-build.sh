# Sourced by the scripts that build the rig's prerequisites from the Go
# module proxy (kubernetes.sh, peers.sh): finds Go 1.26 or newer, points
# Go's caches into $CACHE_DIR, and gives `step`. The sourcing script sets
# CACHE_DIR and defines `die` first.

# Go 1.26 or newer: the `go` on PATH, else the official install's. Debian's
# golang-go (1.19) is too old for any current Kubernetes, etcd or peer.
GO_MIN_MINOR=26
go_ok() {
  local v
  v="$("$1" env GOVERSION 2>/dev/null)" || return 1
  [[ "$v" =~ ^go1\.([0-9]+) ]] && ((BASH_REMATCH[1] >= GO_MIN_MINOR))
}
go_bin=""
for candidate in "$(command -v go || true)" /usr/local/go/bin/go; do
  if [[ -n "$candidate" && -x "$candidate" ]] && go_ok "$candidate"; then
    go_bin="$candidate"; break
  fi
done
[[ -n "$go_bin" ]] \
  || die "no Go 1.$GO_MIN_MINOR or newer found (PATH: $(command -v go || echo none) is $(go env GOVERSION 2>/dev/null || echo absent); /usr/local/go/bin/go: absent or older): install the official Go 1.$GO_MIN_MINOR+ toolchain into /usr/local/go"
export PATH="$(dirname "$go_bin"):$PATH"

export GOMODCACHE="$CACHE_DIR/go/mod" GOCACHE="$CACHE_DIR/go/build"
# -modcacherw: the module cache stays removable by rm -rf. local: never
# fetch another toolchain; a too old `go` fails with what it needs.
export GOFLAGS=-modcacherw GOTOOLCHAIN=local CGO_ENABLED=0
mkdir -p "$GOMODCACHE" "$GOCACHE" "$CACHE_DIR/build"

scratch=""
cleanup() { [[ -z "$scratch" ]] || rm -rf "$scratch"; }
trap cleanup EXIT

# cache_built DIR WHAT: the scratch folder's `out` becomes DIR whole (a
# cached build is complete or absent), the scratch folder goes, and WHAT is
# logged as built and cached.
cache_built() {
  local dir="$1" what="$2"
  mkdir -p "$(dirname "$dir")"
  rm -rf "$dir"
  mv "$scratch/out" "$dir"
  rm -rf "$scratch"; scratch=""
  log "$what built and cached at $dir"
}

# step WHAT MODULE VERSION CMD...: runs CMD in the scratch folder; on failure
# stops with the module, the version, the command and the tail of its output.
step() {
  local what="$1" module="$2" version="$3"; shift 3
  local out="$scratch/step.log"
  if ! (cd "$scratch" && "$@") >"$out" 2>&1; then
    tail -n 30 "$out" >&2
    die "$what failed: module $module, version $version; command: (cd <scratch> && $*)"
  fi
}
