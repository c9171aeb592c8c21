//! The shipped systemd unit: valid for systemd, sandboxed, and consistent
//! with what the daemon does (notify protocol, EX_CONFIG, module loading).

use std::process::Command;

use crate::BIN;
use crate::harness::tests;

tests! {
    unit_matches_the_daemon_contract;
    systemd_accepts_the_unit_and_scores_it_below_4_5: SystemdAnalyze;
}

const UNIT: &str = include_str!("../../systemd/harvester-node-agent.service");

fn directive(key: &str) -> Option<&'static str> {
    UNIT.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}

fn unit_matches_the_daemon_contract() {
    assert_eq!(directive("Type"), Some("notify"));
    assert_eq!(directive("RestartPreventExitStatus"), Some("78"));
    assert!(directive("WatchdogSec").is_some());
    assert_eq!(directive("ProtectKernelModules"), Some("no"));
    assert!(directive("SystemCallFilter").unwrap().contains("@module"));
    assert_eq!(
        directive("RestrictAddressFamilies"),
        Some("AF_UNIX AF_NETLINK AF_INET AF_INET6 AF_PACKET")
    );
    assert_eq!(directive("StateDirectory"), Some("harvester-node-agent"));
    assert_eq!(directive("RuntimeDirectory"), Some("harvester-node-agent"));
}

fn systemd_accepts_the_unit_and_scores_it_below_4_5() {
    let dir = tempfile::tempdir().unwrap();
    let unit = dir.path().join("harvester-node-agent.service");
    std::fs::write(&unit, UNIT.replace("/usr/bin/harvester-node-agent", BIN)).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&unit)
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
    assert!(score <= 4.5, "exposure {score} > 4.5");
}
