//! What the tests know about this machine independently of the agent, so
//! they can say what the agent must report here instead of comparing the
//! agent with itself.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The qemu-guest-agent's virtio port name.
const GA_PORT: &str = "org.qemu.guest_agent.0";

/// Whether this machine has the qemu-guest-agent's virtio port (the
/// `/dev/virtio-ports` link udev makes, or the sysfs port of that name).
pub fn guest_agent_port_exists() -> bool {
    Path::new("/dev/virtio-ports").join(GA_PORT).exists()
        || std::fs::read_dir("/sys/class/virtio-ports")
            .into_iter()
            .flatten()
            .flatten()
            .any(|p| {
                std::fs::read_to_string(p.path().join("name"))
                    .is_ok_and(|name| name.trim() == GA_PORT)
            })
}

/// The `GuestAgentReady` condition (status, reason) the agent must report
/// on this machine, when the machine alone decides it: no `qemu-ga` binary
/// means `NotInstalled`, a binary without the virtio port `NoVirtioPort`.
/// `None` on a machine with the port (a real VM), where it depends on the
/// running agent.
pub fn expected_guest_agent() -> Option<(&'static str, &'static str)> {
    let installed = [
        "/usr/bin/qemu-ga",
        "/usr/sbin/qemu-ga",
        "/usr/libexec/qemu-ga",
    ]
    .iter()
    .any(|p| Path::new(p).is_file());
    if !installed {
        Some(("False", "NotInstalled"))
    } else if !guest_agent_port_exists() {
        Some(("False", "NoVirtioPort"))
    } else {
        None
    }
}

/// The `MacvlanReady` condition the daemon (running as root) must report on
/// this machine: its status and the reasons that fit.
///
/// - no module support (`/proc/modules` missing): `BuiltIn` when a macvlan
///   can be created (the test tries it in `probe_ns`, a namespace of its
///   own), else not ready;
/// - listed in `modules.builtin`: `BuiltIn`;
/// - blacklisted (modprobe.d or the kernel command line): `Blacklisted`;
/// - loaded: `Loaded`;
/// - on disk (`modules.dep`): loaded by the daemon, `LoadedByAgent` (or
///   `Loaded` when another test's macvlan made the kernel load it first);
/// - else `ModuleNotFound`.
pub fn expected_macvlan(probe_ns: &str) -> (&'static str, &'static [&'static str]) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string();
    let modules_dir = ["/lib/modules", "/usr/lib/modules"]
        .iter()
        .map(|d| PathBuf::from(d).join(&release))
        .find(|d| d.is_dir());
    let listed = |file: &str| {
        modules_dir
            .as_ref()
            .and_then(|d| std::fs::read_to_string(d.join(file)).ok())
            .is_some_and(|text| {
                text.lines().any(|l| {
                    let path = l.split(':').next().unwrap_or_default();
                    path.rsplit('/')
                        .next()
                        .is_some_and(|f| f == "macvlan.ko" || f.starts_with("macvlan.ko."))
                })
            })
    };
    let Ok(modules) = std::fs::read_to_string("/proc/modules") else {
        return if macvlan_can_be_created(probe_ns) {
            ("True", &["BuiltIn"])
        } else {
            ("False", &["ModuleNotFound", "ProbeFailed"])
        };
    };
    if listed("modules.builtin") {
        ("True", &["BuiltIn"])
    } else if blacklisted() {
        ("False", &["Blacklisted"])
    } else if modules.lines().any(|l| l.starts_with("macvlan ")) {
        ("True", &["Loaded"])
    } else if listed("modules.dep") {
        ("True", &["LoadedByAgent", "Loaded"])
    } else {
        ("False", &["ModuleNotFound"])
    }
}

/// `blacklist macvlan` or `install macvlan /bin/false` in a modprobe.d
/// folder, or macvlan in `modprobe.blacklist=` on the kernel command line.
fn blacklisted() -> bool {
    let in_config = [
        "/etc/modprobe.d",
        "/run/modprobe.d",
        "/usr/lib/modprobe.d",
        "/lib/modprobe.d",
    ]
    .iter()
    .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
    .filter_map(|e| std::fs::read_to_string(e.path()).ok())
    .any(|text| {
        text.lines().any(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            matches!(words.as_slice(), ["blacklist", "macvlan"])
                || matches!(words.as_slice(), ["install", "macvlan", "/bin/false", ..])
        })
    });
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    in_config
        || cmdline.split_whitespace().any(|arg| {
            arg.strip_prefix("modprobe.blacklist=")
                .or_else(|| arg.strip_prefix("module_blacklist="))
                .is_some_and(|list| list.split(',').any(|m| m == "macvlan"))
        })
}

/// Whether a macvlan link can be created in namespace `ns` (on its `eth0`);
/// the link is deleted again.
fn macvlan_can_be_created(ns: &str) -> bool {
    let ip = |args: &[&str]| {
        Command::new("ip")
            .args(["-n", ns])
            .args(args)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let created = ip(&[
        "link",
        "add",
        "hna-fact0",
        "link",
        "eth0",
        "type",
        "macvlan",
        "mode",
        "bridge",
    ]);
    if created {
        ip(&["link", "del", "hna-fact0"]);
    }
    created
}
