//! The shipped systemd unit: valid for systemd, sandboxed, and consistent
//! with what the daemon does (notify protocol, EX_CONFIG, module loading).

use std::process::Command;

use crate::BIN;
use crate::harness::tests;

tests! {
    unit_matches_the_daemon_contract;
    systemd_accepts_the_unit_and_scores_it_at_most_2_9: SystemdAnalyze;
}

/// The exposure `systemd-analyze security` gives the unit. 2.9 is the floor
/// at root without breaking the job (README, "systemd"): 2.5 needs
/// DynamicUser= (the kubelet's credentials are root-only) and PrivateDevices=
/// (the guest-agent check reads /dev/virtio-ports).
const MAX_EXPOSURE: f64 = 2.9;

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
    assert_eq!(directive("ProtectKernelModules"), Some("no"));
    assert_eq!(
        directive("CapabilityBoundingSet"),
        Some("CAP_NET_ADMIN CAP_NET_RAW CAP_SYS_MODULE")
    );
    // Allow-list, then drop the privileged groups, then give back exactly
    // the two calls that load a module (in this order: systemd applies the
    // lines in turn, and ~@privileged removes @module).
    assert_eq!(
        directives("SystemCallFilter"),
        [
            "@system-service @network-io",
            "~@privileged @resources",
            "init_module finit_module"
        ]
    );
    for (key, value) in [
        ("ProtectKernelTunables", "yes"),
        ("ProtectProc", "invisible"),
        ("PrivateMounts", "yes"),
        ("PrivateIPC", "yes"),
        ("KeyringMode", "private"),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("DevicePolicy", "closed"),
    ] {
        assert_eq!(directive(key), Some(value), "{key}");
    }
    // Each would break the job (see the unit's comments).
    for key in ["ProcSubset", "PrivateDevices", "DynamicUser", "User"] {
        assert_eq!(directive(key), None, "{key}");
    }
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

fn systemd_accepts_the_unit_and_scores_it_at_most_2_9() {
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
}
