#!/bin/bash
# kiwi runs this inside the image root after the packages are installed.
# It enables what a guest on Harvester needs at boot; the same file serves
# kiwi/debian (a symlink), so unit names that differ between distributions
# are enabled only where their unit file exists.
set -euxo pipefail

test -f /.kconfig && . /.kconfig
test -f /.profile && . /.profile

echo "Configure image: [${kiwi_iname:-harvester-node-agent}]..."

# By file, not `systemctl cat`: kiwi runs this in a chroot with no systemd
# manager to ask (there `systemctl cat` fails for every unit).
unit_exists() {
    local dir
    for dir in /etc/systemd/system /usr/lib/systemd/system /lib/systemd/system; do
        [ -e "$dir/$1" ] && return 0
    done
    return 1
}

enable_if_present() {
    local unit
    for unit in "$@"; do
        if unit_exists "$unit"; then
            systemctl enable "$unit"
        else
            echo "config.sh: $unit not installed here, not enabled"
        fi
    done
}

# qemu-guest-agent: Harvester reads the guest's addresses through it, and
# harvester-node-agent's `check` asks systemd whether it is running.
enable_if_present qemu-guest-agent.service

# cloud-init: the four classic stages, and the two units that replace the
# first two from cloud-init 24.3 on (Tumbleweed).
enable_if_present cloud-init-local.service cloud-init.service \
    cloud-config.service cloud-final.service \
    cloud-init-main.service cloud-init-network.service

# The agent: installed from the package in kiwi/opensuse; in kiwi/debian it
# comes later (cloud-init), so it may be absent here.
enable_if_present harvester-node-agent.service

# macvlan as a module, loaded at boot even before the agent asks for it.
# The package ships this file too; writing it here keeps images without the
# package (kiwi/debian) the same.
mkdir -p /etc/modules-load.d
[ -e /usr/lib/modules-load.d/harvester-node-agent.conf ] \
    || echo macvlan > /etc/modules-load.d/harvester-node-agent.conf

# Every clone must make its own machine-id (systemd, DHCP client ids).
: > /etc/machine-id
rm -f /var/lib/dbus/machine-id

exit 0
