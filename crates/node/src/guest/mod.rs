//! qemu-guest-agent health: without a running agent Harvester cannot report
//! the VM's IP and cluster provisioning fails.
//!
//! The agent's virtio port admits one opener, so nothing here ever opens it:
//! health is read from the binary on disk, the service manager (systemd over
//! D-Bus, behind `units::ServiceManager`), the device node and its sysfs
//! name, and — where debugfs is readable — the port's `guest_connected` and
//! `host_connected` flags. `assess` turns those facts into a reason; it is
//! pure and unit-tested.

pub(crate) mod facts;
pub(crate) mod units;
pub mod watch;

use serde::{Deserialize, Serialize};

use crate::health::Status;
use units::UnitState;

/// The channel name Harvester (KubeVirt) gives the guest-agent port.
pub(crate) const PORT_NAME: &str = "org.qemu.guest_agent.0";

/// Units that run qemu-ga: Debian, Ubuntu, SUSE (`qemu-ga.service` on older
/// openSUSE).
pub(crate) const UNITS: &[&str] = &["qemu-guest-agent.service", "qemu-ga.service"];

/// The docs' cloud-init snippet that installs and starts the agent.
pub(crate) const CLOUD_INIT_SNIPPET: &str = "#cloud-config\npackage_update: true\npackages:\n- qemu-guest-agent\nruncmd:\n- - systemctl\n  - enable\n  - '--now'\n  - qemu-guest-agent.service";

/// What was found on the node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Facts {
    /// Path of the `qemu-ga` binary, if installed.
    pub(crate) binary: Option<std::path::PathBuf>,
    /// The first unit of [`UNITS`] that the service manager knows, or `None`
    /// when no service manager answered (containers, initramfs).
    pub(crate) unit: Option<(String, UnitState)>,
    /// Whether the service manager answered at all.
    pub(crate) service_manager: bool,
    /// A `qemu-ga` process is running (used when there is no service
    /// manager to ask).
    pub(crate) process_running: bool,
    /// `/dev/virtio-ports/org.qemu.guest_agent.0` exists.
    pub(crate) dev_link: bool,
    /// The `vportNpM` whose sysfs `name` is [`PORT_NAME`].
    pub(crate) vport: Option<String>,
    /// From debugfs, when readable.
    pub(crate) port_flags: Option<PortFlags>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PortFlags {
    pub(crate) guest_connected: bool,
    pub(crate) host_connected: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reason {
    Ready,
    NotInstalled,
    NoVirtioPort,
    UnitMissing,
    UnitInactive,
    NotRunning,
    PortNotOpen,
    HostDisconnected,
    /// The daemon's first assessment was still running when the start-up
    /// budget ran out; the result replaces this when it comes.
    Checking,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Ready => "Ready",
            Reason::NotInstalled => "NotInstalled",
            Reason::NoVirtioPort => "NoVirtioPort",
            Reason::UnitMissing => "UnitMissing",
            Reason::UnitInactive => "UnitInactive",
            Reason::NotRunning => "NotRunning",
            Reason::PortNotOpen => "PortNotOpen",
            Reason::HostDisconnected => "HostDisconnected",
            Reason::Checking => "Checking",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestAgentState {
    pub status: Status,
    pub reason: Reason,
    pub message: String,
    pub remediation: String,
    /// True only for `Ready`: the `GuestAgentReady` condition's status.
    pub(crate) ready: bool,
}

impl GuestAgentState {
    /// An assessment under way: not ready, not yet a failure.
    pub(crate) fn checking(message: String) -> GuestAgentState {
        state(Status::Warn, Reason::Checking, message, "")
    }

    pub(crate) fn short(&self) -> String {
        format!("qemu-ga {}", self.reason.as_str())
    }
}

fn state(status: Status, reason: Reason, message: String, remediation: &str) -> GuestAgentState {
    GuestAgentState {
        status,
        reason,
        ready: reason == Reason::Ready,
        message,
        remediation: remediation.to_string(),
    }
}

pub(crate) fn assess(f: &Facts) -> GuestAgentState {
    let install = format!(
        "install and start it; on Harvester put this in the VM's user data:\n{CLOUD_INIT_SNIPPET}"
    );
    let Some(binary) = &f.binary else {
        return state(
            Status::Fail,
            Reason::NotInstalled,
            "qemu-guest-agent is not installed (no qemu-ga binary); Harvester cannot learn this VM's IP address and provisioning fails".into(),
            &install,
        );
    };
    if !f.dev_link && f.vport.is_none() {
        return state(
            Status::Fail,
            Reason::NoVirtioPort,
            format!(
                "the VM has no virtio-serial port named {PORT_NAME}: the guest agent has nothing to talk through"
            ),
            "add the guest-agent channel to the VM (Harvester VMs created from the UI have it; check the VirtualMachine's spec for the qemu-guest-agent channel) and restart the VM",
        );
    }
    let port_note = match (&f.vport, f.dev_link) {
        (Some(v), true) => format!("port {v} (/dev/virtio-ports/{PORT_NAME})"),
        (Some(v), false) => format!("port {v} (no /dev/virtio-ports link: is udev running?)"),
        (None, _) => format!("/dev/virtio-ports/{PORT_NAME}"),
    };
    let running = match &f.unit {
        Some((name, u)) => {
            if !u.loaded() {
                return state(
                    Status::Fail,
                    Reason::UnitMissing,
                    format!(
                        "{} is installed but systemd has no {name} unit ({})",
                        binary.display(),
                        u.load_state
                    ),
                    "reinstall the qemu-guest-agent package so its unit is present, then `systemctl enable --now qemu-guest-agent`",
                );
            }
            if !u.active() {
                return state(
                    Status::Fail,
                    Reason::UnitInactive,
                    format!(
                        "{name} is {} ({}){}",
                        u.active_state,
                        u.sub_state,
                        if u.unit_file_state.is_empty() {
                            String::new()
                        } else {
                            format!(", unit file {}", u.unit_file_state)
                        }
                    ),
                    &format!(
                        "`systemctl enable --now {name}`; `journalctl -u {name}` says why it stopped"
                    ),
                );
            }
            format!("{name} active")
        }
        None if f.process_running => "qemu-ga process running".to_string(),
        None => {
            let why = if f.service_manager {
                format!("systemd knows none of {}", UNITS.join(", "))
            } else {
                "no service manager answered".to_string()
            };
            return state(
                Status::Fail,
                Reason::NotRunning,
                format!("qemu-ga is installed but not running ({why})"),
                &install,
            );
        }
    };
    match f.port_flags {
        Some(p) if !p.guest_connected => state(
            Status::Fail,
            Reason::PortNotOpen,
            format!("{running} but the guest side of {port_note} is not open"),
            "restart the agent (`systemctl restart qemu-guest-agent`); its log says why it did not open the port",
        ),
        Some(p) if !p.host_connected => state(
            Status::Warn,
            Reason::HostDisconnected,
            format!("{running} on {port_note}, but the host side is not connected"),
            "nothing on the guest; the hypervisor end (virt-launcher) is not attached, which is normal briefly during migration",
        ),
        flags => state(
            Status::Ok,
            Reason::Ready,
            format!(
                "{running} on {port_note}{}",
                if flags.is_some() {
                    ", guest and host connected"
                } else {
                    " (debugfs not readable: connection flags unknown)"
                }
            ),
            "",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready_facts() -> Facts {
        Facts {
            binary: Some("/usr/bin/qemu-ga".into()),
            unit: Some((
                "qemu-guest-agent.service".into(),
                UnitState {
                    load_state: "loaded".into(),
                    active_state: "active".into(),
                    sub_state: "running".into(),
                    unit_file_state: "static".into(),
                },
            )),
            service_manager: true,
            process_running: true,
            dev_link: true,
            vport: Some("vport1p1".into()),
            port_flags: Some(PortFlags {
                guest_connected: true,
                host_connected: true,
            }),
        }
    }

    #[test]
    fn ready_when_everything_is_connected() {
        let s = assess(&ready_facts());
        assert_eq!(
            (s.status, s.reason, s.ready),
            (Status::Ok, Reason::Ready, true)
        );
    }

    #[test]
    fn each_missing_piece_has_its_reason() {
        let mut f = ready_facts();
        f.binary = None;
        let s = assess(&f);
        assert_eq!(s.reason, Reason::NotInstalled);
        assert!(s.remediation.contains("qemu-guest-agent.service"));

        let mut f = ready_facts();
        f.dev_link = false;
        f.vport = None;
        assert_eq!(assess(&f).reason, Reason::NoVirtioPort);

        let mut f = ready_facts();
        f.port_flags = Some(PortFlags {
            guest_connected: true,
            host_connected: false,
        });
        let s = assess(&f);
        assert_eq!(
            (s.status, s.reason, s.ready),
            (Status::Warn, Reason::HostDisconnected, false)
        );

        let mut f = ready_facts();
        f.port_flags = Some(PortFlags {
            guest_connected: false,
            host_connected: true,
        });
        assert_eq!(assess(&f).reason, Reason::PortNotOpen);

        let mut f = ready_facts();
        f.port_flags = None;
        assert_eq!(assess(&f).reason, Reason::Ready);
    }

    /// A D-Bus test double: the unit states systemd would report.
    struct FakeSystemd(
        Vec<(
            &'static str,
            &'static str,
            &'static str,
            &'static str,
            &'static str,
        )>,
    );
    impl units::ServiceManager for FakeSystemd {
        async fn unit(&self, name: &str) -> Result<Option<UnitState>, units::UnitError> {
            Ok(self.0.iter().find(|u| u.0 == name).and_then(|u| {
                (u.1 != "not-found").then(|| UnitState {
                    load_state: u.1.into(),
                    active_state: u.2.into(),
                    sub_state: u.3.into(),
                    unit_file_state: u.4.into(),
                })
            }))
        }
        async fn changed(&self, _: &[&str]) {}
    }

    async fn reason_for(units: FakeSystemd) -> (Reason, String) {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("usr/bin")).unwrap();
        std::fs::write(r.join("usr/bin/qemu-ga"), "").unwrap();
        std::fs::create_dir_all(r.join("dev/virtio-ports")).unwrap();
        std::fs::write(r.join("dev/virtio-ports").join(PORT_NAME), "").unwrap();
        let s = assess(&facts::gather(r, Some(&units)).await);
        (s.reason, s.message)
    }

    #[tokio::test]
    async fn unit_states_map_to_reasons() {
        let cases = [
            (
                (
                    "qemu-guest-agent.service",
                    "loaded",
                    "active",
                    "running",
                    "static",
                ),
                Reason::Ready,
            ),
            (
                (
                    "qemu-guest-agent.service",
                    "loaded",
                    "inactive",
                    "dead",
                    "disabled",
                ),
                Reason::UnitInactive,
            ),
            (
                (
                    "qemu-guest-agent.service",
                    "loaded",
                    "failed",
                    "failed",
                    "enabled",
                ),
                Reason::UnitInactive,
            ),
            (
                (
                    "qemu-guest-agent.service",
                    "loaded",
                    "activating",
                    "start",
                    "enabled",
                ),
                Reason::UnitInactive,
            ),
            (
                (
                    "qemu-guest-agent.service",
                    "masked",
                    "inactive",
                    "dead",
                    "masked",
                ),
                Reason::UnitMissing,
            ),
            // Older openSUSE names the unit qemu-ga.service.
            (
                ("qemu-ga.service", "loaded", "active", "running", "enabled"),
                Reason::Ready,
            ),
        ];
        for (unit, want) in cases {
            let (reason, message) = reason_for(FakeSystemd(vec![unit])).await;
            assert_eq!(reason, want, "{unit:?}: {message}");
        }
        let (reason, message) = reason_for(FakeSystemd(vec![(
            "qemu-guest-agent.service",
            "loaded",
            "failed",
            "failed",
            "enabled",
        )]))
        .await;
        assert_eq!(reason, Reason::UnitInactive);
        assert!(
            message.contains("failed") && message.contains("enabled"),
            "{message}"
        );
        // systemd answers but knows neither unit and nothing runs.
        let (reason, _) = reason_for(FakeSystemd(vec![])).await;
        assert_eq!(reason, Reason::NotRunning);
    }

    #[test]
    fn without_a_service_manager_the_process_decides() {
        let mut f = ready_facts();
        f.unit = None;
        f.service_manager = false;
        assert_eq!(assess(&f).reason, Reason::Ready);
        f.process_running = false;
        assert_eq!(assess(&f).reason, Reason::NotRunning);
    }
}
