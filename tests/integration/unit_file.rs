//! The shipped systemd unit: valid for systemd, sandboxed, and consistent
//! with what the daemon does (notify protocol, EX_CONFIG, module loading).

use std::process::Command;

use crate::BIN;
use crate::harness::tests;

tests! {
    unit_matches_the_daemon_contract;
    systemd_accepts_the_unit_and_scores_it_at_most_2_0: SystemdAnalyze;
}

/// The exposure `systemd-analyze security` may give the unit (issue #22).
const MAX_EXPOSURE: f64 = 2.0;

const UNIT: &str = include_str!("../../systemd/harvester-node-agent.service");

fn directive(key: &str) -> Option<&'static str> {
    directives(key).into_iter().next()
}

/// Every value of a directive that may be repeated, in order.
fn directives(key: &str) -> Vec<&'static str> {
    UNIT.lines()
        .filter_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .collect()
}

fn unit_matches_the_daemon_contract() {
    assert_eq!(directive("Type"), Some("notify"));
    assert_eq!(directive("RestartPreventExitStatus"), Some("78"));
    assert!(directive("WatchdogSec").is_some());
    // The kernel loads macvlan (modules-load.d, or its own autoload when
    // the daemon creates a macvlan link): no module privilege at all.
    assert_eq!(directive("ProtectKernelModules"), Some("yes"));
    let caps = "CAP_NET_ADMIN CAP_NET_RAW CAP_DAC_READ_SEARCH";
    assert_eq!(directive("CapabilityBoundingSet"), Some(caps));
    assert_eq!(directive("AmbientCapabilities"), Some(caps));
    // Allow-list, then drop the privileged groups (which hold @module).
    assert_eq!(
        directives("SystemCallFilter"),
        ["@system-service @network-io", "~@privileged @resources"]
    );
    let settings = UNIT.lines().filter(|l| !l.starts_with('#'));
    for l in settings {
        assert!(
            !l.contains("module(") && !l.contains("init_module") && !l.contains("CAP_SYS_MODULE"),
            "{l}"
        );
    }
    // What CAP_DAC_READ_SEARCH could read and must not: cluster-admin
    // kubeconfigs, join tokens, CA keys, Pods' tokens.
    let hidden = directives("InaccessiblePaths").join(" ");
    for path in [
        "/etc/rancher",
        "/var/lib/rancher/rke2/server",
        "/var/lib/rancher/k3s/server",
        "/etc/kubernetes/admin.conf",
        "/etc/kubernetes/super-admin.conf",
        "/etc/kubernetes/pki",
        "/run/systemd/private",
        // Issue #29: every Pod's Secrets and ServiceAccount tokens.
        "/var/lib/kubelet/pods",
    ] {
        assert!(
            hidden
                .split_whitespace()
                .any(|p| p.trim_start_matches('-') == path),
            "{path} is not hidden: {hidden}"
        );
    }
    // The one hidden path made to exist before the sandbox is set up, so
    // it is hidden from the first start on; as root (`+`), and a read-only
    // /etc (`-`) does not stop the start.
    assert_eq!(
        directive("ExecStartPre"),
        Some("-+/usr/bin/mkdir -p /etc/rancher")
    );
    for (key, value) in [
        ("ProtectKernelTunables", "yes"),
        ("ProtectProc", "invisible"),
        ("PrivateMounts", "yes"),
        ("PrivateIPC", "yes"),
        ("KeyringMode", "private"),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("User", "harvester-node-agent"),
        ("Group", "harvester-node-agent"),
        ("ProcSubset", "pid"),
        ("PrivateDevices", "yes"),
        ("RemoveIPC", "yes"),
    ] {
        assert_eq!(directive(key), Some(value), "{key}");
    }
    // dbus-daemon refuses users it cannot resolve (no nss-systemd).
    assert_eq!(directive("DynamicUser"), None);
    let sysusers = include_str!("../../packaging/sysusers.d/harvester-node-agent.conf");
    assert!(
        sysusers.lines().any(|l| l
            .split_whitespace()
            .take(2)
            .eq(["u", "harvester-node-agent"])),
        "{sysusers}"
    );
    assert_eq!(
        directive("Documentation"),
        Some("man:harvester-node-agent-check(8) man:harvester-node-agent(8)")
    );
    assert_eq!(
        directive("RestrictAddressFamilies"),
        Some("AF_UNIX AF_NETLINK AF_INET AF_INET6 AF_PACKET")
    );
    assert_eq!(directive("StateDirectory"), Some("harvester-node-agent"));
    assert_eq!(directive("RuntimeDirectory"), Some("harvester-node-agent"));
}

fn systemd_accepts_the_unit_and_scores_it_at_most_2_0() {
    let dir = tempfile::tempdir().unwrap();
    let unit = dir.path().join("harvester-node-agent.service");
    std::fs::write(&unit, UNIT.replace("/usr/bin/harvester-node-agent", BIN)).unwrap();
    // `verify` looks up every `man:` page of Documentation=: the shipped
    // pages, installed into a private MANPATH as the package installs them.
    hna_testkit::find_program("man").expect(
        "man is missing (systemd-analyze verify runs it); install it with `apt-get install man-db`",
    );
    let man8 = dir.path().join("man/man8");
    std::fs::create_dir_all(&man8).unwrap();
    for page in ["harvester-node-agent.8", "harvester-node-agent-check.8"] {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("packaging/man")
            .join(page);
        std::fs::copy(&src, man8.join(page)).unwrap_or_else(|e| panic!("{}: {e}", src.display()));
    }
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&unit)
        .env("MANPATH", dir.path().join("man"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "systemd-analyze verify: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--no-pager"])
        .arg(&unit)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let score: f64 = text
        .lines()
        .find_map(|l| {
            l.split("exposure level for harvester-node-agent.service: ")
                .nth(1)
        })
        .and_then(|r| r.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no exposure score in: {text}"));
    assert!(
        score <= MAX_EXPOSURE,
        "exposure {score} > {MAX_EXPOSURE}:\n{text}"
    );
    // systemd's own reading of the unit, not ours: no root, no module
    // loading by any means.
    for passed in [
        "User=/DynamicUser=",
        "CapabilityBoundingSet=~CAP_SYS_MODULE",
        "SystemCallFilter=~@module",
        "ProtectKernelModules=",
        "PrivateDevices=",
        "ProcSubset=",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with('✓')
                && l[l.char_indices().nth(1).map_or(0, |(i, _)| i)..]
                    .trim_start()
                    .starts_with(passed)),
            "systemd-analyze does not pass {passed}:\n{text}"
        );
    }
}
