//! Reads the guest-agent facts off the node (never opening the port).

use std::path::{Path, PathBuf};

use super::units::{self, ServiceManager};
use super::{Facts, PORT_NAME, PortFlags, UNITS};

const BINARIES: &[&str] = &[
    "usr/bin/qemu-ga",
    "usr/sbin/qemu-ga",
    "usr/libexec/qemu-ga",
    "bin/qemu-ga",
    "sbin/qemu-ga",
];

/// The device link, its sysfs port and debugfs flags, the binary and the
/// process table under `root`; the unit from `sm` when given.
pub(crate) async fn gather<S: ServiceManager>(root: &Path, sm: Option<&S>) -> Facts {
    let (unit, service_manager) = match sm {
        Some(sm) => match units::first_known(sm, UNITS).await {
            Ok(u) => (u, true),
            Err(e) => {
                tracing::debug!(error = %e, "service manager did not answer");
                (None, false)
            }
        },
        None => (None, false),
    };
    let vport = find_vport(root);
    let dev_link = root.join("dev/virtio-ports").join(PORT_NAME).exists()
        || vport.as_deref().is_some_and(|v| udev_made_link(root, v));
    Facts {
        binary: BINARIES.iter().map(|b| root.join(b)).find(|p| p.is_file()),
        unit,
        service_manager,
        process_running: process_running(root, "qemu-ga"),
        dev_link,
        port_flags: vport.as_deref().and_then(|v| port_flags(root, v)),
        vport,
    }
}

/// The `vportNpM` whose sysfs name is the guest-agent channel.
fn find_vport(root: &Path) -> Option<String> {
    let dir = root.join("sys/class/virtio-ports");
    std::fs::read_dir(dir).ok()?.flatten().find_map(|e| {
        let name = std::fs::read_to_string(e.path().join("name")).ok()?;
        (name.trim() == PORT_NAME).then(|| e.file_name().to_string_lossy().to_string())
    })
}

/// Whether udev's database records the `virtio-ports/<name>` link for the
/// port. The daemon's unit sets `PrivateDevices=yes`, so its own `/dev` has
/// no such link even where udev made it; udev's database under /run says.
fn udev_made_link(root: &Path, vport: &str) -> bool {
    let Ok(dev) =
        std::fs::read_to_string(root.join("sys/class/virtio-ports").join(vport).join("dev"))
    else {
        return false;
    };
    let link = format!("S:virtio-ports/{PORT_NAME}");
    std::fs::read_to_string(root.join("run/udev/data").join(format!("c{}", dev.trim())))
        .is_ok_and(|db| db.lines().any(|l| l.trim() == link))
}

/// `guest_connected`/`host_connected` from debugfs, when mounted and
/// readable.
fn port_flags(root: &Path, vport: &str) -> Option<PortFlags> {
    let text =
        std::fs::read_to_string(root.join("sys/kernel/debug/virtio-ports").join(vport)).ok()?;
    parse_port_flags(&text)
}

pub(crate) fn parse_port_flags(text: &str) -> Option<PortFlags> {
    let flag = |key: &str| {
        text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key).then(|| v.trim() == "1")
        })
    };
    Some(PortFlags {
        guest_connected: flag("guest_connected")?,
        host_connected: flag("host_connected")?,
    })
}

fn process_running(root: &Path, comm: &str) -> bool {
    let Ok(entries) = std::fs::read_dir(root.join("proc")) else {
        return false;
    };
    entries.flatten().any(|e| {
        e.file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
            && std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim() == comm)
    })
}

/// Paths whose changes mean "look again" (device hot-plug).
pub(crate) fn watched_dirs(root: &Path) -> Vec<PathBuf> {
    vec![root.join("dev/virtio-ports"), root.join("dev")]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debugfs_flags() {
        let text = "name: org.qemu.guest_agent.0\nguest_connected: 1\nhost_connected: 0\noutvq_full: 0\nis_console: no\n";
        assert_eq!(
            parse_port_flags(text),
            Some(PortFlags {
                guest_connected: true,
                host_connected: false
            })
        );
        assert_eq!(parse_port_flags("name: x\n"), None);
    }

    struct NoUnits;
    impl ServiceManager for NoUnits {
        async fn unit(&self, _: &str) -> Result<Option<units::UnitState>, units::UnitError> {
            Ok(None)
        }
        async fn changed(&self, _: &[&str]) {}
    }

    #[tokio::test]
    async fn reads_a_fake_root() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("usr/bin")).unwrap();
        std::fs::write(r.join("usr/bin/qemu-ga"), "").unwrap();
        std::fs::create_dir_all(r.join("sys/class/virtio-ports/vport1p1")).unwrap();
        std::fs::write(
            r.join("sys/class/virtio-ports/vport1p1/name"),
            "org.qemu.guest_agent.0\n",
        )
        .unwrap();
        std::fs::create_dir_all(r.join("proc/42")).unwrap();
        std::fs::write(r.join("proc/42/comm"), "qemu-ga\n").unwrap();
        let f = gather(r, Some(&NoUnits)).await;
        assert_eq!(f.binary, Some(r.join("usr/bin/qemu-ga")));
        assert_eq!(f.vport.as_deref(), Some("vport1p1"));
        assert!(f.process_running && f.service_manager && !f.dev_link);
        // No unit known, but the process runs (started by hand or by udev).
        assert_eq!(super::super::assess(&f).reason, super::super::Reason::Ready);

        // Under PrivateDevices= the link is not in this /dev; udev's
        // database still records it.
        std::fs::write(r.join("sys/class/virtio-ports/vport1p1/dev"), "246:1\n").unwrap();
        std::fs::create_dir_all(r.join("run/udev/data")).unwrap();
        std::fs::write(
            r.join("run/udev/data/c246:1"),
            "S:char/246:1\nS:virtio-ports/org.qemu.guest_agent.0\nI:123\n",
        )
        .unwrap();
        assert!(gather(r, Some(&NoUnits)).await.dev_link);
    }
}
