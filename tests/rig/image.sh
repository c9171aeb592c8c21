#!/usr/bin/env bash
# Builds the Debian bookworm image the image test (tests/integration/vm_image.rs)
# boots, from Debian's repositories, and caches it outside the checkout keyed
# by a hash of everything that decides its content (suite, mirrors, package
# list, this script's recipe):
#   ${HNA_CACHE_DIR:-/var/cache/harvester-node-agent}/image/<hash>/
#     rootfs/        the tree (kept: the test builds its no-macvlan variant from it)
#     disk.raw       ext4 of rootfs, sparse, made by `mkfs.ext4 -d` (no mount, no loop)
#     vmlinuz initrd.img  the rootfs's kernel and initramfs, for direct kernel boot
#     RELEASE        the kernel release (uname -r in the guest)
#     timings        seconds taken by the rootfs and the disk
#     READY          written last; a folder without it is not used
# Concurrent runs (parallel tests, CI and a developer) take a lock, so the
# image is built once. Prints the image folder on its last line of stdout.
#
# Usage: tests/rig/image.sh            build (if needed) and print the folder
#        tests/rig/image.sh --print    print the folder it would use, build nothing
set -euo pipefail

CACHE_DIR="${HNA_CACHE_DIR:-/var/cache/harvester-node-agent}"
SUITE=bookworm
MIRRORS=(
  "deb http://deb.debian.org/debian bookworm main"
  "deb http://deb.debian.org/debian bookworm-updates main"
  "deb http://deb.debian.org/debian-security bookworm-security main"
)
# linux-image-amd64: macvlan is a loadable module there, virtio too (the
# cloud flavour is what Harvester images use, but the stock one is what the
# other VM tests boot, so the two agree on the module layout).
# curl and qemu-guest-agent: what the shipped cloud-config's `packages:`
# asks apt for, here already (as in a cloud image that has them), since
# the guest reaches no Debian mirror. locales: cloud-init's locale module
# sets en_US.UTF-8 when the user data names none (the shipped one does
# not), which fails unless that locale is generated, as it is in the cloud
# images users boot (the customize hook below generates it).
PACKAGES=(systemd systemd-sysv udev dbus cloud-init qemu-guest-agent curl locales
          linux-image-amd64 initramfs-tools ifupdown isc-dhcp-client
          iproute2 kmod e2fsprogs mount util-linux procps netbase)
# The image's apt source: the rig's HTTP server on the LAN (vm_image.rs
# serves a flat repository there), so that the shipped cloud-config's
# `package_update` runs as on a VM with a mirror.
APT_SOURCE="deb [trusted=yes] http://10.77.0.1:8080/debian ./"
# Bump when the recipe below changes in a way the package list does not show.
RECIPE=3
# Big driver trees a virtio VM never loads: less to copy into the disk.
EXCLUDE=(
         "/lib/modules/*/kernel/drivers/gpu/*" "/lib/modules/*/kernel/sound/*"
         "/lib/modules/*/kernel/drivers/media/*" "/lib/modules/*/kernel/drivers/net/wireless/*"
         "/lib/modules/*/kernel/drivers/infiniband/*" "/lib/modules/*/kernel/drivers/staging/*"
         "/lib/modules/*/kernel/drivers/bluetooth/*" "/lib/modules/*/kernel/net/bluetooth/*")

log() { echo "image: $*" >&2; }

HASH=$( { echo "$SUITE"; printf '%s\n' "${MIRRORS[@]}" "${PACKAGES[@]}" "${EXCLUDE[@]}" "$APT_SOURCE"; echo "recipe $RECIPE"; } \
        | sha256sum | cut -c1-16)
OUT="$CACHE_DIR/image/$HASH"

if [[ "${1:-}" == "--print" ]]; then echo "$OUT"; exit 0; fi
if [[ -f "$OUT/READY" ]]; then log "cached at $OUT"; echo "$OUT"; exit 0; fi
if [[ $(id -u) -ne 0 ]]; then log "must run as root (mmdebstrap, file ownership in the image)"; exit 1; fi
for p in mmdebstrap mkfs.ext4; do
  command -v "$p" >/dev/null || { log "$p missing: sudo tests/rig/prereqs.sh"; exit 1; }
done

mkdir -p "$CACHE_DIR/image"
exec 9>"$CACHE_DIR/image/.lock"
log "waiting for the image lock"
flock 9
if [[ -f "$OUT/READY" ]]; then log "cached at $OUT (built by another run)"; echo "$OUT"; exit 0; fi

rm -rf "$OUT"
WORK=$(mktemp -d "$CACHE_DIR/image/.tmp-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
excl=(); for e in "${EXCLUDE[@]}"; do excl+=(--dpkgopt="path-exclude=$e"); done
list=$(IFS=,; echo "${PACKAGES[*]}")

log "building the $SUITE rootfs ($list)"
t0=$(date +%s)
# The initramfs needs only virtio and ext4 (MODULES=list + a hook): smaller
# means faster to unpack under emulation.
mmdebstrap --variant=apt --include="$list" "${excl[@]}" \
  --essential-hook='mkdir -p "$1/etc/initramfs-tools/conf.d" "$1/etc/initramfs-tools/hooks"' \
  --essential-hook='echo MODULES=list > "$1/etc/initramfs-tools/conf.d/hna-virtio.conf"' \
  --essential-hook='printf "%s\n" "#!/bin/sh" "[ \"\$1\" = prereqs ] && exit 0" ". /usr/share/initramfs-tools/hook-functions" "manual_add_modules virtio_pci virtio_blk virtio_console ext4" > "$1/etc/initramfs-tools/hooks/hna-virtio"; chmod 755 "$1/etc/initramfs-tools/hooks/hna-virtio"' \
  --customize-hook='echo "/dev/vda / ext4 defaults 0 0" > "$1/etc/fstab"' \
  --customize-hook='echo hna-image > "$1/etc/hostname"' \
  --customize-hook='echo "en_US.UTF-8 UTF-8" > "$1/etc/locale.gen"; chroot "$1" locale-gen >/dev/null' \
  --customize-hook="rm -f \"\$1\"/etc/apt/sources.list.d/*; echo '$APT_SOURCE' > \"\$1/etc/apt/sources.list\"" \
  --customize-hook='printf "%s\n" "datasource_list: [ NoCloud, None ]" > "$1/etc/cloud/cloud.cfg.d/90-hna-nocloud.cfg"' \
  --customize-hook='for t in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer; do chroot "$1" systemctl disable "$t" >/dev/null 2>&1 || true; done' \
  "$SUITE" "$WORK/rootfs" "${MIRRORS[@]}" >&2
t1=$(date +%s)

R="$WORK/rootfs"
VMLINUZ=$(find "$R/boot" -maxdepth 1 -name 'vmlinuz-*' | sort -V | tail -1)
[[ -f "$VMLINUZ" ]] || { log "no /boot/vmlinuz-* in the rootfs"; exit 1; }
REL=${VMLINUZ##*/vmlinuz-}
[[ -f "$R/boot/initrd.img-$REL" ]] || { log "no /boot/initrd.img-$REL in the rootfs"; exit 1; }
MACVLAN=$(find "$R/usr/lib/modules/$REL" -name 'macvlan.ko*' | sed -n 1p)
[[ -n "$MACVLAN" ]] || { log "kernel $REL has no macvlan module"; exit 1; }
cp "$VMLINUZ" "$WORK/vmlinuz"
cp "$R/boot/initrd.img-$REL" "$WORK/initrd.img"
echo "$REL" > "$WORK/RELEASE"

log "making disk.raw with mkfs.ext4 -d"
# Room for the agent's package, logs and journal beside the tree.
SIZE_MB=$(( $(du -sm "$R" | cut -f1) + 768 ))
truncate -s "${SIZE_MB}M" "$WORK/disk.raw"
mkfs.ext4 -q -F -L hna-root -d "$R" "$WORK/disk.raw" >&2
t2=$(date +%s)
printf 'rootfs_seconds %s\ndisk_seconds %s\n' $((t1 - t0)) $((t2 - t1)) > "$WORK/timings"

mv "$WORK" "$OUT"
trap - EXIT
chmod 755 "$OUT"
date -u +%FT%TZ > "$OUT/READY"
log "built in $((t2 - t0)) s (rootfs $((t1 - t0)) s, disk $((t2 - t1)) s), cached at $OUT"
echo "$OUT"
