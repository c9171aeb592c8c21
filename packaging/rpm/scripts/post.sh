# %post of the rpm made by cargo-generate-rpm, which has no rpm macros: plain
# shell, the same steps as %systemd_post / %service_add_post. Works in a chroot
# or an image build without a running systemd (`systemctl preset` only writes
# symlinks). $1 is 1 on first install, 2 on upgrade.
# The daemon's user, before the unit starts (systemd-sysusers also creates
# it at every boot).
systemd-sysusers /usr/lib/sysusers.d/harvester-node-agent.conf >/dev/null 2>&1 || :
if [ "$1" -eq 1 ]; then
    # Enable per the presets (/usr/lib/systemd/system-preset/90-harvester-node-agent.preset).
    systemctl --no-reload preset harvester-node-agent.service >/dev/null 2>&1 || :
fi
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
fi
