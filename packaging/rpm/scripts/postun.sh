# %postun (as %systemd_postun_with_restart): reload units; on upgrade
# ($1 >= 1) restart the agent if it runs, so the new binary takes over.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
    if [ "$1" -ge 1 ]; then
        systemctl try-restart harvester-node-agent.service >/dev/null 2>&1 || :
    fi
fi
