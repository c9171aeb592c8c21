# %preun (as %systemd_preun): on the last removal ($1 = 0), disable and stop.
if [ "$1" -eq 0 ]; then
    systemctl --no-reload disable --now harvester-node-agent.service >/dev/null 2>&1 || :
fi
